#!/usr/bin/env bash
# Tuning cost of the AG-GEMM (or AG + MoE) step: each variant of bench/tuning_cost.py in its own process
# with a fresh Triton cache (the warm run reuses the last run's caches, as a second job on the same
# machine would), then a table of first-call times against the baseline.
# Usage: bash bench/tuning_cost.sh [NPROC] [--out FILE] [args for bench/tuning_cost.py, e.g. --M 4096 or --workload moe]
# Rows, stores, caches and logs live in a temporary directory; --out FILE appends the rows to FILE.
set -euo pipefail
cd "$(dirname "$0")/.."
nproc=2
if [[ $# -gt 0 && $1 != -* ]]; then nproc="$1"; shift; fi
keep=""
args=()
while [[ $# -gt 0 ]]; do
    if [[ $1 == --out ]]; then keep="$2"; shift 2; else args+=("$1"); shift; fi
done
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
rows="$work/tuning_cost.jsonl"
store="$work/store"
run() {  # variant triton-cache
    local variant="$1" cache="$2"
    TRITON_CACHE_DIR="$cache" DISTTUNE_CACHE_DIR="$store" DISTTUNE_LOG_DIR="$work/logs-$variant" \
        bash scripts/launch.sh --nproc_per_node="$nproc" bench/tuning_cost.py --variant "$variant" --out "$rows" \
        ${args[@]+"${args[@]}"}
}
for variant in baseline parallel early split share all; do  # "all" last: untuned and warm reuse its Triton cache
    cache="$work/triton-$variant"; mkdir -p "$cache"  # a cold Triton cache for each cold variant
    run "$variant" "$cache"
done
run untuned "$cache"  # a fresh process with the winner fixed, no tuner: the "all" run's Triton cache
run warm "$cache"  # the second process on this machine: the "all" run's Triton cache and store
if [[ -n $keep ]]; then
    mkdir -p "$(dirname "$keep")"
    cat "$rows" >> "$keep"
fi
python3 - "$rows" <<'PY'
import json, sys
rows = {r["variant"]: r for r in map(json.loads, open(sys.argv[1]))}
base = rows["baseline"]
step = {"gemm": "AG-GEMM step", "moe": "AG + MoE grouped GEMM step"}[base.get("workload", "gemm")]
print(f"\ntuning cost, {step}, {base['world']} x {base['device']} (torch {base['torch']}, triton {base['triton']}, "
      f"{base['date']})")
print(f"{'variant':<10} {'first call s':>12} {'vs baseline':>11} {'runs':>5} {'source':>7} {'step ms (100)':>13}  winner")
for name in ("baseline", "parallel", "early", "all", "split", "share", "untuned", "warm"):
    r = rows[name]
    print(f"{name:<10} {r['first_call_s']:12.3f} {r['first_call_s'] / base['first_call_s']:10.2f}x {r['function_runs']:5d} "
          f"{r['source']:>7} {r['step_ms_median_of_100']:13.4f}  {r['winner']}")
warm, untuned = rows["warm"], rows["untuned"]
print(f"warm start over an untuned call: {warm['first_call_s'] - warm['plain_call_s']:.3f} s "
      f"= {100 * (warm['first_call_s'] - warm['plain_call_s']) / base['first_call_s']:.1f}% of the baseline's tuning time "
      "(same process: warm first call minus a later call)")
added = warm["first_call_s"] - untuned["first_call_s"]
print(f"warm start over an untuned run: {added:.3f} s = {100 * added / base['first_call_s']:.1f}% of the baseline's "
      f"tuning time (first calls of two fresh processes: store hit {warm['first_call_s']:.3f} s, "
      f"winner fixed without a tuner {untuned['first_call_s']:.3f} s; target <= 5%)")
PY
