"""Persistent Hopper GEMM over row shards, with optional per-shard ready flags.

One kernel serves three jobs:

* a plain GEMM ``C = A @ B`` (one shard, no flags);
* the GEMM of the *fused* AllGather-GEMM: ``A`` is the gathered ``[M, K]`` workspace whose
  row shards arrive from other ranks while the kernel runs. Tiles are walked shard by shard,
  starting with the launching rank's own shard, and before a tile of another shard loads A it
  spins on that shard's int32 ready flag (an acquire load) until the copy engine has set it;
* the per-shard GEMMs of the *decomposed* designs (one launch per shard, no flags).

It is persistent (``min(#SMs, #tiles)`` programs loop over the tiles), loads A and B through
device-side tensor descriptors (TMA on Hopper; ``triton.set_allocator`` is set for the
descriptors' scratch memory), and stores C with a masked pointer store so a tile never
writes rows of another shard (shards may be ragged: any row counts).

Constraints declared by :func:`config_is_valid` and :func:`prune_by_shared_memory`:
power-of-two blocks >= 16, GROUP_M >= 1, pipelined shared memory within the device limit.
Input constraints (:func:`check_gemm_inputs`): 2-D, same dtype (fp16/bf16/fp32), last
dimension contiguous, rows 16-byte aligned (K and N multiples of 8 for 16-bit types), as
the tensor descriptors require.

Cost: one launch; with flags, a tile whose shard has not arrived costs a spin loop on one
int32 in global memory (no SM is needed to set the flag, so the spin cannot deadlock).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from .matmul import (
    BF16_INTERPRETER_NOTE,
    CPU_GEMM_CONFIGS,
    HOPPER_GEMM_CONFIGS,
    SUPPORTED_DTYPES,
    config_is_valid,
    host_clock_bench,
    interpreting,
    prune_by_shared_memory,
)

__all__ = [
    "MAX_WORLD",
    "default_configs",
    "make_shard_gemm_kernel",
    "shard_gemm_jit",
    "shard_gemm_kernel",
    "shard_gemm",
    "persistent_matmul",
    "check_gemm_inputs",
    "num_sms",
    "shard_offsets_tensor",
    "config_is_valid",
]

#: Largest number of shards (ranks) the kernel's unrolled shard lookup handles.
MAX_WORLD = 8

_CPU_SMS = 4  # programs of the persistent grid under the interpreter


def default_configs() -> list:
    """The 12-config Hopper space on a GPU, small configs under the interpreter."""
    if torch.cuda.is_available() and not interpreting():
        return list(HOPPER_GEMM_CONFIGS)
    return list(CPU_GEMM_CONFIGS)


@triton.jit
def _locate_tile(tile, rank, offsets_ptr, num_pid_n, WORLD: tl.constexpr, BLOCK_M: tl.constexpr,
                 GROUP_M: tl.constexpr):
    """(shard, first row of the tile, rows left in the shard from there, pid_n) of persistent tile ``tile``.

    Shards are visited in the order rank, rank+1, ...; each shard's tiles are grouped by
    GROUP_M row-tiles for L2 reuse of B.
    """
    first = 0
    shard = rank
    local = tile
    row_start = 0
    rows = 0
    for i in tl.static_range(WORLD):
        s = (rank + i) % WORLD
        s_start = tl.load(offsets_ptr + s)
        s_rows = tl.load(offsets_ptr + s + 1) - s_start
        count = tl.cdiv(s_rows, BLOCK_M) * num_pid_n
        hit = (tile >= first) & (tile < first + count)
        shard = tl.where(hit, s, shard)
        local = tl.where(hit, tile - first, local)
        row_start = tl.where(hit, s_start, row_start)
        rows = tl.where(hit, s_rows, rows)
        first += count
    num_pid_m = tl.cdiv(rows, BLOCK_M)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = local // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (local % num_pid_in_group) % group_size_m
    pid_n = (local % num_pid_in_group) // group_size_m
    return shard, row_start + pid_m * BLOCK_M, rows - pid_m * BLOCK_M, pid_n


@triton.jit
def _count_tiles(offsets_ptr, num_pid_n, WORLD: tl.constexpr, BLOCK_M: tl.constexpr):
    total = 0
    for s in tl.static_range(WORLD):
        total += tl.cdiv(tl.load(offsets_ptr + s + 1) - tl.load(offsets_ptr + s), BLOCK_M) * num_pid_n
    return total


def persistent_shard_gemm(
    a_ptr, b_ptr, c_ptr, flags_ptr, offsets_ptr,
    M, N, K,
    stride_am, stride_bk, stride_cm,
    rank,
    WORLD: tl.constexpr, NUM_SMS: tl.constexpr, WAIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_am, 1], block_shape=[BLOCK_M, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[stride_bk, 1], block_shape=[BLOCK_K, BLOCK_N])
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    num_tiles = _count_tiles(offsets_ptr, num_pid_n, WORLD, BLOCK_M)
    # A spin loop inside the tile loop keeps the compiler from flattening the loop nest.
    for tile in tl.range(tl.program_id(0), num_tiles, NUM_SMS, flatten=not WAIT):
        shard, row, rows_left, pid_n = _locate_tile(tile, rank, offsets_ptr, num_pid_n, WORLD, BLOCK_M, GROUP_M)
        if WAIT:
            if shard != rank:
                while tl.atomic_add(flags_ptr + shard, 0, sem="acquire", scope="sys") == 0:
                    pass
        col = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            a = a_desc.load([row, ki * BLOCK_K])
            b = b_desc.load([ki * BLOCK_K, col])
            acc = tl.dot(a, b, acc)
        offs_m = tl.arange(0, BLOCK_M)
        offs_n = col + tl.arange(0, BLOCK_N)
        c_ptrs = c_ptr + (row + offs_m)[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m < rows_left)[:, None] & (offs_n < N)[None, :])


#: The jitted kernel without a tuner.
shard_gemm_jit = triton.jit(persistent_shard_gemm)

_AUTOTUNE_KEY = ["M", "N", "K", "WORLD", "WAIT"]


def make_shard_gemm_kernel(configs: Optional[Sequence[triton.Config]] = None, do_bench=None, **autotune_kwargs):
    """A NEW ``triton.autotune`` Autotuner over :data:`shard_gemm_jit` (own cache).

    ``configs`` defaults to :func:`default_configs`; configs are pruned by shared memory.
    Under the interpreter the benchmarker defaults to a host clock (Triton's needs a GPU).
    """
    configs = list(configs) if configs is not None else default_configs()
    if not configs:
        raise ValueError("make_shard_gemm_kernel: empty config list")
    if do_bench is None and interpreting():
        do_bench = host_clock_bench
    return triton.autotune(configs=configs, key=_AUTOTUNE_KEY,
                           prune_configs_by={"early_config_prune": prune_by_shared_memory},
                           do_bench=do_bench, **autotune_kwargs)(shard_gemm_jit)


#: The default autotuned kernel (what :func:`shard_gemm` launches when no ``kernel`` is given).
shard_gemm_kernel = make_shard_gemm_kernel()

_sms_cache: dict = {}


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a fixed small number under the interpreter)."""
    if device.type != "cuda" or interpreting():
        return _CPU_SMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _sms_cache:
        _sms_cache[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _sms_cache[index]


def _descriptor_scratch(size: int, alignment: int, stream: Optional[int]) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_allocator() -> None:
    """Device-side tensor descriptors need scratch memory from ``triton.set_allocator`` (per thread)."""
    from triton.runtime import _allocation

    if _allocation._allocator.get() is _allocation._NULL_ALLOCATOR:
        triton.set_allocator(_descriptor_scratch)


_offsets_cache: dict = {}


def shard_offsets_tensor(rows: Sequence[int], device: torch.device) -> torch.Tensor:
    """int32 prefix sums ``[0, rows0, rows0+rows1, ...]`` of shard row counts on ``device`` (cached)."""
    key = (tuple(int(r) for r in rows), str(device))
    cached = _offsets_cache.get(key)
    if cached is None:
        offsets = [0]
        for r in key[0]:
            offsets.append(offsets[-1] + r)
        cached = _offsets_cache[key] = torch.tensor(offsets, dtype=torch.int32, device=device)
    return cached


def check_gemm_inputs(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, who: str) -> None:
    """Raise a clear error unless ``a @ b -> out`` fits the descriptor-based kernel."""
    for name, t in (("a", a), ("b", b), ("out", out)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{who}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{who}: {name} must be 2-D, got shape {tuple(t.shape)}")
    if a.shape[1] != b.shape[0] or out.shape != (a.shape[0], b.shape[1]):
        raise ValueError(f"{who}: shapes do not chain: a {tuple(a.shape)} @ b {tuple(b.shape)} -> out {tuple(out.shape)}")
    if a.dtype != b.dtype or a.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{who}: a and b need one dtype among {SUPPORTED_DTYPES}, got {a.dtype} and {b.dtype}")
    if a.dtype == torch.bfloat16 and interpreting():
        raise TypeError(f"{who}: bf16 is not supported under TRITON_INTERPRET=1. " + BF16_INTERPRETER_NOTE)
    if len({a.device, b.device, out.device}) != 1:
        raise ValueError(f"{who}: a, b and out must be on one device, got {a.device}, {b.device}, {out.device}")
    if a.device.type != "cuda" and not interpreting():
        raise ValueError(f"{who}: tensors are on {a.device}; Triton needs CUDA tensors unless TRITON_INTERPRET=1")
    elem = a.element_size()
    for name, t in (("a", a), ("b", b)):
        if t.stride(1) != 1 or (t.stride(0) * elem) % 16:
            raise ValueError(
                f"{who}: {name} (shape {tuple(t.shape)}, strides {t.stride()}) needs a contiguous last dimension "
                f"and rows aligned to 16 bytes (for {a.dtype}: a row stride that is a multiple of {16 // elem}); "
                "pass .contiguous() of a tensor whose last dimension is padded to that multiple")
    if out.stride(1) != 1:
        raise ValueError(f"{who}: out needs a contiguous last dimension, got strides {out.stride()}")


def shard_gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, rows: Sequence[int], rank: int,
               flags: Optional[torch.Tensor] = None, kernel=None) -> torch.Tensor:
    """``out = a @ b`` tile by tile, shard by shard from ``rank``'s shard on (see module doc).

    ``rows``: row count of each shard (``sum(rows) == a.shape[0]``, at most MAX_WORLD shards).
    ``flags``: int32 ``[len(rows)]``; when given, tiles of shard ``s != rank`` wait for
    ``flags[s] != 0``. ``kernel``: an Autotuner from :func:`make_shard_gemm_kernel`
    (default :data:`shard_gemm_kernel`). Inputs are not re-validated here: call
    :func:`check_gemm_inputs` once per shape.
    """
    world = len(rows)
    M, K = a.shape
    N = b.shape[1]
    if M == 0 or N == 0:
        return out
    if a.device.type == "cuda":
        _ensure_allocator()
    offsets = shard_offsets_tensor(rows, a.device)
    kern = kernel if kernel is not None else shard_gemm_kernel
    sms = num_sms(a.device)
    wait = flags is not None

    def grid(meta):
        tiles = sum(triton.cdiv(r, meta["BLOCK_M"]) for r in rows) * triton.cdiv(N, meta["BLOCK_N"])
        return (max(1, min(sms, tiles)),)

    kern[grid](a, b, out, flags if wait else offsets, offsets, M, N, K, a.stride(0), b.stride(0), out.stride(0), rank,
               WORLD=world, NUM_SMS=sms, WAIT=wait)
    return out


def persistent_matmul(a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None, kernel=None) -> torch.Tensor:
    """Plain ``a @ b`` with the persistent descriptor GEMM (one shard, no flags)."""
    if out is None and isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() == b.dim() == 2:
        out = torch.empty(a.shape[0], b.shape[1], dtype=a.dtype, device=a.device)
    check_gemm_inputs(a, b, out, "persistent_matmul")
    return shard_gemm(a, b, out, [a.shape[0]], rank=0, kernel=kernel)
