"""Benchmark: ``--speculate auto`` against ``off`` over the split, at long and short context (issue #27 item 5).

The demo base model split 2+2 over a real trunk server (``splitspec cloud serve`` in another
process, one torch thread) on loopback, through the WAN emulator at each RTT (``splitspec netem``, a
process of its own; ``--link in-process`` runs it on the edge's event loop, as this benchmark did
before stop 36, where a draft on the edge delays the link's bytes). Three modes, run in
turn on every case (repeats interleaved, the modes' order rotated each repeat; the RTT order alternates between
repeats):

* ``off``: one round trip per token;
* ``auto``: the adaptive controller with the drafters an edge has without a draft model
  (n-grams, prompt lookup, their mixed tree);
* ``auto+draft``: the same with the demo draft model as well;
* ``auto+head`` (with ``--head``): the same with the shipped EAGLE head (``embedded_model("base-eagle")``) and no
  draft model.

Cases: a 2,000-token prompt of third-party code (the source of ``tqdm/std.py`` from the installed
``tqdm`` package, read at run time: a package the demo models never saw) with a 32-token and a
96-token answer, and short prose (the opening of a held-out document) with 32 and 96 tokens.
``--code-modules`` adds more code (``rich.console``, ``starlette.routing``, ``pydantic.main``: modules of
splitspec's own dependencies), a case each: greedy decoding takes one path per prompt, so one prompt is one draw
of how a short answer's drafts fall. The demo base model knows 1,024 positions; a copy of its config in a temp dir
extends ``max_position_embeddings`` to 4,096 (weights linked, not copied; default RoPE, so the extension
changes no logit below 1,024). The draft model is the shipped one: it declares the 256 positions it was trained
on and reads a longer context through a window of its latest tokens (since stop 50; before, it was extended too and
read the whole context).

Every run is a fresh :class:`SplitClient` (its own engine, controller and step-time estimates, as a
``splitspec generate`` process): the cold start is what is measured. Greedy; every mode's tokens
are checked against ``off``'s. Per run: end-to-end tok/s (new tokens / wall time, prefill
included), decode tok/s ((new tokens - 1) / (wall - prefill steps' time)) and tokens per round trip
after the prefill. Reported: medians over repeats and the median of the paired per-repeat ratios.

    python benchmarks/auto_floor.py                 # ~8 min on 2 shared CPU cores
    python benchmarks/auto_floor.py --quick         # 1 repeat, 20 ms, 32-token answers (~1 min)
    python benchmarks/auto_floor.py --answers 32 --repeats 2 --baseline REF --blocks 3   # beside REF's code
    python benchmarks/auto_floor.py --pin           # the trunk and the link on a core the edge does not use

Unpinned, the trunk server, the link and the edge share this machine's cores, so the edge's drafting during a
round trip slows the trunk's compute and the link's forwarding in that round trip, which a remote trunk and a real
network would not feel. ``--pin`` puts the trunk server and the link on the last core and the edge on the others.

Writes auto_floor.json, auto_floor.md and auto_floor.png into --out
(default benchmarks/results/auto_floor/).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from splitspec.decoding.sampling import SamplingParams
from splitspec.demo import _spawn, _stop, _wait_for_port, embedded_model, free_port
from splitspec.edge import EdgeConfig, SplitClient
from splitspec.edge.client import GenerationResult
from splitspec.models.stack import EdgeModel, FullModel
from splitspec.netem.emulator import WanEmulator
from splitspec.netem.schedule import NetemConfig
from splitspec.run_info import run_environment

log = logging.getLogger("bench.auto_floor")

MODES = ("off", "auto", "auto+draft")
HEAD_MODE = "auto+head"  # with --head: auto with the shipped EAGLE head (no draft model)
LINKS = ("process", "in-process")  # where the WAN emulator runs: see wan_link
POSITIONS = 4096  # max_position_embeddings of the extended config copies
CODE_MODULE = "tqdm.std"  # third-party code the demo models never saw (their code corpus is CPython's stdlib)
# more of it, for --code-modules: modules of splitspec's own dependencies, each over 2,000 tokens
MORE_CODE = ("rich.console", "starlette.routing", "pydantic.main")


@dataclass(frozen=True)
class Case:
    name: str
    prompt: tuple[int, ...]
    new_tokens: int


def extended_copy(source: Path, dest: Path) -> Path:
    """``source`` checkpoint in ``dest`` with max_position_embeddings = POSITIONS (other files linked)."""
    dest.mkdir(parents=True)
    for item in source.iterdir():
        if item.name != "config.json":
            (dest / item.name).symlink_to(item.resolve())
    config = json.loads((source / "config.json").read_text())
    config["max_position_embeddings"] = POSITIONS
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return dest


def _relative(path: Path) -> str:
    """``path`` relative to this repository when it lies inside it (results name no machine's paths)."""
    repo = Path(__file__).resolve().parents[1]
    try:
        return str(path.resolve().relative_to(repo))
    except ValueError:
        return path.name


def code_text(name: str = CODE_MODULE) -> tuple[str, str]:
    """The installed third-party module's source, and where it came from."""
    import importlib
    import importlib.metadata

    module = importlib.import_module(name)
    path = Path(str(module.__file__))
    package = name.split(".")[0]
    return path.read_text(), f"{name} ({package} {importlib.metadata.version(package)})"


def code_case_name(module: str, long_tokens: int, answer: int) -> str:
    """``code2000/32`` for the default module (the name earlier results use), ``code2000[rich.console]/32``."""
    tag = "" if module == CODE_MODULE else f"[{module}]"
    return f"code{long_tokens}{tag}/{answer}"


def build_cases(
    model_dir: Path, long_tokens: int, answers: tuple[int, ...], modules: tuple[str, ...] = (CODE_MODULE,)
) -> tuple[list[Case], dict[str, str]]:
    """The code cases (the first ``long_tokens`` tokens of each module's source) and the prose ones, with where
    their texts came from."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    cases = []
    code_sources = []
    for module in modules:
        code, code_source = code_text(module)
        code_ids = tokenizer.encode(code, add_special_tokens=False)
        if len(code_ids) < long_tokens:
            raise SystemExit(f"{code_source} has only {len(code_ids)} tokens, fewer than {long_tokens}")
        code_sources.append(code_source)
        cases += [Case(code_case_name(module, long_tokens, n), tuple(bos + code_ids[:long_tokens]), n) for n in answers]
    prose_path = embedded_model("base").parents[1] / "corpus" / "heldout" / "prose" / "lovers_complaint.txt"
    prose_ids = tokenizer.encode(prose_path.read_text(), add_special_tokens=False)[:64]
    for n in answers:
        cases.append(Case(f"prose{len(prose_ids)}/{n}", tuple(bos + prose_ids), n))
    sources = {"code": ", ".join(code_sources), "prose": f"held-out demo corpus: {prose_path.name}, first 64 tokens"}
    return cases, sources


def pin_process(cores: set[int]) -> None:
    """Every thread of this process onto ``cores`` (a thread started later inherits its starter's cores)."""
    for task in Path("/proc/self/task").iterdir():
        os.sched_setaffinity(int(task.name), cores)


def pinned_cores() -> tuple[set[int], set[int]]:
    """(the edge's cores, the others' core) for ``--pin``: the trunk server and the link on the last core, the rest
    to the edge (this process)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit(f"--pin needs at least 2 cores, this process may use {len(cores)}")
    return set(cores[:-1]), {cores[-1]}


@contextlib.contextmanager
def on_cores(cores: set[int] | None) -> Iterator[None]:
    """Within: this thread, and so any child process it starts, on ``cores`` (None: as it is)."""
    if cores is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def start_trunk(model_dir: Path, port: int, dtype: str, cores: set[int] | None = None) -> subprocess.Popen[bytes]:
    """The trunk server (one torch thread), on ``cores`` when given."""
    args = ["cloud", "serve", "--model", str(model_dir), "--port", str(port), "--threads", "1", "--dtype", dtype]
    with on_cores(cores):
        server = _spawn(args)
    _wait_for_port(port, server, 60)
    return server


@contextlib.asynccontextmanager
async def wan_link(
    kind: str, trunk_port: int, rtt_ms: float, seed: int, cores: set[int] | None = None
) -> AsyncIterator[str]:
    """The emulated link to the trunk -> its URL. ``process``: ``splitspec netem`` in a process of its own, as a
    network is: it forwards on time whatever the edge computes. ``in-process``: the emulator on the edge's event
    loop (this benchmark before stop 36), where its forwarding waits for the edge's interpreter lock, so a draft
    computed on the edge's drafting thread during a round trip (an aside judgement) delays the bytes in flight."""
    if kind == "in-process":
        async with WanEmulator(NetemConfig(upstream_port=trunk_port, rtt_ms=rtt_ms, seed=seed)) as emu:
            yield f"ws://{emu.host}:{emu.port}"
        return
    port = free_port()
    with on_cores(cores):
        link = _spawn(["netem", "--listen", f"127.0.0.1:{port}", "--upstream", f"127.0.0.1:{trunk_port}",
                       "--rtt-ms", str(rtt_ms), "--seed", str(seed)])  # fmt: skip
    try:
        _wait_for_port(port, link, 60)
        yield f"ws://127.0.0.1:{port}"
    finally:
        _stop([link])


def run_figures(result: GenerationResult) -> dict[str, Any]:
    n = len(result.token_ids)
    prefill_s = sum(s.network_ms + s.cloud_ms + s.edge_ms + s.serialize_ms for s in result.steps if s.kind == "prefill")
    prefill_s /= 1e3
    decode_steps = len(result.decode_steps)
    decode_s = result.wall_s - prefill_s
    return {
        "e2e_tok_s": n / result.wall_s,
        "decode_tok_s": (n - 1) / decode_s if decode_s > 0 else 0.0,
        "tokens_per_trip": (n - 1) / decode_steps if decode_steps else 0.0,
        "prefill_s": prefill_s,
        "wall_s": result.wall_s,
        "drafted_steps": float(sum(1 for s in result.spec_steps if s.drafter is not None)),
        "draft_s": sum(s.draft_s for s in result.spec_steps),  # drafting, all steps
        "first_step_s": result.spec_steps[0].step_s + result.spec_steps[0].draft_s if result.spec_steps else 0.0,
        "first_draft_s": result.spec_steps[0].draft_s if result.spec_steps else 0.0,
        "first_drafter": str(result.spec_steps[0].drafter) if result.spec_steps else "",
        # every decode step: query tokens, verifier seconds, drafting seconds, drafter, accepted
        "trace": [[1 + s.draft_tokens, s.step_s, s.draft_s, s.drafter, s.accepted] for s in result.spec_steps],
    }


async def one_run(
    config: EdgeConfig, edge: EdgeModel, draft: FullModel | None, case: Case, mode: str
) -> GenerationResult:
    async with SplitClient(config, edge=edge, draft_model=draft) as client:
        speculate = "off" if mode == "off" else "auto"
        return await client.generate(list(case.prompt), case.new_tokens, SamplingParams(), (), speculate)


def modes(args: argparse.Namespace) -> tuple[str, ...]:
    return (*MODES, HEAD_MODE) if args.head else MODES


async def measure(
    args: argparse.Namespace, base: Path, draft_dir: Path, cases: list[Case], port: int, link_cores: set[int] | None
) -> list[dict[str, Any]]:
    common = {"allow_stock_edge_weights": True, "model_dir": base, "dtype": args.dtype}
    all_modes = modes(args)
    loader = SplitClient(EdgeConfig(**common, cloud_url=f"ws://127.0.0.1:{port}", draft_model_dir=draft_dir))
    edge, draft = loader.model, loader.draft_model
    records: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        rtts = sorted(args.rtt_ms) if repeat % 2 == 0 else sorted(args.rtt_ms, reverse=True)
        for rtt in rtts:
            async with wan_link(args.link, port, rtt, repeat, link_cores) as url:
                configs = {
                    "off": (EdgeConfig(**common, cloud_url=url), None),
                    "auto": (EdgeConfig(**common, cloud_url=url), None),
                    "auto+draft": (EdgeConfig(**common, cloud_url=url, draft_model_dir=draft_dir), draft),
                    HEAD_MODE: (EdgeConfig(**common, cloud_url=url, draft_head_dir=embedded_model("base-eagle")), None),
                }
                if repeat == 0:  # warm-up, not recorded
                    await one_run(configs["auto+draft"][0], edge, draft, Case("warm", cases[0].prompt[:64], 4), "auto")
                for case in cases:
                    reference: list[int] | None = None
                    # a cyclic rotation: over len(modes) repeats each mode runs first, second and last once
                    # (alternating forward and reverse left "auto" always in the middle)
                    turn = repeat % len(all_modes)
                    order = all_modes[turn:] + all_modes[:turn]
                    for mode in order:
                        config, drafter = configs[mode]
                        result = await one_run(config, edge, drafter, case, mode)
                        figures = run_figures(result)
                        rec = {"repeat": repeat, "rtt_ms": rtt, "case": case.name, "mode": mode, **figures,
                               "tokens": result.token_ids}  # fmt: skip
                        records.append(rec)
                        log.info("r%d %4g ms %-14s %-10s decode %6.1f tok/s  e2e %6.1f  %.2f tok/trip",
                                 repeat, rtt, case.name, mode, figures["decode_tok_s"], figures["e2e_tok_s"],
                                 figures["tokens_per_trip"])  # fmt: skip
                        reference = reference or (result.token_ids if mode == "off" else None)
                    offs = [
                        r for r in records if r["repeat"] == repeat and r["rtt_ms"] == rtt and r["case"] == case.name
                    ]
                    ref = next(r["tokens"] for r in offs if r["mode"] == "off")
                    for r in offs:
                        r["matches_off"] = r["tokens"] == ref
    return records


def ratio(runs: dict[str, list[dict[str, Any]]], a: str, b: str, key: str) -> float:
    """Median over repeats of mode a's figure over mode b's in the same repeat."""
    pairs = zip(runs[a], runs[b], strict=True)  # both in repeat order
    return float(statistics.median(x[key] / y[key] for x, y in pairs))


def summarize(records: list[dict[str, Any]], rtts: list[float], cases: list[Case]) -> list[dict[str, Any]]:
    rows = []
    measured = [m for m in (*MODES, HEAD_MODE) if any(r["mode"] == m for r in records)]
    for rtt in rtts:
        for case in cases:
            runs = {
                m: [r for r in records if r["rtt_ms"] == rtt and r["case"] == case.name and r["mode"] == m]
                for m in measured
            }

            row: dict[str, Any] = {"rtt_ms": rtt, "case": case.name}
            for m in measured:
                for key in ("decode_tok_s", "e2e_tok_s", "tokens_per_trip"):
                    row[f"{m}:{key}"] = statistics.median(r[key] for r in runs[m])
            for key in ("decode_tok_s", "e2e_tok_s"):
                row[f"auto/off:{key}"] = ratio(runs, "auto", "off", key)
                row[f"auto+draft/off:{key}"] = ratio(runs, "auto+draft", "off", key)
                row[f"auto+draft/auto:{key}"] = ratio(runs, "auto+draft", "auto", key)
                if HEAD_MODE in runs:
                    row[f"{HEAD_MODE}/off:{key}"] = ratio(runs, HEAD_MODE, "off", key)
                    row[f"{HEAD_MODE}/auto:{key}"] = ratio(runs, HEAD_MODE, "auto", key)
            row["all_match_off"] = all(r["matches_off"] for m in measured for r in runs[m])
            rows.append(row)
    return rows


PINNED = " The trunk server and the link on one core, the edge on the other (`--pin`)."


def markdown(results: dict[str, Any]) -> str:
    env = results["environment"]
    lines = [
        "# `auto` against `off` over the split, long and short context",
        "",
        f"Commit {env['commit']}; demo base model split 2+2, {results['dtype']}, trunk server process on loopback "
        f"through the WAN emulator; {results['repeats']} interleaved repeats, medians (ratios: median of paired "
        f"per-repeat ratios); a fresh client per run (cold controller). Load average before/after: "
        f"{results['load_before']} / {results['load_after']}." + (PINNED if results.get("pinned") else ""),
        f"Code: {results['sources']['code']}; prose: {results['sources']['prose']}.",
        "",
        "| RTT ms | case | off decode | auto decode | auto+draft decode | auto/off decode | auto/off e2e "
        "| +draft/off decode | +draft/off e2e | +draft/auto decode | tok/trip auto, +draft | greedy = off |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results["summary"]:
        lines.append(
            f"| {r['rtt_ms']:g} | {r['case']} | {r['off:decode_tok_s']:.1f} | {r['auto:decode_tok_s']:.1f} "
            f"| {r['auto+draft:decode_tok_s']:.1f} | {r['auto/off:decode_tok_s']:.2f} | {r['auto/off:e2e_tok_s']:.2f} "
            f"| {r['auto+draft/off:decode_tok_s']:.2f} | {r['auto+draft/off:e2e_tok_s']:.2f} "
            f"| {r['auto+draft/auto:decode_tok_s']:.2f} "
            f"| {r['auto:tokens_per_trip']:.2f}, {r['auto+draft:tokens_per_trip']:.2f} | {r['all_match_off']} |"
        )
    head_rows = [r for r in results["summary"] if f"{HEAD_MODE}:decode_tok_s" in r]
    if head_rows:
        lines += [
            "",
            "With the shipped EAGLE head (`auto+head`: auto with the head, no draft model):",
            "",
            "| RTT ms | case | auto+head decode | +head/off decode | +head/off e2e | +head/auto decode "
            "| +head/auto e2e | tok/trip +head |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in head_rows:
            lines.append(
                f"| {r['rtt_ms']:g} | {r['case']} | {r[f'{HEAD_MODE}:decode_tok_s']:.1f} "
                f"| {r[f'{HEAD_MODE}/off:decode_tok_s']:.2f} | {r[f'{HEAD_MODE}/off:e2e_tok_s']:.2f} "
                f"| {r[f'{HEAD_MODE}/auto:decode_tok_s']:.2f} | {r[f'{HEAD_MODE}/auto:e2e_tok_s']:.2f} "
                f"| {r[f'{HEAD_MODE}:tokens_per_trip']:.2f} |"
            )
    lines += ["", f"Reproduce: `{results['command']}`", ""]
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = results["summary"]
    fig = Figure(figsize=(10, 4.5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    labels = [f"{r['case']}\n{r['rtt_ms']:g} ms" for r in rows]
    xs = range(len(rows))
    width = 0.38
    ax.bar([x - width / 2 for x in xs], [r["auto/off:decode_tok_s"] for r in rows], width, label="auto / off")
    ax.bar(
        [x + width / 2 for x in xs], [r["auto+draft/off:decode_tok_s"] for r in rows], width, label="auto+draft / off"
    )
    ax.axhline(0.97, color="red", linestyle="--", linewidth=1, label="0.97 floor")
    ax.axhline(1.0, color="black", linewidth=0.5)
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set_ylabel("decode tok/s ratio to off")
    ax.set_title(
        f"auto vs off, demo models split 2+2, {results['dtype']} (commit {results['environment']['commit'][:7]})"
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


PAIRS = (("auto+draft", "auto"), ("auto", "off"), ("auto+draft", "off"))


def _short(a: str, b: str) -> str:
    """A ratio's column name: ``auto+draft@e2e``, ``auto@e2e`` -> ``+draft/auto e2e``."""
    e2e = " e2e" if a.endswith("@e2e") else ""
    a, b = a.removesuffix("@e2e"), b.removesuffix("@e2e")
    return f"{a.removeprefix('auto') if a != 'auto' else a}/{b}{e2e}"


def _cell(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def beside(args: argparse.Namespace) -> int:
    """This checkout's code and ``--baseline``'s in ``--blocks`` interleaved blocks of ``--repeats`` each (child
    processes, :func:`~splitspec.bench.beside.measure_beside`); per RTT and case, the median over all repeats of
    the paired per-repeat ratios, of decode and of end-to-end tok/s. Writes auto_floor_beside.json and .md into
    --out."""
    from splitspec.bench.beside import measure_beside

    child = ["--repeats", str(args.repeats), "--long-tokens", str(args.long_tokens), "--dtype", args.dtype,
             "--rtt-ms", *map(str, args.rtt_ms), "--answers", *map(str, args.answers), "--link", args.link,
             *(["--head"] if args.head else []), *(["--pin"] if args.pin else []),
             "--code-modules", *args.code_modules]  # fmt: skip
    decode_pairs = (*PAIRS, ("auto+head", "auto")) if args.head else PAIRS
    pairs = (*decode_pairs, *((f"{a}@e2e", f"{b}@e2e") for a, b in decode_pairs))  # decode, then end to end
    root = Path(__file__).resolve().parents[1]
    runs = measure_beside(Path(__file__).resolve(), root, args.blocks, args.baseline, child)
    rows = []
    keys = sorted(
        {k.rsplit("|", 2)[0] for block in runs["this"] for k in block}, key=lambda k: (float(k.split("|")[0]), k)
    )
    for key in keys:
        row: dict[str, Any] = {"rtt_ms": float(key.split("|")[0]), "case": key.split("|", 1)[1]}
        for label, blocks in runs.items():
            for a, b in pairs:
                ratios = [block[f"{key}|{a}|{r}"] / block[f"{key}|{b}|{r}"] for block in blocks
                          for r in range(args.repeats) if f"{key}|{a}|{r}" in block]  # fmt: skip
                if not ratios:  # a baseline from before end-to-end figures were measured
                    continue
                row[f"{label}:{a}/{b}"] = statistics.median(ratios)
                row[f"{label}:{a}/{b}:each"] = [round(x, 3) for x in ratios]
        rows.append(row)
    environment = run_environment()
    command = "python benchmarks/auto_floor.py " + shlex.join(sys.argv[1:])
    results = {"environment": environment, "baseline": args.baseline, "command": command, "rows": rows, "runs": runs}
    lines = [
        f"# `auto` ratios, commit {environment['commit'][:7]} beside {args.baseline}",
        "",
        f"{args.blocks} interleaved blocks of {args.repeats} repeats each (child processes; the order alternates);"
        " medians of the paired per-repeat ratios of decode tok/s, then of end-to-end tok/s (e2e)."
        + (PINNED if args.pin else ""),
        "",
        "| RTT ms | case | "
        + " | ".join(f"{_short(a, b)} {label}" for a, b in pairs for label in ("this", "before"))
        + " |",
        "|---|---|" + "---|" * (2 * len(pairs)),
    ]
    for r in rows:
        cells = " | ".join(_cell(r.get(f"{label}:{a}/{b}")) for a, b in pairs for label in ("this", "before"))
        lines.append(f"| {r['rtt_ms']:g} | {r['case']} | {cells} |")
    lines += ["", f"Reproduce: `{command}`", ""]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "auto_floor_beside.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "auto_floor_beside.md").write_text("\n".join(lines))
    sys.stdout.write("\n".join(lines))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/auto_floor"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rtt-ms", type=float, nargs="+", default=[20.0, 80.0])
    parser.add_argument("--answers", type=int, nargs="+", default=[32, 96])
    parser.add_argument("--long-tokens", type=int, default=2000)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16"])
    parser.add_argument("--quick", action="store_true", help="1 repeat, 20 ms, 32-token answers")
    parser.add_argument("--head", action="store_true", help="also auto with the shipped EAGLE head (auto+head)")
    parser.add_argument("--baseline", help="a commit whose code is measured beside this checkout's, in blocks")
    where = "the WAN emulator in a process of its own (default) or on the edge's event loop"
    parser.add_argument("--link", choices=LINKS, default="process", help=where)
    pin = (
        "the trunk server and the link on the last core and the edge (this process) on the others, as a remote"
        " trunk and a network take none of the edge's cores (needs 2 cores)"
    )
    parser.add_argument("--pin", action="store_true", help=pin)
    more = f"modules whose source is a long prompt, a case each (default {CODE_MODULE}; more: {' '.join(MORE_CODE)})"
    parser.add_argument("--code-modules", nargs="+", default=[CODE_MODULE], help=more)
    parser.add_argument("--blocks", type=int, default=3, help="with --baseline: interleaved blocks of --repeats each")
    parser.add_argument("--measure", type=Path, help=argparse.SUPPRESS)  # one block, flat figures (bench/beside.py)
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.rtt_ms, args.answers = 1, [20.0], [32]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for name in ("splitspec", "websockets"):
        logging.getLogger(name).setLevel(logging.WARNING)
    if args.baseline:
        return beside(args)
    torch.set_num_threads(1)  # edge and trunk processes on a shared machine: one thread each
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    work = Path(tempfile.mkdtemp(prefix="auto_floor_"))
    base = extended_copy(embedded_model("base"), work / "base")
    draft_dir = embedded_model("draft")  # as shipped: a window of its latest tokens past its 256 positions
    cases, sources = build_cases(base, args.long_tokens, tuple(args.answers), tuple(args.code_modules))
    environment = run_environment()
    port = free_port()
    others: set[int] | None = None  # --pin: the trunk's and the link's core
    if args.pin:
        edge_cores, others = pinned_cores()
        pin_process(edge_cores)
    server = start_trunk(base, port, args.dtype, others)
    try:
        t0 = time.perf_counter()
        records = asyncio.run(measure(args, base, draft_dir, cases, port, others))
        environment["wall_s"] = time.perf_counter() - t0
    finally:
        server.terminate()
        server.wait(timeout=30)
    if args.measure:  # decode and end-to-end tok/s per run, for beside() ("MODE@e2e": end to end)
        figures = {f"{r['rtt_ms']:g}|{r['case']}|{r['mode']}|{r['repeat']}": r["decode_tok_s"] for r in records}
        figures |= {f"{r['rtt_ms']:g}|{r['case']}|{r['mode']}@e2e|{r['repeat']}": r["e2e_tok_s"] for r in records}
        args.measure.write_text(json.dumps(figures))
        return 0
    import splitspec

    results = {
        "environment": environment,
        # the code measured (a before/after pair may differ), relative to the repository when it lies inside it
        "splitspec_src": _relative(Path(splitspec.__file__).parent),
        "command": "python benchmarks/auto_floor.py " + shlex.join(sys.argv[1:]),
        "dtype": args.dtype,
        "pinned": args.pin,  # the trunk and the link on a core of their own (--pin)
        "repeats": args.repeats,
        "rtt_ms": args.rtt_ms,
        "sources": sources,
        "load_before": load_before,
        "load_after": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "summary": summarize(records, args.rtt_ms, cases),
        "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in records],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "auto_floor.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "auto_floor.md").write_text(markdown(results))
    plot(results, args.out / "auto_floor.png")
    sys.stdout.write(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
