"""How a tuner spends its runs over a site's configs: ``search="exhaustive" | "screen" | "model"``.

* ``"exhaustive"`` times every config for ``n_warmup + n_repeat`` runs of the step;
* ``"screen"`` (also ``early_stop=True``) times every config once, agrees, and tunes the fastest
  quarter fully;
* ``"model"`` (:class:`ModelSearch`) times a seeded random batch, fits a small Gaussian process to
  the *agreed* times over the configs' features, and times the batch the model expects to improve
  most on, until no batch has improved the best agreed time by more than ``margin`` for ``patience``
  batches in a row (or ``budget`` of the configs were timed).

They are :data:`SEARCHES`, by name: a new search is a :data:`SearchFunction` and one line there
(``docs/extending.md``).

The model is a few lines of numpy (an RBF Gaussian process with its length scale chosen by marginal
likelihood, expected improvement, batches by the "kriging believer" rule), so it needs no dependency.

Every proposal is computed from the agreed vector (identical bits on every rank) and a generator
seeded by ``seed``: every rank proposes the same configs and the schedule stays rank-independent.
As a guard against floating-point differences between unlike hosts, the ranks also exchange their
proposals (one small all-gather per batch) and follow rank 0's; :attr:`SearchTrace.mismatches`
counts the batches where a rank's own differed (it is 0 on any sane system).

Cost of ``"model"``: ``sum(batch sizes) * (n_warmup + n_repeat)`` runs of the step, one agreement
and one proposal all-gather per batch; fitting is milliseconds for a few hundred configs.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np

from .sites import Schedule, Site, SiteId

INF = float("inf")

@dataclasses.dataclass(frozen=True)
class ModelSearch:
    """The settings of ``search="model"``; pass an instance as ``search=`` to change them.

    ``batch``: configs timed per batch (the first, random one has ``initial`` configs, default
    ``batch``); ``patience``/``margin``: stop after ``patience`` batches in a row that improved the
    best agreed time by no more than ``margin`` (relative, 0.01 = 1 %); ``budget``: the most configs
    timed, as a fraction of the site's (at least the first two batches); ``seed``: the generator's.
    """

    batch: int = 8
    patience: int = 3
    margin: float = 0.01
    budget: float = 0.2
    seed: int = 0
    initial: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("batch", "patience"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"disttune: ModelSearch.{name} must be an integer >= 1, got {value!r}")
        if self.initial is not None and (not isinstance(self.initial, int) or self.initial < 2):
            raise ValueError(f"disttune: ModelSearch.initial must be an integer >= 2, got {self.initial!r}")
        if not 0 <= self.margin < 1:
            raise ValueError(f"disttune: ModelSearch.margin must be in [0, 1), got {self.margin!r}")
        if not 0 < self.budget <= 1:
            raise ValueError(f"disttune: ModelSearch.budget must be in (0, 1], got {self.budget!r}")

    @property
    def first_batch(self) -> int:
        return self.initial if self.initial is not None else max(2, self.batch)

    def limit(self, n_configs: int) -> int:
        """The most configs this search times in a site of ``n_configs``."""
        return min(n_configs, max(self.first_batch + self.batch, math.ceil(self.budget * n_configs)))


Search = Union[str, ModelSearch]


def survivors(agreed: Sequence[float], keep: int) -> list[int]:
    """The ``keep`` fastest finite entries (ties to the lowest index): who goes on after screening."""
    ranked = sorted((t, i) for i, t in enumerate(agreed) if t < INF and not math.isnan(t))
    return [i for _, i in ranked[:keep]]


def screening_keep(n_configs: int) -> int:
    """How many configs survive screening: a quarter, at least two."""
    return max(2, -(-n_configs // 4))


def resolve_search(search: Optional[Search], early_stop: bool = False) -> Search:
    """A name in :data:`SEARCHES` or a :class:`ModelSearch` (``"model"`` is ``ModelSearch()``); ``early_stop=True``
    is ``"screen"``."""
    if search is None:
        return "screen" if early_stop else "exhaustive"
    if isinstance(search, ModelSearch):
        chosen: Search = search
    elif isinstance(search, str) and search in SEARCHES:
        chosen = ModelSearch() if search == "model" else search
    else:
        raise ValueError(f"disttune: search must be one of {tuple(SEARCHES)} or a ModelSearch, got {search!r}")
    if early_stop and chosen != "screen":
        raise ValueError(f"disttune: early_stop=True is search='screen'; it contradicts search={search!r}")
    return chosen


# -- config features ---------------------------------------------------------------------------------------

def config_items(config: Any) -> dict:
    """A config's tunables as one flat dict: a ``triton.Config``'s meta-parameters and options, or a dict."""
    if isinstance(config, dict):
        return dict(config)
    items = dict(getattr(config, "kwargs", {}))
    for option in ("num_warps", "num_stages", "num_ctas", "maxnreg"):
        value = getattr(config, option, None)
        if value is not None:
            items[option] = value
    return items


def config_features(configs: Sequence[Any]) -> np.ndarray:
    """``[n, d]`` features in [0, 1]: log2 of positive numbers, one-hot for anything else; constant ones dropped."""
    rows = [config_items(c) for c in configs]
    names = sorted({name for row in rows for name in row})
    columns: list[np.ndarray] = []
    for name in names:
        values = [row.get(name) for row in rows]
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
        if numeric:
            raw = np.array([math.log2(v) if v > 0 else float(v) for v in values], dtype=np.float64)
            span = raw.max() - raw.min()
            if span > 0:
                columns.append((raw - raw.min()) / span)
        else:
            labels = sorted({repr(v) for v in values})
            if len(labels) > 1:
                for label in labels:
                    columns.append(np.array([repr(v) == label for v in values], dtype=np.float64))
    if not columns:
        return np.zeros((len(configs), 1))
    return np.stack(columns, axis=1)


# -- the surrogate -------------------------------------------------------------------------------------------

class GaussianProcess:
    """A zero-mean RBF Gaussian process over standardized targets; length scale by marginal likelihood."""

    SCALES = (0.15, 0.3, 0.6, 1.2)
    NOISE = 1e-3

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        self.x = x
        self.mean, self.std = float(y.mean()), float(y.std()) or 1.0
        self.y = (y - self.mean) / self.std
        best = None
        for scale in self.SCALES:
            fitted = self._fit(scale * math.sqrt(x.shape[1]))
            if best is None or fitted[0] > best[0]:
                best = fitted
        _, self.scale, self.chol, self.alpha = best  # type: ignore[misc]

    def _kernel(self, a: np.ndarray, b: np.ndarray, scale: float) -> np.ndarray:
        squared = ((a[:, None, :] - b[None, :, :]) ** 2).sum(-1)
        return np.exp(-0.5 * squared / scale**2)

    def _fit(self, scale: float) -> tuple:
        k = self._kernel(self.x, self.x, scale) + self.NOISE * np.eye(len(self.x))
        chol = np.linalg.cholesky(k)
        alpha = np.linalg.solve(chol.T, np.linalg.solve(chol, self.y))
        likelihood = -0.5 * float(self.y @ alpha) - float(np.log(np.diag(chol)).sum())
        return likelihood, scale, chol, alpha

    def predict(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Mean and standard deviation at ``x``, in the targets' units."""
        k = self._kernel(x, self.x, self.scale)
        mean = k @ self.alpha
        v = np.linalg.solve(self.chol, k.T)
        var = np.clip(1.0 - (v**2).sum(0), 1e-12, None)
        return self.mean + self.std * mean, self.std * np.sqrt(var)


def expected_improvement(mean: np.ndarray, std: np.ndarray, best: float) -> np.ndarray:
    """EI for minimisation of ``mean`` below ``best``."""
    z = (best - mean) / std
    cdf = 0.5 * (1 + np.vectorize(math.erf)(z / math.sqrt(2)))
    pdf = np.exp(-0.5 * z**2) / math.sqrt(2 * math.pi)
    return (best - mean) * cdf + std * pdf


def propose(features: np.ndarray, observed: dict[int, float], count: int, rng: np.random.Generator) -> list[int]:
    """The next ``count`` config indices to time, from ``observed`` (index -> agreed ms, inf = failed).

    Fits the process to log time (failed configs at the worst finite time plus one), takes the best
    expected improvement, pretends it came out as predicted ("kriging believer") and repeats. Ties go
    to the lowest index; ``rng`` is used only when nothing finite was observed yet.
    """
    candidates = [i for i in range(len(features)) if i not in observed]
    if not candidates or count <= 0:
        return []
    finite = [t for t in observed.values() if math.isfinite(t) and t > 0]
    if len(finite) < 2:
        picks = rng.permutation(len(candidates))[:count]
        return sorted(candidates[i] for i in picks)
    worst = math.log(max(finite)) + 1.0
    xs = sorted(observed)
    ys = [math.log(observed[i]) if math.isfinite(observed[i]) and observed[i] > 0 else worst for i in xs]
    chosen: list[int] = []
    for _ in range(min(count, len(candidates))):
        model = GaussianProcess(features[xs], np.array(ys))
        left = [i for i in candidates if i not in chosen]
        mean, std = model.predict(features[left])
        gain = np.round(expected_improvement(mean, std, min(ys)), 12)  # bit noise must not reorder
        pick = left[int(np.argmax(gain))]  # argmax: the first (lowest index) of equals
        chosen.append(pick)
        xs.append(pick)
        ys.append(float(model.predict(features[[pick]])[0][0]))
    return sorted(chosen)


# -- the searches over sites -------------------------------------------------------------------------------

#: ``stage(schedule, label) -> runs``: run the step ``schedule.runs`` times, each site timing its
#: ``active`` configs as the schedule says.
Stage = Callable[[Schedule, str], int]
#: ``gather(sites, label) -> [(per-rank matrix, agreed vector)]``: one agreement over ``sites``.
Gather = Callable[[Sequence[Site], str], list]


@dataclasses.dataclass
class SearchTrace:
    """What a model search did: per site, each batch this rank proposed; batches where ranks differed."""

    batches: dict[SiteId, list[list[int]]] = dataclasses.field(default_factory=dict)
    timed: dict[SiteId, int] = dataclasses.field(default_factory=dict)
    mismatches: int = 0


@dataclasses.dataclass(frozen=True)
class SearchRun:
    """What a search works with in one tuning call: ``stage(schedule, label)`` makes the tuning runs a
    :class:`~disttune.sites.Schedule` gives the sites' ``active`` configs (returns how many), ``gather(sites,
    label)`` agrees on their times so far, ``exchange(value, label)`` all-gathers a small value; ``n_warmup``
    and ``n_repeat`` are the tuner's."""

    n_warmup: int
    n_repeat: int
    stage: Stage
    gather: Gather
    exchange: Callable[[Any, str], list]


@dataclasses.dataclass(frozen=True)
class Searched:
    """What a search did: the runs it made, a model search's trace, and whether the full timing of every
    ``active`` config (``n_warmup + n_repeat`` runs each) is still due."""

    runs: int
    trace: Optional[SearchTrace] = None
    full_timing: bool = True


#: ``search(sites, run) -> Searched``: narrows each site's ``active`` configs (the same on every rank: decide
#: from agreed times only) before the full timing. Leave a config out of ``active`` and it cannot win.
SearchFunction = Callable[[Sequence[Site], SearchRun], Searched]


def exhaustive(sites: Sequence[Site], run: SearchRun) -> Searched:
    """Every config gets the full timing."""
    return Searched(0)


def screen(sites: Sequence[Site], run: SearchRun) -> Searched:
    """One warm-up and one timed run per config, agreed; the fastest quarter (at least two) goes on to the full
    timing (nothing to screen where no site has more than two configs)."""
    if max(len(s.configs) for s in sites) <= 2:
        return Searched(0)
    runs = run.stage(Schedule(max(s.slots() for s in sites), 1, 1), "screening run")
    for site, (per_rank, agreed) in zip(sites, run.gather(sites, "screening agreement")):
        site.keep_only(survivors(agreed, screening_keep(len(site.configs))), per_rank, agreed)
    return Searched(runs)


def model(sites: Sequence[Site], run: SearchRun, plan: Optional[ModelSearch] = None) -> Searched:
    """:class:`ModelSearch` batches (``plan``, default ``ModelSearch()``), which are the full timing."""
    runs, trace = model_search(sites, plan or ModelSearch(), run.n_warmup, run.n_repeat, run.stage, run.gather,
                               run.exchange)
    return Searched(runs, trace, full_timing=False)


#: ``search=`` by name. A new search is one :data:`SearchFunction` and one line here (``docs/extending.md``).
SEARCHES: dict[str, SearchFunction] = {"exhaustive": exhaustive, "screen": screen, "model": model}


def narrow(sites: Sequence[Site], search: Search, n_warmup: int, n_repeat: int, stage: Stage, gather: Gather,
           exchange: Callable[[Any, str], list]) -> tuple[int, Optional[SearchTrace], bool]:
    """What ``search`` does before the full timing; returns (runs made, model trace, full timing still due)."""
    if not sites:
        return 0, None, False
    run = SearchRun(n_warmup, n_repeat, stage, gather, exchange)
    done = model(sites, run, search) if isinstance(search, ModelSearch) else SEARCHES[search](sites, run)
    return done.runs, done.trace, done.full_timing


class _SiteSearch:
    """One site's model search: what was observed, when it stops."""

    def __init__(self, site: Site, plan: ModelSearch) -> None:
        self.site, self.plan = site, plan
        self.features = config_features(site.configs)
        self.rng = np.random.default_rng(plan.seed)
        self.observed: dict[int, float] = {}
        self.best = math.inf
        self.stale = 0
        self.limit = plan.limit(len(site.configs))
        self.done = False
        self.per_rank: Optional[np.ndarray] = None

    def propose(self) -> list[int]:
        if self.done:
            return []
        count = self.plan.first_batch if not self.observed else self.plan.batch
        count = min(count, self.limit - len(self.observed))
        if not self.observed:
            return sorted(int(i) for i in self.rng.permutation(len(self.site.configs))[:count])
        return propose(self.features, self.observed, count, self.rng)

    def observe(self, batch: list[int], per_rank: np.ndarray, agreed: np.ndarray) -> None:
        if not batch:
            return
        for index in batch:
            self.observed[index] = float(agreed[index])
        if self.per_rank is None:
            self.per_rank = np.full(np.shape(per_rank), np.nan)
        self.per_rank[:, batch] = np.asarray(per_rank)[:, batch]
        best = min(self.observed.values())
        if best < self.best * (1 - self.plan.margin):
            self.stale = 0
        else:
            self.stale += 1
        self.best = min(self.best, best)
        if self.stale >= self.plan.patience or len(self.observed) >= self.limit:
            self.done = True

    def finish(self) -> None:
        """The verdict considers the timed configs only; the others read "not timed" (nan)."""
        n = len(self.site.configs)
        agreed = np.full(n, np.nan)
        per_rank = self.per_rank if self.per_rank is not None else np.full((1, n), np.nan)
        self.site.active = sorted(self.observed)
        self.site.screen = (per_rank, agreed)


def model_search(sites: Sequence[Site], plan: ModelSearch, n_warmup: int, n_repeat: int, stage: Stage,
                 gather: Gather, exchange: Callable[[Any, str], list]) -> tuple[int, SearchTrace]:
    """Batches of proposed configs, timed and agreed, until every site stops; returns (runs, trace).

    ``exchange(value, label)`` all-gathers a picklable value. Samples are kept between batches (a
    config is proposed once), so the final agreement covers every timed config; after this each
    site's ``active`` holds its timed configs and the untimed ones read ``nan``.
    """
    searches = [_SiteSearch(site, plan) for site in sites]
    trace = SearchTrace({s.site.id: [] for s in searches})
    runs, number = 0, 0
    while not all(s.done for s in searches):
        number += 1
        mine = [s.propose() for s in searches]
        everyone = exchange(mine, f"model search proposals {number}")
        trace.mismatches += any(other != everyone[0] for other in everyone)
        batches = everyone[0]
        for search, local, batch in zip(searches, mine, batches):
            if local or batch:  # a site that stopped proposes nothing while the others go on
                trace.batches[search.site.id].append(local)
            search.site.active = list(batch)
            if not batch:
                search.done = True
        longest = max(s.site.slots() for s in searches)
        if longest == 0:
            break
        runs += stage(Schedule(longest, n_warmup, n_repeat), f"model search run (batch {number})")
        for search, batch, (per_rank, agreed) in zip(searches, batches,
                                                     gather(sites, f"model search agreement {number}")):
            search.observe(batch, per_rank, agreed)
    for search in searches:
        search.finish()
        trace.timed[search.site.id] = len(search.observed)
    return runs, trace
