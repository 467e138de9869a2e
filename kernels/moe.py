"""Mixture-of-experts kernels tuned in context: routing, a fused grouped GEMM, the MLP,
AllGather-MoE and MoE-ReduceScatter.

Pieces:

* routing -- :func:`moe_align` sorts the ``T * top_k`` (token, choice) rows by expert
  (stable, so every rank that sorts the same ids gets the same order) and returns a
  :class:`MoeRouting`: ``sorted_ids`` (flat index ``t * top_k + j`` of each sorted row),
  ``expert_offs`` (``int32 [E + 1]``, row where each expert starts; ``offs[1:]`` is
  ``torch._grouped_mm``'s ``offs``) and ``counts``. No padding and no host sync: the
  GEMM maps its M-tiles to experts itself, so BLOCK_M is freely tunable. On GPUs the sort is
  one Triton launch (``kernels.moe_routing.group_sort``), elsewhere torch's stable sort.
  :func:`moe_align_block_size` is vLLM's padded form (sentinel-padded ``sorted_token_ids``,
  ``expert_ids`` per M-block, ``num_tokens_post_padded``) for one fixed block size, for
  kernels written against that layout (it syncs with the host).
* ``moe_gemm_jit`` / ``moe_gemm_kernel`` / :func:`make_moe_kernel` -- one Triton kernel for
  all experts' GEMMs: ``C[row] = A[a_row(row)] @ W[expert(row)]`` (optionally times the
  routing weight), fp32 accumulate. Layouts:

  - ``W``: ``[E, K, N]`` (``[E, H, I]`` for the up projection, ``[E, I, H]`` for down),
    any strides; a transposed view of ``[E, N, K]`` works too (same as ``torch._grouped_mm``'s
    ``mat_b``).
  - ``A`` (``a_order``): ``"token"`` -- ``[T, K]``, rows gathered through the routing
    (``sorted_ids // top_k``, vLLM's indirect load: no permuted copy of A); ``"flat"`` --
    ``[T * top_k, K]`` in (token, choice) order, gathered through ``sorted_ids``;
    ``"sorted"`` -- ``[R, K]`` already in the routing's sorted order (contiguous loads).
  - ``C`` (``out_order``): ``"sorted"`` (contiguous, ``[R, N]`` in sorted order) or ``"flat"``
    (row ``t * top_k + j``: scattered stores, ready for the top-k sum).

  Persistent: ``min(#SMs, tile bound)`` programs walk the ``BLOCK_M x BLOCK_N`` tiles. Each
  program builds the expert table once from ``expert_offs`` (an ``E``-wide cumulative sum) and
  maps every tile to its expert with it; experts without tokens own no tiles. W is read through a
  3-D tensor descriptor (TMA) when its rows are 16-byte aligned, either ``[E, K, N]`` row-major or
  the transpose of ``[E, N, K]``; sorted A through a 2-D descriptor likewise (its rows past an
  expert's end are loaded and never stored); gathered A and unaligned layouts use pointer loads.
  C is stored with a mask (a tile must not write the next expert's rows).
* :func:`moe_mlp` -- gate-up GEMM (token-gathered A, sorted C), SiLU-gated product in torch,
  down GEMM (sorted A, flat C, routing weight in the epilogue), top-k sum back to ``[T, H]``.
* :func:`ag_moe`, :func:`moe_rs`, :func:`tp_moe_layer` -- tensor-parallel MoE over ranks
  (each rank holds a slice of every expert's intermediate dimension and its own tokens,
  possibly uneven): all-gather tokens + routing, grouped GEMM per source rank (the local
  chunk first, overlapping the gather); grouped GEMM per destination rank, each chunk
  reduced to its owner while the next one computes. ``graph_safe=True`` makes AG-MoE and the
  layer capturable in a CUDA graph (fixed-value flags, no host sync).
* references: :func:`moe_gemm_reference`, :func:`moe_mlp_reference` (per-expert torch loops).

Tuning key: ``N, K, E, TOP_K, ROWS_BUCKET`` and the A/C/weight modes (plus dtypes, as Triton
adds them). ``ROWS_BUCKET`` is the total number of routed rows rounded up to a power of two
(``bucket=`` changes that); per-expert counts are never in the key, so ranks with different
routings tune the same sites and agree on one winner. Every host function here is what a
user wraps with ``disttune.contextual_autotune``.

Interpreter notes: as kernels/matmul.py (``TRITON_INTERPRET=1`` before importing triton;
host-clock ``do_bench`` under the interpreter; bf16 refused there, see
``BF16_INTERPRETER_NOTE``).
"""

from __future__ import annotations

import bisect
import functools
import itertools
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from disttune import env

from .matmul import (
    BF16_INTERPRETER_NOTE,
    SUPPORTED_DTYPES,
    cdiv,
    config_is_valid,
    gemm_config,
    interpreting,
    make_autotuner,
    max_shared_memory,
    prune_configs,
    shared_memory_bytes,  # noqa: F401 - re-exported: moe.shared_memory_bytes sizes MoE configs
)
from .moe_routing import MAX_GROUPS, group_sort
from .shard_gemm import ensure_descriptor_allocator, num_sms
from .symm import refuse_capture, uses_nccl

__all__ = [
    "HOPPER_MOE_CONFIGS",
    "CPU_MOE_CONFIGS",
    "A_ORDERS",
    "OUT_ORDERS",
    "TILE_ORDERS",
    "MoeRouting",
    "next_power_of_2",
    "default_moe_configs",
    "moe_config_is_valid",
    "prune_moe_configs",
    "moe_align",
    "moe_align_stacked",
    "moe_align_block_size",
    "make_moe_kernel",
    "moe_gemm_jit",
    "moe_gemm_kernel",
    "moe_gemm",
    "moe_gemm_with_config",
    "silu_and_mul",
    "moe_mlp",
    "ag_moe",
    "AgMoeResult",
    "moe_rs",
    "tp_moe_layer",
    "moe_gemm_reference",
    "moe_mlp_reference",
]


#: Hopper (H100/H200) space, bf16/fp16: large tiles for the 8-expert shape, 64-row tiles for
#: many small experts (64 experts x ~400 rows), deeper pipelines for the narrower tiles.
HOPPER_MOE_CONFIGS = [
    gemm_config(128, 256, 64, 8, 3, 8),
    gemm_config(128, 256, 64, 8, 4, 8),
    gemm_config(256, 128, 64, 8, 3, 8),
    gemm_config(128, 128, 64, 8, 4, 4),
    gemm_config(128, 128, 64, 8, 3, 8),
    gemm_config(128, 128, 128, 8, 3, 8),
    gemm_config(64, 256, 64, 8, 4, 4),
    gemm_config(64, 128, 64, 8, 4, 4),
    gemm_config(128, 64, 64, 8, 4, 4),
    gemm_config(64, 64, 64, 8, 4, 4),
    gemm_config(128, 128, 32, 8, 4, 4),
    gemm_config(64, 128, 128, 8, 3, 4),
]

#: Small configs for CPU runs under the interpreter, whose cost is mostly per program:
#: few, wide tiles keep the tests fast.
CPU_MOE_CONFIGS = [
    gemm_config(32, 32, 32, 4, 1, 1),
    gemm_config(16, 32, 32, 1, 1, 1),
    gemm_config(32, 32, 16, 4, 1, 1),
]

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

#: Set to 1 to fill every buffer these functions allocate with NaN (tests: an unwritten
#: tile or row then shows up in the result instead of passing as stale memory).
POISON_ENV = env.MOE_POISON


def _empty(shape, dtype, device) -> torch.Tensor:
    if env.poison_buffers():
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def default_moe_configs() -> list:
    """Hopper space on a real GPU, small CPU configs under the interpreter / without CUDA."""
    if torch.cuda.is_available() and not interpreting():
        return list(HOPPER_MOE_CONFIGS)
    return list(CPU_MOE_CONFIGS)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1): the default row bucket of the tuning key."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


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
    args = {**(named_args or {}), **kwargs}
    tensors = [args[n] for n in ("a_ptr", "b_ptr") if isinstance(args.get(n), torch.Tensor)]
    if not tensors:
        raise ValueError("prune_moe_configs: a_ptr/b_ptr tensors not found in the kernel arguments")
    dtype = max((t.dtype for t in tensors), key=lambda d: torch.empty((), dtype=d).element_size())
    return prune_configs(configs, dtype, max_shared_memory(tensors[0].device))


# --------------------------------------------------------------------------- routing


@dataclass(frozen=True)
class MoeRouting:
    """Rows sorted by expert. ``R = num_tokens * top_k`` rows, no padding.

    * ``sorted_ids`` int32 [R]: flat index ``t * top_k + j`` of sorted row i (stable by expert);
    * ``expert_offs`` int32 [groups + 1]: group g owns sorted rows ``offs[g]:offs[g+1]``;
    * ``counts`` int32 [groups]: rows per group.

    A plain routing has one group per expert. A *rank-stacked* one (:func:`moe_align_stacked`)
    sorts the tokens of ``len(rank_tokens)`` ranks, concatenated in rank order, by (source rank,
    expert): group ``r * num_experts + e``, so each rank's rows stay contiguous and in the order its
    own plain routing gives; :meth:`per_rank` returns those routings as views.
    """

    sorted_ids: torch.Tensor
    expert_offs: torch.Tensor
    num_tokens: int
    top_k: int
    num_experts: int
    rank_tokens: tuple = ()  # tokens of each stacked rank (empty: a plain routing)

    @property
    def num_rows(self) -> int:
        return self.num_tokens * self.top_k

    @property
    def groups(self) -> int:
        return self.num_experts * max(1, len(self.rank_tokens))

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
        E, k, parts, token_start = self.num_experts, self.top_k, [], 0
        for r, tokens in enumerate(self.rank_tokens):
            offs = self.expert_offs[r * E: (r + 1) * E + 1]
            row_start = token_start * k
            parts.append(MoeRouting(self.sorted_ids[row_start: row_start + tokens * k] - row_start,
                                    offs - row_start, tokens, k, E))
            token_start += tokens
        return tuple(parts)


def _check_topk_ids(topk_ids: torch.Tensor, num_experts: int, where: str, check_range: bool) -> None:
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

    Cost: on GPUs one Triton launch (``kernels.moe_routing.group_sort``, a counting sort, up to
    ``moe_routing.MAX_GROUPS`` experts); elsewhere, for more experts, or with ``routing_kernel=False``,
    four torch ops (the ids cast to the narrowest key type, a stable sort, which makes one radix
    pass per key byte, the index cast, ``searchsorted``). No host sync unless ``check_range`` (one ``min``/``max`` read back to reject ids outside ``[0, num_experts)``).
    """
    _check_topk_ids(topk_ids, num_experts, "moe_align", check_range)
    T, k = topk_ids.shape
    if routing_kernel and _routing_kernel_fits(topk_ids, num_experts):
        sorted_ids, offs = group_sort(topk_ids, num_experts)
    else:
        sorted_ids, offs = _sort_by_group(topk_ids.reshape(-1).to(_key_dtype(num_experts)), num_experts)
    return MoeRouting(sorted_ids, offs, int(T), int(k), int(num_experts))


def moe_align_stacked(topk_ids: torch.Tensor, num_experts: int, rank_tokens: Sequence[int], *,
                      routing_kernel: bool = True) -> MoeRouting:
    """The rank-stacked routing of ``topk_ids [sum(rank_tokens), top_k]`` (every rank's ids, in rank
    order): rows sorted by (source rank, expert), stable. Expert ids are not range-checked here (each
    rank checks its own before they are gathered). Cost: as :func:`moe_align` (one Triton launch on
    GPUs unless ``routing_kernel=False``; else one add, written in the narrow key type, and the torch
    sort, cast and search)."""
    _check_topk_ids(topk_ids, num_experts, "moe_align_stacked", check_range=False)
    rank_tokens = tuple(int(t) for t in rank_tokens)
    if sum(rank_tokens) != topk_ids.shape[0]:
        raise ValueError(f"moe_align_stacked: {topk_ids.shape[0]} rows of ids but rank_tokens sum to "
                         f"{sum(rank_tokens)}")
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


_aranges: dict = {}
_bases: dict = {}


def _routing_kernel_fits(topk_ids: torch.Tensor, groups: int) -> bool:
    """Whether ``kernels.moe_routing.group_sort`` can sort these ids: GPU tensors, Triton compiled (under
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
    host once (the padded length). The grouped GEMM here does not need it (see module doc).
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


# --------------------------------------------------------------------------- kernel


def _moe_gemm_body(
    a_ptr, b_ptr, c_ptr, weights_ptr, sorted_ids_ptr, expert_offs_ptr, flags_ptr,
    R, N, K, E, B_EXPERTS, TOP_K, ROWS_BUCKET, first_group, epoch,
    stride_am, stride_ak,
    stride_be, stride_bk, stride_bn,
    stride_cm, stride_cn,
    E_POW2: tl.constexpr,       # E rounded up: E groups in expert_offs, group g multiplies W[g % B_EXPERTS]
    WAIT: tl.constexpr,         # a tile of group g first spins until flags[g // B_EXPERTS] >= epoch
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
):
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
        if WAIT:  # the source rank's tokens arrive by copy-engine pushes, flagged with the call's epoch
            while tl.atomic_add(flags_ptr + group // B_EXPERTS, 0, sem="acquire", scope="sys") < epoch:
                pass
        sel = e_idx == group
        first_tile = tl.sum(tl.where(sel, tile_end - tiles, 0), axis=0)
        row_start = tl.sum(tl.where(sel, starts, 0), axis=0) + (pid_m - first_tile) * BLOCK_M
        row_end = tl.sum(tl.where(sel, ends, 0), axis=0)

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
#: Whether it runs in the interpreter (fixed when ``triton.jit`` ran, as Triton decides it then).
INTERPRETED = interpreting()

#: Tuning key: shapes, expert count, top-k, bucketed total rows and the load/store modes.
MOE_KEY = ["N", "K", "E", "B_EXPERTS", "TOP_K", "ROWS_BUCKET", "WAIT", "A_MODE", "C_FLAT", "MUL_WEIGHT", "A_TMA",
           "B_TMA"]


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


def _check_float(where: str, name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{where}: {name} dtype {t.dtype} not supported (need one of {SUPPORTED_DTYPES})")


def _check_device(where: str, ref: torch.Tensor, **tensors: Optional[torch.Tensor]) -> None:
    for name, t in tensors.items():
        if t is not None and t.device != ref.device:
            raise ValueError(f"{where}: {name} is on {t.device} but the input is on {ref.device}; "
                             "move every tensor to one device")
    if ref.device.type != "cuda" and not INTERPRETED:
        raise ValueError(f"{where}: tensors are on {ref.device}; Triton needs CUDA tensors unless "
                         "TRITON_INTERPRET=1 was set before triton was imported")


def _check_routing(where: str, routing: MoeRouting, device: torch.device) -> None:
    if not isinstance(routing, MoeRouting):
        raise TypeError(f"{where}: routing must be a MoeRouting (from moe_align), got {type(routing).__name__}")
    if routing.sorted_ids.device != device:
        raise ValueError(f"{where}: routing is on {routing.sorted_ids.device} but the input is on {device}")


def _prepare(a, w, routing, a_order, out, out_order, weights, where, wait=None, tile_order="expert_bands"):
    """Validate a grouped-GEMM call; returns (out, kernel args up to TOP_K, strides, constexpr kwargs).

    ``wait``: ``(flags, epoch)`` for a rank-stacked routing whose tokens are still arriving.
    The host launchers always run the persistent, flattened tile loop (``PERSISTENT=FLATTEN=True``).
    Cost: about 10 µs of Python per call (each tensor's shape and strides are read once)."""
    a_mode = _A_MODE.get(a_order)
    if a_mode is None:
        raise ValueError(f"{where}: a_order must be one of {A_ORDERS}, got {a_order!r}")
    if out_order not in OUT_ORDERS:
        raise ValueError(f"{where}: out_order must be one of {OUT_ORDERS}, got {out_order!r}")
    if tile_order not in TILE_ORDERS:
        raise ValueError(f"{where}: tile_order must be one of {TILE_ORDERS}, got {tile_order!r}")
    _check_float(where, "a", a)
    _check_float(where, "w", w)
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
    _check_routing(where, routing, a.device)
    _check_device(where, a, w=w, out=out, weights=weights)
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
        weights = weights.contiguous()
    if out is None:
        out = _empty((R, N), dtype, a.device)
    else:
        _check_float(where, "out", out)
        if tuple(out.shape) != (R, N):
            raise ValueError(f"{where}: out has shape {tuple(out.shape)}, expected {(R, N)}")
        if out.numel() and a.numel() and out.untyped_storage().data_ptr() == a.untyped_storage().data_ptr():
            raise ValueError(f"{where}: out shares storage with a; in-place grouped GEMM is not supported")
    a_stride, w_stride, out_stride = a.stride(), w.stride(), out.stride()
    for name, shape, stride in (("a", a_shape, a_stride), ("w", w_shape, w_stride), ("out", (R, N), out_stride)):
        if _span(shape, stride) > _INT32_MAX:
            raise ValueError(f"{where}: {name} spans more than 2**31-1 elements; the kernel uses 32-bit offsets")
    if wait is not None and not routing.rank_tokens:
        raise ValueError(f"{where}: waiting on arrival flags needs a rank-stacked routing (moe_align_stacked)")
    groups = routing.groups
    args = (a, w, out, weights if weights is not None else a, routing.sorted_ids, routing.expert_offs,
            routing.expert_offs if wait is None else wait[0], R, N, K, groups, E, routing.top_k)
    strides = (*a_stride, *w_stride, *out_stride)
    elem = a.element_size()
    a_tma = a_mode == 2 and _descriptor_ready(a, a_stride, 1, elem)
    b_tma = _weight_layout(w, w_stride, elem)
    meta = dict(E_POW2=max(2, next_power_of_2(groups)), WAIT=wait is not None, A_MODE=a_mode,
                C_FLAT=out_order == "flat", MUL_WEIGHT=weights is not None, A_TMA=a_tma, B_TMA=b_tma,
                NUM_SMS=num_sms(a.device), PERSISTENT=True, FLATTEN=True,
                EXPERT_BANDS=tile_order == "expert_bands")
    if (a_tma or b_tma) and a.device.type == "cuda":
        ensure_descriptor_allocator()
    return out, args, strides, meta


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
    walked from group ``first_group`` on, and with ``wait=(flags, epoch)`` a tile of source rank
    ``r`` spins until ``flags[r] >= epoch`` before reading A (tokens pushed by
    ``kernels.symm.ShardPusher``; every flag must reach ``epoch`` or the kernel never ends).

    ``tile_order`` (one of :data:`TILE_ORDERS`) chooses the order in which programs walk the tiles.
    """
    out, args, strides, meta = _prepare(a, w, routing, a_order, out, out_order, weights, "moe_gemm", wait,
                                        tile_order)
    R, N = out.shape
    if R == 0 or N == 0:
        return out
    if a.shape[1] == 0:
        return out.zero_()
    rb = int(rows_bucket) if rows_bucket is not None else int(bucket(R))
    kern = kernel if kernel is not None else moe_gemm_kernel
    kern[_grid(R, N, routing, meta["NUM_SMS"])](*args, rb, first_group, 0 if wait is None else wait[1], *strides,
                                                **meta)
    return out


def moe_gemm_with_config(a: torch.Tensor, w: torch.Tensor, routing: MoeRouting, config: triton.Config, *,
                         a_order: str = "token", out: Optional[torch.Tensor] = None, out_order: str = "sorted",
                         weights: Optional[torch.Tensor] = None, tile_order: str = "expert_bands") -> torch.Tensor:
    """:func:`moe_gemm` launching ``moe_gemm_jit`` directly with one config (no tuner)."""
    out, args, strides, meta = _prepare(a, w, routing, a_order, out, out_order, weights, "moe_gemm_with_config",
                                        tile_order=tile_order)
    ok, why = moe_config_is_valid(config, a.dtype)
    if not ok:
        raise ValueError(f"moe_gemm_with_config: invalid config [{config}]: {why}")
    R, N = out.shape
    if R == 0 or N == 0:
        return out
    if a.shape[1] == 0:
        return out.zero_()
    kw = config.kwargs
    grid = _grid(R, N, routing, meta["NUM_SMS"])({**kw, **meta})
    moe_gemm_jit[grid](*args, next_power_of_2(R), 0, 0, *strides, **meta, **kw,
                       num_warps=config.num_warps, num_stages=config.num_stages)
    return out


def silu_and_mul(h: torch.Tensor) -> torch.Tensor:
    """``silu(h[:, :I]) * h[:, I:]`` for ``h [R, 2I]`` (gate first, then up), computed in fp32."""
    if h.dim() != 2 or h.shape[1] % 2:
        raise ValueError(f"silu_and_mul: h must be [rows, 2 * I], got shape {tuple(h.shape)}")
    gate, up = h.float().chunk(2, dim=1)
    return (F.silu(gate) * up).to(h.dtype)


def _topk_sum(y_flat: torch.Tensor, T: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    return y_flat.view(T, k, -1).sum(dim=1, dtype=torch.float32).to(dtype)


def _check_token_routing(where: str, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: Optional[torch.Tensor],
                   num_experts: int, check_range: bool) -> None:
    """The routing of ``x``'s tokens: valid ids, one row per token, weights shaped like the ids."""
    _check_topk_ids(topk_ids, num_experts, where, check_range=check_range)
    if topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"{where}: topk_ids has {topk_ids.shape[0]} rows but x has {x.shape[0]} tokens")
    if topk_weights is not None and tuple(topk_weights.shape) != tuple(topk_ids.shape):
        raise ValueError(f"{where}: topk_weights must have topk_ids' shape {tuple(topk_ids.shape)}, "
                         f"got {tuple(topk_weights.shape)}")


def _check_mlp(x, topk_ids, topk_weights, w_gate_up, w_down, where):
    _check_float(where, "x", x)
    if x.dim() != 2:
        raise ValueError(f"{where}: x must be 2-D [tokens, H], got shape {tuple(x.shape)}")
    for name, t in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        _check_float(where, name, t)
        if t.dim() != 3:
            raise ValueError(f"{where}: {name} must be 3-D, got shape {tuple(t.shape)}")
    E, H, I2 = w_gate_up.shape
    if I2 % 2:
        raise ValueError(f"{where}: w_gate_up must be [E, H, 2 * I] (gate then up), got last dim {I2}")
    if tuple(w_down.shape) != (E, I2 // 2, H):
        raise ValueError(f"{where}: w_down must be [E, I, H] = {(E, I2 // 2, H)} to match w_gate_up "
                         f"{tuple(w_gate_up.shape)}, got {tuple(w_down.shape)}")
    if x.shape[1] != H:
        raise ValueError(f"{where}: x has H={x.shape[1]} but w_gate_up is [E, H={H}, 2I]")
    _check_token_routing(where, x, topk_ids, topk_weights, E, check_range=False)
    _check_device(where, x, topk_ids=topk_ids, topk_weights=topk_weights, w_gate_up=w_gate_up, w_down=w_down)
    return E


def moe_mlp(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: Optional[torch.Tensor],
            w_gate_up: torch.Tensor, w_down: torch.Tensor, *, kernel=None,
            routing: Optional[MoeRouting] = None, check_ids: bool = True,
            bucket: Callable[[int], int] = next_power_of_2) -> torch.Tensor:
    """The MoE MLP: ``sum_j w[t,j] * (silu(x[t] @ Wg[e]) * (x[t] @ Wu[e])) @ Wd[e]``, ``e = topk_ids[t, j]``.

    ``w_gate_up [E, H, 2I]`` (gate columns first), ``w_down [E, I, H]``; ``topk_weights``
    ``[T, top_k]`` or None (all ones). Two grouped GEMM launches (gate-up: token-gathered A,
    sorted C; down: sorted A, flat C, weight in the epilogue) plus torch for routing,
    SiLU-gating and the top-k sum. Returns ``[T, H]`` in x's dtype. ``check_ids=False`` skips
    the range check of the expert ids (one host sync on a GPU).
    """
    E = _check_mlp(x, topk_ids, topk_weights, w_gate_up, w_down, "moe_mlp")
    routing = routing if routing is not None else moe_align(topk_ids, E, check_range=check_ids)
    T, k = topk_ids.shape
    h = moe_gemm(x, w_gate_up, routing, a_order="token", out_order="sorted", kernel=kernel, bucket=bucket)
    g = silu_and_mul(h)
    y = moe_gemm(g, w_down, routing, a_order="sorted", out_order="flat", weights=topk_weights,
                 kernel=kernel, bucket=bucket)
    return _topk_sum(y, T, k, x.dtype)


# --------------------------------------------------------------------------- multi-rank


def _group_info(group):
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call disttune.dist.init() first")
    return dist, dist.get_rank(group), dist.get_world_size(group)


#: Codes of the float dtypes in the cross-rank signature (0: no tensor, -1: not known).
_DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3}
#: (group, signature) pairs whose inputs every rank has agreed on, for calls with ``tokens_per_rank``.
_agreed: set = set()


def _shape_of(t, dims: int) -> Optional[tuple]:
    """``t``'s shape if it is a tensor with ``dims`` dimensions, else None (for messages and signatures)."""
    return tuple(t.shape) if isinstance(t, torch.Tensor) and t.dim() == dims else None


def _dtype_code(t) -> int:
    if t is None:
        return 0
    return _DTYPE_CODES.get(getattr(t, "dtype", None), -1)


def _agree_on_inputs(where: str, group, rank: int, world: int, tokens: int, signature: tuple, described: dict,
                     local_error: Optional[Exception], given: Optional[tuple], out_rows: int,
                     top_k: int) -> tuple[int, ...]:
    """Every rank's token count, after making sure every rank's input is valid and agrees with the others'.

    One all-gather of a row of int64 per rank (token count, ``signature`` ints, ``out_rows``, an error
    flag) and one host sync: the token-count gather AG-MoE needs anyway. If any rank's local checks
    failed (``local_error``), the signatures differ, or an ``out`` buffer (``out_rows``, -1 for none)
    does not have ``sum(tokens) * top_k`` rows, every rank raises the same ValueError, listing each
    rank's inputs (one more, object all-gather, on that path only), instead of one rank raising
    and the others waiting in the next collective. With ``given`` token counts (``tokens_per_rank``:
    no host sync, as CUDA-graph capture needs) the gather runs only the first time a signature is
    seen; later calls check locally only.
    """
    from .tp_common import GroupInfo, check_same_on_all_ranks

    import torch.distributed as dist

    key = (id(group), signature)
    if given is not None and key in _agreed:
        if local_error is not None:
            raise local_error
        return given
    refuse_capture(where, "run it once eagerly with the same inputs first (the ranks check then that their inputs "
                          "agree)")
    device = torch.device("cuda", torch.cuda.current_device()) if uses_nccl(group) else torch.device("cpu")
    row = torch.tensor([tokens, *signature, out_rows, int(local_error is not None)], dtype=torch.int64,
                       device=device)
    rows = [torch.empty_like(row) for _ in range(world)]
    dist.all_gather(rows, row, group=group)
    table = torch.stack(rows).tolist()  # one host sync
    if any(r[-1] for r in table) or any(r[1:-2] != table[0][1:-2] for r in table):
        info = GroupInfo(group, rank, world, dist.get_backend(group))
        message = None if local_error is None else f"{type(local_error).__name__}: {local_error}"
        check_same_on_all_ranks(info, where, tuple(table[rank][1:-2]), described, message)
        raise RuntimeError(f"{where}: the ranks' inputs disagree but the check found no difference")  # unreachable
    tpr = given if given is not None else tuple(r[0] for r in table)
    want = sum(tpr) * top_k
    wrong = [r for r, entry in enumerate(table) if entry[-2] not in (-1, want)]
    if wrong:
        raise ValueError(f"{where}: out must have {want} rows (sum of tokens over ranks * top_k), but rank(s) "
                         f"{wrong} passed " + ", ".join(str(table[r][-2]) for r in wrong) + " (every rank raises this)")
    if given is not None:
        _agreed.add(key)
    return tpr


@dataclass
class AgMoeResult:
    """What :func:`ag_moe` returns.

    ``out`` ``[sum_r T_r * top_k, N]``: rank r's chunk at rows ``row_offsets[r]:row_offsets[r+1]``,
    each chunk in the sorted order of ``routings[r]`` (``routings[r].unsort(chunk)`` gives flat
    (token, choice) order). ``routing`` is the rank-stacked routing of all of them (one group per
    source rank and expert); ``routings`` its per-rank views, built on first use.
    ``topk_ids`` / ``topk_weights`` are the gathered routing ``[sum_r T_r, top_k]`` in rank order
    (``topk_ids`` a strided view into the gathered rows).
    """

    out: torch.Tensor
    routing: MoeRouting
    tokens_per_rank: tuple
    row_offsets: tuple
    topk_ids: torch.Tensor
    topk_weights: Optional[torch.Tensor]

    @functools.cached_property
    def routings(self) -> tuple:
        return self.routing.per_rank()

    def chunk(self, r: int) -> torch.Tensor:
        return self.out[self.row_offsets[r]:self.row_offsets[r + 1]]


def ag_moe(x: torch.Tensor, topk_ids: torch.Tensor, w: torch.Tensor, *,
           topk_weights: Optional[torch.Tensor] = None, group=None,
           tokens_per_rank: Optional[Sequence[int]] = None, kernel=None,
           out: Optional[torch.Tensor] = None, check_ids: bool = True,
           bucket: Callable[[int], int] = next_power_of_2, graph_safe: bool = False) -> AgMoeResult:
    """AllGather-MoE: gather every rank's tokens ``x [T_r, H]`` and routing, then the grouped GEMM
    ``[tokens of all ranks] x w [E, H, N]`` (N: this rank's slice of the expert columns).

    ``out``: optional ``[sum_r T_r * top_k, N]`` buffer (else allocated). Uneven ``T_r`` allowed
    (``tokens_per_rank`` skips one small all-gather + host sync).

    One routing and one GEMM launch for all ranks: the gathered ids are sorted by (source rank,
    expert) (:func:`moe_align_stacked`), so each rank's rows stay contiguous and the GEMM walks its
    tiles from the launching rank's own tokens on. On NCCL GPUs the tokens travel first, by
    copy-engine pushes into the peers' symmetric memory (``kernels.symm.ShardPusher``: no SM
    taken from the GEMM, no barrier), while the routing is all-gathered (one small collective:
    ids bit-cast into a float32 row next to the weights) and sorted; tiles of another rank's
    tokens spin on that rank's arrival flag, so the GEMM computes the local tokens while the rest
    arrive. Elsewhere (gloo) the tokens are all-gathered first and the same kernel runs without
    waiting. The tuning key holds the bucket of the *global* row count, the same on every rank.
    Host syncs: the token counts (unless ``tokens_per_rank``) and the id range check on every
    rank's ids (unless ``check_ids=False``).

    Inputs that are bad on one rank, or valid on each but inconsistent across ranks (hidden size,
    dtypes, expert count, top-k, weights given or not, ``tokens_per_rank``, ``graph_safe``), raise
    the same ValueError on every rank instead of a hang or a silently wrong result: the token-count
    gather carries each rank's input signature (with ``tokens_per_rank``, only a signature's first
    call gathers it; later calls check locally).

    ``graph_safe=True``: the call can be captured in a CUDA graph (``torch.cuda.graph``) and
    replayed. It needs ``tokens_per_rank`` and ``check_ids=False`` (no host sync), pushes with
    fixed flag values (``ShardPusher(graph_safe=True)``, its own workspace) and must run once
    eagerly with the same shapes before capture (the workspace is allocated then). A replay costs
    the host a few µs where an eager call costs hundreds (docs/moe.md, "CUDA graphs").
    """
    return _ag_moe(x, topk_ids, w, topk_weights=topk_weights, group=group, tokens_per_rank=tokens_per_rank,
                   kernel=kernel, out=out, check_ids=check_ids, bucket=bucket, graph_safe=graph_safe)


def _ag_moe(x, topk_ids, w, *, topk_weights, group, tokens_per_rank, kernel, out, check_ids, bucket, graph_safe,
            where: str = "ag_moe", extra_check: Optional[Callable[[], None]] = None) -> AgMoeResult:
    """:func:`ag_moe`; ``extra_check`` (a caller's own input check, raising TypeError/ValueError) runs
    with the local checks, so its error too is raised on every rank."""
    dist, rank, world = _group_info(group)
    _check_graph_safe(where, graph_safe, tokens_per_rank, check_ids)
    given = None if tokens_per_rank is None else tuple(int(t) for t in tokens_per_rank)

    def local_checks() -> None:
        if extra_check is not None:
            extra_check()
        _check_float(where, "x", x)
        _check_float(where, "w", w)
        if x.dim() != 2 or w.dim() != 3:
            raise ValueError(f"{where}: x must be [T_r, H] and w [E, H, N], got {tuple(x.shape)} and {tuple(w.shape)}")
        if x.shape[1] != w.shape[1]:
            raise ValueError(f"{where}: x has H={x.shape[1]} but w is [E, H={w.shape[1]}, N]")
        # expert ids are range-checked after the routing gather, on every rank's ids at once
        _check_token_routing(where, x, topk_ids, topk_weights, w.shape[0], check_range=False)
        _check_device(where, x, topk_ids=topk_ids, topk_weights=topk_weights, w=w)
        if given is not None:
            if len(given) != world:
                raise ValueError(f"{where}: tokens_per_rank has {len(given)} entries but the group has {world} ranks")
            if given[rank] != x.shape[0]:
                raise ValueError(f"{where}: tokens_per_rank[{rank}] = {given[rank]} but this rank has "
                                 f"{x.shape[0]} tokens")
        if out is not None:
            _check_float(where, "out", out)
            if out.dim() != 2 or out.shape[1] != w.shape[2]:
                raise ValueError(f"{where}: out must be [sum of tokens over ranks * top_k, N={w.shape[2]}] "
                                 f"(w's N), got {tuple(out.shape)}")
            if given is not None and out.shape[0] != sum(given) * topk_ids.shape[1]:
                raise ValueError(f"{where}: out has {out.shape[0]} rows, expected {sum(given) * topk_ids.shape[1]} "
                                 "(sum of tokens over ranks * top_k)")

    try:
        local_checks()
        local_error = None
    except (TypeError, ValueError) as err:
        local_error = err
    xs, ws, ids_s = _shape_of(x, 2), _shape_of(w, 3), _shape_of(topk_ids, 2)
    signature = (xs[1] if xs else -1, ids_s[1] if ids_s else -1, ws[0] if ws else -1, _dtype_code(x), _dtype_code(w),
                 _dtype_code(topk_weights), int(graph_safe), int(given is not None),
                 hash(given) & 0x3FFFFFFFFFFF if given is not None else 0)
    described = {"x": xs, "x dtype": str(getattr(x, "dtype", None)), "w": ws, "topk_ids": ids_s,
                 "topk_weights": None if topk_weights is None else str(getattr(topk_weights, "dtype", None)),
                 "tokens_per_rank": given, "graph_safe": graph_safe}
    out_rows = out.shape[0] if isinstance(out, torch.Tensor) and out.dim() == 2 else -1
    tpr = _agree_on_inputs(where, group, rank, world, xs[0] if xs else -1, signature, described, local_error, given,
                           out_rows, ids_s[1] if ids_s else 1)
    E, H, N = w.shape
    dev, k = x.device, topk_ids.shape[1]
    row_offsets = tuple(itertools.accumulate((t * k for t in tpr), initial=0))
    if out is None:
        out = _empty((row_offsets[-1], N), x.dtype, dev)

    # 1. tokens first: pushed on the copy engines (GPUs) or all-gathered (elsewhere)
    pusher = _pusher(group, graph_safe) if x.is_cuda and uses_nccl(group) else None
    if pusher is not None:
        x_all = pusher.gather(x.contiguous(), tpr, include_own=True)
    else:
        x_all = _gather_rows(dist, x, tpr, group)
    # 2. every rank's routing: one collective, then one sort by (source rank, expert)
    ids_all, weights_all = _gather_routing(dist, topk_ids, topk_weights, tpr, group)
    if check_ids:
        _check_gathered_ids(where, ids_all, E, tpr, pusher)
    routing = moe_align_stacked(ids_all, E, tpr)
    # 3. one GEMM over all ranks' tokens, own tokens first; other ranks' tiles wait for their arrival
    if row_offsets[-1]:
        moe_gemm(x_all, w, routing, a_order="token", out=out, out_order="sorted", kernel=kernel,
                 rows_bucket=int(bucket(row_offsets[-1])), first_group=rank * E,
                 wait=(pusher.arrival_flags, pusher.epoch) if pusher is not None else None)
    if pusher is not None:
        pusher.finish()
    return AgMoeResult(out, routing, tpr, row_offsets, ids_all, weights_all)


def _check_gathered_ids(where: str, ids_all: torch.Tensor, E: int, tpr: tuple, pusher) -> None:
    """Every rank's expert ids in ``[0, E)``: checked on the gathered ids, so every rank raises the same
    error naming the ranks whose router gave bad ids (one host sync)."""
    if not ids_all.numel():
        return
    lo, hi = torch.stack(torch.aminmax(ids_all)).tolist()
    if lo >= 0 and hi < E:
        return
    bad_rows = ((ids_all < 0) | (ids_all >= E)).any(dim=1).nonzero().flatten().tolist()
    starts = list(itertools.accumulate(tpr))
    ranks = sorted({bisect.bisect_right(starts, row) for row in bad_rows})
    if pusher is not None:
        pusher.finish()  # the tokens were pushed: release them, or the next call waits for them forever
    raise ValueError(f"{where}: expert ids must lie in [0, {E}), got values in [{lo}, {hi}] from rank(s) {ranks}; "
                     "check the router's output and num_experts (every rank raises this)")


def _gather_rows(dist, x: torch.Tensor, tpr: tuple, group) -> torch.Tensor:
    """Every rank's rows of ``x``, concatenated in rank order (a collective; padded to the largest rank)."""
    max_t = max(tpr)
    x_pad = x if x.shape[0] == max_t else torch.cat([x, x.new_zeros(max_t - x.shape[0], x.shape[1])])
    gathered = _empty((len(tpr) * max_t, x.shape[1]), x.dtype, x.device)
    _all_gather(dist, gathered, x_pad.contiguous(), group)
    if all(t == max_t for t in tpr):
        return gathered
    return torch.cat([gathered[r * max_t: r * max_t + t] for r, t in enumerate(tpr)])


def _gather_routing(dist, topk_ids: torch.Tensor, topk_weights: Optional[torch.Tensor], tpr: tuple,
                    group) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Every rank's ``topk_ids`` (int32) and ``topk_weights``, in rank order: one all-gather of float32
    rows (ids bit-cast, then the weights), padded to the largest rank."""
    T, k = topk_ids.shape
    max_t, world = max(tpr), len(tpr)
    parts = [topk_ids.to(torch.int32).view(torch.float32)]
    if topk_weights is not None:
        parts.append(topk_weights.float())
    meta = torch.cat(parts, dim=1)
    if T != max_t:
        meta = torch.cat([meta, meta.new_zeros(max_t - T, meta.shape[1])])
    metas = torch.empty(world * max_t, meta.shape[1], dtype=torch.float32, device=meta.device)
    _all_gather(dist, metas, meta, group)
    if any(t != max_t for t in tpr):
        metas = torch.cat([metas[r * max_t: r * max_t + t] for r, t in enumerate(tpr)])
    ids_all = metas[:, :k].view(torch.int32)  # a strided view: moe_align_stacked reads it as it is
    weights_all = metas[:, k:].to(topk_weights.dtype) if topk_weights is not None else None
    return ids_all, weights_all


def _check_graph_safe(where: str, graph_safe: bool, tokens_per_rank, check_ids: bool) -> None:
    """A call being captured in a CUDA graph must be graph-safe and must not synchronize with the host."""
    if not graph_safe:
        refuse_capture(where, "pass graph_safe=True, tokens_per_rank and check_ids=False (without graph_safe its "
                              "arrival flags carry a per-call epoch that every replay would repeat)")
        return
    if tokens_per_rank is None or check_ids:
        raise ValueError(f"{where}(graph_safe=True) must not synchronize with the host: pass tokens_per_rank "
                         f"(got {tokens_per_rank!r}) and check_ids=False (got {check_ids!r}); check the expert ids "
                         "once outside the graph instead")


_pushers: dict = {}


def _pusher(group, graph_safe: bool = False):
    """The cached ``kernels.symm.ShardPusher`` of ``group`` (symmetric-memory token gather); the
    graph-safe one is a separate pusher with its own workspace and flags."""
    from .symm import ShardPusher, overlap_support

    key = (id(group), graph_safe)
    if key not in _pushers:
        ok, why = overlap_support(group)
        if not ok:
            raise RuntimeError(f"ag_moe: the overlapped GPU token gather is unavailable: {why}")
        _pushers[key] = ShardPusher(group, graph_safe=graph_safe)
    return _pushers[key]


def _all_gather(dist, out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = False):
    """all_gather_into_tensor on NCCL; the list form elsewhere (gloo has no all_gather_into_tensor)."""
    if out.is_cuda and uses_nccl(group):
        return dist.all_gather_into_tensor(out, inp, group=group, async_op=async_op)
    world = out.shape[0] // inp.shape[0] if inp.shape[0] else dist.get_world_size(group)
    return dist.all_gather(list(out.chunk(world)), inp, group=group, async_op=async_op)


def moe_rs(h: torch.Tensor, routings: Sequence[MoeRouting], topk_weights: Optional[torch.Tensor],
           w: torch.Tensor, *, group=None, kernel=None,
           bucket: Callable[[int], int] = next_power_of_2) -> torch.Tensor:
    """MoE-ReduceScatter: down-projection grouped GEMM, top-k weighted sum and reduction to the
    ranks that own the tokens. Returns this rank's ``[T_rank, H]`` (the sum over ranks).

    ``h [sum_r T_r * top_k, K]``: rank r's rows (at ``sum_{q<r} T_q * top_k``) in the sorted
    order of ``routings[r]`` (what :func:`ag_moe` gives, after the activation); ``w [E, K, H]``
    (this rank's slice of K); ``topk_weights [sum_r T_r, top_k]`` or None (all ones), in rank
    order. Destination by destination (same order on every rank): GEMM with the weight in
    the epilogue and flat output, top-k sum in fp32, cast to h's dtype, then an asynchronous
    ``dist.reduce`` to the owner, which runs while the next destination's chunk computes.
    Uneven token counts need no padding. One GEMM key (bucket of the global rows) for all.

    Inputs bad on one rank or inconsistent across ranks (H, expert count, dtypes, token counts,
    weights given or not) raise the same ValueError on every rank: the first call with a given
    signature (shapes, dtypes and every rank's token count) all-gathers it once (one small
    collective and a host sync; not allowed during CUDA-graph capture, so run it eagerly first);
    later calls with that signature check locally only. :func:`tp_moe_layer` skips this, its
    :func:`ag_moe` has checked already.
    """
    return _moe_rs(h, routings, topk_weights, w, group=group, kernel=kernel, bucket=bucket, check_across_ranks=True)


#: Per group, the moe_rs signatures every rank has agreed on.
_moe_rs_agreed: dict = {}


def _check_moe_rs(where: str, h, routings, topk_weights, w, world: int) -> None:
    """moe_rs's local input checks (TypeError/ValueError)."""
    _check_float(where, "h", h)
    _check_float(where, "w", w)
    if h.dim() != 2 or w.dim() != 3:
        raise ValueError(f"{where}: h must be [rows, K] and w [E, K, H], got {tuple(h.shape)} and {tuple(w.shape)}")
    if len(routings) != world:
        raise ValueError(f"{where}: {len(routings)} routings given for a group of {world} ranks (one per rank)")
    E, K, H = w.shape
    if h.shape[1] != K:
        raise ValueError(f"{where}: h has {h.shape[1]} columns but w is [E, K={K}, H]")
    for r, rt in enumerate(routings):
        _check_routing(where, rt, h.device)
        if rt.num_experts != E:
            raise ValueError(f"{where}: routings[{r}] has {rt.num_experts} experts, w has {E}")
    rows = sum(rt.num_rows for rt in routings)
    if h.shape[0] != rows:
        raise ValueError(f"{where}: h has {h.shape[0]} rows but the routings cover {rows} (sum of T_r * top_k)")
    tokens = sum(rt.num_tokens for rt in routings)
    if topk_weights is not None and tuple(topk_weights.shape) != (tokens, routings[0].top_k):
        raise ValueError(f"{where}: topk_weights must be [{tokens}, {routings[0].top_k}], "
                         f"got {tuple(topk_weights.shape)}")
    _check_device(where, h, w=w, topk_weights=topk_weights)


def _moe_rs_signature(h, routings, topk_weights, w) -> tuple[tuple, dict]:
    """What every rank's moe_rs call must agree on (ints, for the cross-rank check) and its description."""
    hs, ws = _shape_of(h, 2), _shape_of(w, 3)
    tokens = tuple(getattr(rt, "num_tokens", -1) for rt in routings) if isinstance(routings, Sequence) else ()
    top_k = tuple(getattr(rt, "top_k", -1) for rt in routings) if isinstance(routings, Sequence) else ()
    # not K: each rank's slice of it may differ
    signature = (hs[0] if hs else -1, ws[0] if ws else -1, ws[2] if ws else -1, _dtype_code(h), _dtype_code(w),
                 _dtype_code(topk_weights), tokens, top_k)
    described = {"h": hs, "h dtype": str(getattr(h, "dtype", None)), "w": ws,
                 "topk_weights": None if topk_weights is None else str(getattr(topk_weights, "dtype", None)),
                 "tokens per rank": tokens, "top_k": top_k[:1]}
    return signature, described


def _moe_rs(h, routings, topk_weights, w, *, group, kernel, bucket, check_across_ranks: bool) -> torch.Tensor:
    """:func:`moe_rs`; ``check_across_ranks=False`` when the caller has already made the ranks agree."""
    from .tp_common import GroupInfo, check_inputs

    dist, rank, world = _group_info(group)
    where = "moe_rs"
    if check_across_ranks:
        signature, described = _moe_rs_signature(h, routings, topk_weights, w)
        agreed = _moe_rs_agreed.setdefault(id(group), set())
        if signature not in agreed:
            refuse_capture(where, "run it once eagerly with the same inputs first (the ranks check then that their "
                                  "inputs agree)")
        check_inputs(GroupInfo(group, rank, world, dist.get_backend(group)), where, agreed, signature, described,
                     lambda: _check_moe_rs(where, h, routings, topk_weights, w, world))
    else:
        _check_moe_rs(where, h, routings, topk_weights, w, world)
    H = w.shape[2]
    rows = [rt.num_rows for rt in routings]
    rows_bucket = int(bucket(sum(rows)))
    row_off, tok_off, works, mine = 0, 0, [], None
    for r, rt in enumerate(routings):
        T, k = rt.num_tokens, rt.top_k
        part_h = h[row_off: row_off + rows[r]]
        wts = topk_weights[tok_off: tok_off + T] if topk_weights is not None else None
        partial = _empty((T, H), h.dtype, h.device)
        if T:
            y = moe_gemm(part_h, w, rt, a_order="sorted", out_order="flat", weights=wts, kernel=kernel,
                         rows_bucket=rows_bucket)
            partial = _topk_sum(y, T, k, h.dtype)
        else:
            partial.zero_()
        dst = dist.get_global_rank(group, r) if group is not None else r
        if T:
            works.append(dist.reduce(partial, dst=dst, group=group, async_op=True))
        if r == rank:
            mine = partial
        row_off += rows[r]
        tok_off += T
    for work in works:
        work.wait()
    return mine


def tp_moe_layer(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: Optional[torch.Tensor],
                 w_gate_up: torch.Tensor, w_down: torch.Tensor, *, group=None,
                 tokens_per_rank: Optional[Sequence[int]] = None, kernel=None, check_ids: bool = True,
                 bucket: Callable[[int], int] = next_power_of_2, graph_safe: bool = False) -> torch.Tensor:
    """Tensor-parallel MoE MLP: :func:`ag_moe` (gate-up) -> SiLU-gating -> :func:`moe_rs` (down).

    Each rank: its tokens ``x [T_r, H]`` with routing, its slice of every expert
    ``w_gate_up [E, H, 2 * I_r]`` (its gate columns then its up columns) and
    ``w_down [E, I_r, H]``. Returns ``[T_r, H]``: what :func:`moe_mlp` gives on the full weights.
    ``graph_safe``: as :func:`ag_moe` (the whole layer can then be captured in a CUDA graph).
    """
    # the MLP check runs with ag_moe's own, so a bad input on one rank is an error on every rank
    gathered = _ag_moe(x, topk_ids, w_gate_up, topk_weights=topk_weights, group=group,
                       tokens_per_rank=tokens_per_rank, kernel=kernel, out=None, check_ids=check_ids, bucket=bucket,
                       graph_safe=graph_safe, where="tp_moe_layer",
                       extra_check=lambda: _check_mlp(x, topk_ids, topk_weights, w_gate_up, w_down, "tp_moe_layer"))
    g = silu_and_mul(gathered.out)
    return _moe_rs(g, gathered.routings, gathered.topk_weights, w_down, group=group, kernel=kernel, bucket=bucket,
                   check_across_ranks=False)


# --------------------------------------------------------------------------- references


def moe_gemm_reference(x: torch.Tensor, topk_ids: torch.Tensor, w: torch.Tensor,
                       weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-expert torch loop: ``[T * top_k, N]`` in flat (token, choice) order, fp32 accumulate,
    result in x's dtype. ``x [T, K]``, ``w [E, K, N]``."""
    T, k = topk_ids.shape
    flat = topk_ids.reshape(-1).long()
    src = torch.arange(T * k, device=x.device) // k
    out = torch.zeros(T * k, w.shape[2], dtype=torch.float32, device=x.device)
    for e in range(w.shape[0]):
        rows = (flat == e).nonzero().flatten()
        if rows.numel():
            out[rows] = x[src[rows]].float() @ w[e].float()
    if weights is not None:
        out *= weights.reshape(-1, 1).float()
    return out.to(x.dtype)


def moe_mlp_reference(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: Optional[torch.Tensor],
                      w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """Per-expert torch reference of :func:`moe_mlp` (fp32 throughout, result in x's dtype)."""
    T, k = topk_ids.shape
    h = moe_gemm_reference(x.float(), topk_ids, w_gate_up.float())
    gate, up = h.chunk(2, dim=1)
    g = F.silu(gate) * up
    flat = topk_ids.reshape(-1).long()
    y = torch.zeros(T * k, w_down.shape[2], dtype=torch.float32, device=x.device)
    for e in range(w_down.shape[0]):
        rows = (flat == e).nonzero().flatten()
        if rows.numel():
            y[rows] = g[rows] @ w_down[e].float()
    if topk_weights is not None:
        y *= topk_weights.reshape(-1, 1).float()
    return y.view(T, k, -1).sum(1).to(x.dtype)
