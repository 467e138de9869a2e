"""MoE-ReduceScatter: the down-projection grouped GEMM per destination rank, reduced to its owner.

:func:`moe_rs` is the second half of the tensor-parallel MoE layer: every rank multiplies each
destination rank's rows by its slice of the down weights (weight in the epilogue, flat output), sums
the top-k choices in fp32 and reduces the result to the rank that owns the tokens, asynchronously,
while the next destination's chunk computes. Cost: one GEMM launch and one ``dist.reduce`` per rank
with tokens; a signature's first call adds one small all-gather and a host sync (the cross-rank input check).

:func:`moe_rs_stacked` is the form ``kernels.moe.tp_moe_layer`` runs: one GEMM launch over every
destination's rows (the routing :func:`~kernels.moe_ag.ag_moe` returns, rank-stacked or gathered), one top-k sum and
one reduce-scatter. It hides no communication, but its host cost does not grow with the ranks.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from .moe_combine import topk_sum
from .moe_common import (PassedChecks, check_device, check_float_tensor, dtype_code, empty_buffer, shape_of,
                          tensor_layout)
from .moe_gemm import moe_gemm, next_power_of_2
from .moe_routing import MoeRouting, check_routing
from .symm import refuse_capture, uses_nccl
from .tp_common import check_inputs, group_info

__all__ = ["moe_rs", "moe_rs_stacked"]


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
    later calls with that signature check locally only.
    """
    info = group_info(group)
    rank, world = info.rank, info.world_size
    where = "moe_rs"
    signature, described = _moe_rs_signature(h, routings, topk_weights, w)
    agreed = _agreed_signatures.setdefault(id(group), set())
    if signature not in agreed:
        refuse_capture(where, "run it once eagerly with the same inputs first (the ranks check then that their "
                              "inputs agree)")
    check_inputs(info, where, agreed, signature, described,
                 lambda: _check_moe_rs(where, h, routings, topk_weights, w, world))
    H = w.shape[2]
    rows = [rt.num_rows for rt in routings]
    rows_bucket = int(bucket(sum(rows)))
    row_off, tok_off, works, mine = 0, 0, [], None
    for r, rt in enumerate(routings):
        T, k = rt.num_tokens, rt.top_k
        part_h = h[row_off: row_off + rows[r]]
        wts = topk_weights[tok_off: tok_off + T] if topk_weights is not None else None
        partial = empty_buffer((T, H), h.dtype, h.device)
        if T:
            y = moe_gemm(part_h, w, rt, a_order="sorted", out_order="flat", weights=wts, kernel=kernel,
                         rows_bucket=rows_bucket)
            partial = topk_sum(y, T, k, h.dtype)
        else:
            partial.zero_()
        if T:
            works.append(dist.reduce(partial, dst=_global_rank(group, r), group=group, async_op=True))
        if r == rank:
            mine = partial
        row_off += rows[r]
        tok_off += T
    for work in works:
        work.wait()
    return mine


#: Per group, the moe_rs signatures every rank has agreed on.
_agreed_signatures: dict = {}


def _check_moe_rs(where: str, h, routings, topk_weights, w, world: int) -> None:
    """moe_rs's local input checks (TypeError/ValueError)."""
    check_float_tensor(where, "h", h)
    check_float_tensor(where, "w", w)
    if h.dim() != 2 or w.dim() != 3:
        raise ValueError(f"{where}: h must be [rows, K] and w [E, K, H], got {tuple(h.shape)} and {tuple(w.shape)}")
    if len(routings) != world:
        raise ValueError(f"{where}: {len(routings)} routings given for a group of {world} ranks (one per rank)")
    E, K, H = w.shape
    if h.shape[1] != K:
        raise ValueError(f"{where}: h has {h.shape[1]} columns but w is [E, K={K}, H]")
    for r, rt in enumerate(routings):
        check_routing(where, rt, h.device)
        if rt.num_experts != E:
            raise ValueError(f"{where}: routings[{r}] has {rt.num_experts} experts, w has {E}")
    rows = sum(rt.num_rows for rt in routings)
    if h.shape[0] != rows:
        raise ValueError(f"{where}: h has {h.shape[0]} rows but the routings cover {rows} (sum of T_r * top_k)")
    tokens = sum(rt.num_tokens for rt in routings)
    if topk_weights is not None and tuple(topk_weights.shape) != (tokens, routings[0].top_k):
        raise ValueError(f"{where}: topk_weights must be [{tokens}, {routings[0].top_k}], "
                         f"got {tuple(topk_weights.shape)}")
    check_device(where, h, w=w, topk_weights=topk_weights)


def _moe_rs_signature(h, routings, topk_weights, w) -> tuple[tuple, dict]:
    """What every rank's moe_rs call must agree on (ints, for the cross-rank check) and its description."""
    hs, ws = shape_of(h, 2), shape_of(w, 3)
    tokens = tuple(getattr(rt, "num_tokens", -1) for rt in routings) if isinstance(routings, Sequence) else ()
    top_k = tuple(getattr(rt, "top_k", -1) for rt in routings) if isinstance(routings, Sequence) else ()
    # not K: each rank's slice of it may differ
    signature = (hs[0] if hs else -1, ws[0] if ws else -1, ws[2] if ws else -1, dtype_code(h), dtype_code(w),
                 dtype_code(topk_weights), tokens, top_k)
    described = {"h": hs, "h dtype": str(getattr(h, "dtype", None)), "w": ws,
                 "topk_weights": None if topk_weights is None else str(getattr(topk_weights, "dtype", None)),
                 "tokens per rank": tokens, "top_k": top_k[:1]}
    return signature, described


def moe_rs_stacked(h: torch.Tensor, routing: MoeRouting, topk_weights: Optional[torch.Tensor], w: torch.Tensor, *,
                   group=None, kernel=None, bucket: Callable[[int], int] = next_power_of_2) -> torch.Tensor:
    """MoE-ReduceScatter over every rank's rows of ``ag_moe``'s routing, for inputs the ranks have agreed on: one
    GEMM launch, one top-k sum, one reduction. Returns this rank's ``[T_rank, H]``, as :func:`moe_rs` does.

    ``h [sum_r T_r * top_k, K]`` in ``routing``'s sorted order (``ag_moe(...).out`` after the activation),
    ``routing`` rank-stacked or gathered (``ag_moe(...).routing``), ``topk_weights [sum_r T_r, top_k]`` in
    rank order.
    The reduction is one ``reduce_scatter_tensor`` under NCCL when every rank has as many tokens, else one
    ``dist.reduce`` per rank with tokens. Why one launch: per destination (:func:`moe_rs`) the GEMMs,
    top-k sums and reductions each cost the host a launch per rank, which at 2 and 4 ranks on H100 took
    longer than the communication they hid (docs/moe.md). Its input checks run once per layout of the inputs
    (shapes, strides, dtypes, devices, the routing's sizes); a call with a known layout skips them.
    """
    where = "moe_rs"
    info = group_info(group)
    key = _stacked_key(h, routing, topk_weights, w, info.world_size)
    if _passed_stacked.get(key) is None:
        _check_stacked(where, h, routing, topk_weights, w, info.world_size)
        _passed_stacked.add(key, True)
    T, k, H = routing.num_tokens, routing.top_k, w.shape[2]
    y = moe_gemm(h, w, routing, a_order="sorted", out_order="flat", weights=topk_weights, kernel=kernel,
                 rows_bucket=int(bucket(routing.num_rows)))
    summed = topk_sum(y, T, k, h.dtype) if T else empty_buffer((0, H), h.dtype, h.device)
    return _reduce_to_owners(summed, routing.rank_tokens, info.rank, group)


#: Layouts of moe_rs_stacked calls whose checks passed.
_passed_stacked = PassedChecks()


def _stacked_key(h, routing, topk_weights, w, world: int) -> Optional[tuple]:
    """Everything :func:`_check_stacked` reads, as a :class:`PassedChecks` key (None where an argument is not
    what it should be: the checks then say what is wrong)."""
    try:
        return (world, type(routing), routing.sorted_ids.device, routing.num_tokens, routing.top_k,
                routing.num_experts, len(routing.rank_tokens), tensor_layout(h), tensor_layout(topk_weights),
                tensor_layout(w))
    except (AttributeError, TypeError, RuntimeError):  # RuntimeError: a tensor without storage
        return None


def _check_stacked(where: str, h, routing, topk_weights, w, world: int) -> None:
    """moe_rs_stacked's local input checks (TypeError/ValueError)."""
    check_float_tensor(where, "h", h)
    check_float_tensor(where, "w", w)
    check_routing(where, routing, h.device)
    if len(routing.rank_tokens) != world:
        raise ValueError(f"{where}: the routing stacks {len(routing.rank_tokens)} ranks, the group has {world} "
                         "(pass ag_moe's routing)")
    if h.dim() != 2 or w.dim() != 3 or h.shape[1] != w.shape[1] or w.shape[0] != routing.num_experts:
        raise ValueError(f"{where}: h must be [rows, K] and w [E={routing.num_experts}, K, H], got "
                         f"{tuple(h.shape)} and {tuple(w.shape)}")
    if h.shape[0] != routing.num_rows:
        raise ValueError(f"{where}: h has {h.shape[0]} rows but the routing covers {routing.num_rows}")
    if topk_weights is not None and tuple(topk_weights.shape) != (routing.num_tokens, routing.top_k):
        raise ValueError(f"{where}: topk_weights must be [{routing.num_tokens}, {routing.top_k}], "
                         f"got {tuple(topk_weights.shape)}")
    check_device(where, h, w=w, topk_weights=topk_weights)


def _reduce_to_owners(summed: torch.Tensor, rank_tokens: Sequence[int], rank: int, group) -> torch.Tensor:
    """Each rank's rows of ``summed`` (every rank's tokens, in rank order) summed over the ranks, on that
    rank: one reduce-scatter where NCCL can (even token counts), else one reduce per rank with tokens."""
    if summed.is_cuda and uses_nccl(group) and len(set(rank_tokens)) == 1:
        mine = empty_buffer((rank_tokens[rank], summed.shape[1]), summed.dtype, summed.device)
        dist.reduce_scatter_tensor(mine, summed, group=group)
        return mine
    works, start, mine = [], 0, summed[:0]
    for r, tokens in enumerate(rank_tokens):
        rows = summed[start:start + tokens]
        if tokens:
            works.append(dist.reduce(rows, dst=_global_rank(group, r), group=group, async_op=True))
        if r == rank:
            mine = rows
        start += tokens
    for work in works:
        work.wait()
    return mine


def _global_rank(group, rank: int) -> int:
    """The job-wide rank of ``group``'s rank ``rank`` (what ``dist.reduce``'s ``dst`` takes)."""
    return dist.get_global_rank(group, rank) if group is not None else rank
