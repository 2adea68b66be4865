"""The trusted side: embedding, edge layers, LM head, and the client that drives a remote trunk."""

from splitspec.edge.client import GenerationResult, SplitClient, StepStats
from splitspec.edge.config import EdgeConfig

__all__ = ["EdgeConfig", "GenerationResult", "SplitClient", "StepStats"]
