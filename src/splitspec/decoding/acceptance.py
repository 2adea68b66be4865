"""Acceptance rules for speculative decoding: which drafted tokens the target model keeps.

Greedy: a drafted token is accepted while it equals the target's argmax; the first mismatch is
replaced by the argmax, so the output is token-for-token what greedy decoding would produce.

Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): drafted token x drawn from q is
accepted with probability min(1, p(x) / q(x)); on rejection the replacement is drawn from
norm(max(0, p - q)). The emitted tokens then follow p exactly. A deterministic drafter (n-gram,
prompt lookup) has q one-hot on its token: acceptance becomes p(x), and the residual is p with x
removed. When every drafted token is accepted, a bonus token is drawn from p at the next position.

Trees: at each accepted node its children are tried in order, each rejection replacing p by the
residual (SpecInfer, SpecTr). Model-drafted siblings are draws without replacement from one q, so
each rejection also removes the rejected token from q (Yang et al. 2024); the emitted tokens still
follow p exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from splitspec.decoding.sampling import greedy_tokens
from splitspec.models.masks import chain


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one linear draft."""

    accepted: int  # number of drafted tokens kept
    next_token: int  # the target's correction (or bonus token after a full acceptance)

    def tokens(self, draft: Sequence[int]) -> list[int]:
        """The tokens this step emits: the accepted prefix of ``draft`` plus ``next_token``."""
        return [*draft[: self.accepted], self.next_token]


def greedy_verify(draft: Sequence[int], target_logits: torch.Tensor) -> Verdict:
    """target_logits (len(draft)+1, V): row i scores the token after draft[:i].

    A linear draft is a one-branch tree: see :func:`greedy_verify_tree`.
    """
    verdict = greedy_verify_tree(draft, chain(len(draft)), target_logits)
    return Verdict(accepted=len(verdict.path), next_token=verdict.next_token)


def one_hot_draft(draft: Sequence[int], vocab_size: int) -> torch.Tensor:
    """q for a deterministic drafter: (len(draft), V), one-hot on each drafted token."""
    q = torch.zeros(len(draft), vocab_size)
    if draft:
        q[torch.arange(len(draft)), torch.tensor(list(draft))] = 1.0
    return q


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)); falls back to p when p <= q everywhere (then rejection has probability 0)."""
    r = (p - q).clamp_min(0)
    total = r.sum()
    return r / total if total > 0 else p


def speculative_verify(
    draft: Sequence[int], draft_probs: torch.Tensor, target_probs: torch.Tensor, generator: torch.Generator
) -> Verdict:
    """Lossless speculative sampling of a linear draft (the one-branch case of :func:`sample_verify_tree`).

    draft_probs (γ, V): q for each drafted position; target_probs (γ+1, V): p at each position,
    both after the same temperature / top-p transform.
    """
    verdict = sample_verify_tree(draft, chain(len(draft)), draft_probs, target_probs, generator)
    return Verdict(accepted=len(verdict.path), next_token=verdict.next_token)


@dataclass(frozen=True)
class TreeVerdict:
    """Outcome of verifying a draft tree: the accepted root-to-node path and the next token."""

    path: list[int]  # accepted draft-node indices, root first
    next_token: int  # correction, or bonus token after the deepest accepted node


def _children(parents: Sequence[int]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        out.setdefault(parent, []).append(node)
    return out


def greedy_verify_tree(tokens: Sequence[int], parents: Sequence[int], target_logits: torch.Tensor) -> TreeVerdict:
    """target_logits (1 + n, V): row 0 scores the roots, row i + 1 scores the children of node i.

    Walk down from the root, following the child equal to the target's argmax; stop at the first
    position where no child matches. Output is exactly greedy decoding's.
    """
    children = _children(parents)
    choices = greedy_tokens(target_logits).tolist()
    path: list[int] = []
    node, row = -1, 0
    while True:
        match = next((c for c in children.get(node, []) if tokens[c] == choices[row]), None)
        if match is None:
            return TreeVerdict(path=path, next_token=int(choices[row]))
        path.append(match)
        node, row = match, match + 1


def sample_verify_tree(
    tokens: Sequence[int],
    parents: Sequence[int],
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator,
) -> TreeVerdict:
    """Recursive rejection sampling over a draft tree (SpecInfer / SpecTr style); lossless.

    At each accepted node, try its children in order. ``draft_probs`` None means deterministic
    drafts (q one-hot on each child), where this is exact sampling from p. With model drafts
    (``draft_probs`` (n, V)), a node's children are draws *without replacement* from one q, in
    node order (:func:`splitspec.decoding.trees.dynamic_tree` draws them so; every sibling carries
    that same row); a chain is the one-child case, plain speculative sampling. If every child is
    rejected, the next token is drawn from the final p.
    """
    children = _children(parents)
    path: list[int] = []
    node, row = -1, 0
    while True:
        p = target_probs[row]
        accepted = None
        shared: torch.Tensor | None = None  # model drafts: the siblings' q, less the rejected ones
        for child in children.get(node, []):
            x = tokens[child]
            if draft_probs is None:
                q = torch.zeros_like(p)
                q[x] = 1.0
            elif shared is None:
                q = shared = draft_probs[child].to(p.device)
            else:
                if not torch.equal(draft_probs[child].to(p.device), draft_probs[children[node][0]].to(p.device)):
                    raise ValueError(f"draft node {child}: siblings must be drawn from one q (without replacement)")
                q = shared
            q_x, p_x = float(q[x]), float(p[x])
            # accept x ~ q with probability min(1, p(x) / q(x))
            if q_x > 0 and torch.rand((), generator=generator, device=generator.device).item() < min(1.0, p_x / q_x):
                accepted = child
                break
            # rejected: p becomes the target law conditioned on not taking x, norm(max(0, p - q))
            p = residual(p, q)
            if shared is not None and q_x > 0:
                # without replacement (Yang et al. 2024, multi-candidate speculative decoding): the
                # next sibling was drawn from q with x removed, renormalised; p(x) is now 0
                shared = shared.clone()
                shared[x] = 0.0
                total = shared.sum()
                shared = shared / total if total > 0 else shared
        if accepted is None:
            return TreeVerdict(path=path, next_token=int(torch.multinomial(p, 1, generator=generator)))
        path.append(accepted)
        node, row = accepted, accepted + 1
