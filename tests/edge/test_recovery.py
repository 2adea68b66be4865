"""Issue #12 item 8: recovery bugs of the split client, each proven on a real server first.

Failures are injected at chosen Step requests: the n-th Step sent by any channel either loses the
connection (a transport failure) or, on the server, fails its compute after the cache command.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from splitspec.cloud.config import CloudConfig
from splitspec.cloud.server import TrunkServer
from splitspec.edge import EdgeConfig, SplitClient
from splitspec.edge import engine as engine_module
from splitspec.exceptions import ConfigError, TransportError
from splitspec.models.kv_cache import KVCache
from splitspec.protocol.messages import Message, Step
from splitspec.transport.client import Channel, Exchange
from tests.conftest import local_greedy
from tests.e2e.test_split_generate import PROMPT

LONG_PROMPT = random.Random(5).choices(range(3, 96), k=300)
SMALL_CAP = 20_000  # (20,000 − 2,048) // (64 · 4 + 16) = 66-token chunks: a 300-token prompt is 5 steps


@pytest.fixture
def fail_steps(monkeypatch: pytest.MonkeyPatch) -> set[int]:
    """Step requests (numbered from 1, all channels) that lose their connection instead of an answer."""
    failing: set[int] = set()
    count = 0
    request = Channel.request

    async def flaky(self: Channel, message: Message, timeout_s: float) -> tuple[Message, Exchange]:
        nonlocal count
        if isinstance(message, Step):
            count += 1
            if count in failing:
                await self.close()
                raise TransportError(f"injected failure of step {count}")
        return await request(self, message, timeout_s)

    monkeypatch.setattr(Channel, "request", flaky)
    return failing


def _edge(model: Path, server: TrunkServer, **kw: object) -> EdgeConfig:
    return EdgeConfig(allow_stock_edge_weights=True, model_dir=model, cloud_url=server.url, **kw)  # type: ignore[arg-type]


async def _only_session_length(server: TrunkServer) -> int:
    for _ in range(200):  # the dropped connection's session goes once its handler notices
        if len(server.sessions) == 1:
            break
        await asyncio.sleep(0.01)
    (session,) = server.sessions._sessions.values()
    return len(session.cache)


async def test_a_failure_between_prefill_chunks_does_not_duplicate_them(
    make_checkpoint: Callable[..., Path], fail_steps: set[int]
) -> None:
    model = make_checkpoint("llama")
    fail_steps.add(2)  # the second of the five prefill chunks
    async with TrunkServer(CloudConfig(model_dir=model, port=0)) as server:
        async with SplitClient(_edge(model, server, max_message_bytes=SMALL_CAP)) as client:
            assert client.chunk_tokens == 66
            result = await client.generate(LONG_PROMPT, 8, speculate="off")
            cached = await _only_session_length(server)
    assert result.recoveries == 1
    assert cached == len(LONG_PROMPT) + 8 - 1  # was 376 + 7 with the committed chunks sent twice
    assert result.token_ids == local_greedy(model, LONG_PROMPT, 8)


async def test_a_failed_replay_keeps_the_whole_history(
    make_checkpoint: Callable[..., Path], fail_steps: set[int]
) -> None:
    """The decode step after the prefill fails, then the second chunk of its replay fails too:
    the next attempt must replay all 301 tokens, not the 66 the broken replay got through."""
    model = make_checkpoint("llama")
    fail_steps.update({7, 9})  # prefill is steps 1-5, step 6 decodes; 7 fails; 8-12 replay, 9 fails
    async with TrunkServer(CloudConfig(model_dir=model, port=0)) as server:
        async with SplitClient(_edge(model, server, max_message_bytes=SMALL_CAP)) as client:
            result = await client.generate(LONG_PROMPT, 6, speculate="off")
            cached = await _only_session_length(server)
    assert result.recoveries == 2
    assert cached == len(LONG_PROMPT) + 6 - 1
    assert result.token_ids == local_greedy(model, LONG_PROMPT, 6)


async def test_a_server_error_after_the_cache_command_is_recovered(make_checkpoint: Callable[..., Path]) -> None:
    """The trunk fails a step whose keep_last it had already applied: the edge used to resend the
    command and be refused for good (PositionOutOfRange), wedging the session. (The failure is
    injected in the per-session path's compute; a failed batched forward fails its steps alike.)"""
    model = make_checkpoint("llama")
    async with TrunkServer(CloudConfig(model_dir=model, port=0, batching=False)) as server:
        compute = server._compute
        injected: list[str] = []

        def failing(step: Step, cache: KVCache) -> tuple[torch.Tensor, float, float]:
            if not injected and step.cache is not None and step.cache.keep_last is not None:
                injected.append(step.session_id)
                raise RuntimeError("injected trunk failure")
            return compute(step, cache)

        server._compute = failing  # type: ignore[method-assign]
        async with SplitClient(_edge(model, server)) as client:
            client.reset()
            await client.forward(PROMPT)
            await client.forward([20, 21, 22])  # a draft of three
            client.keep([0, 1])  # two accepted: the command rides on the next step
            recovered = await client.forward([23])
            after = await client.forward([24])  # and the session carries on (a chat's next turn)
        assert injected
        assert injected[0] not in server.sessions._sessions
        assert client.recoveries == 1
        async with SplitClient(_edge(model, server)) as clean:
            clean.reset()
            expected = await clean.forward([*PROMPT, 20, 21, 23, 24])
    torch.testing.assert_close(recovered[-1], expected[-2])
    torch.testing.assert_close(after[-1], expected[-1])


async def test_a_generation_past_the_models_last_position_is_refused_up_front(
    make_checkpoint: Callable[..., Path],
) -> None:
    """The edge used to fail with PositionOutOfRange at the limit, losing every token it made; now a
    request fits whole (prompt + max new tokens <= positions) or is refused before a step is sent."""
    model = make_checkpoint("llama", max_positions=24)
    fits = 24 - len(PROMPT)
    async with TrunkServer(CloudConfig(model_dir=model, port=0)) as server:
        async with SplitClient(_edge(model, server)) as client:
            with pytest.raises(ConfigError, match="exceeds the model's 24 positions"):
                await client.generate(PROMPT, fits + 1)
            assert client.steps == []  # refused before anything crossed the link
            result = await client.generate(PROMPT, fits)
    assert result.token_ids == local_greedy(model, PROMPT, fits)


async def test_sent_is_called_once_after_the_head_and_before_the_step_even_through_a_recovery(
    make_checkpoint: Callable[..., Path], fail_steps: set[int]
) -> None:
    """The decode loop starts its aside proposals from ``sent``: once a step, when the head forward has run and
    the trunk has not yet seen the step; a recovered attempt does not call it again."""
    model = make_checkpoint("llama")
    async with TrunkServer(CloudConfig(model_dir=model, port=0)) as server:
        async with SplitClient(_edge(model, server)) as client:
            await client.forward(PROMPT)  # step 1: the prefill
            fail_steps.add(2)  # the decode step loses its connection; the replay, then the step again
            seen: list[tuple[int, int, int]] = []

            def sent() -> None:  # what the head, the trunk and the committed tokens hold at that moment
                (session,) = server.sessions._sessions.values()
                seen.append((len(client.sequence.head_cache), len(session.cache), len(client.sequence.tokens)))

            logits = await client.forward([7], sent=sent)
            assert client.recoveries == 1
    assert seen == [(len(PROMPT) + 1, len(PROMPT), len(PROMPT))]
    assert logits.shape[0] == 1


async def _session_count(server: TrunkServer, expected: int) -> int:
    for _ in range(300):  # a session the edge abandons is closed in the background
        if len(server.sessions) == expected:
            break
        await asyncio.sleep(0.01)
    return len(server.sessions)


async def test_a_failure_after_the_trunk_ran_the_step_is_recovered_and_the_old_session_closed(
    make_checkpoint: Callable[..., Path],
) -> None:
    """The edge's tail forward fails once the trunk has run the step: the trunk's cache holds the step, the
    edge's does not. The edge used to keep the session and send its next step from the old position, refused
    for good (position_out_of_range); now that step recovers on a new session, and the old one is closed."""
    model = make_checkpoint("llama")
    async with TrunkServer(CloudConfig(model_dir=model, port=0)) as server:
        async with SplitClient(_edge(model, server)) as client:
            client.reset()
            await client.forward(PROMPT)
            tail = client.engine._tail
            run_rows = tail.run_rows
            failures = [RuntimeError("injected tail failure")]

            def failing(rows: list[Any]) -> list[torch.Tensor]:
                if failures:
                    raise failures.pop()
                return run_rows(rows)

            tail.run_rows = failing  # type: ignore[method-assign]
            with pytest.raises(RuntimeError, match="injected tail failure"):
                await client.forward([23])
            assert client.sequence.tokens == PROMPT
            recovered = await client.forward([24])
            assert client.recoveries == 1
            assert await _session_count(server, 1) == 1  # the abandoned session does not wait for its TTL
        async with SplitClient(_edge(model, server)) as clean:
            clean.reset()
            expected = await clean.forward([*PROMPT, 24])
    torch.testing.assert_close(recovered[-1], expected[-1])


async def _cancel_in_the_tail(client: SplitClient, tokens: list[int], before_cancel: Callable[[], None]) -> None:
    """A forward of ``tokens`` cancelled while its step waits for the tail (its caller went away);
    ``before_cancel`` runs while it waits."""
    tail = client.engine._tail
    submit = tail.submit
    reached = asyncio.Event()

    async def stalled(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, float, float]:
        reached.set()
        await asyncio.sleep(30)
        return await submit(*args, **kwargs)

    tail.submit = stalled  # type: ignore[method-assign]
    try:
        step = asyncio.ensure_future(client.forward(tokens))
        await reached.wait()
        before_cancel()
        step.cancel()
        with pytest.raises(asyncio.CancelledError):
            await step
    finally:
        tail.submit = submit  # type: ignore[method-assign]


async def test_a_cancelled_step_leaves_no_session_and_no_feature_stream_behind(
    make_checkpoint: Callable[..., Path],
) -> None:
    """A chat whose turn is cancelled while its step waits for the tail (the caller went away): the sequence
    recovers on its next forward, its old trunk session is closed, and the tail worker keeps nothing of the
    step (a sequence keeping features for a draft head used to leave its output stream registered for good)."""
    model = make_checkpoint("llama")
    async with TrunkServer(CloudConfig(model_dir=model, port=0)) as server:
        config = _edge(model, server, edge_layers=(2, 2))
        async with SplitClient(config) as client:
            client.reset()
            assert client.sequence.keep_features((2, 4, 6)) is not None
            await client.forward(PROMPT)
            tail = client.engine._tail

            def registered() -> None:
                assert tail._streams  # the step's stream is registered while it waits

            await _cancel_in_the_tail(client, [23], registered)
            assert tail._streams == {}
            await client.forward([24])
            assert client.recoveries == 1
            assert await _session_count(server, 1) == 1


async def test_a_sequence_cut_short_after_a_cancelled_step_can_still_be_truncated(
    make_checkpoint: Callable[..., Path],
) -> None:
    """A cancelled step leaves the sequence with fresh, empty edge caches (a worker may still hold the old ones):
    truncating its history then raised (the caches held 0 entries), so a caller could not rewind a chat turn. The
    kept tokens are what the recovery replays."""
    model = make_checkpoint("llama")
    async with TrunkServer(CloudConfig(model_dir=model, port=0)) as server:
        async with SplitClient(_edge(model, server)) as client:
            client.reset()
            await client.forward(PROMPT)
            await _cancel_in_the_tail(client, [23], lambda: None)
            client.sequence.truncate(len(PROMPT) - 2)
            rewound = await client.forward([24])
            assert client.recoveries == 1
        async with SplitClient(_edge(model, server)) as clean:
            clean.reset()
            expected = await clean.forward([*PROMPT[:-2], 24])
    torch.testing.assert_close(rewound[-1], expected[-1])


async def test_a_prefill_failing_after_its_first_chunk_commits_none_of_it(make_checkpoint: Callable[..., Path]) -> None:
    """A forward is all or nothing: a failure of another kind than a lost session (here the tail's, on the second
    of five chunks) left the first chunk committed, and the next forward replayed it ahead of the prompt sent
    again."""
    model = make_checkpoint("llama")
    async with TrunkServer(CloudConfig(model_dir=model, port=0)) as server:
        async with SplitClient(_edge(model, server, max_message_bytes=SMALL_CAP)) as client:
            client.reset()
            tail = client.engine._tail
            run_rows = tail.run_rows
            calls = {"n": 0}

            def failing_second(rows: list[Any]) -> list[torch.Tensor]:
                calls["n"] += 1
                if calls["n"] == 2:
                    raise RuntimeError("injected tail failure")
                return run_rows(rows)

            tail.run_rows = failing_second  # type: ignore[method-assign]
            with pytest.raises(RuntimeError, match="injected"):
                await client.forward(LONG_PROMPT, logits_from=len(LONG_PROMPT) - 1)
            assert client.sequence.tokens == []
            again = await client.forward(LONG_PROMPT, logits_from=len(LONG_PROMPT) - 1)
        async with SplitClient(_edge(model, server)) as clean:
            clean.reset()
            expected = await clean.forward(LONG_PROMPT, logits_from=len(LONG_PROMPT) - 1)
    torch.testing.assert_close(again[-1], expected[-1])


async def _recover_at_the_session_limit(model: Path, server: TrunkServer) -> SplitClient:
    """A sequence loses its session's sync with the trunk (its tail fails after the trunk ran the step) on a trunk
    that holds one session, then steps again: the recovery gives the old session up and opens a new one."""
    async with SplitClient(_edge(model, server)) as client:
        client.reset()
        await client.forward(PROMPT)
        tail = client.engine._tail
        run_rows = tail.run_rows
        failures = [RuntimeError("injected tail failure")]

        def failing(rows: list[Any]) -> list[torch.Tensor]:
            if failures:
                raise failures.pop()
            return run_rows(rows)

        tail.run_rows = failing  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="injected tail failure"):
            await client.forward([23])
        await client.forward([24])  # was: TooManySessions, the trunk's one session being the edge's old one
        assert client.recoveries == 1
        assert await _session_count(server, 1) == 1
    return client


async def test_a_recovery_at_the_trunks_session_limit_closes_the_old_session_first(
    make_checkpoint: Callable[..., Path],
) -> None:
    """The recovery used to close the session it gave up in the background and open the new one at once: the
    open reached the trunk first and was refused (max_sessions), for the edge's own session."""
    model = make_checkpoint("llama")
    async with TrunkServer(CloudConfig(model_dir=model, port=0, max_sessions=1)) as server:
        await _recover_at_the_session_limit(model, server)


async def test_a_recovery_refused_for_its_old_session_tries_again(
    make_checkpoint: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Should the trunk still count the session given up when the new one is opened (its close not waited for,
    here), the refusal (too_many_sessions; here its per-address kind, session_quota) is retried within
    reconnect_timeout_s."""
    monkeypatch.setattr(engine_module, "ABANDON_WAIT_S", 0.0, raising=False)
    model = make_checkpoint("llama")
    async with TrunkServer(CloudConfig(model_dir=model, port=0, max_sessions_per_address=1)) as server:
        await _recover_at_the_session_limit(model, server)
