"""What an edge process loads once, whatever number of sequences it serves.

:class:`EdgeRuntime` reads the checkpoint's edge weights, the draft model and the tokenizer-side
facts (stop tokens, published sampling) once; checks the edge weights' provenance once (with a
divergence record that hashes every edge tensor, so doing it per session would rehash them each
time); works out the trunk fingerprint the cloud must present once; and fixes the device and the
compute dtype. Every :class:`~splitspec.edge.sequence.EdgeSequence` of an engine shares it; none of
it changes while sequences run. The one exception comes before any of them has run a step: under
``--dtype auto`` the edge computes in the trunk's dtype, which the first Welcome states
(:meth:`EdgeRuntime.follow_trunk_dtype`); if the edge layers were loaded in another, they are
loaded again in it, and the dtype is pinned for every later connection.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import torch
from torch import nn

from splitspec.decoding.drafters import warm_up_draft_model
from splitspec.decoding.eagle import check_draft_head, warm_up_draft_head
from splitspec.decoding.published import published_sampling, sampling_settings
from splitspec.decoding.sampling import SamplingParams
from splitspec.devices import HostStaging, resolve_device
from splitspec.edge.config import EdgeConfig
from splitspec.edge.provenance import check_edge_weights, send_noise
from splitspec.exceptions import CheckpointError, ConfigError, HandshakeMismatch
from splitspec.models.checkpoint import Checkpoint, fingerprint, generation_stop_ids, load_tokenizer
from splitspec.models.features import edge_feature_sources
from splitspec.models.kv_cache import KVCache
from splitspec.models.loading import load_edge, load_full, resolve_dtype
from splitspec.models.precision import dtype_from_name
from splitspec.models.precision import dtype_name as dtype_name_of
from splitspec.models.prepack import PackedLinear, packed_is_faster, prepack_linears, prepack_obstacle
from splitspec.models.quantization import published_method
from splitspec.models.split import SplitPlan
from splitspec.models.stack import EdgeModel, FullModel, ModelEnds
from splitspec.models.static_kv import StaticKVCache, static_cache_size
from splitspec.models.trunk_fingerprint import trunk_fingerprint
from splitspec.models.warm_up import WARM_UP_WIDTHS, pays_cold_start, warm_up_edge
from splitspec.protocol.codec import WIRE_CODECS
from splitspec.protocol.messages import AUTO_DTYPE, Hello
from splitspec.protocol.trunk_fingerprint import TrunkFingerprint
from splitspec.transport import LOOPBACK_HOSTS

if TYPE_CHECKING:
    from splitspec.models.draft_head import DraftHead

log = logging.getLogger(__name__)


PACKED_HEAD_MAX_BYTES = 256 * 2**20  # a bigger LM head keeps PyTorch's matmul: packing it would cost a copy, bytes


def prepack_pieces(model: ModelEnds, stacks: Sequence[nn.Module], measure: bool) -> int:
    """Prepack the linear layers of ``stacks`` and ``model``'s LM head up to :data:`PACKED_HEAD_MAX_BYTES`
    (``measure``: each shape only where it times faster packed on this CPU); return how many were packed.
    The packed head sits beside the embedding's weight (a tied head) or the skeleton's: one more copy of it."""
    packed = prepack_linears(*stacks, where_faster=measure)
    head = model.lm_head
    if (
        isinstance(head, nn.Linear)
        and head.weight.nelement() * head.weight.element_size() <= PACKED_HEAD_MAX_BYTES
        and (not measure or packed_is_faster(head))
    ):
        model.lm_head = PackedLinear(head)
        packed += 1
    return packed


def _warn_if_unencrypted(config: EdgeConfig) -> None:
    """Say at start-up that hidden states (and a shared secret) would cross a network in the clear."""
    url = urlsplit(config.cloud_url)
    if url.scheme == "ws" and url.hostname not in LOOPBACK_HOSTS:
        secret = "the shared secret and the hidden states" if config.auth_token else "the hidden states"
        log.warning("%s travel unencrypted to %s: use a wss:// trunk (cloud serve --tls-cert)", secret, url.hostname)


class EdgeRuntime:
    """The edge's weights, device, dtype and handshake, loaded and checked once per process.

    ``edge`` and ``draft_model`` may be passed in already loaded (a benchmark that loads once for
    many configurations); they hold no per-sequence state.
    """

    def __init__(self, config: EdgeConfig, edge: EdgeModel | None = None, draft_model: FullModel | None = None) -> None:
        self.config = config
        ckpt = Checkpoint(config.model_dir)
        self.checkpoint = ckpt
        self.plan = SplitPlan(ckpt.config.num_hidden_layers, *config.edge_layers)
        self.provenance = check_edge_weights(
            config.model_dir, self.plan, config.published_model_dir, config.allow_stock_edge_weights
        )
        self.send_noise = send_noise(config.model_dir)  # the defence the edge layers were trained with
        _warn_if_unencrypted(config)
        if config.wire_codec not in WIRE_CODECS:
            raise ConfigError(f"--wire-codec must be one of {', '.join(WIRE_CODECS)}, got {config.wire_codec!r}")
        self.device = edge.device if edge is not None else resolve_device(config.device)
        self.dtype, dtype_name = resolve_dtype(ckpt, config.dtype, self.device, "edge", config.quantize)
        if edge is not None:  # already loaded: its dtype is the one it computes in
            self.dtype, dtype_name = edge.dtype, dtype_name_of(edge.dtype)
        self.model = (
            edge
            if edge is not None
            else load_edge(ckpt, self.plan, self.dtype, config.attn_implementation, self.device, config.quantize)
        )
        self._prepack()
        self.staging = HostStaging(self.device)
        self.max_positions = int(ckpt.config.max_position_embeddings)  # longest sequence, tokens
        self.vocab_size = int(ckpt.config.vocab_size)
        self.cache_size = self._compile_fixed_decode()  # static KV entries with --compile, else None
        self.hello = Hello(
            fingerprint=fingerprint(ckpt.config),
            layer_start=self.plan.trunk_layers.start,
            layer_end=self.plan.trunk_layers.stop,
            dtype=AUTO_DTYPE if config.dtype == AUTO_DTYPE else dtype_name,  # auto: the trunk's (Welcome)
            hidden_size=self.model.hidden_size,
            auth_token=config.auth_token,
            client="splitspec-edge",
            wire_codec=config.wire_codec,
        )
        self.expected_trunk, self.trunk_source = expected_trunk(config, ckpt, self.plan)
        self.eos_token_ids = generation_stop_ids(config.model_dir, ckpt.config)
        self.published_sampling = published_sampling(config.model_dir)  # generation_config.json's
        self.default_sampling = self.sampling()
        self.draft_model: FullModel | None = draft_model
        if draft_model is None and config.draft_model_dir is not None:
            draft_ckpt = Checkpoint(config.draft_model_dir)
            check_draft_tokenizer(ckpt, draft_ckpt)
            draft_dtype, _ = resolve_dtype(draft_ckpt, config.dtype, self.device, "draft")  # auto: its own, fitted
            self.draft_model = load_full(draft_ckpt, draft_dtype, config.attn_implementation, self.device)
            self._prepack_draft_model(self.draft_model, draft_ckpt)
            self.draft_model.align_vocabulary(self.vocab_size)  # a padded embedding: logits of the model's width
        # an EAGLE head drafts from this model's features: it computes in the edge's dtype, on its device
        self.draft_head: DraftHead | None = None
        if config.draft_head_dir is not None:
            from splitspec.models.draft_head_io import load_draft_head  # safetensors and a layer class, when asked

            self.draft_head = load_draft_head(
                config.draft_head_dir, ckpt, self.device, self.dtype, target_check=config.draft_head_target_check
            )
            check_draft_head(self.draft_head)  # here, not at every request's first draft
            edge_feature_sources(self.draft_head.config.feature_layers, self.plan.num_layers, *config.edge_layers)
        # a shared edge model (and draft model) was warmed where it was loaded
        self._warm_up(edge=edge is None, draft_model=draft_model is None)

    def ends(self) -> EdgeModel:
        """The edge model's embedding, final norm and LM head, as loaded now (an auto edge may load them again
        in the trunk's dtype at the first Welcome): what a draft head reads at each draft."""
        return self.model

    def follow_trunk_dtype(self, trunk_dtype: str) -> Hello:
        """Take a Welcome's dtype; return the Hello for the next connections.

        An ``auto`` edge computes in the trunk's dtype: the edge layers are loaded again in it when
        they were loaded in another (only the first Welcome can do that, before any sequence has run
        a step), and the dtype is pinned from then on, so a trunk that restarts in another dtype is
        refused at the handshake rather than followed under sequences' feet. A pinned dtype that the
        trunk accepted is its own (anything else is refused). All this with the raw wire codec only: bf16
        and int8 carry their own dtype, so the edge keeps its own compute dtype (auto's: fitted to its device).
        """
        if self.hello.wire_codec != "raw":
            if self.hello.dtype == AUTO_DTYPE:
                self.hello = dataclasses.replace(self.hello, dtype=dtype_name_of(self.dtype))
            return self.hello
        if self.hello.dtype != AUTO_DTYPE:
            if trunk_dtype != self.hello.dtype:
                raise HandshakeMismatch(f"dtype: edge expects {self.hello.dtype!r}, trunk is {trunk_dtype!r}")
            return self.hello
        if trunk_dtype != dtype_name_of(self.dtype):
            log.info(
                "dtype auto: the trunk computes in %s, so the edge does too (its layers loaded again, were %s; "
                "--dtype pins one instead)",
                trunk_dtype,
                dtype_name_of(self.dtype),
            )
            self.dtype = dtype_from_name(trunk_dtype)
            config = self.config
            self.model = load_edge(
                self.checkpoint, self.plan, self.dtype, config.attn_implementation, self.device, config.quantize
            )
            self._prepack()
            self.cache_size = self._compile_fixed_decode()
            if self.draft_head is not None:
                self.draft_head.to(self.dtype)  # it reads the features this dtype computes
            self._warm_up(edge=True, draft_model=False)
        self.hello = dataclasses.replace(self.hello, dtype=trunk_dtype)
        return self.hello

    def _warm_up(self, edge: bool, draft_model: bool) -> None:
        """On an accelerator, every step width once through the edge's layers (``edge``), the draft model
        (``draft_model``) and the draft head (models/warm_up.py): their cold kernels are paid here, not measured by
        the first steps' speculation estimates."""
        if not pays_cold_start([self.device]):
            return
        seconds = {}
        if edge:
            seconds["edge"] = warm_up_edge(self.model)
        if draft_model and self.draft_model is not None:
            seconds["draft model"] = warm_up_draft_model(self.draft_model)
        if self.draft_head is not None:
            seconds["draft head"] = warm_up_draft_head(self.draft_head, self.model)
        times = ", ".join(f"{name} {s * 1e3:.0f} ms" for name, s in seconds.items())
        log.info("warmed up at step widths %s: %s", WARM_UP_WIDTHS, times or "nothing to warm")

    def _prepack(self) -> None:
        """``prepack``: the head's and tail's linear layers, and the LM head up to :data:`PACKED_HEAD_MAX_BYTES`,
        reordered once for oneDNN (MKL repacks a weight on every call: a 16-row (256 x 8192) LM-head
        product took 0.99 ms, prepacked 0.35 ms, on this project's 2-core AMD EPYC). Under ``auto`` only the
        shapes measured faster packed here: oneDNN's call costs more for a small weight (the demo's 256-wide
        layers ran 2-2.8x slower packed at 1-8 rows on an Intel Xeon, where its LM head ran 2x faster at 8)."""
        quantized = self.config.quantize is not None or published_method(self.checkpoint.config) is not None
        if self._may_prepack("edge", self.dtype, quantized):
            packed = prepack_pieces(self.model, (self.model.head, self.model.tail), self.config.prepack == "auto")
            if packed:
                log.info("edge: %d linear layers prepacked for oneDNN", packed)

    def _prepack_draft_model(self, draft: FullModel, checkpoint: Checkpoint) -> None:
        """``prepack`` for the draft model this runtime loaded, by the same rule as the edge's. Its LM head is
        most of its forward: each tree level reads the whole (128 x 8192) head of the demo's draft model for a
        few rows, 515 us a 4-row product through MKL against 137 us prepacked on this project's 2-core AMD EPYC,
        while its 128-wide layers run faster unpacked (``auto`` leaves them)."""
        if self._may_prepack("draft model", draft.dtype, published_method(checkpoint.config) is not None):
            packed = prepack_pieces(draft, (draft.layers,), self.config.prepack == "auto")
            if packed:
                log.info("draft model: %d linear layers prepacked for oneDNN", packed)

    def _may_prepack(self, piece: str, dtype: torch.dtype, quantized: bool) -> bool:
        """Whether ``prepack`` packs ``piece``'s linear layers; ``on`` refuses a piece that cannot be packed."""
        config = self.config
        if config.prepack == "off":
            return False
        on_cpu = self.device.type == "cpu"
        why_not = prepack_obstacle(piece, on_cpu, dtype, quantized, config.compile is not None)
        if why_not is not None and config.prepack == "on":
            raise ConfigError(f"cannot prepack the {piece}'s linear layers: {why_not}")
        return why_not is None

    def _compile_fixed_decode(self) -> int | None:
        """With ``compile``: the head's and tail's fixed-shape decode steps, compiled now (once per
        shared model); return the static KV size. None without (growable caches)."""
        config = self.config
        size = static_cache_size(config.compile, config.max_cache_tokens, self.max_positions)
        if config.compile is None or size is None:
            return None
        for stack in (self.model.head, self.model.tail):
            if len(stack.layers) and stack.fixed_decode is None:
                stack.enable_fixed_decode(config.compile, config.compile_backend).warm_up(size)
        return size

    def new_cache(self) -> KVCache:
        """A sequence's cache on the edge: static buffers with ``compile``, else growable."""
        return KVCache() if self.cache_size is None else StaticKVCache(self.cache_size)

    def sampling(
        self,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        min_p: float | None = None,
    ) -> SamplingParams:
        """Sampling as the checkpoint publishes it (generation_config.json), overridden by the values given."""
        return sampling_settings(self.published_sampling, temperature, top_p, top_k, seed, min_p)

    def check_length(self, prompt_tokens: int, max_new_tokens: int, context_tokens: int = 0) -> None:
        """Refuse a generation that could pass the model's maximum positions: context + prompt + max new tokens.

        The one length policy: the CLI calls it before connecting, a generation before sending
        anything, so a request either fits whole or fails at once, never midway.
        """
        total = context_tokens + prompt_tokens + max_new_tokens
        if self.cache_size is not None and total > self.cache_size:
            raise ConfigError(
                f"prompt + max new tokens + context = {total} exceeds the edge's static KV size of "
                f"{self.cache_size} (--max-cache-tokens)"
            )
        if total > self.max_positions:
            raise ConfigError(
                f"prompt ({prompt_tokens} tokens) + max new tokens ({max_new_tokens})"
                + (f" + context ({context_tokens})" if context_tokens else "")
                + f" = {total} exceeds the model's {self.max_positions} positions: shorten the prompt or "
                "lower --max-new-tokens"
            )

    def generator(self, params: SamplingParams) -> tuple[torch.Generator, int]:
        """A seeded generator where this edge's logits live (a CUDA edge samples on CUDA), and its seed."""
        return params.generator(self.device)


def check_draft_tokenizer(ckpt: Checkpoint, draft: Checkpoint) -> None:
    """Refuse a draft model whose tokenizer is not the model's: its token ids would stand for other text.

    The two tokenizers' vocabularies (token -> id, added tokens included) must be equal; the checkpoints'
    ``vocab_size`` may differ, an embedding padded past the tokenizer's ids (Qwen2.5-0.5B's 151936 rows drafting
    for Qwen2.5-7B's 152064: :meth:`~splitspec.models.stack.ModelEnds.align_vocabulary`). Where either has no
    tokenizer to compare, equal ``vocab_size`` is all there is to go by."""
    vocab, draft_vocab = int(ckpt.config.vocab_size), int(draft.config.vocab_size)
    try:
        ours, theirs = load_tokenizer(ckpt.directory).get_vocab(), load_tokenizer(draft.directory).get_vocab()
    except CheckpointError as exc:
        if draft_vocab != vocab:
            raise ConfigError(
                f"draft model vocabulary ({draft_vocab}) differs from the model's ({vocab}), and their tokenizers "
                f"cannot be compared ({exc}): they must share one tokenizer"
            ) from None
        log.warning(
            "cannot compare the draft model's tokenizer with the model's (%s): trusting their equal vocab_size", exc
        )
        return
    if ours == theirs:
        return
    by_id, draft_by_id = {i: t for t, i in ours.items()}, {i: t for t, i in theirs.items()}
    first = min(i for i in by_id.keys() | draft_by_id.keys() if by_id.get(i) != draft_by_id.get(i))
    raise ConfigError(
        f"the draft model {draft.directory} has another tokenizer than the model's ({len(theirs)} tokens against "
        f"{len(ours)}; id {first} is {draft_by_id.get(first)!r:.40} there, {by_id.get(first)!r:.40} here): a draft "
        "model must share the model's tokenizer"
    )


def expected_trunk(config: EdgeConfig, ckpt: Checkpoint, plan: SplitPlan) -> tuple[TrunkFingerprint, str]:
    """The trunk fingerprint the cloud must send, and where it comes from: the pin, else the edge's own copy."""
    if config.trunk_fingerprint is not None:
        try:
            pinned = TrunkFingerprint.parse(config.trunk_fingerprint)
        except ValueError as exc:
            raise ConfigError(f"--trunk-fingerprint: {exc}") from None
        if (pinned.layer_start, pinned.layer_end) != (plan.trunk_layers.start, plan.trunk_layers.stop):
            raise ConfigError(
                f"--trunk-fingerprint is for {pinned.layers}, but --edge-layers {plan.head},{plan.tail} "
                f"leave layers {plan.trunk_layers.start}..{plan.trunk_layers.stop - 1} to the trunk"
            )
        return pinned, "the pinned --trunk-fingerprint"
    try:
        own = trunk_fingerprint(ckpt, plan, config.quantize)  # quantized as this edge expects
    except CheckpointError as exc:
        raise CheckpointError(
            f"{exc}: the edge checks the cloud's trunk against its own copy; without one, pin the trunk with "
            "--trunk-fingerprint (the trunk server logs it at start)"
        ) from None
    return own, f"the edge's copy of the checkpoint ({ckpt.directory})"
