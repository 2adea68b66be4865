"""The ``splitspec probe`` and ``splitspec bench`` subcommands.

Probe a running trunk server (directly or through ``splitspec netem``) for its RTT and per-step
overhead, with break-even acceptance, projected tok/s and cost per million tokens::

    splitspec probe --cloud ws://127.0.0.1:9000 [--model DIR] [--edge-layers 2,2] \\
        [--trunk-fingerprint FP] [--dollars-per-hour 1.35] [--repeats 10] [--json]

Run a benchmark scenario (in-process server, emulated links, local baselines) and write its
report (JSON, markdown, PNG plots)::

    splitspec bench default [--out DIR] [--quick]      # a scenario shipped with the package
    splitspec bench my_scenario.toml                   # or any scenario file

The main CLI wires both in with :func:`register`, which sets ``run=<function>`` on each subparser;
``splitspec probe ...`` and ``splitspec bench ...`` run them.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
from pathlib import Path

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
from splitspec.bench.scenario import DEFAULT_MODEL_DIR
from splitspec.device_choices import DEVICE_HELP
from splitspec.exceptions import ConfigError
from splitspec.protocol.choices import WIRE_CODECS

__all__ = ["register", "run_bench", "run_probe"]

log = logging.getLogger(__name__)

SCENARIO_DIR = Path(__file__).parent / "scenarios"  # the shipped scenarios, looked up by bare name
RESULTS_DIR = Path("benchmarks") / "results"  # default parent of a bench's output folder


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _float_list(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if any(not v >= 0 for v in values):
        raise argparse.ArgumentTypeError(f"expected numbers >= 0, got {text!r}")
    return values


# -- probe ---------------------------------------------------------------------------------------


def run_probe(args: argparse.Namespace) -> int:
    """Probe the server and print the tables (or JSON). Returns an exit status."""
    from splitspec.bench.probe import ProbeConfig, format_report, probe

    config = ProbeConfig(
        cloud_url=args.cloud,
        model_dir=args.model,
        edge_layers=args.edge_layers,
        dtype=args.dtype,
        wire_codec=args.wire_codec,
        device=args.device,
        auth_token=read_token_file(args.token_file),
        query_tokens=args.query_tokens,
        repeats=args.repeats,
        warmup=args.warmup,
        pings=args.pings,
        context_tokens=args.context_tokens,
        projection_rtt_ms=args.project_rtt,
        dollars_per_hour=args.dollars_per_hour,
        tls_ca_file=args.tls_ca,
        trunk_fingerprint=args.trunk_fingerprint,
    )
    set_threads(args.threads)
    report = asyncio.run(probe(config))
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print(format_report(report))
    return 0


def _add_probe(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "probe",
        help="measure RTT and per-step overhead f(k) of a trunk server; break-even, tok/s, cost",
        description="Separate link RTT from the fixed per-step overhead f(k) of a split deployment.",
    )
    p.add_argument("--cloud", required=True, help="trunk server URL, e.g. ws://127.0.0.1:8765")
    p.add_argument(
        "--model",
        type=model_dir,
        default=DEFAULT_MODEL_DIR,
        help=MODEL_HELP + "; only edge tensors are loaded (default: the demo base model)",
    )
    p.add_argument(
        "--edge-layers", type=edge_layers, default=(2, 2), metavar="HEAD,TAIL", help="edge layers (default 2,2)"
    )
    add_dtype_arg(p, "; it must equal the server's, which an auto probe follows")
    p.add_argument("--device", default="auto", help=DEVICE_HELP)
    add_wire_codec(p)
    add_token_file(p)
    add_tls_ca(p)
    add_trunk_fingerprint_arg(p)
    p.add_argument("--dollars-per-hour", type=float, help="cloud rental price, USD/hour (adds $/M tokens)")
    p.add_argument("--repeats", type=positive_int, default=10, help="timed steps per k (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per k first (default 2)")
    p.add_argument("--pings", type=positive_int, default=20, help="control round-trip pairs, before and after")
    p.add_argument(
        "--query-tokens",
        type=_int_list,
        default=(1, 2, 4, 8, 16),
        metavar="K,...",
        help="step sizes (default 1,2,4,8,16)",
    )
    p.add_argument("--context-tokens", type=positive_int, default=32, help="committed prefix, tokens (default 32)")
    p.add_argument(
        "--project-rtt",
        type=_float_list,
        default=(5.0, 20.0, 40.0, 80.0, 150.0),
        metavar="MS,...",
        help="RTTs to project to, ms (default 5,20,40,80,150)",
    )
    p.add_argument("--threads", type=positive_int, help="CPU threads for the edge's compute (default: torch's choice)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.set_defaults(run=run_probe)


# -- bench ---------------------------------------------------------------------------------------


def resolve_scenario(text: str) -> Path:
    """A scenario path, or the bare name of a scenario shipped with the package (``bench/scenarios/NAME.toml``)."""
    path = Path(text)
    if path.is_file():
        return path
    named = SCENARIO_DIR / f"{text}.toml"
    if named.is_file():
        return named
    shipped = ", ".join(sorted(p.stem for p in SCENARIO_DIR.glob("*.toml")))
    raise ConfigError(f"no scenario file {path}, and no shipped scenario named {text!r} (shipped: {shipped})")


def run_bench(args: argparse.Namespace) -> int:
    """Run a scenario and write its report. Returns an exit status."""
    from splitspec.bench.harness import run_benchmark
    from splitspec.bench.scenario import load_scenario

    scenario = load_scenario(
        resolve_scenario(args.scenario),
        model_dir=args.model,
        device=args.device,
        dtype=args.dtype,
        draft_model_dir=args.draft_model,
    )
    if args.quick:
        scenario = scenario.quick()
    if args.wire_codec is not None:
        scenario = dataclasses.replace(scenario, wire_codec=args.wire_codec)
    out = args.out if args.out is not None else RESULTS_DIR / scenario.name
    run_benchmark(scenario, out, progress=not args.no_progress, write_runs=not args.no_runs)
    print(f"wrote {out / 'summary.md'}, {out / 'summary.json'} and plots")
    return 0


def _add_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "bench",
        help="run a benchmark scenario over emulated WAN links and write its report",
        description="Run a benchmark scenario (TOML) in-process on loopback and write JSON, markdown and PNGs.",
    )
    p.add_argument("scenario", help="scenario TOML file, or the name of a shipped scenario (default, speculative)")
    p.add_argument("--out", type=Path, help="output folder (default benchmarks/results/<scenario name>)")
    p.add_argument("--model", type=model_dir, help=MODEL_HELP + ", instead of the scenario's model")
    p.add_argument(
        "--draft-model",
        type=model_dir,
        help="draft model checkpoint for the draft, mix and auto modes, instead of the scenario's (with --model, "
        "the demo drafter is dropped: the draft and mix modes then need this)",
    )
    p.add_argument("--quick", action="store_true", help="smoke test: 1 repeat, 1 prompt per set, <= 16 tokens")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--no-runs", action="store_true", help="skip the per-run records file (runs.jsonl.gz)")
    p.add_argument("--device", help=DEVICE_HELP.replace("default auto", "default: the scenario's, else auto"))
    p.add_argument(
        "--wire-codec",
        choices=WIRE_CODECS,
        help="how hidden states cross the emulated link (see generate --wire-codec; default: the scenario's "
        "wire_codec, else raw)",
    )
    add_dtype_arg(p, " (default: the scenario's dtype, else auto)", default=None)
    p.set_defaults(run=run_bench)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``probe`` and ``bench`` subcommands, each with ``run=<function>``."""
    _add_probe(sub)
    _add_bench(sub)
