"""CUDA graphs of a tuned step: each argument signature's call captured once, then replayed.

An eager step of a dozen launches and a few collectives costs the host hundreds of µs per call (each
Triton launch 20-25 µs, each c10d collective 30-150 µs), which at a millisecond of GPU work can be
the whole step's time. :class:`StepGraphs` turns every call after the first of a signature into one
``CUDAGraph.replay()`` and a copy per tensor argument: a few µs of host whatever the step launches.
``contextual_autotune(cuda_graph=True)`` holds one per wrapper and uses it after tuning, so the graph
captures the agreed winners; a later tuning (new keys, ``retune``) drops the graphs.

A call's *signature* is its arguments' structure (keywords in name order), each tensor's shape,
strides, dtype and device, every other argument's value, grad mode, autocast and the current device.
A call with an unhashable argument, tensors that share memory, or a tensor that needs grad while grad
is enabled runs eagerly. For each signature: the first call runs the step as it is (its lazy
allocations, Triton's compiles and communicator set-up happen then, outside any capture); the second
clones the tensor arguments into the graph's own inputs, captures the step on them and replays it;
every later call copies its tensors into those inputs and replays. An argument the capture run
changed is one the step writes into: it is copied back after every replay. Results are returned as
clones (one copy per output tensor), so a result stays valid after the next call; a result holding
anything but tensors and plain values (an object with tensors inside) makes its signature run eagerly.
A capture that fails raises once, saying what a replayed step must not do; that signature then runs
eagerly. Given ``agree`` (``contextual_autotune`` passes its ranks' control plane), the ranks compare how
their captures went, in one collective per captured signature: a capture that fails on one rank raises the
same error on every rank, naming it, and that signature runs eagerly on every rank, so no rank replays
collectives its peers no longer join.

What a replayed step must be, as for any CUDA graph: no host synchronization (``.item()``,
``.tolist()``, a host-side check), no CPU work whose effect the caller needs each call, and every
tensor it reads either an argument or one that keeps its address (a closure's weights, updated in
place). Non-tensor results are those of the capture call. Every rank must change its signatures at the
same calls, as its collectives must match (every rank then captures at the same call). One thread and one
stream at a time per step. Memory: each graph keeps the memory its step allocated (its private pool) until
it is dropped; at most :data:`GRAPHS_PER_STEP` are kept per step, the least recently used dropped first.
Graphs that captured NCCL collectives must be dropped before their communicators are destroyed:
:func:`release_all` does it; ``disttune.dist.destroy`` and the exit handler call it, and a program that
destroys its process groups itself calls it first.
"""

from __future__ import annotations

import atexit
import collections
import functools
import weakref
from typing import Any, Callable, Optional

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .env import interpreting

__all__ = ["CAPTURED", "GRAPHS_PER_STEP", "HOLDS_OBJECTS", "CudaGraphCapture", "StepGraphs", "capturing",
           "release_all", "signature", "why_unavailable"]

#: Graphs kept per step (one per signature), least recently used dropped first.
GRAPHS_PER_STEP = 8
#: Signatures remembered as called once (not captured yet) per step, apart from the graphs.
SEEN_PER_STEP = 64
#: What a result may hold besides tensors for its graph to be replayed (a replay clones the tensors).
_PLAIN = (type(None), bool, int, float, complex, str)
#: How a rank's capture of a signature went, when it did not fail (a failure is its error's text).
CAPTURED, HOLDS_OBJECTS = "captured", "captured, but the result holds objects"

_live: "weakref.WeakSet[StepGraphs]" = weakref.WeakSet()


def why_unavailable() -> str:
    """Why CUDA graphs cannot replay a step here ("" where they can): no CUDA GPU, or Triton's interpreter."""
    if not torch.cuda.is_available():
        return "there is no CUDA GPU here"
    if interpreting():
        return "Triton runs in its interpreter here (TRITON_INTERPRET=1): kernels run on the CPU"
    return ""


def signature(args: tuple, kwargs: dict) -> tuple[Optional[tuple], list, Any]:
    """``(key, leaves, spec)`` of a call (keyword arguments in name order). The key holds the arguments'
    structure, each tensor's shape, strides, dtype and device, every other argument's value, grad mode,
    autocast and the current device. It is None where the call cannot be replayed: an argument that is
    not a tensor and not hashable, a tensor that is not strided, two tensors that share memory, or one
    that needs grad while grad is enabled."""
    leaves, spec = tree_flatten((args, dict(sorted(kwargs.items()))))
    grad = torch.is_grad_enabled()
    parts: list = [grad, torch.is_autocast_enabled("cuda"), torch.cuda.current_device() if _has_cuda() else -1]
    storages = set()
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            if leaf.layout != torch.strided or (grad and leaf.requires_grad):
                return None, leaves, spec
            storage = leaf.untyped_storage().data_ptr()
            if storage in storages:
                return None, leaves, spec
            storages.add(storage)
            parts.append((tuple(leaf.shape), leaf.stride(), leaf.dtype, leaf.device))
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
    __slots__ = ("replay", "inputs", "outputs", "written")

    def __init__(self, replay: Callable[[], None], inputs: list, outputs: Any, written: list) -> None:
        self.replay, self.inputs, self.outputs, self.written = replay, inputs, outputs, written


class StepGraphs:
    """A step's CUDA graphs, one per call signature (see the module doc). ``name`` is the step's, for errors.

    ``capture`` makes a graph of a step (``CudaGraphCapture``, the real one, by default); tests that must run
    the cache's logic without a GPU pass their own. ``agree`` gathers one string per rank, in rank order (a
    collective off the GPU, e.g. a ``Communicator``'s ``all_gather_objects``): each capture's outcome is
    compared across the ranks with it (module doc). ``captures`` and ``replays`` count what the graphs did.
    One thread and one stream at a time: a replay's inputs and outputs are the graph's own buffers.
    """

    def __init__(self, name: str, capture: Optional[Callable] = None, capacity: int = GRAPHS_PER_STEP,
                 agree: Optional[Callable[[str], list]] = None) -> None:
        self.name = name
        self.capacity = capacity
        self._capture = capture if capture is not None else CudaGraphCapture()
        self._agree = agree
        self._graphs: collections.OrderedDict = collections.OrderedDict()  # signature -> _Graph
        self._seen: collections.OrderedDict = collections.OrderedDict()  # signatures called once
        self._eager: set = set()  # signatures that run as they are (their capture failed, or their results)
        self.captures = 0
        self.replays = 0
        _live.add(self)

    def __len__(self) -> int:
        return len(self._graphs)

    def seen(self, args: tuple, kwargs: dict) -> None:
        """Count a call made outside :meth:`__call__` (a tuning call) as a signature's first, eager call."""
        key = signature(args, kwargs)[0]
        if key is not None:
            _remember(self._seen, key, True, SEEN_PER_STEP)

    def __call__(self, run: Callable[[tuple, dict], Any], args: tuple, kwargs: dict) -> Any:
        """``run(args, kwargs)`` the first time a signature is met, captured the second, replayed after (run as it
        is while the caller captures a graph of its own, which then holds the step's launches)."""
        if capturing():
            return run(args, kwargs)
        key, leaves, spec = signature(args, kwargs)
        graph = self._graphs.get(key) if key is not None else None
        if graph is not None:
            self._graphs.move_to_end(key)
            return self._replay(graph, leaves)
        if key is None or key in self._eager:
            return run(args, kwargs)
        if self._seen.pop(key, None) is None:  # a first call: it runs as it is
            _remember(self._seen, key, True, SEEN_PER_STEP)
            return run(args, kwargs)
        return self._capture_and_replay(key, run, leaves, spec)

    def _replay(self, graph: _Graph, leaves: list) -> Any:
        for mine, given in zip(graph.inputs, leaves):
            if mine is not None:
                mine.copy_(given)
        graph.replay()
        self.replays += 1
        for index in graph.written:  # the step writes into these arguments: the caller sees the writes
            leaves[index].copy_(graph.inputs[index])
        return _cloned(graph.outputs)

    def _capture_and_replay(self, key: tuple, run: Callable[[tuple, dict], Any], leaves: list, spec: Any) -> Any:
        inputs = [leaf.clone() if isinstance(leaf, torch.Tensor) else None for leaf in leaves]
        bound = tree_unflatten([mine if mine is not None else leaf for mine, leaf in zip(inputs, leaves)], spec)
        failure: Optional[Exception] = None
        try:
            replay, outputs = self._capture(lambda: run(*bound))
            clonable = all(isinstance(leaf, (torch.Tensor, *_PLAIN)) for leaf in tree_flatten(outputs)[0])
            outcome = CAPTURED if clonable else HOLDS_OBJECTS
        except Exception as err:  # noqa: BLE001 - said again with what to do, on every rank
            failure, outcome = err, f"{type(err).__name__}: {err}"
        outcomes = self._agree(outcome) if self._agree is not None else [outcome]
        failed = {rank: text for rank, text in enumerate(outcomes) if text not in (CAPTURED, HOLDS_OBJECTS)}
        if failed:
            self._eager.add(key)
            raise RuntimeError(self._capture_failed(failed, len(outcomes))) from failure
        self.captures += 1
        if HOLDS_OBJECTS in outcomes:
            self._eager.add(key)  # a result a replay could not clone (an object holding tensors): run as it is
            return run(*tree_unflatten(leaves, spec))
        replay()
        self.replays += 1
        # an argument the capture run changed is one the step writes into: copied back after every replay
        written = [i for i, (mine, given) in enumerate(zip(inputs, leaves))
                   if mine is not None and not torch.equal(mine, given)]
        for index in written:
            leaves[index].copy_(inputs[index])
        _remember(self._graphs, key, _Graph(replay, inputs, outputs, written), self.capacity)
        return _cloned(outputs)

    def _capture_failed(self, failed: dict, world: int) -> str:
        """The error every rank raises when a capture failed on ``failed`` (rank -> the error's text)."""
        if world == 1:
            where, why = "", next(iter(failed.values()))
        else:
            where = " on rank" + ("s " if len(failed) > 1 else " ") + ", ".join(map(str, failed))
            why = "; ".join(f"rank {rank}: {text}" for rank, text in failed.items())
        return (f"disttune: capturing {self.name} in a CUDA graph failed{where} ({why}); later calls with these "
                "arguments run as they are" + (" on every rank" if world > 1 else "") + ". A step replayed from a "
                "CUDA graph must not synchronize with the host (.item(), .tolist(), host-side checks of GPU values) "
                "nor allocate communicators or workspaces on its second call; fix the step or pass cuda_graph=False")

    def clear(self) -> None:
        """Drop every graph (and its memory): the next call of each signature runs eagerly again."""
        self._graphs.clear()
        self._seen.clear()
        self._eager.clear()


def _remember(entries: collections.OrderedDict, key: tuple, value: Any, capacity: int) -> None:
    entries[key] = value
    entries.move_to_end(key)
    while len(entries) > capacity:
        entries.popitem(last=False)


@functools.lru_cache(maxsize=None)
def _has_cuda() -> bool:
    """Whether this process sees a CUDA GPU (asked once: every call of a replayed step needs the answer)."""
    return torch.cuda.is_available()


def capturing() -> bool:
    """Whether the current CUDA stream is being captured into a graph (False without CUDA). One C call: the
    device check is made once (``torch.cuda.is_available()`` costs a few µs, and kernels ask on every launch)."""
    return _has_cuda() and torch.cuda.is_current_stream_capturing()


def _cloned(outputs: Any) -> Any:
    leaves, spec = tree_flatten(outputs)
    return tree_unflatten([leaf.clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves], spec)


def release_all() -> None:
    """Drop every step's graphs: call it, once the device has drained, before destroying the process groups
    whose collectives they captured (NCCL cannot destroy a communicator a live graph still uses)."""
    for graphs in list(_live):
        graphs.clear()


atexit.register(release_all)
