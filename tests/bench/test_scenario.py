"""Scenario files: defaults, relative paths, and a clear ConfigError for every mistake."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

import splitspec
from splitspec.bench.cli import SCENARIO_DIR, resolve_scenario
from splitspec.bench.modes import MODES
from splitspec.bench.prompts import build_prompts, literal_runs
from splitspec.bench.scenario import DEFAULT_CORPUS_DIR, Scenario, load_scenario
from splitspec.cli import main as bench_main
from splitspec.exceptions import ConfigError
from splitspec.paths import display_path

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "s.toml"
    path.write_text(body)
    return path


def test_minimal_scenario_and_relative_model(tmp_path: Path, make_checkpoint: Callable[..., Path]) -> None:
    model = make_checkpoint("llama")
    (tmp_path / "m").symlink_to(model)
    sc = load_scenario(write(tmp_path, 'name = "x"\nmodel = "m"\n'))
    assert sc.model_dir == (tmp_path / "m").resolve()
    assert sc.modes == ("sequential",)
    assert sc.rtt_ms == (0.0, 5.0, 20.0, 80.0, 150.0)
    assert sc.prompts.corpus_dir == DEFAULT_CORPUS_DIR
    assert sc.dtype == "auto"  # --dtype auto is every role's default: models.precision fits it to the device
    assert load_scenario(write(tmp_path, 'name = "x"\nmodel = "m"\ndtype = "bfloat16"\n')).dtype == "bfloat16"
    assert load_scenario(write(tmp_path, 'name = "x"\nmodel = "m"\n'), dtype="float16").dtype == "float16"
    quick = sc.quick()
    assert quick.repeats == 1
    assert quick.prompts.per_set == 1
    assert quick.max_new_tokens <= 16


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ('name = "x"\nmodel = "M"\nrtt = [1]\n', "unknown key"),
        ('model = "M"\n', "missing required key 'name'"),
        ('name = "x"\nmodel = "M"\nrtt_ms = []\n', "rtt_ms"),
        ('name = "x"\nmodel = "M"\nrtt_ms = [-5]\n', "rtt_ms"),
        ('name = "x"\nmodel = "M"\nmodes = ["lookahead9"]\n', "unknown value"),
        ('name = "x"\nmodel = "M"\nrepeats = 0\n', "repeats"),
        ('name = "x"\nmodel = "M"\nedge_layers = [2]\n', "edge_layers"),
        ('name = "x"\nmodel = "M"\n[prompts]\nsets = ["poetry"]\n', "unknown value"),
        ('name = "x"\nmodel = "M"\n[baselines]\nhf_generate = "yes"\n', "true or false"),
        ('name = "x"\nmodel = "M"\nmax_new_tokens = 1.5\n', "max_new_tokens"),
        ('name = "a/b"\nmodel = "M"\n', "'name' may only"),
        ('name = "x"\nmodel = "/nonexistent/model"\n', "no checkpoint"),
        ('name = "x"\nmodel = "M"\ndtype = "float64"\n', "'dtype' must be one of"),
        ("name = [\n", "not valid TOML"),
    ],
)
def test_bad_scenarios(tmp_path: Path, make_checkpoint: Callable[..., Path], body: str, message: str) -> None:
    body = body.replace('"M"', f'"{make_checkpoint("llama")}"')
    with pytest.raises(ConfigError, match=message):
        load_scenario(write(tmp_path, body))


def test_missing_file() -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_scenario(Path("/nonexistent/s.toml"))


def test_repo_scenarios_parse() -> None:
    """Every shipped scenario loads against the embedded models and names only registered modes."""
    paths = sorted(SCENARIO_DIR.glob("*.toml"))
    assert {p.stem for p in paths} >= {"default", "speculative"}
    names = set()
    for path in paths:
        sc = load_scenario(path)
        assert set(sc.modes) <= set(MODES)
        assert (sc.model_dir / "config.json").is_file()
        names.add(sc.name)
    assert len(names) == len(paths)  # each writes its own results folder


def test_shipped_scenarios_are_found_by_name_outside_the_repository(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # nothing of the repository around
    assert resolve_scenario("default") == SCENARIO_DIR / "default.toml"
    assert SCENARIO_DIR.is_relative_to(Path(splitspec.__file__).parent)  # inside the package: installed with it
    with pytest.raises(ConfigError, match=r"no shipped scenario named 'nope' \(shipped: default, speculative\)"):
        resolve_scenario("nope")


class CharTokenizer:
    """One token per character: enough to check the windowing."""

    bos_token_id = 0

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, token_ids: list[int]) -> str:
        return "".join(chr(t) for t in token_ids)


def test_prompts_are_fixed_length_windows(tmp_path: Path) -> None:
    (tmp_path / "prose").mkdir()
    (tmp_path / "code").mkdir()
    for i in range(3):
        (tmp_path / "prose" / f"p{i}.txt").write_text(f"Title {i}\n" + "a line of verse\n" * 20)
        (tmp_path / "code" / f"c{i}.txt").write_text(
            "import os\n\nTABLE = {\n" + "".join(f"    'k{j}': {j},\n" for j in range(6)) + "}\n" + "x = 1\n" * 20
        )
    (tmp_path / "code" / "zz_plain.txt").write_text("def f():\n    return 1\n" * 10)
    prompts = build_prompts(CharTokenizer(), tmp_path, ("prose", "code", "structured"), 2, 20)
    assert [p.prompt_id for p in prompts] == ["prose0", "prose1", "code0", "code1", "structured0", "structured1"]
    assert all(len(p.token_ids) == 20 and p.token_ids[0] == 0 for p in prompts)
    structured = CharTokenizer().decode(list(prompts[4].token_ids[1:]))
    assert structured.endswith(",\n")
    assert "'k" in structured
    assert prompts[4].source != "zz_plain.txt"
    with pytest.raises(ConfigError, match="only"):
        build_prompts(CharTokenizer(), tmp_path, ("prose",), 5, 20)


def test_literal_runs() -> None:
    text = "x = [\n  1,\n  2,\n  3,\n]\ny = (\n 'a',\n)\n"
    assert literal_runs(text) == [(1, 3)]


def test_draft_modes_need_a_draft_model(tmp_path: Path, make_checkpoint: Callable[..., Path]) -> None:
    """``bench speculative --model DIR`` drops the demo drafter: its draft and mix modes are refused up front."""
    model = make_checkpoint("llama")
    with pytest.raises(ConfigError, match=r"'modes' \['draft', 'mix'\] need a draft model.*'draft_model'"):
        load_scenario(resolve_scenario("speculative"), model_dir=model)
    with pytest.raises(ConfigError, match="'draft_model'"):
        load_scenario(write(tmp_path, f'name = "x"\nmodel = "{model}"\nmodes = ["mix"]\n'))
    auto = load_scenario(write(tmp_path, f'name = "x"\nmodel = "{model}"\nmodes = ["auto"]\n'))  # drafts without one
    assert auto.draft_model_dir is None
    assert auto.to_json()["draft_model"] is None

    given = load_scenario(resolve_scenario("speculative"), model_dir=model, draft_model_dir=model)  # --draft-model
    assert given.draft_model_dir == model.resolve()
    assert given.to_json()["draft_model"] == display_path(model.resolve())
    named = load_scenario(
        write(tmp_path, f'name = "x"\nmodel = "{model}"\ndraft_model = "{model}"\nmodes = ["draft"]\n')
    )
    assert named.to_json()["draft_model"] == display_path(model)
    with pytest.raises(ConfigError, match="no draft model checkpoint"):
        load_scenario(write(tmp_path, f'name = "x"\nmodel = "{model}"\ndraft_model = "{tmp_path}"\n'))


def test_bench_draft_model_flag(
    tmp_path: Path,
    make_checkpoint: Callable[..., Path],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``splitspec bench speculative --model DIR`` without --draft-model stops before any run (exit status 2)."""
    from splitspec.bench import harness

    started: list[Scenario] = []

    def run_benchmark(scenario: Scenario, *args: object, **kwargs: object) -> dict[str, object]:
        started.append(scenario)
        return {}

    monkeypatch.setattr(harness, "run_benchmark", run_benchmark)
    model = str(make_checkpoint("llama"))
    out = tmp_path / "o"
    assert bench_main(["bench", "speculative", "--model", model, "--out", str(out)]) == 2
    assert not started  # refused when the scenario is read, not in the middle of its runs
    assert "'draft_model'" in caplog.text
    assert bench_main(["bench", "speculative", "--model", model, "--draft-model", model, "--out", str(out)]) == 0
    assert started[0].draft_model_dir == Path(model).resolve()
