"""``disttune.autotune``: tune a function over a space of keyword arguments, agreed across ranks.

The counterpart of Triton-distributed's ``tune.autotune`` for functions whose tunables
are arbitrary keyword arguments (algorithm choices, chunk counts, a ``triton.Config``
handed to a kernel by hand). Each config of the pruned space is timed over whole
calls of the function, with a barrier before every timed call so all ranks start
together; per-rank statistics are all-gathered and combined like the contextual
tuner's (max over ranks by default, ``inf`` if a config failed on any rank), and the
winner is stored so later processes skip tuning.

It walks the contextual tuner's protocol with a whole call in place of an intercepted launch: the
call becomes one site whose candidates are the configs, each tuning call runs the config the shared
:class:`~disttune.sites.Schedule` gives it and is timed by the Timer, the ranks agree through the
same :class:`~disttune.agreement.Agreement` (consensus on key, configs, options and stored winner;
agreed vector; all-failed error), and the winner goes to the same store.

Cost of one tuning: ``len(space) * (n_warmup + n_repeat) + 1`` calls of the function
(the last with the winner, whose result is returned), one barrier per call, and three
all-gathers: the consensus, the agreement, and the final call's status, so that an error in that
call on one rank is the same TuningError on all. On the first call an error of ``key_fn`` or
``prune_fn`` on one rank is one too (every rank is tuning then; later, a rank cannot know
whether its peers are, and raises alone). Every collective uses ``group=`` (a torch process
group or an mpi4py communicator; ``comm=`` is the older name for the latter), or
``autotune_pg=`` at call time.

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

from . import engine, warmup
from . import store as stores
from .agreement import Agreement, TuningError
from .comm import Communicator, is_comm, make_communicator
from .checks import CheckSpec, OutputCheck, blame, check_spec, make_check
from .measures import Objective, Probe, ProbingTimer, default_probe, describe_measurements, measured, measures_of
from .options import check_common, check_objective, check_path, describe_objective, describe_options
from .env import timeout_or_error
from .search import Search, SearchTrace, describe_search, narrow, resolve_search
from .sites import AllConfigsFailed, Schedule, Site, SiteId, Statistic
from .sweep import SweepRow, sweep_function
from .unseen import (DEFAULT_AGREE_EVERY, NEVER, NewKeyVotes, UnseenKeyError, check_on_new_key, choose,
                     table_candidates)
from .timing import LaunchInfo, Timer, default_timer, flushing

CALL_FLAGS = ("autotune", "autotune_verbose", "autotune_pg")


def _describe(config: dict) -> str:
    return "{" + ", ".join(f"{k}={v}" for k, v in config.items()) + "}"


class FunctionAutotuner:
    """The callable that :func:`autotune` returns; see there."""

    def __init__(
        self,
        fn: Callable[..., Any],
        config_space: Sequence[dict],
        key_fn: Callable[..., Any],
        prune_fn: Optional[Callable[..., bool]] = None,
        *,
        n_warmup: int = 3,
        n_repeat: int = 5,
        timer: Optional[Timer] = None,
        reduce: str = "max",
        statistic: Statistic = "median",
        group: Any = None,
        comm: Any = None,
        timeout_s: Optional[float] = None,
        cache_dir: Optional[str | os.PathLike] = None,
        store: bool = True,
        split: bool = False,
        search: Optional[Search] = None,
        on_new_key: str = "tune",
        agree_every: int = DEFAULT_AGREE_EVERY,
        objective: Objective = "launch",
        flush_l2: bool = False,
        check: CheckSpec = None,
        pinned: Optional[str | os.PathLike] = None,
        probe: Optional[Probe] = None,
    ) -> None:
        if not config_space or not all(isinstance(c, dict) for c in config_space):
            raise ValueError("disttune.autotune: config_space must be a non-empty list of dicts of keyword arguments")
        if not callable(key_fn):
            raise TypeError("disttune.autotune: key_fn must be callable (it gets the function's arguments)")
        check_common(n_warmup, n_repeat, reduce, statistic, timer)
        check_on_new_key(on_new_key, agree_every)
        check_objective(objective, search, split)
        self.objective, self.flush_l2, self.check, self.probe = objective, bool(flush_l2), check_spec(check), probe
        reserved = {name for config in config_space for name in config} & set(CALL_FLAGS)
        if reserved:
            raise ValueError(f"disttune.autotune: config_space uses reserved names {sorted(reserved)}")
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.config_space = [dict(c) for c in config_space]
        self._tunables = frozenset(name for config in self.config_space for name in config)
        self.key_fn, self.prune_fn = key_fn, prune_fn
        self.n_warmup, self.n_repeat = n_warmup, n_repeat
        self.timer, self.reduce, self.statistic = timer, reduce, statistic
        self.group = group if group is not None else comm
        # a bad $DISTTUNE_TIMEOUT is raised on every rank by the first tuning's consensus
        self.timeout_s, self._env_error = timeout_or_error(timeout_s)
        check_path("cache_dir", cache_dir)
        self.cache_dir, self.use_store = cache_dir, store
        self.split = bool(split)
        self.search = resolve_search(search)
        self.search_trace: Optional[SearchTrace] = None  # what the last model search proposed
        self.pinned = stores.load_table(pinned) if pinned else None  # a deployed table: its keys are never tuned
        self.cache: dict[Any, dict] = {}  # key -> winning config, for this process
        self.on_new_key, self.agree_every = on_new_key, agree_every
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
            return self.fn(*args, **kwargs, **self._pruned(args, kwargs)[0])
        self._countdown -= 1
        if not self._countdown:
            self._agree_on_new_keys(autotune_pg, autotune_verbose)
        try:
            winner = self.cache.get(self.key_fn(*args, **kwargs))
        except Exception:  # key_fn raised or gave an unhashable key: the slow path reports it
            winner = None
        if winner is not None:  # the fast path: one key_fn call and a dict lookup over the plain call
            return self.fn(*args, **kwargs, **winner)
        return self._new_key_call(args, kwargs, self._communicator(autotune_pg), autotune_verbose)

    def _new_key_call(self, args: tuple, kwargs: dict, comm: Communicator, verbose: bool) -> Any:
        """A key with no winner yet: tuned (the first key, or any key in a world of one), served from the
        pinned table, or served by its fallback with no collective (see :mod:`disttune.unseen`)."""
        tunes_now = not self.cache and self.pinned is None
        try:
            key = self._key(args, kwargs)
            configs = self._pruned(args, kwargs)
        except Exception as err:
            if comm.world_size == 1 or not tunes_now:
                raise
            # Nothing tuned yet, so every peer is tuning too and waits in the consensus: join it with the error.
            agreement = Agreement(comm, self.__qualname__)
            with agreement.ending:
                agreement.consensus([], (err, f"before tuning: {type(err).__name__}: {err}"), {}, [])
            raise  # not reached: the consensus raised the error on every rank
        served = self.fallbacks.get(key)
        if served is None and self.pinned is not None:
            pinned = self._pinned_winner(key, configs)
            if pinned is not None:
                self.cache[key] = pinned
                return self.fn(*args, **kwargs, **pinned)
        if served is None:
            if tunes_now or (self.on_new_key == "tune" and comm.world_size == 1):
                result = self._tuning_call(key, configs, args, kwargs, comm, verbose)
                if self.on_new_key == "tune" and comm.world_size > 1 and self._countdown > self.agree_every:
                    self._countdown = self.agree_every  # the first key is tuned: later new keys wait for agreements
                return result
            served = self._fallback(key, configs)
        if self.on_new_key == "tune" and self._saved_call is None:
            self._saved_call = (self.agree_every - self._countdown, key, args, kwargs)
        return self.fn(*args, **kwargs, **served[0])

    def _tuning_call(self, key: Any, configs: list[dict], args: tuple, kwargs: dict, comm: Communicator,
                     verbose: bool) -> Any:
        """Tuning (or the stored winner) and the call with the winner, whose result it returns; an error on
        one rank in the call is the same TuningError on every rank."""
        agreement = self._agreement(comm)
        with agreement.ending:  # the same ending on every rank (disttune.ending)
            config, save = self._tune(key, configs, args, kwargs, agreement, verbose)
            if comm.world_size == 1:
                result = self.fn(*args, **kwargs, **config)
            else:
                try:
                    result, error = self.fn(*args, **kwargs, **config), None
                except Exception as err:
                    result, error = None, (err, f"{type(err).__name__}: {err}")
                agreement.final_run_status([], error, {}, "final call (with the winner)")
        if save is not None:
            save()
        self.cache[key] = config
        return result

    def _key(self, args: tuple, kwargs: dict) -> Any:
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
        if self.on_new_key == "error":
            raise UnseenKeyError(f"disttune.autotune: {self.__qualname__} was called with key {key!r}, which it was "
                                 "not tuned for (on_new_key='error'); tune it first (sweep)")
        candidates: dict = dict(self.cache)
        for tuned, text in table_candidates(self.pinned, self.entry(key, configs).name, 0).items():
            candidates.setdefault(tuned, text)
        served = self.fallbacks[key] = choose(key, configs, candidates, _describe)
        logging.getLogger("disttune").info("disttune.autotune %s: key %r served by the %s: %s", self.__qualname__,
                                           key, served[1], _describe(served[0]))
        return served

    def _agree_on_new_keys(self, group: Any, verbose: bool) -> None:
        """Every ``agree_every`` calls: the ranks' first calls with a new key; the same call on every rank is
        tuned with its arguments at the next point (see :mod:`disttune.unseen`); no wait for the peers."""
        self._countdown = self.agree_every
        saved, self._saved_call = self._saved_call, None
        comm = self._communicator(group)
        due = self._votes.point(comm, saved)
        if due is None:
            return
        _, key, args, kwargs = due
        try:
            agreement = self._agreement(comm)
            with agreement.ending:
                config, save = self._tune(key, self._pruned(args, kwargs), args, kwargs, agreement, verbose)
            if save is not None:
                save()
            self.cache[key] = config
        except (TuningError, AllConfigsFailed) as err:  # the same on every rank: the key keeps its fallback
            logging.getLogger("disttune").warning("disttune.autotune %s: tuning key %r failed, it keeps its "
                                                  "fallback: %s", self.__qualname__, key, err)
            return
        self.fallbacks.pop(key, None)

    def _pruned(self, args: tuple, kwargs: dict) -> list[dict]:
        configs = [c for c in self.config_space if self.prune_fn is None or self.prune_fn(c, *args, **kwargs)]
        if not configs:
            raise ValueError(f"disttune.autotune: prune_fn rejected every config of {self.__qualname__}")
        return configs

    def _communicator(self, group: Any) -> Communicator:
        """``group`` (``autotune_pg=``, else ``group=``/``comm=``): an mpi4py communicator, a torch process
        group, or None (torch.distributed's default group when it is initialised, else a world of one)."""
        import torch.distributed as dist

        group = self.group if group is None else group
        if is_comm(group):
            return make_communicator(False, group, None, self.timeout_s)
        initialised = dist.is_available() and dist.is_initialized()
        if group is not None and not initialised:
            raise RuntimeError("disttune.autotune: a process group was given (group= or autotune_pg=) but "
                               "torch.distributed is not initialised")
        return make_communicator(initialised, group, None, self.timeout_s)

    def entry(self, key: Any, configs: list[dict]) -> stores.EntryId:
        """The store identity of ``key`` tuned over ``configs`` (a checked tuning's winners are stored apart)."""
        kind, name = "function checked" if self.check else "function", f"{self.fn.__module__}.{self.__qualname__}"
        if measured(self.objective):  # winners of another score are stored apart
            kind += f" objective={describe_objective(self.objective)}"
        return stores.EntryId(kind, name, stores.function_source_key(self.fn), repr(key), 0,
                              tuple(_describe(c) for c in configs))

    def _agreement(self, comm: Communicator) -> Agreement:
        """The collectives of one tuning call over ``comm`` (enter its ``ending`` around the call)."""
        return Agreement(comm, self.__qualname__, self.reduce, self.statistic, self.objective)

    def _tune(self, key: Any, configs: list[dict], args: tuple, kwargs: dict, agreement: Agreement,
              verbose: bool) -> tuple[dict, Optional[Callable[[], None]]]:
        """Consensus, the scheduled whole calls and the agreement: the contextual tuner's walk.
        Returns the winner and what writes it to the store once the call with it has run on every rank
        (None: nothing to write here)."""
        comm = agreement.comm
        name = f"{self.fn.__module__}.{self.__qualname__}"
        entry = self.entry(key, configs)
        site = Site(SiteId(name, (repr(key),), 0), None, configs)
        winners_store = engine.open_store(self.use_store, self.cache_dir, comm, timeout_s=self.timeout_s)
        lookup = engine.lookup(winners_store, None, False, entry=lambda _: entry)
        site.local_answer = None if lookup is None else lookup(site)
        env_error = self._env_error
        error = None if env_error is None else (env_error, f"{type(env_error).__name__}: {env_error}")
        agreement.consensus([site], error, describe_options(n_warmup=self.n_warmup, n_repeat=self.n_repeat,
                                                           reduce=self.reduce, statistic=self.statistic,
                                                           split=self.split, search=describe_search(self.search),
                                                           check=self.check, flush_l2=self.flush_l2,
                                                           objective=self.objective, on_new_key=self.on_new_key,
                                                           agree_every=self.agree_every,
                                                           timeout_s=self.timeout_s),
                            [self.split])
        if site.decided is not None:
            return configs[site.decided], None
        if self.split:
            site.share = (comm.rank, comm.world_size)
        check: Optional[OutputCheck] = None  # one reference for every stage of the search

        def stage(schedule: Schedule, label: str) -> int:
            nonlocal check
            check = self._timed_calls(site, schedule, key, args, kwargs, agreement, check)
            return schedule.runs

        _, self.search_trace, full_timing = narrow([site], self.search, self.n_warmup, self.n_repeat, stage,
                                                   agreement.gather_agreed, comm.all_gather_objects)
        if full_timing:
            stage(Schedule(site.slots(), self.n_warmup, self.n_repeat), "tuning call")
        (result,) = agreement.verdicts([site])
        self.last_timings = {"configs": configs, "per_rank_ms": [list(row) for row in result.per_rank_ms],
                             "agreed_ms": list(result.agreed_ms), "winner": result.winner,
                             "measurements": list(result.measurements), "front": list(result.front)}
        save = None
        if winners_store is not None and comm.rank == 0:
            save = lambda: engine.save_winners(winners_store, [(entry, result, site)], self.__qualname__)  # noqa: E731
        if verbose and comm.rank == 0:
            for i, config in enumerate(configs):
                mark = "  <- winner" if i == result.winner else ""
                extra = (f", {describe_measurements(result.measurements[i])}, score {result.scores[i]:.4g}"
                         if result.measurements else "")
                print(f"disttune.autotune {self.__qualname__} {_describe(config)}: {result.agreed_ms[i]:.4f} ms"
                      f"{extra}{mark}", file=sys.stdout, flush=True)
        return configs[result.winner], save

    def _timed_calls(self, site: Site, schedule: Schedule, key: Any, args: tuple, kwargs: dict,
                     agreement: Agreement, check: Optional[OutputCheck]) -> Optional[OutputCheck]:
        """The tuning calls, each after a barrier so all ranks start together; samples and failures into ``site``.

        ``check``: the output check of an earlier stage (None: made from this stage's first successful
        call); returned for the next stage (a search's batches), so every config meets the same reference."""
        timer = self.timer or default_timer()
        if measured(self.objective):
            timer = ProbingTimer(timer, self.probe or default_probe(
                lambda step: agreement.wait_for_device(step, counted=False)))
        if self.flush_l2:
            timer = flushing(timer)
        comm = agreement.comm
        per_config = self.n_warmup + self.n_repeat
        for run in range(schedule.runs):
            slot, phase = divmod(run, per_config)
            comm.barrier(f"function autotune config slot {slot} run {phase}")
            position, timed = schedule.slot(run, len(site.active), site.share)
            index = None if position is None else site.active[position]
            outcome: dict = {}
            read = None
            if index is not None and index not in site.failures:
                config = site.configs[index]
                try:
                    if not timed:
                        outcome["result"] = self.fn(*args, **kwargs, **config)
                    else:
                        info = LaunchInfo(self.__qualname__, (repr(key),), 0, index, config, phase, comm.rank)
                        read = timer.time(lambda: outcome.__setitem__("result", self.fn(*args, **kwargs, **config)),
                                          info)
                except Exception as err:  # scored inf on every rank through the agreement
                    site.record_failure(index, err)
            # every rank, every call: the timer and the check read the GPU's results
            agreement.wait_for_device(f"function autotune config slot {slot} run {phase} (on the GPU)")
            if index is None or index in site.failures:
                continue
            if read is not None:
                site.add_sample(index, read(), time.time(), measures_of(read))
            if self.check:  # the first successful call's result is the reference
                if check is None:
                    check = make_check(self.check, outcome["result"])
                elif not check.matches(outcome["result"]):
                    blame({site.id: site}, {site.id: index})
        return check


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
    callable over :class:`~disttune.measures.Measurements`, or :func:`~disttune.pareto`, scoring each
    config by its agreed time, peak GPU memory and NVML energy, read around each timed call by
    ``probe``, at the cost given in :mod:`disttune.measures`),
    ``flush_l2`` (evict the GPU's L2 before each timed call; see :mod:`disttune.timing`) and ``check``
    (``True`` or ``(reference, output) -> bool``: a config whose result differs from the first
    successful config's scores ``inf`` on every rank; see :mod:`disttune.checks`).

    The first call tunes its key on every rank. After that a key the wrapper has no winner for never
    starts a collective (only some ranks may meet it): it runs on the winner of the nearest tuned key
    (:mod:`disttune.nearest`; the first config when none is a candidate), the same on every rank, and
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
