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
5. **agreed**: one all-gather of a fixed-length vector (a slot per site x config), reduced over ranks;
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

from . import engine, env
from . import store as stores
from .agreement import Agreement, SiteResult, TuningError, TuningReport, settled_results
from .comm import Communicator, is_comm, make_communicator
from .compile import CompilePool, compile_share, default_compile_threads
from .fast_path import FastPlan
from .handlers import Discover
from .intercept import active_handler, close_scope, open_scope
from .logs import RankLog
from .options import AGREED, check_common, check_count, check_directory, check_path, describe_options
from .sites import Schedule, Site, SiteId, Statistic, split_predicate, total_function_runs
from .timing import Timer, default_timer

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
    cache_dir: Optional[Union[str, os.PathLike]] = None
    store: bool = True
    store_check: str = "strict"
    store_writer: str = "global"
    pinned: Optional[Union[str, os.PathLike]] = None
    compile_threads: Optional[int] = None
    compile_split: bool = True
    split: SplitSpec = False

    def __post_init__(self) -> None:
        check_common(self.n_warmup, self.n_repeat, self.reduce, self.statistic, self.timer)
        object.__setattr__(self, "timeout_s", env.timeout_s(self.timeout_s))
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
        object.__setattr__(self, "early_stop", bool(self.early_stop))
        object.__setattr__(self, "compile_split", bool(self.compile_split))

    def agreed(self) -> dict[str, str]:
        """The options every rank must share, as text for the consensus."""
        return describe_options(**{name: getattr(self, name) for name in AGREED})


class ContextualAutotuner:
    """The callable that ``contextual_autotune`` returns. See :func:`contextual_autotune`."""

    def __init__(self, fn: Callable[..., Any], is_dist: bool = False, n_repeat: int = 5, n_warmup: int = 3,
                 **options: Any) -> None:
        self.options = Options(is_dist, n_repeat, n_warmup, **options)
        functools.update_wrapper(self, fn)
        self.fn = fn
        self._splits = split_predicate(self.options.split)
        self.report: Optional[TuningReport] = None
        self._winners: dict[SiteId, Any] = {}
        self._plan: Optional[FastPlan] = None
        self._tuned = False
        self._communicator: Optional[Communicator] = None
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
            return result
        return self._tuning_call(args, kwargs)

    def _went_stale(self, stale: list[str]) -> None:
        self._tuned = False
        warnings.warn(
            f"disttune: {self.__qualname__} launched kernels it was not tuned for ("
            + ", ".join(stale) + "); they ran with their first config and the next call tunes again",
            RuntimeWarning, stacklevel=3,
        )

    def _get_communicator(self) -> Communicator:
        if self._communicator is None:
            o = self.options
            self._communicator = make_communicator(o.is_dist, o.group, o.comm, o.timeout_s)
        return self._communicator

    def _commit(self, sites: dict[SiteId, Site], results: list[SiteResult]) -> dict[SiteId, Any]:
        self._winners = engine.commit(sites, results)
        self._plan = FastPlan(sites, self._winners)
        return self._winners

    def _tuning_call(self, args: tuple, kwargs: dict) -> Any:
        """Discover, agree on the sites, tune, agree on the winners, commit and store, run with the winners."""
        o, name = self.options, self.__qualname__
        engine.refuse_graph_capture(name)
        comm = self._get_communicator()
        started = time.perf_counter()
        agreement = Agreement(comm, name, o.reduce, o.statistic)
        threads = default_compile_threads() if o.compile_threads is None else o.compile_threads
        share = compile_share(comm) if o.compile_split and threads > 0 and comm.world_size > 1 else None
        compiles = CompilePool(threads, share) if threads > 0 else None
        sites: dict[SiteId, Site] = {}
        log = RankLog(o.log_dir, engine.global_rank(comm), name)
        winners_store, table, setup_error = None, None, None
        try:  # what fails here on one rank reaches the others in the consensus, after a paired discovery run
            check_directory("log_dir (resolved)", log.path.parent)
            winners_store = engine.open_store(o.store, o.cache_dir, comm, o.store_check, o.timeout_s)
            table = stores.load_table(o.pinned) if o.pinned else None
        except Exception as err:
            setup_error = (err, f"before the discovery run: {type(err).__name__}: {err}")
        try:
            discover = Discover(sites, o.always_tune, engine.lookup(winners_store, table, o.always_tune), compiles)
            result, error = engine.run_once(self.fn, discover, args, kwargs)
            error = setup_error or error
            if compiles is not None:
                compiles.finish()
            found = list(sites.values())
            agreement.consensus(found, error, o.agreed(), [bool(self._splits(s)) for s in found],
                                None if table is None else stores.table_digest(table), o.pinned)
            tuned = [s for s in found if s.preset is None and s.decided is None]
            for site in tuned:
                if comm.world_size > 1 and self._splits(site):
                    site.share = (comm.rank, comm.world_size)
            if compiles is not None:  # every rank finished its share before the consensus: the peers' are cached
                compiles.compile_rest(tuned)
            runs = engine.Runs(self.fn, args, kwargs, sites, agreement, o.timer or default_timer(), o.verbose)
            function_runs = 1
            if o.early_stop and max((len(s.configs) for s in tuned), default=0) > 2:
                function_runs += runs.screen(tuned)
            longest = max((s.slots() for s in tuned), default=0)
            function_runs += runs.stage(Schedule(longest, o.n_warmup, o.n_repeat), "tuning run")
            results = agreement.verdicts(tuned, log) + settled_results(found, log)
            winners = self._commit(sites, results)
            if any(s.preset is None for s in found):
                result, results, final_runs = runs.final(results, winners, log, lambda r: self._commit(sites, r))
                function_runs += final_runs
            if winners_store is not None and engine.is_store_writer(o.store_writer, comm):
                engine.save_winners(winners_store, [(engine.kernel_entry(sites[r.site]), r) for r in results], name)
            wall_s = time.perf_counter() - started
            self.report = TuningReport(tuple(results), function_runs, wall_s, comm.world_size)
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
