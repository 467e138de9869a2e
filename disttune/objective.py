"""What a tuning minimises (``objective=``, checked by :func:`disttune.options.check_objective`): each launch's
own time, or the time of the whole function run.

* ``"launch"`` (the default): the Timer wraps each intercepted launch (CUDA events around it on
  GPUs), in context: the other launches and the communication of the run go on around it.
* ``"step"``: the Timer wraps the whole run of the wrapped function (CUDA events on the current
  stream around the run on GPUs, the host clock elsewhere), with the configs under test in place.
  It sees what a launch's own time cannot: a GEMM config that occupies the SMs or the memory a
  communication kernel beside it needs makes the step slower while its own launch looks fast.

With several tuned sites, ``"step"`` tunes them **jointly** when they share one config list (run
``r`` tries config ``c`` at every site, so ``C * (n_warmup + n_repeat)`` tuning runs for ``C``
configs, and every site gets the same winner), else **coordinate-wise**, one site at a time in the
order of discovery, the others on the winners agreed so far (sites not reached yet on their first
working config): ``sum(C_s) * (n_warmup + n_repeat)`` tuning runs, plus one small all-gather after
each site. Either way plus the discovery and the final run. ``early_stop`` and ``split`` are
launch-level tools and cannot be combined with ``"step"``.

The Timer sees a whole-run timing as a :class:`~disttune.timing.LaunchInfo` whose ``kernel`` is
:data:`STEP` (``key=()``, ``occurrence=0``, ``config_index`` the position of the configs tried).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional, Sequence

from . import triton_launch as triton
from .checks import OutputCheck, blame
from .compat import config_text
from .engine import Runs, run_once
from .handlers import SiteLaunches, launch_stand_in
from .sites import Schedule, Site, SiteId, winner_index
from .timing import LaunchInfo

STEP = "<step>"  # LaunchInfo.kernel of a whole-run timing


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

    def finish(self) -> list[str]:
        missing = [ident.describe() for ident in self.sites if ident not in self.launched]
        if missing:
            self.problems.append("the wrapped function did not launch " + "; ".join(missing)
                                 + f" in tuning run {self.run + 1}, though the discovery run did")
        return self.problems


def step_stages(runs: Runs, tuned: Sequence[Site], n_warmup: int, n_repeat: int,
                check: Optional[OutputCheck] = None) -> int:
    """The tuning runs of the step objective (see the module doc); returns how many were made."""
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
            error = outcome["error"]
            problems = handler.finish() + ([error[1]] if error else [])
            if check is not None and error is None and not check.matches(outcome["result"]):
                blame(runs.sites, handler.tried)
            if read is not None and error is None:
                ms, now = read(), time.time()
                for ident, index in handler.tried.items():
                    runs.sites[ident].add_sample(index, ms, now)
            agreement.check_run(problems, f"{label} {run + 1}/{schedule.runs}")
        total += schedule.runs
        if len(groups) > 1:  # coordinate-wise: the next site runs beside this one's agreed winner
            (site,) = group
            ((_, agreed),) = agreement.gather_agreed([site], f"step agreement, site {number + 1}")
            best = winner_index(list(agreed))
            if best is not None:
                fixed[site.id] = best
    return total
