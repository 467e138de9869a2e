"""``contextual_autotune``: tune every ``triton.autotune`` kernel inside a function, in place.

A tuning call of a wrapped function is a :class:`KernelTuningCall`, the pipeline's steps
(:mod:`disttune.pipeline`) with the function's launches as its sites:

1. **discover**: one run of the function with its autotuned launches routed to a launch handler
   (:mod:`disttune.intercept`, :mod:`disttune.handlers`) names every launch a site (kernel, tuning
   key, occurrence), finds a config that works on this rank and starts compiling the rest
   (:mod:`disttune.compile`);
2. **consensus**: one all-gather, so that a mismatch (sites, options, split, pinned table) or a
   discovery error is the same clear error on every rank (:mod:`disttune.agreement`);
3. **tune**: ``longest * (n_warmup + n_repeat)`` tuning runs, each site trying the config the
   rank-independent schedule gives it (:class:`~disttune.sites.Schedule`) under the Timer, each run
   ended by a one-float all-gather that turns an error on any rank into an error on all (a search
   narrows the configs, :mod:`disttune.search`);
4. **agree**: one all-gather of a fixed-length vector (a slot per site x config, x measurement with a
   measured objective), reduced over ranks: the same winners everywhere, logged and committed to each
   kernel's ``Autotuner.cache``;
5. **final**: a run with the winners gives the caller its result, ended by a status all-gather (an
   error on any rank is an error on all);
6. **store**: then, only then, the winners go into the winner store (:mod:`disttune.store`).

After that every call takes the fast path (:mod:`disttune.fast_path`).
"""

from __future__ import annotations

import functools
import os
import sys
import warnings
from typing import Any, Callable, Iterable, Optional, TypeVar, Union

from . import console, diagnostics, env, startup, verify, warmup
from . import store as stores
from .agreement import SiteResult, TuningError, TuningReport
from .checks import make_check
from .comm import Communicator, global_rank, make_communicator
from .compile import CompilePool, compile_share, default_compile_threads
from .configs import config_text
from .fast_path import FastPlan
from .graphs import StepGraphs
from .handlers import Discover
from .intercept import active_handler, close_scope, open_scope
from .logs import RankLog
from .objective import ProbingTimer, default_probe, measured
from .options import Options, check_directory
from .pipeline import Runs, TuningCall, commit, refuse_graph_capture, run_once, step_stages
from .search import SearchTrace, narrow
from .sites import AllConfigsFailed, Schedule, Site, SiteId, split_predicate, total_function_runs
from .sweep import SweepRow, sweep_contextual
from .timing import default_timer, flushing
from .triton_launch import check_driver
from .unseen import NEVER, NEW_KEY_POLICIES, NewKeys, NewKeyVotes, pinned_or_nearest

__all__ = ["ContextualAutotuner", "KernelTuningCall", "Options", "SiteResult", "TuningError", "TuningReport",
           "contextual_autotune"]

F = TypeVar("F", bound=Callable[..., Any])


class KernelTuningCall(TuningCall):
    """One tuning call of a :class:`ContextualAutotuner` with ``args`` and ``kwargs``: the pipeline's steps over
    the function's intercepted launches. What fails before the discovery run on one rank (a bad
    ``$DISTTUNE_TIMEOUT``, the log directory, the store, the pinned table) is kept as its error and reaches
    the peers in the consensus, after a paired discovery run."""

    def __init__(self, tuner: "ContextualAutotuner", args: tuple, kwargs: dict, verbose: bool = True) -> None:
        o, name = tuner.options, tuner.__qualname__
        check_driver()  # the same on every rank of a CPU job: one line, before any collective
        refuse_graph_capture(name)
        self.verify_threshold = verify.requested()
        super().__init__(name, tuner.communicator(), o)
        self.tuner, self.args, self.kwargs, self.verbose = tuner, args, kwargs, verbose and o.verbose
        threads = default_compile_threads() if o.compile_threads is None else o.compile_threads
        self.share = compile_share(self.comm) if o.compile_split and threads > 0 and self.comm.world_size > 1 else None
        self.compiles = CompilePool(threads, self.share) if threads > 0 else None
        # the step objective's runs do not wait config by config: every compile finishes before them
        self.overlap = (self.compiles is not None and self.share is None and env.compile_overlap()
                        and o.objective != "step")
        self.log = RankLog(o.log_dir, global_rank(self.comm), name)
        self.from_nearest: dict[SiteId, tuple[Any, str]] = {}  # pinned-table sites answered by their nearest entry
        self.setup_failed = False
        try:
            if o.env_error is not None:
                raise o.env_error
            check_directory("log_dir (resolved)", self.log.path.parent)
            self.winners_store = stores.open_store(o.store, o.cache_dir, self.comm, o.store_check, o.timeout_s)
            self.table = stores.load_table(o.pinned) if o.pinned else None
        except Exception as err:
            self.setup_failed = True
            self.error = (err, f"{type(err).__name__}: {err} (while setting up)")
        self.runs: Optional[Runs] = None
        self.winners: dict[SiteId, Any] = {}  # committed by the agree step, launched by the final run

    def entry(self, site: Site) -> stores.EntryId:
        return self.tuner.entry(site)

    def discover(self) -> None:
        o = self.options
        lookup = stores.lookup(self.winners_store, self.table, o.always_tune, self.entry)
        if self.table is not None and o.on_new_key == "nearest":
            lookup = pinned_or_nearest(lookup, self.table, self.from_nearest)
        handler = Discover(self.sites, o.always_tune, lookup, self.compiles, self.phases)
        self.result, error = run_once(self.tuner.fn, handler, self.args, self.kwargs)
        self.error = self.error or (error and (error[0], f"{error[1]} (in the discovery run)"))
        self.function_runs = 1
        if self.compiles is not None and not self.overlap:  # (overlapping: the tuning runs wait config by config)
            with self.phases.span("compile wait"):
                self.compiles.finish()

    def agreed_options(self) -> dict[str, str]:
        return {**self.options.agreed(), "DISTTUNE_VERIFY": repr(self.verify_threshold)}  # verify adds runs: all or none

    def split_flags(self, sites: Iterable[Site]) -> list[bool]:
        return [bool(self.tuner.splits(site)) for site in sites]

    def consensus_inputs(self) -> dict[str, Any]:
        return {"table": None if self.table is None else stores.table_digest(self.table), "pinned": self.options.pinned,
                "run": self.log.run}  # type: ignore[union-attr]

    def consensus(self) -> None:
        super().consensus()
        log, comm = self.log, self.comm
        log.run = self.agreement.run or log.run  # type: ignore[union-attr]
        for site in self.sites.values():
            log.label_key(site.id.kernel, site.id.key, site.id.key_text())  # type: ignore[union-attr]
        for site in self.tuned:
            if comm.world_size > 1 and self.tuner.splits(site):
                site.share = (comm.rank, comm.world_size)
        if self.compiles is not None and self.share is not None:  # every rank finished its share: load the peers'
            with self.phases.span("compile wait"):
                self.compiles.compile_rest(self.tuned)

    def tune(self) -> None:
        o = self.options
        timer = o.timer or default_timer()
        if measured(o.objective):
            probe = o.probe or default_probe(lambda step: self.agreement.wait_for_device(step, counted=False))
            timer = ProbingTimer(timer, probe, repeatable=True)
        runs = self.runs = Runs(self.tuner.fn, self.args, self.kwargs, self.sites, self.agreement,
                                flushing(timer) if o.flush_l2 else timer, self.verbose,
                                self.compiles if self.overlap else None, self.phases)
        runs.check = make_check(o.check, self.result)  # the discovery run's result is the reference
        self.function_runs += self.verify_decided()
        if o.objective == "step":
            self.function_runs += step_stages(runs, self.tuned, o.n_warmup, o.n_repeat, runs.check)
        else:
            searched, self.tuner.search_trace, full_timing = narrow(
                self.tuned, o.search, o.n_warmup, o.n_repeat, runs.stage, self.agreement.gather_agreed,
                self.comm.all_gather_objects)
            self.function_runs += searched
            if full_timing:
                longest = max((s.slots() for s in self.tuned), default=0)
                self.function_runs += runs.stage(Schedule(longest, o.n_warmup, o.n_repeat), "tuning run")
        if self.overlap:
            with self.phases.span("compile wait"):
                self.compiles.finish()  # type: ignore[union-attr]  # a config never launched may still fail here

    def verify_decided(self) -> int:
        """With ``$DISTTUNE_VERIFY``: time the stored and pinned winners in place (:mod:`disttune.verify`)."""
        o = self.options
        if self.verify_threshold is None:
            return 0
        if o.objective == "step":
            verify.not_for_the_step_objective(self.log, self.name)
            return 0
        return verify.verify_decided(list(self.sites.values()), self.runs, self.agreement, o.n_warmup, o.n_repeat,
                                     self.winners_store, self.table, self.log, self.verify_threshold, self.entry,
                                     self.verbose)

    def agree(self) -> None:
        super().agree()
        compiled = self.compiles.compiled if self.compiles is not None else {}
        diagnostics.log_tuned(self.log, self.sites, self.results, compiled)
        self.winners = self.tuner.commit(self.sites, self.results, self.elapsed())
        for ident, (config, source) in self.from_nearest.items():  # the same on every rank: the table is agreed
            self.tuner.new_key_fallback(ident, config, source)
            self.log.fallback(ident.kernel, ident.key, ident.occurrence, config_text(config), source)  # type: ignore[union-attr]

    def final(self) -> None:
        """The run with the winners (none is needed when every site was in the kernels' caches: the discovery run
        launched the winners)."""
        if all(s.preset is not None for s in self.sites.values()):
            return
        self.result, self.results, made = self.runs.final(  # type: ignore[union-attr]
            self.results, self.winners, self.log, lambda r: self.tuner.commit(self.sites, r, self.elapsed()))
        self.function_runs += made

    def background(self) -> dict[str, float]:
        return self.compiles.busy_s() if self.compiles is not None else {}

    def finish(self) -> None:
        super().finish()
        o, report = self.options, self.report
        self.log.tuning(self.name, report.wall_s, self.function_runs, len(self.tuned),  # type: ignore[union-attr]
                        self.comm.world_size, o.reduce, str(o.statistic))

    def close(self) -> None:
        if self.compiles is not None:
            self.compiles.shutdown()
        if not self.setup_failed:
            self.log.flush()  # type: ignore[union-attr]

    def failed(self, error: BaseException) -> None:
        """The error goes into the rank log, under the job's run where the consensus agreed on it, so the report
        of the run names the failure rather than an earlier run's winners."""
        if self.setup_failed:
            return
        self.log.run = self.agreement.run or self.log.run  # type: ignore[union-attr]
        self.log.failure(" ".join(f"{type(error).__name__}: {error}".split()))  # type: ignore[union-attr]
        try:
            self.log.flush()  # type: ignore[union-attr]
        except OSError:  # the error being raised says more than a log that cannot be written
            pass


class ContextualAutotuner:
    """The callable that ``contextual_autotune`` returns. See :func:`contextual_autotune`."""

    def __init__(self, fn: Callable[..., Any], is_dist: bool = False, n_repeat: int = 5, n_warmup: int = 3,
                 **options: Any) -> None:
        self.options = Options(is_dist, n_repeat, n_warmup, **options)
        startup.start()  # a disttune error ends the job in one line; unknown DISTTUNE_* variables are named
        warmup.start_for_tuner()  # Triton's one-time initialisation, off the first tuning call
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.splits = split_predicate(self.options.split)
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
        # after tuning, each call signature's second call is captured in a CUDA graph and later ones replay it
        self._graphs = StepGraphs(self.__qualname__, agree=self._agree_on_capture) if self.options.cuda_graph else None
        # update_wrapper has made the instance dict a key-sharing one, whose reads CPython 3.11 does not
        # specialize: a plain copy keeps the fast path's three attribute reads at a dict hint's cost.
        self.__dict__ = dict(self.__dict__)

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        return self if obj is None else functools.partial(self.__call__, obj)

    @property
    def tuned(self) -> bool:
        return self._tuned

    @property
    def graphs(self) -> Optional[StepGraphs]:
        """This step's CUDA graphs with ``cuda_graph=True`` (``captures`` and ``replays`` count them), else None."""
        return self._graphs

    @property
    def known_sites(self) -> dict[SiteId, Site]:
        """Every site a tuning call of this wrapper has met, by its identity (what the fast path serves)."""
        return self._known_sites

    def retune(self) -> None:
        """Forget the winners of this wrapper; the next call tunes again (the kernels' caches are kept)."""
        self._tuned = False
        self._winners = {}
        self._plan = None
        self._known_sites, self._known_winners, self._new_keys, self._saved_call = {}, {}, None, None
        self._votes = None
        if self._graphs is not None:
            self._graphs.clear()

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
            plan = self._plan
            graphs = self._graphs
            if graphs is None:
                result = self._launch_winners(args, kwargs)
            else:
                result = graphs(self._launch_winners, args, kwargs)
            plan.countdown -= 1  # type: ignore[union-attr]
            if not plan.countdown:  # type: ignore[union-attr]
                self._agree_on_new_keys()
            return result
        return self.tuning_call(args, kwargs)

    def _launch_winners(self, args: tuple, kwargs: dict) -> Any:
        """One run of the function on the fast path (what every call after tuning costs): a spare handler
        (list.pop and append are atomic, so threads never share one), the bare scope pair, the planned launches."""
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
        return result

    def tuning_call(self, args: tuple, kwargs: dict, verbose: bool = True) -> Any:
        """One tuning call with ``args`` and ``kwargs`` (what the first call makes): the pipeline's steps, then the
        fast path from the next call on; returns the function's result with the winners. ``verbose=False``
        keeps rank 0's summary to itself (the sweep prints its own table)."""
        call = KernelTuningCall(self, args, kwargs, verbose)
        result = call.run()
        o, comm = self.options, call.comm
        self.report = call.report
        self._tuned = True
        if self._graphs is not None:  # graphs of earlier winners are stale; this call was the signature's first
            self._graphs.clear()
            self._graphs.seen(args, kwargs)
        if call.verbose and comm.rank == 0:
            console.print_summary(self.__qualname__, self.report, o.reduce, call.log.path)  # type: ignore[union-attr]
        if env.triton_prints_autotuning():
            console.print_triton_style(self.report, comm.rank)
        return result

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
        due = self._votes.point(self.communicator(), saved)
        if due is None:
            return  # some rank met none, or met them in another call: they stay on their fallback
        try:
            self.tuning_call(due[1], due[2])
        except (TuningError, AllConfigsFailed) as err:  # agreed on every rank: the keys keep their fallback
            log = RankLog(self.options.log_dir, global_rank(self.communicator()), self.__qualname__)
            log.note("new keys", f"tuning the new keys failed, they stay on their fallback: {err}")
            log.flush()

    def _agree_on_capture(self, outcome: str) -> list:
        """Every rank's outcome of capturing one signature's graph (one control-plane collective per capture)."""
        return self.communicator().all_gather_objects(outcome, "capturing the step in a CUDA graph")

    def _went_stale(self, stale: list[str]) -> None:
        self._tuned = False
        warnings.warn(
            f"disttune: {self.__qualname__} launched kernels it was not tuned for ("
            + ", ".join(stale) + "); they ran with their first config and the next call tunes again",
            RuntimeWarning, stacklevel=_frames_to_caller(),
        )

    def entry(self, site: Site) -> stores.EntryId:
        """A site's identity in the winner store: winners of the step objective or of a checked tuning are their own."""
        o = self.options
        kind = "kernel" + ("" if o.objective == "launch" else f" objective={o.objective_text()}")
        kind += " checked" if o.check else ""
        return stores.kernel_entry(site, kind)

    def communicator(self) -> Communicator:
        """The ranks this wrapper agrees with (made on first use from ``is_dist``, ``group`` and ``comm``)."""
        if self._communicator is None:
            o = self.options
            self._communicator = make_communicator(o.is_dist, o.group, o.comm, o.timeout_s)
        return self._communicator

    def commit(self, sites: dict[SiteId, Site], results: list[SiteResult], wall_s: float = 0.0) -> dict[SiteId, Any]:
        """The agreed winners into the kernels' caches and this wrapper's fast path; returns them by site."""
        self._winners = commit(sites, results, wall_s)
        self._known_sites.update(sites)
        self._known_winners.update(self._winners)
        self._plan = FastPlan(self._known_sites, self._known_winners, *self._unseen_policy())
        return self._winners

    def new_key_fallback(self, ident: SiteId, config: Any, source: str) -> None:
        """A site the pinned table lacked, answered with its nearest entry: served as a fallback from now on."""
        self._new_keys.served[ident] = (config, source)  # type: ignore[union-attr]

    def _unseen_policy(self) -> tuple[Optional[NewKeys], int]:
        """The plan's fallback for keys it was not tuned for, and its countdown to the next agreement.

        A world of one with ``on_new_key="tune"`` keeps the simplest rule: the launch runs its first config
        and the next call tunes (no peer can be left waiting). A tuner with a pinned table never tunes: a
        key the table lacks stays on its fallback, as with ``"nearest"``.
        """
        o, comm = self.options, self.communicator()
        tunes_new_keys = NEW_KEY_POLICIES[o.on_new_key].tunes and not o.pinned
        if tunes_new_keys and comm.world_size == 1:
            return None, NEVER
        if self._new_keys is None:
            table = stores.load_table(o.pinned) if o.pinned else None
            self._new_keys = NewKeys(self.__qualname__, o.on_new_key, table, self._log_fallback)
        self._new_keys.remember(self._winners)
        return self._new_keys, o.agree_every if tunes_new_keys else NEVER

    def _log_fallback(self, ident: SiteId, config: Any, source: str) -> None:
        log = RankLog(self.options.log_dir, global_rank(self.communicator()), self.__qualname__)
        log.fallback(ident.kernel, ident.key, ident.occurrence, config_text(config), source)
        log.flush()


def _frames_to_caller() -> int:
    """The ``stacklevel`` that names the first frame outside the disttune package, for a warning raised in the
    function calling this (the fast path reaches it through one frame or, replaying, through several)."""
    package = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package + os.sep):
        frame, level = frame.f_back, level + 1
    return level


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
    the nearest tuned key (the rule in :mod:`disttune.unseen`; the first config when none is a candidate), the same
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
    ``objective`` may also be a callable over :class:`~disttune.objective.Measurements` (``time_ms``,
    ``peak_memory_mb``, ``energy_mj``; lower score wins) or :func:`~disttune.pareto`: launches are timed
    as with ``"launch"`` and also read by ``probe`` (default: the CUDA allocator's peak, and NVML's
    energy counter where ``pynvml`` imports, at the cost of a device synchronisation and two NVML reads
    per timed launch; nothing beside the time on the CPU), every measurement agreed over the ranks
    (:mod:`disttune.objective`).

    ``cuda_graph`` (default False; GPUs only, a ValueError elsewhere): after tuning, each argument signature's
    second call is captured in a CUDA graph with the winners and every later call replays it, copying its tensor
    arguments in and returning clones of the results (:mod:`disttune.graphs`): a few µs of host per call, where
    an eager step pays every launch and collective. The function must be capturable (no host synchronization;
    the tensors it reads are arguments or keep their address) and the process groups it uses must be destroyed
    after its graphs (``disttune.dist.destroy`` and the exit handler see to it). A later tuning drops the graphs.
    """

    def decorate(fn: F) -> F:
        return ContextualAutotuner(fn, is_dist, n_repeat, n_warmup, **options)  # type: ignore[return-value]

    return decorate
