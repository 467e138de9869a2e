"""Single-GPU check: the shard-ordered GEMM vs kernels.matmul's GEMM vs cuBLAS on one shape.

    python bench/gemm_alone.py [--M 8192 --K 8192 --N 4096]

Each Triton kernel is tuned by stock ``triton.autotune`` over the same 12 Hopper configs;
prints the best time of each (``triton.testing.do_bench``, ms) and cuBLAS's.
"""
import argparse

import torch
import triton

from disttune.kernels.matmul import HOPPER_GEMM_CONFIGS, make_matmul_kernel, matmul
from disttune.kernels.shard_gemm import make_shard_gemm_kernel, matmul_shards

parser = argparse.ArgumentParser()
parser.add_argument("--M", type=int, default=8192)
parser.add_argument("--K", type=int, default=8192)
parser.add_argument("--N", type=int, default=4096)
args = parser.parse_args()
a = torch.randn(args.M, args.K, device="cuda", dtype=torch.bfloat16)
b = torch.randn(args.K, args.N, device="cuda", dtype=torch.bfloat16)
c = torch.empty(args.M, args.N, device="cuda", dtype=torch.bfloat16)
flops = 2 * args.M * args.N * args.K
results = {"cuBLAS": triton.testing.do_bench(lambda: torch.matmul(a, b, out=c), warmup=50, rep=300)}
for name, kernel, fn in (("kernels.matmul", make_matmul_kernel(HOPPER_GEMM_CONFIGS), matmul),
                         ("kernels.shard_gemm", make_shard_gemm_kernel(HOPPER_GEMM_CONFIGS), matmul_shards)):
    fn(a, b, c, kernel=kernel)
    results[name] = triton.testing.do_bench(lambda: fn(a, b, c, kernel=kernel), warmup=50, rep=300)
    print(name, "winner", kernel.best_config, flush=True)
for name, ms in results.items():
    print(f"{name:20s} {ms:.3f} ms  {flops / ms / 1e9:.0f} TFLOP/s")
