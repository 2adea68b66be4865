"""The ``splitspec fed`` subcommands: a SpecFed worker and the coordinator's generate.

    splitspec fed worker --model DIR --host 127.0.0.1 --port 8781 [--token-file F]
    splitspec fed generate --draft DIR --worker ws://127.0.0.1:8781 --worker ws://127.0.0.1:8782 \\
        [--weights 0.5,0.5] [--top-k 320 | --target-epsilon 0.01 [--epsilon-scope position|round]] \\
        [--reconstruct renorm|residual] [--prob-codec quantized|float16|float32] [--quant-budget 0.05] \\
        [--gamma 4] [--temperature T] [--top-p P] [--seed S] [--max-new-tokens N] \\
        [--prompt TEXT] [--json] [--audit]

The main CLI wires this in with :func:`register`; each subparser sets ``run`` to a function
``(args) -> int``. ``splitspec fed ...`` runs it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys

from splitspec.arguments import (
    MODEL_HELP,
    add_connection_limit_args,
    add_dtype_arg,
    add_tls_ca,
    add_token_file,
    model_dir,
    port_number,
    positive_int,
    read_token_file,
)
from splitspec.detokenize import IncrementalText
from splitspec.device_choices import DEVICE_HELP
from splitspec.exceptions import ConfigError
from splitspec.protocol.choices import DEFAULT_QUANT_BUDGET

log = logging.getLogger(__name__)


def _weights(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"weights must be comma-separated numbers, got {text!r}") from None
    if any(v < 0 for v in values) or sum(values) <= 0:
        raise argparse.ArgumentTypeError("weights must be non-negative with a positive sum")
    return values


def _run_worker(args: argparse.Namespace) -> int:
    from splitspec.federated.worker import WorkerConfig, serve_forever

    config = WorkerConfig(
        model_dir=args.model,
        host=args.host,
        port=args.port,
        auth_token=read_token_file(args.token_file),
        max_message_bytes=args.max_message_mb * 1024 * 1024,
        max_sessions=args.max_sessions,
        max_sessions_per_address=args.max_sessions_per_address,
        handshake_timeout_s=args.handshake_timeout,
        max_connections_per_address=args.max_connections_per_address,
        device=args.device,
        dtype=args.dtype,
    )
    asyncio.run(serve_forever(config))
    return 0


def _run_generate(args: argparse.Namespace) -> int:
    from splitspec.decoding.sampling import SamplingParams
    from splitspec.devices import resolve_device
    from splitspec.federated.config import CoordinatorConfig, check_temperature
    from splitspec.federated.coordinator import Coordinator
    from splitspec.federated.lm import load_model
    from splitspec.protocol.fed import DEFAULT_MAX_K

    if args.max_new_tokens < 1:
        raise ConfigError("--max-new-tokens must be at least 1")
    check_temperature(args.temperature)
    top_k = None if args.target_epsilon is not None else (args.top_k if args.top_k is not None else 320)
    # the config takes a cap with a fixed K (benchmarks set it to |V| for every mode); on the command line
    # it would be ignored
    if top_k is not None and args.max_k is not None and args.max_k != DEFAULT_MAX_K:
        raise ConfigError("--max-k caps adaptive K: give --target-epsilon (a fixed K is sent as it is)")
    config = CoordinatorConfig(
        draft_dir=args.draft,
        worker_urls=tuple(args.worker),
        weights=args.weights,
        top_k=top_k,
        target_epsilon=args.target_epsilon,
        epsilon_scope=args.epsilon_scope,
        max_k=DEFAULT_MAX_K if args.max_k is None else args.max_k,
        reconstruct=args.reconstruct,
        gamma=args.gamma,
        prob_codec=args.prob_codec,
        quant_budget=args.quant_budget,
        audit=args.audit,
        auth_token=read_token_file(args.token_file),
        tls_ca_file=args.tls_ca,
        round_timeout_s=args.round_timeout,
        device=args.device,
        dtype=args.dtype,
    )
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    draft = load_model(config.draft_dir, config.dtype, resolve_device(config.device))
    prompt_ids = list(draft.tokenizer.encode(args.prompt))
    if not prompt_ids:
        raise ConfigError("the prompt encodes to no tokens")

    async def run() -> int:
        async with Coordinator(config, draft) as coordinator:
            if args.json:
                result = await coordinator.generate(prompt_ids, args.max_new_tokens, params)
                print(json.dumps(result.to_json(), indent=2))
                return 0
            generator, seed = params.generator()
            text = IncrementalText(lambda ids: str(draft.tokenizer.decode(ids)))
            generated = 0
            async for token in coordinator.stream(prompt_ids, args.max_new_tokens, params, generator):
                generated += 1
                sys.stdout.write(text.push(token))
                sys.stdout.flush()
            sys.stdout.write(text.finish() + "\n")
            rounds = coordinator.rounds
            drafted = sum(r.drafted for r in rounds)
            accepted = sum(r.accepted for r in rounds)
            log.info(
                "%d tokens in %d rounds, accepted %d/%d drafts, seed %d",
                generated,
                len(rounds),
                accepted,
                drafted,
                seed,
            )
            return 0

    return asyncio.run(run())


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``fed worker`` and ``fed generate`` to the main CLI's subparsers."""
    fed = sub.add_parser("fed", help="federated speculative inference (SpecFed)")
    fed_sub = fed.add_subparsers(dest="fed_command", required=True)

    w = fed_sub.add_parser("worker", help="serve a whole model that scores draft tokens with top-K replies")
    w.add_argument("--model", type=model_dir, required=True, help=MODEL_HELP + ", with a tokenizer")
    w.add_argument("--host", default="127.0.0.1", help="interface to listen on (default 127.0.0.1)")
    w.add_argument("--port", type=port_number, default=8781, help="TCP port (default 8781; 0 picks one)")
    add_token_file(w)
    w.add_argument("--max-message-mb", type=positive_int, default=64, help="largest message, MiB (default 64)")
    w.add_argument("--max-sessions", type=int, default=16, help="concurrent coordinator sessions (default 16)")
    w.add_argument(
        "--max-sessions-per-address",
        type=int,
        default=4,
        help="sessions one IP address may hold at once, so one client cannot take them all (default 4)",
    )
    add_connection_limit_args(w)
    w.add_argument("--device", default="auto", help=DEVICE_HELP)
    add_dtype_arg(w)
    w.set_defaults(run=_run_worker)

    g = fed_sub.add_parser("generate", help="draft locally, verify against the workers' aggregate")
    g.add_argument("--draft", type=model_dir, required=True, help="draft model: " + MODEL_HELP + ", with a tokenizer")
    g.add_argument("--worker", action="append", required=True, help="worker URL (repeat), e.g. ws://127.0.0.1:8781")
    g.add_argument("--weights", type=_weights, help="aggregation weights, comma-separated (default equal)")
    k = g.add_mutually_exclusive_group()
    k.add_argument("--top-k", type=int, help="fixed K per position (default 320)")
    k.add_argument(
        "--target-epsilon", type=float, help="adaptive K: largest residual mass 1 − Σ top-K (see --epsilon-scope)"
    )
    g.add_argument(
        "--epsilon-scope",
        choices=["position", "round"],
        default="position",
        help="adaptive K: the target holds at every position (default), or on each round's mean (fewest tokens)",
    )
    g.add_argument("--max-k", type=positive_int, help="cap on adaptive K, with --target-epsilon (default 4096)")
    g.add_argument("--reconstruct", choices=["renorm", "residual"], default="renorm", help="reconstruction")
    g.add_argument("--gamma", type=int, default=4, help="draft tokens per round (default 4)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus mass applied to the aggregate (default 1)")
    g.add_argument("--seed", type=int, help="sampling seed")
    g.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default 64)")
    g.add_argument("--prompt", default="The", help="prompt text")
    g.add_argument(
        "--prob-codec",
        choices=["quantized", "float16", "float32"],
        default="quantized",
        help="how top-K probabilities travel (default quantized: exp-Golomb coded multiples of a step)",
    )
    g.add_argument(
        "--quant-budget",
        type=float,
        default=DEFAULT_QUANT_BUDGET,
        help=f"quantized: error allowed per position, as a fraction of its tail mass (default {DEFAULT_QUANT_BUDGET})",
    )
    g.add_argument(
        "--round-timeout",
        type=float,
        default=30.0,
        help="seconds a worker may take to answer one message before it is dropped for the round (default 30)",
    )
    add_token_file(g)
    add_tls_ca(g)
    g.add_argument("--json", action="store_true", help="print tokens, text and per-round figures as JSON")
    g.add_argument("--audit", action="store_true", help="workers also send full laws: check the bounds each round")
    g.add_argument("--device", default="auto", help=DEVICE_HELP + " (for the draft model; sampling stays on the host)")
    add_dtype_arg(g, " (for the draft model)")
    g.set_defaults(run=_run_generate)
