"""A whole local model with its tokenizer and identity, as federated workers and the coordinator use it.

The model is a :class:`splitspec.models.stack.FullModel` (the one way this package runs a whole
model) and a sequence on it is a :class:`splitspec.decoding.local.LocalSequence`.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from splitspec.models.checkpoint import Checkpoint, fingerprint, generation_stop_ids, load_tokenizer
from splitspec.models.dtype_choices import AUTO
from splitspec.models.loading import load_full, resolve_dtype
from splitspec.models.stack import FullModel


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A stable hash of the tokenizer's vocabulary (token -> id) and special tokens (hex, 16 chars)."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    special = sorted((str(k), str(v)) for k, v in tokenizer.special_tokens_map.items())
    blob = json.dumps({"vocab": vocab, "special": special}, ensure_ascii=False).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


@dataclass(frozen=True)
class LoadedModel:
    """A checkpoint loaded whole, with its tokenizer and identity."""

    model: FullModel
    tokenizer: PreTrainedTokenizerBase
    vocab_size: int  # logits width, tokens
    tokenizer_fingerprint: str
    model_fingerprint: str
    max_positions: int  # tokens
    # config.json's and generation_config.json's end-of-sequence ids (an instruct model's end of turn is there)
    generation_stops: frozenset[int] = frozenset()

    @property
    def eos_token_id(self) -> int | None:
        eos = self.tokenizer.eos_token_id
        return eos if isinstance(eos, int) else None

    @property
    def stop_ids(self) -> frozenset[int]:
        """Every id that ends a generation: the tokenizer's end-of-sequence token and the checkpoint's."""
        eos = self.eos_token_id
        return self.generation_stops | ({eos} if eos is not None else set())


def load_model(directory: str | Path, dtype: str = AUTO, device: torch.device | None = None) -> LoadedModel:
    """Load a whole checkpoint onto ``device`` (default CPU), in ``dtype`` (auto: its published dtype
    fitted to the device, :mod:`splitspec.models.precision`), and its tokenizer; never downloads."""
    path = Path(directory)
    ckpt = Checkpoint(path)
    tokenizer = load_tokenizer(path)
    device = device or torch.device("cpu")
    model = load_full(ckpt, resolve_dtype(ckpt, dtype, device)[0], device=device)
    config = ckpt.config
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        vocab_size=int(config.vocab_size),
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        model_fingerprint=fingerprint(config),
        max_positions=int(getattr(config, "max_position_embeddings", 1 << 20)),
        generation_stops=generation_stop_ids(path, config),
    )
