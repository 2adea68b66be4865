"""Render an audit: ``report.json``, ``report.md``, ``recovery_vs_depth.png``, ``outcomes.csv.gz``."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from splitspec.privacy.outcomes import AuditData, write_outcomes
from splitspec.privacy.stats import EXACT_SIGN_FLIP_DOCUMENTS

log = logging.getLogger(__name__)

CONDITION_STYLE = {"stock": "-", "diverged/non-adaptive": ":", "diverged/adaptive": "--"}
OFFSET = {"stock": 0.0, "diverged/non-adaptive": 0.06, "diverged/adaptive": 0.12}  # x jitter (depth units)
ATTACKER_COLOR = {
    "nn-embed": "tab:green",
    "mlp": "tab:blue",
    "bigru": "tab:purple",
    "search": "tab:orange",
    "stock-tail": "tab:red",
}


def _fmt(cell: dict[str, Any]) -> str:
    lo, hi = cell["wilson95"]
    return f"{100 * cell['rate']:.1f} [{100 * lo:.1f}, {100 * hi:.1f}]"


def _series_table(results: dict[str, Any], metric: str) -> list[str]:
    depths = results["depths"]
    rows: dict[tuple[str, str, str], dict[int, str]] = {}
    for s in results["series"]:
        if s["depth"] > 0:
            rows.setdefault((s["condition"], s["side"], s["attacker"]), {})[s["depth"]] = _fmt(s[metric])
    lines = [
        "| condition | side | attacker | " + " | ".join(f"d={d}" for d in depths) + " |",
        "|---|---|---|" + "---|" * len(depths),
    ]
    order = {"stock": 0, "diverged/non-adaptive": 1, "diverged/adaptive": 2}
    for (cond, side, attacker), cells in sorted(
        rows.items(), key=lambda kv: (order.get(kv[0][0], 9), kv[0][1], kv[0][2])
    ):
        lines.append(f"| {cond} | {side} | {attacker} | " + " | ".join(cells.get(d, "n/a") for d in depths) + " |")
    return lines


def _name(column: str) -> str:
    """A series column ("cond|attacker|side|depth") in a form that does not break a markdown table."""
    cond, attacker, side, depth = column.split("|")
    return f"{cond} {attacker} {side} d={depth}" if side != "-" else attacker


def _tests_table(tests: list[dict[str, Any]], family: str, metric: str) -> list[str]:
    lines = [
        "| A | B | rate A | rate B | A - B (doc-bootstrap 95%) | only A / only B | McNemar p (tokens) "
        "| document p | Holm p | sig. |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t in tests:
        if t["family"] != family or t["metric"] != metric:
            continue
        lines.append(
            f"| {_name(t['a'])} | {_name(t['b'])} | {100 * t['rate_a']:.1f} | {100 * t['rate_b']:.1f} | "
            f"{100 * t['diff']:+.1f} {_interval(t.get('bootstrap95'))} | {t['only_a']} / {t['only_b']} | "
            f"{t['p_exact_mcnemar']:.2g} | {_p(t.get('p_documents'))} | {t['p_holm']:.2g} | "
            f"{'yes' if t['significant'] else 'no'} |"
        )
    return lines


def _interval(bounds: list[float] | None) -> str:
    """A bootstrap interval in points, or why there is none (one test document)."""
    if bounds is None:
        return "[n/a: one document]"
    return f"[{100 * bounds[0]:+.1f}, {100 * bounds[1]:+.1f}]"


def _p(value: float | None) -> str:
    """A p-value, or n/a for a report written before the document-level test."""
    return "n/a" if value is None else f"{value:.2g}"


def _overlap(edge: dict[str, Any]) -> str:
    """Attacker-train windows (documents) whose document the edge was fitted on, or why that is not known."""
    if "attacker_train_overlap" not in edge:
        return "not recorded"
    overlap = edge["attacker_train_overlap"]
    if overlap is None:
        return "unknown: no training documents recorded"
    return (
        f"{overlap['windows']} of {overlap['of_windows']} windows "
        f"({overlap['documents']} of {overlap['of_documents']} documents)"
    )


FEW_DOCUMENTS = 10  # below this many test documents, percentile intervals under-cover


def _few_documents(tests: list[dict[str, Any]]) -> str:
    """A warning when the tests rest on fewer than FEW_DOCUMENTS test documents."""
    fewest = min((int(t["clusters"]) for t in tests), default=FEW_DOCUMENTS)
    if fewest >= FEW_DOCUMENTS:
        return ""
    return (
        f" **Only {fewest} test document(s):** percentile bootstrap intervals from so few documents are too "
        "narrow, and the document-level test has little power; test on more documents (`--max-test-tokens`)."
    )


def _headline(results: dict[str, Any]) -> list[str]:
    """Best attacker per condition, side and depth, and which depth differences are significant."""
    best: dict[tuple[str, str, int], dict[str, Any]] = {}
    for s in results["series"]:
        if s["depth"] > 0:
            key = (s["condition"], s["side"], s["depth"])
            if key not in best or s["top1"]["rate"] > best[key]["top1"]["rate"]:
                best[key] = s
    freq = next((s for s in results["series"] if s["attacker"] == "freq"), None)
    lines = ["## Headline", ""]
    if freq is not None:
        lines.append(f"Frequency prior (the floor): top-1 {_fmt(freq['top1'])}, top-5 {_fmt(freq['top5'])}.")
        lines.append("")
    lines += ["| condition | side | depth | best attacker | top-1 | top-5 |", "|---|---|---|---|---|---|"]
    order = {"stock": 0, "diverged/non-adaptive": 1, "diverged/adaptive": 2}
    for (cond, side, d), s in sorted(best.items(), key=lambda kv: (order.get(kv[0][0], 9), kv[0][1], kv[0][2])):
        lines.append(f"| {cond} | {side} | {d} | {s['attacker']} | {_fmt(s['top1'])} | {_fmt(s['top5'])} |")
    adjacent = [t for t in results["tests"] if t["family"] == "adjacent depths" and t["metric"] == "top1"]
    parts = []
    for cond in sorted({t["a"].split("|")[0] for t in adjacent}, key=lambda c: order.get(c, 9)):
        mine = [t for t in adjacent if t["a"].startswith(cond + "|")]
        parts.append(f"{cond}: {sum(bool(t['significant']) for t in mine)} of {len(mine)}")
    lines += [
        "",
        "Adjacent-depth differences in top-1 recovery significant after Holm correction - "
        + "; ".join(parts)
        + " (details under Paired tests).",
        "",
    ]
    return lines


def render_markdown(results: dict[str, Any]) -> str:
    split = results["split"]
    base = {s["attacker"]: s for s in results["series"] if s["depth"] == 0}
    lines = [
        "# Privacy audit: token recovery from what the cloud sees",
        "",
        f"Model `{results['model_dir']}` ({results['num_layers']} decoder layers, vocabulary {results['vocab_size']}). "
        f"At depth d the cloud receives h_d (**input** side, after the edge's first d layers) and returns "
        f"h_(L-d) (**output** side, d layers before the LM head); stream indices per depth: "
        f"`{json.dumps(results['stream_index'])}`.",
        "",
        f"Documents split by document: {len(split['train_documents'])} attacker-train documents "
        f"({split['train_documents_used']} used, {split['train_tokens']} tokens), "
        f"{len(split['test_documents'])} test documents ({split['test_documents_used']} used, "
        f"**{results['n_test_tokens']} test tokens, the same tokens for every depth and condition** - paired). "
        f"{100 * split['test_classes_seen_in_train']:.1f}% of test tokens occur in attacker-train (a ceiling for "
        "learned inverters, which can only output tokens they saw).",
        "",
        "Rates are % of test tokens, with Wilson 95% intervals (tokens treated as independent; "
        "the document-clustered bootstrap below is the honest interval for differences).",
        "",
        *_headline(results),
        "## Baselines",
        "",
        "| attacker | top-1 | top-5 |",
        "|---|---|---|",
    ]
    for name in ("freq", "freq-pos"):
        if name in base:
            lines.append(f"| {name} | {_fmt(base[name]['top1'])} | {_fmt(base[name]['top5'])} |")
    u = results["uniform"]
    lines += [
        f"| uniform (reference only) | {100 * u['top1']:.3f} | {100 * u['top5']:.3f} |",
        "",
        "`freq`: the most frequent attacker-train tokens; `freq-pos`: the same per log2 bucket of the "
        "position in the document. These, not uniform guessing, are the floor an attack must beat.",
        "",
        "## Top-1 recovery",
        "",
        *_series_table(results, "top1"),
        "",
        "## Top-5 recovery",
        "",
        *_series_table(results, "top5"),
        "",
        "Attackers: `nn-embed` cosine nearest row of the public embedding; `mlp` the paper's per-token "
        "MLP inverter; `bigru` a sequence-aware bidirectional GRU over the window; `search` (input side) "
        "white-box inversion with the published edge layers: the stock-trained GRU (MLP if no GRU) proposes "
        f"{results['config'].get('search_candidates', '?')} candidates per position, the published layers recompute "
        "h_d for each after the already-decoded prefix, the closest (cosine) wins; `stock-tail` the "
        "published last d layers + norm + LM head applied to the returned state (reads position j-1, "
        "guesses token j: what the edge is about to emit). Conditions: `stock` edge = published weights; "
        "`diverged/non-adaptive` edge privately fine-tuned, attacker trained on stock activations; "
        "`diverged/adaptive` attacker retrained on activations of the diverged deployment for chosen "
        "text (the attacker-train documents; how much of that text each edge was itself fitted on is in the "
        "diverged-edge table).",
        "",
    ]
    edges = results.get("edges") or {}
    if edges:
        lines += [
            "## Diverged edges",
            "",
            "| depth | held-out ppl stock -> diverged | max rel. weight diff "
            "| activation rel. distance (in / out) | send noise | attacker-train text the edge was fitted on "
            "| fingerprint |",
            "|---|---|---|---|---|---|---|",
        ]
        notes: list[str] = []
        for d, e in sorted(edges.items(), key=lambda kv: int(kv[0])):
            if "skipped" in e:
                lines.append(f"| {d} | n/a: {e['skipped']} | | | | | |")
                continue
            overlap = e.get("attacker_train_overlap")
            if overlap and overlap["windows"]:
                notes.append(
                    f"Depth {d}: {overlap['windows']} of the {overlap['of_windows']} attacker-train windows "
                    f"({overlap['documents']} of {overlap['of_documents']} documents) come from documents this edge "
                    "was fitted on: the adaptive attacker learned from the edge's states on the edge's own training "
                    "text, not on text the edge never saw (the test documents are apart from both). "
                    "`--unseen-attacker-text` keeps the two apart."
                )
            if e.get("head_is_stock"):
                notes.append(
                    f"Depth {d}: the edge's head layers are the published ones, so the input side is what anyone "
                    "holding the published model computes."
                )
            if e.get("train_documents_checked") is False:
                notes.append(f"Depth {d}: the edge records no training documents; train/test separation unchecked.")
            ppl = (
                f"{e['heldout_perplexity_before']:.2f} -> {e['heldout_perplexity_after']:.2f}"
                if "heldout_perplexity_before" in e
                else "n/a"
            )
            ad = e.get("activation_relative_distance", {})
            lines.append(
                f"| {d} | {ppl} | {e['max_relative_weight_difference']:.3f} | "
                f"{ad.get('input', float('nan')):.3f} / {ad.get('output', float('nan')):.3f} | "
                f"{e.get('send_noise_scale', 0.0):g} | {_overlap(e)} | `{str(e['fingerprint_sha256'])[:16]}` |"
            )
        lines += ["", *notes, ""] if notes else [""]
    tests = results["tests"]
    lines += [
        "## Paired tests",
        "",
        "Each test's p-value (`document p`) treats the test *document* as the unit: each document's "
        "difference in hits keeps or flips its sign under the null (exact over every flip up to "
        f"{EXACT_SIGN_FLIP_DOCUMENTS} documents, else 20000 random flips). Holm-adjusted within each question "
        f"below (family and metric; alpha {results['alpha']}). "
        "Differences carry a 95% percentile bootstrap that resamples whole test documents. Exact McNemar on "
        "the per-token outcomes is shown for reference only: it counts the tokens of one document as "
        "independent, which they are not, so it overstates the evidence." + _few_documents(tests),
        "",
        "### Adjacent depths (top-1)",
        "",
        *_tests_table(tests, "adjacent depths", "top1"),
        "",
        "### Shallowest vs deepest (top-1)",
        "",
        *_tests_table(tests, "shallowest vs deepest", "top1"),
        "",
        "### Stock vs diverged edge (top-1)",
        "",
        *_tests_table(tests, "stock vs diverged", "top1"),
        "",
        "### Adjacent depths (top-5)",
        "",
        *_tests_table(tests, "adjacent depths", "top5"),
        "",
        "### Attacker vs frequency prior (top-1)",
        "",
        *_tests_table(tests, "attacker vs frequency prior", "top1"),
        "",
        "## Caveats",
        "",
        "- `stock-tail` guesses the *next* token from the state at the previous position; with stock weights "
        "it is the model's own greedy prediction, so it does not depend on depth. The other attackers guess "
        "the token at the position itself.",
        "- When d = L - d the two sides are the same stream h_d (shared rows in the tables). A diverged edge "
        "needs a (d, d) split that leaves a trunk; depths without one are marked n/a.",
        "- Learned inverters only output tokens seen in attacker-train; `search` only finds tokens among its "
        "candidates, so its stock-weight recovery measures the candidates' recall (with the true token among "
        "them, the published layers reproduce h_d exactly).",
        "- The model is a small demo model; absolute rates do not transfer to large models. The comparisons "
        "(depth, stock vs diverged, adaptive vs not) are the point.",
        "",
        "Per-token outcomes: `outcomes.csv.gz` (rank of the true token in each series' top-5, 0 = miss); "
        "`splitspec.privacy.outcomes.load_outcomes` reads it back for re-testing.",
        "",
    ]
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    """Recovery vs depth, top-1 and top-5, both directions, every attacker and condition."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5), sharex=True)
    base = {s["attacker"]: s for s in results["series"] if s["depth"] == 0}
    for row, metric in enumerate(("top1", "top5")):
        for col, side in enumerate(("input", "output")):
            ax = axes[row][col]
            groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
            for s in results["series"]:
                if s["side"] == side:
                    groups.setdefault((s["condition"], s["attacker"]), []).append(s)
            for (cond, attacker), items in sorted(groups.items()):
                items.sort(key=lambda s: s["depth"])
                x = [s["depth"] + OFFSET.get(cond, 0.0) for s in items]
                y = [100 * s[metric]["rate"] for s in items]
                err = [
                    [100 * (s[metric]["rate"] - s[metric]["wilson95"][0]) for s in items],
                    [100 * (s[metric]["wilson95"][1] - s[metric]["rate"]) for s in items],
                ]
                ax.errorbar(
                    x,
                    y,
                    yerr=err,
                    linestyle=CONDITION_STYLE.get(cond, "-"),
                    marker="o",
                    markersize=3,
                    capsize=2,
                    color=ATTACKER_COLOR.get(attacker, "black"),
                    label=f"{attacker} ({cond})",
                )
            for name, style in (("freq", "--"), ("freq-pos", "-.")):
                if name in base:
                    ax.axhline(
                        100 * base[name][metric]["rate"], color="gray", linestyle=style, label=f"{name} baseline"
                    )
            ax.set_title(f"{side} side, {metric.replace('top', 'top-')}")
            ax.set_ylabel("tokens recovered (%)")
            ax.set_ylim(0, 100)
            ax.grid(alpha=0.3)
            if row == 1:
                ax.set_xlabel("split depth d (edge layers on that side)")
    ax0 = axes[0][0]
    handles, labels = [], []
    for ax in axes.ravel():
        for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=7)
    ax0.set_xticks(results["depths"])
    fig.suptitle(
        "Token recovery vs split depth (Wilson 95% intervals); "
        "solid stock, dotted diverged non-adaptive, dashed adaptive"
    )
    fig.tight_layout(rect=(0, 0.1, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(data: AuditData, results: dict[str, Any], out_dir: Path, outcomes: bool = True) -> None:
    """The report files; ``outcomes=False`` keeps an existing ``outcomes.csv.gz`` (a re-test)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").write_text(json.dumps(results, indent=1) + "\n")
    (out_dir / "report.md").write_text(render_markdown(results))
    plot(results, out_dir / "recovery_vs_depth.png")
    if outcomes:
        write_outcomes(data, out_dir / "outcomes.csv.gz")
    log.info("wrote the audit report to %s", out_dir)
