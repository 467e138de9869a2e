"""Communicators: the tuner's control plane, a few collectives each bounded by a timeout.

The tuner talks to its peers through three operations: an all-gather of a fixed-length float
vector (timings), an all-gather of small plain-data objects (digests, error messages,
:mod:`disttune.wire`) and a barrier; where a communicator can, it also combines every rank's
vector, or every rank's object, once for all (:func:`combine_floats`, :func:`combine_objects`), so
that each rank receives only the result. Three implementations share that protocol:

* :class:`TorchComm`, for a ``torch.distributed`` job (NCCL, gloo, ...): every collective travels
  through the job's rendezvous store (the c10d store every rank is connected to), never through a
  process group (:mod:`disttune.storeplane`). It shares nothing with the user's communicators, never
  enters an NCCL queue and never waits on a CUDA stream, so a rank whose GPU is stuck behind a user
  collective still hears from its peers. ``group=`` maps to the keys of that group's ranks. Set-up:
  none (the store exists); each collective costs the store's host about four requests per rank
  (``bench/control_plane.py``, ``bench/control_plane_scale.py``). In jobs of 64 ranks or more over
  several nodes the ranks of a node combine first, through a relay in the process of the node's lowest
  rank, and the rendezvous store's host serves about three requests per node (:mod:`disttune.nodeplane`).
* :class:`MpiComm` over an ``mpi4py`` communicator (non-blocking MPI collectives, polled);
* :class:`LocalComm` for a single process (no collective at all).

Every wait is bounded: a collective that does not complete within ``timeout`` seconds becomes a
:class:`CollectiveTimeout` that names the step and the ranks that did not arrive, never a hang.
:meth:`TorchComm.wait_until` is the wait loop of the host's waits on the GPU (:mod:`disttune.device`),
with the collectives' deadline.

:class:`TorchComm` is also a :class:`ControlPlane`: it carries *posts* on a channel (one per tuning
call). A rank that fails where its peers may be waiting elsewhere posts its error there
(:meth:`~TorchComm.post`); a rank waiting on a watched channel reads the channel's post counter
every 0.1 s (less often beyond 1,000 ranks) once the wait has lasted that long, and leaves with
:class:`PeerFailed` when a peer has posted. A collective that completes in time reads no post. MPI
and custom communicators have no posts: their waits end by timeout.

When the rendezvous store itself cannot be reached (its host is gone: torchrun's agent, or rank 0 of a
job started without torchrun), every store operation of the control plane raises
:class:`ControlPlaneLost`, the first with torch's reason and every later one at once, without another
attempt on the dead connection (each failed attempt also makes TCPStore log a C++ stack).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional, Protocol, Sequence, runtime_checkable

import numpy as np

from . import wire
from .env import DEFAULT_TIMEOUT_S
from .errors import CollectiveTimeout, ControlPlaneLost, PeerFailed
from .nodeplane import NodeStorePlane
from .storeplane import poll
from .wire import MalformedMessage

__all__ = ["CollectiveTimeout", "PeerFailed", "ControlPlaneLost", "MalformedMessage", "Communicator", "ControlPlane",
           "LocalComm", "TorchComm", "MpiComm", "make_communicator", "is_comm", "wait_until", "start_gather_floats",
           "combine_floats", "combine_objects", "global_rank"]


@runtime_checkable
class Communicator(Protocol):
    """What the tuner needs from its peers. ``step`` names the caller's step in errors."""

    rank: int
    world_size: int

    def all_gather_floats(self, values: Sequence[float], step: str) -> np.ndarray:
        """Gather one equal-length float vector per rank; returns ``[world_size, len(values)]``."""
        ...

    def all_gather_objects(self, obj: Any, step: str) -> list[Any]:
        """Gather one small plain-data object per rank (:mod:`disttune.wire`), in rank order."""
        ...

    def barrier(self, step: str) -> None:
        ...


@runtime_checkable
class Waits(Protocol):
    """A communicator with its own wait loop: ``wait_until(ready, step)`` polls ``ready`` with the collectives'
    deadline and breaks for a peer's post (:func:`wait_until` uses it where it is there)."""

    def wait_until(self, ready: Callable[[], bool], step: str, timeout_s: Optional[float] = None,
                   behind: Optional[Callable[[], list[int]]] = None) -> None: ...


@runtime_checkable
class GathersLater(Protocol):
    """A communicator that can start an all-gather now and finish it later without waiting for the peers in
    between (:func:`start_gather_floats` uses it where it is there)."""

    def start_gather_floats(self, values: Sequence[float], step: str, channel: str) -> Callable[[], np.ndarray]: ...


@runtime_checkable
class Combines(Protocol):
    """A communicator that can combine every rank's vector once, for all (:func:`combine_floats` uses it where it
    is there): ``combine_floats(values, step, combine)`` returns ``combine([world_size, n])``, the same on every
    rank."""

    def combine_floats(self, values: Sequence[float], step: str,
                       combine: Callable[[np.ndarray], Sequence[float]]) -> np.ndarray: ...


@runtime_checkable
class CombinesObjects(Protocol):
    """A communicator that can combine every rank's object once, for all (:func:`combine_objects` uses it where it
    is there): ``combine_objects(obj, step, combine)`` returns ``combine([every rank's obj])``, the same plain data
    on every rank."""

    def combine_objects(self, obj: Any, step: str, combine: Callable[[list[Any]], Any]) -> Any: ...


@runtime_checkable
class ControlPlane(Communicator, Protocol):
    """A communicator that also carries posts on channels, so that a failing rank reaches peers waiting
    anywhere (:mod:`disttune.ending` builds the endings of a failed tuning call on it).

    ``post(channel, slot, value)`` sets this rank's ``value`` (plain data) in ``slot`` of ``channel``;
    ``posted(channel, slot)`` reads every rank's value there (a :class:`MalformedMessage` where one does not
    decode); ``decide(channel, slot, value)`` sets
    ``value`` unless some rank set one first, and returns the one that stands (the same on every rank);
    ``decided(channel, slot)`` reads it without setting one (None while none stands);
    ``peers_posted(channel)`` tells cheaply whether any peer has posted on ``channel``;
    ``note_progress(channel, count)`` / ``progress(channel)`` say how far each rank got.
    """

    timeout_s: float

    def watch(self, channel: Optional[str]) -> None: ...

    def post(self, channel: str, slot: str, value: Any) -> None: ...

    def posted(self, channel: str, slot: str) -> dict[int, Any]: ...

    def peers_posted(self, channel: str) -> bool: ...

    def decide(self, channel: str, slot: str, value: Any) -> Any: ...

    def decided(self, channel: str, slot: str) -> Any: ...

    def wait_until(self, ready: Callable[[], bool], step: str, timeout_s: Optional[float] = None,
                   behind: Optional[Callable[[], list[int]]] = None) -> None: ...

    def note_progress(self, channel: str, count: int) -> None: ...

    def progress(self, channel: str) -> dict[int, int]: ...


def wait_until(comm: Communicator, ready: Callable[[], bool], step: str) -> None:
    """Wait for ``ready()`` through ``comm``'s own wait (deadline, peers' posts) where it has one; a plain
    poll otherwise (a world of one, a custom communicator)."""
    if isinstance(comm, Waits):
        comm.wait_until(ready, step)
    else:
        poll(ready, None, lambda: RuntimeError(step))


class LocalComm:
    """A world of one process: every collective returns at once."""

    rank = 0
    world_size = 1
    timeout_s = DEFAULT_TIMEOUT_S

    def all_gather_floats(self, values: Sequence[float], step: str) -> np.ndarray:
        return np.asarray(values, dtype=np.float64).reshape(1, -1)

    def all_gather_objects(self, obj: Any, step: str) -> list[Any]:
        return [wire.unpack(wire.pack(obj), 0, step)]

    def barrier(self, step: str) -> None:
        return None

    def wait_until(self, ready: Callable[[], bool], step: str, timeout_s: Optional[float] = None,
                   behind: Optional[Callable[[], list[int]]] = None) -> None:
        """No peer can hold this wait up: poll until ``ready()``."""
        poll(ready, None, lambda: RuntimeError(step))

    def describe(self) -> str:
        return "local (1 process)"


def control_store() -> Any:
    """The default process group's rendezvous store (the c10d store every rank is connected to)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


class TorchComm(NodeStorePlane):
    """The control plane of a ``torch.distributed`` job: collectives and posts through its rendezvous store
    (:class:`~disttune.storeplane.StorePlane`; its module doc gives the protocol and its cost), through a relay
    per node first in jobs of many ranks over several nodes (:mod:`disttune.nodeplane`).

    ``group``: a process group (default: the whole job); its ranks name the keys, so two groups over the
    same ranks share them (their tuners' channels tell them apart). ``store``: default
    :func:`control_store`, kept by reference, so it outlives an aborted process group. ``node``: this rank's
    node (default ``$DISTTUNE_NODE``, else the host name).
    """

    def __init__(self, group: Any = None, timeout_s: float = DEFAULT_TIMEOUT_S, store: Any = None,
                 node: Optional[str] = None) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "disttune: is_dist=True needs an initialised torch.distributed process group. "
                "Call disttune.dist.init() (or torch.distributed.init_process_group) first, "
                "pass comm=<mpi4py communicator>, or use is_dist=False for a single process."
            )
        self.group = group
        world_size = dist.get_world_size(group)
        self.ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(world_size))
        self.backend = str(dist.get_backend(group))
        prefix = "disttune/" + ("all" if group is None else ",".join(map(str, self.ranks)))
        super().__init__(store if store is not None else control_store(), dist.get_rank(group), world_size, prefix,
                         timeout_s, node)

    def describe(self) -> str:
        return f"torch.distributed ({self.backend}, {self.world_size} ranks; control plane: the rendezvous store)"


class MpiComm:
    """Collectives over an ``mpi4py`` communicator, non-blocking and polled until ``timeout``.

    MPI has no timeout of its own, so each collective is started with its
    non-blocking form and tested in a short sleep loop.
    """

    def __init__(self, comm: Any, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.world_size = comm.Get_size()
        self.timeout_s = float(timeout_s)

    def describe(self) -> str:
        return f"MPI ({self.world_size} ranks)"

    def wait_until(self, ready: Callable[[], bool], step: str, timeout_s: Optional[float] = None,
                   behind: Optional[Callable[[], list[int]]] = None) -> None:
        """Poll ``ready()`` until it is true; :class:`CollectiveTimeout` after ``timeout_s`` (MPI has no posts)."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        poll(ready, time.monotonic() + limit, lambda: CollectiveTimeout(
            f"disttune: rank {self.rank}: MPI collective in step '{step}' did not complete within {limit:g} s (a "
            "peer rank died, hung, or skipped this step)"))

    def _wait(self, request: Any, step: str) -> None:
        self.wait_until(request.Test, step)

    def all_gather_floats(self, values: Sequence[float], step: str) -> np.ndarray:
        send = np.ascontiguousarray(values, dtype=np.float64)
        recv = np.empty((self.world_size, send.size), dtype=np.float64)
        self._wait(self.comm.Iallgather(send, recv), step)
        return recv

    def all_gather_objects(self, obj: Any, step: str) -> list[Any]:
        payload = np.frombuffer(bytearray(wire.pack(obj)), dtype=np.uint8)
        sizes = self.all_gather_floats([float(payload.size)], step)[:, 0].astype(np.int64)
        recv = np.empty(int(sizes.sum()), dtype=np.uint8)
        displacements = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        from mpi4py import MPI

        request = self.comm.Iallgatherv(payload, [recv, sizes, displacements, MPI.BYTE])
        self._wait(request, step)
        return [wire.unpack(recv[start : start + size].tobytes(), rank, step)
                for rank, (start, size) in enumerate(zip(displacements, sizes))]

    def barrier(self, step: str) -> None:
        self._wait(self.comm.Ibarrier(), step)

    def start_gather_floats(self, values: Sequence[float], step: str, channel: str) -> Callable[[], np.ndarray]:
        """A non-blocking all-gather started now; the returned function waits for it (MPI has no channels)."""
        send = np.ascontiguousarray(values, dtype=np.float64)
        recv = np.empty((self.world_size, send.size), dtype=np.float64)
        request = self.comm.Iallgather(send, recv)

        def finish() -> np.ndarray:
            self._wait(request, step)
            return recv

        return finish


def start_gather_floats(comm: Communicator, values: Sequence[float], step: str, channel: str
                        ) -> Callable[[], np.ndarray]:
    """Start an all-gather of ``values`` that ``comm`` finishes when the returned function is called: without
    waiting for the peers now where ``comm`` can (its own ``start_gather_floats``), else gathered at once."""
    if isinstance(comm, GathersLater):
        return comm.start_gather_floats(values, step, channel)
    gathered = comm.all_gather_floats(values, step)
    return lambda: gathered


def combine_floats(comm: Communicator, values: Sequence[float], step: str,
                   combine: Callable[[np.ndarray], Sequence[float]]) -> np.ndarray:
    """``combine`` of every rank's ``values`` (``[world_size, len(values)]``), the same vector on every rank: computed
    once where ``comm`` can (:class:`Combines`: the rendezvous store's last arriver), else by every rank from an
    all-gather (``combine`` must then be deterministic)."""
    if isinstance(comm, Combines):
        return comm.combine_floats(values, step, combine)
    return np.asarray(combine(comm.all_gather_floats(values, step)), dtype=np.float64).ravel()


def combine_objects(comm: Communicator, obj: Any, step: str, combine: Callable[[list[Any]], Any]) -> Any:
    """``combine`` of every rank's ``obj`` (a list in rank order), the same plain data on every rank: computed once
    where ``comm`` can (:class:`CombinesObjects`: the rendezvous store's last arriver, and each rank receives only the
    result), else by every rank from an all-gather (``combine`` must then be deterministic). Either way the result
    travels as plain data (:mod:`disttune.wire`), so every rank holds the same types."""
    if isinstance(comm, CombinesObjects):
        return comm.combine_objects(obj, step, combine)
    return wire.unpack(wire.pack(combine(comm.all_gather_objects(obj, step))), comm.rank, step)


def global_rank(comm: Communicator) -> int:
    """The process's rank in the whole job (what names its rank log and picks the store's writer), whatever
    group ``comm`` spans."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except ImportError:
        pass
    if not isinstance(comm, LocalComm):
        try:
            from mpi4py import MPI

            return MPI.COMM_WORLD.Get_rank()
        except ImportError:
            pass
    return comm.rank


def is_comm(group: Any) -> bool:
    """Whether ``group`` is an mpi4py communicator or a :class:`Communicator`, rather than a torch process group."""
    return isinstance(group, Communicator) or hasattr(group, "Iallgather")


def make_communicator(
    is_dist: bool, group: Any = None, comm: Any = None, timeout_s: float = DEFAULT_TIMEOUT_S
) -> Communicator:
    """Pick the communicator the caller asked for; a clear error when it is not there.

    ``group``: a torch process group (with ``is_dist``), an mpi4py communicator, or None (the default
    torch group with ``is_dist``, else a world of one); ``comm`` is the older name for an mpi4py one.
    """
    if comm is None and is_comm(group):
        comm, group = group, None
    if comm is not None:
        if isinstance(comm, Communicator):
            return comm
        return MpiComm(comm, timeout_s)
    if not is_dist:
        if group is not None:
            raise ValueError("disttune: group= was given but is_dist=False; pass is_dist=True to agree over it")
        return LocalComm()
    return TorchComm(group, timeout_s)
