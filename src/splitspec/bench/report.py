"""A benchmark's report files from its summary: ``summary.md`` and the PNG plots."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["write_markdown", "write_plots"]


def _fmt(value: float | None, digits: int = 1) -> str:
    if value is None or value != value:  # None or NaN
        return "-"
    return f"{value:.{digits}f}"


def _ratio_cell(value: float | None) -> str:
    return "-" if value is None else _fmt(value, 3) + "x"


def _table(header: list[str], rows: list[list[str]], text_columns: int = 1) -> Iterator[str]:
    yield "| " + " | ".join(header) + " |"
    yield "|" + "|".join(":---" if i < text_columns else "---:" for i in range(len(header))) + "|"
    for row in rows:
        yield "| " + " | ".join(row) + " |"


def write_markdown(summary: dict[str, Any]) -> str:
    """The ``summary.md`` report."""
    sc, env = summary["scenario"], summary["environment"]
    lines = [
        f"# Benchmark `{sc['name']}`",
        "",
        *([sc["description"], ""] if sc.get("description") else []),
        f"Model `{sc['model_dir']}`, edge layers {sc['edge_layers'][0]}+{sc['edge_layers'][1]}, {sc['dtype']}; "
        f"{len(summary['prompts'])} prompts ({', '.join(sc['prompts']['sets'])}; "
        f"{sc['prompts']['prompt_tokens']} tokens each), {sc['max_new_tokens']} new tokens, "
        f"{sc['repeats']} repeats. Emulated RTTs {sc['rtt_ms']} ms on loopback "
        f"(jitter {sc['jitter_ms']} ms, bandwidth {sc['bandwidth_mbit'] or 'unlimited'} Mbit/s).",
        f"Run {env['started_utc']}, {env['wall_s']:.0f} s wall; torch {env['torch']}, transformers "
        f"{env['transformers']}, {env['cpu_count']} CPUs ({env['torch_threads']} torch threads), "
        "shared machine: read the ratios, not the absolute times.",
        "",
        "## Throughput (medians over prompts and repeats)",
        "",
    ]
    header = [
        "mode",
        "RTT set ms",
        "RTT meas. ms",
        "decode tok/s",
        "e2e tok/s",
        "vs HF generate",
        "vs local loop",
        "accepted/step",
        "B up/step",
        "B down/step",
        "network ms",
        "edge ms",
        "cloud ms",
        "serialize ms",
        "step ms",
        f"= {summary.get('token_reference') or 'hf_generate'} tokens",
    ]
    rows: list[list[str]] = []
    for name, b in summary["baselines"].items():
        match = b["token_match"]
        rows.append(
            [
                f"{name} (local)",
                "-",
                "-",
                "-",
                _fmt(b["e2e_tok_s"]),
                _ratio_cell(b["ratio_vs_hf_generate"]),
                _ratio_cell(b["ratio_vs_local_loop"]),
                "-",
                "-",
                "-",
                "-",
                "-",
                "-",
                "-",
                "-",
                "ref" if match is None else f"{match[0]}/{match[1]}",
            ]
        )
    for g in summary["split"]:
        s = g["step_ms"]
        rows.append(
            [
                f"split {g['mode']}",
                f"{g['rtt_ms']:g}",
                _fmt(g["measured_rtt_ms"]),
                _fmt(g["decode_tok_s"]),
                _fmt(g["e2e_tok_s"]),
                _ratio_cell(g["ratio_vs_hf_generate"]),
                _ratio_cell(g["ratio_vs_local_loop"]),
                _fmt(g["accepted_per_step"], 2),
                _fmt(g["bytes_up_per_step"], 0),
                _fmt(g["bytes_down_per_step"], 0),
                _fmt(s["network_ms"], 2),
                _fmt(s["edge_ms"], 2),
                _fmt(s["cloud_ms"], 2),
                _fmt(s["serialize_ms"], 2),
                _fmt(s["step_ms"], 2),
                f"{g['token_match'][0]}/{g['token_match'][1]}" if g["token_match"][1] else "-",
            ]
        )
    lines += list(_table(header, rows))
    lines += ["", "## Fixed overhead: tok/s = 1000·a / (RTT + f)", ""]
    fit_rows = []
    for mode, fit in summary["fits"].items():
        if fit is None:
            continue
        fit_rows.append(
            [
                mode,
                _fmt(fit.get("overhead_ms"), 2),
                _fmt(fit.get("acceptance"), 3),
                _fmt(fit.get("r_squared"), 4),
                _fmt(fit.get("max_abs_error_tok_s"), 2),
                _fmt(fit.get("overhead_from_steps_ms"), 2),
            ]
        )
    lines += list(_table(["mode", "fitted f ms", "fitted a", "R²", "max err tok/s", "median step − RTT ms"], fit_rows))
    lines += [
        "",
        "The fit uses the measured RTT (control round trips through the emulator) and the median decode tok/s "
        "at each setting; 'median step − RTT' is the same overhead read directly off the step timings.",
        "",
        "## Decode tok/s by prompt set",
        "",
    ]
    rtts = sorted(sc["rtt_ms"])
    set_rows = []
    for mode in sc["modes"]:
        for s in sc["prompts"]["sets"]:
            cells = {g["rtt_ms"]: g for g in summary["split_by_set"] if g["mode"] == mode and g["prompt_set"] == s}
            set_rows.append(
                [f"{mode} / {s}"]
                + [
                    _fmt(cells[r]["decode_tok_s"]) + f" ({_fmt(cells[r]['accepted_per_step'], 2)})"
                    if r in cells
                    else "-"
                    for r in rtts
                ]
            )
    lines += list(_table(["mode / set"] + [f"RTT {r:g} ms" for r in rtts], set_rows))
    lines += ["", "Cells: median decode tok/s (accepted tokens per step).", "", "## Prompts", ""]
    prompt_rows = [
        [
            p["prompt_id"],
            p["source"],
            str(p["tokens"]),
            "`" + (p["text_tail"] or "").replace("\n", "⏎").replace("|", "¦").replace("`", "'") + "`",
        ]
        for p in summary["prompts"]
    ]
    lines += list(_table(["id", "document", "tokens", "last tokens"], prompt_rows, text_columns=4))
    lines += ["", "Definitions:", ""]
    lines += [f"- `{k}`: {v}" for k, v in summary["definitions"].items()]
    return "\n".join(lines) + "\n"


def write_plots(summary: dict[str, Any], out_dir: Path) -> list[Path]:
    """``tok_s_vs_rtt.png`` and ``step_breakdown.png`` (matplotlib, Agg canvas, no pyplot)."""
    import numpy as np
    from matplotlib.figure import Figure

    paths = []
    fig = Figure(figsize=(7.0, 4.5), dpi=110)
    ax = fig.add_subplot()
    groups = summary["split"]
    # one distinct colour per mode (baselines use black / green / red lines)
    colors = ["tab:blue", "tab:orange", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan", "tab:gray"]
    max_rtt = max([g["measured_rtt_ms"] for g in groups] + [1.0])
    xs = np.linspace(0.0, max_rtt * 1.05, 200)
    for i, mode in enumerate(summary["scenario"]["modes"]):
        pts = [g for g in groups if g["mode"] == mode]
        if not pts:
            continue
        color = colors[i % len(colors)]
        x = [g["measured_rtt_ms"] for g in pts]
        y = [g["decode_tok_s"] for g in pts]
        lo = [g["decode_tok_s"] - g["decode_tok_s_iqr"][0] for g in pts]
        hi = [g["decode_tok_s_iqr"][1] - g["decode_tok_s"] for g in pts]
        ax.errorbar(x, y, yerr=[lo, hi], fmt="o", color=color, capsize=3, label=f"split {mode} (median, IQR)")
        fit = summary["fits"].get(mode) or {}
        if "overhead_ms" in fit:
            f, a = fit["overhead_ms"], fit["acceptance"]
            ax.plot(xs, 1000.0 * a / (xs + f), "-", color=color, alpha=0.7, label=f"1000·{a:.2f}/(RTT + {f:.1f} ms)")
    styles = {"hf_generate": ("k", "--"), "hf_prompt_lookup": ("tab:green", ":"), "local_loop": ("tab:red", "-.")}
    for name, b in summary["baselines"].items():
        color, style = styles.get(name, ("gray", "-."))
        ax.axhline(b["e2e_tok_s"], color=color, linestyle=style, label=f"{name}, local: {b['e2e_tok_s']:.1f} tok/s e2e")
    ax.set_xlabel("measured RTT (ms)")
    ax.set_ylabel("tokens / s")
    ax.set_title(f"{summary['scenario']['name']}: decode throughput vs RTT")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / "tok_s_vs_rtt.png"
    fig.savefig(path)
    paths.append(path)

    many = len(groups) > 8  # many bars: one-line labels, turned upright, on a wider figure
    fig = Figure(figsize=(max(7.0, 0.45 * len(groups)), 5.0 if many else 4.5), dpi=110)
    ax = fig.add_subplot()
    sep = " " if many else "\n"
    labels = [f"{g['mode']}{sep}{g['rtt_ms']:g} ms" for g in groups]
    bottom = np.zeros(len(groups))
    rtt = np.array([g["measured_rtt_ms"] for g in groups])
    parts = {
        "RTT (measured)": ("tab:blue", rtt),
        "network − RTT": (
            "lightsteelblue",
            np.maximum(0.0, np.array([g["step_ms"]["network_ms"] for g in groups]) - rtt),
        ),
        "edge": ("tab:orange", np.array([g["step_ms"]["edge_ms"] for g in groups])),
        "cloud": ("tab:red", np.array([g["step_ms"]["cloud_ms"] for g in groups])),
        "serialize": ("tab:gray", np.array([g["step_ms"]["serialize_ms"] for g in groups])),
    }
    for label, (color, vals) in parts.items():
        ax.bar(labels, vals, bottom=bottom, color=color, label=label)
        bottom += vals
    if many:
        ax.tick_params(axis="x", labelrotation=90, labelsize=8)
    ax.set_ylabel("median per decode step (ms)")
    ax.set_title("per decode step: RTT and fixed overhead (medians)")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path = out_dir / "step_breakdown.png"
    fig.savefig(path)
    paths.append(path)
    return paths
