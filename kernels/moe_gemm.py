"""The grouped GEMM of mixture-of-experts: one Triton kernel for all experts, its configs and launchers.

``moe_gemm_jit`` / ``moe_gemm_kernel`` / :func:`make_moe_kernel` compute
``C[row] = A[a_row(row)] @ W[expert(row)]`` (optionally times the routing weight), fp32
accumulate, for the rows of a :class:`~disttune.kernels.moe_routing.MoeRouting`. Layouts:

- ``W``: ``[E, K, N]`` (``[E, H, I]`` for the up projection, ``[E, I, H]`` for down), any strides;
  a transposed view of ``[E, N, K]`` works too (same as ``torch._grouped_mm``'s ``mat_b``).
- ``A`` (``a_order``): ``"token"`` -- ``[T, K]``, rows gathered through the routing
  (``sorted_ids // top_k``, vLLM's indirect load: no permuted copy of A); ``"flat"`` --
  ``[T * top_k, K]`` in (token, choice) order, gathered through ``sorted_ids``; ``"sorted"`` --
  ``[R, K]`` already in the routing's sorted order (contiguous loads).
- ``C`` (``out_order``): ``"sorted"`` (contiguous, ``[R, N]`` in sorted order) or ``"flat"``
  (row ``t * top_k + j``: scattered stores, ready for the top-k sum).

Persistent: ``min(#SMs, tile bound)`` programs walk the ``BLOCK_M x BLOCK_N`` tiles. Each program
builds the expert table once from ``expert_offs`` (an ``E``-wide cumulative sum) and maps every tile
to its expert with it; experts without tokens own no tiles, and BLOCK_M is freely tunable (no
padding). W is read through a 3-D tensor descriptor (TMA) when its rows are 16-byte aligned, either
``[E, K, N]`` row-major or the transpose of ``[E, N, K]``; sorted A through a 2-D descriptor likewise
(its rows past an expert's end are loaded and never stored); gathered A and unaligned layouts use
pointer loads. C is stored with a mask (a tile must not write the next expert's rows). Cost:
``2 * R * K * N`` flops plus one tile's padding per non-empty expert, and about 10 µs of host
Python per launch. :func:`moe_gemm_sorting` sorts the routing in the same launch (``SORT``): the first
programs run the counting sort's chunks (``moe_routing.sort_chunk``) and every program waits until all
are sorted before its tiles, one launch where sort and GEMM take two.

Tuning key (:data:`MOE_KEY`): ``N, K, E, TOP_K, ROWS_BUCKET``, the A/C/weight modes and ``SORT`` (plus dtypes,
as Triton adds them); a launch that sorts its routing tunes apart, as its programs also need the sort's
registers and shared memory. ``ROWS_BUCKET`` is the total number of routed rows rounded up to a power of
two (``bucket=`` changes that); per-expert counts are never in the key, so ranks with different
routings tune the same sites and agree on one winner.

Interpreter notes: as kernels/matmul.py (``TRITON_INTERPRET=1`` before importing triton; host-clock
``do_bench`` under the interpreter; bf16 refused there, see ``BF16_INTERPRETER_NOTE``).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import triton
import triton.language as tl

from disttune import cached_launch

from .matmul import (
    BF16_INTERPRETER_NOTE,
    cdiv,
    check_config,
    config_is_valid,
    gemm_config,
    interpreting,
    make_autotuner,
    next_power_of_2,
    prune_by_shared_memory,
)
from .moe_common import INTERPRETED, PassedChecks, check_device, check_float_tensor, empty_buffer, tensor_layout
from .moe_routing import (MAX_GROUPS, MoeRouting, SortPlan, check_rank_ids, check_routing, check_topk_ids,
                          moe_align_ranks, sort_chunk, sort_chunks, token_starts)
from .shard_gemm import ensure_descriptor_allocator, num_sms

__all__ = [
    "HOPPER_MOE_CONFIGS",
    "CPU_MOE_CONFIGS",
    "TILE_ORDERS",
    "A_ORDERS",
    "OUT_ORDERS",
    "MOE_KEY",
    "default_moe_configs",
    "next_power_of_2",
    "moe_config_is_valid",
    "prune_moe_configs",
    "moe_gemm_jit",
    "make_moe_kernel",
    "moe_gemm_kernel",
    "prepare_launch",
    "sorting_launch",
    "moe_gemm",
    "moe_gemm_sorting",
    "moe_gemm_with_config",
]


#: Hopper (H100/H200) space, bf16/fp16: large tiles for the 8-expert shape, 64-row tiles for
#: many small experts (64 experts x ~400 rows), deeper pipelines for the narrower tiles.
#: Each entry: BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, stages, warps.
HOPPER_MOE_CONFIGS = [gemm_config(*entry) for entry in (
    (128, 256, 64, 8, 3, 8), (128, 256, 64, 8, 4, 8), (256, 128, 64, 8, 3, 8),  # large tiles
    (128, 128, 64, 8, 4, 4), (128, 128, 64, 8, 3, 8), (128, 128, 128, 8, 3, 8),
    (64, 256, 64, 8, 4, 4), (64, 128, 64, 8, 4, 4), (128, 64, 64, 8, 4, 4), (64, 64, 64, 8, 4, 4),  # small experts
    (128, 128, 32, 8, 4, 4), (64, 128, 128, 8, 3, 4),
)]

#: Small configs for CPU runs under the interpreter, whose cost is mostly per program:
#: few, wide tiles keep the tests fast.
CPU_MOE_CONFIGS = [gemm_config(*entry) for entry in (
    (32, 32, 32, 4, 1, 1), (16, 32, 32, 1, 1, 1), (32, 32, 16, 4, 1, 1),
)]

#: Tile orders of the grouped GEMM (``tile_order=``). ``"expert_bands"`` (the default): bands of
#: GROUP_M to 2 * GROUP_M - 1 M-tiles that never straddle two groups (experts), each band walking all
#: its N-tiles, so a band reads its expert's weight columns from DRAM once. ``"grouped"``: Triton's
#: GROUP_M raster over the M-tiles of all experts, whose bands may straddle two experts and then
#: read both experts' weights. Both compute every tile once; the tuning key does not include the
#: order, so one kernel tunes one winner for both.
TILE_ORDERS = ("expert_bands", "grouped")

A_ORDERS = ("token", "flat", "sorted")
OUT_ORDERS = ("sorted", "flat")
_A_MODE = {name: i for i, name in enumerate(A_ORDERS)}
_INT32_MAX = 2**31 - 1

def default_moe_configs() -> list:
    """Hopper space on a real GPU, small CPU configs under the interpreter / without CUDA."""
    if torch.cuda.is_available() and not interpreting():
        return list(HOPPER_MOE_CONFIGS)
    return list(CPU_MOE_CONFIGS)


# --------------------------------------------------------------------------- constraints


def moe_config_is_valid(config: triton.Config, dtype: torch.dtype) -> tuple[bool, str]:
    """Declared constraints: those of kernels/matmul.py's ``config_is_valid`` (powers of two
    >= 16 for BLOCK_M/N/K, GROUP_M >= 1, power-of-two warps, stages >= 1, supported dtype).
    No divisibility constraint ties BLOCK_M to the routing: tiles are mapped to experts in
    the kernel. Returns (ok, reason)."""
    return config_is_valid(config, dtype)


def prune_moe_configs(configs, named_args: dict, **kwargs) -> list:
    """``early_config_prune`` hook: declared constraints + shared memory of the device.

    Shared memory is ``num_stages * (BLOCK_M*BLOCK_K + BLOCK_K*BLOCK_N) * element size``,
    the widest of A's and W's element sizes. Raises ValueError listing each config's reason
    if nothing survives.
    """
    return prune_by_shared_memory(configs, named_args, **kwargs)


# --------------------------------------------------------------------------- kernel


def _moe_gemm_body(
    a_ptr, b_ptr, c_ptr, weights_ptr, sorted_ids_ptr, expert_offs_ptr, flags_ptr, rank_starts_ptr,
    R, N, K, E, B_EXPERTS, TOP_K, ROWS_BUCKET, first_group, epoch,
    stride_am, stride_ak,
    stride_be, stride_bk, stride_bn,
    stride_cm, stride_cn,
    sort_ids_ptr, sort_starts_ptr, sort_scratch_ptr, sort_sync_ptr, sort_stride_t, sort_stride_k,
    E_POW2: tl.constexpr,       # E rounded up: E groups in expert_offs, group g multiplies W[g % B_EXPERTS]
    WAIT: tl.constexpr,         # True: a tile of group g first spins until flags[g // B_EXPERTS] >= epoch;
                                # 2: until flags[r] >= epoch for every rank r whose tokens the tile reads
    WORLD: tl.constexpr,        # WAIT == 2: ranks, rank r's tokens from rank_starts[r] (in token order)
    A_MODE: tl.constexpr,       # 0: A [T, K] gathered by sorted_ids // TOP_K; 1: A [R, K] by sorted_ids; 2: sorted
    C_FLAT: tl.constexpr,       # store row sorted_ids[row] (True) or row (False)
    MUL_WEIGHT: tl.constexpr,   # multiply row by weights[sorted_ids[row]]
    A_TMA: tl.constexpr,        # sorted A read through a tensor descriptor (else pointer loads)
    B_TMA: tl.constexpr,        # 0: pointer loads; 1: descriptor over W [E, K, N]; 2: over K-major W [E, N, K]
    NUM_SMS: tl.constexpr,
    PERSISTENT: tl.constexpr,   # NUM_SMS programs walk the tiles (else one program per tile of the bound)
    FLATTEN: tl.constexpr,      # persistent: flatten the tile and K loops (next tile's loads overlap the epilogue)
    EXPERT_BANDS: tl.constexpr,  # tile order: GROUP_M bands inside each group (else across all M-tiles)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SORT: tl.constexpr = False,  # sort the routing first (moe_routing.sort_chunk's counting sort of the ids at
                                 # sort_ids_ptr into sorted_ids and expert_offs), then multiply: one launch
    SORT_WORLD: tl.constexpr = 1, SORT_BINS: tl.constexpr = 2, SORT_BLOCK: tl.constexpr = 256,
    SORT_SCAN: tl.constexpr = 256,
):
    if SORT:
        # the programs sort the routing's chunks (each chunk independent of the others), count them done, and
        # every program waits until all are: the tiles below read rows that other programs sorted. Only the chunk
        # programs (the grid's first, at most 32) are waited for, and they never wait before counting
        chunks = tl.cdiv(R, SORT_BLOCK)
        for chunk in range(tl.program_id(0), chunks, tl.num_programs(0)):
            sort_chunk(sort_ids_ptr, sort_starts_ptr, sorted_ids_ptr, expert_offs_ptr, sort_scratch_ptr, chunk, R,
                       sort_stride_t, sort_stride_k, B_EXPERTS, E, TOP_K, SORT_WORLD, SORT_BINS, SORT_BLOCK, SORT_SCAN)
            tl.debug_barrier()  # every thread's stores of the chunk precede the count
            tl.atomic_add(sort_sync_ptr, 1, sem="release", scope="gpu")
        while tl.atomic_add(sort_sync_ptr, 0, sem="acquire", scope="gpu") < chunks:
            pass
        tl.debug_barrier()
        # the last program through resets the counts, so the next launch on the stream (which shares them) waits
        if tl.atomic_add(sort_sync_ptr + 1, 1, sem="acq_rel", scope="gpu") == tl.num_programs(0) - 1:
            tl.atomic_xchg(sort_sync_ptr, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(sort_sync_ptr + 1, 0, sem="relaxed", scope="gpu")
    # The group table, once per program: group e owns cdiv(count_e, BLOCK_M) consecutive M-tiles.
    # A rank-stacked routing has one group per (source rank, expert); tiles are walked from
    # group first_group on (the launching rank's own tokens first).
    e_idx = tl.arange(0, E_POW2)
    e_mask = e_idx < E
    starts = tl.load(expert_offs_ptr + e_idx, mask=e_mask, other=0)
    ends = tl.load(expert_offs_ptr + e_idx + 1, mask=e_mask, other=0)
    tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
    tile_end = tl.cumsum(tiles, axis=0)
    num_pid_m = tl.sum(tiles, axis=0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    first_m = tl.sum(tl.where(e_idx < first_group, tiles, 0), axis=0)
    if A_TMA:
        a_desc = tl.make_tensor_descriptor(a_ptr, shape=[R, K], strides=[stride_am, 1], block_shape=[BLOCK_M, BLOCK_K])
    if B_TMA == 1:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[E, K, N], strides=[stride_be, stride_bk, 1],
                                           block_shape=[1, BLOCK_K, BLOCK_N])
    elif B_TMA == 2:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[E, N, K], strides=[stride_be, stride_bn, 1],
                                           block_shape=[1, BLOCK_N, BLOCK_K])
    offs_k = tl.arange(0, BLOCK_K)
    k_tiles = tl.cdiv(K, BLOCK_K)
    # (A spin loop inside the tile loop keeps the compiler from flattening the loop nest.)
    pid = tl.program_id(0)
    num_tiles = num_pid_m * num_pid_n
    stop = num_tiles if PERSISTENT else tl.minimum(pid + 1, num_tiles)
    for tile in tl.range(pid, stop, NUM_SMS if PERSISTENT else 1, flatten=FLATTEN and PERSISTENT and not WAIT):
        if EXPERT_BANDS:
            # group g owns tiles [(tile_end[g] - tiles[g]) * num_pid_n, tile_end[g] * num_pid_n), cut into
            # bands of q or q + 1 M-tiles (q >= GROUP_M unless the group has fewer), N-minor inside a band
            t = (tile + first_m * num_pid_n) % num_tiles
            group = tl.sum((tile_end * num_pid_n <= t).to(tl.int32), axis=0)
            sel = e_idx == group
            g_tiles = tl.sum(tl.where(sel, tiles, 0), axis=0)
            g_first = tl.sum(tl.where(sel, tile_end, 0), axis=0) - g_tiles
            local = t - g_first * num_pid_n
            bands = tl.maximum(g_tiles // GROUP_M, 1)
            q = g_tiles // bands
            tall = g_tiles - q * bands  # the first `tall` bands have q + 1 M-tiles
            tall_tiles = tall * (q + 1) * num_pid_n
            in_tall = local < tall_tiles  # no branch: an if here would keep the loop nest from flattening
            band_size = tl.where(in_tall, q + 1, q)
            rel = tl.where(in_tall, local, local - tall_tiles)
            band_first = tl.where(in_tall, 0, tall * (q + 1)) + (rel // (band_size * num_pid_n)) * band_size
            in_band = rel % (band_size * num_pid_n)
            pid_m = g_first + band_first + in_band % band_size
            pid_n = in_band // band_size
        else:
            group_id = tile // num_pid_in_group
            first_pid_m = group_id * GROUP_M
            group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
            pid_m = (first_pid_m + ((tile % num_pid_in_group) % group_size_m) + first_m) % num_pid_m
            pid_n = (tile % num_pid_in_group) // group_size_m
            group = tl.sum((tile_end <= pid_m).to(tl.int32), axis=0)
        expert = group % B_EXPERTS
        sel = e_idx == group
        first_tile = tl.sum(tl.where(sel, tile_end - tiles, 0), axis=0)
        row_start = tl.sum(tl.where(sel, starts, 0), axis=0) + (pid_m - first_tile) * BLOCK_M
        row_end = tl.sum(tl.where(sel, ends, 0), axis=0)
        # the source ranks' tokens arrive by copy-engine pushes, flagged with the call's epoch
        if WAIT == 2:  # a group's rows are in token order: the tile reads the tokens first..last
            first = tl.load(sorted_ids_ptr + row_start) // TOP_K
            last = tl.load(sorted_ids_ptr + tl.minimum(row_start + BLOCK_M, row_end) - 1) // TOP_K
            for r in tl.static_range(WORLD):
                lo = tl.load(rank_starts_ptr + r)
                if r + 1 < WORLD:
                    hi = tl.load(rank_starts_ptr + r + 1)
                else:
                    hi = R // TOP_K
                if (first < hi) & (last >= lo) & (hi > lo):
                    while tl.atomic_add(flags_ptr + r, 0, sem="acquire", scope="sys") < epoch:
                        pass
        elif WAIT:
            while tl.atomic_add(flags_ptr + group // B_EXPERTS, 0, sem="acquire", scope="sys") < epoch:
                pass

        offs_m = row_start + tl.arange(0, BLOCK_M)
        mask_m = offs_m < row_end
        ids = tl.load(sorted_ids_ptr + offs_m, mask=mask_m, other=0)
        if A_MODE == 0:
            a_rows = ids // TOP_K
        elif A_MODE == 1:
            a_rows = ids
        else:
            a_rows = offs_m
        col = pid_n * BLOCK_N
        offs_n = col + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
        b_ptrs = b_ptr + expert * stride_be + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            k = ki * BLOCK_K
            if A_TMA:  # rows past the expert's end belong to the next one: loaded, never stored
                a = a_desc.load([row_start, k])
            else:
                a = tl.load(a_ptrs + k * stride_ak, mask=mask_m[:, None] & (offs_k[None, :] < K - k), other=0.0)
            if B_TMA == 1:
                b = tl.reshape(b_desc.load([expert, k, col]), (BLOCK_K, BLOCK_N))
            elif B_TMA == 2:
                b = tl.reshape(b_desc.load([expert, col, k]), (BLOCK_N, BLOCK_K)).T
            else:
                b = tl.load(b_ptrs + k * stride_bk, mask=(offs_k[:, None] < K - k) & mask_n[None, :], other=0.0)
            acc = tl.dot(a, b, acc)

        if MUL_WEIGHT:
            w = tl.load(weights_ptr + ids, mask=mask_m, other=0.0).to(tl.float32)
            acc = acc * w[:, None]
        if C_FLAT:
            c_rows = ids
        else:
            c_rows = offs_m
        c = acc.to(c_ptr.dtype.element_ty)
        c_ptrs = c_ptr + c_rows[:, None] * stride_cm + offs_n[None, :] * stride_cn
        tl.store(c_ptrs, c, mask=mask_m[:, None] & mask_n[None, :])


#: The jitted kernel without a tuner (an InterpretedFunction under TRITON_INTERPRET=1).
moe_gemm_jit = triton.jit(_moe_gemm_body, do_not_specialize=["first_group", "epoch"])

#: Tuning key: shapes, expert count, top-k, bucketed total rows, the load/store modes and whether it sorts.
MOE_KEY = ["N", "K", "E", "B_EXPERTS", "TOP_K", "ROWS_BUCKET", "WAIT", "A_MODE", "C_FLAT", "MUL_WEIGHT", "A_TMA",
           "B_TMA", "SORT"]


def make_moe_kernel(configs: Optional[Sequence[triton.Config]] = None, do_bench: Optional[Callable] = None,
                    **autotune_kwargs):
    """A NEW Autotuner over ``moe_gemm_jit`` (own cache), key :data:`MOE_KEY`, prune
    :func:`prune_moe_configs`. ``configs`` defaults to :func:`default_moe_configs`;
    ``do_bench`` to the driver's on a GPU and :func:`host_clock_bench` under the interpreter."""
    return make_autotuner(moe_gemm_jit, default_moe_configs() if configs is None else configs, MOE_KEY,
                          prune_moe_configs, "make_moe_kernel", do_bench, **autotune_kwargs)


#: The default autotuned grouped GEMM (default_moe_configs(), key MOE_KEY).
moe_gemm_kernel = make_moe_kernel()


# --------------------------------------------------------------------------- host side


def _span(shape: Sequence[int], stride: Sequence[int]) -> int:
    """Elements between a tensor's first and last element (0 when empty)."""
    return sum((n - 1) * abs(st) for n, st in zip(shape, stride) if n > 0)


def prepare_launch(a, w, routing, a_order, out, out_order, weights, where, wait=None, tile_order="expert_bands"):
    """Validate a grouped-GEMM call; returns (out, kernel args up to TOP_K, strides, constexpr kwargs).

    ``wait``: ``(flags, epoch)`` for a routing of several ranks' tokens (rank-stacked or gathered) still arriving.
    The host launchers always run the persistent, flattened tile loop (``PERSISTENT=FLATTEN=True``).
    The checks and the constexprs depend only on the call's layout (shapes, strides, dtypes, devices,
    alignment, modes), so they run once per layout and are kept (up to 256 layouts); a call with a
    known layout costs a few µs of Python (its layout key, ``out``'s aliasing check, the arguments)."""
    key = _layout_key(a, w, routing, a_order, out, out_order, weights, wait, tile_order)
    meta = _checked_layouts.get(key)
    if meta is None:
        meta = _check_layout(a, w, routing, a_order, out, out_order, weights, where, wait, tile_order)
        _checked_layouts.add(key, meta)
    elif (out is not None and out.numel() and a.numel()
          and out.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()):
        raise ValueError(f"{where}: out shares storage with a; in-place grouped GEMM is not supported")
    R = routing.num_rows
    if weights is not None:
        weights = weights.contiguous()
    if out is None:
        out = empty_buffer((R, w.shape[2]), a.dtype, a.device)
    rank_starts = token_starts(routing.rank_tokens, a.device) if meta["WAIT"] == 2 else routing.expert_offs
    args = (a, w, out, weights if weights is not None else a, routing.sorted_ids, routing.expert_offs,
            routing.expert_offs if wait is None else wait[0], rank_starts, R, w.shape[2], w.shape[1],
            routing.groups, w.shape[0], routing.top_k)
    strides = (*a.stride(), *w.stride(), *out.stride())
    if (meta["A_TMA"] or meta["B_TMA"]) and a.device.type == "cuda":
        ensure_descriptor_allocator()
    return out, args, strides, dict(meta)


_checked_layouts = PassedChecks()


def _layout_key(a, w, routing, a_order, out, out_order, weights, wait, tile_order) -> Optional[tuple]:
    """Everything :func:`_check_layout` reads, as a dictionary key; None where an argument is not what it
    should be (the full check then says what is wrong)."""
    if not (isinstance(a, torch.Tensor) and isinstance(w, torch.Tensor) and isinstance(routing, MoeRouting)
            and (out is None or isinstance(out, torch.Tensor))
            and (weights is None or isinstance(weights, torch.Tensor))):
        return None
    return (a_order, out_order, tile_order, wait is None, tensor_layout(a), tensor_layout(w), tensor_layout(out),
            None if weights is None else (weights.dtype, weights.shape, weights.device),
            routing.sorted_ids.device, routing.num_experts, routing.num_tokens, routing.top_k, routing.rank_tokens,
            routing.by_rank)


def _check_layout(a, w, routing, a_order, out, out_order, weights, where, wait, tile_order) -> dict:
    """Every check of a grouped-GEMM call's layout (raising what is wrong); returns the constexpr kwargs."""
    a_mode = _A_MODE.get(a_order)
    if a_mode is None:
        raise ValueError(f"{where}: a_order must be one of {A_ORDERS}, got {a_order!r}")
    if out_order not in OUT_ORDERS:
        raise ValueError(f"{where}: out_order must be one of {OUT_ORDERS}, got {out_order!r}")
    if tile_order not in TILE_ORDERS:
        raise ValueError(f"{where}: tile_order must be one of {TILE_ORDERS}, got {tile_order!r}")
    check_float_tensor(where, "a", a)
    check_float_tensor(where, "w", w)
    a_shape, w_shape = a.shape, w.shape
    if len(a_shape) != 2:
        raise ValueError(f"{where}: a must be 2-D, got shape {tuple(a_shape)}")
    if len(w_shape) != 3:
        raise ValueError(f"{where}: w must be 3-D [E, K, N], got shape {tuple(w_shape)}")
    dtype = a.dtype
    if w.dtype != dtype:
        raise TypeError(f"{where}: a and w must have the same dtype, got {dtype} and {w.dtype}")
    if dtype == torch.bfloat16 and INTERPRETED:
        raise TypeError(f"{where}: bf16 is not supported under TRITON_INTERPRET=1. " + BF16_INTERPRETER_NOTE)
    check_routing(where, routing, a.device)
    check_device(where, a, w=w, out=out, weights=weights)
    E, K, N = w_shape
    if E != routing.num_experts:
        raise ValueError(f"{where}: w has {E} experts but the routing was built for {routing.num_experts}")
    if a_shape[1] != K:
        raise ValueError(f"{where}: a has {a_shape[1]} columns but w is [E, K={K}, N={N}]")
    R, T = routing.num_rows, routing.num_tokens
    want_rows = T if a_mode == 0 else R
    if a_shape[0] != want_rows:
        raise ValueError(f"{where}: a_order={a_order!r} needs a with {want_rows} rows "
                         f"({'tokens' if a_order == 'token' else 'tokens * top_k'}), got {a_shape[0]}")
    if weights is not None:
        if not isinstance(weights, torch.Tensor) or not weights.is_floating_point():
            raise TypeError(f"{where}: weights must be a floating-point tensor [tokens, top_k]")
        if tuple(weights.shape) != (T, routing.top_k):
            raise ValueError(f"{where}: weights must have shape {(T, routing.top_k)}, got {tuple(weights.shape)}")
    if out is None:
        out_stride: Sequence[int] = (N, 1)  # what empty_buffer gives
    else:
        check_float_tensor(where, "out", out)
        if tuple(out.shape) != (R, N):
            raise ValueError(f"{where}: out has shape {tuple(out.shape)}, expected {(R, N)}")
        if out.numel() and a.numel() and out.untyped_storage().data_ptr() == a.untyped_storage().data_ptr():
            raise ValueError(f"{where}: out shares storage with a; in-place grouped GEMM is not supported")
        out_stride = out.stride()
    a_stride, w_stride = a.stride(), w.stride()
    for name, shape, stride in (("a", a_shape, a_stride), ("w", w_shape, w_stride), ("out", (R, N), out_stride)):
        if _span(shape, stride) > _INT32_MAX:
            raise ValueError(f"{where}: {name} spans more than 2**31-1 elements; the kernel uses 32-bit offsets")
    if wait is not None and not routing.rank_tokens:
        raise ValueError(f"{where}: waiting on arrival flags needs a routing of several ranks' tokens "
                         "(moe_align_stacked or moe_align_gathered)")
    elem = a.element_size()
    a_tma = a_mode == 2 and _descriptor_ready(a, a_stride, 1, elem)
    b_tma = _weight_layout(w, w_stride, elem)
    # waiting per group (rank-stacked: one source rank each) or per tile (expert groups: the ranks it reads)
    waits = False if wait is None else True if routing.by_rank else 2
    return dict(E_POW2=max(2, next_power_of_2(routing.groups)), WAIT=waits,
                WORLD=len(routing.rank_tokens) if waits == 2 else 1, A_MODE=a_mode,
                C_FLAT=out_order == "flat", MUL_WEIGHT=weights is not None, A_TMA=a_tma, B_TMA=b_tma,
                NUM_SMS=num_sms(a.device), PERSISTENT=True, FLATTEN=True,
                EXPERT_BANDS=tile_order == "expert_bands", SORT=False)


def _descriptor_ready(t: torch.Tensor, stride: Sequence[int], inner: int, elem: int) -> bool:
    """Whether ``t`` (strides ``stride``, ``elem`` bytes per element) can be read through a tensor
    descriptor with dimension ``inner`` innermost (unit stride there, every other stride and the
    start 16-byte aligned)."""
    return (stride[inner] == 1 and t.data_ptr() % 16 == 0
            and all((st * elem) % 16 == 0 for d, st in enumerate(stride) if d != inner))


def _weight_layout(w: torch.Tensor, stride: Sequence[int], elem: int) -> int:
    """The kernel's ``B_TMA``: 1 for a descriptor-ready row-major ``[E, K, N]``, 2 for the transpose
    of a descriptor-ready ``[E, N, K]`` (``torch._grouped_mm``'s favourite), 0 (pointer loads) otherwise."""
    if _descriptor_ready(w, stride, 2, elem):
        return 1
    if _descriptor_ready(w, stride, 1, elem):
        return 2
    return 0


def _grid(R: int, N: int, routing: MoeRouting, sms: int):
    """Programs: the tile bound (M-tiles bounded on the host by ``cdiv(R, BLOCK_M) + min(E, R)``, no host
    sync; the kernel counts the real tiles itself), at most ``sms`` of them when persistent."""
    E = routing.groups

    def grid(META):
        bound = (cdiv(R, META["BLOCK_M"]) + min(E, R)) * cdiv(N, META["BLOCK_N"])
        return (max(1, min(sms, bound) if META["PERSISTENT"] else bound),)

    return grid


def moe_gemm(a: torch.Tensor, w: torch.Tensor, routing: MoeRouting, *, a_order: str = "token",
             out: Optional[torch.Tensor] = None, out_order: str = "sorted",
             weights: Optional[torch.Tensor] = None, kernel=None,
             rows_bucket: Optional[int] = None,
             bucket: Callable[[int], int] = next_power_of_2,
             wait: Optional[tuple[torch.Tensor, int]] = None, first_group: int = 0,
             tile_order: str = "expert_bands") -> torch.Tensor:
    """Grouped GEMM over all experts with the autotuned kernel (``kernel`` or ``moe_gemm_kernel``).

    ``out[row] = A[a_row(row)] @ w[expert(row)]`` (``* weights[t, j]`` if given), for the
    ``R = T * top_k`` rows of ``routing``; see the module doc for ``a_order``/``out_order``.
    ``out`` is ``[R, N]``, fp32-accumulated, in ``out``'s dtype (default a's). Cost:
    ``2 * R * K * N`` flops plus one tile's padding per non-empty expert.

    Tuning key row count: ``rows_bucket`` if given (use the *global* total in multi-rank code
    so every rank keys the same), else ``bucket(R)`` (next power of two).

    For a rank-stacked routing (:func:`moe_align_stacked`, used by :func:`ag_moe`): tiles are
    walked from group ``first_group`` on (``rank * E`` walks the launching rank's own tokens first), and
    with ``wait=(flags, epoch)`` a tile of source rank ``r`` spins until ``flags[r] >= epoch`` before
    reading A (tokens pushed by ``kernels.symm.ShardPusher``; every flag must reach ``epoch`` or the
    kernel never ends). For a gathered routing (:func:`moe_align_gathered`) a tile spins on the flag of
    every rank whose tokens it reads, and ``first_group`` is ignored (its groups are experts over every
    rank: the walk starts at the first), so callers pass ``rank * E`` for either routing.

    ``tile_order`` (one of :data:`TILE_ORDERS`) chooses the order in which programs walk the tiles.
    """
    return _launch(a, w, routing, a_order, out, out_order, weights, kernel, rows_bucket, bucket, wait, first_group,
                   tile_order, None, "moe_gemm")


def moe_gemm_sorting(a: torch.Tensor, w: torch.Tensor, topk_ids: torch.Tensor, rank_tokens: Sequence[int] = (), *,
                     by_rank: bool = True, a_order: str = "token", out: Optional[torch.Tensor] = None,
                     out_order: str = "sorted", weights: Optional[torch.Tensor] = None, kernel=None,
                     rows_bucket: Optional[int] = None, bucket: Callable[[int], int] = next_power_of_2,
                     wait: Optional[tuple[torch.Tensor, int]] = None, first_group: int = 0,
                     tile_order: str = "expert_bands") -> tuple[torch.Tensor, MoeRouting]:
    """Sort the routing of ``topk_ids [T, top_k]`` by expert and run :func:`moe_gemm` over it, in one launch:
    returns ``(out, routing)``, what :func:`moe_align` (no range check), or with ``rank_tokens``
    :func:`moe_align_stacked` (``by_rank``) or :func:`moe_align_gathered`, followed by :func:`moe_gemm` give.

    The grouped GEMM's programs first run the routing's counting sort (``moe_routing.sort_chunk``, chunk by
    chunk, as :func:`~.moe_routing.group_sort` does) and wait for every chunk before their tiles: one launch
    where the two steps take two, which is what an eager host-bound step saves (a Triton launch costs the host
    tens of µs). Under the interpreter one program sorts and multiplies. Where the sort kernel cannot run (more
    than ``MAX_GROUPS`` groups, no rows, ``K`` or ``N`` zero) the two steps run. Same results, bit for bit, as
    the two steps with the same config. ``topk_ids`` are not range-checked (in one launch, rows with ids
    outside ``[0, E)`` go after every group and are not computed; the two steps' torch sort may file them
    under another group): check them first where they may be wrong. ``a_order="sorted"`` is refused (A cannot
    be in an order that the launch computes). Cost: besides the GEMM, one allocation for the routing and, in
    the launch, the sort's chunks in the first programs (every program waits for the last chunk).

    Fused only for up to 32 chunks (131,072 rows): the chunk programs, the grid's first, then need no more
    SMs than a GPU shared with other work still offers."""
    where = "moe_gemm_sorting"
    if a_order == "sorted":
        raise ValueError(f"{where}: a_order='sorted' needs the routing before the launch; sort with moe_align "
                         "(or moe_align_stacked / moe_align_gathered) and call moe_gemm, or pass a in 'token' or "
                         "'flat' order")
    check_float_tensor(where, "w", w)
    if w.dim() != 3:
        raise ValueError(f"{where}: w must be 3-D [E, K, N], got shape {tuple(w.shape)}")
    num_experts = w.shape[0]
    if rank_tokens:
        rank_tokens = check_rank_ids(topk_ids, num_experts, rank_tokens, where)
    else:
        check_topk_ids(topk_ids, num_experts, where, check_range=False)
        rank_tokens = ()
    return sorting_launch(a, w, topk_ids, rank_tokens, by_rank, a_order, out, out_order, weights, kernel, rows_bucket,
                          bucket, wait, first_group, tile_order, where)


def sorting_launch(a, w, topk_ids, rank_tokens: tuple, by_rank, a_order, out, out_order, weights, kernel, rows_bucket,
                   bucket, wait, first_group, tile_order, where: str) -> tuple[torch.Tensor, MoeRouting]:
    """:func:`moe_gemm_sorting` after its own checks, for a caller that made ``topk_ids`` itself (2-D integer ids,
    ``sum(rank_tokens)`` rows, ``rank_tokens`` a tuple of ints or ``()``) and checked ``w`` (a supported float
    dtype, 3-D): ag_moe, whose gathered routing is all of that by construction. Saves the few µs of those checks
    on an eager call that is host-bound."""
    num_experts = w.shape[0]
    groups = num_experts * (len(rank_tokens) if rank_tokens and by_rank else 1)
    T, k = topk_ids.shape
    if not (T and w.shape[1] and w.shape[2] and groups <= MAX_GROUPS and isinstance(a, torch.Tensor)
            and topk_ids.device == a.device and (a.is_cuda or INTERPRETED)
            and sort_chunks(T * k) <= MAX_SORT_CHUNKS):
        routing = moe_align_ranks(topk_ids, num_experts, rank_tokens, by_rank)
        return _launch(a, w, routing, a_order, out, out_order, weights, kernel, rows_bucket, bucket, wait,
                       first_group, tile_order, None, where), routing
    plan = SortPlan.make(topk_ids, num_experts, rank_tokens, by_rank, counted=True)
    routing = MoeRouting(plan.sorted_ids, plan.offs, T, k, num_experts, rank_tokens, by_rank or not rank_tokens)
    return _launch(a, w, routing, a_order, out, out_order, weights, kernel, rows_bucket, bucket, wait, first_group,
                   tile_order, plan, where), routing


#: Rows each program of a sorting launch counts per step of its scan over the ids (fewer than group_sort's own
#: launch: a GEMM config may run 4 warps).
SORT_SCAN_ROWS = 4096
#: The most sort chunks a launch runs in its GEMM's programs (more rows: the sort and the GEMM launch apart).
MAX_SORT_CHUNKS = 32


def _launch(a, w, routing, a_order, out, out_order, weights, kernel, rows_bucket, bucket, wait, first_group,
            tile_order, plan: Optional[SortPlan], where: str) -> torch.Tensor:
    """:func:`moe_gemm`'s launch; with ``plan`` the programs sort the routing first (:func:`moe_gemm_sorting`)."""
    out, args, strides, meta = prepare_launch(a, w, routing, a_order, out, out_order, weights, where, wait,
                                              tile_order)
    R, N = out.shape
    if R == 0 or N == 0:
        return out
    if a.shape[1] == 0:
        return out.zero_()
    rb = int(rows_bucket) if rows_bucket is not None else int(bucket(R))
    kern = kernel if kernel is not None else moe_gemm_kernel
    first_group = first_group if routing.by_rank else 0
    if plan is not None:
        meta.update(SORT=True, SORT_WORLD=plan.world, SORT_BINS=plan.bins, SORT_BLOCK=plan.block,
                    SORT_SCAN=SORT_SCAN_ROWS)
        if INTERPRETED:  # programs run one after another there: one program sorts every chunk, then multiplies
            meta["NUM_SMS"] = 1
    cached_launch.launch(kern, _grid(R, N, routing, meta["NUM_SMS"]),
                         (*args, rb, first_group, 0 if wait is None else wait[1], *strides,
                          *_sort_args(routing, plan)), meta)
    return out


def _sort_args(routing: MoeRouting, plan: Optional[SortPlan]) -> tuple:
    """The kernel's sort arguments: the plan's ids, token starts, scratch, counts and id strides, or
    placeholders where the launch does not sort."""
    if plan is None:
        offs = routing.expert_offs
        return routing.sorted_ids, offs, offs, offs, 0, 0
    return plan.ids, plan.starts, plan.scratch, plan.sync, plan.ids.stride(0), plan.ids.stride(1)


def moe_gemm_with_config(a: torch.Tensor, w: torch.Tensor, routing: MoeRouting, config: triton.Config, *,
                         a_order: str = "token", out: Optional[torch.Tensor] = None, out_order: str = "sorted",
                         weights: Optional[torch.Tensor] = None, tile_order: str = "expert_bands") -> torch.Tensor:
    """:func:`moe_gemm` launching ``moe_gemm_jit`` directly with one config (no tuner)."""
    out, args, strides, meta = prepare_launch(a, w, routing, a_order, out, out_order, weights, "moe_gemm_with_config",
                                              tile_order=tile_order)
    check_config("moe_gemm_with_config", config, a.dtype)
    R, N = out.shape
    if R == 0 or N == 0:
        return out
    if a.shape[1] == 0:
        return out.zero_()
    kw = config.kwargs
    grid = _grid(R, N, routing, meta["NUM_SMS"])({**kw, **meta})
    moe_gemm_jit[grid](*args, next_power_of_2(R), 0, 0, *strides, *_sort_args(routing, None), **meta, **kw,
                       num_warps=config.num_warps, num_stages=config.num_stages)
    return out
