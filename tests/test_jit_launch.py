"""``disttune.jit_launch``: a JIT kernel's cached launch cut to the binder, a lookup and the launcher, and
Triton's own ``JITFunction.run`` wherever the launch could differ.

The cut path runs on GPUs only (under the interpreter a kernel is not a ``JITFunction``); its tests skip
without one and run on a GPU machine with ``bash scripts/gpu_check.sh tests/test_jit_launch.py``.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from triton import knobs
from triton.runtime.jit import JITFunction

from disttune import jit_launch
from tiny_kernels import DEV, add_block

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
OFFSET = tl.constexpr(3)


def fresh_add_block():
    """A JITFunction of its own (nothing launched yet), computing what ``add_block`` computes."""
    @triton.jit
    def add_block_again(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        tl.store(y_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + BLOCK, mask=mask)

    return add_block_again


@triton.jit
def add_offset(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(y_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + OFFSET, mask=mask)


def launch(kernel, x, y, block=32):
    return jit_launch.launch(kernel, (triton.cdiv(x.numel(), block),), x, y, x.numel(), BLOCK=block)


@pytest.fixture
def triton_runs(monkeypatch):
    """The launches that went through ``JITFunction.run`` (Triton's own path), by kernel."""
    seen = []
    original = JITFunction.run

    def counted(self, *args, **kwargs):
        seen.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(JITFunction, "run", counted)
    return seen


def test_a_launch_computes_what_triton_computes():
    x = torch.randn(100, device=DEV)
    y = torch.empty_like(x)
    for _ in range(3):
        y.zero_()
        launch(add_block, x, y)
        assert torch.equal(y, x + 32)


def test_under_the_interpreter_or_for_another_launchable_the_runner_is_the_kernels_own_run():
    if type(add_block) is JITFunction:
        pytest.skip("compiled for a GPU: the cut path applies")
    assert jit_launch.runner(add_block) == add_block.run


@needs_gpu
def test_a_second_launch_skips_jitfunction_run_and_launches_the_same_compiled_kernel(triton_runs):
    kernel = fresh_add_block()
    x, y = torch.randn(100, device="cuda"), torch.empty(100, device="cuda")
    first = launch(kernel, x, y)
    assert triton_runs == [kernel]  # a key not seen yet: Triton finds or compiles the kernel
    y.zero_()
    second = launch(kernel, x, y)
    assert triton_runs == [kernel], "the cached launch went through JITFunction.run"
    assert second is first and torch.equal(y, x + 32)
    triton_runs.clear()
    assert kernel.run(x, y, 100, BLOCK=32, grid=(4,), warmup=False) is first  # Triton's own cache agrees
    jit_launch.enabled = False
    try:
        launch(kernel, x, y)
    finally:
        jit_launch.enabled = True
    assert len(triton_runs) == 2, "with the cut path turned off a launch goes through JITFunction.run"


@needs_gpu
def test_a_launch_that_triton_specializes_differently_gets_its_own_kernel(triton_runs):
    kernel = fresh_add_block()
    base = torch.randn(129, device="cuda")
    x, y = base[:128], torch.empty(128, device="cuda")
    aligned = launch(kernel, x, y)
    misaligned_x = base[1:]  # 4 bytes past a 16-byte boundary: Triton compiles another kernel
    one = torch.randn(1, device="cuda")
    triton_runs.clear()
    y.zero_()
    other = launch(kernel, misaligned_x, y)
    assert triton_runs == [kernel] and other is not aligned
    assert torch.equal(y, misaligned_x + 32)
    y1 = torch.empty(1, device="cuda")
    launch(kernel, one, y1)  # n == 1: specialized as a constant
    assert torch.equal(y1, one + 32) and len(triton_runs) == 2
    launch(kernel, misaligned_x, y)
    launch(kernel, one, y1)
    assert len(triton_runs) == 2, "known specializations should take the cut path"


@needs_gpu
def test_an_installed_launch_hook_sees_every_launch(triton_runs):
    kernel = fresh_add_block()
    x, y = torch.randn(64, device="cuda"), torch.empty(64, device="cuda")
    launch(kernel, x, y)
    seen = []
    hook = lambda metadata: seen.append(metadata.get()["name"])  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        launch(kernel, x, y)
        launch(kernel, x, y)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert seen == ["add_block_again"] * 2 and len(triton_runs) == 3


@needs_gpu
def test_the_debug_knob_reaches_the_compiled_kernel(monkeypatch):
    kernel = fresh_add_block()
    x, y = torch.randn(64, device="cuda"), torch.empty(64, device="cuda")
    plain = launch(kernel, x, y)
    assert launch(kernel, x, y) is plain
    monkeypatch.setattr(knobs.runtime, "debug", True)
    debug = launch(kernel, x, y)
    assert debug is not plain and debug.metadata.debug and not plain.metadata.debug
    assert launch(kernel, x, y) is debug
    monkeypatch.setattr(knobs.runtime, "debug", False)
    assert launch(kernel, x, y) is plain


@needs_gpu
def test_a_changed_global_raises_as_triton_does(monkeypatch):
    x, y = torch.randn(64, device="cuda"), torch.empty(64, device="cuda")
    launch(add_offset, x, y)
    assert torch.equal(y, x + 3)
    monkeypatch.setitem(globals(), "OFFSET", tl.constexpr(4))
    with pytest.raises(RuntimeError, match="OFFSET"):
        launch(add_offset, x, y)

