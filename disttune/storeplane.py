"""The control plane over a c10d store: collectives whose store work grows as O(N), and posts on channels.

Every rank of a ``torch.distributed`` job holds a connection to the job's rendezvous store, a key-value
server on one host. :class:`StorePlane` runs the tuner's collectives through it. Collective number
``seq`` on a channel uses three keys under ``<prefix>/<channel>/c/<seq>/``:

* ``d``: each rank appends its payload, framed with its rank (:func:`disttune.wire.pack_frame`);
* ``n``: each rank then adds 1 to this counter; the answer tells the rank that completes the count
  that it arrived last;
* ``k``: the last arriver reads ``d`` once, combines the payloads into one result (the float matrix,
  each distinct object once, a reduction, nothing for a barrier) and sets ``k``; every other rank waits
  for ``k`` with one request that the store answers when ``k`` is set, and reads it with that answer.

So the store host serves about four requests per rank and holds each payload once; it sends the
result once to each rank. Nothing is polled: the wait is the store's own blocking ``WAIT``, made by a
:class:`Waiter` thread on a connection of its own while the caller's thread checks its deadline, the
watched channel's posts (one counter, every :data:`POST_POLL_S` once the wait has lasted that long)
and Ctrl-C. The last arriver also deletes the channel's previous collective: every rank has read it,
since every rank has arrived at this one. A channel that is no longer watched (a tuning call's, when
the call ends) is *retired*: its last keys go at the next collective that completes.

A rank that leaves a collective early (its deadline, a peer's post, an interrupt) sets ``k`` to an
*ending* (:func:`ending_record`: the error's type, text and ranks) unless the result stands there
already; the first of the two stands (``compare_set``). Every rank waiting there, and every rank
that arrives later, wakes and raises that same error. A deadline names the ranks that did not
arrive: the timing-out rank reads ``d`` once.

Posts (:class:`StorePosts`) carry a failing rank's error to peers waiting anywhere: each slot of a
channel is one key of appended frames, plus one counter per channel that a waiting rank reads.
"""

from __future__ import annotations

import datetime
import queue
import threading
import time
import weakref
from collections import defaultdict
from typing import Any, Callable, Optional, Sequence

import numpy as np

from . import wire
from .env import DEFAULT_TIMEOUT_S
from .errors import CollectiveTimeout, PeerFailed
from .wire import MalformedMessage

__all__ = ["PLANE", "POST_POLL_S", "poll", "read_now", "ending_record", "Waiter", "Collective", "StorePosts",
           "StorePlane"]

#: The channel of collectives made outside a tuning call (the agreement on new keys, a sweep's barrier).
PLANE = "plane"
#: How often a wait reads the watched channel's posts, once it has lasted that long.
POST_POLL_S = 0.1
#: A value no writer sets: ``compare_set`` with it as the expected value reads a key without waiting.
_ABSENT = "\x00disttune: absent"
#: The first byte of a collective's ``k``: its result follows, or an ending (a rank left).
RESULT, ENDED = b"R", b"E"
_ENDINGS = {"CollectiveTimeout": CollectiveTimeout, "PeerFailed": PeerFailed, "MalformedMessage": MalformedMessage}


def poll(ready: Callable[[], bool], deadline: Optional[float], on_timeout: Callable[[], Exception],
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


def read_now(store: Any, key: str) -> Optional[bytes]:
    """``key``'s value, or None where it is not set: one request that never waits (``get`` waits)."""
    value = store.compare_set(key, _ABSENT, _ABSENT)
    return None if value == _ABSENT.encode() else bytes(value)


def ending_record(kind: type, text: str, ranks: Sequence[int] = ()) -> bytes:
    """What a rank that leaves a collective sets in its ``k``: every rank there raises ``kind(text)``."""
    return ENDED + wire.pack({"type": kind.__name__, "text": text, "ranks": [int(r) for r in ranks]})


def raise_ending(value: bytes) -> None:
    """Raise the error an ending record carries (a :class:`MalformedMessage` where it is not one)."""
    record = wire.unpack(value[1:], -1, "a collective's ending")
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise MalformedMessage("disttune: a collective's ending is not disttune's; is another program writing into "
                               "this job's rendezvous store?")
    kind, text, ranks = record.get("type"), record["text"], record.get("ranks") or []
    if kind in ("CollectiveTimeout", "PeerFailed"):
        raise _ENDINGS[kind](text, ranks)
    raise _ENDINGS.get(kind, RuntimeError)(text)


class _Ticket:
    """One wait handed to a :class:`Waiter`: the key's value, or the error the store gave."""

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.value: Optional[bytes] = None
        self.error: Optional[BaseException] = None

    def result(self, timeout: float) -> Optional[bytes]:
        """The value within ``timeout`` seconds, else None; the store's error, raised."""
        if not self.ready.wait(timeout):
            return None
        if self.error is not None:
            raise self.error
        return self.value


class Waiter:
    """A daemon thread with its own connection to the store (``store.clone()``) that waits for one key at a time
    with the store's blocking ``get``: the store answers when the key is set, so a long wait costs the store
    one request, and the caller's thread stays free. A store that cannot be cloned is polled instead (one
    request per 1 ms at most). Idle: a thread blocked on its queue."""

    def __init__(self, store: Any) -> None:
        try:
            self.connection, self.blocking = store.clone(), True
            self.connection.set_timeout(datetime.timedelta(days=7))  # the waits end by their key, never by this
        except (AttributeError, RuntimeError, NotImplementedError):
            self.connection, self.blocking = store, False
        self.busy = False
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, name="disttune-store-waiter", daemon=True).start()

    def wait_for(self, key: str) -> _Ticket:
        ticket = _Ticket()
        self.busy = True
        self._requests.put((key, ticket))
        return ticket

    def close(self) -> None:
        self._requests.put(None)

    def _serve(self) -> None:
        while (request := self._requests.get()) is not None:
            key, ticket = request
            try:
                ticket.value = bytes(self.connection.get(key)) if self.blocking else _read_when_set(self.connection, key)
            except Exception as err:  # noqa: BLE001 - the store is gone: the caller raises it
                ticket.error = err
            self.busy = False
            ticket.ready.set()


def _read_when_set(store: Any, key: str) -> bytes:
    """Poll ``key`` until it is set (for a store that gives a waiter no connection of its own)."""
    pause = 0.0
    while (value := read_now(store, key)) is None:
        time.sleep(pause)
        pause = min(pause * 2 or 2e-5, 1e-3)
    return value


class _PlaneState:
    """What every communicator over one store object shares in this process: each channel's count of collectives
    (a new communicator over the same ranks continues it), the retired keys and the idle waiters."""

    def __init__(self, store: Any) -> None:
        self.store = weakref.ref(store)
        self.lock = threading.Lock()
        self.sequences: defaultdict[tuple[str, str], int] = defaultdict(int)
        self.retired: list[str] = []
        self.waiters: list[Waiter] = []

    def waiter(self) -> Waiter:
        with self.lock:
            for waiter in self.waiters:
                if not waiter.busy:
                    waiter.busy = True
                    return waiter
            store = self.store()
            assert store is not None
            self.waiters.append(Waiter(store))
            return self.waiters[-1]


_STATES: "weakref.WeakKeyDictionary[Any, _PlaneState]" = weakref.WeakKeyDictionary()
_STATES_LOCK = threading.Lock()


def _state(store: Any) -> _PlaneState:
    with _STATES_LOCK:
        if store not in _STATES:
            state = _STATES[store] = _PlaneState(store)
            weakref.finalize(store, lambda waiters: [w.close() for w in waiters], state.waiters)
        return _STATES[store]


class Collective:
    """The keys and store requests of one collective, based at ``base`` (see the module doc)."""

    def __init__(self, store: Any, base: str, rank: int, world_size: int) -> None:
        self.store, self.base, self.rank, self.world_size = store, base, rank, world_size
        self.data, self.count, self.result = f"{base}/d", f"{base}/n", f"{base}/k"

    def arrive(self, payload: bytes) -> bool:
        """Add this rank's payload (two requests); True when this rank completed the count."""
        self.store.append(self.data, wire.pack_frame(self.rank, payload))
        return int(self.store.add(self.count, 1)) == self.world_size

    def payloads(self, what: str) -> list[bytes]:
        """Every rank's payload in rank order, once the count is complete (one request)."""
        frames = wire.unpack_frames(read_now(self.store, self.data) or b"", what)
        by_rank = dict(frames)
        if len(frames) != self.world_size or sorted(by_rank) != list(range(self.world_size)):
            raise MalformedMessage(f"disttune: the messages for {what} come from ranks {sorted(r for r, _ in frames)}, "
                                   f"not once from each of {self.world_size}; is another program writing into this "
                                   "job's rendezvous store?")
        return [by_rank[rank] for rank in range(self.world_size)]

    def arrived(self) -> set[int]:
        """The ranks that have arrived so far (for a deadline's message; one request)."""
        try:
            return {rank for rank, _ in wire.unpack_frames(read_now(self.store, self.data) or b"", "arrivals")}
        except (MalformedMessage, RuntimeError):
            return set()

    def settle(self, value: bytes) -> bytes:
        """Set ``k`` to ``value`` unless it is set (one request); the value that stands there."""
        return bytes(self.store.compare_set(self.result, "", value))

    def keys(self) -> tuple[str, str, str]:
        return self.data, self.count, self.result


def delete_keys(store: Any, keys: Sequence[str]) -> None:
    """Delete ``keys`` (one request each); a store without deletion keeps them."""
    for key in keys:
        try:
            store.delete_key(key)
        except (RuntimeError, NotImplementedError):
            return


def _matrix(payloads: Sequence[bytes], length: int, step: str) -> bytes:
    """Every rank's float vector of ``length`` values, in rank order (a :class:`MalformedMessage` naming a rank
    that sent another length)."""
    for rank, payload in enumerate(payloads):
        if len(payload) != 8 * length:
            wire.unpack_floats(payload, length, rank, step)
    return b"".join(payloads)


class StorePosts:
    """Posts on channels over a c10d store: the :class:`~disttune.comm.ControlPlane` half of :class:`StorePlane`.

    Each slot of a channel is one key of appended frames (``<prefix>/<channel>/<slot>``), so that reading
    every rank's post is one request whatever the number of ranks; ``<prefix>/<channel>/posts`` counts the
    posts. Progress notes (:meth:`note_progress`) are one key per rank, read only when a wait times out.
    """

    def __init__(self, store: Any, rank: int, world_size: int, prefix: str) -> None:
        self.store, self.rank, self.world_size, self.prefix = store, rank, world_size, prefix
        self._channel: Optional[str] = None
        self._own_posts: defaultdict[str, int] = defaultdict(int)
        self._noted: set[str] = set()
        self._lock = threading.Lock()  # the watcher thread posts too (disttune.ending)

    def _key(self, channel: str, *parts: Any) -> str:
        return "/".join((self.prefix, channel, *map(str, parts)))

    def watch(self, channel: Optional[str]) -> None:
        """Leave a wait with :class:`PeerFailed` when a peer posts on ``channel`` (None: stop watching)."""
        self._channel = channel

    def post(self, channel: str, slot: str, value: Any) -> None:
        """Set this rank's ``value`` in ``slot`` of ``channel``, for peers waiting anywhere. Two store requests."""
        with self._lock:
            self.store.append(self._key(channel, slot), wire.pack_frame(self.rank, wire.pack(value)))
            self._own_posts[channel] += 1
            self.store.add(self._key(channel, "posts"), 1)

    def peers_posted(self, channel: str) -> bool:
        """Whether a peer has posted on ``channel`` (one store request)."""
        with self._lock:
            own = self._own_posts[channel]
        return int(self.store.add(self._key(channel, "posts"), 0)) > own

    def posted(self, channel: str, slot: str) -> dict[int, Any]:
        """Every rank's value in ``slot`` of ``channel`` so far (this rank's included; a rank's latest), by rank, in
        one request. A value that does not decode is kept as the :class:`~disttune.wire.MalformedMessage` that names
        its rank; frames that do not parse are one such entry under rank -1."""
        what = f"'{slot}' on {channel}"
        values: dict[int, Any] = {}
        try:
            frames = wire.unpack_frames(read_now(self.store, self._key(channel, slot)) or b"", what)
        except MalformedMessage as err:
            return {-1: err}
        for rank, value in frames:
            try:
                values[rank] = wire.unpack(value, rank, what)
            except MalformedMessage as err:
                values[rank] = err
        return values

    def decide(self, channel: str, slot: str, value: Any) -> Any:
        """``value`` in ``slot`` of ``channel`` unless a rank decided first; the value that stands (one request)."""
        standing = self.store.compare_set(self._key(channel, slot), "", wire.pack(value))
        return wire.unpack(standing, -1, f"'{slot}' on {channel}")

    def note_progress(self, channel: str, count: int) -> None:
        """Say that this rank has reached its ``count``-th wait on the GPU on ``channel`` (one request)."""
        self._noted.add(channel)
        self.store.set(self._key(channel, "at", self.rank), str(count))

    def progress(self, channel: str) -> dict[int, int]:
        """Each rank's last :meth:`note_progress` count on ``channel`` (0 where it has noted none): one request per
        rank, made only when a wait has timed out."""
        noted = {}
        for rank in range(self.world_size):
            key = self._key(channel, "at", rank)
            noted[rank] = int(self.store.get(key) or 0) if self.store.check([key]) else 0
        return noted


class StorePlane(StorePosts):
    """The tuner's communicator over a c10d store: rank ``rank`` of ``world_size``, its keys under ``prefix``.

    A :class:`~disttune.comm.ControlPlane` (collectives, posts, the one wait loop);
    :class:`disttune.comm.TorchComm` is one made from a ``torch.distributed`` group. Each collective is
    bounded by ``timeout_s``. Cost per collective on the store's host: about four requests per rank, each
    payload held once, the result sent once to each rank (``bench/control_plane_scale.py`` measures it).
    A rank finishes a channel's collective before it starts the channel's next one.
    """

    def __init__(self, store: Any, rank: int, world_size: int, prefix: str = "disttune/all",
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        super().__init__(store, rank, world_size, prefix)
        self.timeout_s = float(timeout_s)
        self._shared = _state(store)

    def describe(self) -> str:
        return f"rendezvous store ({self.world_size} ranks)"

    def watch(self, channel: Optional[str]) -> None:
        """Leave a wait with :class:`PeerFailed` when a peer posts on ``channel``. None stops watching and retires
        the channel watched until now: its collectives' keys go at the next collective that completes."""
        previous = self._channel
        super().watch(channel)
        if channel is None and previous is not None:
            self._retire(previous)

    # -- collectives ----------------------------------------------------------------------------------------------

    def all_gather_floats(self, values: Sequence[float], step: str) -> np.ndarray:
        """Every rank's ``values`` as ``[world_size, len(values)]`` (the store sends that matrix to each rank)."""
        return self.start_gather_floats(values, step, None)()

    def start_gather_floats(self, values: Sequence[float], step: str,
                            channel: Optional[str]) -> Callable[[], np.ndarray]:
        """An all-gather of ``values`` on ``channel`` that waits for nobody now: this rank arrives at once, and the
        returned function waits for the peers and reads the matrix."""
        length = len(values)
        finish = self._start(wire.pack_floats(values), step, lambda payloads: _matrix(payloads, length, step), channel)
        return lambda: np.frombuffer(finish(), dtype="<f8").reshape(self.world_size, length).astype(np.float64)

    def combine_floats(self, values: Sequence[float], step: str,
                       combine: Callable[[np.ndarray], Sequence[float]]) -> np.ndarray:
        """``combine`` of every rank's ``values`` (``[world_size, len(values)]``), computed once, by the last rank to
        arrive: every rank gets the same vector, and the store sends each rank only that vector."""
        length = len(values)

        def combined(payloads: list[bytes]) -> bytes:
            matrix = np.frombuffer(_matrix(payloads, length, step), dtype="<f8").reshape(self.world_size, length)
            return wire.pack_floats(np.asarray(combine(matrix), dtype=np.float64).ravel())

        return np.frombuffer(self._start(wire.pack_floats(values), step, combined)(), dtype="<f8").astype(np.float64)

    def all_gather_objects(self, obj: Any, step: str) -> list[Any]:
        """Every rank's ``obj`` (plain data), in rank order. Ranks that sent the same message get one decoded object,
        shared between their entries: read, don't modify."""
        finish = self._start(wire.pack(obj), step, wire.pack_shared)
        decoded: dict[int, Any] = {}
        for sender, payload in (shared := wire.unpack_shared(finish(), self.world_size, step)):
            if sender not in decoded:
                decoded[sender] = wire.unpack(payload, sender, step)
        return [decoded[sender] for sender, _ in shared]

    def barrier(self, step: str) -> None:
        self._start(b"", step, None)()

    # -- one collective ----------------------------------------------------------------------------------------------

    def _start(self, payload: bytes, step: str, combine: Optional[Callable[[list[bytes]], bytes]],
               channel: Optional[str] = None) -> Callable[[], bytes]:
        """Arrive at the channel's next collective with ``payload``; returns the function that waits for its result.
        The last arriver combines the payloads (``combine``; None: a barrier) and deletes what is done with."""
        channel = channel or self._channel or PLANE
        shared = self._shared
        with shared.lock:
            seq = shared.sequences[(self.prefix, channel)]
            shared.sequences[(self.prefix, channel)] += 1
            retired, shared.retired = shared.retired, []
        collective = Collective(self.store, self._key(channel, "c", seq), self.rank, self.world_size)
        if not collective.arrive(payload):
            return lambda: self._outcome(self._wait(collective, step))
        standing = collective.settle(self._completed(collective, combine, step))
        previous = Collective(self.store, self._key(channel, "c", seq - 1), self.rank, self.world_size)
        delete_keys(self.store, retired + (list(previous.keys()) if seq else []))
        return lambda: self._outcome(standing)

    def _completed(self, collective: Collective, combine: Optional[Callable[[list[bytes]], bytes]], step: str) -> bytes:
        """What the last arriver sets: the combined result, or the error combining met (raised on every rank)."""
        if combine is None:
            return RESULT
        try:
            return RESULT + combine(collective.payloads(step))
        except MalformedMessage as err:
            return ending_record(MalformedMessage, str(err))
        except Exception as err:  # noqa: BLE001 - a combine that fails fails on every rank, with this text
            return ending_record(RuntimeError, f"disttune: step '{step}': combining every rank's values failed on "
                                               f"rank {self.rank}: {type(err).__name__}: {err}")

    @staticmethod
    def _outcome(value: bytes) -> bytes:
        if value[:1] == RESULT:
            return value[1:]
        if value[:1] == ENDED:
            raise_ending(value)
        raise MalformedMessage("disttune: a collective's result is not disttune's; is another program writing into "
                               "this job's rendezvous store?")

    def _wait(self, collective: Collective, step: str) -> bytes:
        """Wait for ``collective``'s result (see the module doc); leaving early sets its ending for every rank."""
        channel, deadline = self._channel, time.monotonic() + self.timeout_s
        ticket = self._shared.waiter().wait_for(collective.result)
        try:
            while (value := self._answer(ticket, step)) is None:
                self._look(channel, step)
                if time.monotonic() > deadline:
                    raise self._timed_out(step, sorted(set(range(self.world_size)) - collective.arrived()))
            return value
        except (CollectiveTimeout, PeerFailed) as err:
            return self._leave(collective, err)
        except BaseException:  # Ctrl-C: the peers waiting here leave too, and hear of it from the posts
            try:
                collective.settle(ending_record(PeerFailed, f"disttune: step '{step}': rank {self.rank} left", [self.rank]))
            except RuntimeError:
                pass
            raise

    @staticmethod
    def _answer(ticket: _Ticket, step: str) -> Optional[bytes]:
        try:
            return ticket.result(POST_POLL_S)
        except RuntimeError as err:  # the store is gone (the launcher died): no wait can end any more
            raise CollectiveTimeout(f"disttune: step '{step}': the rendezvous store is unreachable: {err}") from err

    @staticmethod
    def _leave(collective: Collective, err: Exception) -> bytes:
        """Set ``collective``'s ending to ``err`` unless a result or another ending stands there: then that one."""
        ranks = getattr(err, "missing", ()) or getattr(err, "ranks", ())
        mine = ending_record(type(err), str(err), ranks)
        try:
            standing = collective.settle(mine)
        except RuntimeError:
            raise err from None
        if standing == mine:
            raise err
        return standing

    def _timed_out(self, step: str, missing: list[int], limit: Optional[float] = None) -> CollectiveTimeout:
        limit = self.timeout_s if limit is None else limit
        who = f"rank(s) {missing} did not arrive" if missing else "it did not complete"
        return CollectiveTimeout(f"disttune: step '{step}': {who} within {limit:g} s (a rank died, hung, or skipped "
                                 "the step)", missing)

    def _look(self, channel: Optional[str], step: str) -> None:
        """:class:`PeerFailed` if a peer has posted on ``channel`` (one request)."""
        if channel is not None and self.peers_posted(channel):
            ranks = sorted(r for slot in ("note", "settle") for r in self.posted(channel, slot) if r != self.rank)
            raise PeerFailed(f"disttune: step '{step}': rank(s) {ranks} posted an error or left", ranks)

    def _retire(self, channel: str) -> None:
        """The channel's last two collectives (and its progress notes) are deleted by the last arriver of the next
        collective of this process: by then every rank has left the channel."""
        with self._shared.lock:
            last = self._shared.sequences.pop((self.prefix, channel), 0) - 1
            for seq in (last - 1, last):
                if seq >= 0:
                    self._shared.retired.extend(Collective(self.store, self._key(channel, "c", seq), 0, 0).keys())
            if channel in self._noted:
                self._noted.discard(channel)
                self._shared.retired.extend(self._key(channel, "at", r) for r in range(self.world_size))

    # -- the one wait loop for the GPU --------------------------------------------------------------------------

    def wait_until(self, ready: Callable[[], bool], step: str, timeout_s: Optional[float] = None,
                   behind: Optional[Callable[[], list[int]]] = None) -> None:
        """Poll ``ready()`` until it is true (a wait on the GPU). Leaves with :class:`PeerFailed` when a peer posts on
        the watched channel, and with :class:`CollectiveTimeout` after ``timeout_s`` (default the communicator's),
        naming the ranks ``behind()`` gives (those that had not arrived)."""
        channel = self._channel
        limit = self.timeout_s if timeout_s is None else timeout_s

        def checked() -> bool:
            try:
                return ready()
            except (MalformedMessage, CollectiveTimeout, PeerFailed):
                raise
            except RuntimeError as err:  # the store is gone (the launcher died): no wait can end any more
                raise CollectiveTimeout(f"disttune: step '{step}': the rendezvous store is unreachable: {err}") from err

        poll(checked, time.monotonic() + limit, lambda: self._timed_out(step, behind() if behind else [], limit),
             lambda: self._look(channel, step))
