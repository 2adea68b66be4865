"""Evidence on the two defences not built: a secret transform of the sent state, and random split depth.

    python benchmarks/privacy_transforms.py [--model base] [--out benchmarks/results/privacy_frontier]

1. **Secret transform.** For the published trunk to consume T·h instead of h, its first layer must
   undo T: its input projections become W·diag(g)·T^-1 (g the RMSNorm gain; for an orthogonal T,
   RMSNorm commutes with it). The cloud holds those deployed projections *and* the published W and
   g, so it recovers T^-1 by least squares: the transform is not secret from the trunk. This script
   does exactly that for a random orthogonal T on the model's first trunk layer and reports the
   relative error of the recovered T (and the same for the trunk's output side, whose
   o_proj/down_proj would have to apply T).
2. **Random split depth.** Per-session depth only helps if the cloud cannot tell depths apart. This
   script trains the simplest classifier - nearest mean of one number per window, the mean log RMS
   of its token states - on public windows at depths 1..D and reports its accuracy on held-out
   windows. With the depth known, recovery is the per-depth recovery (the audit's table).

Writes ``transforms.json`` and ``transforms.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from splitspec.models.checkpoint import Checkpoint
from splitspec.models.loading import load_full
from splitspec.privacy.activations import collect_layers
from splitspec.privacy.corpus import DEFAULT_CORPUS, corpus_windows
from splitspec.run_info import run_environment

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "src" / "splitspec" / "assets" / "models"


def recovered_transform_error(weight: np.ndarray, seed: int) -> float:
    """Relative error of T recovered from (W, W T^-1) by least squares, T random orthogonal."""
    rng = np.random.default_rng(seed)
    t, _ = np.linalg.qr(rng.standard_normal((weight.shape[1], weight.shape[1])))
    deployed = weight @ t.T  # T orthogonal: T^-1 = T^T
    t_inv, *_ = np.linalg.lstsq(weight, deployed, rcond=None)
    return float(np.linalg.norm(t_inv.T - t) / np.linalg.norm(t))


def depth_identification(acts: dict[int, np.ndarray], n_train: int) -> float:
    """Accuracy of nearest-mean depth classification from one number per window (mean log RMS)."""
    feats = {k: np.log(np.sqrt((a[:, 1:] ** 2).mean(-1))).mean(-1) for k, a in acts.items()}  # (n,) per depth
    means = {k: f[:n_train].mean() for k, f in feats.items()}
    hits = total = 0
    for k, f in feats.items():
        for x in f[n_train:]:
            guess = min(means, key=lambda m: abs(means[m] - x))
            hits += int(guess == k)
            total += 1
    return hits / total


def main() -> int:
    torch.set_num_threads(1)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="base")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "privacy_frontier")
    parser.add_argument("--depth", type=int, default=2, help="edge layers per side of the split analysed")
    parser.add_argument("--windows", type=int, default=40, help="windows per depth (half train, half test)")
    args = parser.parse_args()
    model_dir = MODELS / args.model if (MODELS / args.model).is_dir() else Path(args.model)
    ckpt = Checkpoint(model_dir)
    full = load_full(ckpt, torch.float32)
    n_layers = int(ckpt.config.num_hidden_layers)
    sd = {k: v.detach().numpy().astype(np.float64) for k, v in full.state_dict().items()}
    depth = args.depth
    first = depth  # the trunk's first layer under a (depth, depth) split
    last = n_layers - depth - 1  # the trunk's last layer
    names = {k: v for k, v in sd.items() if k.startswith(f"layers.layers.{first}.")}
    proj = [k for k in names if k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight"))]
    gain_key = next(k for k in names if k.endswith("input_layernorm.weight"))
    stacked = np.concatenate([sd[k] * sd[gain_key][None, :] for k in proj], axis=0)  # (out, H): W diag(g)
    out_side = [
        k for k in sd if k.startswith(f"layers.layers.{last}.") and k.endswith(("o_proj.weight", "down_proj.weight"))
    ]
    out_stacked = np.concatenate([sd[k].T for k in out_side], axis=0)  # (in, H): rows map into the residual
    corpus = corpus_windows(
        model_dir,
        DEFAULT_CORPUS,
        test_fraction=0.3,
        seed=0,
        window=128,
        max_train_tokens=128 * args.windows // 2,
        max_test_tokens=128 * args.windows // 2,
    )
    tokens = np.concatenate([corpus.train.tokens, corpus.test.tokens])
    depths = list(range(1, n_layers - 1))
    acts = collect_layers(full, tokens, depths)
    result = {
        "model": str(model_dir),
        **run_environment(),
        "secret_transform": {
            "input_side_layer": first,
            "input_side_relative_error": recovered_transform_error(stacked, 0),
            "output_side_layer": last,
            "output_side_relative_error": recovered_transform_error(out_stacked, 1),
        },
        "random_depth": {
            "depths": depths,
            "train_windows": int(corpus.train.tokens.shape[0]),
            "test_windows_per_depth": int(corpus.test.tokens.shape[0]),
            "accuracy": depth_identification(acts, corpus.train.tokens.shape[0]),
        },
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "transforms.json").write_text(json.dumps(result, indent=1) + "\n")
    st, rd = result["secret_transform"], result["random_depth"]
    md = [
        f"# Secret transforms and random split depth (`{model_dir.name}`)",
        "",
        f"- Secret orthogonal transform of the sent state: recovered from the deployed trunk's first-layer "
        f"projections and the published ones by least squares with relative error "
        f"{st['input_side_relative_error']:.1e} (input side, layer {st['input_side_layer']}) and "
        f"{st['output_side_relative_error']:.1e} (output side, layer {st['output_side_layer']}).",
        f"- Random split depth among {rd['depths']}: a nearest-mean classifier on one number per window "
        f"(mean log RMS of the states) names the depth of {100 * rd['accuracy']:.1f} % of "
        f"{rd['test_windows_per_depth']} held-out windows per depth.",
        "",
    ]
    (args.out / "transforms.md").write_text("\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
