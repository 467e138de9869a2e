"""Timing helpers for the scripts in ``bench/``: how one step is measured, the same way in every benchmark.

Every helper works on a GPU and on a CPU, in one process and over ``torch.distributed`` ranks:

* :func:`one_call_ms` -- one call from an idle device: the median of single calls, each started
  after a device synchronisation (and a barrier when distributed), so the host's launch latency
  counts. CUDA events on GPUs, the host clock otherwise.
* :func:`steady_ms` -- steady state: ``calls`` calls back to back between two events (the host runs
  ahead, as in a model's forward pass), per call; the median of ``runs`` such runs.
* :func:`max_over_ranks` -- the slowest rank's value (one ``all_reduce``); the value itself without
  ``torch.distributed``.
* :func:`interleaved` -- several contenders timed in interleaved rounds (steady state or one call from
  idle), each round's time the slowest rank's, reported as median and spread with each rank's median and
  the host's time to issue the calls beside it: what every speed ratio in ``bench/`` is taken from.
* :func:`host_and_wall_us` -- per call, the host's time to issue ``calls`` calls and the wall time
  until their device work is done, in interleaved rounds: when host ~ wall, the step is host-bound.
* :func:`capture_graph` -- a step captured in a CUDA graph, for replays that cost a few µs of host.
* :func:`cprofile` -- where the host time of a few calls goes (cProfile's top functions, as text).
* :func:`environment` and :func:`append_rows` -- the metadata of a result row (device, world size,
  versions, date) and JSON lines appended on rank 0, only to a path the user asked for.
* :func:`rel_error` -- relative Frobenius error of a result against a reference.
* :func:`stacks_on_termination` -- a rank that a launcher terminates (a time limit, a hang) prints where
  each of its threads was first.

The timing helpers return this rank's median; reduce it with :func:`max_over_ranks` where a
distributed step is only as fast as its slowest rank. Every rank must call the distributed
helpers in the same order (they contain collectives).
"""

from __future__ import annotations

import cProfile
import datetime
import io
import json
import platform
import pstats
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union, overload

import torch
import torch.distributed as dist

from .timing import interpreting

__all__ = [
    "HostWall",
    "Spread",
    "append_rows",
    "capture_graph",
    "cprofile",
    "distributed",
    "environment",
    "gather_over_ranks",
    "host_and_wall_us",
    "interleaved",
    "max_over_ranks",
    "on_gpu",
    "one_call_ms",
    "rank",
    "rel_error",
    "stacks_on_termination",
    "steady_ms",
    "sync",
]

Step = Callable[[], Any]


def on_gpu() -> bool:
    """True when steps run on a CUDA GPU (CUDA present and Triton not in its CPU interpreter)."""
    return torch.cuda.is_available() and not interpreting()


def distributed() -> bool:
    """True when ``torch.distributed`` is initialised (the helpers then synchronise the ranks)."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank, 0 without ``torch.distributed``."""
    return dist.get_rank() if distributed() else 0


def sync() -> None:
    """Wait for the current device's work (``torch.cuda.synchronize``; nothing on CPUs)."""
    if on_gpu():
        torch.cuda.synchronize()


def _start_together(barrier: Optional[bool]) -> None:
    """A device sync, then a barrier when distributed (``barrier=None``) or when asked to."""
    sync()
    if (distributed() if barrier is None else barrier):
        dist.barrier()


class _Stopwatch:
    """CUDA events on GPUs, the host clock otherwise; :meth:`ms` waits for the end event."""

    def __init__(self) -> None:
        self.gpu = on_gpu()
        if self.gpu:
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        if self.gpu:
            self._start.record()
        else:
            self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self.gpu:
            self._end.record()
        else:
            self._t1 = time.perf_counter()

    def ms(self) -> float:
        if self.gpu:
            self._end.synchronize()
            return float(self._start.elapsed_time(self._end))
        return (self._t1 - self._t0) * 1e3


def _median_run_ms(fn: Step, *, calls: int, runs: int, warmup: int, barrier: Optional[bool]) -> float:
    """Milliseconds per call, the median over ``runs`` runs of ``calls`` back-to-back calls.

    ``warmup`` calls first; each run starts after a device sync and, when distributed (or
    ``barrier=True``), a barrier.
    """
    for _ in range(warmup):
        fn()
    watch, times = _Stopwatch(), []
    for _ in range(max(1, runs)):
        _start_together(barrier)
        watch.start()
        for _ in range(calls):
            fn()
        watch.stop()
        times.append(watch.ms() / calls)
    return statistics.median(times)


def one_call_ms(fn: Step, *, samples: int = 30, warmup: int = 5, barrier: Optional[bool] = None) -> float:
    """Milliseconds of one call from an idle device: the median of ``samples`` single calls.

    Each sample starts after a device sync and, when distributed (or ``barrier=True``), a barrier,
    so every rank starts together and the host's launch latency is part of the time. CUDA events
    around the call on GPUs, the host clock on CPUs (where the call's work is done when it returns).
    Cost: ``warmup + samples`` calls, one sync (and barrier) per sample.
    """
    return _median_run_ms(fn, calls=1, runs=samples, warmup=warmup, barrier=barrier)


def steady_ms(fn: Step, *, calls: int = 10, runs: int = 10, warmup: int = 3,
              barrier: Optional[bool] = None) -> float:
    """Milliseconds per call in steady state: ``calls`` calls back to back between two events.

    The host issues the next call while the device runs the last one, as in a model, so this is the
    device time a step costs once the host keeps ahead (or the host time, where it cannot). The
    median over ``runs`` runs, each started after a device sync and, when distributed (or
    ``barrier=True``), a barrier. Cost: ``warmup + runs * calls`` calls, one sync per run.
    """
    return _median_run_ms(fn, calls=calls, runs=runs, warmup=warmup, barrier=barrier)


@overload
def max_over_ranks(value: float) -> float: ...


@overload
def max_over_ranks(value: Sequence[float]) -> list[float]: ...


def max_over_ranks(value: Union[float, Sequence[float]]) -> Union[float, list[float]]:
    """The largest ``value`` over all ranks (element-wise for a sequence): one ``all_reduce`` in
    float64, on the GPU under NCCL, on the CPU otherwise (a host sync either way). Without
    ``torch.distributed`` the value is returned as it is (a sequence as a list)."""
    scalar = not isinstance(value, (list, tuple))
    values = [float(value)] if scalar else [float(v) for v in value]
    if distributed():
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        tensor = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        values = tensor.tolist()
    return values[0] if scalar else values


def gather_over_ranks(values: Sequence[float]) -> list[list[float]]:
    """Every rank's ``values`` (one ``all_gather`` in float64, on the GPU under NCCL); ``[values]`` alone."""
    if not distributed():
        return [[float(v) for v in values]]
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    mine = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return [t.tolist() for t in everyone]


@dataclass(frozen=True)
class Spread:
    """One contender's times over the rounds of :func:`interleaved`, ms per call.

    ``rounds``: each round's time, the slowest rank's; ``median``, ``low`` and ``high`` over them;
    ``per_rank``: each rank's own median (a rank that is always the slowest shows here);
    ``host``: the median ms the host took to issue a round's calls, per call (close to ``median``: the
    step runs at the host's pace, not the GPU's)."""

    rounds: tuple
    per_rank: tuple
    host: float

    @property
    def median(self) -> float:
        return statistics.median(self.rounds)

    @property
    def low(self) -> float:
        return min(self.rounds)

    @property
    def high(self) -> float:
        return max(self.rounds)

    def text(self) -> str:
        """``median [low-high]`` with three decimals."""
        return f"{self.median:.3f} [{self.low:.3f}-{self.high:.3f}]"


def interleaved(contenders: Mapping[str, Step], *, rounds: int = 10, calls: int = 10, warmup: int = 3,
                barrier: Optional[bool] = None) -> dict[str, Spread]:
    """Time ``contenders`` in interleaved rounds: each round times every contender once, in an order that
    rotates from round to round, so a drift of the machine (clocks, a neighbour's load) hits them alike and
    no contender always follows the same one.

    One timing is ``calls`` calls back to back between two CUDA events (the host clock on CPUs), per call,
    started after a device sync and, when distributed, a barrier: ``calls=10`` is the steady state of a
    model's forward pass, ``calls=1`` one call from an idle device (the host's launch latency counts).
    Returns a :class:`Spread` per contender, whose round times are the slowest rank's. Every rank must
    call this with the same contenders in the same order (it holds collectives).
    Cost: ``warmup + rounds * calls`` calls per contender, a sync and a barrier per timing, one all-gather.
    """
    names, rounds = list(contenders), max(1, rounds)
    for fn in contenders.values():
        for _ in range(warmup):
            fn()
    watch = _Stopwatch()
    device_ms = {name: [] for name in names}
    host_ms = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            fn = contenders[name]
            _start_together(barrier)
            started = time.perf_counter()
            watch.start()
            for _ in range(calls):
                fn()
            watch.stop()
            host_ms[name].append((time.perf_counter() - started) * 1e3 / calls)
            device_ms[name].append(watch.ms() / calls)
    flat = [v for name in names for v in device_ms[name]] + [statistics.median(host_ms[name]) for name in names]
    everyone = gather_over_ranks(flat)
    result = {}
    for i, name in enumerate(names):
        span = slice(i * rounds, (i + 1) * rounds)
        per_round = tuple(max(ranks) for ranks in zip(*(values[span] for values in everyone)))
        per_rank = tuple(statistics.median(values[span]) for values in everyone)
        host = max(values[len(names) * rounds + i] for values in everyone)
        result[name] = Spread(per_round, per_rank, host)
    return result


@dataclass(frozen=True)
class HostWall:
    """One round of back-to-back calls, per call: ``host_us`` to issue them, ``wall_us`` until the
    device finished them (host + waiting). ``wall_us - host_us`` is device time the host did not hide."""

    host_us: float
    wall_us: float


def host_and_wall_us(fns: Mapping[str, Step], *, calls: int = 200, rounds: int = 5, warmup: int = 1,
                     barrier: Optional[bool] = None) -> dict[str, list[HostWall]]:
    """Host and wall µs per call of each step, one :class:`HostWall` per round.

    Each round calls every step ``calls`` times back to back and synchronises the device once at
    the end; the rounds interleave the steps, so drift (clocks, other processes) hits all alike.
    Take ``min(samples, key=lambda s: s.wall_us)`` for the least disturbed round. On CPUs there
    is nothing to wait for and host equals wall. Cost: ``warmup + rounds * calls`` calls per step,
    one sync (and a barrier when distributed) per round and step.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    sync()
    samples: dict[str, list[HostWall]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            _start_together(barrier)
            started = time.perf_counter()
            for _ in range(calls):
                fn()
            issued = time.perf_counter()
            sync()
            done = time.perf_counter()
            samples[name].append(HostWall((issued - started) / calls * 1e6, (done - started) / calls * 1e6))
    return samples


def stacks_on_termination() -> None:
    """On SIGTERM (what torchrun and ``timeout`` send), print every thread's Python stack to stderr, then end as
    SIGTERM would: a benchmark that hangs, at its end or anywhere, says where. Costs nothing until then."""
    import faulthandler
    import signal

    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)


def capture_graph(fn: Step) -> "torch.cuda.CUDAGraph":
    """``fn`` captured once in a CUDA graph; ``graph.replay()`` then reruns its kernels (and captured
    NCCL collectives) for a few µs of host. Two warm-up calls on a side stream first (lazy
    initialisation must not be captured), then a barrier when distributed, so every rank captures in
    the same order. Keep the graph alive as long as its replays are used (it owns their memory), and
    drop it before the process group is destroyed (NCCL waits for graphs that use its communicators).
    GPU only: raises RuntimeError elsewhere."""
    if not on_gpu():
        raise RuntimeError("capture_graph: CUDA graphs need a CUDA GPU (and Triton outside its interpreter)")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    _start_together(None)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


def cprofile(fn: Step, *, calls: int = 50, top: int = 25) -> tuple[float, str]:
    """(host ms per call, cProfile's ``top`` functions by own time as text) for ``calls`` calls back
    to back, without a sync in between. The profiler slows Python code down, so the host time is
    an upper bound; the table shows where it goes. Cost: ``calls`` profiled calls and one sync."""
    sync()
    profiler = cProfile.Profile()
    started = time.perf_counter()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    host_ms = (time.perf_counter() - started) * 1e3 / calls
    sync()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return host_ms, text.getvalue()


def environment(**extra: Any) -> dict[str, Any]:
    """Where a result was measured: ``device`` (the GPU's name, or ``cpu (<processor>)`` with
    ``interpreter`` when Triton runs interpreted), ``world`` (ranks), ``torch``, ``triton``, ``cuda``
    (torch's CUDA version, None on CPU builds), ``python`` and ``date`` (UTC, ISO 8601), then
    ``extra``. Cheap: no device work."""
    import triton

    if torch.cuda.is_available():
        device = torch.cuda.get_device_name()
    else:
        device = f"cpu ({platform.processor() or platform.machine()})"
    return {
        "device": device,
        "interpreter": interpreting(),
        "world": dist.get_world_size() if distributed() else 1,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **extra,
    }


def append_rows(path: Union[str, Path, None], rows: Iterable[Mapping[str, Any]],
                meta: Optional[Mapping[str, Any]] = None) -> Optional[Path]:
    """Append ``rows`` as JSON lines to ``path``, each after ``meta`` (default :func:`environment`),
    on rank 0 only; creates the parent directory. Returns the path written, or None where nothing
    was written (no ``path``: a benchmark writes files only where ``--out`` asks, or not rank 0)."""
    if path is None or rank() != 0:
        return None
    head = dict(environment() if meta is None else meta)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        for row in rows:
            handle.write(json.dumps({**head, **row}) + "\n")
    return path


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """``||got - want|| / ||want||`` in fp32 (Frobenius norms; inf or nan when ``want`` is all
    zeros). One host sync on GPUs."""
    got, want = got.float(), want.float()
    return float(((got - want).norm() / want.norm()).item())
