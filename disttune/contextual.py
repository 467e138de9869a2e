"""``contextual_autotune``: tune every ``triton.autotune`` kernel inside a function, in place.

The walk of one tuning call, step by step (:meth:`ContextualAutotuner._tuning_call` reads the same):

1. **intercept**: each run of the wrapped function routes its autotuned launches to a launch handler
   (:mod:`disttune.intercept`, :mod:`disttune.handlers`);
2. **sites**: the discovery run names every launch a site (kernel, tuning key, occurrence), finds a
   config that works on this rank and starts compiling the rest (:mod:`disttune.compile`);
3. **consensus**: one all-gather, so that a mismatch (sites, options, split, pinned table) or a
   discovery error is the same clear error on every rank (:mod:`disttune.agreement`);
4. **timed**: ``longest * (n_warmup + n_repeat)`` tuning runs, each site trying the config the
   rank-independent schedule gives it (:class:`~disttune.sites.Schedule`) under the Timer, each run
   ended by a one-float all-gather that turns an error on any rank into an error on all;
5. **agreed**: one all-gather of a fixed-length vector (a slot per site x config, x measurement with a
   measured objective), reduced over ranks;
   the same winners everywhere;
6. **final**: the winners go into each kernel's ``Autotuner.cache`` and the per-rank log; a final run
   with the winners gives the caller its result, ended by a status all-gather (an error on any rank is
   an error on all);
7. **stored**: then, only then, the winners go into the winner store (:mod:`disttune.store`).

After that every call takes the fast path (:mod:`disttune.fast_path`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
import warnings
from typing import Any, Callable, Iterable, Optional, TypeVar, Union

from . import diagnostics, engine, env, verify, warmup
from . import store as stores
from .agreement import Agreement, SiteResult, TuningError, TuningReport, settled_results
from .checks import CheckSpec, check_spec, make_check
from .comm import Communicator, is_comm, make_communicator
from .compat import config_text
from .compile import CompilePool, compile_share, default_compile_threads
from .fast_path import FastPlan
from .handlers import Discover
from .triton_launch import check_driver
from .intercept import active_handler, close_scope, open_scope
from .logs import RankLog
from .objective import step_stages
from .phases import Phases
from .measures import Objective, Probe, ProbingTimer, default_probe, measured
from .options import (AGREED, check_common, check_count, check_directory, check_objective, check_path,
                      describe_objective, describe_options)
from .search import Search, SearchTrace, narrow, resolve_search
from .sites import AllConfigsFailed, Schedule, Site, SiteId, Statistic, split_predicate, total_function_runs
from .sweep import SweepRow, sweep_contextual
from .timing import Timer, default_timer, flushing
from .unseen import DEFAULT_AGREE_EVERY, NEVER, NewKeys, NewKeyVotes, check_on_new_key, pinned_or_nearest

__all__ = ["ContextualAutotuner", "Options", "SiteResult", "TuningError", "TuningReport", "contextual_autotune"]

F = TypeVar("F", bound=Callable[..., Any])

#: What ``split=`` accepts: True/False, kernel names or autotuned kernels, or a predicate over a site.
SplitSpec = Union[bool, str, Any, Iterable[Any], Callable[[SiteId], bool]]


@dataclasses.dataclass(frozen=True)
class Options:
    """Every option of a contextual tuner, checked once when it is built (see :func:`contextual_autotune`).

    ``timeout_s`` is resolved here (``$DISTTUNE_TIMEOUT`` or 300 s when not given) and ``pinned`` from
    ``$DISTTUNE_PINNED``; a bad value is a ValueError or TypeError that names the option.
    """

    is_dist: bool = False
    n_repeat: int = 5
    n_warmup: int = 3
    group: Any = None
    comm: Any = None
    timer: Optional[Timer] = None
    reduce: str = "max"
    statistic: Statistic = "median"
    timeout_s: Optional[float] = None
    log_dir: Optional[Union[str, os.PathLike]] = None
    verbose: bool = True
    always_tune: bool = False
    early_stop: bool = False
    search: Optional[Search] = None
    cache_dir: Optional[Union[str, os.PathLike]] = None
    store: bool = True
    store_check: str = "strict"
    store_writer: str = "global"
    pinned: Optional[Union[str, os.PathLike]] = None
    compile_threads: Optional[int] = None
    compile_split: bool = True
    split: SplitSpec = False
    on_new_key: str = "tune"
    agree_every: int = DEFAULT_AGREE_EVERY
    objective: Objective = "launch"
    flush_l2: bool = False
    check: CheckSpec = None
    probe: Optional[Probe] = None
    #: a bad ``$DISTTUNE_TIMEOUT`` (``timeout_s`` then holds the default): raised on every rank at the consensus
    env_error: Optional[Exception] = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_common(self.n_warmup, self.n_repeat, self.reduce, self.statistic, self.timer)
        check_on_new_key(self.on_new_key, self.agree_every)
        check_objective(self.objective, self.search, self.split, self.early_stop)
        object.__setattr__(self, "check", check_spec(self.check))
        if self.objective == "step" and (self.early_stop or self.split or self.search not in (None, "exhaustive")):
            raise ValueError("disttune: objective='step' times whole runs; search, early_stop and split are for "
                             "objective='launch'")
        object.__setattr__(self, "flush_l2", bool(self.flush_l2))
        timeout, env_error = env.timeout_or_error(self.timeout_s)
        object.__setattr__(self, "timeout_s", timeout)
        object.__setattr__(self, "env_error", env_error)
        if not self.is_dist and self.group is not None and not is_comm(self.group):
            raise ValueError("disttune: group= was given but is_dist=False; pass is_dist=True to agree over it")
        if self.store_check not in stores.CHECKS:
            raise ValueError(f"disttune: store_check must be one of {stores.CHECKS}, got {self.store_check!r}")
        if self.store_writer not in ("global", "node"):
            raise ValueError(f"disttune: store_writer must be 'global' or 'node', got {self.store_writer!r}")
        if self.compile_threads is not None:
            check_count("compile_threads", self.compile_threads, minimum=0)
        check_directory("log_dir", self.log_dir)
        check_path("cache_dir", self.cache_dir)
        check_path("pinned", self.pinned)
        object.__setattr__(self, "pinned", self.pinned or env.pinned_table())
        object.__setattr__(self, "search", resolve_search(self.search, bool(self.early_stop)))
        object.__setattr__(self, "early_stop", self.search == "screen")
        object.__setattr__(self, "compile_split", bool(self.compile_split))

    def agreed(self) -> dict[str, str]:
        """The options every rank must share, as text for the consensus."""
        return describe_options(**{name: getattr(self, name) for name in AGREED})


class ContextualAutotuner:
    """The callable that ``contextual_autotune`` returns. See :func:`contextual_autotune`."""

    def __init__(self, fn: Callable[..., Any], is_dist: bool = False, n_repeat: int = 5, n_warmup: int = 3,
                 **options: Any) -> None:
        self.options = Options(is_dist, n_repeat, n_warmup, **options)
        warmup.start_for_tuner()  # Triton's one-time initialisation, off the first tuning call
        functools.update_wrapper(self, fn)
        self.fn = fn
        self._splits = split_predicate(self.options.split)
        self.report: Optional[TuningReport] = None
        self._winners: dict[SiteId, Any] = {}
        self._plan: Optional[FastPlan] = None
        self._tuned = False
        self._communicator: Optional[Communicator] = None
        self.search_trace: Optional[SearchTrace] = None  # what the last model search proposed, per site
        self._known_sites: dict[SiteId, Site] = {}  # every tuning call's sites and winners: what the plan serves
        self._known_winners: dict[SiteId, Any] = {}
        self._new_keys: Optional[NewKeys] = None  # keys met after tuning (see disttune.unseen)
        self._saved_call: Optional[tuple[int, tuple, dict]] = None  # (position, args, kwargs) of a call that met one
        self._votes: Optional[NewKeyVotes] = None  # the agreement points on new keys
        # update_wrapper has made the instance dict a key-sharing one, whose reads CPython 3.11 does not
        # specialize: a plain copy keeps the fast path's three attribute reads at a dict hint's cost.
        self.__dict__ = dict(self.__dict__)

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
        self._known_sites, self._known_winners, self._new_keys, self._saved_call = {}, {}, None, None
        self._votes = None

    @property
    def fallbacks(self) -> dict[str, str]:
        """Sites served by a fallback since tuning (``on_new_key``): ``{site: "config <- nearest tuned key ..."}``."""
        return {} if self._new_keys is None else self._new_keys.fallbacks()

    def sweep(self, cases: Iterable[tuple[tuple, dict]], table: Optional[Union[str, os.PathLike]] = None,
              verbose: bool = True) -> list[SweepRow]:
        """Tune every new key of ``cases`` (``(args, kwargs)`` pairs, the same order on every rank), print the
        table on rank 0, write a pinned table to ``table``; one tuning call per case (:mod:`disttune.sweep`)."""
        return sweep_contextual(self, cases, table, verbose)

    def expected_runs(self, longest_config_list: int) -> int:
        """How many times one tuning call runs the function: ``2 + longest * (n_warmup + n_repeat)``.

        Without early stopping or split sites; with ``split``, pass ``ceil(configs / world)`` for a
        split site (and count one more final run per split winner that failed on a rank that did not time it).
        """
        return total_function_runs(longest_config_list, self.options.n_warmup, self.options.n_repeat)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if active_handler() is not None:
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
            token = open_scope(handler)
            try:
                result = self.fn(*args, **kwargs)
            finally:
                close_scope(token)
            if handler.following:  # it followed the learned launch sequence: ready as it is for the next call
                handler.position = 0
                plan.spare.append(handler)  # type: ignore[union-attr]
            else:
                stale = plan.finish(handler)  # type: ignore[union-attr]
                if stale:
                    self._went_stale(stale)
                elif plan.unseen is not None and plan.unseen.met_in_call:  # type: ignore[union-attr]
                    self._met_new_key(plan, args, kwargs)
            plan.countdown -= 1  # type: ignore[union-attr]
            if not plan.countdown:  # type: ignore[union-attr]
                self._agree_on_new_keys()
            return result
        return self._tuning_call(args, kwargs)

    def _met_new_key(self, plan: FastPlan, args: tuple, kwargs: dict) -> None:
        """A call served a pending key on its fallback: keep its arguments for a tuning at the agreement point."""
        plan.unseen.met_in_call = False  # type: ignore[union-attr]
        if self._saved_call is None:
            self._saved_call = (self.options.agree_every - plan.countdown, args, kwargs)

    def _agree_on_new_keys(self) -> None:
        """Every ``agree_every`` calls, on every rank: each rank gives the position of its first call of the
        period that met a pending key; a period whose position is the same everywhere has that call's keys
        tuned at the next point (see :mod:`disttune.unseen`). Never waits for the peers at the point."""
        plan, saved = self._plan, self._saved_call
        plan.countdown = self.options.agree_every  # type: ignore[union-attr]
        self._saved_call = None
        if self._votes is None:
            self._votes = NewKeyVotes(self.__qualname__)
        due = self._votes.point(self._get_communicator(), saved)
        if due is None:
            return  # some rank met none, or met them in another call: they stay on their fallback
        try:
            self._tuning_call(due[1], due[2])
        except (TuningError, AllConfigsFailed) as err:  # agreed on every rank: the keys keep their fallback
            log = RankLog(self.options.log_dir, engine.global_rank(self._get_communicator()), self.__qualname__)
            log.note("new keys", f"tuning the new keys failed, they stay on their fallback: {err}")
            log.flush()

    def _went_stale(self, stale: list[str]) -> None:
        self._tuned = False
        warnings.warn(
            f"disttune: {self.__qualname__} launched kernels it was not tuned for ("
            + ", ".join(stale) + "); they ran with their first config and the next call tunes again",
            RuntimeWarning, stacklevel=3,
        )

    def _entry(self, site: Site) -> stores.EntryId:
        """A site's identity in the winner store: winners of the step objective or of a checked tuning are their own."""
        o = self.options
        kind = "kernel" + ("" if o.objective == "launch" else f" objective={describe_objective(o.objective)}")
        kind += " checked" if o.check else ""
        return engine.kernel_entry(site, kind)

    def _get_communicator(self) -> Communicator:
        if self._communicator is None:
            o = self.options
            self._communicator = make_communicator(o.is_dist, o.group, o.comm, o.timeout_s)
        return self._communicator

    def _commit(self, sites: dict[SiteId, Site], results: list[SiteResult], wall_s: float = 0.0) -> dict[SiteId, Any]:
        self._winners = engine.commit(sites, results, wall_s)
        self._known_sites.update(sites)
        self._known_winners.update(self._winners)
        self._plan = FastPlan(self._known_sites, self._known_winners, *self._unseen_policy())
        return self._winners

    def _unseen_policy(self) -> tuple[Optional[NewKeys], int]:
        """The plan's fallback for keys it was not tuned for, and its countdown to the next agreement.

        A world of one with ``on_new_key="tune"`` keeps the simplest rule: the launch runs its first config
        and the next call tunes (no peer can be left waiting). A tuner with a pinned table never tunes: a
        key the table lacks stays on its fallback, as with ``"nearest"``.
        """
        o, comm = self.options, self._get_communicator()
        tunes_new_keys = o.on_new_key == "tune" and not o.pinned
        if tunes_new_keys and comm.world_size == 1:
            return None, NEVER
        if self._new_keys is None:
            table = stores.load_table(o.pinned) if o.pinned else None
            self._new_keys = NewKeys(self.__qualname__, o.on_new_key, table, self._log_fallback)
        self._new_keys.remember(self._winners)
        return self._new_keys, o.agree_every if tunes_new_keys else NEVER

    def _log_fallback(self, ident: SiteId, config: Any, source: str) -> None:
        log = RankLog(self.options.log_dir, engine.global_rank(self._get_communicator()), self.__qualname__)
        log.fallback(ident.kernel, ident.key, ident.occurrence, config_text(config), source)
        log.flush()

    def _tuning_call(self, args: tuple, kwargs: dict) -> Any:
        """Discover, agree on the sites, tune, agree on the winners, commit and store, run with the winners."""
        o, name = self.options, self.__qualname__
        check_driver()  # the same on every rank of a CPU job: one line, before any collective
        engine.refuse_graph_capture(name)
        verify_threshold = verify.requested()
        comm = self._get_communicator()
        started = time.perf_counter()
        agreement = Agreement(comm, name, o.reduce, o.statistic, o.objective)
        threads = default_compile_threads() if o.compile_threads is None else o.compile_threads
        share = compile_share(comm) if o.compile_split and threads > 0 and comm.world_size > 1 else None
        compiles = CompilePool(threads, share) if threads > 0 else None
        sites: dict[SiteId, Site] = {}
        log = RankLog(o.log_dir, engine.global_rank(comm), name)
        winners_store, table, setup_error = None, None, None
        try:  # what fails here on one rank reaches the others in the consensus, after a paired discovery run
            if o.env_error is not None:
                raise o.env_error
            check_directory("log_dir (resolved)", log.path.parent)
            winners_store = engine.open_store(o.store, o.cache_dir, comm, o.store_check, o.timeout_s)
            table = stores.load_table(o.pinned) if o.pinned else None
        except Exception as err:
            setup_error = (err, f"before the discovery run: {type(err).__name__}: {err}")
        with agreement.ending:  # the same ending on every rank, wherever a peer's failure finds this one
            phases = Phases()
            span = phases.span
            try:
                lookup, from_nearest = engine.lookup(winners_store, table, o.always_tune, self._entry), {}
                if table is not None and o.on_new_key == "nearest":
                    lookup = pinned_or_nearest(lookup, table, from_nearest)
                discover = Discover(sites, o.always_tune, lookup, compiles, phases)
                with span("discovery run"):
                    result, error = engine.run_once(self.fn, discover, args, kwargs)
                error = setup_error or error
                # the step objective's runs do not wait config by config: every compile finishes first
                overlap = compiles is not None and share is None and env.compile_overlap() and o.objective != "step"
                if compiles is not None and not overlap:  # (overlapping: the tuning runs wait config by config)
                    with span("compile wait"):
                        compiles.finish()
                found = list(sites.values())
                with span("collectives"):
                    agreed = {**o.agreed(), "DISTTUNE_VERIFY": repr(verify_threshold)}  # verify adds runs: all or none
                    agreement.consensus(found, error, agreed, [bool(self._splits(s)) for s in found],
                                        None if table is None else stores.table_digest(table), o.pinned, log.run)
                log.run = agreement.run or log.run
                for site in found:
                    log.label_key(site.id.kernel, site.id.key, site.id.key_text())
                tuned = [s for s in found if s.preset is None and s.decided is None]
                for site in tuned:
                    if comm.world_size > 1 and self._splits(site):
                        site.share = (comm.rank, comm.world_size)
                if compiles is not None and share is not None:  # every rank finished its share: the peers' are cached
                    with span("compile wait"):
                        compiles.compile_rest(tuned)
                timer = o.timer or default_timer()
                if measured(o.objective):
                    probe = o.probe or default_probe(lambda step: agreement.wait_for_device(step, counted=False))
                    timer = ProbingTimer(timer, probe, repeatable=True)
                runs = engine.Runs(self.fn, args, kwargs, sites, agreement, flushing(timer) if o.flush_l2 else timer,
                                   o.verbose, compiles if overlap else None, phases)
                runs.check = make_check(o.check, result)  # the discovery run's result is the reference
                if verify_threshold is not None and o.objective == "step":
                    verify_threshold = None
                    verify.not_for_the_step_objective(log, name)
                verified = 0 if verify_threshold is None else verify.verify_decided(
                    found, runs, agreement, o.n_warmup, o.n_repeat, winners_store, table, log, verify_threshold,
                    self._entry, o.verbose)
                function_runs = 1 + verified
                with span("tuning runs"):
                    if o.objective == "step":
                        function_runs += step_stages(runs, tuned, o.n_warmup, o.n_repeat, runs.check)
                    else:
                        searched, self.search_trace, full_timing = narrow(
                            tuned, o.search, o.n_warmup, o.n_repeat, runs.stage, agreement.gather_agreed,
                            comm.all_gather_objects)
                        function_runs += searched
                        if full_timing:
                            longest = max((s.slots() for s in tuned), default=0)
                            function_runs += runs.stage(Schedule(longest, o.n_warmup, o.n_repeat), "tuning run")
                if overlap:
                    with span("compile wait"):
                        compiles.finish()  # type: ignore[union-attr]  # a config never launched may still fail here
                with span("collectives"):
                    results = agreement.verdicts(tuned, log) + settled_results(found, log)
                diagnostics.log_tuned(log, sites, results, compiles.compiled if compiles is not None else {})
                winners = self._commit(sites, results, time.perf_counter() - started)
                for ident, (config, source) in from_nearest.items():  # the same on every rank: the table is agreed
                    self._new_keys.served[ident] = (config, source)  # type: ignore[union-attr]
                    log.fallback(ident.kernel, ident.key, ident.occurrence, config_text(config), source)
                if any(s.preset is None for s in found):
                    result, results, final_runs = runs.final(results, winners, log, lambda r: self._commit(sites, r, time.perf_counter() - started))
                    function_runs += final_runs
                if winners_store is not None and engine.is_store_writer(o.store_writer, comm):
                    with span("store"):
                        engine.save_winners(winners_store, [(self._entry(sites[r.site]), r, sites[r.site])
                                                             for r in results], name)
                wall_s = time.perf_counter() - started
                self.report = TuningReport(tuple(results), function_runs, wall_s, comm.world_size,
                                           phases.breakdown(wall_s), compiles.busy_s() if compiles is not None else {})
                log.tuning(name, wall_s, function_runs, len(tuned), comm.world_size, o.reduce, str(o.statistic))
                self._tuned = True
                if o.verbose and comm.rank == 0:
                    engine.print_summary(name, self.report, o.reduce, log)
                if env.triton_prints_autotuning():
                    engine.print_triton_style(self.report, comm.rank)
                return result
            finally:
                if compiles is not None:
                    compiles.shutdown()
                if setup_error is None:
                    log.flush()


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

    Keyword-only options: ``group`` (a torch process group or an mpi4py communicator;
    ``comm`` is the older name for the latter), ``timer`` (a :class:`~disttune.timing.Timer`), ``reduce``
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
    shared), ``search`` (``"exhaustive"``, the default; ``"screen"``; ``"model"`` or a
    :class:`~disttune.search.ModelSearch`: batches proposed by a surrogate model over the agreed times,
    stopped by a patience rule, see :mod:`disttune.search`), ``early_stop`` (``search="screen"``: screen every config with one
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

    ``on_new_key`` (``"tune"``, ``"nearest"`` or ``"error"``) and ``agree_every`` (default 128) say what a
    call after tuning does with a key it was not tuned for (:mod:`disttune.unseen`): it never enters a
    collective, so a size that only some ranks meet never stalls them. It runs at once on the winner of
    the nearest tuned key (:mod:`disttune.nearest`; the first config when none is a candidate), the same
    on every rank; ``"tune"`` then tunes keys that every rank met in the same call, one agreement point
    later (every ``agree_every`` calls each rank sets one number in the rendezvous store and reads its
    peers' from the point before: no wait), so between ``agree_every`` and ``2 * agree_every`` calls
    later and not in the call that met them; ``"nearest"`` never tunes in traffic (with ``pinned=``, sites
    the table lacks take its nearest entry); ``"error"`` raises :class:`~disttune.unseen.UnseenKeyError`.
    A tuner with ``pinned=`` never tunes after its first call: under ``"tune"`` too, a key the table
    lacks stays on its fallback.
    A world of one with ``"tune"`` runs the first config and tunes on the next call. ``fallbacks``
    and the rank log name each key served by a fallback and which one.

    ``objective`` (:mod:`disttune.objective`): ``"launch"`` (default) times each launch; ``"step"`` times
    each whole run of the function with the configs in place, tuning sites that share one config list
    jointly (``2 + C * (n_warmup + n_repeat)`` runs) and other sites one at a time, each beside the
    winners agreed before it (``2 + sum(C_s) * (n_warmup + n_repeat)`` runs). ``flush_l2`` (default
    False; the L2 policy is in :mod:`disttune.timing`) evicts the GPU's L2 before each timed launch or
    run. ``check`` (``True`` or ``(reference, output) -> bool``, :mod:`disttune.checks`) compares each
    tuning run's result with the discovery run's (each site's first working config): a config whose
    result differs on any rank scores ``inf`` on every rank, named in the log and the report. Winners
    tuned with ``objective="step"`` or ``check`` are stored apart from plain launch-level ones.
    ``objective`` may also be a callable over :class:`~disttune.measures.Measurements` (``time_ms``,
    ``peak_memory_mb``, ``energy_mj``; lower score wins) or :func:`~disttune.pareto`: launches are timed
    as with ``"launch"`` and also read by ``probe`` (default: the CUDA allocator's peak, and NVML's
    energy counter where ``pynvml`` imports, at the cost of a device synchronisation and two NVML reads
    per timed launch; nothing beside the time on the CPU), every measurement agreed over the ranks
    (:mod:`disttune.measures`).
    """

    def decorate(fn: F) -> F:
        return ContextualAutotuner(fn, is_dist, n_repeat, n_warmup, **options)  # type: ignore[return-value]

    return decorate
