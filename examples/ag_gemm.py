"""AllGather-GEMM tuned in context: the main demo of disttune.

Each rank holds a row shard of A (``[M/w, K]``) and a column shard of B (``[K, N/w]``) and computes
``C_r = all_gather(A) @ B_r`` with the shipped overlapped ``AllGatherGEMM``: on GPUs each rank
pushes its shard to its peers with the copy engines while the GEMM on its own shard runs, and the
GEMM on each peer's shard starts when that shard has arrived. The step is wrapped with
``contextual_autotune``, so the Triton GEMMs are tuned while the copies really run beside them,
and every rank ends with the same winners. Then the tuned step is timed against the sequential
form people use today (NCCL all-gather, then cuBLAS). Run it with

    bash scripts/launch.sh --nproc_per_node=2 examples/ag_gemm.py     # GPUs (NCCL) or CPUs (gloo)
    bash scripts/launch.sh --mpi -n 2 examples/ag_gemm.py

On a machine without a GPU the step gathers with gloo and runs the same GEMM in Triton's
interpreter at a small size. Exits non-zero if any rank's result differs from all_gather + matmul.
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
from demo_common import check_output, compare, finish, run  # noqa: E402
from disttune import dist as dt_dist  # noqa: E402
from disttune.kernels.ag_gemm import DESIGNS, AllGatherGEMM, ag_gemm_reference  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    gpu = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--M", type=int, default=8192 if gpu else 96, help="rows of A, all ranks together")
    parser.add_argument("--K", type=int, default=8192 if gpu else 64)
    parser.add_argument("--N", type=int, default=8192 if gpu else 64, help="columns of B, all ranks together")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16" if gpu else "float16")
    parser.add_argument("--n-warmup", type=int, default=3)
    parser.add_argument("--n-repeat", type=int, default=5)
    parser.add_argument("--samples", type=int, default=30, help="timing rounds of the tuned step and the baseline")
    parser.add_argument("--design", choices=DESIGNS, default="auto",
                        help="the AllGatherGEMM design (auto: the one it picks for the world size)")
    return parser.parse_args(argv)


def sizes_error(options: argparse.Namespace, world: int) -> str | None:
    """What makes the sizes impossible at ``world`` ranks (``disttune demo`` asks before it launches any)."""
    if options.M % world or options.N % world:
        return f"--M ({options.M}) and --N ({options.N}) must be multiples of the world size {world}"
    return None


def main() -> int:
    options = parse_args()
    info = dt_dist.init()
    rank, world, device = info.rank, info.world_size, info.device
    gpu = device.type == "cuda"
    dtype = getattr(torch, options.dtype)
    if sizes_error(options, world):
        raise SystemExit(sizes_error(options, world))
    generator = torch.Generator().manual_seed(1234 + rank)
    a_shard = torch.randn(options.M // world, options.K, generator=generator).to(device, dtype)
    b_local = (torch.randn(options.K, options.N // world, generator=generator) / options.K ** 0.5).to(device, dtype)
    c = torch.empty(options.M, options.N // world, device=device, dtype=dtype)
    ag_gemm = AllGatherGEMM(design=options.design)

    @disttune.contextual_autotune(is_dist=True, n_warmup=options.n_warmup, n_repeat=options.n_repeat,
                                 verbose=False)  # the table below says more
    def ag_gemm_step() -> torch.Tensor:
        return ag_gemm(a_shard, b_local, out=c)

    a_full = torch.empty(options.M, options.K, device=device, dtype=dtype)
    c_sequential = torch.empty_like(c)

    def sequential_step() -> torch.Tensor:
        if gpu:
            dist.all_gather_into_tensor(a_full, a_shard)
        else:
            dist.all_gather(list(a_full.chunk(world)), a_shard)
        return torch.matmul(a_full, b_local, out=c_sequential)

    started = time.perf_counter()
    ag_gemm_step()
    tuning_s = time.perf_counter() - started
    c.fill_(float("nan"))  # a tile the tuned step leaves unwritten fails the check below
    out = ag_gemm_step()

    ok, worst = check_output(out, ag_gemm_reference(a_shard, b_local), tolerance=1e-2)
    timing = compare(ag_gemm_step, sequential_step, "NCCL all-gather then cuBLAS" if gpu else "gloo then torch",
                     gpu, world, options.samples)
    where = torch.cuda.get_device_name() if gpu else "CPU, Triton interpreter"
    title = (f"AllGather-GEMM M={options.M} K={options.K} N={options.N} {options.dtype} on {world} rank(s) "
             f"({info.backend}, {where}), {ag_gemm.design_for(device)} design")
    return finish(title, ag_gemm_step, tuning_s, timing, ok, worst)

if __name__ == "__main__":
    sys.exit(run(main))
