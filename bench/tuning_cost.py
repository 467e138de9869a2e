"""Tuning cost of the AG-GEMM step (12-config Hopper GEMM space), one variant per process.

    bash bench/tuning_cost.sh [NPROC]      # runs every variant with a fresh Triton cache, prints the table

Variants (``--variant``):
  baseline  Triton-distributed-style: compile inside the loop, exhaustive, 3 warm-up + 5 timed runs per config
  parallel  the same, with every candidate compiled up front in a thread pool
  early     baseline + early stopping (screen all configs, full runs for the best quarter)
  all       parallel compile + early stopping (writes the winner store)
  warm      a second process: the winner store from the "all" run is present

Each process times its first call of the wrapped step (the tuning call; max over
ranks), then 100 calls with the winners (CUDA events around each whole step, median,
max over ranks) and writes one JSON row to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

if not torch.cuda.is_available():  # CPU smoke runs: the interpreter must be chosen before triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.distributed as dist  # noqa: E402

import disttune  # noqa: E402
from disttune import dist as dt_dist  # noqa: E402
from disttune.kernels.matmul import CPU_GEMM_CONFIGS, HOPPER_GEMM_CONFIGS, make_matmul_kernel, matmul  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", choices=["baseline", "parallel", "early", "all", "warm"], required=True)
    parser.add_argument("--M", type=int, default=8192)
    parser.add_argument("--K", type=int, default=8192)
    parser.add_argument("--N", type=int, default=8192)
    parser.add_argument("--out", required=True, help="JSON lines file to append this variant's row to")
    options = parser.parse_args()
    info = dt_dist.init()
    world, device = info.world_size, info.device
    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float16
    a_local = torch.randn(options.M // world, options.K, device=device, dtype=dtype)
    b_local = torch.randn(options.K, options.N // world, device=device, dtype=dtype) / options.K ** 0.5
    a_full = torch.empty(options.M, options.K, device=device, dtype=dtype)
    c = torch.empty(options.M, options.N // world, device=device, dtype=dtype)
    kernel = make_matmul_kernel(HOPPER_GEMM_CONFIGS if gpu else CPU_GEMM_CONFIGS)

    @disttune.contextual_autotune(is_dist=True, n_warmup=3, n_repeat=5, verbose=False,
                                  compile_threads=0 if options.variant in ("baseline", "early") else None,
                                  early_stop=options.variant in ("early", "all"),
                                  store=options.variant in ("all", "warm"))
    def step():
        dist.all_gather(list(a_full.chunk(world)), a_local)
        matmul(a_full, b_local, out=c, kernel=kernel)
        return c

    first_call_s = wall_time_of_one_call(step, device)

    step_ms = []
    for _ in range(100):
        if gpu:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            step()
            end.record()
            end.synchronize()
            step_ms.append(begin.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            step_ms.append((time.perf_counter() - t0) * 1e3)
    step_median = max_over_ranks(statistics.median(step_ms), device)

    plain_call_s = wall_time_of_one_call(step, device)

    (result,) = step.report.results
    row = {"variant": options.variant, "world": world, "device": torch.cuda.get_device_name() if gpu else "cpu",
           "torch": torch.__version__, "first_call_s": first_call_s, "plain_call_s": plain_call_s,
           "function_runs": step.report.function_runs, "source": result.source,
           "winner": disttune.describe_config(result.config), "step_ms_median_of_100": step_median,
           "date": time.strftime("%Y-%m-%d")}
    if info.rank == 0:
        with open(options.out, "a") as handle:
            handle.write(json.dumps(row) + "\n")
        print(json.dumps(row))
    dist.barrier()
    dt_dist.destroy()


def wall_time_of_one_call(step, device: torch.device) -> float:
    """Seconds of one call, all ranks starting together, until its GPU work is done; max over ranks."""
    dist.barrier()
    started = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return max_over_ranks(time.perf_counter() - started, device)


def max_over_ranks(value: float, device: torch.device) -> float:
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


if __name__ == "__main__":
    main()
