"""GPU transport for the overlapped kernels: torch symmetric memory and copy-engine signals.

* :class:`SymmetricBuffer` -- one buffer of identical shape on every rank of a group, mapped
  into every peer's address space (``torch.distributed._symmetric_memory``), with views of
  any rank's copy and a cross-rank barrier that runs on the current CUDA stream.
  Copies between a local view and a peer view (``dst.copy_(src)``) are ``cudaMemcpyAsync``
  over NVLink: they run on the copy engines and need no SM.
* :func:`write_flag_at` / :func:`wait_flag_at` -- ``cuStreamWriteValue32`` /
  ``cuStreamWaitValue32`` (cuda-bindings): write an int32 (local or in a peer's memory) in
  stream order, after the stream's earlier copies, or hold a stream until one reaches a
  value, without an SM. A kernel that occupies every SM can therefore spin on such a flag
  without deadlocking, and no barrier kernel has to find a free SM.
* :class:`ShardPusher` -- the all-gather of row shards built from the two (AG-GEMM, AG-MoE).
* :func:`overlap_support` -- whether all this is usable here, and if not, why.

Only the GPU paths use this module; on CPUs the kernels gather with gloo instead.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from disttune.graphs import capturing

from .tp_common import group_info, row_starts

__all__ = ["SymmetricBuffer", "ShardPusher", "SignalBoard", "copy_async", "stream_handle", "wait_flag_at",
           "write_flag_at", "chunk_rows", "CHUNK_ALIGN", "DEFAULT_STREAMS", "push_order", "arrival_order", "uses_nccl", "overlap_support", "flag_writer_available",
           "capturing", "refuse_capture", "refuse_epoch_capture", "Timeline"]


@functools.lru_cache(maxsize=None)
def _driver():
    try:
        from cuda.bindings import driver  # cuda-bindings >= 12.6
    except ImportError:
        from cuda import cuda as driver  # older cuda-python
    return driver


def flag_writer_available() -> tuple[bool, str]:
    """(True, "") if ``cuStreamWriteValue32`` can be called through cuda-bindings."""
    try:
        _driver()
    except ImportError as err:
        return False, f"cuda-bindings is not installed ({err}); `pip install cuda-bindings` enables the overlapped GPU kernels"
    return True, ""


_CURRENT_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # absent from CPU builds of torch


def raw_current_stream(device_index: int) -> int:
    """The ``cudaStream_t`` of ``device_index``'s current stream, as an int (one C call)."""
    if _CURRENT_RAW_STREAM is not None:
        return _CURRENT_RAW_STREAM(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


def stream_handle(stream):
    """The ``CUstream`` of a torch stream (a ``CUstream`` is passed through)."""
    driver = _driver()
    return stream if isinstance(stream, driver.CUstream) else driver.CUstream(stream.cuda_stream)


def write_flag_at(stream, address, value: int) -> None:
    """Set the int32 at ``address`` (int or ``CUdeviceptr``; local or peer-mapped) to ``value`` in
    ``stream``'s order (a torch stream or a ``CUstream``), with no SM.

    The write is ordered after the stream's earlier work and carries a memory barrier, so a
    reader that waits for the value (or loads it with acquire semantics) then sees the data
    copied before it."""
    _check(_driver().cuStreamWriteValue32(stream_handle(stream), _pointer(address), value, 0),
           "cuStreamWriteValue32")


def _pointer(address):
    """A ``CUdeviceptr`` for an int address (computed plans keep theirs)."""
    return address if not isinstance(address, int) else _driver().CUdeviceptr(address)


def _check(result, what: str) -> None:
    err = result[0] if isinstance(result, tuple) else result
    if int(err) != 0:
        raise RuntimeError(f"{what} failed with CUresult {err}")


def _GEQ():
    return _driver().CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ


def wait_flag_at(stream, address, value: int) -> None:
    """Hold ``stream`` (no SM, no host wait) until the int32 at ``address`` is >= ``value``.

    ``cuStreamWaitValue32`` with ``GEQ``: the comparison is wrap-safe for epoch counters.
    """
    _check(_driver().cuStreamWaitValue32(stream_handle(stream), _pointer(address), value, _GEQ()),
           "cuStreamWaitValue32")


#: Why the epoch-flagged GPU paths (AG-GEMM, GEMM-RS, ag_moe without graph_safe) refuse CUDA graph capture.
EPOCH_FLAGS = ("its arrival flags carry a per-call epoch that every replay would repeat; call it outside the graph "
               "(it has no graph-safe mode yet)")


def refuse_capture(who: str, why: str) -> None:
    """RuntimeError if the current CUDA stream is being captured into a graph: ``who`` cannot be replayed
    correctly from one (``why``), and saying so beats an invalidated capture or a silently wrong replay."""
    if capturing():
        raise RuntimeError(f"{who} cannot be captured in a CUDA graph: {why}")


def refuse_epoch_capture(who: str, t: torch.Tensor) -> None:
    """:func:`refuse_capture` for a call on CUDA tensor ``t`` whose flags carry a per-call epoch
    (:data:`EPOCH_FLAGS`); calls on other devices are never captured and pass."""
    if t.is_cuda:
        refuse_capture(who, EPOCH_FLAGS)


def uses_nccl(group: Optional[dist.ProcessGroup] = None) -> bool:
    """Whether ``group`` runs its CUDA collectives on NCCL (also for "cpu:gloo,cuda:nccl" groups); asked once
    per group (:func:`~.tp_common.group_info`)."""
    return "nccl" in group_info(group).backend


def overlap_support(group: Optional[dist.ProcessGroup] = None) -> tuple[bool, str]:
    """Whether symmetric memory and the stream memory operations (cuda-bindings) that the
    overlapped GPU kernels need can be used on ``group`` here: (ok, reason if not)."""
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    if not dist.is_initialized():
        return False, "torch.distributed is not initialized"
    backend = dist.get_backend(group)
    if not uses_nccl(group):
        return False, f"the process group uses {backend}; symmetric memory needs NCCL on CUDA devices"
    try:
        importlib.import_module("torch.distributed._symmetric_memory")
    except ImportError as err:
        return False, f"torch has no symmetric memory ({err})"
    return flag_writer_available()


class SymmetricBuffer:
    """A ``[*shape]`` tensor of ``dtype`` allocated on every rank of ``group`` and mapped into all.

    Creating one is a collective (every rank of the group must create it with the same
    shape and dtype) and costs a rendezvous (a few ms); keep it for the life of the job.
    """

    def __init__(self, shape: Sequence[int], dtype: torch.dtype, group: Optional[dist.ProcessGroup] = None,
                 device: Optional[torch.device] = None) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.group = group if group is not None else dist.group.WORLD
        self.shape = tuple(int(s) for s in shape)
        self.dtype = dtype
        device = device if device is not None else torch.device("cuda", torch.cuda.current_device())
        group_name = self.group.group_name
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None and not symm_mem.is_symm_mem_enabled_for_group(group_name):
            enable(group_name)  # needed by torch < 2.9; harmless later
        self.local = symm_mem.empty(self.shape, dtype=dtype, device=device)
        self.handle = symm_mem.rendezvous(self.local, self.group)
        self.rank = self.handle.rank
        self.world_size = self.handle.world_size
        self._peers: dict[int, torch.Tensor] = {self.rank: self.local}

    def peer(self, rank: int) -> torch.Tensor:
        """Rank ``rank``'s copy of the buffer as a local tensor (its own copy for ``rank == self.rank``)."""
        view = self._peers.get(rank)
        if view is None:
            view = self._peers[rank] = self.handle.get_buffer(rank, self.shape, self.dtype, 0)
        return view

    def barrier(self, channel: int = 0) -> None:
        """Every rank of the group reaches this point of its current stream before any goes on (GPU-side)."""
        self.handle.barrier(channel=channel)


#: Copy streams the overlapped kernels spread a push's pieces over by default. One copy engine already moves
#: 367 GB/s to a peer on 2 x H200 (both ways at once), and more streams moved less (docs/benchmarks.md,
#: "The transport for N peers"); ``streams=`` tries more.
DEFAULT_STREAMS = 1

#: Chunks of a pushed shard start at multiples of this many rows (``shard_gemm.MAX_BLOCK_M``),
#: so no GEMM tile spans two chunks.
CHUNK_ALIGN = 256


def chunk_rows(rows: Sequence[int], chunks: int) -> int:
    """Rows per chunk when every shard of ``rows`` is pushed in at most ``chunks`` pieces."""
    per = -(-max(max(rows), 1) // max(1, chunks))
    return -(-per // CHUNK_ALIGN) * CHUNK_ALIGN


class SignalBoard:
    """int32 signal slots in symmetric memory, two rows per rank: ``ARRIVED`` and ``FREED``.

    Producers set a slot *in the consumer's memory* with :func:`write_flag_at` (after their
    copies, in stream order); consumers wait on their own slots with :func:`wait_flag_at` or
    spin on them in a kernel. Values are epochs (call counters), so flags are never reset (except in
    the graph-safe use below).
    Creating one is a collective (zeroed, the FREED row set to ``freed``, then one barrier); 8 KB per rank.
    """

    ARRIVED, FREED = 0, 1
    #: Slots per row.
    SLOTS = 1024

    def __init__(self, group: Optional[dist.ProcessGroup], device: torch.device, freed: int = 0) -> None:
        self.buffer = SymmetricBuffer((2, self.SLOTS), torch.int32, group, device)
        self.buffer.local.zero_()
        self.buffer.local[self.FREED].fill_(freed)
        torch.cuda.current_stream().synchronize()
        self.buffer.barrier()  # every rank's flags hold their initial values before anyone signals
        torch.cuda.current_stream().synchronize()
        self.rank, self.world_size = self.buffer.rank, self.buffer.world_size

    @property
    def arrived(self) -> torch.Tensor:
        """This rank's ``ARRIVED`` row (``[SLOTS]`` int32), for kernels that spin on it."""
        return self.buffer.local[self.ARRIVED]

    def address(self, owner: int, row: int, index: int):
        """The ``CUdeviceptr`` of slot ``index`` of ``row`` in rank ``owner``'s memory."""
        if not 0 <= index < self.SLOTS:
            raise ValueError(f"SignalBoard: slot {index} out of range (at most {self.SLOTS} per row)")
        return _driver().CUdeviceptr(self.buffer.peer(owner).data_ptr() + 4 * (row * self.SLOTS + index))


def copy_async(stream, dest: int, source: int, nbytes: int) -> None:
    """``cuMemcpyDtoDAsync`` (the copy engines; local or peer-mapped addresses) on a ``CUstream``."""
    driver = _driver()
    _check(driver.cuMemcpyDtoDAsync(driver.CUdeviceptr(dest), driver.CUdeviceptr(source), nbytes, stream),
           "cuMemcpyDtoDAsync")


def pieces_of(rows: int, dest: int, row_bytes: int, step_rows: int, flag_of: Callable[[int], Any]) -> list:
    """A push of ``rows`` rows to address ``dest`` cut into ``step_rows``-row pieces:
    ``[(offset from the source, destination, bytes, arrival flag address)]``, piece ``c`` flagged at ``flag_of(c)``."""
    return [(first * row_bytes, dest + first * row_bytes, (min(rows, first + step_rows) - first) * row_bytes,
             flag_of(c)) for c, first in enumerate(range(0, rows, step_rows))]


def push_pieces(stream, source: int, pieces: Sequence[tuple], epoch: int, free=None, graph_safe: bool = False,
                ready: Optional[Sequence[Any]] = None) -> None:
    """On ``stream`` (a ``CUstream``): wait until ``free`` (the destination's "read it" flag for this
    target, if any) holds ``epoch - 2``, then copy each piece from ``source`` and set its arrival flag
    to ``epoch``. The double-buffered pattern (epoch mode) shared by :class:`ShardPusher` and GEMM-ReduceScatter.
    ``ready``: a flag address per piece that must hold ``epoch`` before the piece is copied (a piece that a
    kernel running beside the stream is still writing).

    ``graph_safe``: fixed values instead of epochs (``epoch`` is then 1): wait until ``free`` is 1
    (the destination has read the last push), set it back to 0, then copy and flag as above."""
    if free is not None:
        if graph_safe:
            wait_flag_at(stream, free, 1)
            write_flag_at(stream, free, 0)
        elif epoch > 2:  # the destination has read what was put in this half two calls ago
            wait_flag_at(stream, free, epoch - 2)
    for n, (offset, dest, size, flag) in enumerate(pieces):
        if ready is not None:
            wait_flag_at(stream, ready[n], epoch)
        if size:  # (a graph-safe sender without rows still signals: the handshake runs every call)
            copy_async(stream, dest, source + offset, size)
        write_flag_at(stream, flag, epoch)


class Timeline:
    """Where one call's GPU time goes: CUDA events recorded at named points on the streams that reach them.

    The overlapped kernels take one as ``timeline=`` and mark their steps (a GEMM done, a shard landed, a
    push done, on the stream that did it); :meth:`read` gives each point's milliseconds after the first.
    For benchmarks and diagnosis: each mark costs an event record (a few µs of host), so leave it None in
    production."""

    def __init__(self) -> None:
        self.marks: list = []

    def mark(self, label: str, stream) -> None:
        """An event on ``stream`` (a torch stream) labelled ``label``."""
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        self.marks.append((label, event))

    def read(self) -> list[tuple[str, float]]:
        """``[(label, ms after the first mark)]`` in the order marked (waits for the last events)."""
        if not self.marks:
            return []
        for _, event in self.marks:
            event.synchronize()
        first = self.marks[0][1]
        return [(label, first.elapsed_time(event)) for label, event in self.marks]


class ShardPusher:
    """All-gather of row shards by copy-engine *pushes*, signalled by stream memory operations.

    No SM and no barrier kernel is involved, so a GEMM that fills the GPU can run at the same
    time, and the caller can launch its local work before anything else.

    ``gather(local, rows)`` makes ``streams`` side streams wait for the current stream (so
    ``local`` is ready), runs ``local_work()`` if given (launch the GEMM on the local shard
    there: it needs nothing from the peers), then pushes ``local`` to each peer ``p`` in
    :func:`push_order` (rank+1, rank+2, ...: at each step every rank sends to one rank and
    receives from one, so shards land one after another in :func:`arrival_order`). A push is cut
    into ``chunks`` pieces (multiples of 256 rows) spread over the side streams, so that several
    copy engines carry one shard at once (one engine alone moves a fraction of what NVLink can);
    each stream waits until ``p`` has finished reading what this rank pushed into the same half of
    its workspace two calls ago (epoch mode; graph-safe: below), copies its pieces
    (``cuMemcpyDtoDAsync``, copy engine) and after each sets the piece's arrival flag *in ``p``'s
    memory* to this call's epoch (1 when graph-safe). With ``include_own`` the local shard is also
    copied into the own workspace and flagged (for a kernel that reads every shard from the
    workspace), on a copy stream of its own, beside the first push to a peer rather than ahead of
    it. It returns the ``[sum(rows), H]`` workspace at once.

    Consume shard ``s`` after :meth:`wait_shard` (a stream wait, no host wait) or from a kernel
    that spins until ``arrival_flags[s * chunks + c] >= epoch``; call :meth:`finish` after
    the last kernel that reads the workspace was launched: it tells every peer that this
    rank's half of the workspace (its only one, graph-safe) is free again.

    Memory: a ``[2, capacity, H]`` symmetric workspace (double-buffered, one half when graph-safe;
    grown as needed, a regrowth is a collective) and a small int32 signal buffer. Cost per call: ``(w - 1) chunks``
    copies on the copy engines, about ``(w - 1) (chunks + streams)`` stream memory operations and no local copy
    (one with ``include_own``); on the host, a driver call per operation (the addresses are computed once per shape).

    ``graph_safe=True``: every value written is fixed, so a CUDA graph that captured calls
    (``torch.cuda.graph``) can replay them. Epochs would be baked into the graph and repeat on
    replay, letting a reader pass a flag set by the previous replay. Instead:

    * a sender waits until the destination's "read it" flag is 1 and sets it back to 0 before it
      pushes (all of a destination's pieces go on one stream, the one that did the handshake), then sets the arrival flags to 1 (:attr:`epoch` stays 1). A sender without rows still
      does this (it sets its first arrival flag, copying nothing), so the handshake pairs up every call;
    * :meth:`finish` (after the readers) waits until each arrival flag of the call is 1, sets it
      back to 0, *then* sets the "read it" flag of each peer to 1, so a peer's next arrival can only
      land after the reset;
    * the own shard (``include_own``) is copied on the current stream, ahead of everything the caller
      launches next: a kernel that occupies every SM and spins on its flag never waits for a copy
      that CUDA might run as a kernel and that a graph would not order before it.

    One workspace serves every call (a sender waits until the last push was read), and it must be
    allocated before capture: run the call once eagerly first, the usual warm-up before
    ``torch.cuda.graph``. A workspace outgrown later is kept alive, since captured graphs still
    point at it. Cost: about ``4 w`` more stream memory operations per call (a wait and a clear of
    each peer's "read it" flag before pushing, a wait and a clear of each arrival flag in :meth:`finish`).
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None, streams: int = 1, graph_safe: bool = False) -> None:
        self.group = group
        self.graph_safe = graph_safe
        self.epoch = 0
        self._buffer: Optional[SymmetricBuffer] = None
        self._signals: Optional[SignalBoard] = None
        self._n_streams = streams
        self._sides: list = []
        self._handles: list = []
        self._device_index = 0
        self._ready = self._pushed = None  # events joining the streams, reused every call
        self._plans: dict = {}
        self._plan = None
        self._retired: list = []  # graph-safe: outgrown workspaces that captured graphs may still use
        self._current_stream: Optional[tuple] = None  # (raw handle, torch stream, CUstream) last seen current
        self.timeline: Optional[Timeline] = None  # marks each push's end on its stream when set

    def _current(self) -> tuple:
        """The current stream of the pusher's device as (torch stream, ``CUstream``). Torch is asked for the raw
        handle only (one C call, where ``torch.cuda.current_stream`` builds a Python object through several
        layers: 5-8 µs on a busy host); the objects are made again when the current stream changes."""
        raw = raw_current_stream(self._device_index)
        cached = self._current_stream
        if cached is None or cached[0] != raw:
            stream = torch.cuda.current_stream(self._device_index)
            cached = self._current_stream = (raw, stream, stream_handle(stream))
        return cached[1], cached[2]

    @property
    def arrival_flags(self) -> torch.Tensor:
        """int32 flags of this rank: ``[s * chunks + c]`` holds the epoch of the last arrival (graph-safe:
        1 from an arrival until :meth:`finish` clears it)."""
        return self._signals.arrived

    def _setup(self, total: int, width: int, dtype: torch.dtype, device: torch.device) -> SymmetricBuffer:
        buf = self._buffer
        grow = buf is None or buf.shape[1] < total or buf.shape[2] != width or buf.dtype != dtype
        if (self._signals is None or grow) and capturing():
            raise RuntimeError(
                f"ShardPusher: the symmetric workspace for {total} rows x {width} {dtype} must be allocated "
                "before CUDA graph capture (allocating it is a collective with host synchronization); run the "
                "call once eagerly with the same shapes before capturing it")
        if self._signals is None:
            self._signals = SignalBoard(self.group, device, freed=1 if self.graph_safe else 0)
            # the copy streams of the pushes to peers, then one for the local copy of the own shard
            # (``include_own``), so that copy runs beside the first push instead of ahead of every push
            self._sides = [torch.cuda.Stream(device=device) for _ in range(self._n_streams + 1)]
            self._handles = [stream_handle(side) for side in self._sides]
            # the pusher serves one device (its streams, events and buffers live there); current_stream(None)
            # would look the current device up through several Python layers on every call
            self._device_index = device.index if device.index is not None else torch.cuda.current_device()
            self._ready = torch.cuda.Event()
            self._pushed = [torch.cuda.Event() for _ in self._sides]
        if grow:
            if buf is not None:  # peers may still push into or read the old buffer: quiesce everyone
                torch.cuda.synchronize(device)
                self._signals.buffer.barrier()
                torch.cuda.synchronize(device)
                if self.graph_safe:
                    self._retired.append(buf)
            capacity = 1 << max(0, total - 1).bit_length()
            halves = 1 if self.graph_safe else 2
            buf = self._buffer = SymmetricBuffer((halves, capacity, width), dtype, self.group, device)
            self._plans.clear()
        return buf

    def _make_plan(self, rows: tuple, chunks: int, parity: int, include_own: bool) -> "_PushPlan":
        buf = self._buffer
        rank, world = buf.rank, buf.world_size
        if world * chunks > SignalBoard.SLOTS:
            raise ValueError(f"ShardPusher: {world} ranks x {chunks} chunks exceed {SignalBoard.SLOTS} signal slots")
        board = self._signals
        starts = row_starts(rows)
        step_rows = chunk_rows(rows, chunks)
        row_bytes = buf.shape[2] * buf.local.element_size()
        safe = self.graph_safe
        pushes = []  # (side index or None = current stream, free flag, pieces)
        targets = []  # the rank each push goes to
        for p in push_order(rank, world, include_own):
            arrival = lambda c, p=p: board.address(p, board.ARRIVED, rank * chunks + c)  # noqa: E731
            free = board.address(rank, board.FREED, p) if p != rank else None
            if rows[rank]:
                dest = buf.peer(p)[parity].data_ptr() + starts[rank] * row_bytes
                pieces = pieces_of(rows[rank], dest, row_bytes, step_rows, arrival)
            elif safe and p != rank:  # the handshake still runs: a flag, no copy
                pieces = [(0, 0, 0, arrival(0))]
            else:  # a rank without rows sends nothing, and nobody waits for its empty shard
                continue
            streams = self._n_streams
            if safe:  # one stream per target: the "read it" handshake resets its flag, so only one stream may wait on it
                groups = [(None if p == rank else len(pushes) % streams, pieces)]
            elif p == rank:  # the local copy, on the stream kept for it: the first push to a peer starts at once
                groups = [(streams, pieces)]
            else:  # the target's pieces spread over every copy stream, each stream waiting for the target's free flag
                groups = [(side, pieces[side::streams]) for side in range(min(streams, len(pieces)))]
            pushes += [(side, free, part) for side, part in groups]
            targets += [p] * len(groups)
        shard_flags = [[board.address(rank, board.ARRIVED, s * chunks + c) for c in range(-(-rows[s] // step_rows))]
                       for s in range(world)]
        frees = [board.address(p, board.FREED, rank) for p in range(world) if p != rank]
        arrivals = [board.address(rank, board.ARRIVED, s * chunks + c)
                    for s in range(world) if (s != rank or include_own) and (rows[s] or (safe and s != rank))
                    for c in range(max(1, -(-rows[s] // step_rows)))]
        own_side = any(side == self._n_streams for side, _, _ in pushes)
        joined = len(self._sides) if own_side else self._n_streams
        return _PushPlan(pushes, targets, shard_flags, frees, arrivals, buf.local[parity, :sum(rows)], joined)

    def gather(self, local: torch.Tensor, rows: Sequence[int], chunks: int = 1, local_work=None,
               include_own: bool = False) -> torch.Tensor:
        rows = tuple(rows)
        self._setup(sum(rows), local.shape[1], local.dtype, local.device)
        if self.graph_safe:
            self.epoch = 1
        else:
            self.epoch += 1
        epoch, parity = self.epoch, 0 if self.graph_safe else self.epoch % 2
        key = (rows, chunks, parity, include_own)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._make_plan(rows, chunks, parity, include_own)
        self._plan = plan
        if not local.is_contiguous():
            local = local.contiguous()
        current, current_handle = self._current()
        self._ready.record(current)  # (a wait uses the event as recorded when it is enqueued)
        for side in self._sides[:plan.joined]:
            side.wait_event(self._ready)
        if local_work is not None:
            local_work()
        source = local.data_ptr()
        for (side, free, pieces), target in zip(plan.pushes, plan.targets):
            handle = self._handles[side] if side is not None else current_handle
            push_pieces(handle, source, pieces, epoch, free, self.graph_safe)
            if self.timeline is not None:
                self.timeline.mark(f"pushed to rank {target} (copy stream {side})", self._sides[side] if side is not None
                                   else current)
        return plan.workspace

    def wait_shard(self, shard: int) -> None:
        """Make the current stream wait (on the GPU) until every piece of ``shard`` has arrived (one stream
        wait per piece: pieces travel on several copy streams, so the last one sent need not land last)."""
        self._wait_for(self._plan.shard_flags[shard:shard + 1])

    def wait_all(self) -> None:
        """:meth:`wait_shard` for every shard of the last gather."""
        self._wait_for(self._plan.shard_flags)

    def _wait_for(self, shards: Sequence[Sequence[Any]]) -> None:
        """The current stream waits for every piece of ``shards`` (each a list of arrival flag addresses)."""
        _, current = self._current()
        for flags in shards:
            for address in flags:
                wait_flag_at(current, address, self.epoch)

    def finish(self) -> None:
        """After the last reader of the workspace: the current stream waits for this rank's pushes
        (``local`` may be reused) and then tells every peer that this half is free (graph-safe: after
        setting this rank's arrival flags back to 0)."""
        current, handle = self._current()
        for side, pushed in zip(self._sides[:self._plan.joined], self._pushed):
            pushed.record(side)
            current.wait_event(pushed)
        if self.graph_safe:
            for address in self._plan.arrivals:  # (a reader may not have waited for every flag it got)
                wait_flag_at(handle, address, 1)
                write_flag_at(handle, address, 0)
        for address in self._plan.frees:
            write_flag_at(handle, address, self.epoch)


def push_order(rank: int, world: int, include_own: bool = False) -> list[int]:
    """The ranks ``rank`` pushes its shard to, in order: itself first (``include_own``), then ``rank + 1``,
    ``rank + 2``, ... So at step ``k`` every rank sends to the rank ``k`` after it: each rank receives from one
    sender at a time, the shard of ``rank - k``, and consumes shards in :func:`arrival_order`."""
    return ([rank] if include_own else []) + [(rank + k) % world for k in range(1, world)]


def arrival_order(rank: int, world: int) -> list[int]:
    """The shards ``rank`` receives, in the order :func:`push_order` delivers them: its own, then ``rank - 1``,
    ``rank - 2``, ... A consumer that walks shards in this order waits for each only as long as the transport
    takes to deliver it."""
    return [(rank - k) % world for k in range(world)]


class _PushPlan(NamedTuple):
    pushes: list  # (side index or None = current stream, own free flag or None, [(offset, dest, bytes, flag)])
    targets: list  # the rank each of ``pushes`` goes to
    shard_flags: list  # per shard: the addresses of its pieces' arrival flags here (empty: an empty shard)
    frees: list  # the peers' free-flag addresses for this rank
    arrivals: list  # every arrival flag here that a call of this plan sets (graph-safe finish resets them)
    workspace: torch.Tensor
    joined: int  # the side streams a call joins: the copy streams, and the local copy's when it has one
