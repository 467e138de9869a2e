"""The scoped hook on ``Autotuner.run``: it intercepts only inside the wrapped call, on its own thread,
and leaves Triton's own ``run`` in place everywhere else.

Kernels run under TRITON_INTERPRET=1 on the CPU (see conftest.py); fake timers from
``tiny_kernels.TableTimer`` make the expected winners computable.
"""

from __future__ import annotations

import functools
import threading

import pytest
import torch
import triton
from triton.runtime.autotuner import Autotuner
from triton.runtime.jit import KernelInterface

import disttune
from disttune import intercept
from tiny_kernels import DEV, STOCK_RUN, block_configs, assert_no_scope_left, counting_step, grid, host_bench, key_of, launch_add, make_kernel, TableTimer, tuner


def test_hook_intercepts_only_inside_the_function_and_leaves_at_the_first_launch_outside(tmp_path):
    kernel = make_kernel()
    seen = []

    @tuner(tmp_path, timer=TableTimer(lambda i: 1.0))
    def step(x):
        seen.append(intercept.hook_installed())
        y = torch.empty_like(x)
        launch_add(kernel, x, y)
        return y

    assert_no_scope_left()  # (an earlier test's wrapped calls may have left the hook installed)
    x = torch.randn(64, device=DEV)
    step(x)
    assert seen and all(seen)
    step(x)  # the fast path
    assert seen[-1] and intercept.hook_installed(), "a tuned function called in a loop installs the hook once"
    outside = make_kernel(do_bench=host_bench)
    y = torch.empty_like(x)
    launch_add(outside, x, y)  # outside every scope: stock Triton tunes it, and the hook goes
    assert outside.cache, "the launch outside the scope was not Triton's own"
    assert torch.equal(y, x + 16) and Autotuner.run is STOCK_RUN


def test_hook_is_installed_again_where_other_code_put_tritons_run_back(tmp_path):
    x = torch.randn(64, device=DEV)
    first, _ = counting_step(tmp_path, make_kernel(), timer=TableTimer(lambda i: 1.0), store=False)
    first(x)
    assert intercept.hook_installed()
    Autotuner.run = STOCK_RUN  # another tool restores what it saved before disttune's hook went in
    try:
        second, runs = counting_step(tmp_path, make_kernel(), timer=TableTimer(lambda i: 3.0 - i.config_index),
                                     store=False)
        y = second(x)
        assert second.tuned and len(second.report.results) == 1, "the tuning call intercepted nothing"
        assert runs["n"] > 2 and torch.equal(y, x + 64)  # tuned in place: BLOCK 64 is the fastest
    finally:
        assert_no_scope_left()


def test_a_wrapper_around_the_hook_is_kept_and_still_reaches_it(tmp_path):
    """A profiler that wraps ``Autotuner.run`` (with functools.wraps) between tuned calls keeps its
    patch: the first launch outside leaves it in place, and tuned calls are still intercepted through it."""
    kernel = make_kernel()
    step, _ = counting_step(tmp_path, kernel, timer=TableTimer(lambda i: 1.0))
    x = torch.randn(64, device=DEV)
    step(x)
    assert intercept.hook_installed()
    seen = []
    inner = Autotuner.run

    @functools.wraps(inner)
    def profiler(self, *args, **kwargs):
        seen.append(self)
        return inner(self, *args, **kwargs)

    Autotuner.run = profiler
    try:
        outside = make_kernel(do_bench=host_bench)
        y = torch.empty_like(x)
        launch_add(outside, x, y)
        assert Autotuner.run is profiler, "the profiler's patch was overwritten"
        assert outside.cache and torch.equal(y, x + 16)  # stock Triton ran it, through the wrapper
        y = step(x)
        assert step.tuned and torch.equal(y, x + 16) and seen == [outside, kernel]
    finally:
        Autotuner.run = STOCK_RUN
        assert_no_scope_left()


def test_hook_restored_after_exception_and_keyboard_interrupt(tmp_path):
    kernel = make_kernel()
    runs = {"n": 0, "interrupt_at": 4}
    x = torch.randn(64, device=DEV)

    @tuner(tmp_path, timer=TableTimer(lambda i: float(i.config_index)))
    def step():
        runs["n"] += 1
        y = torch.full_like(x, float("nan"))
        launch_add(kernel, x, y)
        if runs["n"] == runs["interrupt_at"]:
            raise KeyboardInterrupt
        return y

    with pytest.raises(KeyboardInterrupt):
        step()
    assert_no_scope_left()
    assert kernel.cache == {} and not step.tuned, "an interrupted tuning must leave no winner behind"
    runs["interrupt_at"] = -1
    y = step()  # tunes again from scratch, correctly
    assert step.tuned and torch.equal(y, x + 16)
    assert_no_scope_left()

    @tuner(tmp_path, timer=TableTimer(lambda i: 1.0))
    def broken():
        launch_add(kernel, x, torch.empty_like(x))
        raise ValueError("user bug")

    with pytest.raises(disttune.TuningError, match="ValueError: user bug") as info:
        broken()
    assert isinstance(info.value.__cause__, ValueError)
    assert_no_scope_left()


def test_launches_on_other_threads_are_not_intercepted(tmp_path):
    ours = make_kernel()
    theirs = make_kernel(blocks=(16, 32), do_bench=host_bench)  # stock Triton tuning with a host benchmarker
    inside, done, outcome = threading.Event(), threading.Event(), {}

    def other_thread():
        inside.wait(30)
        z = torch.randn(48, device=DEV)
        out = torch.empty_like(z)
        theirs[grid(48)](z, out, 48)
        outcome["stock_tuned"] = key_of(z) in theirs.cache
        outcome["handler"] = intercept.active_handler()
        done.set()

    worker = threading.Thread(target=other_thread)
    worker.start()
    timer = TableTimer(lambda i: 1.0)

    @tuner(tmp_path, timer=timer)
    def step(x):
        y = torch.empty_like(x)
        launch_add(ours, x, y)
        inside.set()
        assert done.wait(30)
        return y

    step(torch.randn(64, device=DEV))
    worker.join(30)
    assert outcome == {"stock_tuned": True, "handler": None}
    assert {i.kernel for i in timer.seen} == {"tiny_kernels.add_block"}
    assert len(step.report.results) == 1, "the other thread's launch must not become a site"


def test_nested_wrapped_call_is_tuned_by_the_outer_one(tmp_path):
    kernel = make_kernel()
    timer = TableTimer(lambda i: {0: 3.0, 1: 1.0, 2: 2.0}[i.config_index])

    @tuner(tmp_path, timer=TableTimer(lambda i: 9.0))
    def inner(x):
        y = torch.empty_like(x)
        launch_add(kernel, x, y)
        return y

    @tuner(tmp_path, timer=timer)
    def outer(x):
        return inner(x) * 2

    x = torch.randn(64, device=DEV)
    assert torch.equal(outer(x), (x + 32) * 2)
    assert outer.tuned and not inner.tuned
    assert timer.seen, "the outer tuner timed the inner function's kernel"


def test_kernels_outside_behave_like_stock_triton(tmp_path):
    kernel = make_kernel(do_bench=host_bench)

    @tuner(tmp_path, timer=TableTimer(lambda i: {0: 3.0, 1: 1.0, 2: 2.0}[i.config_index]))
    def step(x):
        y = torch.empty_like(x)
        launch_add(kernel, x, y)
        return y

    x = torch.randn(64, device=DEV)
    step(x)
    y = torch.empty_like(x)
    launch_add(kernel, x, y)  # outside: Triton's own run, hitting the committed winner
    assert torch.equal(y, x + 32)
    z = torch.randn(80, device=DEV)
    out = torch.empty_like(z)
    launch_add(kernel, z, out)  # a new key outside: stock Triton tunes it with its own benchmarker
    assert key_of(z) in kernel.cache and torch.equal(out, z + kernel.cache[key_of(z)].kwargs["BLOCK"])


class RecordingKernel(KernelInterface):
    """A launchable with ``add_block``'s signature that records each launch's BLOCK per thread (Triton's
    interpreter cannot launch from two threads at once)."""

    def __init__(self) -> None:
        self.fn = _recorded_body
        self.arg_names = ["x_ptr", "y_ptr", "n", "BLOCK"]
        self.blocks: dict = {}

    def run(self, *args, grid, warmup, **kwargs):
        self.blocks.setdefault(threading.get_ident(), []).append(kwargs["BLOCK"])


def _recorded_body(x_ptr, y_ptr, n, BLOCK):  # noqa: N803 - the signature RecordingKernel reports
    """What RecordingKernel stands for."""


def test_tuned_calls_keep_their_hook_while_another_thread_launches_outside_every_scope(tmp_path):
    """Launches outside every scope put Triton's run back; a tuned call running meanwhile on another
    thread must still see all its launches. Its second occurrence's winner differs from the first's,
    which is the one in the kernel's cache: a launch that bypassed the hook would show the first's."""
    recording = RecordingKernel()
    kernel = triton.autotune(block_configs((16, 32, 64)), key=["n"])(recording)
    timer = TableTimer(lambda i: 1.0 if i.config_index == (1 if i.occurrence == 0 else 2) else 2.0)
    x = torch.randn(16)

    @tuner(tmp_path, timer=timer, n_warmup=0, n_repeat=1, store=False)
    def step():
        kernel[grid(16)](x, x, 16)
        kernel[grid(16)](x, x, 16)

    step()
    me = threading.get_ident()
    recording.blocks.clear()
    stop = threading.Event()

    def launch_outside():
        while not stop.is_set():
            kernel[grid(16)](x, x, 16)  # Triton's cached winner, outside every scope

    worker = threading.Thread(target=launch_outside)
    worker.start()
    try:
        for _ in range(3000):
            step()
    finally:
        stop.set()
        worker.join(30)
    outside = [blocks for ident, blocks in recording.blocks.items() if ident != me]
    assert outside and set(outside[0]) == {32}, "outside: the cached winner of the key (the first occurrence's)"
    assert recording.blocks[me] == [32, 64] * 3000, "every tuned call launched both of its winners"
    assert_no_scope_left()
