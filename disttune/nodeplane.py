"""The node-level step of the store's collectives: the ranks of a node hand their payloads to their node's lowest
rank over loopback sockets, so that the rendezvous store serves about three requests per node and collective
instead of four per rank, and each rank's own part is one message out and one in.

:class:`NodeStorePlane` is a :class:`~disttune.storeplane.StorePlane` that knows its node (``node=``, else
``$DISTTUNE_NODE``, else the host name: :func:`disttune.env.node_name`). At its first collective a job of at least
:data:`NODE_STEP_MIN_RANKS` ranks gathers every rank's node name (one flat all-gather); where that shows several
nodes, some of more than one rank, each node's lowest rank (its *host*) starts a :class:`NodeRelay` in its process, a
thread behind a socket listening on loopback, and publishes the port in the rendezvous store; the node's other ranks
(its *members*) connect to it. Smaller jobs, jobs of one node and jobs of one rank per node keep the flat protocol of
:mod:`disttune.storeplane`, unchanged.

A collective then goes:

* each member sends its payload to the relay (a message without an answer); the host hands its own over in its
  process. Nobody waits for anybody to arrive;
* whichever thread completes the node's payloads (the relay's, or the host's) appends them to the rendezvous
  store's ``d`` as one bundle and counts the node in (``n``); the node that completes that count combines every
  rank's payload and sets the result in the rendezvous store's ``k``, as the flat protocol's last arriver does;
* the host blocks in the rendezvous store's ``get`` of ``k``, then sends what stands there to each member, which
  blocks on its socket meanwhile.

Why sockets and not a store per node: over a loopback ``TCPStore`` a member's part is three requests (an append,
the count that names the node's last arriver, a ``get`` of two round trips), about 170 µs of CPU on both ends
together on a 2-core host; over a socket it is a send and a receive (``bench/control_plane_scale.py`` measures
both).

A rank that has waited :data:`ARRIVAL_REPORT_S` (a quarter of the timeout where that is shorter) appends its rank to
the collective's arrivals (``a``) in the rendezvous store, a request without an answer: a deadline names the ranks
neither there nor in a node's bundle, so a rank that never arrives is named, while a collective that completes in
time costs the rendezvous store nothing per rank. (A rank that arrived within that time of the first deadline is
named with the absent ones.)

Endings are decided in the rendezvous store: a deadline, a peer's post or a relay that is gone sets an ending in its
``k`` unless the result stands there, and every rank raises what stands: a
:class:`~disttune.errors.CollectiveTimeout` naming the ranks that did not arrive, a
:class:`~disttune.errors.PeerFailed`, or a :class:`~disttune.errors.ControlPlaneLost` naming the node whose relay
went and the rank whose process held it (where the rendezvous store itself is gone, the host sends its members
that error). The host's wait is watched by the process's
:class:`~disttune.storeplane.WaitWatch`; a member watches its own (its socket's reads end every
:attr:`~disttune.storeplane.StorePosts.post_poll_s` to look at the posts and the deadline), so a member learns an
ending even where its host never arrives.
"""

from __future__ import annotations

import collections
import datetime
import logging
import selectors
import socket
import threading
import time
import weakref
from typing import Any, Callable, Optional, Sequence

from . import wire
from .env import DEFAULT_TIMEOUT_S, node_name
from .errors import CollectiveTimeout, ControlPlaneLost, PeerFailed
from .storeplane import Collective, StorePlane, ending_record, read_now

__all__ = ["NODE_STEP_MIN_RANKS", "ARRIVAL_REPORT_S", "MEMBERSHIP", "Nodes", "NodeRelay", "NodeLink",
           "NodeCollective", "NodeStorePlane"]

#: Jobs of fewer ranks keep the flat protocol: their store answers a collective in a few milliseconds.
NODE_STEP_MIN_RANKS = 64
#: How long a rank waits before it reports its arrival to the rendezvous store, for a deadline's message.
ARRIVAL_REPORT_S = 1.0
#: The channel of the one all-gather of node names, and of the relays' ports.
MEMBERSHIP = "nodes"
#: Collectives a relay or a member remembers as over, so that a message for one that comes late is dropped.
_REMEMBERED = 1024
#: What a member sends first on its connection: its rank.
_HELLO = "hello"

class _Remembered:
    """The last :data:`_REMEMBERED` keys added, for membership tests."""

    def __init__(self) -> None:
        self._order: collections.deque = collections.deque()
        self._keys: set[str] = set()

    def add(self, key: str) -> None:
        self._order.append(key)
        self._keys.add(key)
        if len(self._order) > _REMEMBERED:
            self._keys.discard(self._order.popleft())

    def __contains__(self, key: str) -> bool:
        return key in self._keys


class Nodes:
    """Which node each rank runs on (``names``, by rank), and the ranks of each node in rank order."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = tuple(names)
        self.members: dict[str, list[int]] = {}
        for rank, name in enumerate(self.names):
            self.members.setdefault(name, []).append(rank)

    def worth_a_step(self) -> bool:
        """Whether relays spare the rendezvous store work: several nodes, and some of more than one rank."""
        return 1 < len(self.members) < len(self.names)

    def ranks_of(self, rank: int) -> list[int]:
        """The ranks on ``rank``'s node (its lowest is the host)."""
        return self.members[self.names[rank]]


class _Gathering:
    """One collective's payloads at a relay until its node's are all in, and what delivers them then."""

    __slots__ = ("frames", "deliver")

    def __init__(self) -> None:
        self.frames: dict[int, bytes] = {}
        self.deliver: Optional[Callable[[bytes], None]] = None


class NodeRelay:
    """In a node's host's process: the members' connections, and a thread that reads their payloads. Each collective's
    bundle goes to the rendezvous store from the thread that completes it (the host hands its own payload over with
    :meth:`arrive`); :meth:`forward` sends the members what stands. Costs a thread, a listening socket on loopback and
    a connection per member; per collective, one read per member and, on the host's thread, one send per member."""

    def __init__(self, name: str, ranks: Sequence[int], timeout_s: float) -> None:
        self.name, self.ranks, self.timeout_s = name, tuple(ranks), timeout_s
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(len(self.ranks))
        self.port: int = self._listener.getsockname()[1]
        self._members: dict[int, socket.socket] = {}
        self._gathering: dict[str, _Gathering] = {}
        self._over = _Remembered()  # collectives forwarded: a payload for one of them comes too late
        self._lock = threading.Lock()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._wake, self._waker = socket.socketpair()
        self._selector.register(self._wake, selectors.EVENT_READ)
        self._closing = False
        threading.Thread(target=self._run, name=f"disttune-relay-{name}", daemon=True).start()

    def arrive(self, key: str, frame: bytes, deliver: Callable[[bytes], None]) -> None:
        """The host's ``frame`` for collective ``key``, and what delivers the node's bundle once every member's frame
        is in (called here, now, where they are)."""
        self._take(key, self.ranks[0], frame, deliver)

    def forward(self, key: str, value: bytes) -> None:
        """Send ``value`` (what stands in collective ``key``'s result) to every member. A member that does not take it
        within the timeout is dropped: it hung, and its own deadline ends its wait."""
        with self._lock:
            self._gathering.pop(key, None)
            self._over.add(key)
            members = list(self._members.items())
        message = wire.pack_keyed(key, value)
        for rank, connection in members:
            try:
                connection.sendall(message)
            except OSError:
                self._forget(rank, connection)

    def close(self) -> None:
        """Stop the relay: its thread closes every connection (each member's wait ends with
        :class:`ControlPlaneLost`)."""
        self._closing = True
        self._waker.send(b"\0")

    def _take(self, key: str, rank: int, frame: bytes, deliver: Optional[Callable[[bytes], None]]) -> None:
        with self._lock:
            if key in self._over:
                return
            gathering = self._gathering.setdefault(key, _Gathering())
            gathering.frames[rank] = frame
            gathering.deliver = deliver or gathering.deliver
            if gathering.deliver is None or len(gathering.frames) < len(self.ranks):
                return
            del self._gathering[key]
        gathering.deliver(b"".join(gathering.frames.values()))

    def _forget(self, rank: int, connection: socket.socket) -> None:
        with self._lock:
            if self._members.get(rank) is connection:
                del self._members[rank]

    def _run(self) -> None:
        while not self._closing:
            for selected, _ in self._selector.select():
                if selected.fileobj is self._listener:
                    self._accept()
                elif selected.data is not None:
                    self._read(selected.fileobj, selected.data)
        for selected in list(self._selector.get_map().values()):
            selected.fileobj.close()
        self._waker.close()
        self._selector.close()

    def _accept(self) -> None:
        try:
            connection, _ = self._listener.accept()
        except OSError:
            return
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        connection.settimeout(self.timeout_s)  # a forward's send; reads come only once the selector has data
        self._selector.register(connection, selectors.EVENT_READ, [None, wire.KeyedStream()])  # [its rank, its stream]

    def _read(self, connection: socket.socket, state: list) -> None:
        try:
            data = connection.recv(1 << 16)
            messages = state[1].feed(data) if data else None
            if state[0] is None and messages:  # a member's first message says its rank
                key, body = messages.pop(0)
                rank = int(body) if key == _HELLO else -1
                if rank not in self.ranks[1:]:
                    raise ValueError(f"a connection that is not a member's ({key!r}, {body[:32]!r})")
                state[0] = rank
                with self._lock:
                    self._members[rank] = connection
        except OSError:
            messages = None
        except (ValueError, UnicodeDecodeError) as err:
            logging.getLogger(__name__).warning("disttune: node '%s''s relay dropped a connection: %s", self.name, err)
            messages = None
        if messages is None:  # a member's process is gone (its collectives end at their deadlines), or a stranger
            self._selector.unregister(connection)
            connection.close()
            if state[0] is not None:
                self._forget(state[0], connection)
            return
        for key, body in messages:
            try:
                self._take(key, state[0], body, None)
            except Exception:  # noqa: BLE001 - the relay reads on; the host's wait meets the deadline
                logging.getLogger(__name__).exception("disttune: node '%s''s relay could not deliver %s", self.name,
                                                      key)


class NodeLink:
    """One rank's part of its node's step: in the host's process the :class:`NodeRelay` (``relay``), in a member's its
    connection to the relay. ``ranks``: the node's, ``node_count``: the job's nodes. Once a member has found the relay
    gone, every use raises :class:`ControlPlaneLost` at once."""

    def __init__(self, name: str, ranks: Sequence[int], node_count: int, relay: Optional[NodeRelay] = None,
                 connection: Optional[socket.socket] = None) -> None:
        self.name, self.ranks, self.host, self.node_count = name, tuple(ranks), ranks[0], node_count
        self.relay, self._connection = relay, connection
        self.lost_message = (f"disttune: node '{name}''s relay is unreachable: the process of rank {ranks[0]}, which "
                             "held it, is gone (it died, or left the job before the other ranks of its node)")
        self._lost = False
        self._messages = wire.KeyedStream()
        self._results: dict[str, bytes] = {}
        self._over = _Remembered()  # collectives this member left: what the host forwards for them is dropped
        self._sending, self._receiving = threading.Lock(), threading.Lock()
        self._readable: Optional[selectors.BaseSelector] = None
        if connection is not None:
            self._readable = selectors.DefaultSelector()
            self._readable.register(connection, selectors.EVENT_READ)

    @classmethod
    def join(cls, rendezvous: Any, key: str, rank: int, name: str, ranks: Sequence[int], node_count: int,
             timeout_s: float) -> "NodeLink":
        """Start node ``name``'s relay (``rank`` is its lowest) and publish its port under ``key`` in ``rendezvous``,
        or connect to it once published. A relay that cannot start is the same error on each of the node's ranks; a
        port not published within ``timeout_s`` names the host."""
        from torch.distributed import DistStoreError

        if rank == ranks[0]:
            try:
                relay = NodeRelay(name, ranks, timeout_s)
            except OSError as err:
                rendezvous.set(key, f"!disttune: rank {rank} could not start node '{name}''s relay: "
                                    f"{type(err).__name__}: {err}")
                raise
            rendezvous.set(key, str(relay.port))
            return cls(name, ranks, node_count, relay=relay)
        try:
            rendezvous.wait([key], datetime.timedelta(seconds=timeout_s))
        except DistStoreError:
            raise CollectiveTimeout(f"disttune: rank {ranks[0]} did not start node '{name}''s relay within "
                                    f"{timeout_s:g} s (it died, hung, or skipped its first collective)", [ranks[0]]
                                    ) from None
        text = (read_now(rendezvous, key) or b"").decode()
        if text.startswith("!"):
            raise RuntimeError(text[1:])
        try:
            connection = socket.create_connection(("127.0.0.1", int(text)), timeout=timeout_s)
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            connection.sendall(wire.pack_keyed(_HELLO, str(rank).encode()))
        except OSError as err:
            raise ControlPlaneLost(f"disttune: rank {rank} could not reach node '{name}''s relay on loopback port "
                                   f"{text} (rank {ranks[0]}'s): {type(err).__name__}: {err}. Ranks that share a node "
                                   "name must run on one host: check $DISTTUNE_NODE") from None
        return cls(name, ranks, node_count, connection=connection)

    def send(self, key: str, frame: bytes) -> None:
        """A member's ``frame`` for collective ``key``, to the relay (no answer)."""
        with self._sending:
            if self._lost:
                raise ControlPlaneLost(self.lost_message)
            try:
                self._connection.sendall(wire.pack_keyed(key, frame))
            except OSError:
                self._lost = True
                raise ControlPlaneLost(self.lost_message) from None

    def receive(self, key: str, until: float) -> Optional[bytes]:
        """What the host forwarded for collective ``key``, waiting until ``until`` (``time.monotonic()``) at most;
        None then."""
        with self._receiving:
            while key not in self._results:
                if self._lost:
                    raise ControlPlaneLost(self.lost_message)
                if not self._readable.select(max(0.0, until - time.monotonic())):
                    return None
                try:
                    data = self._connection.recv(1 << 16)
                except OSError:
                    data = b""
                if not data:
                    self._lost = True
                    raise ControlPlaneLost(self.lost_message)
                for done, body in self._messages.feed(data):
                    if done not in self._over:
                        self._results[done] = body
            return self._results.pop(key)

    def leave(self, key: str) -> None:
        """This member left collective ``key`` by an ending it read in the rendezvous store: drop what comes for it."""
        with self._receiving:
            self._results.pop(key, None)
            self._over.add(key)

    def close(self) -> None:
        """Stop the relay (in the host's process) or close the connection to it."""
        if self.relay is not None:
            self.relay.close()
        elif self._connection is not None:
            self._connection.close()


class NodeCollective:
    """One collective's keys in the rendezvous store, based at ``base``: every rank's payload (``d``, in node
    bundles), the count of nodes (``n``), the result (``k``) and the arrivals (``a``); and this rank's node link."""

    def __init__(self, store: Any, link: NodeLink, base: str, rank: int, world_size: int) -> None:
        self.everyone = Collective(store, base, rank, world_size)
        self.link, self.base, self.arrivals = link, base, f"{base}/a"
        self.reported = False

    def report(self) -> None:
        """Add this rank to the arrivals in the rendezvous store (once; one request without an answer)."""
        if not self.reported:
            self.reported = True
            self.everyone.store.append(self.arrivals, wire.pack_frame(self.everyone.rank, b""))

    def deliver(self, bundle: bytes) -> bool:
        """The node's payloads to the rendezvous store as one bundle, and the node counted in (two requests); True
        when this node completed the count."""
        store = self.everyone.store
        store.append(self.everyone.data, bundle)
        return int(store.add(self.everyone.count, 1)) == self.link.node_count

    def settle(self, value: bytes) -> bytes:
        """Set the rendezvous store's ``k`` to ``value`` unless it is set (one request); the value that stands."""
        return self.everyone.settle(value)

    def missing(self) -> list[int]:
        """The ranks that did not arrive (two requests): neither among the reported arrivals nor in a node's
        bundle in the rendezvous store."""
        arrived = _ranks_in(read_now(self.everyone.store, self.arrivals)) | self.everyone.arrived()
        return sorted(set(range(self.everyone.world_size)) - arrived)

    @staticmethod
    def keys_at(base: str) -> list[str]:
        """The rendezvous store's keys of the collective based at ``base``."""
        return Collective.keys_at(base) + [f"{base}/a"]


def _ranks_in(frames: Optional[bytes]) -> set[int]:
    try:
        return {rank for rank, _ in wire.unpack_frames(frames or b"", "arrivals")}
    except (ValueError, RuntimeError):
        return set()


class _Memberships:
    """Per rendezvous store connection: each prefix's node link (None: the flat protocol), made once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_prefix: dict[str, Optional[NodeLink]] = {}


_MEMBERSHIPS: "weakref.WeakKeyDictionary[Any, _Memberships]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


class NodeStorePlane(StorePlane):
    """A :class:`~disttune.storeplane.StorePlane` whose collectives take the node-level step (the module doc) where
    the job is large enough and spans several nodes; ``node``: the name of this rank's node
    (:func:`disttune.env.node_name`). Its first collective, in such a job, gathers the node names and starts the
    relays (about one flat all-gather). Cost per collective then, on the rendezvous store's host: three requests per
    node (the bundle, the count, the host's wait and read), and one append without an answer per rank that waits
    :data:`ARRIVAL_REPORT_S`; on each member, one send and one receive on loopback.
    """

    def __init__(self, store: Any, rank: int, world_size: int, prefix: str = "disttune/all",
                 timeout_s: float = DEFAULT_TIMEOUT_S, node: Optional[str] = None) -> None:
        super().__init__(store, rank, world_size, prefix, timeout_s)
        self.node = node_name(node)
        self._node_link: tuple[Optional[NodeLink], ...] = () if world_size >= NODE_STEP_MIN_RANKS else (None,)

    def node_link(self) -> Optional[NodeLink]:
        """This rank's node link, made at the first call (a collective: every rank calls it); None where the job
        keeps the flat protocol. Later calls read what this communicator found."""
        if self._node_link:
            return self._node_link[0]
        memberships = self._memberships()
        with memberships.lock:
            if self.prefix not in memberships.by_prefix:
                memberships.by_prefix[self.prefix] = self._join_node()
            link = memberships.by_prefix[self.prefix]
        self._node_link = (link,)
        return link

    def _memberships(self) -> _Memberships:
        with _LOCK:
            return _MEMBERSHIPS.setdefault(self.store.store, _Memberships())

    def _join_node(self) -> Optional[NodeLink]:
        """Gather every rank's node name; start (the node's lowest rank) or join this rank's node relay."""
        step = "which node each rank runs on"
        finish = super()._start(wire.pack(self.node), step, wire.pack_shared, MEMBERSHIP)
        names = [wire.unpack(payload, sender, step) for sender, payload in wire.unpack_shared(finish(), self.world_size,
                                                                                              step)]
        nodes = Nodes([str(name) for name in names])
        if not nodes.worth_a_step():
            return None
        return NodeLink.join(self.store, self._key(MEMBERSHIP, "port", self.node), self.rank, self.node,
                             nodes.ranks_of(self.rank), len(nodes.members), self.timeout_s)

    # -- one collective ----------------------------------------------------------------------------------------------

    def _start(self, payload: bytes, step: str, combine: Optional[Callable[[list[bytes]], bytes]],
               channel: Optional[str] = None) -> Callable[[], bytes]:
        """Arrive at the channel's next collective through the node's relay where there is one (else flat)."""
        link = self.node_link()
        if link is None:
            return super()._start(payload, step, combine, channel)
        channel, seq, retired = self._take_sequence(channel)
        here = NodeCollective(self.store, link, self._key(channel, "c", seq), self.rank, self.world_size)
        frame = wire.pack_frame(self.rank, payload)
        if link.relay is None:
            try:
                link.send(here.base, frame)
            except ControlPlaneLost:
                standing = self._relay_gone(here)
                return lambda: self._outcome(standing, step)
            return lambda: self._finish_member(here, step)
        before = NodeCollective.keys_at(self._key(channel, "c", seq - 1)) if seq else []

        def deliver(bundle: bytes) -> None:
            try:
                if here.deliver(bundle):
                    here.settle(self._completed(here.everyone, combine, step))
                    self._shared.delete_later(retired + before)  # every rank has left the one before
            except ControlPlaneLost:  # the rendezvous store is gone: the host's wait raises it
                pass

        link.relay.arrive(here.base, frame, deliver)
        return lambda: self._finish_host(here, step)

    def _finish_host(self, here: NodeCollective, step: str) -> bytes:
        """The host's wait for the collective's outcome in the rendezvous store; it sends the members what stands (or,
        where the rendezvous store is gone, that error)."""
        try:
            value = self._wait_at(here, step)
        except ControlPlaneLost as lost:
            here.link.relay.forward(here.base, ending_record(ControlPlaneLost, str(lost)))
            raise
        here.link.relay.forward(here.base, value)
        return self._outcome(value, step)

    def _finish_member(self, here: NodeCollective, step: str) -> bytes:
        """A member's wait for what its host forwards. Its socket's reads end every :attr:`post_poll_s` to look at the
        posts, and at :data:`ARRIVAL_REPORT_S` and the deadline, so that it ends even where its host never arrives."""
        channel, started = self._channel, time.monotonic()
        deadline = started + self.timeout_s
        report_at = started + min(ARRIVAL_REPORT_S, self.timeout_s / 4)
        look_at = started + self.post_poll_s
        value = None
        while value is None:
            try:
                value = here.link.receive(here.base, min(deadline, look_at, deadline if here.reported else report_at))
            except ControlPlaneLost:
                value = self._relay_gone(here)
                break
            if value is not None:
                return self._outcome(value, step)
            now = time.monotonic()
            if now >= report_at:
                here.report()
            if now >= deadline:
                value = self._expire_at(here, step)
            elif now >= look_at:
                look_at = now + self.post_poll_s
                if channel is not None and self.peers_posted(channel):
                    value = here.settle(ending_record(PeerFailed, "posted", self.posters(channel)))
        here.link.leave(here.base)
        return self._outcome(value, step)

    def _relay_gone(self, here: NodeCollective) -> bytes:
        """This member found its node's relay gone: end the collective for every rank with that error (unless its
        result stands already); what stands. Where the rendezvous store is gone too, its error goes up."""
        if self.store.lost.reason is not None:
            raise ControlPlaneLost(self.store.lost.message)
        return here.settle(ending_record(ControlPlaneLost, here.link.lost_message))

    def _wait_at(self, here: NodeCollective, step: str) -> bytes:
        """The host's wait: block in the ``get`` of the collective's result in the rendezvous store on a connection of
        its own, while the process's watch reports its arrival, and ends the wait for a post or the deadline."""
        channel = self._channel
        report_at = time.monotonic() + min(ARRIVAL_REPORT_S, self.timeout_s / 4)
        return self._watched_get(here.everyone.store, here.everyone.result,
                                 lambda: self._look_at(here, channel, report_at), lambda: self._expire_at(here, step))

    def _look_at(self, here: NodeCollective, channel: Optional[str], report_at: float) -> bool:
        """Report this rank's arrival once it has waited until ``report_at``; end the collective for every rank if a
        peer has posted on ``channel`` (one request; four if one has)."""
        if time.monotonic() >= report_at:
            here.report()
        if channel is None or not self.peers_posted(channel):
            return False
        here.settle(ending_record(PeerFailed, "posted", self.posters(channel)))
        return True

    def _expire_at(self, here: NodeCollective, step: str) -> bytes:
        """End the collective for every rank with the deadline's error, naming the ranks that did not arrive; what
        stands."""
        here.report()
        missing = here.missing()
        return here.settle(ending_record(CollectiveTimeout, str(self._timed_out(step, missing)), missing))

    def _retire(self, channel: str) -> None:
        """Besides the flat protocol's keys, the arrivals of the channel's last two collectives go."""
        if self._memberships().by_prefix.get(self.prefix) is not None:  # (no node step: no arrivals)
            with self._shared.lock:
                last = self._shared.sequences.get((self.prefix, channel), 0) - 1
                self._shared.retired.extend(f"{self._key(channel, 'c', seq)}/a" for seq in (last - 1, last) if seq >= 0)
        super()._retire(channel)

