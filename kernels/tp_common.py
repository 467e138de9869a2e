"""What the tensor-parallel kernels share: row splits, group facts and a cross-rank input check."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["GroupInfo", "group_info", "split_rows", "check_same_on_all_ranks"]


@dataclass(frozen=True)
class GroupInfo:
    group: Optional[dist.ProcessGroup]
    rank: int
    world_size: int
    backend: str


def group_info(group: Optional[dist.ProcessGroup]) -> GroupInfo:
    """This rank's place in ``group`` (the default group when None); a clear error if none exists."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call disttune.dist.init() (or "
                           "torch.distributed.init_process_group) before using the tensor-parallel kernels")
    from .shard_gemm import MAX_WORLD

    world = dist.get_world_size(group)
    if world > MAX_WORLD:
        raise ValueError(f"the tensor-parallel kernels handle at most {MAX_WORLD} ranks per group, got {world}")
    return GroupInfo(group, dist.get_rank(group), world, dist.get_backend(group))


def split_rows(total: int, world: int) -> tuple[int, ...]:
    """``torch.tensor_split``'s rule: the first ``total % world`` ranks get one row more."""
    base, extra = divmod(int(total), world)
    return tuple(base + (1 if r < extra else 0) for r in range(world))


def check_same_on_all_ranks(info: GroupInfo, who: str, signature: tuple, local: dict) -> None:
    """All-gather ``signature`` (what must agree) and raise the same ValueError on every rank if it differs.

    One small collective; callers cache the result per signature, so a job pays it once per shape.
    ``local`` describes this rank's inputs for the message.
    """
    gathered: list = [None] * info.world_size
    dist.all_gather_object(gathered, (signature, local), group=info.group)
    first = gathered[0][0]
    differing = [r for r, (sig, _) in enumerate(gathered) if sig != first]
    if differing:
        lines = "\n".join(f"  rank {r}: {desc}" for r, (_, desc) in enumerate(gathered))
        raise ValueError(f"{who}: ranks were called with inconsistent inputs (ranks {differing} differ from rank 0):\n"
                         f"{lines}\nEvery rank must pass the same dtype, inner sizes and shard row counts.")


def check_rows(rows: Sequence[int], total: int, world: int, who: str) -> tuple[int, ...]:
    rows = tuple(int(r) for r in rows)
    if len(rows) != world or any(r < 0 for r in rows) or sum(rows) != total:
        raise ValueError(f"{who}: shard_rows {list(rows)} must list {world} non-negative row counts summing to {total}")
    return rows
