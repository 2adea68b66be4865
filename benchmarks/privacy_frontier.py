"""Privacy-utility frontier of the edge defences: perplexity cost vs T1/T2/T3 token recovery.

    python benchmarks/privacy_frontier.py [--models base:2,worker:1] [--seeds 0,1]
        [--settings none,adv=1,noise=0.5,...] [--steps N] [--max-tokens N] [--seq-epochs E]
        [--out benchmarks/results/privacy_frontier] [--report-only]

Every measured point is appended to ``points-<model>-s<seed>-<tag>.jsonl`` as soon as it exists (an interrupted run
keeps what it finished; a rerun skips points already there with per-token outcomes and measures older ones
again; parallel processes use different tags). ``--report-only``
(and every new point) gathers all points into ``runs.jsonl.gz`` (one line per model, seed and setting, stamped with
the run's commit; the points files can then be deleted) and renders ``report.md`` (threat model, frontier tables,
targets check, recommended setting) and one plot per side, ``frontier_input.png`` and ``frontier_output.png``. See
:mod:`splitspec.privacy.frontier` for what each point measures.

A point is keyed by model, seed, setting and attacker-train size (``--max-tokens``): the tables and plots use each
model's most common size; points rerun with a larger ``--max-tokens`` (its own ``--tag``) get a section that pairs
them with the same seed and setting at that size, on the same test tokens.
"""

from __future__ import annotations

import argparse
import json
import logging
import shlex
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from splitspec.privacy.attackers import TrainConfig
from splitspec.privacy.defence_config import DEFAULT_DEFENCE, parse_defence
from splitspec.privacy.frontier import TIERS, FrontierConfig, compare_points, run_frontier
from splitspec.privacy.stats import wilson_interval
from splitspec.run_info import read_jsonl_gz, run_environment, write_jsonl_gz

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "src" / "splitspec" / "assets" / "models"
RESULTS = ROOT / "benchmarks" / "results" / "privacy_frontier"
COST_BUDGET = 0.10  # the issue's perplexity-cost budget
log = logging.getLogger("privacy_frontier")


RUNS = "runs.jsonl.gz"  # every point of the run, gathered


def load_points(out: Path) -> list[dict[str, Any]]:
    """Every point in ``out``: those gathered in ``runs.jsonl.gz``, then any ``points-*.jsonl`` not there yet."""
    records: list[dict[str, Any]] = list(read_jsonl_gz(out / RUNS)) if (out / RUNS).is_file() else []
    for path in sorted(out.glob("points-*.jsonl")):
        records += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    points: dict[tuple[str, int, str, int], dict[str, Any]] = {}
    for p in records:
        key = (p["model_name"], p["seed"], p["setting"], train_tokens(p))
        if key not in points or ("outcomes" in p and "outcomes" not in points[key]):
            points[key] = p  # parallel runs may repeat one; a re-measured point with per-token outcomes wins
    return sorted(points.values(), key=lambda p: (p["model_name"], p["seed"], p["setting"], train_tokens(p)))


def train_tokens(point: dict[str, Any]) -> int:
    """The attacker-train tokens a point was measured with (public + traffic: its --max-tokens, corpus allowing)."""
    return int(point["tokens"]["public"]) + int(point["tokens"]["traffic"])


def by_train_size(points: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(points at each model's reference attacker-train size, the points at other sizes).

    The reference size of a model is the one most of its points have (ties: the smaller); the frontier tables,
    plots and targets use it alone, so a few points with a larger attacker never mix into a row's pooled rates.
    """
    sizes: dict[str, dict[int, int]] = {}
    for p in points:
        count = sizes.setdefault(p["model_name"], {})
        count[train_tokens(p)] = count.get(train_tokens(p), 0) + 1
    ref = {m: min(c, key=lambda size: (-c[size], size)) for m, c in sizes.items()}
    main = [p for p in points if train_tokens(p) == ref[p["model_name"]]]
    return main, [p for p in points if train_tokens(p) != ref[p["model_name"]]]


# ------------------------------------------------------------------ aggregation over seeds


def family(setting: str) -> str:
    """Which curve a setting belongs to: the knobs it turns (values stripped)."""
    if setting in ("stock", "none"):
        return setting
    return "+".join(part.split("=")[0] for part in setting.split("+"))


def pooled(points: list[dict[str, Any]], side: str, tier: str) -> dict[str, Any] | None:
    """Best-of-tier top-1 recovery pooled over seeds (sum of hits / sum of tokens, Wilson 95%)."""
    # an attacker of a tier knows everything the lower tiers know: its best is the best of them all
    allowed = TIERS[: TIERS.index(tier) + 1]
    entries = [
        max(
            (p["sides"][side]["best"][t] for t in allowed if t in p["sides"][side]["best"]),
            key=lambda e: float(e["rate"]),
            default=None,
        )
        for p in points
    ]
    if any(e is None for e in entries) or not entries:
        return None
    s = sum(int(e["successes"]) for e in entries if e)
    n = sum(int(e["n"]) for e in entries if e)
    diffs = [e["minus_stock"] for e in entries if e and "minus_stock" in e]
    return {
        "rate": s / n,
        "wilson95": list(wilson_interval(s, n)),
        "attackers": sorted({str(e["attacker"]) for e in entries if e}),
        "minus_stock": diffs,
    }


def aggregate(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (model, setting): mean perplexity cost over seeds and pooled tier recoveries per side."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for p in points:
        groups.setdefault((p["model_name"], p["setting"]), []).append(p)
    rows: list[dict[str, Any]] = []
    for (model, setting), items in groups.items():
        floor_s = sum(p["frequency_floor"]["top1"]["successes"] for p in items)
        floor_n = sum(p["frequency_floor"]["top1"]["n"] for p in items)
        row: dict[str, Any] = {
            "model": model,
            "depth": items[0]["depth"],
            "setting": setting,
            "family": family(setting),
            "seeds": sorted(p["seed"] for p in items),
            "ppl_cost": float(np.mean([p["ppl_cost"] for p in items])),
            "ppl_cost_range": [min(p["ppl_cost"] for p in items), max(p["ppl_cost"] for p in items)],
            "floor": floor_s / floor_n,
            "sides": {},
        }
        for side in ("input", "output"):
            tiers = {t: pooled(items, side, t) for t in TIERS}
            if setting == "stock":  # public weights: T2 and T3 learn nothing T1 cannot compute
                tiers = {t: tiers["T1"] for t in TIERS}
            row["sides"][side] = tiers
        rows.append(row)
    return rows


def strongest(row: dict[str, Any], side: str, tiers: tuple[str, ...] = TIERS) -> float:
    return float(max(row["sides"][side][t]["rate"] for t in tiers if row["sides"][side][t] is not None))


def significant_drop(row: dict[str, Any], side: str, tier: str) -> bool:
    """Every seed's bootstrap interval of (defended - stock) lies below zero."""
    entry = row["sides"][side][tier]
    return bool(entry and entry["minus_stock"] and all(d["bootstrap95"][1] < 0 for d in entry["minus_stock"]))


def meets_targets(row: dict[str, Any], stock_row: dict[str, Any]) -> dict[str, bool]:
    """The issue's targets at <= 10 % perplexity cost (T1 and T2)."""
    return {
        "cost <= 10%": row["ppl_cost"] <= COST_BUDGET,
        "input T1,T2 <= 2x floor": strongest(row, "input", ("T1", "T2")) <= 2 * row["floor"],
        "output T1,T2 significantly below stock": all(significant_drop(row, "output", t) for t in ("T1", "T2")),
    }


def recommend(rows: list[dict[str, Any]], model: str) -> dict[str, Any] | None:
    """The setting within the cost budget that minimises the worst of T1/T2 over both sides."""
    cands = [r for r in rows if r["model"] == model and r["setting"] != "stock" and r["ppl_cost"] <= COST_BUDGET]
    if not cands:
        return None
    return min(cands, key=lambda r: max(strongest(r, "input", ("T1", "T2")), strongest(r, "output", ("T1", "T2"))))


def paired(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every setting against the stock edge and the plain divergence, as paired differences over seeds.

    Only points that store per-token outcomes take part (older points keep rates alone).
    """
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for p in points:
        groups.setdefault((p["model_name"], p["setting"]), []).append(p)
    rows: list[dict[str, Any]] = []
    for (model, setting), items in sorted(groups.items()):
        for versus in ("stock", "none"):
            if setting in ("stock", versus) or (model, versus) not in groups:
                continue
            for side in ("input", "output"):
                for tier in TIERS:
                    cmp = compare_points(items, groups[(model, versus)], side, tier)
                    if cmp is not None:
                        theirs = {q["seed"] for q in groups[(model, versus)] if "outcomes" in q}
                        seeds = sorted(p["seed"] for p in items if "outcomes" in p and p["seed"] in theirs)
                        rows.append(
                            {
                                "model": model,
                                "setting": setting,
                                "versus": versus,
                                "side": side,
                                "tier": tier,
                                "seeds": seeds,
                                **asdict(cmp),
                            }
                        )
    return rows


# ------------------------------------------------------------------ rendering


def _fmt(entry: dict[str, Any] | None) -> str:
    if entry is None:
        return "n/a"
    lo, hi = entry["wilson95"]
    return f"{100 * entry['rate']:.1f} [{100 * lo:.1f}, {100 * hi:.1f}]"


def _diff(entry: dict[str, Any] | None) -> str:
    if entry is None or not entry["minus_stock"]:
        return ""
    return "; ".join(
        f"{100 * d['diff']:+.1f} [{100 * d['bootstrap95'][0]:+.1f}, {100 * d['bootstrap95'][1]:+.1f}]"
        for d in entry["minus_stock"]
    )


def _paired_cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return "n/a"
    return (
        f"{100 * row['diff']:+.1f} [{100 * row['low']:+.1f}, {100 * row['high']:+.1f}] "
        f"(p {row['mcnemar_p']:.2g}; {row['only_a']}/{row['only_b']})"
    )


def render_paired(rows: list[dict[str, Any]], model: str) -> list[str]:
    """The paired-comparison table of one model (empty when no point has per-token outcomes)."""
    mine = [r for r in rows if r["model"] == model]
    if not mine:
        return []
    cell = {(r["setting"], r["versus"], r["side"], r["tier"]): r for r in mine}
    keys = sorted({(r["setting"], r["versus"], tuple(r["seeds"])) for r in mine}, key=lambda k: (k[1] != "stock", k[0]))
    lines = [
        "### Paired differences between defences (percentage points of top-1 recovery)",
        "",
        "Each cell: this setting's strongest attacker of the tier minus the reference's, on the same test "
        "tokens, pooled over the seeds listed (document-clustered bootstrap 95 % interval, each seed's "
        "documents their own clusters; exact McNemar p on the pooled tokens; tokens recovered only under "
        "this setting / only under the reference). McNemar treats tokens as independent and so overstates "
        "significance; the bootstrap interval, which resamples whole documents, is the one to read. "
        f"The default edge is `{DEFAULT_DEFENCE.label}`.",
        "",
        "| setting | minus | seeds | side | T1 | T2 | T3 |",
        "|---|---|---|---|---|---|---|",
    ]
    for setting, versus, seeds in keys:
        name = f"**{setting}** (default)" if setting == DEFAULT_DEFENCE.label else setting
        for side in ("input", "output"):
            lines.append(
                f"| {name} | {versus} | {','.join(map(str, seeds))} | {side} | "
                + " | ".join(_paired_cell(cell.get((setting, versus, side, t))) for t in TIERS)
                + " |"
            )
    return [*lines, ""]


def train_size_rows(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each (model, setting) measured at a second attacker-train size: larger minus reference, per seed and pooled.

    Per side and tier: the strongest attacker's top-1 at the reference size and at the larger one (pooled over the
    seeds of the row), their paired difference (the same test tokens: the test split does not depend on the
    attacker-train size), and, for a defence, its paired difference from the stock edge at each size (does the
    defence's gain hold against the bigger attacker?). One row per seed, plus one pooling the seeds when a size
    has several. Only points with per-token outcomes and a reference point of their seed take part.
    """
    main, larger = by_train_size(points)
    at = {(p["model_name"], p["seed"], p["setting"], train_tokens(p)): p for p in points if "outcomes" in p}
    ref_size = {p["model_name"]: train_tokens(p) for p in main}
    groups: dict[tuple[str, str, int], list[tuple[dict[str, Any], dict[str, Any]]]] = {}
    for big in larger:
        ref = at.get((big["model_name"], big["seed"], big["setting"], ref_size[big["model_name"]]))
        if "outcomes" in big and ref is not None:
            groups.setdefault((big["model_name"], big["setting"], train_tokens(big)), []).append((ref, big))
    rows: list[dict[str, Any]] = []
    for (model, setting, size), pairs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] != "stock", kv[0])):
        pairs.sort(key=lambda pair: pair[0]["seed"])
        for chosen in [[pair] for pair in pairs] + ([pairs] if len(pairs) > 1 else []):
            sides = [[pair[i] for pair in chosen] for i in (0, 1)]  # reference points, larger points
            stocks = [[at.get((model, p["seed"], "stock", train_tokens(p))) for p in side] for side in sides]
            for side in ("input", "output"):
                for tier in TIERS:
                    diff = compare_points(sides[1], sides[0], side, tier)
                    if diff is None:
                        continue
                    minus_stock = [
                        compare_points(mine, [q for q in stock if q is not None], side, tier)
                        if setting != "stock" and None not in stock
                        else None
                        for mine, stock in zip(sides, stocks, strict=True)
                    ]
                    rows.append(
                        {
                            "model": model,
                            "setting": setting,
                            "seeds": [pair[0]["seed"] for pair in chosen],
                            "side": side,
                            "tier": tier,
                            "tokens": [ref_size[model], size],
                            "best": [_pooled_best(mine, side, tier) for mine in sides],
                            "larger_minus_reference": asdict(diff),
                            "minus_stock": [asdict(m) if m is not None else None for m in minus_stock],
                        }
                    )
    return rows


def _pooled_best(points: list[dict[str, Any]], side: str, tier: str) -> dict[str, Any]:
    """Top-1 recovery of the tier's strongest attacker pooled over ``points`` (Wilson 95 %), and who it was."""
    entries = [p["sides"][side]["best"][tier] for p in points]
    s, n = sum(int(e["successes"]) for e in entries), sum(int(e["n"]) for e in entries)
    return {"rate": s / n, "wilson95": list(wilson_interval(s, n)), "attackers": [e["attacker"] for e in entries]}


def _best_cell(entry: dict[str, Any]) -> str:
    lo, hi = entry["wilson95"]
    names = "/".join(dict.fromkeys(entry["attackers"]))
    return f"{100 * entry['rate']:.1f} [{100 * lo:.1f}, {100 * hi:.1f}] {names}"


def render_train_size(rows: list[dict[str, Any]], model: str) -> list[str]:
    """The attacker-train size table of one model (empty when no point was measured at a second size)."""
    mine = [r for r in rows if r["model"] == model]
    if not mine:
        return []
    lines: list[str] = []
    for small, big in sorted({tuple(r["tokens"]) for r in mine}):
        a, b = f"{round(small / 2000)}k", f"{round(big / 2000)}k"  # per tier
        lines += [
            f"### Attacker-train size: {a} vs {b} tokens per tier",
            "",
            f"The same seeds, settings and test tokens, with every attacker trained on {small} attacker-train tokens "
            f"({a} public + {a} traffic, the rows above) or {big} ({b} + {b}). Top-1 recovery of the tier's "
            f"strongest attacker (Wilson 95 %, pooled over the seeds listed; the attacker named per seed); "
            f"`{b} - {a}`: the paired difference (percentage points, document-clustered bootstrap 95 %, McNemar p, "
            f"tokens recovered only with the larger / only with the smaller set); `- stock`: the defence minus the "
            "stock edge at that size, paired the same way.",
            "",
            f"| setting | seeds | side | tier | top-1 at {a} | top-1 at {b} | {b} - {a} "
            f"| - stock at {a} | - stock at {b} |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in mine:
            if tuple(r["tokens"]) != (small, big):
                continue
            if r["setting"] == "stock" and r["tier"] != "T1":
                continue  # public weights: T2 and T3 are T1 on the stock edge
            lines.append(
                f"| {r['setting']} | {','.join(map(str, r['seeds']))} | {r['side']} | "
                f"{'T1-T3' if r['setting'] == 'stock' else r['tier']} | "
                + " | ".join(_best_cell(e) for e in r["best"])
                + f" | {_paired_cell(r['larger_minus_reference'])} | "
                + " | ".join(_paired_cell(m) if m else "" for m in r["minus_stock"])
                + " |"
            )
        lines.append("")
    return lines


def render(every: list[dict[str, Any]], meta: dict[str, Any], out_dir: Path | None = None) -> str:
    points, _ = by_train_size(every)  # the tables pool one attacker-train size; the others get their own section
    rows = aggregate(points)
    pairs = paired(points)
    sizes = train_size_rows(every)
    models = sorted({r["model"] for r in rows})
    lines = [
        "# Privacy-utility frontier of the edge defences",
        "",
        f"Commit `{meta.get('commit', 'unknown')}`. Reproduce: `{meta.get('command', '')}`.",
        "",
        *([str(meta["notes"]), ""] if meta.get("notes") else []),
        "Per model the split is d,d edge layers (the cloud receives h_d and returns h_(L-d)). Each point trains "
        "a diverged edge with one defence setting, then measures held-out perplexity (with the defence on) and "
        "top-1 token recovery from what the cloud sees, on the same held-out test tokens for every point. "
        "Rates pool the seeds' test tokens (Wilson 95%); `- stock` is the paired document-clustered bootstrap "
        "95% interval of (this point's strongest attacker of the tier) minus (the strongest attacker on the "
        "stock edge), one per seed. The strongest attacker of a tier is chosen per point on the test tokens "
        "(a choice that favours the attacker) among that tier's attackers and those of the tiers below it "
        "(a T2 cloud can also run every T1 attack).",
        "",
        "## Threat model",
        "",
        "The cloud runs the published trunk and sees every hidden state the edge sends up (input side, "
        "h_d) and every state it returns (output side, h_(L-d)); it holds the published weights of the "
        "whole model. It is honest-but-curious: it computes correctly and tries to read the user's text.",
        "",
        "- **T1, non-adaptive**: inverters trained on the published model's activations of public text "
        "(`t1-mlp` / `t1-bigru`, see `--inverter`), white-box search that re-runs the published edge layers "
        "on candidate tokens "
        "(`t1-search`, input side), and the published tail on the returned state (`t1-stock-tail`, output "
        "side, guesses the next token).",
        "- **T2, adaptive without labels** (the target of the defences): additionally the deployment's own "
        "activations on its users' text (the traffic half of attacker-train, ~half the tokens), never the "
        "text. `t2-selftrain`: the T1 inverter re-standardised on the traffic, its confident guesses become "
        "labels for a new inverter on deployed activations; `t2-align`: a ridge map from deployed activations to "
        "the published model's activations of the traffic's pseudo-text (two rounds), read by the T1 inverter. The T2 "
        "API takes activations only (`splitspec.privacy.adaptive.Traffic`); a test checks that a token only the "
        "traffic contains is never produced.",
        "- **T3, chosen plaintext**: labelled (deployed activation, token) pairs of the traffic "
        "(`t3-mlp` / `t3-bigru`). "
        "The upper bound, reported, not the target.",
        "",
        "Defences (knobs; `splitspec diverge --noise-scale S --adversary-weight W`):",
        "",
        "- `noise=S`: Gaussian noise of std S x the token's RMS activation added to the state sent up; the "
        "edge layers are trained with it so the tail tolerates it; the serving edge adds the same noise "
        "(keyed by the token prefix, so a replay repeats it and cannot be averaged away).",
        "- `adv=W`: adversarial divergence: per-token probes learn the current token from both sides' states "
        "during training, alternating with the edge, which pays W x relu(CE_prior - CE_probe) per side on top "
        "of the next-token loss (it is pushed until a probe does no better than the frequency prior).",
        "- `none`: the plain weight divergence (LoRA on the edge layers, pushed a relative distance of 0.5 away "
        "from the published states while keeping the next-token loss).",
        "- Every setting trains under the scale cap (`--max-scale`, default 1.5): the edge pays for any token "
        "whose sent or returned state's RMS strays beyond 1.5x (or below 1/1.5 of) the published model's on the "
        "same token. Without it the adversary inflates the states instead of hiding the tokens (x80 RMS in 30 "
        "steps on a tiny test model, where a fresh probe then fails for numerical reasons, not privacy ones).",
        "",
    ]
    for model in models:
        mrows = sorted(
            (r for r in rows if r["model"] == model),
            key=lambda r: (r["setting"] != "stock", r["family"], r["ppl_cost"]),
        )
        stock_row = next((r for r in mrows if r["setting"] == "stock"), None)
        depth = mrows[0]["depth"]
        seeds = sorted({s for r in mrows for s in r["seeds"]})
        tok = next(p["tokens"] for p in points if p["model_name"] == model)
        lines += [
            f"## Model `{model}` (split {depth},{depth}; seeds {seeds})",
            "",
            f"Attacker-train per seed: {tok['public']} public tokens (T1), {tok['traffic']} traffic tokens (T2 "
            f"unlabelled, T3 labelled); {tok['test']} test tokens. Frequency floor (top-1): "
            f"{100 * mrows[0]['floor']:.1f} %. Stock held-out perplexity: "
            + ", ".join(f"{p['ppl_stock']:.2f}" for p in points if p["model_name"] == model and p["setting"] == "stock")
            + ".",
            "",
        ]
        for side in ("input", "output"):
            lines += [
                f"### {side} side: top-1 recovery (%)",
                "",
                "| setting | ppl cost (mean, range) | T1 | T2 | T3 | T1 - stock | T2 - stock | T3 - stock |",
                "|---|---|---|---|---|---|---|---|",
            ]
            for r in mrows:
                t = r["sides"][side]
                lo, hi = r["ppl_cost_range"]
                lines.append(
                    f"| {r['setting']} | {100 * r['ppl_cost']:+.1f} % ({100 * lo:+.1f}, {100 * hi:+.1f}) | "
                    + " | ".join(_fmt(t[x]) for x in TIERS)
                    + " | "
                    + " | ".join(_diff(t[x]) if r["setting"] != "stock" else "" for x in TIERS)
                    + " |"
                )
            lines.append("")
        best_attackers = {
            (side, tier): sorted({a for r in mrows for a in (r["sides"][side][tier] or {}).get("attackers", [])})
            for side in ("input", "output")
            for tier in TIERS
        }
        lines += [
            "Strongest attackers seen per tier: "
            + "; ".join(f"{s} {t}: {', '.join(a)}" for (s, t), a in best_attackers.items())
            + ".",
            "",
        ]
        lines += render_paired(pairs, model)
        lines += render_train_size(sizes, model)
        if stock_row is not None:
            lines += ["### Targets (at <= 10 % perplexity cost)", ""]
            lines += ["| setting | ppl cost | " + " | ".join(meets_targets(stock_row, stock_row)) + " |"]
            lines += ["|---|---|---|---|---|"]
            for r in mrows:
                if r["setting"] == "stock":
                    continue
                met = meets_targets(r, stock_row)
                lines.append(
                    f"| {r['setting']} | {100 * r['ppl_cost']:+.1f} % | "
                    + " | ".join("yes" if v else "no" for v in met.values())
                    + " |"
                )
            rec = recommend(rows, model)
            lines += [
                "",
                (
                    f"Best setting within the budget (lowest worst-case T1/T2 top-1 over both sides): "
                    f"**{rec['setting']}** (cost {100 * rec['ppl_cost']:+.1f} %; input T1/T2/T3 "
                    f"{', '.join(_fmt(rec['sides']['input'][t]) for t in TIERS)}; output T1/T2/T3 "
                    f"{', '.join(_fmt(rec['sides']['output'][t]) for t in TIERS)})."
                )
                if rec
                else "No defence setting stays within the 10 % perplexity budget.",
                "",
            ]
    transforms = out_dir / "transforms.md" if out_dir is not None else None
    if transforms is not None and transforms.is_file():
        lines += ["## Defences not built: evidence", "", *transforms.read_text().splitlines()[2:], ""]
    lines += [
        "## Plots",
        "",
        "`frontier_input.png`, `frontier_output.png`: per model, perplexity cost (x) against the strongest "
        "attacker's top-1 recovery (y) of each tier (marker), one curve per defence family (colour, knob "
        "increasing along the curve, starting from the plain divergence), with the stock point and the "
        "frequency floor.",
        "",
        "Raw points (one JSON line per model, seed and setting, with every attacker's top-1/top-5 and the "
        f"commit): `{RUNS}`.",
        "",
    ]
    return "\n".join(lines)


TIER_MARKER = {"T1": "o", "T2": "s", "T3": "^"}
TIER_STYLE = {"T1": "-", "T2": "--", "T3": ":"}


def plot(points: list[dict[str, Any]], side: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = aggregate(points)
    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models), 5.2), squeeze=False)
    families = sorted({r["family"] for r in rows if r["family"] not in ("stock", "none")})
    tab10 = plt.get_cmap("tab10")  # a listed colour map: tab10(i) is its i-th colour
    colours = dict(zip(families, (tab10(i) for i in range(tab10.N)), strict=False))
    for ax, model in zip(axes[0], models, strict=True):
        mrows = [r for r in rows if r["model"] == model]
        none = next((r for r in mrows if r["setting"] == "none"), None)
        stock = next((r for r in mrows if r["setting"] == "stock"), None)
        for fam in families:
            curve = sorted((r for r in mrows if r["family"] == fam), key=lambda r: r["ppl_cost"])
            if none is not None:
                curve = [none, *curve]
            for tier in TIERS:
                pts = [(100 * r["ppl_cost"], r["sides"][side][tier]) for r in curve if r["sides"][side][tier]]
                if not pts:
                    continue
                x = [p[0] for p in pts]
                y = [100 * p[1]["rate"] for p in pts]
                err = [
                    [100 * (p[1]["rate"] - p[1]["wilson95"][0]) for p in pts],
                    [100 * (p[1]["wilson95"][1] - p[1]["rate"]) for p in pts],
                ]
                ax.errorbar(
                    x,
                    y,
                    yerr=err,
                    color=colours[fam],
                    linestyle=TIER_STYLE[tier],
                    marker=TIER_MARKER[tier],
                    markersize=4,
                    capsize=2,
                    label=f"{fam} {tier}",
                )
        if stock is not None:
            for tier in TIERS:
                ax.plot(
                    [0],
                    [100 * stock["sides"][side][tier]["rate"]],
                    marker=TIER_MARKER[tier],
                    color="black",
                    linestyle="none",
                    label=f"stock {tier}" if tier == "T1" else None,
                )
        ax.axhline(100 * mrows[0]["floor"], color="gray", linestyle="--", label="frequency floor")
        ax.axhline(200 * mrows[0]["floor"], color="gray", linestyle=":", label="2x floor (input target)")
        ax.axvline(100 * COST_BUDGET, color="red", alpha=0.4, linestyle="-.", label="10 % ppl budget")
        ax.set_title(f"{model} (split {mrows[0]['depth']},{mrows[0]['depth']}), {side} side")
        ax.set_xscale("symlog", linthresh=10)  # costs run from a few % to thousands of %
        ax.set_xlim(left=-1)
        ax.set_xlabel("held-out perplexity cost (%, linear to 10, log beyond)")
        ax.set_ylabel("top-1 tokens recovered (%)")
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6, ncol=2)
    fig.suptitle(f"Privacy-utility frontier, {side} side (solid T1, dashed T2, dotted T3; Wilson 95%)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(out: Path, meta: dict[str, Any]) -> None:
    points = load_points(out)
    if not points:
        log.warning("no points yet in %s", out)
        return
    # each point keeps the commit it was measured at (rounds run at different commits share one file)
    stamped = [{**p, "commit": p.get("commit", meta.get("commit", "unknown"))} for p in points]
    write_jsonl_gz(out / RUNS, stamped)
    (out / "report.md").write_text(render(points, meta, out))
    main, _ = by_train_size(points)
    summary = {"meta": meta, "rows": aggregate(main), "paired": paired(main), "train_size": train_size_rows(points)}
    (out / "frontier.json").write_text(json.dumps(summary, indent=1) + "\n")
    for side in ("input", "output"):
        plot(main, side, out / f"frontier_{side}.png")
    log.info("wrote %s", out / "report.md")


def measured(out: Path, max_tokens: int) -> tuple[set[tuple[str, int, str]], set[tuple[str, int, str]]]:
    """(model, seed, setting) of the points in ``out`` at this attacker-train size: (with outcomes, all).

    A rerun skips the points stored with per-token outcomes (:func:`todo_settings`) and does not write them again;
    older points without them are measured again, and the new point wins over the old (:func:`load_points`). A
    point at another ``--max-tokens`` is another point. A size is matched exactly, so
    a cap above what the corpus holds (the point records what it got) is measured again on a rerun.
    """
    here = [p for p in load_points(out) if train_tokens(p) == max_tokens]
    return (
        {(p["model_name"], p["seed"], p["setting"]) for p in here if "outcomes" in p},
        {(p["model_name"], p["seed"], p["setting"]) for p in here},
    )


def todo_settings(
    settings: tuple[Any, ...], model: str, seed: int, done: set[tuple[str, int, str]]
) -> tuple[Any, ...] | None:
    """The ``settings`` (each with a ``label``) of ``model`` at ``seed`` to measure: those without a stored point
    with per-token outcomes (``done``, from :func:`measured`), so an older point that keeps rates alone is measured
    again. None when there is nothing to run: every setting and the stock point have outcomes stored."""
    todo = tuple(s for s in settings if (model, seed, s.label) not in done)
    return None if not todo and (model, seed, "stock") in done else todo


def main() -> int:
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="base:2,worker:1", help="NAME:DEPTH list (shipped models) or DIR:DEPTH")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--settings", default="none,noise=0.5,adv=0.5,noise=0.25,adv=0.1")
    parser.add_argument("--steps", type=int, default=100, help="edge training steps per setting")
    parser.add_argument("--max-tokens", type=int, default=48_000, help="attacker-train tokens (public + traffic)")
    parser.add_argument("--max-test-tokens", type=int, default=6_000, help="test tokens (the same for every point)")
    parser.add_argument("--inverter", default="bigru", choices=("mlp", "bigru"), help="learned inverter of every tier")
    parser.add_argument("--epochs", type=int, default=3, help="MLP epochs (T1, T2, T3)")
    parser.add_argument("--seq-epochs", type=int, default=3, help="GRU epochs (T1, T2, T3)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--work", type=Path, default=Path("/tmp/splitspec-frontier"), help="diverged edges")
    parser.add_argument("--tag", default="main", help="points file suffix (parallel runs write separate files)")
    parser.add_argument("--report-only", action="store_true", help="re-render report and plots from the points files")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    meta_path = args.out / "meta.json"
    if args.report_only:
        write_report(args.out, json.loads(meta_path.read_text()) if meta_path.is_file() else {})
        return 0
    meta = {**run_environment(), "command": "python benchmarks/privacy_frontier.py " + shlex.join(sys.argv[1:])}
    meta_path.write_text(json.dumps(meta, indent=1) + "\n")
    settings = tuple(parse_defence(s) for s in args.settings.split(","))
    done, _ = measured(args.out, args.max_tokens)
    seeds = [int(s) for s in args.seeds.split(",")]
    models = []
    for item in args.models.split(","):
        name, _, depth = item.rpartition(":")
        path = MODELS / name if (MODELS / name).is_dir() else Path(name)
        models.append((path, int(depth)))
    # seeds outermost: a run cut short still has every model at one seed
    for seed in seeds:
        for path, depth in models:
            todo = todo_settings(settings, path.name, seed, done)
            if todo is None:
                continue

            def on_point(point: dict[str, Any]) -> None:
                if (point["model_name"], point["seed"], point["setting"]) in done:
                    return
                name = f"points-{point['model_name']}-s{point['seed']}-{args.tag}.jsonl"
                with (args.out / name).open("a") as f:
                    f.write(json.dumps({**point, "commit": meta["commit"]}) + "\n")
                write_report(args.out, meta)

            config = FrontierConfig(
                model_dir=path,
                out_dir=args.work,
                depth=depth,
                seed=seed,
                settings=todo,
                max_train_tokens=args.max_tokens,
                max_test_tokens=args.max_test_tokens,
                diverge_steps=args.steps,
                train=TrainConfig(epochs=args.epochs, seq_epochs=args.seq_epochs),
                inverter=args.inverter,
            )
            run_frontier(config, on_point)
    write_report(args.out, meta)
    return 0


if __name__ == "__main__":
    sys.exit(main())
