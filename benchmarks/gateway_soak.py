"""Gateway soak with faults: ``splitspec serve`` under steady load while the trunk dies and the link drops.

Processes on loopback: ``splitspec cloud serve`` (demo base model, float32) on a fixed port, the
WAN emulator in front of it, and ``splitspec serve`` (the edge engine, ``--speculate auto`` with
the draft model) behind it. ``--streams`` clients each send completions back to back (greedy,
prompts from the held-out documents) for ``--seconds``. Meanwhile the trunk server is SIGKILLed
and restarted on the same port ``--kills`` times, and the emulator is SIGKILLed and restarted after
``--cut-s`` seconds ``--cuts`` times (the link is down meanwhile).

Checks (exit status 1 when one fails, with the reason):

* every request either completes with exactly the text of a fault-free run of the same prompt
  (taken before the faults start), or gets a typed HTTP error (503 or 429 with OpenAI's error
  JSON); none hangs past ``--request-timeout-s``;
* the gateway recovers: after each recovery event (the trunk restarted, the link back) some request
  completes ok within ``--recovery-s`` (and before the next fault), and typed errors are at most
  ``MAX_TYPED_SHARE`` (a quarter) of all requests: a gateway that answered 503 from the first fault
  on would otherwise pass on typed errors alone;
* the gateway's resident memory and open file descriptors stay flat: after the warm-up (the
  first fifth of the run) they stay within 10 % of the highest value the warm-up reached. The
  fault-free reference run, at the soak's full concurrency, warms the gateway up first.

Writes ``gateway_soak.json``, ``gateway_soak.md`` and ``gateway_soak.log`` (one line per event).

    python benchmarks/gateway_soak.py [--seconds 600 --kills 2 --cuts 1] [--out benchmarks/results/gateway_soak]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from transformers import AutoTokenizer

from splitspec.demo import ASSETS, _stop, _wait_for_port, embedded_model, free_port
from splitspec.run_info import resident_bytes, run_environment

MAX_GROWTH = 0.10  # RSS and open descriptors may grow at most this much after the warm-up
MAX_TYPED_SHARE = 0.25  # typed 503/429 answers may be at most this share of all requests
RECOVERY_S = 30.0  # after a recovery event some request must complete ok within this many seconds (--recovery-s)


def spawn(args: list[str]) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "splitspec.cli", "--log-level", "WARNING", *args]
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL)


def prompts(count: int, tokens: int) -> list[str]:
    tokenizer = AutoTokenizer.from_pretrained(embedded_model("base"), local_files_only=True)
    ids: list[int] = []
    for doc in sorted((ASSETS / "corpus" / "heldout").glob("*/*.txt")):
        ids += tokenizer(doc.read_text(encoding="utf-8"))["input_ids"]
        if len(ids) >= count * tokens:
            break
    return [str(tokenizer.decode(ids[i * tokens : (i + 1) * tokens], skip_special_tokens=True)) for i in range(count)]


def process_footprint(pid: int) -> tuple[int, int]:
    """(resident bytes, open file descriptors) of process ``pid``."""
    return resident_bytes(pid), len(os.listdir(f"/proc/{pid}/fd"))


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.base, self.draft = embedded_model("base"), embedded_model("draft")
        self.trunk_port, self.link_port, self.serve_port = free_port(), free_port(), free_port()
        self.events: list[str] = []
        self.timeline: list[tuple[str, float]] = []  # ("fault" | "recovered", seconds since the load started)
        self.t0 = time.monotonic()
        self.trunk: subprocess.Popen[bytes] | None = None
        self.netem: subprocess.Popen[bytes] | None = None
        self.serve: subprocess.Popen[bytes] | None = None

    def mark(self, kind: str) -> None:
        """A fault (``fault``) or the end of one (``recovered``), at seconds since the load started."""
        self.timeline.append((kind, time.monotonic() - self.started))

    def log(self, text: str) -> None:
        line = f"{time.monotonic() - self.t0:8.2f} s  {text}"
        self.events.append(line)
        print(line, file=sys.stderr, flush=True)

    def start_trunk(self) -> None:
        self.trunk = spawn(["cloud", "serve", "--model", str(self.base), "--port", str(self.trunk_port),
                            "--dtype", "float32", "--threads", "1"])  # fmt: skip
        _wait_for_port(self.trunk_port, self.trunk, 120)

    def start_netem(self) -> None:
        self.netem = spawn(["netem", "--listen", f"127.0.0.1:{self.link_port}", "--upstream",
                            f"127.0.0.1:{self.trunk_port}", "--rtt-ms", str(self.args.rtt_ms)])  # fmt: skip
        _wait_for_port(self.link_port, self.netem, 60)

    def start(self) -> None:
        self.start_trunk()
        self.start_netem()
        self.serve = spawn([
            "serve", "--model", str(self.base), "--draft-model", str(self.draft), "--cloud",
            f"ws://127.0.0.1:{self.link_port}", "--served-model-name", "demo", "--port", str(self.serve_port),
            "--dtype", "float32", "--threads", "1", "--max-active", str(2 * self.args.streams),
            "--allow-stock-edge-weights",
        ])  # fmt: skip
        _wait_for_port(self.serve_port, self.serve, 180)

    def stop(self) -> None:
        _stop([p for p in (self.serve, self.netem, self.trunk) if p is not None])

    async def faults(self) -> None:
        """SIGKILL the trunk (restarted at once) and cut the link (restarted after cut_s), spread over the run."""
        args = self.args
        plan = [("kill", k) for k in range(args.kills)] + [("cut", c) for c in range(args.cuts)]
        random.Random(0).shuffle(plan)
        for i, (kind, _) in enumerate(plan):
            at = args.seconds * (i + 1) / (len(plan) + 1)
            await asyncio.sleep(max(0.0, at - (time.monotonic() - self.started)))
            if kind == "kill":
                assert self.trunk is not None
                self.mark("fault")
                self.trunk.send_signal(signal.SIGKILL)
                self.trunk.wait()
                self.log("trunk SIGKILLed")
                await asyncio.to_thread(self.start_trunk)
                self.mark("recovered")
                self.log("trunk restarted")
            else:
                assert self.netem is not None
                self.mark("fault")
                self.netem.send_signal(signal.SIGKILL)
                self.netem.wait()
                self.log(f"link cut for {args.cut_s:g} s")
                await asyncio.sleep(args.cut_s)
                await asyncio.to_thread(self.start_netem)
                self.mark("recovered")
                self.log("link back")

    async def request(self, http: httpx.AsyncClient, prompt: str) -> tuple[str, str | None]:
        """(outcome, text): "ok", "typed-503", "typed-429", or what went wrong."""
        body = {"model": "demo", "prompt": prompt, "max_tokens": self.args.max_tokens, "temperature": 0}
        try:
            r = await http.post(f"http://127.0.0.1:{self.serve_port}/v1/completions", json=body,
                                timeout=self.args.request_timeout_s)  # fmt: skip
        except httpx.TimeoutException:
            return "hung past its timeout", None
        except httpx.HTTPError as exc:
            return f"transport error {type(exc).__name__}", None
        if r.status_code == 200:
            return "ok", str(r.json()["choices"][0]["text"])
        try:
            typed = isinstance(r.json()["error"]["message"], str)
        except (ValueError, KeyError, TypeError):
            typed = False
        return (f"typed-{r.status_code}" if typed and r.status_code in (429, 503) else f"HTTP {r.status_code}"), None

    async def client(
        self, http: httpx.AsyncClient, index: int, texts: list[str], reference: list[str]
    ) -> list[tuple[str, float]]:
        """This stream's requests: (outcome, seconds since the load started when it ended)."""
        outcomes = []
        i = index
        while time.monotonic() - self.started < self.args.seconds:
            outcome, text = await self.request(http, texts[i % len(texts)])
            if outcome == "ok" and text != reference[i % len(texts)]:
                outcome = "completed with other text"
                self.log(f"stream {index}: prompt {i % len(texts)} came back different")
            elif outcome != "ok":
                self.log(f"stream {index}: {outcome}")
                if outcome.startswith("typed"):
                    await asyncio.sleep(0.5)  # as a client honouring the error would
            outcomes.append((outcome, time.monotonic() - self.started))
            i += self.args.streams
        return outcomes

    async def sample(self, samples: list[dict[str, float]]) -> None:
        assert self.serve is not None
        while time.monotonic() - self.started < self.args.seconds:
            rss, fds = process_footprint(self.serve.pid)
            samples.append({"t": time.monotonic() - self.started, "rss": rss, "fds": fds})
            await asyncio.sleep(self.args.seconds / 60)

    async def run(self) -> dict[str, Any]:
        texts = prompts(2 * self.args.streams, 64)
        async with httpx.AsyncClient() as http:
            # fault-free greedy texts at the soak's concurrency, which also warms the gateway up on the
            # batch shapes the load makes (the engine makes concurrency change no output)
            reference = []
            for start in range(0, len(texts), self.args.streams):
                batch = texts[start : start + self.args.streams]
                for outcome, out in await asyncio.gather(*(self.request(http, t) for t in batch)):
                    if outcome != "ok" or out is None:
                        raise SystemExit(f"the fault-free reference run failed: {outcome}")
                    reference.append(out)
            self.log(f"reference texts of {len(texts)} prompts taken")
            self.started = time.monotonic()
            samples: list[dict[str, float]] = []
            results = await asyncio.gather(
                *(self.client(http, i, texts, reference) for i in range(self.args.streams)),
                self.faults(),
                self.sample(samples),
            )
        per_stream = results[: self.args.streams]
        ended = sorted((o for mine in per_stream for o in mine), key=lambda o: o[1])  # type: ignore[union-attr]
        return {
            "outcomes": [o for o, _ in ended],
            "ended": [t for _, t in ended],  # each outcome's request ended then (s since the load started)
            "timeline": [[kind, t] for kind, t in self.timeline],
            "samples": samples,
        }


def recoveries(raw: dict[str, Any], within_s: float) -> list[str]:
    """Each recovery event (the trunk restarted, the link back) after which no request completed ok within
    ``within_s`` seconds, nor before the next fault: a failure line each. Empty for runs without a timeline."""
    timeline = raw.get("timeline", [])
    oks = [t for o, t in zip(raw["outcomes"], raw.get("ended", []), strict=False) if o == "ok"]
    failures = []
    for i, (kind, at) in enumerate(timeline):
        if kind != "recovered":
            continue
        later = [t for k, t in timeline[i + 1 :] if k == "fault"]
        until = min([at + within_s, *later])
        if not any(at < t <= until for t in oks):
            failures.append(f"no request completed ok within {until - at:.1f} s of the recovery at {at:.1f} s")
    return failures


def judge(raw: dict[str, Any], recovery_s: float = RECOVERY_S) -> dict[str, Any]:
    outcomes: list[str] = raw["outcomes"]
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o] = counts.get(o, 0) + 1
    bad = {o: n for o, n in counts.items() if o != "ok" and not o.startswith("typed-")}
    typed = sum(n for o, n in counts.items() if o.startswith("typed-"))
    samples = raw["samples"]
    # a leak grows past the high-water mark the warm-up reached; one low sample (descriptors while
    # the trunk reconnects) is not a baseline
    end_of_warmup = samples[-1]["t"] / 5 if samples else 0.0
    warmup = [s for s in samples if s["t"] <= end_of_warmup]
    after = [s for s in samples if s["t"] > end_of_warmup]
    growth = {}
    for key in ("rss", "fds"):
        if warmup and after:
            growth[key] = max(s[key] for s in after) / max(s[key] for s in warmup) - 1
    failures = [f"{n} request(s): {o}" for o, n in bad.items()]
    if not counts.get("ok"):
        failures.append("no request completed ok")
    if typed > MAX_TYPED_SHARE * len(outcomes):
        failures.append(
            f"typed errors were {typed / len(outcomes):.0%} of the requests (at most {MAX_TYPED_SHARE:.0%})"
        )
    failures += recoveries(raw, recovery_s)
    failures += [f"gateway {k} grew {g:.0%} after warm-up" for k, g in growth.items() if g > MAX_GROWTH]
    return {
        "counts": counts,
        "typed_share": typed / max(1, len(outcomes)),
        "recovery_s": recovery_s,
        "growth_after_warmup": growth,
        "failures": failures,
        "passed": not failures,
    }


def markdown(results: dict[str, Any]) -> str:
    v = results["verdict"]
    lines = [
        "# Gateway soak with faults",
        "",
        f"Commit `{results['commit'][:12]}`; {results['seconds']} s at {results['streams']} streams, "
        f"{results['kills']} trunk SIGKILL(s), {results['cuts']} link cut(s) of {results['cut_s']} s, "
        f"{results['rtt_ms']:g} ms RTT, {results['max_tokens']} tokens per request. "
        f"Reproduce: `{results['command']}`.",
        "",
        "| outcome | requests |",
        "|---|---:|",
        *(f"| {o} | {n} |" for o, n in sorted(v["counts"].items())),
        "",
        f"Typed errors (503/429): {v.get('typed_share', 0.0):.1%} of the requests (at most "
        f"{MAX_TYPED_SHARE:.0%}). After each recovery event (trunk restarted, link back) a request must complete ok "
        f"within {v.get('recovery_s', RECOVERY_S):g} s, and before the next fault.",
        "",
        "| after warm-up | growth |",
        "|---|---:|",
        *(f"| {k} | {g:+.1%} |" for k, g in v["growth_after_warmup"].items()),
        "",
        "Passed." if v["passed"] else "FAILED: " + "; ".join(v["failures"]),
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--seconds", type=float, default=600.0, help="length of the load, seconds")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--kills", type=int, default=2, help="times the trunk server is SIGKILLed and restarted")
    parser.add_argument("--cuts", type=int, default=1, help="times the link is cut")
    parser.add_argument("--cut-s", type=float, default=5.0, help="how long a cut lasts, seconds")
    parser.add_argument("--rtt-ms", type=float, default=80.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--request-timeout-s", type=float, default=120.0)
    parser.add_argument(
        "--recovery-s", type=float, default=RECOVERY_S, help="a request must complete ok this soon after a recovery"
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "gateway_soak")
    args = parser.parse_args()
    soak = Soak(args)
    soak.start()
    try:
        raw = asyncio.run(soak.run())
    finally:
        soak.stop()
    results: dict[str, Any] = {
        **run_environment(), **{k: v for k, v in vars(args).items() if k != "out"},
        "command": "python benchmarks/gateway_soak.py " + shlex.join(sys.argv[1:]), "raw": raw,
        "verdict": judge(raw, args.recovery_s),
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gateway_soak.json").write_text(json.dumps(results, indent=1))
    (args.out / "gateway_soak.md").write_text(markdown(results))
    (args.out / "gateway_soak.log").write_text("\n".join(soak.events) + "\n")
    print(markdown(results))
    if not results["verdict"]["passed"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
