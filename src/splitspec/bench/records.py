"""One benchmark run as a record: a split generation over an emulated link, or a local baseline."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from splitspec.bench.probe import step_total_ms
from splitspec.bench.prompts import Prompt
from splitspec.edge import GenerationResult
from splitspec.measure import median

__all__ = ["COMPONENTS", "RunRecord", "baseline_record", "split_record"]

COMPONENTS = ("network_ms", "edge_ms", "cloud_ms", "serialize_ms")  # parts of a decode step, ms


@dataclass
class RunRecord:
    """One generation: a split run (``rtt_ms`` set) or a local baseline (``rtt_ms`` None)."""

    run_id: str
    mode: str  # a MODES key or a BASELINES name
    rtt_ms: float | None  # emulated RTT setting, ms; None for local baselines
    measured_rtt_ms: float | None  # median control round trip through the emulator, ms
    prompt_set: str
    prompt_id: str
    repeat: int
    prompt_tokens: int  # tokens
    new_tokens: int  # tokens
    wall_s: float  # whole generation, seconds
    e2e_tok_s: float  # new tokens / wall, tokens/second
    decode_tok_s: float | None  # decode-phase throughput, tokens/second (split runs only)
    decode_steps: int | None  # round trips after the prefill, count
    accepted_per_step: float | None  # (new tokens − 1) / decode steps, tokens/step
    prefill_ms: float | None  # prefill steps' total time, ms
    step_ms: dict[str, float] = field(default_factory=dict)  # medians over decode steps, ms
    bytes_per_step: dict[str, float] = field(default_factory=dict)  # medians over decode steps, bytes
    # token-identical to the reference baseline's run of the prompt (token_reference; None: not checked)
    matches_hf_generate: bool | None = None
    token_reference: str | None = None  # that baseline: hf_generate, or local_loop when hf_generate is off
    token_ids: list[int] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)  # every StepStats, as dicts

    @property
    def is_split(self) -> bool:
        return self.rtt_ms is not None


def split_record(
    result: GenerationResult,
    *,
    run_id: str,
    mode: str,
    rtt_ms: float,
    measured_rtt_ms: float,
    prompt: Prompt,
    repeat: int,
) -> RunRecord:
    """Derive the per-run figures (see the module doc) from a split generation."""
    decode = [s for s in result.steps if s.kind == "decode"]
    prefill_ms = sum(step_total_ms(s) for s in result.steps if s.kind == "prefill")
    n = len(result.token_ids)
    decode_s = result.wall_s - prefill_ms / 1e3
    step_ms = {k: median(getattr(s, k) for s in decode) for k in COMPONENTS}
    step_ms["step_ms"] = median(step_total_ms(s) for s in decode)
    return RunRecord(
        run_id=run_id,
        mode=mode,
        rtt_ms=rtt_ms,
        measured_rtt_ms=measured_rtt_ms,
        prompt_set=prompt.prompt_set,
        prompt_id=prompt.prompt_id,
        repeat=repeat,
        prompt_tokens=len(prompt.token_ids),
        new_tokens=n,
        wall_s=result.wall_s,
        e2e_tok_s=n / result.wall_s if result.wall_s > 0 else float("nan"),
        decode_tok_s=(n - 1) / decode_s if decode and decode_s > 0 else None,
        decode_steps=len(decode),
        accepted_per_step=(n - 1) / len(decode) if decode else None,
        prefill_ms=prefill_ms,
        step_ms=step_ms,
        bytes_per_step={
            "up": median(float(s.bytes_up) for s in decode),
            "down": median(float(s.bytes_down) for s in decode),
        },
        token_ids=list(result.token_ids),
        steps=[asdict(s) for s in result.steps],
    )


def baseline_record(mode: str, tokens: list[int], wall: float, prompt: Prompt, repeat: int) -> RunRecord:
    return RunRecord(
        run_id=f"r{repeat}_{mode}_{prompt.prompt_id}",
        mode=mode,
        rtt_ms=None,
        measured_rtt_ms=None,
        prompt_set=prompt.prompt_set,
        prompt_id=prompt.prompt_id,
        repeat=repeat,
        prompt_tokens=len(prompt.token_ids),
        new_tokens=len(tokens),
        wall_s=wall,
        e2e_tok_s=len(tokens) / wall if wall > 0 else float("nan"),
        decode_tok_s=None,
        decode_steps=None,
        accepted_per_step=None,
        prefill_ms=None,
        token_ids=tokens,
    )
