#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py): calibrate the GPU, train a ~1B Llama with the exported script in bf16
# with and without --compile, and compare tokens/s, MFU and peak memory with the planner's prediction and a
# hand-written Hugging Face + AdamW loop. One GPU, under 8 minutes. Figures: $OUT (or artifacts/gpu_check)/report.md.
#   bash benchmarks/gpu_check.sh                      # on a CUDA machine
#   bash benchmarks/gpu_check.sh --size tiny --device cpu --steps 4 --seq 32   # the same flow, tiny, on a CPU
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
DEST=${OUT:+$OUT/gpu_check}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" benchmarks/gpu_check.py --out "${DEST:-artifacts/gpu_check}" "$@"
