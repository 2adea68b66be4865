"""Run the privacy audit on the shipped demo model and copy the report into benchmarks/results/privacy/.

    python benchmarks/privacy_audit.py [--model DIR] [--work DIR] [--out DIR] [extra `splitspec audit` args]

The audit itself (diverged edge checkpoints included) runs in ``--work`` (default: a temporary
directory, removed afterwards); only the report files are copied into ``--out`` (default: the repository's
benchmarks/results/privacy/): report.md, report.json,
recovery_vs_depth.png, outcomes.csv.gz and each diverged edge's edge.json (fingerprint,
perplexity before/after).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from splitspec.cli import main as privacy_main

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "privacy"
FILES = ("report.md", "report.json", "recovery_vs_depth.png", "outcomes.csv.gz")


def audit_and_copy(model: Path, work: Path, out: Path, extra: list[str]) -> int:
    """``splitspec audit`` in ``work``; its report files copied into ``out``."""
    rc = privacy_main(["audit", "--model", str(model), "--depths", "1,2,3,4", "--out", str(work), *extra])
    if rc != 0:
        return rc
    out.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        shutil.copy2(work / name, out / name)
    for edge_json in sorted(work.glob("edges/*/edge.json")):
        shutil.copy2(edge_json, out / f"edge_{edge_json.parent.name}.json")
    print(f"report copied to {out}")
    return 0


def main() -> int:
    torch.set_num_threads(1)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=ROOT / "src" / "splitspec" / "assets" / "models" / "base")
    parser.add_argument("--work", type=Path, help="where the audit runs (default: a temporary directory, removed)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the report is copied (default: %(default)s)")
    args, extra = parser.parse_known_args()
    if args.work is not None:
        return audit_and_copy(args.model, args.work, args.out, extra)
    with tempfile.TemporaryDirectory(prefix="splitspec-privacy-") as work:
        return audit_and_copy(args.model, Path(work), args.out, extra)


if __name__ == "__main__":
    sys.exit(main())
