"""What the edge commands' arguments make: the :class:`~splitspec.edge.EdgeConfig` and the sampling parameters.

Shared by ``generate``, ``chat`` (:mod:`splitspec.cli`) and ``serve`` (:mod:`splitspec.serve.cli`); kept out of
:mod:`splitspec.arguments`, which every subcommand module imports and which must not import the edge.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from splitspec.arguments import read_token_file, set_threads
from splitspec.exceptions import ConfigError

if TYPE_CHECKING:
    from splitspec.decoding.sampling import SamplingParams
    from splitspec.edge import EdgeConfig


def edge_config(args: argparse.Namespace) -> EdgeConfig:
    """The edge's frozen config from the arguments of :func:`splitspec.arguments.add_edge_link_args`; pins the
    torch threads (``--threads``) on the way."""
    from splitspec.edge import EdgeConfig

    if getattr(args, "max_new_tokens", 1) < 1:  # serve has no --max-new-tokens: requests say
        raise ConfigError("--max-new-tokens must be at least 1")
    set_threads(args.threads)
    return EdgeConfig(
        model_dir=args.model,
        cloud_url=args.cloud,
        edge_layers=args.edge_layers,
        dtype=args.dtype,
        wire_codec=args.wire_codec,
        quantize=args.quantize,
        device=args.device,
        auth_token=read_token_file(args.token_file),
        draft_model_dir=args.draft_model,
        draft_head_dir=args.draft_head,
        draft_head_target_check=args.draft_head_target_check == "on",
        draft_tree_width=args.draft_tree_width,
        allow_stock_edge_weights=args.allow_stock_edge_weights,
        published_model_dir=args.published_model,
        trunk_fingerprint=args.trunk_fingerprint,
        tls_ca_file=args.tls_ca,
        compile=args.compile,
        max_cache_tokens=args.max_cache_tokens,
        compute_on=args.compute_on,
    )


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The flags given, else the checkpoint's generation_config.json: the same rule as SplitClient.sampling."""
    from splitspec.decoding.published import published_sampling, sampling_settings

    published = published_sampling(args.model)
    return sampling_settings(
        published, args.temperature, args.top_p, args.top_k, args.seed, args.min_p, repetition_applied=True
    )


def repetition_penalty(args: argparse.Namespace) -> float:
    """``--repetition-penalty``, else the checkpoint's generation_config.json's (as transformers' generate), else 1
    (off)."""
    from splitspec.decoding.published import published_sampling

    value = args.repetition_penalty
    if value is None:
        value = published_sampling(args.model).repetition_penalty
    elif not value > 0:
        raise ConfigError(f"--repetition-penalty must be above 0, got {value:g}")
    return 1.0 if value is None else value
