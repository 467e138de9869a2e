"""``disttune.autotune``: tune a function over a space of keyword arguments, agreed across ranks.

The counterpart of Triton-distributed's ``tune.autotune`` for functions whose tunables
are arbitrary keyword arguments (algorithm choices, chunk counts, a ``triton.Config``
handed to a kernel by hand). Each config of the pruned space is timed over whole
calls of the function, every call starting right after a collective so all ranks start
together; per-rank statistics are all-gathered and combined like the contextual
tuner's (max over ranks by default, ``inf`` if a config's result failed ``check=`` on any
rank), and the winner is stored so later processes skip tuning.

A tuning is a :class:`FunctionTuningCall`, the pipeline's steps (:mod:`disttune.pipeline`) with a whole
call in place of an intercepted launch: the key becomes one site whose candidates are the configs,
each tuning run (a call of the function) runs the config the shared :class:`~disttune.sites.Schedule`
gives it and is timed by the Timer, and the ranks agree, run the winner and store it through the same
steps, and end alike through the same :mod:`disttune.ending`, as the contextual tuner's.

The function's own exceptions end the tuning, as in the contextual tuner: one raised in a tuning run or
in the final run on any rank, before or after the function's own collectives, is the same TuningError
on every rank, naming each rank's exception, within seconds (a peer stranded in the function's own
collective is freed by aborting the job's process groups; :mod:`disttune.ending`). A config that
cannot run is not scored ``inf``: leave it out with ``prune_fn``.

Cost of one tuning: ``len(space) * (n_warmup + n_repeat) + 1`` calls of the function
(the last with the winner, whose result is returned), one status all-gather after each tuning run
(it is also the next run's starting line), and three more all-gathers: the consensus, the agreement,
and the final run's status. On the first call an error of ``key_fn`` or ``prune_fn`` on one rank is
the same error on all (every rank is tuning then; later, a rank cannot know whether its peers are,
and raises alone). Every collective uses ``group=`` (a torch process group or an mpi4py communicator;
``comm=`` is the older name for the latter), or ``autotune_pg=`` at call time.

``split=True`` is for functions with no communication inside: rank ``r`` times only
configs ``r, r + w, r + 2w, ...`` and each config's time is its owner's, so ``w`` ranks
tune about ``w`` times faster (every rank still sees the same winner). In ``last_timings`` a
config another rank timed is ``nan`` in this rank's ``per_rank_ms`` row.

After tuning, a call costs one ``key_fn`` call and a dict lookup over calling the function with
the winner (``bench/fast_path.py`` measures it).
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
from typing import Any, Callable, Iterable, Optional, Sequence

from . import store as stores
from . import startup, warmup
from .agreement import Agreement, SiteResult, TuningError
from .checks import OutputCheck, blame, make_check
from .comm import Communicator, is_comm, make_communicator
from .configs import kwargs_text
from .objective import ProbingTimer, default_probe, describe_measurements, measured, measures_of
from .options import Options
from .pipeline import TuningCall
from .search import SearchTrace, narrow
from .sites import AllConfigsFailed, Schedule, Site, SiteId
from .sweep import SweepRow, sweep_function
from .timing import LaunchInfo, default_timer, flushing
from .unseen import NEVER, NEW_KEY_POLICIES, NewKeyVotes, UnseenKeyError, table_candidates

CALL_FLAGS = ("autotune", "autotune_verbose", "autotune_pg")


class FunctionTuningCall(TuningCall):
    """The tuning of one key of a :class:`FunctionAutotuner` over ``configs`` with ``args`` and ``kwargs``: the
    pipeline's steps over one site, the key, timed over whole calls. ``final=False`` skips the call with the
    winner (a sweep, or a key tuned at an agreement point); :attr:`config` is the winner."""

    def __init__(self, tuner: "FunctionAutotuner", key: Any, configs: list[dict], args: tuple, kwargs: dict,
                 comm: Communicator, verbose: bool = False, final: bool = True) -> None:
        super().__init__(tuner.__qualname__, comm, tuner.options)
        self.tuner, self.key, self.configs, self.args, self.kwargs = tuner, key, configs, args, kwargs
        self.verbose, self.with_final = verbose, final
        self.config: Optional[dict] = None
        self.timings: Optional[dict] = None  # the agreed timings of a key tuned here (``last_timings``)

    def entry(self, site: Site) -> stores.EntryId:
        return self.tuner.entry(self.key, self.configs)

    def discover(self) -> None:
        o = self.options
        site = Site(SiteId(f"{self.tuner.fn.__module__}.{self.name}", (repr(self.key),), 0), None, self.configs)
        self.sites[site.id] = site
        self.winners_store = stores.open_store(o.store, o.cache_dir, self.comm, timeout_s=o.timeout_s)
        lookup = stores.lookup(self.winners_store, None, False, self.entry)
        site.local_answer = None if lookup is None else lookup(site)
        if o.env_error is not None:  # a bad $DISTTUNE_TIMEOUT: the same error on every rank
            self.error = (o.env_error, f"{type(o.env_error).__name__}: {o.env_error} (while setting up)")

    def tune(self) -> None:
        o, comm = self.options, self.comm
        if not self.tuned:
            return
        (site,) = self.tuned
        if o.split:
            site.share = (comm.rank, comm.world_size)
        timed = TimedCalls(self, site)
        _, self.tuner.search_trace, full_timing = narrow([site], o.search, o.n_warmup, o.n_repeat, timed.stage,
                                                         self.agreement.gather_agreed, comm.all_gather_objects)
        if full_timing:
            timed.stage(Schedule(site.slots(), o.n_warmup, o.n_repeat), "tuning run")

    def agree(self) -> None:
        super().agree()
        (result,) = self.results
        self.config = self.configs[result.winner]
        if result.source != "tuned":
            return
        self.timings = {"configs": self.configs, "per_rank_ms": [list(row) for row in result.per_rank_ms],
                        "agreed_ms": list(result.agreed_ms), "winner": result.winner,
                        "measurements": list(result.measurements), "front": list(result.front)}
        if self.verbose and self.comm.rank == 0:
            print_timings(self.name, self.configs, result)

    def final(self) -> None:
        """The final run: the call with the winner, whose result the tuning call returns; an error there on one
        rank is the same TuningError on every rank (a world of one raises it itself)."""
        if not self.with_final:
            return
        call = functools.partial(self.tuner.fn, *self.args, **self.kwargs, **self.config)  # type: ignore[arg-type]
        if self.comm.world_size == 1:
            self.result = call()
            return
        try:
            self.result, error = call(), None
        except Exception as err:
            error = (err, f"{type(err).__name__}: {err}")
        self.agreement.final_run_status([], error, {}, "final run")

    def writes_store(self) -> bool:
        return self.comm.rank == 0  # the group's first rank (a subgroup need not hold global rank 0)


def print_timings(name: str, configs: Sequence[dict], result: SiteResult) -> None:
    """``autotune_verbose=True``: every config's agreed time on rank 0, the winner marked."""
    for i, config in enumerate(configs):
        mark = "  <- winner" if i == result.winner else ""
        extra = (f", {describe_measurements(result.measurements[i])}, score {result.scores[i]:.4g}"
                 if result.measurements else "")
        print(f"disttune.autotune {name} {kwargs_text(config)}: {result.agreed_ms[i]:.4f} ms{extra}{mark}",
              file=sys.stdout, flush=True)


class TimedCalls:
    """The function tuner's tuning runs: whole calls timed into ``site``'s samples, each ended by a status
    all-gather (:meth:`~disttune.agreement.Agreement.check_run`) that turns an exception on any rank into the same
    error on all, and from which the next call starts on every rank together. One output check serves every
    stage (a search's batches): made from the first successful call, so every config meets the same reference;
    a config whose result differs is scored ``inf`` and keeps its turns, so the ranks' calls stay paired."""

    def __init__(self, call: FunctionTuningCall, site: Site) -> None:
        o = call.options
        self.call, self.site = call, site
        self.check: Optional[OutputCheck] = None
        timer = o.timer or default_timer()
        if measured(o.objective):
            timer = ProbingTimer(timer, o.probe or default_probe(
                lambda step: call.agreement.wait_for_device(step, counted=False)))
        self.timer = flushing(timer) if o.flush_l2 else timer

    def stage(self, schedule: Schedule, label: str) -> int:
        """``schedule.runs`` calls of the function (tuning runs named ``label``); returns the count."""
        call, site, o = self.call, self.site, self.call.options
        comm, agreement = call.comm, call.agreement
        fn, args, kwargs = call.tuner.fn, call.args, call.kwargs
        for run in range(schedule.runs):
            step = f"{label} {run + 1}/{schedule.runs}"
            position, timed = schedule.slot(run, len(site.active), site.share)
            index = None if position is None else site.active[position]
            outcome: dict = {}
            read, error = None, None
            if index is not None:
                config = site.configs[index]
                try:
                    if not timed:
                        outcome["result"] = fn(*args, **kwargs, **config)
                    else:
                        iteration = run % (o.n_warmup + o.n_repeat)
                        info = LaunchInfo(call.name, (repr(call.key),), 0, index, config, iteration, comm.rank)
                        read = self.timer.time(lambda: outcome.__setitem__("result", fn(*args, **kwargs, **config)),
                                               info)
                except Exception as err:  # the function's own error: the same error on every rank, below
                    error = (err, f"{type(err).__name__}: {err}")
            # every rank, every call: the timer and the check read the GPU's results
            agreement.wait_for_device(f"{step} (on the GPU)")
            call.function_runs += 1
            if error is None and index is not None and index not in site.failures:
                self.record(index, read, outcome["result"])
            agreement.check_run([error[1]] if error else [], step, error and error[0])
        return schedule.runs

    def record(self, index: int, read: Optional[Callable[[], float]], result: Any) -> None:
        """A successful call of config ``index``: its time (if ``read``), and its ``result`` against the reference."""
        site, o = self.site, self.call.options
        if read is not None:
            site.add_sample(index, read(), time.time(), measures_of(read))
        if o.check:  # the first successful call's result is the reference
            if self.check is None:
                self.check = make_check(o.check, result)
            elif not self.check.matches(result):
                blame({site.id: site}, {site.id: index})


class FunctionAutotuner:
    """The callable that :func:`autotune` returns; see there."""

    def __init__(self, fn: Callable[..., Any], config_space: Sequence[dict], key_fn: Callable[..., Any],
                 prune_fn: Optional[Callable[..., bool]] = None, **options: Any) -> None:
        if not config_space or not all(isinstance(c, dict) for c in config_space):
            raise ValueError("disttune.autotune: config_space must be a non-empty list of dicts of keyword arguments")
        if not callable(key_fn):
            raise TypeError("disttune.autotune: key_fn must be callable (it gets the function's arguments)")
        self.options = Options.for_function(**options)
        startup.start()  # a disttune error ends the job in one line; unknown DISTTUNE_* variables are named
        reserved = {name for config in config_space for name in config} & set(CALL_FLAGS)
        if reserved:
            raise ValueError(f"disttune.autotune: config_space uses reserved names {sorted(reserved)}")
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.config_space = [dict(c) for c in config_space]
        self._tunables = frozenset(name for config in self.config_space for name in config)
        self.key_fn, self.prune_fn = key_fn, prune_fn
        o = self.options
        self.group = o.group if o.group is not None else o.comm
        self.check = o.check
        self.policy = NEW_KEY_POLICIES[o.on_new_key]
        self.search_trace: Optional[SearchTrace] = None  # what the last model search proposed
        self.pinned = stores.load_table(o.pinned) if o.pinned else None  # a deployed table: its keys are never tuned
        self.cache: dict[Any, dict] = {}  # key -> winning config, for this process
        self.fallbacks: dict[Any, tuple[dict, str]] = {}  # key -> (config, source): keys served without tuning
        self._countdown = NEVER  # calls to the next agreement on new keys (multi-rank "tune" only)
        self._saved_call: Optional[tuple[int, Any, tuple, dict]] = None  # (position, key, args, kwargs)
        self._votes = NewKeyVotes(self.__qualname__)  # the agreement points on new keys
        self.last_timings: Optional[dict] = None
        warmup.start_for_tuner()  # Triton's one-time initialisation, off the first tuning call

    def __call__(self, *args: Any, autotune: bool = True, autotune_verbose: bool = False, autotune_pg: Any = None,
                 **kwargs: Any) -> Any:
        if kwargs and not self._tunables.isdisjoint(kwargs):
            clash = sorted(self._tunables & kwargs.keys())
            raise TypeError(f"disttune.autotune: {self.__qualname__} got {clash} as keyword argument(s), "
                            "but the autotuner sets them from config_space; drop them from the call")
        if not autotune:
            return self.fn(*args, **kwargs, **self.pruned(args, kwargs)[0])
        self._countdown -= 1
        if not self._countdown:
            self._agree_on_new_keys(autotune_pg, autotune_verbose)
        try:
            winner = self.cache.get(self.key_fn(*args, **kwargs))
        except Exception:  # key_fn raised or gave an unhashable key: the slow path reports it
            winner = None
        if winner is not None:  # the fast path: one key_fn call and a dict lookup over the plain call
            return self.fn(*args, **kwargs, **winner)
        return self._new_key_call(args, kwargs, self.communicator(autotune_pg), autotune_verbose)

    def _new_key_call(self, args: tuple, kwargs: dict, comm: Communicator, verbose: bool) -> Any:
        """A key with no winner yet: tuned (the first key, or any key in a world of one), served from the
        pinned table, or served by its fallback with no collective (see :mod:`disttune.unseen`)."""
        o = self.options
        tunes_now = not self.cache and self.pinned is None
        where = "key_fn"
        try:
            key = self.key(args, kwargs)
            where = "prune_fn"
            configs = self.pruned(args, kwargs)
        except Exception as err:
            if comm.world_size == 1 or not tunes_now:
                raise
            # Nothing tuned yet, so every peer is tuning too and waits in the consensus: join it with the error.
            agreement = Agreement(comm, self.__qualname__)
            with agreement.ending:
                agreement.consensus([], (err, f"{type(err).__name__}: {err} (in {where})"), {}, [])
            raise  # not reached: the consensus raised the error on every rank
        served = self.fallbacks.get(key)
        if served is None and self.pinned is not None:
            pinned = self._pinned_winner(key, configs)
            if pinned is not None:
                self.cache[key] = pinned
                return self.fn(*args, **kwargs, **pinned)
        if served is None:
            if tunes_now or (self.policy.tunes and comm.world_size == 1):
                call = self.tune_key(key, configs, args, kwargs, comm, verbose, final=True)
                if self.policy.tunes and comm.world_size > 1 and self._countdown > o.agree_every:
                    self._countdown = o.agree_every  # the first key is tuned: later new keys wait for agreements
                return call.result
            served = self._fallback(key, configs)
        if self.policy.tunes and self._saved_call is None:
            self._saved_call = (o.agree_every - self._countdown, key, args, kwargs)
        return self.fn(*args, **kwargs, **served[0])

    def tune_key(self, key: Any, configs: list[dict], args: tuple, kwargs: dict, comm: Communicator,
                 verbose: bool = False, final: bool = False) -> FunctionTuningCall:
        """Tune ``key`` over ``configs`` with ``args`` and ``kwargs`` on every rank of ``comm`` (or take its stored
        winner), store it and serve it from now on; ``final=True`` also calls the function with the winner
        (the call's ``result``). Returns the finished call (``results``, ``timings``)."""
        call = FunctionTuningCall(self, key, configs, args, kwargs, comm, verbose, final)
        call.run()
        self.last_timings = call.timings
        self.cache[key] = call.config  # type: ignore[assignment]
        self.fallbacks.pop(key, None)
        return call

    def key(self, args: tuple, kwargs: dict) -> Any:
        """``key_fn``'s key for these arguments; a TypeError when it is not hashable."""
        key = self.key_fn(*args, **kwargs)
        try:
            hash(key)
        except TypeError:
            raise TypeError(f"disttune.autotune: key_fn of {self.__qualname__} returned an unhashable "
                            f"{type(key).__name__} ({key!r}); return a tuple or another hashable value") from None
        return key

    def sweep(self, cases: Iterable[tuple[tuple, dict]], table: Optional[str | os.PathLike] = None,
              verbose: bool = True, group: Any = None) -> list[SweepRow]:
        """Tune every new key of ``cases`` (``(args, kwargs)`` pairs, the same order on every rank) over ``group``
        (default ``group=``), print the table on rank 0, write a pinned table to ``table`` (:mod:`disttune.sweep`)."""
        return sweep_function(self, cases, table, verbose, group)

    def _pinned_winner(self, key: Any, configs: list[dict]) -> Optional[dict]:
        """The pinned table's winner for ``key`` over ``configs`` (None when the table has none)."""
        entry = self.entry(key, configs)
        index = stores.pinned_lookup(self.pinned, entry)  # type: ignore[arg-type]
        return None if index is None else configs[index]

    def _fallback(self, key: Any, configs: list[dict]) -> tuple[dict, str]:
        """A key met after tuning: its fallback (nearest tuned key's winner, else the first config), no collective."""
        candidates: dict = dict(self.cache)
        for tuned, text in table_candidates(self.pinned, self.entry(key, configs).name, 0).items():
            candidates.setdefault(tuned, text)
        try:
            served = self.fallbacks[key] = self.policy.fallback(key, configs, candidates, kwargs_text)
        except UnseenKeyError as err:
            raise UnseenKeyError(f"disttune.autotune: {self.__qualname__} was called with a key it was not tuned "
                                 f"for: {err}; tune it first (sweep)") from None
        logging.getLogger("disttune").info("disttune.autotune %s: key %r served by the %s: %s", self.__qualname__,
                                           key, served[1], kwargs_text(served[0]))
        return served

    def _agree_on_new_keys(self, group: Any, verbose: bool) -> None:
        """Every ``agree_every`` calls: the ranks' first calls with a new key; the same call on every rank is
        tuned with its arguments at the next point (see :mod:`disttune.unseen`); no wait for the peers."""
        self._countdown = self.options.agree_every
        saved, self._saved_call = self._saved_call, None
        comm = self.communicator(group)
        due = self._votes.point(comm, saved)
        if due is None:
            return
        _, key, args, kwargs = due
        try:
            self.tune_key(key, self.pruned(args, kwargs), args, kwargs, comm, verbose)
        except (TuningError, AllConfigsFailed) as err:  # the same on every rank: the key keeps its fallback
            logging.getLogger("disttune").warning("disttune.autotune %s: tuning key %r failed, it keeps its "
                                                  "fallback: %s", self.__qualname__, key, err)

    def pruned(self, args: tuple, kwargs: dict) -> list[dict]:
        """The configs ``prune_fn`` keeps for these arguments; a ValueError when it keeps none."""
        configs = [c for c in self.config_space if self.prune_fn is None or self.prune_fn(c, *args, **kwargs)]
        if not configs:
            raise ValueError(f"disttune.autotune: prune_fn rejected every config of {self.__qualname__}")
        return configs

    def communicator(self, group: Any = None) -> Communicator:
        """``group`` (``autotune_pg=``, else ``group=``/``comm=``): an mpi4py communicator, a torch process
        group, or None (torch.distributed's default group when it is initialised, else a world of one)."""
        import torch.distributed as dist

        group = self.group if group is None else group
        timeout_s = self.options.timeout_s
        if is_comm(group):
            return make_communicator(False, group, None, timeout_s)
        initialised = dist.is_available() and dist.is_initialized()
        if group is not None and not initialised:
            raise RuntimeError("disttune.autotune: a process group was given (group= or autotune_pg=) but "
                               "torch.distributed is not initialised")
        return make_communicator(initialised, group, None, timeout_s)

    def entry(self, key: Any, configs: list[dict]) -> stores.EntryId:
        """The store identity of ``key`` tuned over ``configs`` (a checked tuning's winners are stored apart)."""
        o = self.options
        kind, name = "function checked" if o.check else "function", f"{self.fn.__module__}.{self.__qualname__}"
        if measured(o.objective):  # winners of another score are stored apart
            kind += f" objective={o.objective_text()}"
        return stores.EntryId(kind, name, stores.function_source_key(self.fn), repr(key), 0,
                              tuple(kwargs_text(c) for c in configs))


def autotune(
    config_space: Sequence[dict],
    key_fn: Callable[..., Any],
    prune_fn: Optional[Callable[..., bool]] = None,
    **options: Any,
) -> Callable[[Callable[..., Any]], FunctionAutotuner]:
    """Tune a function over ``config_space`` (dicts of keyword arguments), agreed across ranks.

    ``key_fn(*args, **kwargs)`` gives the hashable tuning key; ``prune_fn(config, *args, **kwargs)``
    returns False for configs to skip. At call time: ``autotune=False`` uses the first config
    of the pruned space, ``autotune_verbose=True`` prints the agreed times on rank 0,
    ``autotune_pg=group`` agrees over a process subgroup. Keyword-only options:
    ``n_warmup``, ``n_repeat``, ``timer``, ``reduce``, ``statistic``, ``group`` (a torch process
    group or an mpi4py communicator; ``comm`` is the older name for the latter),
    ``timeout_s``, ``cache_dir``, ``store``, ``split`` (ranks time disjoint shares of the
    space: only for functions with no collectives inside), ``search`` (``"exhaustive"``, the default,
    ``"screen"`` or ``"model"``/a :class:`~disttune.search.ModelSearch`: see :mod:`disttune.search`),
    ``on_new_key`` and ``agree_every``,
    ``pinned`` (a winners table, e.g. written by ``sweep``: its keys are served from it with no tuning and
    no collective, so deploy the same file to every rank; other keys follow ``on_new_key``),
    ``objective`` (``"launch"`` or ``"step"``: the same here, each config is timed over whole calls; or a
    callable over :class:`~disttune.objective.Measurements`, or :func:`~disttune.pareto`, scoring each
    config by its agreed time, peak GPU memory and NVML energy, read around each timed call by
    ``probe``, at the cost given in :mod:`disttune.objective`),
    ``flush_l2`` (evict the GPU's L2 before each timed call; see :mod:`disttune.timing`) and ``check``
    (``True`` or ``(reference, output) -> bool``: a config whose result differs from the first
    successful config's scores ``inf`` on every rank; see :mod:`disttune.checks`).

    The first call tunes its key on every rank. After that a key the wrapper has no winner for never
    starts a collective (only some ranks may meet it): it runs on the winner of the nearest tuned key
    (the rule in :mod:`disttune.unseen`; the first config when none is a candidate), the same on every rank, and
    ``fallbacks`` names it. With ``on_new_key="tune"`` (the default) every ``agree_every`` calls each
    rank gives one number (:class:`~disttune.unseen.NewKeyVotes`, no wait), and a key every rank met in
    the same call is tuned with that call's arguments at the point after; ``"nearest"`` never tunes it; ``"error"`` raises
    :class:`~disttune.unseen.UnseenKeyError`. In a world of one, ``"tune"`` tunes every new key at
    once. Per call this adds one counter; the agreement assumes every rank calls the wrapper (with
    ``autotune=True``) as often, and uses the group of the call that reaches it.
    """

    def decorate(fn: Callable[..., Any]) -> FunctionAutotuner:
        return FunctionAutotuner(fn, config_space, key_fn, prune_fn, **options)

    return decorate
