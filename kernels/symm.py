"""GPU transport for the overlapped kernels: torch symmetric memory and copy-engine signals.

* :class:`SymmetricBuffer` -- one buffer of identical shape on every rank of a group, mapped
  into every peer's address space (``torch.distributed._symmetric_memory``), with views of
  any rank's copy and a cross-rank barrier that runs on the current CUDA stream.
  Copies between a local view and a peer view (``dst.copy_(src)``) are ``cudaMemcpyAsync``
  over NVLink: they run on the copy engines and need no SM.
* :func:`write_flag` -- ``cuStreamWriteValue32`` (cuda-bindings): writes an int32 in global
  memory in stream order, after the stream's earlier copies, without an SM. A
  kernel that occupies every SM can therefore spin on such a flag without deadlocking.
* :func:`overlap_support` -- whether both are usable here, and if not, why.

Only the GPU paths use this module; on CPUs the kernels gather with gloo instead.
"""

from __future__ import annotations

import functools
import importlib
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .tp_common import row_starts

__all__ = ["SymmetricBuffer", "ShardPuller", "chunk_rows", "CHUNK_ALIGN", "uses_nccl", "write_flag", "overlap_support", "flag_writer_available"]


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
        return False, f"cuda-bindings is not installed ({err}); `pip install cuda-bindings` enables the fused design"
    return True, ""


def write_flag(stream: torch.cuda.Stream, flag: torch.Tensor, value: int = 1) -> None:
    """Set the int32 ``flag`` (one element) to ``value`` in ``stream``'s order, with no SM.

    The write is ordered after the stream's earlier work and carries a memory barrier, so
    a kernel that reads the flag with acquire semantics then sees the data copied before it.
    """
    driver = _driver()
    (err,) = driver.cuStreamWriteValue32(driver.CUstream(stream.cuda_stream), driver.CUdeviceptr(flag.data_ptr()),
                                         value, 0)
    if int(err) != 0:
        raise RuntimeError(f"cuStreamWriteValue32 failed with CUresult {err}")


def uses_nccl(group: Optional[dist.ProcessGroup] = None) -> bool:
    """Whether ``group`` runs its CUDA collectives on NCCL (also for "cpu:gloo,cuda:nccl" groups)."""
    return "nccl" in str(dist.get_backend(group))


def overlap_support(group: Optional[dist.ProcessGroup] = None, need_flags: bool = False) -> tuple[bool, str]:
    """Whether the overlapped GPU designs can run on ``group`` here: (ok, reason if not)."""
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
    if need_flags:
        return flag_writer_available()
    return True, ""


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


#: Chunks of a pulled shard start at multiples of this many rows (``shard_gemm.MAX_BLOCK_M``),
#: so no GEMM tile spans two chunks.
CHUNK_ALIGN = 256


def chunk_rows(rows: Sequence[int], chunks: int) -> int:
    """Rows per chunk when every shard of ``rows`` is pulled in at most ``chunks`` pieces."""
    per = -(-max(max(rows), 1) // max(1, chunks))
    return -(-per // CHUNK_ALIGN) * CHUNK_ALIGN


class ShardPuller:
    """All-gather of row shards by copy-engine pulls, in chunks, with events or ready flags.

    ``gather(local, rows)`` copies this rank's ``[rows[rank], H]`` shard into its slot of a
    double-buffered symmetric workspace, meets the other ranks in one GPU-side barrier, then
    pulls every other shard (in the order rank+1, rank+2, ...) into the same local workspace
    in chunks of :func:`chunk_rows` rows, alternating between ``streams`` side streams (two let
    two copy engines work at once; the default one is what was measured on H200s). After each chunk it sets that chunk's int32 flag with
    :func:`write_flag` when ``flags`` (``[w * chunks]``) is given; after each shard it records
    the shard's events. It returns the gathered ``[sum(rows), H]`` view at once: consume shard
    ``s`` after :meth:`wait_shard` (or from a kernel that spins on the flags), then call
    :meth:`finish` before the next gather.

    The workspace grows to the largest ``sum(rows)`` seen (re-allocation is a collective, and
    every rank sees the same ``rows``). Cost per gather: one local copy, one barrier, the
    ``w - 1`` shards' copies on the copy engines (no SM).
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None, streams: int = 1) -> None:
        self.group = group
        self._buffer: Optional[SymmetricBuffer] = None
        self._step = 0
        self._n_streams = streams
        self._sides: list = []
        self._events: list = []

    def _workspace(self, total: int, width: int, dtype: torch.dtype, device: torch.device) -> SymmetricBuffer:
        buf = self._buffer
        if buf is None or buf.shape[1] < total or buf.shape[2] != width or buf.dtype != dtype:
            if buf is not None:  # peers may still pull from the old buffer: meet them before dropping it
                torch.cuda.current_stream().synchronize()
                buf.barrier(channel=0)
                torch.cuda.current_stream().synchronize()
            capacity = 1 << max(0, total - 1).bit_length()
            buf = self._buffer = SymmetricBuffer((2, capacity, width), dtype, self.group, device)
        if not self._sides:
            self._sides = [torch.cuda.Stream(device=device) for _ in range(self._n_streams)]
            self._events = [[torch.cuda.Event() for _ in self._sides] for _ in range(buf.world_size)]
        return buf

    def gather(self, local: torch.Tensor, rows: Sequence[int], flags: Optional[torch.Tensor] = None,
               chunks: int = 1) -> torch.Tensor:
        total, width = sum(rows), local.shape[1]
        buf = self._workspace(total, width, local.dtype, local.device)
        rank, world = buf.rank, buf.world_size
        starts = row_starts(rows)
        step_rows = chunk_rows(rows, chunks)
        parity = self._step % 2
        self._step += 1
        workspace = buf.local[parity, :total]
        current = torch.cuda.current_stream()
        for side in self._sides:  # the previous gather's pulls are done before anything is rewritten
            current.wait_stream(side)
        if flags is not None:
            flags.zero_()
        workspace[starts[rank]: starts[rank] + rows[rank]].copy_(local)
        # All shards are in place; and since every rank waited for its own previous pulls before the
        # barrier of the previous call, nobody still reads this parity's last contents.
        buf.barrier(channel=0)
        for side in self._sides:
            side.wait_stream(current)
        source = buf.peer
        n = 0
        for s in [(rank + i) % world for i in range(1, world)]:
            for c, first in enumerate(range(0, rows[s], step_rows)):
                side = self._sides[n % len(self._sides)]
                n += 1
                block = slice(starts[s] + first, starts[s] + min(rows[s], first + step_rows))
                with torch.cuda.stream(side):
                    workspace[block].copy_(source(s)[parity, block])
                    if flags is not None:
                        write_flag(side, flags[s * chunks + c: s * chunks + c + 1])
            for side, event in zip(self._sides, self._events[s]):
                event.record(side)
        return workspace

    def wait_shard(self, shard: int) -> None:
        """Make the current stream wait until shard ``shard`` of the last gather has arrived."""
        current = torch.cuda.current_stream()
        for event in self._events[shard]:
            current.wait_event(event)

    def finish(self) -> None:
        """Make the current stream wait for every pull of the last gather."""
        current = torch.cuda.current_stream()
        for side in self._sides:
            current.wait_stream(side)
