"""Argument helpers shared by the ``splitspec`` command and its subcommand modules.

They live here, not in :mod:`splitspec.cli`, so that the subcommand modules (``bench/cli.py``,
``federated/cli.py``, ...) never import the top-level command that imports them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from splitspec.exceptions import ConfigError
from splitspec.models.compile_modes import COMPILE_MODES
from splitspec.models.precision import AUTO, DTYPE_CHOICES
from splitspec.models.split import parse_edge_layers
from splitspec.protocol.codec import WIRE_CODECS

__all__ = [
    "DTYPE_HELP",
    "MODEL_HELP",
    "add_compile_args",
    "add_connection_limit_args",
    "add_dtype_arg",
    "add_tls_ca",
    "add_token_file",
    "add_wire_codec",
    "add_wire_codecs",
    "edge_layers",
    "model_dir",
    "read_token_file",
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
    """``--dtype {auto,float32,bfloat16,float16}`` (default auto, see :mod:`splitspec.models.precision`)."""
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default=default, help=DTYPE_HELP + extra)


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
