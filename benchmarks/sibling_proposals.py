"""Benchmark: how much a draft tree's width can add at temperature > 0, under several lossless sibling schemes.

A sampled draft tree gains over a chain only through its siblings: once the first child (drawn from the
drafter's q) is rejected, the verifier's target becomes the residual norm(max(0, p - q)), and the next sibling
is accepted only as far as its proposal covers that residual. Every scheme below is exact (sequential
rejection sampling, each stage against the current residual with the distribution that stage's token was
drawn from), so they differ only in how often a level of k siblings accepts one:

* ``without replacement``: what the engine does (Gumbel-top-k draws from q, each rejection also removing the
  rejected token from q; Yang et al. 2024);
* ``flatter siblings T``: the first child from q, later siblings from the drafter at a higher temperature T
  (without the earlier siblings), betting that the residual lies where q is too confident;
* ``residual estimate T``: later siblings from norm(max(0, q_T - q)), an estimate of the residual itself;
* ``top k-1 + 1 sampled``: the k-1 tokens q ranks highest, verified as deterministic drafts (one-hot), then one
  draw from q without them (the greedy multi-draft scheme of Hu et al. 2025);
* ``deterministic top-k``: the k tokens q ranks highest, one-hot (EAGLE's tree verification at temperature > 0).

p and q are the demo base model's and the drafter's (the demo draft model, or the shipped EAGLE head fed the
base model's own features) distributions after the same temperature, teacher-forced over held-out text (the
prompts are corpus text, not the model's own samples). Reported: the chance a level of k siblings accepts one
(k = 1 is a chain's level), and the j-th sibling's acceptance once those before it were rejected.

    python benchmarks/sibling_proposals.py [--temperature 0.8] [--tokens 300] [--draws 4]
        [--out benchmarks/results/trees/siblings]

Writes sibling_proposals.json and sibling_proposals.md into --out.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from splitspec.demo import embedded_model
from splitspec.models.checkpoint import Checkpoint
from splitspec.models.draft_head_io import load_draft_head
from splitspec.models.features import full_model_step
from splitspec.models.kv_cache import KVCache
from splitspec.models.loading import load_full
from splitspec.models.masks import chain
from splitspec.run_info import run_environment

REPO = Path(__file__).resolve().parents[1]
HELDOUT = REPO / "src" / "splitspec" / "assets" / "corpus" / "heldout"
WIDTHS = (1, 2, 3, 4)
FLAT_T = (1.0, 1.3, 2.0)

Proposal = Callable[[list[torch.Tensor]], torch.Tensor]  # earlier siblings' tokens (N,) each -> s_j (N, V)


def texts() -> list[Path]:
    prose = sorted((HELDOUT / "prose").iterdir())[:2]
    return [HELDOUT / "code" / "chunk.txt", HELDOUT / "code" / "asyncio.taskgroups.txt", *prose]


def logits_pairs(drafter: str, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(target logits, drafter logits), both (N, V), row i of each scoring the same next token."""
    base_dir = embedded_model("base")
    target = load_full(Checkpoint(base_dir), torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    head = load_draft_head(embedded_model("base-eagle"), Checkpoint(base_dir)) if drafter == "head" else None
    draft = load_full(Checkpoint(embedded_model("draft")), torch.float32) if drafter == "draft" else None
    ps, qs = [], []
    for path in texts():
        ids = tokenizer(path.read_text(encoding="utf-8")[: tokens * 3])["input_ids"][:tokens]
        n = len(ids)
        x = torch.tensor(ids)
        pos, parents = torch.arange(n, dtype=torch.int32), torch.tensor(chain(n), dtype=torch.int32)
        with torch.inference_mode():
            if draft is not None:
                ps.append(target.forward(x, pos, parents, KVCache()))  # (n, V)
                qs.append(draft.forward(x, pos, parents, KVCache()))
                continue
            assert head is not None
            p, feats = full_model_step(target, x, pos, parents, KVCache(), head.config.feature_layers)
            # pair i = (feature of token i, token i + 1) predicts the feature of token i + 1; its logits score
            # token i + 2, as the target's row i + 1 does
            m = n - 1
            out = head.forward(target, x[1:], feats[:m], pos[:m], parents[:m], KVCache())  # (m, H)
            ps.append(p[1:])
            qs.append(head.logits(target, out))
    return torch.cat(ps), torch.cat(qs)


def _renorm(x: torch.Tensor) -> torch.Tensor:
    return x / x.sum(-1, keepdim=True).clamp_min(1e-30)


def _without(d: torch.Tensor, earlier: list[torch.Tensor]) -> torch.Tensor:
    d = d.clone()
    for x in earlier:
        d.scatter_(1, x[:, None], 0.0)
    return _renorm(d)


def level(p0: torch.Tensor, proposals: list[Proposal], generator: torch.Generator, draws: int) -> dict[str, Any]:
    """Sequential rejection over one level of siblings, each drawn from its proposal: the chance one is
    accepted, and each rank's acceptance once the earlier ones were rejected (Monte Carlo over ``draws``)."""
    reached, accepted, level_acc = [0.0] * len(proposals), [0.0] * len(proposals), 0.0
    for _ in range(draws):
        earlier: list[torch.Tensor] = []
        p, alive = p0.clone(), torch.ones(p0.shape[0])
        for j, proposal in enumerate(proposals):
            s = proposal(earlier)  # (N, V)
            x = torch.multinomial(s + 1e-30, 1, generator=generator).squeeze(1)  # (N,)
            px, sx = p.gather(1, x[:, None]).squeeze(1), s.gather(1, x[:, None]).squeeze(1)
            a = (px / sx.clamp_min(1e-30)).clamp(max=1.0)  # accept x ~ s with min(1, p(x) / s(x))
            reached[j] += float(alive.mean())
            accepted[j] += float((alive * a).mean())
            alive = alive * (1 - a)
            p = _renorm((p - s).clamp_min(0))  # rejected: the target is the residual
            earlier.append(x)
        level_acc += float(1 - alive.mean())
    ranks = [a / r if r > 0 else 0.0 for a, r in zip(accepted, reached, strict=True)]
    return {"level": level_acc / draws, "ranks": ranks}


def deterministic(p: torch.Tensor, q: torch.Tensor, k: int, sampled_last: bool) -> dict[str, Any]:
    """Exact: the top k (or k - 1) of q as one-hot drafts (accepted with the target's mass on them), and with
    ``sampled_last`` one more draw from q without them, against the residual that remains."""
    det = k - 1 if sampled_last else k
    top = q.topk(max(det, 1), dim=-1).indices[:, :det]  # (N, det)
    mass = p.gather(1, top).sum(-1) if det else torch.zeros(p.shape[0])
    if not sampled_last:
        return {"level": float(mass.mean())}
    rest_p = _renorm(p.scatter(1, top, 0.0)) if det else p
    rest_q = _renorm(q.scatter(1, top, 0.0)) if det else q
    return {"level": float((mass + (1 - mass) * torch.minimum(rest_p, rest_q).sum(-1)).mean())}


def measure(p_logits: torch.Tensor, q_logits: torch.Tensor, temperature: float, draws: int) -> dict[str, Any]:
    p = torch.softmax(p_logits / temperature, -1)
    q = torch.softmax(q_logits / temperature, -1)
    generator = torch.Generator().manual_seed(0)
    schemes: dict[str, dict[int, dict[str, Any]]] = {}

    def first(_: list[torch.Tensor]) -> torch.Tensor:
        return q

    def later_from(d: torch.Tensor) -> Proposal:
        return lambda earlier: _without(d, earlier)

    for k in WIDTHS:
        siblings = [later_from(q)] * (k - 1)
        schemes.setdefault("without replacement", {})[k] = level(p, [first, *siblings], generator, draws)
        for t in FLAT_T:
            flat = torch.softmax(q_logits / t, -1)
            schemes.setdefault(f"flatter siblings T={t:g}", {})[k] = level(
                p, [first] + [later_from(flat)] * (k - 1), generator, draws
            )
            estimate = _renorm((flat - q).clamp_min(0)) + 1e-6 * flat  # never zero where q_T is not
            schemes.setdefault(f"residual estimate T={t:g}", {})[k] = level(
                p, [first] + [later_from(estimate)] * (k - 1), generator, draws
            )
        schemes.setdefault("top k-1 + 1 sampled", {})[k] = deterministic(p, q, k, sampled_last=True)
        schemes.setdefault("deterministic top-k", {})[k] = deterministic(p, q, k, sampled_last=False)
    return {"positions": int(p.shape[0]), "schemes": schemes}


def markdown(results: dict[str, Any]) -> list[str]:
    lines = []
    for drafter, res in results.items():
        lines += [
            "",
            f"## {drafter} ({res['positions']} positions)",
            "",
            "| scheme | " + " | ".join(f"level of {k}" for k in WIDTHS) + " | sibling acceptance by rank (k = 4) |",
            "|---|" + "---:|" * len(WIDTHS) + "---|",
        ]
        for name, by_k in res["schemes"].items():
            ranks = by_k[WIDTHS[-1]].get("ranks")
            cells = " | ".join(f"{by_k[k]['level']:.3f}" for k in WIDTHS)
            lines.append(f"| {name} | {cells} | {', '.join(f'{r:.2f}' for r in ranks) if ranks else '-'} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--temperature", type=float, default=0.8, help="sampling temperature of p and q (> 0)")
    parser.add_argument("--tokens", type=int, default=300, help="tokens of each held-out text")
    parser.add_argument("--draws", type=int, default=4, help="Monte Carlo draws per position")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/trees/siblings"))
    args = parser.parse_args()
    if args.temperature <= 0:
        parser.error("--temperature must be > 0: at 0 every scheme is greedy verification")
    torch.set_num_threads(1)
    env = run_environment()
    results = {}
    for drafter, label in (("draft", "the demo draft model"), ("head", "the shipped EAGLE head")):
        p_logits, q_logits = logits_pairs(drafter, args.tokens)
        results[label] = measure(p_logits, q_logits, args.temperature, args.draws)
        print(label, {n: round(v[2]["level"], 3) for n, v in results[label]["schemes"].items()}, flush=True)
    command = (
        f"python benchmarks/sibling_proposals.py --temperature {args.temperature:g} --tokens {args.tokens} "
        f"--draws {args.draws}"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {"environment": env, "command": command, "temperature": args.temperature, "results": results}
    (args.out / "sibling_proposals.json").write_text(json.dumps(payload, indent=2) + "\n")
    lines = [
        f"# Siblings at temperature {args.temperature:g}: how often a level of k drafts accepts one",
        "",
        f"Commit `{env['commit']}`. Teacher-forced over held-out text (2 code, 2 prose files); every scheme is "
        "lossless. A level of 1 is a chain's level.",
        "",
        f"    {command}",
        *markdown(results),
    ]
    (args.out / "sibling_proposals.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
