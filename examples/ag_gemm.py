"""AllGather-GEMM tuned in context: the 2-rank demo of disttune.

Each rank holds A_r [M/w, K] (rows) and B_r [K, N/w] (columns) and computes
C_r = all_gather(A) @ B_r. The step is wrapped with ``contextual_autotune``, so the
Triton GEMM is tuned while the all-gather really runs next to it, and every rank
ends with the same winner. Run it with

    bash scripts/launch.sh --nproc_per_node=2 examples/ag_gemm.py            # GPUs (NCCL) or CPUs (gloo)
    bash scripts/launch.sh --mpi -n 2 examples/ag_gemm.py

On a machine without a GPU the GEMM runs in Triton's interpreter at a small size.
Exits non-zero if any rank's result differs from all_gather + torch.matmul.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.distributed as dist  # noqa: E402

import disttune  # noqa: E402
from disttune import dist as dt_dist  # noqa: E402
from disttune.kernels.matmul import (  # noqa: E402
    CPU_GEMM_CONFIGS,
    HOPPER_GEMM_CONFIGS,
    make_matmul_kernel,
    matmul,
    matmul_reference,
)


def parse_args() -> argparse.Namespace:
    gpu = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--M", type=int, default=8192 if gpu else 96, help="total rows of A (all ranks)")
    parser.add_argument("--K", type=int, default=8192 if gpu else 64)
    parser.add_argument("--N", type=int, default=8192 if gpu else 64, help="total columns of B (all ranks)")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16" if gpu else "float16")
    parser.add_argument("--n-warmup", type=int, default=3)
    parser.add_argument("--n-repeat", type=int, default=5)
    parser.add_argument("--timed-calls", type=int, default=20, help="calls of the tuned step to time afterwards")
    return parser.parse_args()


def main() -> int:
    options = parse_args()
    info = dt_dist.init()
    rank, world, device = info.rank, info.world_size, info.device
    dtype = getattr(torch, options.dtype)
    if options.M % world or options.N % world:
        raise SystemExit(f"--M ({options.M}) and --N ({options.N}) must be multiples of the world size {world}")
    rows, cols = options.M // world, options.N // world
    generator = torch.Generator(device="cpu").manual_seed(1234 + rank)
    a_local = torch.randn(rows, options.K, generator=generator).to(device, dtype)
    b_local = torch.randn(options.K, cols, generator=generator).to(device, dtype) / options.K ** 0.5
    a_full = torch.empty(options.M, options.K, device=device, dtype=dtype)
    c = torch.empty(options.M, cols, device=device, dtype=dtype)
    configs = HOPPER_GEMM_CONFIGS if device.type == "cuda" else CPU_GEMM_CONFIGS
    kernel = make_matmul_kernel(configs)

    @disttune.contextual_autotune(is_dist=True, n_warmup=options.n_warmup, n_repeat=options.n_repeat)
    def ag_gemm_step() -> torch.Tensor:
        dist.all_gather(list(a_full.chunk(world)), a_local)
        c.fill_(float("nan"))  # poison: an unwritten tile fails the check
        matmul(a_full, b_local, out=c, kernel=kernel)
        return c

    started = time.perf_counter()
    out = ag_gemm_step()
    tuning_s = time.perf_counter() - started

    gathered = torch.empty_like(a_full)
    dist.all_gather(list(gathered.chunk(world)), a_local)
    reference = matmul_reference(gathered, b_local).float()
    error = ((out.float() - reference).norm() / reference.norm()).item()
    ok = bool(torch.isfinite(out).all()) and error < 1e-2

    for _ in range(3):
        ag_gemm_step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(options.timed_calls):
        ag_gemm_step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    step_ms = (time.perf_counter() - started) * 1e3 / max(options.timed_calls, 1)

    verdicts = [None] * world
    dist.all_gather_object(verdicts, (ok, error))
    if rank == 0:
        (result,) = ag_gemm_step.report.results
        print(f"AG-GEMM M={options.M} K={options.K} N={options.N} {options.dtype} on {world} rank(s) "
              f"({info.backend}, {torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU, interpreter'})")
        if result.source != "tuned":
            print(f"winner from the {result.source} (no tuning): {disttune.describe_config(result.config)}")
        else:
            print(f"{'config (ms)':<52} " + " ".join(f"{'rank ' + str(r):>9}" for r in range(world)) + f" {'agreed':>9}")
            for index, config in enumerate(result.configs):
                times = " ".join(f"{row[index]:9.4f}" for row in result.per_rank_ms)
                mark = "  <- winner" if index == result.winner else ""
                print(f"{disttune.describe_config(config):<52} {times} {result.agreed_ms[index]:9.4f}{mark}")
        print(f"tuning call: {tuning_s:.2f} s, {ag_gemm_step.report.function_runs} runs; "
              f"tuned step: {step_ms:.3f} ms/call (host clock, {options.timed_calls} calls)")
        print("correct on every rank:", all(v[0] for v in verdicts),
              "max rel. error:", f"{max(v[1] for v in verdicts):.2e}")
        print(f"per-rank logs: {os.path.abspath(os.environ.get('DISTTUNE_LOG_DIR', 'logs'))}/rank-*.log")
    dist.barrier()
    dt_dist.destroy()
    return 0 if all(v[0] for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
