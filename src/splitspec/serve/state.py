"""What every request shares: tokenizer, edge (and draft) weights, the speculation controller,
the session pool and the metrics. Built once when the server starts."""

from __future__ import annotations

import logging
from typing import Any

from splitspec.chat_template import end_of_turn_ids, has_chat_template
from splitspec.decoding.controller import SpeculationController
from splitspec.decoding.sampling import SamplingParams
from splitspec.decoding.speculative import make_drafters
from splitspec.edge.client import SplitClient
from splitspec.models.checkpoint import Checkpoint
from splitspec.serve.config import ServeConfig
from splitspec.serve.metrics import ServeMetrics
from splitspec.serve.pool import SessionPool
from splitspec.serve.prefix_cache import PrefixCache

log = logging.getLogger(__name__)


class ServeState:
    def __init__(self, config: ServeConfig) -> None:
        from transformers import AutoTokenizer

        self.config = config
        edge = config.edge
        self.tokenizer: Any = AutoTokenizer.from_pretrained(edge.model_dir, local_files_only=True)
        if config.chat_template is not None:  # --chat-template: for a checkpoint that ships none
            self.tokenizer.chat_template = config.chat_template
        self.templated = has_chat_template(self.tokenizer)
        model_config = Checkpoint(edge.model_dir).config
        self.max_positions = int(model_config.max_position_embeddings)  # prompt + completion, tokens
        self.vocab_size = int(model_config.vocab_size)
        # the first client loads (and checks the provenance of) the edge and draft weights; every
        # later one shares them, and shares one controller: link and acceptance estimates describe
        # the link and the model pair, so each request starts from what earlier ones measured
        first = SplitClient(edge)
        self.edge_model, self.draft_model = first.model, first.draft_model
        drafters = list(make_drafters(config.speculate, SamplingParams(), self.draft_model))
        self.controller = SpeculationController(drafters) if drafters else None
        self.eos_token_ids = first.eos_token_ids
        # a chat reply also ends at the template's end-of-turn token (<|im_end|>, <|eot_id|>, ...)
        self.chat_stop_ids = self.eos_token_ids | (end_of_turn_ids(self.tokenizer) if self.templated else frozenset())
        self.metrics = ServeMetrics()
        self.pool = SessionPool(
            self.new_client,
            config.max_active,
            config.queue_timeout_s,
            PrefixCache(config.prefix_cache_entries, config.prefix_cache_bytes),
            reuse=config.prefix_reuse,
        )

    def new_client(self) -> SplitClient:
        return SplitClient(self.config.edge, self.edge_model, self.draft_model, self.controller)

    def decode(self, token_ids: list[int]) -> str:
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))
