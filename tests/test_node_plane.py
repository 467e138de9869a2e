"""The node-level step of the control plane at 64 simulated ranks on 8 simulated nodes: threads of this process,
each with its own TCPStore client of one rendezvous server, each running its own
:class:`~disttune.nodeplane.NodeStorePlane` told its node; each node's lowest rank opens its node store.

Protocol, not speed (``bench/control_plane_scale.py --per-node 8`` measures that): every rank gets every value, a
rank that never arrives is named on every rank (also a node's last rank, and the rank that holds its node's store),
a post ends every waiting rank, a node store that goes away ends every rank's wait with one clear error, and both
stores keep a bounded number of keys. Every test joins its rank threads within :data:`simulated_ranks.WALL_S`: a
hang fails it.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable

import numpy as np
import pytest

import plane_cases
import simulated_ranks
from disttune.errors import CollectiveTimeout, ControlPlaneLost
from disttune.nodeplane import NODE_STEP_MIN_RANKS, NodeStorePlane

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


def test_every_rank_gets_every_value_through_its_node_store(cluster):
    def job(r: int, plane: NodeStorePlane):
        floats = plane.all_gather_floats([r, -r / 2], "floats")
        objects = plane.all_gather_objects({"rank": r} if r % 3 else {"same": [1, None]}, "objects")
        combined = plane.combine_floats([r, 1.0], "combined", lambda matrix: matrix.sum(axis=0))
        verdict = plane.combine_objects(r % 5, "verdict", lambda everyone: sorted(set(everyone)))
        plane.barrier("barrier")
        node = plane.node_store()
        return floats, objects, combined, verdict, (node.name, node.ranks, node.node_count)

    expected_objects = [{"rank": r} if r % 3 else {"same": [1, None]} for r in range(WORLD)]
    for r, result in enumerate(on_every_rank(cluster, job, "values")):
        assert not isinstance(result, Exception), (r, result)
        floats, objects, combined, verdict, node = result
        np.testing.assert_array_equal(floats, [[q, -q / 2] for q in range(WORLD)])
        assert objects == expected_objects
        np.testing.assert_array_equal(combined, [sum(range(WORLD)), WORLD])
        assert verdict == [0, 1, 2, 3, 4]
        first = r - r % PER_NODE
        assert node == (node_of(r), tuple(range(first, first + PER_NODE)), WORLD // PER_NODE)


def test_one_node_and_small_jobs_keep_the_flat_protocol(cluster):
    def job(r: int, plane: NodeStorePlane):
        values = plane.all_gather_floats([r], "floats")
        return plane.node_store(), values

    for r, (node, values) in enumerate(on_every_rank(cluster, job, "one node", node=lambda r: "the host")):
        assert node is None
        np.testing.assert_array_equal(values[:, 0], range(WORLD))
    _, clients = cluster
    assert NodeStorePlane(clients[0], 0, NODE_STEP_MIN_RANKS - 1, prefix="small", node="node0").node_store() is None


@pytest.mark.parametrize("absent", [17, 24, 31], ids=["a rank", "the rank holding its node's store",
                                                      "a node's last rank"])
def test_a_rank_that_never_arrives_is_named_on_every_rank(cluster, absent):
    def job(r: int, plane: NodeStorePlane):
        plane.all_gather_floats([r], "before")
        if r != absent:
            plane.barrier("tuning run 3/9")
        return "returned"

    results = on_every_rank(cluster, job, f"absent {absent}", timeout_s=2.0)
    assert results[absent] == "returned"
    errors = [result for r, result in enumerate(results) if r != absent]
    assert all(isinstance(err, CollectiveTimeout) for err in errors), errors
    assert {err.missing for err in errors} == {(absent,)}
    assert {str(err) for err in errors} == {f"disttune: step 'tuning run 3/9': rank(s) [{absent}] did not arrive "
                                            "within 2 s (a rank died, hung, or skipped the step)"}


def test_a_post_ends_every_waiting_rank(cluster):
    plane_cases.a_post_ends_every_waiting_rank(functools.partial(on_every_rank, cluster))


def test_a_node_store_that_goes_away_ends_every_wait_with_one_clear_error(cluster):
    holder = 16  # node2's lowest rank: its process holds node2's store

    def job(r: int, plane: NodeStorePlane):
        plane.all_gather_floats([r], "before")
        if r == holder:  # its process goes away: the store it held stops, and it never arrives
            time.sleep(0.5)
            plane.node_store().close(0.0)
            return "left"
        plane.barrier("tuning run 2/9")
        return "returned"

    results = on_every_rank(cluster, job, "node store gone", timeout_s=600.0)  # only the lost store ends these
    assert results[holder] == "left"
    errors = [result for r, result in enumerate(results) if r != holder]
    assert all(isinstance(err, ControlPlaneLost) for err in errors), errors
    assert {str(err) for err in errors} == {"disttune: node 'node2''s store is unreachable: the process of rank 16, "
                                            "which held it, is gone (it died, or left the job before the other ranks "
                                            "of its node)"}


def test_both_stores_keep_a_bounded_number_of_keys(cluster):
    server, _ = cluster
    node_stores = {}

    def job(r: int, plane: NodeStorePlane):
        plane.barrier("first")  # the membership, and its keys
        for call in range(3):  # each tuning call's channel is retired when the call ends
            plane.watch(f"tuner#{call}")
            for _ in range(5):
                plane.all_gather_objects({"status": None}, "status")
                plane.barrier("run")
            plane.watch(None)
        plane.barrier("after the calls")  # its leaders and last arriver delete what the calls left
        if r % PER_NODE == 0:
            node_stores[r] = plane.node_store().server[0]

    before = server.num_keys()
    results = on_every_rank(cluster, job, "bounded")
    assert not any(isinstance(result, Exception) for result in results), results
    # Left: the membership's keys and ports, the posts' counters (read by the waits), the last barrier's 4 keys.
    deadline = time.monotonic() + 10  # deletions run on the watch thread, off the collective's path
    while time.monotonic() < deadline and (server.num_keys() - before > 3 + WORLD // PER_NODE + 4
                                           or any(store.num_keys() > 3 for store in node_stores.values())):
        time.sleep(0.05)
    assert server.num_keys() - before <= 3 + WORLD // PER_NODE + 4
    assert [store.num_keys() for store in node_stores.values()] == [3] * (WORLD // PER_NODE)
