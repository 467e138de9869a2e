"""Launch handlers: what an intercepted launch does in each run of a tuning call, one class per run kind.

:mod:`disttune.intercept` hands every autotuned launch inside the wrapped function to the handler
of the current run. Each handler names the launch as a *site* (kernel, Triton's tuning key,
occurrence of that kernel and key within the run; see :mod:`disttune.sites`) and then:

* :class:`Discover` (the first run) registers the site, starts compiling its candidates and
  launches the first config that works on this rank (or a stored / pinned / cached winner);
* :class:`Tune` (each tuning run) launches the config the rank-independent schedule gives the
  site for this run, timed by the Timer when the schedule says so; a config that fails here keeps
  its turns with a stand-in launch and is scored ``inf``;
* :class:`Final` (the run whose result the caller gets) launches the agreed winners, with Triton's
  one reset after benchmarking; a split winner that fails here is recorded for the agreement;
* :class:`Fast` launches the winners of a finished tuning: the tuned fast path
  (:mod:`disttune.fast_path`) hands it the launches its plan does not cover, and a site no winner
  covers to its fallback (:mod:`disttune.unseen`).

Handlers only launch and record; the agreement between ranks lives in :mod:`disttune.agreement`.
Naming a launch costs Triton's key computation and a dictionary update.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

from . import triton_launch as triton
from .compile import CompilePool
from .intercept import triton_run
from .objective import measures_of
from .phases import Phases, span
from .sites import Schedule, Site, SiteId
from .timing import LaunchInfo, Timer


class SiteLaunches:
    """The part every handler shares: a launch with configs to choose between becomes a site."""

    def __init__(self, occurrences: Optional[dict] = None) -> None:
        self.occurrences: dict[tuple, int] = {} if occurrences is None else occurrences

    def launch(self, autotuner: Any, args: tuple, kwargs: dict) -> Any:
        if not triton.has_choice(autotuner):
            try:
                return triton_run(autotuner, *args, **kwargs)
            except TypeError as err:  # a missing argument: say where it comes from when the list was empty
                if triton.empty_config_list(autotuner):
                    raise ValueError(
                        f"disttune: {triton.kernel_name(autotuner)} was given an empty config list "
                        "(triton.autotune(configs=[])), so Triton launches it with one empty Config and its "
                        f"meta-parameters are missing ({err}); give triton.autotune at least one triton.Config"
                    ) from err
                raise
        key = triton.tuning_key(autotuner, args, kwargs)
        name = triton.kernel_name(autotuner)
        occurrence = self.occurrences.get((name, key), 0)
        self.occurrences[(name, key)] = occurrence + 1
        return self.launch_site(SiteId(name, key, occurrence), autotuner, key, args, kwargs)

    def launch_site(self, ident: SiteId, autotuner: Any, key: tuple, args: tuple, kwargs: dict) -> Any:
        raise NotImplementedError

    def finish(self, raised: bool = False) -> list[str]:
        """End of the run (which ``raised`` an exception, or not): what else went wrong on this rank that the peers
        must hear of (none by default)."""
        return []


class Discover(SiteLaunches):
    """The discovery run: registers each site in ``sites`` and launches a config that works here.

    ``lookup(site)`` is this rank's stored or pinned winner for a new site (None: tune it);
    ``always_tune`` ignores winners already in the kernels' caches; ``compiles`` compiles ahead.
    """

    def __init__(self, sites: dict[SiteId, Site], always_tune: bool,
                 lookup: Optional[Callable[[Site], Optional[int]]] = None,
                 compiles: Optional[CompilePool] = None, phases: Optional[Phases] = None) -> None:
        super().__init__()
        self.sites, self.always_tune, self.lookup, self.compiles = sites, always_tune, lookup, compiles
        self.phases = phases

    def launch_site(self, ident: SiteId, autotuner: Any, key: tuple, args: tuple, kwargs: dict) -> Any:
        ident = SiteId(ident.kernel, key, ident.occurrence, triton.key_names(autotuner, args, kwargs))
        configs = triton.candidate_configs(autotuner, args, kwargs)
        for config in configs:
            triton.check_conflicts(autotuner, kwargs, config)
        preset = None if self.always_tune else autotuner.cache.get(key)
        site = Site(ident, autotuner, configs, preset)
        self.sites[ident] = site
        if preset is not None:
            return triton.launch_winner(autotuner, args, kwargs, preset)
        site.local_answer = self.lookup(site) if self.lookup is not None else None
        if site.local_answer is not None:
            # A stored or pinned winner: compile and launch just that one (a warm start compiles nothing else).
            try:
                result = triton.launch_config(autotuner, args, kwargs, configs[site.local_answer])
                site.stand_in = site.local_answer
                return result
            except Exception as err:
                site.record_failure(site.local_answer, err)
        compiling = self.compiles is not None and bool(self.compiles.start(site, args, kwargs))
        for index, config in enumerate(configs):
            if index in site.failures:
                continue
            if compiling:
                with span(self.phases, "compile wait"):  # this config (the rest go on in the background)
                    if not self.compiles.ready(site, index):  # type: ignore[union-attr]
                        continue
            try:
                with span(self.phases if first_launch(self.phases, ident, index) else None, "first launches"):
                    result = triton.launch_config(autotuner, args, kwargs, config)
            except Exception as err:  # a config that fails here is scored inf, not fatal
                site.record_failure(index, err)
                continue
            site.stand_in = index
            return result
        return None  # nothing launches on this rank; agreement fails the site on every rank


def first_launch(phases: Optional[Phases], ident: SiteId, index: int) -> bool:
    """Whether config ``index`` of site ``ident`` launches for the first time (when a breakdown is kept)."""
    return phases is not None and phases.first((ident, index))


def launch_stand_in(site: Site, args: tuple, kwargs: dict, problems: list[str]) -> Any:
    """The site's stand-in config (one that launched fine here), in place of a config that cannot run."""
    if site.stand_in is None:
        return None
    try:
        return triton.launch_config(site.autotuner, args, kwargs, site.configs[site.stand_in])
    except Exception as err:
        problems.append(f"stand-in config of {site.id.describe()} failed: {type(err).__name__}: {err}")
        return None


class Tune(SiteLaunches):
    """Tuning run ``run`` of ``schedule``: each site launches the config the schedule gives it, timed or not.

    ``compiles``: a compile pool still at work (its configs are waited for before their first launch,
    and every compile before a timed launch, so no sample is taken beside a compile)."""

    def __init__(self, sites: dict[SiteId, Site], schedule: Schedule, run: int, timer: Timer, rank: int,
                 compiles: Optional[CompilePool] = None, phases: Optional[Phases] = None) -> None:
        super().__init__()
        self.sites, self.schedule, self.run, self.timer, self.rank = sites, schedule, run, timer, rank
        self.compiles, self.phases = compiles, phases
        self.launched: set[SiteId] = set()
        self.problems: list[str] = []
        self.readers: list[tuple[Site, int, Callable[[], float]]] = []

    def launch_site(self, ident: SiteId, autotuner: Any, key: tuple, args: tuple, kwargs: dict) -> Any:
        site = self.sites.get(ident)
        if site is None:
            self.problems.append(
                f"tuning run {self.run + 1} launched {ident.describe()}, which the discovery run did not: the "
                "wrapped function must launch the same autotuned kernels with the same keys on every run"
            )
            return None
        self.launched.add(ident)
        if site.preset is not None:
            return triton.launch_winner(autotuner, args, kwargs, site.preset)
        position, timed = self.schedule.slot(self.run, len(site.active), site.share)
        index = None if position is None else site.active[position]
        if index is None or index in site.failures:
            return launch_stand_in(site, args, kwargs, self.problems)
        config = site.configs[index]
        if self.compiles is not None and not self._compiled(site, index, timed):
            return launch_stand_in(site, args, kwargs, self.problems)
        try:
            with span(self.phases if first_launch(self.phases, ident, index) else None, "first launches"):
                if not timed:
                    return triton.launch_config(autotuner, args, kwargs, config)
                info = LaunchInfo(site.id.kernel, site.id.key, site.id.occurrence, index, config, self.run, self.rank)
                outcome: dict = {}

                def timed_launch(launch: Callable[[], Any]) -> None:
                    outcome["read"] = self.timer.time(lambda: outcome.__setitem__("result", launch()), info)

                triton.launch_config(autotuner, args, kwargs, config, timed_launch)
                self.readers.append((site, index, outcome["read"]))
                return outcome.get("result")
        except Exception as err:
            site.record_failure(index, err)
            return launch_stand_in(site, args, kwargs, self.problems)

    def _compiled(self, site: Site, index: int, timed: bool) -> bool:
        """Wait for config ``index``'s compile (for a timed launch, for every compile); False if it failed."""
        with span(self.phases, "compile wait"):
            if timed and not self.compiles.idle():  # type: ignore[union-attr]
                self.compiles.finish()  # type: ignore[union-attr]
            return self.compiles.ready(site, index)  # type: ignore[union-attr]

    def finish(self, raised: bool = False) -> list[str]:
        """Read this run's timers into the sites' samples and check that every site launched (unless the run
        ``raised``: the launches it never reached follow from its exception, which is the news)."""
        now = time.time()
        for site, index, read in self.readers:
            site.add_sample(index, read(), now, measures_of(read))
        missing = [ident.describe() for ident in self.sites if ident not in self.launched]
        if missing and not raised:
            self.problems.append(
                "the wrapped function did not launch " + "; ".join(missing)
                + f" in tuning run {self.run + 1}, though the discovery run did: it must launch the same "
                "autotuned kernels with the same keys on every run"
            )
        return self.problems


def launch_fast(ident: SiteId, autotuner: Any, key: tuple, args: tuple, kwargs: dict, winners: dict,
                stale: list[str]) -> Any:
    """A launch with the site's winner, else the kernel's cached one, else its first candidate (noted as stale)."""
    config = winners.get(ident) or autotuner.cache.get(key)
    if config is None:
        config = triton.candidate_configs(autotuner, args, kwargs)[0]
        stale.append(ident.describe())
    return triton.launch_winner(autotuner, args, kwargs, config)


class Final(SiteLaunches):
    """The run with the agreed ``winners``; its result is the caller's.

    Each site's first launch is preceded by Triton's reset after benchmarking (``reset_to_zero``).
    A split site's winner was timed by one rank only, and a stored or pinned winner was rank 0's
    answer, so its first launch here may fail: the failure is kept in ``failures`` (site -> (config
    index, message)) and the run goes on with the stand-in, keeping the function's own collectives paired.
    """

    def __init__(self, sites: dict[SiteId, Site], winners: dict[SiteId, Any]) -> None:
        super().__init__()
        self.sites, self.winners = sites, winners
        self.reset_done: set[SiteId] = set()
        self.failures: dict[SiteId, tuple[int, str]] = {}
        self.stale: list[str] = []

    def launch_site(self, ident: SiteId, autotuner: Any, key: tuple, args: tuple, kwargs: dict) -> Any:
        config = self.winners.get(ident)
        if config is None:
            return launch_fast(ident, autotuner, key, args, kwargs, self.winners, self.stale)
        site = self.sites.get(ident)
        try:
            if ident not in self.reset_done:
                self.reset_done.add(ident)
                triton.reset_before_real_launch(autotuner, args, kwargs, config)
            return triton.launch_winner(autotuner, args, kwargs, config)
        except Exception as err:
            if site is None or not (site.split or site.decided is not None):
                raise
            self.failures.setdefault(ident, (site.configs.index(config), f"{type(err).__name__}: {err}"))
            return launch_stand_in(site, args, kwargs, [])


class Fast(SiteLaunches):
    """Launches after tuning that the fast path's plan does not cover; ``stale`` names untuned sites.

    ``occurrences`` is shared with the fast-path call that hands launches over, so a site is named
    as it would have been had this handler seen the whole call.
    """

    def __init__(self, winners: dict[SiteId, Any], occurrences: Optional[dict] = None, unseen: Any = None) -> None:
        super().__init__(occurrences)
        self.winners = winners
        self.unseen = unseen  # a disttune.unseen.NewKeys: the fallback of sites no winner covers
        self.stale: list[str] = []

    def launch_site(self, ident: SiteId, autotuner: Any, key: tuple, args: tuple, kwargs: dict) -> Any:
        if self.unseen is not None and ident not in self.winners and key not in autotuner.cache:
            return self.unseen.launch(ident, autotuner, key, args, kwargs)
        return launch_fast(ident, autotuner, key, args, kwargs, self.winners, self.stale)
