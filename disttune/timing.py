"""Timers: how one intercepted launch is measured.

A :class:`Timer` wraps a launch and hands back a *reader*: a callable that returns
the launch's time in milliseconds once the run is over. Reading late lets GPU
timers record events without a device synchronisation per launch.

* :class:`CudaEventTimer` records two CUDA events on the current stream around the
  launch (the launch's own GPU time, nothing of the host: a sleep kernel covers the time the host
  takes to issue it, so a starved stream does not count that time).
* :class:`HostTimer` reads the host clock; it is what runs under
  ``TRITON_INTERPRET=1`` or without a GPU.

Tests inject their own Timer so the expected winner is computable.

**L2 between tuning runs.** By default nothing is done to the GPU's L2 cache between runs: each timed
launch meets the cache as the launches before it in the same run of the function left it, which is
how it meets it in production when the function runs in a loop (in context, that is the honest
measurement). ``flush_l2=True`` (both tuners) writes a buffer twice the L2's size before each timed
launch, or before each timed run with ``objective="step"`` (:func:`flushing`), for kernels that run
cold in production (the first layer after a large copy, say). Under the interpreter or without a GPU
there is no L2 to flush and the option does nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, runtime_checkable

from .env import interpreting

Reader = Callable[[], float]


@dataclass(frozen=True)
class LaunchInfo:
    """What is being timed: one launch of one config at one tuning site.

    ``repeat`` (set for a probe by :class:`~disttune.objective.ProbingTimer` where the launch may be made again,
    a kernel launch of the contextual tuner): the bare launch, for a probe that needs a longer window than
    one launch (NVML's energy counter)."""

    kernel: str
    key: tuple
    occurrence: int
    config_index: int
    config: Any
    run: int
    rank: int
    repeat: Optional[Callable[[], Any]] = field(default=None, compare=False, repr=False)


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
    """CUDA events on the current stream around the launch; the read synchronises on the end event.

    The time is the launch's own GPU time, not the host's time to issue it. Where the host is slower
    than the GPU (an eager step of many small launches and collectives), the stream is idle when the
    start event is enqueued: the event fires at once and the kernel starts only once the host has
    issued it, so the host's cost would land in the kernel's time, more on a slower rank's host (on
    2 x H100 the MoE layer's GEMMs read up to 40 % slower than they run, and the ranks' times
    differed by as much). So a sleep kernel (``torch.cuda._sleep``) keeps the stream busy before the
    start event for 1.25x the host time this site's last timed launch took to issue (200 µs for its
    first, at most 2 ms): the kernel is queued by the time the start event fires. Cost per timed
    launch: that sleep on the GPU (where the stream is busy anyway, it delays what follows by as much)
    and two ``perf_counter`` calls; the first timing on a device calibrates the sleep (one device sync).
    A launch that also waits for its peers (a kernel spinning on arrival flags) still counts the time a
    slower peer's host took to send them: the cover removes this rank's host, not the others'.
    """

    COVER_FIRST_S = 200e-6
    COVER_MAX_S = 2e-3
    COVER_FACTOR = 1.25

    def __init__(self) -> None:
        import torch

        self._cuda = torch.cuda
        self._cover_s: dict[tuple, float] = {}  # per site: how long the sleep before its next timed launch lasts
        self._cycles_per_s: dict[int, float] = {}  # per device

    def time(self, launch: Callable[[], Any], info: LaunchInfo) -> Reader:
        site = (info.kernel, info.key, info.occurrence)
        self._cuda._sleep(int(self._cover_s.get(site, self.COVER_FIRST_S) * self._sleep_rate()))
        start = self._cuda.Event(enable_timing=True)
        end = self._cuda.Event(enable_timing=True)
        start.record()
        issuing = time.perf_counter()
        launch()
        issued_s = time.perf_counter() - issuing
        end.record()
        self._cover_s[site] = min(self.COVER_MAX_S, self.COVER_FACTOR * issued_s + 10e-6)

        def read() -> float:
            end.synchronize()
            return float(start.elapsed_time(end))

        return read

    def _sleep_rate(self) -> float:
        """Sleep-kernel cycles per second on the current GPU, measured once per device: a 2M-cycle sleep between
        two events, after one as long that brings the clocks up (clocks that drop later only lengthen the cover)."""
        device = self._cuda.current_device()
        rate = self._cycles_per_s.get(device)
        if rate is None:
            cycles = 2_000_000
            start, end = self._cuda.Event(enable_timing=True), self._cuda.Event(enable_timing=True)
            self._cuda._sleep(cycles)
            start.record()
            self._cuda._sleep(cycles)
            end.record()
            end.synchronize()
            rate = self._cycles_per_s[device] = cycles / max(start.elapsed_time(end) * 1e-3, 1e-6)
        return rate


class L2FlushingTimer:
    """``flush_l2=True``: before each timed launch (or run), ``flush()`` evicts the L2 cache, then ``inner`` times.

    The flush is enqueued before the timer starts, so it is not part of the time.
    """

    def __init__(self, inner: Timer, flush: Callable[[], Any]) -> None:
        self.inner, self.flush = inner, flush

    def time(self, launch: Callable[[], Any], info: LaunchInfo) -> Reader:
        self.flush()
        return self.inner.time(launch, info)


def l2_flush() -> Optional[Callable[[], Any]]:
    """A function that writes a buffer twice the GPU's L2 size (at least 32 MiB), evicting what the L2 holds;
    None without a GPU or under the interpreter (there is nothing to flush). Costs one memset per call."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available() or interpreting():
        return None
    l2_bytes = int(getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 0) or 0)
    buffer = torch.empty(max(2 * l2_bytes, 32 << 20), dtype=torch.int8, device="cuda")
    return buffer.zero_


def flushing(timer: Timer, flush: Optional[Callable[[], Any]] = None) -> Timer:
    """``timer`` with an L2 flush before each timing (``flush`` default :func:`l2_flush`); ``timer`` itself when
    there is nothing to flush."""
    flush = flush or l2_flush()
    return timer if flush is None else L2FlushingTimer(timer, flush)


def default_timer() -> Timer:
    """CUDA events on a GPU, the host clock under the interpreter or without CUDA."""
    try:
        import torch

        if torch.cuda.is_available() and not interpreting():
            return CudaEventTimer()
    except ImportError:
        pass
    return HostTimer()
