"""Sites and the rank-independent schedule: split shares, split agreement, the split= spec.

Kernels run under TRITON_INTERPRET=1 on the CPU (see conftest.py); fake timers from
``tiny_kernels.TableTimer`` make the expected winners computable.
"""

from __future__ import annotations

import pytest

from tiny_kernels import accumulate, make_kernel


def test_split_schedule_gives_each_rank_a_disjoint_share():
    from disttune.sites import Schedule

    world, n = 3, 7
    schedule = Schedule(longest=-(-n // world), n_warmup=1, n_repeat=2)
    assert schedule.runs == 3 * 3
    seen = {}
    for rank in range(world):
        for run in range(schedule.runs):
            index, timed = schedule.slot(run, n, (rank, world))
            if timed:
                seen.setdefault(index, []).append(rank)
    assert seen == {c: [c % world] * 2 for c in range(n)}, "each config timed twice, by one rank only"
    # slot 2 is warmed up in run 2 and timed in runs 5 and 8; rank 2's position there, 8, is past the list
    assert [schedule.slot(run, n, (2, world)) for run in (2, 5, 8)] == [(None, False)] * 3, "a stand-in"


def test_timed_runs_interleave_the_configs_after_every_warm_up():
    from disttune.sites import Schedule

    schedule = Schedule(longest=3, n_warmup=2, n_repeat=3)
    slots = [schedule.slot(run, 3) for run in range(schedule.runs)]
    assert slots == [(0, False), (0, False), (1, False), (1, False), (2, False), (2, False)] + [
        (c, True) for _ in range(3) for c in range(3)], "warm-ups config by config, then rounds of every config"
    assert [schedule.slot(run, 2) for run in (4, 5, 8)] == [(None, False)] * 3, "a shorter list: its stand-in"
    assert [Schedule(2, 0, 2).slot(run, 2) for run in range(4)] == [(0, True), (1, True), (0, True), (1, True)]


def test_split_agreement_takes_the_owner_time_and_keeps_failures():
    from disttune.agreement import agree

    nan, inf = float("nan"), float("inf")
    per_rank = [[1.0, nan, 3.0, nan], [nan, 2.0, inf, nan]]
    assert list(agree(per_rank, "max", split=True)) == [1.0, 2.0, inf, inf]  # 2: failed on rank 1; 3: nobody timed it
    assert list(agree(per_rank, "min", split=True)) == [1.0, 2.0, inf, inf]


def test_split_accepts_names_kernels_and_predicates():
    from disttune.sites import split_predicate as _split_predicate
    from disttune.sites import Site, SiteId

    kernel, other = make_kernel(), make_kernel(accumulate)
    site = Site(SiteId("tiny_kernels.add_block", (64,), 0), kernel, [])
    elsewhere = Site(SiteId("tiny_kernels.accumulate", (64,), 0), other, [])
    for spec in (True, "add_block", "tiny_kernels.add_block", ["add_block"], {kernel}, (kernel,),
                 lambda ident: ident.kernel.endswith("add_block")):
        chosen = _split_predicate(spec)
        assert chosen(site) and (spec is True or not chosen(elsewhere)), spec
    assert not _split_predicate(False)(site)
    with pytest.raises(TypeError, match="split= entries must be kernel names"):
        _split_predicate([3])
    with pytest.raises(TypeError, match="split must be a bool"):
        _split_predicate(3.5)
