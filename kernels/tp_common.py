"""What the tensor-parallel kernels share: row splits, group facts and a cross-rank input check."""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["GroupInfo", "group_info", "split_rows", "check_same_on_all_ranks", "check_inputs", "check_rows", "row_starts", "check_matrices"]


@dataclass(frozen=True)
class GroupInfo:
    group: Optional[dist.ProcessGroup]
    rank: int
    world_size: int
    backend: str


#: Each live process group's facts, as the :class:`GroupInfo` of a ``group=None`` caller (weakly keyed and holding
#: no reference to the group: a destroyed group is freed as before, a new default group is a new key).
_infos: "weakref.WeakKeyDictionary[dist.ProcessGroup, GroupInfo]" = weakref.WeakKeyDictionary()


def group_info(group: Optional[dist.ProcessGroup], max_world: Optional[int] = None) -> GroupInfo:
    """This rank's place in ``group`` (the default group when None); a clear error if none exists, or if
    the group has more than ``max_world`` ranks (the limit of the caller's kernel; None: no limit).
    Asked once per group (four c10d calls, 10-15 µs of a busy GPU host), then a dictionary lookup."""
    process_group = group if group is not None else dist.GroupMember.WORLD
    cacheable = isinstance(process_group, dist.ProcessGroup)  # not a rank's NON_GROUP_MEMBER marker, not None
    info = _infos.get(process_group) if cacheable else None
    if info is None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: call disttune.dist.init() (or "
                               "torch.distributed.init_process_group) before using the tensor-parallel kernels")
        info = GroupInfo(None, dist.get_rank(group), dist.get_world_size(group), str(dist.get_backend(group)))
        if cacheable:
            _infos[process_group] = info
    if group is not None:
        info = GroupInfo(group, info.rank, info.world_size, info.backend)
    if max_world is not None and info.world_size > max_world:
        raise ValueError(f"the tensor-parallel kernels handle at most {max_world} ranks per group, "
                         f"got {info.world_size}")
    return info


def row_starts(rows: Sequence[int]) -> list[int]:
    """First row of each shard: the prefix sums ``[0, rows0, rows0 + rows1, ...]`` (one per shard)."""
    return list(itertools.accumulate(rows, initial=0))[:-1]


def split_rows(total: int, world: int) -> tuple[int, ...]:
    """``torch.tensor_split``'s rule: the first ``total % world`` ranks get one row more."""
    base, extra = divmod(int(total), world)
    return tuple(base + (1 if r < extra else 0) for r in range(world))


def check_same_on_all_ranks(info: GroupInfo, who: str, signature: tuple, local: dict,
                            local_error: Optional[str] = None) -> None:
    """All-gather ``signature`` (what must agree) and raise the same ValueError on every rank if it differs.

    ``local_error``: what this rank's own input check found wrong (None if nothing), so a bad
    input on one rank is an error on every rank instead of a hang in the next collective.
    One small collective; callers cache the result per signature, so a job pays it once per shape.
    ``local`` describes this rank's inputs for the message.
    """
    gathered: list = [None] * info.world_size
    dist.all_gather_object(gathered, (signature, local, local_error), group=info.group)
    errors = [(r, err) for r, (_, _, err) in enumerate(gathered) if err]
    if errors:
        raise ValueError(f"{who}: invalid input on rank(s) {[r for r, _ in errors]}:\n"
                         + "\n".join(f"  rank {r}: {err}" for r, err in errors))
    first = gathered[0][0]
    differing = [r for r, (sig, _, _) in enumerate(gathered) if sig != first]
    if differing:
        lines = "\n".join(f"  rank {r}: {desc}" for r, (_, desc, _) in enumerate(gathered))
        raise ValueError(f"{who}: ranks were called with inconsistent inputs (ranks {differing} differ from rank 0):\n"
                         f"{lines}\nEvery rank must pass the same dtype, inner sizes and shard row counts.")


def check_inputs(info: GroupInfo, who: str, checked: set, signature: tuple, local: dict,
                 local_check: Callable[[], None]) -> None:
    """Run ``local_check`` (raises TypeError/ValueError on bad input) on every call; on the first call
    with ``signature`` also :func:`check_same_on_all_ranks`, which turns one rank's bad input into the
    same ValueError on every rank (a later call's local error is raised on that rank only)."""
    if signature in checked:
        local_check()
        return
    try:
        local_check()
    except (TypeError, ValueError) as err:
        local_error: Optional[str] = f"{type(err).__name__}: {err}"
    else:
        local_error = None
    check_same_on_all_ranks(info, who, signature, local, local_error)
    checked.add(signature)


def check_matrices(who: str, **tensors) -> None:
    """TypeError unless every keyword argument is a tensor, ValueError unless every one is 2-D."""
    names = " and ".join(tensors)
    if not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        raise TypeError(f"{who}: {names} must be torch.Tensors")
    if any(t.dim() != 2 for t in tensors.values()):
        raise ValueError(f"{who}: {names} must be 2-D, got " + " and ".join(str(tuple(t.shape)) for t in tensors.values()))


def check_rows(rows: Sequence[int], total: int, world: int, who: str) -> tuple[int, ...]:
    rows = tuple(int(r) for r in rows)
    if len(rows) != world or any(r < 0 for r in rows) or sum(rows) != total:
        raise ValueError(f"{who}: shard_rows {list(rows)} must list {world} non-negative row counts summing to {total}")
    return rows
