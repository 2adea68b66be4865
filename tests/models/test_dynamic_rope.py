"""Dynamic-NTK rotary (``rope_type: dynamic``): each step's tables come from its own positions, never from an earlier
call's.

transformers' dynamic update is stateful (its frequencies grow with the largest position seen and reset only below
the original length), and one rotary serves every session and every row of a batch: a 40-token sequence after a
60-token one got the 60-token frequencies. Each step must get what the sequence alone gets in transformers: for a
largest position P past the original length, base' = base * (factor * (P + 1) / original - (factor - 1)) **
(dim / (dim - 2)).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from splitspec.models.batched import BatchRow, forward_batch
from splitspec.models.checkpoint import Checkpoint
from splitspec.models.kv_cache import KVCache
from splitspec.models.loading import load_full, load_trunk
from splitspec.models.masks import chain
from splitspec.models.split import SplitPlan
from splitspec.models.stack import FullModel

ORIGINAL = 32  # max_position_embeddings: past it, the frequencies follow the sequence's length
VOCAB = 96


@pytest.fixture(scope="module")
def dynamic(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=4,
        max_position_embeddings=ORIGINAL,
        rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0},
        initializer_range=0.2,
        bos_token_id=0,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("dynamic-ntk")
    transformers.AutoModelForCausalLM.from_config(config).eval().save_pretrained(directory)
    return directory


def tokens(count: int, seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (count,), generator=torch.Generator().manual_seed(seed))


def prefill(model: FullModel, ids: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
    q = len(ids)
    logits: torch.Tensor = model(ids, torch.arange(q), torch.tensor(chain(q)), KVCache() if cache is None else cache)
    return logits


def test_a_sequence_after_a_longer_one_equals_it_alone(dynamic: Path) -> None:
    long, short = tokens(60, 1), tokens(40, 2)
    alone = prefill(load_full(Checkpoint(dynamic)), short)
    shared = load_full(Checkpoint(dynamic))
    prefill(shared, long)
    torch.testing.assert_close(prefill(shared, short), alone, rtol=0, atol=0)  # was off by 2.0
    hf = transformers.AutoModelForCausalLM.from_pretrained(dynamic, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(alone, hf(short[None]).logits[0])


def test_a_batched_step_of_rows_of_different_lengths_equals_each_alone(dynamic: Path) -> None:
    plan = SplitPlan(4, 1, 1)
    batched_trunk = load_trunk(Checkpoint(dynamic), plan, torch.float32)
    torch.manual_seed(0)
    rows, expected = [], []
    for past, parents in [(50, [-1, 0, 1]), (36, [-1]), (20, [-1, 0])]:  # the longest row first
        prefix = torch.randn(1, past, 32)
        positions = torch.arange(past, past + len(parents))
        parent_t = torch.tensor(parents)
        hidden = torch.randn(1, len(parents), 32)
        solo_trunk = load_trunk(Checkpoint(dynamic), plan, torch.float32)  # a fresh rotary: the row alone
        solo = KVCache()
        solo_trunk(prefix, torch.arange(past), torch.tensor(chain(past)), solo)
        expected.append(solo_trunk(hidden, positions, parent_t, solo))
        cache = KVCache()
        batched_trunk(prefix, torch.arange(past), torch.tensor(chain(past)), cache)
        rows.append(BatchRow(hidden, positions, parent_t, cache))
    for out, want in zip(forward_batch(batched_trunk, rows), expected, strict=True):
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_greedy_decoding_across_the_original_length_equals_transformers_generate(dynamic: Path) -> None:
    """Step by step from a 24-token prompt to position 43, another session's 60-token sequence run in between."""
    prompt, new = tokens(24, 3), 20
    hf = transformers.AutoModelForCausalLM.from_pretrained(dynamic, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(
            prompt[None],
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=new,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    expected = out.sequences[0, len(prompt) :].tolist()
    model = load_full(Checkpoint(dynamic))
    cache = KVCache()
    logits = prefill(model, prompt, cache)[-1]
    got: list[torch.Tensor] = []
    for step in range(new):
        if step == ORIGINAL - len(prompt) + 2:  # past the original length: another session's longer sequence
            prefill(model, tokens(60, 1))
        got.append(logits)
        token = int(logits.argmax())
        position = len(prompt) + step
        logits = model(torch.tensor([token]), torch.tensor([position]), torch.tensor([-1]), cache)[0]
    assert [int(x.argmax()) for x in got] == expected
    torch.testing.assert_close(torch.stack(got), torch.cat(out.logits), rtol=1e-4, atol=1e-4)
