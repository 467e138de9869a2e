"""GEMM-ReduceScatter for tensor parallelism: rank r gets its row block of ``sum_r A_r @ B_r``.

Each rank holds ``A_r`` (``[M, K_r]``, its column shard of A) and ``B_r`` (``[K_r, N]``, its
row shard of B); rank ``r`` gets rows ``rows_r`` of ``sum_r A_r @ B_r`` (``[rows_r, N]``; rows are
split by ``torch.tensor_split``'s rule unless ``out_rows`` says otherwise). fp16/bf16 (fp32 too),
fp32 accumulation inside each GEMM; the other ranks' partials travel rounded to the input dtype
(as with ``matmul`` then ``reduce_scatter_tensor``), the own partial is summed before rounding.

GPU designs (push, overlapped, no reduction kernel), ``design=``:

* ``"decomposed"``: the partial for each destination rank is computed in turn by a GEMM launch of
  its own, in ``kernels.symm.push_order`` (the next rank's rows first, so at each step every rank
  sends to a different rank) and ending with this rank's own. As soon as a partial is done, the
  copy engines push it in ``chunks`` pieces, spread over ``streams`` copy streams, into the
  destination's symmetric-memory receive slot, flagging each piece in the destination's memory
  (``cuStreamWriteValue32``) while the GEMM goes on with the next destination.
* ``"fused"``: one persistent GEMM launch computes every other rank's partial, walking them in the
  same order (``kernels.shard_gemm.partials_gemm``). The last tile of each piece sets that piece's
  ready flag, and the copy streams, which wait on those flags (``cuStreamWaitValue32``), push each
  piece as soon as it is done: two launches (the partials, the own rows) and a few driver calls per
  destination, where the decomposed design costs the host a launch per partial (with 4 ranks an
  8192^3 step's partials take the GPU about as long as the host takes to issue them).
* ``"auto"``: fused on GPUs from :data:`FUSED_FROM_WORLD` ranks on, decomposed below.

Either way the own rows' GEMM adds the received partials in its epilogue, each tile after spinning
on its piece's flag. Slots are double-buffered; a pusher waits (``cuStreamWaitValue32``) until the
destination has read the same half two calls earlier. No barrier kernel, no reduction pass. Memory:
``[2, w, R, N]`` symmetric receive slots and a ``[w, R, N]`` staging buffer (row ``rank``
unused), ``R`` the largest rank's rows rounded up to a power of two; 8 KB of flags.

On CPUs (gloo, ``TRITON_INTERPRET=1``) the partials are computed with the same GEMM (the fused
design's one launch leaves out the own rows) and delivered by an all-gather, and the own rows' GEMM
adds them in the same epilogue (flags preset), so CI checks the kernel paths the GPUs run.

The GEMM is a ``triton.autotune`` kernel: wrap the step with ``disttune.contextual_autotune``.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from .shard_gemm import MAX_WORLD, check_gemm_inputs, make_shard_gemm_kernel, partials_gemm, shard_gemm
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

__all__ = ["DESIGNS", "FUSED_FROM_WORLD", "GemmReduceScatter", "auto_design", "default_pieces", "gemm_rs",
           "gemm_rs_reference", "padded_width"]

DESIGNS = ("auto", "fused", "decomposed")

#: ``"auto"`` runs the fused design on GPUs from this many ranks on (``bench/ag_gemm.py``, 8192^3 bf16: on
#: 2 x H200 fused in 2 pieces 0.873 ms, decomposed 0.887, and from an idle GPU 1.052 against 1.138; at 4 ranks
#: the decomposed design is host-bound).
FUSED_FROM_WORLD = 2


def auto_design(world_size: int, device: torch.device) -> str:
    """The design ``"auto"`` runs for ``world_size`` ranks on ``device``: fused on GPUs from
    :data:`FUSED_FROM_WORLD` ranks on, else decomposed."""
    return "fused" if device.type == "cuda" and world_size >= FUSED_FROM_WORLD else "decomposed"


def padded_width(columns: int, dtype: torch.dtype) -> int:
    """Elements per row of a buffer of ``columns`` that rounds each row up to whole 16 bytes (tensor descriptors'
    stride rule)."""
    per_16_bytes = max(1, 16 // dtype.itemsize)
    return -(-columns // per_16_bytes) * per_16_bytes


def default_pieces(world_size: int, fused: bool) -> int:
    """Flagged pieces per pushed partial when ``chunks`` is not given (``bench/ag_gemm.py --rs-chunks``, 8192^3
    bf16): the fused design in 2 up to 2 ranks (2 x H200: 0.873 ms; 0.885 in 4, 0.996 in 1) and whole partials
    from 3 (4 x H200: 0.64 ms; 0.71 in 4); the decomposed design in 4."""
    if not fused:
        return 4
    return 2 if world_size <= 2 else 1


class GemmReduceScatter:
    """Callable ``(a_local, b_local, out=None, out_rows=None) -> this rank's rows of sum_r A_r @ B_r``.

    Keep one per process group: the first call with a new shape allocates the buffers (a
    collective on GPUs) and checks that all ranks agree on the shapes.

    ``design``: one of :data:`DESIGNS` (see the module doc). ``chunks``: flagged pieces per pushed partial
    (at least ``streams``; default: :func:`default_pieces`).
    ``streams``: copy streams. ``last_launches``: the decomposed design's GEMMs for the last partial.
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None, kernel=None, chunks: Optional[int] = None,
                 streams: int = DEFAULT_STREAMS, last_launches: int = 2, design: str = "auto") -> None:
        if design not in DESIGNS:
            raise ValueError(f"GemmReduceScatter: design must be one of {DESIGNS}, got {design!r}")
        self.requested_design = design
        self.info = group_info(group, max_world=MAX_WORLD)
        self.kernel = kernel if kernel is not None else make_shard_gemm_kernel()
        if chunks is None:
            fused = design == "fused" or (design == "auto" and self.info.world_size >= FUSED_FROM_WORLD)
            chunks = default_pieces(self.info.world_size, fused)
        if int(chunks) < 1 or int(streams) < 1:
            raise ValueError(f"GemmReduceScatter: chunks and streams must be >= 1, got {chunks} and {streams}")
        # each partial travels in ``chunks`` flagged pieces (at least one per copy stream) spread over ``streams``
        self.chunks = max(int(chunks), int(streams))
        self.streams = int(streams)
        # decomposed: the last partial before the own rows' GEMM is computed in this many GEMMs, each pushed as
        # it is done
        self.last_launches = max(1, int(last_launches))
        self._checked: set = set()
        self._buffers: dict = {}
        self._epoch = 0
        self._board = None  # kernels.symm.SignalBoard, made on the first GPU call
        self._signals = None  # the fused GEMM's tile counts and ready flags per piece
        self._last_stream = None  # the stream of the last GPU call
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
        design = self.design_for(a_local.device)
        signature = (rows, a_local.shape[1], N, str(a_local.dtype), self.chunks, design)

        def local_check() -> None:
            if not isinstance(out, torch.Tensor) or tuple(out.shape) != (mine, N):
                raise ValueError(f"GemmReduceScatter: out must be a tensor of shape {(mine, N)} (rank {info.rank}'s "
                                 f"rows x N), got {tuple(out.shape) if isinstance(out, torch.Tensor) else out}")
            check_gemm_inputs(a_local, b_local, None, "GemmReduceScatter")
            check_gemm_inputs(a_local[:mine], b_local, out, "GemmReduceScatter")  # the own rows' GEMM writes out

        check_inputs(info, "GemmReduceScatter", self._checked, signature,
                     {"a_local": tuple(a_local.shape), "b_local": tuple(b_local.shape), "dtype": str(a_local.dtype),
                      "out_rows": list(rows), "chunks": self.chunks, "design": design}, local_check)
        if M == 0 or N == 0:
            return out
        if a_local.device.type == "cuda" and uses_nccl(info.group):
            if design == "fused":
                return self._fused_step(a_local, b_local, out, rows)
            return self._gpu_step(a_local, b_local, out, rows)
        return self._reduced_step(a_local, b_local, out, rows, fused=design == "fused")

    def design_for(self, device: torch.device) -> str:
        """The design a call on ``device`` runs (``"auto"`` resolved by :func:`auto_design`)."""
        if self.requested_design != "auto":
            return self.requested_design
        return auto_design(self.info.world_size, device)

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
            self._signals = torch.zeros(2 * self.info.world_size * self.chunks, dtype=torch.int32, device=device)
            torch.cuda.current_stream(device).synchronize()  # zeroed before a copy stream first waits on it
        key = (N, dtype)
        bufs = self._buffers.get(key)
        if bufs is None or bufs[0].shape[2] < max(rows):
            if bufs is not None:  # peers may still push into the old slots: quiesce everyone before dropping them
                torch.cuda.synchronize(device)
                self._board.buffer.barrier()
                torch.cuda.synchronize(device)
            world, capacity = self.info.world_size, 1 << max(0, max(rows) - 1).bit_length()
            width = padded_width(N, dtype)  # rows of whole 16 bytes, as the reduction's descriptor reads them
            recv = SymmetricBuffer((2, world, capacity, width), dtype, self.info.group, device)
            staging = torch.empty(world, capacity, width, dtype=dtype, device=device)[..., :N]
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
            flags = self._signals.data_ptr() + 4 * world * chunks  # the ready flags, after the tile counts
            ready = {d: [flags + 4 * (d * chunks + c) for c in range(len(pieces))] for d, _, pieces in pushes}
            plan = self._plans[key] = _RsPlan(launch_groups(pushes, rows, step_rows, self.last_launches), frees,
                                              step_rows, pushes, ready)
        return plan

    def _begin(self, a_local, b_local, rows) -> tuple:
        """A GPU call's stream, buffers, epoch, parity (the half of the receive slots it uses) and push plan. A call on
        another stream than the last one first waits for that stream: the staging buffer and the fused GEMM's
        tile counts must not be shared by two calls at once."""
        recv, staging = self._gpu_buffers(rows, b_local.shape[1], a_local.dtype, a_local.device)
        current = torch.cuda.current_stream()
        if self._last_stream is not None and current != self._last_stream:
            current.wait_stream(self._last_stream)
        self._last_stream = current
        self._epoch += 1
        epoch, parity = self._epoch, self._epoch % 2
        if self.timeline is not None:
            self.timeline.mark("call starts", current)
        return current, recv, staging, epoch, parity, self._push_plan(rows, recv, staging, parity)

    def _gpu_step(self, a_local, b_local, out, rows):
        current, recv, staging, epoch, parity, plan = self._begin(a_local, b_local, rows)
        sides, handles, timeline = self._sides, self._side_handles, self.timeline
        starts = row_starts(rows)
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
        return self._finish(current, a_local, b_local, out, rows, recv.local[parity], epoch, plan)

    def _fused_step(self, a_local, b_local, out, rows):
        """Every other rank's partial in one persistent GEMM, each piece pushed once its last tile sets its ready
        flag; then the own rows' GEMM with the received partials."""
        current, recv, staging, epoch, parity, plan = self._begin(a_local, b_local, rows)
        sides, handles, timeline = self._sides, self._side_handles, self.timeline
        if not partials_gemm(a_local, b_local, staging, self._signals, rows, self.info.rank, kernel=self.kernel,
                             chunks=self.chunks, chunk_rows=plan.step_rows, epoch=epoch):
            # a tuner launched no config here (every one failed on this rank; it fails the call on every rank):
            # flag the pieces anyway, so the copy streams and the peers' GEMMs waiting on them do not hang
            for addresses in plan.ready.values():
                for address in addresses:
                    write_flag_at(current, address, epoch)
        if timeline is not None:
            timeline.mark("the other ranks' partials done", current)
        # pushed after the launch: with CUDA's lazy module loading, a kernel's first launch may wait for every
        # stream, and a copy stream already waiting on that kernel's flags would never let it start
        for n, (d, free, pieces) in enumerate(plan.pushes):  # destination n on copy stream n (mod streams)
            side, handle = sides[n % len(sides)], handles[n % len(sides)]
            push_pieces(handle, staging[d].data_ptr(), pieces, epoch, free, ready=plan.ready[d])
            if timeline is not None:
                timeline.mark(f"pushed to rank {d} (copy stream {n % len(sides)})", side)
        return self._finish(current, a_local, b_local, out, rows, recv.local[parity], epoch, plan)

    def _finish(self, current, a_local, b_local, out, rows, received, epoch: int, plan: "_RsPlan") -> torch.Tensor:
        """The own rows' GEMM, adding every peer's partial in its epilogue piece by piece as they land; then the
        copy streams joined (into ``current``, the call's stream) and the peers told that this half of the receive
        slots is read."""
        rank, mine = self.info.rank, rows[self.info.rank]
        if mine:
            start = row_starts(rows)[rank]
            shard_gemm(a_local[start: start + mine], b_local, out, (mine,), 0, kernel=self.kernel, chunks=self.chunks,
                       chunk_rows=plan.step_rows, epoch=epoch, addend=received[:, :mine, : out.shape[1]],
                       addend_flags=self._board.arrived, addend_skip=rank)
            if self.timeline is not None:
                self.timeline.mark("own rows' GEMM (with the peers' partials) done", current)
        for side in self._sides:
            current.wait_stream(side)
        for address in plan.frees:
            write_flag_at(current, address, epoch)
        return out

    # ------------------------------------------------------------------ CPU / gloo

    def _reduced_step(self, a_local, b_local, out, rows, fused: bool):
        """The GPU schedule with gloo in place of the pushes: every rank computes the partials of
        the others' rows (``fused``: in one launch that leaves out the own rows, and checks that it flagged
        every piece), an all-gather delivers them, and the own rows' GEMM adds them in its
        epilogue (flags preset), so the interpreter checks the same kernel paths."""
        info = self.info
        rank, world = info.rank, info.world_size
        starts = row_starts(rows)
        most, N = max(rows), b_local.shape[1]
        # rows of whole 16 bytes, as on GPUs (the GEMMs store and read them through tensor descriptors)
        padded = torch.zeros(world, most, padded_width(N, a_local.dtype), dtype=a_local.dtype, device=a_local.device)
        staging = padded[..., :N]
        if fused:
            signals = torch.zeros(2 * world * self.chunks, dtype=torch.int32, device=a_local.device)
            step_rows = chunk_rows(rows, self.chunks)
            partials_gemm(a_local, b_local, staging, signals, rows, rank, kernel=self.kernel, chunks=self.chunks,
                          chunk_rows=step_rows)
            _check_flagged(signals, rows, rank, self.chunks, step_rows)
        else:
            for d in range(world):
                if d != rank and rows[d]:
                    block = slice(starts[d], starts[d] + rows[d])
                    shard_gemm(a_local[block], b_local, staging[d, : rows[d]], (rows[d],), 0, kernel=self.kernel)
        everyone = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(everyone, padded, group=info.group)
        mine = rows[rank]
        if mine:
            received = torch.stack([everyone[s][rank, :mine] for s in range(world)])[..., :N]
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


def _check_flagged(signals: torch.Tensor, rows: Sequence[int], rank: int, chunks: int, step_rows: int) -> None:
    """That the fused GEMM left every tile count at zero and set the ready flag of exactly the pieces of the
    other ranks' rows (a RuntimeError otherwise: a copy stream would wait forever on a missing flag)."""
    world = len(rows)
    want = torch.zeros(world, chunks, dtype=torch.int32)
    for d in range(world):
        if d != rank:
            want[d, : -(-rows[d] // step_rows)] = 1
    counts, flags = signals.view(2, world, chunks).cpu()
    if counts.any() or not torch.equal(flags, want):
        raise RuntimeError(f"GemmReduceScatter: the fused GEMM left tile counts {counts.tolist()} and ready flags "
                           f"{flags.tolist()}, expected zeros and {want.tolist()}")


class _RsPlan(NamedTuple):
    groups: list  # launch_groups(...): (destination, free flag here, first row, end row, pieces into its slot)
    frees: list  # the peers' free-flag addresses for this rank
    step_rows: int  # rows per piece
    pushes: list  # (destination, free flag here, pieces into its slot), in push order
    ready: dict  # destination -> the ready flag address of each of its pieces (the fused design's)


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
