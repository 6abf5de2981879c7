#!/usr/bin/env bash
# Command B: install everything, then run the whole test suite (unit, multi-rank torchrun, widget, browser).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
bash scripts/install.sh
start=$(date +%s)
"$PY" -m pytest -q -ra "$@" tests
echo "[test] wall time: $(( $(date +%s) - start )) s"
