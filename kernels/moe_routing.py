"""The MoE routing sort as one Triton kernel: rows sorted by group, stable, and each group's start.

:func:`group_sort` is what ``kernels.moe.moe_align`` / ``moe_align_stacked`` run on GPUs for up to
:data:`MAX_GROUPS` groups: one launch, where torch's path takes five (the key add or cast, the
stable radix sort with its temporary storage, the index cast and ``searchsorted``), so it costs
less host time and, for few experts, less GPU time.

The kernel is a counting sort. The ``R = T * top_k`` (token, choice) rows are cut into chunks of
``BLOCK`` rows, one program per chunk. Every program reads all the ids (``SCAN_ROWS`` at a time,
from L2 after the first program) and counts them per group with ``tl.histogram``: the totals give
each group's start, the counts of the rows before its chunk give where its rows of each group go. It then sorts its own chunk by ``key * BLOCK + row`` (a bitonic
``tl.sort``, which keeps rows of one group in row order) and scatters each row's flat index to
``start[group] + rows of the group in earlier chunks + rank in its chunk``. So the result equals
a stable sort's, and every rank that sorts the same ids gets the same order.

Cost on the GPU: two histograms per ``SCAN_ROWS`` rows in every program and one sort of ``BLOCK``
keys. Up to 131072 rows there are at most 32 programs (``BLOCK`` grows with ``R``); beyond, the
program count grows with ``R``, so the total work grows as ``R**2 / 4096``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from .matmul import cdiv
from .symm import capturing
from .tp_common import row_starts

__all__ = ["MAX_GROUPS", "group_sort", "group_sort_block"]

#: Group counts above this fall back to torch's sort (the kernel keeps one histogram bin per group).
MAX_GROUPS = 4095
#: Rows each program counts per step of its scan over all rows (few, wide steps: the scan's loads
#: are what a program waits on).
SCAN_ROWS = 8192


@triton.jit
def _keys(ids_ptr, token_starts_ptr, f, valid, stride_t, stride_k, E, dump,
          TOP_K: tl.constexpr, WORLD: tl.constexpr):
    """Group of each flat row ``f = t * TOP_K + j``: ``rank(t) * E + ids[t, j]``; ids outside ``[0, E)``
    (and rows past the end) get the last bin, after every group, so no group ever reads them."""
    t = f // TOP_K
    raw = tl.load(ids_ptr + t.to(tl.int64) * stride_t + (f % TOP_K) * stride_k, mask=valid, other=-1)
    in_range = (raw >= 0) & (raw < E)  # in the ids' own type: a wide id must not wrap into range
    rank = tl.zeros(f.shape, dtype=tl.int32)
    for r in tl.static_range(1, WORLD):
        rank += (t >= tl.load(token_starts_ptr + r)).to(tl.int32)
    return tl.where(in_range, rank * E + raw.to(tl.int32), dump)


@triton.jit
def _group_sort_kernel(
    ids_ptr, token_starts_ptr, sorted_ids_ptr, offs_ptr, scratch_ptr,
    R, stride_t, stride_k, E, GROUPS,
    TOP_K: tl.constexpr, WORLD: tl.constexpr, BINS: tl.constexpr, BLOCK: tl.constexpr, SCAN: tl.constexpr,
):
    pid = tl.program_id(0)
    first = pid * BLOCK
    dump = BINS - 1
    # every row's group, SCAN rows at a time: per-group totals, and counts of the rows before this chunk
    before = tl.zeros((BINS,), dtype=tl.int32)
    total = tl.zeros((BINS,), dtype=tl.int32)
    for c in range(0, tl.cdiv(R, SCAN)):
        f = c * SCAN + tl.arange(0, SCAN)
        valid = f < R
        keys = _keys(ids_ptr, token_starts_ptr, f, valid, stride_t, stride_k, E, dump, TOP_K, WORLD)
        total += tl.histogram(keys, BINS, mask=valid)
        before += tl.histogram(keys, BINS, mask=valid & (f < first))
    starts = tl.cumsum(total, axis=0) - total
    # this chunk: sorted by (group, row), so sorted position j goes to base[group] + j
    lanes = tl.arange(0, BLOCK)
    valid = first + lanes < R
    own = _keys(ids_ptr, token_starts_ptr, first + lanes, valid, stride_t, stride_k, E, dump, TOP_K, WORLD)
    own_counts = tl.histogram(own, BINS, mask=valid)
    bins = tl.arange(0, BINS)
    base = starts + before - (tl.cumsum(own_counts, axis=0) - own_counts)
    tl.store(scratch_ptr + pid * BINS + bins, base)
    tl.debug_barrier()
    order = tl.sort(own * BLOCK + lanes)
    row = order % BLOCK
    dest = tl.load(scratch_ptr + pid * BINS + order // BLOCK) + lanes
    tl.store(sorted_ids_ptr + dest, first + row, mask=first + row < R)
    if pid == 0:
        tl.store(offs_ptr + bins, starts, mask=bins <= GROUPS)


def group_sort_block(rows: int) -> int:
    """Rows per program: at most about 32 chunks (each program counts them all), 256 to 4096 rows."""
    return max(256, min(4096, triton.next_power_of_2(max(1, cdiv(rows, 32)))))


_starts_cache: dict = {}


def _token_starts(rank_tokens: tuple, device) -> torch.Tensor:
    """First token of each rank as an int32 device tensor, made once per layout and kept (never
    evicted: a captured CUDA graph keeps reading the one it captured)."""
    key = (rank_tokens, device)
    starts = _starts_cache.get(key)
    if starts is None:
        if capturing():
            raise RuntimeError(f"group_sort: the token layout {list(rank_tokens)} is new inside a CUDA graph "
                               "capture (its table is copied from the host); run the call once before capturing it")
        starts = _starts_cache[key] = torch.tensor(row_starts(rank_tokens), dtype=torch.int32, device=device)
    return starts


def group_sort(topk_ids: torch.Tensor, num_experts: int, rank_tokens: Optional[Sequence[int]] = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(int32 flat index of each row in stable group order ``[R]``, int32 start of each group and the
    end ``[groups + 1]``) for ``topk_ids [T, top_k]`` (any integer dtype, any strides).

    Groups: the expert id, or with ``rank_tokens`` (the tokens of each rank, concatenated in rank
    order in ``topk_ids``) ``rank * num_experts + id``. Ids outside ``[0, num_experts)`` are
    placed after every group. One kernel launch, no host sync; ``groups`` must be at most
    :data:`MAX_GROUPS`."""
    T, k = topk_ids.shape
    world = len(rank_tokens) if rank_tokens else 1
    groups = num_experts * world
    if groups > MAX_GROUPS:
        raise ValueError(f"group_sort: {groups} groups exceed {MAX_GROUPS}; sort with torch instead (moe.moe_align "
                         "and moe.moe_align_stacked fall back to it by themselves)")
    device = topk_ids.device
    R = T * k
    sorted_ids = torch.empty(R, dtype=torch.int32, device=device)
    offs = torch.empty(groups + 1, dtype=torch.int32, device=device)
    if R == 0:
        return sorted_ids, offs.zero_()
    block = group_sort_block(R)
    programs = cdiv(R, block)
    bins = triton.next_power_of_2(groups + 1)
    scratch = torch.empty(programs * bins, dtype=torch.int32, device=device)
    starts = _token_starts(tuple(rank_tokens), device) if rank_tokens else offs
    _group_sort_kernel[(programs,)](topk_ids, starts, sorted_ids, offs, scratch, R, topk_ids.stride(0),
                                    topk_ids.stride(1), num_experts, groups, TOP_K=k, WORLD=world, BINS=bins,
                                    BLOCK=block, SCAN=SCAN_ROWS, num_warps=8)
    return sorted_ids, offs
