# Sourced by the other scripts: every cache lives inside the repo's ignored .cache/.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PIP_CACHE_DIR="$ROOT/.cache/pip"
export npm_config_cache="$ROOT/.cache/npm"
export HF_HOME="$ROOT/.cache/hf"
export HF_HUB_OFFLINE=1
export TORCH_EXTENSIONS_DIR="$ROOT/.cache/torch_extensions"
export MPLCONFIGDIR="$ROOT/.cache/mpl"
export JUPYTER_PLATFORM_DIRS=1
export PYTHONUNBUFFERED=1
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
