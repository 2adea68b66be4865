"""The frontier on a tiny model: every point, tier and interval is produced and streamed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from splitspec.privacy.attackers import TrainConfig
from splitspec.privacy.defence_config import DefenceConfig
from splitspec.privacy.frontier import FrontierConfig, compare_points, point_clusters, point_hits, run_frontier
from splitspec.privacy.outcomes import unpack_hits
from tests.privacy.test_audit import write_corpus

torch.set_num_threads(1)


def test_frontier_points(make_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    directory = make_checkpoint("llama", layers=4)
    corpus = write_corpus(tmp_path / "corpus", docs_per_domain=4, words=120)
    streamed: list[dict[str, Any]] = []
    config = FrontierConfig(
        model_dir=directory,
        out_dir=tmp_path / "work",
        depth=1,
        settings=(DefenceConfig(), DefenceConfig(noise_scale=0.5, adversary_weight=1.0)),
        corpus_dir=corpus,
        window=16,
        max_train_tokens=320,
        max_test_tokens=96,
        diverge_steps=3,
        train=TrainConfig(epochs=1, seq_epochs=1, mlp_hidden=32, bottleneck=16, gru_hidden=8),
        search_candidates=4,
        bootstrap=50,
    )
    points = run_frontier(config, streamed.append)
    assert [p["setting"] for p in points] == ["stock", "none", "adv=1+noise=0.5"]
    assert streamed == points
    stock, _, defended = points
    assert stock["ppl_cost"] == 0.0
    assert defended["defence"]["noise_scale"] == 0.5
    stock_best = stock["sides"]["input"]["best"]
    assert stock_best["T1"] == stock_best["T2"] == stock_best["T3"]  # on stock weights nobody knows more than T1
    for side, expected in (("input", {"t1-mlp", "t1-search"}), ("output", {"t1-mlp", "t1-stock-tail"})):
        attackers = set(defended["sides"][side]["attackers"])
        assert attackers == expected | {"t2-selftrain", "t2-align", "t3-mlp"}
        best = defended["sides"][side]["best"]
        assert set(best) == {"T1", "T2", "T3"}
        assert best["T1"]["rate"] <= best["T2"]["rate"] <= best["T3"]["rate"]  # tiers include the lower ones
        for entry in best.values():
            lo, hi = entry["wilson95"]
            assert lo <= entry["rate"] <= hi
            d_lo, d_hi = entry["minus_stock"]["bootstrap95"]
            # a percentile bound can equal the estimate up to float rounding (degenerate resamples)
            assert d_lo - 1e-12 <= entry["minus_stock"]["diff"] <= d_hi + 1e-12

    # per-token outcomes: every attacker's stored hits add up to its rate, on the same test tokens everywhere
    n = stock["outcomes"]["n"]
    assert point_clusters(stock).size == n == stock["tokens"]["test"]
    for p in points:
        assert p["outcomes"]["window_docs"] == stock["outcomes"]["window_docs"]
        for side, measured in p["sides"].items():
            assert set(p["outcomes"]["sides"][side]) == set(measured["attackers"])
            for name, entry in measured["attackers"].items():
                assert int(unpack_hits(p["outcomes"]["sides"][side][name], n).sum()) == entry["top1"]["successes"]
    # the paired comparison from stored outcomes reproduces the difference measured during the run
    for side in ("input", "output"):
        for tier in ("T1", "T2", "T3"):
            cmp = compare_points([defended], [stock], side, tier, resamples=50)
            assert cmp is not None
            assert cmp.diff == pytest.approx(defended["sides"][side]["best"][tier]["minus_stock"]["diff"])
            assert cmp.only_a - cmp.only_b == int(point_hits(defended, side, tier).sum()) - int(
                point_hits(stock, side, tier).sum()
            )
            assert cmp.clusters == len(set(stock["outcomes"]["window_doc_ids"]))  # clusters named by document
    assert compare_points([defended], [{**stock, "seed": 99}], "input", "T1") is None  # no seed pairs up
