"""``disttune.cached_launch.launch``: the cached winner launched without Triton's autotuner dispatch, and
Triton's own path wherever that could differ."""

from __future__ import annotations

import torch
import triton
from triton.runtime.autotuner import Autotuner

import disttune
from disttune import cached_launch
from tiny_kernels import DEV, add_block, grid, host_bench, make_kernel, preferring


def launch(kernel, x, y):
    cached_launch.launch(kernel, grid(x.numel()), (x, y, x.numel()), {})


def test_a_cached_winner_launches_without_autotuner_run(monkeypatch):
    kernel = make_kernel(do_bench=host_bench)
    x = torch.randn(64, device=DEV)
    y = torch.empty_like(x)
    launch(kernel, x, y)  # a new key: Triton tunes it (the first config wins under host_bench's ties)
    (winner,) = kernel.cache.values()
    assert torch.equal(y, x + winner.kwargs["BLOCK"])
    kernel.cache[next(iter(kernel.cache))] = kernel.configs[2]  # another winner: the launch must follow the cache
    calls = []
    monkeypatch.setattr(Autotuner, "run", lambda *a, **k: calls.append(1))
    y.zero_()
    launch(kernel, x, y)
    assert calls == [] and torch.equal(y, x + kernel.configs[2].kwargs["BLOCK"])


def test_a_new_key_or_a_winner_with_a_pre_hook_goes_through_triton():
    hooked = []
    kernel = make_kernel(do_bench=host_bench, pre_hooks={0: lambda nargs: hooked.append(nargs["n"])})
    x, x2 = torch.randn(64, device=DEV), torch.randn(32, device=DEV)
    y, y2 = torch.empty_like(x), torch.empty_like(x2)
    launch(kernel, x, y)
    launch(kernel, x2, y2)
    assert len(kernel.cache) == 2, "each new key was tuned by Triton"
    hooked.clear()
    launch(kernel, x, y)
    assert hooked == [64], "the winner's pre_hook ran, as Triton runs it"


def test_a_single_config_kernel_and_a_plain_jit_function_launch_as_given():
    x = torch.randn(64, device=DEV)
    y = torch.empty_like(x)
    single = triton.autotune([triton.Config({"BLOCK": 32}, num_warps=1)], key=["n"])(add_block)
    launch(single, x, y)
    assert torch.equal(y, x + 32)
    cached_launch.launch(add_block, grid(64), (x, y, 64), {"BLOCK": 16})
    assert torch.equal(y, x + 16)


def test_inside_a_tuner_the_launches_still_reach_it(tmp_path):
    kernel = make_kernel()

    @disttune.contextual_autotune(timer=preferring(1), n_warmup=1, n_repeat=1, verbose=False, store=False,
                                  log_dir=tmp_path)
    def step(x):
        y = torch.empty_like(x)
        launch(kernel, x, y)
        return y

    x = torch.randn(64, device=DEV)
    y = step(x)
    (result,) = step.report.results
    assert result.winner == 1 and torch.equal(y, x + 32), "the tuner saw every launch and chose config 1"
    kernel.cache.clear()  # the fast path launches from its plan, not from the kernel's cache
    assert torch.equal(step(x), x + 32)


def test_the_key_reader_is_generated_once_per_kernel(monkeypatch):
    from disttune.fast_path import FastKernel

    made = []
    real = FastKernel._specialize

    def counting(self, args, kwargs):
        made.append(1)
        return real(self, args, kwargs)

    monkeypatch.setattr(FastKernel, "_specialize", counting)
    kernel = make_kernel(do_bench=host_bench)
    x = torch.randn(64, device=DEV)
    y = torch.empty_like(x)
    for _ in range(4):
        launch(kernel, x, y)
    assert made == [1]
