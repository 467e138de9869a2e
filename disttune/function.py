"""``disttune.autotune``: tune a function over a space of keyword arguments, agreed across ranks.

The counterpart of Triton-distributed's ``tune.autotune`` for functions whose tunables
are arbitrary keyword arguments (algorithm choices, chunk counts, a ``triton.Config``
handed to a kernel by hand). Each config of the pruned space is timed over whole
calls of the function, with a barrier before every timed call so all ranks start
together; per-rank statistics are all-gathered and combined like the contextual
tuner's (max over ranks by default, ``inf`` if a config failed on any rank), and the
winner is stored so later processes skip tuning.

Cost of one tuning: ``len(space) * (n_warmup + n_repeat) + 1`` calls of the function
(the last with the winner, whose result is returned), one barrier per call, and two
all-gathers. Every collective uses ``autotune_pg`` (or ``comm=``) when given.

``split=True`` is for functions with no communication inside: rank ``r`` times only
configs ``r, r + w, r + 2w, ...`` and each config's time is its owner's, so ``w`` ranks
tune about ``w`` times faster (every rank still sees the same winner). In ``last_timings`` a
config another rank timed is ``nan`` in this rank's ``per_rank_ms`` row.

After tuning, a call costs one ``key_fn`` call and a dict lookup over calling the function with
the winner (``bench/fast_path.py`` measures it).
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any, Callable, Optional, Sequence


from . import env
from . import store as _store
from .comm import Communicator, make_communicator
from .contextual import TuningError, _check_count
from .sites import AllConfigsFailed, REDUCTIONS, Statistic, agree, resolve_statistic, winner_index
from .timing import LaunchInfo, Timer, default_timer

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
        comm: Any = None,
        timeout_s: Optional[float] = None,
        cache_dir: Optional[str | os.PathLike] = None,
        store: bool = True,
        split: bool = False,
    ) -> None:
        if not config_space or not all(isinstance(c, dict) for c in config_space):
            raise ValueError("disttune.autotune: config_space must be a non-empty list of dicts of keyword arguments")
        if not callable(key_fn):
            raise TypeError("disttune.autotune: key_fn must be callable (it gets the function's arguments)")
        _check_count("n_warmup", n_warmup, 0)
        _check_count("n_repeat", n_repeat, 1)
        if reduce not in REDUCTIONS:
            raise ValueError(f"disttune: unknown reduce {reduce!r}; use one of {', '.join(REDUCTIONS)}")
        resolve_statistic(statistic)
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
        self.comm = comm
        self.timeout_s = env.timeout_s(timeout_s)
        self.cache_dir, self.use_store = cache_dir, store
        self.split = bool(split)
        self.cache: dict[Any, dict] = {}  # key -> winning config, for this process
        self.last_timings: Optional[dict] = None

    def __call__(self, *args: Any, autotune: bool = True, autotune_verbose: bool = False, autotune_pg: Any = None,
                 **kwargs: Any) -> Any:
        if kwargs and not self._tunables.isdisjoint(kwargs):
            clash = sorted(self._tunables & kwargs.keys())
            raise TypeError(f"disttune.autotune: {self.__qualname__} got {clash} as keyword argument(s), "
                            "but the autotuner sets them from config_space; drop them from the call")
        if autotune:
            winner = self.cache.get(self.key_fn(*args, **kwargs))
            if winner is not None:  # the fast path: one key_fn call and a dict lookup over the plain call
                return self.fn(*args, **kwargs, **winner)
        configs = self._pruned(args, kwargs)
        if not autotune:
            return self.fn(*args, **kwargs, **configs[0])
        key = self.key_fn(*args, **kwargs)
        self.cache[key] = self._tune(key, configs, args, kwargs, self._communicator(autotune_pg), autotune_verbose)
        return self.fn(*args, **kwargs, **self.cache[key])

    def _pruned(self, args: tuple, kwargs: dict) -> list[dict]:
        configs = [c for c in self.config_space if self.prune_fn is None or self.prune_fn(c, *args, **kwargs)]
        if not configs:
            raise ValueError(f"disttune.autotune: prune_fn rejected every config of {self.__qualname__}")
        return configs

    def _communicator(self, group: Any) -> Communicator:
        """``comm=`` if given, else torch.distributed when it is initialised, else a world of one."""
        import torch.distributed as dist

        initialised = dist.is_available() and dist.is_initialized()
        if group is not None and not initialised and self.comm is None:
            raise RuntimeError("disttune.autotune: autotune_pg was given but torch.distributed is not initialised")
        return make_communicator(initialised, group, self.comm, self.timeout_s)

    def _tune(self, key: Any, configs: list[dict], args: tuple, kwargs: dict, comm: Communicator,
              verbose: bool) -> dict:
        entry = _store.EntryId("function", f"{self.fn.__module__}.{self.__qualname__}",
                               _store.function_source_key(self.fn), repr(key), 0, tuple(_describe(c) for c in configs))
        winners_store = None
        stored = None
        if self.use_store:
            fingerprint = _store.environment_fingerprint(comm.world_size, env.local_world_size())
            winners_store = _store.WinnerStore(self.cache_dir, fingerprint)
            if not env.always_tune():
                record = winners_store.load(entry)
                stored = None if record is None else record["winner"]
        everyone = comm.all_gather_objects({"key": repr(key), "configs": entry.configs, "stored": stored},
                                           "function autotune consensus")
        differing = [r for r, d in enumerate(everyone) if (d["key"], d["configs"]) != (repr(key), entry.configs)]
        if differing:
            raise TuningError(
                f"disttune.autotune: {self.__qualname__}: ranks disagree on the tuning key or pruned configs: "
                + "; ".join(f"rank {r}: key={d['key']} with {len(d['configs'])} config(s)" for r, d in enumerate(everyone))
            )
        if everyone[0]["stored"] is not None:
            return configs[everyone[0]["stored"]]

        timer = self.timer or default_timer()
        samples: list[list[float]] = [[] for _ in configs]
        failures: dict[int, str] = {}
        world = comm.world_size if self.split else 1
        for slot in range(-(-len(configs) // world)):  # the same number of slots on every rank
            index = slot * world + (comm.rank if self.split else 0)
            config = configs[index] if index < len(configs) else None
            for run in range(self.n_warmup + self.n_repeat):
                comm.barrier(f"function autotune config slot {slot} run {run}")
                if config is None or index in failures:
                    continue
                try:
                    if run < self.n_warmup:
                        self.fn(*args, **kwargs, **config)
                    else:
                        info = LaunchInfo(self.__qualname__, (repr(key),), 0, index, config, run, comm.rank)
                        samples[index].append(timer.time(lambda: self.fn(*args, **kwargs, **config), info)())
                except Exception as err:  # scored inf on every rank through the agreement
                    failures[index] = f"{type(err).__name__}: {err}"
        reduce_stat = resolve_statistic(self.statistic)
        unmeasured = float("nan") if self.split else float("inf")  # split: another rank timed it
        local = [float("inf") if i in failures else float(reduce_stat(s)) if s else unmeasured
                 for i, s in enumerate(samples)]
        per_rank = comm.all_gather_floats(local, "function autotune agreement")
        agreed = agree(per_rank, self.reduce, split=self.split)  # split: each config's time is its owner's
        winner = winner_index(agreed)
        self.last_timings = {"configs": configs, "per_rank_ms": per_rank.tolist(), "agreed_ms": agreed.tolist(),
                             "winner": winner}
        if winner is None:
            reports = comm.all_gather_objects(failures, "function autotune failures")
            raise AllConfigsFailed(f"disttune.autotune: {self.__qualname__}: every config failed on some rank: "
                                   + "; ".join(f"rank {r} config {i}: {m}" for r, f in enumerate(reports)
                                               for i, m in f.items()))
        if winners_store is not None and comm.rank == 0:
            winners_store.save(entry, winner, list(agreed), {"function": self.__qualname__})
        if verbose and comm.rank == 0:
            for i, config in enumerate(configs):
                mark = "  <- winner" if i == winner else ""
                print(f"disttune.autotune {self.__qualname__} {_describe(config)}: {agreed[i]:.4f} ms{mark}",
                      file=sys.stdout, flush=True)
        return configs[winner]


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
    ``n_warmup``, ``n_repeat``, ``timer``, ``reduce``, ``statistic``, ``comm`` (mpi4py),
    ``timeout_s``, ``cache_dir``, ``store``, ``split`` (ranks time disjoint shares of the
    space: only for functions with no collectives inside).
    """

    def decorate(fn: Callable[..., Any]) -> FunctionAutotuner:
        return FunctionAutotuner(fn, config_space, key_fn, prune_fn, **options)

    return decorate
