"""The train-drafter command: train an EAGLE-style draft head for a model on local text.

    splitspec train-drafter --model DIR --corpus FILE... --out DIR [--steps 600] [--seq-len 128] [--resume]

Features come from the whole model on this machine (:class:`~splitspec.models.train_draft_head.LocalFeatures`),
or, with ``--cloud URL``, through a trunk server for an edge that holds only its own layers
(:class:`~splitspec.edge.split_features.SplitFeatures`), computed in the edge's ``--dtype`` (auto: the trunk's)
and converted to float32, in which the head trains either way.
``--eval-corpus`` measures the head afterwards: greedy chains against the local model on held-out
text, the mean accepted length written to the out directory's ``trainer_state.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from splitspec.arguments import (
    MODEL_HELP,
    add_dtype_arg,
    add_tls_ca,
    add_token_file,
    add_trunk_fingerprint_arg,
    add_wire_codec,
    edge_layers,
    model_dir,
    positive_int,
    read_token_file,
    set_threads,
)
from splitspec.device_choices import DEVICE_HELP
from splitspec.exceptions import ConfigError
from splitspec.models.dtype_choices import AUTO

if TYPE_CHECKING:
    from splitspec.models.train_draft_head import TrainConfig

log = logging.getLogger(__name__)


def feature_layers(text: str) -> tuple[int, ...]:
    """argparse type of ``--feature-layers``: ``8`` or ``2,5,8``."""
    parts = [p.strip() for p in text.split(",")]
    if not parts or not all(p.isdigit() for p in parts):
        raise ConfigError(f"--feature-layers must look like 8 or 2,5,8, got {text!r}")
    return tuple(int(p) for p in parts)


async def _train_through_the_split(config: TrainConfig, args: argparse.Namespace) -> None:
    """Train on features read through a trunk server: ``--model`` is this edge's checkpoint (it may hold only
    its own layers); the features are those the edge has without asking (see splitspec.edge.split_features)."""
    from splitspec.edge import EdgeConfig, SplitClient
    from splitspec.edge.split_features import SplitFeatures
    from splitspec.models.checkpoint import Checkpoint
    from splitspec.models.train_draft_head import train

    edge = EdgeConfig(
        model_dir=args.model,
        cloud_url=args.cloud,
        edge_layers=args.edge_layers or (2, 2),
        # the edge computes the features in its dtype (auto: the trunk's); the head trains in float32 either way,
        # on the features converted to it
        dtype=args.dtype or AUTO,
        wire_codec=args.wire_codec or "raw",
        device=args.device,
        auth_token=read_token_file(args.token_file),
        tls_ca_file=args.tls_ca,
        allow_stock_edge_weights=args.allow_stock_edge_weights,
        trunk_fingerprint=args.trunk_fingerprint,
    )
    layers = config.feature_layers or (int(Checkpoint(args.model).config.num_hidden_layers),)
    async with SplitClient(edge) as client:
        await train(config, SplitFeatures(client, layers))


# flags that only mean something with --cloud -> their argparse destinations (each defaults to None or False)
_CLOUD_ONLY = {
    "--edge-layers": "edge_layers",
    "--dtype": "dtype",
    "--wire-codec": "wire_codec",
    "--allow-stock-edge-weights": "allow_stock_edge_weights",
    "--trunk-fingerprint": "trunk_fingerprint",
    "--token-file": "token_file",
    "--tls-ca": "tls_ca",
}
# flags that only mean something with --eval-corpus -> (argparse destination, default)
_EVAL_ONLY = {
    "--eval-prompts": ("eval_prompts", 16),
    "--eval-prompt-tokens": ("eval_prompt_tokens", 64),
    "--eval-new-tokens": ("eval_new_tokens", 48),
    "--eval-depth": ("eval_depth", 4),
}


def _run(args: argparse.Namespace) -> int:
    from splitspec.models.draft_head_eval import greedy_chains, heldout_prompts
    from splitspec.models.train_draft_head import STATE_FILE, LocalFeatures, TrainConfig, read_corpus, train_local

    set_threads(args.threads)
    config = TrainConfig(
        model=args.model,
        corpus=tuple(args.corpus),
        out=args.out,
        steps=args.steps,
        seq_len=args.seq_len,
        batch=args.batch,
        lr=args.lr,
        warmup=args.warmup,
        cls_weight=args.cls_weight,
        noise=args.noise,
        feature_layers=args.feature_layers,
        seed=args.seed,
        resume=args.resume,
        save_every=args.save_every,
        save_dtype=args.save_dtype,
        device=args.device,
        progress=not args.no_progress,
        draft_vocab=args.draft_vocab,
    )
    if args.cloud is None:  # the split's own flags mean nothing without it: refused, never silently ignored
        given = [flag for flag, value in _CLOUD_ONLY.items() if getattr(args, value) not in (None, False)]
        if given:
            verb = "applies" if len(given) == 1 else "apply"
            raise ConfigError(f"{', '.join(given)} {verb} only with --cloud (features read through a trunk server)")
    if not args.eval_corpus:  # nothing to measure: the measurement's settings are refused, never silently ignored
        given = [flag for flag, (value, default) in _EVAL_ONLY.items() if getattr(args, value) != default]
        if given:
            verb = "applies" if len(given) == 1 else "apply"
            raise ConfigError(f"{', '.join(given)} {verb} only with --eval-corpus (the held-out measurement)")
    if args.cloud is not None:
        if args.eval_corpus:
            raise ConfigError("--eval-corpus needs the whole model on this machine, not --cloud")
        asyncio.run(_train_through_the_split(config, args))
        return 0
    head, source = train_local(config)
    if args.eval_corpus:
        if not isinstance(source, LocalFeatures):
            raise ConfigError("--eval-corpus needs the whole model on this machine")
        streams = read_corpus(args.eval_corpus, args.model, args.eval_prompt_tokens + 1)
        prompts = heldout_prompts(streams, args.eval_prompts, args.eval_prompt_tokens, args.seed)
        report = greedy_chains(head, source, prompts, args.eval_new_tokens, args.eval_depth)
        trained_on = {Path(p).resolve() for p in args.corpus} & {Path(p).resolve() for p in args.eval_corpus}
        if trained_on:
            log.warning(
                "--eval-corpus shares %s with --corpus: the head was trained on that text, so the figure below "
                "overstates what it does on text it has not seen",
                ", ".join(sorted(p.name for p in trained_on)),
            )
        log.info(
            "greedy chains of depth %d on %d %s prompts: mean accepted length %.3f tokens per verification",
            args.eval_depth,
            len(prompts),
            "training" if trained_on else "held-out",
            report.mean_accepted_length,
        )
        state_path = Path(args.out) / STATE_FILE
        state = json.loads(state_path.read_text())
        state["eval"] = {
            "files": [Path(p).name for p in args.eval_corpus],
            "held_out": not trained_on,  # no evaluation file is a training file
            "prompts": len(prompts),
            "prompt_tokens": args.eval_prompt_tokens,
            "new_tokens": args.eval_new_tokens,
            "depth": args.eval_depth,
            "verifications": report.verifications,
            "accepted": report.accepted,
            "mean_accepted_length": round(report.mean_accepted_length, 4),
        }
        state_path.write_text(json.dumps(state, indent=2) + "\n")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "train-drafter",
        help="train an EAGLE-style draft head (one decoder layer over the model's own features) on local text",
        description="Train an EAGLE-style draft head for --model on local text: one decoder layer of the model's "
        "family over the model's own hidden states, sharing its embedding, final norm and LM head. The head in --out "
        "is what --draft-head DIR loads; it refuses any other model.",
    )
    p.add_argument("--model", type=model_dir, required=True, help=MODEL_HELP + ": the target the head drafts for")
    p.add_argument("--corpus", type=Path, nargs="+", required=True, metavar="FILE", help="UTF-8 text files to train on")
    p.add_argument(
        "--out",
        type=Path,
        required=True,
        help="directory for the head (config.json, model.safetensors) and the training state",
    )
    p.add_argument(
        "--steps", type=int, default=600, help="optimizer steps in all, a resumed run included (default 600)"
    )
    p.add_argument("--seq-len", type=int, default=128, help="tokens per training window (default 128)")
    p.add_argument("--batch", type=int, default=8, help="windows per step (default 8)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate of AdamW (default 1e-3)")
    p.add_argument("--warmup", type=int, default=20, help="linear warmup steps before the cosine decay (default 20)")
    p.add_argument(
        "--cls-weight",
        type=float,
        default=0.1,
        help="weight of the cross-entropy against the target's next-token law (default 0.1, EAGLE's); "
        "the feature regression weighs 1",
    )
    p.add_argument(
        "--noise",
        type=float,
        default=0.05,
        help="uniform noise on the input features, times each token's RMS (default 0.05)",
    )
    p.add_argument(
        "--feature-layers",
        type=feature_layers,
        metavar="K[,K...]",
        help="target layers whose outputs the head reads, concatenated (default: the last, L)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seeds the head's initialisation, the windows and the noise (default 0)"
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run saved in --out from its last saved step (same --steps for the same schedule)",
    )
    p.add_argument(
        "--save-every", type=int, default=100, help="save the head and optimizer state every N steps (default 100)"
    )
    p.add_argument(
        "--save-dtype",
        choices=("float32", "float16", "bfloat16"),
        default="float32",
        help="dtype of the saved head (default float32; float16 halves it for shipping)",
    )
    p.add_argument(
        "--draft-vocab",
        type=int,
        metavar="N",
        help="save a head that drafts over the N target tokens most frequent in --corpus only (EAGLE-3's reduced "
        "draft vocabulary): its logits are N rows of the target's LM head instead of all of them, which makes "
        "drafting cheaper where the LM head is large; tokens outside are never drafted, and decoding stays "
        "lossless (default: the whole vocabulary). With --resume and the saved --steps, reduces a head "
        "without training it further",
    )
    p.add_argument("--device", default="auto", help=DEVICE_HELP)
    p.add_argument(
        "--cloud",
        metavar="URL",
        help="read the features through this trunk server (ws:// or wss://) instead of running the whole model here: "
        "--model is then this edge's checkpoint, which may hold only the edge's layers; the features are the ones "
        "the edge has (its head's output, the trunk's, the last layer's)",
    )
    p.add_argument("--edge-layers", type=edge_layers, metavar="HEAD,TAIL", help="with --cloud (default 2,2)")
    p.add_argument(
        "--allow-stock-edge-weights",
        action="store_true",
        help="with --cloud: run the published edge weights anyway (the trunk sees the corpus's hidden states)",
    )
    add_dtype_arg(
        p,
        ". With --cloud only: the edge's compute dtype, in which the features are computed (default auto: the "
        "trunk's with the raw wire codec); the head trains in float32 whatever it is",
        default=None,
    )
    add_wire_codec(p)
    p.set_defaults(wire_codec=None)  # raw when --cloud is given; None tells a --wire-codec given without it
    add_trunk_fingerprint_arg(p, "with --cloud: ")
    add_token_file(p)
    add_tls_ca(p)
    p.add_argument("--threads", type=positive_int, help="CPU threads (default: torch's choice)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (logs only)")
    p.add_argument(
        "--eval-corpus",
        type=Path,
        nargs="+",
        metavar="FILE",
        help="held-out files: after training, measure greedy chains against the model on them",
    )
    defaults = {dest: default for dest, default in _EVAL_ONLY.values()}
    p.add_argument(
        "--eval-prompts",
        type=int,
        default=defaults["eval_prompts"],
        help="with --eval-corpus: held-out prompts to measure (default 16)",
    )
    p.add_argument(
        "--eval-prompt-tokens",
        type=int,
        default=defaults["eval_prompt_tokens"],
        help="with --eval-corpus: tokens per held-out prompt (default 64)",
    )
    p.add_argument(
        "--eval-new-tokens",
        type=int,
        default=defaults["eval_new_tokens"],
        help="with --eval-corpus: tokens generated after each (default 48)",
    )
    p.add_argument(
        "--eval-depth",
        type=int,
        default=defaults["eval_depth"],
        help="with --eval-corpus: drafted chain length (default 4)",
    )
    p.set_defaults(run=_run)
