"""objective="step" against "launch", the output check, and the L2 flush, in one process with injected timers."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

import disttune
from disttune.pipeline import STEP
from disttune.search import ModelSearch
from disttune.timing import HostTimer, L2FlushingTimer, flushing
from tiny_kernels import DEV, TableTimer, grid, launch_add, make_kernel, tuner


def _blocks_used(x, *outputs):
    return tuple(int(round(float((y - x)[0]))) for y in outputs)


def test_step_objective_picks_the_config_that_makes_the_step_fastest(tmp_path):
    """Config 0 has the fastest launch but slows what runs beside it: the step is slowest with it."""
    launch_ms = {0: 1.0, 1: 2.0, 2: 3.0}
    step_ms = {16: 5.0, 32: 3.0, 64: 4.0}
    used = {}

    def table(info):
        return step_ms[used["block"]] if info.kernel == STEP else launch_ms[info.config_index]

    winners = {}
    for objective in ("launch", "step"):
        kernel = make_kernel(blocks=(16, 32, 64))
        runs = {"n": 0}

        @tuner(tmp_path, timer=TableTimer(table), objective=objective)
        def step(x):
            runs["n"] += 1
            y = torch.empty_like(x)
            launch_add(kernel, x, y)
            used["block"] = _blocks_used(x, y)[0]
            return y

        x = torch.randn(64, device=DEV)
        step(x)
        winners[objective] = step.report.results[0].config.kwargs["BLOCK"]
        assert runs["n"] == step.expected_runs(3) == 2 + 3 * (1 + 2)
        assert step.report.results[0].agreed_ms == ((1.0, 2.0, 3.0) if objective == "launch" else (5.0, 3.0, 4.0))
    assert winners == {"launch": 16, "step": 32}


def test_step_objective_tunes_sites_with_one_config_list_jointly(tmp_path):
    kernel = make_kernel(blocks=(16, 32, 64))
    used, runs = {}, {"n": 0}
    step_ms = {16: 3.0, 32: 2.0, 64: 1.0}

    @tuner(tmp_path, timer=TableTimer(lambda info: step_ms[used["blocks"][0]] if info.kernel == STEP else 1.0),
           objective="step")
    def step(x, z):
        runs["n"] += 1
        y, w = torch.empty_like(x), torch.empty_like(z)
        launch_add(kernel, x, y)
        launch_add(kernel, z, w)  # another key: a second site with the same configs
        used["blocks"] = _blocks_used(x, y) + _blocks_used(z, w)
        assert used["blocks"][0] == used["blocks"][1]  # run r tries config c at both sites
        return y, w

    step(torch.randn(64, device=DEV), torch.randn(32, device=DEV))
    assert runs["n"] == 2 + 3 * 3
    assert [r.config.kwargs["BLOCK"] for r in step.report.results] == [64, 64]


def test_step_objective_tunes_sites_with_different_config_lists_one_at_a_time(tmp_path):
    first, second = make_kernel(blocks=(16, 32, 64)), make_kernel(blocks=(16, 32))
    used, runs, seen = {}, {"n": 0}, []

    def step_ms(info):
        if info.kernel != STEP:
            return {0: 1.0, 1: 5.0, 2: 5.0}[info.config_index]  # per launch, the first config looks best
        a, b = used["blocks"]
        seen.append((a, b))
        return abs(a - 32) + (1.0 if b == 16 else 0.5)

    @tuner(tmp_path, timer=TableTimer(step_ms), objective="step")
    def step(x):
        runs["n"] += 1
        y, w = torch.empty_like(x), torch.empty_like(x)
        launch_add(first, x, y)
        launch_add(second, x, w)
        used["blocks"] = _blocks_used(x, y, w)
        return y, w

    step(torch.randn(64, device=DEV))
    assert runs["n"] == 2 + (3 + 2) * 3
    # the first site tried with the second on its first config, then the second beside the first's winner
    assert sorted(set(seen)) == [(16, 16), (32, 16), (32, 32), (64, 16)]
    assert [r.config.kwargs["BLOCK"] for r in step.report.results] == [32, 32]


@triton.jit
def copy_block(x_ptr, y_ptr, n, BLOCK: tl.constexpr, SKIP_LAST: tl.constexpr):
    """Copies x to y; ``SKIP_LAST`` leaves the last element unwritten, as a kernel that skips a wait would."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    if SKIP_LAST:
        mask = mask & (offsets < n - 1)
    tl.store(y_ptr + offsets, tl.load(x_ptr + offsets, mask=mask), mask=mask)


def _copy_kernel():
    configs = [triton.Config({"BLOCK": 16, "SKIP_LAST": 0}, num_warps=1),
               triton.Config({"BLOCK": 32, "SKIP_LAST": 1}, num_warps=1),  # fastest, and wrong
               triton.Config({"BLOCK": 64, "SKIP_LAST": 0}, num_warps=1)]
    return triton.autotune(configs, key=["n"])(copy_block)


@pytest.mark.parametrize("check", [None, True, lambda reference, output: torch.equal(reference, output)])
def test_check_scores_a_config_with_a_wrong_result_inf(tmp_path, check):
    kernel = _copy_kernel()

    @tuner(tmp_path, timer=TableTimer(lambda info: {0: 3.0, 1: 1.0, 2: 2.0}[info.config_index]), check=check)
    def step(x):
        y = torch.zeros_like(x)
        kernel[grid(x.numel())](x, y, x.numel())
        return y

    x = torch.randn(64, device=DEV) + 10  # the skipped element is far from 0, whatever the draw
    y = step(x)
    (result,) = step.report.results
    if check is None:
        assert result.winner == 1 and not torch.equal(y, x)
        return
    assert result.winner == 2 and torch.equal(y, x) and result.agreed_ms[1] == float("inf")
    log = "\n".join(path.read_text() for path in (tmp_path / "logs").glob("rank-*.log"))
    assert "output differs from the reference config's" in log


def test_function_tuner_check_and_step_objective(tmp_path):
    @disttune.autotune([{"skip": s, "speed": v} for s, v in ((0, 3.0), (1, 1.0), (0, 2.0))], key_fn=lambda x: x.numel(),
                       n_warmup=0, n_repeat=1, timer=TableTimer(lambda info: info.config["speed"]), store=False,
                       check=True, objective="step")
    def copy(x, *, skip, speed):
        y = x.clone()
        if skip:
            y[-1] = 0.0
        return y

    x = torch.randn(8) + 10
    assert torch.equal(copy(x), x) and copy.last_timings["winner"] == 2
    assert copy.last_timings["agreed_ms"][1] == float("inf")
    with pytest.raises(ValueError, match="objective must be one of"):
        disttune.autotune([{"a": 1}], key_fn=lambda: 0, objective="wall")(lambda *, a: a)


@pytest.mark.parametrize("search", ["screen", ModelSearch(initial=2, batch=3, budget=1.0, patience=10)],
                         ids=["screen", "model"])
def test_function_tuner_checks_every_search_stage_against_one_reference(search):
    """Whichever stage or batch a wrong config falls in, it is compared with the first successful call's result
    (a wrong config called first would be the reference itself, as the check documents)."""
    later = 0
    for wrong in range(8):
        calls = []

        @disttune.autotune([{"c": c} for c in range(8)], key_fn=lambda x: x.numel(), n_warmup=0, n_repeat=1,
                           timer=TableTimer(lambda info: 0.5 if info.config["c"] == wrong
                                            else 5.0 - info.config["c"] / 10),
                           store=False, check=True, search=search)
        def scale(x, *, c):
            calls.append(c)
            return x * (2 if c == wrong else 1)

        x = torch.randn(8)
        y = scale(x)
        if calls[0] == wrong:
            continue
        later += 1
        assert torch.equal(y, x), f"config {wrong} (wrong) won; calls {calls}"
        assert scale.last_timings["agreed_ms"][wrong] == float("inf")
    assert later >= 6, "the wrong config should be called after the reference in most cases"


def test_l2_flush_runs_before_each_timing_and_is_off_by_default(tmp_path):
    order = []

    class Recording(HostTimer):
        def time(self, launch, info):
            order.append("time")
            return super().time(launch, info)

    timer = flushing(Recording(), flush=lambda: order.append("flush"))
    assert isinstance(timer, L2FlushingTimer)
    timer.time(lambda: None, None)
    assert order == ["flush", "time"]
    if not torch.cuda.is_available():
        plain = HostTimer()
        assert flushing(plain) is plain  # no GPU: no L2 to flush
    with pytest.raises(ValueError, match="objective"):
        tuner(tmp_path, objective="step", early_stop=True)(lambda: None)
    assert disttune.contextual_autotune()(lambda: None).options.flush_l2 is False
