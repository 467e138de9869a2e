#!/usr/bin/env bash
# On one GPU: every speed measurement of the tuner and the shipped kernels' host paths, in one call
# (6 to 8 minutes on one H100 or H200; the time limits add up to 495 s).
# Usage: OUT=DIR bash scripts/gpu_speed.sh [tuning fast moe moehost launch ...]   (default: all of them)
# Each step has its own time limit and log, $OUT/<step>.log; its table is echoed; JSON rows go to
# $OUT/<step>.jsonl. Steps:
#   tuning    bench/tuning_cost.sh 1: first call of the AG-GEMM step per variant, tuning overhead, where it went
#   fast      bench/fast_path.py: per-call cost after tuning (null, null-kw, tiny kernels)
#   moe       bench/moe.py --parts a: grouped GEMM vs _grouped_mm, ms back to back and one call from idle, host µs
#   moehost   bench/moe_host.py --shapes 64 --profile: AG-MoE host µs vs GPU per call, with a cProfile
#   launch    bench/launch_host.py --profile: host µs of one AG-GEMM call vs a plain JIT launch
#   tests     (not in the default) the one-GPU tests of the tuner and the GEMM kernels, about 3 minutes
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d -t disttune-gpu-speed-XXXXXX)}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 DISTTUNE_LOG_DIR="$OUT/logs" CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
steps="${*:-tuning fast moe moehost launch}"
python3 -m pip install --quiet --no-deps --no-build-isolation --no-index -e . > "$OUT/install.log" 2>&1 \
  || echo "editable install failed (see install.log)"
started=$(date +%s)

run() {  # name limit_s lines command...: the log's last lines (its table) are echoed
    local name="$1" limit="$2" lines="$3"; shift 3
    local t0=$(date +%s)
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc=$rc, $(( $(date +%s) - t0 )) s ($(date +%T))"
    grep -v '^\[rank\|Warning\|warn(' "$OUT/$name.log" | tail -n "$lines"
}
want() { [[ " $steps " == *" $1 "* ]]; }
one=(bash scripts/launch.sh --nproc_per_node=1)

if want tuning; then
    run tuning 170 45 bash bench/tuning_cost.sh 1 --out "$OUT/tuning.jsonl"
fi
if want fast; then
    run fast 70 16 python3 bench/fast_path.py --out "$OUT/fast.jsonl"
fi
if want moe; then
    run moe 150 30 "${one[@]}" bench/moe.py --parts a --iters 30 --out "$OUT/moe.jsonl"
fi
if want moehost; then
    run moehost 60 45 "${one[@]}" bench/moe_host.py --shapes 64 --profile --out "$OUT/moehost.jsonl"
fi
if want launch; then
    run launch 45 60 "${one[@]}" bench/launch_host.py --profile --out "$OUT/launch.jsonl"
fi
if want tests; then
    run tests 240 20 python3 -m pytest -q -m "" -x tests/test_gpu.py tests/test_cached_launch.py tests/test_phases.py \
        tests/test_fast_path.py tests/test_intercept.py tests/test_matmul.py
fi
echo "all steps: $(( $(date +%s) - started )) s; logs and rows under $OUT"
