"""AllGather-GEMM for tensor parallelism: ``C_r = all_gather(A) @ B_r``, the gather overlapped.

Each rank holds ``A_r`` (``[rows_r, K]``, its row shard of A; shards may be ragged) and
``B_r`` (``[K, N_r]``, its column shard of B) and gets ``C_r = A @ B_r`` (``[M, N_r]``).
fp16/bf16 (fp32 too), fp32 accumulation.

Transport (GPUs, ``kernels.symm.ShardPusher``): each rank pushes its shard into every peer's
symmetric-memory workspace with the copy engines, one peer at a time (rank+1, rank+2, ...), and
flags each piece in the peer's memory with ``cuStreamWriteValue32``; receivers walk the shards in
the order they land (own, rank-1, rank-2, ...) and wait with ``cuStreamWaitValue32`` (decomposed)
or spin in the kernel (fused). Neither side needs an SM or a barrier kernel, so the GEMM on the
local shard is launched first, before any communication is even enqueued. ``chunks`` and
``streams`` cut each push into flagged pieces spread over several copy streams.

Designs (``design=``):

* ``"decomposed"``: one GEMM launch per shard; the local shard's GEMM reads ``a_shard``
  directly and starts at once, each peer shard's GEMM waits (a stream wait, no SM) for the
  shard's arrival flag. ``gemm="cublas"`` runs the same schedule with ``torch.matmul`` per
  shard (a baseline for the transport; nothing to tune).
* ``"fused"``: one persistent Triton GEMM (``kernels.shard_gemm``) over all shards: it walks
  the local shard's tiles first, reading ``a_shard`` where it lies, then the peers' shards in
  the workspace, each tile spinning on its piece's flag (``chunks`` pieces per shard,
  multiples of 256 rows; in inline PTX on sm_90, which keeps the tile loop flat) before
  loading A.
* ``"auto"``: fused on GPUs from :data:`FUSED_FROM_WORLD` ranks on, decomposed below. The
  decomposed design costs the host one GEMM launch and a few driver calls per shard; with
  4 ranks an 8192^3 step's shards are 2048 rows, each GEMM takes the GPU about as long as
  the host takes to issue it, and the step runs at the host's pace (4 x H100: decomposed
  0.64-0.76 ms, fused 0.47-0.49, sequential 0.71). At 2 ranks each shard's GEMM is long
  enough to hide its launch, and the decomposed design starts its local GEMM before the
  exchange is enqueued.

On CPUs (gloo, ``TRITON_INTERPRET=1``) both designs gather with ``dist.all_gather`` first
and then run the same GEMM code (fused: flags preset), so CI checks tile mapping and results.

Both GEMMs are ``triton.autotune`` kernels: wrap the step that calls :class:`AllGatherGEMM`
with ``disttune.contextual_autotune`` to tune them while the copies really run.

Cost per call (GPU): ``w - 1`` pushes of the local shard on the copy engines, in
``max(chunks, streams)`` pieces each, a few stream memory operations per piece, the GEMM(s).
Memory: a ``[2, M, K]`` symmetric workspace (double-buffered) and a 8 KB signal buffer per rank.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .shard_gemm import MAX_WORLD, check_gemm_inputs, make_shard_gemm_kernel, shard_gemm
from .symm import (DEFAULT_STREAMS, ShardPusher, Timeline, arrival_order, chunk_rows, overlap_support,
                   refuse_epoch_capture, uses_nccl)
from .tp_common import check_inputs, check_matrices, check_rows, group_info, row_starts

__all__ = ["AllGatherGEMM", "ag_gemm", "ag_gemm_reference", "auto_design", "DESIGNS", "FUSED_FROM_WORLD"]

DESIGNS = ("auto", "fused", "decomposed")

#: ``"auto"`` picks the fused design on GPUs from this many ranks on, where the shards are short enough that a
#: GEMM launch per shard holds the step to the host's pace (``bench/ag_gemm.py`` at 2 and 4 ranks:
#: docs/benchmarks.md).
FUSED_FROM_WORLD = 3


def auto_design(world_size: int, device: torch.device) -> str:
    """The design ``"auto"`` runs for ``world_size`` ranks on ``device``: fused on GPUs from :data:`FUSED_FROM_WORLD`
    ranks on, else decomposed (on CPUs both gather first; decomposed is the simpler)."""
    return "fused" if device.type == "cuda" and world_size >= FUSED_FROM_WORLD else "decomposed"


class AllGatherGEMM:
    """Callable ``(a_shard, b_local, out=None, shard_rows=None) -> C_r``, holding its buffers.

    Create one per process group and keep it: the first call with a new shape allocates the
    workspace (a collective on GPUs) and checks that all ranks agree on the shapes (one small
    all-gather); later calls with that shape do neither (local checks run on every call; a
    cross-rank mismatch that first appears in a later call is not diagnosed).
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None, design: str = "auto", kernel=None,
                 chunks: int = 1, streams: int = DEFAULT_STREAMS, gemm: str = "triton") -> None:
        if design not in DESIGNS:
            raise ValueError(f"AllGatherGEMM: design must be one of {DESIGNS}, got {design!r}")
        self.info = group_info(group, max_world=MAX_WORLD)
        self.kernel = kernel if kernel is not None else make_shard_gemm_kernel()
        self.requested_design = design
        # each shard travels in ``pieces`` flagged pieces spread over ``streams`` copy streams (at least one
        # piece per stream): the fused GEMM's tiles wait for their own piece, the decomposed GEMMs for the shard
        self.chunks = int(chunks)
        self.streams = int(streams)
        if self.chunks < 1 or self.streams < 1:
            raise ValueError(f"AllGatherGEMM: chunks and streams must be >= 1, got {chunks} and {streams}")
        self.pieces = max(self.chunks, self.streams)
        self._checked: set = set()
        if gemm not in ("triton", "cublas"):
            raise ValueError(f"AllGatherGEMM: gemm must be 'triton' or 'cublas', got {gemm!r}")
        self.gemm = gemm
        self._pusher = None  # kernels.symm.ShardPusher, made on the first GPU call
        #: a kernels.symm.Timeline to mark each step of the GPU calls in (for benchmarks; None: no marks)
        self.timeline: Optional[Timeline] = None

    # ------------------------------------------------------------------ public

    def design_for(self, device: torch.device) -> str:
        """The design a call on ``device`` runs (``auto`` resolved)."""
        if self.requested_design != "auto":
            return self.requested_design
        return auto_design(self.info.world_size, device)

    def __call__(self, a_shard: torch.Tensor, b_local: torch.Tensor, out: Optional[torch.Tensor] = None,
                 shard_rows: Optional[Sequence[int]] = None) -> torch.Tensor:
        info = self.info
        check_matrices("AllGatherGEMM", a_shard=a_shard, b_local=b_local)
        refuse_epoch_capture("AllGatherGEMM", a_shard)
        rows = (check_rows(shard_rows, sum(shard_rows), info.world_size, "AllGatherGEMM")
                if shard_rows is not None else (a_shard.shape[0],) * info.world_size)
        if rows[info.rank] != a_shard.shape[0]:
            raise ValueError(f"AllGatherGEMM: rank {info.rank}'s a_shard has {a_shard.shape[0]} rows but shard_rows "
                             f"says {rows[info.rank]}")
        M, K, N = sum(rows), a_shard.shape[1], b_local.shape[1]
        if out is None:
            out = torch.empty(M, N, dtype=a_shard.dtype, device=a_shard.device)
        design = self.design_for(a_shard.device)
        signature = (rows, K, str(a_shard.dtype), design, self.pieces)

        def local_check() -> None:
            if not isinstance(out, torch.Tensor) or tuple(out.shape) != (M, N):
                raise ValueError(f"AllGatherGEMM: out must be a tensor of shape {(M, N)} (all ranks' rows x "
                                 f"b_local's columns), got {tuple(out.shape) if isinstance(out, torch.Tensor) else out}")
            check_gemm_inputs(a_shard, b_local, out[: a_shard.shape[0]], "AllGatherGEMM")

        check_inputs(info, "AllGatherGEMM", self._checked, signature,
                     {"a_shard": tuple(a_shard.shape), "b_local": tuple(b_local.shape), "dtype": str(a_shard.dtype),
                      "shard_rows": list(rows), "design": design, "pieces": self.pieces}, local_check)
        if M == 0:  # N may differ between ranks: a rank without columns still takes part in the gather
            return out
        if a_shard.device.type == "cuda" and uses_nccl(info.group):
            return self._gpu_step(a_shard, b_local, out, rows, design)
        return self._gathered_step(a_shard, b_local, out, rows, design)

    # ------------------------------------------------------------------ GPU (symmetric memory)

    def _gpu_step(self, a_shard, b_local, out, rows, design):
        if self._pusher is None:
            ok, why = overlap_support(self.info.group)
            if not ok:
                raise RuntimeError(f"AllGatherGEMM: the {design} GPU design is unavailable here: {why}")
            self._pusher = ShardPusher(self.info.group, streams=self.streams)
        rank, world = self.info.rank, self.info.world_size
        pusher, timeline = self._pusher, self.timeline
        pusher.timeline = timeline
        current = torch.cuda.current_stream()
        if timeline is not None:
            timeline.mark("call starts", current)
        starts = row_starts(rows)
        if design == "fused":
            workspace = pusher.gather(a_shard, rows, self.pieces)
            shard_gemm(workspace, b_local, out, rows, rank, flags=pusher.arrival_flags, kernel=self.kernel,
                       chunks=self.pieces, chunk_rows=chunk_rows(rows, self.pieces), epoch=pusher.epoch, own=a_shard)
        else:
            def gemm(a, block):
                if self.gemm == "cublas":
                    torch.matmul(a, b_local, out=out[block])
                else:
                    shard_gemm(a, b_local, out[block], (a.shape[0],), 0, kernel=self.kernel)

            def local_gemm():  # needs nothing from the peers: the GPU starts on it at once
                if rows[rank]:
                    gemm(a_shard, slice(starts[rank], starts[rank] + rows[rank]))
                    if timeline is not None:
                        timeline.mark(f"GEMM of own shard {rank} done", current)

            workspace = pusher.gather(a_shard, rows, self.pieces, local_work=local_gemm)
            for s in arrival_order(rank, world)[1:]:
                if rows[s]:
                    pusher.wait_shard(s)
                    if timeline is not None:
                        timeline.mark(f"shard {s} landed, or the GEMM before done", current)
                    block = slice(starts[s], starts[s] + rows[s])
                    gemm(workspace[block], block)
                    if timeline is not None:
                        timeline.mark(f"GEMM of shard {s} done", current)
        pusher.finish()
        return out

    # ------------------------------------------------------------------ CPU / gloo (gather first)

    def _gathered_step(self, a_shard, b_local, out, rows, design):
        info = self.info
        rank, world = info.rank, info.world_size
        most = max(rows)
        gathered = torch.empty(world, most, a_shard.shape[1], dtype=a_shard.dtype, device=a_shard.device)
        send = a_shard.contiguous()
        if a_shard.shape[0] != most:
            send = torch.zeros(most, a_shard.shape[1], dtype=a_shard.dtype, device=a_shard.device)
            send[: a_shard.shape[0]] = a_shard
        dist.all_gather(list(gathered.unbind(0)), send, group=info.group)
        a_full = torch.cat([gathered[s, : rows[s]] for s in range(world)])
        if design == "fused":
            ready = torch.ones(world * self.pieces, dtype=torch.int32, device=a_shard.device)
            return shard_gemm(a_full, b_local, out, rows, rank, flags=ready, kernel=self.kernel, chunks=self.pieces,
                              chunk_rows=chunk_rows(rows, self.pieces), own=a_shard)
        starts = row_starts(rows)
        for s in arrival_order(rank, world):
            rows_s = slice(starts[s], starts[s] + rows[s])
            if rows[s]:
                shard_gemm(a_full[rows_s], b_local, out[rows_s], (rows[s],), 0, kernel=self.kernel)
        return out


_instances: dict = {}


def ag_gemm(a_shard: torch.Tensor, b_local: torch.Tensor, out: Optional[torch.Tensor] = None, *,
            shard_rows: Optional[Sequence[int]] = None, group: Optional[dist.ProcessGroup] = None,
            design: str = "auto") -> torch.Tensor:
    """``all_gather(a_shard) @ b_local`` with a cached :class:`AllGatherGEMM` per (group, design)."""
    key = (id(group), design)
    op = _instances.get(key)
    if op is None:
        op = _instances[key] = AllGatherGEMM(group, design)
    return op(a_shard, b_local, out, shard_rows)


def ag_gemm_reference(a_shard: torch.Tensor, b_local: torch.Tensor, shard_rows: Optional[Sequence[int]] = None,
                      group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """torch reference: gather with ``dist.all_gather`` (padded for ragged shards), fp32 matmul, cast."""
    world = dist.get_world_size(group)
    rows = tuple(shard_rows) if shard_rows is not None else (a_shard.shape[0],) * world
    most = max(rows)
    send = torch.zeros(most, a_shard.shape[1], dtype=a_shard.dtype, device=a_shard.device)
    send[: a_shard.shape[0]] = a_shard
    gathered = [torch.empty_like(send) for _ in range(world)]
    dist.all_gather(gathered, send, group=group)
    a_full = torch.cat([g[:r] for g, r in zip(gathered, rows)])
    return (a_full.float() @ b_local.float()).to(a_shard.dtype)
