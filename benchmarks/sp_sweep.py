"""Sequence parallelism over transformers' own families: the Megatron preset with ``sequence_parallel=True``
at TP 2, judged by the numeric check (forward and every gradient against the unsharded model on simulated
ranks), with the same harness as the TP sweep (``tests/family_sweep.py``).

Usage: ``.venv/bin/python benchmarks/sp_sweep.py [--task causal] [--workers 2] [--out FILE] [names...]``.
Prints the table (family | status | detail), the counts per status and the wall time; ``--out`` writes the
table as Markdown. "full" means the whole sequence-parallel layout checks ✓; "refused" gives the preset's
sentence (a family the TP preset already refuses, or where sequence parallelism would change the result).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
os.environ["SLAPO_SWEEP_SP"] = "1"  # read by the harness in every worker (spawned: they inherit it)

import family_sweep as fs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help="model types (default: every family of --task)")
    ap.add_argument(
        "--task", default=None, help="only the families of this task (seq2seq, masked, causal or image)"
    )
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default=None, help="write the table here (Markdown)")
    args = ap.parse_args()
    fams = fs.families()
    names = args.names or [f for f, (task, _cls) in fams.items() if args.task in (None, task)]
    t0 = time.perf_counter()
    results = fs.run_sweep(names=names, workers=args.workers)
    seconds = time.perf_counter() - t0
    text = (
        "Sequence parallelism, TP 2, numeric check on simulated ranks.\n\n"
        + fs.table(results)
        + fs.causes(results)
        + f"\nCounts: {fs.counts(results)}. Wall time: {seconds:.0f} s on {args.workers} workers.\n"
    )
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
