"""CUDA graphs of a tuned step: each argument signature's call captured once, then replayed.

An eager step of a dozen launches and a few collectives costs the host hundreds of µs per call (each
Triton launch 20-25 µs, each c10d collective 30-150 µs), which at a millisecond of GPU work can be
the whole step's time. :class:`StepGraphs` turns every call after the first of a signature into one
``CUDAGraph.replay()`` and a copy per tensor argument: a few µs of host whatever the step launches.
``contextual_autotune(cuda_graph=True)`` holds one per wrapper and uses it after tuning, so the graph
captures the agreed winners; a later tuning (new keys, ``retune``) drops the graphs.

A call's *signature* is its arguments' structure, each tensor's shape, strides, dtype and device, and
every other argument's value (which must be hashable; a call with an unhashable one runs eagerly).
For each signature: the first call runs the step as it is (its lazy allocations, Triton's compiles
and communicator set-up happen then, outside any capture); the second clones the tensor arguments
into the graph's own inputs, captures the step on them and replays it; every later call copies its
tensors into those inputs and replays. Results are returned as clones (one copy per output tensor),
so a result stays valid after the next call.

What a replayed step must be, as for any CUDA graph: no host synchronization (``.item()``,
``.tolist()``, a host-side check), no CPU work whose effect the caller needs each call, and every
tensor it reads either an argument or one that keeps its address (a closure's weights, updated in
place). Non-tensor results are those of the capture call. Memory: each graph keeps the memory its
step allocated (its private pool) until it is dropped; at most :data:`GRAPHS_PER_STEP` are kept per
step, the least recently used dropped first. Graphs that captured NCCL collectives must be dropped
before their communicators are destroyed: :func:`release_all` does it, and ``disttune.dist.destroy``
and the exit handler call it.
"""

from __future__ import annotations

import atexit
import collections
import weakref
from typing import Any, Callable, Optional

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .env import interpreting

__all__ = ["GRAPHS_PER_STEP", "CudaGraphCapture", "StepGraphs", "release_all", "signature", "why_unavailable"]

#: Graphs kept per step (one per signature), least recently used dropped first.
GRAPHS_PER_STEP = 8

_SEEN = object()  # a signature called once, not captured yet
_UNHASHABLE = object()

_live: "weakref.WeakSet[StepGraphs]" = weakref.WeakSet()


def why_unavailable() -> str:
    """Why CUDA graphs cannot replay a step here ("" where they can): no CUDA GPU, or Triton's interpreter."""
    if not torch.cuda.is_available():
        return "there is no CUDA GPU here"
    if interpreting():
        return "Triton runs in its interpreter here (TRITON_INTERPRET=1): kernels run on the CPU"
    return ""


def signature(args: tuple, kwargs: dict) -> tuple[Optional[tuple], list, Any]:
    """``(key, leaves, spec)`` of a call: the key is None when an argument that is not a tensor is unhashable."""
    leaves, spec = tree_flatten((args, kwargs))
    parts = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            parts.append((tuple(leaf.shape), leaf.stride(), leaf.dtype, leaf.device, leaf.requires_grad))
        else:
            try:
                hash(leaf)
            except TypeError:
                return None, leaves, spec
            parts.append((type(leaf), leaf))
    return (spec, tuple(parts)), leaves, spec


class CudaGraphCapture:
    """The real capture: ``torch.cuda.graph`` around the step (on its private memory pool), replayed by
    ``CUDAGraph.replay`` on the current stream. A capture synchronizes the device (torch does) and costs
    the step's own launch time once."""

    def __call__(self, step: Callable[[], Any]) -> tuple[Callable[[], None], Any]:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = step()
        return graph.replay, outputs


class _Graph:
    __slots__ = ("replay", "inputs", "outputs")

    def __init__(self, replay: Callable[[], None], inputs: list, outputs: Any) -> None:
        self.replay, self.inputs, self.outputs = replay, inputs, outputs


class StepGraphs:
    """A step's CUDA graphs, one per call signature (see the module doc). ``name`` is the step's, for errors.

    ``capture`` makes a graph of a step (``CudaGraphCapture``, the real one, by default); tests that must run
    the cache's logic without a GPU pass their own. ``captures`` and ``replays`` count what the graphs did.
    """

    def __init__(self, name: str, capture: Optional[Callable] = None, capacity: int = GRAPHS_PER_STEP) -> None:
        self.name = name
        self.capacity = capacity
        self._capture = capture if capture is not None else CudaGraphCapture()
        self._graphs: collections.OrderedDict = collections.OrderedDict()
        self.captures = 0
        self.replays = 0
        _live.add(self)

    def __len__(self) -> int:
        return sum(1 for entry in self._graphs.values() if isinstance(entry, _Graph))

    def seen(self, args: tuple, kwargs: dict) -> None:
        """Count a call made outside :meth:`__call__` (a tuning call) as a signature's first, eager call."""
        key = signature(args, kwargs)[0]
        if key is not None and key not in self._graphs:
            self._remember(key, _SEEN)

    def __call__(self, run: Callable[[tuple, dict], Any], args: tuple, kwargs: dict) -> Any:
        """``run(args, kwargs)`` the first time a signature is met, captured the second, replayed after (run as it
        is while the caller captures a graph of its own, which then holds the step's launches)."""
        if _capturing():
            return run(args, kwargs)
        key, leaves, spec = signature(args, kwargs)
        entry = self._graphs.get(key, None) if key is not None else _UNHASHABLE
        if isinstance(entry, _Graph):
            self._graphs.move_to_end(key)
            for mine, given in zip(entry.inputs, leaves):
                if mine is not None:
                    mine.copy_(given)
            entry.replay()
            self.replays += 1
            return _cloned(entry.outputs)
        if entry is None:
            self._remember(key, _SEEN)
        if entry is not _SEEN:  # a first call, or an unhashable argument: eager
            return run(args, kwargs)
        inputs = [leaf.clone() if isinstance(leaf, torch.Tensor) else None for leaf in leaves]
        bound = tree_unflatten([mine if mine is not None else leaf for mine, leaf in zip(inputs, leaves)], spec)
        try:
            replay, outputs = self._capture(lambda: run(*bound))
        except Exception as err:  # noqa: BLE001 - said again with what to do
            self._graphs.pop(key, None)
            raise RuntimeError(
                f"disttune: capturing {self.name} in a CUDA graph failed ({type(err).__name__}: {err}). A step "
                "replayed from a CUDA graph must not synchronize with the host (.item(), .tolist(), host-side checks "
                "of GPU values) nor allocate communicators or workspaces on its second call; fix the step or pass "
                "cuda_graph=False") from err
        self._remember(key, _Graph(replay, inputs, outputs))
        self.captures += 1
        replay()
        self.replays += 1
        return _cloned(outputs)

    def _remember(self, key: tuple, entry: Any) -> None:
        self._graphs[key] = entry
        self._graphs.move_to_end(key)
        while len(self._graphs) > self.capacity:
            self._graphs.popitem(last=False)

    def clear(self) -> None:
        """Drop every graph (and its memory): the next call of each signature runs eagerly again."""
        self._graphs.clear()


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _cloned(outputs: Any) -> Any:
    leaves, spec = tree_flatten(outputs)
    return tree_unflatten([leaf.clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves], spec)


def release_all() -> None:
    """Drop every step's graphs: call it, once the device has drained, before destroying the process groups
    whose collectives they captured (NCCL cannot destroy a communicator a live graph still uses)."""
    for graphs in list(_live):
        graphs.clear()


atexit.register(release_all)
