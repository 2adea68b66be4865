"""The coordinator's link to one worker: connection, handshake, what its cache holds, retry schedule.

:meth:`WorkerLink.score` brings the worker's cache to a context (keeping the longest common
prefix, chunked prefill) and has it score the last positions; every exchange is one
:meth:`splitspec.transport.client.Channel.exchange`.
"""

from __future__ import annotations

import asyncio
import logging
import time

import torch

from splitspec.exceptions import BadTensor, ConfigError, HandshakeMismatch, TransportError, UnexpectedMessage
from splitspec.federated.codec import max_reply_bytes
from splitspec.federated.config import CoordinatorConfig
from splitspec.prefix import common_prefix
from splitspec.protocol.fed import FedHello, FedScore, FedScores, FedWelcome, decode_fed, encode_fed
from splitspec.protocol.frames import MAX_HEADER_BYTES, PREFIX_SIZE
from splitspec.transport.client import Channel

log = logging.getLogger(__name__)
_HEADER_ONLY = PREFIX_SIZE + MAX_HEADER_BYTES  # the largest frame without tensors (a welcome, an error), bytes


class WorkerLink:
    """The coordinator's view of one worker: connection, cache contents, retry schedule."""

    def __init__(self, url: str, weight: float, config: CoordinatorConfig) -> None:
        self.url = url
        self.weight = weight
        self.config = config
        self.channel: Channel | None = None
        self.welcome: FedWelcome | None = None
        self.model_fingerprint: str | None = None  # the worker's model at its first connection: a rejoin must match
        self.tokens: list[int] = []  # tokens the worker's cache holds, as far as we know
        self.seq = 0
        self.next_retry = 0.0  # monotonic time of the next reconnect attempt
        self.backoff_s = config.rejoin_interval_s

    @property
    def alive(self) -> bool:
        return self.channel is not None

    @property
    def closed(self) -> bool:
        """Connected, but the worker has closed the connection since (it closes one idle past its timeout)."""
        return self.channel is not None and self.channel.closed

    async def connect(self, hello: FedHello) -> FedWelcome:
        """Connect and handshake, and use the connection from now on; a refused handshake raises its typed error."""
        channel, welcome = await self.open(hello)
        self.adopt(channel, welcome)
        return welcome

    async def open(self, hello: FedHello) -> tuple[Channel, FedWelcome]:
        """Connect and handshake without using the connection yet (see :meth:`adopt`)."""
        cfg = self.config
        # a worker speaks only when asked, and its welcome is a header: nothing bigger is buffered
        channel = await Channel.connect(
            self.url,
            max_message_bytes=cfg.max_message_bytes,
            timeout_s=cfg.connect_timeout_s,
            idle_frame_limit=_HEADER_ONLY,
            ca_file=cfg.tls_ca_file,
        )
        try:
            reply, _ = await channel.exchange(
                hello, cfg.connect_timeout_s, encode_fed, decode_fed, reply_limit=_HEADER_ONLY
            )
            if not isinstance(reply, FedWelcome):
                raise UnexpectedMessage(f"expected fed_welcome, got {reply.TYPE!r}")
            if reply.vocab_size != hello.vocab_size or reply.tokenizer_fingerprint != hello.tokenizer_fingerprint:
                raise HandshakeMismatch(f"worker {self.url} answered with another vocabulary or tokenizer")
            first = self.model_fingerprint
            if first is not None and reply.model_fingerprint != first:  # its weight was set for the first model
                raise HandshakeMismatch(
                    f"worker {self.url} came back with another model ({reply.model_fingerprint}, first {first})"
                )
        except BaseException:
            await close_quietly(channel)
            raise
        return channel, reply

    def adopt(self, channel: Channel, welcome: FedWelcome) -> None:
        """Use a connection :meth:`open` made: the worker's cache starts empty (the next round re-prefills it)."""
        self.channel, self.welcome, self.tokens, self.seq = channel, welcome, [], 0
        if self.model_fingerprint is None:
            self.model_fingerprint = welcome.model_fingerprint
        self.backoff_s = self.config.rejoin_interval_s

    def defer_retry(self) -> None:
        """The next reconnection waits the backoff, which doubles (10 s at most) until a connection is adopted."""
        self.next_retry = time.monotonic() + self.backoff_s
        self.backoff_s = min(10.0, 2 * self.backoff_s)

    async def drop(self, reason: str, *, backoff: bool = True) -> None:
        """Close the connection; reconnect after the backoff, or at once when ``backoff`` is False."""
        channel, self.channel = self.channel, None
        self.tokens = []
        if backoff:
            self.defer_retry()
            log.warning("worker %s dropped: %s", self.url, reason)
        else:
            self.next_retry = 0.0
            log.info("worker %s: %s; reconnecting", self.url, reason)
        if channel is not None:
            await close_quietly(channel)

    async def score(self, context: list[int], num_scored: int, temperature: float) -> tuple[FedScores, int, int]:
        """Bring the worker's cache to ``context`` and score its last positions; (reply, bytes up, bytes down)."""
        channel, welcome = self.channel, self.welcome
        if channel is None or welcome is None:
            raise TransportError("not connected")
        cfg = self.config
        keep = common_prefix(self.tokens, context, len(context) - num_scored)
        limit = welcome.max_query_tokens
        if num_scored > limit:
            raise ConfigError(f"the worker takes {limit} tokens a message, fewer than the {num_scored} a round scores")
        up = down = 0
        # chunked prefill: no single message appends more than the worker's max_query_tokens, and the last one
        # still holds the num_scored positions it scores (a last chunk shorter than that was refused)
        while len(context) - keep > limit:
            chunk = context[keep : keep + min(limit, len(context) - keep - num_scored)]
            reply, u, d = await self._exchange(channel, welcome.vocab_size, keep, chunk, 1, 1.0, k=1)
            up, down, keep = up + u, down + d, keep + len(chunk)
            self.tokens = context[:keep]
        # a fixed K above the worker's vocabulary means every token (TopKPolicy caps it at |V|); the worker
        # refuses a K above its vocabulary, so it is capped here
        k = None if cfg.top_k is None else cfg.k_cap(welcome.vocab_size)
        reply, u, d = await self._exchange(
            channel, welcome.vocab_size, keep, context[keep:], num_scored, temperature, k=k
        )
        self.tokens = list(context)
        return reply, up + u, down + d

    async def _exchange(
        self,
        channel: Channel,
        vocab: int,
        keep: int,
        tokens: list[int],
        num_scored: int,
        temperature: float,
        k: int | None,
    ) -> tuple[FedScores, int, int]:
        cfg = self.config
        self.seq += 1
        request = FedScore(
            seq=self.seq,
            keep=keep,
            tokens=torch.tensor(tokens, dtype=torch.int32),
            num_scored=num_scored,
            temperature=temperature,
            k=k,
            target_epsilon=cfg.target_epsilon if k is None else None,
            max_k=cfg.max_k,
            epsilon_scope=cfg.epsilon_scope,
            prob_codec=cfg.prob_codec,
            quant_budget=cfg.quant_budget,
            audit=cfg.audit,
        )
        cap = k if k is not None else cfg.k_cap(vocab)
        # a reply is bounded by what this request can produce (an Error, header only, always fits)
        limit = max(max_reply_bytes(num_scored, cap, vocab, audit=cfg.audit), _HEADER_ONLY)
        reply, exchange = await channel.exchange(
            request, cfg.round_timeout_s, encode_fed, decode_fed, reply_limit=limit
        )
        if not isinstance(reply, FedScores):
            raise UnexpectedMessage(f"expected fed_scores, got {reply.TYPE!r}")
        if reply.seq != self.seq or reply.positions != num_scored:
            raise BadTensor(
                f"reply for round {reply.seq} with {reply.positions} positions, expected {self.seq}/{num_scored}"
            )
        return reply, exchange.bytes_up, exchange.bytes_down


async def close_quietly(channel: Channel) -> None:
    """Close ``channel``, logging (not raising) whatever a dead connection throws."""
    try:
        await asyncio.wait_for(channel.close(), 2.0)
    except Exception:  # closing a dead connection may fail in many ways; nothing to do about it
        log.debug("closing a worker connection failed", exc_info=True)
