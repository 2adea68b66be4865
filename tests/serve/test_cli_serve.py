"""``splitspec serve`` as a process, driven by the README's own curl and openai examples."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from splitspec.cli import main
from splitspec.demo import free_port
from tests.commands import start_command, still_running
from tests.serve.conftest import Stack
from tests.serve.test_tools_api import SCHEMA, WEATHER

README = Path(__file__).resolve().parents[2] / "README.md"
README_URL = "http://127.0.0.1:8000"


def readme_blocks() -> tuple[str, str, str]:
    """The serve section's curl command, its five-line openai example and its agent turn over the Responses API."""
    text = README.read_text()
    section = text[text.index("### The OpenAI API on the edge") :]
    bash = re.search(r"```bash\n(.*?)```", section, re.S)
    python = re.search(r"<!-- serve-example[^\n]*\n```python\n(.*?)```", section, re.S)
    assert bash
    assert python
    curl = bash.group(1)[bash.group(1).index("curl ") :].replace("\\\n", " ")
    assert len(python.group(1).strip().splitlines()) <= 5
    agent = re.search(r"<!-- serve-agent-example[^\n]*\n```python\n(.*?)```", section, re.S)
    assert agent
    return curl, python.group(1), agent.group(1)


@pytest.mark.slow
def test_serve_process_answers_the_readme_examples_and_forces_tool_calls(
    tool_stack: Stack, tool_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One process, the tool-calling checkpoint served with ``--tool-call-parser hermes``: the README's curl and
    openai examples, a forced tool call and a JSON-schema answer; SIGINT stops it with status 130."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    args = ["--log-level", "WARNING", "serve", "--model", str(tool_model),
            "--cloud", f"ws://127.0.0.1:{tool_stack.trunk_port}", "--served-model-name", "splitspec",
            "--port", str(port), "--allow-stock-edge-weights", "--threads", "1",
            "--tool-call-parser", "hermes"]  # fmt: skip
    pid = None
    with ThreadPoolExecutor(1) as runner:
        # a process of its own, forked from this test worker's fork server (tests/forkserver.py: the command's imports
        # are paid once per test worker); it is killed past the timeout
        run = start_command(runner, args, timeout=290)  # pytest-timeout: 300 s
        try:
            deadline = time.monotonic() + 120
            with httpx.Client() as http:  # one client: httpx.get builds a TLS context a call, ~80 ms of CPU each
                while still_running(run):
                    try:
                        health = http.get(f"{base}/health", timeout=1)
                        if health.status_code == 200:
                            pid = int(health.json()["pid"])
                            break
                    except httpx.TransportError:
                        pass
                    assert time.monotonic() < deadline, "splitspec serve did not come up"
                    time.sleep(0.2)
            assert pid != os.getpid()
            curl, example, agent = readme_blocks()
            if shutil.which("curl"):
                command = shlex.split(curl.replace(README_URL, base))
                out = subprocess.run(command, capture_output=True, text=True, timeout=60)
                reply = json.loads(out.stdout)
                assert reply["object"] == "chat.completion"
                assert reply["model"] == "splitspec"
                assert reply["usage"]["completion_tokens"] <= 32
            capsys.readouterr()
            names: dict[str, Any] = {}
            exec(compile(example.replace(README_URL, base), "README", "exec"), names)
            printed = capsys.readouterr().out
            # the example samples (temperature 1): the random model may end its turn at once, about 1 run in
            # 100, so the check is that it printed the reply it got, not that the reply has text
            example_reply = names["reply"]
            assert example_reply.choices[0].finish_reason in ("stop", "length")
            assert isinstance(example_reply.choices[0].message.content, str)
            assert printed == example_reply.choices[0].message.content + "\n", "the README example printed no reply"
            assert 1 <= example_reply.usage.completion_tokens <= 32
            exec(compile(agent, "README", "exec"), names)  # the client the example above made
            printed = capsys.readouterr().out
            call, answer = names["call"], names["answer"]
            assert call.name == "get_weather"
            assert json.loads(call.arguments)["city"] in ("Oslo", "Paris", "Lima")  # the forcing grammar's schema
            assert printed == f"{call.name} {call.arguments} {answer.output_text}\n"
            assert 1 <= answer.usage.output_tokens <= 32

            client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
            ask: list[Any] = [{"role": "user", "content": "to be"}]
            reply = client.chat.completions.create(model="splitspec", messages=ask, tools=[WEATHER],
                                                   tool_choice="required", max_tokens=60, temperature=0)  # fmt: skip
            calls = reply.choices[0].message.tool_calls or []
            assert [c.function.name for c in calls] == ["get_weather"]  # type: ignore[union-attr]
            jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])  # type: ignore[union-attr]
            fmt: Any = {"type": "json_schema", "json_schema": {"name": "v", "schema": SCHEMA}}
            answer = client.chat.completions.create(model="splitspec", messages=ask, response_format=fmt, max_tokens=60)
            jsonschema.validate(json.loads(answer.choices[0].message.content or ""), SCHEMA)
        finally:
            if pid is not None:  # else the run ends at its timeout
                os.kill(pid, signal.SIGINT)
        code = run.result().returncode
    assert code == 130  # uvicorn shut down cleanly, then main's KeyboardInterrupt exit status


def test_serve_cli_refuses_bad_options(tmp_path: Path, chat_model: Path) -> None:
    common = ["serve", "--model", str(chat_model), "--cloud", "ws://127.0.0.1:1", "--allow-stock-edge-weights"]
    assert main([*common, "--chat-template", str(tmp_path / "missing.jinja")]) == 2
    assert main([*common, "--max-active", "0"]) == 2
    with pytest.raises(SystemExit):
        main([*common, "--speculate", "sometimes"])
    with pytest.raises(SystemExit):
        main([*common, "--tool-call-parser", "mistral"])
