"""The cross-rank protocol of a tuning call: every collective the tuners make, and the verdict each one gives.

After the launches have been intercepted, named as sites and timed (:mod:`disttune.handlers`), the
ranks agree here. Every verdict is computed from gathered data only, so every rank reaches the same
one: the same winners, or the same :class:`TuningError` with the same message, before the next
collective. In the order a tuning call meets them:

1. :meth:`Agreement.consensus` (one collective, :func:`consensus_verdict`): each rank's error before tuning (a setting, ``key_fn``,
   the discovery run), the options that change
   the schedule or the verdict, each rank's site digests, which sites are split, the pinned table's
   digest, each rank's stored/pinned answer (rank 0's decides for everyone, unless it failed to launch
   on some rank in the discovery run: then a stored winner is tuned again without it, a pinned one is
   an error);
2. :meth:`Agreement.check_run` (one barrier per run: no rank starts a run whose collectives a failed
   peer would leave it waiting in): an error in any rank's tuning run is an error on all. Through the
   rendezvous store the error travels on the call's posts (the failing rank posts it and does not
   arrive), and beyond :data:`FENCED_RUNS_MAX_RANKS` ranks there is no barrier, only a look at the posts;
   over MPI, the barrier is an all-gather of a flag, and a second one of the errors on trouble;
3. :meth:`Agreement.gather_agreed` (one collective of every site's per-config statistic, and of each
   measurement a measured objective reads, :mod:`disttune.objective`, combined once over the ranks:
   :class:`TimingVector`) and :meth:`Agreement.verdicts`: the agreed vector (``reduce`` over ranks,
   ``inf`` where a config failed on any rank), the times' spread over the ranks, the winner (argmin, ties to the lowest index; a measured
   objective's lowest score), :class:`SiteResult` per site; every config failing is
   :class:`~disttune.sites.AllConfigsFailed`, with each rank's reasons;
4. :meth:`Agreement.final_run_status` (one collective after the final run, :func:`final_run_verdict`): an error or a split
   winner failing on any rank in the final run; :meth:`Agreement.drop_failed_winners` scores
   such winners ``inf`` and takes the next best.

The consensus, the timing vector and the final run's status are each concluded once, from every rank's
message, by the rendezvous store's last arriver (:func:`~disttune.comm.combine_objects`,
:func:`~disttune.comm.combine_floats`), and every rank receives only the conclusion: O(sites x configs)
per rank whatever the number of ranks, O(ranks x sites x configs) on the one that concludes (over MPI
every rank concludes from an all-gather, alike).

Each collective is bounded by the communicator's timeout (:mod:`disttune.comm`), and so is every wait
for the GPU (:meth:`Agreement.wait_for_device`). A rank that brings an error of its own to a collective
also posts it on the tuning call's channel, so a peer held up elsewhere (inside the function's own
collective, or behind it on the GPU) still hears of it: any wait here that breaks, times out or is
left for a peer's post ends in the one verdict of :mod:`disttune.ending`, the same on every rank.
Either way an error some ranks brought reads the same (:func:`~disttune.errors.failed_on_ranks`): headed by
where it arose (the ``failed`` of :meth:`Agreement._together`), then each rank's own exception first.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Sequence, TypeVar

import numpy as np

from . import device
from .comm import CollectiveTimeout, Communicator, PeerFailed, combine_floats, combine_objects, wait_until
from .configs import config_text, describe_config
from .ending import Ending
from .errors import FINAL_RUN_FAILED, NOT_STARTED, StoreWarning, TuningError, failed_on_ranks
from .objective import EXTRA, Choice, Measurements, choose, measured
from .sites import AllConfigsFailed, Site, SiteId, Statistic

INF = float("inf")
NAN = float("nan")
T = TypeVar("T")

#: How ``reduce=`` combines the ranks' values of one config: ``[world, n] -> [n]``, ``nan`` where a rank has no
#: value to give (a split site's configs are each timed by one rank). A new reduction is one line here
#: (docs/extending.md).
REDUCERS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "max": lambda values: np.nanmax(values, axis=0),
    "mean": lambda values: np.nanmean(values, axis=0),
    "min": lambda values: np.nanmin(values, axis=0),
}


def agree(per_rank: np.ndarray, reduce: str, split: bool = False) -> np.ndarray:
    """Combine ``[world, n]`` per-rank times into one agreed vector.

    A config that is ``inf`` on any rank is ``inf`` in the result (a config that fails anywhere fails
    everywhere); otherwise :data:`REDUCERS`' ``reduce`` over the ranks. With ``split=True`` a ``nan`` entry
    means "not timed by this rank": the reduction runs over the ranks that timed the config (in a split
    site, its one owner), and a config no rank timed is ``inf``.
    """
    per_rank = np.asarray(per_rank, dtype=np.float64)
    finite = np.isfinite(per_rank)
    failed = np.isinf(per_rank).any(axis=0) | ~finite.any(axis=0) if split else ~finite.all(axis=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-nan columns: replaced by inf below
        combined = REDUCERS[reduce](np.where(finite, per_rank, NAN))
    return np.where(failed, INF, combined)


def agree_measure(per_rank: np.ndarray, reduce: str) -> np.ndarray:
    """Combine ``[world, n]`` per-rank readings of a measurement: ``nan`` (not read) on any rank is ``nan``
    for everyone, otherwise the ``reduce`` over ranks (as :func:`agree` does for times)."""
    per_rank = np.asarray(per_rank, dtype=np.float64)
    missing = np.isnan(per_rank).any(axis=0)
    return np.where(missing, NAN, REDUCERS[reduce](np.where(missing, 0.0, per_rank)))


#: Every rank receives every rank's times while ``world^2 x slots x 8`` bytes (what the store's host sends for that)
#: stays within this; beyond it, each rank receives the agreed values and keeps its own times (its log has them).
ROWS_BYTES = 1 << 26
#: Up to this many ranks, every tuning run ends in a barrier through the rendezvous store (:meth:`Agreement.check_run`);
#: beyond it the runs are not fenced: a barrier per run costs the store's host about four requests per rank, which at
#: a thousand ranks is most of a tuning call's agreement (``bench/control_plane_scale.py``).
FENCED_RUNS_MAX_RANKS = 64


#: The rows of :attr:`SiteTimes.spread`: over the ranks that timed a config, its min, median and max time, and the
#: slowest rank (the first with the max; ``nan`` where no rank timed it).
SPREAD = ("min_ms", "median_ms", "max_ms", "slowest_rank")


def spread_of(per_rank: np.ndarray) -> np.ndarray:
    """``[world, n]`` times -> ``[4, n]``: :data:`SPREAD` per config, over the ranks whose time is not ``nan``
    (``inf``, a failure, is the slowest)."""
    per_rank = np.asarray(per_rank, dtype=np.float64)
    timed = ~np.isnan(per_rank)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-nan columns: nan below
        low, middle, high = np.nanmin(per_rank, axis=0), np.nanmedian(per_rank, axis=0), np.nanmax(per_rank, axis=0)
    slowest = np.argmax(np.where(timed, per_rank, -INF), axis=0).astype(np.float64)
    return np.vstack([low, middle, high, np.where(timed.any(axis=0), slowest, NAN)])


@dataclass(frozen=True)
class SiteTimes:
    """One site's times after the agreement's collective, as this rank holds them: the ``agreed`` vector, this
    rank's ``own`` times, their ``spread`` over the ranks (``[4, configs]``, :data:`SPREAD`), every rank's ``rows``
    (``[world, configs]``) where :attr:`TimingVector.rows` sent them (else None), and per measurement ``extra``:
    ``{name: (rows or None, own, agreed)}``."""

    agreed: np.ndarray
    own: np.ndarray
    spread: np.ndarray
    rows: Optional[np.ndarray]
    extra: dict
    rank: int
    world: int

    def per_rank(self) -> np.ndarray:
        """``[world, configs]``: :attr:`rows`, or ``nan`` but for this rank's own row where they were not sent
        (O(world x configs): for the searches' rounds, not the verdict)."""
        return self.rows if self.rows is not None else own_row_only(self.own, self.rank, self.world)


def own_row_only(own: np.ndarray, rank: int, world: int) -> np.ndarray:
    """``[world, n]`` of ``nan`` with ``own`` in row ``rank``: what a rank knows of the others' values beyond
    :data:`ROWS_BYTES`."""
    rows = np.full((world, len(own)), NAN)
    rows[rank] = own
    return rows


class TimingVector:
    """The layout of one agreement's vector over ``sites`` and how the ranks' vectors combine, computed once for all.

    Each rank sends a status flag, then per site its configs' statistics and, with a measured objective, each of
    ``extra``'s readings. :meth:`combine` maps ``[world, 1 + slots]`` to the flag of any rank, each site's agreed
    times (:func:`agree`) and measurements (:func:`agree_measure`), the times' spread over the ranks
    (:func:`spread_of`) and, while ``world^2 x slots`` stays within :data:`ROWS_BYTES`, every rank's vector;
    :meth:`split` reads that back into one :class:`SiteTimes` per site. Beyond the bound each rank receives
    ``O(slots)`` values, not ``O(world x slots)``, and holds no ``[world, configs]`` matrix.
    """

    def __init__(self, sites: Sequence[Site], extra: Sequence[str], reduce: str, world: int) -> None:
        self.sites = [(len(site.configs), site.split) for site in sites]
        self.extra, self.reduce, self.world = tuple(extra), reduce, world
        self.slots = sum((1 + len(self.extra)) * n for n, _ in self.sites)
        self.timed = sum(n for n, _ in self.sites)
        self.rows = world * world * (1 + self.slots) * 8 <= ROWS_BYTES

    def combine(self, matrix: np.ndarray) -> np.ndarray:
        """``[world, 1 + slots]`` -> any rank's flag, the agreed values, the spread of the times, every rank's row
        where :attr:`rows`."""
        data, out, spreads, offset = matrix[:, 1:], [np.asarray([float(matrix[:, 0].any())])], [], 0
        for n, split in self.sites:
            out.append(agree(data[:, offset : offset + n], self.reduce, split=split))
            spreads.append(spread_of(data[:, offset : offset + n]))
            for position in range(1, 1 + len(self.extra)):
                out.append(agree_measure(data[:, offset + position * n : offset + (position + 1) * n], self.reduce))
            offset += (1 + len(self.extra)) * n
        out.append(np.hstack(spreads).ravel() if spreads else np.empty(0))
        if self.rows:
            out.append(data.ravel())
        return np.concatenate(out)

    def split(self, combined: np.ndarray, local: Sequence[float], rank: int) -> list[SiteTimes]:
        """One :class:`SiteTimes` per site, from :meth:`combine`'s vector and this rank's own ``local`` vector."""
        agreed, local = combined[1 : 1 + self.slots], np.asarray(local, dtype=np.float64)
        spreads = combined[1 + self.slots : 1 + self.slots + 4 * self.timed].reshape(4, self.timed)
        rows = combined[1 + self.slots + 4 * self.timed :].reshape(self.world, self.slots) if self.rows else None
        out, offset, column = [], 0, 0
        for n, _ in self.sites:
            parts = [slice(offset + k * n, offset + (k + 1) * n) for k in range(1 + len(self.extra))]
            extra = {name: (None if rows is None else rows[:, parts[k]], local[parts[k]], agreed[parts[k]])
                     for k, name in enumerate(self.extra, start=1)}
            out.append(SiteTimes(agreed[parts[0]], local[parts[0]], spreads[:, column : column + n],
                                 None if rows is None else rows[:, parts[0]], extra, rank, self.world))
            offset += (1 + len(self.extra)) * n
            column += n
        return out


def winner_index(agreed: Sequence[float]) -> Optional[int]:
    """argmin, ties to the lowest index; None when every entry is inf (or nan)."""
    best, best_time = None, INF
    for i, t in enumerate(agreed):
        if t < best_time:
            best, best_time = i, t
    return best if best_time < INF and not math.isnan(best_time) else None

#: Tuning calls so far per tuner name: each call's note channel (the same count on every rank of an SPMD job).
_CALLS: defaultdict[str, itertools.count] = defaultdict(itertools.count)


@dataclass(frozen=True)
class SiteResult:
    """The outcome of one site: candidates, agreed times (ms, inf = failed), the winner.

    ``per_rank_ms[r][c]`` is what rank ``r`` measured for config ``c`` (its statistic over the
    timed runs; ``inf``: failed or pruned there). Where the ranks are too many for each to receive every
    rank's times (:data:`ROWS_BYTES`), only this rank's row is known, the others are ``nan``, and ``spread``
    summarises them. For a *split* site each config is timed by one rank only, ``c % world`` of its position
    in the running: the other ranks hold ``nan`` there ("not timed here"), and ``agreed_ms[c]`` is the
    owner's time (``inf`` if it failed on any rank).
    """

    site: SiteId
    configs: tuple
    per_rank_ms: tuple  # [rank][config]
    agreed_ms: tuple
    winner: int
    source: str  # "tuned", "cached", "store" or "pinned"
    split: bool = False  # configs were divided among the ranks (see above)
    #: with a measured objective (:mod:`disttune.objective`): each config's agreed Measurements, its score
    #: (the winner has the lowest) and, for a Pareto option, the configs on the front
    measurements: tuple = ()
    scores: tuple = ()
    front: tuple = ()
    #: ``spread[k][c]``: config ``c``'s :data:`SPREAD` entry ``k`` over the ranks that timed it (min, median and max
    #: ms, the slowest rank), known even where the ranks' rows are not (beyond :data:`ROWS_BYTES`)
    spread: tuple = ()

    @property
    def config(self) -> Any:
        return self.configs[self.winner]


@dataclass(frozen=True)
class TuningReport:
    """What one tuning call did."""

    results: tuple
    function_runs: int
    wall_s: float
    world_size: int
    #: seconds per step of the call, summing to ``wall_s`` (see :mod:`disttune.phases`; empty if not kept)
    phases: dict = field(default_factory=dict)
    #: seconds of work beside the call (compile threads): ``compile busy``, ``compile span``
    background: dict = field(default_factory=dict)

    def __str__(self) -> str:
        """A table people read: per site, its key with names, the winner, its agreed time and where it came from."""
        lines = [f"tuning call: {len(self.results)} site(s) over {self.world_size} rank(s), {self.function_runs} "
                 f"runs of the function, {self.wall_s:.3f} s", "",
                 "| kernel | key | winner | agreed ms | from |", "| --- | --- | --- | ---: | --- |"]
        for r in self.results:
            agreed = f"{r.agreed_ms[r.winner]:.4f}" if r.agreed_ms and 0 <= r.winner < len(r.agreed_ms) else ""
            config = describe_config(r.config) if 0 <= r.winner < len(r.configs) else "(the kernel's cached one)"
            lines.append(f"| {r.site.kernel} | {r.site.key_text()} | {config} | {agreed} | {r.source} |")
        if self.phases:
            lines += ["", "time: " + ", ".join(f"{name} {seconds:.3f} s" for name, seconds in self.phases.items())]
        return "\n".join(lines)


def describe_mismatch(per_rank_sites: list[list[tuple]]) -> Optional[str]:
    """None when every rank has the same site list; else which site differs on which ranks."""
    reference = per_rank_sites[0]
    if all(sites == reference for sites in per_rank_sites):
        return None
    longest = max(len(s) for s in per_rank_sites)
    for position in range(longest):
        groups: dict[Any, list[int]] = {}
        for rank, sites in enumerate(per_rank_sites):
            groups.setdefault(sites[position] if position < len(sites) else None, []).append(rank)
        if len(groups) > 1:
            described = []
            for entry, ranks in groups.items():
                if entry is None:
                    described.append(f"ranks {ranks}: no such launch")
                else:
                    kernel, key, occurrence, configs = entry
                    described.append(
                        f"ranks {ranks}: kernel {kernel} key={key} occurrence={occurrence} with {len(configs)} "
                        f"config(s) [{'; '.join(configs)}]"
                    )
            return (
                f"autotuned launch #{position} differs between ranks (different kernels, keys, or config lists "
                "after pruning):\n  " + "\n  ".join(described)
                + "\nMake the tuning key rank-independent (e.g. a bucketed global size) so all ranks tune the same sites."
            )
    return "site lists differ"  # unreachable: unequal lists differ at some position


def describe_option_mismatch(per_rank_options: list[dict]) -> Optional[str]:
    """None when every rank set the same options; else each differing option with every rank's value."""
    names = sorted({name for options in per_rank_options for name in options})
    lines = []
    for name in names:
        values = [options.get(name) for options in per_rank_options]
        if len(set(values)) > 1:
            lines.append(f"{name}: " + ", ".join(f"rank {r}: {v}" for r, v in enumerate(values)))
    return "\n  ".join(lines) or None


def consensus_verdict(everyone: list[dict]) -> dict:
    """What :meth:`Agreement.consensus` concludes from every rank's findings (in rank order), as plain data: rank
    0's ``run``; the ranks' ``errors`` (``[rank, message]``); a ``refusal`` (the ranks differ in their options, sites
    or pinned table: the error's text); ``split_differs``, the sites whose ``split`` differs; and per site whether
    to ``tune`` it (its kernels' cached config differs), rank 0's store ``answer`` and the ranks where that answer
    ``failing`` in the discovery run. Computed once, by the last arriver where the communicator can
    (:func:`~disttune.comm.combine_objects`): O(ranks x sites) there, and every rank receives O(sites)."""
    verdict: dict[str, Any] = {"run": everyone[0].get("run"), "refusal": None, "split_differs": [], "sites": [],
                               "errors": [[r, d["error"]] for r, d in enumerate(everyone) if d["error"]]}
    if verdict["errors"]:
        return verdict
    differing = describe_option_mismatch([d["options"] for d in everyone])
    mismatch = describe_mismatch([d["sites"] for d in everyone])
    split_views = [d["split"] for d in everyone]
    tables = [d["table"] for d in everyone]
    if differing:
        verdict["refusal"] = ("ranks set different tuning options (every rank must pass the same, and set the same "
                              f"DISTTUNE_* variables):\n  {differing}")
    elif mismatch:
        verdict["refusal"] = f"ranks disagree on what to tune: {mismatch}"
    elif any(view != split_views[0] for view in split_views):
        verdict["split_differs"] = [i for i in range(len(split_views[0])) if len({view[i] for view in split_views}) > 1]
    elif len(set(tables)) != 1:
        verdict["refusal"] = (f"ranks loaded different pinned winner tables (digests by rank: {tables}); deploy the "
                              "same file to all")
    else:
        for index in range(len(everyone[0]["sites"])):
            answer = everyone[0]["lookups"][index]  # rank 0's entry decides for everyone
            verdict["sites"].append({
                "tune": len({d["presets"][index] for d in everyone}) != 1,
                "answer": answer,
                # the ranks that launched that answer in the discovery run and saw it fail
                "failing": [f"rank {r}: {d['failures'][index][answer]}" for r, d in enumerate(everyone)
                            if answer is not None and answer in d["failures"][index]],
            })
    return verdict


def final_run_verdict(everyone: list[dict]) -> dict:
    """What :meth:`Agreement.final_run_status` concludes from every rank's report: the ranks' ``errors`` (``[rank,
    message]``) and each winner that ``failed`` (``[result index, config index, "rank r: message"]``, in rank
    order). Computed once, like :func:`consensus_verdict`."""
    return {"errors": [[r, d["error"]] for r, d in enumerate(everyone) if d["error"]],
            "failed": [[i, config_index, f"rank {rank}: {message}"] for rank, report in enumerate(everyone)
                       for i, config_index, message in report["failed"]]}


def checked_times(site: Site, statistic: Statistic) -> list[float]:
    """``site.local_times(statistic)``; a ValueError naming the config where the statistic of real
    samples is not a time (nan or negative)."""
    times = site.local_times(statistic)
    for index, (ms, samples) in enumerate(zip(times, site.samples)):
        if samples and index not in site.failures and not ms >= 0:
            raise ValueError(f"it gave {ms!r} for config[{index}] {{{config_text(site.configs[index])}}} of "
                             f"{site.id.describe()} from the samples {samples}; a statistic must return a time "
                             "in ms (a number >= 0)")
    return times


def _raise_rank_errors(name: str, what: str, errors: list[tuple[int, str]], local: Optional[BaseException]) -> None:
    """Raise every rank's error (``(rank, message)``) as one TuningError in the one wording
    (:func:`~disttune.errors.failed_on_ranks`), chained to this rank's own exception."""
    text = failed_on_ranks(name, what, [r for r, _ in errors], [f"rank {r}: {msg}" for r, msg in errors])
    if local is not None:
        raise TuningError(text) from local
    raise TuningError(text)


class Agreement:
    """The collectives of one tuner over ``comm``; ``name`` (the wrapped function's) heads every error."""

    def __init__(self, comm: Communicator, name: str, reduce: str = "max", statistic: Statistic = "median",
                 objective: Any = "launch", texts: Optional[dict[str, str]] = None) -> None:
        self.comm, self.name, self.reduce, self.statistic = comm, name, reduce, statistic
        self.objective = objective
        #: the options as the consensus names them (``Options.agreed()``), for the errors that name one
        self.texts = texts or {}
        #: what each gathered vector carries per site beside the times (the same names on every rank)
        self.extra = EXTRA if measured(objective) else ()
        self.channel = f"{name}#{next(_CALLS[name])}"
        #: how this call ends on every rank if it fails on some (enter it around the call: it runs the watcher)
        self.ending = Ending(comm, name, self.channel)
        self._device_waits = 0
        self.run: Optional[str] = None  # the job's run, rank 0's (set by the consensus)

    def _together(self, step: str, own: Sequence[str], collective: Callable[[], T], failed: Optional[str] = None,
                  raised: Optional[BaseException] = None) -> T:
        """Run one collective of this tuning call; ``own`` is this rank's errors, if it brings any, which arose
        where ``failed`` says (default: ``step`` failed; it heads the error, whichever path raises it), from the
        exception ``raised``, if any.

        Those are posted on the call's channel first. When the collective breaks, times out or is left
        for a peer's post, the ranks settle on one verdict (:mod:`disttune.ending`). Without a rendezvous
        store (MPI), this rank's own errors and the collective's exception make the TuningError.
        """
        failed = failed or f"{step} failed"
        self.ending.check(step, failed)
        lines = [f"rank {self.comm.rank}: {msg}" for msg in own]
        self.ending.post_errors(step, lines, failed, raised)
        try:
            result = collective()
        except (CollectiveTimeout, PeerFailed) as err:
            if self.ending.plane is not None:
                raise self.ending.settle(err, step, failed) from err
            if not lines:
                raise
            raise TuningError(failed_on_ranks(self.name, failed, [self.comm.rank], lines)) from err
        self.ending.resumed()
        return result

    def wait_for_device(self, step: str, counted: bool = True) -> None:
        """Wait until this rank's GPU has done the work queued so far, through the communicator's wait loop:
        the collectives' deadline, and a peer's post ends it (the same verdict as a collective's).

        A wait that times out names the ranks that had not reached this point: ``counted`` waits are made
        by every rank at the same points of a tuning call (they are counted); a probe's waits are not.
        Nothing without CUDA."""
        marker = device.marker()
        if marker is None:
            return
        self.ending.check(step)
        plane, behind = self.ending.plane, None
        if counted:
            self._device_waits += 1
        count = self._device_waits
        if plane is not None and counted:
            plane.note_progress(self.channel, count)
            behind = lambda: [r for r, reached in plane.progress(self.channel).items() if reached < count]  # noqa: E731
        try:
            if plane is not None:
                plane.wait_until(marker.query, step, behind=behind)
            else:
                wait_until(self.comm, marker.query, step)
        except (CollectiveTimeout, PeerFailed) as err:
            raise self.ending.settle(err, step) from err

    def consensus(self, sites: Sequence[Site], error: Optional[tuple], options: dict[str, str],
                  split: Sequence[bool], table: Optional[str] = None, pinned: Any = None,
                  run: Optional[str] = None) -> None:
        """One all-gather of what each rank found; the same verdict on every rank, applied to ``sites``.

        ``error``: this rank's discovery error as ``(exception, message)``; ``options``: a stable text
        per option that changes the schedule or the verdict; ``split``: per site, whether it is split;
        ``table``: the pinned table's digest (``pinned`` names it in errors); ``run``: this rank's run
        (:func:`disttune.env.run_id`), rank 0's becomes :attr:`run` on every rank. Sites cached on some ranks
        only are tuned everywhere; rank 0's stored or pinned answer decides a site for every rank, unless
        that config failed on some rank in the discovery run (its own answer there, or a config it tried):
        a stored winner is then tuned again on every rank (the failing ranks score it ``inf``), and a
        pinned one, which is never re-tuned, is a TuningError on every rank.
        """
        mine = {
            "error": error[1] if error else None,
            "options": options,
            "sites": [s.digest()[:4] for s in sites],
            "presets": [s.digest()[4] for s in sites],
            "lookups": [s.local_answer for s in sites],
            "failures": [dict(s.failures) for s in sites],
            "table": table,
            "split": list(split),
            "run": run,
        }
        step = "consensus (site digest)"
        verdict = self._together(step, [error[1]] if error else [],
                                 lambda: combine_objects(self.comm, mine, step, consensus_verdict), NOT_STARTED,
                                 error and error[0])
        self.run = verdict["run"]
        if verdict["errors"]:
            _raise_rank_errors(self.name, NOT_STARTED, verdict["errors"], error[0] if error else None)
        if verdict["refusal"]:
            raise TuningError(f"disttune: {self.name}: {verdict['refusal']}")
        if verdict["split_differs"]:
            differ = [sites[i].id.describe() for i in verdict["split_differs"]]
            raise TuningError(f"disttune: {self.name}: ranks disagree on which sites are split (split= "
                              f"must choose the same sites on every rank): {'; '.join(differ)}")
        missing, broken = [], []
        for site, entry in zip(sites, verdict["sites"]):
            if entry["tune"]:
                site.preset = None  # cached on some ranks only, or differently: tune it everywhere
            answer, failing = entry["answer"], entry["failing"]
            if table is not None:
                site.preset = None
                if answer is None:
                    missing.append(site.id.describe())
                elif failing:
                    broken.append(f"{site.id.describe()}: config[{answer}] {{{config_text(site.configs[answer])}}}: "
                                  + "; ".join(failing))
                site.decided, site.decided_by = answer, "pinned"
            elif site.preset is None and answer is not None:
                if failing:  # tuned again on every rank; the failing ranks score that config inf
                    warnings.warn(f"disttune: {self.name}: the stored winner of {site.id.describe()}, config[{answer}] "
                                  f"{{{config_text(site.configs[answer])}}}, failed on " + "; ".join(failing)
                                  + "; tuning again without it", StoreWarning, stacklevel=3)
                else:
                    site.decided, site.decided_by = answer, "store"
        if missing:
            raise TuningError(f"disttune: {self.name}: pinned table {pinned} has no winner for: " + "; ".join(missing)
                              + ". Export a table that covers these sites (disttune.store.export_table after a "
                              "tuning run).")
        if broken:
            raise TuningError(f"disttune: {self.name}: pinned table {pinned} gives winners that fail on some rank "
                              "(a pinned table is never re-tuned; export one made on these ranks):\n  "
                              + "\n  ".join(broken))

    def leave_with(self, problems: list[str], step: str, raised: Optional[BaseException] = None) -> None:
        """Post this rank's ``problems`` on the call's channel and leave ``step`` without arriving: the peers' wait
        there ends with the post, and every rank raises the one verdict (:mod:`disttune.ending`), here chained to
        ``raised`` (what this rank's run raised, if anything)."""
        failed = f"{step} failed"
        self.ending.check(step, failed)
        self.ending.post_errors(step, [f"rank {self.comm.rank}: {msg}" for msg in problems], failed, raised)
        # the verdict is composed from every rank's posted problems; an error that is already one (a TuningError)
        # would stand as it is, so only the run's own exception is passed on, as the verdict's cause
        cause = raised if isinstance(raised, Exception) and not isinstance(raised, (TuningError, AllConfigsFailed)) \
            else RuntimeError(f"{failed} on rank {self.comm.rank}")
        raise self.ending.settle(cause, step, failed)

    def check_run(self, problems: list[str], step: str, raised: Optional[BaseException] = None) -> None:
        """After each tuning run every rank meets the others, so that no rank starts a run whose collectives a peer
        that failed would leave it waiting in; any rank's problem is the same TuningError on all (chained to
        ``raised``, what the run raised on this rank). ``problems`` start with the run's own exception.

        Through the rendezvous store this is a barrier and a problem travels on the call's posts
        (:meth:`leave_with`); beyond :data:`FENCED_RUNS_MAX_RANKS` ranks it is only a look at the posts (a peer
        that fails later strands this rank in the next run, which ends as any stranding does). Elsewhere (MPI)
        an all-gather of one flag per rank, and of the problems on trouble."""
        if self.ending.plane is not None:
            if problems:
                self.leave_with(problems, step, raised)
            fenced = self.comm.world_size <= FENCED_RUNS_MAX_RANKS
            self._together(step, [], (lambda: self.comm.barrier(step)) if fenced else self._unless_posted)
            return
        flags = self._together(step, problems, lambda: self.comm.all_gather_floats([1.0 if problems else 0.0], step))
        if flags.any():
            self._raise_reports(step, problems, raised)

    def _unless_posted(self) -> None:
        """An unfenced run's end: leave for the verdict if a peer has posted on the call's channel by now (one store
        request at most: a read of the post counter less than a tenth of a second old is reused). A peer that fails
        later strands this rank in the next run's collectives, and that ends like any stranding (:mod:`ending`)."""
        plane, channel = self.ending.plane, self.ending.channel
        if plane.peers_posted(channel):
            raise PeerFailed("posted", plane.posters(channel))

    def _raise_reports(self, step: str, problems: list[str], raised: Optional[BaseException] = None) -> None:
        """Some rank flagged a problem at ``step``: gather every rank's (a second all-gather) and raise them all."""
        reports = self._together(step, problems, lambda: self.comm.all_gather_objects(problems, step + " (errors)"))
        _raise_rank_errors(self.name, f"{step} failed", [(r, msg) for r, msgs in enumerate(reports) for msg in msgs],
                           raised)

    def gather_agreed(self, tuned: Sequence[Site], step: str) -> list[tuple]:
        """One all-gather of every site's per-config statistic; (per-rank matrix, agreed vector) per site."""
        return [(times.per_rank(), times.agreed) for times in self.gather_measured(tuned, step)]

    def gather_measured(self, tuned: Sequence[Site], step: str) -> list[SiteTimes]:
        """One collective of every site's per-config statistic and, with a measured objective, of each
        measurement in :attr:`extra`, combined once over the ranks (:class:`TimingVector`); one
        :class:`SiteTimes` per site.

        A statistic that raises or gives no number on any rank is the same TuningError on all: posted
        (:meth:`leave_with`) through the rendezvous store; elsewhere a status flag leads the vector, and a
        second all-gather, of the reasons, follows only then.
        """
        if not tuned:
            return []
        local: list[float] = []
        problems = []
        width = 1 + len(self.extra)
        try:
            for site in tuned:
                local.extend(checked_times(site, self.statistic))
                for name in self.extra:
                    local.extend(site.local_measures(name, self.statistic))
        except Exception as err:  # the user's statistic: its error goes to every rank
            problems.append(f"statistic {self.texts.get('statistic', repr(self.statistic))} failed: "
                            f"{type(err).__name__}: {err}")
            local = [math.nan] * sum(width * len(site.configs) for site in tuned)
        if problems and self.ending.plane is not None:
            self.leave_with(problems, step)
        vector = TimingVector(tuned, self.extra, self.reduce, self.comm.world_size)
        combined = self._together(step, problems, lambda: combine_floats(
            self.comm, [1.0 if problems else 0.0] + local, step, vector.combine))
        if combined[0]:
            self._raise_reports(step, problems)
        return vector.split(combined, local, self.comm.rank)

    def verdicts(self, tuned: Sequence[Site]) -> list["Verdict"]:
        """The agreement proper: each tuned site's agreed times and winner (None where every config failed or
        was pruned on some rank: :meth:`results` then raises). Computed from gathered data only."""
        verdicts = []
        for site, times in zip(tuned, self.gather_measured(tuned, "agreement")):
            per_rank, agreed, own, spread = times.rows, times.agreed, times.own, times.spread
            if site.screen is not None:  # screened-out configs: screening times
                matrix, agreed = site.with_screening(times.per_rank(), agreed)
                own = matrix[self.comm.rank]
                if per_rank is not None:
                    per_rank, spread = matrix, spread_of(matrix)
            winner = winner_index([agreed[c] if c in site.active else INF for c in range(len(agreed))])
            rows: tuple = ()
            choice = None
            if self.extra:
                rows = tuple(Measurements(float(agreed[c]), **{name: known_value(times.extra[name][2][c])
                                                               for name in self.extra})
                             for c in range(len(agreed)))
                try:
                    choice = choose(self.objective, rows, site.active)
                except ValueError as err:  # computed from agreed values: the same on every rank
                    raise TuningError(f"disttune: {self.name}: objective "
                                      f"{self.texts.get('objective', repr(self.objective))} for "
                                      f"{site.id.describe()}: {err}") from err
                winner = choice.winner
            verdicts.append(Verdict(site, per_rank, agreed, winner, rows, choice,
                                    {name: (readings, mine) for name, (readings, mine, _) in times.extra.items()},
                                    own, spread, self.comm.rank, self.comm.world_size))
        return verdicts

    def results(self, verdicts: Sequence["Verdict"]) -> list[SiteResult]:
        """The :class:`SiteResult` of each verdict; :class:`AllConfigsFailed` on every rank, with each rank's
        reasons, when a site has no winner."""
        dead = [v.site for v in verdicts if v.winner is None]
        if dead:
            self.raise_all_failed(dead)
        return [v.result() for v in verdicts]

    def raise_all_failed(self, dead: Sequence[Site]) -> None:
        """Every config of ``dead`` failed somewhere: gather each rank's reasons and raise them on all."""
        step = "agreement (failures)"
        mine = [dict(s.failures) for s in dead]
        failures = self._together(step, [], lambda: self.comm.all_gather_objects(mine, step))
        parts = []
        for i, site in enumerate(dead):
            lines = [
                f"    config[{c}] {{{site.configs[c]}}}: "
                + "; ".join(f"rank {r}: {rank_failures[i][c]}" for r, rank_failures in enumerate(failures)
                            if c in rank_failures[i])
                for c in range(len(site.configs))
            ]
            parts.append(f"  {site.id.describe()}: every config failed or was pruned on some rank:\n"
                         + "\n".join(lines))
        raise AllConfigsFailed(f"disttune: {self.name}: no config works for:\n" + "\n".join(parts))

    def final_run_status(self, results: Sequence[SiteResult], error: Optional[tuple], failures: dict,
                         step: str) -> dict[tuple, list[str]]:
        """After the final run: one all-gather of its error and its failed split, stored or pinned winners.

        An error on any rank is the same TuningError on all. Returns ``(result index, config index) ->
        ["rank r: message", ...]`` for each winner that failed on some rank (empty: all ran).
        """
        failed = [(i, *failures[r.site]) for i, r in enumerate(results) if r.site in failures]
        status = self._together(step, [error[1]] if error else [], lambda: combine_objects(
            self.comm, {"error": error[1] if error else None, "failed": failed}, step, final_run_verdict),
            FINAL_RUN_FAILED, error and error[0])
        if status["errors"]:
            _raise_rank_errors(self.name, FINAL_RUN_FAILED, status["errors"], error[0] if error else None)
        gathered: dict[tuple, list[str]] = {}
        for i, config_index, message in status["failed"]:
            gathered.setdefault((i, config_index), []).append(message)
        return gathered

    def drop_failed_winners(self, results: list[SiteResult], failed: dict[tuple, list[str]],
                            sites: dict[SiteId, Site]) -> tuple[list[SiteResult], list[tuple]]:
        """Score each split winner that failed in the final run ``inf`` on every rank and take the next best;
        a stored or pinned winner that failed there is a TuningError on every rank. Returns the new results
        and, per dropped winner, ``(new result, config index, messages)``."""
        results = list(results)
        settled = [f"{results[i].site.describe()}: config[{c}] {{{config_text(results[i].configs[c])}}} "
                   f"({results[i].source}): " + "; ".join(messages)
                   for (i, c), messages in sorted(failed.items()) if results[i].source in ("store", "pinned")]
        if settled:
            raise TuningError(f"disttune: {self.name}: a stored or pinned winner failed in the final run on a rank "
                              "that had not tried it before (its own store answer differed); tune it again "
                              "(always_tune=True, or disttune clear) or deploy a table made on these ranks:\n  "
                              + "\n  ".join(settled))
        dropped = []
        for (i, config_index), messages in sorted(failed.items()):
            old = results[i]
            site = sites[old.site]
            site.record_failure(config_index, RuntimeError("; ".join(messages)))
            agreed = list(old.agreed_ms)
            agreed[config_index] = INF
            winner = winner_index([agreed[c] if c in site.active else INF for c in range(len(agreed))])
            if winner is None:
                raise AllConfigsFailed(
                    f"disttune: {self.name}: no config works for:\n  {old.site.describe()}: the last "
                    f"candidate, config[{config_index}] {{{old.configs[config_index]}}}, was timed on one rank "
                    "(split) but failed on others in the final run: " + "; ".join(messages))
            results[i] = replace(old, agreed_ms=tuple(agreed), winner=winner)
            dropped.append((results[i], config_index, messages))
        return results, dropped


def known_value(value: float) -> Optional[float]:
    """A gathered measurement as the objective sees it: None where it was not read."""
    return None if math.isnan(value) else float(value)


def settled_results(sites: Sequence[Site]) -> list[SiteResult]:
    """The sites the consensus decided without tuning: a stored or pinned winner, or the kernels' own cache."""
    results = []
    for site in sites:
        if site.decided is not None:
            results.append(SiteResult(site.id, tuple(site.configs), (), (), site.decided, site.decided_by))
        elif site.preset is not None:
            index = site.configs.index(site.preset) if site.preset in site.configs else -1
            results.append(SiteResult(site.id, tuple(site.configs), (), (), index, "cached"))
    return results


@dataclass(frozen=True)
class Verdict:
    """One tuned site's agreement: the agreed times, the winner (None: every config failed or was pruned on some
    rank), with a measured objective the agreed measurements and the objective's choice; this rank's ``own`` times,
    their ``spread`` over the ranks (``[4, configs]``, :data:`SPREAD`) and every rank's times ``per_rank``
    (``[world, configs]``) where they were sent (:attr:`TimingVector.rows`; else None); ``readings``: per
    measurement ``(per-rank readings or None, this rank's)``."""

    site: Site
    per_rank: Optional[np.ndarray]
    agreed: np.ndarray
    winner: Optional[int]
    measurements: tuple = ()
    choice: Optional[Choice] = None
    readings: dict = field(default_factory=dict)
    own: np.ndarray = field(default_factory=lambda: np.empty(0))
    spread: np.ndarray = field(default_factory=lambda: np.empty((len(SPREAD), 0)))
    rank: int = 0
    world: int = 1

    def result(self) -> SiteResult:
        """The :class:`SiteResult`: every rank's row where they were sent, else this rank's own row and ``nan`` rows
        (one shared tuple: O(world) references, no floats made)."""
        site, choice = self.site, self.choice
        if self.per_rank is not None:
            per_rank = tuple(map(tuple, np.asarray(self.per_rank, dtype=np.float64).tolist()))  # one C pass
        else:
            unknown = (NAN,) * len(site.configs)
            per_rank = (unknown,) * self.rank + (tuple(self.own.tolist()),) + (unknown,) * (self.world - self.rank - 1)
        return SiteResult(site.id, tuple(site.configs), per_rank,
                          tuple(np.asarray(self.agreed, dtype=np.float64).tolist()), self.winner, "tuned", site.split,
                          self.measurements,
                          choice.scores if choice else (), choice.front if choice else (),
                          tuple(map(tuple, np.asarray(self.spread, dtype=np.float64).tolist())))
