"""The steps of one tuning call, shared by the tuners: run, check with the peers, commit, store, report.

A tuning call walks the protocol in this order (``contextual.py`` lists it as a flat sequence):
each run of the wrapped function is made under a launch handler (:mod:`disttune.handlers`), which
names every intercepted launch as a site and times it; after each run the ranks compare notes
(:class:`~disttune.agreement.Agreement`); the agreed winners are committed to the kernels' own
caches, saved to the persistent store by one writer (:mod:`disttune.store`), and summarised.

Every step here either runs the function, talks through the Agreement, or writes what was agreed;
none decides a winner by itself.
"""

from __future__ import annotations

import math
import sys
from typing import Any, Callable, Optional, Sequence

import numpy as np

from . import env
from . import store as stores
from .agreement import Agreement, SiteResult, TuningError
from .checks import OutputCheck, blame, scheduled_configs
from .comm import Communicator, LocalComm
from .compat import config_text
from .compile import CompilePool
from .handlers import Final, SiteLaunches, Tune
from .intercept import intercept
from .logs import RankLog
from .measures import describe_measurements
from .phases import Phases, span
from .sites import Schedule, Site, SiteId, describe_config, sample_spread
from .timing import Timer


def refuse_graph_capture(name: str) -> None:
    """Tuning synchronizes (CUDA events, the peers' agreement), which a CUDA graph capture forbids:
    a clear error instead of an invalidated capture."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
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
        bar = progress_bar(self.progress and comm.rank == 0, schedule.runs,
                           f"disttune {self.agreement.name}: {label}s")
        for run in range(schedule.runs):
            handler = Tune(self.sites, schedule, run, self.timer, comm.rank, self.compiles, self.phases)
            result, error = run_once(self.fn, handler, self.args, self.kwargs)
            # the timers and the output check read the GPU's results: wait for them as for a collective
            self.agreement.wait_for_device(f"{label} {run + 1}/{schedule.runs} (on the GPU)")
            problems = handler.finish() + ([error[1]] if error else [])
            if self.check is not None and error is None and not self.check.matches(result):
                blame(self.sites, scheduled_configs(self.sites.values(), schedule, run))
            with span(self.phases, "collectives"):
                self.agreement.check_run(problems, f"{label} {run + 1}/{schedule.runs}")
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        return schedule.runs

    def final(self, results: list[SiteResult], winners: dict[SiteId, Any], log: RankLog,
              commit: Callable[[list[SiteResult]], dict]) -> tuple[Any, list[SiteResult], int]:
        """The final run with the winners, ended by a status exchange; returns (its result, the results, runs made).

        An exception in the run on any rank is the same TuningError on every rank, so no rank returns
        while another raises (a world of one raises the exception itself). A split winner was timed by one rank only, so this run is also its first
        launch on the others: one that failed anywhere is scored ``inf`` on every rank, the next best is
        committed and the run is repeated.
        """
        runs = 0
        while True:
            handler = Final(self.sites, winners)
            with span(self.phases, "final run"):
                result, error = run_once(self.fn, handler, self.args, self.kwargs)
            runs += 1
            if error is not None and self.agreement.comm.world_size == 1:
                raise error[0]
            failed = self.agreement.final_run_status(results, error, handler.failures, f"final run {runs}")
            if not failed:
                return result, results, runs
            results = self.agreement.drop_failed_winners(results, failed, self.sites, log)
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


# -- the persistent store ----------------------------------------------------------------------------------

def open_store(use: bool, cache_dir: Any, comm: Communicator, check: str = "strict",
               timeout_s: float = env.DEFAULT_TIMEOUT_S) -> Optional[stores.WinnerStore]:
    """The winner store of this environment (None when ``use`` is off).

    A write waits at most half the tuner's ``timeout_s`` for another process's lock on its entry, so
    that peers already in their next collective (which waits ``timeout_s``) still hear from the writer.
    """
    if not use:
        return None
    fingerprint = stores.environment_fingerprint(comm.world_size, env.local_world_size())
    return stores.WinnerStore(cache_dir, fingerprint, check, lock_timeout_s=timeout_s / 2)


def kernel_entry(site: Site, kind: str = "kernel") -> stores.EntryId:
    """The store identity of a contextual site; ``kind`` tells winners of different objectives apart."""
    return stores.EntryId(kind, site.id.kernel, stores.kernel_source_key(site.autotuner), repr(site.id.key),
                          site.id.occurrence, tuple(config_text(c) for c in site.configs),
                          stores.kernel_source_digest(site.autotuner))


def lookup(winners_store: Optional[stores.WinnerStore], table: Optional[dict], always_tune: bool,
           entry: Callable[[Site], stores.EntryId] = kernel_entry) -> Optional[Callable[[Site], Optional[int]]]:
    """How this rank answers for a new site: its pinned-table or stored winner index, or None (tune)."""
    if table is not None:  # a table made for another kernel source raises PinnedTableError here
        return lambda site: stores.pinned_lookup(table, entry(site))
    if winners_store is None or always_tune or env.always_tune():
        return None

    def stored(site: Site) -> Optional[int]:
        record = winners_store.load(entry(site))
        return None if record is None else record["winner"]

    return stored


def save_winners(winners_store: stores.WinnerStore, tuned: Sequence[tuple[stores.EntryId, SiteResult, Site]],
                 function: str) -> None:
    """Store each tuned winner with its agreed times and its noise on this rank (the caller is the one writer;
    ``disttune verify`` allows a later time the larger of that noise and its threshold)."""
    for entry, result, site in tuned:
        if result.source == "tuned":
            noise = sample_spread(site.samples[result.winner]) if result.winner < len(site.samples) else None
            winners_store.save(entry, result.winner, list(result.agreed_ms), {"function": function, "noise": noise})


def global_rank(comm: Communicator) -> int:
    """The rank that names the log file and writes the store: the process's rank in the whole job."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except ImportError:
        pass
    if not isinstance(comm, LocalComm):
        try:
            from mpi4py import MPI

            return MPI.COMM_WORLD.Get_rank()
        except ImportError:
            pass
    return comm.rank


def is_store_writer(writer: str, comm: Communicator) -> bool:
    """``"global"``: global rank 0 writes; ``"node"``: local rank 0 of each node does."""
    return env.local_rank() == 0 if writer == "node" else global_rank(comm) == 0


# -- what the user sees --------------------------------------------------------------------------------------

def progress_bar(wanted: bool, total: int, description: str) -> Any:
    """A tqdm bar on stderr when wanted, on a terminal, and not disabled by DISTTUNE_PROGRESS=0."""
    if not wanted or total == 0 or not env.progress_enabled() or not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=description, unit="run", leave=False, file=sys.stderr)


def print_summary(name: str, report: Any, reduce: str, log: RankLog) -> None:
    """Rank 0's summary: the tuning's cost and each site's winner with its agreed time."""
    lines = [f"disttune: tuned {name} over {report.world_size} rank(s) in {report.wall_s:.2f} s "
             f"({report.function_runs} runs of the function); log: {log.path}"]
    for r in report.results:
        agreed = f"{r.agreed_ms[r.winner]:.4f} ms agreed ({reduce})" if r.source == "tuned" else r.source
        if r.measurements:  # a measured objective: what the score saw beside the time
            agreed += f", {describe_measurements(r.measurements[r.winner])}, score {r.scores[r.winner]:.4g}"
        lines.append(f"  {r.site.kernel} {r.site.key_text()} (occurrence {r.site.occurrence}) -> "
                     f"{describe_config(r.config)}: {agreed}")
    print("\n".join(lines), file=sys.stdout, flush=True)


def print_triton_style(report: Any, rank: int) -> None:
    """What Triton prints after tuning, per site, when TRITON_PRINT_AUTOTUNING=1."""
    for r in report.results:
        print(f"Triton autotuning for function {r.site.kernel} (disttune, rank {rank}),\n"
              f"with key as {r.site.key},\nfinished after {report.wall_s:.2f}s,\n"
              f"best config selected: {r.config};", flush=True)
