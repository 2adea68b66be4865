"""A draft tree run level by level over a drafter's own cache: only the nodes the tree builder expands.

EAGLE-2 runs the frontier alone: at each depth the builder (:func:`~splitspec.decoding.trees.dynamic_tree`)
asks for the children of its ``top_k`` best nodes, so only those nodes need a forward and an LM head,
not every node the tree holds (``top_k`` times fewer rows per depth, and no level is run twice).

The drafter's cache holds the committed prefix, ``committed`` entries at positions 0 .. committed - 1
(or only its latest pairs, at positions ``start`` .. committed - 1: a drafter attending to a window of
them). Each wave appends the nodes it runs, in run order; node j's query sits at position
``committed + depth(j)`` and sees the cached prefix, its ancestors (wherever they sit in the cache)
and itself. :meth:`TreeRun.wave` builds that mask and the keys' positions, from which the layer
stack applies each layer's sliding window. The drafter truncates its cache back to the committed
prefix once the draft is built.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Wave:
    """One forward of tree nodes whose parents have run (or are the context)."""

    nodes: list[int]  # tree node indices, in run order
    positions: torch.Tensor  # (q,) int32: committed + depth of each node
    visible: torch.Tensor  # (q, past + q) bool: the keys each node's query sees (before any window)
    key_positions: torch.Tensor  # (past + q,) int32: the position of every key, the cache's then the wave's


class TreeRun:
    """Which tree nodes have run, where their cache entries sit, and the mask of the next wave."""

    def __init__(self, committed: int, start: int = 0) -> None:
        if not 0 <= start <= committed:
            raise ValueError(f"the cache's first position {start} is not in 0..{committed}")
        self.committed = committed  # the tree's roots sit at this position
        self.start = start  # the position of the cache's first entry (0: the whole prefix)
        self.entries = committed - start  # cache entries before the tree's
        self.slot: dict[int, int] = {}  # node -> its cache entry (entries + run order)
        self.ancestors: dict[int, list[int]] = {}  # node -> its ancestors, root first
        self.node_positions: list[int] = []  # the position of every node run, in run order

    def ran(self, node: int) -> bool:
        return node < 0 or node in self.slot

    def pending(self, parents: Sequence[int], expanding: Sequence[int]) -> list[int]:
        """Nodes ``expanding`` asks for that have not run, with any ancestors that have not either: parents first."""
        todo: set[int] = set()
        for node in expanding:
            while not self.ran(node) and node not in todo:
                todo.add(node)
                node = parents[node]
        return sorted(todo)

    def waves(self, parents: Sequence[int], expanding: Sequence[int]) -> Iterator[Wave]:
        """The forwards that run every node ``expanding`` asks for (and any ancestor not run), one level of
        them each: a node's input may be its parent's output. Each wave is registered as run when yielded."""
        todo = self.pending(parents, expanding)
        while todo:
            yield self.wave(parents, todo)
            todo = [j for j in todo if not self.ran(j)]

    def wave(self, parents: Sequence[int], todo: Sequence[int]) -> Wave:
        """The next forward: the nodes of ``todo`` (parents first) whose parents have run; registers them as run."""
        nodes: list[int] = []
        for node in todo:
            if self.ran(parents[node]):
                nodes.append(node)
        if not nodes:
            raise ValueError("no pending node has a parent that has run")
        past = self.entries + len(self.node_positions)
        q = len(nodes)
        visible = torch.zeros(q, past + q, dtype=torch.bool)
        visible[:, : self.entries] = True
        positions: list[int] = []
        for i, node in enumerate(nodes):
            parent = parents[node]
            lineage = [] if parent < 0 else [*self.ancestors[parent], parent]
            self.ancestors[node] = lineage
            for a in lineage:
                visible[i, self.slot[a]] = True
            visible[i, past + i] = True
            positions.append(self.committed + len(lineage))
        for i, node in enumerate(nodes):
            self.slot[node] = past + i
        keys = torch.tensor([*self.node_positions, *positions], dtype=torch.int32)
        self.node_positions.extend(positions)
        key_positions = torch.cat([torch.arange(self.start, self.committed, dtype=torch.int32), keys])
        return Wave(nodes, torch.tensor(positions, dtype=torch.int32), visible, key_positions)
