#!/usr/bin/env bash
# Command A: install everything, then open notebooks/quickstart.ipynb in JupyterLab.
#   --headless   execute the notebook end to end without a browser (exit non-zero on any error)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
bash scripts/install.sh
nb="${NOTEBOOK:-notebooks/quickstart.ipynb}"
if [ "${1:-}" = "--headless" ]; then
  exec "$PY" -m slapo_lab.tools.run_notebook "$nb"
fi
exec "$VENV/bin/jupyter" lab "$nb" "$@"
