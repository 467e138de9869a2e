"""Timers: how one intercepted launch is measured.

A :class:`Timer` wraps a launch and hands back a *reader*: a callable that returns
the launch's time in milliseconds once the run is over. Reading late lets GPU
timers record events without a device synchronisation per launch.

* :class:`CudaEventTimer` records two CUDA events on the current stream around the
  launch (the launch's own GPU time, nothing of the host).
* :class:`HostTimer` reads the host clock; it is what runs under
  ``TRITON_INTERPRET=1`` or without a GPU.

Tests inject their own Timer so the expected winner is computable.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

from .env import interpreting

Reader = Callable[[], float]


@dataclass(frozen=True)
class LaunchInfo:
    """What is being timed: one launch of one config at one tuning site."""

    kernel: str
    key: tuple
    occurrence: int
    config_index: int
    config: Any
    run: int
    rank: int


@runtime_checkable
class Timer(Protocol):
    def time(self, launch: Callable[[], Any], info: LaunchInfo) -> Reader:
        """Run ``launch`` once and return a reader of its time in ms (valid after the run)."""
        ...


class HostTimer:
    """Host wall clock around the launch. Costs two ``perf_counter`` calls."""

    def time(self, launch: Callable[[], Any], info: LaunchInfo) -> Reader:
        start = time.perf_counter()
        launch()
        elapsed_ms = (time.perf_counter() - start) * 1e3
        return lambda: elapsed_ms


class CudaEventTimer:
    """CUDA events on the current stream around the launch; the read synchronises on the end event."""

    def __init__(self) -> None:
        import torch

        self._cuda = torch.cuda

    def time(self, launch: Callable[[], Any], info: LaunchInfo) -> Reader:
        start = self._cuda.Event(enable_timing=True)
        end = self._cuda.Event(enable_timing=True)
        start.record()
        launch()
        end.record()

        def read() -> float:
            end.synchronize()
            return float(start.elapsed_time(end))

        return read


def default_timer() -> Timer:
    """CUDA events on a GPU, the host clock under the interpreter or without CUDA."""
    try:
        import torch

        if torch.cuda.is_available() and not interpreting():
            return CudaEventTimer()
    except ImportError:
        pass
    return HostTimer()
