"""The node-level step of the control plane at 64 simulated ranks on 8 simulated nodes: threads of this process,
each with its own TCPStore client of one rendezvous server, each running its own
:class:`~disttune.nodeplane.NodeStorePlane` told its node; each node's lowest rank starts its node's relay.

Protocol, not speed (``bench/control_plane_scale.py --per-node 8`` measures that): every rank gets every value, a
rank that never arrives is named on every rank (also a node's last rank, and the rank that holds its node's relay),
a post ends every waiting rank, a relay that goes away ends every rank's wait with one clear error, and the
rendezvous store keeps a bounded number of keys. Every test joins its rank threads within
:data:`simulated_ranks.WALL_S`: a hang fails it.
"""

from __future__ import annotations

import functools
import socket
import threading
import time
from typing import Any, Callable

import numpy as np
import pytest

import plane_cases
import simulated_ranks
from disttune import wire
from disttune.errors import CollectiveTimeout, ControlPlaneLost
from disttune.nodeplane import ARRIVAL_REPORT_S, NODE_STEP_MIN_RANKS, NodeLink, NodeStorePlane
from disttune.storeplane import StoreLost

WORLD, PER_NODE = 64, 8


def node_of(rank: int) -> str:
    return f"node{rank // PER_NODE}"


@pytest.fixture(scope="module")
def cluster():
    """One TCPStore server and one client per simulated rank."""
    yield from simulated_ranks.store_and_clients(WORLD)


def on_every_rank(cluster, job: Callable[[int, NodeStorePlane], Any], prefix: str, timeout_s: float = 60.0,
                  node: Callable[[int], str] = node_of) -> list[Any]:
    """``job(rank, plane)`` on every simulated rank at once; what each returned (or raised), in rank order."""
    _, clients = cluster
    return simulated_ranks.on_every_rank(
        WORLD, lambda r: job(r, NodeStorePlane(clients[r], r, WORLD, prefix=prefix, timeout_s=timeout_s, node=node(r))))


def test_every_rank_gets_every_value_through_its_node_relay(cluster):
    def job(r: int, plane: NodeStorePlane):
        floats = plane.all_gather_floats([r, -r / 2], "floats")
        objects = plane.all_gather_objects({"rank": r} if r % 3 else {"same": [1, None]}, "objects")
        combined = plane.combine_floats([r, 1.0], "combined", lambda matrix: matrix.sum(axis=0))
        verdict = plane.combine_objects(r % 5, "verdict", lambda everyone: sorted(set(everyone)))
        plane.barrier("barrier")
        link = plane.node_link()
        return floats, objects, combined, verdict, (link.name, link.ranks, link.node_count, link.relay is not None)

    expected_objects = [{"rank": r} if r % 3 else {"same": [1, None]} for r in range(WORLD)]
    for r, result in enumerate(on_every_rank(cluster, job, "values")):
        assert not isinstance(result, Exception), (r, result)
        floats, objects, combined, verdict, node = result
        np.testing.assert_array_equal(floats, [[q, -q / 2] for q in range(WORLD)])
        assert objects == expected_objects
        np.testing.assert_array_equal(combined, [sum(range(WORLD)), WORLD])
        assert verdict == [0, 1, 2, 3, 4]
        first = r - r % PER_NODE
        assert node == (node_of(r), tuple(range(first, first + PER_NODE)), WORLD // PER_NODE, r == first)


def test_a_gather_started_now_and_finished_later_waits_for_nobody_in_between(cluster):
    def job(r: int, plane: NodeStorePlane):
        plane.barrier("relays started")
        if r % 2:  # odd ranks (members) meet another collective before they start the gather
            plane.barrier("a tuning run")
            return plane.start_gather_floats([r], "agreement on new keys", "tuner:new keys")()
        finish = plane.start_gather_floats([r], "agreement on new keys", "tuner:new keys")  # a host may not wait here
        plane.barrier("a tuning run")
        return finish()

    for result in on_every_rank(cluster, job, "later"):
        assert not isinstance(result, Exception), result
        np.testing.assert_array_equal(result[:, 0], range(WORLD))


def test_one_node_and_small_jobs_keep_the_flat_protocol(cluster):
    def job(r: int, plane: NodeStorePlane):
        values = plane.all_gather_floats([r], "floats")
        return plane.node_link(), values

    for r, (node, values) in enumerate(on_every_rank(cluster, job, "one node", node=lambda r: "the host")):
        assert node is None
        np.testing.assert_array_equal(values[:, 0], range(WORLD))
    _, clients = cluster
    assert NodeStorePlane(clients[0], 0, NODE_STEP_MIN_RANKS - 1, prefix="small", node="node0").node_link() is None


@pytest.mark.parametrize("absent, gone", [(17, False), (24, False), (31, False), (42, True)],
                         ids=["a rank", "the rank holding its node's relay", "a node's last rank",
                              "a rank whose connection to its relay closed"])
def test_a_rank_that_never_arrives_is_named_on_every_rank(cluster, absent, gone):
    def job(r: int, plane: NodeStorePlane):
        plane.all_gather_floats([r], "before")
        plane.timeout_s = 2.0  # only the step under test is timed short: 64 threads may be slow to start
        if r != absent:
            plane.barrier("tuning run 3/9")
        elif gone:  # its process died: the relay sees its connection close
            plane.node_link().close()
        return "returned"

    results = on_every_rank(cluster, job, f"absent {absent}")
    assert results[absent] == "returned"
    errors = [result for r, result in enumerate(results) if r != absent]
    assert all(isinstance(err, CollectiveTimeout) for err in errors), errors
    assert {err.missing for err in errors} == {(absent,)}
    assert {str(err) for err in errors} == {f"disttune: step 'tuning run 3/9': rank(s) [{absent}] did not arrive "
                                            "within 2 s (a rank died, hung, or skipped the step)"}


def test_a_stranger_on_a_relays_port_is_dropped_and_the_node_goes_on(cluster, caplog):
    def job(r: int, plane: NodeStorePlane):
        plane.barrier("relays started")
        link = plane.node_link()
        if r == 8:  # another program on the host connects to node1's relay and writes into it
            with socket.create_connection(("127.0.0.1", link.relay.port)) as stranger:
                stranger.sendall(wire.pack_keyed("hello", b"0") + b"GET / HTTP/1.1\r\n\r\n" * 100)
                time.sleep(0.2)  # the relay reads it (and drops the connection) before the collective
        return plane.all_gather_floats([r], "after")

    for result in on_every_rank(cluster, job, "stranger"):
        assert not isinstance(result, Exception), result
        np.testing.assert_array_equal(result[:, 0], range(WORLD))
    assert [record.getMessage() for record in caplog.records] == [
        "disttune: node 'node1''s relay dropped a connection: a connection that is not a member's ('hello', b'0')"]


def test_a_rank_that_cannot_reach_its_relay_says_where_it_looked(cluster):
    _, clients = cluster
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there: a node name shared by ranks of two hosts looks like this
    clients[0].set("unreachable/port", str(port))
    with pytest.raises(ControlPlaneLost) as raised:
        NodeLink.join(clients[1], "unreachable/port", 5, "node0", [4, 5], 2, 2.0)
    assert str(raised.value).startswith(f"disttune: rank 5 could not reach node 'node0''s relay on loopback port "
                                        f"{port} (rank 4's): ConnectionRefusedError")
    assert str(raised.value).endswith("Ranks that share a node name must run on one host: check $DISTTUNE_NODE")


def test_a_post_ends_every_waiting_rank(cluster):
    plane_cases.a_post_ends_every_waiting_rank(functools.partial(on_every_rank, cluster))


def test_a_relay_that_goes_away_ends_every_wait_with_one_clear_error(cluster):
    holder = 16  # node2's lowest rank: its process holds node2's relay

    def job(r: int, plane: NodeStorePlane):
        plane.all_gather_floats([r], "before")
        if r == holder:  # its process goes away: the relay it held stops, and it never arrives
            time.sleep(0.5)
            plane.node_link().close()
            return "left"
        plane.barrier("tuning run 2/9")
        return "returned"

    results = on_every_rank(cluster, job, "relay gone", timeout_s=600.0)  # only the lost relay ends these
    assert results[holder] == "left"
    errors = [result for r, result in enumerate(results) if r != holder]
    assert all(isinstance(err, ControlPlaneLost) for err in errors), errors
    assert {str(err) for err in errors} == {"disttune: node 'node2''s relay is unreachable: the process of rank 16, "
                                            "which held it, is gone (it died, or left the job before the other ranks "
                                            "of its node)"}


def test_a_rendezvous_store_that_goes_away_ends_every_wait_with_one_clear_error():
    absent = 5  # nobody can complete the barrier: every rank waits there when the store's host goes
    stores = simulated_ranks.store_and_clients(WORLD)
    clients = next(stores)[1]  # (no name holds the server: it stops once the generator lets go of it)

    waiting = threading.Semaphore(0)

    def job(r: int, plane: NodeStorePlane):
        plane.all_gather_floats([r], "before")
        waiting.release()
        if r != absent:
            plane.barrier("first run")  # outside a tuning call: members look at nothing in the store meanwhile
        return "returned"

    def stop_the_store() -> None:
        for _ in range(WORLD):
            waiting.acquire()
        time.sleep(ARRIVAL_REPORT_S + 0.5)  # every rank waits in the barrier, and has reported its arrival
        stores.close()

    threading.Thread(target=stop_the_store, daemon=True).start()
    started = time.monotonic()
    results = simulated_ranks.on_every_rank(
        WORLD, lambda r: job(r, NodeStorePlane(clients[r], r, WORLD, prefix="gone", timeout_s=600.0, node=node_of(r))))
    assert time.monotonic() - started < 30
    errors = [result for r, result in enumerate(results) if r != absent]
    assert all(isinstance(err, ControlPlaneLost) for err in errors), errors
    assert {str(err) for err in errors} == {StoreLost.RENDEZVOUS}


def test_the_rendezvous_store_keeps_a_bounded_number_of_keys(cluster):
    server, _ = cluster

    def job(r: int, plane: NodeStorePlane):
        plane.barrier("first")  # the membership, and its keys
        for call in range(3):  # each tuning call's channel is retired when the call ends
            plane.watch(f"tuner#{call}")
            for _ in range(5):
                plane.all_gather_objects({"status": None}, "status")
                plane.barrier("run")
            plane.watch(None)
        plane.barrier("after the calls")  # its last node's host deletes what the calls left

    before = server.num_keys()
    results = on_every_rank(cluster, job, "bounded")
    assert not any(isinstance(result, Exception) for result in results), results
    # Left: the membership's keys and ports, the posts' counters (read by the waits), the last barrier's 4 keys.
    deadline = time.monotonic() + 10  # deletions run on the watch thread, off the collective's path
    while time.monotonic() < deadline and server.num_keys() - before > 3 + WORLD // PER_NODE + 4:
        time.sleep(0.05)
    assert server.num_keys() - before <= 3 + WORLD // PER_NODE + 4
