"""The control plane over a c10d store: collectives whose store work grows as O(N), and posts on channels.

Every rank of a ``torch.distributed`` job holds a connection to the job's rendezvous store, a key-value
server on one host. :class:`StorePlane` runs the tuner's collectives through it. Collective number
``seq`` on a channel uses three keys under ``<prefix>/<channel>/c/<seq>/``:

* ``d``: each rank appends its payload, framed with its rank (:func:`disttune.wire.pack_frame`);
* ``n``: each rank then adds 1 to this counter; the answer tells the rank that completes the count
  that it arrived last;
* ``k``: the last arriver reads ``d`` once, combines the payloads into one result (the float matrix,
  each distinct object once, a reduction, nothing for a barrier) and sets ``k``; every other rank
  blocks in the store's ``get`` of ``k``, which the store answers when ``k`` is set.

So the store host serves four requests per rank (the append needs no answer) and holds each payload
once; it sends the result once to each rank. Nothing is polled: a waiting thread blocks in ``get`` on
a connection of its own, while the process's :class:`WaitWatch` thread reads the watched channel's
post counter every :data:`POST_POLL_S` once the wait has lasted that long, and ends the wait at its
deadline. The last arriver also deletes the channel's previous collective: every rank has read it,
since every rank has arrived at this one. A channel that is no longer watched (a tuning call's, when
the call ends) is *retired*: its last keys go at the next collective that completes.

A wait ends early by an *ending* set in ``k`` (:func:`ending_record`: the error's type, text and
ranks) unless the result stands there already; the first of the two stands (``compare_set``). Every
rank waiting there, and every rank that arrives later, wakes and raises that same error: a peer's
post (:class:`~disttune.errors.PeerFailed`), or the deadline (:class:`~disttune.errors.CollectiveTimeout`
naming the ranks that did not arrive: the expiring rank reads ``d`` once). Ctrl-C in a thread that
blocks in ``get`` takes effect when the wait ends (at the latest at its deadline).

Posts (:class:`StorePosts`) carry a failing rank's error to peers waiting anywhere: each slot of a
channel is one key of appended frames, plus one counter per channel that a waiting rank reads.

Every connection to the store is a :class:`PlaneStore`: once the store's host is gone, the first request
that finds it so raises :class:`~disttune.errors.ControlPlaneLost` with torch's reason, and every later
request of that connection raises it at once.
"""

from __future__ import annotations

import datetime
import functools
import math
import threading
import time
import weakref
from collections import defaultdict
from typing import Any, Callable, Optional, Sequence

import numpy as np

from . import wire
from .env import DEFAULT_TIMEOUT_S
from .errors import CollectiveTimeout, ControlPlaneLost, PeerFailed
from .wire import MalformedMessage

__all__ = ["PLANE", "POST_POLL_S", "PlaneStore", "Connections", "poll", "read_now", "ending_record", "raise_ending",
           "WaitWatch", "wait_watch", "read_when_set", "delete_keys", "Collective", "StorePosts", "StorePlane"]

#: The channel of collectives made outside a tuning call (the agreement on new keys, a sweep's barrier).
PLANE = "plane"
#: How often a wait reads the watched channel's posts, once it has lasted that long.
POST_POLL_S = 0.1
#: The reads of a post counter the store's host serves per second, at most, from all ranks together: beyond
#: ``POST_POLLS_PER_S * POST_POLL_S`` ranks (200) each rank reads less often (:attr:`StorePosts.post_poll_s`: every
#: half second at 1,000 ranks), so that the reads cost the host a few percent of its CPU while a call tunes.
POST_POLLS_PER_S = 2_000
#: Connections of their own that a process opens to a store, besides its communicators' own: one for a blocking wait,
#: one for the last arriver's deletions.
SPARE_CONNECTIONS = 2

#: A value no writer sets: ``compare_set`` with it as the expected value reads a key without waiting.
_ABSENT = "\x00disttune: absent"
#: The first byte of a collective's ``k``: its result follows, or an ending (a rank left).
RESULT, ENDED = b"R", b"E"
_ENDINGS = {"CollectiveTimeout": CollectiveTimeout, "PeerFailed": PeerFailed, "MalformedMessage": MalformedMessage,
            "ControlPlaneLost": ControlPlaneLost}


class StoreLost:
    """Whether the store's host is gone, shared by every :class:`PlaneStore` connection to one store: the first
    request that finds it so marks it, and no connection tries the dead host again. ``reason``: torch's, kept
    out of the error's text (each connection words it differently, and every rank must raise the same text)."""

    #: What a request to the rendezvous store raises once its host is gone.
    RENDEZVOUS = ("disttune: the rendezvous store is unreachable: its host is gone (torchrun's agent, or rank 0 when "
                  "the job was started without torchrun)")

    def __init__(self, message: str = RENDEZVOUS) -> None:
        self.reason: Optional[str] = None
        self.message = message


class PlaneStore:
    """A c10d store connection as the control plane uses it: the same requests, but a lost connection is
    :class:`~disttune.errors.ControlPlaneLost`, and once a connection to the store has found its host gone
    (``lost``, shared with the store's other connections) every later request raises it at once. Requests
    of one connection take turns (as TCPStore's own client does on its one socket), so no second thread tries
    a dead connection after the first has found it dead (each try makes TCPStore log a C++ stack); a
    connection blocked in a ``get`` when the host dies logs its own. Costs a lock and a ``try`` per request
    (each operation's wrapper is made at its first request and kept)."""

    def __init__(self, store: Any, lost: Optional[StoreLost] = None) -> None:
        self.store = store
        self.lost = lost if lost is not None else StoreLost()
        self._turn = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        operation = getattr(self.store, name)
        if not callable(operation):
            return operation
        wrapped = functools.partial(self._call, operation)
        setattr(self, name, wrapped)  # the next request skips __getattr__
        return wrapped

    def _call(self, operation: Callable[..., Any], *args: Any) -> Any:
        with self._turn:
            if self.lost.reason is None:
                try:
                    return operation(*args)
                except _network_error() as err:  # (evaluated only when the request raised)
                    self.lost.reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ControlPlaneLost(self.lost.message)


@functools.lru_cache(maxsize=None)
def _network_error() -> type:
    """torch's error for a store connection that failed (imported where a request first raises: an import statement
    per request cost the simulated ranks of ``bench/control_plane_scale.py`` about 3 µs each)."""
    from torch.distributed import DistNetworkError

    return DistNetworkError


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


def raise_ending(value: bytes, step: str) -> None:
    """Raise the error an ending record carries (a :class:`MalformedMessage` where it is not one)."""
    record = wire.unpack(value[1:], -1, "a collective's ending")
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise MalformedMessage("disttune: a collective's ending is not disttune's; is another program writing into "
                               "this job's rendezvous store?")
    kind, text, ranks = record.get("type"), record["text"], [int(r) for r in record.get("ranks") or []]
    if kind == "PeerFailed":
        raise PeerFailed(f"disttune: step '{step}': rank(s) {ranks} posted an error or left", ranks)
    if kind == "CollectiveTimeout":
        raise CollectiveTimeout(text, ranks)
    raise _ENDINGS.get(kind, RuntimeError)(text)


class WaitWatch:
    """The daemon thread that watches this process's waits for a collective while their threads block in the store's
    ``get``: once a wait has lasted :data:`POST_POLL_S` it calls the wait's ``look`` every :data:`POST_POLL_S` (a
    peer's post ends it), and past its deadline its ``expire``; both end the wait by setting the collective's
    result to an ending. It also runs the work handed to :meth:`later` (a last arriver's deletions), off the
    collective's path, and the watchers of tuning calls (:mod:`disttune.ending`: waits with no deadline). Idle:
    blocked on a condition. Registering and cancelling a wait are a dictionary update under a lock: a collective
    that completes within :data:`POST_POLL_S` costs nothing more.
    """

    def __init__(self) -> None:
        self._waits: dict[int, list] = {}  # number -> [next look, every, deadline, look, expire]
        self._later: list[Callable[[], None]] = []
        self._numbers = iter(range(1 << 62))
        self._condition = threading.Condition()
        self._idle = False
        threading.Thread(target=self._run, name="disttune-wait-watch", daemon=True).start()

    def watch(self, deadline: float, look: Callable[[], bool], expire: Callable[[], None], every: float = POST_POLL_S
              ) -> int:
        """Watch a wait until :meth:`cancel`: ``look()`` every ``every`` seconds once it has lasted that long (True: it
        ended the wait), and ``expire()`` after ``deadline`` (``time.monotonic()``)."""
        with self._condition:
            number = next(self._numbers)
            self._waits[number] = [time.monotonic() + every, every, deadline, look, expire]
            if self._idle:
                self._condition.notify()
        return number

    def cancel(self, number: int) -> None:
        with self._condition:
            self._waits.pop(number, None)

    def later(self, work: Callable[[], None]) -> None:
        """Run ``work`` on this thread soon (its errors are dropped)."""
        with self._condition:
            self._later.append(work)
            self._condition.notify()

    def _run(self) -> None:
        while True:
            with self._condition:
                while not self._waits and not self._later:
                    self._idle = True
                    self._condition.wait()
                self._idle = False
                later, self._later = self._later, []
                due = [(number, wait) for number, wait in self._waits.items() if wait[0] <= time.monotonic()]
            for work in later:
                try:
                    work()
                except Exception:  # noqa: BLE001 - housekeeping: a store that is gone keeps its keys
                    pass
            for number, wait in due:
                if number in self._waits:  # not ended meanwhile
                    wait[0] = time.monotonic() + wait[1]
                    self._check(number, *wait[2:])
            with self._condition:
                if self._waits and not self._later:
                    self._condition.wait(POST_POLL_S)

    def _check(self, number: int, deadline: float, look: Callable[[], bool], expire: Callable[[], None]) -> None:
        try:
            if time.monotonic() > deadline:
                expire()
                ended = True
            else:
                ended = look()
        except Exception:  # noqa: BLE001 - the store is gone: the waiting thread's get fails too
            ended = True
        if ended:
            self.cancel(number)


class Connections:
    """Store connections for blocking waits, one wait at a time each: :meth:`connection` hands one out (None while
    all are in use: the wait then polls), :meth:`release` takes it back. A list under a lock."""

    def __init__(self, connections: Sequence[Any] = ()) -> None:
        self._idle, self._lock = list(connections), threading.Lock()

    def connection(self) -> Optional[Any]:
        """An idle connection for one blocking wait (give it back with :meth:`release`), or None."""
        with self._lock:
            return self._idle.pop() if self._idle else None

    def release(self, connection: Optional[Any]) -> None:
        """Take back (or add) ``connection``; None: nothing (a wait that had none, or whose connection died)."""
        if connection is not None:
            with self._lock:
                self._idle.append(connection)


class _PlaneState:
    """What every communicator over one store object shares in this process: each channel's count of collectives
    (a new communicator over the same ranks continues it), the retired keys and the ``spares``, connections that
    block in a collective's wait or delete keys (``store.clone()``: the communicator's own connection stays free
    for posts); while both are in use, a wait polls on the communicator's own connection."""

    def __init__(self, store: Any) -> None:
        self.store = weakref.ref(store)
        self.lock = threading.Lock()
        self.sequences: defaultdict[tuple[str, str], int] = defaultdict(int)
        self.retired: list[str] = []
        self.spares = Connections()
        self.opened = False  # whether the spare connections were opened
        self.lost = StoreLost()  # shared by every connection to the store (PlaneStore)

    def open_spares(self) -> None:
        """Open :data:`SPARE_CONNECTIONS` (a wait's and the housekeeping's), once per store, when the first
        communicator over it is made (about a millisecond each). Never later: a connection opened just as the
        store's host dies meets a refused connect, which TCPStore retries until its timeout (a minute). On the
        calling thread: a TCPStore cloned on one thread while another uses it can answer a ``get`` with nothing."""
        with self.lock:
            if self.opened:
                return
            self.opened = True
            for _ in range(SPARE_CONNECTIONS):
                store = self.store()
                if store is None or self.lost.reason is not None:
                    return
                try:
                    connection = PlaneStore(PlaneStore(store, self.lost).clone(), self.lost)
                    connection.set_timeout(datetime.timedelta(days=1))  # a wait ends by its key (the watch sets it)
                except (ControlPlaneLost, AttributeError, RuntimeError, NotImplementedError):
                    return  # a store that is gone, or cannot be cloned: the waits poll
                self.spares.release(connection)

    def delete_later(self, keys: list[str]) -> None:
        """Delete ``keys`` on the process's :class:`WaitWatch` thread, on a connection of its own."""
        def delete() -> None:
            connection = self.spares.connection()
            raw = self.store()
            store = connection if connection is not None else PlaneStore(raw, self.lost) if raw is not None else None
            if store is not None:
                delete_keys(store, keys)
            self.spares.release(connection)

        wait_watch().later(delete)


_STATES: "weakref.WeakKeyDictionary[Any, _PlaneState]" = weakref.WeakKeyDictionary()
_STATES_LOCK = threading.Lock()
_WATCH: list[WaitWatch] = []  # the process's one WaitWatch, once a wait has needed it


def wait_watch() -> WaitWatch:
    """This process's :class:`WaitWatch` (started at the first wait; later calls take no lock)."""
    if _WATCH:
        return _WATCH[0]
    with _STATES_LOCK:
        if not _WATCH:
            _WATCH.append(WaitWatch())
        return _WATCH[0]


def _state(store: Any) -> _PlaneState:
    with _STATES_LOCK:
        if store not in _STATES:
            _STATES[store] = _PlaneState(store)
        return _STATES[store]


def read_when_set(store: Any, key: str) -> bytes:
    """Poll ``key`` until it is set (for a store that gives a wait no connection of its own)."""
    pause = 0.0
    while (value := read_now(store, key)) is None:
        time.sleep(pause)
        pause = min(pause * 2 or 2e-5, 1e-3)
    return value


class Collective:
    """The keys and store requests of one collective, based at ``base`` (see the module doc)."""

    def __init__(self, store: Any, base: str, rank: int, world_size: int) -> None:
        self.store, self.base, self.rank, self.world_size = store, base, rank, world_size
        self.data, self.count, self.result = self.keys_at(base)

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

    @staticmethod
    def keys_at(base: str) -> list[str]:
        """The keys of the collective based at ``base``."""
        return [f"{base}/{part}" for part in "dnk"]


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
    """Posts on channels over a c10d store, and the polled wait on the GPU that they end: the
    :class:`~disttune.comm.ControlPlane` half of :class:`StorePlane`.

    Each slot of a channel is one key of appended frames (``<prefix>/<channel>/<slot>``), so that reading
    every rank's post is one request whatever the number of ranks; ``<prefix>/<channel>/posts`` counts the
    posts. Progress notes (:meth:`note_progress`) are one key per rank, read only when a wait times out.

    ``post_poll_s``: how often a rank reads the post counter while it waits (:data:`POST_POLL_S`, longer beyond
    :data:`POST_POLLS_PER_S` reads per second from all ranks); a read younger than that is answered from the last.
    """

    def __init__(self, store: Any, rank: int, world_size: int, prefix: str, timeout_s: float) -> None:
        self.store, self.rank, self.world_size, self.prefix = store, rank, world_size, prefix
        self.timeout_s = float(timeout_s)
        self.post_poll_s = max(POST_POLL_S, world_size / POST_POLLS_PER_S)
        self._channel: Optional[str] = None
        self._own_posts: defaultdict[str, int] = defaultdict(int)
        self._read_posts: dict[str, tuple[float, int]] = {}  # channel -> (when, the count read)
        self._noted: set[str] = set()
        self._lock = threading.Lock()  # a call's watcher posts too, on the watch thread (disttune.ending)

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
        """Whether a peer has posted on ``channel``: one store request, none where a thread of this rank read the
        counter less than :attr:`post_poll_s` ago (the call's watcher and a wait both read it)."""
        with self._lock:
            own = self._own_posts[channel]
        when, count = self._read_posts.get(channel, (-math.inf, 0))
        if time.monotonic() - when >= self.post_poll_s:
            count = int(self.store.add(self._key(channel, "posts"), 0))
            self._read_posts[channel] = (time.monotonic(), count)
        return count > own

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

    def decided(self, channel: str, slot: str) -> Any:
        """The value :meth:`decide` left in ``slot`` of ``channel``, or None while none stands (one request)."""
        standing = read_now(self.store, self._key(channel, slot))
        return None if standing is None else wire.unpack(standing, -1, f"'{slot}' on {channel}")

    def note_progress(self, channel: str, count: int) -> None:
        """Say that this rank has reached its ``count``-th wait on the GPU on ``channel`` (one request)."""
        self._noted.add(channel)
        self.store.set(self._key(channel, "at", self.rank), str(count))

    def progress(self, channel: str) -> dict[int, int]:
        """Each rank's last :meth:`note_progress` count on ``channel`` (0 where it has noted none): one request per
        rank, made only when a wait has timed out."""
        return {rank: int(read_now(self.store, self._key(channel, "at", rank)) or 0) for rank in range(self.world_size)}

    def posters(self, channel: str) -> list[int]:
        """The peers that posted an error (``note``) or left (``settle``) on ``channel`` (two requests)."""
        return sorted({r for slot in ("note", "settle") for r in self.posted(channel, slot) if r != self.rank})

    def wait_until(self, ready: Callable[[], bool], step: str, timeout_s: Optional[float] = None,
                   behind: Optional[Callable[[], list[int]]] = None) -> None:
        """Poll ``ready()`` until it is true (a wait on the GPU). Leaves with :class:`PeerFailed` when a peer posts on
        the watched channel, and with :class:`CollectiveTimeout` after ``timeout_s`` (default the communicator's),
        naming the ranks ``behind()`` gives (those that had not arrived)."""
        channel = self._channel
        limit = self.timeout_s if timeout_s is None else timeout_s

        def look() -> None:
            if channel is not None and self.peers_posted(channel):
                ranks = self.posters(channel)
                raise PeerFailed(f"disttune: step '{step}': rank(s) {ranks} posted an error or left", ranks)

        poll(ready, time.monotonic() + limit, lambda: self._timed_out(step, behind() if behind else [], limit), look)

    def _timed_out(self, step: str, missing: list[int], limit: Optional[float] = None) -> CollectiveTimeout:
        limit = self.timeout_s if limit is None else limit
        who = f"rank(s) {missing} did not arrive" if missing else "it did not complete"
        return CollectiveTimeout(f"disttune: step '{step}': {who} within {limit:g} s (a rank died, hung, or skipped "
                                 "the step)", missing)


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
        shared = _state(store)  # shared by every communicator over this store (its sequences go on)
        super().__init__(PlaneStore(store, shared.lost), rank, world_size, prefix, timeout_s)
        self._shared = shared
        shared.open_spares()

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

    def combine_objects(self, obj: Any, step: str, combine: Callable[[list[Any]], Any]) -> Any:
        """``combine`` of every rank's ``obj`` (plain data, in rank order), computed once, by the last rank to arrive:
        every rank gets the same plain data back, and the store sends each rank only that. The last arriver decodes
        each distinct message once (ranks that sent the same share one object: read, don't modify); a message that
        does not decode, or a ``combine`` that raises, is the same error on every rank."""
        def combined(payloads: list[bytes]) -> bytes:
            decoded: dict[bytes, Any] = {}
            for sender, payload in enumerate(payloads):
                if payload not in decoded:
                    decoded[payload] = wire.unpack(payload, sender, step)
            return wire.pack(combine([decoded[payload] for payload in payloads]))

        return wire.unpack(self._start(wire.pack(obj), step, combined)(), -1, step)

    def barrier(self, step: str) -> None:
        self._start(b"", step, None)()

    # -- one collective ----------------------------------------------------------------------------------------------

    def _start(self, payload: bytes, step: str, combine: Optional[Callable[[list[bytes]], bytes]],
               channel: Optional[str] = None) -> Callable[[], bytes]:
        """Arrive at the channel's next collective with ``payload``; returns the function that waits for its result.
        The last arriver combines the payloads (``combine``; None: a barrier) and deletes what is done with."""
        channel, seq, retired = self._take_sequence(channel)
        shared = self._shared
        collective = Collective(self.store, self._key(channel, "c", seq), self.rank, self.world_size)
        if not collective.arrive(payload):
            return lambda: self._outcome(self._wait(collective, step), step)
        standing = collective.settle(self._completed(collective, combine, step))
        shared.delete_later(retired + (Collective.keys_at(self._key(channel, "c", seq - 1)) if seq else []))
        return lambda: self._outcome(standing, step)

    def _take_sequence(self, channel: Optional[str]) -> tuple[str, int, list[str]]:
        """The channel a collective runs on (``channel``, else the watched one, else :data:`PLANE`), its number on
        it, and the retired keys this process's next last arriver deletes (taken: the caller deletes them)."""
        channel = channel or self._channel or PLANE
        shared = self._shared
        with shared.lock:
            seq = shared.sequences[(self.prefix, channel)]
            shared.sequences[(self.prefix, channel)] += 1
            retired, shared.retired = shared.retired, []
        return channel, seq, retired

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
    def _outcome(value: bytes, step: str) -> bytes:
        """The result a collective's ``k`` holds, or the ending it holds, raised."""
        if value[:1] == RESULT:
            return value[1:]
        if value[:1] == ENDED:
            raise_ending(value, step)
        raise MalformedMessage("disttune: a collective's result is not disttune's; is another program writing into "
                               "this job's rendezvous store?")

    def _wait(self, collective: Collective, step: str) -> bytes:
        """Block in the store's ``get`` of ``collective``'s result, on a connection of its own, while the
        :class:`WaitWatch` ends the wait (sets an ending there) for a peer's post or the deadline."""
        channel = self._channel
        return self._watched_get(self.store, collective.result, lambda: self._look(collective, channel),
                                 lambda: self._expire(collective, step))

    def _watched_get(self, store: Any, key: str, look: Callable[[], bool], expire: Callable[[], object]) -> bytes:
        """Block in ``store``'s ``get`` of ``key`` on a spare connection (else the store's own), while the process's
        :class:`WaitWatch` calls ``look`` every ``post_poll_s`` and ``expire`` at the deadline; either ends the wait
        by setting ``key``."""
        watch, spares = wait_watch(), self._shared.spares
        watched = watch.watch(time.monotonic() + self.timeout_s, look, expire, self.post_poll_s)
        connection = None
        try:
            connection = spares.connection()
            if connection is None:
                return read_when_set(store, key)
            return bytes(connection.get(key))
        except ControlPlaneLost:  # the store's host is gone: no wait can end any more
            connection = None  # (a dead connection is not kept for the next wait)
            raise
        finally:
            watch.cancel(watched)
            spares.release(connection)

    def _look(self, collective: Collective, channel: Optional[str]) -> bool:
        """End ``collective`` for every rank if a peer has posted on ``channel`` (one request; three if one has)."""
        if channel is None or not self.peers_posted(channel):
            return False
        collective.settle(ending_record(PeerFailed, "posted", self.posters(channel)))
        return True

    def _expire(self, collective: Collective, step: str) -> None:
        """End ``collective`` for every rank with the deadline's error, naming the ranks that did not arrive."""
        missing = sorted(set(range(self.world_size)) - collective.arrived())
        err = self._timed_out(step, missing)
        collective.settle(ending_record(CollectiveTimeout, str(err), missing))

    def _retire(self, channel: str) -> None:
        """The channel's last two collectives, its post counter (a wait's read creates it) and its progress notes
        are deleted by the last arriver of the next collective of this process: by then every rank has left the
        channel."""
        with self._shared.lock:
            last = self._shared.sequences.pop((self.prefix, channel), 0) - 1
            for seq in (last - 1, last):
                if seq >= 0:
                    self._shared.retired.extend(Collective.keys_at(self._key(channel, "c", seq)))
            self._shared.retired.append(self._key(channel, "posts"))
            if channel in self._noted:
                self._noted.discard(channel)
                self._shared.retired.extend(self._key(channel, "at", r) for r in range(self.world_size))
