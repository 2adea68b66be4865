"""What every request shares: tokenizer, the edge runtime (weights, loaded and checked once), the
edge engine (batched head and tail, multiplexed trunk connections), the link's step-time
estimates, the session pool and the metrics. Built once when the server starts."""

from __future__ import annotations

import logging
from typing import Any

from splitspec.chat_template import end_of_turn_ids, has_chat_template
from splitspec.decoding.sampling import SamplingParams
from splitspec.decoding.speculative import make_drafters
from splitspec.edge.client import SplitClient
from splitspec.edge.engine import EdgeEngine
from splitspec.edge.runtime import EdgeRuntime
from splitspec.models.checkpoint import Checkpoint, load_tokenizer
from splitspec.serve.config import ServeConfig
from splitspec.serve.logprobs import TokenBytes
from splitspec.serve.metrics import ServeMetrics
from splitspec.serve.pool import SessionPool
from splitspec.serve.prefix_cache import PrefixCache
from splitspec.serve.sampling_defaults import sampling_defaults

log = logging.getLogger(__name__)


class ServeState:
    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        edge = config.edge
        # a directory that is no checkpoint, or holds no tokenizer, is one CheckpointError line (a traceback before)
        self.tokenizer: Any = load_tokenizer(edge.model_dir)
        if config.chat_template is not None:  # --chat-template: for a checkpoint that ships none
            self.tokenizer.chat_template = config.chat_template
        self.templated = has_chat_template(self.tokenizer)
        model_config = Checkpoint(edge.model_dir).config
        self.max_positions = int(model_config.max_position_embeddings)  # prompt + completion, tokens
        self.vocab_size = int(model_config.vocab_size)
        # the runtime loads (and checks the provenance of) the edge and draft weights once; every
        # request's sequence is one more sequence of the one engine: its head, tail and trunk steps are
        # batched with the others'. Each sequence learns its own acceptance; step times describe the
        # link, so they are the engine's, shared (``controller`` is the server-wide view of them)
        self.runtime = EdgeRuntime(edge)
        if self.runtime.cache_size is not None:  # --compile: the edge's static KV holds this many positions, no more
            self.max_positions = min(self.max_positions, self.runtime.cache_size)
        self.engine = EdgeEngine(self.runtime)
        self.edge_model, self.draft_model = self.runtime.model, self.runtime.draft_model
        runtime = self.runtime
        drafters = list(
            make_drafters(config.speculate, SamplingParams(), self.draft_model, None, runtime.draft_head, runtime.ends)
        )
        self.controller = self.engine.population(drafters) if drafters else None
        self.eos_token_ids = self.runtime.eos_token_ids
        # what a request that leaves temperature, top_p or top_k unset samples with
        self.sampling_defaults = sampling_defaults(runtime.published_sampling, config.generation_config)
        # a chat reply also ends at the template's end-of-turn token (<|im_end|>, <|eot_id|>, ...)
        self.chat_stop_ids = self.eos_token_ids | (end_of_turn_ids(self.tokenizer) if self.templated else frozenset())
        self.metrics = ServeMetrics(worker=config.worker)
        self.metrics.watch_engine(self.engine)
        self.pool = SessionPool(
            self.new_client,
            config.max_active,
            config.queue_timeout_s,
            PrefixCache(config.prefix_cache_entries, config.prefix_cache_bytes),
            reuse=config.prefix_reuse,
        )

        self._token_bytes: TokenBytes | None = None

    @property
    def token_bytes(self) -> TokenBytes:
        """Each token's exact bytes, for logprobs (made on first use: wrapping the tokenizer takes ~1 s)."""
        if self._token_bytes is None:
            self._token_bytes = TokenBytes(self.tokenizer, self.vocab_size)
        return self._token_bytes

    def new_client(self) -> SplitClient:
        """A new sequence of the engine (no weights loaded, no connection of its own)."""
        return SplitClient(self.config.edge, engine=self.engine)

    async def close(self) -> None:
        """Close every pooled session, then the engine's connections and workers."""
        await self.pool.close()
        await self.engine.close()

    def decode(self, token_ids: list[int], skip_special: bool = True) -> str:
        """The text of ``token_ids``; ``skip_special`` False keeps special tokens' text (vLLM's
        ``skip_special_tokens: false``)."""
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=skip_special))
