"""GEMM-ReduceScatter for tensor parallelism: rank r gets its row block of ``sum_r A_r @ B_r``.

Each rank holds ``A_r`` (``[M, K_r]``, its column shard of A) and ``B_r`` (``[K_r, N]``, its
row shard of B); rank ``r`` gets rows ``rows_r`` of ``sum_r A_r @ B_r`` (``[rows_r, N]``; rows are
split by ``torch.tensor_split``'s rule unless ``out_rows`` says otherwise). fp16/bf16 (fp32 too),
fp32 accumulation inside each GEMM; the other ranks' partials travel rounded to the input dtype
(as with ``matmul`` then ``reduce_scatter_tensor``), the own partial is summed before rounding.

GPU design (push, overlapped, no reduction kernel): the partial for each destination rank is
computed in turn, in ``kernels.symm.push_order`` (the next rank's rows first, so at each step
every rank sends to a different rank) and ending with this rank's own. As soon as a partial is
done, the copy engines push it in ``chunks`` pieces, spread over ``streams`` copy streams, into
the destination's symmetric-memory receive slot, flagging each piece in the destination's
memory (``cuStreamWriteValue32``) while the GEMM goes on with the next destination. The own
rows' GEMM then adds the received partials in its epilogue, each tile after spinning on its
piece's flag (the pieces have landed long before: each was computed one GEMM earlier).
Slots are double-buffered; a pusher waits (``cuStreamWaitValue32``) until the destination has
read the same half two calls earlier. No barrier kernel, no reduction pass. Memory:
``[2, w, R, N]`` symmetric receive slots and a ``[w, R, N]`` staging buffer (row ``rank``
unused), ``R`` the largest rank's rows rounded up to a power of two; 8 KB of flags.

On CPUs (gloo, ``TRITON_INTERPRET=1``) the partials are computed with the same GEMM and
delivered by an all-gather, and the own rows' GEMM adds them in the same epilogue (flags
preset), so CI checks the kernel path the GPUs run.

The GEMM is a ``triton.autotune`` kernel: wrap the step with ``disttune.contextual_autotune``.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from .shard_gemm import MAX_WORLD, check_gemm_inputs, make_shard_gemm_kernel, shard_gemm
from .symm import (
    DEFAULT_STREAMS,
    SignalBoard,
    SymmetricBuffer,
    Timeline,
    chunk_rows,
    overlap_support,
    pieces_of,
    push_order,
    push_pieces,
    refuse_epoch_capture,
    stream_handle,
    uses_nccl,
    write_flag_at,
)
from .tp_common import check_inputs, check_matrices, check_rows, group_info, row_starts, split_rows

__all__ = ["GemmReduceScatter", "gemm_rs", "gemm_rs_reference"]


class GemmReduceScatter:
    """Callable ``(a_local, b_local, out=None, out_rows=None) -> this rank's rows of sum_r A_r @ B_r``.

    Keep one per process group: the first call with a new shape allocates the buffers (a
    collective on GPUs) and checks that all ranks agree on the shapes.
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None, kernel=None, chunks: int = 4,
                 streams: int = DEFAULT_STREAMS, last_launches: int = 2) -> None:
        self.info = group_info(group, max_world=MAX_WORLD)
        self.kernel = kernel if kernel is not None else make_shard_gemm_kernel()
        if int(chunks) < 1 or int(streams) < 1:
            raise ValueError(f"GemmReduceScatter: chunks and streams must be >= 1, got {chunks} and {streams}")
        # each partial travels in ``chunks`` flagged pieces (at least one per copy stream) spread over ``streams``
        self.chunks = max(int(chunks), int(streams))
        self.streams = int(streams)
        # the last partial before the own rows' GEMM is computed in this many GEMMs, each pushed as it is done
        self.last_launches = max(1, int(last_launches))
        self._checked: set = set()
        self._buffers: dict = {}
        self._epoch = 0
        self._board = None  # kernels.symm.SignalBoard, made on the first GPU call
        self._sides: list = []  # copy streams
        self._side_handles: list = []
        self._events: list = []
        self._plans: dict = {}  # (rows, N, dtype, parity) -> _RsPlan: the addresses of one call's pushes
        #: a kernels.symm.Timeline to mark each step of the GPU calls in (for benchmarks; None: no marks)
        self.timeline: Optional[Timeline] = None

    def __call__(self, a_local: torch.Tensor, b_local: torch.Tensor, out: Optional[torch.Tensor] = None,
                 out_rows: Optional[Sequence[int]] = None) -> torch.Tensor:
        info = self.info
        check_matrices("GemmReduceScatter", a_local=a_local, b_local=b_local)
        refuse_epoch_capture("GemmReduceScatter", a_local)
        M, N = a_local.shape[0], b_local.shape[1]
        rows = (check_rows(out_rows, M, info.world_size, "GemmReduceScatter") if out_rows is not None
                else split_rows(M, info.world_size))
        mine = rows[info.rank]
        if out is None:
            out = torch.empty(mine, N, dtype=a_local.dtype, device=a_local.device)
        signature = (rows, a_local.shape[1], N, str(a_local.dtype), self.chunks)

        def local_check() -> None:
            if not isinstance(out, torch.Tensor) or tuple(out.shape) != (mine, N):
                raise ValueError(f"GemmReduceScatter: out must be a tensor of shape {(mine, N)} (rank {info.rank}'s "
                                 f"rows x N), got {tuple(out.shape) if isinstance(out, torch.Tensor) else out}")
            check_gemm_inputs(a_local, b_local, None, "GemmReduceScatter")
            check_gemm_inputs(a_local[:mine], b_local, out, "GemmReduceScatter")  # the own rows' GEMM writes out

        check_inputs(info, "GemmReduceScatter", self._checked, signature,
                     {"a_local": tuple(a_local.shape), "b_local": tuple(b_local.shape), "dtype": str(a_local.dtype),
                      "out_rows": list(rows), "chunks": self.chunks}, local_check)
        if M == 0 or N == 0:
            return out
        if a_local.device.type == "cuda" and uses_nccl(info.group):
            return self._gpu_step(a_local, b_local, out, rows)
        return self._reduced_step(a_local, b_local, out, rows)

    # ------------------------------------------------------------------ GPU (push into symmetric memory)

    def _gpu_buffers(self, rows, N, dtype, device):
        """Receive slots and staging for ``max(rows)`` rows, grown to a power of two (a collective)."""
        if self._board is None:
            ok, why = overlap_support(self.info.group)
            if not ok:
                raise RuntimeError(f"GemmReduceScatter: the overlapped GPU path is unavailable: {why}")
            self._board = SignalBoard(self.info.group, device)
            self._sides = [torch.cuda.Stream(device=device) for _ in range(self.streams)]
            self._side_handles = [stream_handle(side) for side in self._sides]
            self._events = [torch.cuda.Event() for _ in range(self.info.world_size + self.chunks)]
        key = (N, dtype)
        bufs = self._buffers.get(key)
        if bufs is None or bufs[0].shape[2] < max(rows):
            if bufs is not None:  # peers may still push into the old slots: quiesce everyone before dropping them
                torch.cuda.synchronize(device)
                self._board.buffer.barrier()
                torch.cuda.synchronize(device)
            world, capacity = self.info.world_size, 1 << max(0, max(rows) - 1).bit_length()
            recv = SymmetricBuffer((2, world, capacity, N), dtype, self.info.group, device)
            staging = torch.empty(world, capacity, N, dtype=dtype, device=device)
            bufs = self._buffers[key] = (recv, staging)
            self._plans = {plan_key: plan for plan_key, plan in self._plans.items() if plan_key[1:3] != key}
        return bufs

    def _push_plan(self, rows: tuple, recv, staging, parity: int) -> "_RsPlan":
        """Where each partial goes (pieces into the destination's receive slot, flagged there), which
        free flag guards it, and the peers' free flags for this rank: computed once per shape and parity."""
        key = (rows, staging.shape[2], staging.dtype, parity)
        plan = self._plans.get(key)
        if plan is None:
            rank, world, board, chunks = self.info.rank, self.info.world_size, self._board, self.chunks
            step_rows = chunk_rows(rows, chunks)
            row_bytes = staging.stride(1) * staging.element_size()
            pushes = [(d, board.address(rank, board.FREED, d),
                       pieces_of(rows[d], recv.peer(d)[parity, rank].data_ptr(), row_bytes, step_rows,
                                 lambda c, d=d: board.address(d, board.ARRIVED, rank * chunks + c)))
                      for d in push_order(rank, world) if rows[d]]
            frees = [board.address(p, board.FREED, rank) for p in range(world) if p != rank]
            plan = self._plans[key] = _RsPlan(launch_groups(pushes, rows, step_rows, self.last_launches), frees,
                                              step_rows)
        return plan

    def _gpu_step(self, a_local, b_local, out, rows):
        info = self.info
        rank = info.rank
        recv, staging = self._gpu_buffers(rows, b_local.shape[1], a_local.dtype, a_local.device)
        board, sides, handles = self._board, self._sides, self._side_handles
        starts = row_starts(rows)
        self._epoch += 1
        epoch, parity = self._epoch, self._epoch % 2
        plan = self._push_plan(rows, recv, staging, parity)
        current, timeline = torch.cuda.current_stream(), self.timeline
        if timeline is not None:
            timeline.mark("call starts", current)
        for n_group, (d, free, first, end, pieces) in enumerate(plan.groups):  # each pushed while the next computes
            part = staging[d, : rows[d]]
            shard_gemm(a_local[starts[d] + first: starts[d] + end], b_local, part[first:end], (end - first,), 0,
                       kernel=self.kernel)
            done = self._events[n_group]
            done.record(current)
            if timeline is not None:
                timeline.mark(f"partial for rank {d}, rows {first}-{end}, done", current)
            for n, (side, handle) in enumerate(zip(sides, handles)):  # its pieces spread over the copy streams
                share = pieces[(n - n_group) % len(sides)::len(sides)]
                if share:
                    side.wait_event(done)
                    push_pieces(handle, part.data_ptr(), share, epoch, free)
                    if timeline is not None:
                        timeline.mark(f"pushed to rank {d}, rows {first}-{end} (copy stream {n})", side)
        mine = rows[rank]
        if mine:  # the own rows' GEMM adds every peer's partial in its epilogue, piece by piece as they land
            shard_gemm(a_local[starts[rank]: starts[rank] + mine], b_local, out, (mine,), 0, kernel=self.kernel,
                       chunks=self.chunks, chunk_rows=plan.step_rows, epoch=epoch,
                       addend=recv.local[parity, :, :mine], addend_flags=board.arrived, addend_skip=rank)
            if timeline is not None:
                timeline.mark("own rows' GEMM (with the peers' partials) done", current)
        for side in sides:
            current.wait_stream(side)
        for address in plan.frees:
            write_flag_at(current, address, epoch)
        return out

    # ------------------------------------------------------------------ CPU / gloo

    def _reduced_step(self, a_local, b_local, out, rows):
        """The GPU schedule with gloo in place of the pushes: every rank computes the partials of
        the others' rows, an all-gather delivers them, and the own rows' GEMM adds them in its
        epilogue (flags preset), so the interpreter checks the same kernel path."""
        info = self.info
        rank, world = info.rank, info.world_size
        starts = row_starts(rows)
        most, N = max(rows), b_local.shape[1]
        staging = torch.zeros(world, most, N, dtype=a_local.dtype, device=a_local.device)
        for d in range(world):
            if d != rank and rows[d]:
                block = slice(starts[d], starts[d] + rows[d])
                shard_gemm(a_local[block], b_local, staging[d, : rows[d]], (rows[d],), 0, kernel=self.kernel)
        everyone = [torch.empty_like(staging) for _ in range(world)]
        dist.all_gather(everyone, staging, group=info.group)
        mine = rows[rank]
        if mine:
            received = torch.stack([everyone[s][rank, :mine] for s in range(world)])
            ready = torch.ones(world * self.chunks, dtype=torch.int32, device=a_local.device)
            shard_gemm(a_local[starts[rank]: starts[rank] + mine], b_local, out, (mine,), 0, kernel=self.kernel,
                       chunks=self.chunks, chunk_rows=chunk_rows(rows, self.chunks), addend=received,
                       addend_flags=ready, addend_skip=rank)
        return out


def launch_groups(pushes: list, rows: Sequence[int], step_rows: int, last_launches: int) -> list:
    """The partial GEMMs of one call and what each pushes: ``[(destination, free flag, first row, end row,
    pieces)]`` from ``pushes`` (``[(destination, free flag, pieces of step_rows rows)]`` in push order).

    Each destination's partial is one GEMM, except the last one's: it is computed in up to ``last_launches``
    GEMMs of whole pieces, each pushed while the next is computed. That partial is the one the destination's
    own GEMM, which comes right after it there, waits for; computed whole, its push would start only when
    that GEMM does. (The earlier partials are pushed while the later ones are computed.) More launches start
    the push sooner, but each smaller GEMM fills the GPU's last wave less well."""
    groups = []
    for n, (d, free, pieces) in enumerate(pushes):
        if n < len(pushes) - 1:
            groups.append((d, free, 0, rows[d], pieces))
            continue
        per_launch = -(-len(pieces) // last_launches)
        for first in range(0, len(pieces), per_launch):
            end = min(len(pieces), first + per_launch)
            groups.append((d, free, first * step_rows, min(rows[d], end * step_rows), pieces[first:end]))
    return groups


class _RsPlan(NamedTuple):
    groups: list  # launch_groups(...): (destination, free flag here, first row, end row, pieces into its slot)
    frees: list  # the peers' free-flag addresses for this rank
    step_rows: int  # rows per piece


_instances: dict = {}


def gemm_rs(a_local: torch.Tensor, b_local: torch.Tensor, out: Optional[torch.Tensor] = None, *,
            out_rows: Optional[Sequence[int]] = None, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """This rank's rows of ``sum_r a_local_r @ b_local_r`` with a cached :class:`GemmReduceScatter` per group."""
    op = _instances.get(id(group))
    if op is None:
        op = _instances[id(group)] = GemmReduceScatter(group)
    return op(a_local, b_local, out, out_rows)


def gemm_rs_reference(a_local: torch.Tensor, b_local: torch.Tensor, out_rows: Optional[Sequence[int]] = None,
                      group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """torch reference: fp32 matmul, partial rounded to the dtype, ``all_reduce`` in fp32, this rank's rows."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    rows = tuple(out_rows) if out_rows is not None else split_rows(a_local.shape[0], world)
    partial = (a_local.float() @ b_local.float()).to(a_local.dtype).float()
    dist.all_reduce(partial, group=group)
    start = row_starts(rows)[rank]
    return partial[start: start + rows[rank]].to(a_local.dtype)
