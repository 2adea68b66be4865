"""The command line's shape, parsed in-process (no subprocess): options every command shares, help text."""

from __future__ import annotations

import argparse
import inspect
import re
from collections.abc import Iterator

import pytest

from splitspec import __version__
from splitspec.cli import build_parser, main

# reStructuredText that help must not show raw: ``literal``, :role:`target`, "::" literal blocks, directives
RST = re.compile(r"``|:[a-z]+:`|::\s*$|^\.\. ", re.MULTILINE)
# options that reach a trunk or worker over the network, and the commands that must take them
CONNECTING = ("generate", "chat", "serve", "probe", "fed generate")


def commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every (sub)command parser, with the words that reach it."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from commands(child, (*path, name))


def leaves() -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    return [
        (path, p)
        for path, p in commands(build_parser())
        if path and not any(isinstance(a, argparse._SubParsersAction) for a in p._actions)
    ]


def test_help_has_no_raw_restructured_text() -> None:
    for path, parser in commands(build_parser()):
        text = parser.format_help()
        assert not RST.search(text), f"splitspec {' '.join(path)} --help: {RST.search(text)!r}\n{text}"


def test_logging_options_are_accepted_after_every_subcommand() -> None:
    for path, parser in leaves():
        options = {o for a in parser._actions for o in a.option_strings}
        assert {"--log-level", "-v", "-q"} <= options, f"splitspec {' '.join(path)}"
    base = ["generate", "--model", "m", "--cloud", "ws://h:1", "--prompt", "p"]
    parse = build_parser().parse_args
    assert parse([*base, "-q"]).log_level == "WARNING"
    assert parse([*base, "-v"]).log_level == "DEBUG"
    assert parse([*base, "--log-level", "ERROR"]).log_level == "ERROR"
    assert parse(["--log-level", "ERROR", *base]).log_level == "ERROR"  # before the subcommand still works
    assert parse(["-q", "cloud", "serve", "--model", "m"]).log_level == "WARNING"
    assert not hasattr(parse(base), "log_level")  # main() supplies INFO
    with pytest.raises(SystemExit):
        parse([*base, "-q", "-v"])  # one level at a time


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"splitspec {__version__}"


def test_threads_and_tls_ca_are_spelled_the_same_everywhere() -> None:
    options = {" ".join(path): {o for a in p._actions for o in a.option_strings} for path, p in leaves()}
    spelled = {o for opts in options.values() for o in opts if "thread" in o}
    assert spelled == {"--threads"}
    for command in CONNECTING:
        assert "--tls-ca" in options[command], command


def test_the_python_api_speculates_like_the_cli_by_default() -> None:
    from splitspec.edge import SplitClient

    args = build_parser().parse_args(["generate", "--model", "m", "--cloud", "ws://h:1", "--prompt", "p"])
    for method in (SplitClient.generate, SplitClient.stream):
        assert inspect.signature(method).parameters["speculate"].default == args.speculate == "auto"


def test_quantize_is_offered_to_the_trunk_and_every_edge_role() -> None:
    options = {" ".join(path): p for path, p in leaves()}
    for command in ("cloud serve", "generate", "chat", "serve"):
        action = next(a for a in options[command]._actions if "--quantize" in a.option_strings)
        assert tuple(action.choices or ()) == ("nf4", "int8"), command
    args = build_parser().parse_args(["cloud", "serve", "--model", "m", "--quantize", "nf4"])
    assert args.quantize == "nf4"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["cloud", "serve", "--model", "m", "--quantize", "gptq"])


# the commands that load model weights; each computes in --dtype auto unless told otherwise
DTYPE_ROLES = ("cloud serve", "generate", "chat", "serve", "demo", "probe", "fed worker", "fed generate")


def test_every_role_that_loads_weights_takes_dtype_auto_by_default() -> None:
    by_path = {" ".join(path): p for path, p in leaves()}
    for role in (*DTYPE_ROLES, "bench"):
        action = next((a for a in by_path[role]._actions if "--dtype" in a.option_strings), None)
        assert action is not None, f"splitspec {role} has no --dtype"
        assert action.choices == ("auto", "float32", "bfloat16", "float16"), role
        assert action.default == ("auto" if role != "bench" else None), role  # bench: the scenario's, else auto
