"""Communicators: the tuner's control plane, a few collectives each bounded by a timeout.

The tuner talks to its peers through three operations: an all-gather of a fixed-length float
vector (timings), an all-gather of small plain-data objects (digests, error messages,
:mod:`disttune.wire`) and a barrier. Three implementations share that protocol:

* :class:`TorchComm`, for a ``torch.distributed`` job (NCCL, gloo, ...): every collective travels
  through the job's rendezvous store (the c10d store every rank is connected to), never through a
  process group. It shares nothing with the user's communicators, never enters an NCCL queue and
  never waits on a CUDA stream, so a rank whose GPU is stuck behind a user collective still hears
  from its peers. ``group=`` maps to the keys of that group's ranks. Set-up: none (the store
  exists); each collective costs a few store round trips (``bench/control_plane.py`` measures them).
* :class:`MpiComm` over an ``mpi4py`` communicator (non-blocking MPI collectives, polled);
* :class:`LocalComm` for a single process (no collective at all).

Every wait is bounded: a collective that does not complete within ``timeout`` seconds becomes a
:class:`CollectiveTimeout` that names the step and the ranks that did not arrive, never a hang.
:meth:`TorchComm.wait_until` is the one wait loop: collectives and the host's waits on the GPU
(:mod:`disttune.device`) poll through it with the same deadline.

:class:`TorchComm` is also a :class:`ControlPlane`: it carries *posts* on a channel (one per tuning
call). A rank that fails where its peers may be waiting elsewhere posts its error there
(:meth:`~TorchComm.post`); a rank waiting in :meth:`~TorchComm.wait_until` on a watched channel
reads the channel's post counter every 0.1 s once the wait has lasted 0.1 s, and leaves with
:class:`PeerFailed` when a peer has posted. A collective that completes in time reads no post.
MPI and custom communicators have no posts: their waits end by timeout.

When the rendezvous store itself cannot be reached (its host is gone: torchrun's agent, or rank 0 of a
job started without torchrun), every store operation of the control plane raises
:class:`ControlPlaneLost`, the first with torch's reason and every later one at once, without another
attempt on the dead connection (each failed attempt also makes TCPStore log a C++ stack).
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
from collections import defaultdict
from typing import Any, Callable, Optional, Protocol, Sequence, runtime_checkable

import numpy as np

from . import wire
from .env import DEFAULT_TIMEOUT_S
from .wire import MalformedMessage

__all__ = ["CollectiveTimeout", "PeerFailed", "ControlPlaneLost", "MalformedMessage", "Communicator", "ControlPlane",
           "LocalComm", "TorchComm", "MpiComm", "make_communicator", "is_comm", "wait_until", "start_gather_floats",
           "global_rank"]

#: The channel of collectives made outside a tuning call (the agreement on new keys, a sweep's barrier).
PLANE = "plane"
#: How often a wait reads the watched channel's posts, once it has lasted that long.
POST_POLL_S = 0.1


class CollectiveTimeout(RuntimeError):
    """A wait did not complete in time (a peer died, hung or skipped the step); ``missing`` names the ranks
    that had not arrived, where the communicator can tell."""

    def __init__(self, message: str, missing: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.missing = tuple(missing)


class PeerFailed(RuntimeError):
    """A peer posted on the watched channel (an error, or leaving after one) while this rank waited."""

    def __init__(self, message: str, ranks: Sequence[int]) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)


class ControlPlaneLost(RuntimeError):
    """The rendezvous store cannot be reached any more: its host (torchrun's agent, or rank 0 of a job started
    without torchrun) is gone, so no collective of the tuner can complete."""


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


def _poll(ready: Callable[[], bool], deadline: Optional[float], on_timeout: Callable[[], Exception],
          look: Optional[Callable[[], None]] = None) -> None:
    """Call ``ready`` with a growing pause (20 us to 1 ms) until it is true; ``look`` every
    :data:`POST_POLL_S` once the wait has lasted that long; ``on_timeout()`` is raised after ``deadline``."""
    started = time.monotonic()
    next_look = started + POST_POLL_S
    pause = 0.0
    while not ready():
        now = time.monotonic()
        if look is not None and now >= next_look:
            next_look = now + POST_POLL_S
            look()
        if deadline is not None and now > deadline:
            raise on_timeout()
        time.sleep(pause)
        pause = min(pause * 2 or 2e-5, 1e-3)


def wait_until(comm: Communicator, ready: Callable[[], bool], step: str) -> None:
    """Wait for ``ready()`` through ``comm``'s own wait (deadline, peers' posts) where it has one; a plain
    poll otherwise (a world of one, a custom communicator)."""
    if isinstance(comm, Waits):
        comm.wait_until(ready, step)
    else:
        _poll(ready, None, lambda: RuntimeError(step))


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
        _poll(ready, None, lambda: RuntimeError(step))

    def describe(self) -> str:
        return "local (1 process)"


#: Collectives so far per (ranks, channel), for every communicator of the process: a channel's sequence
#: continues when a tuner makes a new communicator over the same group.
_SEQUENCE: defaultdict[tuple[str, str], itertools.count] = defaultdict(itertools.count)
_SEQUENCE_LOCK = threading.Lock()


def control_store() -> Any:
    """The default process group's rendezvous store (the c10d store every rank is connected to)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


class PlaneStore:
    """A c10d store as the control plane uses it: the same operations, but a lost connection is
    :class:`ControlPlaneLost`, and once lost every later operation (from any thread) raises it at once.
    Operations take turns (as TCPStore's own client does on its one socket), so no second thread tries the
    dead connection after the first has found it dead. Costs a lock and a ``try`` per operation."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.lost: Optional[str] = None  # why the store was lost, once it was
        self._turn = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        operation = getattr(self.store, name)
        return functools.partial(self._call, operation) if callable(operation) else operation

    def _call(self, operation: Callable[..., Any], *args: Any) -> Any:
        from torch.distributed import DistNetworkError

        with self._turn:
            if self.lost is None:
                try:
                    return operation(*args)
                except DistNetworkError as err:
                    self.lost = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ControlPlaneLost(f"disttune: the rendezvous store is unreachable ({self.lost}): its host is gone "
                               "(torchrun's agent, or rank 0 when the job was started without torchrun)")


class TorchComm:
    """The control plane of a ``torch.distributed`` job: collectives and posts through its rendezvous store.

    ``group``: a process group (default: the whole job); its ranks name the keys, so two groups over the
    same ranks share them (their tuners' channels tell them apart). ``store``: default
    :func:`control_store`, kept by reference, so it outlives an aborted process group. Per collective:
    one ``set``, ``check`` polls until every rank has set its key, one ``multi_get``, and one
    ``delete_key`` of this rank's key two collectives back (no rank reads it any more).
    """

    def __init__(self, group: Any = None, timeout_s: float = DEFAULT_TIMEOUT_S, store: Any = None) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "disttune: is_dist=True needs an initialised torch.distributed process group. "
                "Call disttune.dist.init() (or torch.distributed.init_process_group) first, "
                "pass comm=<mpi4py communicator>, or use is_dist=False for a single process."
            )
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(self.world_size))
        self.backend = str(dist.get_backend(group))
        self.timeout_s = float(timeout_s)
        self.store = PlaneStore(store if store is not None else control_store())
        self._prefix = "disttune/" + ("all" if group is None else ",".join(map(str, self.ranks)))
        self._channel: Optional[str] = None
        self._own_posts: defaultdict[str, int] = defaultdict(int)
        self._lock = threading.Lock()  # the watcher thread posts too (disttune.ending)

    def describe(self) -> str:
        return f"torch.distributed ({self.backend}, {self.world_size} ranks; control plane: the rendezvous store)"

    def _key(self, channel: str, *parts: Any) -> str:
        return "/".join((self._prefix, channel, *map(str, parts)))

    # -- posts ----------------------------------------------------------------------------------------------

    def watch(self, channel: Optional[str]) -> None:
        """Leave a wait with :class:`PeerFailed` when a peer posts on ``channel`` (None: stop watching)."""
        self._channel = channel

    def post(self, channel: str, slot: str, value: Any) -> None:
        """Set this rank's ``value`` in ``slot`` of ``channel``, for peers waiting anywhere. Two store operations."""
        with self._lock:
            self.store.set(self._key(channel, slot, self.rank), wire.pack(value))
            self._own_posts[channel] += 1
            self.store.add(self._key(channel, "posts"), 1)

    def peers_posted(self, channel: str) -> bool:
        """Whether a peer has posted on ``channel`` (one store operation)."""
        with self._lock:
            own = self._own_posts[channel]
        return int(self.store.add(self._key(channel, "posts"), 0)) > own

    def posted(self, channel: str, slot: str) -> dict[int, Any]:
        """Every rank's value in ``slot`` of ``channel`` so far (this rank's included), by rank. A value that does
        not decode is kept as the :class:`~disttune.wire.MalformedMessage` that names its rank."""
        values: dict[int, Any] = {}
        for rank, value in self._read(channel, slot).items():
            try:
                values[rank] = wire.unpack(value, rank, f"'{slot}' on {channel}")
            except MalformedMessage as err:
                values[rank] = err
        return values

    def decide(self, channel: str, slot: str, value: Any) -> Any:
        """``value`` in ``slot`` of ``channel`` unless a rank decided first; the value that stands (one operation)."""
        key = self._key(channel, slot)
        standing = self.store.compare_set(key, "", wire.pack(value))
        return wire.unpack(standing, -1, f"'{slot}' on {channel}")

    def decided(self, channel: str, slot: str) -> Any:
        """The value :meth:`decide` left in ``slot`` of ``channel``, or None while none stands (one or two operations)."""
        key = self._key(channel, slot)
        return wire.unpack(self.store.get(key), -1, f"'{slot}' on {channel}") if self.store.check([key]) else None

    def note_progress(self, channel: str, count: int) -> None:
        """Say that this rank has reached its ``count``-th wait on the GPU on ``channel`` (one operation)."""
        self.store.set(self._key(channel, "at", self.rank), str(count))

    def progress(self, channel: str) -> dict[int, int]:
        """Each rank's last :meth:`note_progress` count on ``channel`` (0 where it has noted none)."""
        noted = self._read(channel, "at")
        return {rank: int(noted.get(rank, b"0") or 0) for rank in range(self.world_size)}

    def _read(self, channel: str, slot: str) -> dict[int, bytes]:
        """The raw values of ``slot`` of ``channel`` by rank, for the ranks that have set one."""
        keys = {rank: self._key(channel, slot, rank) for rank in range(self.world_size)}
        present = [rank for rank, key in keys.items() if self.store.check([key])]
        return dict(zip(present, self.store.multi_get([keys[r] for r in present]))) if present else {}

    # -- the one wait loop -------------------------------------------------------------------------------------

    def wait_until(self, ready: Callable[[], bool], step: str, timeout_s: Optional[float] = None,
                   behind: Optional[Callable[[], list[int]]] = None) -> None:
        """Poll ``ready()`` until it is true. Leaves with :class:`PeerFailed` when a peer posts on the watched
        channel, and with :class:`CollectiveTimeout` after ``timeout_s`` (default the communicator's), naming
        the ranks ``behind()`` gives (those that had not arrived)."""
        channel = self._channel
        limit = self.timeout_s if timeout_s is None else timeout_s

        def look() -> None:
            if channel is not None and self.peers_posted(channel):
                ranks = sorted(r for slots in ("note", "settle") for r in self.posted(channel, slots) if r != self.rank)
                raise PeerFailed(f"disttune: step '{step}': rank(s) {ranks} posted an error or left", ranks)

        def timed_out() -> CollectiveTimeout:
            missing = behind() if behind is not None else []
            who = f"rank(s) {missing} did not arrive" if missing else "it did not complete"
            return CollectiveTimeout(f"disttune: step '{step}': {who} within {limit:g} s (a rank died, hung, or "
                                     "skipped the step)", missing)

        _poll(ready, time.monotonic() + limit, timed_out, look)

    # -- collectives ---------------------------------------------------------------------------------------------

    def _start(self, payload: bytes, channel: Optional[str] = None) -> list[str]:
        """Set this rank's ``payload`` for the channel's next collective; returns every rank's key for it.

        This rank's key of two collectives back is deleted: every peer has read it, since each has set its
        key of the last one, which a rank does only after reading the one before."""
        channel = channel or self._channel or PLANE
        with _SEQUENCE_LOCK:
            seq = next(_SEQUENCE[(self._prefix, channel)])
        keys = [self._key(channel, "c", seq, rank) for rank in range(self.world_size)]
        self.store.set(keys[self.rank], payload)
        if seq >= 2:
            try:
                self.store.delete_key(self._key(channel, "c", seq - 2, self.rank))
            except RuntimeError:
                pass  # a store without delete keeps it: a few bytes
        return keys

    def _finish(self, keys: list[str], step: str) -> list[bytes]:
        """Wait until every rank has set its key of a collective (:meth:`wait_until`), then read them all."""
        self.wait_until(lambda: self.store.check(keys), step,
                        behind=lambda: [r for r, key in enumerate(keys) if not self.store.check([key])])
        return self.store.multi_get(keys)

    def _gather(self, payload: bytes, step: str) -> list[bytes]:
        return self._finish(self._start(payload), step)

    def start_gather_floats(self, values: Sequence[float], step: str, channel: str) -> Callable[[], np.ndarray]:
        """An all-gather of ``values`` on ``channel`` that waits for nobody now: this rank's values are set at
        once (one store operation), and the returned function waits for the peers' and reads them all."""
        payload = wire.pack_floats(values)
        keys = self._start(payload, channel)
        return lambda: self._floats(self._finish(keys, step), len(payload) // 8, step)

    @staticmethod
    def _floats(gathered: list[bytes], length: int, step: str) -> np.ndarray:
        return np.stack([wire.unpack_floats(data, length, rank, step) for rank, data in enumerate(gathered)])

    def all_gather_floats(self, values: Sequence[float], step: str) -> np.ndarray:
        payload = wire.pack_floats(values)
        return self._floats(self._gather(payload, step), len(payload) // 8, step)

    def all_gather_objects(self, obj: Any, step: str) -> list[Any]:
        return [wire.unpack(data, rank, step) for rank, data in enumerate(self._gather(wire.pack(obj), step))]

    def barrier(self, step: str) -> None:
        self._gather(b".", step)


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
        _poll(ready, time.monotonic() + limit, lambda: CollectiveTimeout(
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
