"""AllGather-MoE: every rank's tokens and routing gathered, then one grouped GEMM over all of them.

:func:`ag_moe` is the first half of the tensor-parallel MoE layer (each rank holds a slice of every
expert's intermediate dimension and its own tokens, possibly uneven). The gathered ids are sorted
by (source rank, expert), so one routing and one GEMM launch cover every rank, walking the
launching rank's own tokens first. A call without ``graph_safe`` (and any call on gloo) gathers every
rank's tokens, ids and weights (in one collective on NCCL) and sorts and multiplies in one launch: an eager call is
host-bound at these sizes, and its host time is set by how many library calls it makes. A ``graph_safe=True``
call gathers the routing first (one small all-gather); on NCCL GPUs (made to be captured in a CUDA graph, whose
host operations cost nothing on replay) it pushes the tokens on the copy engines into the peers' symmetric
memory while the routing is sorted, and tiles of another rank's tokens wait for its arrival flag (grouped per
expert: the GEMM waits for every rank's tokens once, on the stream). Cost: one grouped all-gather and one
launch (eager), or one small routing all-gather, the pushes, one sort and one GEMM launch (graph-safe), plus
one host sync for the token counts and one for the id range check unless ``tokens_per_rank`` / ``check_ids=False``
are given. ``graph_safe=True`` makes it capturable in a CUDA graph (fixed-value flags, no host sync).
"""

from __future__ import annotations

import bisect
import functools
import itertools
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from .moe_common import (PassedChecks, check_device, check_float_tensor, dtype_code, empty_buffer, shape_of,
                          tensor_layout)
from .moe_gemm import moe_gemm, next_power_of_2, sorting_launch
from .moe_routing import MoeRouting, check_token_routing, moe_align_ranks
from .symm import ShardPusher, overlap_support, refuse_capture, uses_nccl
from .tp_common import GroupInfo, check_same_on_all_ranks, group_info

__all__ = ["AG_MOE_LAYOUTS", "AgMoeResult", "ag_moe", "ag_moe_for_caller", "gather_routing", "gather_rows",
           "gather_tokens_and_routing", "layout_for", "token_pusher"]

#: How ag_moe groups the gathered rows: per (source rank, expert), per expert over every rank, or
#: whichever :func:`layout_for` picks for the token counts.
AG_MOE_LAYOUTS = ("rank", "expert", "auto")


#: (group, signature) pairs whose inputs every rank has agreed on, for calls with ``tokens_per_rank``.
_agreed: set = set()


def _agree_on_inputs(where: str, info: GroupInfo, tokens: int, signature: tuple, described: Callable[[], dict],
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
    group, rank, world = info.group, info.rank, info.world_size
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
        message = None if local_error is None else f"{type(local_error).__name__}: {local_error}"
        check_same_on_all_ranks(info, where, tuple(table[rank][1:-2]), described(), message)
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

    ``out`` ``[sum_r T_r * top_k, N]`` in ``routing``'s sorted order. With ``layout="rank"``: rank r's
    chunk at rows ``row_offsets[r]:row_offsets[r+1]``, each chunk in the sorted order of ``routings[r]``
    (``routings[r].unsort(chunk)`` gives flat (token, choice) order); ``routing`` is the rank-stacked
    routing of all of them (one group per source rank and expert); ``routings`` its per-rank views,
    built on first use. With ``layout="expert"``: one group per expert over every rank's tokens
    (``routing.unsort(out)`` gives flat order); ``routings`` and :meth:`chunk` raise.
    ``topk_ids`` / ``topk_weights`` are the gathered routing ``[sum_r T_r, top_k]`` in rank order (``topk_ids``
    as int32, the weights in their own dtype).
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
        if not self.routing.by_rank:
            raise ValueError("AgMoeResult.chunk: with layout='expert' a rank's rows are spread over the experts' "
                             "groups; unsort the whole output with routing.unsort, or call ag_moe with layout='rank'")
        return self.out[self.row_offsets[r]:self.row_offsets[r + 1]]


def ag_moe(x: torch.Tensor, topk_ids: torch.Tensor, w: torch.Tensor, *,
           topk_weights: Optional[torch.Tensor] = None, group=None,
           tokens_per_rank: Optional[Sequence[int]] = None, kernel=None,
           out: Optional[torch.Tensor] = None, check_ids: bool = True,
           bucket: Callable[[int], int] = next_power_of_2, graph_safe: bool = False,
           layout: str = "rank") -> AgMoeResult:
    """AllGather-MoE: gather every rank's tokens ``x [T_r, H]`` and routing, then the grouped GEMM
    ``[tokens of all ranks] x w [E, H, N]`` (N: this rank's slice of the expert columns).

    ``out``: optional ``[sum_r T_r * top_k, N]`` buffer (else allocated). Uneven ``T_r`` allowed
    (``tokens_per_rank`` skips one small all-gather + host sync).

    One routing and one GEMM launch for all ranks: the gathered ids are sorted by (source rank,
    expert) (as :func:`moe_align_stacked` sorts them), so each rank's rows stay contiguous and the GEMM walks its
    tiles from the launching rank's own tokens on. A call without ``graph_safe`` gathers every rank's tokens,
    ids and weights in one collective (:func:`gather_rows`: on NCCL one grouped all-gather, one c10d call),
    then sorts and multiplies in one launch (:func:`~.moe_gemm.moe_gemm_sorting`'s, through
    :func:`~.moe_gemm.sorting_launch`, without the checks the gathered routing passes by construction): at
    these sizes an eager call is host-bound, its host time set by the number of library calls (docs/moe.md,
    "Where an eager call's host time goes"). A graph-safe call gathers the routing first
    (:func:`gather_routing`); on NCCL GPUs its tokens travel by copy-engine pushes into the peers'
    symmetric memory (``kernels.symm.ShardPusher``: no SM taken from the GEMM, no barrier) while the routing
    is sorted; grouped by rank, tiles of another rank's tokens spin on that rank's arrival flag, so the GEMM
    computes the local tokens while the rest arrive.
    The tuning key holds the bucket of the *global* row count, the same on every rank.
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

    ``layout`` (one of :data:`AG_MOE_LAYOUTS`): ``"rank"`` groups the rows per (source rank, expert), so
    each rank's rows stay contiguous (:meth:`AgMoeResult.chunk`) and the GEMM computes the own tokens
    first; ``"expert"`` groups them per expert over every rank, so each expert's rows fill whole M-tiles
    (nearly every tile reads several ranks' tokens, so the stream waits for all of them before the GEMM,
    which then runs without arrival flags); ``"auto"``: :func:`layout_for`.
    Where a rank sends an expert few rows the tiles of ``"rank"`` are partly empty and the GEMM slower
    (docs/moe.md, "Grouping the gathered rows").
    """
    return ag_moe_for_caller(x, topk_ids, w, topk_weights=topk_weights, group=group, tokens_per_rank=tokens_per_rank,
                             kernel=kernel, out=out, check_ids=check_ids, bucket=bucket, graph_safe=graph_safe,
                             layout=layout)


def ag_moe_for_caller(x, topk_ids, w, *, topk_weights, group, tokens_per_rank, kernel, out, check_ids, bucket,
                      graph_safe, layout: str = "rank", where: str = "ag_moe",
                      extra_check: Optional[Callable[[], None]] = None,
                      extra_inputs: Optional[tuple] = None) -> AgMoeResult:
    """:func:`ag_moe` on behalf of a caller named ``where`` in errors; ``extra_check`` (the caller's own
    input check, raising TypeError/ValueError) runs with the local checks, so its error too is raised on
    every rank. ``extra_inputs``: the tensors ``extra_check`` reads besides this call's own.

    The local checks and the cross-rank signature depend only on the inputs' layout (shapes, strides,
    dtypes, devices, ``tokens_per_rank``, ``layout``, ``graph_safe``, ``check_ids``, the group's size and
    this rank), so a call with the layout of an earlier call that passed them skips them: a few µs of
    Python instead of tens. A call with ``extra_check`` but no ``extra_inputs`` is checked in full.
    """
    info = group_info(group)
    rank, world = info.rank, info.world_size
    _check_graph_safe(where, graph_safe, tokens_per_rank, check_ids)
    given = None if tokens_per_rank is None else tuple(int(t) for t in tokens_per_rank)
    key = _inputs_key(where, info, x, topk_ids, topk_weights, w, out, given, layout, graph_safe, check_ids,
                      extra_check, extra_inputs)
    signature, local_error = _passed_checks.get(key), None
    if signature is None:
        xs, ws, ids_s = shape_of(x, 2), shape_of(w, 3), shape_of(topk_ids, 2)  # None where not a tensor of that rank
        try:
            _check_locally(where, rank, world, x, topk_ids, topk_weights, w, out, given, layout, extra_check)
        except (TypeError, ValueError) as err:
            local_error = err
        signature = (xs[1] if xs else -1, ids_s[1] if ids_s else -1, ws[0] if ws else -1, dtype_code(x),
                     dtype_code(w), dtype_code(topk_weights), int(graph_safe), int(layout == "expert"),
                     int(given is not None), hash(given) & 0x3FFFFFFFFFFF if given is not None else 0)
        if local_error is None:
            _passed_checks.add(key, signature)
        tokens, top_k = xs[0] if xs else -1, ids_s[1] if ids_s else 1
    else:  # a layout whose checks passed: the inputs are tensors of the right ranks
        tokens, top_k = x.shape[0], topk_ids.shape[1]

    def described() -> dict:  # for the error message only: not built on every call
        return {"x": shape_of(x, 2), "x dtype": str(getattr(x, "dtype", None)), "w": shape_of(w, 3),
                "topk_ids": shape_of(topk_ids, 2),
                "topk_weights": None if topk_weights is None else str(getattr(topk_weights, "dtype", None)),
                "tokens_per_rank": given, "graph_safe": graph_safe, "layout": layout}

    out_rows = out.shape[0] if isinstance(out, torch.Tensor) and out.dim() == 2 else -1
    tpr = _agree_on_inputs(where, info, tokens, signature, described, local_error, given, out_rows, top_k)
    E, H, N = w.shape
    dev, k = x.device, topk_ids.shape[1]
    row_offsets = tuple(itertools.accumulate((t * k for t in tpr), initial=0))
    by_rank = (layout if layout != "auto" else layout_for(tpr, k, E)) == "rank"
    rows_bucket = int(bucket(row_offsets[-1]))
    pusher = None
    if _pushes_tokens(x, group, graph_safe):
        # 1. every rank's routing (one small collective: the sort waits for it), 2. the tokens, pushed on the copy
        # engines while the routing is sorted (no id check: a graph-safe call must not sync with the host)
        if out is None:
            out = empty_buffer((row_offsets[-1], N), x.dtype, dev)
        ids_all, weights_all = gather_routing(topk_ids, topk_weights, tpr, group)
        pusher = token_pusher(group, graph_safe)
        x_all = pusher.gather(x.contiguous(), tpr, include_own=True)
    else:
        # 1. every rank's tokens and routing, in one collective
        x_all, ids_all, weights_all = gather_tokens_and_routing(x, topk_ids, topk_weights, tpr, group)
        if check_ids:
            _check_gathered_ids(where, ids_all, E, tpr)
    try:
        if pusher is None:
            # 2. the sort and one GEMM over all ranks' tokens, in one launch (moe_gemm_sorting's, without its checks:
            # the gathered ids are what they ask for by construction; out, if not given, is allocated with the launch)
            out, routing = sorting_launch(x_all, w, ids_all, tpr, by_rank, "token", out, "sorted", None, kernel,
                                          rows_bucket, bucket, None, rank * E, "expert_bands", where)
        else:
            # 3. the sort (beside the pushes), then one GEMM over all ranks' tokens. Grouped by rank, it starts on
            # the own tokens and a tile of another rank's tokens waits for their arrival flag; grouped by expert,
            # nearly every tile reads several ranks' tokens, so the stream waits for all of them once and the
            # GEMM runs without flags
            routing = moe_align_ranks(ids_all, E, tpr, by_rank)
            wait = None
            if by_rank:
                wait = (pusher.arrival_flags, pusher.epoch)
            else:
                pusher.wait_all()
            if row_offsets[-1]:
                moe_gemm(x_all, w, routing, a_order="token", out=out, out_order="sorted", kernel=kernel,
                         rows_bucket=rows_bucket, first_group=rank * E, wait=wait)
    finally:
        if pusher is not None:  # also after an error: the flags must pair up with the peers' next call
            pusher.finish()
    return AgMoeResult(out, routing, tpr, row_offsets, ids_all, weights_all)


def _pushes_tokens(x: torch.Tensor, group, graph_safe: bool) -> bool:
    """Whether the tokens travel by copy-engine pushes (else by one all-gather): for a ``graph_safe`` call
    (made to be captured in a CUDA graph) on NCCL GPUs. Replayed, host operations cost nothing and the pushes
    overlap the sort (and, grouped by rank, the GEMM); eager, the pushes' host operations cost more than they
    hide (on 2 x H200, ``bench/moe.py`` part b's shapes, against the eager form that all-gathered the routing,
    then the tokens: 0.61x against 0.66x of the sequential form at 64 experts, 0.74x against 0.80x at 8)."""
    return graph_safe and x.is_cuda and uses_nccl(group)


#: Layouts of calls whose local checks passed, each with its cross-rank signature.
_passed_checks = PassedChecks()


def _inputs_key(where: str, info: GroupInfo, x, topk_ids, topk_weights, w, out, given: Optional[tuple], layout,
                graph_safe, check_ids, extra_check, extra_inputs: Optional[tuple]) -> Optional[tuple]:
    """Everything the local checks and the signature read, as a :class:`PassedChecks` key; None where an
    argument is not what it should be (the checks then run and say what is wrong) or where ``extra_check``
    reads tensors not named in ``extra_inputs``."""
    if (extra_check is not None and extra_inputs is None) or layout not in AG_MOE_LAYOUTS:
        return None
    try:
        return (where, info.rank, info.world_size, given, layout, bool(graph_safe), bool(check_ids),
                tensor_layout(x), tensor_layout(topk_ids), tensor_layout(topk_weights), tensor_layout(w),
                tensor_layout(out), *map(tensor_layout, extra_inputs or ()))
    except (AttributeError, TypeError, RuntimeError):  # RuntimeError: a tensor without storage
        return None


def _check_locally(where: str, rank: int, world: int, x, topk_ids, topk_weights, w, out, given: Optional[tuple],
                   layout: str, extra_check: Optional[Callable[[], None]]) -> None:
    """ag_moe's local input checks (TypeError/ValueError): what one rank can tell about its own inputs."""
    if extra_check is not None:
        extra_check()
    if layout not in AG_MOE_LAYOUTS:
        raise ValueError(f"{where}: layout must be one of {AG_MOE_LAYOUTS}, got {layout!r}")
    check_float_tensor(where, "x", x)
    check_float_tensor(where, "w", w)
    if x.dim() != 2 or w.dim() != 3:
        raise ValueError(f"{where}: x must be [T_r, H] and w [E, H, N], got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"{where}: x has H={x.shape[1]} but w is [E, H={w.shape[1]}, N]")
    if x.dtype != w.dtype:
        raise TypeError(f"{where}: x and w must have the same dtype, got {x.dtype} and {w.dtype}")
    # expert ids are range-checked after the routing gather, on every rank's ids at once
    check_token_routing(where, x, topk_ids, topk_weights, w.shape[0], check_range=False)
    check_device(where, x, topk_ids=topk_ids, topk_weights=topk_weights, w=w)
    if given is not None:
        if len(given) != world:
            raise ValueError(f"{where}: tokens_per_rank has {len(given)} entries but the group has {world} ranks")
        if given[rank] != x.shape[0]:
            raise ValueError(f"{where}: tokens_per_rank[{rank}] = {given[rank]} but this rank has "
                             f"{x.shape[0]} tokens")
    if out is not None:
        check_float_tensor(where, "out", out)
        if out.dim() != 2 or out.shape[1] != w.shape[2]:
            raise ValueError(f"{where}: out must be [sum of tokens over ranks * top_k, N={w.shape[2]}] "
                             f"(w's N), got {tuple(out.shape)}")
        if given is not None and out.shape[0] != sum(given) * topk_ids.shape[1]:
            raise ValueError(f"{where}: out has {out.shape[0]} rows, expected {sum(given) * topk_ids.shape[1]} "
                             "(sum of tokens over ranks * top_k)")


def layout_for(tokens_per_rank: Sequence[int], top_k: int, num_experts: int) -> str:
    """The :data:`AG_MOE_LAYOUTS` entry for a gather: ``"expert"`` where a rank sends an expert fewer than
    512 rows on average (groups per rank and expert would leave many M-tiles partly empty), else ``"rank"``
    (whole tiles either way; the GEMM starts on the own tokens while the others arrive)."""
    world = max(1, len(tokens_per_rank))
    return "expert" if world > 1 and sum(tokens_per_rank) * top_k < 512 * num_experts * world else "rank"


def _check_gathered_ids(where: str, ids_all: torch.Tensor, E: int, tpr: tuple) -> None:
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
    raise ValueError(f"{where}: expert ids must lie in [0, {E}), got values in [{lo}, {hi}] from rank(s) {ranks}; "
                     "check the router's output and num_experts (every rank raises this)")


def gather_rows(tensors: Sequence[torch.Tensor], tpr: tuple, group) -> list[torch.Tensor]:
    """Every rank's rows of each of ``tensors`` (each ``[T_r, W_i]``, ``T_r = tpr[rank]``), in rank order. On NCCL
    one grouped all-gather moves them all (one c10d call and one NCCL launch; an eager call's host time is set by
    its number of library calls), elsewhere one all-gather each (gloo's grouped all-gather mixes up tensors of
    different dtypes). Each rank's rows travel padded to the largest rank's count; where counts differ, the
    padding is dropped (one copy per tensor). Returns contiguous tensors; waits (the current stream) for them."""
    max_t, world = max(tpr), len(tpr)
    inputs = [_padded(t.contiguous(), max_t) for t in tensors]
    outputs = [torch.empty(world * max_t, t.shape[1], dtype=t.dtype, device=t.device) for t in inputs]
    if max_t == 0:  # every rank knows the counts: all skip the collective alike
        return outputs
    if outputs[0].is_cuda and uses_nccl(group):
        (group if group is not None else dist.group.WORLD).allgather_into_tensor_coalesced(outputs, inputs).wait()
    else:
        for gathered, local in zip(outputs, inputs):
            _all_gather(gathered, local, group)
    if any(t != max_t for t in tpr):
        outputs = [torch.cat([o[r * max_t: r * max_t + t] for r, t in enumerate(tpr)]) for o in outputs]
    return outputs


def _padded(rows: torch.Tensor, count: int) -> torch.Tensor:
    """``rows`` with uninitialized rows appended up to ``count`` (a rank with fewer tokens than the largest)."""
    if rows.shape[0] == count:
        return rows
    return torch.cat([rows, _filler(count - rows.shape[0], rows.shape[1], rows.dtype, rows.device)])


#: A block per (width, dtype, device) that pads a rank's rows to the largest rank's count, grown to the most
#: rows asked: never read, so one uninitialized block serves every call.
_fillers: dict = {}


def _filler(rows: int, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    block = _fillers.get((width, dtype, device))
    if block is None or block.shape[0] < rows:
        block = _fillers[(width, dtype, device)] = torch.empty(rows, width, dtype=dtype, device=device)
    return block[:rows]


def _routing_rows(topk_ids: torch.Tensor, topk_weights: Optional[torch.Tensor]) -> list[torch.Tensor]:
    """What travels of the routing: the ids as int32 (what the sorts read), and the weights where given."""
    ids = topk_ids if topk_ids.dtype == torch.int32 else topk_ids.to(torch.int32)
    return [ids] if topk_weights is None else [ids, topk_weights]


def gather_routing(topk_ids: torch.Tensor, topk_weights: Optional[torch.Tensor], tpr: tuple,
                   group) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Every rank's ``topk_ids`` (as int32) and ``topk_weights`` (in their dtype), in rank order: one collective
    (:func:`gather_rows`)."""
    ids_all, *weights_all = gather_rows(_routing_rows(topk_ids, topk_weights), tpr, group)
    return ids_all, (weights_all[0] if weights_all else None)


def gather_tokens_and_routing(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: Optional[torch.Tensor],
                              tpr: tuple, group) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Every rank's tokens, ``topk_ids`` (as int32) and ``topk_weights`` (in their dtype), in rank order: one
    collective (:func:`gather_rows`), what an ag_moe call without ``graph_safe`` gathers."""
    x_all, ids_all, *weights_all = gather_rows([x, *_routing_rows(topk_ids, topk_weights)], tpr, group)
    return x_all, ids_all, (weights_all[0] if weights_all else None)


def _check_graph_safe(where: str, graph_safe: bool, tokens_per_rank, check_ids: bool) -> None:
    """A call being captured in a CUDA graph must be graph-safe and must not synchronize with the host."""
    if not graph_safe:
        refuse_capture(where, "pass graph_safe=True, tokens_per_rank and check_ids=False (a graph-safe call pushes "
                              "its tokens with flags a replay can repeat, and overlaps the pushes with the sort)")
        return
    if tokens_per_rank is None or check_ids:
        raise ValueError(f"{where}(graph_safe=True) must not synchronize with the host: pass tokens_per_rank "
                         f"(got {tokens_per_rank!r}) and check_ids=False (got {check_ids!r}); check the expert ids "
                         "once outside the graph instead")


_pushers: dict = {}


def token_pusher(group, graph_safe: bool = False):
    """The cached ``kernels.symm.ShardPusher`` of ``group`` (symmetric-memory token gather); the
    graph-safe one is a separate pusher with its own workspace and flags."""
    key = (id(group), graph_safe)
    if key not in _pushers:
        ok, why = overlap_support(group)
        if not ok:
            raise RuntimeError(f"ag_moe: the overlapped GPU token gather is unavailable: {why}")
        _pushers[key] = ShardPusher(group, graph_safe=graph_safe)
    return _pushers[key]


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = False):
    """all_gather_into_tensor on NCCL; the list form elsewhere (gloo has no all_gather_into_tensor)."""
    if out.is_cuda and uses_nccl(group):
        return dist.all_gather_into_tensor(out, inp, group=group, async_op=async_op)
    world = out.shape[0] // inp.shape[0] if inp.shape[0] else dist.get_world_size(group)
    return dist.all_gather(list(out.chunk(world)), inp, group=group, async_op=async_op)
