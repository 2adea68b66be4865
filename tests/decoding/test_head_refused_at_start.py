"""An edge given a draft head it cannot draft with refuses it when it starts, not at every request's first draft."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from splitspec.edge.config import EdgeConfig
from splitspec.edge.runtime import EdgeRuntime
from splitspec.exceptions import ConfigError
from splitspec.models.checkpoint import Checkpoint
from splitspec.models.draft_head import DraftHead, default_config
from splitspec.models.draft_head_io import save_draft_head


def test_a_head_reading_several_layers_is_refused_when_the_edge_starts(
    make_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    directory = make_checkpoint("llama", layers=4)
    head = DraftHead(default_config(Checkpoint(directory), (2, 4)), torch.device("cpu"), torch.float32)
    config = EdgeConfig(
        allow_stock_edge_weights=True, model_dir=directory, cloud_url="ws://127.0.0.1:1", edge_layers=(1, 1),
        draft_head_dir=save_draft_head(head, tmp_path / "head"),
    )  # fmt: skip
    with pytest.raises(ConfigError, match="several feature layers"):
        EdgeRuntime(config)
