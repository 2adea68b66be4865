"""Train an EAGLE-style draft head on local text: ``splitspec train-drafter``.

Features and the target's logits come from a :class:`FeatureSource`: :class:`LocalFeatures`
runs the whole model on this machine; a source through the split (a stripped edge and a trunk
server) implements the same protocol and is passed to :func:`train` the same way.

Each step draws ``batch`` random windows of ``seq_len`` tokens from the tokenized corpus. With
x_0..x_{T-1}, features f and target logits z, the head's query i (token x_{i+1}, feature f_i,
position i) predicts ĥ_{i+1}; the loss (EAGLE's) is smooth-L1 between ĥ_{i+1} and the target's
layer-L feature f_{i+1} (when L is one of the feature layers) plus ``cls_weight`` times the
cross-entropy of ``logits(ĥ_{i+1})`` against the target's softmax at i+1. Input features get
uniform noise of ``noise`` times each token's RMS. The windows and the noise of step s come from a
generator seeded with (seed, s), so a resumed run draws what the uninterrupted one would have.

The out directory holds the head (splitspec's layout, :mod:`splitspec.models.draft_head_io`),
``trainer_state.json`` (the step, the arguments) and ``optimizer.safetensors`` (AdamW's moments):
``resume`` continues from them. With ``draft_vocab`` N the head trains against the target's whole LM
head, and is saved drafting over the N target tokens most frequent in the corpus
(:mod:`~splitspec.models.draft_vocab`); ``resume`` drops that vocabulary again before training on, and a
run resumed at its last step with ``draft_vocab`` only saves the head again with that vocabulary.
The training state records each corpus file's resolved path, size and SHA-256: ``resume`` refuses
other files, or the same files since edited.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from splitspec.devices import resolve_device
from splitspec.exceptions import ConfigError
from splitspec.models.checkpoint import Checkpoint, load_tokenizer
from splitspec.models.draft_head import DraftHead, check_feature_layers, default_config
from splitspec.models.draft_head_io import HEAD_KEY, WEIGHTS_FILE, load_draft_head, save_draft_head
from splitspec.models.draft_vocab import frequent_tokens, token_counts, with_draft_vocab, without_draft_vocab
from splitspec.models.kv_cache import KVCache
from splitspec.models.loading import load_full
from splitspec.models.masks import chain
from splitspec.models.stack import FullModel, ModelEnds

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
STAGING_DIR = ".saving"  # a save is written here in full, then moved into place
# settings a resumed run must share with the run it continues (the batches drawn, the schedule, the loss)
RESUME_FIXED = ("corpus", "seq_len", "batch", "lr", "warmup", "cls_weight", "noise", "seed")
OPTIMIZER_FILE = "optimizer.safetensors"


class FeatureSource(Protocol):
    """Where training reads the target's features and logits for a token sequence."""

    feature_layers: tuple[int, ...]

    @property
    def ends(self) -> ModelEnds:
        """The target's embedding, final norm and LM head (the head shares them)."""
        ...

    async def features(self, token_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """token ids (T,) from position 0 -> features (T, F*H) and the target's logits (T, V) float32."""
        ...


class LocalFeatures:
    """Features from the whole model on this machine (its LayerStack's per-layer outputs)."""

    def __init__(self, model: FullModel, feature_layers: tuple[int, ...]) -> None:
        self.model = model
        self.feature_layers = check_feature_layers(feature_layers, len(model.layers.layers))

    @property
    def ends(self) -> ModelEnds:
        return self.model

    @torch.no_grad()
    def step(
        self, token_ids: torch.Tensor, positions: torch.Tensor, parents: torch.Tensor, cache: KVCache | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """token_ids (q,) -> features (q, F*H) and logits (q, V) float32; appends q entries to a cache and commits."""
        outs = self.model.layers.run(self.model.embed(token_ids[None]), positions, parents, cache)  # L x (1, q, H)
        if cache is not None:
            cache.commit()
        feats = torch.cat([outs[k - 1][0] for k in self.feature_layers], dim=-1)  # (q, F*H)
        return feats, self.model.logits(outs[-1])[0]

    async def features(self, token_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        q = len(token_ids)
        ids = torch.tensor(list(token_ids), dtype=torch.long)
        return self.step(ids, torch.arange(q, dtype=torch.int32), torch.tensor(chain(q), dtype=torch.int32), None)


@dataclass(frozen=True)
class TrainConfig:
    """One training run (``splitspec train-drafter``'s options)."""

    model: Path
    corpus: tuple[Path, ...]
    out: Path
    steps: int = 600
    seq_len: int = 128
    batch: int = 8
    lr: float = 1e-3
    warmup: int = 20
    cls_weight: float = 0.1
    noise: float = 0.05
    feature_layers: tuple[int, ...] | None = None  # None: (L,)
    seed: int = 0
    resume: bool = False
    save_every: int = 100
    save_dtype: str = "float32"  # of model.safetensors; float16 to ship (resume then reads it back)
    device: str = "auto"  # where the model and the head compute (splitspec.devices.resolve_device)
    progress: bool = True
    draft_vocab: int | None = None  # tokens the saved head drafts over (the corpus's most frequent); None: all

    def __post_init__(self) -> None:
        if self.steps < 1 or self.seq_len < 3 or self.batch < 1 or self.save_every < 1:
            raise ConfigError("--steps, --batch and --save-every must be at least 1 and --seq-len at least 3")
        if not self.lr > 0 or self.warmup < 0 or self.cls_weight < 0 or self.noise < 0:
            raise ConfigError("--lr must be positive; --warmup, --cls-weight and --noise non-negative")
        if self.save_dtype not in ("float32", "float16", "bfloat16"):
            raise ConfigError("--save-dtype must be float32, float16 or bfloat16")
        if not self.corpus:
            raise ConfigError("--corpus needs at least one file")
        if self.draft_vocab is not None and self.draft_vocab < 1:
            raise ConfigError("--draft-vocab must be at least 1")


def corpus_files(files: Sequence[Path]) -> list[dict[str, object]]:
    """Each corpus file's resolved path, size (bytes) and SHA-256: what a resumed run must train on again."""
    out: list[dict[str, object]] = []
    for path in files:
        digest, size = hashlib.sha256(), 0
        try:
            with Path(path).open("rb") as f:
                while block := f.read(1 << 20):
                    digest.update(block)
                    size += len(block)
        except OSError as exc:
            raise ConfigError(f"corpus file {path}: {exc}") from None
        out.append({"path": str(Path(path).resolve()), "bytes": size, "sha256": digest.hexdigest()})
    return out


def read_corpus(files: Sequence[Path], tokenizer_dir: Path, min_tokens: int) -> list[torch.Tensor]:
    """Each file's token ids (T_f,) long, as the target's tokenizer encodes it; files shorter than
    ``min_tokens`` are skipped."""
    tokenizer = load_tokenizer(tokenizer_dir)
    streams = []
    for path in files:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"corpus file {path}: {exc}") from None
        ids = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)
        if ids.numel() >= min_tokens:
            streams.append(ids)
    if not streams:
        raise ConfigError(f"no corpus file holds at least {min_tokens} tokens (--seq-len)")
    return streams


def windows(streams: Sequence[torch.Tensor], count: int, length: int, gen: torch.Generator) -> list[list[int]]:
    """``count`` windows of ``length`` tokens, a file drawn in proportion to its length and a uniform start."""
    sizes = torch.tensor([s.numel() - length + 1 for s in streams], dtype=torch.float64)
    picks = torch.multinomial(sizes, count, replacement=True, generator=gen).tolist()
    out = []
    for f in picks:
        start = int(torch.randint(0, int(sizes[f]), (1,), generator=gen))
        out.append(streams[f][start : start + length].tolist())
    return out


def head_loss(
    head: DraftHead,
    ends: ModelEnds,
    tokens: torch.Tensor,
    feats: torch.Tensor,
    logits: torch.Tensor,
    reg_slice: slice | None,
    cls_weight: float,
    noise: float,
    gen: torch.Generator,
) -> tuple[torch.Tensor, dict[str, float]]:
    """tokens (B, T), feats (B, T, F*H), target logits (B, T, V) -> EAGLE's loss and its parts (see the module doc)."""
    inputs = feats[:, :-1]  # (B, T-1, F*H): f_i for the queries i = 0..T-2
    if noise > 0:
        rms = inputs.pow(2).mean(-1, keepdim=True).sqrt()  # (B, T-1, 1)
        uniform = torch.rand(inputs.shape, generator=gen).to(inputs.device)  # drawn on the host: the same on any device
        inputs = inputs + (uniform * 2 - 1) * noise * rms
    hidden = head.run_chunks(ends, tokens[:, 1:], inputs)  # (B, T-1, H) = ĥ_{i+1}
    width = hidden.shape[-1]
    predicted = head.logits(ends, hidden.reshape(-1, width))  # (B*(T-1), V)
    wanted = F.softmax(logits[:, 1:].reshape(-1, logits.shape[-1]), dim=-1)  # (B*(T-1), V)
    cls = -(wanted * F.log_softmax(predicted, dim=-1).clamp_min(-1e4)).sum(-1).mean()
    reg = F.smooth_l1_loss(hidden, feats[:, 1:, reg_slice].to(hidden.dtype)) if reg_slice else hidden.new_zeros(())
    top1 = (predicted.argmax(-1) == wanted.argmax(-1)).float().mean()
    return reg + cls_weight * cls, {"reg": float(reg.detach()), "cls": float(cls.detach()), "top1": float(top1)}


def _lr_at(step: int, config: TrainConfig) -> float:
    """Linear warmup, then cosine decay to 0.1 x peak."""
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    done = (step - config.warmup) / max(1, config.steps - config.warmup)
    return config.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, done))))


def _save(
    head: DraftHead,
    opt: torch.optim.AdamW,
    step: int,
    config: TrainConfig,
    wall_s: float,
    notes: dict[str, object],
    shipped: DraftHead | None = None,
    corpus: list[dict[str, object]] | None = None,
) -> None:
    """Write the head (``shipped``: what is saved as the head, the trained head with a reduced vocabulary) and
    the training state (``corpus``: the corpus files' :func:`corpus_files`, recorded for a resumed run to check).

    Every file is written in full to a staging folder first, then moved into place, the training state last.
    A process killed while writing leaves the previous save whole; one killed between the moves leaves files
    of two steps, which :func:`_restore` refuses (each file names its step) rather than resume from.
    """
    staging = config.out / STAGING_DIR
    shutil.rmtree(staging, ignore_errors=True)
    dtype = getattr(torch, config.save_dtype)
    save_draft_head(
        shipped if shipped is not None else head,
        staging,
        dtype=dtype,
        notes={**notes, "steps": step, "train_wall_s": round(wall_s, 1)},
    )
    names = {id(p): n for n, p in head.named_parameters()}
    moments: dict[str, torch.Tensor] = {}
    for param, state in opt.state.items():
        for key, value in state.items():
            moments[f"{names[id(param)]}/{key}"] = torch.as_tensor(value).detach().cpu().clone()
    save_file(moments, str(staging / OPTIMIZER_FILE), metadata={"step": str(step)})
    args = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items()}
    args["corpus"] = [str(p) for p in config.corpus]
    state_doc: dict[str, object] = {"step": step, "train_wall_s": wall_s, "args": args}
    if corpus is not None:
        state_doc["corpus_files"] = corpus
    (staging / STATE_FILE).write_text(json.dumps(state_doc, indent=2) + "\n")
    for path in sorted(staging.iterdir(), key=lambda f: f.name == STATE_FILE):  # the state, naming the step, last
        os.replace(path, config.out / path.name)
    staging.rmdir()


def _restore(
    head: DraftHead, opt: torch.optim.AdamW, config: TrainConfig, corpus: list[dict[str, object]]
) -> tuple[int, float]:
    """Load the optimizer's moments saved beside the head; (step, wall seconds so far).

    Refuses files of different steps (a save cut short between its moves), a run already at ``config.steps``
    (unless ``config.draft_vocab`` asks only to reduce the finished head's vocabulary), and settings that change
    what the steps ahead draw or compute: a resumed run is the run that never stopped. The corpus is compared by
    its files' resolved paths and, where the save recorded them, their sizes and SHA-256 (``corpus``, now's).
    """
    out = config.out
    try:
        state_doc = json.loads((out / STATE_FILE).read_text())
        step, wall_s = int(state_doc["step"]), float(state_doc["train_wall_s"])
        saved_args = dict(state_doc["args"])
        moments = load_file(str(out / OPTIMIZER_FILE))
        with safe_open(str(out / OPTIMIZER_FILE), framework="pt") as f:
            moments_step = int((f.metadata() or {}).get("step", step))
        head_step = int(json.loads((out / "config.json").read_text())[HEAD_KEY]["notes"]["steps"])
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as exc:
        raise ConfigError(f"--resume: {out} holds no readable training state ({exc})") from None
    if not step == moments_step == head_step:
        raise ConfigError(
            f"--resume: {out} holds a save cut short (the head is at step {head_step}, the optimizer at "
            f"{moments_step}, the training state at {step}); train again without --resume"
        )
    if step > config.steps or (step == config.steps and config.draft_vocab is None):
        raise ConfigError(
            f"--resume: {out} is already at step {step}; give --steps above it to train on (or --steps {step} "
            "with --draft-vocab N to reduce its vocabulary without training)"
        )
    now = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items()}
    changed = [
        k for k in RESUME_FIXED if k != "corpus" and k in saved_args and _jsonish(saved_args[k]) != _jsonish(now[k])
    ]
    _check_corpus(state_doc, saved_args, corpus)
    if changed:
        raise ConfigError(
            f"--resume: {', '.join('--' + k.replace('_', '-') for k in changed)} differ from the run being resumed "
            f"({', '.join(f'{k}={saved_args[k]}' for k in changed)}); resume with the same settings"
        )
    for name, param in head.named_parameters():
        keys = {k.split("/", 1)[1]: v for k, v in moments.items() if k.split("/", 1)[0] == name}
        if keys:
            opt.state[param] = {k: (v.to(param.device) if k != "step" else v.float()) for k, v in keys.items()}
    return step, wall_s


def _check_corpus(state_doc: dict[str, object], saved_args: dict[str, object], corpus: list[dict[str, object]]) -> None:
    """Refuse a resumed run's corpus unless it is the saved run's: the same files (resolved paths, in order) and,
    where the save recorded them (``corpus_files``), the same contents. An older save names its files as given,
    resolved here from the current directory."""
    saved_files = state_doc.get("corpus_files")
    if isinstance(saved_files, list):
        saved_paths = [str(f.get("path")) if isinstance(f, dict) else None for f in saved_files]
    else:
        saved_paths = [str(Path(str(p)).resolve()) for p in _as_list(saved_args.get("corpus"))]
    now_paths = [str(f["path"]) for f in corpus]
    if saved_paths != now_paths:
        raise ConfigError(
            f"--resume: --corpus differs from the run being resumed (it trained on "
            f"{', '.join(map(str, saved_paths))}); resume with the same files"
        )
    if isinstance(saved_files, list):
        edited = [
            now["path"]
            for saved, now in zip(saved_files, corpus, strict=True)
            if not isinstance(saved, dict) or (saved.get("bytes"), saved.get("sha256")) != (now["bytes"], now["sha256"])
        ]
        if edited:
            raise ConfigError(
                f"--resume: corpus file {', '.join(map(str, edited))} changed since the run being resumed saved "
                "(its size or SHA-256 differ); resume with the text it trained on, or train again without --resume"
            )


def _as_list(value: object) -> list[object]:
    return list(value) if isinstance(value, list | tuple) else [value]


def _jsonish(value: object) -> object:
    """A setting as its JSON round trip reads (tuples as lists), so saved and current settings compare."""
    return json.loads(json.dumps(value))


def local_source(config: TrainConfig) -> LocalFeatures:
    """The whole target on this machine, in float32, reading ``config.feature_layers`` (default: the last)."""
    target = Checkpoint(config.model)
    num_layers = int(target.config.num_hidden_layers)
    model = load_full(target, torch.float32, device=resolve_device(config.device))
    return LocalFeatures(model, config.feature_layers or (num_layers,))


async def train(config: TrainConfig, source: FeatureSource) -> DraftHead:
    """Train (or, with ``config.resume``, continue training) a head for ``config.model`` on ``source``'s features."""
    torch.manual_seed(config.seed)
    target = Checkpoint(config.model)
    ends = source.ends
    num_layers = int(target.config.num_hidden_layers)
    if config.resume:
        if not (config.out / WEIGHTS_FILE).is_file():
            raise ConfigError(f"--resume: {config.out} holds no draft head to continue")
        # a head saved with a reduced vocabulary trains on against the target's whole LM head
        head = without_draft_vocab(load_draft_head(config.out, target, device=ends.device, dtype=torch.float32))
        if head.config.feature_layers != source.feature_layers:
            raise ConfigError(f"--resume: {config.out} reads feature layers {list(head.config.feature_layers)}")
    else:
        head = DraftHead(default_config(target, source.feature_layers), ends.device, torch.float32)
    head.train().requires_grad_(True)
    reg_slice = None
    if num_layers in source.feature_layers:
        j = source.feature_layers.index(num_layers)
        reg_slice = slice(j * head.config.hidden_size, (j + 1) * head.config.hidden_size)
    opt = torch.optim.AdamW(head.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=0.0)
    corpus = corpus_files(config.corpus)
    start, wall_before = _restore(head, opt, config, corpus) if config.resume else (0, 0.0)
    streams = read_corpus(config.corpus, config.model, config.seq_len)
    notes: dict[str, object] = {
        "corpus": [Path(p).name for p in config.corpus],
        "seq_len": config.seq_len,
        "batch": config.batch,
        "seed": config.seed,
    }
    vocab_ids = None
    if config.draft_vocab is not None:
        vocab_ids = frequent_tokens(token_counts(streams, int(ends.vocab_size)), config.draft_vocab)
        notes["draft_vocab"] = f"the {config.draft_vocab} target tokens most frequent in the corpus"

    def shipped() -> DraftHead | None:
        return None if vocab_ids is None else with_draft_vocab(head, ends, vocab_ids)

    log.info(
        "training a draft head for %s: %d parameters, features from layers %s, steps %d..%d",
        target.directory.name,
        sum(p.numel() for p in head.parameters()),
        list(source.feature_layers),
        start,
        config.steps,
    )
    began = time.perf_counter()
    bar = tqdm(total=config.steps, initial=start, disable=not config.progress, desc="train-drafter", unit="step")
    step = start
    for step in range(start, config.steps):
        gen = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
        batch = windows(streams, config.batch, config.seq_len, gen)
        pairs = [await source.features(w) for w in batch]
        tokens = torch.tensor(batch, dtype=torch.long).to(ends.device)  # (B, T)
        feats = torch.stack([p[0] for p in pairs]).float()  # (B, T, F*H)
        logits = torch.stack([p[1] for p in pairs])  # (B, T, V)
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, config)
        loss, parts = head_loss(head, ends, tokens, feats, logits, reg_slice, config.cls_weight, config.noise, gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
        opt.step()
        bar.update(1)
        bar.set_postfix(loss=f"{float(loss.detach()):.3f}", top1=f"{parts['top1']:.2f}")
        if (step + 1) % config.save_every == 0 and step + 1 < config.steps:
            _save(head, opt, step + 1, config, wall_before + time.perf_counter() - began, notes, shipped(), corpus)
        if step % 50 == 0:
            log.debug("step %d: loss %.4f, reg %.4f, cls %.4f, top1 %.3f", step, float(loss.detach()), *parts.values())
    bar.close()
    wall = wall_before + time.perf_counter() - began
    _save(head, opt, config.steps, config, wall, notes, shipped(), corpus)
    if start == config.steps:
        log.info(
            "draft head at step %d saved to %s with a %d-token draft vocabulary", start, config.out, config.draft_vocab
        )
    else:
        log.info("draft head saved to %s after %d steps (%.1f s of training)", config.out, config.steps, wall)
    head.eval().requires_grad_(False)
    reduced = shipped()
    return head if reduced is None else reduced


def train_local(config: TrainConfig) -> tuple[DraftHead, LocalFeatures]:
    """:func:`train` on the whole model on this machine, from synchronous code (the command): the head, its source."""
    source = local_source(config)
    return asyncio.run(train(config, source)), source
