"""Issue #12: what a hostile or buggy worker can cost the coordinator, and one client a worker.

A fake worker (a bare WebSocket server speaking the fed protocol) answers each round with a reply
the request cannot legitimately produce; a real worker answers honestly beside it, so the
generation goes on and the round records show the hostile one dropped.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import torch
from websockets.asyncio.client import connect
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from splitspec.decoding.sampling import SamplingParams
from splitspec.exceptions import BadTensor, MessageTooLarge, SessionQuotaExceeded, TransportError, error_from_code
from splitspec.federated import codec as codec_module
from splitspec.federated import coordinator as coordinator_module
from splitspec.federated.codec import encode_topk, max_reply_bytes, max_stream_bytes
from splitspec.federated.config import CoordinatorConfig
from splitspec.federated.coordinator import Coordinator
from splitspec.federated.link import WorkerLink
from splitspec.federated.lm import LoadedModel, load_model
from splitspec.federated.topk import TopKPolicy, select_topk
from splitspec.federated.worker import FedWorker, WorkerConfig
from splitspec.protocol.fed import FedHello, FedScore, FedScores, FedWelcome, decode_fed, encode_fed
from splitspec.protocol.messages import Error
from splitspec.transport.client import Channel

K = 4
PROMPT = [0, 5, 17, 42, 8, 23]


@pytest.fixture(scope="module")
def models(make_checkpoint: Callable[..., Path]) -> dict[str, LoadedModel]:
    return {
        "worker": load_model(make_checkpoint("llama", layers=2, logit_scale=6.0)),
        "draft": load_model(make_checkpoint("llama", layers=1, logit_scale=6.0)),
    }


def laws(positions: int, vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(positions)
    return torch.softmax(torch.randn(positions, vocab, generator=gen) * 3, -1)  # (n, V)


def test_the_reply_bound_covers_the_longest_stream_the_encoder_writes() -> None:
    vocab = 96
    for codec in ("quantized", "float16", "float32"):
        for k in (1, 7, vocab):
            p = laws(5, vocab)
            stream = encode_topk(p, select_topk(p, TopKPolicy(k=k)), codec)
            assert len(stream) <= max_stream_bytes(5, k, vocab)
    flat = torch.full((3, vocab), 1.0 / vocab)  # every token kept, values at the grid's limit
    assert len(encode_topk(flat, select_topk(flat, TopKPolicy(k=vocab)))) <= max_stream_bytes(3, vocab, vocab)
    assert max_reply_bytes(5, K, vocab, audit=True) == max_reply_bytes(5, K, vocab, audit=False) + 4 * 5 * vocab


HostileReply = Callable[[FedScore, int], bytes]


class FakeWorkers:
    """Fake workers answering every FedScore with ``reply(request, vocab)``; the close codes they saw."""

    def __init__(self, loaded: LoadedModel) -> None:
        self.loaded = loaded
        self.servers: list[Server] = []
        self.closes: list[int] = []  # close codes of connections that ended in an error

    async def start(self, reply: HostileReply, unsolicited: bytes | None = None) -> str:
        """Serve on a free loopback port (sending ``unsolicited`` right after the handshake); the URL."""
        loaded = self.loaded
        welcome = FedWelcome(
            worker="fake",
            model_fingerprint="fake",
            vocab_size=loaded.vocab_size,
            tokenizer_fingerprint=loaded.tokenizer_fingerprint,
            max_message_bytes=1 << 26,
            max_query_tokens=4096,
            max_positions=loaded.max_positions,
        )

        async def handler(ws: ServerConnection) -> None:
            try:
                assert isinstance(decode_fed(await ws.recv(decode=False)), FedHello)
                await ws.send(encode_fed(welcome))
                if unsolicited is not None:
                    await asyncio.sleep(0.2)  # once the handshake is over, between rounds
                    await ws.send(unsolicited)
                async for data in ws:
                    request = decode_fed(data if isinstance(data, bytes) else data.encode())
                    assert isinstance(request, FedScore)
                    await ws.send(reply(request, loaded.vocab_size))
            except ConnectionClosed as exc:
                frame = exc.rcvd or exc.sent
                if frame is not None:
                    self.closes.append(frame.code)

        server = await serve(handler, "127.0.0.1", 0, max_size=None, compression=None)
        self.servers.append(server)
        return f"ws://127.0.0.1:{server.sockets[0].getsockname()[1]}"


@pytest.fixture
async def fakes(models: dict[str, LoadedModel]) -> AsyncIterator[FakeWorkers]:
    fake = FakeWorkers(models["worker"])
    yield fake
    for server in fake.servers:
        server.close()
        await server.wait_closed()


async def generate_beside(
    models: dict[str, LoadedModel], hostile_url: str, n: int = 6, audit: bool = False
) -> list[str]:
    """Greedy generation with one honest worker and the hostile one; the hostile one's drop reasons."""
    async with FedWorker(WorkerConfig(model_dir=Path("."), port=0), models["worker"]) as honest:
        honest_url = honest.url
        cfg = CoordinatorConfig(
            draft_dir=Path("."),
            worker_urls=(honest_url, hostile_url),
            top_k=K,
            gamma=3,
            round_timeout_s=10.0,
            rejoin_interval_s=0.0,
            audit=audit,
        )
        async with Coordinator(cfg, models["draft"]) as coord:
            result = await coord.generate(PROMPT, n, SamplingParams(temperature=0.0))
    assert len(result.token_ids) == n
    # between two drops, the rounds its reconnection runs in (in the background) find it down
    hostile = [w for r in result.rounds for w in r.workers if w.url == hostile_url]
    assert all(w.status in ("dropped", "down") for w in hostile)
    reasons = [w.error or "" for w in hostile if w.status == "dropped"]
    assert reasons
    assert all(w.status == "ok" for r in result.rounds for w in r.workers if w.url == honest_url)
    return reasons


async def test_a_reply_bigger_than_the_request_allows_is_refused_unread(
    models: dict[str, LoadedModel], fakes: FakeWorkers
) -> None:
    """1 MiB for 4 positions of K = 4: the WebSocket layer refuses it from its length (close 1009)."""

    def huge(request: FedScore, vocab: int) -> bytes:
        stream = bytes(1 << 20)
        return FedScores(request.seq, request.num_scored, vocab, stream, 1.0).to_bytes()

    reasons = await generate_beside(models, await fakes.start(huge))
    assert all(r.startswith("MessageTooLarge") for r in reasons), reasons
    assert fakes.closes
    assert set(fakes.closes) == {1009}


async def test_a_reply_with_more_tokens_than_k_is_refused(models: dict[str, LoadedModel], fakes: FakeWorkers) -> None:
    """A well-formed stream of K + 1 tokens per position fits the byte bound but not the request."""

    def one_too_many(request: FedScore, vocab: int) -> bytes:
        p = laws(request.num_scored, vocab)
        stream = encode_topk(p, select_topk(p, TopKPolicy(k=K + 1)), "float32")
        return FedScores(request.seq, request.num_scored, vocab, stream, 1.0).to_bytes()

    reasons = await generate_beside(models, await fakes.start(one_too_many))
    assert all(r.startswith("BadTensor") and f"the {K} the request allowed" in r for r in reasons), reasons


async def test_an_unsolicited_frame_between_rounds_is_refused_unread(
    models: dict[str, LoadedModel], fakes: FakeWorkers
) -> None:
    """A worker speaks only when asked: while the link is idle, a frame above a header's size is
    refused from its length by the WebSocket layer (not buffered, then refused by the decoder)."""

    def never(request: FedScore, vocab: int) -> bytes:
        raise AssertionError("the link must be closed before it asks")

    url = await fakes.start(never, unsolicited=bytes(1 << 20))
    cfg = CoordinatorConfig(draft_dir=Path("."), worker_urls=(url,), top_k=K)
    link = WorkerLink(url, 1.0, cfg)
    loaded = models["draft"]
    await link.connect(FedHello(loaded.vocab_size, loaded.tokenizer_fingerprint))
    await asyncio.sleep(0.5)  # the unsolicited frame arrives while the link is idle
    with pytest.raises(MessageTooLarge, match="exceeded our size limit"):
        await link.score(PROMPT, 2, 1.0)
    await link.drop("test over")


@pytest.fixture
def decode_threads(monkeypatch: pytest.MonkeyPatch) -> list[threading.Thread]:
    """Record the thread every top-K decode of the coordinator runs on."""
    seen: list[threading.Thread] = []
    real = codec_module.decode_topk

    def recording(*args: object, **kwargs: object) -> object:
        seen.append(threading.current_thread())
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(coordinator_module, "decode_topk", recording)
    return seen


async def test_replies_are_decoded_off_the_event_loop(
    models: dict[str, LoadedModel], decode_threads: list[threading.Thread]
) -> None:
    loop_thread = threading.current_thread()
    async with FedWorker(WorkerConfig(model_dir=Path("."), port=0), models["worker"]) as w:
        cfg = CoordinatorConfig(draft_dir=Path("."), worker_urls=(w.url,), top_k=K, gamma=3)
        async with Coordinator(cfg, models["draft"]) as coord:
            await coord.generate(PROMPT, 4, SamplingParams(temperature=0.0))
    assert decode_threads
    assert all(t is not loop_thread for t in decode_threads)


async def hello_from(url: str, address: str, loaded: LoadedModel) -> tuple[Channel, object]:
    """Connect from ``address`` (any 127.x.y.z is loopback), send a FedHello; the channel and the reply."""
    ws = await connect(url, local_addr=(address, 0), compression=None)
    channel = Channel(ws, 1 << 20)
    await channel.send_raw(encode_fed(FedHello(loaded.vocab_size, loaded.tokenizer_fingerprint)))
    reply = decode_fed(await channel.recv_raw(10.0))
    return channel, error_from_code(reply.code, reply.message) if isinstance(reply, Error) else reply


async def test_one_address_cannot_take_every_worker_session(models: dict[str, LoadedModel]) -> None:
    loaded = models["worker"]
    config = WorkerConfig(model_dir=Path("."), port=0, max_sessions=16, max_sessions_per_address=2)
    async with FedWorker(config, loaded) as w:
        first, a = await hello_from(w.url, "127.0.0.1", loaded)
        second, b = await hello_from(w.url, "127.0.0.1", loaded)
        third, c = await hello_from(w.url, "127.0.0.1", loaded)
        assert isinstance(a, FedWelcome)
        assert isinstance(b, FedWelcome)
        assert isinstance(c, SessionQuotaExceeded)
        other, d = await hello_from(w.url, "127.0.0.2", loaded)  # another address still gets in
        assert isinstance(d, FedWelcome)
        await first.close()
        for _ in range(100):  # the closed connection's session is released
            if len(w.active) == 2:
                break
            await asyncio.sleep(0.02)
        again, e = await hello_from(w.url, "127.0.0.1", loaded)
        assert isinstance(e, FedWelcome)
        for ch in (second, third, other, again):
            await ch.close()


async def test_a_prefill_in_chunks_keeps_the_scored_positions_in_its_last_message(
    models: dict[str, LoadedModel],
) -> None:
    """A worker taking 8 tokens a message, a round scoring 4: a context of 10 was sent as 8 + 2, and the last
    message, shorter than the positions it scores, was refused, dropping the worker every round (a prompt within
    gamma of 4096 tokens does the same with the default limit). Now 6 + 4; the output is the unchunked one."""
    prompt = [*PROMPT, 9]  # 7 tokens + 3 drafted = 10 = 8 + 2

    async def run(max_query_tokens: int) -> list[int]:
        config = WorkerConfig(model_dir=Path("."), port=0, max_query_tokens=max_query_tokens)
        async with FedWorker(config, models["worker"]) as worker:
            cfg = CoordinatorConfig(draft_dir=Path("."), worker_urls=(worker.url,), top_k=K, gamma=3)
            async with Coordinator(cfg, models["draft"]) as coord:
                result = await coord.generate(prompt, 6, SamplingParams(temperature=0.0))
        assert all(w.status == "ok" for r in result.rounds for w in r.workers)
        return result.token_ids

    assert await run(8) == await run(4096)


def _valid_reply(request: FedScore, vocab: int) -> bytes:
    """A well-formed answer of K tokens per scored position, without the full laws an audit asks for."""
    p = laws(request.num_scored, vocab)
    stream = encode_topk(p, select_topk(p, TopKPolicy(k=K)), "float32")
    return FedScores(request.seq, request.num_scored, vocab, stream, 1.0).to_bytes()


async def test_in_audit_mode_a_worker_without_its_full_laws_is_dropped_not_the_generation(
    models: dict[str, LoadedModel], fakes: FakeWorkers
) -> None:
    """One worker omitting what the audit reads used to abort the whole generation mid-round."""
    reasons = await generate_beside(models, await fakes.start(_valid_reply), audit=True)
    assert all(r.startswith("ProtocolError") and "full distributions" in r for r in reasons), reasons


async def test_when_only_workers_of_weight_zero_answer_the_round_fails_in_words(
    models: dict[str, LoadedModel], fakes: FakeWorkers
) -> None:
    """Weights (1, 0) and the weighted worker down: a ConfigError about weights used to surface mid-generation.
    The round waits for the weighted worker to rejoin (it does, and fails again) up to rejoin_wait_s(), 1 s here."""

    def never(request: FedScore, vocab: int) -> bytes:
        raise ConnectionClosed(None, None)

    async with FedWorker(WorkerConfig(model_dir=Path("."), port=0), models["worker"]) as honest:
        cfg = CoordinatorConfig(
            draft_dir=Path("."),
            worker_urls=(await fakes.start(never), honest.url),
            weights=(1.0, 0.0),
            top_k=K,
            gamma=3,
            round_timeout_s=10.0,
            connect_timeout_s=1.0,
            rejoin_interval_s=0.0,
        )
        async with Coordinator(cfg, models["draft"]) as coord:
            with pytest.raises(TransportError, match="positive weight failed this round and none rejoined within 1 s"):
                await coord.generate(PROMPT, 4, SamplingParams(temperature=0.0))


async def test_a_worker_refuses_to_score_more_positions_than_a_round_needs(models: dict[str, LoadedModel]) -> None:
    """Scores at 4,096 positions of a 150k vocabulary would make the worker build tens of GB of laws."""
    async with FedWorker(WorkerConfig(model_dir=Path("."), port=0, max_scored_positions=8), models["worker"]) as w:
        cfg = CoordinatorConfig(draft_dir=Path("."), worker_urls=(w.url,), top_k=K)
        link = WorkerLink(w.url, 1.0, cfg)
        loaded = models["draft"]
        await link.connect(FedHello(loaded.vocab_size, loaded.tokenizer_fingerprint))
        with pytest.raises(BadTensor, match="exceed this worker's limit of 8"):
            await link.score([*PROMPT, *PROMPT], 9, 1.0)
        reply, _, _ = await link.score([*PROMPT, *PROMPT], 8, 1.0)
        assert reply.positions == 8
        await link.drop("test over")


async def test_a_rejoin_prefill_in_several_messages_may_take_longer_than_one_round_timeout(
    models: dict[str, LoadedModel],
) -> None:
    """Each message waits the round timeout, not the whole prefill: 4 messages of 0.4 s under a 1 s timeout (one
    timeout for all of them dropped a worker whose context took several messages, on every rejoin)."""
    config = WorkerConfig(model_dir=Path("."), port=0, max_query_tokens=8, delay_s=0.4)
    async with FedWorker(config, models["worker"]) as worker:
        cfg = CoordinatorConfig(draft_dir=Path("."), worker_urls=(worker.url,), top_k=K, gamma=3, round_timeout_s=1.0)
        async with Coordinator(cfg, models["draft"]) as coord:
            result = await coord.generate(PROMPT * 4, 2, SamplingParams(temperature=0.0))  # 24 + 3 tokens: 4 messages
    assert len(result.token_ids) == 2
    assert all(w.status == "ok" for r in result.rounds for w in r.workers)


async def test_in_audit_mode_a_worker_sending_nan_full_laws_is_dropped(
    models: dict[str, LoadedModel], fakes: FakeWorkers
) -> None:
    """The protocol checks only the size of the full laws; NaN ones made Δ NaN, which passed every bound check
    ("0 violations"). Full laws must be finite, non-negative and sum to 1, else the worker is dropped."""

    def nan_laws(request: FedScore, vocab: int) -> bytes:
        p = laws(request.num_scored, vocab)
        stream = encode_topk(p, select_topk(p, TopKPolicy(k=K)), "float32")
        full = torch.full((request.num_scored, vocab), float("nan"))
        return FedScores(request.seq, request.num_scored, vocab, stream, 1.0, full=full).to_bytes()

    reasons = await generate_beside(models, await fakes.start(nan_laws), audit=True)
    assert all(r.startswith("BadTensor") and "not finite" in r for r in reasons), reasons
