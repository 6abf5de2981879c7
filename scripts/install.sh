#!/usr/bin/env bash
# Installs everything slapo-lab needs on a fresh Debian machine, idempotently:
# Debian packages (graphviz, chromium), a venv in .venv with torch (CPU wheel, pinned in pyproject.toml) first,
# then the package itself (`pip install -e .[test]`, whose build produces the labextension).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$ROOT"
# pip here warns once per package about local index folders that do not exist: keep the log readable.
exec 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
need_apt=()
command -v dot >/dev/null 2>&1 || need_apt+=(graphviz)
[ -x /usr/bin/chromium ] || need_apt+=(chromium)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "[install] apt-get install ${need_apt[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi
if [ ! -x "$PY" ]; then
  python3 -m venv "$VENV"
fi
"$PY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
# torch first, pinned, so that nothing later pulls the CUDA build; the pin's one home is pyproject.toml.
TORCH_PIN=$(grep -o '"torch==[^"]*"' "$ROOT/pyproject.toml" | tr -d '"')
"$PY" -m pip install -q "$TORCH_PIN"
"$PY" -m pip install -q -e ".[test]"
# byte-compile the package, as pip does when it installs a wheel (an editable install does not): every fresh
# process (the CLI, an exported script, a benchmark) then imports it without compiling it first, also where
# PYTHONDONTWRITEBYTECODE keeps Python from writing the cache itself. Python still recompiles a changed file.
"$PY" -m compileall -q slapo_lab >/dev/null
# DeepSpeed without its CUDA ops (pipeline runtime "deepspeed").
DS_BUILD_OPS=0 "$PY" -m pip install -q "deepspeed>=0.19" || echo "[install] deepspeed not installed; its runtime tests will be skipped"
# Slapo 0.0.3's wheel, unpacked (not installed): tests/slapo_compat/test_slapo_compat.py runs its own tests and schedules.
if [ ! -d "$ROOT/.cache/slapo/wheel/slapo/model_schedule" ]; then
  "$PY" -m pip download -q --no-deps slapo==0.0.3 -d "$ROOT/.cache/slapo"
  "$PY" -m zipfile -e "$ROOT/.cache/slapo/slapo-0.0.3-py3-none-any.whl" "$ROOT/.cache/slapo/wheel"
fi
"$PY" -m ipykernel install --sys-prefix --name python3 >/dev/null
echo "[install] done: $("$PY" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"
