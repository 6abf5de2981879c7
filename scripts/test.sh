#!/usr/bin/env bash
# Command B: install everything, then lint (ruff check, ruff format --check) and run the whole test suite
# (unit, multi-rank torchrun, widget, browser).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
bash scripts/install.sh
start=$(date +%s)
# lint and format first: one line each when clean (ruff is pinned in the test extras)
"$VENV/bin/ruff" check .
"$VENV/bin/ruff" format --check .
"$PY" -m pytest -q -ra "$@" tests
echo "[test] wall time: $(( $(date +%s) - start )) s"
