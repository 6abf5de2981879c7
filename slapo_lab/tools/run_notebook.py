"""Execute a notebook end to end without a browser: ``python -m slapo_lab.tools.run_notebook NB``.

Exits non-zero (with the failing cell's error) on any error. Used by ``scripts/lab.sh --headless``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient


def run(path: str | Path, timeout: int = 600, kernel: str = "python3") -> None:
    """Run every cell of ``path`` in a fresh kernel (cwd = the notebook's folder).

    Raises:
        nbclient.exceptions.CellExecutionError: the first failing cell.
        FileNotFoundError: if the notebook does not exist.
    """
    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb, timeout=timeout, kernel_name=kernel, resources={"metadata": {"path": str(path.parent.resolve())}}
    )
    client.execute()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("notebook")
    ap.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    try:
        run(args.notebook, timeout=args.timeout)
    except Exception as err:  # noqa: BLE001 - report, exit non-zero
        print(f"[headless] {args.notebook} FAILED: {type(err).__name__}: {str(err)[-3000:]}", file=sys.stderr)
        return 1
    print(f"[headless] {args.notebook} ran end to end in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
