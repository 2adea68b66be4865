"""The trunk's continuous batcher: steps of many sessions through the trunk layers in one forward.

The batching policy (gathering, small steps first, big prefills in chunks between them) is
:class:`splitspec.models.batcher.RowBatcher`; here a forward is the trunk stack's batched forward
with its outputs copied to the host (they go on the wire), and each batch is recorded in the
trunk's metrics.
"""

from __future__ import annotations

import torch

from splitspec.cloud.metrics import TrunkMetrics
from splitspec.models.batched import BatchRow, forward_batch
from splitspec.models.batcher import RowBatcher
from splitspec.models.stack import LayerStack


class StepBatcher(RowBatcher):
    """Queues steps from all sessions and runs them through ``stack`` in batched forwards."""

    def __init__(
        self,
        stack: LayerStack,
        metrics: TrunkMetrics,
        max_batch_steps: int = 64,
        small_step_tokens: int = 64,
        prefill_chunk_tokens: int = 256,
        gather: float = 0.5,
        threaded: bool = True,  # forwards on a worker thread; False = on the event loop (devices.compute_on_threads)
    ) -> None:
        super().__init__(
            max_batch_steps,
            small_step_tokens,
            prefill_chunk_tokens,
            gather,
            thread_name="trunk-batch",
            threaded=threaded,
        )
        self.stack = stack
        self.metrics = metrics

    def run_rows(self, rows: list[BatchRow]) -> list[torch.Tensor]:
        return [out.to("cpu") for out in forward_batch(self.stack, rows)]

    def observe_batch(self, steps: int, tokens: int, compute_ms: float) -> None:
        self.metrics.observe_batch(steps, tokens, compute_ms)
