"""The SpecFed coordinator: drafts locally, lets M workers score, verifies against their aggregate.

One round:

1. the draft model proposes γ tokens (sampled from q at the run's temperature / top-p, or argmax
   when greedy);
2. every live worker gets, concurrently, the tokens its cache lacks plus the draft, and answers
   with the top-K of its next-token law at the γ + 1 positions (compact encoding);
3. each answer is rebuilt (``renorm`` or ``residual``), the rebuilt laws are mixed with the
   weights w_i renormalised over the workers that answered, giving the aggregate p̂;
4. the draft is verified against p̂ with the shared acceptance code
   (:func:`splitspec.decoding.acceptance.speculative_verify`; greedy: argmax of p̂), so the emitted
   tokens follow p̂ exactly (after top-p, which is applied to p̂).

Workers apply the temperature before their top-K (greedy runs use T = 1 there); the aggregate of
tempered laws is the target. A worker that times out, disconnects or sends a bad reply is dropped
for the round (logged) and the others' weights are renormalised; the coordinator reconnects it in
a later round and re-prefills its cache from scratch. Handshake refusals (vocabulary or tokenizer
mismatch, auth) are fatal: they mean a misconfiguration, not a fault.

Every round records K sent, ε per worker and position, bytes each way per worker, accepted
tokens; in audit mode the workers also return their full laws and the round records the true
aggregation bias Δ, the acceptance-rate drift and the bound checks (violations are logged).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from splitspec.decoding.acceptance import Verdict, greedy_verify, speculative_verify
from splitspec.decoding.local import LocalSequence
from splitspec.decoding.sampling import SamplingParams, probabilities
from splitspec.exceptions import (
    BadTensor,
    ConfigError,
    HandshakeMismatch,
    ProtocolError,
    SplitspecError,
    TransportError,
    UnexpectedMessage,
    error_from_code,
)
from splitspec.federated.codec import decode_topk
from splitspec.federated.lm import LoadedModel, load_model
from splitspec.federated.topk import (
    RECONSTRUCTIONS,
    Reconstruction,
    TopK,
    aggregate,
    bound_report,
    normalize_weights,
    nucleus,
    reconstruct,
)
from splitspec.protocol.fed import (
    DEFAULT_QUANT_BUDGET,
    EPSILON_SCOPES,
    MAX_QUANT_BUDGET,
    VALUE_CODECS,
    EpsilonScope,
    FedHello,
    FedMessage,
    FedScore,
    FedScores,
    FedWelcome,
    ValueCodec,
    decode_fed,
    encode_fed,
)
from splitspec.protocol.messages import Error
from splitspec.transport.client import Channel, websocket_max_size

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CoordinatorConfig:
    """Everything a coordinator needs, built once by the CLI."""

    draft_dir: Path  # HF checkpoint directory of the draft model, with tokenizer
    worker_urls: tuple[str, ...]  # ws:// URLs of the workers
    weights: tuple[float, ...] | None = None  # aggregation weight per worker (renormalised); None = equal
    top_k: int | None = 320  # fixed K per position, tokens; None = adaptive (target_epsilon)
    target_epsilon: float | None = None  # adaptive K: largest residual mass 1 − Σ top-K, probability
    epsilon_scope: EpsilonScope = "position"  # adaptive K: target on every position, or on each round's mean
    max_k: int = 4096  # cap on adaptive K, tokens
    reconstruct: Reconstruction = "renorm"  # top-K only, or top-K plus the residual spread uniformly
    gamma: int = 4  # draft tokens per round
    prob_codec: ValueCodec = "quantized"  # how top-K probabilities travel
    quant_budget: float = DEFAULT_QUANT_BUDGET  # ρ: quantization error allowed per position, fraction of its tail mass
    audit: bool = False  # workers also send full laws; rounds record Δ, drift and bound checks
    auth_token: str | None = None  # shared secret for the workers
    round_timeout_s: float = 30.0  # a worker slower than this is dropped for the round, seconds
    connect_timeout_s: float = 10.0  # connecting and handshaking, seconds
    rejoin_interval_s: float = 0.5  # first wait before reconnecting a dropped worker, seconds (doubles, <= 10)
    max_message_bytes: int = 64 * 1024 * 1024  # largest frame sent or accepted, bytes

    def __post_init__(self) -> None:
        if not self.worker_urls:
            raise ConfigError("give at least one worker URL")
        if self.weights is not None:
            if len(self.weights) != len(self.worker_urls):
                raise ConfigError(f"{len(self.weights)} weights for {len(self.worker_urls)} workers")
            normalize_weights(self.weights)
        if (self.top_k is None) == (self.target_epsilon is None):
            raise ConfigError("give exactly one of --top-k and --target-epsilon")
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError("--top-k must be at least 1")
        if self.target_epsilon is not None and not 0 <= self.target_epsilon < 1:
            raise ConfigError("--target-epsilon must be in [0, 1)")
        if self.reconstruct not in RECONSTRUCTIONS:
            raise ConfigError(f"--reconstruct must be one of {RECONSTRUCTIONS}")
        if self.prob_codec not in VALUE_CODECS:
            raise ConfigError(f"probability codec must be one of {VALUE_CODECS}")
        if self.epsilon_scope not in EPSILON_SCOPES:
            raise ConfigError(f"--epsilon-scope must be one of {EPSILON_SCOPES}")
        if self.epsilon_scope != "position" and self.target_epsilon is None:
            raise ConfigError("--epsilon-scope applies to adaptive K: give --target-epsilon")
        if not 0 < self.quant_budget <= MAX_QUANT_BUDGET:
            raise ConfigError(f"--quant-budget must be in (0, {MAX_QUANT_BUDGET}]")
        if self.gamma < 0:
            raise ConfigError("--gamma must be >= 0")
        if self.round_timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ConfigError("timeouts must be positive")

    def weight_list(self) -> list[float]:
        return list(self.weights) if self.weights is not None else [1.0] * len(self.worker_urls)


@dataclass(frozen=True)
class WorkerRound:
    """One worker's part of one round."""

    url: str
    status: str  # "ok", "rejoined" (reconnected and re-prefilled this round), "dropped", "down"
    weight: float  # weight used this round after renormalisation; 0 when absent
    k: list[int] = field(default_factory=list)  # tokens sent per position
    epsilon: list[float] = field(default_factory=list)  # ε = ‖p − p̃‖₁ per position, as the worker reported it
    residual: list[float] = field(default_factory=list)  # 1 − Σ p̃ per position as received (≈ tail mass τ)
    bytes_up: int = 0  # request frame(s), bytes
    bytes_down: int = 0  # reply frame(s), bytes
    payload_bytes: int = 0  # top-K bit stream in the reply, bytes
    worker_ms: float = 0.0  # model compute on the worker, milliseconds
    roundtrip_ms: float = 0.0  # request sent to reply parsed, milliseconds
    error: str | None = None  # why the worker was dropped


@dataclass(frozen=True)
class AuditRound:
    """Audit figures of one round, per scored position."""

    delta: list[float]  # Δ = ‖p − p̂‖₁ of the aggregate
    bound: list[float]  # 2 Σ w_i ε_i with the exact ε_i = ‖p_i − p̃_i‖₁
    weighted_epsilon: list[float]  # Σ w_i ε_i with the exact ε
    drift: list[float]  # |α − α̂| per drafted position
    violations: list[str]  # failed bound checks (empty when all hold)


@dataclass(frozen=True)
class RoundStats:
    """Accounting of one round."""

    index: int
    drafted: int  # γ used this round, tokens
    accepted: int  # draft tokens kept, tokens
    emitted: list[int]  # token ids emitted this round
    workers: list[WorkerRound]
    weighted_epsilon: list[float]  # Σ w_i ε_i per position, as seen by the coordinator
    draft_ms: float  # drafting time, milliseconds
    round_ms: float  # whole round, milliseconds
    audit: AuditRound | None = None


@dataclass(frozen=True)
class FedResult:
    """A finished generation."""

    token_ids: list[int]
    text: str
    seed: int
    rounds: list[RoundStats]

    def summary(self) -> dict[str, Any]:
        rounds = self.rounds
        drafted = sum(r.drafted for r in rounds)
        accepted = sum(r.accepted for r in rounds)
        urls = sorted({w.url for r in rounds for w in r.workers})
        per_worker = {
            url: {
                "rounds_ok": sum(
                    1 for r in rounds for w in r.workers if w.url == url and w.status in ("ok", "rejoined")
                ),
                "rounds_missed": sum(
                    1 for r in rounds for w in r.workers if w.url == url and w.status in ("dropped", "down")
                ),
                "bytes_up": sum(w.bytes_up for r in rounds for w in r.workers if w.url == url),
                "bytes_down": sum(w.bytes_down for r in rounds for w in r.workers if w.url == url),
                "mean_k": _mean([k for r in rounds for w in r.workers if w.url == url for k in w.k]),
                "mean_epsilon": _mean([e for r in rounds for w in r.workers if w.url == url for e in w.epsilon]),
            }
            for url in urls
        }
        audits = [r.audit for r in rounds if r.audit is not None]
        out: dict[str, Any] = {
            "rounds": len(rounds),
            "tokens": len(self.token_ids),
            "drafted": drafted,
            "accepted": accepted,
            "acceptance": accepted / drafted if drafted else None,
            "tokens_per_round": len(self.token_ids) / len(rounds) if rounds else None,
            "workers": per_worker,
        }
        if audits:
            out["audit"] = {
                "mean_delta": _mean([d for a in audits for d in a.delta]),
                "mean_bound": _mean([b for a in audits for b in a.bound]),
                "max_drift": max([d for a in audits for d in a.drift], default=0.0),
                "violations": sum(len(a.violations) for a in audits),
            }
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "token_ids": self.token_ids,
            "text": self.text,
            "seed": self.seed,
            "summary": self.summary(),
            "rounds": [asdict(r) for r in self.rounds],
        }


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def aggregate_target(topks: Sequence[TopK], weights: Sequence[float], method: Reconstruction) -> torch.Tensor:
    """(n, V) aggregate p̂ = Σ w_i reconstruct(top-K_i), weights renormalised over the given workers."""
    return aggregate([reconstruct(t, method) for t in topks], weights)


def verify_against(
    draft: Sequence[int],
    draft_probs: torch.Tensor,
    p_hat: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator,
) -> Verdict:
    """Verify a draft against the aggregate p̂ (γ + 1, V): argmax when greedy, else lossless sampling.

    Sampling uses nucleus(p̂, top_p) as the target law; draft_probs (γ, V) is q after the same
    temperature / top-p.
    """
    if params.greedy:
        return greedy_verify(draft, p_hat)
    return speculative_verify(draft, draft_probs, nucleus(p_hat, params.top_p), generator)


class WorkerLink:
    """The coordinator's view of one worker: connection, cache contents, retry schedule."""

    def __init__(self, url: str, weight: float, config: CoordinatorConfig) -> None:
        self.url = url
        self.weight = weight
        self.config = config
        self.channel: Channel | None = None
        self.welcome: FedWelcome | None = None
        self.tokens: list[int] = []  # tokens the worker's cache holds, as far as we know
        self.seq = 0
        self.next_retry = 0.0  # monotonic time of the next reconnect attempt
        self.backoff_s = config.rejoin_interval_s

    @property
    def alive(self) -> bool:
        return self.channel is not None

    async def connect(self, hello: FedHello) -> FedWelcome:
        """Connect and handshake; a refused handshake raises its typed error."""
        cfg = self.config
        channel = await Channel.connect(
            self.url, max_message_bytes=cfg.max_message_bytes, timeout_s=cfg.connect_timeout_s
        )
        try:
            await channel.send_raw(encode_fed(hello))
            reply = await self._recv(channel, cfg.connect_timeout_s)
            if not isinstance(reply, FedWelcome):
                raise UnexpectedMessage(f"expected fed_welcome, got {reply.TYPE!r}")
            if reply.vocab_size != hello.vocab_size or reply.tokenizer_fingerprint != hello.tokenizer_fingerprint:
                raise HandshakeMismatch(f"worker {self.url} answered with another vocabulary or tokenizer")
        except BaseException:
            await _close_quietly(channel)
            raise
        self.channel, self.welcome, self.tokens, self.seq = channel, reply, [], 0
        self.backoff_s = cfg.rejoin_interval_s
        return reply

    async def _recv(self, channel: Channel, timeout_s: float) -> FedMessage:
        raw = await channel.recv_raw(timeout_s)
        reply = decode_fed(raw, max_bytes=websocket_max_size(self.config.max_message_bytes))
        if isinstance(reply, Error):
            raise error_from_code(reply.code, reply.message)
        return reply

    async def drop(self, reason: str) -> None:
        channel, self.channel = self.channel, None
        self.tokens = []
        self.next_retry = time.monotonic() + self.backoff_s
        self.backoff_s = min(10.0, 2 * self.backoff_s)
        log.warning("worker %s dropped: %s", self.url, reason)
        if channel is not None:
            await _close_quietly(channel)

    async def score(self, context: list[int], num_scored: int, temperature: float) -> tuple[FedScores, int, int]:
        """Bring the worker's cache to ``context`` and score its last positions; (reply, bytes up, bytes down)."""
        channel, welcome = self.channel, self.welcome
        if channel is None or welcome is None:
            raise TransportError("not connected")
        cfg = self.config
        keep = 0
        limit = min(len(self.tokens), len(context) - num_scored)
        while keep < limit and self.tokens[keep] == context[keep]:
            keep += 1
        up = down = 0
        # chunked prefill: no single message appends more than the worker's max_query_tokens
        while len(context) - keep > welcome.max_query_tokens:
            chunk = context[keep : keep + welcome.max_query_tokens]
            reply, u, d = await self._exchange(channel, keep, chunk, 1, 1.0, k=1)
            up, down, keep = up + u, down + d, keep + len(chunk)
            self.tokens = context[:keep]
        reply, u, d = await self._exchange(channel, keep, context[keep:], num_scored, temperature, k=cfg.top_k)
        self.tokens = list(context)
        return reply, up + u, down + d

    async def _exchange(
        self, channel: Channel, keep: int, tokens: list[int], num_scored: int, temperature: float, k: int | None
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
        data = encode_fed(request)
        await channel.send_raw(data)
        raw = await channel.recv_raw(cfg.round_timeout_s)
        reply = decode_fed(raw, max_bytes=websocket_max_size(cfg.max_message_bytes))
        if isinstance(reply, Error):
            raise error_from_code(reply.code, reply.message)
        if not isinstance(reply, FedScores):
            raise UnexpectedMessage(f"expected fed_scores, got {reply.TYPE!r}")
        if reply.seq != self.seq or reply.positions != num_scored:
            raise BadTensor(
                f"reply for round {reply.seq} with {reply.positions} positions, expected {self.seq}/{num_scored}"
            )
        return reply, len(data), len(raw)


async def _close_quietly(channel: Channel) -> None:
    try:
        await asyncio.wait_for(channel.close(), 2.0)
    except Exception:  # closing a dead connection may fail in many ways; nothing to do about it
        log.debug("closing a worker connection failed", exc_info=True)


class Coordinator:
    """Federated speculative generation. Use as ``async with Coordinator(cfg) as coord``."""

    def __init__(self, config: CoordinatorConfig, draft: LoadedModel | None = None) -> None:
        self.config = config
        self.draft = draft if draft is not None else load_model(config.draft_dir)
        self.links = [WorkerLink(u, w, config) for u, w in zip(config.worker_urls, config.weight_list(), strict=True)]
        self.hello = FedHello(
            vocab_size=self.draft.vocab_size,
            tokenizer_fingerprint=self.draft.tokenizer_fingerprint,
            auth_token=config.auth_token,
        )
        self._draft_lm = LocalSequence(self.draft.model)
        self.rounds: list[RoundStats] = []

    async def __aenter__(self) -> Coordinator:
        await self.connect()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def connect(self) -> None:
        """Connect every worker; any failure at start is fatal (misconfiguration)."""
        results = await asyncio.gather(*(link.connect(self.hello) for link in self.links), return_exceptions=True)
        failures = [(link, r) for link, r in zip(self.links, results, strict=True) if isinstance(r, BaseException)]
        if failures:
            await self.close()
            link, exc = failures[0]
            if isinstance(exc, SplitspecError):
                raise type(exc)(f"worker {link.url}: {exc}") from exc
            raise exc
        for link, r in zip(self.links, results, strict=True):
            if isinstance(r, FedWelcome):
                log.info("worker %s: %s, model %s", link.url, r.worker, r.model_fingerprint)

    async def close(self) -> None:
        for link in self.links:
            if link.channel is not None:
                channel, link.channel = link.channel, None
                await _close_quietly(channel)

    async def _rejoin(self) -> list[str]:
        """Try to reconnect dropped workers whose retry time has come; return the URLs that came back."""
        now = time.monotonic()
        due = [link for link in self.links if not link.alive and now >= link.next_retry]
        if not due:
            return []
        results = await asyncio.gather(*(link.connect(self.hello) for link in due), return_exceptions=True)
        back = []
        for link, r in zip(due, results, strict=True):
            if isinstance(r, BaseException):
                link.next_retry = time.monotonic() + link.backoff_s
                link.backoff_s = min(10.0, 2 * link.backoff_s)
                log.info("worker %s still unavailable: %s", link.url, r)
            else:
                log.warning("worker %s rejoined; its cache will be re-prefilled", link.url)
                back.append(link.url)
        return back

    def _draft(
        self, sequence: list[int], gamma: int, params: SamplingParams, generator: torch.Generator
    ) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """γ draft tokens, q (γ, V) after temperature / top-p, and q at the workers' temperature (audit)."""
        tokens: list[int] = []
        q_rows: list[torch.Tensor] = []
        audit_rows: list[torch.Tensor] = []
        t_eff = params.temperature if params.temperature > 0 else 1.0
        for _ in range(gamma):
            logits = self._draft_lm.logits_for(sequence + tokens, 1)[0]
            if params.greedy:
                token = int(logits.argmax())
                q = torch.zeros_like(logits)
                q[token] = 1.0
            else:
                q = probabilities(logits, params.temperature, params.top_p)
                token = int(torch.multinomial(q, 1, generator=generator))
            tokens.append(token)
            q_rows.append(q)
            audit_rows.append(probabilities(logits, t_eff))
        vocab = self.draft.vocab_size
        if not tokens:
            return [], torch.zeros(0, vocab), torch.zeros(0, vocab)
        return tokens, torch.stack(q_rows), torch.stack(audit_rows)

    async def _score_one(
        self, link: WorkerLink, context: list[int], num_scored: int, temperature: float
    ) -> tuple[FedScores, TopK, int, int, float]:
        t0 = time.perf_counter()
        reply, up, down = await asyncio.wait_for(
            link.score(context, num_scored, temperature), self.config.round_timeout_s
        )
        if reply.vocab_size != self.draft.vocab_size:
            raise BadTensor(f"reply over a vocabulary of {reply.vocab_size}, expected {self.draft.vocab_size}")
        topk = decode_topk(reply.stream, reply.positions, reply.vocab_size)
        return reply, topk, up, down, (time.perf_counter() - t0) * 1e3

    async def stream(
        self, prompt_ids: Sequence[int], max_new_tokens: int, params: SamplingParams, generator: torch.Generator
    ) -> AsyncIterator[int]:
        """Yield generated tokens as rounds complete; per-round figures land in ``self.rounds``."""
        if not prompt_ids:
            raise ConfigError("the prompt must hold at least one token")
        if max_new_tokens < 1:
            raise ConfigError("max_new_tokens must be at least 1")
        cfg = self.config
        sequence = list(prompt_ids)
        produced = 0
        eos = self.draft.eos_token_id
        worker_temperature = params.temperature if params.temperature > 0 else 1.0
        self.rounds = []
        self._draft_lm.reset()
        while produced < max_new_tokens:
            t_round = time.perf_counter()
            rejoined = set(await self._rejoin())
            gamma = min(cfg.gamma, max_new_tokens - produced - 1)
            t0 = time.perf_counter()
            draft, q, q_audit = await asyncio.to_thread(self._draft, sequence, gamma, params, generator)
            draft_ms = (time.perf_counter() - t0) * 1e3
            context = sequence + draft
            live = [link for link in self.links if link.alive]
            results = await asyncio.gather(
                *(self._score_one(link, context, gamma + 1, worker_temperature) for link in live),
                return_exceptions=True,
            )
            answered: list[tuple[WorkerLink, FedScores, TopK, int, int, float]] = []
            records: dict[str, WorkerRound] = {}
            for link, r in zip(live, results, strict=True):
                if isinstance(r, BaseException):
                    if not isinstance(r, (SplitspecError, TimeoutError, OSError)):
                        raise r  # a bug of ours (or cancellation), not a worker fault
                    reason = "timed out" if isinstance(r, TimeoutError) else f"{type(r).__name__}: {r}"
                    await link.drop(reason)
                    records[link.url] = WorkerRound(url=link.url, status="dropped", weight=0.0, error=reason)
                else:
                    answered.append((link, *r))
            if not answered:
                raise TransportError("every worker failed this round; cannot continue")
            weights = normalize_weights([a[0].weight for a in answered]).tolist()
            topks = [a[2] for a in answered]
            p_hat = aggregate_target(topks, weights, cfg.reconstruct)
            verdict = verify_against(draft, q, p_hat, params, generator)
            emitted = verdict.tokens(draft)
            eps_by_worker = [t.transmitted_epsilon() for t in topks]
            for (link, reply, topk, up, down, ms), w, eps in zip(answered, weights, eps_by_worker, strict=True):
                records[link.url] = WorkerRound(
                    url=link.url,
                    status="rejoined" if link.url in rejoined else "ok",
                    weight=w,
                    k=topk.counts.tolist(),
                    epsilon=[round(float(e), 8) for e in eps],
                    residual=[round(float(e), 8) for e in topk.residual_mass()],
                    bytes_up=up,
                    bytes_down=down,
                    payload_bytes=len(reply.stream),
                    worker_ms=reply.worker_ms,
                    roundtrip_ms=ms,
                )
            weighted_eps = sum(w * e for w, e in zip(weights, eps_by_worker, strict=True))
            audit = self._audit(answered, weights, q_audit) if cfg.audit else None
            if eos is not None and eos in emitted:
                emitted = emitted[: emitted.index(eos) + 1]
            emitted = emitted[: max_new_tokens - produced]
            ordered = [
                records.get(link.url, WorkerRound(url=link.url, status="down", weight=0.0)) for link in self.links
            ]
            self.rounds.append(
                RoundStats(
                    index=len(self.rounds),
                    drafted=gamma,
                    accepted=verdict.accepted,
                    emitted=list(emitted),
                    workers=ordered,
                    weighted_epsilon=[round(float(e), 8) for e in torch.as_tensor(weighted_eps).flatten()],
                    draft_ms=draft_ms,
                    round_ms=(time.perf_counter() - t_round) * 1e3,
                    audit=audit,
                )
            )
            log.debug("round %d: accepted %d/%d, emitted %s", len(self.rounds) - 1, verdict.accepted, gamma, emitted)
            for token in emitted:
                yield token
            produced += len(emitted)
            sequence.extend(emitted)
            if eos is not None and eos in emitted:
                return

    def _audit(
        self, answered: list[tuple[WorkerLink, FedScores, TopK, int, int, float]], weights: list[float], q: torch.Tensor
    ) -> AuditRound:
        fulls = [a[1].full for a in answered]
        if any(f is None for f in fulls):
            raise ProtocolError("audit mode: a worker did not send its full distributions")
        report = bound_report(
            [f for f in fulls if f is not None],
            [a[2] for a in answered],
            weights,
            self.config.reconstruct,
            draft=q,
        )
        violations = report.violations()
        for v in violations:
            log.warning("bound violated: %s", v)
        drift = report.drift
        return AuditRound(
            delta=[float(x) for x in report.delta],
            bound=[float(x) for x in report.bound],
            weighted_epsilon=[float(x) for x in report.weighted_epsilon],
            drift=[] if drift is None else [float(x) for x in drift],
            violations=violations,
        )

    async def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, params: SamplingParams) -> FedResult:
        """Generate up to ``max_new_tokens`` tokens; return them with the per-round figures."""
        generator, seed = params.generator()
        tokens = [t async for t in self.stream(prompt_ids, max_new_tokens, params, generator)]
        text = str(self.draft.tokenizer.decode(tokens))
        return FedResult(token_ids=tokens, text=text, seed=seed, rounds=list(self.rounds))
