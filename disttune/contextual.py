"""``contextual_autotune``: tune every ``triton.autotune`` kernel inside a function, in place.

The wrapped function is run again and again. Each run, every autotuned launch
inside it (a *site*: kernel, tuning key, occurrence) tries the config the
rank-independent schedule gives it, on that launch's own current arguments and
grid, and a Timer measures it. Per-rank statistics are all-gathered once and
combined (max by default), so every rank picks the same winner. See
``docs``/README for the walk-through; in short, one tuning call is:

1. discovery run (registers the sites, finds a config that works on this rank);
2. consensus: one all-gather of the site digests and errors, so a mismatch is the
   same clear error on every rank before anything else happens;
3. ``longest * (n_warmup + n_repeat)`` tuning runs, each ended by a one-float
   all-gather that turns an error on any rank into an error on all (``longest``: the
   longest candidate list; a ``split`` site counts ``ceil(configs / world)``, since in
   each run every rank times a different config of it);
4. agreement: one all-gather of a fixed-length vector (a slot per site x config);
5. commit to each kernel's ``Autotuner.cache`` and the per-rank log;
6. a final run with the winners, whose return value the caller gets.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import sys
import time
import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Optional, Sequence, TypeVar, Union

from . import env
from . import intercept as _hook
from . import store as _store
from .comm import Communicator, LocalComm, make_communicator
from .fast_path import FastPlan
from .logs import RankLog
from .sites import (
    REDUCTIONS,
    AllConfigsFailed,
    Schedule,
    Site,
    SiteId,
    Statistic,
    agree,
    describe_config,
    resolve_statistic,
    screening_keep,
    survivors,
    total_function_runs,
    winner_index,
)
from .timing import LaunchInfo, Timer, default_timer

F = TypeVar("F", bound=Callable[..., Any])

#: What ``split=`` accepts: True/False, kernel names or autotuned kernels, or a predicate over a site.
SplitSpec = Union[bool, str, Any, Iterable[Any], Callable[[SiteId], bool]]

class TuningError(RuntimeError):
    """Tuning could not complete; raised with the same message on every rank."""


def _refuse_graph_capture(name: str) -> None:
    """Tuning synchronizes (CUDA events, the peers' agreement), which a CUDA graph capture forbids:
    a clear error instead of an invalidated capture."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise TuningError(f"disttune: {name} is being captured in a CUDA graph but is not tuned: tuning runs the function "
                          "many times and synchronizes with the GPU and the peers. Call it once before the capture "
                          "(the warm-up torch.cuda.graph asks for anyway); the captured call then takes the tuned "
                          "fast path")


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


class _Session:
    """The launch handler of one call of the wrapped function: discover, tune, final or fast mode."""

    def __init__(self, timer: Timer, rank: int, always_tune: bool, compile_pool: Any = None,
                 lookup: Optional[Callable[[Site], Optional[int]]] = None,
                 compile_share: Optional[tuple[int, int]] = None) -> None:
        self.timer = timer
        self.lookup = lookup  # this rank's stored/pinned winner for a new site, if any
        self.compile_pool = compile_pool
        self.compile_share = compile_share  # (rank, ranks) of the node: this rank's share of each site's compiles
        self._compiles: dict[SiteId, list] = {}
        self._compile_later: dict[SiteId, tuple] = {}
        self.rank = rank
        self.always_tune = always_tune
        self.sites: dict[SiteId, Site] = {}
        self.winners: dict[SiteId, Any] = {}
        self.schedule: Optional[Schedule] = None
        self.mode = "discover"
        self.run = -1
        self.stale: list[str] = []
        self._occurrences: dict[tuple, int] = {}
        self._launched: set = set()
        self._problems: list[str] = []
        self._readers: list = []
        self._reset_done: set = set()
        self.final_failures: dict[SiteId, tuple] = {}  # split sites: winner that failed here in the final run

    # -- run bookkeeping -------------------------------------------------------------------
    def start_run(self, mode: str, run: int = -1) -> None:
        self.mode, self.run = mode, run
        self._occurrences.clear()
        self._launched.clear()
        self._problems = []
        self._readers = []

    def finish_run(self) -> list[str]:
        """Read this run's timers and check that every site launched; returns local problems."""
        for site, index, read in self._readers:
            site.samples[index].append(read())
        if self.mode == "tune":
            missing = [ident.describe() for ident in self.sites if ident not in self._launched]
            if missing:
                self._problems.append(
                    "the wrapped function did not launch " + "; ".join(missing)
                    + f" in tuning run {self.run + 1}, though the discovery run did: it must launch the same "
                    "autotuned kernels with the same keys on every run"
                )
        return self._problems

    # -- the hook ----------------------------------------------------------------------------
    def launch(self, autotuner: Any, args: tuple, kwargs: dict) -> Any:
        if not _hook.has_choice(autotuner):
            return _hook.triton_run(autotuner, *args, **kwargs)
        key = _hook.tuning_key(autotuner, args, kwargs)
        name = _hook.kernel_name(autotuner)
        occurrence = self._occurrences.get((name, key), 0)
        self._occurrences[(name, key)] = occurrence + 1
        ident = SiteId(name, key, occurrence)
        if self.mode == "fast":
            return self._launch_fast(ident, autotuner, key, args, kwargs)
        if self.mode == "discover":
            return self._launch_discover(ident, autotuner, key, args, kwargs)
        if self.mode == "tune":
            return self._launch_tune(ident, autotuner, args, kwargs)
        return self._launch_final(ident, autotuner, key, args, kwargs)

    def _launch_discover(self, ident, autotuner, key, args, kwargs) -> Any:
        configs = _hook.candidate_configs(autotuner, args, kwargs)
        for config in configs:
            _hook.check_conflicts(autotuner, kwargs, config)
        preset = None if self.always_tune else autotuner.cache.get(key)
        site = Site(ident, autotuner, configs, preset)
        self.sites[ident] = site
        if preset is not None:
            return _hook.launch_winner(autotuner, args, kwargs, preset)
        site.local_answer = self.lookup(site) if self.lookup is not None else None
        if site.local_answer is not None:
            # A stored or pinned winner: compile and launch just that one (a warm start compiles nothing else).
            try:
                result = _hook.launch_config(autotuner, args, kwargs, configs[site.local_answer])
                site.stand_in = site.local_answer
                return result
            except Exception as err:
                site.record_failure(site.local_answer, err)
        compiles = self._start_compiles(ident, autotuner, configs, args, kwargs)
        for index, config in enumerate(configs):
            if index in site.failures:
                continue
            try:
                if compiles and compiles[index] is not None:
                    compiles[index].result()  # this config compiled (the rest go on in the background)
                result = _hook.launch_config(autotuner, args, kwargs, config)
            except Exception as err:  # a config that fails here is scored inf, not fatal
                site.record_failure(index, err)
                continue
            site.stand_in = index
            return result
        return None  # nothing launches on this rank; agreement fails the site on every rank

    def _start_compiles(self, ident: SiteId, autotuner: Any, configs: list, args: tuple, kwargs: dict) -> list:
        """Compile the candidates in the pool (JITFunction.warmup: no launch): every one, or with a
        compile share ``(r, n)`` config 0 (the discovery run's, needed at once) and configs ``i >= 1``
        with ``(i - 1 + s) % n == r`` for the ``s``-th site so shared (small sites spread over the
        ranks), the rest in :meth:`compile_rest`. Returns a future per config (None: later); []
        when not pooled."""
        if self.compile_pool is None or not _hook.can_precompile(autotuner):
            return []
        device = _hook.current_cuda_device()
        if self.compile_share is None:
            mine: Sequence[int] = range(len(configs))
        else:
            rank, ranks = self.compile_share
            offset = len(self._compile_later)
            mine = [0, *(i for i in range(1, len(configs)) if (i - 1 + offset) % ranks == rank)]
            self._compile_later[ident] = (autotuner, args, kwargs, configs, device, set(mine))
        futures = self._submit_compiles(autotuner, args, kwargs, configs, device, mine)
        self._compiles[ident] = futures
        return futures

    def _submit_compiles(self, autotuner: Any, args: tuple, kwargs: dict, configs: list, device: Optional[int],
                         indices: Any) -> list:
        futures: list = [None] * len(configs)
        for index in indices:
            futures[index] = self.compile_pool.submit(_hook.precompile, autotuner, args, kwargs, configs[index], device)
        return futures

    def compile_rest(self, tuned: Sequence[Site]) -> None:
        """With a compile share: the configs of the ``tuned`` sites left to the peers, once every rank has
        finished its share (call it after a collective that follows :meth:`finish_compiles` on every rank).
        They load from Triton's cache where the ranks share it (the ranks of one node, by default) and
        compile here otherwise. Sites decided without tuning (store, pinned, cached) need nothing more."""
        for site in tuned:
            later = self._compile_later.get(site.id)
            if later is None:
                continue
            autotuner, args, kwargs, configs, device, done = later
            rest = [i for i in range(len(configs)) if i not in done and i not in site.failures]
            self._compiles[site.id] = self._submit_compiles(autotuner, args, kwargs, configs, device, rest)
        self._compile_later.clear()
        self.finish_compiles()

    def finish_compiles(self) -> None:
        """Wait for the compile pool; a config that did not compile fails on this rank (inf)."""
        for ident, futures in self._compiles.items():
            for index, future in enumerate(futures):
                if future is None:
                    continue
                try:
                    future.result()
                except Exception as err:
                    self.sites[ident].record_failure(index, err)
        self._compiles.clear()

    def _launch_tune(self, ident, autotuner, args, kwargs) -> Any:
        site = self.sites.get(ident)
        if site is None:
            self._problems.append(
                f"tuning run {self.run + 1} launched {ident.describe()}, which the discovery run did not: the "
                "wrapped function must launch the same autotuned kernels with the same keys on every run"
            )
            return None
        self._launched.add(ident)
        if site.preset is not None:
            return _hook.launch_winner(autotuner, args, kwargs, site.preset)
        position, timed = self.schedule.slot(self.run, len(site.active), site.share)  # type: ignore[union-attr]
        index = None if position is None else site.active[position]
        if index is None or index in site.failures:
            return self._launch_stand_in(site, args, kwargs)
        config = site.configs[index]
        try:
            if not timed:
                return _hook.launch_config(autotuner, args, kwargs, config)
            info = LaunchInfo(site.id.kernel, site.id.key, site.id.occurrence, index, config, self.run, self.rank)
            outcome: dict = {}

            def timed_launch(launch: Callable[[], Any]) -> None:
                outcome["read"] = self.timer.time(lambda: outcome.__setitem__("result", launch()), info)

            _hook.launch_config(autotuner, args, kwargs, config, timed_launch)
            self._readers.append((site, index, outcome["read"]))
            return outcome.get("result")
        except Exception as err:
            site.record_failure(index, err)
            return self._launch_stand_in(site, args, kwargs)

    def _launch_stand_in(self, site: Site, args: tuple, kwargs: dict) -> Any:
        if site.stand_in is None:
            return None
        try:
            return _hook.launch_config(site.autotuner, args, kwargs, site.configs[site.stand_in])
        except Exception as err:
            self._problems.append(f"stand-in config of {site.id.describe()} failed: {type(err).__name__}: {err}")
            return None

    def _launch_final(self, ident, autotuner, key, args, kwargs) -> Any:
        config = self.winners.get(ident)
        if config is None:
            return self._launch_fast(ident, autotuner, key, args, kwargs)
        site = self.sites.get(ident)
        if site is None or not site.split:
            if ident not in self._reset_done:
                self._reset_done.add(ident)
                _hook.reset_before_real_launch(autotuner, args, kwargs, config)
            return _hook.launch_winner(autotuner, args, kwargs, config)
        # A split winner was timed by one rank only: its first launch here may fail (a compile fault on
        # this rank). Record it for the final-run check and let the run go on with the stand-in.
        try:
            if ident not in self._reset_done:
                self._reset_done.add(ident)
                _hook.reset_before_real_launch(autotuner, args, kwargs, config)
            return _hook.launch_winner(autotuner, args, kwargs, config)
        except Exception as err:
            self.final_failures.setdefault(ident, (site.configs.index(config), f"{type(err).__name__}: {err}"))
            return self._launch_stand_in(site, args, kwargs)

    def _launch_fast(self, ident, autotuner, key, args, kwargs) -> Any:
        config = self.winners.get(ident) or autotuner.cache.get(key)
        if config is None:
            config = _hook.candidate_configs(autotuner, args, kwargs)[0]
            self.stale.append(ident.describe())
        return _hook.launch_winner(autotuner, args, kwargs, config)

    def launch_unplanned(self, kernel: str, key: tuple, occurrence: int, autotuner: Any, args: tuple,
                         kwargs: dict) -> Any:
        """A fast-mode launch of a site the fast plan lacks (its occurrence already counted)."""
        return self._launch_fast(SiteId(kernel, key, occurrence), autotuner, key, args, kwargs)


_active_handler = _hook._current.get  # bound once: the tuned fast path asks on every call


def _fallback_session(winners: dict, occurrences: dict) -> _Session:
    """The fast path's handler for launches its plan does not cover, sharing the call's occurrence counts."""
    session = _Session(None, 0, False)  # type: ignore[arg-type]
    session.winners = winners
    session.mode = "fast"
    session._occurrences = occurrences
    return session


class ContextualAutotuner:
    """The callable that ``contextual_autotune`` returns. See :func:`contextual_autotune`."""

    def __init__(
        self,
        fn: Callable[..., Any],
        is_dist: bool = False,
        n_repeat: int = 5,
        n_warmup: int = 3,
        *,
        group: Any = None,
        comm: Any = None,
        timer: Optional[Timer] = None,
        reduce: str = "max",
        statistic: Statistic = "median",
        timeout_s: Optional[float] = None,
        log_dir: Optional[str | os.PathLike] = None,
        verbose: bool = True,
        always_tune: bool = False,
        early_stop: bool = False,
        cache_dir: Optional[str | os.PathLike] = None,
        store: bool = True,
        store_check: str = "strict",
        store_writer: str = "global",
        pinned: Optional[str | os.PathLike] = None,
        compile_threads: Optional[int] = None,
        compile_split: bool = True,
        split: SplitSpec = False,
    ) -> None:
        _check_count("n_repeat", n_repeat, minimum=1)
        _check_count("n_warmup", n_warmup, minimum=0)
        if reduce not in REDUCTIONS:
            raise ValueError(f"disttune: unknown reduce {reduce!r}; use one of {', '.join(REDUCTIONS)}")
        resolve_statistic(statistic)
        timeout_s = env.timeout_s(timeout_s)
        if timer is not None and not isinstance(timer, Timer):
            raise TypeError(f"disttune: timer must have a .time(launch, info) method, got {type(timer).__name__}")
        if not is_dist and group is not None:
            raise ValueError("disttune: group= was given but is_dist=False; pass is_dist=True to agree over it")
        if store_check not in _store.CHECKS:
            raise ValueError(f"disttune: store_check must be one of {_store.CHECKS}, got {store_check!r}")
        if store_writer not in ("global", "node"):
            raise ValueError(f"disttune: store_writer must be 'global' or 'node', got {store_writer!r}")
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.is_dist = is_dist
        self.n_repeat = n_repeat
        self.n_warmup = n_warmup
        self.group = group
        self.comm = comm
        self.timer = timer
        self.reduce = reduce
        self.statistic = statistic
        self.timeout_s = timeout_s
        self.log_dir = log_dir
        self.verbose = verbose
        self.always_tune = always_tune
        self.early_stop = bool(early_stop)
        self.cache_dir = cache_dir
        self.use_store = store
        self.store_check = store_check
        self.store_writer = store_writer
        self.pinned = pinned or env.pinned_table()
        if compile_threads is not None:
            _check_count("compile_threads", compile_threads, minimum=0)
        self.compile_threads = compile_threads
        self.compile_split = bool(compile_split)
        self.split = split
        self._splits = _split_predicate(split)
        self.report: Optional[TuningReport] = None
        self._winners: dict[SiteId, Any] = {}
        self._plan: Optional[FastPlan] = None
        self._tuned = False
        self._communicator: Optional[Communicator] = None

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        return self if obj is None else functools.partial(self.__call__, obj)

    @property
    def tuned(self) -> bool:
        return self._tuned

    def retune(self) -> None:
        """Forget the winners of this wrapper; the next call tunes again (the kernels' caches are kept)."""
        self._tuned = False
        self._winners = {}
        self._plan = None

    def expected_runs(self, longest_config_list: int) -> int:
        """How many times one tuning call runs the function: ``2 + longest * (n_warmup + n_repeat)``.

        Without early stopping or split sites; with ``split``, pass ``ceil(configs / world)`` for a
        split site (and count one more final run per split winner that failed on a rank that did not time it).
        """
        return total_function_runs(longest_config_list, self.n_warmup, self.n_repeat)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _active_handler() is not None:
            # Nested inside another wrapped call: its kernels are that call's sites.
            return self.fn(*args, **kwargs)
        if self._tuned:
            # The fast path, inlined (it is what every call after tuning costs): a spare handler (list.pop
            # and append are atomic, so threads never share one), the bare scope pair, the planned launches.
            plan = self._plan
            try:
                handler = plan.spare.pop()  # type: ignore[union-attr]
            except IndexError:
                handler = plan.new_handler()  # type: ignore[union-attr]
            token = _hook.open_scope(handler)
            try:
                result = self.fn(*args, **kwargs)
            finally:
                _hook.close_scope(token)
            if handler.following:  # it followed the learned launch sequence: ready as it is for the next call
                handler.position = 0
                plan.spare.append(handler)  # type: ignore[union-attr]
            else:
                stale = plan.finish(handler)  # type: ignore[union-attr]
                if stale:
                    self._went_stale(stale)
            return result
        return self._tuning_call(args, kwargs)

    # -- after tuning ------------------------------------------------------------------------
    def _went_stale(self, stale: list[str]) -> None:
        self._tuned = False
        warnings.warn(
            f"disttune: {self.__qualname__} launched kernels it was not tuned for ("
            + ", ".join(stale) + "); they ran with their first config and the next call tunes again",
            RuntimeWarning, stacklevel=3,
        )

    # -- one tuning call ---------------------------------------------------------------------
    def _get_communicator(self) -> Communicator:
        if self._communicator is None:
            self._communicator = make_communicator(self.is_dist, self.group, self.comm, self.timeout_s)
        return self._communicator

    def _tuning_call(self, args: tuple, kwargs: dict) -> Any:
        _refuse_graph_capture(self.__qualname__)
        comm = self._get_communicator()
        started = time.perf_counter()
        threads = _hook.default_compile_threads() if self.compile_threads is None else self.compile_threads
        pool = concurrent.futures.ThreadPoolExecutor(threads, "disttune-compile") if threads > 0 else None
        winners_store = self._open_store(comm)
        table = _store.load_table(self.pinned) if self.pinned else None
        share = _compile_share(comm) if self.compile_split and pool is not None and comm.world_size > 1 else None
        session = _Session(self.timer or default_timer(), comm.rank, self.always_tune, pool,
                           self._lookup_function(winners_store, table), share)
        log = RankLog(self.log_dir, _global_rank(comm), self.__qualname__)
        try:
            with _hook.intercept(session):
                result, error = self._guarded_run(session, "discover", -1, args, kwargs)
                session.finish_compiles()
                session.finish_run()
                self._consensus(comm, session, error, [s.local_answer for s in session.sites.values()], table)
                tuned = [s for s in session.sites.values() if s.preset is None and s.decided is None]
                if comm.world_size > 1:
                    for site in tuned:
                        if self._splits(site):
                            site.share = (comm.rank, comm.world_size)
                # every rank finished its compile share before the consensus: the peers' are in the cache
                session.compile_rest(tuned)
                tuning_runs = 0
                if self.early_stop and max((len(s.configs) for s in tuned), default=0) > 2:
                    screening = Schedule(max(s.slots() for s in tuned), 1, 1)
                    tuning_runs += self._run_stage(comm, session, screening, "screening run", args, kwargs)
                    for site, (per_rank, agreed) in zip(tuned, self._gather_agreed(comm, tuned, "screening agreement")):
                        site.keep_only(survivors(agreed, screening_keep(len(site.configs))), per_rank, agreed)
                longest = max((s.slots() for s in tuned), default=0)
                tuning_runs += self._run_stage(comm, session, Schedule(longest, self.n_warmup, self.n_repeat),
                                               "tuning run", args, kwargs)
                results = self._agree(comm, session, tuned, log)
                self._commit(session, results)
                final_run = any(s.preset is None for s in session.sites.values())
                final_runs = int(final_run)
                if any(s.split for s in tuned):
                    result, results, final_runs = self._checked_final_run(comm, session, results, log, args, kwargs)
                if winners_store is not None and self._is_store_writer(comm):
                    self._save(winners_store, session, results)
                if final_run and not any(s.split for s in tuned):
                    session.start_run("final")
                    result = self.fn(*args, **kwargs)
            wall_s = time.perf_counter() - started
            runs = 1 + tuning_runs + final_runs
            self.report = TuningReport(tuple(results), runs, wall_s, comm.world_size)
            log.tuning(self.__qualname__, wall_s, runs, len(tuned), comm.world_size, self.reduce, str(self.statistic))
            self._tuned = True
            if self.verbose and comm.rank == 0:
                self._print_summary(log)
            if env.triton_prints_autotuning():
                for r in self.report.results:
                    print(f"Triton autotuning for function {r.site.kernel} (disttune, rank {comm.rank}),\n"
                          f"with key as {r.site.key},\nfinished after {wall_s:.2f}s,\n"
                          f"best config selected: {r.config};", flush=True)
            return result
        finally:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
            log.flush()

    def _run_stage(self, comm: Communicator, session: _Session, schedule: Schedule, label: str,
                   args: tuple, kwargs: dict) -> int:
        """Run the function ``schedule.runs`` times, checking with the peers after each run; returns the count."""
        session.schedule = schedule
        progress = _progress_bar(self.verbose and comm.rank == 0, schedule.runs,
                                 f"disttune {self.__qualname__}: {label}s")
        for run in range(schedule.runs):
            _, error = self._guarded_run(session, "tune", run, args, kwargs)
            problems = session.finish_run() + ([error[1]] if error else [])
            self._check_run(comm, problems, f"{label} {run + 1}/{schedule.runs}")
            if progress is not None:
                progress.update(1)
        if progress is not None:
            progress.close()
        return schedule.runs

    def _guarded_run(self, session: _Session, mode: str, run: int, args: tuple, kwargs: dict):
        """Run the function once; an exception is kept (to be shared with the peers), not raised."""
        session.start_run(mode, run)
        try:
            return self.fn(*args, **kwargs), None
        except Exception as err:
            return None, (err, f"{type(err).__name__}: {err}")

    def _check_run(self, comm: Communicator, problems: list[str], step: str) -> None:
        flags = comm.all_gather_floats([1.0 if problems else 0.0], step)
        if flags.any():
            reports = comm.all_gather_objects(problems, step + " (errors)")
            lines = [f"rank {r}: {msg}" for r, msgs in enumerate(reports) for msg in msgs]
            raise TuningError(f"disttune: {self.__qualname__}: {step} failed on some rank(s):\n  " + "\n  ".join(lines))

    # -- the persistent store -----------------------------------------------------------------
    def _open_store(self, comm: Communicator) -> Optional[_store.WinnerStore]:
        if not self.use_store:
            return None
        fingerprint = _store.environment_fingerprint(comm.world_size, env.local_world_size())
        return _store.WinnerStore(self.cache_dir, fingerprint, self.store_check)

    def _is_store_writer(self, comm: Communicator) -> bool:
        if self.store_writer == "node":
            return env.local_rank() == 0
        return _global_rank(comm) == 0

    @staticmethod
    def _entry(site: Site) -> _store.EntryId:
        return _store.EntryId("kernel", site.id.kernel, _store.kernel_source_key(site.autotuner), repr(site.id.key),
                              site.id.occurrence, tuple(str(c) for c in site.configs))

    def _lookup_function(self, winners_store, table) -> Optional[Callable[[Site], Optional[int]]]:
        """How this rank answers for a new site: its pinned-table or stored winner index, or None."""
        if table is not None:
            return lambda site: _store.pinned_lookup(table, site.id.kernel, repr(site.id.key), site.id.occurrence,
                                                     tuple(str(c) for c in site.configs))
        if winners_store is None or self.always_tune or env.always_tune():
            return None

        def stored(site: Site) -> Optional[int]:
            record = winners_store.load(self._entry(site))
            return None if record is None else record["winner"]

        return stored

    def _save(self, winners_store: _store.WinnerStore, session: _Session, results: list[SiteResult]) -> None:
        for result in results:
            if result.source == "tuned":
                winners_store.save(self._entry(session.sites[result.site]), result.winner, list(result.agreed_ms),
                                   {"function": self.__qualname__})

    def _consensus(self, comm: Communicator, session: _Session, error, lookups: list, table) -> None:
        """One all-gather of digests, discovery errors and store answers; identical verdict on every rank."""
        mine = {
            "error": error[1] if error else None,
            "sites": [s.digest()[:4] for s in session.sites.values()],
            "presets": [s.digest()[4] for s in session.sites.values()],
            "lookups": lookups,
            "table": None if table is None else _store.table_digest(table),
            "split": [bool(self._splits(s)) for s in session.sites.values()],
        }
        everyone = comm.all_gather_objects(mine, "consensus (site digest)")
        failed = [(r, d["error"]) for r, d in enumerate(everyone) if d["error"]]
        if failed:
            message = (
                f"disttune: {self.__qualname__}: the discovery run raised on rank(s) "
                + ", ".join(str(r) for r, _ in failed) + ":\n  "
                + "\n  ".join(f"rank {r}: {msg}" for r, msg in failed)
            )
            if error:
                raise TuningError(message) from error[0]
            raise TuningError(message)
        mismatch = describe_mismatch([d["sites"] for d in everyone])
        if mismatch:
            raise TuningError(f"disttune: {self.__qualname__}: ranks disagree on what to tune: {mismatch}")
        split_views = [d["split"] for d in everyone]
        if any(view != split_views[0] for view in split_views):
            differing = [site.id.describe() for i, site in enumerate(session.sites.values())
                         if len({view[i] for view in split_views}) > 1]
            raise TuningError(f"disttune: {self.__qualname__}: ranks disagree on which sites are split (split= "
                              f"must choose the same sites on every rank): {'; '.join(differing)}")
        tables = {d["table"] for d in everyone}
        if len(tables) != 1:
            raise TuningError(f"disttune: {self.__qualname__}: ranks loaded different pinned winner tables "
                              f"(digests by rank: {[d['table'] for d in everyone]}); deploy the same file to all")
        missing = []
        for index, site in enumerate(session.sites.values()):
            if len({d["presets"][index] for d in everyone}) != 1:
                site.preset = None  # cached on some ranks only, or differently: tune it everywhere
            answer = everyone[0]["lookups"][index]  # rank 0's entry decides for everyone
            if table is not None:
                site.preset = None
                if answer is None:
                    missing.append(site.id.describe())
                site.decided, site.decided_by = answer, "pinned"
            elif site.preset is None and answer is not None:
                site.decided, site.decided_by = answer, "store"
        if missing:
            raise TuningError(f"disttune: {self.__qualname__}: pinned table {self.pinned} has no winner for: "
                              + "; ".join(missing) + ". Export a table that covers these sites (disttune.store.export_table after a tuning run).")

    def _gather_agreed(self, comm: Communicator, tuned: list[Site], step: str) -> list[tuple]:
        """One all-gather of every site's per-config statistic; (per-rank matrix, agreed vector) per site."""
        local: list[float] = []
        for site in tuned:
            local.extend(site.local_times(self.statistic))
        gathered = comm.all_gather_floats(local, step) if tuned else None
        out, offset = [], 0
        for site in tuned:
            per_rank = gathered[:, offset : offset + len(site.configs)]
            offset += len(site.configs)
            out.append((per_rank, agree(per_rank, self.reduce, split=site.split)))
        return out

    def _agree(self, comm: Communicator, session: _Session, tuned: list[Site], log: RankLog) -> list[SiteResult]:
        results, dead = [], []
        for site, (per_rank, agreed) in zip(tuned, self._gather_agreed(comm, tuned, "agreement")):
            per_rank, agreed = site.with_screening(per_rank, agreed)  # screened-out configs: screening times
            winner = winner_index([agreed[c] if c in site.active else float("inf") for c in range(len(agreed))])
            for r_index, samples in enumerate(site.samples):
                for iteration, ms in enumerate(samples):
                    log.measure(site.id.kernel, site.id.key, r_index, str(site.configs[r_index]), iteration, ms)
            for c, config in enumerate(site.configs):
                log.config_result(site.id.kernel, site.id.key, site.id.occurrence, c, str(config),
                                  list(per_rank[:, c]), float(agreed[c]), site.failures.get(c))
            if winner is None:
                dead.append(site)
                continue
            log.winner(site.id.kernel, site.id.key, site.id.occurrence, winner, str(site.configs[winner]),
                       float(agreed[winner]), "tuned")
            results.append(SiteResult(site.id, tuple(site.configs), tuple(tuple(map(float, row)) for row in per_rank),
                                      tuple(map(float, agreed)), winner, "tuned", site.split))
        if dead:
            self._raise_all_failed(comm, dead)
        for site in session.sites.values():
            if site.decided is not None:
                log.winner(site.id.kernel, site.id.key, site.id.occurrence, site.decided,
                           str(site.configs[site.decided]), float("nan"), site.decided_by)
                results.append(SiteResult(site.id, tuple(site.configs), (), (), site.decided, site.decided_by))
            elif site.preset is not None:
                index = site.configs.index(site.preset) if site.preset in site.configs else -1
                results.append(SiteResult(site.id, tuple(site.configs), (), (), index, "cached"))
        return results

    def _checked_final_run(self, comm: Communicator, session: _Session, results: list[SiteResult], log: RankLog,
                           args: tuple, kwargs: dict) -> tuple[Any, list[SiteResult], int]:
        """The final run when some site was split; returns (its result, the results, runs made).

        A split winner was timed by one rank only, so this run is also its first launch on the
        others. Each rank reports what failed (one all-gather); a winner that failed anywhere
        is scored ``inf`` on every rank, the next best is committed and the run is repeated.
        An exception in the run itself is the same TuningError on every rank.
        """
        runs = 0
        while True:
            session.final_failures = {}
            session._reset_done.clear()
            result, error = self._guarded_run(session, "final", -1, args, kwargs)
            runs += 1
            failed = [(i, *session.final_failures[r.site]) for i, r in enumerate(results)
                      if r.site in session.final_failures]
            everyone = comm.all_gather_objects({"error": error[1] if error else None, "failed": failed},
                                               f"final run {runs} (split winners)")
            errors = [(r, d["error"]) for r, d in enumerate(everyone) if d["error"]]
            if errors:
                message = (f"disttune: {self.__qualname__}: the final run (with the winners) failed on rank(s) "
                           + ", ".join(str(r) for r, _ in errors) + ":\n  "
                           + "\n  ".join(f"rank {r}: {msg}" for r, msg in errors))
                if error:
                    raise TuningError(message) from error[0]
                raise TuningError(message)
            failures: dict[tuple, list[str]] = {}
            for rank, report in enumerate(everyone):
                for i, config_index, msg in report["failed"]:
                    failures.setdefault((i, config_index), []).append(f"rank {rank}: {msg}")
            if not failures:
                return result, results, runs
            for (i, config_index), messages in sorted(failures.items()):
                old = results[i]
                site = session.sites[old.site]
                site.record_failure(config_index, RuntimeError("; ".join(messages)))
                agreed = list(old.agreed_ms)
                agreed[config_index] = float("inf")
                winner = winner_index([agreed[c] if c in site.active else float("inf") for c in range(len(agreed))])
                log.config_result(old.site.kernel, old.site.key, old.site.occurrence, config_index,
                                  str(old.configs[config_index]), [float("nan")] * comm.world_size, float("inf"),
                                  "failed in the final run: " + "; ".join(messages))
                if winner is None:
                    raise AllConfigsFailed(
                        f"disttune: {self.__qualname__}: no config works for:\n  {old.site.describe()}: the last "
                        f"candidate, config[{config_index}] {{{old.configs[config_index]}}}, was timed on one rank "
                        "(split) but failed on others in the final run: " + "; ".join(messages))
                log.winner(old.site.kernel, old.site.key, old.site.occurrence, winner, str(old.configs[winner]),
                           agreed[winner], "tuned")
                results[i] = replace(old, agreed_ms=tuple(agreed), winner=winner)
            self._commit(session, results)

    def _raise_all_failed(self, comm: Communicator, dead: list[Site]) -> None:
        failures = comm.all_gather_objects([dict(s.failures) for s in dead], "agreement (failures)")
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
        raise AllConfigsFailed(f"disttune: {self.__qualname__}: no config works for:\n" + "\n".join(parts))

    def _commit(self, session: _Session, results: list[SiteResult]) -> None:
        winners, committed = {}, set()
        for result in sorted(results, key=lambda r: r.site.occurrence):
            site = session.sites[result.site]
            config = site.preset if result.source == "cached" else result.config
            winners[result.site] = config
            if (id(site.autotuner), result.site.key) not in committed:  # the kernel's cache holds one per key
                committed.add((id(site.autotuner), result.site.key))
                site.autotuner.cache[result.site.key] = config
        session.winners = winners
        self._winners = winners
        self._plan = FastPlan(session.sites, winners, _fallback_session)

    def _print_summary(self, log: RankLog) -> None:
        report = self.report
        assert report is not None
        lines = [
            f"disttune: tuned {self.__qualname__} over {report.world_size} rank(s) in {report.wall_s:.2f} s "
            f"({report.function_runs} runs of the function); log: {log.path}"
        ]
        for r in report.results:
            agreed = f"{r.agreed_ms[r.winner]:.4f} ms agreed ({self.reduce})" if r.source == "tuned" else r.source
            lines.append(f"  {r.site.describe()} -> {describe_config(r.config)}: {agreed}")
        print("\n".join(lines), file=sys.stdout, flush=True)


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


def _split_predicate(spec: SplitSpec) -> Callable[[Site], bool]:
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


def _check_count(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"disttune: {name} must be an integer >= {minimum}, got {value!r}")


def _progress_bar(wanted: bool, total: int, description: str) -> Any:
    """A tqdm bar on stderr when wanted, on a terminal, and not disabled by DISTTUNE_PROGRESS=0."""
    if not wanted or total == 0 or not env.progress_enabled() or not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=description, unit="run", leave=False, file=sys.stderr)


def _compile_share(comm: Communicator) -> tuple[int, int]:
    """(this rank's index, ranks) among the ranks that share a Triton cache: the node's, where the
    launcher says (LOCAL_RANK / LOCAL_WORLD_SIZE or MPI's), else the communicator's."""
    local_world, local_rank = env.local_world_size(), env.local_rank(default=-1)
    if 0 <= local_rank < local_world:
        return local_rank, local_world
    return comm.rank, comm.world_size


def _global_rank(comm: Communicator) -> int:
    """The rank that names the log file: the process's rank in the whole job."""
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


def contextual_autotune(
    is_dist: bool = False,
    n_repeat: int = 5,
    n_warmup: int = 3,
    **options: Any,
) -> Callable[[F], F]:
    """Tune every ``triton.autotune`` kernel launched inside the decorated function, in context.

    Compatible with Triton-distributed's ``contextual_autotune(is_dist=False, n_repeat=5, n_warmup=3)``.

    **The function runs several times.** The first call runs it
    ``2 + C * (n_warmup + n_repeat)`` times, where ``C`` is the longest candidate
    list of any site (one discovery run, the tuning runs, one final run with the
    winners whose result is returned); with the defaults and 12 configs that is 98
    runs. It must be re-runnable with the same inputs. Later calls run it once,
    with the winners, at close to the cost of a plain launch.

    Keyword-only options: ``group`` (a torch process group), ``comm`` (an mpi4py
    communicator), ``timer`` (a :class:`~disttune.timing.Timer`), ``reduce``
    (``"max"``, ``"mean"`` or ``"min"`` over ranks), ``statistic`` (``"median"``,
    ``"mean"``, ``"min"`` or a callable over a config's timed samples),
    ``timeout_s`` (per collective; default ``$DISTTUNE_TIMEOUT`` or 300),
    ``log_dir`` (default ``$DISTTUNE_LOG_DIR`` or ``logs``), ``verbose`` (rank 0
    prints a summary and, on a terminal, a progress bar), ``always_tune`` (ignore
    winners already in kernels' caches), ``cache_dir`` / ``store`` / ``store_check``
    (``"strict"`` or ``"warn"``) / ``store_writer`` (``"global"`` or ``"node"``) for the
    persistent winner store, ``pinned`` (a winners table: never tune), and
    ``compile_threads`` (candidates compiled up front; default up to 16 per rank on
    GPUs, 0 under the interpreter), ``compile_split`` (default on; with several ranks and a compile
    pool, local rank ``r`` of ``n`` compiles config 0, which the discovery run launches at once, and
    configs ``i >= 1`` with ``(i - 1 + s) % n == r`` for the ``s``-th site; after the consensus, when every rank has finished
    its share, it loads the rest of the tuned sites' configs from Triton's cache, which the ranks of
    one node share unless ``TRITON_CACHE_DIR`` differs between them, or compiles them where it is not
    shared), ``early_stop`` (screen every config with one
    warm-up and one timed run, agree, and give the full ``n_warmup + n_repeat`` runs
    only to the fastest quarter (at least two): ``2C + K(n_warmup+n_repeat)`` tuning
    runs instead of ``C(n_warmup+n_repeat)``). With a store or pinned hit the first call runs the
    function twice (discovery + final) and compiles only the winner.

    ``split`` (``True``, a kernel name, a collection of names or ``triton.autotune`` kernels, or a
    predicate over a :class:`~disttune.sites.SiteId`) divides a site's configs among the ``w`` ranks:
    in each tuning slot rank ``r`` runs position ``j*w + r`` of the candidate list, each config's
    time is its owner's (``nan`` in the other ranks' ``per_rank_ms``), and a site of ``C`` configs
    needs ``ceil(C / w)`` slots instead of ``C``. Use it only for kernels whose time does not depend
    on what the other ranks launch at the same moment (no communication inside or beside them).
    The final run then checks that each split winner also runs on the ranks that did not time it
    (a winner that fails there is dropped for the next best, on every rank, and the run repeated).
    """

    def decorate(fn: F) -> F:
        return ContextualAutotuner(fn, is_dist, n_repeat, n_warmup, **options)  # type: ignore[return-value]

    return decorate
