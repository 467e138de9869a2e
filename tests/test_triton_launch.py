"""Triton's own semantics, kept by the tuner: pruning, ``reset_to_zero``/``restore_value``, hooks and
the conflicting meta-parameter error.

Kernels run under TRITON_INTERPRET=1 on the CPU (see conftest.py); fake timers from
``tiny_kernels.TableTimer`` make the expected winners computable.
"""

from __future__ import annotations

import pytest
import torch
import triton

import disttune
from tiny_kernels import DEV, accumulate, grid, increment, launch_add, make_kernel, TableTimer, tuner


def test_early_config_prune_and_perf_model_top_k(tmp_path):
    pruned = make_kernel(blocks=(16, 32, 64, 128), prune_configs_by={
        "early_config_prune": lambda configs, nargs, **kw: [c for c in configs if c.kwargs["BLOCK"] != 64]})
    modelled = make_kernel(blocks=(16, 32, 64, 128), prune_configs_by={
        "perf_model": lambda **kw: -kw["BLOCK"], "top_k": 2})
    timer = TableTimer(lambda i: 1.0)

    @tuner(tmp_path, timer=timer)
    def step(x):
        y, z = torch.empty_like(x), torch.empty_like(x)
        launch_add(pruned, x, y)
        launch_add(modelled, x, z)
        return y

    step(torch.randn(64, device=DEV))
    tried = {}
    for info in timer.seen:
        tried.setdefault(info.occurrence, set()).add(info.config.kwargs["BLOCK"])
    assert tried == {0: {16, 32, 128}, 1: {128, 64}}


def test_reset_to_zero_and_restore_value_keep_their_meaning(tmp_path):
    acc = make_kernel(accumulate, reset_to_zero=["out_ptr"])
    inc = make_kernel(increment, restore_value=["x_ptr"])
    x = torch.randn(64, device=DEV)
    out = torch.zeros(64, device=DEV)
    counter = torch.arange(64, dtype=torch.float32, device=DEV)
    original = counter.clone()

    @tuner(tmp_path, timer=TableTimer(lambda i: 1.0))
    def step():
        acc[grid(64)](x, out, 64)
        inc[grid(64)](counter, 64)

    step()
    # tuning launches were reset/restored, the final run applied each kernel exactly once
    assert torch.allclose(out, x)
    assert torch.equal(counter, original + 1)


def test_user_hooks_and_config_pre_hook_run_on_each_tuning_launch(tmp_path):
    calls = {"pre": 0, "post": 0, "config": 0}
    configs = [triton.Config({"BLOCK": 16}, pre_hook=lambda nargs: calls.__setitem__("config", calls["config"] + 1)),
               triton.Config({"BLOCK": 32})]
    from tiny_kernels import add_block

    kernel = triton.autotune(configs, key=["n"],
                             pre_hook=lambda kwargs, reset_only=False: calls.__setitem__("pre", calls["pre"] + 1),
                             post_hook=lambda kwargs, exception: calls.__setitem__("post", calls["post"] + 1))(add_block)

    @tuner(tmp_path, timer=TableTimer(lambda i: float(i.config_index)))
    def step(x):
        y = torch.empty_like(x)
        launch_add(kernel, x, y)
        return y

    step(torch.randn(64, device=DEV))
    tuning_launches = 1 + 2 * (1 + 2)  # discovery + configs x (warm-up + repeat)
    assert calls["post"] == tuning_launches
    assert calls["pre"] == tuning_launches + 1  # + Triton's reset_only call before the real launch
    # config 0's hook: discovery + its 3 tuning launches + the final launch (config 0 wins)
    assert calls["config"] == 1 + 3 + 1


def test_meta_parameter_given_by_caller_and_config_is_tritons_conflict_error(tmp_path):
    kernel = make_kernel()

    @tuner(tmp_path, timer=TableTimer(lambda i: 1.0))
    def step(x):
        y = torch.empty_like(x)
        kernel[(4,)](x, y, x.numel(), BLOCK=16)
        return y

    with pytest.raises(disttune.TuningError, match="Conflicting meta-parameters: BLOCK") as info:
        step(torch.randn(64, device=DEV))
    assert isinstance(info.value.__cause__, ValueError)
