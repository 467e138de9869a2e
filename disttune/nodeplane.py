"""The node-level step of the store's collectives: the ranks of a node combine on a store of their own first, so
that the rendezvous store serves about three requests per node and collective instead of per rank.

:class:`NodeStorePlane` is a :class:`~disttune.storeplane.StorePlane` that knows its node (``node=``, else
``$DISTTUNE_NODE``, else the host name: :func:`disttune.env.node_name`). At its first collective a job of at least
:data:`NODE_STEP_MIN_RANKS` ranks gathers every rank's node name (one flat all-gather); where that shows several
nodes, some of more than one rank, each node's lowest rank opens a ``TCPStore`` on loopback in its own process,
the *node store*, and publishes its port in the rendezvous store. Smaller jobs, jobs of one node and jobs of one
rank per node keep the flat protocol of :mod:`disttune.storeplane`, unchanged.

A collective then runs the flat protocol twice, with the same keys on both stores:

* every rank appends its payload to its node store's ``d`` and counts itself in there;
* the node's last arriver, its *leader*, reads the node's frames once, appends them to the rendezvous store's
  ``d`` as one bundle and counts the node in; the rendezvous store's last arriver combines every rank's payload
  and sets the result in the rendezvous store's ``k``;
* each leader, blocked in the rendezvous store's ``get``, copies that result into its node store's ``k``, where
  the node's other ranks are blocked in theirs.

A rank that has waited :data:`ARRIVAL_REPORT_S` (a quarter of the timeout where that is shorter) appends its rank to
the collective's arrivals (``a``) in the rendezvous store, a request without an answer: a deadline names the ranks
neither there nor in a node's bundle, so a rank that never arrives is named, while a collective that completes in
time costs the rendezvous store nothing per rank. (A rank that arrived within that time of the first deadline is
named with the absent ones.)

Endings are decided in the rendezvous store: a deadline, a peer's post or a node store that is gone sets an
ending in its ``k`` unless the result stands there, and the rank that set it copies what stands into its node
store. So every rank raises the same error: a :class:`~disttune.errors.CollectiveTimeout` naming the ranks that did
not arrive, a :class:`~disttune.errors.PeerFailed`, or a :class:`~disttune.errors.ControlPlaneLost` naming the node
whose store went and the rank whose process held it. (A node whose ranks have not all arrived has no leader
waiting: its ranks learn an ending set elsewhere at their next look at the posts, or at their deadline.)

The node store lives in its host rank's process: at exit that process waits, at most :data:`NODE_EXIT_WAIT_S`,
until the node's other processes have left, and every other process says it leaves.
"""

from __future__ import annotations

import atexit
import datetime
import socket
import threading
import time
import weakref
from typing import Any, Callable, Optional, Sequence

from . import wire
from .env import DEFAULT_TIMEOUT_S, node_name
from .errors import CollectiveTimeout, ControlPlaneLost, PeerFailed
from .storeplane import (Collective, Connections, PlaneStore, StoreLost, StorePlane, delete_keys, ending_record,
                         read_now, read_when_set, wait_watch)

__all__ = ["NODE_STEP_MIN_RANKS", "NODE_EXIT_WAIT_S", "ARRIVAL_REPORT_S", "MEMBERSHIP", "Nodes", "NodeStore",
           "NodeCollective", "NodeStorePlane", "loopback_store"]

#: Jobs of fewer ranks keep the flat protocol: their store answers a collective in a few milliseconds.
NODE_STEP_MIN_RANKS = 64
#: How long, at most, the process holding a node store waits at exit for the node's other processes to leave.
NODE_EXIT_WAIT_S = 30.0
#: How long a rank waits before it reports its arrival to the rendezvous store, for a deadline's message.
ARRIVAL_REPORT_S = 1.0
#: The channel of the one all-gather of node names, and of the node stores' ports.
MEMBERSHIP = "nodes"


class Nodes:
    """Which node each rank runs on (``names``, by rank), and the ranks of each node in rank order."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = tuple(names)
        self.members: dict[str, list[int]] = {}
        for rank, name in enumerate(self.names):
            self.members.setdefault(name, []).append(rank)

    def worth_a_step(self) -> bool:
        """Whether node stores spare the rendezvous store work: several nodes, and some of more than one rank."""
        return 1 < len(self.members) < len(self.names)

    def ranks_of(self, rank: int) -> list[int]:
        """The ranks on ``rank``'s node (its lowest holds the node store)."""
        return self.members[self.names[rank]]


class NodeStore:
    """One rank's connections to its node's store, and in the process of the node's lowest rank the store itself
    (``server``, from :func:`loopback_store`); ``ranks``: the node's, ``node_count``: the job's nodes. ``main``
    carries the collectives' requests; a blocking wait takes a connection of its own (``waiters``). Once
    the store is found gone, every request raises :class:`ControlPlaneLost` at once. Costs two connections."""

    def __init__(self, name: str, ranks: Sequence[int], node_count: int, port: int, timeout_s: float,
                 server: Any = None) -> None:
        self.name, self.ranks, self.host, self.server = name, tuple(ranks), ranks[0], server
        self.node_count = node_count
        self.lost = StoreLost(f"disttune: node '{name}''s store is unreachable: the process of rank {ranks[0]}, which "
                              "held it, is gone (it died, or left the job before the other ranks of its node)")
        self.main = PlaneStore(_connect(port, timeout_s), self.lost)
        waiter = PlaneStore(_connect(port, timeout_s), self.lost)
        waiter.set_timeout(datetime.timedelta(days=1))  # a wait ends by its key (the watch sets it)
        self.waiters = Connections([waiter])
        self._lock = threading.Lock()
        self._retired: list[str] = []  # the node's keys of retired channels: its next leader deletes them

    @classmethod
    def join(cls, rendezvous: Any, key: str, rank: int, name: str, ranks: Sequence[int], node_count: int,
             timeout_s: float) -> "NodeStore":
        """Connect to node ``name``'s store, whose port its lowest rank publishes under ``key`` in ``rendezvous``
        once it has opened the store (when ``rank`` is that rank, it does so here). A store that cannot be opened is
        the same error on each of the node's ranks; a port not published within ``timeout_s`` names the rank."""
        from torch.distributed import DistStoreError

        server = None
        if rank == ranks[0]:
            try:
                server, port = loopback_store()
            except Exception as err:  # noqa: BLE001 - every rank of the node raises this text
                rendezvous.set(key, f"!disttune: rank {rank} could not open node '{name}''s store: "
                                    f"{type(err).__name__}: {err}")
                raise
            rendezvous.set(key, str(port))
        try:
            rendezvous.wait([key], datetime.timedelta(seconds=timeout_s))
        except DistStoreError:
            raise CollectiveTimeout(f"disttune: rank {ranks[0]} did not open node '{name}''s store within "
                                    f"{timeout_s:g} s (it died, hung, or skipped its first collective)", [ranks[0]]
                                    ) from None
        text = (read_now(rendezvous, key) or b"").decode()
        if text.startswith("!"):
            raise RuntimeError(text[1:])
        return cls(name, ranks, node_count, int(text), timeout_s, server)

    def retire(self, keys: list[str]) -> None:
        """Have the node's leader of this process's next collective delete ``keys``."""
        with self._lock:
            self._retired.extend(keys)

    def take_retired(self) -> list[str]:
        """The keys :meth:`retire` was given since the last call (a leader deletes them, others drop them)."""
        with self._lock:
            retired, self._retired = self._retired, []
        return retired

    def delete_later(self, keys: list[str]) -> None:
        """Delete ``keys`` from the node store on the process's watch thread, off the collective's path, on ``main``
        (a connection that blocks in waits answers a later ``get`` wrongly after deletions from another thread)."""
        def delete() -> None:
            delete_keys(self.main, keys)

        wait_watch().later(delete)

    def leave(self) -> None:
        """Say that this process leaves the node (at exit; one request, none once the store is gone)."""
        try:
            self.main.add("left", 1)
        except (ControlPlaneLost, RuntimeError):
            pass

    def close(self, wait_s: float) -> None:
        """Stop the node store held here, once the node's other processes have left or after ``wait_s``."""
        deadline = time.monotonic() + wait_s
        try:
            while int(self.main.add("left", 0)) < len(self.ranks) - 1 and time.monotonic() < deadline:
                time.sleep(0.01)
        except (ControlPlaneLost, RuntimeError):
            pass
        server, self.server = self.server, None
        if server is not None:
            self.lost.reason = "closed by this process"  # no request tries it again
            store, listener = server
            del store
            listener.close()


def loopback_store(backlog: int = 1024) -> tuple[tuple[Any, socket.socket], int]:
    """A ``TCPStore`` server (libuv) on loopback, listening on IPv4 (some container stacks name IPv6-mapped peers
    slowly): ``(store, its listening socket)`` (keep both; dropping the store stops it) and its port."""
    import torch.distributed as dist

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(backlog)
    port = listener.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, use_libuv=True,
                          master_listen_fd=listener.fileno())
    return (store, listener), port


def _connect(port: int, timeout_s: float) -> Any:
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


class NodeCollective:
    """One collective's keys on both stores, based at ``base``: on the rendezvous store every rank's payload
    (``d``, in node bundles), the count of nodes (``n``), the result (``k``) and the arrivals (``a``); on the node
    store the node's payloads, count and result (``d``, ``n``, ``k``)."""

    def __init__(self, store: Any, node: NodeStore, base: str, rank: int, world_size: int) -> None:
        self.everyone = Collective(store, base, rank, world_size)
        self.node = Collective(node.main, base, rank, len(node.ranks))
        self.node_store, self.node_count, self.arrivals = node, node.node_count, f"{base}/a"
        self.reported = False

    def arrive(self, payload: bytes) -> bool:
        """Arrive with ``payload`` (two requests to the node store); True: this rank leads its node."""
        return self.node.arrive(payload)

    def report(self) -> None:
        """Add this rank to the arrivals in the rendezvous store (once; one request without an answer)."""
        if not self.reported:
            self.reported = True
            self.everyone.store.append(self.arrivals, wire.pack_frame(self.everyone.rank, b""))

    def deliver(self) -> bool:
        """The leader's part: the node's payloads to the rendezvous store as one bundle, and the node counted in
        (three requests); True when this node completed the count."""
        store = self.everyone.store
        store.append(self.everyone.data, read_now(self.node.store, self.node.data) or b"")
        return int(store.add(self.everyone.count, 1)) == self.node_count

    def settle(self, value: bytes) -> bytes:
        """Set the rendezvous store's ``k`` to ``value`` unless it is set, and copy what stands there into the node
        store (two requests); the value that stands."""
        standing = self.everyone.settle(value)
        self.copy_to_node(standing)
        return standing

    def copy_to_node(self, standing: bytes) -> None:
        try:
            self.node.settle(standing)
        except ControlPlaneLost:  # the node store is gone: each of its ranks finds that out in its own wait
            pass

    def missing(self) -> list[int]:
        """The ranks that did not arrive (two requests): neither among the reported arrivals nor in a node's
        bundle in the rendezvous store."""
        arrived = _ranks_in(read_now(self.everyone.store, self.arrivals)) | self.everyone.arrived()
        return sorted(set(range(self.everyone.world_size)) - arrived)

    @staticmethod
    def keys_at(base: str) -> tuple[list[str], list[str]]:
        """The keys of the collective based at ``base``: the rendezvous store's, the node store's."""
        return Collective.keys_at(base) + [f"{base}/a"], Collective.keys_at(base)


def _ranks_in(frames: Optional[bytes]) -> set[int]:
    try:
        return {rank for rank, _ in wire.unpack_frames(frames or b"", "arrivals")}
    except (ValueError, RuntimeError):
        return set()


class _Memberships:
    """Per rendezvous store connection: each prefix's node store (None: the flat protocol), made once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_prefix: dict[str, Optional[NodeStore]] = {}


_MEMBERSHIPS: "weakref.WeakKeyDictionary[Any, _Memberships]" = weakref.WeakKeyDictionary()
_OPEN: list[NodeStore] = []  # every node store connection of this process, for its exit
_LOCK = threading.Lock()


def _leave_nodes() -> None:
    """At exit: every process says it leaves its nodes, then the processes holding node stores wait for the others
    (at most :data:`NODE_EXIT_WAIT_S`) and stop them."""
    with _LOCK:
        stores = list(_OPEN)
    for store in stores:
        if store.server is None:
            store.leave()
    deadline = time.monotonic() + NODE_EXIT_WAIT_S
    for store in stores:
        if store.server is not None:
            store.close(max(0.0, deadline - time.monotonic()))


class NodeStorePlane(StorePlane):
    """A :class:`~disttune.storeplane.StorePlane` whose collectives take the node-level step (the module doc) where
    the job is large enough and spans several nodes; ``node``: the name of this rank's node
    (:func:`disttune.env.node_name`). Its first collective, in such a job, gathers the node names and opens the
    node stores (about one flat all-gather). Cost per collective then, on the rendezvous store's host: three
    requests per node (the bundle, the count, the wait and read), and one append without an answer per rank that
    waits :data:`ARRIVAL_REPORT_S`; on each node store's, four requests per rank.
    """

    def __init__(self, store: Any, rank: int, world_size: int, prefix: str = "disttune/all",
                 timeout_s: float = DEFAULT_TIMEOUT_S, node: Optional[str] = None) -> None:
        super().__init__(store, rank, world_size, prefix, timeout_s)
        self.node = node_name(node)
        self._node_store: tuple[Optional[NodeStore], ...] = () if world_size >= NODE_STEP_MIN_RANKS else (None,)

    def node_store(self) -> Optional[NodeStore]:
        """This rank's node store, made at the first call (a collective: every rank calls it); None where the job
        keeps the flat protocol. Later calls read what this communicator found."""
        if self._node_store:
            return self._node_store[0]
        memberships = self._memberships()
        with memberships.lock:
            if self.prefix not in memberships.by_prefix:
                memberships.by_prefix[self.prefix] = self._join_node()
            store = memberships.by_prefix[self.prefix]
        self._node_store = (store,)
        return store

    def _memberships(self) -> _Memberships:
        with _LOCK:
            return _MEMBERSHIPS.setdefault(self.store.store, _Memberships())

    def _join_node(self) -> Optional[NodeStore]:
        """Gather every rank's node name; open (the node's lowest rank) or find this rank's node store."""
        step = "which node each rank runs on"
        finish = super()._start(wire.pack(self.node), step, wire.pack_shared, MEMBERSHIP)
        names = [wire.unpack(payload, sender, step) for sender, payload in wire.unpack_shared(finish(), self.world_size,
                                                                                              step)]
        nodes = Nodes([str(name) for name in names])
        if not nodes.worth_a_step():
            return None
        store = NodeStore.join(self.store, self._key(MEMBERSHIP, "port", self.node), self.rank, self.node,
                               nodes.ranks_of(self.rank), len(nodes.members), self.timeout_s)
        with _LOCK:
            if not _OPEN:
                atexit.register(_leave_nodes)
            _OPEN.append(store)
        return store

    # -- one collective ----------------------------------------------------------------------------------------------

    def _start(self, payload: bytes, step: str, combine: Optional[Callable[[list[bytes]], bytes]],
               channel: Optional[str] = None) -> Callable[[], bytes]:
        """Arrive at the channel's next collective through the node store where there is one (else flat)."""
        node = self.node_store()
        if node is None:
            return super()._start(payload, step, combine, channel)
        channel, seq, retired = self._take_sequence(channel)
        node_retired = node.take_retired()
        here = NodeCollective(self.store, node, self._key(channel, "c", seq), self.rank, self.world_size)
        before = NodeCollective.keys_at(self._key(channel, "c", seq - 1)) if seq else ([], [])
        try:
            if not here.arrive(payload):
                return lambda: self._finish(here, step, leader=False)
            node.delete_later(node_retired + before[1])  # every rank of the node has left the one before
            if not here.deliver():
                return lambda: self._finish(here, step, leader=True)
        except ControlPlaneLost:
            standing = self._node_gone(here)
            return lambda: self._outcome(standing, step)
        standing = here.settle(self._completed(here.everyone, combine, step))
        self._shared.delete_later(retired + before[0])
        return lambda: self._outcome(standing, step)

    def _finish(self, here: NodeCollective, step: str, leader: bool) -> bytes:
        """Wait for the collective's outcome (a leader in the rendezvous store, its node's other ranks in the node
        store); a leader copies it into the node store."""
        try:
            value = self._wait_at(here, step, leader)
        except ControlPlaneLost:
            value = self._node_gone(here)
        if leader:
            here.copy_to_node(value)
        return self._outcome(value, step)

    def _node_gone(self, here: NodeCollective) -> bytes:
        """This rank found its node store gone: end the collective for every rank with that error (unless its
        result stands already); what stands. Where the rendezvous store is gone too, its error goes up."""
        if self.store.lost.reason is not None:
            raise ControlPlaneLost(self.store.lost.message)
        return here.everyone.settle(ending_record(ControlPlaneLost, here.node_store.lost.message))

    def _wait_at(self, here: NodeCollective, step: str, leader: bool) -> bytes:
        """Block in the ``get`` of the collective's result (the rendezvous store's for a leader, else the node
        store's) on a connection of its own, while the process's watch ends the wait for a post or the deadline."""
        pool = self._shared.spares if leader else here.node_store.waiters
        collective = here.everyone if leader else here.node
        channel, deadline, watch = self._channel, time.monotonic() + self.timeout_s, wait_watch()
        report_at = None if leader else time.monotonic() + min(ARRIVAL_REPORT_S, self.timeout_s / 4)
        watched = watch.watch(deadline, lambda: self._look_at(here, channel, report_at),
                              lambda: self._expire_at(here, step, leader), self.post_poll_s)
        connection = pool.connection()
        try:
            if connection is None:
                return read_when_set(collective.store, collective.result)
            return bytes(connection.get(collective.result))
        except ControlPlaneLost:
            connection = None  # (a dead connection is not kept for the next wait)
            raise
        finally:
            watch.cancel(watched)
            pool.release(connection)

    def _look_at(self, here: NodeCollective, channel: Optional[str], report_at: Optional[float]) -> bool:
        """Report this rank's arrival once it has waited until ``report_at`` (None: a leader, whose node's bundle
        says so); end the collective for every rank if a peer has posted on ``channel`` (one request; five if one
        has)."""
        if report_at is not None and time.monotonic() >= report_at:
            here.report()
        if channel is None or not self.peers_posted(channel):
            return False
        here.settle(ending_record(PeerFailed, "posted", self.posters(channel)))
        return True

    def _expire_at(self, here: NodeCollective, step: str, leader: bool) -> None:
        """End the collective for every rank with the deadline's error, naming the ranks that did not arrive."""
        if not leader:
            here.report()
        missing = here.missing()
        here.settle(ending_record(CollectiveTimeout, str(self._timed_out(step, missing)), missing))

    def _retire(self, channel: str) -> None:
        """Besides the flat protocol's keys, the channel's last two collectives' arrivals and node keys go."""
        node = self._memberships().by_prefix.get(self.prefix)  # None before the first collective: no keys yet
        if node is not None:
            with self._shared.lock:
                last = self._shared.sequences.get((self.prefix, channel), 0) - 1
                for seq in (last - 1, last):
                    if seq >= 0:
                        everyone, on_node = NodeCollective.keys_at(self._key(channel, "c", seq))
                        self._shared.retired.append(everyone[-1])
                        node.retire(on_node)
        super()._retire(channel)

