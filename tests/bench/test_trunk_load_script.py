"""benchmarks/trunk_load.py: its load generator still speaks the protocol to a trunk server in a
process of its own, and measures what it reports (a run of it would otherwise rot unnoticed)."""

from __future__ import annotations

import asyncio
import importlib
import multiprocessing
from collections.abc import Iterator
from types import ModuleType, SimpleNamespace

import pytest

from tests.bench.scripts import BENCHMARKS

# What trunk_load imports (a forkserver child imports the script itself: the forkserver does not get sys.path)
PRELOAD = [
    "torch",
    "transformers.models.llama.modeling_llama",
    "splitspec.cloud.server",
    "splitspec.models.family",
    "splitspec.models.prepack",
    "splitspec.run_info",
    "splitspec.transport.client",
]


@pytest.fixture(scope="module")
def trunk_load() -> Iterator[ModuleType]:
    # imported under its own name from a path the server processes also get (the pickled process carries sys.path)
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(BENCHMARKS))
        module = importlib.import_module("trunk_load")
        # The script spawns its trunk server and the mix's prefilling edge, each a fresh interpreter importing
        # torch, transformers and splitspec (5-10 s on a busy 2-core machine; four per run of this file): here
        # they fork from a forkserver that imported those once. Still processes of their own, started by the
        # script's spawn_with_pipe with its pipes, from the same pickled target and arguments as under spawn.
        forkserver = multiprocessing.get_context("forkserver")
        forkserver.set_forkserver_preload(PRELOAD)
        patch.setattr(module, "multiprocessing", SimpleNamespace(get_context=lambda method: forkserver))
        yield module


@pytest.mark.parametrize("batching", [True, False])
def test_load_against_a_server_process(trunk_load: ModuleType, batching: bool) -> None:
    server = trunk_load.ServerProcess(trunk_load.server_config(trunk_load.DEMO, batching, 4, 1))
    try:
        decode = asyncio.run(trunk_load.run_load(server, 2, 0.3, False))
        mix = asyncio.run(trunk_load.run_load(server, 1, 0.4, True, prefill=40))  # the earlier run's sessions went
    finally:
        server.close()
    assert (server.endpoint.device, server.endpoint.prepacked) == ("cpu", False)  # float16 weights: not prepacked
    assert decode["steps"] > 2
    assert decode["steps_per_s"] > 0
    assert 0 < decode["p50_ms"] <= decode["p99_ms"]
    theory = decode["theory_bytes_per_token"]
    assert theory == 2048  # the demo base trunk: 4 layers x 2 (K, V) x 2 kv heads x 64 dims x 2 bytes (float16)
    # whole 16-entry blocks: at least the theory; each session holds >= 17 entries, so < 32 / 17 of it
    assert theory <= decode["kv_bytes_per_token"] < theory * 32 / 17
    assert mix["prefill_tokens"] == 40
    assert mix["prefill_ms"] > 0
    assert mix["prefill_kv_bytes_per_token"] == theory * 48 / 40  # 40 entries in three 16-entry blocks
