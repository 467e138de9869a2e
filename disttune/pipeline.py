"""One tuning call as named steps, the protocol both tuners and the sweep run: :class:`TuningCall`.

    discover -> consensus -> tune -> agree -> final -> store

* **discover**: name the call's tuning sites (:class:`~disttune.sites.Site`) and this rank's answer for each
  (a stored or pinned winner), and keep any error of this rank for the consensus;
* **consensus**: one all-gather, so that a mismatch (sites, options, settings, a pinned table) or a rank's
  error is the same clear error on every rank (:meth:`~disttune.agreement.Agreement.consensus`);
* **tune**: time the configs of the sites left to tune (a search narrows them, :mod:`disttune.search`);
* **agree**: one all-gather of every site's times, reduced over the ranks: the same winners everywhere;
  they are logged and committed to the kernels' own caches;
* **final**: run with the winners; an error there on any rank is the same error on all;
* **store**: one writer puts the tuned winners into the winner store (:mod:`disttune.store`).

Each step is a method of that name, replaced by overriding it: the contextual tuner's call
(:class:`disttune.contextual.KernelTuningCall`) discovers sites by intercepting the function's launches
and times each launch in context; the function tuner's (:class:`disttune.function.FunctionTuningCall`)
has one site, its key, and times whole calls. Each step's time is recorded in the call's phases (the
span :data:`SPANS` names, with the finer spans nested inside), which the report carries as
``TuningReport.phases``. :meth:`TuningCall.run` walks the steps inside the call's ending
(:mod:`disttune.ending`): an exception on any rank leaves every rank as the same one.

Also here, for the tuners' steps: :class:`Runs` (the tuning and final runs of an intercepted function),
:func:`step_stages` (the tuning runs of ``objective="step"``), :func:`commit` (winners into the kernels'
caches, with what ``triton.autotune`` leaves on a kernel) and the rank log's records of a verdict.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np

from . import console
from . import triton_launch as triton
from .agreement import (Agreement, SiteResult, TuningError, TuningReport, Verdict, known_value, settled_results,
                        winner_index)
from .checks import OutputCheck, blame, scheduled_configs
from .comm import Communicator
from .compile import CompilePool
from .configs import config_text
from .graphs import capturing
from .handlers import Final, SiteLaunches, Tune, launch_stand_in
from .intercept import intercept
from .logs import RankLog
from .options import Options
from .phases import Phases, span
from .sites import Schedule, Site, SiteId, sample_spread
from .store import is_store_writer, save_winners
from .timing import LaunchInfo, Timer

#: The steps of a tuning call, in order.
STEPS = ("discover", "consensus", "tune", "agree", "final", "store")
#: The span each step's time is recorded under (finer spans, such as compile waits, nest inside).
SPANS = {"discover": "discovery run", "consensus": "collectives", "tune": "tuning runs", "agree": "collectives",
         "final": "final run", "store": "store"}
#: ``LaunchInfo.kernel`` of a whole-run timing (``objective="step"``).
STEP = "<step>"


class TuningCall:
    """One tuning call of the tuner ``name`` over ``comm`` with ``options``: :meth:`run` walks :data:`STEPS`.

    What the steps share lives here: the :class:`~disttune.agreement.Agreement` (and its ending), the
    phases, the sites, this rank's error before the consensus (``error``: ``(exception, message)``), the
    results, the result the call returns and the count of the function's runs. The base class implements
    ``consensus``, ``agree`` and ``store``; a tuner's call implements ``discover``, ``tune`` and ``final``.
    """

    def __init__(self, name: str, comm: Communicator, options: Options) -> None:
        self.name, self.comm, self.options = name, comm, options
        self.agreement = Agreement(comm, name, options.reduce, options.statistic, options.objective,
                                   self.agreed_options())
        self.phases = Phases()
        self.started = time.perf_counter()
        self.sites: dict[SiteId, Site] = {}
        self.error: Optional[tuple] = None
        self.tuned: list[Site] = []
        self.verdicts: list[Verdict] = []
        self.results: list[SiteResult] = []
        self.result: Any = None
        self.function_runs = 0
        self.winners_store: Any = None
        self.table: Optional[dict] = None
        self.log: Optional[RankLog] = None
        self.report: Optional[TuningReport] = None  # set by finish()

    def run(self) -> Any:
        """Every step in turn, each in its span of the phases; returns ``result``. An exception on any rank ends
        every rank alike (:mod:`disttune.ending`), which :meth:`failed` sees."""
        try:
            with self.agreement.ending:
                try:
                    for step in STEPS:
                        with self.phases.span(SPANS[step]):
                            getattr(self, step)()
                    self.finish()
                    return self.result
                finally:
                    self.close()
        except BaseException as err:
            self.failed(err)
            raise

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    # -- the steps ----------------------------------------------------------------------------------------------

    def discover(self) -> None:
        raise NotImplementedError

    def consensus_inputs(self) -> dict[str, Any]:
        """What the consensus compares beyond the sites (keyword arguments of ``Agreement.consensus``)."""
        return {}

    def consensus(self) -> None:
        found = list(self.sites.values())
        self.agreement.consensus(found, self.error, self.agreement.texts, self.split_flags(found),
                                 **self.consensus_inputs())
        self.tuned = [s for s in found if s.preset is None and s.decided is None]

    def split_flags(self, sites: Sequence[Site]) -> list[bool]:
        """Per site, whether its configs are divided among the ranks (``split=``), for the consensus."""
        return [bool(self.options.split)] * len(sites)

    def agreed_options(self) -> dict[str, str]:
        """The text every rank must share: the options and the ``DISTTUNE_*`` settings that change the tuning
        (read once, when the call is made: ``agreement.texts``)."""
        return self.options.agreed()

    def tune(self) -> None:
        raise NotImplementedError

    def agree(self) -> None:
        """The verdicts of the tuned sites (logged before a site without any working config raises), then the
        sites the consensus settled."""
        self.verdicts = self.agreement.verdicts(self.tuned)
        if self.log is not None:
            log_verdicts(self.log, self.verdicts, self.agreement.extra)
        self.results = self.agreement.results(self.verdicts) + settled_results(self.sites.values())
        if self.log is not None:
            log_settled(self.log, self.results)

    def final(self) -> None:
        raise NotImplementedError

    def store(self) -> None:
        """The tuned winners into the store, by one writer (the options' ``store_writer``)."""
        if self.winners_store is not None and self.writes_store():
            save_winners(self.winners_store, [(self.entry(self.sites[r.site]), r, winner_noise(self.sites[r.site], r))
                                              for r in self.results], self.name)

    def writes_store(self) -> bool:
        """Whether this rank is the store's writer (``store_writer``: global rank 0, or local rank 0 per node)."""
        return is_store_writer(self.options.store_writer, self.comm)

    def entry(self, site: Site) -> Any:
        """A site's identity in the winner store."""
        raise NotImplementedError

    def close(self) -> None:
        """After the steps, whatever they ended with (free the compile threads, write the rank log)."""

    def failed(self, error: BaseException) -> None:
        """After :meth:`close`, when the call ends in ``error`` (the error every rank raises)."""

    def finish(self) -> None:
        """After the last step, on every rank: the call's :class:`~disttune.agreement.TuningReport`."""
        wall_s = self.elapsed()
        self.report = TuningReport(tuple(self.results), self.function_runs, wall_s, self.comm.world_size,
                                   self.phases.breakdown(wall_s), self.background())

    def background(self) -> dict[str, float]:
        """Seconds of work done beside the call (compile threads), for the report."""
        return {}


def winner_noise(site: Site, result: SiteResult) -> Optional[float]:
    """The noise of a tuned winner's samples on this rank (what the store keeps for ``disttune verify``)."""
    return sample_spread(site.samples[result.winner]) if 0 <= result.winner < len(site.samples) else None


# -- the rank log's records of a verdict ------------------------------------------------------------------------

#: Up to this many ranks every rank's log holds every rank's time of each config (where it received them); beyond,
#: only rank 0's does, and the others hold their own and the spread over the ranks: O(configs) per rank.
LOGGED_ROWS_MAX_RANKS = 64


def log_verdicts(log: RankLog, verdicts: Sequence[Verdict], extra: Sequence[str]) -> None:
    """Each tuned site's samples, every config's agreed time, per-rank times or this rank's own with their spread
    (:data:`LOGGED_ROWS_MAX_RANKS`), measurements, and its winner."""
    for verdict in verdicts:
        site, choice = verdict.site, verdict.choice
        every_rank = verdict.per_rank is not None and (verdict.world <= LOGGED_ROWS_MAX_RANKS or verdict.rank == 0)
        taken = [(at, index, iteration, ms) for index, samples in enumerate(site.samples)
                 for iteration, (ms, at) in enumerate(zip(samples, site.sample_times[index]))]
        for at, index, iteration, ms in sorted(taken):  # in the order they were taken: the configs interleave
            log.measure(site.id.kernel, site.id.key, index, config_text(site.configs[index]), iteration, ms, at)
        for c, config in enumerate(site.configs):
            measures = None
            if choice is not None:
                measures = {"agreed": {name: getattr(verdict.measurements[c], name) for name in extra},
                            "per_rank": {name: [known_value(v) for v in readings[:, c]]
                                         for name, (readings, _) in verdict.readings.items()} if every_rank else None,
                            "own": {name: known_value(own[c]) for name, (_, own) in verdict.readings.items()},
                            "score": choice.scores[c], "front": c in choice.front}
            log.config_result(site.id.kernel, site.id.key, site.id.occurrence, c, config_text(config),
                              verdict.per_rank[:, c].tolist() if every_rank else None, float(verdict.agreed[c]),
                              site.failures.get(c), measures, float(verdict.own[c]), verdict.spread[:, c].tolist())
        if verdict.winner is not None:
            log.winner(site.id.kernel, site.id.key, site.id.occurrence, verdict.winner,
                       config_text(site.configs[verdict.winner]), float(verdict.agreed[verdict.winner]), "tuned")


def log_settled(log: RankLog, results: Sequence[SiteResult]) -> None:
    """The winner record of each site decided by the store or a pinned table."""
    for r in results:
        if r.source in ("store", "pinned"):
            log.winner(r.site.kernel, r.site.key, r.site.occurrence, r.winner, config_text(r.configs[r.winner]),
                       float("nan"), r.source)


# -- the runs of an intercepted function --------------------------------------------------------------------------

def refuse_graph_capture(name: str) -> None:
    """Tuning synchronizes (CUDA events, the peers' agreement), which a CUDA graph capture forbids:
    a clear error instead of an invalidated capture."""
    if capturing():
        raise TuningError(f"disttune: {name} is being captured in a CUDA graph but is not tuned: tuning runs the function "
                          "many times and synchronizes with the GPU and the peers. Call it once before the capture "
                          "(the warm-up torch.cuda.graph asks for anyway); the captured call then takes the tuned "
                          "fast path")


def run_once(fn: Callable[..., Any], handler: SiteLaunches, args: tuple, kwargs: dict) -> tuple[Any, Optional[tuple]]:
    """One run of ``fn`` with its launches routed to ``handler``; returns (result, None) or
    (None, (exception, message)): the exception is kept to be shared with the peers, not raised."""
    with intercept(handler):
        try:
            return fn(*args, **kwargs), None
        except Exception as err:
            return None, (err, f"{type(err).__name__}: {err}")


def run_problems(error: Optional[tuple], handler: SiteLaunches) -> list[str]:
    """What one run brings to its check: the exception it raised first (the cause), then what else went wrong."""
    return ([error[1]] if error else []) + handler.finish(raised=error is not None)


class Runs:
    """The tuning and final runs of one tuning call of ``fn(*args, **kwargs)`` over ``sites``."""

    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: dict, sites: dict[SiteId, Site],
                 agreement: Agreement, timer: Timer, progress: bool = False,
                 compiles: Optional[CompilePool] = None, phases: Optional[Phases] = None) -> None:
        self.fn, self.args, self.kwargs, self.sites = fn, args, kwargs, sites
        self.agreement, self.timer, self.progress = agreement, timer, progress
        self.check: Optional[OutputCheck] = None  # check=: each run's result against the reference
        self.compiles, self.phases = compiles, phases  # a pool still compiling; the call's breakdown

    def stage(self, schedule: Schedule, label: str) -> int:
        """Run the function ``schedule.runs`` times, checking with the peers after each run; returns the count."""
        comm = self.agreement.comm
        bar = console.progress_bar(self.progress and comm.rank == 0, schedule.runs,
                                   f"disttune {self.agreement.name}: {label}s")
        for run in range(schedule.runs):
            handler = Tune(self.sites, schedule, run, self.timer, comm.rank, self.compiles, self.phases)
            result, error = run_once(self.fn, handler, self.args, self.kwargs)
            # the timers and the output check read the GPU's results: wait for them as for a collective
            self.agreement.wait_for_device(f"{label} {run + 1}/{schedule.runs} (on the GPU)")
            problems = run_problems(error, handler)
            if self.check is not None and error is None and not self.check.matches(result):
                blame(self.sites, scheduled_configs(self.sites.values(), schedule, run))
            with span(self.phases, "collectives"):
                self.agreement.check_run(problems, f"{label} {run + 1}/{schedule.runs}", error and error[0])
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        return schedule.runs

    def final(self, results: list[SiteResult], winners: dict[SiteId, Any], log: RankLog,
              commit: Callable[[list[SiteResult]], dict]) -> tuple[Any, list[SiteResult], int]:
        """The final run with the winners, ended by a status exchange; returns (its result, the results, runs made).

        An exception in the run on any rank is the same TuningError on every rank, so no rank returns
        while another raises (a world of one raises the exception itself). A split winner was timed by one
        rank only, so this run is also its first launch on the others: one that failed anywhere is scored
        ``inf`` on every rank, the next best is committed and the run is repeated.
        """
        runs = 0
        while True:
            handler = Final(self.sites, winners)
            result, error = run_once(self.fn, handler, self.args, self.kwargs)
            runs += 1
            if error is not None and self.agreement.comm.world_size == 1:
                raise error[0]
            failed = self.agreement.final_run_status(results, error, handler.failures, f"final run {runs}")
            if not failed:
                return result, results, runs
            results, dropped = self.agreement.drop_failed_winners(results, failed, self.sites)
            for new, config_index, messages in dropped:
                log.config_result(new.site.kernel, new.site.key, new.site.occurrence, config_index,
                                  config_text(new.configs[config_index]), [math.nan] * self.agreement.comm.world_size,
                                  math.inf, "failed in the final run: " + "; ".join(messages))
                log.winner(new.site.kernel, new.site.key, new.site.occurrence, new.winner,
                           config_text(new.configs[new.winner]), new.agreed_ms[new.winner], "tuned")
            winners = commit(results)


def commit(sites: dict[SiteId, Site], results: Sequence[SiteResult], wall_s: float = 0.0) -> dict[SiteId, Any]:
    """Each site's winner into its kernel's own cache (later launches, inside or outside, use it), with what
    ``triton.autotune`` sets after benchmarking (:func:`keep_triton_attributes`); returns the winners by site.
    A kernel's cache holds one config per key: its first occurrence's."""
    winners, committed = {}, set()
    for result in sorted(results, key=lambda r: r.site.occurrence):
        site = sites[result.site]
        config = site.preset if result.source == "cached" else result.config
        winners[result.site] = config
        if (id(site.autotuner), result.site.key) not in committed:
            committed.add((id(site.autotuner), result.site.key))
            site.autotuner.cache[result.site.key] = config
            keep_triton_attributes(site, result, config, wall_s)
    return winners


def keep_triton_attributes(site: Site, result: SiteResult, config: Any, wall_s: float) -> None:
    """What Triton's ``Autotuner.run`` leaves on the kernel after benchmarking, so code that reads it after
    ``triton.autotune`` keeps working: ``best_config``, ``bench_time`` (the tuning call's seconds) and, for a
    site tuned here, ``configs_timings``: per config, ``[agreed ms, 20th, 80th percentile of this rank's
    samples]`` (Triton's median, 20th and 80th percentile; ``inf`` for a config that failed, ``nan`` where
    this rank took no sample)."""
    autotuner = site.autotuner
    autotuner.best_config = config
    autotuner.bench_time = wall_s
    if result.source != "tuned" or not result.agreed_ms:
        return
    timings = {}
    for index, candidate in enumerate(result.configs):
        samples = site.samples[index] if index < len(site.samples) else []
        low, high = (np.percentile(samples, [20, 80]).tolist() if samples else [math.nan, math.nan])
        timings[candidate] = [float(result.agreed_ms[index]), float(low), float(high)]
    autotuner.configs_timings = timings


# -- objective="step": whole runs timed with the configs in place -----------------------------------------------

def joint(sites: Sequence[Site]) -> bool:
    """Whether the sites share one config list (then ``"step"`` tunes them together)."""
    lists = {tuple(config_text(c) for c in site.configs) for site in sites}
    return len(lists) == 1


class StepTune(SiteLaunches):
    """One tuning run of the step objective: the sites in ``tuning`` launch the schedule's config (untimed:
    the whole run is timed), every other site the config ``fixed`` gives it, else its stand-in."""

    def __init__(self, sites: dict[SiteId, Site], schedule: Schedule, run: int, tuning: set[SiteId],
                 fixed: dict[SiteId, int]) -> None:
        super().__init__()
        self.sites, self.schedule, self.run, self.tuning, self.fixed = sites, schedule, run, tuning, fixed
        self.tried: dict[SiteId, int] = {}  # what each tuned site tried in this run (not its stand-in)
        self.launched: set[SiteId] = set()
        self.problems: list[str] = []

    def launch_site(self, ident: SiteId, autotuner: Any, key: tuple, args: tuple, kwargs: dict) -> Any:
        site = self.sites.get(ident)
        if site is None:
            self.problems.append(f"tuning run {self.run + 1} launched {ident.describe()}, which the discovery run "
                                 "did not: the wrapped function must launch the same autotuned kernels on every run")
            return None
        self.launched.add(ident)
        if site.preset is not None:
            return triton.launch_winner(autotuner, args, kwargs, site.preset)
        index = self.fixed.get(ident, site.stand_in)
        if ident in self.tuning:
            position, _ = self.schedule.slot(self.run, len(site.active))
            index = None if position is None else site.active[position]
        if index is None or index in site.failures:
            return launch_stand_in(site, args, kwargs, self.problems)
        try:
            result = triton.launch_config(autotuner, args, kwargs, site.configs[index])
        except Exception as err:
            site.record_failure(index, err)
            return launch_stand_in(site, args, kwargs, self.problems)
        if ident in self.tuning:
            self.tried[ident] = index
        return result

    def finish(self, raised: bool = False) -> list[str]:
        missing = [ident.describe() for ident in self.sites if ident not in self.launched]
        if missing and not raised:  # a run that raised never reached them: its exception is the news
            self.problems.append("the wrapped function did not launch " + "; ".join(missing)
                                 + f" in tuning run {self.run + 1}, though the discovery run did")
        return self.problems


def step_stages(runs: Runs, tuned: Sequence[Site], n_warmup: int, n_repeat: int,
                check: Optional[OutputCheck] = None) -> int:
    """The tuning runs of ``objective="step"``; returns how many were made.

    The Timer wraps each whole run (with the configs under test in place): it sees what a launch's own
    time cannot, a config that slows the communication beside it. Sites that share one config list are
    tuned **jointly** (run ``r`` tries config ``c`` at every site, ``C * (n_warmup + n_repeat)`` runs), else
    **coordinate-wise**, one site at a time in the order of discovery, the others on the winners agreed so
    far (``sum(C_s) * (n_warmup + n_repeat)`` runs, plus one small all-gather after each site). The Timer sees
    a whole-run timing as a :class:`~disttune.timing.LaunchInfo` whose ``kernel`` is :data:`STEP`.
    """
    if not tuned:
        return 0
    groups = [list(tuned)] if joint(tuned) else [[site] for site in tuned]
    fixed: dict[SiteId, int] = {}
    agreement, rank = runs.agreement, runs.agreement.comm.rank
    total = 0
    for number, group in enumerate(groups):
        schedule = Schedule(max(len(site.active) for site in group), n_warmup, n_repeat)
        label = "step tuning run" + ("" if len(groups) == 1 else f" (site {number + 1} of {len(groups)})")
        for run in range(schedule.runs):
            handler = StepTune(runs.sites, schedule, run, {site.id for site in group}, fixed)
            position, timed = schedule.slot(run, schedule.longest)
            outcome: dict = {}

            def whole_run() -> None:
                outcome["result"], outcome["error"] = run_once(runs.fn, handler, runs.args, runs.kwargs)

            read: Optional[Callable[[], float]] = None
            if timed:
                info = LaunchInfo(STEP, (), 0, position if position is not None else -1, None, run, rank)
                read = runs.timer.time(whole_run, info)
            else:
                whole_run()
            # the timer and the output check read the GPU's results: wait for them as for a collective
            agreement.wait_for_device(f"{label} {run + 1}/{schedule.runs} (on the GPU)")
            error = outcome["error"]
            problems = run_problems(error, handler)
            if check is not None and error is None and not check.matches(outcome["result"]):
                blame(runs.sites, handler.tried)
            if read is not None and error is None:
                ms, now = read(), time.time()
                for ident, index in handler.tried.items():
                    runs.sites[ident].add_sample(index, ms, now)
            agreement.check_run(problems, f"{label} {run + 1}/{schedule.runs}", error and error[0])
        total += schedule.runs
        if len(groups) > 1:  # coordinate-wise: the next site runs beside this one's agreed winner
            (site,) = group
            ((_, agreed),) = agreement.gather_agreed([site], f"step agreement, site {number + 1}")
            best = winner_index(list(agreed))
            if best is not None:
                fixed[site.id] = best
    return total
