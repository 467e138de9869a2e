"""Which GEMM main loop for the shard-ordered GEMM? The shipped one vs simpler TMA loops, on one GPU.

    python bench/gemm_variants.py [--M 8192 --K 8192 --N 4096]

Variants, each tuned by stock ``triton.autotune`` over the same Hopper configs, then timed with
``triton.testing.do_bench`` against cuBLAS on the same inputs:

* ``shipped``     the current main loop (``kernels.shard_gemm``: persistent, TMA, K-major B when
                  given one; here B is row-major). It was a pointer-load loop when this bench chose
                  the TMA design (0.813 ms on 8192 x 8192 x 4096, the README's number);
* ``tma``         device-side descriptors for A ``[M, K]`` and B ``[K, N]`` (row-major B);
* ``tma_bt``      descriptors with B stored K-major (``[N, K]``, a transposed copy of the weight);
* ``persistent``  ``tma_bt`` in a persistent loop (grid = #SMs, flattened loop nest) with the C
                  tile stored through a descriptor in two halves (epilogue subtiling).
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from disttune.kernels.matmul import gemm_config
from disttune.kernels.shard_gemm import make_shard_gemm_kernel, matmul_shards


def _configs():
    return [gemm_config(bm, bn, bk, 8, s, w) for bm, bn, bk, s, w in [
        (128, 256, 64, 3, 8), (128, 256, 64, 4, 8), (256, 128, 64, 3, 8), (128, 128, 64, 4, 4),
        (128, 128, 64, 3, 8), (128, 128, 128, 3, 8)]]


@triton.jit
def _pid(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_in_group = GROUP_M * num_pid_n
    first_m = (tile // num_in_group) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (tile % num_in_group) % size_m, (tile % num_in_group) // size_m


@triton.autotune(configs=_configs(), key=["M", "N", "K"])
@triton.jit
def tma_gemm(a_ptr, b_ptr, c_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             GROUP_M: tl.constexpr):
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[N, 1], block_shape=[BLOCK_K, BLOCK_N])
    pid_m, pid_n = _pid(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        acc = tl.dot(a_desc.load([pid_m * BLOCK_M, k * BLOCK_K]), b_desc.load([k * BLOCK_K, pid_n * BLOCK_N]), acc)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(c_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(tl.bfloat16),
             mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


@triton.autotune(configs=_configs(), key=["M", "N", "K"])
@triton.jit
def tma_bt_gemm(a_ptr, bt_ptr, c_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                GROUP_M: tl.constexpr):
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(bt_ptr, shape=[N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    pid_m, pid_n = _pid(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        acc = tl.dot(a_desc.load([pid_m * BLOCK_M, k * BLOCK_K]), b_desc.load([pid_n * BLOCK_N, k * BLOCK_K]).T, acc)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(c_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(tl.bfloat16),
             mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


@triton.autotune(configs=_configs(), key=["M", "N", "K"])
@triton.jit
def persistent_gemm(a_ptr, bt_ptr, c_ptr, M, N, K, NUM_SMS: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(bt_ptr, shape=[N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N // 2])
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_tiles, NUM_SMS, flatten=True):
        pid_m, pid_n = _pid(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(k_tiles):
            acc = tl.dot(a_desc.load([pid_m * BLOCK_M, k * BLOCK_K]), b_desc.load([pid_n * BLOCK_N, k * BLOCK_K]).T,
                         acc)
        acc = tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2))
        acc = tl.permute(acc, (0, 2, 1))
        left, right = tl.split(acc)
        c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], left.to(tl.bfloat16))
        c_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N + BLOCK_N // 2], right.to(tl.bfloat16))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--M", type=int, default=8192)
    parser.add_argument("--K", type=int, default=8192)
    parser.add_argument("--N", type=int, default=4096)
    args = parser.parse_args()
    M, K, N = args.M, args.K, args.N
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16) / K ** 0.5
    bt = b.t().contiguous()
    c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    want = a.float() @ b.float()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    flops = 2 * M * N * K
    shipped_kernel = make_shard_gemm_kernel(_configs())

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    variants = {
        "cuBLAS": (lambda: torch.matmul(a, b, out=c), None),
        "shipped": (lambda: matmul_shards(a, b, c, kernel=shipped_kernel), shipped_kernel),
        "tma": (lambda: tma_gemm[grid](a, b, c, M, N, K), tma_gemm),
        "tma_bt": (lambda: tma_bt_gemm[grid](a, bt, c, M, N, K), tma_bt_gemm),
        "persistent": (lambda: persistent_gemm[lambda meta: (min(sms, grid(meta)[0]),)](a, bt, c, M, N, K,
                                                                                       NUM_SMS=sms),
                       persistent_gemm),
    }
    for name, (fn, kernel) in variants.items():
        try:
            c.fill_(float("nan"))
            fn()
            torch.cuda.synchronize()
            err = ((c.float() - want).norm() / want.norm()).item()
            ms = triton.testing.do_bench(fn, warmup=50, rep=300)
            best = kernel.best_config if kernel is not None else ""
            print(f"{name:11s} {ms:.3f} ms {flops / ms / 1e9:5.0f} TFLOP/s  rel.err {err:.1e}  {best}", flush=True)
        except Exception as exc:  # noqa: BLE001 - a variant that fails to compile is a result too
            print(f"{name:11s} failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)


if __name__ == "__main__":
    main()
