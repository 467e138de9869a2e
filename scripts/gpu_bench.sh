#!/usr/bin/env bash
# On a GPU machine: the GPU checks and every benchmark in bench/, in one call.
# Usage: OUT=DIR bash scripts/gpu_bench.sh [NPROC] [transport|ag|moe|moehost|tuning|tuning_moe|fast|plane|stephost|faults|
#                                                   moeexit|owngroup|demo|energy|tests|gputests|moetests|all ...]
# NPROC defaults to the GPU count; OUT to a new temporary directory. Each step has its own time limit
# and logs to $OUT/<step>.log, so one failing step does not hide the others; the last lines of each
# log are echoed. The benchmarks append their JSON rows to $OUT/<bench>.jsonl.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d -t disttune-gpu-bench-XXXXXX)}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 DISTTUNE_LOG_DIR="$OUT/logs"
nproc="${1:-$(nvidia-smi -L | wc -l)}"; shift || true
steps="${*:-all}"
python3 -c "import disttune.kernels, sys; sys.exit(not disttune.__file__.startswith('$PWD/'))" 2>/dev/null \
  || python3 -m pip install --quiet --no-deps --no-build-isolation --no-index -e . > "$OUT/install.log" 2>&1 \
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
    run gpu_tests 250 python3 -m pytest -q -m "" -x tests/test_gpu.py
fi
if want moetests; then  # the MoE suite on the GPUs: single-GPU GEMM cases, and the 2-rank cases under NCCL
    # (cold, their compiles take most of the limit: 54 of the 67 cases passed in 330 s on 2 x H200)
    run moe_tests 560 python3 -m pytest -q -m "" -x -rs tests/test_moe.py -k "not 4_ranks"
fi
if want transport; then  # what the copy engines give a push: GB/s by streams and pieces, beside a GEMM
    TAIL=20 run transport 120 "${launch[@]}" bench/transport.py --out "$OUT/transport.jsonl"
fi
if want ag; then
    TAIL=40 run ag_gemm 240 "${launch[@]}" bench/ag_gemm.py --out "$OUT/ag_gemm.jsonl"
fi
if want moe; then
    TAIL=70 run moe 420 "${launch[@]}" bench/moe.py --out "$OUT/moe.jsonl"
fi
if want moehost; then  # is AG-MoE host-bound? host, wall and GPU time per call, with a cProfile on rank 0
    TAIL=30 run moe_host 200 "${launch[@]}" bench/moe_host.py --profile --phases --out "$OUT/moe_host.jsonl"
fi
if want tuning; then
    run tuning_cost 300 bash bench/tuning_cost.sh "$nproc" --out "$OUT/tuning_cost.jsonl"
fi
if want tuning_moe; then
    run tuning_cost_moe 300 bash bench/tuning_cost.sh "$nproc" --out "$OUT/tuning_cost_moe.jsonl" --workload moe
fi
if want faults; then  # the fault suite under NCCL at 2 and NPROC GPUs, and the control plane's own test
    TAIL=30 run faults 600 python3 -m pytest -q -m "" -s -p no:cacheprovider tests/test_stranded.py tests/test_control_plane.py \
        -k "nccl or plane"
fi
if want energy; then  # one GPU: NVML's energy per launch against power x time, and a Pareto front over both
    TAIL=24 run energy 180 env CUDA_VISIBLE_DEVICES=0 python3 -m pytest -q -m "" -s -p no:cacheprovider tests/test_gpu.py \
        -k "energy or pareto"
fi
if want moeexit; then  # part b of bench/moe.py (CUDA graphs of NCCL collectives): does every rank exit by itself?
    TAIL=12 run moe_exit 150 "${launch[@]}" bench/moe.py --parts b --iters 10
fi
if want owngroup; then  # first call with the warm-up a tuner starts (own process group) vs init's vs none
    run tuning_own_group 180 env VARIANTS="parallel background own_group" bash bench/tuning_cost.sh "$nproc" \
        --out "$OUT/tuning_own_group.jsonl"
fi
if want demo; then  # the main job at NPROC ranks; its logs come back for the report's figures
    TAIL=30 run demo 150 python3 -m disttune demo --nproc "$nproc" --log-dir "$OUT/demo-logs"
fi
if want plane; then  # the control plane: µs per collective through the rendezvous store, and on the group
    TAIL=14 run control_plane 60 "${launch[@]}" bench/control_plane.py --out "$OUT/control_plane.jsonl"
fi
if want stephost; then  # host µs per call of the tuned AG + GEMM 8192^3 step, wrapped vs plain
    TAIL=10 run step_host 120 "${launch[@]}" bench/step_host.py --out "$OUT/step_host.jsonl"
fi
if want fast; then
    TAIL=20 run fast_path 120 env CUDA_VISIBLE_DEVICES=0 python3 bench/fast_path.py --out "$OUT/fast_path.jsonl"
fi
echo "logs and rows under $OUT"
