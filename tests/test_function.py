"""disttune.autotune in one process: the winner, the store, the call flags, bad spaces, choosing ranks.

Fake timers from ``tiny_kernels.TableTimer`` make the expected winners computable; the multi-rank
cases (gloo, MPI, subgroups, split) run in test_store.py through ``dist_cases.py``.
"""

from __future__ import annotations

import pytest
import torch

import disttune
from disttune.comm import LocalComm
from tiny_kernels import DEV, TableTimer


def test_function_autotune_picks_stores_and_obeys_call_flags(tmp_path, capsys):
    space = [{"chunks": c, "mode": m} for c in (1, 2, 4) for m in ("a", "b")]
    times = {(1, "a"): 5.0, (1, "b"): 4.0, (2, "a"): 1.5, (2, "b"): 3.0, (4, "a"): 9.0, (4, "b"): 2.0}
    calls = []

    def build():
        timer = TableTimer(lambda info: times[(info.config["chunks"], info.config["mode"])])

        @disttune.autotune(space, key_fn=lambda x, **kw: (x.shape, x.dtype),
                           prune_fn=lambda cfg, x, **kw: cfg["chunks"] <= x.shape[0], n_warmup=1, n_repeat=2,
                           timer=timer)
        def work(x, *, scale=1.0, chunks, mode):
            calls.append((chunks, mode))
            return x * chunks * scale

        return work, timer

    work, timer = build()
    x = torch.ones(2, device=DEV)
    assert torch.equal(work(x, scale=2.0, autotune_verbose=True), x * 4.0)  # winner chunks=2 (4 pruned: 4 > 2)
    assert {(i.config["chunks"]) for i in timer.seen} == {1, 2}
    assert len(calls) == 4 * (1 + 2) + 1
    assert "<- winner" in capsys.readouterr().out
    assert torch.equal(work(x, autotune=False), x * 1.0)  # first config of the pruned space
    with pytest.raises(TypeError, match=r"got \['chunks'\] as keyword"):
        work(x, chunks=2)
    again, timer2 = build()  # a new process would do the same: the store answers
    assert torch.equal(again(x), x * 2.0) and timer2.seen == []


def test_function_autotune_bad_space():
    with pytest.raises(ValueError, match="non-empty list of dicts"):
        disttune.autotune([], key_fn=lambda: 0)(lambda: 0)
    with pytest.raises(ValueError, match="reserved names"):
        disttune.autotune([{"autotune": 1}], key_fn=lambda: 0)(lambda: 0)
    tuner = disttune.autotune([{"a": 1}], key_fn=lambda: 0, prune_fn=lambda c: False)(lambda *, a: a)
    with pytest.raises(ValueError, match="rejected every config"):
        tuner()


def test_group_accepts_a_communicator_and_autotune_pg_stays_as_the_call_time_name():
    seen = []
    timer = TableTimer(lambda info: [2.0, 1.0][info.config_index])
    pick = disttune.autotune([{"v": 0}, {"v": 1}], key_fn=lambda: 0, n_warmup=0, n_repeat=1, timer=timer,
                             group=LocalComm(), store=False)(lambda *, v: seen.append(v) or v)
    assert pick() == 1 and seen == [0, 1, 1]
    fresh = disttune.autotune([{"v": 0}, {"v": 1}], key_fn=lambda: 1, store=False)(lambda *, v: v)
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        fresh(autotune_pg=object())  # a torch group without torch.distributed


def test_an_exception_of_the_function_ends_tuning_naming_it():
    """A config whose call raises is not scored inf (with the function's own collectives inside, its peers would
    wait in them): tuning ends with the exception, first in the error; prune_fn leaves such a config out."""
    def pick(*, v):
        if v == 1:
            raise ValueError("v=1 cannot run here")
        return v

    tuner = disttune.autotune([{"v": 0}, {"v": 1}], key_fn=lambda: 0, n_warmup=0, n_repeat=1, store=False,
                              timer=TableTimer(lambda info: 1.0))(pick)
    with pytest.raises(disttune.TuningError) as raised:
        tuner()
    assert str(raised.value) == (f"disttune: {tuner.__qualname__}: tuning run 2/2 failed on rank(s) 0:\n"
                                 "  rank 0: ValueError: v=1 cannot run here")
    pruned = disttune.autotune([{"v": 0}, {"v": 1}], key_fn=lambda: 0, n_warmup=0, n_repeat=1, store=False,
                               timer=TableTimer(lambda info: 1.0), prune_fn=lambda config: config["v"] != 1)(pick)
    assert pruned() == 0
