"""CPU stand-ins for what ``kernels.symm.ShardPusher`` needs from GPUs, for tests of its bookkeeping and
protocol on machines without them (the pushes themselves run in the GPU tests).

* :class:`Board` -- a SignalBoard's flag layout: addresses are ``(owner, row, slot)`` tuples.
* :class:`Workspace` -- one rank's view of the group's workspaces, each rank's a CPU tensor standing in
  for its symmetric-memory copy (so copies between them are real memory copies).
* :func:`simulated_pusher` -- a ShardPusher of one simulated rank, its setup done with these.
"""

from __future__ import annotations

import torch

from disttune.kernels.symm import ShardPusher, SignalBoard


class Board:
    """The flag layout of a SignalBoard, as addresses (owner, row, slot)."""

    ARRIVED, FREED = SignalBoard.ARRIVED, SignalBoard.FREED

    def address(self, owner: int, row: int, index: int) -> tuple:
        if not 0 <= index < SignalBoard.SLOTS:
            raise ValueError(f"slot {index} out of range")
        return owner, row, index


class Workspace:
    """One rank's view of the group's workspaces: its own tensor and its peers'."""

    def __init__(self, rank: int, tensors: list) -> None:
        self.rank, self.world_size, self._tensors = rank, len(tensors), tensors
        self.local = tensors[rank]
        self.shape, self.dtype = tuple(self.local.shape), self.local.dtype

    def peer(self, rank: int) -> torch.Tensor:
        return self._tensors[rank]


def workspaces(world: int, rows: int, width: int, graph_safe: bool, dtype=torch.float32) -> list:
    """Every rank's workspace tensor, ``[halves, rows, width]`` as ShardPusher._setup allocates them."""
    return [torch.zeros(1 if graph_safe else 2, max(1, rows), width, dtype=dtype) for _ in range(world)]


def simulated_pusher(rank: int, tensors: list, graph_safe: bool, sides=(None,), own_side="own copy", ready=None,
                     pushed=None) -> ShardPusher:
    """Rank ``rank``'s pusher over the workspaces ``tensors``, with ``sides`` as its copy streams and ``own_side``
    as the stream of its local copy (each stream its own handle), and ``ready`` / ``pushed`` as its events."""
    pusher = ShardPusher(None, streams=len(sides), graph_safe=graph_safe)
    pusher._buffer, pusher._signals = Workspace(rank, tensors), Board()
    pusher._sides = pusher._handles = [*sides, own_side]
    pusher._ready, pusher._pushed = ready, pushed
    return pusher
