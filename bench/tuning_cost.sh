#!/usr/bin/env bash
# Tuning cost of the AG-GEMM (or AG + MoE) step: each variant of bench/tuning_cost.py in its own process
# with a fresh Triton cache (the warm run reuses the last run's caches, as a second job on the same
# machine would), then a table of first-call times against the baseline, the tuning overhead over an
# untuned cold first call, and where each first call went.
# Usage: bash bench/tuning_cost.sh [NPROC] [--out FILE] [args for bench/tuning_cost.py, e.g. --M 4096 or --workload moe]
# VARIANTS="baseline parallel ..." runs a subset (the untuned, warm and untuned_cold runs need "all").
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
run() {  # variant triton-cache [VAR=value ...]
    local variant="$1" cache="$2"; shift 2
    # No background warm-up from disttune.dist.init, except where a variant asks: each variant pays
    # Triton's one-time initialisation where its row says.
    env DISTTUNE_WARM_UP=0 "$@" TRITON_CACHE_DIR="$cache" DISTTUNE_CACHE_DIR="$store" \
        DISTTUNE_LOG_DIR="$work/logs-$variant" \
        bash scripts/launch.sh --nproc_per_node="$nproc" bench/tuning_cost.py --variant "$variant" --out "$rows" \
        ${args[@]+"${args[@]}"}
}
fresh() { local cache="$work/triton-$1"; mkdir -p "$cache"; echo "$cache"; }  # a cold Triton cache
variants="${VARIANTS:-baseline parallel sequential_compiles background warmed early warmed_early split share all}"
for variant in $variants; do  # "all" last: untuned and warm reuse its Triton cache
    case "$variant" in
        sequential_compiles) run "$variant" "$(fresh "$variant")" DISTTUNE_COMPILE_OVERLAP=0 ;;
        background | own_group) run "$variant" "$(fresh "$variant")" DISTTUNE_WARM_UP=1 ;;
        *) run "$variant" "$(fresh "$variant")" ;;
    esac
done
if [[ " $variants " == *" all "* ]]; then
    run untuned "$work/triton-all"  # a fresh process with the winner fixed, no tuner: the "all" run's Triton cache
    run warm "$work/triton-all"  # the second process on this machine: the "all" run's Triton cache and store
    run untuned_cold "$(fresh untuned_cold)"  # the winner fixed, no tuner, a cold Triton cache
fi
if [[ -n $keep ]]; then
    mkdir -p "$(dirname "$keep")"
    cat "$rows" >> "$keep"
fi
python3 bench/tuning_cost_table.py "$rows"
