"""Tuning sites, the rank-independent schedule and the per-rank statistics.

A *site* is one autotuned launch within a run of the wrapped function, named by
(kernel, tuning key, occurrence of that kernel and key within the run). It owns its
candidate configs and the samples this rank measured for them. Nothing here talks
to other ranks: :mod:`disttune.agreement` gathers :meth:`Site.local_times` from every
rank and reduces the gathered matrix (:func:`disttune.agreement.agree`). :func:`split_predicate` turns
the ``split=`` option into a test on a site.
"""

from __future__ import annotations

import math
import statistics as _stats
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np

from .configs import config_text

INF = float("inf")
NAN = float("nan")

Statistic = Union[str, Callable[[Sequence[float]], float]]
#: ``statistic=`` by name: one config's timed samples on one rank -> one number. A new one is one line here.
STATISTICS: dict[str, Callable[[Sequence[float]], float]] = {
    "median": _stats.median,
    "mean": _stats.fmean,
    "min": min,
}


class AllConfigsFailed(RuntimeError):
    """Every candidate config of a site failed (or was pruned) on at least one rank."""


@dataclass(frozen=True)
class SiteId:
    kernel: str
    key: tuple
    occurrence: int
    #: the names of the key's entries (``triton_launch.key_names``), where known; not part of the identity
    names: tuple = field(default=(), compare=False, repr=False)

    def describe(self) -> str:
        return f"{self.kernel} key={self.key!r} occurrence={self.occurrence}"

    def key_text(self) -> str:
        """The key with its names, as people read it: ``M=48 N=32 K=64 dtype=float16`` (see :func:`label_key`)."""
        return label_key(self.names, self.key)


def sample_spread(samples: Sequence[float]) -> Optional[float]:
    """A config's *noise* on one rank: ``(max - min) / median`` of its timed samples; None with fewer than two
    finite ones."""
    finite = [s for s in samples if math.isfinite(s)]
    if len(finite) < 2:
        return None
    middle = _stats.median(finite)
    return (max(finite) - min(finite)) / middle if middle > 0 else None


def label_key(names: Sequence[str], key: Sequence[Any]) -> str:
    """``M=48 N=32 K=64 dtype=float16``: each key entry with its name, then the tensors' dtypes as one
    ``dtype=`` (the most common one, without ``torch.``) and the arguments of other dtypes in brackets,
    ``dtype=float16 (int32: flags, offsets)``. Without names (a key from the logs of an older version),
    the key's repr."""
    if len(names) != len(key):
        return repr(tuple(key))
    parts, dtypes = [], {}
    for name, value in zip(names, key):
        if str(name).endswith(".dtype"):
            argument = str(name).removesuffix(".dtype").removesuffix("_ptr")
            dtypes.setdefault(str(value).removeprefix("torch."), []).append(argument)
        else:
            parts.append(f"{name}={value}")
    if dtypes:
        common = max(dtypes, key=lambda dtype: len(dtypes[dtype]))
        others = "; ".join(f"{dtype}: {', '.join(args)}" for dtype, args in dtypes.items() if dtype != common)
        parts.append(f"dtype={common}" + (f" ({others})" if others else ""))
    return " ".join(parts)


@dataclass
class Site:
    """One tuning site on this rank: its candidates, its samples, its local failures."""

    id: SiteId
    autotuner: Any
    configs: list
    preset: Optional[Any] = None  # a winner already in the kernel's cache (used only if all ranks agree)
    samples: list = field(default_factory=list)
    failures: dict = field(default_factory=dict)  # config index -> message
    stand_in: Optional[int] = None  # index of a config that launched fine on this rank
    local_answer: Optional[int] = None  # this rank's stored or pinned winner, before agreement
    decided: Optional[int] = None  # winner agreed without tuning (store or pinned table)
    decided_by: str = ""

    active: list = field(default_factory=list)  # config indices still in the running (early stopping)
    screen: Optional[tuple] = None  # (per-rank, agreed) screening times, when early stopping screened this site
    share: Optional[tuple] = None  # (rank, world) when split: rank r times only positions r, r + w, ... of active

    @property
    def split(self) -> bool:
        return self.share is not None

    def slots(self) -> int:
        """Config slots this site needs in a stage: its active configs, divided among the ranks when split."""
        if self.share is None:
            return len(self.active)
        return -(-len(self.active) // self.share[1])

    def __post_init__(self) -> None:
        self.clear_samples()
        self.active = list(range(len(self.configs)))

    def clear_samples(self) -> None:
        """Forget every sample (and what probes read beside them), keeping failures and the active configs."""
        self.samples = [[] for _ in self.configs]
        self.sample_times: list[list[float]] = [[] for _ in self.configs]  # when each sample was read (epoch s)
        self.measures: dict[str, list] = {}  # name -> per config, what a probe read beside each sample (nan: none)

    def add_sample(self, index: int, ms: float, at: float, measures: Optional[dict] = None) -> None:
        """One timed run of config ``index``: ``ms``, read at ``at`` (seconds since the epoch), and what a
        probe read beside it (``{name: value or None}``, see :mod:`disttune.objective`)."""
        self.samples[index].append(ms)
        self.sample_times[index].append(at)
        for name, value in (measures or {}).items():
            per_config = self.measures.setdefault(name, [[] for _ in self.configs])
            per_config[index].append(NAN if value is None else float(value))

    def keep_only(self, survivors: list[int], per_rank: np.ndarray, agreed: np.ndarray) -> None:
        """After an agreed screening round: only ``survivors`` are tuned further; their samples restart."""
        self.active = sorted(survivors)
        self.screen = (np.array(per_rank), np.array(agreed))
        self.samples = [[] for _ in self.configs]
        self.sample_times = [[] for _ in self.configs]
        self.measures = {}

    def with_screening(self, per_rank: np.ndarray, agreed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Final times where screened-out configs keep their (agreed) screening times."""
        if self.screen is None:
            return per_rank, agreed
        dropped = [c for c in range(len(self.configs)) if c not in self.active]
        per_rank, agreed = np.array(per_rank), np.array(agreed)
        per_rank[:, dropped] = self.screen[0][:, dropped]
        agreed[dropped] = self.screen[1][dropped]
        return per_rank, agreed

    def digest(self) -> tuple:
        """What must be identical on every rank: identity and candidate list (plus the preset)."""
        return (
            self.id.kernel,
            repr(self.id.key),
            self.id.occurrence,
            tuple(config_text(c) for c in self.configs),
            None if self.preset is None else config_text(self.preset),
        )

    def record_failure(self, index: int, err: BaseException) -> None:
        self.failures.setdefault(index, f"{type(err).__name__}: {err}")

    def local_times(self, statistic: Statistic) -> list[float]:
        """One value per config: the statistic of its samples, ``inf`` where it failed here.

        A config this rank did not time (a split site's config owned by another rank) is ``nan``.
        """
        reduce = resolve_statistic(statistic)
        unmeasured = NAN if self.share is not None else INF
        return [
            INF if i in self.failures else float(reduce(samples)) if samples else unmeasured
            for i, samples in enumerate(self.samples)
        ]

    def local_measures(self, name: str, statistic: Statistic) -> list[float]:
        """One value per config of measurement ``name``: the statistic of what was read beside its timed runs;
        ``nan`` where nothing (or not every run) was read, or the config failed here."""
        reduce = resolve_statistic(statistic)
        per_config = self.measures.get(name, [[] for _ in self.configs])
        return [
            NAN if i in self.failures or not values or len(values) != len(self.samples[i])
            or any(math.isnan(v) for v in values) else float(reduce(values))
            for i, values in enumerate(per_config)
        ]


def resolve_statistic(statistic: Statistic) -> Callable[[Sequence[float]], float]:
    if callable(statistic):
        return statistic
    try:
        return STATISTICS[statistic]
    except KeyError:
        raise ValueError(
            f"disttune: unknown statistic {statistic!r}; use one of {sorted(STATISTICS)} or a callable"
        ) from None


@dataclass(frozen=True)
class Schedule:
    """Which config each site tries in each tuning run: the same on every rank.

    First the warm-ups: config ``c`` of every site gets runs ``c*w .. c*w+w-1``. Then ``r`` rounds of
    timed runs, each round timing every config once, in list order: config ``c``'s timed runs are
    ``L*w + c``, ``L*w + L + c``, ... (``L`` = ``longest``). Interleaved so, a stretch in which the machine
    runs slow (another job, a clock that drops for a while) costs every config a sample alike instead of
    all of one config's samples, which would hand the win to a slower config. A site with fewer configs
    than the longest list launches its stand-in (untimed) in the other configs' slots.

    A *split* site (``share=(rank, world)``) hands slot ``j`` to position ``j*world + rank``:
    in each slot every rank runs a different config, so it needs ``ceil(n / world)`` slots.
    ``longest`` counts slots, not configs.
    """

    longest: int
    n_warmup: int
    n_repeat: int

    @property
    def runs(self) -> int:
        return self.longest * (self.n_warmup + self.n_repeat)

    def slot(self, run: int, n_configs: int, share: Optional[tuple] = None) -> tuple[Optional[int], bool]:
        """(config position or None for a stand-in launch, whether this launch is timed)."""
        warmups = self.longest * self.n_warmup
        timed = run >= warmups
        index = (run - warmups) % self.longest if timed else run // self.n_warmup
        if share is not None:
            rank, world = share
            index = index * world + rank
        if index >= n_configs:
            return None, False
        return index, timed


def total_function_runs(longest: int, n_warmup: int, n_repeat: int) -> int:
    """Runs of the wrapped function for one tuning: discovery + tuning runs + the final run."""
    if longest == 0:
        return 1
    return 2 + longest * (n_warmup + n_repeat)


def split_predicate(spec: Any) -> Callable[["Site"], bool]:
    """``split=`` as a test on a site: True/False, a kernel name, autotuned kernels, or a predicate.

    Names match the kernel's ``module.qualname`` (as in logs and reports) or its bare function
    name; a ``triton.autotune`` kernel object matches itself; a callable gets the ``SiteId``.
    """
    from triton.runtime.autotuner import Autotuner

    if spec is None or spec is False:
        return lambda site: False
    if spec is True:
        return lambda site: True
    if isinstance(spec, (str, Autotuner)):
        spec = [spec]
    elif callable(spec):
        predicate = spec
        return lambda site: bool(predicate(site.id))
    try:
        items = list(spec)
    except TypeError:
        raise TypeError(f"disttune: split must be a bool, kernel names or kernels, or a predicate over a SiteId; "
                        f"got {type(spec).__name__}") from None
    names = {item for item in items if isinstance(item, str)}
    kernels = {id(item) for item in items if isinstance(item, Autotuner)}
    other = [item for item in items if not isinstance(item, (str, Autotuner))]
    if other:
        raise TypeError(f"disttune: split= entries must be kernel names or triton.autotune kernels, got {other!r}")

    def chosen(site: Site) -> bool:
        return (id(site.autotuner) in kernels or site.id.kernel in names
                or getattr(site.autotuner.base_fn, "__name__", None) in names)

    return chosen
