"""The tuned fast path: Triton's key read faster, the learned launch sequence, departures from it,
threads, and launches the plan does not cover.

Kernels run under TRITON_INTERPRET=1 on the CPU (see conftest.py); fake timers from
``tiny_kernels.TableTimer`` make the expected winners computable.
"""

from __future__ import annotations

import sys
import threading

import pytest
import torch
import triton

from disttune import fast_path, triton_launch
from disttune.fast_path import FastKernel
from tiny_kernels import DEV, assert_no_scope_left, grid, launch_add, make_kernel, TableTimer, tuner


def test_fast_key_equals_tritons_key_for_every_way_of_passing_arguments():
    """Each way of passing arguments is read right by a reader generated for it (a fresh FastKernel's first
    launch) and by the readers generated for every other way (whose type guards must send it elsewhere)."""
    kernel = make_kernel()
    x, h = torch.randn(8, device=DEV), torch.randn(8, device=DEV).half()

    class DtypeLike:
        dtype = "custom"

    class OwnDtype(torch.Tensor):
        @property
        def dtype(self):
            return "own"

    cases = [((x, h, 8), {"grid": None, "warmup": False}),  # positional (the fast case)
             ((x, h), {"n": 8, "grid": None}),               # the key argument by keyword
             ((x,), {"y_ptr": h, "n": 8}),                    # more by keyword
             ((DtypeLike(), x, 8), {}),                       # a non-tensor with a dtype
             ((x, None, 8.0), {}),                            # same count, other types: a guard must fail
             ((h, x, 9), {}),                                 # same types, other dtypes and key
             ((torch.nn.Parameter(x), h, 8), {}),             # a tensor subclass
             ((x, h), {"n": 9, "grid": None}),                # the key's value by keyword changes
             ((x, h), {"grid": None, "n": 8}),                # the same keywords in another order
             ((x, h), {"n": 8.0}),                            # a keyword of another type
             ((), {"x_ptr": x, "y_ptr": h, "n": 8}),          # everything by keyword
             ((), {"y_ptr": h, "x_ptr": x, "n": 8}),          # ... tensors in another order: dtype order
             ((x,), {"n": 8, "y_ptr": DtypeLike()}),          # a keyword with a dtype of its own
             ((x,), {"n": 8, "y_ptr": x, "BLOCK": 16}),       # a constexpr by keyword
             ((), {"BLOCK": 16}),                             # an empty key (no key value, no tensor)
             ((8,), {"num_warps": 4}),                        # ... and a keyword that is no kernel argument
             ((x,), {"y_ptr": x.as_subclass(OwnDtype), "n": 8})]  # a tensor subclass with a dtype of its own
    for first_args, first_kwargs in cases:
        fast = FastKernel(kernel)
        assert fast.key(first_args, first_kwargs) == triton_launch.tuning_key(kernel, first_args, first_kwargs)
        for args, kwargs in cases:
            assert fast.key(args, kwargs) == triton_launch.tuning_key(kernel, args, kwargs), (first_args, args, kwargs)


def test_fast_path_runs_the_winners_pre_hook_and_hands_unplanned_launches_to_the_general_path(tmp_path):
    calls = {"hook": 0}
    kernel = make_kernel(pre_hooks={1: lambda nargs: calls.__setitem__("hook", calls["hook"] + 1)})
    other = make_kernel(blocks=(16, 32))
    launches = {"count": 1, "other": False}

    @tuner(tmp_path, timer=TableTimer(lambda i: {0: 2.0, 1: 1.0, 2: 3.0}[i.config_index]))
    def step(x):
        ys = [torch.empty_like(x) for _ in range(launches["count"])]
        for y in ys:
            launch_add(kernel, x, y)
        if launches["other"]:
            launch_add(other, x, torch.empty_like(x))
        return ys

    x = torch.randn(64, device=DEV)
    step(x)
    calls["hook"] = 0
    (y,) = step(x)
    assert calls["hook"] == 1 and torch.equal(y, x + 32)
    launches["other"] = True  # an autotuner the plan does not know: a warning, and the next call tunes it
    with pytest.warns(RuntimeWarning, match="not tuned for"):
        step(x)
    assert not step.tuned
    step(x)
    launches["count"] = 2  # a second occurrence of the same key: the kernel's own cache answers, as before
    first, second = step(x)
    assert step.tuned and torch.equal(first, x + 32) and torch.equal(second, x + 32)


def _recorded_body(x_ptr, n, BLOCK):  # noqa: N803 - the signature the recording kernel reports
    """What RecordingKernel stands for: its source names the kernel; it never runs."""


def _other_recorded_body(x_ptr, n, BLOCK):  # noqa: N803 - a second kernel name for RecordingKernel
    """A second recording kernel's stand-in source."""


class RecordingKernel(triton.runtime.KernelInterface):
    """A launchable that records the BLOCK of every launch instead of running (Triton's interpreter
    is not thread-safe, so concurrent calls are checked on the launch path, not on kernel output)."""

    def __init__(self, body=_recorded_body) -> None:
        self.fn = body
        self.arg_names = ["x_ptr", "n", "BLOCK"]
        self.blocks: list = []
        self._lock = threading.Lock()

    def run(self, *args, grid, warmup, **kwargs):
        with self._lock:
            self.blocks.append(kwargs["BLOCK"])


def test_tuned_wrapper_called_from_several_threads_at_once(tmp_path):
    """After tuning, concurrent calls each get their own handler (or the one spare): every launch
    uses the winner, none is mistaken for a new site, and Triton's ``run`` is back afterwards."""
    recorder = RecordingKernel()
    kernel = triton.autotune([triton.Config({"BLOCK": b}) for b in (16, 32, 64)], key=["n"])(recorder)
    timer = TableTimer(lambda i: {0: 3.0, 1: 1.0, 2: 2.0}[i.config_index])  # BLOCK=32 wins

    @tuner(tmp_path, timer=timer)
    def step(x):
        kernel[grid(x.numel())](x, x.numel())
        kernel[grid(x.numel())](x, x.numel())  # a second occurrence of the same site key in one call
        return x

    x = torch.randn(64, device=DEV)
    step(x)
    recorder.blocks.clear()
    start, errors = threading.Barrier(4), []

    def hammer():
        try:
            start.wait(30)
            for _ in range(200):
                step(x)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    workers = [threading.Thread(target=hammer) for _ in range(4)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, so calls really interleave
    try:
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(60)
    finally:
        sys.setswitchinterval(interval)
    assert not any(worker.is_alive() for worker in workers) and errors == []
    assert recorder.blocks == [32] * (4 * 200 * 2)
    assert step.tuned and len(step.report.results) == 2
    assert_no_scope_left()


@pytest.mark.parametrize("by_keyword", [False, True], ids=["positional", "keyword"])
def test_fast_path_follows_calls_that_depart_from_the_learned_launch_order(tmp_path, by_keyword):
    """The fast path learns the launch order of the first clean call; later calls in another order, with an
    extra occurrence or with a new key still launch each site's own winner (or retune), as the general way does."""
    recorders = {"first": RecordingKernel(), "second": RecordingKernel(_other_recorded_body)}
    kernels = {name: triton.autotune([triton.Config({"BLOCK": b}) for b in (16, 32, 64)], key=["n"])(recorder)
               for name, recorder in recorders.items()}
    winners = {"first": 1, "second": 2}  # BLOCK=32 and BLOCK=64

    def table(info):
        name = "second" if info.kernel.endswith("_other_recorded_body") else "first"
        return 1.0 if info.config_index == winners[name] else 2.0 + info.config_index

    order = ["first", "second"]

    @tuner(tmp_path, timer=TableTimer(table))
    def step(x, n):
        for name in order:
            if by_keyword:  # no generated key reader: the general one, in the sequence check too
                kernels[name][grid(n)](x, n=n)
            else:
                kernels[name][grid(n)](x, n)

    x = torch.randn(64, device=DEV)
    step(x, 64)
    step(x, 64)
    assert step._plan.sequence is not None and len(step._plan.sequence) == 2

    def launched(n=64):
        for recorder in recorders.values():
            recorder.blocks.clear()
        step(x, n)
        return recorders["first"].blocks, recorders["second"].blocks

    assert launched() == ([32], [64])
    order[:] = ["second", "first"]
    assert launched() == ([32], [64])
    order[:] = ["first", "first", "second"]  # an extra occurrence: the kernel's cache holds the winner
    assert launched() == ([32, 32], [64]) and step.tuned
    order[:] = ["first", "second"]
    assert launched() == ([32], [64])
    with pytest.warns(RuntimeWarning, match="not tuned for"):
        launched(n=32)  # a new key: first config now, retuned on the next call
    assert not step.tuned
    assert_no_scope_left()


def test_single_config_kernels_keep_the_fast_path_on_its_learned_sequence(tmp_path, monkeypatch):
    """A kernel with one config is never a site (nothing to choose): after tuning its launches go to
    Triton's own ``run`` between the planned ones, with no fallback handler and without leaving the
    learned sequence (before, each call built a fallback and cost more than stock Triton)."""
    tuned_recorder, single_recorder = RecordingKernel(), RecordingKernel(_other_recorded_body)
    tuned = triton.autotune([triton.Config({"BLOCK": b}) for b in (16, 32, 64)], key=["n"])(tuned_recorder)
    single = triton.autotune([triton.Config({"BLOCK": 128})], key=["n"])(single_recorder)

    @tuner(tmp_path, timer=TableTimer(lambda i: {0: 3.0, 1: 1.0, 2: 2.0}[i.config_index]))
    def step(x, n):
        tuned[grid(n)](x, n)
        single[grid(n)](x, n)
        tuned[grid(n)](x, n)

    x = torch.randn(64, device=DEV)
    step(x, 64)
    step(x, 64)  # the first clean call: learns the sequence
    plan = step._plan
    assert plan.sequence is not None and len(plan.sequence) == 2
    fallbacks = []
    fast_handler = fast_path.Fast
    monkeypatch.setattr(fast_path, "Fast", lambda *a: fallbacks.append(1) or fast_handler(*a))
    tuned_recorder.blocks.clear()
    single_recorder.blocks.clear()
    for _ in range(3):
        step(x, 64)
    assert tuned_recorder.blocks == [32] * 6 and single_recorder.blocks == [128] * 3
    assert fallbacks == [] and len(plan.spare) == 1 and plan.spare[0].following
    assert step.tuned
    assert_no_scope_left()


def test_fast_path_reads_keys_of_launches_with_keyword_arguments_without_the_general_reader(tmp_path, monkeypatch):
    """Launches passing arguments by keyword (a constexpr such as ``LIMIT=``, the key itself) get a generated
    reader and an in-place key comparison too; Triton's general key function is not called on the fast path
    (before, every keyword launch built the general key: about 10 µs per launch on the H200 host)."""
    from tiny_kernels import add_block_limited

    kernel = make_kernel(add_block_limited)
    order = {"n by keyword": False}

    @tuner(tmp_path, timer=TableTimer(lambda i: {0: 3.0, 1: 1.0, 2: 2.0}[i.config_index]))
    def step(x):
        y = torch.empty_like(x)
        if order["n by keyword"]:
            kernel[grid(x.numel())](x, y, LIMIT=1024, n=x.numel())
        else:
            kernel[grid(x.numel())](x, y, x.numel(), LIMIT=1024)
        return y

    x = torch.randn(64, device=DEV)
    step(x)
    step(x)
    general = []
    real_key = triton_launch.tuning_key
    monkeypatch.setattr(triton_launch, "tuning_key", lambda *a: general.append(1) or real_key(*a))
    for _ in range(3):
        assert torch.equal(step(x), x + 32)  # BLOCK=32 won
    assert general == [] and step.tuned
    order["n by keyword"] = True  # another signature: read by the general reader, same winner
    assert torch.equal(step(x), x + 32) and step.tuned and general
    with pytest.warns(RuntimeWarning, match="not tuned for"):
        step(torch.randn(48, device=DEV))  # another key by keyword: not planned
    assert_no_scope_left()


def test_untuned_key_on_the_fast_path_retunes_next_call(tmp_path):
    kernel = make_kernel()

    @tuner(tmp_path, timer=TableTimer(lambda i: {0: 2.0, 1: 3.0, 2: 1.0}[i.config_index]))
    def step(x):
        y = torch.empty_like(x)
        launch_add(kernel, x, y)
        return y

    step(torch.randn(64, device=DEV))
    with pytest.warns(RuntimeWarning, match="not tuned for"):
        step(torch.randn(80, device=DEV))
    assert not step.tuned
    z = torch.randn(80, device=DEV)
    assert torch.equal(step(z), z + 64) and step.tuned


def test_occurrences_of_one_key_keep_their_own_winners_once_the_sequence_is_learned(tmp_path):
    """Two launches with the same key are two sites with their own winners; the learned launch
    sequence (from the second call on) must launch each one's, not the first's twice."""
    kernel = make_kernel()
    timer = TableTimer(lambda i: 1.0 if i.config_index == (1 if i.occurrence == 0 else 2) else 2.0)

    @tuner(tmp_path, timer=timer, n_warmup=0, n_repeat=1, store=False)
    def step(x):
        first, second = torch.empty_like(x), torch.empty_like(x)
        launch_add(kernel, x, first)
        launch_add(kernel, x, second)
        return first, second

    x = torch.randn(16, device=DEV)
    for _ in range(4):  # tuning, the call that learns the sequence, two calls that follow it
        first, second = step(x)
        assert torch.equal(first, x + 32) and torch.equal(second, x + 64)
