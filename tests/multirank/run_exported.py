"""Run several exported training scripts one after another in one torchrun launch (tests/families/test_families_matrix.py).

    torchrun --nproc_per_node=2 tests/multirank/run_exported.py NAME=SCRIPT.py [NAME=SCRIPT.py ...] -- [ARGS ...]

Each exported script is loaded without running its ``__main__`` block, and the one call that block makes,
``slapo_lab.train.main(model=MODEL, schedule=schedule, ...)``, is made here with ``ARGS`` as its command
line: the same code path as ``torchrun SCRIPT.py ARGS``, without starting torchrun, Python, torch and
transformers once per script (about 15 s each on 2 CPU cores). The ranks keep one gloo group for all scripts
(``slapo_lab.train.main`` would destroy it after each). Rank 0 prints, per script, one
``RESULT {json}`` line: ``case``, the exit status ``rc`` (0 done, 1 Verify failed, 2 a problem of the launch,
3 an exception: ``error``; the worst over the ranks) and ``out``, the script's own output (stdout and stderr).
"""

from __future__ import annotations

import contextlib
import io
import json
import runpy
import sys
import traceback
import warnings

import torch
import torch.distributed as dist

import slapo_lab.train

warnings.filterwarnings("ignore")


def run_one(path: str, argv: list[str]) -> tuple[int, str, str]:
    ns = runpy.run_path(path, run_name="exported_script")
    buf = io.StringIO()
    error = ""
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        try:
            rc = slapo_lab.train.main(
                model=ns["MODEL"],
                schedule=ns["schedule"],
                inputs=ns["INPUTS"],
                tp=ns["TP"],
                stages=ns["STAGES"],
                launcher="torchrun",
                config=ns["CONFIG"],
                argv=list(argv),
                title=ns["__doc__"].splitlines()[0],
            )
        except Exception as err:  # noqa: BLE001 - reported in the case's result, the next script still runs
            rc, error = 3, f"{type(err).__name__}: {err}\n{traceback.format_exc()}"
    return rc, buf.getvalue(), error


def main() -> int:
    args = sys.argv[1:]
    cut = args.index("--") if "--" in args else len(args)
    cases, argv = args[:cut], args[cut + 1 :]
    dist.init_process_group("gloo")
    destroy = dist.destroy_process_group
    dist.destroy_process_group = lambda *a, **k: None  # one group for every script
    worst = 0
    try:
        for case in cases:
            name, _, path = case.partition("=")
            rc, out, error = run_one(path, argv)
            status = torch.tensor([rc])
            dist.all_reduce(status, op=dist.ReduceOp.MAX)  # a rank that failed fails the case
            rc = int(status)
            worst = max(worst, rc)
            if dist.get_rank() == 0:
                print(
                    "RESULT " + json.dumps({"case": name, "rc": rc, "out": out, "error": error}), flush=True
                )
    finally:
        dist.destroy_process_group = destroy
        destroy()
    return worst


if __name__ == "__main__":
    raise SystemExit(main())
