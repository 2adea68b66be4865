"""Benchmark: does the draft model keep drafting after the edge's first steps on a device?

Fresh edge engines (``--clients``, one after another, in one process) with the demo base model, the demo draft
model and ``--speculate draft`` answer ``--answers`` greedy 16-token prompts each over an emulated RTT. Per
answer: the draft model's proposals, their wall times, decode steps and tokens per step, and the engine's
estimates afterwards (predicted step times at 1, 3 and 9 query tokens; the draft model's cost per drafted token).

On a CPU every answer makes about 7 proposals of 5-15 ms. On an H200 before the warm-up at load
(``models/warm_up.py``) the first proposal took 821 ms and 3- and 9-token steps were predicted at 498 and
1,315 ms: the controller judged drafting too dear and the first engine's later answers made 0-1 proposals.
After the warm-up (2026-12-04, ``benchmarks/results/gpu/h200-2026-12-04b/``) every answer made 6-7 proposals,
but each engine's first 6-8 still took 110-160 ms and 9-token steps stayed predicted at 540-730 ms; the likely
cause, cuDNN's attention building a plan per new shape, is why every stack on CUDA now takes cuDNN out of sdpa
(``models/row_attention.keep_sdpa_off_cudnn``). ``--cudnn-sdpa`` puts it back after each load, to compare.
The compute columns split each answer's decode steps into one-token steps and longer (speculative) ones.

    python benchmarks/draft_cold_start.py --device cuda [--rtt-ms 40] [--clients 2] [--answers 5] [--cudnn-sdpa]
        [--stall-first-proposal-ms MS] [--baseline REF [--repeats 3]] [--out DIR]

``--stall-first-proposal-ms`` holds each engine's first proposal that long, as a stall would (on a CPU, with 170
ms, the draft model's estimated cost per token read 85 ms and priced drafting out for 24 one-token steps, until
``estimates.Seconds`` and the controller's confirming probe: ``benchmarks/controller_stalls.py``).

Writes draft_cold_start.json and draft_cold_start.md into --out (default benchmarks/results/draft_cold_start); with
``--baseline REF``, the same run on commit REF's code (a git worktree, same venv) beside this checkout's, repeats
interleaved: draft_cold_start_beside.{json,md,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from splitspec.bench.scenario import ASSETS_DIR
from splitspec.cloud.config import CloudConfig
from splitspec.cloud.server import TrunkServer
from splitspec.decoding import drafters
from splitspec.decoding.lockstep import Steps
from splitspec.decoding.sampling import SamplingParams
from splitspec.edge import EdgeConfig, SplitClient
from splitspec.edge.sequence import StepStats
from splitspec.netem.emulator import WanEmulator
from splitspec.netem.schedule import NetemConfig
from splitspec.run_info import run_environment

BASE, DRAFT = ASSETS_DIR / "models" / "base", ASSETS_DIR / "models" / "draft"
PROMPT = list(range(40, 104))  # 64 token ids of the demo vocabulary
NEW_TOKENS = 16


class ProposalTimer:
    """Wraps :meth:`DraftModel.propose_steps` (the class, for every engine of the run; ``propose`` runs it too) to
    time each proposal from its first step to its last (with other sequences' forwards, when several run in
    lockstep: one client here)."""

    def __init__(self, stall_s: float = 0.0) -> None:
        self.proposals: list[tuple[int, int, float]] = []  # (budget, drafted tokens, ms)
        self.stall_s = stall_s  # seconds added to the next proposal while ``stall_next`` (a simulated stall)
        self.stall_next = False
        real = drafters.DraftModel.propose_steps

        def propose_steps(self_: drafters.DraftModel, context: Sequence[int], budget: int) -> Steps[drafters.Draft]:
            def timed() -> Steps[drafters.Draft]:
                t0 = time.perf_counter()
                if self.stall_next:  # the thread that drafts is held, as by a collection or a cold kernel
                    self.stall_next = False
                    time.sleep(self.stall_s)
                draft = yield from real(self_, context, budget)
                self.proposals.append((budget, len(draft), (time.perf_counter() - t0) * 1e3))
                return draft

            return timed()

        drafters.DraftModel.propose_steps = propose_steps  # type: ignore[method-assign,assignment]


def _compute_ms(steps: Sequence[StepStats]) -> list[float]:
    """Each step's edge + cloud compute, ms."""
    return [round(s.edge_ms + s.cloud_ms, 2) for s in steps]


async def run(
    device: str, rtt_ms: float, clients: int, answers: int, cudnn_sdpa: bool, stall_ms: float = 0.0
) -> list[dict[str, Any]]:
    timer = ProposalTimer(stall_ms / 1e3)
    rows: list[dict[str, Any]] = []
    async with (
        TrunkServer(CloudConfig(model_dir=BASE, port=0, device=device)) as server,
        WanEmulator(NetemConfig(upstream_port=server.port, rtt_ms=rtt_ms)) as link,
    ):
        if cudnn_sdpa:  # the trunk's stacks took it out (after their warm-up, whose shapes no real step has anyway)
            torch.backends.cuda.enable_cudnn_sdp(True)
        for client_no in range(clients):
            edge = EdgeConfig(
                model_dir=BASE,
                cloud_url=f"ws://127.0.0.1:{link.port}",
                device=device,
                allow_stock_edge_weights=True,
                draft_model_dir=DRAFT,
            )
            async with SplitClient(edge) as client:
                if cudnn_sdpa:  # and so did the edge's and the draft model's
                    torch.backends.cuda.enable_cudnn_sdp(True)
                timer.stall_next = stall_ms > 0  # each engine's first proposal
                for answer in range(answers):
                    start = len(timer.proposals)
                    t0 = time.perf_counter()
                    result = await client.generate(
                        PROMPT, NEW_TOKENS, SamplingParams(temperature=0.0), speculate="draft"
                    )
                    wall_ms = (time.perf_counter() - t0) * 1e3
                    made = timer.proposals[start:]
                    engine = client.engine
                    stats = engine.population(["draft"])._stats["draft"]
                    steps = [s for s in result.steps if s.kind == "decode"]
                    rows.append(
                        {
                            "client": client_no,
                            "answer": answer,
                            "wall_ms": wall_ms,
                            "tokens": len(result.token_ids),
                            "decode_steps": len(steps),
                            "tokens_per_step": len(result.token_ids) / max(1, len(steps)),
                            "proposals": len(made),
                            "proposal_ms": [round(ms, 2) for _, _, ms in made],
                            "cudnn_sdpa": torch.backends.cuda.cudnn_sdp_enabled(),
                            "one_token_step_compute_ms": _compute_ms([s for s in steps if s.query_tokens == 1]),
                            "longer_step_compute_ms": _compute_ms([s for s in steps if s.query_tokens > 1]),
                            "predicted_step_ms": {q: engine.step_times.predict(q) * 1e3 for q in (1, 3, 9)},
                            "draft_cost_per_token_ms": stats.cost_per_token.value * 1e3,
                        }
                    )
                    log.info("client %d answer %d: %d proposals, %s", client_no, answer, len(made), rows[-1])
    return rows


def _median_max(values: Sequence[float]) -> str:
    return f"{statistics.median(values):.1f}; {max(values):.1f}" if values else "-"


def markdown(rows: list[dict[str, Any]], env: dict[str, Any], command: str) -> str:
    lines = [
        "# Draft model after a cold start: proposals per answer",
        "",
        f"commit {env.get('commit')}, `{command}`; device {env.get('device')}. 16-token greedy answers to a "
        "64-token prompt, `--speculate draft`, demo base + draft models.",
        "",
        "| engine | answer | proposals | proposal ms (median; first) | decode steps | tokens/step | "
        "predicted T(1) / T(3) / T(9) ms | draft ms per token (estimate) | compute ms, 1-token steps "
        "(median; max) | compute ms, longer steps (median; max) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ms = r["proposal_ms"]
        times = f"{statistics.median(ms):.1f}; {ms[0]:.1f}" if ms else "-"
        t = r["predicted_step_ms"]
        lines.append(
            f"| {r['client']} | {r['answer']} | {r['proposals']} | {times} | {r['decode_steps']} | "
            f"{r['tokens_per_step']:.2f} | {t[1]:.0f} / {t[3]:.0f} / {t[9]:.0f} | {r['draft_cost_per_token_ms']:.1f} | "
            f"{_median_max(r['one_token_step_compute_ms'])} | {_median_max(r['longer_step_compute_ms'])} |"
        )
    return "\n".join(lines) + "\n"


log = logging.getLogger("draft_cold_start")


def flat(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """A run's figures as ``--measure`` writes them: ``client|answer|proposals``, ``...|wall_ms``, ``...|tokens``."""
    out: dict[str, float] = {}
    for r in rows:
        for figure in ("proposals", "wall_ms", "tokens"):
            out[f"{r['client']}|{r['answer']}|{figure}"] = float(r[figure])
    return out


def answer_keys(runs: dict[str, list[dict[str, float]]]) -> list[str]:
    """The ``client|answer`` keys of a beside run's figures, in engine then answer order."""
    return sorted({k.rsplit("|", 1)[0] for k in runs["this"][0]}, key=lambda k: tuple(map(int, k.split("|"))))


def beside_markdown(results: dict[str, Any]) -> str:
    """Per answer, the median over repeats of this checkout's and the baseline's proposals and wall ms; overall,
    the median of the per-repeat ratios of tokens per second (all answers' tokens over their wall time)."""
    runs, base = results["runs"], results["baseline"]
    answers = answer_keys(runs)

    def med(label: str, key: str) -> float:
        return float(statistics.median(r[key] for r in runs[label]))

    def tok_s(run: dict[str, float]) -> float:
        return sum(run[a + "|tokens"] for a in answers) / sum(run[a + "|wall_ms"] / 1e3 for a in answers)

    ratios = [tok_s(t) / tok_s(b) for t, b in zip(runs["this"], runs["before"], strict=True)]
    lines = [
        f"# Draft model after a stall: commit {results['commit'][:7]} beside {base}",
        "",
        f"`{results['command']}`: {len(ratios)} interleaved repeats (order alternated), medians. Every answer: 16 "
        "greedy tokens, `--speculate draft`, demo base + draft models, a fresh engine per `client`.",
        "",
        f"Tokens per second over all answers, this / {base}: **{statistics.median(ratios):.2f}** (per repeat: "
        + ", ".join(f"{x:.2f}" for x in ratios)
        + ").",
        "",
        f"| engine | answer | proposals | {base} proposals | wall ms | {base} wall ms | this / {base} wall |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for a in answers:
        client, answer = a.split("|")
        this_ms, base_ms = med("this", a + "|wall_ms"), med("before", a + "|wall_ms")
        lines.append(
            f"| {client} | {answer} | {med('this', a + '|proposals'):.0f} | {med('before', a + '|proposals'):.0f} | "
            f"{this_ms:.0f} | {base_ms:.0f} | {this_ms / base_ms:.2f} |"
        )
    return "\n".join(lines) + "\n"


def beside_plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    answers = answer_keys(runs)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.2))
    for label, name in (("this", "this"), ("before", results["baseline"])):
        for ax, figure in zip(axes, ("proposals", "wall_ms"), strict=True):
            ax.plot(range(len(answers)), [statistics.median(r[a + "|" + figure] for r in runs[label]) for a in answers],
                    "o-", label=name)  # fmt: skip
    for ax, title in zip(axes, ("proposals per answer", "wall ms per answer"), strict=True):
        ax.set_xticks(range(len(answers)), [a.replace("|", ".") for a in answers], fontsize=7)
        ax.set_xlabel("engine.answer")
        ax.set_title(title, fontsize=9)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--device", default="auto", help="the trunk's and the edge's device (default auto)")
    parser.add_argument("--rtt-ms", type=float, default=40.0, help="emulated round trip, ms (default 40)")
    parser.add_argument("--clients", type=int, default=2, help="fresh edge engines, one after another (default 2)")
    parser.add_argument("--answers", type=int, default=5, help="answers per engine (default 5)")
    parser.add_argument(
        "--cudnn-sdpa",
        action="store_true",
        help="put cuDNN back into sdpa after each load (torch's default; every stack on CUDA takes it out)",
    )
    parser.add_argument(
        "--stall-first-proposal-ms",
        type=float,
        default=0.0,
        help="hold each engine's first proposal this long (a stall: a collection, a busy neighbour; default 0)",
    )
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--baseline", help="a git commit whose code runs beside this checkout's (--repeats each)")
    parser.add_argument("--repeats", type=int, default=3, help="with --baseline: interleaved repeats (default 3)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "draft_cold_start")
    parser.add_argument("--measure", metavar="JSON", help=argparse.SUPPRESS)  # a child's job (--baseline)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    env = {} if args.measure else {**run_environment(), "device": args.device}  # a child's figures carry none
    command = "python benchmarks/draft_cold_start.py " + shlex.join(sys.argv[1:])
    if args.baseline:
        from splitspec.bench.beside import measure_beside

        child = ["--device", args.device, "--rtt-ms", str(args.rtt_ms), "--clients", str(args.clients),
                 "--answers", str(args.answers), "--stall-first-proposal-ms", str(args.stall_first_proposal_ms),
                 *(["--cudnn-sdpa"] if args.cudnn_sdpa else []),
                 *(["--threads", str(args.threads)] if args.threads else [])]  # fmt: skip
        runs = measure_beside(Path(__file__).resolve(), Path(__file__).resolve().parents[1], args.repeats,
                              args.baseline, child)  # fmt: skip
        results = {"commit": env.get("commit", ""), "environment": env, "baseline": args.baseline,
                   "command": command, "runs": runs}  # fmt: skip
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "draft_cold_start_beside.json").write_text(json.dumps(results, indent=1))
        report = beside_markdown(results)
        (args.out / "draft_cold_start_beside.md").write_text(report)
        beside_plot(results, args.out / "draft_cold_start_beside.png")
        log.info("\n%s", report)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = asyncio.run(
        run(args.device, args.rtt_ms, args.clients, args.answers, args.cudnn_sdpa, args.stall_first_proposal_ms)
    )
    if args.measure:
        Path(args.measure).write_text(json.dumps(flat(rows)))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "draft_cold_start.json").write_text(
        json.dumps({"environment": env, "command": command, "rows": rows}, indent=1)
    )
    report = markdown(rows, env, command)
    (args.out / "draft_cold_start.md").write_text(report)
    log.info("\n%s", report)


if __name__ == "__main__":
    main()
