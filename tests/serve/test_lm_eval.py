"""lm-evaluation-harness (``lm-eval run --model local-completions``, as a process) scores a multiple-choice
task against ``splitspec serve`` (the shared stack's server, over loopback HTTP; tests/serve/test_cli_serve.py
runs the command itself): its per-item loglikelihoods and its accuracy equal what transformers computes on the
whole model here. The task and its data are written by the test (no download); lm-eval finds the server's
tokenizer through /tokenizer_info and /tokenize."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from tests.conftest import local_model
from tests.serve.conftest import MODEL_NAME, Stack

TASK = "splitspec_mc"
DOCS: list[dict[str, Any]] = [
    {"question": "to be or not to", "choices": ["be", "question", "mind"], "answer": 0},
    {"question": "that is the", "choices": ["question", "nobler", "suffer"], "answer": 0},
    {"question": "whether tis nobler in the", "choices": ["mind", "range", "class"], "answer": 0},
    {"question": "def main(): return", "choices": ["print(value)", "to be", "the question"], "answer": 0},
    {"question": "for x in", "choices": ["range(10):", "the mind", "Split"], "answer": 1},
    {"question": "class Split:", "choices": ["pass", "yield x", "or not"], "answer": 2},
]
TASK_YAML = f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {{data}}
test_split: test
output_type: multiple_choice
doc_to_text: question
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
"""

# ``lm-eval run`` (its own CLI, in a process of its own), less one thing: every TaskManager first indexes lm-eval's
# ~14,000 built-in task YAMLs, most of the command's time; the task here is ours, from --include_path
LM_EVAL_RUN = (
    "import lm_eval.tasks\n"
    "from lm_eval.__main__ import cli_evaluate\n"
    "init = lm_eval.tasks.TaskManager.__init__\n"
    "lm_eval.tasks.TaskManager.__init__ = lambda self, *a, **kw: init(self, *a, **{'include_defaults': False, **kw})\n"
    "cli_evaluate()\n"
)


def encode_pair(tokenizer: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a request into context and continuation tokens (trailing spaces move right)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    ctx = tokenizer(context, add_special_tokens=False).input_ids
    return ctx, whole[len(ctx) :]


@pytest.mark.slow
def test_lm_eval_multiple_choice_matches_the_local_model(stack: Stack, chat_model: Path, tmp_path: Path) -> None:
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / f"{TASK}.yaml").write_text(TASK_YAML.format(data=data))
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, "-c", LM_EVAL_RUN, "run", "--model", "local-completions", "--model_args",
         f"model={MODEL_NAME},base_url={stack.base_url}/completions,num_concurrent=1,max_retries=1",
         "--tasks", TASK, "--include_path", str(tasks), "--batch_size", "3", "--log_samples",
         "--output_path", str(out)],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "remote tokenizer" in run.stdout + run.stderr  # lm-eval used the server's own tokenizer
    (samples_file,) = out.rglob(f"samples_{TASK}_*.jsonl")
    (results_file,) = out.rglob("results_*.json")
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    assert len(samples) == len(DOCS)

    tokenizer = AutoTokenizer.from_pretrained(chat_model, local_files_only=True)
    model = local_model(chat_model)
    correct = 0
    for sample in sorted(samples, key=lambda s: int(s["doc_id"])):
        doc = DOCS[int(sample["doc_id"])]
        expected = []
        for choice in doc["choices"]:
            ctx, cont = encode_pair(tokenizer, doc["question"], " " + choice)
            with torch.no_grad():
                logits = model(torch.tensor([ctx + cont])).logits[0].float()  # (T, V)
            rows = torch.log_softmax(logits, dim=-1)[len(ctx) - 1 : -1]  # row k scores cont[k]
            expected.append(float(rows[torch.arange(len(cont)), torch.tensor(cont)].sum()))
        got = [float(r[0]) for r in sample["filtered_resps"]]
        assert got == pytest.approx(expected, abs=1e-4), sample["doc_id"]
        correct += max(range(len(expected)), key=expected.__getitem__) == doc["answer"]
    acc = json.loads(results_file.read_text())["results"][TASK]["acc,none"]
    assert acc == correct / len(DOCS)
