"""The argument helpers every subcommand shares (splitspec.arguments)."""

from __future__ import annotations

import pytest
import torch

from splitspec.arguments import set_threads
from splitspec.exceptions import ConfigError


def test_set_threads_pins_torch_and_refuses_fewer_than_one() -> None:
    before = torch.get_num_threads()
    try:
        set_threads(1)
        assert torch.get_num_threads() == 1
        set_threads(None)  # not given: torch's choice stays
        assert torch.get_num_threads() == 1
        for bad in (0, -2):
            with pytest.raises(ConfigError, match="--threads must be at least 1"):
                set_threads(bad)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
