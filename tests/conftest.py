"""Shared fixtures: tiny random checkpoints of each family, saved with save_pretrained."""

from __future__ import annotations

import signal
from collections import Counter
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

VOCAB = 96
torch.set_num_threads(1)  # tiny models: threads only add sync overhead on a loaded 2-core machine
TOKENIZER_TEXT = (
    "to be or not to be that is the question whether tis nobler in the mind to suffer "
    "def main(): return print(value) for x in range(10): yield x class Split: pass"
)


def tiny_config(
    family: str, layers: int = 6, vocab: int = VOCAB, hidden: int = 64, max_positions: int = 4096
) -> object:
    common: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        eos_token_id=None,
        bos_token_id=0,
        pad_token_id=None,
    )
    if family == "llama":
        return LlamaConfig(**common)
    if family == "mistral":
        return MistralConfig(**common, sliding_window=8)  # small window: exercised by short prompts
    if family == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=True)
    raise ValueError(family)


_MODEL_CLASSES = {"llama": LlamaForCausalLM, "mistral": MistralForCausalLM, "qwen2": Qwen2ForCausalLM}


def save_tiny_tokenizer(directory: Path, vocab: int = VOCAB) -> None:
    """A small BPE tokenizer whose ids all fall inside the tiny models' vocabulary."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>", "<unk>"])
    tok.train_from_iterator([TOKENIZER_TEXT] * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(directory)


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Build (once per arguments) a random checkpoint directory with a tokenizer."""
    cache: dict[tuple[object, ...], Path] = {}

    def build(
        family: str = "llama",
        *,
        layers: int = 6,
        sharded: bool = False,
        hidden: int = 64,
        vocab: int = VOCAB,
        logit_scale: float = 1.0,
        max_positions: int = 4096,
        seed: int = 1234,
    ) -> Path:
        """``logit_scale`` multiplies the LM head so the next-token law is far from uniform."""
        key = (family, layers, sharded, hidden, vocab, logit_scale, max_positions, seed)
        if key not in cache:
            torch.manual_seed(seed)
            config = tiny_config(family, layers, vocab=vocab, hidden=hidden, max_positions=max_positions)
            model = _MODEL_CLASSES[family](config).eval()
            with torch.no_grad():
                model.lm_head.weight.mul_(logit_scale)
            directory = tmp_path_factory.mktemp(f"{family}-{layers}{'-sharded' if sharded else ''}")
            model.save_pretrained(directory, max_shard_size="60KB" if sharded else "2GB")
            if vocab >= VOCAB:
                save_tiny_tokenizer(directory)
            cache[key] = directory
        return cache[key]

    return build


def pytest_configure(config: pytest.Config) -> None:
    # A shell starts a background job (`make test &`) with SIGINT ignored, and every process it
    # spawns inherits that: the tests that stop a splitspec process with Ctrl-C's signal would then
    # see it ignored. A handler here makes the signal's default come back in the processes we start.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--device",
        default="cpu",
        help="device for the device-parametrised tests (cpu, cuda, cuda:N, mps); scripts/gpu_check.sh passes cuda",
    )

    parser.addoption(
        "--compile-backend",
        default="eager",
        help="torch.compile backend of the --compile tests: eager (dynamo's graph capture only, seconds; the "
        "default) or inductor (the real compile, minutes on a CPU; scripts/gpu_check.sh passes it)",
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the files with a slow-lane test first, then the others with the most tests first.

    ``make test`` hands whole files to two xdist workers in this order (--dist loadfile
    --no-loadscope-reorder). xdist's own order (most tests first) put the files that start
    ``splitspec`` processes, which hold few tests but take longest, at the very end, where one
    worker finished them while the other had nothing left to do. The order within a file is kept.
    """
    tests_in = Counter(item.path for item in items)
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: (item.path not in slow, -tests_in[item.path]))


@pytest.fixture(scope="session")
def compile_backend(request: pytest.FixtureRequest) -> str:
    return str(request.config.getoption("--compile-backend"))


@pytest.fixture(scope="session")
def device(request: pytest.FixtureRequest) -> str:
    """The device the device-aware tests run on; they are skipped when this machine lacks it."""
    from splitspec.devices import resolve_device
    from splitspec.exceptions import DeviceUnavailable

    name = str(request.config.getoption("--device"))
    try:
        resolve_device(name)
    except DeviceUnavailable as exc:
        pytest.skip(f"--device {name}: {exc}")
    return name


def law_fit_pvalue(counts: Counter[int], law: torch.Tensor, n: int) -> float:
    """Chi-square p-value of ``n`` sampled tokens against ``law`` (V,), rare cells pooled (expected >= 5)."""
    from scipy.stats import chisquare

    support = (law > 0).nonzero().flatten().tolist()
    big = [t for t in support if law[t] * n >= 5]
    observed = [counts[t] for t in big] + [n - sum(counts[t] for t in big)]
    exp = [float(law[t]) * n for t in big]
    exp.append(max(0.0, n - sum(exp)))
    if exp[-1] < 1e-6:  # no rare cells to pool
        observed, exp = observed[:-1], exp[:-1]
    exp = [e * n / sum(exp) for e in exp]  # float32 rounding: make the totals agree exactly
    return float(chisquare(observed, exp).pvalue)


def joint_law_pvalue(counts: Counter[tuple[int, int]], joint: torch.Tensor, n: int) -> float:
    """:func:`law_fit_pvalue` of ``n`` sampled token pairs against their joint law ``joint`` (V, V)."""
    vocab = joint.shape[1]
    flat: Counter[int] = Counter({a * vocab + b: c for (a, b), c in counts.items()})
    return law_fit_pvalue(flat, joint.flatten(), n)


def local_model(directory: Path, dtype: torch.dtype = torch.float32, device: str = "cpu") -> PreTrainedModel:
    """The whole checkpoint in one process, as transformers loads it, on ``device``."""
    from transformers import AutoModelForCausalLM

    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
    model.to(torch.device(device))  # type: ignore[arg-type]  # transformers types .to() oddly; moves in place
    model.eval()
    return model


def local_greedy(
    directory: Path, prompt: list[int], max_new_tokens: int, dtype: torch.dtype = torch.float32, device: str = "cpu"
) -> list[int]:
    """transformers' own greedy ``generate`` of the whole checkpoint on ``device``."""
    model = local_model(directory, dtype, device)
    with torch.no_grad():
        generate: Callable[..., torch.Tensor] = model.generate  # type: ignore[assignment]  # transformers types it as a Tensor
        ids = torch.tensor(
            [prompt], device=device
        )  # an explicit mask: a BOS equal to pad_token_id must not be masked out
        out = generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0
        )
    return list(out[0, len(prompt) :].tolist())


@cache
def greedy_reference(directory: Path, prompt: tuple[int, ...], max_new_tokens: int) -> list[int]:
    """:func:`local_greedy` (float32, CPU), computed once per checkpoint, prompt and length in a test process: the
    identity tests compare several runs with the same reference. Do not modify the list returned."""
    return local_greedy(directory, list(prompt), max_new_tokens)


@pytest.fixture(scope="session")
def tool_model(make_checkpoint: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2 with a byte-level tokenizer and a Qwen2.5-style tools chat template."""
    from tests.tool_model import TOOL_VOCAB, build_tool_model

    return build_tool_model(make_checkpoint("qwen2", vocab=TOOL_VOCAB), tmp_path_factory.mktemp("tool-qwen2"))
