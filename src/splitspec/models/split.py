"""Split plans: which decoder layers run on the edge and which on the cloud."""

from __future__ import annotations

from dataclasses import dataclass

from splitspec.exceptions import ConfigError


@dataclass(frozen=True)
class SplitPlan:
    """The first ``head`` and last ``tail`` decoder layers run on the edge; the rest is the trunk."""

    num_layers: int  # decoder layers in the model
    head: int  # layers on the edge before the trunk
    tail: int  # layers on the edge after the trunk

    def __post_init__(self) -> None:
        if self.head < 1 or self.tail < 1:
            raise ConfigError(
                f"edge layers ({self.head},{self.tail}): the edge needs at least one layer on each side, "
                "or raw embeddings / final hidden states would cross the link"
            )
        if self.head + self.tail >= self.num_layers:
            raise ConfigError(
                f"edge layers ({self.head},{self.tail}) leave no trunk: the model has {self.num_layers} "
                f"decoder layers, so head + tail must be at most {self.num_layers - 1}"
            )

    @property
    def head_layers(self) -> range:
        return range(0, self.head)

    @property
    def trunk_layers(self) -> range:
        return range(self.head, self.num_layers - self.tail)

    @property
    def tail_layers(self) -> range:
        return range(self.num_layers - self.tail, self.num_layers)


def parse_edge_layers(text: str) -> tuple[int, int]:
    """Parse ``"2,2"`` into ``(2, 2)`` with a clear error for anything else."""
    parts = text.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ConfigError(f"--edge-layers must look like HEAD,TAIL (e.g. 2,2), got {text!r}")
    return int(parts[0]), int(parts[1])
