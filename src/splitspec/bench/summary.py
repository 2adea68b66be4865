"""A benchmark's summary: medians, paired ratios and the 1000·a / (RTT + f) fit over its runs (pure)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from splitspec.bench.modes import BASELINES, reference_baseline
from splitspec.bench.prompts import Prompt
from splitspec.bench.records import COMPONENTS, RunRecord
from splitspec.bench.scenario import Scenario
from splitspec.measure import median, quartiles
from splitspec.netem.projection import fit_projection

__all__ = ["summarize"]

log = logging.getLogger(__name__)


def _paired_ratios(records: list[RunRecord], reference: dict[tuple[int, str], RunRecord]) -> list[float]:
    out = []
    for rec in records:
        ref = reference.get((rec.repeat, rec.prompt_id))
        if ref is not None and ref.e2e_tok_s > 0:
            out.append(rec.e2e_tok_s / ref.e2e_tok_s)
    return out


_Refs = dict[str, dict[tuple[int, str], RunRecord]]  # baseline -> (repeat, prompt id) -> its run


def _ratio(group: list[RunRecord], refs: _Refs, baseline: str) -> float | None:
    """Median paired e2e tok/s ratio of ``group`` to ``baseline`` (None without that baseline)."""
    ref = refs.get(baseline)
    if not ref:
        return None
    if group and group[0].mode == baseline:
        return 1.0
    return median(_paired_ratios(group, ref))


def _group_split(group: list[RunRecord], refs: _Refs) -> dict[str, Any]:
    decode = [r.decode_tok_s for r in group if r.decode_tok_s is not None]
    matches = [r.matches_hf_generate for r in group if r.matches_hf_generate is not None]
    q25, q75 = quartiles(decode)
    return {
        "n_runs": len(group),
        "measured_rtt_ms": median(r.measured_rtt_ms for r in group if r.measured_rtt_ms is not None),
        "decode_tok_s": median(decode),
        "decode_tok_s_iqr": [q25, q75],
        "e2e_tok_s": median(r.e2e_tok_s for r in group),
        "ratio_vs_hf_generate": _ratio(group, refs, "hf_generate"),
        "ratio_vs_local_loop": _ratio(group, refs, "local_loop"),
        "accepted_per_step": median(r.accepted_per_step for r in group if r.accepted_per_step is not None),
        "bytes_up_per_step": median(r.bytes_per_step["up"] for r in group),
        "bytes_down_per_step": median(r.bytes_per_step["down"] for r in group),
        "step_ms": {k: median(r.step_ms[k] for r in group) for k in (*COMPONENTS, "step_ms")},
        "prefill_ms": median(r.prefill_ms for r in group if r.prefill_ms is not None),
        "new_tokens": median(float(r.new_tokens) for r in group),
        "token_match": [sum(matches), len(matches)],
    }


def summarize(
    scenario: Scenario,
    prompts: list[Prompt],
    records: list[RunRecord],
    environment: dict[str, Any],
    *,
    tokenizer: Any = None,
) -> dict[str, Any]:
    """Medians, paired ratios and fits over the runs (pure; no I/O)."""
    refs: _Refs = {
        name: {(r.repeat, r.prompt_id): r for r in records if r.mode == name} for name in ("hf_generate", "local_loop")
    }
    token_reference = reference_baseline({r.mode for r in records})
    baselines: dict[str, Any] = {}
    for mode in BASELINES:
        group = [r for r in records if r.mode == mode]
        if not group:
            continue
        matches = [r.matches_hf_generate for r in group if r.matches_hf_generate is not None]
        baselines[mode] = {
            "n_runs": len(group),
            "e2e_tok_s": median(r.e2e_tok_s for r in group),
            "e2e_tok_s_iqr": list(quartiles([r.e2e_tok_s for r in group])),
            "ratio_vs_hf_generate": _ratio(group, refs, "hf_generate"),
            "ratio_vs_local_loop": _ratio(group, refs, "local_loop"),
            "new_tokens": median(float(r.new_tokens) for r in group),
            "token_match": None if mode == token_reference else [sum(matches), len(matches)],
            "by_set": {s: median(r.e2e_tok_s for r in group if r.prompt_set == s) for s in scenario.prompts.sets},
        }
    split: list[dict[str, Any]] = []
    by_set: list[dict[str, Any]] = []
    fits: dict[str, Any] = {}
    for mode in scenario.modes:
        for rtt in sorted(scenario.rtt_ms):
            group = [r for r in records if r.mode == mode and r.rtt_ms == rtt]
            if group:
                split.append({"mode": mode, "rtt_ms": rtt, **_group_split(group, refs)})
            for s in scenario.prompts.sets:
                sub = [r for r in group if r.prompt_set == s]
                if sub:
                    by_set.append(
                        {
                            "mode": mode,
                            "rtt_ms": rtt,
                            "prompt_set": s,
                            "decode_tok_s": median(r.decode_tok_s for r in sub if r.decode_tok_s is not None),
                            "accepted_per_step": median(
                                r.accepted_per_step for r in sub if r.accepted_per_step is not None
                            ),
                        }
                    )
        fits[mode] = _fit(mode, [g for g in split if g["mode"] == mode])
    return {
        "scenario": scenario.to_json(),
        "environment": environment,
        "prompts": [
            {
                "prompt_id": p.prompt_id,
                "prompt_set": p.prompt_set,
                "source": p.source,
                "cut_char": p.cut_char,
                "tokens": len(p.token_ids),
                "text_tail": _tail(tokenizer, p.token_ids),
            }
            for p in prompts
        ],
        "token_reference": token_reference,  # the baseline token_match compares with (None: no check)
        "baselines": baselines,
        "split": split,
        "split_by_set": by_set,
        "fits": fits,
        "definitions": {
            "e2e_tok_s": "new tokens / wall time of the whole generation (prefill included)",
            "decode_tok_s": "(new tokens - 1) / (wall - prefill steps' time)",
            "accepted_per_step": "(new tokens - 1) / decode steps; 1 for sequential",
            "ratio_vs_hf_generate": "median over (repeat, prompt) of e2e tok/s / hf_generate e2e tok/s",
            "ratio_vs_local_loop": "the same against the bare KV-cached local greedy loop",
            "step_ms": "medians over runs of each run's median over decode steps",
            "network_ms": "step round trip minus the cloud's reported compute",
            "fit": "tok/s = 1000*a/(RTT+f) fitted to (measured RTT, median decode tok/s) per RTT",
        },
    }


def _tail(tokenizer: Any, ids: Sequence[int], n: int = 24) -> str | None:
    if tokenizer is None:
        return None
    return str(tokenizer.decode(list(ids[-n:])))


def _fit(mode: str, groups: list[dict[str, Any]]) -> dict[str, Any] | None:
    points = [(g["measured_rtt_ms"], g["decode_tok_s"]) for g in groups if g["decode_tok_s"] > 0]
    overhead = [g["step_ms"]["step_ms"] - g["measured_rtt_ms"] for g in groups]
    out: dict[str, Any] = {
        "overhead_from_steps_ms": median(overhead),  # median over RTTs of (step − measured RTT)
    }
    if len({round(x, 6) for x, _ in points}) < 2:
        return out
    try:
        fit = fit_projection([x for x, _ in points], [y for _, y in points])
    except ValueError as exc:
        log.warning("mode %s: cannot fit 1000a/(RTT+f): %s", mode, exc)
        return out
    out.update(asdict(fit))
    return out
