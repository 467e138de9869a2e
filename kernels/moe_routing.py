"""MoE routing: the (token, choice) rows sorted by expert, as the grouped GEMM reads them.

:func:`moe_align` sorts the ``T * top_k`` rows of ``topk_ids [T, top_k]`` by expert (stable, so
every rank that sorts the same ids gets the same order) and returns a :class:`MoeRouting`:
``sorted_ids`` (flat index ``t * top_k + j`` of each sorted row), ``expert_offs`` (``int32
[E + 1]``, row where each expert starts; ``offs[1:]`` is ``torch._grouped_mm``'s ``offs``) and
``counts``. No padding and no host sync. :func:`moe_align_stacked` sorts every rank's ids at once
by (source rank, expert), for AG-MoE. :func:`moe_align_block_size` is vLLM's padded form
(sentinel-padded ``sorted_token_ids``, ``expert_ids`` per M-block, ``num_tokens_post_padded``) for
one fixed block size, for kernels written against that layout (it syncs with the host).

On GPUs the sort is one Triton launch, :func:`group_sort` (rows sorted by group, stable, and each
group's start), for up to :data:`MAX_GROUPS` groups. Elsewhere, under the interpreter or for more
groups, torch's path runs: five ops (the key add or cast, the stable radix sort with its temporary
storage, the index cast and ``searchsorted``), so the kernel costs less host time and, for few
experts, less GPU time.

:func:`group_sort` is a counting sort. The ``R = T * top_k`` (token, choice) rows are cut into chunks of
``BLOCK`` rows, one program per chunk. Every program reads all the ids (``SCAN_ROWS`` at a time,
from L2 after the first program) and counts them per group with ``tl.histogram``: the totals give
each group's start, the counts of the rows before its chunk give where its rows of each group go.
It then sorts its own chunk by ``key * BLOCK + row`` (a bitonic ``tl.sort``, which keeps rows of
one group in row order) and scatters each row's flat index to ``start[group] + rows of the group
in earlier chunks + rank in its chunk``. So the result equals
a stable sort's, and every rank that sorts the same ids gets the same order.

A kernel can run these chunks itself (:func:`sort_chunk`, with a :class:`SortPlan`'s buffers): the grouped
GEMM does, in ``moe_gemm.moe_gemm_sorting``.

Cost on the GPU: two histograms per ``SCAN_ROWS`` rows in every program and one sort of ``BLOCK``
keys. Up to 131072 rows there are at most 32 programs (``BLOCK`` grows with ``R``); beyond, the
program count grows with ``R``, so the total work grows as ``R**2 / 4096``.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from disttune.graphs import capturing
from disttune.jit_launch import launch

from .matmul import cdiv, next_power_of_2
from .moe_common import INTERPRETED
from .symm import raw_current_stream
from .tp_common import row_starts

__all__ = ["MAX_GROUPS", "SortPlan", "sort_counters", "group_sort", "group_sort_block", "sort_chunk", "MoeRouting",
           "moe_align", "moe_align_stacked", "moe_align_gathered", "moe_align_ranks", "moe_align_block_size",
           "sort_chunks", "token_starts", "check_rank_ids", "check_topk_ids", "check_routing", "check_token_routing"]

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
def sort_chunk(ids_ptr, token_starts_ptr, sorted_ids_ptr, offs_ptr, scratch_ptr, chunk,
               R, stride_t, stride_k, E, GROUPS,
               TOP_K: tl.constexpr, WORLD: tl.constexpr, BINS: tl.constexpr, BLOCK: tl.constexpr, SCAN: tl.constexpr):
    """The counting sort's work for rows ``chunk * BLOCK ..`` (:func:`group_sort`'s program ``chunk``): every
    row's group counted, then this chunk's rows scattered to their sorted places; chunk 0 writes the starts."""
    first = chunk * BLOCK
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
    tl.store(scratch_ptr + chunk * BINS + bins, base)
    tl.debug_barrier()
    order = tl.sort(own * BLOCK + lanes)
    row = order % BLOCK
    dest = tl.load(scratch_ptr + chunk * BINS + order // BLOCK) + lanes
    tl.store(sorted_ids_ptr + dest, first + row, mask=first + row < R)
    if chunk == 0:
        tl.store(offs_ptr + bins, starts, mask=bins <= GROUPS)


@triton.jit
def _group_sort_kernel(
    ids_ptr, token_starts_ptr, sorted_ids_ptr, offs_ptr, scratch_ptr,
    R, stride_t, stride_k, E, GROUPS,
    TOP_K: tl.constexpr, WORLD: tl.constexpr, BINS: tl.constexpr, BLOCK: tl.constexpr, SCAN: tl.constexpr,
):
    sort_chunk(ids_ptr, token_starts_ptr, sorted_ids_ptr, offs_ptr, scratch_ptr, tl.program_id(0), R, stride_t,
               stride_k, E, GROUPS, TOP_K, WORLD, BINS, BLOCK, SCAN)


@functools.lru_cache(maxsize=256)
def group_sort_block(rows: int) -> int:
    """Rows per program: at most about 32 chunks (each program counts them all), 256 to 4096 rows."""
    return max(256, min(4096, next_power_of_2(max(1, cdiv(rows, 32)))))


def sort_chunks(rows: int) -> int:
    """How many chunks (programs) the sort of ``rows`` rows runs in: ``rows`` over :func:`group_sort_block`."""
    return cdiv(rows, group_sort_block(rows))


_starts_cache: dict = {}


def token_starts(rank_tokens: tuple, device) -> torch.Tensor:
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
    if T * k == 0:
        return (torch.empty(0, dtype=torch.int32, device=topk_ids.device),
                torch.zeros(groups + 1, dtype=torch.int32, device=topk_ids.device))
    plan = SortPlan.make(topk_ids, num_experts, tuple(rank_tokens) if rank_tokens else (), True)
    launch(_group_sort_kernel, (plan.chunks,), *plan.args(), **plan.meta(SCAN_ROWS), num_warps=8)
    return plan.sorted_ids, plan.offs


class SortPlan:
    """:func:`group_sort`'s buffers and launch parameters, for a kernel that runs the sort's chunks itself
    (:func:`sort_chunk`): ``sorted_ids`` and ``offs`` are filled by the launch. One allocation holds them
    and the per-chunk scratch, each part 16-byte aligned as a buffer of its own would be (the kernels
    specialize on pointer alignment)."""

    __slots__ = ("ids", "starts", "sorted_ids", "offs", "scratch", "sync", "num_experts", "groups", "world", "bins",
                 "block", "chunks")

    @classmethod
    def make(cls, topk_ids: torch.Tensor, num_experts: int, rank_tokens: tuple, by_rank: bool,
             counted: bool = False) -> "SortPlan":
        """The plan for ``topk_ids [T, top_k]`` (``T * top_k > 0``): groups per (rank, expert) for a rank-stacked
        sort (``rank_tokens`` and ``by_rank``), else per expert. ``counted``: ``sync`` holds the
        two int32 counts of a kernel whose programs wait for every chunk to be sorted (:func:`sort_counters`)."""
        plan = cls()
        world = len(rank_tokens) if rank_tokens and by_rank else 1
        R = topk_ids.shape[0] * topk_ids.shape[1]
        plan.ids, plan.num_experts, plan.world = topk_ids, num_experts, world
        plan.groups, plan.block, plan.chunks, plan.bins, at_offs, at_scratch, size = _sort_geometry(R, num_experts,
                                                                                                     world)
        memory = torch.empty(size, dtype=torch.int32, device=topk_ids.device)
        plan.sorted_ids, plan.offs = memory[:R], memory[at_offs:at_offs + plan.groups + 1]
        plan.scratch = memory[at_scratch:]
        plan.sync = sort_counters(topk_ids.device) if counted else None
        plan.starts = token_starts(rank_tokens, topk_ids.device) if world > 1 else plan.offs
        return plan

    def args(self) -> tuple:
        """The sort's runtime arguments, in :func:`sort_chunk`'s order (without the chunk)."""
        ids = self.ids
        return (ids, self.starts, self.sorted_ids, self.offs, self.scratch, ids.shape[0] * ids.shape[1],
                ids.stride(0), ids.stride(1), self.num_experts, self.groups)

    def meta(self, scan: int) -> dict:
        """The sort's constexprs (``scan``: rows counted per step)."""
        return dict(TOP_K=self.ids.shape[1], WORLD=self.world, BINS=self.bins, BLOCK=self.block, SCAN=scan)


@functools.lru_cache(maxsize=256)
def _sort_geometry(rows: int, num_experts: int, world: int) -> tuple[int, int, int, int, int, int, int]:
    """A sort plan's sizes for ``rows`` rows: (groups, rows per chunk, chunks, bins, start of the group offsets and of
    the scratch in the plan's int32 block, the block's size), each part 16-byte aligned."""
    groups = num_experts * world
    block, chunks = group_sort_block(rows), sort_chunks(rows)
    bins = next_power_of_2(groups + 1)
    at_offs = -(-rows // 4) * 4
    at_scratch = -(-(at_offs + groups + 1) // 4) * 4
    return groups, block, chunks, bins, at_offs, at_scratch, at_scratch + chunks * bins


#: Each stream's two counts for launches that sort in their own programs (see :func:`sort_counters`).
_counters: dict = {}


def sort_counters(device: torch.device) -> torch.Tensor:
    """Two int32 counts, zero, for a launch on ``device``'s current stream whose programs sort the routing and wait
    for every chunk (``moe_gemm_sorting``): chunks sorted, programs past the wait. The launch's last program sets
    both back to zero, so the launches on one stream, which run one after another, share one pair made once (a
    dictionary lookup per call, where a fresh pair cost a zero fill); launches on other streams, which may run at
    the same time, have pairs of their own, and so have the threads of an interpreted run (``TRITON_INTERPRET=1``).
    A launch being captured into a CUDA graph gets a new pair, zeroed by every replay. A tuner that times a
    sorting launch on a stream of its own without waiting for the caller's (``triton.testing.do_bench_cudagraph``)
    would share the caller's pair with a launch still running there: tune these kernels with the default timing."""
    if capturing():
        return torch.zeros(2, dtype=torch.int32, device=device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        key = (index, raw_current_stream(index))
    else:  # the interpreter runs a launch's programs on the launching thread, one after another
        key = (str(device), threading.get_ident())
    pair = _counters.get(key)
    if pair is None:
        if len(_counters) >= 64:  # streams (or threads) made and dropped call after call: start over (a dropped
            _counters.clear()     # pair's memory is reused in stream order, after the launches that use it)
        pair = _counters[key] = torch.zeros(2, dtype=torch.int32, device=device)
    return pair


@dataclass(frozen=True)
class MoeRouting:
    """Rows sorted by expert. ``R = num_tokens * top_k`` rows, no padding.

    * ``sorted_ids`` int32 [R]: flat index ``t * top_k + j`` of sorted row i (stable by expert);
    * ``expert_offs`` int32 [groups + 1]: group g owns sorted rows ``offs[g]:offs[g+1]``;
    * ``counts`` int32 [groups]: rows per group.

    A plain routing has one group per expert. A *rank-stacked* one (:func:`moe_align_stacked`)
    sorts the tokens of ``len(rank_tokens)`` ranks, concatenated in rank order, by (source rank,
    expert): group ``r * num_experts + e``, so each rank's rows stay contiguous and in the order its
    own plain routing gives; :meth:`per_rank` returns those routings as views. A *gathered* one
    (:func:`moe_align_gathered`, ``by_rank=False``) keeps one group per expert over every rank's tokens
    (each expert's rows in token order, so in rank order) and only records ``rank_tokens``.
    """

    sorted_ids: torch.Tensor
    expert_offs: torch.Tensor
    num_tokens: int
    top_k: int
    num_experts: int
    rank_tokens: tuple = ()  # tokens of each rank, concatenated in rank order (empty: one rank's routing)
    by_rank: bool = True  # with rank_tokens: one group per (rank, expert) (else one per expert)

    @property
    def num_rows(self) -> int:
        return self.num_tokens * self.top_k

    @property
    def groups(self) -> int:
        return self.num_experts * (len(self.rank_tokens) if self.rank_tokens and self.by_rank else 1)

    @property
    def counts(self) -> torch.Tensor:
        return self.expert_offs[1:] - self.expert_offs[:-1]

    def token_rows(self) -> torch.Tensor:
        """int64 [R]: token (row of the un-expanded input) of each sorted row."""
        return self.sorted_ids.long() // self.top_k

    def permute(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, H]`` -> ``[R, H]`` in sorted order (the pre-permuted A; one gather, R*H elements)."""
        return x.index_select(0, self.token_rows())

    def unsort(self, y: torch.Tensor) -> torch.Tensor:
        """Sorted rows ``[R, N]`` -> flat (token, choice) order ``[R, N]``."""
        out = torch.empty_like(y)
        out[self.sorted_ids.long()] = y
        return out

    def per_rank(self) -> tuple["MoeRouting", ...]:
        """A rank-stacked routing as one plain routing per rank (two small torch ops per rank)."""
        if not self.rank_tokens:
            return (self,)
        if not self.by_rank:
            raise ValueError("MoeRouting.per_rank: a gathered routing groups rows by expert over every rank's tokens, "
                             "so a rank's rows are not contiguous; build it with moe_align_stacked to split it by rank")
        E, k, parts, token_start = self.num_experts, self.top_k, [], 0
        for r, tokens in enumerate(self.rank_tokens):
            offs = self.expert_offs[r * E: (r + 1) * E + 1]
            row_start = token_start * k
            parts.append(MoeRouting(self.sorted_ids[row_start: row_start + tokens * k] - row_start,
                                    offs - row_start, tokens, k, E))
            token_start += tokens
        return tuple(parts)


def check_topk_ids(topk_ids: torch.Tensor, num_experts: int, where: str, check_range: bool) -> None:
    """TypeError/ValueError unless ``topk_ids`` is a 2-D integer tensor of ids in ``[0, num_experts)``
    (the range only with ``check_range``: one host sync on a GPU)."""
    if not isinstance(topk_ids, torch.Tensor):
        raise TypeError(f"{where}: topk_ids must be a torch.Tensor, got {type(topk_ids).__name__}")
    if topk_ids.dim() != 2:
        raise ValueError(f"{where}: topk_ids must be 2-D [tokens, top_k], got shape {tuple(topk_ids.shape)}")
    if topk_ids.dtype.is_floating_point or topk_ids.dtype.is_complex or topk_ids.dtype == torch.bool:
        raise TypeError(f"{where}: topk_ids must be an integer tensor, got {topk_ids.dtype}")
    if not isinstance(num_experts, int) or isinstance(num_experts, bool) or num_experts < 1:
        raise ValueError(f"{where}: num_experts must be an int >= 1, got {num_experts!r}")
    if topk_ids.shape[1] < 1:
        raise ValueError(f"{where}: top_k (topk_ids.shape[1]) must be >= 1")
    if check_range and topk_ids.numel():
        lo, hi = torch.stack(torch.aminmax(topk_ids)).tolist()  # one host sync on a GPU for both bounds
        if lo < 0 or hi >= num_experts:
            raise ValueError(f"{where}: expert ids must lie in [0, {num_experts}), got values in [{lo}, {hi}]; "
                             "check the router's output and num_experts")


def moe_align(topk_ids: torch.Tensor, num_experts: int, check_range: bool = True, *,
              routing_kernel: bool = True) -> MoeRouting:
    """Sort the (token, choice) rows by expert (stable) and find each expert's first row.

    Cost: on GPUs one Triton launch (group_sort, a counting sort, up to
    ``moe_routing.MAX_GROUPS`` experts); elsewhere, for more experts, or with ``routing_kernel=False``,
    four torch ops (the ids cast to the narrowest key type, a stable sort, which makes one radix
    pass per key byte, the index cast, ``searchsorted``). No host sync unless ``check_range`` (one
    ``min``/``max`` read back to reject ids outside ``[0, num_experts)``).
    """
    check_topk_ids(topk_ids, num_experts, "moe_align", check_range)
    T, k = topk_ids.shape
    return MoeRouting(*_sorted_by_expert(topk_ids, num_experts, routing_kernel), int(T), int(k), int(num_experts))


def _sorted_by_expert(topk_ids: torch.Tensor, num_experts: int, routing_kernel: bool = True
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`moe_align`'s sort, without its checks: (sorted flat indices, each expert's first row and the end)."""
    if routing_kernel and _routing_kernel_fits(topk_ids, num_experts):
        return group_sort(topk_ids, num_experts)
    return _sort_by_group(topk_ids.reshape(-1).to(_key_dtype(num_experts)), num_experts)


def check_rank_ids(topk_ids: torch.Tensor, num_experts: int, rank_tokens: Sequence[int], where: str) -> tuple:
    """TypeError/ValueError unless ``topk_ids`` are every rank's ids (``sum(rank_tokens)`` rows; ids not
    range-checked); returns ``rank_tokens`` as a tuple of ints."""
    check_topk_ids(topk_ids, num_experts, where, check_range=False)
    rank_tokens = tuple(int(t) for t in rank_tokens)
    if sum(rank_tokens) != topk_ids.shape[0]:
        raise ValueError(f"{where}: {topk_ids.shape[0]} rows of ids but rank_tokens sum to {sum(rank_tokens)}")
    return rank_tokens


def moe_align_stacked(topk_ids: torch.Tensor, num_experts: int, rank_tokens: Sequence[int], *,
                      routing_kernel: bool = True) -> MoeRouting:
    """The rank-stacked routing of ``topk_ids [sum(rank_tokens), top_k]`` (every rank's ids, in rank
    order): rows sorted by (source rank, expert), stable. Expert ids are not range-checked here (each
    rank checks its own before they are gathered). Cost: as :func:`moe_align` (one Triton launch on
    GPUs unless ``routing_kernel=False``; else one add, written in the narrow key type, and the torch
    sort, cast and search)."""
    rank_tokens = check_rank_ids(topk_ids, num_experts, rank_tokens, "moe_align_stacked")
    T, k = topk_ids.shape
    groups = num_experts * len(rank_tokens)
    if routing_kernel and _routing_kernel_fits(topk_ids, groups):
        sorted_ids, offs = group_sort(topk_ids, num_experts, rank_tokens)
        return MoeRouting(sorted_ids, offs, int(T), int(k), int(num_experts), rank_tokens)
    bases = _rank_bases(rank_tokens, k, num_experts, topk_ids.device, topk_ids.dtype)
    # one op, also from a strided view of the ids, written in the sort's narrow key type
    keys = torch.empty(T, k, dtype=_key_dtype(groups), device=topk_ids.device)
    torch.add(topk_ids, bases.view(T, k), out=keys)
    sorted_ids, offs = _sort_by_group(keys.view(-1), groups)
    return MoeRouting(sorted_ids, offs, int(T), int(k), int(num_experts), rank_tokens)


def moe_align_gathered(topk_ids: torch.Tensor, num_experts: int, rank_tokens: Sequence[int]) -> MoeRouting:
    """The routing of every rank's ids ``[sum(rank_tokens), top_k]`` (in rank order) with one group per
    expert, recording ``rank_tokens``: fewer, fuller M-tiles than :func:`moe_align_stacked`'s group per
    (rank, expert) when a rank sends an expert few rows, at the price of tiles that read several ranks'
    tokens. Expert ids are not range-checked. Cost: as :func:`moe_align`."""
    rank_tokens = check_rank_ids(topk_ids, num_experts, rank_tokens, "moe_align_gathered")
    T, k = topk_ids.shape
    return MoeRouting(*_sorted_by_expert(topk_ids, num_experts), int(T), int(k), int(num_experts), rank_tokens,
                      by_rank=False)


def moe_align_ranks(topk_ids: torch.Tensor, num_experts: int, rank_tokens: Sequence[int] = (),
                    by_rank: bool = True) -> MoeRouting:
    """The routing of ``topk_ids`` in the form a caller names by ``rank_tokens`` and ``by_rank``: one rank's
    (:func:`moe_align`, no range check) without ``rank_tokens``, else every rank's, grouped per (rank, expert)
    (:func:`moe_align_stacked`, ``by_rank``) or per expert (:func:`moe_align_gathered`)."""
    if not rank_tokens:
        return moe_align(topk_ids, num_experts, check_range=False)
    if by_rank:
        return moe_align_stacked(topk_ids, num_experts, rank_tokens)
    return moe_align_gathered(topk_ids, num_experts, rank_tokens)


_aranges: dict = {}
_bases: dict = {}


def _routing_kernel_fits(topk_ids: torch.Tensor, groups: int) -> bool:
    """Whether group_sort can sort these ids: GPU tensors, Triton compiled (under
    the interpreter its per-program loops are slow; torch's sort runs there), at most MAX_GROUPS groups."""
    return topk_ids.is_cuda and not INTERPRETED and groups <= MAX_GROUPS


def _key_dtype(groups: int) -> torch.dtype:
    """The narrowest integer type holding 0..groups: the stable radix sort makes one pass per byte of
    its keys (one pass for up to 255 groups, four for int32 keys)."""
    return torch.uint8 if groups <= 255 else torch.int16 if groups <= 32767 else torch.int32


def _sort_by_group(keys: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int32 stable sort order of ``keys``, int32 start of every group 0..groups and the end).
    ``keys`` (group of each row) should be of :func:`_key_dtype` ``(groups)``."""
    values, order = torch.sort(keys, stable=True)
    cache_key = (groups, keys.device, keys.dtype)
    bounds = _aranges.get(cache_key)
    if bounds is None:
        bounds = _aranges[cache_key] = torch.arange(groups + 1, device=keys.device, dtype=keys.dtype)
    return order.to(torch.int32), torch.searchsorted(values, bounds, out_int32=True)


def _rank_bases(rank_tokens: tuple, k: int, num_experts: int, device, dtype) -> torch.Tensor:
    """``r * num_experts`` for every (token, choice) row of rank r, cached per layout."""
    key = (rank_tokens, k, num_experts, device, dtype)
    bases = _bases.get(key)
    if bases is None:
        if len(_bases) > 64:
            _bases.clear()
        per_rank = torch.arange(len(rank_tokens), dtype=dtype) * num_experts
        bases = _bases[key] = torch.repeat_interleave(per_rank, torch.tensor(rank_tokens) * k).to(device)
    return bases


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM's ``moe_align_block_size`` layout, for kernels that need a fixed block size.

    Returns ``(sorted_token_ids, expert_ids, num_tokens_post_padded)``: each expert's rows
    (flat indices ``t * top_k + j``, stable order) padded to a multiple of ``block_m`` with the
    sentinel ``R = T * top_k``; ``expert_ids[b]`` is the expert of M-block b; the padded
    total as a 1-element int32 tensor. Experts without tokens get no block. Syncs with the
    host once (the padded length). The grouped GEMM (``kernels.moe_gemm``) maps its tiles to experts itself
    and does not need it.
    """
    if not isinstance(block_m, int) or block_m < 1:
        raise ValueError(f"moe_align_block_size: block_m must be an int >= 1, got {block_m!r}")
    routing = moe_align(topk_ids, num_experts)
    dev = routing.sorted_ids.device
    counts = routing.counts.long()
    padded = (counts + block_m - 1) // block_m * block_m
    padded_offs = torch.zeros(num_experts + 1, dtype=torch.long, device=dev)
    padded_offs[1:] = torch.cumsum(padded, 0)
    total = int(padded_offs[-1])
    R = routing.num_rows
    out = torch.full((total,), R, dtype=torch.int32, device=dev)
    expert_of_row = torch.repeat_interleave(torch.arange(num_experts, device=dev), counts, output_size=R)
    pos = torch.arange(R, device=dev) - routing.expert_offs.long()[expert_of_row] + padded_offs[expert_of_row]
    out[pos] = routing.sorted_ids
    expert_ids = torch.repeat_interleave(torch.arange(num_experts, device=dev, dtype=torch.int32),
                                         padded // block_m, output_size=total // block_m)
    return out, expert_ids, torch.tensor([total], dtype=torch.int32, device=dev)



def check_routing(where: str, routing: MoeRouting, device: torch.device) -> None:
    """TypeError unless ``routing`` is a :class:`MoeRouting`, ValueError unless it is on ``device``."""
    if not isinstance(routing, MoeRouting):
        raise TypeError(f"{where}: routing must be a MoeRouting (from moe_align), got {type(routing).__name__}")
    if routing.sorted_ids.device != device:
        raise ValueError(f"{where}: routing is on {routing.sorted_ids.device} but the input is on {device}")


def check_token_routing(where: str, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: Optional[torch.Tensor],
                         num_experts: int, check_range: bool) -> None:
    """The routing of ``x``'s tokens: valid ids, one row per token, weights shaped like the ids."""
    check_topk_ids(topk_ids, num_experts, where, check_range=check_range)
    if topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"{where}: topk_ids has {topk_ids.shape[0]} rows but x has {x.shape[0]} tokens")
    if topk_weights is not None and tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"{where}: topk_weights must have topk_ids' shape {tuple(topk_ids.shape)}, "
                         f"got {tuple(topk_weights.shape)}")
