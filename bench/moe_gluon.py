"""Does a hand-written Hopper pipeline beat Triton's on the 8-expert grouped GEMM? Two Gluon kernels, one GPU.

    python bench/moe_gluon.py            # needs a Hopper GPU (compute capability 9.x)

Issue 4 asks the grouped GEMM to be at least as fast as ``torch._grouped_mm`` on
``T=4096, E=8, top-2, H=4096, I=7168``. ``kernels/moe.py``'s ``tl`` kernel, whose main loop
Triton's compiler pipelines, is 0.87-1.05x of it there with row-major weights, timed alone
(below 1 on the faster machines). This benchmark asks whether the pipeline is the reason, with
the same grouped GEMM written in Gluon (Triton's explicit-layout dialect), where every part of the
pipeline is spelled out:

* ``pipelined``: persistent programs, ``NUM_BUFFERS`` shared-memory slots filled by TMA loads
  ``NUM_BUFFERS - 1`` K-steps ahead, one asynchronous warpgroup MMA in flight while the next
  is issued, an mbarrier per slot; the next tile's first loads are issued before the previous
  tile's epilogue. ``TMA_STORE`` writes full tiles with an asynchronous TMA store.
* ``warp-specialized``: the same loop split CUTLASS's "cooperative" way: one producer warp
  issues the TMA loads (40 registers), the MMA warpgroups consume slots and release each one
  through an "empty" mbarrier once the MMA that read it is done.

Both map tiles to experts exactly as ``_moe_gemm_body`` (expert table per program, grouped
order), take sorted A (``a_order="sorted"``) and W ``[E, K, N]`` row-major or K-major, and
apply the routing weight and the flat output order in the epilogue. Every variant is first
checked against an fp32 per-expert reference (uneven experts, empty experts, ragged N and K);
a wrong result stops the run before any timing.

Timed per call with ``triton.testing.do_bench`` (mean, L2 flushed before each call) and back to
back (10 calls, best of 5 bursts), beside ``torch._grouped_mm`` and the ``tl`` kernel in the
same process. Prints a markdown table and appends JSON lines to ``$OUT/moe_gluon.jsonl`` (or
``bench/results/moe_gluon-<gpu>-<date>.jsonl``). The result on six H200s
(``docs/gpu-runs/2026-11-23d-h200x1.md``): the best Gluon variant runs at 0.91-1.02x of the ``tl``
kernel. CUTLASS's kernel has 128x256x64 tiles like ours, but in 2-CTA clusters that multicast the
weight tile, which Triton 3.6 cannot emit on Hopper. It is faster with row-major weights and
slower with K-major ones. The kernels here are a measurement, not shipped: ``kernels/moe.py`` keeps
the ``tl`` kernel, which runs everywhere (also on CPUs).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)


def gluon_config(block_m: int, block_n: int, block_k: int, group_m: int, buffers: int, warps: int) -> triton.Config:
    """One point of the Gluon kernels' space (the pipeline depth is ``NUM_BUFFERS``, not ``num_stages``)."""
    return triton.Config({"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_M": group_m,
                          "NUM_BUFFERS": buffers}, num_warps=warps, num_stages=1)


# --------------------------------------------------------------------------- layouts


@gluon.constexpr_function
def _mma_layout(BLOCK_M, BLOCK_N, num_warps):
    """The wgmma accumulator layout: warps stacked along M while M has rows for them, the widest
    instruction N (<= 256) that divides BLOCK_N."""
    warps = [4, 1]
    while warps[0] * warps[1] != num_warps:
        if BLOCK_M > 16 * warps[0]:
            warps[0] *= 2
        else:
            warps[1] *= 2
    m_reps = (BLOCK_M + 15) // 16
    n_reps = (num_warps + m_reps - 1) // m_reps
    max_n = max(BLOCK_N // n_reps, 8)
    n = 256
    while n > max_n or BLOCK_N % n != 0:
        n -= 8
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=warps, instr_shape=[16, n, 16])


@gluon.constexpr_function
def _store_layout(BLOCK_N, num_warps):
    """16-byte vectors along N, a warp's lanes across a row first: coalesced epilogue stores."""
    lanes_n = min(32, max(1, BLOCK_N // 8))
    return gl.BlockedLayout([1, 8], [32 // lanes_n, lanes_n], [num_warps, 1], [1, 0])


@gluon.constexpr_function
def _table_layout(num_warps):
    return gl.BlockedLayout([1], [32], [num_warps], [0])



# --------------------------------------------------------------------------- kernels


@gluon.jit
def _add(x, y):
    """The combine function of sums and prefix sums (``gl.sum`` wraps a ``tl`` function, which
    breaks compiling in a process that has TRITON_INTERPRET=1 set, as the CPU tests do)."""
    return x + y


@gluon.jit
def _expert_table(expert_offs_ptr, E, first_group, N, K, E_POW2: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr):
    """The group table, once per program (as ``_moe_gemm_body``): group e owns cdiv(count_e, BLOCK_M)
    consecutive M-tiles; also the tile counts and K-steps per tile."""
    table: gl.constexpr = _table_layout(gl.num_warps())
    e_idx = gl.arange(0, E_POW2, layout=table)
    e_mask = e_idx < E
    starts = gl.load(expert_offs_ptr + e_idx, mask=e_mask, other=0)
    ends = gl.load(expert_offs_ptr + e_idx + 1, mask=e_mask, other=0)
    tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
    tile_end = gl.associative_scan(tiles, 0, _add)
    num_pid_m = gl.reduce(tiles, 0, _add)
    num_pid_in_group = GROUP_M * gl.cdiv(N, BLOCK_N)
    first_m = gl.reduce(gl.where(e_idx < first_group, tiles, 0), 0, _add)
    num_tiles = num_pid_m * gl.cdiv(N, BLOCK_N)
    return e_idx, starts, ends, tiles, tile_end, num_pid_m, num_pid_in_group, first_m, num_tiles, gl.cdiv(K, BLOCK_K)


@gluon.jit
def _load_k_step(producer, a_desc, b_desc, row, b_row, col, k, bars, a_bufs, b_bufs,
                 B_KMAJOR: gl.constexpr, NUM_BUFFERS: gl.constexpr, pred):
    """TMA loads of one K-step into the next slot (if ``pred``); the slot's barrier counts the bytes."""
    slot = producer % NUM_BUFFERS
    bar = bars.index(slot)
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(a_desc, [row, k], bar, a_bufs.index(slot), pred)
    if B_KMAJOR:
        tma.async_copy_global_to_shared(b_desc, [b_row, k], bar, b_bufs.index(slot), pred)
    else:
        tma.async_copy_global_to_shared(b_desc, [b_row + k, col], bar, b_bufs.index(slot), pred)
    return producer + pred.to(gl.int32)


@gluon.jit
def _tile_coords(tile, num_pid_m, num_pid_in_group, first_m, tile_end, tiles, starts, ends, e_idx, N, K,
                 B_EXPERTS, B_KMAJOR: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 GROUP_M: gl.constexpr):
    """Tile -> (first row, end of its expert's rows, W row of its first K-step, first column), in the
    grouped order of kernels/moe.py's ``_moe_gemm_body``; the own rank's groups first (``first_m``)."""
    group_id = tile // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = gl.maximum(gl.minimum(num_pid_m - first_pid_m, GROUP_M), 1)
    pid_m = (first_pid_m + ((tile % num_pid_in_group) % group_size_m) + first_m) % gl.maximum(num_pid_m, 1)
    pid_n = (tile % num_pid_in_group) // group_size_m
    group = gl.reduce((tile_end <= pid_m).to(gl.int32), 0, _add)
    expert = group % B_EXPERTS
    sel = e_idx == group
    first_tile = gl.reduce(gl.where(sel, tile_end - tiles, 0), 0, _add)
    row_start = gl.reduce(gl.where(sel, starts, 0), 0, _add) + (pid_m - first_tile) * BLOCK_M
    row_end = gl.reduce(gl.where(sel, ends, 0), 0, _add)
    col = pid_n * BLOCK_N
    if B_KMAJOR:
        b_row = expert * N + col
    else:
        b_row = expert * K
    return row_start, row_end, b_row, col


@gluon.jit
def _operands(a_ptr, b_ptr, R, N, K, B_EXPERTS, stride_am, stride_bk, stride_bn, B_KMAJOR: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, NUM_BUFFERS: gl.constexpr):
    """TMA descriptors of sorted A ``[R, K]`` and of W as 2-D (``[E * N, K]`` K-major, else ``[E * K, N]``),
    and ``NUM_BUFFERS`` shared-memory slots for each."""
    dtype: gl.constexpr = a_ptr.dtype.element_ty
    a_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_K], dtype)
    a_desc = tma.make_tensor_descriptor(a_ptr, shape=[R, K], strides=[stride_am, 1],
                                        block_shape=[BLOCK_M, BLOCK_K], layout=a_smem)
    if B_KMAJOR:  # [E * N, K]: a tile past N reads the next expert's rows, never stored
        b_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], dtype)
        b_desc = tma.make_tensor_descriptor(b_ptr, shape=[B_EXPERTS * N, K], strides=[stride_bn, 1],
                                            block_shape=[BLOCK_N, BLOCK_K], layout=b_smem)
        b_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS, BLOCK_N, BLOCK_K], b_smem)
    else:  # [E * K, N]: K % BLOCK_K == 0 keeps every K-step inside one expert
        b_smem: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_K, BLOCK_N], dtype)
        b_desc = tma.make_tensor_descriptor(b_ptr, shape=[B_EXPERTS * K, N], strides=[stride_bk, 1],
                                            block_shape=[BLOCK_K, BLOCK_N], layout=b_smem)
        b_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS, BLOCK_K, BLOCK_N], b_smem)
    a_bufs = gl.allocate_shared_memory(dtype, [NUM_BUFFERS, BLOCK_M, BLOCK_K], a_smem)
    return a_desc, b_desc, a_bufs, b_bufs


@gluon.jit
def _mma_step(acc, count, ready, a_bufs, b_bufs, B_KMAJOR: gl.constexpr, NUM_BUFFERS: gl.constexpr):
    """K-step ``count``: wait for its slot to fill, issue its warpgroup MMA asynchronously, and wait
    until at most that one is in flight (the previous K-step's MMA is done)."""
    slot = count % NUM_BUFFERS
    mbarrier.wait(ready.index(slot), (count // NUM_BUFFERS) & 1)
    if B_KMAJOR:
        b = b_bufs.index(slot).permute((1, 0))
    else:
        b = b_bufs.index(slot)
    acc = warpgroup_mma(a_bufs.index(slot), b, acc, is_async=True)
    return warpgroup_mma_wait(1, deps=(acc,))


@gluon.jit
def _times_weight(acc, weights_ptr, sorted_ids_ptr, row_start, row_end, layout: gl.constexpr, BLOCK_M: gl.constexpr):
    """Each row of the fp32 tile times its routing weight ``weights[sorted_ids[row]]``."""
    rows = row_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    ids = gl.load(sorted_ids_ptr + rows, mask=rows < row_end, other=0)
    w = gl.load(weights_ptr + ids, mask=rows < row_end, other=0.0).to(gl.float32)
    return acc * gl.expand_dims(w, 1)


@gluon.jit
def _store_tile(c, c_ptr, sorted_ids_ptr, row_start, row_end, col, N, stride_cm, stride_cn, C_FLAT: gl.constexpr,
                layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Masked store of one tile (in ``layout``): rows past the expert's end belong to the next one."""
    rows = row_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    row_ok = rows < row_end
    if C_FLAT:
        rows = gl.load(sorted_ids_ptr + rows, mask=row_ok, other=0)
    cols = col + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    ptrs = c_ptr + gl.expand_dims(rows * stride_cm, 1) + gl.expand_dims(cols * stride_cn, 0)
    gl.store(ptrs, c, mask=gl.expand_dims(row_ok, 1) & gl.expand_dims(cols < N, 0))


def pipelined_body(
    a_ptr, b_ptr, c_ptr, weights_ptr, sorted_ids_ptr, expert_offs_ptr,
    R, N, K, E, B_EXPERTS, first_group,
    stride_am, stride_be, stride_bk, stride_bn, stride_cm, stride_cn,
    E_POW2: gl.constexpr,      # groups rounded up; group g multiplies W[g % B_EXPERTS]
    C_FLAT: gl.constexpr,      # store row sorted_ids[row] (True) or row (False)
    MUL_WEIGHT: gl.constexpr,  # multiply row by weights[sorted_ids[row]]
    B_KMAJOR: gl.constexpr,    # W is the transpose of a contiguous [E, N, K] (else row-major [E, K, N])
    NUM_SMS: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
    GROUP_M: gl.constexpr, NUM_BUFFERS: gl.constexpr,
    TMA_STORE: gl.constexpr,   # full tiles of sorted C by an asynchronous TMA store (else every tile as below)
):
    num_warps: gl.constexpr = gl.num_warps()
    dtype: gl.constexpr = a_ptr.dtype.element_ty
    mma_layout: gl.constexpr = _mma_layout(BLOCK_M, BLOCK_N, num_warps)
    store_layout: gl.constexpr = _store_layout(BLOCK_N, num_warps)

    e_idx, starts, ends, tiles, tile_end, num_pid_m, num_pid_in_group, first_m, num_tiles, k_tiles = _expert_table(
        expert_offs_ptr, E, first_group, N, K, E_POW2, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)

    a_desc, b_desc, a_bufs, b_bufs = _operands(a_ptr, b_ptr, R, N, K, B_EXPERTS, stride_am, stride_bk, stride_bn,
                                               B_KMAJOR, BLOCK_M, BLOCK_N, BLOCK_K, NUM_BUFFERS)
    if TMA_STORE:
        c_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype)
        c_desc = tma.make_tensor_descriptor(c_ptr, shape=[R, N], strides=[stride_cm, 1],
                                            block_shape=[BLOCK_M, BLOCK_N], layout=c_smem_layout)
        c_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, BLOCK_N], c_smem_layout)
    bars = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.init(bars.index(i), count=1)
    # K-steps loaded and consumed so far by this program: slot = count % NUM_BUFFERS, and the
    # slot's barrier phase flips each time it fills.
    producer = 0
    consumer = 0

    # The first tile's first K-steps; every later tile's are issued before the previous tile's
    # epilogue, so its loads are in flight while the previous tile is stored.
    tile = gl.program_id(0)
    row_start, row_end, b_row, col = _tile_coords(tile, num_pid_m, num_pid_in_group, first_m, tile_end, tiles,
                                                  starts, ends, e_idx, N, K, B_EXPERTS, B_KMAJOR, BLOCK_M,
                                                  BLOCK_N, GROUP_M)
    for i in gl.static_range(NUM_BUFFERS - 1):
        producer = _load_k_step(producer, a_desc, b_desc, row_start, b_row, col, i * BLOCK_K, bars, a_bufs,
                                b_bufs, B_KMAJOR, NUM_BUFFERS, (i < k_tiles) & (tile < num_tiles))

    while tile < num_tiles:
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_layout)
        for ki in range(k_tiles):
            # One MMA stays in flight; the one before it is done, so its slot can be refilled.
            acc = _mma_step(acc, consumer, bars, a_bufs, b_bufs, B_KMAJOR, NUM_BUFFERS)
            consumer += 1
            nxt = ki + NUM_BUFFERS - 1
            producer = _load_k_step(producer, a_desc, b_desc, row_start, b_row, col, nxt * BLOCK_K, bars, a_bufs,
                                    b_bufs, B_KMAJOR, NUM_BUFFERS, nxt < k_tiles)
        acc = warpgroup_mma_wait(0, deps=(acc,))

        out_start = row_start
        out_end = row_end
        out_col = col
        tile += NUM_SMS
        row_start, row_end, b_row, col = _tile_coords(tile, num_pid_m, num_pid_in_group, first_m, tile_end, tiles,
                                                      starts, ends, e_idx, N, K, B_EXPERTS, B_KMAJOR, BLOCK_M,
                                                      BLOCK_N, GROUP_M)
        for i in gl.static_range(NUM_BUFFERS - 1):
            producer = _load_k_step(producer, a_desc, b_desc, row_start, b_row, col, i * BLOCK_K, bars, a_bufs,
                                    b_bufs, B_KMAJOR, NUM_BUFFERS, (i < k_tiles) & (tile < num_tiles))

        if MUL_WEIGHT:
            acc = _times_weight(acc, weights_ptr, sorted_ids_ptr, out_start, out_end, mma_layout, BLOCK_M)
        c = acc.to(dtype)
        if not TMA_STORE:  # through shared memory into 16-byte row vectors, masked
            _store_tile(gl.convert_layout(c, store_layout), c_ptr, sorted_ids_ptr, out_start, out_end, out_col, N,
                        stride_cm, stride_cn, C_FLAT, store_layout, BLOCK_M, BLOCK_N)
        else:
            tma.store_wait(pendings=0)  # the previous tile's store has read c_smem
            c_smem.store(c)
            if out_end - out_start >= BLOCK_M:  # the whole tile is this expert's: one asynchronous TMA store
                fence_async_shared()
                tma.async_copy_shared_to_global(c_desc, [out_start, out_col], c_smem)
            else:
                gl.thread_barrier()
                _store_tile(c_smem.load(store_layout), c_ptr, sorted_ids_ptr, out_start, out_end, out_col, N,
                            stride_cm, stride_cn, C_FLAT, store_layout, BLOCK_M, BLOCK_N)
                gl.thread_barrier()  # everyone has read c_smem before the next tile writes it

    if TMA_STORE:
        tma.store_wait(pendings=0)
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.invalidate(bars.index(i))




@gluon.jit
def _ws_loader(a_desc, b_desc, a_bufs, b_bufs, ready, empty, expert_offs_ptr, E, first_group, N, K, B_EXPERTS,
               E_POW2: gl.constexpr, B_KMAJOR: gl.constexpr, NUM_SMS: gl.constexpr, BLOCK_M: gl.constexpr,
               BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, NUM_BUFFERS: gl.constexpr):
    """Producer warp: TMA loads of every K-step of this program's tiles into free slots."""
    e_idx, starts, ends, tiles, tile_end, num_pid_m, num_pid_in_group, first_m, num_tiles, k_tiles = _expert_table(
        expert_offs_ptr, E, first_group, N, K, E_POW2, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    count = 0
    for tile in range(gl.program_id(0), num_tiles, NUM_SMS):
        row_start, row_end, b_row, col = _tile_coords(tile, num_pid_m, num_pid_in_group, first_m, tile_end, tiles,
                                                      starts, ends, e_idx, N, K, B_EXPERTS, B_KMAJOR, BLOCK_M,
                                                      BLOCK_N, GROUP_M)
        for ki in range(k_tiles):
            slot = count % NUM_BUFFERS
            # A slot's first fill waits on parity 1 of a fresh barrier, which passes at once.
            mbarrier.wait(empty.index(slot), ((count // NUM_BUFFERS) & 1) ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            k = ki * BLOCK_K
            tma.async_copy_global_to_shared(a_desc, [row_start, k], bar, a_bufs.index(slot))
            if B_KMAJOR:
                tma.async_copy_global_to_shared(b_desc, [b_row, k], bar, b_bufs.index(slot))
            else:
                tma.async_copy_global_to_shared(b_desc, [b_row + k, col], bar, b_bufs.index(slot))
            count += 1


@gluon.jit
def _ws_compute(a_bufs, b_bufs, ready, empty, c_ptr, weights_ptr, sorted_ids_ptr, expert_offs_ptr, E, first_group,
                N, K, B_EXPERTS, stride_cm, stride_cn,
                E_POW2: gl.constexpr, C_FLAT: gl.constexpr, MUL_WEIGHT: gl.constexpr, B_KMAJOR: gl.constexpr,
                NUM_SMS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                GROUP_M: gl.constexpr, NUM_BUFFERS: gl.constexpr):
    """Default partition: the MMAs of every tile, each slot released once its MMA is done, then the epilogue."""
    num_warps: gl.constexpr = gl.num_warps()
    dtype: gl.constexpr = c_ptr.dtype.element_ty
    mma_layout: gl.constexpr = _mma_layout(BLOCK_M, BLOCK_N, num_warps)
    store_layout: gl.constexpr = _store_layout(BLOCK_N, num_warps)
    e_idx, starts, ends, tiles, tile_end, num_pid_m, num_pid_in_group, first_m, num_tiles, k_tiles = _expert_table(
        expert_offs_ptr, E, first_group, N, K, E_POW2, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    count = 0
    for tile in range(gl.program_id(0), num_tiles, NUM_SMS):
        row_start, row_end, b_row, col = _tile_coords(tile, num_pid_m, num_pid_in_group, first_m, tile_end, tiles,
                                                      starts, ends, e_idx, N, K, B_EXPERTS, B_KMAJOR, BLOCK_M,
                                                      BLOCK_N, GROUP_M)
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, mma_layout)
        for ki in range(k_tiles):
            acc = _mma_step(acc, count, ready, a_bufs, b_bufs, B_KMAJOR, NUM_BUFFERS)
            # Every warpgroup's MMA of the previous K-step is done: its slot may be refilled.
            gl.thread_barrier()
            mbarrier.arrive(empty.index((count + NUM_BUFFERS - 1) % NUM_BUFFERS), pred=ki > 0)
            count += 1
        acc = warpgroup_mma_wait(0, deps=(acc,))
        gl.thread_barrier()
        mbarrier.arrive(empty.index((count + NUM_BUFFERS - 1) % NUM_BUFFERS))
        if MUL_WEIGHT:
            acc = _times_weight(acc, weights_ptr, sorted_ids_ptr, row_start, row_end, mma_layout, BLOCK_M)
        _store_tile(gl.convert_layout(acc.to(dtype), store_layout), c_ptr, sorted_ids_ptr, row_start, row_end, col,
                    N, stride_cm, stride_cn, C_FLAT, store_layout, BLOCK_M, BLOCK_N)


def warp_specialized_body(
    a_ptr, b_ptr, c_ptr, weights_ptr, sorted_ids_ptr, expert_offs_ptr,
    R, N, K, E, B_EXPERTS, first_group,
    stride_am, stride_be, stride_bk, stride_bn, stride_cm, stride_cn,
    E_POW2: gl.constexpr, C_FLAT: gl.constexpr, MUL_WEIGHT: gl.constexpr, B_KMAJOR: gl.constexpr,
    NUM_SMS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
    GROUP_M: gl.constexpr, NUM_BUFFERS: gl.constexpr, LOADER_REGS: gl.constexpr = 40,
):
    a_desc, b_desc, a_bufs, b_bufs = _operands(a_ptr, b_ptr, R, N, K, B_EXPERTS, stride_am, stride_bk, stride_bn,
                                               B_KMAJOR, BLOCK_M, BLOCK_N, BLOCK_K, NUM_BUFFERS)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_BUFFERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    gl.warp_specialize([
        (_ws_compute, (a_bufs, b_bufs, ready, empty, c_ptr, weights_ptr, sorted_ids_ptr, expert_offs_ptr, E,
                       first_group, N, K, B_EXPERTS, stride_cm, stride_cn, E_POW2, C_FLAT, MUL_WEIGHT, B_KMAJOR,
                       NUM_SMS, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_BUFFERS)),
        (_ws_loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, expert_offs_ptr, E, first_group, N, K,
                      B_EXPERTS, E_POW2, B_KMAJOR, NUM_SMS, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, NUM_BUFFERS)),
    ], [1], [LOADER_REGS])
    for i in gl.static_range(NUM_BUFFERS):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))



pipelined_jit = gluon.jit(pipelined_body, do_not_specialize=["first_group"])
warp_specialized_jit = gluon.jit(warp_specialized_body, do_not_specialize=["first_group"])
KERNELS = {"pipelined": pipelined_jit, "warp-specialized": warp_specialized_jit}


# --------------------------------------------------------------------------- host side


def weight_is_k_major(w: torch.Tensor) -> bool:
    """True for the transpose of a contiguous ``[E, N, K]``, False for a contiguous ``[E, K, N]``
    (the two layouts the kernels read through 2-D descriptors); anything else is refused."""
    E, K, N = w.shape
    se, sk, sn = w.stride()
    if sn == 1 and se == K * sk:
        if K % 64:
            raise ValueError(f"row-major W needs K % 64 == 0 (a K-step must not cross experts), got K={K}")
        return False
    if sk == 1 and se == N * sn:
        return True
    raise ValueError(f"W must be a contiguous [E, K, N] or the transpose of a contiguous [E, N, K]; "
                     f"got strides {w.stride()}")


def launch(kind: str, a: torch.Tensor, w: torch.Tensor, routing, config: triton.Config, out: torch.Tensor,
           weights=None, flat: bool = False, tma_store: bool = False) -> torch.Tensor:
    """``out[row] = a[row] @ w[expert(row)]`` for sorted ``a`` with the Gluon kernel ``kind``."""
    from disttune.kernels import moe
    from disttune.kernels.shard_gemm import ensure_descriptor_allocator, num_sms

    ensure_descriptor_allocator()
    R, groups = routing.num_rows, routing.groups
    E, K, N = w.shape
    kw = config.kwargs
    sms = num_sms(a.device)
    bound = (triton.cdiv(R, kw["BLOCK_M"]) + min(groups, R)) * triton.cdiv(N, kw["BLOCK_N"])
    extra = {"TMA_STORE": tma_store and not flat} if kind == "pipelined" else {}
    sw = w.stride()
    KERNELS[kind][(max(1, min(sms, bound)),)](
        a, w, out, weights if weights is not None else a, routing.sorted_ids, routing.expert_offs,
        R, N, K, groups, E, 0, a.stride(0), sw[0], sw[1], sw[2], out.stride(0), out.stride(1),
        E_POW2=max(2, moe.next_power_of_2(groups)), C_FLAT=flat, MUL_WEIGHT=weights is not None,
        B_KMAJOR=weight_is_k_major(w), NUM_SMS=sms, **extra, **kw, num_warps=config.num_warps)
    return out


def variants() -> list[tuple[str, str, triton.Config, bool]]:
    """(name, kernel, config, TMA store): the winners of this session's sweeps and their neighbours."""
    G = gluon_config
    return [("pipelined 128x256x64, 3 slots", "pipelined", G(128, 256, 64, 8, 3, 8), False),
            ("pipelined 128x256x64, 4 slots", "pipelined", G(128, 256, 64, 8, 4, 8), False),
            ("pipelined 128x256x64, 3 slots, TMA store", "pipelined", G(128, 256, 64, 8, 3, 8), True),
            ("pipelined 128x128x64, 5 slots, 4 warps", "pipelined", G(128, 128, 64, 8, 5, 4), False),
            ("warp-specialized 128x256x64, 3 slots", "warp-specialized", G(128, 256, 64, 8, 3, 8), False),
            ("warp-specialized 128x256x64, 4 slots", "warp-specialized", G(128, 256, 64, 8, 4, 8), False),
            ("warp-specialized 256x128x64, 4 slots", "warp-specialized", G(256, 128, 64, 8, 4, 8), False),
            ("warp-specialized 128x128x64, 5 slots, 4 warps", "warp-specialized", G(128, 128, 64, 8, 5, 4), False)]


def check_all(device: str) -> int:
    """Every variant against an fp32 per-expert reference: sorted output, and flat output with
    the routing weight. Returns the number of wrong results (NaN-poisoned outputs catch unwritten rows)."""
    from disttune.kernels import moe

    cases = [dict(T=37, E=8, k=2, H=128, I=200, empty=3), dict(T=300, E=16, k=6, H=192, I=1000, empty=5),
             dict(T=5, E=64, k=6, H=256, I=96, empty=0), dict(T=300, E=8, k=2, H=200, I=256, empty=0),
             dict(T=4096, E=8, k=2, H=4096, I=7168, empty=0)]
    bad = 0
    for case in cases:
        T, E, k, H, I = case["T"], case["E"], case["k"], case["H"], case["I"]
        x = torch.randn(T, H, device=device, dtype=torch.bfloat16)
        scores = torch.rand(T, E, device=device)
        scores[:, :case["empty"]] = -1  # experts without tokens
        rt = moe.moe_align(scores.topk(k, dim=1).indices.to(torch.int32), E)
        topk_w = torch.rand(T, k, device=device)
        w_rows = (torch.randn(E, H, I, device=device) / H ** 0.5).to(torch.bfloat16)
        xs = rt.permute(x)
        offs = rt.expert_offs.tolist()
        ref = torch.zeros(rt.num_rows, I, device=device)
        for e in range(E):
            ref[offs[e]:offs[e + 1]] = xs[offs[e]:offs[e + 1]].float() @ w_rows[e].float()
        ref_flat = rt.unsort(ref) * topk_w.reshape(-1, 1)
        layouts = {"K-major W": w_rows.transpose(1, 2).contiguous().transpose(1, 2)}
        if H % 64 == 0:
            layouts["row-major W"] = w_rows
        for w_name, w in layouts.items():
            for name, kind, config, tma_store in variants():
                if w_name == "row-major W" and H % config.kwargs["BLOCK_K"]:
                    continue
                out = torch.full((rt.num_rows, I), float("nan"), device=device, dtype=torch.bfloat16)
                flat = torch.full_like(out, float("nan"))
                launch(kind, xs, w, rt, config, out, tma_store=tma_store)
                launch(kind, xs, w, rt, config, flat, weights=topk_w, flat=True)
                errs = [((o.float() - r).abs().max() / r.abs().max().clamp_min(1e-6)).item()
                        for o, r in ((out, ref), (flat, ref_flat))]
                if not all(e < 2e-2 for e in errs):  # NaN fails too
                    bad += 1
                    print(f"WRONG: {name}, {w_name}, {case}: relative errors {errs}", flush=True)
    return bad


def append_rows(path: Path, rows: list[dict]) -> None:
    """Append ``rows`` to the JSON-lines file ``path`` (its folder made if missing) and say where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"\nrows appended to {path}")


def back_to_back_ms(fn, calls: int = 10, bursts: int = 5) -> float:
    """Milliseconds per call over ``calls`` launches back to back, the best of ``bursts`` bursts (CUDA events)."""
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(bursts):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        stop.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(stop) / calls)
    return best


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="JSON lines file (default: $OUT/moe_gluon.jsonl or bench/results/)")
    p.add_argument("--skip-check", action="store_true", help="time without checking the variants first")
    options = p.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("bench/moe_gluon.py needs a Hopper GPU (compute capability 9.x)", file=sys.stderr)
        return 2
    from disttune.kernels import moe

    device = "cuda"
    torch.manual_seed(0)
    if not options.skip_check:
        bad = check_all(device)
        print(f"checked every variant against the fp32 reference: {bad} wrong", flush=True)
        if bad:
            return 1
    gpu = torch.cuda.get_device_name()
    date = datetime.date.today().isoformat()
    out_path = Path(options.out or (Path(os.environ["OUT"]) / "moe_gluon.jsonl" if os.environ.get("OUT") else
                    Path(__file__).with_name("results") / f"moe_gluon-{gpu.split()[-1]}-{date}.jsonl"))
    rows = []
    for T, E, k, H, I in ((4096, 8, 2, 4096, 7168), (4096, 64, 6, 2048, 1408)):
        x = torch.randn(T, H, device=device, dtype=torch.bfloat16)
        rt = moe.moe_align(torch.rand(T, E, device=device).topk(k, dim=1).indices.to(torch.int32), E)
        w_rows = (torch.randn(E, H, I, device=device) / H ** 0.5).to(torch.bfloat16)
        xs = rt.permute(x)
        out = torch.empty(rt.num_rows, I, device=device, dtype=torch.bfloat16)
        shape = f"T={T} E={E} top-{k} H={H} I={I}"
        print(f"\n### {shape}, {gpu}: ms per call, L2 flushed / back to back; ratio = torch._grouped_mm / this\n")
        print("| kernel | W | ms (flushed) | ms (back to back) | vs `_grouped_mm` |")
        print("| --- | --- | ---: | ---: | ---: |")
        for w_name, w in (("row-major", w_rows), ("K-major", w_rows.transpose(1, 2).contiguous().transpose(1, 2))):
            contenders = [("torch._grouped_mm", lambda: torch._grouped_mm(xs, w, offs=rt.expert_offs[1:],
                                                                          out_dtype=torch.bfloat16))]
            for config in moe.HOPPER_MOE_CONFIGS[:2]:
                kw = config.kwargs
                contenders.append((f"tl {kw['BLOCK_M']}x{kw['BLOCK_N']}x{kw['BLOCK_K']}, {config.num_stages} stages",
                                   lambda c=config: moe.moe_gemm_with_config(xs, w, rt, c, a_order="sorted", out=out)))
            for name, kind, config, tma_store in variants():
                contenders.append((name, lambda kd=kind, c=config, t=tma_store: launch(kd, xs, w, rt, c, out,
                                                                                        tma_store=t)))
            ref = None
            for name, fn in contenders:
                flushed = triton.testing.do_bench(fn, warmup=25, rep=100)
                b2b = back_to_back_ms(fn)
                ref = ref or (flushed, b2b)
                print(f"| {name} | {w_name} | {flushed:.3f} | {b2b:.3f} | {ref[0] / flushed:.2f}x / "
                      f"{ref[1] / b2b:.2f}x |", flush=True)
                rows.append(dict(bench="moe_gluon", gpu=gpu, date=date, shape=shape, weights=w_name, kernel=name,
                                 ms_flushed=round(flushed, 4), ms_back_to_back=round(b2b, 4)))
    append_rows(out_path, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
