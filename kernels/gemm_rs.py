"""GEMM-ReduceScatter for tensor parallelism: rank r gets its row block of ``sum_r A_r @ B_r``.

Each rank holds ``A_r`` (``[M, K_r]``, its column shard of A) and ``B_r`` (``[K_r, N]``, its
row shard of B); rank ``r`` gets rows ``rows_r`` of ``sum_r A_r @ B_r`` (``[rows_r, N]``; rows are
split by ``torch.tensor_split``'s rule unless ``out_rows`` says otherwise). fp16/bf16 (fp32 too),
fp32 accumulation inside each GEMM; partials are rounded to the input dtype before the sum,
as ``matmul`` then ``reduce_scatter_tensor`` does.

GPU design (push, overlapped): the partial for each destination rank is computed in turn,
starting with the next rank's rows and ending with this rank's own. As soon as a partial is
done, the copy engines push it into the destination's symmetric-memory receive slot on a
side stream while the GEMM goes on with the next destination. After the own partial, one
symmetric-memory barrier (all pushes into this rank have landed) and one reduction kernel
sum the ``w`` slots into ``out``. Memory: ``[2, w, R, N]`` symmetric receive slots
(double-buffered: one barrier per call) and a ``[w, R, N]`` staging buffer (row ``rank``
unused), ``R`` the largest rank's rows rounded up to a power of two.

On CPUs (gloo, ``TRITON_INTERPRET=1``) the partials are computed with the same GEMM and
summed with ``dist.all_reduce`` (gloo has no reduce-scatter of tensors), then sliced.

The GEMM is a ``triton.autotune`` kernel: wrap the step with ``disttune.contextual_autotune``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .shard_gemm import check_gemm_inputs, make_shard_gemm_kernel, shard_gemm
from .symm import uses_nccl
from .tp_common import check_inputs, check_rows, group_info, row_starts, split_rows

__all__ = ["GemmReduceScatter", "gemm_rs", "gemm_rs_reference"]


class GemmReduceScatter:
    """Callable ``(a_local, b_local, out=None, out_rows=None) -> this rank's rows of sum_r A_r @ B_r``.

    Keep one per process group: the first call with a new shape allocates the buffers (a
    collective on GPUs) and checks that all ranks agree on the shapes.
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None, kernel=None) -> None:
        self.info = group_info(group)
        self.kernel = kernel if kernel is not None else make_shard_gemm_kernel()
        self._checked: set = set()
        self._buffers: dict = {}
        self._step = 0
        self._side: Optional[torch.cuda.Stream] = None
        self._events: list = []

    def __call__(self, a_local: torch.Tensor, b_local: torch.Tensor, out: Optional[torch.Tensor] = None,
                 out_rows: Optional[Sequence[int]] = None) -> torch.Tensor:
        info = self.info
        if not isinstance(a_local, torch.Tensor) or not isinstance(b_local, torch.Tensor):
            raise TypeError("GemmReduceScatter: a_local and b_local must be torch.Tensors")
        if a_local.dim() != 2 or b_local.dim() != 2:
            raise ValueError(f"GemmReduceScatter: a_local and b_local must be 2-D, got {tuple(a_local.shape)} and "
                             f"{tuple(b_local.shape)}")
        M, N = a_local.shape[0], b_local.shape[1]
        rows = (check_rows(out_rows, M, info.world_size, "GemmReduceScatter") if out_rows is not None
                else split_rows(M, info.world_size))
        mine = rows[info.rank]
        if out is None:
            out = torch.empty(mine, N, dtype=a_local.dtype, device=a_local.device)
        signature = (rows, a_local.shape[1], N, str(a_local.dtype))

        def local_check() -> None:
            if not isinstance(out, torch.Tensor) or tuple(out.shape) != (mine, N):
                raise ValueError(f"GemmReduceScatter: out must be a tensor of shape {(mine, N)} (rank {info.rank}'s "
                                 f"rows x N), got {tuple(out.shape) if isinstance(out, torch.Tensor) else out}")
            check_gemm_inputs(a_local, b_local, None, "GemmReduceScatter")  # the partials go to our own buffers

        check_inputs(info, "GemmReduceScatter", self._checked, signature,
                     {"a_local": tuple(a_local.shape), "b_local": tuple(b_local.shape), "dtype": str(a_local.dtype),
                      "out_rows": list(rows)}, local_check)
        if M == 0 or N == 0:
            return out
        if a_local.device.type == "cuda" and uses_nccl(info.group):
            return self._gpu_step(a_local, b_local, out, rows)
        return self._reduced_step(a_local, b_local, out, rows)

    # ------------------------------------------------------------------ GPU (push into symmetric memory)

    def _gpu_buffers(self, rows, N, dtype, device):
        """Receive slots and staging for ``max(rows)`` rows, grown to a power of two (a collective)."""
        key = (N, dtype)
        bufs = self._buffers.get(key)
        if bufs is None or bufs[0].shape[2] < max(rows):
            from .symm import SymmetricBuffer, overlap_support

            ok, why = overlap_support(self.info.group, signals=False)
            if not ok:
                raise RuntimeError(f"GemmReduceScatter: the overlapped GPU path is unavailable: {why}")
            if bufs is not None:  # peers may still push into the old slots: meet them before dropping them
                torch.cuda.current_stream().synchronize()
                bufs[0].barrier(channel=0)
                torch.cuda.current_stream().synchronize()
            world, capacity = self.info.world_size, 1 << max(0, max(rows) - 1).bit_length()
            recv = SymmetricBuffer((2, world, capacity, N), dtype, self.info.group, device)
            staging = torch.empty(world, capacity, N, dtype=dtype, device=device)
            bufs = self._buffers[key] = (recv, staging)
        if self._side is None:
            self._side = torch.cuda.Stream(device=device)
            self._events = [torch.cuda.Event() for _ in range(self.info.world_size)]
        return bufs

    def _gpu_step(self, a_local, b_local, out, rows):
        info = self.info
        rank, world = info.rank, info.world_size
        recv, staging = self._gpu_buffers(rows, b_local.shape[1], a_local.dtype, a_local.device)
        starts = row_starts(rows)
        parity = self._step % 2
        self._step += 1
        current, side = torch.cuda.current_stream(), self._side
        for d in [(rank + i) % world for i in range(1, world)]:
            part = staging[d, : rows[d]]
            shard_gemm(a_local[starts[d]: starts[d] + rows[d]], b_local, part, (rows[d],), 0, kernel=self.kernel)
            self._events[d].record(current)
            side.wait_event(self._events[d])
            with torch.cuda.stream(side):
                recv.peer(d)[parity, rank, : rows[d]].copy_(part)
        mine = rows[rank]
        slots = recv.local[parity, :, :mine]
        shard_gemm(a_local[starts[rank]: starts[rank] + mine], b_local, slots[rank], (mine,), 0, kernel=self.kernel)
        current.wait_stream(side)
        recv.barrier(channel=0)  # every rank's pushes into this rank have landed
        torch.sum(slots, dim=0, out=out)
        return out

    # ------------------------------------------------------------------ CPU / gloo

    def _reduced_step(self, a_local, b_local, out, rows):
        info = self.info
        rank, world = info.rank, info.world_size
        starts = row_starts(rows)
        partial = torch.empty(a_local.shape[0], b_local.shape[1], dtype=a_local.dtype, device=a_local.device)
        for d in [(rank + i) % world for i in range(1, world + 1)]:
            if rows[d]:
                block = slice(starts[d], starts[d] + rows[d])
                shard_gemm(a_local[block], b_local, partial[block], (rows[d],), 0, kernel=self.kernel)
        summed = partial.float()
        dist.all_reduce(summed, group=info.group)
        out.copy_(summed[starts[rank]: starts[rank] + rows[rank]])
        return out


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
