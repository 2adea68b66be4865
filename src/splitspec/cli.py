"""The splitspec command: one entry point, one subcommand per job.

    splitspec cloud serve --model DIR|ORG/NAME[@REV] [--edge-layers 2,2] [--port 8765] [--dtype auto] ...
    splitspec generate --model DIR|ORG/NAME[@REV] --cloud ws://HOST:PORT --prompt TEXT [--max-new-tokens N] ...

A model id is read from the local Hugging Face cache only (never downloaded).

Each subcommand builds its frozen config once from the arguments and hands it to the library.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from splitspec.arguments import (
    MODEL_HELP,
    add_draft_head_arg,
    add_dtype_arg,
    add_edge_args,
    add_edge_layers_arg,
    add_wire_codec,
    model_dir,
    positive_int,
    set_threads,
)
from splitspec.detokenize import CONTEXT_TOKENS, IncrementalText, text_after
from splitspec.device_choices import DEVICE_HELP
from splitspec.edge_cli import edge_config, repetition_penalty, sampling_params
from splitspec.exceptions import ConfigError, SplitspecError

if TYPE_CHECKING:
    from splitspec.decoding.processors import LogitsProcessor
    from splitspec.decoding.sampling import SamplingParams
    from splitspec.edge import SplitClient

log = logging.getLogger("splitspec")

Runner = Callable[[argparse.Namespace], int]


def _register_cloud(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from splitspec.cloud.cli import register

    register(sub)


# -- generate ------------------------------------------------------------------------------------


def _run_generate(args: argparse.Namespace) -> int:
    from splitspec.decoding.adjusters import RepetitionPenalty
    from splitspec.edge import SplitClient
    from splitspec.models.checkpoint import load_tokenizer

    config = edge_config(args)
    tokenizer = load_tokenizer(args.model)  # the checkpoint checked before its generation_config is read (and logged)
    params = sampling_params(args)
    penalty = repetition_penalty(args)
    prompt_ids = tokenizer.encode(args.prompt)
    if not prompt_ids:
        raise ConfigError("the prompt encodes to no tokens")

    client = SplitClient(config)
    client.check_length(len(prompt_ids), args.max_new_tokens)  # before connecting

    async def run() -> int:
        async with client:
            processor = None if penalty == 1.0 else RepetitionPenalty(penalty)
            if args.json:
                return await _generate_json(client, tokenizer, prompt_ids, args, params, processor)
            text = IncrementalText(lambda ids: str(tokenizer.decode(ids)), prompt_ids[-CONTEXT_TOKENS:])
            try:
                async for token in client.stream(
                    prompt_ids, args.max_new_tokens, params, speculate=args.speculate, processor=processor
                ):
                    sys.stdout.write(text.push(token))
                    sys.stdout.flush()
            finally:  # what was produced stays on screen, even when the link fails midway
                sys.stdout.write(text.finish() + "\n")
            return 0

    return asyncio.run(run())


async def _generate_json(
    client: SplitClient,
    tokenizer: Any,
    prompt_ids: list[int],
    args: argparse.Namespace,
    params: SamplingParams,
    processor: LogitsProcessor | None,
) -> int:
    """--json: the result, or on a failure midway every token produced so far with an ``error`` field."""
    produced: list[int] = []
    try:
        result = await client.generate(
            prompt_ids, args.max_new_tokens, params, speculate=args.speculate, produced=produced, processor=processor
        )
    except SplitspecError as exc:
        out: dict[str, Any] = {"prompt_ids": prompt_ids, "token_ids": produced}
        out["text"] = text_after(tokenizer.decode, prompt_ids[-CONTEXT_TOKENS:], produced)
        out["error"] = f"{type(exc).__name__}: {exc}"
        print(json.dumps(out, indent=2))
        return 2
    out = result.to_json()
    out["text"] = text_after(tokenizer.decode, prompt_ids[-CONTEXT_TOKENS:], result.token_ids)  # the continuation
    print(json.dumps(out, indent=2))
    return 0


def _register_generate(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("generate", help="generate text with the edge half of a split model")
    add_edge_args(p, "tokens to generate")
    p.add_argument("--prompt", required=True, help="prompt text")
    p.add_argument("--json", action="store_true", help="print token ids, text and per-step figures as JSON")
    p.set_defaults(run=_run_generate)


# -- entry point ---------------------------------------------------------------------------------


def _run_chat(args: argparse.Namespace) -> int:
    from splitspec.chat import ChatConfig, chat

    config = ChatConfig(
        edge=edge_config(args),
        max_new_tokens=args.max_new_tokens,
        params=sampling_params(args),
        repetition_penalty=repetition_penalty(args),
        speculate=args.speculate,
        json_lines=args.json,
        system_prompt=args.system,
        plain=args.plain,
    )
    asyncio.run(chat(config, sys.stdin))
    return 0


def _register_chat(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("chat", help="interactive multi-turn generation; the KV cache is kept across turns")
    add_edge_args(p, "tokens per turn")
    p.add_argument("--json", action="store_true", help="one JSON object per turn (for scripts)")
    p.add_argument("--system", help="system prompt opening the conversation (needs a chat template)")
    p.add_argument(
        "--plain",
        action="store_true",
        help="ignore the tokenizer's chat template: each line is plain text appended to the context (base models)",
    )
    p.set_defaults(run=_run_chat)


def _run_demo(args: argparse.Namespace) -> int:
    from splitspec.demo import SHOWCASE, DemoConfig, embedded_model, run_demo

    if args.max_new_tokens < 1:
        raise ConfigError("--max-new-tokens must be at least 1")
    if args.rtt_ms < 0:
        raise ConfigError("--rtt-ms must be >= 0")
    set_threads(args.threads)
    model = args.model or embedded_model("base")
    draft = args.draft_model or (embedded_model("draft") if args.model is None else None)
    head = args.draft_head or (embedded_model("base-eagle") if args.model is None else None)
    config = DemoConfig(
        model_dir=model,
        draft_model_dir=draft,
        draft_head_dir=head,
        draft_head_target_check=args.draft_head_target_check == "on",
        prompts=(("prompt", args.prompt),) if args.prompt else SHOWCASE,
        max_new_tokens=args.max_new_tokens,
        rtt_ms=args.rtt_ms,
        mode=args.mode,
        temperature=args.temperature,
        edge_layers=args.edge_layers,
        device=args.device,
        wire_codec=args.wire_codec,
        dtype=args.dtype,
    )
    return run_demo(config)


def _register_demo(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from splitspec.decoding.modes import SPECULATE_MODES

    p = sub.add_parser("demo", help="run cloud, WAN emulator and edge on this machine with the embedded models")
    p.add_argument("--prompt", help="prompt text (default: a short prose and code showcase)")
    p.add_argument("--max-new-tokens", type=int, default=48, help="tokens per prompt (default 48)")
    p.add_argument("--rtt-ms", type=float, default=80.0, help="emulated round-trip time, ms (default 80)")
    p.add_argument(
        "--mode",
        "--speculate",
        dest="mode",
        choices=SPECULATE_MODES,
        default="auto",
        help="speculation mode (default auto)",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--model", type=model_dir, help=MODEL_HELP + ", to split (default: the embedded base model)")
    p.add_argument(
        "--draft-model",
        type=model_dir,
        help="drafter, a directory or model id (default: the embedded draft model, with the embedded base model "
        "only; with --model, none)",
    )
    add_draft_head_arg(p, " (default: the embedded base model's head, with the embedded base model only)")
    add_edge_layers_arg(p)
    p.add_argument("--threads", type=positive_int, default=1, help="CPU threads for the edge (default 1: small models)")
    p.add_argument("--device", default="auto", help=DEVICE_HELP + "; the trunk server child uses it too")
    add_wire_codec(p)
    add_dtype_arg(p, "; the trunk server child uses it too")
    p.set_defaults(run=_run_demo)


def _register_netem(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from splitspec.netem.cli import register

    register(sub)


def _register_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from splitspec.bench.cli import register

    register(sub)


def _register_fed(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from splitspec.federated.cli import register

    register(sub)


def _register_privacy(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from splitspec.privacy.cli import register

    register(sub)


def _register_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from splitspec.serve.cli import register

    register(sub)


def _register_train_drafter(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from splitspec.train_drafter import register

    register(sub)


REGISTRARS: list[Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None]] = [
    _register_cloud,
    _register_generate,
    _register_netem,
    _register_demo,
    _register_chat,
    _register_bench,
    _register_fed,
    _register_privacy,
    _register_serve,
    _register_train_drafter,
]


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class CommandParser(argparse.ArgumentParser):
    """An ArgumentParser whose every command and subcommand takes the logging options.

    ``--log-level``, ``-v`` and ``-q`` are accepted before or after any subcommand's name
    (``splitspec -q generate ...`` and ``splitspec generate ... -q`` alike). Subparsers are made
    with the parent's class, so each level gets them; their default is "not given", so a value
    given at one level is not reset by another.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        levels = self.add_argument_group("logging").add_mutually_exclusive_group()
        levels.add_argument(
            "--log-level", choices=LOG_LEVELS, default=argparse.SUPPRESS, help="what to log (default INFO)"
        )
        levels.add_argument(
            "-v", "--verbose", dest="log_level", action="store_const", const="DEBUG", default=argparse.SUPPRESS,
            help="log everything (--log-level DEBUG)",
        )  # fmt: skip
        levels.add_argument(
            "-q", "--quiet", dest="log_level", action="store_const", const="WARNING", default=argparse.SUPPRESS,
            help="log only warnings and errors (--log-level WARNING)",
        )  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    from splitspec import __version__

    parser = CommandParser(prog="splitspec", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--version", action="version", version=f"splitspec {__version__}")
    # the registrars take any ArgumentParser's subparsers; these make CommandParsers
    sub = cast(
        "argparse._SubParsersAction[argparse.ArgumentParser]", parser.add_subparsers(dest="command", required=True)
    )
    for register in REGISTRARS:
        register(sub)
    return parser


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def _log_cached_models(args: argparse.Namespace) -> None:
    """Say which cached snapshot each model id resolved to (resolved while parsing, before logging was set)."""
    from splitspec.models.hub import model_label, snapshot_repo

    for name, value in sorted(vars(args).items()):
        if isinstance(value, Path) and snapshot_repo(value) is not None:
            log.info("--%s %s: the cached snapshot %s", name.replace("_", "-"), model_label(value), value)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SplitspecError as exc:  # from an option's type: a --model id that is not in the local cache
        logging.basicConfig(level="INFO", format=LOG_FORMAT)
        log.error("%s: %s", type(exc).__name__, exc)
        return 2
    args.log_level = getattr(args, "log_level", "INFO")
    logging.basicConfig(level=args.log_level, format=LOG_FORMAT)
    logging.getLogger("websockets").setLevel(max(logging.WARNING, logging.getLevelName(args.log_level)))
    if args.log_level != "DEBUG":  # transformers' per-load progress bars are noise around our log lines
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    _log_cached_models(args)
    run: Runner = args.run
    try:
        return run(args)
    except KeyboardInterrupt:
        return 130
    except SplitspecError as exc:
        log.error("%s: %s", type(exc).__name__, exc)
        return 2


if __name__ == "__main__":
    sys.exit(main())
