"""guidellm, the load tester vLLM's docs recommend, against ``splitspec serve``: zero errored requests.

Processes on loopback: a trunk server and ``splitspec serve`` on the demo models (``--speculate
auto``), optionally through the WAN emulator. guidellm (``guidellm run``, the ``openai_http``
backend) then sends a short concurrent run of synthetic prompts with both ``request_format``s
(``/v1/completions`` and ``/v1/chat/completions``); guidellm streams with
``stream_options.continuous_usage_stats``, which the server honours. The script reads guidellm's
JSON report and fails unless every request succeeded.

guidellm pins its own click and datasets, so install it where it cannot disturb splitspec's
environment, e.g. ``pip install --target /tmp/guidellm guidellm==0.8.1`` and pass
``--guidellm-path /tmp/guidellm`` (prepended to PYTHONPATH for guidellm's process only).

    python benchmarks/guidellm_run.py [--guidellm-path DIR] [--streams 4] [--requests 16] [--rtt-ms 0]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from splitspec.demo import _spawn, _stop, _wait_for_port, embedded_model, free_port

CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}QUESTION.\n{{ m['content'] }}\n"
    "{% else %}{{ m['content'] }}\n{% endif %}{% endfor %}{% if add_generation_prompt %}ANSWER.\n{% endif %}"
)


REPO = Path(__file__).resolve().parents[1]


def guidellm(args: argparse.Namespace, target: str, request_format: str, out: Path) -> dict[str, Any]:
    env = dict(os.environ)
    if args.guidellm_path:
        env["PYTHONPATH"] = os.pathsep.join([str(args.guidellm_path), env.get("PYTHONPATH", "")])
    model = os.path.relpath(embedded_model("base"), REPO)  # run from the repository: the report names no machine path
    command = [
        sys.executable, "-m", "guidellm", "run",
        "--backend", f"kind=openai_http,target={target},model=demo,request_format={request_format}",
        "--profile", f"kind=concurrent,streams={args.streams}",
        "--constraint", f"kind=max_requests,count={args.requests}",
        "--tokenizer", f"kind=huggingface_auto,model={model}",
        "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
        "--output", f"kind=json,path={out}",
        "--disable-console-interactive",
    ]  # fmt: skip
    subprocess.run(command, env=env, check=True, timeout=args.timeout, cwd=REPO)
    report: dict[str, Any] = json.loads(out.read_text())
    return report


def totals(report: dict[str, Any]) -> dict[str, float]:
    """Successful, errored and incomplete requests over the report's benchmarks, and guidellm's own
    figures of the (single) benchmark: output tokens, output tok/s (mean), median TTFT."""
    counts: dict[str, float] = {"successful": 0, "errored": 0, "incomplete": 0}
    for bench in report["benchmarks"]:
        for key in ("successful", "errored", "incomplete"):
            counts[key] += len(bench["requests"].get(key, []) or [])
    metrics = report["benchmarks"][0]["metrics"]
    counts["output_tokens"] = metrics["output_token_count"]["successful"]["total_sum"]
    counts["output_tok_s_mean"] = metrics["output_tokens_per_second"]["successful"]["mean"]
    counts["ttft_ms_median"] = metrics["time_to_first_token_ms"]["successful"]["median"]
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--guidellm-path", type=Path, help="directory holding guidellm (pip install --target)")
    parser.add_argument("--streams", type=int, default=4, help="concurrent streams")
    parser.add_argument("--requests", type=int, default=16, help="requests per request format")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=24)
    parser.add_argument("--rtt-ms", type=float, default=0.0, help="WAN emulator RTT (0: no emulator)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per guidellm run")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/guidellm"))
    args = parser.parse_args()
    base = embedded_model("base")
    trunk_port, port = free_port(), free_port()
    procs = [_spawn(["cloud", "serve", "--model", str(base), "--port", str(trunk_port), "--threads", "1"])]
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        template = Path(tmp) / "chat.jinja"
        template.write_text(CHAT_TEMPLATE)
        try:
            _wait_for_port(trunk_port, procs[0], 120)
            link = trunk_port
            if args.rtt_ms > 0:
                link = free_port()
                procs.append(_spawn(["netem", "--listen", f"127.0.0.1:{link}", "--upstream",
                                     f"127.0.0.1:{trunk_port}", "--rtt-ms", str(args.rtt_ms)]))  # fmt: skip
                _wait_for_port(link, procs[-1], 60)
            procs.append(_spawn(["serve", "--model", str(base), "--draft-model", str(embedded_model("draft")),
                                 "--cloud", f"ws://127.0.0.1:{link}", "--served-model-name", "demo", "--port",
                                 str(port), "--chat-template", str(template), "--threads", "1",
                                 "--allow-stock-edge-weights"]))  # fmt: skip
            _wait_for_port(port, procs[-1], 120)
            args.out.mkdir(parents=True, exist_ok=True)
            for fmt in ("/v1/completions", "/v1/chat/completions"):
                name = fmt.strip("/").replace("/", "_")
                report = guidellm(args, f"http://127.0.0.1:{port}", fmt, args.out / f"{name}.json")
                results[fmt] = totals(report)
                print(f"{fmt}: {results[fmt]}", file=sys.stderr)
        finally:
            _stop(procs)
    summary = {"streams": args.streams, "requests": args.requests, "rtt_ms": args.rtt_ms, "results": results}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    failed = any(r["errored"] or r["incomplete"] or r["successful"] < args.requests for r in results.values())
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
