"""Argument helpers shared by the ``splitspec`` command and its subcommand modules.

They live here, not in :mod:`splitspec.cli`, so that the subcommand modules (``bench/cli.py``,
``federated/cli.py``, ...) never import the top-level command that imports them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from splitspec.device_choices import COMPUTE_ON_CHOICES, COMPUTE_ON_HELP, DEVICE_HELP
from splitspec.exceptions import ConfigError
from splitspec.models.compile_modes import COMPILE_MODES
from splitspec.models.dtype_choices import AUTO, DTYPE_CHOICES
from splitspec.models.quantize_choices import QUANTIZE_CHOICES, QUANTIZE_HELP
from splitspec.models.split import parse_edge_layers
from splitspec.protocol.choices import WIRE_CODECS

__all__ = [
    "DTYPE_HELP",
    "MODEL_HELP",
    "add_compile_args",
    "add_connection_limit_args",
    "add_draft_head_arg",
    "add_dtype_arg",
    "add_edge_args",
    "add_edge_layers_arg",
    "add_edge_link_args",
    "add_speculation_args",
    "add_split_args",
    "add_tls_ca",
    "add_token_file",
    "add_trunk_fingerprint_arg",
    "add_wire_codec",
    "add_wire_codecs",
    "edge_layers",
    "model_dir",
    "port_number",
    "positive_int",
    "read_token_file",
    "set_threads",
    "wire_codecs",
]


def add_wire_codec(parser: argparse.ArgumentParser) -> None:
    """``--wire-codec``: how an edge role's hidden states travel, both ways (:mod:`splitspec.protocol.codec`)."""
    parser.add_argument(
        "--wire-codec",
        choices=WIRE_CODECS,
        default="raw",
        help="how hidden states cross the link, both ways: raw (the compute dtype as is; both sides must "
        "compute in one dtype), bf16 (2 bytes per channel), int8 (per 16 channels one bfloat16 scale, plus "
        "each token's 8 largest values as bfloat16: 1.125*H + 32 bytes per token against 2*H for bf16). "
        "The trunk must accept it (cloud serve --wire-codecs). Default raw",
    )


def wire_codecs(text: str) -> tuple[str, ...]:
    """``raw,bf16,int8`` -> the codec names, each one of WIRE_CODECS, in order, without repeats."""
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",")))
    unknown = [n for n in names if n not in WIRE_CODECS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"expected codecs among {','.join(WIRE_CODECS)}, got {text!r}")
    return names


def add_wire_codecs(parser: argparse.ArgumentParser) -> None:
    """``--wire-codecs``: the hidden-state codecs a trunk server accepts."""
    parser.add_argument(
        "--wire-codecs",
        type=wire_codecs,
        default=WIRE_CODECS,
        metavar="CODEC,...",
        help=f"hidden-state wire codecs an edge may choose (its --wire-codec), comma-separated among "
        f"{','.join(WIRE_CODECS)} (default: all); an edge asking for another is refused at the handshake",
    )


def add_compile_args(p: argparse.ArgumentParser, whose: str) -> None:
    """``--compile [MODE]`` and ``--max-cache-tokens``: the fixed-shape decode step over static KV
    buffers (:mod:`splitspec.models.fixed_decode`)."""
    p.add_argument(
        "--compile",
        nargs="?",
        const="auto",
        choices=COMPILE_MODES,
        metavar="MODE",
        help=f"compile {whose} fixed-shape decode step with torch.compile over static KV buffers (gpt-fast "
        "style). MODE auto (when the flag is given alone) picks reduce-overhead (CUDA graphs) on CUDA and "
        f"inductor's default elsewhere; MODE is one of {', '.join(COMPILE_MODES)}. A failed compile stops "
        "with one line",
    )
    p.add_argument(
        "--max-cache-tokens",
        type=int,
        help="with --compile: the static KV buffers' size per sequence, tokens (default: the model's maximum "
        "positions; smaller saves memory and attention time, and bounds prompt + output)",
    )


DTYPE_HELP = (
    "compute dtype: auto (the default) computes in the checkpoint's own dtype (config.json's) on an accelerator; "
    "on a CPU a float16/bfloat16 checkpoint computes in float32 unless the CPU has native matrix instructions "
    "for it (AMX-BF16 or AVX512-BF16 for bfloat16, AMX-FP16 or AVX512-FP16 for float16); the choice is logged"
)


def add_dtype_arg(p: argparse.ArgumentParser, extra: str = "", default: str | None = AUTO) -> None:
    """``--dtype {auto,float32,bfloat16,float16}`` (default auto, see :mod:`splitspec.models.precision`); with
    another ``default``, ``extra`` says what it is (and the help does not call auto the default)."""
    text = DTYPE_HELP if default == AUTO else DTYPE_HELP.replace("auto (the default)", "auto")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default=default, help=text + extra)


MODEL_HELP = (
    "a checkpoint directory (config.json + safetensors), or a Hugging Face model id org/name[@revision] found in "
    "the local cache (HF_HUB_CACHE / HF_HOME; never downloaded)"
)


def model_dir(text: str) -> Path:
    """argparse type of every option naming a model: a directory as given, or a model id resolved from the
    local Hugging Face cache (:func:`splitspec.models.hub.resolve_model`; a missing one raises
    :class:`~splitspec.exceptions.ModelNotFound`, which the command reports in one line)."""
    from splitspec.models.hub import resolve_model  # imports transformers: not at the CLI's start-up

    return resolve_model(text)


def read_token_file(path: Path | None) -> str | None:
    """The shared secret stored in ``path`` (surrounding whitespace ignored), or None."""
    if path is None:
        return None
    try:
        token = path.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read token file {path}: {exc}") from None
    if not token:
        raise ConfigError(f"token file {path} is empty")
    return token


def add_token_file(parser: argparse.ArgumentParser) -> None:
    """``--token-file F``: where the shared secret is (read with :func:`read_token_file`)."""
    parser.add_argument("--token-file", type=Path, help="file holding the shared secret")


def add_tls_ca(parser: argparse.ArgumentParser) -> None:
    """``--tls-ca F``: the CA bundle a command that connects verifies a wss:// server with."""
    parser.add_argument("--tls-ca", type=Path, help="PEM CA bundle to verify a wss:// server (default: system store)")


def add_connection_limit_args(parser: argparse.ArgumentParser) -> None:
    """Flags bounding what a server's connections may cost (see transport.server.ConnectionLimits)."""
    parser.add_argument(
        "--handshake-timeout",
        type=float,
        default=10.0,
        help="seconds a new connection has to complete its handshake before it is closed (default 10)",
    )
    parser.add_argument(
        "--max-connections-per-address",
        type=int,
        default=32,
        help="open connections allowed from one IP address (default 32)",
    )


def edge_layers(text: str) -> tuple[int, int]:
    """argparse type for ``--edge-layers HEAD,TAIL``."""
    try:
        return parse_edge_layers(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1 (a count, a size, threads)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 0 (pick a free one) to 65535, refused before anything loads."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 to 65535, got {value}")
    return value


# -- shared by the commands that run a split model ------------------------------------------------


def set_threads(threads: int | None) -> None:
    """Pin torch's intra-op threads (small models run fastest on one thread of a shared CPU)."""
    if threads is None:
        return
    if threads < 1:
        raise ConfigError("--threads must be at least 1")
    import torch

    torch.set_num_threads(threads)


def add_edge_layers_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--edge-layers",
        type=edge_layers,
        default=(2, 2),
        metavar="HEAD,TAIL",
        help="decoder layers kept on the edge before and after the trunk (default 2,2)",
    )


def add_split_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=model_dir, required=True, help=MODEL_HELP)
    add_edge_layers_arg(p)
    add_dtype_arg(
        p,
        ". With the raw wire codec it is the wire's dtype too: an auto edge follows the trunk's (stated at the "
        "handshake); a pinned one must equal it (--wire-codec bf16 and int8 carry their own)",
    )
    p.add_argument("--quantize", choices=QUANTIZE_CHOICES, help=QUANTIZE_HELP)
    p.add_argument("--device", default="auto", help=DEVICE_HELP)
    add_token_file(p)
    p.add_argument("--threads", type=positive_int, help="CPU threads for this side's compute (default: torch's choice)")
    p.add_argument("--compute-on", choices=COMPUTE_ON_CHOICES, default="auto", help=COMPUTE_ON_HELP)


def add_speculation_args(p: argparse.ArgumentParser) -> None:
    from splitspec.decoding.modes import SPECULATE_MODES

    p.add_argument(
        "--speculate",
        choices=SPECULATE_MODES,
        default="auto",
        help="draft tokens locally and verify several per round trip; auto (default) picks the drafter "
        "and draft length from measured RTT, step cost (per context length) and acceptance, and falls "
        "back to one token per trip when speculation would not pay; it starts with a one-token step and "
        "probes each drafter with a short draft, so a short answer is not slower than off",
    )
    p.add_argument(
        "--draft-model",
        type=model_dir,
        help="small local model sharing the tokenizer, for --speculate draft: it drafts a dynamic tree "
        "(EAGLE-2), greedy or sampled (a directory or a cached org/name[@revision])",
    )
    p.add_argument(
        "--draft-tree-width",
        type=int,
        default=4,
        metavar="K",
        help="children per expanded node, and nodes expanded per level, of the draft model's and the head's "
        "trees (default 4, as EAGLE-2); 1 drafts a single chain",
    )
    add_draft_head_arg(p, "")


def add_draft_head_arg(p: argparse.ArgumentParser, default_help: str) -> None:
    p.add_argument(
        "--draft-head",
        type=Path,
        metavar="DIR",
        help="EAGLE draft head trained for this model (splitspec train-drafter), for --speculate eagle and auto; "
        "a head trained for another model is refused" + default_help,
    )
    p.add_argument(
        "--draft-head-target-check",
        choices=("on", "off"),
        default="on",
        help="on (default): refuse a draft head pinned to another model; off: warn instead, and load a published "
        "EAGLE-layout head (it carries no pin) when its shapes fit this model",
    )


def add_edge_link_args(p: argparse.ArgumentParser) -> None:
    """Arguments of every edge-side command that talks to a trunk server."""
    add_split_args(p)
    p.add_argument("--cloud", required=True, help="trunk server URL, e.g. ws://127.0.0.1:8765 or wss://HOST:PORT")
    add_wire_codec(p)
    add_tls_ca(p)
    p.add_argument(
        "--allow-stock-edge-weights",
        action="store_true",
        help="run the published edge weights anyway (the cloud can invert its hidden states; warned every session)",
    )
    p.add_argument(
        "--published-model",
        type=model_dir,
        help="published checkpoint to compare the edge weights with (a directory or a cached org/name[@revision])",
    )
    add_trunk_fingerprint_arg(p)
    add_speculation_args(p)
    add_compile_args(p, "the edge's (head and tail layers)")


def add_trunk_fingerprint_arg(p: argparse.ArgumentParser, prefix: str = "") -> None:
    """``--trunk-fingerprint``: the trunk an edge expects the cloud to serve (EdgeConfig.trunk_fingerprint)."""
    p.add_argument(
        "--trunk-fingerprint",
        metavar="START-END:DTYPE:DIGEST",
        help=prefix + "the trunk the cloud must serve, as its server logs it at start (default: hash the trunk "
        "layers of --model; needed when that copy lacks them)",
    )


def add_edge_args(p: argparse.ArgumentParser, tokens_help: str) -> None:
    """The link arguments plus one generation's length and sampling."""
    add_edge_link_args(p)
    p.add_argument("--max-new-tokens", type=int, default=64, help=f"{tokens_help} (default 64)")
    p.add_argument(
        "--temperature",
        type=float,
        help="0 = greedy; > 0 samples (default: the checkpoint's generation_config.json: its temperature "
        "when it sets do_sample, else greedy, which is logged)",
    )
    p.add_argument("--top-p", type=float, help="nucleus sampling mass (default: generation_config.json's, else 1.0)")
    p.add_argument(
        "--top-k",
        type=int,
        help="sample from the k likeliest tokens, 0 = all (default: generation_config.json's, else 50)",
    )
    p.add_argument(
        "--min-p",
        type=float,
        help="drop tokens less likely than this fraction of the likeliest one, in [0, 1], 0 = none (default: "
        "generation_config.json's, else 0)",
    )
    p.add_argument(
        "--repetition-penalty",
        type=float,
        help="divide the logits of the tokens seen so far (prompt and output) by this where positive, multiply "
        "where negative; 1 = off (default: generation_config.json's, else 1)",
    )
    p.add_argument(
        "--seed",
        type=int,
        help="sampling seed: the same tokens again with --speculate off; under speculation the same distribution "
        "(which tokens are drafted depends on the link's timing)",
    )
