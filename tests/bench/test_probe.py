"""The probe on a real trunk server over loopback, directly and through the WAN emulator."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from splitspec.bench import probe as probe_module
from splitspec.bench.probe import ProbeConfig, ProbeReport, build_report, format_report, probe
from splitspec.cli import build_parser
from splitspec.cli import main as bench_main
from splitspec.cloud.config import CloudConfig
from splitspec.cloud.server import TrunkServer
from splitspec.edge.client import StepStats
from splitspec.exceptions import ConfigError
from splitspec.netem.emulator import WanEmulator
from splitspec.netem.schedule import NetemConfig
from tests.e2e.test_trunk_fingerprint import edge_only_copy

KS = (1, 2, 4, 8, 16)


def check_sane(report: ProbeReport) -> None:
    assert report.rtt_ms > 0
    assert [s.query_tokens for s in report.steps] == list(KS)
    for s in report.steps:
        assert s.n == 5
        assert s.step_ms > 0
        assert s.edge_ms > 0
        assert s.cloud_ms > 0
        assert s.serialize_ms > 0
        assert s.overhead_ms > 0  # the step costs more than a bare round trip
    # Payloads grow strictly with k (deterministic); compute roughly does too on a shared machine.
    ups = [s.bytes_up for s in report.steps]
    downs = [s.bytes_down for s in report.steps]
    assert ups == sorted(ups)
    assert len(set(ups)) == len(ups)
    assert downs == sorted(downs)
    assert len(set(downs)) == len(downs)
    f1, f16 = report.overhead_ms(1), report.overhead_ms(16)
    assert f16 > 0.5 * f1, "f(k) should not fall with k beyond noise"
    assert report.break_even_measured[1] == pytest.approx(1.0)
    # Break-even falls as RTT grows (same f(k)), and projected tok/s falls with RTT.
    rows = report.projection
    assert [r.rtt_ms for r in rows] == [5.0, 20.0, 40.0, 80.0, 150.0]
    assert all(a.tok_s > b.tok_s for a, b in itertools.pairwise(rows))
    for k in KS[1:]:
        if report.overhead_ms(k) > report.overhead_ms(1):
            assert rows[0].break_even[k] > rows[-1].break_even[k] > 1.0
    assert all(r.usd_per_million_tokens is not None and r.usd_per_million_tokens > 0 for r in rows)


async def test_probe_loopback_and_emulated_rtt(make_checkpoint: Callable[..., Path]) -> None:
    model = make_checkpoint("llama")
    async with TrunkServer(CloudConfig(model_dir=model, port=0)) as server:
        config = ProbeConfig(cloud_url=server.url, model_dir=model, repeats=5, warmup=1, pings=5, dollars_per_hour=1.35)
        direct = await probe(config)
        async with WanEmulator(NetemConfig(upstream_port=server.port, rtt_ms=40.0)) as emu:
            url = f"ws://127.0.0.1:{emu.port}"
            emulated = await probe(ProbeConfig(**{**config.__dict__, "cloud_url": url}))
    check_sane(direct)
    check_sane(emulated)
    assert direct.rtt_ms < 5.0
    # The emulator is never early and ~1 ms late; the control round trips carry no compute.
    assert 39.5 <= emulated.rtt_ms <= 48.0
    # RTT and fixed overhead stay separate: the emulated link's step network time is RTT + transfer.
    one = emulated.steps[0]
    assert one.network_ms == pytest.approx(emulated.rtt_ms + one.transfer_ms)
    assert one.step_ms > 40.0
    text = format_report(emulated)
    assert "a*(16)" in text
    assert "$/Mtok" in text
    json.dumps(emulated.to_json())


def test_build_report_is_pure_arithmetic() -> None:
    """f(k) = step − RTT and a*(k) from hand-made timings."""
    steps = [
        StepStats(
            "decode",
            k,
            network_ms=10.0 + 0.1 * k,
            edge_ms=2.0 * k,
            cloud_ms=1.0,
            serialize_ms=0.5,
            bytes_up=100 * k,
            bytes_down=90 * k,
        )
        for k in (1, 2, 4)
        for _ in range(3)
    ]
    config = ProbeConfig(
        cloud_url="ws://x",
        model_dir=Path("."),
        query_tokens=(1, 2, 4),
        repeats=3,
        projection_rtt_ms=(10.0,),
        dollars_per_hour=None,
    )
    report = build_report(config, [10.0, 10.0, 10.0], steps)
    # step(k) = 10 + 0.1k + 2k + 1 + 0.5  =>  f(k) = 1.5 + 2.1k
    assert report.overhead_ms(1) == pytest.approx(3.6)
    assert report.overhead_ms(4) == pytest.approx(9.9)
    assert report.break_even_measured[4] == pytest.approx((10 + 9.9) / (10 + 3.6))
    assert report.fit.f1_ms_per_token == pytest.approx(2.1)
    assert report.projection[0].usd_per_million_tokens is None
    assert report.steps[2].transfer_ms == pytest.approx(0.4)


@pytest.mark.parametrize(
    "kw", [{"query_tokens": (2, 4)}, {"query_tokens": (0, 1)}, {"repeats": 0}, {"dollars_per_hour": -1.0}]
)
def test_probe_config_errors(kw: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        ProbeConfig(cloud_url="ws://x", model_dir=Path("."), **kw)  # type: ignore[arg-type]


def test_probe_cli_unreachable_server_is_a_clean_error(make_checkpoint: Callable[..., Path]) -> None:
    model = make_checkpoint("llama")
    status = bench_main(["probe", "--cloud", "ws://127.0.0.1:9", "--model", str(model), "--repeats", "1"])
    assert status == 2


def test_probe_cli_takes_a_trunk_fingerprint() -> None:
    args = build_parser().parse_args(
        ["probe", "--cloud", "ws://x", "--model", ".", "--trunk-fingerprint", "2-4:float32:abc"]
    )
    assert args.trunk_fingerprint == "2-4:float32:abc"
    seen: dict[str, ProbeConfig] = {}

    async def fake_probe(config: ProbeConfig) -> ProbeReport:
        seen["config"] = config
        raise ConfigError("stop here")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(probe_module, "probe", fake_probe)
        assert bench_main(["probe", "--cloud", "ws://x", "--model", ".", "--trunk-fingerprint", "2-4:float32:abc"]) == 2
    assert seen["config"].trunk_fingerprint == "2-4:float32:abc"


async def test_probe_runs_on_an_edge_only_checkpoint(
    make_checkpoint: Callable[..., Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An edge that holds only its own layers cannot hash the trunk: it names it, as generate does."""
    model = make_checkpoint("llama")
    edge = edge_only_copy(model, tmp_path)
    async with TrunkServer(CloudConfig(model_dir=model, port=0)) as server:
        base = ["probe", "--cloud", server.url, "--model", str(edge), "--repeats", "1", "--warmup", "0",
                "--pings", "1", "--query-tokens", "1,2", "--json"]  # fmt: skip
        assert await asyncio.to_thread(bench_main, base) == 2  # nothing to check the trunk against
        capsys.readouterr()
        pinned = [*base, "--trunk-fingerprint", str(server.trunk_fingerprint)]
        assert await asyncio.to_thread(bench_main, pinned) == 0
    report = json.loads(capsys.readouterr().out)
    assert [s["query_tokens"] for s in report["steps"]] == [1, 2]
