#!/usr/bin/env bash
# On a GPU machine: install disttune in place and run the test suite (NCCL, CUDA events), or the
# test paths given as arguments; everything is logged under $OUT (default: a new temporary directory).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d -t disttune-gpu-check-XXXXXX)}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 DISTTUNE_LOG_DIR="$OUT/logs"
python3 -m pip install --quiet --no-deps --no-build-isolation --no-index -e . > "$OUT/install.log" 2>&1 \
  || echo "editable install failed (see install.log)"
nvidia-smi -L | tee "$OUT/gpus.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpus.txt"
python3 -m pytest -q -m "" -p no:cacheprovider -rs "${@:-tests}" 2>&1 | tee "$OUT/pytest.log" | tail -40
