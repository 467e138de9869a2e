"""The control plane's store protocol at 64 simulated ranks: threads of this process, each with its own TCPStore
client of one server, each running its own :class:`~disttune.storeplane.StorePlane` (the code of ``TorchComm``).

Protocol, not speed (``bench/control_plane_scale.py`` measures that): every rank gets every value, a rank that
never arrives is named on every rank, a post ends every waiting rank, and the store keeps a bounded number of keys.
Every test joins its rank threads within :data:`simulated_ranks.WALL_S`: a hang fails it.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable

import numpy as np
import pytest

import plane_cases
import simulated_ranks
from disttune.errors import CollectiveTimeout
from disttune.storeplane import StorePlane

WORLD = 64


@pytest.fixture(scope="module")
def cluster():
    """One TCPStore server and one client per simulated rank."""
    yield from simulated_ranks.store_and_clients(WORLD)


def on_every_rank(cluster, job: Callable[[int, StorePlane], Any], prefix: str, timeout_s: float = 60.0) -> list[Any]:
    """``job(rank, plane)`` on every simulated rank at once; what each returned (or raised), in rank order."""
    _, clients = cluster
    return simulated_ranks.on_every_rank(
        WORLD, lambda r: job(r, StorePlane(clients[r], r, WORLD, prefix=prefix, timeout_s=timeout_s)))


def test_every_rank_gets_every_value(cluster):
    def job(r: int, plane: StorePlane):
        floats = plane.all_gather_floats([r, -r / 2], "floats")
        objects = plane.all_gather_objects({"rank": r, "key": (64, "f16")} if r % 2 else {"same": [1, None]}, "objects")
        combined = plane.combine_floats([r, 1.0], "combined", lambda matrix: matrix.sum(axis=0))
        plane.barrier("barrier")
        return floats, objects, combined

    expected_objects = [{"rank": r, "key": (64, "f16")} if r % 2 else {"same": [1, None]} for r in range(WORLD)]
    for r, result in enumerate(on_every_rank(cluster, job, "values")):
        assert not isinstance(result, Exception), (r, result)
        floats, objects, combined = result
        np.testing.assert_array_equal(floats, [[q, -q / 2] for q in range(WORLD)])
        assert objects == expected_objects
        np.testing.assert_array_equal(combined, [sum(range(WORLD)), WORLD])


def test_the_last_arriver_combines_the_objects_once_and_every_rank_receives_its_result(cluster):
    combined_on: list[int] = []

    def job(r: int, plane: StorePlane):
        def verdict(everyone: list) -> dict:
            combined_on.append(r)
            return {"odd": [q for q, obj in enumerate(everyone) if obj["odd"]], "first": everyone[0]}

        result = plane.combine_objects({"odd": r % 2 == 1, "key": (64, "f16")}, "verdict", verdict)
        last = plane.combine_objects(r, "the last rank's", lambda everyone: everyone[-1])
        return result, last

    results = on_every_rank(cluster, job, "combined")
    assert len(combined_on) == 1, "the combine runs on one rank only"
    for result, last in results:
        assert result == {"odd": list(range(1, WORLD, 2)), "first": {"odd": False, "key": (64, "f16")}}
        assert last == WORLD - 1

    def raising(r: int, plane: StorePlane):
        return plane.combine_objects(r, "raising verdict", lambda everyone: everyone[WORLD])

    errors = on_every_rank(cluster, raising, "combined raising")
    assert all(isinstance(err, RuntimeError) for err in errors), errors
    assert len({str(err) for err in errors}) == 1, "every rank raises the same error"
    assert "step 'raising verdict': combining every rank's values failed" in str(errors[0])


def test_the_consensus_through_the_store_names_the_rank_that_differs_on_every_rank(cluster):
    from disttune.agreement import Agreement
    from disttune.ending import Ending
    from disttune.errors import TuningError
    from disttune.sites import Site, SiteId

    odd_one = 37

    def job(r: int, plane: StorePlane):
        configs = ["config 0", "config 1"] + (["config 2"] if r == odd_one else [])
        sites = [Site(SiteId("gemm", (4096, "bf16"), 0), None, configs)]
        agreement = Agreement(plane, "step")
        agreement.channel = "step#0"  # one process per rank numbers its calls; here the ranks share a process
        agreement.ending = Ending(plane, "step", agreement.channel)
        with agreement.ending:
            agreement.consensus(sites, None, {"reduce": "'max'"}, [False])
        return "agreed"

    errors = on_every_rank(cluster, job, "consensus")
    assert all(isinstance(err, TuningError) for err in errors), errors
    assert len({str(err) for err in errors}) == 1, "every rank raises the same error"
    text = str(errors[0])
    assert f"ranks [{odd_one}]: kernel gemm" in text and "with 3 config(s)" in text
    assert f"ranks {[r for r in range(WORLD) if r != odd_one]}: kernel gemm" in text


def test_a_rank_that_never_arrives_is_named_on_every_rank(cluster):
    absent = 17

    def job(r: int, plane: StorePlane):
        plane.all_gather_floats([r], "before")
        plane.timeout_s = 2.0  # only the step under test is timed short: 64 threads may be slow to start
        if r != absent:
            plane.barrier("tuning run 3/9")
        return "returned"

    results = on_every_rank(cluster, job, "absent")
    assert results[absent] == "returned"
    errors = [result for r, result in enumerate(results) if r != absent]
    assert all(isinstance(err, CollectiveTimeout) for err in errors), errors
    assert {err.missing for err in errors} == {(absent,)}
    assert {str(err) for err in errors} == {"disttune: step 'tuning run 3/9': rank(s) [17] did not arrive within 2 s "
                                            "(a rank died, hung, or skipped the step)"}


def test_a_post_ends_every_waiting_rank(cluster):
    plane_cases.a_post_ends_every_waiting_rank(functools.partial(on_every_rank, cluster))


def test_the_store_keeps_a_bounded_number_of_keys(cluster):
    server, _ = cluster

    def job(r: int, plane: StorePlane):
        for call in range(4):  # each tuning call's channel is retired when the call ends
            plane.watch(f"tuner#{call}")
            for _ in range(10):
                plane.all_gather_objects({"status": None}, "status")
                plane.barrier("run")
            plane.watch(None)
        plane.barrier("after the calls")  # its last arriver deletes what the calls left

    before = server.num_keys()
    results = on_every_rank(cluster, job, "bounded")
    assert not any(isinstance(result, Exception) for result in results), results
    deadline = time.monotonic() + 10  # the last arriver deletes on its watch thread, off the collective's path
    while server.num_keys() - before > 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.num_keys() - before == 3  # the last barrier's own keys: data, count, result
