"""The verdicts of the agreement: all configs failing is an error, ties go to the lowest index, and
what one rank decides alone (options, a discovery error) is the same verdict on every rank (ranks as threads).

Kernels run under TRITON_INTERPRET=1 on the CPU (see conftest.py); fake timers from
``tiny_kernels.TableTimer`` make the expected winners computable.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import disttune
from disttune.agreement import Agreement
from disttune.options import Options
from tiny_kernels import DEV, launch_add, make_kernel, TableTimer, tuner


def test_all_configs_failing_is_an_error_not_a_default(tmp_path):
    def fault(nargs):
        raise RuntimeError("cannot run")

    kernel = make_kernel(blocks=(16, 32), pre_hooks={0: fault, 1: fault})

    @tuner(tmp_path, timer=TableTimer(lambda i: 1.0))
    def step(x):
        launch_add(kernel, x, torch.empty_like(x))

    with pytest.raises(disttune.AllConfigsFailed, match=r"config\[1\].*rank 0: RuntimeError: cannot run"):
        step(torch.randn(64, device=DEV))
    assert kernel.cache == {}


def test_ties_go_to_the_lowest_config_index(tmp_path):
    kernel = make_kernel(blocks=(16, 32, 64))

    @tuner(tmp_path, timer=TableTimer(lambda i: 2.0 if i.config_index == 0 else 1.0))
    def step(x):
        launch_add(kernel, x, torch.empty_like(x))

    step(torch.randn(64, device=DEV))
    assert step.report.results[0].winner == 1


# -- two ranks as threads: the verdicts are the same on every rank ------------------------------------------

class ThreadComm:
    """A Communicator whose ranks are threads of this process (all-gathers through a shared list)."""

    def __init__(self, world: "ThreadWorld", rank: int) -> None:
        self.world, self.rank, self.world_size = world, rank, world.size

    def all_gather_objects(self, obj, step):
        world = self.world
        world.barrier.wait()
        world.slots[self.rank] = obj
        world.barrier.wait()
        gathered = list(world.slots)
        world.barrier.wait()
        return gathered

    def all_gather_floats(self, values, step):
        return np.array(self.all_gather_objects([float(v) for v in values], step), dtype=np.float64)

    def barrier(self, step):
        self.world.barrier.wait()


class ThreadWorld:
    def __init__(self, size: int) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=30)  # a hang fails the test
        self.slots: list = [None] * size


def on_every_rank(size: int, body) -> list:
    """Run ``body(comm)`` on ``size`` thread-ranks; each rank's return value or exception, by rank."""
    world, outcomes = ThreadWorld(size), [None] * size

    def rank_main(rank):
        try:
            outcomes[rank] = body(ThreadComm(world, rank))
        except Exception as err:  # the outcome under test
            outcomes[rank] = err

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads), "a rank hung"
    return outcomes


def test_options_that_differ_are_the_same_error_on_every_rank_naming_option_and_values():
    def body(comm):
        options = Options(reduce=("max", "min")[comm.rank], n_repeat=5, split=("add_block", True)[comm.rank]).agreed()
        Agreement(comm, "step").consensus([], None, options, [])

    outcomes = on_every_rank(2, body)
    assert all(isinstance(o, disttune.TuningError) for o in outcomes), outcomes
    assert len({str(o) for o in outcomes}) == 1, "ranks raised different messages"
    message = str(outcomes[0])
    assert "reduce: rank 0: 'max', rank 1: 'min'" in message
    assert "split: rank 0: 'add_block', rank 1: True" in message
    assert "n_repeat" not in message, "only the options that differ are named"


def test_the_function_tuner_agrees_its_options_and_its_winner():
    table = {0: [3.0, 1.0, 2.0], 1: [1.0, 3.0, 2.0]}  # alone each rank would pick another config; max picks 2

    def tune(comm, n_repeat):
        timer = TableTimer(lambda info: table[comm.rank][info.config_index])
        pick = disttune.autotune([{"variant": v} for v in range(3)], key_fn=lambda: 0, n_warmup=0,
                                 n_repeat=n_repeat, timer=timer, group=comm, store=False)(lambda *, variant: variant)
        return pick()

    assert on_every_rank(2, lambda comm: tune(comm, 2)) == [2, 2]
    outcomes = on_every_rank(2, lambda comm: tune(comm, 1 + comm.rank))
    assert all(isinstance(o, disttune.TuningError) for o in outcomes), outcomes
    assert "n_repeat: rank 0: 1, rank 1: 2" in str(outcomes[0]) and str(outcomes[0]) == str(outcomes[1])


def test_an_error_before_tuning_on_one_rank_is_the_same_error_on_all():
    def body(comm):
        error = (ValueError("bad input"), "ValueError: bad input") if comm.rank == 1 else None
        Agreement(comm, "step").consensus([], error, {}, [])

    outcomes = on_every_rank(2, body)
    assert [type(o) for o in outcomes] == [disttune.TuningError] * 2 and str(outcomes[0]) == str(outcomes[1])
    assert str(outcomes[0]) == "disttune: step: tuning could not start on rank(s) 1:\n  rank 1: ValueError: bad input"
    assert isinstance(outcomes[1].__cause__, ValueError), "the failing rank chains its own exception"


def test_the_function_tuners_errors_name_the_cause_first_in_the_one_wording():
    """Rank 1's function raises in a tuning run, in the final run, or its key_fn raises: every rank raises the same
    TuningError, headed by where it failed, then rank 1's own exception (as the contextual tuner words them)."""

    def tune(comm, fail_at: int, where: str = "call"):
        calls = {"n": 0}

        def fn(*, variant):
            calls["n"] += 1
            if comm.rank == 1 and where == "call" and calls["n"] == fail_at:
                raise ValueError("user bug")
            return variant

        def key_fn():
            if comm.rank == 1 and where == "key_fn":
                raise KeyError("no key")
            return 0

        pick = disttune.autotune([{"variant": v} for v in range(3)], key_fn=key_fn, n_warmup=0, n_repeat=1,
                                 timer=TableTimer(lambda info: 1.0), group=comm, store=False)(fn)
        return pick()

    name = "test_the_function_tuners_errors_name_the_cause_first_in_the_one_wording.<locals>.tune.<locals>.fn"

    for fail_at, where, heading, cause in (
            (2, "call", "tuning run 2/3 failed", "ValueError: user bug"),
            (4, "call", "the final run (with the winners) failed", "ValueError: user bug"),
            (0, "key_fn", "tuning could not start", "KeyError: 'no key' (in key_fn)")):
        outcomes = on_every_rank(2, lambda comm: tune(comm, fail_at, where))
        expected = f"disttune: {name}: {heading} on rank(s) 1:\n  rank 1: {cause}"
        assert [type(o) for o in outcomes] == [disttune.TuningError] * 2, outcomes
        assert [str(o) for o in outcomes] == [expected] * 2
        assert isinstance(outcomes[1].__cause__, (ValueError, KeyError)), "the failing rank chains its own exception"


def _site(n_configs: int, split: bool = False):
    from disttune.sites import Site, SiteId

    site = Site(SiteId("k", (n_configs,), 0), None, [f"config {c}" for c in range(n_configs)])
    site.share = (0, 2) if split else None
    return site


def test_the_timing_vector_combines_every_ranks_times_once():
    from disttune.agreement import TimingVector, agree

    rng = np.random.default_rng(0)
    sites = [_site(3), _site(2, split=True)]
    for world, rows in ((4, True), (4096, False)):  # 4096^2 x 6 x 8 bytes: more than every rank should receive
        matrix = rng.uniform(1, 2, size=(world, 6))
        matrix[:, 0] = 0.0
        matrix[1, 2] = np.inf  # config 1 of the first site failed on rank 1
        matrix[np.arange(world), 4 + (np.arange(world) % 2)] = np.nan  # the split site: each rank timed one config
        vector = TimingVector(sites, (), "max", world)
        assert vector.rows == rows
        first, second = vector.split(vector.combine(matrix), matrix[3, 1:], 3)
        np.testing.assert_array_equal(first.agreed, agree(matrix[:, 1:4], "max"))
        np.testing.assert_array_equal(second.agreed, agree(matrix[:, 4:6], "max", split=True))
        assert first.agreed[1] == np.inf
        np.testing.assert_array_equal(first.own, matrix[3, 1:4])  # this rank's own times, always
        np.testing.assert_array_equal(first.per_rank()[3], matrix[3, 1:4])
        # the spread over the ranks, always: min, median, max and the slowest rank (a failure is the slowest)
        times = matrix[:, 1:4]
        np.testing.assert_array_equal(first.spread[:3, [0, 2]], [times[:, [0, 2]].min(axis=0),
                                                                 np.median(times[:, [0, 2]], axis=0),
                                                                 times[:, [0, 2]].max(axis=0)])
        np.testing.assert_array_equal(first.spread[3], [times[:, 0].argmax(), 1, times[:, 2].argmax()])
        assert first.spread[2, 1] == np.inf
        split_times = matrix[:, 4:6]  # only the ranks that timed a split config count
        np.testing.assert_array_equal(second.spread[2], np.nanmax(split_times, axis=0))
        np.testing.assert_array_equal(second.spread[3], np.nanargmax(split_times, axis=0))
        if rows:
            np.testing.assert_array_equal(np.hstack([first.rows, second.rows]), matrix[:, 1:])
        else:  # the others' rows are not sent: this rank holds its own, and no [world, configs] matrix
            assert first.rows is None and second.rows is None
            assert np.isnan(np.delete(first.per_rank(), 3, axis=0)).all()
