#!/usr/bin/env bash
# On a lent GPU machine: every measurement behind the README's benchmark tables, in one call.
# Usage: OUT=... bash scripts/gpu_bench.sh [NPROC] [ag|moe|moehost|moegluon|clocks|tileorder|tuning|tuning_moe|fast|tests|gputests|moetests|all ...]
# NPROC defaults to the GPU count. Each step has its own time limit and logs to $OUT/<step>.log,
# so one failing step does not hide the others; the last lines of each log are echoed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 DISTTUNE_LOG_DIR="$OUT/logs"
nproc="${1:-$(nvidia-smi -L | wc -l)}"; shift || true
steps="${*:-all}"
python3 -m pip install --quiet --no-deps --no-build-isolation --no-index -e . > "$OUT/install.log" 2>&1 \
  || echo "editable install failed (see install.log)"

run() {  # name limit_s command...
    local name="$1" limit="$2"; shift 2
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "== $name: rc=$? ($(date +%T))"
    grep -v '^\[rank\|Warning\|warn(' "$OUT/$name.log" | tail -n "${TAIL:-16}"
}
want() { [[ " $steps " == *" all "* || " $steps " == *" $1 "* ]]; }

launch=(bash scripts/launch.sh --nproc_per_node="$nproc")
if want tests; then
    run tp_cases 300 "${launch[@]}" tests/tp_cases.py --size large --dtypes bfloat16,float16 --tune --trace
fi
if want gputests; then
    run gpu_tests 250 python3 -m pytest -q -x tests/test_gpu.py
fi
if want moetests; then  # the MoE suite on the GPUs: single-GPU GEMM cases, and the 2-rank cases under NCCL
    run moe_tests 300 python3 -m pytest -q -x tests/test_moe.py -k "not 4_ranks"
fi
if want ag; then
    run ag_gemm 240 "${launch[@]}" bench/ag_gemm.py --samples 30
    TAIL=30 run overlap_probe 200 "${launch[@]}" bench/overlap_probe.py --out "$OUT"
fi
if want moe; then
    run moe 240 "${launch[@]}" bench/moe.py
fi
if want moehost; then  # is AG-MoE host-bound? host, wall and GPU time per call, with a cProfile on rank 0
    TAIL=30 run moe_host 200 "${launch[@]}" bench/moe_host.py --profile --out "$OUT/moe_host.jsonl"
fi
if want moegluon; then  # the 8-expert grouped GEMM hand-pipelined in Gluon, against the tl kernel and _grouped_mm
    TAIL=50 run moe_gluon 240 env CUDA_VISIBLE_DEVICES=0 python3 bench/moe_gluon.py --out "$OUT/moe_gluon.jsonl"
fi
if want clocks; then  # the 8-expert grouped GEMM sustained: SM clock, power and throttle reasons per kernel
    TAIL=30 run moe_clocks 330 env CUDA_VISIBLE_DEVICES=0 python3 bench/moe_clocks.py --out "$OUT/moe_clocks.jsonl"
    if command -v ncu > /dev/null; then  # L2/DRAM bytes and SM clock from the counters (Firecracker only)
        for n in 0 1 2 3 4 5; do
            TAIL=14 run "moe_ncu_$n" 120 env CUDA_VISIBLE_DEVICES=0 ncu --clock-control none -k 'regex:device_kernel|moe_gemm' \
                -c 3 --metrics gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,lts__t_bytes.sum,\
dram__bytes_read.sum,l1tex__m_xbar2l1tex_read_bytes.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed \
                python3 bench/moe_clocks.py --only "$n"
        done
    fi
fi
if want tileorder; then  # the grouped GEMM's two tile orders: interleaved do_bench, then ncu at locked base clocks
    TAIL=50 run moe_tile_order 240 env CUDA_VISIBLE_DEVICES=0 python3 bench/moe_tile_order.py
    if command -v ncu > /dev/null; then
        run moe_tile_order_ncu 240 env CUDA_VISIBLE_DEVICES=0 ncu --clock-control base --csv --page raw --print-units base \
            -k 'regex:device_kernel|moe_gemm' --metrics gpu__time_duration.sum,dram__bytes_read.sum,sm__cycles_elapsed.avg.per_second \
            python3 bench/moe_tile_order.py --launch-only
        TAIL=50 run moe_tile_order_counters 30 python3 bench/moe_tile_order.py --parse "$OUT/moe_tile_order_ncu.log"
    fi
fi
if want tuning; then
    run tuning_cost 300 env OUT="$OUT" bash bench/tuning_cost.sh "$nproc"
fi
if want tuning_moe; then
    run tuning_cost_moe 300 env OUT="$OUT/moe" bash bench/tuning_cost.sh "$nproc" --workload moe
fi
if want fast; then
    run fast_path 120 env CUDA_VISIBLE_DEVICES=0 python3 bench/fast_path.py --out "$OUT/fast_path.jsonl"
fi
echo "logs and rows under $OUT"
