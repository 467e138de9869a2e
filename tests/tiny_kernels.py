"""Small autotuned kernels, a table-driven Timer and the wrappers the tuner's tests share.

``add_block`` writes ``x + BLOCK``: its output shows which config a launch used.
Factories return a fresh ``Autotuner`` (empty cache) around the shared jitted body,
so every test starts from an untuned kernel.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import triton
import triton.language as tl

from triton.runtime.autotuner import Autotuner

import disttune
from disttune import intercept
from disttune.timing import LaunchInfo

STOCK_RUN = Autotuner.run  # Triton's own, before any test installs the hook


@triton.jit
def add_block(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask)
    tl.store(y_ptr + offsets, x + BLOCK, mask=mask)


@triton.jit
def accumulate(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.atomic_add(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask), mask=mask)


@triton.jit
def increment(x_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + 1, mask=mask)


def block_configs(blocks: Sequence[int], pre_hooks: dict | None = None) -> list[triton.Config]:
    pre_hooks = pre_hooks or {}
    return [triton.Config({"BLOCK": b}, num_warps=1, pre_hook=pre_hooks.get(i)) for i, b in enumerate(blocks)]


def make_kernel(body: Any = add_block, blocks: Sequence[int] = (16, 32, 64), pre_hooks: dict | None = None,
                **autotune_kwargs: Any) -> Any:
    """A fresh autotuned kernel over ``body`` with one config per block size."""
    return triton.autotune(block_configs(blocks, pre_hooks), key=["n"], **autotune_kwargs)(body)


def grid(n: int) -> Callable[[dict], tuple]:
    return lambda meta: (triton.cdiv(n, meta["BLOCK"]),)


def launch_add(kernel: Any, x: torch.Tensor, y: torch.Tensor) -> None:
    kernel[grid(x.numel())](x, y, x.numel())


class TableTimer:
    """A fake Timer: runs the launch for real, reports ``table(info)`` ms and remembers what it saw."""

    def __init__(self, table: Callable[[LaunchInfo], float]) -> None:
        self.table = table
        self.seen: list[LaunchInfo] = []

    def time(self, launch: Callable[[], Any], info: LaunchInfo) -> Callable[[], float]:
        launch()
        self.seen.append(info)
        value = float(self.table(info))
        return lambda: value


class TableProbe:
    """A fake measurement probe: reports ``table(info)`` (``{name: value or None}``) for each timed launch."""

    def __init__(self, table: Callable[[LaunchInfo], dict]) -> None:
        self.table = table
        self.seen: list[LaunchInfo] = []

    def start(self, info: LaunchInfo) -> Any:
        return None

    def stop(self, started: Any, info: LaunchInfo) -> dict:
        self.seen.append(info)
        return dict(self.table(info))


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


@triton.jit
def add_block_limited(x_ptr, y_ptr, n, LIMIT: tl.constexpr, BLOCK: tl.constexpr):
    """``add_block`` that fails to compile (static assertion) when BLOCK >= LIMIT: a real compile fault."""
    tl.static_assert(BLOCK < LIMIT, "BLOCK must be smaller than LIMIT")
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(y_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + BLOCK, mask=mask)


DEV = device()


def tuner(tmp_path, **options):
    options.setdefault("n_warmup", 1)
    options.setdefault("n_repeat", 2)
    options.setdefault("verbose", False)
    return disttune.contextual_autotune(log_dir=tmp_path / "logs", **options)


def host_bench(kernel_call, quantiles):
    kernel_call()
    return [1.0, 1.0, 1.0]


def counting_step(tmp_path, kernel, **options):
    """A wrapped step launching ``add_block`` on its argument, and the counter of its runs."""
    runs = {"n": 0}

    @tuner(tmp_path, **options)
    def step(x):
        runs["n"] += 1
        y = torch.empty_like(x)
        launch_add(kernel, x, y)
        return y

    return step, runs


def key_of(x):
    return (x.numel(), str(x.dtype), str(x.dtype))


def assert_no_scope_left() -> None:
    """Every scope was closed: Triton's ``run`` can come back (the hook leaves lazily, see intercept's doc)."""
    assert intercept.restore_triton_run(), "a scope was left open"
    assert Autotuner.run is STOCK_RUN


def tuned_step(kernel, timer, **options):
    """A one-launch step wrapped in ``contextual_autotune`` (1 warm-up and 1 timed run per config by default)."""
    options.setdefault("n_warmup", 1)
    options.setdefault("n_repeat", 1)

    @disttune.contextual_autotune(timer=timer, verbose=False, **options)
    def step(x):
        y = torch.empty_like(x)
        launch_add(kernel, x, y)
        return y

    return step


def preferring(index: int) -> TableTimer:
    """A timer under which config ``index`` is the fastest (1 ms; every other config 2 ms)."""
    return TableTimer(lambda info: 1.0 if info.config_index == index else 2.0)
