"""The cross-rank protocol of a tuning call: every collective the tuners make, and the verdict each one gives.

After the launches have been intercepted, named as sites and timed (:mod:`disttune.handlers`), the
ranks agree here. Every verdict is computed from gathered data only, so every rank reaches the same
one: the same winners, or the same :class:`TuningError` with the same message, before the next
collective. In the order a tuning call meets them:

1. :meth:`Agreement.consensus` (one all-gather): the discovery run's error, the options that change
   the schedule or the verdict, each rank's site digests, which sites are split, the pinned table's
   digest, each rank's stored/pinned answer (rank 0's decides for everyone, unless it failed to launch
   on some rank in the discovery run: then a stored winner is tuned again without it, a pinned one is
   an error);
2. :meth:`Agreement.check_run` (one all-gather of a flag per run, a second only on trouble): an
   error in any rank's tuning run is an error on all;
3. :meth:`Agreement.gather_agreed` (one all-gather of every site's per-config statistic, and of each
   measurement a measured objective reads, :mod:`disttune.measures`) and :meth:`Agreement.verdicts`: the
   agreed vector (``reduce`` over ranks, ``inf`` where a config failed on any rank), the winner (argmin,
   ties to the lowest index; a measured objective's lowest score), :class:`SiteResult` per site; every
   config failing is :class:`~disttune.sites.AllConfigsFailed`, with each rank's reasons;
4. :meth:`Agreement.final_run_status` (one all-gather after the final run): an error or a split
   winner failing on any rank in the final run; :meth:`Agreement.drop_failed_winners` scores
   such winners ``inf`` and takes the next best.

Each collective is bounded by the communicator's timeout (:mod:`disttune.comm`), and so is every wait
for the GPU (:meth:`Agreement.wait_for_device`). A rank that brings an error of its own to a collective
also posts it on the tuning call's channel, so a peer held up elsewhere (inside the function's own
collective, or behind it on the GPU) still hears of it: any wait here that breaks, times out or is
left for a peer's post ends in the one verdict of :mod:`disttune.ending`, the same on every rank.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Sequence, TypeVar

from . import device
from .comm import CollectiveTimeout, Communicator, PeerFailed, wait_until
from .compat import config_text
from .ending import Ending
from .errors import TuningError
from .logs import RankLog
from .measures import EXTRA, Measurements, choose, measured
from .options import describe_value
from .sites import AllConfigsFailed, Site, SiteId, Statistic, agree, agree_measure, describe_config, winner_index
from .store import StoreWarning

INF = float("inf")
T = TypeVar("T")

#: Tuning calls so far per tuner name: each call's note channel (the same count on every rank of an SPMD job).
_CALLS: defaultdict[str, itertools.count] = defaultdict(itertools.count)


@dataclass(frozen=True)
class SiteResult:
    """The outcome of one site: candidates, agreed times (ms, inf = failed), the winner.

    ``per_rank_ms[r][c]`` is what rank ``r`` measured for config ``c`` (its statistic over the
    timed runs; ``inf``: failed or pruned there). For a *split* site each config is timed by one
    rank only, ``c % world`` of its position in the running: the other ranks hold ``nan`` there
    ("not timed here"), and ``agreed_ms[c]`` is the owner's time (``inf`` if it failed on any rank).
    """

    site: SiteId
    configs: tuple
    per_rank_ms: tuple  # [rank][config]
    agreed_ms: tuple
    winner: int
    source: str  # "tuned", "cached", "store" or "pinned"
    split: bool = False  # configs were divided among the ranks (see above)
    #: with a measured objective (:mod:`disttune.measures`): each config's agreed Measurements, its score
    #: (the winner has the lowest) and, for a Pareto option, the configs on the front
    measurements: tuple = ()
    scores: tuple = ()
    front: tuple = ()

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


def _raise_rank_errors(message: str, errors: list[tuple[int, str]], local: Optional[tuple]) -> None:
    """Raise ``message`` and every rank's error as one TuningError, chained to this rank's own exception."""
    text = (message + " on rank(s) " + ", ".join(str(r) for r, _ in errors) + ":\n  "
            + "\n  ".join(f"rank {r}: {msg}" for r, msg in errors))
    if local:
        raise TuningError(text) from local[0]
    raise TuningError(text)


class Agreement:
    """The collectives of one tuner over ``comm``; ``name`` (the wrapped function's) heads every error."""

    def __init__(self, comm: Communicator, name: str, reduce: str = "max", statistic: Statistic = "median",
                 objective: Any = "launch") -> None:
        self.comm, self.name, self.reduce, self.statistic = comm, name, reduce, statistic
        self.objective = objective
        #: what each gathered vector carries per site beside the times (the same names on every rank)
        self.extra = EXTRA if measured(objective) else ()
        self.channel = f"{name}#{next(_CALLS[name])}"
        #: how this call ends on every rank if it fails on some (enter it around the call: it runs the watcher)
        self.ending = Ending(comm, name, self.channel)
        self._device_waits = 0
        self.run: Optional[str] = None  # the job's run, rank 0's (set by the consensus)

    def _together(self, step: str, own: Sequence[str], collective: Callable[[], T]) -> T:
        """Run one collective of this tuning call; ``own`` is this rank's errors, if it brings any.

        Those are posted on the call's channel first. When the collective breaks, times out or is left
        for a peer's post, the ranks settle on one verdict (:mod:`disttune.ending`). Without a rendezvous
        store (MPI), this rank's own errors and the collective's exception make the TuningError.
        """
        self.ending.check(step)
        lines = [f"rank {self.comm.rank}: {msg}" for msg in own]
        self.ending.post_errors(step, lines)
        try:
            return collective()
        except (CollectiveTimeout, PeerFailed) as err:
            if self.ending.plane is not None:
                raise self.ending.settle(err, step) from err
            if not lines:
                raise
            raise TuningError(f"disttune: {self.name}: {step} failed on some rank(s):\n  " + "\n  ".join(lines)) from err

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
        everyone = self._together(step, [error[1]] if error else [],
                                  lambda: self.comm.all_gather_objects(mine, step))
        self.run = everyone[0].get("run")
        failed = [(r, d["error"]) for r, d in enumerate(everyone) if d["error"]]
        if failed:
            _raise_rank_errors(f"disttune: {self.name}: the discovery run raised", failed, error)
        differing = describe_option_mismatch([d["options"] for d in everyone])
        if differing:
            raise TuningError(f"disttune: {self.name}: ranks set different tuning options (every rank must pass "
                              f"the same, and set the same DISTTUNE_* variables):\n  {differing}")
        mismatch = describe_mismatch([d["sites"] for d in everyone])
        if mismatch:
            raise TuningError(f"disttune: {self.name}: ranks disagree on what to tune: {mismatch}")
        split_views = [d["split"] for d in everyone]
        if any(view != split_views[0] for view in split_views):
            differ = [site.id.describe() for i, site in enumerate(sites) if len({view[i] for view in split_views}) > 1]
            raise TuningError(f"disttune: {self.name}: ranks disagree on which sites are split (split= "
                              f"must choose the same sites on every rank): {'; '.join(differ)}")
        if len({d["table"] for d in everyone}) != 1:
            raise TuningError(f"disttune: {self.name}: ranks loaded different pinned winner tables "
                              f"(digests by rank: {[d['table'] for d in everyone]}); deploy the same file to all")
        missing, broken = [], []
        for index, site in enumerate(sites):
            if len({d["presets"][index] for d in everyone}) != 1:
                site.preset = None  # cached on some ranks only, or differently: tune it everywhere
            answer = everyone[0]["lookups"][index]  # rank 0's entry decides for everyone
            # the ranks that launched that answer in the discovery run and saw it fail
            failing = [f"rank {r}: {d['failures'][index][answer]}" for r, d in enumerate(everyone)
                       if answer is not None and answer in d["failures"][index]]
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

    def check_run(self, problems: list[str], step: str) -> None:
        """After each tuning run: one flag per rank; any rank's problem is the same TuningError on all."""
        flags = self._together(step, problems, lambda: self.comm.all_gather_floats([1.0 if problems else 0.0], step))
        if flags.any():
            reports = self._together(step, problems, lambda: self.comm.all_gather_objects(problems, step + " (errors)"))
            lines = [f"rank {r}: {msg}" for r, msgs in enumerate(reports) for msg in msgs]
            raise TuningError(f"disttune: {self.name}: {step} failed on some rank(s):\n  " + "\n  ".join(lines))

    def gather_agreed(self, tuned: Sequence[Site], step: str) -> list[tuple]:
        """One all-gather of every site's per-config statistic; (per-rank matrix, agreed vector) per site."""
        return [(per_rank, agreed) for per_rank, agreed, _ in self.gather_measured(tuned, step)]

    def gather_measured(self, tuned: Sequence[Site], step: str) -> list[tuple]:
        """One all-gather of every site's per-config statistic and, with a measured objective, of each
        measurement in :attr:`extra`; (per-rank matrix, agreed vector, ``{name: (per-rank, agreed)}``) per site.

        The vector (the same length on every rank: a slot per site x config x (time + extra)) starts with
        a status flag: a statistic that raises or gives no number on any rank is the same TuningError on
        all (a second all-gather, of the reasons, only then).
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
            problems.append(f"statistic {describe_value(self.statistic)} failed: {type(err).__name__}: {err}")
            local = [math.nan] * sum(width * len(site.configs) for site in tuned)
        gathered = self._together(step, problems,
                                  lambda: self.comm.all_gather_floats([1.0 if problems else 0.0] + local, step))
        if gathered[:, 0].any():
            reports = self._together(step, problems,
                                     lambda: self.comm.all_gather_objects(problems, step + " (errors)"))
            lines = [f"rank {r}: {msg}" for r, msgs in enumerate(reports) for msg in msgs]
            raise TuningError(f"disttune: {self.name}: {step} failed on some rank(s):\n  " + "\n  ".join(lines))
        gathered = gathered[:, 1:]
        out, offset = [], 0
        for site in tuned:
            n = len(site.configs)
            per_rank = gathered[:, offset : offset + n]
            extra = {}
            for position, name in enumerate(self.extra, start=1):
                readings = gathered[:, offset + position * n : offset + (position + 1) * n]
                extra[name] = (readings, agree_measure(readings, self.reduce))
            offset += width * n
            out.append((per_rank, agree(per_rank, self.reduce, split=site.split), extra))
        return out

    def verdicts(self, tuned: Sequence[Site], log: Optional[RankLog] = None) -> list[SiteResult]:
        """The agreement proper: each tuned site's agreed times and winner (logged per rank when ``log``)."""
        results, dead = [], []
        for site, (per_rank, agreed, extra) in zip(tuned, self.gather_measured(tuned, "agreement")):
            per_rank, agreed = site.with_screening(per_rank, agreed)  # screened-out configs: screening times
            winner = winner_index([agreed[c] if c in site.active else INF for c in range(len(agreed))])
            rows, choice = (), None
            if self.extra:
                rows = tuple(Measurements(float(agreed[c]), **{name: _known(extra[name][1][c]) for name in self.extra})
                             for c in range(len(agreed)))
                try:
                    choice = choose(self.objective, rows, site.active)
                except ValueError as err:  # computed from agreed values: the same on every rank
                    raise TuningError(f"disttune: {self.name}: objective {describe_value(self.objective)} for "
                                      f"{site.id.describe()}: {err}") from err
                winner = choice.winner
            if log is not None:
                for index, samples in enumerate(site.samples):
                    for iteration, (ms, at) in enumerate(zip(samples, site.sample_times[index])):
                        log.measure(site.id.kernel, site.id.key, index, config_text(site.configs[index]), iteration,
                                    ms, at)
                for c, config in enumerate(site.configs):
                    measures = None
                    if choice is not None:
                        measures = {"agreed": {name: getattr(rows[c], name) for name in self.extra},
                                    "per_rank": {name: [_known(v) for v in readings[:, c]]
                                                 for name, (readings, _) in extra.items()},
                                    "score": choice.scores[c], "front": c in choice.front}
                    log.config_result(site.id.kernel, site.id.key, site.id.occurrence, c, config_text(config),
                                      list(per_rank[:, c]), float(agreed[c]), site.failures.get(c), measures)
            if winner is None:
                dead.append(site)
                continue
            if log is not None:
                log.winner(site.id.kernel, site.id.key, site.id.occurrence, winner, config_text(site.configs[winner]),
                           float(agreed[winner]), "tuned")
            results.append(SiteResult(site.id, tuple(site.configs), tuple(tuple(map(float, row)) for row in per_rank),
                                      tuple(map(float, agreed)), winner, "tuned", site.split, rows,
                                      choice.scores if choice else (), choice.front if choice else ()))
        if dead:
            self.raise_all_failed(dead)
        return results

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
        everyone = self._together(step, [error[1]] if error else [], lambda: self.comm.all_gather_objects(
            {"error": error[1] if error else None, "failed": failed}, step))
        errors = [(r, d["error"]) for r, d in enumerate(everyone) if d["error"]]
        if errors:
            _raise_rank_errors(f"disttune: {self.name}: the final run (with the winners) failed", errors, error)
        gathered: dict[tuple, list[str]] = {}
        for rank, report in enumerate(everyone):
            for i, config_index, msg in report["failed"]:
                gathered.setdefault((i, config_index), []).append(f"rank {rank}: {msg}")
        return gathered

    def drop_failed_winners(self, results: list[SiteResult], failed: dict[tuple, list[str]],
                            sites: dict[SiteId, Site], log: RankLog) -> list[SiteResult]:
        """Score each split winner that failed in the final run ``inf`` on every rank and take the next best;
        a stored or pinned winner that failed there is a TuningError on every rank."""
        results = list(results)
        settled = [f"{results[i].site.describe()}: config[{c}] {{{config_text(results[i].configs[c])}}} "
                   f"({results[i].source}): " + "; ".join(messages)
                   for (i, c), messages in sorted(failed.items()) if results[i].source in ("store", "pinned")]
        if settled:
            raise TuningError(f"disttune: {self.name}: a stored or pinned winner failed in the final run on a rank "
                              "that had not tried it before (its own store answer differed); tune it again "
                              "(always_tune=True, or disttune clear) or deploy a table made on these ranks:\n  "
                              + "\n  ".join(settled))
        for (i, config_index), messages in sorted(failed.items()):
            old = results[i]
            site = sites[old.site]
            site.record_failure(config_index, RuntimeError("; ".join(messages)))
            agreed = list(old.agreed_ms)
            agreed[config_index] = INF
            winner = winner_index([agreed[c] if c in site.active else INF for c in range(len(agreed))])
            log.config_result(old.site.kernel, old.site.key, old.site.occurrence, config_index,
                              str(old.configs[config_index]), [float("nan")] * self.comm.world_size, INF,
                              "failed in the final run: " + "; ".join(messages))
            if winner is None:
                raise AllConfigsFailed(
                    f"disttune: {self.name}: no config works for:\n  {old.site.describe()}: the last "
                    f"candidate, config[{config_index}] {{{old.configs[config_index]}}}, was timed on one rank "
                    "(split) but failed on others in the final run: " + "; ".join(messages))
            log.winner(old.site.kernel, old.site.key, old.site.occurrence, winner, str(old.configs[winner]),
                       agreed[winner], "tuned")
            results[i] = replace(old, agreed_ms=tuple(agreed), winner=winner)
        return results


def _known(value: float) -> Optional[float]:
    """A gathered measurement as the objective sees it: None where it was not read."""
    return None if math.isnan(value) else float(value)


def settled_results(sites: Sequence[Site], log: Optional[RankLog] = None) -> list[SiteResult]:
    """The sites the consensus decided without tuning: a stored or pinned winner, or the kernels' own cache."""
    results = []
    for site in sites:
        if site.decided is not None:
            if log is not None:
                log.winner(site.id.kernel, site.id.key, site.id.occurrence, site.decided,
                           config_text(site.configs[site.decided]), float("nan"), site.decided_by)
            results.append(SiteResult(site.id, tuple(site.configs), (), (), site.decided, site.decided_by))
        elif site.preset is not None:
            index = site.configs.index(site.preset) if site.preset in site.configs else -1
            results.append(SiteResult(site.id, tuple(site.configs), (), (), index, "cached"))
    return results
