"""A whole local causal LM with an incremental KV cache, as workers, drafters and references use it.

:class:`IncrementalLM` keeps a ``DynamicCache`` and the token ids it holds. Asked for the logits
of the last positions of a sequence, it keeps the longest cached prefix of that sequence, crops
the rest, and feeds only the new tokens. transformers 5.x changed ``DynamicCache.crop``: it now
takes a non-positive count of tokens to *remove* (``crop(-n)``), no longer the length to keep;
:meth:`IncrementalLM.truncate` hides that. Sliding-window layers that have passed their window
cannot roll back at all; then the kept prefix is re-prefilled (correct, but it costs a forward).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedTokenizerBase

from splitspec.exceptions import CheckpointError, ConfigError
from splitspec.models.checkpoint import fingerprint

log = logging.getLogger(__name__)


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A stable hash of the tokenizer's vocabulary (token -> id) and special tokens (hex, 16 chars)."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    special = sorted((str(k), str(v)) for k, v in tokenizer.special_tokens_map.items())
    blob = json.dumps({"vocab": vocab, "special": special}, ensure_ascii=False).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


@dataclass(frozen=True)
class LoadedModel:
    """A checkpoint loaded whole, with its tokenizer and identity."""

    model: Any  # a transformers PreTrainedModel for causal LM, eval mode
    tokenizer: PreTrainedTokenizerBase
    vocab_size: int  # logits width, tokens
    tokenizer_fingerprint: str
    model_fingerprint: str
    max_positions: int  # tokens

    @property
    def eos_token_id(self) -> int | None:
        eos = self.tokenizer.eos_token_id
        return eos if isinstance(eos, int) else None


def load_model(directory: str | Path, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load a whole HF causal LM and its tokenizer from a local directory (never downloads)."""
    path = Path(directory)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path} is not a checkpoint directory: config.json is missing")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: cannot load the tokenizer ({exc}); federated roles need one") from None
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).eval()
    config = model.config
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        vocab_size=int(config.vocab_size),
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        model_fingerprint=fingerprint(config),
        max_positions=int(getattr(config, "max_position_embeddings", 1 << 20)),
    )


class IncrementalLM:
    """One sequence's forward passes through a whole model, reusing its KV cache."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.cache = DynamicCache(config=model.config)
        self.tokens: list[int] = []  # the token ids whose keys/values the cache holds, in order

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.tokens = []

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` cached tokens (transformers 5.x: ``crop`` takes minus the count removed)."""
        if not 0 <= length <= len(self.tokens):
            raise ConfigError(f"cannot truncate a cache of {len(self.tokens)} tokens to {length}")
        remove = len(self.tokens) - length
        if not remove:
            return
        kept = self.tokens[:length]
        if length > 0:
            try:
                self.cache.crop(-remove)
                self.tokens = kept
                return
            except (RuntimeError, ValueError) as exc:  # sliding-window layers past their window cannot roll back
                log.debug("cache cannot roll back (%s): re-prefilling %d tokens", exc, length)
        self.reset()
        if kept:
            self.append(kept, 1)

    @torch.no_grad()
    def append(self, tokens: Sequence[int], num_scored: int) -> torch.Tensor:
        """Feed ``tokens`` after the cached ones; (num_scored, V) float32 logits of the last positions."""
        if not tokens or not 1 <= num_scored <= len(tokens):
            raise ConfigError(f"need 1 <= num_scored ({num_scored}) <= new tokens ({len(tokens)})")
        ids = torch.tensor([list(tokens)], dtype=torch.long)
        out = self.model(input_ids=ids, past_key_values=self.cache, use_cache=True, logits_to_keep=num_scored)
        self.cache = out.past_key_values
        self.tokens.extend(int(t) for t in tokens)
        scored: torch.Tensor = out.logits[0, -num_scored:].float()  # (num_scored, V)
        return scored

    def logits_for(self, sequence: Sequence[int], num_scored: int = 1) -> torch.Tensor:
        """(num_scored, V) logits for the last ``num_scored`` positions of ``sequence``, reusing the cache."""
        common = 0
        limit = min(len(self.tokens), len(sequence) - num_scored)
        while common < limit and self.tokens[common] == sequence[common]:
            common += 1
        self.truncate(common)
        return self.append(list(sequence[common:]), num_scored)
