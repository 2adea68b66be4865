"""Benchmark scenarios: a TOML file read once into frozen dataclasses, with explicit errors.

A scenario names the model, the split, the emulated RTTs, the decoding modes and the prompt sets
of one benchmark. Example (``splitspec/bench/scenarios/default.toml``)::

    name = "split_sequential"          # also the default output folder name
    # model = "path/to/checkpoint"     # default: the demo base model shipped in splitspec/assets
    # draft_model = "path/to/drafter"  # default: the demo drafter, with the demo model only;
    #                                  # the draft and mix modes need one
    edge_layers = [2, 2]
    rtt_ms = [0, 5, 20, 80, 150]       # emulated round-trip times, ms
    modes = ["sequential"]             # keys of splitspec.bench.modes.MODES
    repeats = 3
    max_new_tokens = 48
    torch_threads = 1                  # torch intra-op threads during the run
    # wire_codec = "int8"              # hidden states on the link: raw (default), bf16 or int8

    [prompts]
    sets = ["code", "prose", "structured"]
    per_set = 2
    prompt_tokens = 64
    # corpus = "path/to/heldout"       # default: splitspec/assets/corpus/heldout

    [baselines]
    hf_generate = true
    prompt_lookup = true
    prompt_lookup_num_tokens = 10
    local_loop = true

Relative paths are resolved against the scenario file's folder. Every mistake (unknown key,
wrong type, out-of-range value, missing model) is a :class:`~splitspec.exceptions.ConfigError`
naming the file and the key. A model given on the command line (``--model``) drops the demo
drafter (it may not share that model's vocabulary): give ``--draft-model`` (or ``draft_model``) for
the ``draft`` and ``mix`` modes, which a scenario without a draft model refuses.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import splitspec
from splitspec.bench.modes import MODES
from splitspec.exceptions import ConfigError
from splitspec.models.dtype_choices import AUTO, DTYPE_CHOICES
from splitspec.paths import display_path
from splitspec.protocol.choices import WIRE_CODECS

__all__ = [
    "DEFAULT_CORPUS_DIR",
    "DEFAULT_MODEL_DIR",
    "PROMPT_SETS",
    "BaselineSpec",
    "PromptSpec",
    "Scenario",
    "load_scenario",
    "scenario_from_dict",
]

ASSETS_DIR = Path(splitspec.__file__).resolve().parent / "assets"
DEFAULT_MODEL_DIR = ASSETS_DIR / "models" / "base"  # the demo model that gets split
DEFAULT_DRAFT_DIR = ASSETS_DIR / "models" / "draft"  # the demo drafter (for the draft / mix / auto modes)
DRAFT_MODES = ("draft", "mix")  # modes that run a draft model (auto uses one only when there is one)
DEFAULT_CORPUS_DIR = ASSETS_DIR / "corpus" / "heldout"  # held-out documents: prose/*.txt, code/*.txt
PROMPT_SETS = ("code", "prose", "structured")


@dataclass(frozen=True)
class PromptSpec:
    """Which prompts to build from the held-out documents."""

    sets: tuple[str, ...] = PROMPT_SETS  # prompt sets, each one of PROMPT_SETS
    per_set: int = 2  # prompts per set, count
    prompt_tokens: int = 64  # tokens per prompt (BOS included when the tokenizer has one), tokens
    corpus_dir: Path = DEFAULT_CORPUS_DIR  # folder holding prose/*.txt and code/*.txt


@dataclass(frozen=True)
class BaselineSpec:
    """Local-only baselines run on the same model and prompts (independent of RTT)."""

    hf_generate: bool = True  # plain transformers greedy generate
    prompt_lookup: bool = True  # transformers prompt-lookup decoding (greedy)
    prompt_lookup_num_tokens: int = 10  # draft tokens per prompt-lookup step, tokens
    local_loop: bool = True  # a bare KV-cached greedy loop over the full model (no generate() overhead)


@dataclass(frozen=True)
class Scenario:
    """One benchmark: model and split, link RTTs, decoding modes, prompts, repeats."""

    name: str  # label; also the default output folder name
    model_dir: Path = DEFAULT_MODEL_DIR  # checkpoint directory (HF format with tokenizer)
    draft_model_dir: Path | None = None  # drafter for speculative modes; None = no draft model
    edge_layers: tuple[int, int] = (2, 2)  # decoder layers kept on the edge (head, tail)
    rtt_ms: tuple[float, ...] = (0.0, 5.0, 20.0, 80.0, 150.0)  # emulated round-trip times, ms
    modes: tuple[str, ...] = ("sequential",)  # split decoding modes (keys of bench.modes.MODES)
    repeats: int = 3  # passes over every (RTT, mode, prompt), count
    max_new_tokens: int = 48  # tokens generated per run, tokens
    dtype: str = "auto"  # compute dtype: auto (models.precision: per device) or a pinned one
    wire_codec: str = "raw"  # how hidden states cross the emulated link: raw, bf16 or int8 (protocol.codec)
    device: str = "auto"  # compute device of the trunk, the edge and the local baselines (splitspec.devices)
    pings: int = 10  # control round trips per emulated link for its measured RTT, count
    jitter_ms: float = 0.0  # emulated jitter per direction, ms
    bandwidth_mbit: float | None = None  # emulated link rate per direction, Mbit/s; None = unlimited
    torch_threads: int = 1  # torch intra-op threads for the run (1 = least noise on a shared CPU), count
    prompts: PromptSpec = PromptSpec()
    baselines: BaselineSpec = BaselineSpec()
    description: str = ""  # free text shown in the report

    def quick(self) -> Scenario:
        """A smoke-test version: one repeat, one prompt per set, at most 16 new tokens."""
        return replace(
            self,
            name=f"{self.name}_quick",
            repeats=1,
            max_new_tokens=min(self.max_new_tokens, 16),
            pings=min(self.pings, 4),
            prompts=replace(self.prompts, per_set=1),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "model_dir": display_path(self.model_dir),
            "draft_model": None if self.draft_model_dir is None else display_path(self.draft_model_dir),
            "edge_layers": list(self.edge_layers),
            "rtt_ms": list(self.rtt_ms),
            "modes": list(self.modes),
            "repeats": self.repeats,
            "max_new_tokens": self.max_new_tokens,
            "dtype": self.dtype,
            "wire_codec": self.wire_codec,
            "device": self.device,
            "pings": self.pings,
            "jitter_ms": self.jitter_ms,
            "bandwidth_mbit": self.bandwidth_mbit,
            "torch_threads": self.torch_threads,
            "prompts": {
                "sets": list(self.prompts.sets),
                "per_set": self.prompts.per_set,
                "prompt_tokens": self.prompts.prompt_tokens,
                "corpus_dir": display_path(self.prompts.corpus_dir),
            },
            "baselines": {
                "hf_generate": self.baselines.hf_generate,
                "prompt_lookup": self.baselines.prompt_lookup,
                "prompt_lookup_num_tokens": self.baselines.prompt_lookup_num_tokens,
                "local_loop": self.baselines.local_loop,
            },
        }


_TOP_KEYS = {
    "name",
    "description",
    "model",
    "draft_model",
    "edge_layers",
    "rtt_ms",
    "modes",
    "repeats",
    "max_new_tokens",
    "dtype",
    "wire_codec",
    "device",
    "pings",
    "jitter_ms",
    "bandwidth_mbit",
    "torch_threads",
    "prompts",
    "baselines",
}
_PROMPT_KEYS = {"sets", "per_set", "prompt_tokens", "corpus"}
_BASELINE_KEYS = {"hf_generate", "prompt_lookup", "prompt_lookup_num_tokens", "local_loop"}


class _Reader:
    """Typed access to one TOML table, raising ConfigError that names the file and key."""

    def __init__(self, data: dict[str, Any], where: str, allowed: set[str]) -> None:
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise ConfigError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(allowed)}")
        self.data = data
        self.where = where

    def _fail(self, key: str, expected: str) -> ConfigError:
        return ConfigError(f"{self.where}: '{key}' must be {expected}, got {self.data[key]!r}")

    def string(self, key: str, default: str | None = None) -> str:
        if key not in self.data:
            if default is None:
                raise ConfigError(f"{self.where}: missing required key '{key}'")
            return default
        value = self.data[key]
        if not isinstance(value, str) or not value.strip():
            raise self._fail(key, "a non-empty string")
        return value

    def integer(self, key: str, default: int, minimum: int) -> int:
        value = self.data.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self._fail(key, f"an integer >= {minimum}")
        return value

    def number(self, key: str, default: float, minimum: float = 0.0) -> float:
        value = self.data.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < minimum:
            raise self._fail(key, f"a finite number >= {minimum}")
        return float(value)

    def boolean(self, key: str, default: bool) -> bool:
        value = self.data.get(key, default)
        if not isinstance(value, bool):
            raise self._fail(key, "true or false")
        return value

    def str_list(self, key: str, default: tuple[str, ...], choices: tuple[str, ...] | None) -> tuple[str, ...]:
        value = self.data.get(key, list(default))
        if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
            raise self._fail(key, "a non-empty list of strings")
        if len(set(value)) != len(value):
            raise self._fail(key, "a list without duplicates")
        if choices is not None:
            bad = [v for v in value if v not in choices]
            if bad:
                raise ConfigError(f"{self.where}: '{key}' has unknown value(s) {bad}; choose from {list(choices)}")
        return tuple(value)

    def table(self, key: str) -> dict[str, Any]:
        value = self.data.get(key, {})
        if not isinstance(value, dict):
            raise self._fail(key, "a table")
        return value

    def path(self, key: str, default: Path, base_dir: Path) -> Path:
        if key not in self.data:
            return default
        path = Path(self.string(key)).expanduser()
        return path if path.is_absolute() else (base_dir / path).resolve()


def scenario_from_dict(
    data: dict[str, Any],
    *,
    base_dir: Path,
    where: str = "scenario",
    model_dir: Path | None = None,
    device: str | None = None,
    dtype: str | None = None,
    draft_model_dir: Path | None = None,
) -> Scenario:
    """Validate a parsed scenario table; relative paths resolve against ``base_dir``.

    ``model_dir``, ``device``, ``dtype`` and ``draft_model_dir``, when given, replace the scenario's
    (command-line overrides). A ``model_dir`` override drops the demo drafter (not a named ``draft_model``)."""

    top = _Reader(data, where, _TOP_KEYS)
    name = top.string("name")
    if not all(c.isalnum() or c in "-_." for c in name):
        raise ConfigError(f"{where}: 'name' may only hold letters, digits, '-', '_' and '.', got {name!r}")
    layers = data.get("edge_layers", [2, 2])
    if (
        not isinstance(layers, list)
        or len(layers) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in layers)
    ):
        raise ConfigError(f"{where}: 'edge_layers' must be two integers >= 1 like [2, 2], got {layers!r}")
    rtts = data.get("rtt_ms", [0, 5, 20, 80, 150])
    if (
        not isinstance(rtts, list)
        or not rtts
        or not all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0 for v in rtts)
    ):
        raise ConfigError(f"{where}: 'rtt_ms' must be a non-empty list of numbers >= 0 (ms), got {rtts!r}")
    if len(set(rtts)) != len(rtts):
        raise ConfigError(f"{where}: 'rtt_ms' holds duplicates: {rtts!r}")
    dtype = dtype if dtype is not None else top.string("dtype", AUTO)
    if dtype not in DTYPE_CHOICES:
        raise ConfigError(f"{where}: 'dtype' must be one of {list(DTYPE_CHOICES)}, got {dtype!r}")
    wire_codec = top.string("wire_codec", "raw")
    if wire_codec not in WIRE_CODECS:
        raise ConfigError(f"{where}: 'wire_codec' must be one of {list(WIRE_CODECS)}, got {wire_codec!r}")
    bandwidth = data.get("bandwidth_mbit")
    if bandwidth is not None:
        bandwidth = top.number("bandwidth_mbit", 0.0)
        if bandwidth <= 0:
            raise ConfigError(f"{where}: 'bandwidth_mbit' must be > 0 (or left out for unlimited)")

    prompts_table = top.table("prompts")
    pr = _Reader(prompts_table, f"{where} [prompts]", _PROMPT_KEYS)
    prompts = PromptSpec(
        sets=pr.str_list("sets", PROMPT_SETS, PROMPT_SETS),
        per_set=pr.integer("per_set", 2, 1),
        prompt_tokens=pr.integer("prompt_tokens", 64, 2),
        corpus_dir=pr.path("corpus", DEFAULT_CORPUS_DIR, base_dir),
    )
    bl = _Reader(top.table("baselines"), f"{where} [baselines]", _BASELINE_KEYS)
    baselines = BaselineSpec(
        hf_generate=bl.boolean("hf_generate", True),
        prompt_lookup=bl.boolean("prompt_lookup", True),
        prompt_lookup_num_tokens=bl.integer("prompt_lookup_num_tokens", 10, 1),
        local_loop=bl.boolean("local_loop", True),
    )
    scenario = Scenario(
        name=name,
        description=str(data.get("description", "")),
        model_dir=model_dir.resolve() if model_dir is not None else top.path("model", DEFAULT_MODEL_DIR, base_dir),
        draft_model_dir=(
            draft_model_dir.resolve()
            if draft_model_dir is not None
            else _draft_dir(top, base_dir, model_dir is None and "model" not in data)
        ),
        edge_layers=(int(layers[0]), int(layers[1])),
        rtt_ms=tuple(float(v) for v in rtts),
        modes=top.str_list("modes", ("sequential",), tuple(MODES)),
        repeats=top.integer("repeats", 3, 1),
        max_new_tokens=top.integer("max_new_tokens", 48, 1),
        dtype=dtype,
        wire_codec=wire_codec,
        device=device if device is not None else top.string("device", "auto"),
        pings=top.integer("pings", 10, 1),
        jitter_ms=top.number("jitter_ms", 0.0),
        bandwidth_mbit=bandwidth,
        torch_threads=top.integer("torch_threads", 1, 1),
        prompts=prompts,
        baselines=baselines,
    )
    needs_draft = [m for m in scenario.modes if m in DRAFT_MODES]
    if needs_draft and scenario.draft_model_dir is None:
        raise ConfigError(
            f"{where}: 'modes' {needs_draft} need a draft model, and there is none: set 'draft_model' "
            "(or give --draft-model; a --model override drops the demo drafter), or leave those modes out"
        )
    check_paths(scenario, where)
    return scenario


def check_paths(scenario: Scenario, where: str = "scenario") -> None:
    """Fail early, with the path in the message, when the model or the corpus is missing."""
    if not (scenario.model_dir / "config.json").is_file():
        hint = (
            " (the demo models are built by scripts/train_demo_models.py)"
            if scenario.model_dir == DEFAULT_MODEL_DIR
            else ""
        )
        raise ConfigError(f"{where}: no checkpoint at {scenario.model_dir} (config.json missing){hint}")
    draft = scenario.draft_model_dir
    if draft is not None and not (draft / "config.json").is_file():
        raise ConfigError(f"{where}: no draft model checkpoint at {draft} (config.json missing)")
    for folder in {"code" if s == "structured" else s for s in scenario.prompts.sets}:
        docs = scenario.prompts.corpus_dir / folder
        if not docs.is_dir() or not any(docs.glob("*.txt")):
            raise ConfigError(f"{where}: no held-out documents in {docs} (needed by the prompt sets)")


def _draft_dir(top: _Reader, base_dir: Path, default_model: bool) -> Path | None:
    """The scenario's draft model; the demo drafter goes with the demo model when none is named."""
    if "draft_model" in top.data:
        path: Path = top.path("draft_model", DEFAULT_DRAFT_DIR, base_dir)
        return path
    return DEFAULT_DRAFT_DIR if default_model and (DEFAULT_DRAFT_DIR / "config.json").is_file() else None


def load_scenario(
    path: Path,
    *,
    model_dir: Path | None = None,
    device: str | None = None,
    dtype: str | None = None,
    draft_model_dir: Path | None = None,
) -> Scenario:
    """Read and validate a scenario TOML file (``model_dir``, ``device``, ``dtype`` and ``draft_model_dir``
    override its own; see :func:`scenario_from_dict`)."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read scenario file {path}: {exc}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"scenario file {path} is not valid TOML: {exc}") from None
    return scenario_from_dict(
        data,
        base_dir=path.resolve().parent,
        where=f"scenario {path}",
        model_dir=model_dir,
        device=device,
        dtype=dtype,
        draft_model_dir=draft_model_dir,
    )
