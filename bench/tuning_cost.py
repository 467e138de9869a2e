"""Tuning cost of the AG-GEMM step (12-config Hopper GEMM space) or of the AG + MoE grouped GEMM
step (its 12-config Hopper space), one variant per process.

    bash bench/tuning_cost.sh [NPROC] [--out FILE]                 # AG-GEMM step, every variant, fresh Triton caches
    bash bench/tuning_cost.sh [NPROC] [--out FILE] --workload moe  # the MoE step
    torchrun --nproc_per_node=2 bench/tuning_cost.py --variant all --out rows.jsonl   # one variant

Workloads (``--workload``):
  gemm  all_gather of A's row shards, then the Triton GEMM ``[M, K] @ [K, N/w]`` (``kernels.matmul``)
  moe   all_gather of the token shards, then the Triton grouped GEMM (``kernels.moe.moe_gemm``, A
        gathered through the routing) on T=4096, E=8, top-2, H=4096, I/w=7168/w (routing fixed outside)

Variants (``--variant``):
  baseline  Triton-distributed-style: compile inside the loop, exhaustive, 3 warm-up + 5 timed runs per config
  parallel  the same, with every candidate compiled up front in a thread pool
  early     baseline + early stopping (screen all configs, full runs for the best quarter)
  all       parallel compile + early stopping (writes the winner store)
  split     all + ``split=True``: in each tuning run every rank times a different config (the GEMM
            runs after the all-gather, not beside it, so its time does not depend on the peers' configs)
  share     all + ``compile_split=True`` (disttune's default; every other variant turns it off, so
            they show what each step costs without it): each rank compiles its share of the configs,
            then loads the peers' from the Triton cache they share (same node, same TRITON_CACHE_DIR)
  background  parallel, with the warm-up ``disttune.dist.init`` starts in the background (``DISTTUNE_WARM_UP=1``;
            ``bench/tuning_cost.sh`` turns it off for every other variant) still running at the first call
  own_group   parallel in a script that makes its own process group (``torch.distributed.init_process_group``,
            no ``disttune.dist.init``) and its tuner first, then its data: the warm-up the tuner starts
            (``DISTTUNE_WARM_UP=1``) runs while the data is made
  warmed    parallel, after ``disttune.warm_up()`` paid Triton's one-time initialisation before the first
            call (as it can while a model loads; its seconds are reported apart, as ``warm_up_s``)
  warmed_early  warmed + early stopping
  sequential_compiles  parallel with ``DISTTUNE_COMPILE_OVERLAP=0`` (the tuning runs wait for every compile)
  untuned   a fresh process running the same step with the "all" run's winner fixed and no tuner at all
            (a one-config ``triton.autotune`` kernel, which Triton launches without benchmarking)
  untuned_cold  the same with a fresh Triton cache: it compiles the one config and pays Triton's one-time
            initialisation, as every cold first call does; a tuner's *tuning overhead* is its first call
            minus this one
  warm      a second process: the winner store from the "all" run is present

Every tuned variant's row holds ``phases``, where its first call went (``TuningReport.phases``: discovery
run, compile wait, first launches, tuning runs, collectives, store, final run, Python overhead; they sum to
the call's wall time on rank 0) and ``background`` (compile threads: busy seconds summed, first start to
last end). ``bench/tuning_cost.sh`` prints them side by side.

Each process times its first call of the wrapped step (the tuning call: host clock until the
device is done, max over ranks), then 100 calls with the winners (``disttune.benchmark.one_call_ms``:
CUDA events around each whole step, the host clock on CPUs; median, max over ranks) and rank 0
appends one JSON row (with device, versions and date) to ``--out``, which the "untuned" variant
reads back.

Why "untuned": a warm start's first call pays for more than disttune's store lookup: the process's
first NCCL collective, loading the winner's kernel from Triton's cache, CUDA lazy initialisation.
An untuned fresh process pays the same, so "warm start adds X% of the baseline over an untuned
run" is ``(warm.first_call_s - untuned.first_call_s) / baseline.first_call_s``, like with like
(``bench/tuning_cost.sh`` runs "untuned" and "warm" on the "all" run's Triton cache and prints
both this and the within-process figure, warm first call minus warm plain call).
The untuned variant reads the winner from the "all" row of ``--out`` (or ``--winner``).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

if not torch.cuda.is_available():  # CPU smoke runs: the interpreter must be chosen before triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.distributed as dist  # noqa: E402

import disttune  # noqa: E402
from disttune import benchmark  # noqa: E402
from disttune import dist as dt_dist  # noqa: E402
from disttune.kernels import moe  # noqa: E402
from disttune.kernels.matmul import CPU_GEMM_CONFIGS, HOPPER_GEMM_CONFIGS, make_matmul_kernel, matmul  # noqa: E402


VARIANTS = ["baseline", "parallel", "background", "own_group", "early", "all", "split", "share", "warmed", "warmed_early",
            "sequential_compiles", "untuned", "untuned_cold", "warm"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", choices=VARIANTS, required=True)
    parser.add_argument("--winner", default=None,
                        help="untuned: the config to fix, as describe_config prints it (default: the 'all' row's)")
    parser.add_argument("--M", type=int, default=8192)
    parser.add_argument("--K", type=int, default=8192)
    parser.add_argument("--N", type=int, default=8192)
    parser.add_argument("--workload", choices=["gemm", "moe"], default="gemm")
    parser.add_argument("--out", required=True, help="JSON lines file to append this variant's row to")
    options = parser.parse_args()
    variant = options.variant
    if variant == "own_group":
        own_group_first_call(options)
        return
    info = dt_dist.init()
    world, device = info.world_size, info.device
    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float16
    configs, make_kernel, body = make_workload(options, world, device, dtype)
    if variant.startswith("untuned"):
        winner = fixed_winner(options, configs)
        kernel = make_kernel([winner])  # one config: Triton launches it with no benchmarking

        def fixed_step():
            return body(kernel)

        first_call_s = wall_time_of_one_call(fixed_step, device)
        step_median = median_step_ms(fixed_step)
        plain_call_s = wall_time_of_one_call(fixed_step, device)
        write_row(options, {"variant": variant, "workload": options.workload,
                            "first_call_s": first_call_s, "plain_call_s": plain_call_s, "function_runs": 1,
                            "source": "fixed", "winner": disttune.describe_config(winner),
                            "step_ms_median_of_100": step_median})
        return
    warm_up_s = None
    if variant.startswith("warmed"):
        started = time.perf_counter()
        disttune.warm_up()
        warm_up_s = benchmark.max_over_ranks(time.perf_counter() - started)
    kernel = make_kernel(configs)

    @disttune.contextual_autotune(is_dist=True, n_warmup=3, n_repeat=5, verbose=False,
                                  compile_threads=0 if variant in ("baseline", "early") else None,
                                  early_stop=variant in ("early", "all", "split", "share", "warmed_early"),
                                  split=variant == "split", compile_split=variant == "share",
                                  store=variant in ("all", "warm"))
    def step():
        return body(kernel)

    first_call_s = wall_time_of_one_call(step, device)
    report = step.report
    step_median = median_step_ms(step)
    plain_call_s = wall_time_of_one_call(step, device)

    (result,) = report.results
    row = {"variant": variant, "workload": options.workload, "first_call_s": first_call_s,
           "plain_call_s": plain_call_s, "function_runs": report.function_runs, "source": result.source,
           "winner": disttune.describe_config(result.config), "step_ms_median_of_100": step_median,
           "tuning_wall_s": report.wall_s, "phases": report.phases, "background": report.background,
           "warm_up_s": warm_up_s}
    write_row(options, row)


def own_group_first_call(options) -> None:
    """The "own_group" variant: the script's own process group, then its tuner (which starts Triton's warm-up),
    then its data, then the first call."""
    gpu = torch.cuda.is_available()
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if gpu else "gloo")
    world = dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    workload: dict = {}

    @disttune.contextual_autotune(is_dist=True, n_warmup=3, n_repeat=5, verbose=False, store=False)
    def step():
        return workload["body"](workload["kernel"])

    configs, make_kernel, workload["body"] = make_workload(options, world, device,
                                                           torch.bfloat16 if gpu else torch.float16)
    workload["kernel"] = make_kernel(configs)
    first_call_s = wall_time_of_one_call(step, device)
    (result,) = step.report.results
    write_row(options, {"variant": "own_group", "workload": options.workload, "first_call_s": first_call_s,
                        "plain_call_s": wall_time_of_one_call(step, device), "function_runs": step.report.function_runs,
                        "source": result.source, "winner": disttune.describe_config(result.config),
                        "step_ms_median_of_100": median_step_ms(step), "tuning_wall_s": step.report.wall_s,
                        "phases": step.report.phases, "background": step.report.background, "warm_up_s": None})


def make_workload(options, world: int, device: torch.device, dtype: torch.dtype):
    """(configs, make_kernel(configs), body(kernel)): the step of ``--workload`` without its tuner."""
    gpu = device.type == "cuda"
    if options.workload == "gemm":
        a_local = torch.randn(options.M // world, options.K, device=device, dtype=dtype)
        b_local = torch.randn(options.K, options.N // world, device=device, dtype=dtype) / options.K ** 0.5
        a_full = torch.empty(options.M, options.K, device=device, dtype=dtype)
        c = torch.empty(options.M, options.N // world, device=device, dtype=dtype)

        def gemm_body(kernel):
            dist.all_gather(list(a_full.chunk(world)), a_local)
            matmul(a_full, b_local, out=c, kernel=kernel)
            return c

        return (HOPPER_GEMM_CONFIGS if gpu else CPU_GEMM_CONFIGS), make_matmul_kernel, gemm_body
    T, E, k, H, I = (4096, 8, 2, 4096, 7168) if gpu else (64, 4, 2, 32, 64)
    g = torch.Generator().manual_seed(0)  # one routing for every rank (the gathered tokens' ids)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(device, torch.int32)
    routing = moe.moe_align(ids, E)
    x_local = torch.randn(T // world, H, device=device, dtype=dtype)
    x_all = torch.empty(T, H, device=device, dtype=dtype)
    w = torch.randn(E, H, I // world, device=device, dtype=dtype) / H ** 0.5
    out = torch.empty(T * k, I // world, device=device, dtype=dtype)

    def moe_body(kernel):
        dist.all_gather(list(x_all.chunk(world)), x_local)
        moe.moe_gemm(x_all, w, routing, a_order="token", out=out, kernel=kernel)
        return out

    return (moe.HOPPER_MOE_CONFIGS if gpu else moe.CPU_MOE_CONFIGS), moe.make_moe_kernel, moe_body


def fixed_winner(options, configs):
    """The config the untuned variant fixes: ``--winner``, else the "all" row's winner in ``--out``."""
    wanted = options.winner
    if wanted is None:
        rows = [json.loads(line) for line in open(options.out)] if os.path.exists(options.out) else []
        tuned = [r for r in rows if r["variant"] == "all" and r.get("workload", "gemm") == options.workload]
        if not tuned:
            raise SystemExit(f"tuning_cost.py --variant untuned: no 'all' row in {options.out}; run the 'all' "
                             "variant first or pass --winner")
        wanted = tuned[-1]["winner"]
    matches = [config for config in configs if disttune.describe_config(config) == wanted]
    if not matches:
        raise SystemExit(f"tuning_cost.py --variant untuned: {wanted!r} is none of the configs: "
                         + "; ".join(disttune.describe_config(config) for config in configs))
    return matches[0]


def median_step_ms(step) -> float:
    """Median of 100 whole-step times (CUDA events on GPUs, the host clock otherwise), max over ranks."""
    return benchmark.max_over_ranks(benchmark.one_call_ms(step, samples=100, warmup=0, barrier=False))


def write_row(options, row: dict) -> None:
    """Rank 0 appends ``row`` with the environment's metadata to ``--out`` and prints it; then every rank
    leaves the process group."""
    written = benchmark.append_rows(options.out, [row])
    if written:
        print(json.dumps(row))
    dist.barrier()
    dt_dist.destroy()


def wall_time_of_one_call(step, device: torch.device) -> float:
    """Seconds of one call, all ranks starting together, until its GPU work is done (the host clock: a
    tuning call is mostly host work); max over ranks."""
    dist.barrier()
    started = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return benchmark.max_over_ranks(time.perf_counter() - started)


if __name__ == "__main__":
    main()
