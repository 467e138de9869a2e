"""Where a tuning call's time goes (``TuningReport.phases``), and tuning runs that start while compiles finish.

Under the interpreter nothing compiles, so a stand-in that sleeps takes ``precompile``'s place where a
compile pool is needed.
"""

from __future__ import annotations

import time

import pytest
import torch

from disttune import compile as compiling
from disttune.phases import OTHER, SPANS, Phases
from tiny_kernels import DEV, make_kernel, preferring, tuned_step


def test_nested_spans_count_each_second_once_and_the_breakdown_sums_to_the_wall_time():
    phases = Phases()
    started = time.perf_counter()
    with phases.span("tuning runs"):
        time.sleep(0.05)
        with phases.span("collectives"):
            time.sleep(0.1)
        with phases.span("first launches"):
            time.sleep(0.05)
    time.sleep(0.05)
    wall = time.perf_counter() - started
    parts = phases.breakdown(wall)
    assert list(parts) == ["first launches", "tuning runs", "collectives", OTHER], "SPANS order, the rest last"
    # upper bounds 0.1 s above the sleeps: a busy host's late wake-ups fit, a nested span counted twice does not
    assert 0.1 <= parts["collectives"] < 0.2
    assert 0.05 <= parts["tuning runs"] < 0.15, "the nested spans are not counted in the outer one"
    assert 0.05 <= parts[OTHER] < 0.15
    assert sum(parts.values()) == pytest.approx(wall)
    assert phases.first("a") and not phases.first("a") and phases.first("b")


def test_a_tuning_call_reports_its_phases_summing_to_its_wall_time(tmp_path):
    step = tuned_step(make_kernel(), preferring(1), log_dir=tmp_path, store=False, n_warmup=1, n_repeat=2)
    step(torch.randn(64, device=DEV))
    report = step.report
    parts = report.phases
    assert set(parts) <= set(SPANS) | {OTHER}
    assert all(seconds >= 0 for seconds in parts.values())
    assert sum(parts.values()) == pytest.approx(report.wall_s, rel=1e-6, abs=1e-6)
    for name in ("discovery run", "tuning runs", "collectives", "final run", "first launches"):
        assert parts[name] > 0, name
    assert report.background == {}, "no compile pool under the interpreter"


@pytest.fixture
def slow_compiles(monkeypatch):
    """Compiles that take 0.3 s each on the pool (BLOCK 64 fails), and when each ended."""
    ended: dict = {}

    def sleeping_precompile(autotuner, args, kwargs, config, device):
        time.sleep(0.3)
        ended[config.kwargs["BLOCK"]] = time.perf_counter()
        if config.kwargs["BLOCK"] == 64:
            raise RuntimeError("injected compile fault")

    monkeypatch.setattr(compiling, "precompile", sleeping_precompile)
    monkeypatch.setattr(compiling, "can_precompile", lambda autotuner: True)
    return ended


@pytest.mark.parametrize("overlap", ["1", "0"])
def test_tuning_runs_start_during_the_compiles_but_no_sample_is_timed_beside_one(tmp_path, monkeypatch,
                                                                                slow_compiles, overlap):
    monkeypatch.setenv("DISTTUNE_COMPILE_OVERLAP", overlap)
    timer = preferring(2)  # BLOCK 64 would win, but it does not compile
    timed_at: list = []
    launches: list = []
    real_time = timer.time

    def recording_time(launch, info):
        timed_at.append(time.perf_counter())
        return real_time(launch, info)

    timer.time = recording_time
    kernel = make_kernel(blocks=(16, 32, 64, 128))
    step = tuned_step(kernel, timer, log_dir=tmp_path, store=False, compile_threads=1, n_warmup=1, n_repeat=1)
    x = torch.randn(64, device=DEV)

    real_ready = compiling.CompilePool.ready

    def recording_ready(pool, site, index):
        launches.append((index, time.perf_counter()))
        return real_ready(pool, site, index)

    monkeypatch.setattr(compiling.CompilePool, "ready", recording_ready)
    y = step(x)
    (result,) = step.report.results
    assert result.winner != 2 and result.agreed_ms[2] == float("inf"), "the config that did not compile lost"
    assert torch.equal(y, x + result.config.kwargs["BLOCK"])
    last_compile = max(slow_compiles.values())
    assert timed_at and min(timed_at) >= last_compile, "every sample after the last compile"
    config_0 = [t for index, t in launches if index == 0]  # the discovery run, then the first tuning run
    if overlap == "1":
        assert len(config_0) >= 2 and config_0[1] < last_compile, "the tuning runs began before the compiles ended"
    else:
        assert len(config_0) == 1, "without overlap the tuning runs wait for no compile"
    assert step.report.background["compile busy"] >= 4 * 0.3 - 0.05
    assert step.report.phases["compile wait"] > 0.3
