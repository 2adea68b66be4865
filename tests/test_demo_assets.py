"""Checks of the embedded demo assets: corpus manifest, tokenizer and the trained demo models.

The models and held-out documents are produced by ``scripts/build_corpus.py`` and
``scripts/train_demo_models.py`` and ship inside the package (``splitspec/assets``). Everything
here loads from the installed package path with ``local_files_only=True``, i.e. fully offline.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

import splitspec

ASSETS = Path(splitspec.__file__).parent / "assets"
MODELS = ASSETS / "models"
CORPUS = ASSETS / "corpus"
MODEL_NAMES = ("base", "draft", "worker")
# Shipped model sizes: the split demo pair (base + draft) and the SpecFed worker have separate budgets.
MAX_BASE_DRAFT_BYTES = 20 * 1024 * 1024
MAX_WORKER_BYTES = 10 * 1024 * 1024
MAX_HELDOUT_BYTES = 1_500_000
EXCERPT_TOKENS = 384

# Held-out excerpts: (file under heldout/<domain>/, character offset; the excerpt starts at the next line).
HELDOUT_EXCERPTS = {"prose": ("alls_well_that_ends_well.txt", 10_000), "code": ("pkgutil.txt", 0)}
# Perplexity ceilings on those excerpts, about twice what the shipped models score (base: prose ~94,
# code ~32; draft: prose ~133, code ~47; worker: prose ~131, code ~27; see the model cards for the full
# held-out numbers). An untrained model scores about the vocabulary size (~8000), so these catch broken or
# untrained weights.
PPL_CEILING = {
    ("base", "prose"): 200.0,
    ("base", "code"): 80.0,
    ("draft", "prose"): 300.0,
    ("draft", "code"): 120.0,
    ("worker", "prose"): 300.0,
    ("worker", "code"): 60.0,
}


@pytest.fixture(scope="module")
def manifest() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((CORPUS / "manifest.json").read_text(encoding="utf-8"))
    return data


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, PreTrainedTokenizerBase]:
    return {n: AutoTokenizer.from_pretrained(MODELS / n, local_files_only=True) for n in MODEL_NAMES}


@pytest.fixture(scope="module")
def models() -> dict[str, PreTrainedModel]:
    torch.set_num_threads(1)
    loaded = {}
    for name in MODEL_NAMES:
        model = AutoModelForCausalLM.from_pretrained(MODELS / name, dtype=torch.float32, local_files_only=True)
        loaded[name] = model.eval()
    return loaded


def test_manifest_splits_are_disjoint(manifest: dict[str, Any]) -> None:
    docs = manifest["documents"]
    keys = [(d["domain"], d["doc_id"]) for d in docs]
    assert len(keys) == len(set(keys)), "a document appears twice (i.e. in two splits)"
    texts = [d["sha256"] for d in docs]
    assert len(texts) == len(set(texts)), "two documents have identical text"
    for domain in ("prose", "code"):
        splits = {d["split"] for d in docs if d["domain"] == domain}
        assert splits == {"train", "val", "test"}, domain
    for d in docs:
        assert d["source"]
        assert d["licence"]


def test_heldout_files_match_manifest(manifest: dict[str, Any]) -> None:
    shipped = [d for d in manifest["documents"] if d["heldout_file"]]
    assert {d["domain"] for d in shipped} == {"prose", "code"}
    total = 0
    for d in shipped:
        assert d["split"] == "test", f"{d['doc_id']} is shipped as held-out but is in {d['split']}"
        data = (CORPUS / d["heldout_file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == d["sha256"]
        total += len(data)
    on_disk = sorted(p.relative_to(CORPUS).as_posix() for p in (CORPUS / "heldout").rglob("*.txt"))
    assert on_disk == sorted(d["heldout_file"] for d in shipped)
    assert total <= MAX_HELDOUT_BYTES


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_models_total_size() -> None:
    heads = ("base-eagle",)  # the base model's EAGLE draft head: tests/test_demo_head.py
    assert sorted(p.name for p in MODELS.iterdir() if p.is_dir()) == sorted((*MODEL_NAMES, *heads))
    base_draft = _dir_bytes(MODELS / "base") + _dir_bytes(MODELS / "draft")
    assert base_draft <= MAX_BASE_DRAFT_BYTES, f"base + draft: {base_draft} bytes"
    worker = _dir_bytes(MODELS / "worker")
    assert worker <= MAX_WORKER_BYTES, f"worker: {worker} bytes"
    for name in MODEL_NAMES:
        for fname in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md"):
            assert (MODELS / name / fname).is_file(), f"{name}/{fname}"


def test_tokenizer_vocab_and_round_trip(tokenizers: dict[str, PreTrainedTokenizerBase]) -> None:
    base, draft = tokenizers["base"], tokenizers["draft"]
    assert 8000 <= len(base) <= 8500
    assert base.get_vocab() == draft.get_vocab() == tokenizers["worker"].get_vocab()
    assert base.bos_token is not None
    assert base.eos_token is not None
    assert base.bos_token_id != base.eos_token_id
    text = "O, what a rogue and peasant slave am I!\n\ndef f(x: int) -> int:\n    return x ** 2  # é\n"
    ids = base(text)["input_ids"]
    assert ids[0] == base.bos_token_id
    assert base.decode(ids, skip_special_tokens=True) == text
    assert len(ids) < len(text.encode("utf-8")) / 2  # BPE actually merges


def test_models_load_with_expected_shapes(
    models: dict[str, PreTrainedModel], tokenizers: dict[str, PreTrainedTokenizerBase]
) -> None:
    base, draft = models["base"], models["draft"]
    assert base.config.model_type == draft.config.model_type == "llama"
    assert base.config.num_hidden_layers >= 8
    assert base.config.vocab_size == draft.config.vocab_size == len(tokenizers["base"])
    n_base = sum(p.numel() for p in base.parameters())
    n_draft = sum(p.numel() for p in draft.parameters())
    assert 5_000_000 <= n_base <= 10_000_000
    assert 1_000_000 <= n_draft <= 2_000_000
    assert base.get_input_embeddings().weight.dtype == torch.float32
    assert base.config.eos_token_id == tokenizers["base"].eos_token_id


def test_worker_model_is_a_heterogeneous_federation_peer(
    models: dict[str, PreTrainedModel], tokenizers: dict[str, PreTrainedTokenizerBase]
) -> None:
    """SpecFed needs workers that differ (shape, data) but share the vocabulary and special tokens."""
    base, worker = models["base"], models["worker"]
    assert worker.config.model_type == "llama"
    assert worker.config.vocab_size == base.config.vocab_size == len(tokenizers["worker"])
    assert (worker.config.num_hidden_layers, worker.config.hidden_size) != (
        base.config.num_hidden_layers,
        base.config.hidden_size,
    )
    assert worker.config.eos_token_id == base.config.eos_token_id
    assert worker.config.bos_token_id == base.config.bos_token_id
    n_worker = sum(p.numel() for p in worker.parameters())
    assert 2_000_000 <= n_worker <= 5_000_000


def _excerpt_ppl(model: PreTrainedModel, tok: PreTrainedTokenizerBase, domain: str) -> float:
    fname, offset = HELDOUT_EXCERPTS[domain]
    text = (CORPUS / "heldout" / domain / fname).read_text(encoding="utf-8")
    if offset:
        text = text[text.index("\n", offset) + 1 :]
    ids = tok(text, return_tensors="pt")["input_ids"][:, :EXCERPT_TOKENS]
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss
    return math.exp(float(loss))


@pytest.mark.parametrize("name", MODEL_NAMES)
@pytest.mark.parametrize("domain", ["prose", "code"])
def test_heldout_perplexity(
    name: str,
    domain: str,
    models: dict[str, PreTrainedModel],
    tokenizers: dict[str, PreTrainedTokenizerBase],
) -> None:
    ppl = _excerpt_ppl(models[name], tokenizers[name], domain)
    assert ppl < PPL_CEILING[(name, domain)], f"{name} {domain} held-out ppl {ppl:.1f}"


def test_base_beats_draft_on_heldout(
    models: dict[str, PreTrainedModel], tokenizers: dict[str, PreTrainedTokenizerBase]
) -> None:
    for domain in ("prose", "code"):
        base = _excerpt_ppl(models["base"], tokenizers["base"], domain)
        draft = _excerpt_ppl(models["draft"], tokenizers["draft"], domain)
        assert base < draft, domain


def test_code_heavy_worker_beats_draft_on_code(
    models: dict[str, PreTrainedModel], tokenizers: dict[str, PreTrainedTokenizerBase]
) -> None:
    """The worker's 75 % code mix shows: on held-out code it is well ahead of the draft model."""
    worker = _excerpt_ppl(models["worker"], tokenizers["worker"], "code")
    draft = _excerpt_ppl(models["draft"], tokenizers["draft"], "code")
    assert worker < draft, (worker, draft)
