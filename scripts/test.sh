#!/usr/bin/env bash
# Command B: install everything, then lint (ruff check, ruff format --check) and run the whole test suite
# (unit, multi-rank torchrun, widget, browser), with a type check (pyrefly) between.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
bash scripts/install.sh
start=$(date +%s)
# lint and format first: one line each when clean (ruff is pinned in the test extras)
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
# type check (pyrefly's "basic" preset: missing imports and attributes of modules, bad unpacking, calls that cannot
# succeed; its stricter presets report ~150 findings over the engine still to work through)
"$VENV/bin/pyrefly" check -p basic slapo_lab --python-interpreter-path "$PY"
"$PY" -m pytest -q -ra "$@" tests
echo "[test] wall time: $(( $(date +%s) - start )) s"
