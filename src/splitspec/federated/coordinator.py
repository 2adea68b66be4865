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
   tokens follow p̂ exactly (after the run's top-k, then top-p, both applied to p̂ as
   :func:`splitspec.decoding.sampling.probabilities` applies them to logits).

Workers apply the temperature before their top-K (greedy runs, ``SamplingParams.greedy``, use T = 1
there); the aggregate of tempered laws is the target. A worker that times out, disconnects or sends a
bad reply is dropped for the round (logged) and the others' weights are renormalised; the coordinator
reconnects it in the background (a worker slow to accept costs no round) and, once connected, it joins
at the next round boundary with its cache re-prefilled from scratch. A connection the worker closed
between rounds (its idle timeout) is reconnected the same way, and when no worker is left connected
the round waits for those reconnections. A round in which every worker failed (or every one with a
positive weight) waits for one to rejoin, up to ``CoordinatorConfig.rejoin_wait_s()`` (the first
reconnection's backoff plus one connection attempt), and is scored again with the same draft; only
then does the generation fail. Handshake refusals (vocabulary or tokenizer mismatch, auth) at start
are fatal: they mean a misconfiguration, not a fault; a worker that comes back with another model
than the one it first served is refused (logged as an error) and stays dropped.

Every round records K sent, ε per worker and position, bytes each way per worker, accepted
tokens; in audit mode the workers also return their full laws and the round records the true
aggregation bias Δ, the acceptance-rate drift and the bound checks (violations are logged).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from types import TracebackType
from typing import NamedTuple

import torch

from splitspec.decoding.acceptance import Verdict, greedy_verify, speculative_verify
from splitspec.decoding.local import LocalSequence
from splitspec.decoding.sampling import SamplingParams, probabilities
from splitspec.devices import HostStaging, resolve_device
from splitspec.exceptions import (
    BadTensor,
    ConfigError,
    HandshakeMismatch,
    ProtocolError,
    SplitspecError,
    TransportError,
)
from splitspec.federated.codec import decode_topk
from splitspec.federated.config import CoordinatorConfig, check_temperature
from splitspec.federated.link import WorkerLink, close_quietly
from splitspec.federated.lm import LoadedModel, load_model
from splitspec.federated.records import AuditRound, FedResult, RoundStats, WorkerRound
from splitspec.federated.topk import (
    Reconstruction,
    TopK,
    aggregate,
    bound_report,
    distribution_error,
    normalize_weights,
    nucleus,
    reconstruct,
    scoring_temperature,
    top_k_filter,
)
from splitspec.protocol.fed import FedHello, FedScores, FedWelcome
from splitspec.transport.client import Channel

log = logging.getLogger(__name__)
FULL_SUM_TOLERANCE = 1e-3  # audit: how far from 1 a worker's full law may sum (float32 over a large vocabulary)


class _Answer(NamedTuple):
    """One worker's answer in one round."""

    link: WorkerLink
    reply: FedScores
    topk: TopK  # decoded from reply.stream
    bytes_up: int  # request frame(s), bytes
    bytes_down: int  # reply frame(s), bytes
    roundtrip_ms: float  # request sent to reply decoded, milliseconds

    def record(self, weight: float, epsilon: torch.Tensor, *, rejoined: bool, error: str | None) -> WorkerRound:
        """This answer as the worker's part of the round's figures (``error``: why it was dropped this round)."""
        return WorkerRound(
            url=self.link.url,
            status="rejoined" if rejoined else "ok",
            weight=weight,
            k=self.topk.counts.tolist(),
            epsilon=[round(float(e), 8) for e in epsilon],
            residual=[round(float(e), 8) for e in self.topk.residual_mass()],
            bytes_up=self.bytes_up,
            bytes_down=self.bytes_down,
            payload_bytes=len(self.reply.stream),
            worker_ms=self.reply.worker_ms,
            roundtrip_ms=self.roundtrip_ms,
            error=error,
        )


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

    Sampling uses nucleus(top_k_filter(p̂, top_k), top_p) as the target law (the order of
    :func:`splitspec.decoding.sampling.probabilities`); draft_probs (γ, V) is q after the same
    temperature / top-k / top-p, the law the draft was drawn from, so acceptance stays lossless.
    """
    if params.greedy:
        return greedy_verify(draft, p_hat)
    target = nucleus(top_k_filter(p_hat, params.top_k), params.top_p)
    return speculative_verify(draft, draft_probs, target, generator)


class Coordinator:
    """Federated speculative generation. Use as ``async with Coordinator(cfg) as coord``."""

    def __init__(self, config: CoordinatorConfig, draft: LoadedModel | None = None) -> None:
        self.config = config
        device = resolve_device(config.device) if draft is None else draft.model.device
        self.draft = draft if draft is not None else load_model(config.draft_dir, config.dtype, device)
        # the target is aggregated on the host from the workers' replies, so drafts are drawn
        # there too: each drafted position's logits cross once
        self._staging = HostStaging(device)
        self.links = [WorkerLink(u, w, config) for u, w in zip(config.worker_urls, config.weight_list(), strict=True)]
        self.hello = FedHello(
            vocab_size=self.draft.vocab_size,
            tokenizer_fingerprint=self.draft.tokenizer_fingerprint,
            auth_token=config.auth_token,
        )
        self._draft_lm = LocalSequence(self.draft.model)
        self.rounds: list[RoundStats] = []
        # background reconnections of dropped workers: a link joins at the round boundary after its task finished
        self._reconnecting: dict[WorkerLink, asyncio.Task[tuple[Channel, FedWelcome]]] = {}

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
        tasks = list(self._reconnecting.values())
        self._reconnecting.clear()
        for task in tasks:
            task.cancel()
        for r in await asyncio.gather(*tasks, return_exceptions=True):
            if isinstance(r, tuple):  # connected before it was cancelled, never used
                await close_quietly(r[0])
        for link in self.links:
            if link.channel is not None:
                channel, link.channel = link.channel, None
                await close_quietly(channel)

    async def _rejoin(self) -> tuple[set[str], dict[str, WorkerRound]]:
        """At a round boundary: the URLs of the workers that rejoin, and records of connections found closed.

        Dropped workers reconnect in background tasks: one whose host accepts connections but never
        answers costs its task up to connect_timeout_s, not every round it is due. A link whose
        reconnection finished joins here (its cache is re-prefilled this round). A connection the
        worker closed since the last round (its idle timeout: a coordinator idle for minutes finds every
        connection closed) is reconnected at once; when no worker is left connected, the round has
        nothing else to do and waits for the reconnections in flight.
        """
        dropped: dict[str, WorkerRound] = {}
        for link in self.links:
            if link.closed:
                reason = "the worker closed the connection"
                await link.drop(reason, backoff=False)
                dropped[link.url] = WorkerRound(url=link.url, status="dropped", weight=0.0, error=reason)
        back = self._adopt_reconnected()
        self._start_reconnects()
        if self._reconnecting and not any(link.alive for link in self.links):
            await asyncio.wait(list(self._reconnecting.values()))
            back |= self._adopt_reconnected()
        return back, dropped

    def _adopt_reconnected(self) -> set[str]:
        """Use the connections whose background task finished; the URLs that came back."""
        back: set[str] = set()
        for link, task in list(self._reconnecting.items()):
            if not task.done():
                continue
            del self._reconnecting[link]
            exc = task.exception()  # never cancelled here: only close() cancels, after clearing the dict
            if isinstance(exc, HandshakeMismatch):  # another model or tokenizer now: a misconfiguration
                log.error("worker %s refused: %s", link.url, exc)
                continue
            if exc is not None:
                log.info("worker %s still unavailable: %s", link.url, exc)
                continue
            link.adopt(*task.result())
            log.warning("worker %s rejoined; its cache will be re-prefilled", link.url)
            back.add(link.url)
        return back

    async def _await_rejoin(self, deadline: float) -> set[str]:
        """Wait until a dropped worker is connected again; the URLs that came back (none: ``deadline`` passed).

        Reconnections follow each worker's retry schedule; one still in flight at the deadline goes on in the
        background (a later round adopts it).
        """
        while True:
            back = self._adopt_reconnected()
            if back:
                return back
            self._start_reconnects()
            now = time.monotonic()
            if now >= deadline:
                return back
            due = [link.next_retry for link in self.links if not link.alive and link not in self._reconnecting]
            wait_s = min([deadline, *due]) - now  # <= 0 for one that fell due meanwhile: started next turn
            pending = list(self._reconnecting.values())
            if pending:
                await asyncio.wait(pending, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
            else:
                await asyncio.sleep(wait_s)

    def _start_reconnects(self) -> None:
        """Start a background reconnection of every dropped worker whose retry time has come."""
        now = time.monotonic()
        for link in self.links:
            if not link.alive and link not in self._reconnecting and now >= link.next_retry:
                self._reconnecting[link] = asyncio.get_running_loop().create_task(self._reopen(link))

    async def _reopen(self, link: WorkerLink) -> tuple[Channel, FedWelcome]:
        try:
            return await link.open(self.hello)
        except Exception:  # scheduled from when it failed; logged when the round boundary reads it
            link.defer_retry()
            raise

    def _draft(
        self, sequence: list[int], gamma: int, params: SamplingParams, generator: torch.Generator
    ) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """γ draft tokens, q (γ, V) after temperature / top-p, and q at the workers' temperature (audit)."""
        tokens: list[int] = []
        q_rows: list[torch.Tensor] = []
        audit_rows: list[torch.Tensor] = []
        t_eff = scoring_temperature(params.temperature)  # the workers' temperature (see _round)
        for _ in range(gamma):
            logits = self._staging.to_host(self._draft_lm.logits_for(sequence + tokens, 1)[0])  # (V,)
            if params.greedy:
                token = int(logits.argmax())
                q = torch.zeros_like(logits)
                q[token] = 1.0
            else:
                q = params.probabilities(logits)
                token = int(torch.multinomial(q, 1, generator=generator))
            tokens.append(token)
            q_rows.append(q)
            audit_rows.append(probabilities(logits, t_eff))
        vocab = self.draft.vocab_size
        if not tokens:
            return [], torch.zeros(0, vocab), torch.zeros(0, vocab)
        return tokens, torch.stack(q_rows), torch.stack(audit_rows)

    async def _score_one(self, link: WorkerLink, context: list[int], num_scored: int, temperature: float) -> _Answer:
        t0 = time.perf_counter()
        # each message waits round_timeout_s (link.score): a rejoining worker's prefill, in several messages, may
        # take longer in all (one timeout for all of them dropped it on every rejoin of a long context)
        reply, up, down = await link.score(context, num_scored, temperature)
        if reply.vocab_size != self.draft.vocab_size:
            raise BadTensor(f"reply over a vocabulary of {reply.vocab_size}, expected {self.draft.vocab_size}")
        # decoding costs CPU in proportion to the reply: off the event loop, which keeps serving
        # the other workers' links; a count above the request's K is refused before allocation
        if self.config.audit:  # a worker failing these is dropped, not the round
            if reply.full is None:
                raise ProtocolError("audit mode: the worker did not send its full distributions")
            # the protocol checks only their size; NaN or negative laws made Δ NaN and passed every bound check
            problem = distribution_error(reply.full, FULL_SUM_TOLERANCE)
            if problem is not None:
                raise BadTensor(f"audit mode: the worker's full distributions are not probability laws: {problem}")
        cap = self.config.k_cap(reply.vocab_size)
        topk = await asyncio.to_thread(decode_topk, reply.stream, reply.positions, reply.vocab_size, cap)
        return _Answer(link, reply, topk, up, down, (time.perf_counter() - t0) * 1e3)

    async def _score_all(
        self, context: list[int], num_scored: int, temperature: float
    ) -> tuple[list[_Answer], dict[str, WorkerRound]]:
        """Every live worker scores ``context`` concurrently; the answers (maybe none), records of the dropped ones."""
        live = [link for link in self.links if link.alive]
        results = await asyncio.gather(
            *(self._score_one(link, context, num_scored, temperature) for link in live), return_exceptions=True
        )
        answered: list[_Answer] = []
        dropped: dict[str, WorkerRound] = {}
        for link, r in zip(live, results, strict=True):
            if isinstance(r, BaseException):
                if not isinstance(r, (SplitspecError, TimeoutError, OSError)):
                    raise r  # a bug of ours (or cancellation), not a worker fault
                timed_out = isinstance(r, TimeoutError) or isinstance(r.__cause__, TimeoutError)  # a message's wait
                reason = "timed out" if timed_out else f"{type(r).__name__}: {r}"
                await link.drop(reason)
                dropped[link.url] = WorkerRound(url=link.url, status="dropped", weight=0.0, error=reason)
            else:
                answered.append(r)
        return answered, dropped

    async def _score_until_answered(
        self, context: list[int], num_scored: int, temperature: float, rejoined: set[str]
    ) -> tuple[list[_Answer], dict[str, WorkerRound]]:
        """:meth:`_score_all`, again after a rejoin while no worker with a positive weight answered.

        Up to ``rejoin_wait_s()`` from the first such try; ``rejoined`` gains the URLs that came back.
        """
        answered, dropped = await self._score_all(context, num_scored, temperature)
        records = dict(dropped)
        deadline: float | None = None
        while sum(a.link.weight for a in answered) <= 0:
            wait_s = self.config.rejoin_wait_s()
            if deadline is None:
                deadline = time.monotonic() + wait_s
                log.warning("no worker with a positive weight answered; waiting up to %.1f s for a rejoin", wait_s)
            back = await self._await_rejoin(deadline)
            if not back:
                who = "every worker with a positive weight" if answered else "every worker"
                raise TransportError(f"{who} failed this round and none rejoined within {wait_s:g} s; cannot continue")
            rejoined.update(back)
            answered, dropped = await self._score_all(context, num_scored, temperature)
            records.update(dropped)
        return answered, records

    async def stream(
        self, prompt_ids: Sequence[int], max_new_tokens: int, params: SamplingParams, generator: torch.Generator
    ) -> AsyncIterator[int]:
        """Yield generated tokens as rounds complete; per-round figures land in ``self.rounds``."""
        if not prompt_ids:
            raise ConfigError("the prompt must hold at least one token")
        if max_new_tokens < 1:
            raise ConfigError("max_new_tokens must be at least 1")
        check_temperature(params.temperature)
        sequence = list(prompt_ids)
        produced = 0
        stops = self.draft.stop_ids
        self.rounds = []
        self._draft_lm.reset()
        while produced < max_new_tokens:
            emitted = await self._round(sequence, max_new_tokens - produced, params, generator)
            for token in emitted:
                yield token
            produced += len(emitted)
            sequence.extend(emitted)
            if stops.intersection(emitted):
                return

    async def _round(
        self, sequence: list[int], budget: int, params: SamplingParams, generator: torch.Generator
    ) -> list[int]:
        """One round after ``sequence``: draft, score, verify; appends its RoundStats, returns the emitted tokens.

        ``budget`` is how many tokens may still be emitted (the last round drafts fewer).
        """
        cfg = self.config
        t_round = time.perf_counter()
        rejoined, records = await self._rejoin()
        gamma = min(cfg.gamma, budget - 1)
        t0 = time.perf_counter()
        draft, q, q_audit = await asyncio.to_thread(self._draft, sequence, gamma, params, generator)
        draft_ms = (time.perf_counter() - t0) * 1e3
        # greedy (T below GREEDY_BELOW, not only 0) verifies on the argmax of the T = 1 aggregate: a tiny T
        # would make every worker's law one-hot and the aggregate a vote
        worker_temperature = scoring_temperature(params.temperature)
        # a round no worker answered waits for a rejoin and is scored again, with the same draft
        answered, dropped = await self._score_until_answered(sequence + draft, gamma + 1, worker_temperature, rejoined)
        records.update(dropped)
        weights = normalize_weights([a.link.weight for a in answered]).tolist()
        topks = [a.topk for a in answered]
        p_hat = aggregate_target(topks, weights, cfg.reconstruct)
        verdict = verify_against(draft, q, p_hat, params, generator)
        emitted = verdict.tokens(draft)
        eps_by_worker = [t.transmitted_epsilon() for t in topks]
        for a, w, eps in zip(answered, weights, eps_by_worker, strict=True):
            earlier = records.get(a.link.url)  # dropped earlier this round, then rejoined
            records[a.link.url] = a.record(
                w, eps, rejoined=a.link.url in rejoined, error=None if earlier is None else earlier.error
            )
        weighted_eps = sum(w * e for w, e in zip(weights, eps_by_worker, strict=True))
        audit = self._audit(answered, weights, q_audit) if cfg.audit else None
        stop = next((i for i, t in enumerate(emitted) if t in self.draft.stop_ids), None)
        if stop is not None:  # the first end-of-sequence token ends the answer (an instruct model's end of turn too)
            emitted = emitted[: stop + 1]
        emitted = emitted[:budget]
        # a worker that neither answered nor was dropped this round was already down
        workers = [records.get(link.url, WorkerRound(url=link.url, status="down", weight=0.0)) for link in self.links]
        self.rounds.append(
            RoundStats(
                index=len(self.rounds),
                drafted=gamma,
                accepted=verdict.accepted,
                emitted=list(emitted),
                workers=workers,
                weighted_epsilon=[round(float(e), 8) for e in torch.as_tensor(weighted_eps).flatten()],
                draft_ms=draft_ms,
                round_ms=(time.perf_counter() - t_round) * 1e3,
                audit=audit,
            )
        )
        log.debug("round %d: accepted %d/%d, emitted %s", len(self.rounds) - 1, verdict.accepted, gamma, emitted)
        return emitted

    def _audit(self, answered: list[_Answer], weights: list[float], q: torch.Tensor) -> AuditRound:
        fulls = [a.reply.full for a in answered if a.reply.full is not None]  # every one: _score_one checks
        report = bound_report(
            fulls,
            [a.topk for a in answered],
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
