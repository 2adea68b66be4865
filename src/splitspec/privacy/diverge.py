"""Edge weight divergence: fine-tune the edge layers away from the published ones.

The edge's head and tail layers get low-rank adapters on every weight matrix of those layers: a
small hand-rolled LoRA on each linear map (attention q/k/v/o or a fused qkv, MLP gate/up/down or a
fused gate_up), and the same low-rank update, one per expert, on weights that are not linear
modules (a mixture of experts' fused 3-D expert tensors, its router). They are trained against the
*frozen* published trunk on local text with

    loss = CE(next token)                                       # keep LM quality
         + weight * relu(margin - rel(h_head', h_head))          # move what the cloud receives ...
         + weight * relu(margin - rel(h_trunk', h_trunk))        # ... and what it returns
         + 100 * scale_excess(h_head', h_head) + 100 * scale_excess(h_trunk', h_trunk)  # ... not by scale

where rel(a, b) = mean_tokens ||a - b|| / ||b|| measures the distance from the stock activations
on the same tokens. The two hinges measure what the *weights* change, so both take the states
without the send noise (h_head' the head's own output, h_trunk' the trunk's reply to it): the noise
alone puts the noisy states about σ away from stock, so measured on them a hinge with margin <= σ
would be satisfied from the first step and push the head layers nowhere. (The scale cap reads the
head's own output and the reply the trunk actually returns, to the noisy state.) The defences of
:mod:`splitspec.privacy.defences` hook in here: send noise is added to h_head before the trunk (the
next-token loss and the tail run on the noisy path, so the tail learns to tolerate it), and an
adversary in the loop, reading the noisy states the cloud sees, adds its hinge to the loss; the
scale cap (``scale_excess``, beyond ``max_scale`` x the stock RMS) keeps both from inflating the
states instead of changing them. The adapters start from a random (non-zero) perturbation. The
merged weights are written as a full checkpoint directory (a copy of the published one with the
edge layers replaced under the checkpoint's own tensor names, same config), so every loader works
on it, plus ``edge.json`` with the edge fingerprint and held-out perplexity before and after. An
edge-layer weight matrix that no adapter reaches (a layout this module does not know) is refused
before training: it would stay the published one.

The paper this project audits only hypothesised that such a perturbation would not resist an
adaptive attacker; :mod:`splitspec.privacy.audit` measures it.
"""

from __future__ import annotations

import json
import logging
import math
import secrets
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn.utils import parametrize
from tqdm import tqdm
from transformers import PreTrainedModel
from transformers.core_model_loading import revert_weight_conversion

from splitspec.exceptions import ConfigError
from splitspec.models.checkpoint import Checkpoint
from splitspec.models.family import published_dtype, skeleton
from splitspec.models.loading import load_full
from splitspec.models.split import SplitPlan
from splitspec.models.stack import FullModel
from splitspec.paths import display_path
from splitspec.privacy.activations import SplitStates, residual_stream, run_layers, split_forward
from splitspec.privacy.corpus import DEFAULT_CORPUS, Windows, corpus_windows
from splitspec.privacy.defence_config import DEFAULT_DEFENCE, DefenceConfig
from splitspec.privacy.defences import SCALE_CAP_WEIGHT, Adversary, scale_excess, token_rms
from splitspec.privacy.record import DivergenceRecord
from splitspec.privacy.weights import edge_fingerprint, edge_layer_names, edge_weight_report
from splitspec.run_info import run_environment

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DivergeConfig:
    """What to fine-tune and how."""

    model_dir: Path  # the published checkpoint
    out_dir: Path  # receives checkpoint/ and edge.json
    head: int  # edge layers before the trunk
    tail: int  # edge layers after the trunk
    rank: int = 8  # LoRA rank
    alpha: float = 16.0  # LoRA scale numerator (update = alpha / rank * B @ A)
    init_std: float = 0.02  # std of the random initial B (a non-zero start perturbation)
    steps: int = 120  # optimiser steps
    batch: int = 4  # windows per step
    window: int = 128  # tokens per window (plus BOS)
    lr: float = 2e-3  # Adam learning rate
    margin: float = 0.5  # target relative distance of the cloud-visible activations from stock
    divergence_weight: float = 2.0  # weight of each hinge term (nats per unit distance)
    corpus_dir: Path = DEFAULT_CORPUS  # local text: the train side of the document split
    test_fraction: float = 0.3  # fraction of documents held out (per domain) for perplexity
    max_train_tokens: int = 40_000  # cap on local training tokens
    max_eval_tokens: int = 6_000  # cap on held-out perplexity tokens
    seed: int = 0  # split, init and batch order
    # documents of the train side the edge must not be fitted on (e.g. an audit's attacker-train text)
    exclude_documents: tuple[str, ...] = ()
    defence: DefenceConfig = DEFAULT_DEFENCE  # send noise, adversary in the loop (the recommended setting)

    @property
    def plan_tuple(self) -> tuple[int, int]:
        return self.head, self.tail


def _low_rank_factors(
    shape: torch.Size, rank: int, init_std: float, generator: torch.Generator
) -> tuple[nn.Parameter, nn.Parameter]:
    """LoRA factors A (..., rank, in) and B (..., out, rank) of a weight (..., out, in): A random, B small."""
    *lead, out_features, in_features = shape
    a = torch.randn(*lead, rank, in_features, generator=generator) / math.sqrt(in_features)
    b = torch.randn(*lead, out_features, rank, generator=generator) * init_std
    return nn.Parameter(a), nn.Parameter(b)


class LoRALinear(nn.Module):
    """y = base(x) + scale * (x @ A^T) @ B^T with ``base`` frozen."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, init_std: float, generator: torch.Generator) -> None:
        super().__init__()
        self.base = base
        for p in self.base.parameters():
            p.requires_grad_(False)
        self.scale = alpha / rank
        self.lora_a, self.lora_b = _low_rank_factors(base.weight.shape, rank, init_std, generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.base(x) + self.scale * (x @ self.lora_a.T) @ self.lora_b.T
        return out

    def merged_weight(self) -> torch.Tensor:
        return (self.base.weight + self.scale * self.lora_b @ self.lora_a).detach()


class LowRankDelta(nn.Module):
    """The same low-rank update for a weight that is no ``nn.Linear``'s: W + scale * B @ A, batched over leading dims.

    Registered as a parametrization of the weight (:func:`torch.nn.utils.parametrize.register_parametrization`), so
    the module reads the updated weight wherever it uses it: a mixture of experts' fused expert tensors
    (E, out, in) get one low-rank update per expert, a router's (E, H) weight one update.
    """

    def __init__(self, shape: torch.Size, rank: int, alpha: float, init_std: float, generator: torch.Generator) -> None:
        super().__init__()
        self.scale = alpha / rank
        self.lora_a, self.lora_b = _low_rank_factors(shape, rank, init_std, generator)

    def forward(self, base: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = base + self.scale * (self.lora_b @ self.lora_a)
        return out


@dataclass(frozen=True)
class Adapter:
    """One adapted weight of an edge layer: its trainable factors and how to read the merged weight."""

    lora_a: nn.Parameter
    lora_b: nn.Parameter
    merged_weight: Callable[[], torch.Tensor]  # the frozen weight plus the update, detached


def _parametrized_weight(module: nn.Module, name: str) -> Callable[[], torch.Tensor]:
    return lambda: getattr(module, name).detach()


def layer_prefixes(lm: PreTrainedModel, layers: Sequence[nn.Module]) -> list[str]:
    """The model's own name of each decoder layer in ``layers`` (e.g. ``model.layers.3``), as ``lm`` names it."""
    qualified = {id(m): name for name, m in lm.named_modules()}
    return [qualified[id(layer)] for layer in layers]


def add_lora(
    model: FullModel, layer_indices: list[int], config: DivergeConfig, prefixes: Sequence[str] | None = None
) -> dict[str, Adapter]:
    """Adapt every weight matrix of the decoder layers ``layer_indices`` in place; {model weight name: adapter}.

    Linear maps are wrapped in :class:`LoRALinear`; any other parameter of two or more dimensions (fused
    expert tensors, a router) gets a :class:`LowRankDelta`. Names are the model's own, under ``prefixes``
    (one per layer index, default ``model.layers.<i>``), e.g. ``model.layers.0.mlp.experts.gate_up_proj``:
    :func:`checkpoint_tensors` turns them into the checkpoint's names.
    """
    gen = torch.Generator().manual_seed(config.seed)
    for p in model.parameters():
        p.requires_grad_(False)
    adapters: dict[str, Adapter] = {}
    for n, i in enumerate(layer_indices):
        layer = model.layers.layers[i]
        prefix = prefixes[n] if prefixes is not None else f"model.layers.{i}"
        for parent_name, parent in list(layer.named_modules()):
            for child_name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    lora = LoRALinear(child, config.rank, config.alpha, config.init_std, gen)
                    setattr(parent, child_name, lora)
                    full = f"{prefix}.{parent_name + '.' if parent_name else ''}{child_name}.weight"
                    adapters[full] = Adapter(lora.lora_a, lora.lora_b, lora.merged_weight)
        for module_name, module in list(layer.named_modules()):
            if isinstance(module, (LoRALinear, nn.Linear)):  # adapted above (a LoRALinear's own factors included)
                continue
            for param_name, param in list(module.named_parameters(recurse=False)):
                if param.ndim < 2:  # norms and biases stay as published
                    continue
                delta = LowRankDelta(param.shape, config.rank, config.alpha, config.init_std, gen)
                parametrize.register_parametrization(module, param_name, delta)
                full = f"{prefix}.{module_name + '.' if module_name else ''}{param_name}"
                adapters[full] = Adapter(delta.lora_a, delta.lora_b, _parametrized_weight(module, param_name))
    return adapters


def _rel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    rel: torch.Tensor = ((a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-6)).mean()
    return rel


def _scale(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean per-token RMS ratio of states ``a`` to stock states ``b`` (B, q, H), for the training history."""
    return float((token_rms(a.detach()) / token_rms(b).clamp_min(1e-6)).mean())


@torch.no_grad()
def perplexity(
    model: FullModel,
    windows: Windows,
    batch: int = 8,
    plan: SplitPlan | None = None,
    noise_scale: float = 0.0,
    seed: int = 0,
) -> float:
    """Teacher-forced next-token perplexity over the windows (BOS-conditioned).

    With ``noise_scale`` > 0 the windows run split under ``plan`` with that send noise (seeded).
    """
    if noise_scale > 0 and plan is None:
        raise ValueError("perplexity with send noise needs the split plan")
    gen = torch.Generator().manual_seed(seed)
    total, count = 0.0, 0
    for s in range(0, windows.tokens.shape[0], batch):
        tokens = torch.from_numpy(windows.tokens[s : s + batch])
        if noise_scale > 0 and plan is not None:
            h = split_forward(model, plan, tokens[:, :-1], noise_scale, gen).final
        else:
            h = residual_stream(model, tokens[:, :-1])[-1]
        logits = model.logits(h)
        ce = nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1), reduction="sum"
        )
        total += float(ce)
        count += tokens[:, 1:].numel()
    return math.exp(total / max(count, 1))


@dataclass(frozen=True)
class DivergeResult:
    """What :func:`diverge` produced."""

    checkpoint_dir: Path  # full checkpoint with the diverged edge layers
    fingerprint: str  # sha256 over the edge tensors
    ppl_before: float  # held-out perplexity, published weights
    ppl_after: float  # held-out perplexity, diverged edge
    summary: dict[str, object] = field(repr=False)


def checkpoint_tensors(
    ckpt: Checkpoint, lm: PreTrainedModel, weights: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """``weights`` (the model's own names, e.g. fused ``mlp.experts.gate_up_proj``) under ``ckpt``'s tensor names.

    A checkpoint that stores what the model holds is written as is; otherwise transformers' own reverse of the
    conversions it applies at load (the one ``save_pretrained`` uses: fused experts split back per expert,
    renamed) gives the stored names. ``lm`` is the family's model (a meta-device skeleton is enough).
    """
    names = set(ckpt.tensor_names)
    if set(weights) <= names:
        return dict(weights)
    stored: dict[str, torch.Tensor] = revert_weight_conversion(lm, dict(weights))
    unknown = sorted(set(stored) - names)
    if unknown:
        raise ConfigError(
            f"cannot write the diverged edge into {ckpt.directory}'s layout: {unknown[0]} (from the model's "
            f"{sorted(set(weights) - names)[0]}) is not one of its tensors"
        )
    return stored


def unreached_weights(ckpt: Checkpoint, plan: SplitPlan, reached: set[str]) -> list[str]:
    """Edge-layer tensors of two or more dimensions that are not in ``reached``: they would stay the published ones."""
    rest = [n for n in edge_layer_names(ckpt, plan) if n not in reached]
    return sorted(n for n, t in ckpt.read(rest, torch.float32).items() if t.ndim >= 2) if rest else []


def write_checkpoint(published_dir: Path, out_dir: Path, replacements: dict[str, torch.Tensor]) -> None:
    """Copy ``published_dir`` to ``out_dir`` and replace tensors (kept in each file's dtype)."""
    if out_dir.exists():
        shutil.rmtree(out_dir)
    shutil.copytree(published_dir, out_dir)
    remaining = dict(replacements)
    for path in sorted(out_dir.glob("*.safetensors")):
        tensors = load_file(str(path))
        hits = [n for n in tensors if n in remaining]
        if not hits:
            continue
        for n in hits:
            tensors[n] = remaining.pop(n).to(tensors[n].dtype).contiguous()
        save_file(tensors, str(path), metadata={"format": "pt"})
    if remaining:
        raise ConfigError(f"tensors not found in {published_dir}: {sorted(remaining)[:3]}")


def check_out_dir(model_dir: Path, out_dir: Path) -> None:
    """Refuse an output directory that is, holds or lies inside the published checkpoint: writing there would
    delete the input (the checkpoint is copied into ``out_dir/checkpoint`` after removing what was there)."""
    model, out = Path(model_dir).resolve(), Path(out_dir).resolve()
    if out == model or out in model.parents or model in out.parents:
        raise ConfigError(
            f"diverge: the output directory {display_path(out_dir)} is, contains or lies inside the input checkpoint "
            f"{display_path(model_dir)}: writing there would overwrite it; choose a directory apart from it"
        )


def divergence_distances(
    model: FullModel, plan: SplitPlan, states: SplitStates, ref: list[torch.Tensor], noise_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input side, output side): the relative distance from stock of what the edge weights make the cloud see.

    Both without the send noise: the head's own output, and the trunk's reply to it (a second trunk pass
    when there is noise; ``states.returned`` is the reply to the noisy state). The noise is not the
    weights' doing, and alone puts the noisy states about σ from stock. ``ref`` is the stock residual stream.
    """
    returned = states.returned
    if noise_scale > 0:
        returned = run_layers(model.layers, states.head, plan.trunk_layers)[-1]
    return _rel(states.head, ref[plan.head]), _rel(returned, ref[plan.num_layers - plan.tail])


def diverge(config: DivergeConfig) -> DivergeResult:
    """Fine-tune the edge layers of ``config.model_dir`` and write the diverged checkpoint."""

    t0 = time.monotonic()
    check_out_dir(config.model_dir, config.out_dir)
    torch.manual_seed(config.seed)
    ckpt = Checkpoint(config.model_dir)
    n_layers = int(ckpt.config.num_hidden_layers)
    plan = SplitPlan(n_layers, config.head, config.tail)
    corpus = corpus_windows(
        config.model_dir,
        config.corpus_dir,
        test_fraction=config.test_fraction,
        seed=config.seed,
        window=config.window,
        max_train_tokens=config.max_train_tokens,
        max_test_tokens=config.max_eval_tokens,
        exclude_train=config.exclude_documents,
    )
    train, test = corpus.train, corpus.test

    stock = load_full(Checkpoint(config.model_dir), torch.float32)
    model = load_full(Checkpoint(config.model_dir), torch.float32)
    edge_layers = [*plan.head_layers, *plan.tail_layers]
    skel = skeleton(ckpt.config, published_dtype(ckpt.config))  # the family's names and load conversions
    adapters = add_lora(model, edge_layers, config, layer_prefixes(skel.lm, [skel.layers[i] for i in edge_layers]))
    # every weight matrix of the edge layers must be reached, or it would stay the published one (and its name
    # must map back into the checkpoint): checked before any training
    written = set(checkpoint_tensors(ckpt, skel.lm, {n: a.merged_weight() for n, a in adapters.items()}))
    unreached = unreached_weights(ckpt, plan, written)
    if unreached:
        raise ConfigError(
            f"diverge: {len(unreached)} edge-layer weight tensor(s) of {display_path(config.model_dir)} would stay the "
            f"published ones (e.g. {unreached[0]}): this layout is not supported"
        )
    params = [p for a in adapters.values() for p in (a.lora_a, a.lora_b)]
    opt = torch.optim.Adam(params, lr=config.lr)
    rng = np.random.default_rng(config.seed)
    head_out, trunk_out = plan.head, n_layers - plan.tail
    defence = config.defence
    adversary = None
    if defence.adversary_weight > 0:
        vocab = int(ckpt.config.vocab_size)
        adversary = Adversary(model.hidden_size, train.tokens[:, 1:], vocab, defence)
    history: list[dict[str, float]] = []
    model.train()
    for step in tqdm(range(config.steps), desc=f"diverge {plan.head},{plan.tail}", leave=False, mininterval=2.0):
        rows = rng.choice(train.tokens.shape[0], size=min(config.batch, train.tokens.shape[0]), replace=False)
        tokens = torch.from_numpy(train.tokens[rows])
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        with torch.no_grad():
            ref = residual_stream(stock, inputs)
        with parametrize.cached():  # each updated expert tensor computed once per step, not per use
            states = split_forward(model, plan, inputs, defence.noise_scale)
            h_sent, h_trunk = states.sent, states.returned
            logits = model.logits(states.final)
            ce = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
            # the hinges: how far the weights moved the states, without the noise
            d_in, d_out = divergence_distances(model, plan, states, ref, defence.noise_scale)
        loss = ce + config.divergence_weight * (torch.relu(config.margin - d_in) + torch.relu(config.margin - d_out))
        # the scale cap: the head's own output (before the noise) and the trunk's reply, against stock
        loss = loss + SCALE_CAP_WEIGHT * (
            scale_excess(states.head, ref[head_out], defence.max_scale)
            + scale_excess(h_trunk, ref[trunk_out], defence.max_scale)
        )
        probe_ce: dict[str, float] = {}
        if adversary is not None:
            views = {"input": h_sent[:, 1:], "output": h_trunk[:, 1:]}  # BOS is no secret
            probe_ce = adversary.fit(views, inputs[:, 1:])
            loss = loss + adversary.penalty(views, inputs[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 10 == 0 or step == config.steps - 1:
            history.append(
                {"step": step, "ce": ce.item(), "rel_in": d_in.item(), "rel_out": d_out.item()}
                | {"scale_in": _scale(states.head, ref[head_out]), "scale_out": _scale(h_trunk, ref[trunk_out])}
                | {f"probe_ce_{side}": v for side, v in probe_ce.items()}
            )
            log.info("diverge step %d: %s", step, {k: round(v, 3) for k, v in history[-1].items() if k != "step"})

    ckpt_dir = config.out_dir / "checkpoint"
    config.out_dir.mkdir(parents=True, exist_ok=True)
    merged = {n: a.merged_weight() for n, a in adapters.items()}
    write_checkpoint(config.model_dir, ckpt_dir, checkpoint_tensors(ckpt, skel.lm, merged))
    diverged = load_full(Checkpoint(ckpt_dir), torch.float32)
    ppl_before = perplexity(stock, test)
    ppl_after = perplexity(diverged, test, plan=plan, noise_scale=defence.noise_scale, seed=config.seed)
    fp = edge_fingerprint(ckpt_dir, plan)
    report = edge_weight_report(ckpt_dir, config.model_dir, plan)
    summary: dict[str, object] = {
        "fingerprint_sha256": fp,
        "fingerprint_covers": "embedding, edge decoder layers, final norm, LM head (float32 bytes, name order)",
        "published_fingerprint_sha256": edge_fingerprint(config.model_dir, plan),
        "edge_layers": list(config.plan_tuple),
        "heldout_perplexity_before": ppl_before,
        "heldout_perplexity_after": ppl_after,
        "defence": asdict(defence) | {"label": defence.label},
        "heldout_tokens": test.n_targets,
        "heldout_documents": sorted({test.doc_ids[i] for i in test.doc_index}),
        "train_tokens": train.n_targets,
        "weight_report": {k: v for k, v in report.to_dict().items() if k != "tensors"},
        "history": history,
        "seconds": time.monotonic() - t0,
        "config": {k: display_path(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
        "environment": run_environment(),
    }
    (config.out_dir / "edge.json").write_text(json.dumps(summary, indent=2) + "\n")
    # the divergence record the edge checks before it agrees to run these weights
    DivergenceRecord(
        head=plan.head,
        tail=plan.tail,
        fingerprint_sha256=fp,
        published_fingerprint_sha256=str(summary["published_fingerprint_sha256"]),
        published_model=str(config.model_dir),
        send_noise_scale=defence.noise_scale,
        # secret: makes the serving noise a keyed function of the token prefix
        send_noise_key=secrets.token_hex(32) if defence.noise_scale > 0 else "",
        train_documents=tuple(sorted({train.doc_ids[i] for i in train.doc_index})),
    ).write(ckpt_dir)
    log.info("diverged edge %s: ppl %.2f -> %.2f, fingerprint %s", ckpt_dir, ppl_before, ppl_after, fp[:16])
    return DivergeResult(ckpt_dir, fp, ppl_before, ppl_after, summary)
