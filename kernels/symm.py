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

__all__ = ["SymmetricBuffer", "write_flag", "overlap_support", "flag_writer_available"]


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


def overlap_support(group: Optional[dist.ProcessGroup] = None, need_flags: bool = False) -> tuple[bool, str]:
    """Whether the overlapped GPU designs can run on ``group`` here: (ok, reason if not)."""
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    if not dist.is_initialized():
        return False, "torch.distributed is not initialized"
    backend = dist.get_backend(group)
    if backend != "nccl":
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
