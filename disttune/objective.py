"""What a tuning minimises (``objective=``): each launch's time, the whole run's, or a score over more than time.

* ``"launch"`` (the default): the Timer wraps each intercepted launch (CUDA events around it on
  GPUs), in context: the other launches and the communication of the run go on around it.
* ``"step"``: the Timer wraps the whole run of the wrapped function (CUDA events on the current
  stream around the run on GPUs, the host clock elsewhere), with the configs under test in place.
  It sees what a launch's own time cannot: a GEMM config that occupies the SMs or the memory a
  communication kernel beside it needs makes the step slower while its own launch looks fast.
  With several tuned sites it tunes them **jointly** when they share one config list (run ``r``
  tries config ``c`` at every site, ``C * (n_warmup + n_repeat)`` tuning runs), else
  **coordinate-wise**, one site at a time in the order of discovery, the others on the winners
  agreed so far (``sum(C_s) * (n_warmup + n_repeat)`` tuning runs, plus one small all-gather after
  each site); see :func:`disttune.pipeline.step_stages`. ``search`` and ``split`` are launch-level
  tools and cannot be combined with it.
* a callable over :class:`Measurements` (lower score wins), or :func:`pareto`: launches are timed as
  with ``"launch"`` and also read by a :class:`Probe`, as below.

With such an objective each timed launch (or timed call of a function tuner) is also read by a
:class:`Probe`: the GPU memory it allocated at its peak and, where NVML is importable (``pynvml``),
the energy it used. Every measurement is reduced over the ranks with the tuner's ``reduce`` through
the same fixed-length all-gather as the times, and the objective sees only those agreed values, so
every rank picks the same winner. A measurement that some rank could not read is None for everyone.

Cost per timed launch, on top of the Timer: a reset and a read of the CUDA allocator's peak (host
side, no synchronisation). The peak reset is the allocator's own: a reading of
``torch.cuda.max_memory_allocated`` across a tuning call sees it reset.

Energy needs a window: NVML's energy counter moves in steps (every few to tens of milliseconds, measured
once per process by :func:`counter_period_s`), so one launch of a few milliseconds reads 0. With NVML the
probe reads it once per config and site in a tuning call: after the config's first timed launch it makes
that launch again (the bare launch, as ``do_bench`` repeats a kernel) until the repeats last at least
:func:`energy_window_s` (the larger of 50 ms and 8 counter steps) on the GPU, and divides the counter's
change by the repeats; later timed launches of that config reuse the reading. So the energy objective
costs about one window per config and site, and suits kernels that can be launched again in place (no
communication inside them). The host waits for the GPU around the window through the tuner's wait loop
(the collectives' deadline and peer checks). Where a launch cannot be repeated (the function tuner's
calls), the counter is read around the call itself. Without a GPU the probe reads nothing and the
measurements other than time are None.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Optional, Protocol, Sequence, Union

from .env import cuda_devices_narrowed, interpreting
from .timing import LaunchInfo, Reader, Timer

INF = float("inf")

#: The measurements read beside the time, in the order of the gathered vector (the same on every rank).
EXTRA = ("peak_memory_mb", "energy_mj")


@dataclass(frozen=True)
class Measurements:
    """What one config measured, agreed over the ranks: the time (ms), the peak GPU memory it allocated
    beyond what was allocated before its launch (MB), the energy per launch (mJ); None where not read."""

    time_ms: float
    peak_memory_mb: Optional[float] = None
    energy_mj: Optional[float] = None


MEASURES = tuple(f.name for f in fields(Measurements))


@dataclass(frozen=True)
class Pareto:
    """``objective=pareto(...)``: the Pareto front over ``measures`` (lower is better in each), and one config
    picked from it.

    ``pick="balanced"`` takes the front config with the smallest sum of its measures, each scaled to
    0 (the front's best) .. 1 (the front's worst); a measure name takes the front config best in that
    measure. Ties go to the lowest index. A measure that is None for some config (no GPU, no NVML) is
    left out (a ``pick`` left out falls to the first measure left); with none left, the front is the
    fastest config(s).
    """

    measures: tuple
    pick: str = "balanced"

    def usable(self, rows: Sequence[Measurements], eligible: Sequence[int]) -> list[str]:
        """The measures read for every eligible config (``time_ms`` when none is)."""
        return [m for m in self.measures if all(getattr(rows[c], m) is not None for c in eligible)] or ["time_ms"]

    def front(self, rows: Sequence[Measurements], eligible: Sequence[int]) -> list[int]:
        """The eligible configs no other eligible config dominates, in index order."""
        names = self.usable(rows, eligible)
        values = {c: [float(getattr(rows[c], m)) for m in names] for c in eligible}

        def dominates(a: list[float], b: list[float]) -> bool:
            return all(x <= y for x, y in zip(a, b)) and any(x < y for x, y in zip(a, b))

        return [c for c in eligible if not any(dominates(values[o], values[c]) for o in eligible if o != c)]

    def choose(self, rows: Sequence[Measurements], front: Sequence[int], names: Sequence[str]) -> int:
        """The front config ``pick`` says, over the measures ``names`` that made the front."""
        if self.pick != "balanced":
            chosen = self.pick if self.pick in names else names[0]
            return min(front, key=lambda c: (float(getattr(rows[c], chosen)), c))
        spans = {m: (min(float(getattr(rows[c], m)) for c in front), max(float(getattr(rows[c], m)) for c in front))
                 for m in names}

        def scaled(c: int) -> float:
            return sum((float(getattr(rows[c], m)) - low) / (high - low) if high > low else 0.0
                       for m, (low, high) in spans.items())

        return min(front, key=lambda c: (scaled(c), c))


def pareto(*measures: str, pick: str = "balanced") -> Pareto:
    """``objective=disttune.pareto("time_ms", "peak_memory_mb")``: pick from the Pareto front (see :class:`Pareto`).

    The report lists the front. Costs what any measured objective costs (see the module doc)."""
    if len(measures) < 1 or any(m not in MEASURES for m in measures) or len(set(measures)) != len(measures):
        raise ValueError(f"disttune: pareto() takes distinct measurement names from {MEASURES}, got {measures!r}")
    if pick != "balanced" and pick not in measures:
        raise ValueError(f"disttune: pareto(pick=...) must be 'balanced' or one of {measures}, got {pick!r}")
    return Pareto(tuple(measures), pick)


Objective = Union[str, Pareto, Callable[[Measurements], float]]


def describe_measurements(row: Measurements) -> str:
    """The measurements beside the time, as the summary prints them (``n/a``: not read)."""
    memory = "n/a" if row.peak_memory_mb is None else f"{row.peak_memory_mb:.4g} MB"
    energy = "n/a" if row.energy_mj is None else f"{row.energy_mj:.4g} mJ"
    return f"peak memory {memory}, energy {energy}"


def measured(objective: Any) -> bool:
    """Whether ``objective`` needs the measurements beside the time (a callable or a Pareto option)."""
    return isinstance(objective, Pareto) or (callable(objective) and not isinstance(objective, str))

#: What a tuning may minimise by name; a callable over :class:`Measurements` and :func:`pareto` are the others.
OBJECTIVES = ("launch", "step")


def check_objective(objective: Any, search: Any = None, split: Any = False) -> None:
    """``objective=`` of either tuner: one of :data:`OBJECTIVES`, a callable over :class:`Measurements` or a
    :func:`pareto` option; a ValueError otherwise, or where it is combined with what it cannot be:
    a measured objective scores every config's full timing (no ``search``, no ``split``), and ``"step"``
    times whole runs (no ``search``, no ``split``, both launch-level)."""
    named = isinstance(objective, str) and objective in OBJECTIVES
    if isinstance(objective, type) or not (named or measured(objective)):
        raise ValueError(f"disttune: objective must be one of {OBJECTIVES}, a callable over disttune.Measurements "
                         f"or disttune.pareto(...), got {objective!r}")
    narrowed = split or search not in (None, "exhaustive")
    if measured(objective) and narrowed:
        kind = "pareto(...)" if isinstance(objective, Pareto) else "a callable objective"
        raise ValueError(f"disttune: {kind} scores every config's full timing; search, early_stop and split "
                         "cannot be combined with it")
    if objective == "step" and narrowed:
        raise ValueError("disttune: objective='step' times whole runs; search, early_stop and split are for "
                         "objective='launch'")


def describe_objective(objective: Any, describe: Callable[[Any], str]) -> str:
    """``objective=`` as text for the consensus and the store: a function's name and the line it starts on, so
    that two lambdas of one module given on different ranks differ (``describe`` gives the rest)."""
    code = getattr(objective, "__code__", None)
    if code is not None:
        return f"{getattr(objective, '__module__', '?')}.{objective.__qualname__} (line {code.co_firstlineno})"
    return describe(objective)



@dataclass(frozen=True)
class Choice:
    """The verdict of a measured objective: the winner (None: no config works), the score of every config
    (``inf``: failed or out of the running; for a Pareto option, 0 on the front and ``inf`` off it), the front."""

    winner: Optional[int]
    scores: tuple
    front: tuple = ()


def choose(objective: Any, rows: Sequence[Measurements], eligible: Sequence[int]) -> Choice:
    """Score the agreed ``rows`` (only the ``eligible`` configs with a finite time compete).

    A callable that raises or gives no number is a ValueError naming the config; computed from agreed
    values only, it is the same on every rank."""
    running = [c for c in eligible if math.isfinite(rows[c].time_ms)]
    if isinstance(objective, Pareto):
        if not running:
            return Choice(None, (INF,) * len(rows))
        front = objective.front(rows, running)
        return Choice(objective.choose(rows, front, objective.usable(rows, running)), tuple(0.0 if c in front else INF for c in range(len(rows))),
                      tuple(front))
    scores = [INF] * len(rows)
    for c in running:
        try:
            score = float(objective(rows[c]))
        except Exception as err:
            raise ValueError(f"the objective failed for config[{c}] with {rows[c]}: "
                             f"{type(err).__name__}: {err}") from err
        if math.isnan(score):
            raise ValueError(f"the objective gave nan for config[{c}] with {rows[c]}; it must return a number")
        scores[c] = score
    best = min(range(len(rows)), key=lambda c: (scores[c], c)) if running else None
    return Choice(best if best is not None and scores[best] < INF else None, tuple(scores))


# -- reading the measurements --------------------------------------------------------------------------------

class Probe(Protocol):
    """Reads what a launch cost beside its time: ``start`` before it, ``stop`` right after it."""

    def start(self, info: LaunchInfo) -> Any: ...

    def stop(self, started: Any, info: LaunchInfo) -> dict[str, Optional[float]]:
        """``{name: value or None}`` for names in :data:`EXTRA`."""
        ...


class NoProbe:
    """Without a GPU: nothing beside the time is read."""

    def start(self, info: LaunchInfo) -> Any:
        return None

    def stop(self, started: Any, info: LaunchInfo) -> dict[str, Optional[float]]:
        return {}


#: The shortest energy window, whatever NVML's counter period.
MIN_ENERGY_WINDOW_S = 0.05
_COUNTER_PERIOD: dict[int, float] = {}  # per CUDA device: seconds between NVML energy counter steps


def counter_period_s(nvml: tuple, device: int) -> float:
    """Seconds between steps of NVML's energy counter on this GPU: the median interval between its changes,
    read once per process (polled for up to 0.5 s; the counter moves idle too)."""
    if device not in _COUNTER_PERIOD:
        pynvml, handle = nvml
        changes, last, deadline = [], pynvml.nvmlDeviceGetTotalEnergyConsumption(handle), time.monotonic() + 0.5
        while len(changes) < 6 and time.monotonic() < deadline:
            now = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
            if now != last:
                changes.append(time.monotonic())
                last = now
            time.sleep(0.0005)
        gaps = sorted(b - a for a, b in zip(changes, changes[1:]))
        _COUNTER_PERIOD[device] = gaps[len(gaps) // 2] if gaps else 0.1
    return _COUNTER_PERIOD[device]


def energy_window_s(period_s: float) -> float:
    """How long the repeated launches of one energy reading last: 8 counter steps, at least 50 ms."""
    return max(MIN_ENERGY_WINDOW_S, 8 * period_s)


class DeviceProbe:
    """The CUDA allocator's peak over the launch, and NVML's energy per launch where ``pynvml`` is importable,
    read over a window of repeated launches (see the module doc).

    ``wait(step)`` waits for the GPU's queued work (default: the device's own synchronisation; the tuners
    pass their wait loop, which has the collectives' deadline and peer checks)."""

    def __init__(self, wait: Optional[Callable[[str], None]] = None) -> None:
        import torch

        self._cuda = torch.cuda
        self._device = torch.cuda.current_device()
        self._nvml = nvml_handle(self._device)
        self.wait = wait or (lambda step: torch.cuda.synchronize())
        self._energy: dict[tuple, float] = {}  # (site, config) -> mJ per launch: the tuners make a probe per call

    def start(self, info: LaunchInfo) -> Any:
        self._cuda.reset_peak_memory_stats()
        energy = None
        if self._nvml is not None and info.repeat is None:  # a call that cannot be repeated: read around it
            self.wait("energy reading")
            energy = self._counter()
        return self._cuda.memory_allocated(), energy

    def stop(self, started: Any, info: LaunchInfo) -> dict[str, Optional[float]]:
        allocated, energy = started
        read: dict[str, Optional[float]] = {
            "peak_memory_mb": max(0, self._cuda.max_memory_allocated() - allocated) / 2**20, "energy_mj": None}
        if self._nvml is None:
            return read
        if info.repeat is None:
            self.wait("energy reading")
            read["energy_mj"] = float(self._counter() - energy)
            return read
        which = (info.kernel, info.key, info.occurrence, info.config_index)
        if which not in self._energy:
            self._energy[which] = self._window(info.repeat)
        read["energy_mj"] = self._energy[which]
        return read

    def _counter(self) -> int:
        return self._nvml[0].nvmlDeviceGetTotalEnergyConsumption(self._nvml[1])  # type: ignore[index]

    def _window(self, launch: Callable[[], Any]) -> float:
        """mJ per launch of ``launch``, over repeats that last one energy window on the GPU."""
        window = energy_window_s(counter_period_s(self._nvml, self._device))  # type: ignore[arg-type]
        start, end = self._cuda.Event(enable_timing=True), self._cuda.Event(enable_timing=True)
        self.wait("energy window")
        start.record()
        launch()
        end.record()
        self.wait("energy window")
        once_s = max(start.elapsed_time(end) / 1e3, 1e-6)
        repeats = max(1, math.ceil(window / once_s))
        before = self._counter()
        for _ in range(repeats):
            launch()
        self.wait("energy window")
        return float(self._counter() - before) / repeats


def nvml_handle(device: int) -> Optional[tuple]:
    """``(pynvml, handle)`` for CUDA device ``device`` when pynvml imports and the GPU reports energy; None
    otherwise. The GPU is found by its UUID (NVML numbers GPUs without ``CUDA_VISIBLE_DEVICES``); by index
    only where no device list narrows CUDA's view."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        uuid = device_uuid(device)
        if uuid is not None:
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        elif not cuda_devices_narrowed():
            handle = pynvml.nvmlDeviceGetHandleByIndex(device)
        else:
            return None
        pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
        return pynvml, handle
    except Exception:  # no driver, or a GPU without an energy counter
        return None


def device_uuid(device: int) -> Optional[str]:
    """CUDA device ``device``'s UUID as NVML writes it (``GPU-...``); None where torch does not give it."""
    try:
        import torch

        uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    except Exception:
        return None
    if uuid is None:
        return None
    text = str(uuid)
    return text if text.startswith("GPU-") else f"GPU-{text}"


def default_probe(wait: Optional[Callable[[str], None]] = None) -> Probe:
    """A :class:`DeviceProbe` on a GPU (waiting for the GPU through ``wait``), else (and under the interpreter)
    a :class:`NoProbe`."""
    try:
        import torch

        if torch.cuda.is_available() and not interpreting():
            return DeviceProbe(wait)
    except ImportError:
        pass
    return NoProbe()


class Reading:
    """A Timer's reader that also carries what the probe read around the launch."""

    def __init__(self, read: Reader, measures: dict[str, Optional[float]]) -> None:
        self.read, self.measures = read, measures

    def __call__(self) -> float:
        return self.read()


class ProbingTimer:
    """``inner`` timing each launch, with ``probe`` reading around it; its readers are :class:`Reading` s.

    ``repeatable``: the launches may be made again in place (kernel launches), so a probe that needs a longer
    window than one launch gets ``info.repeat``."""

    def __init__(self, inner: Timer, probe: Probe, repeatable: bool = False) -> None:
        self.inner, self.probe, self.repeatable = inner, probe, repeatable

    def time(self, launch: Callable[[], Any], info: LaunchInfo) -> Reader:
        if self.repeatable:
            info = replace(info, repeat=launch)
        started = self.probe.start(info)
        read = self.inner.time(launch, info)
        return Reading(read, self.probe.stop(started, info))


def measures_of(read: Reader) -> Optional[dict]:
    """What a :class:`Reading` carries beside the time (None for a plain reader)."""
    return getattr(read, "measures", None)
