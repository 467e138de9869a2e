"""The options both tuners share, checked once when a tuner is built, and their text for the consensus.

Options that change the schedule (``n_warmup``, ``n_repeat``, ``search``, ``split``,
``compile_split``, ``on_new_key``, ``agree_every``, ``objective``, ``flush_l2``) or the verdict (``reduce``,
``statistic``, ``check``, ``timeout_s``), and the ``DISTTUNE_*`` settings that do the same
(``DISTTUNE_ALWAYS_TUNE``, ``DISTTUNE_COMPILE_OVERLAP``, ``DISTTUNE_VERIFY``, ``DISTTUNE_TIMEOUT``), must be
the same on every rank: the consensus (:meth:`disttune.agreement.Agreement.consensus`) compares
:func:`describe_options` of each rank's and names the option and every rank's value where they differ.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

from .sites import REDUCTIONS, Statistic, resolve_statistic
from .timing import Timer

#: The options that change the schedule or the verdict (compared across ranks by the consensus).
AGREED = ("n_warmup", "n_repeat", "reduce", "statistic", "search", "split", "compile_split", "on_new_key",
          "agree_every", "objective", "flush_l2", "check", "timeout_s")

#: What a tuning may minimise by name (see :mod:`disttune.objective`); :mod:`disttune.measures` adds a
#: callable over the measurements and :func:`disttune.pareto`.
OBJECTIVES = ("launch", "step")


def check_objective(objective: Any, search: Any = None, split: Any = False, early_stop: bool = False) -> None:
    """``objective=`` of either tuner: one of :data:`OBJECTIVES`, a callable over
    :class:`~disttune.measures.Measurements` or a :func:`~disttune.pareto` option; a ValueError otherwise.

    A measured objective times launches (as ``"launch"``) and picks from the full exhaustive timing:
    ``search``, ``early_stop`` and ``split`` cannot be combined with it."""
    from .measures import Pareto, measured

    named = isinstance(objective, str) and objective in OBJECTIVES
    if isinstance(objective, type) or not (named or measured(objective)):
        raise ValueError(f"disttune: objective must be one of {OBJECTIVES}, a callable over disttune.Measurements "
                         f"or disttune.pareto(...), got {objective!r}")
    if measured(objective) and (early_stop or split or search not in (None, "exhaustive")):
        kind = "pareto(...)" if isinstance(objective, Pareto) else "a callable objective"
        raise ValueError(f"disttune: {kind} scores every config's full timing; search, early_stop and split "
                         "cannot be combined with it")


def check_count(name: str, value: Any, minimum: int) -> None:
    """``value`` must be an int (not a bool) of at least ``minimum``; a ValueError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"disttune: {name} must be an integer >= {minimum}, got {value!r}")


def check_path(name: str, value: Any) -> None:
    """``value`` must be None, a ``str`` or an ``os.PathLike``; a TypeError naming ``name`` otherwise."""
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"disttune: {name} must be a path (str or os.PathLike), got {type(value).__name__} {value!r}")


def check_directory(name: str, path: Any) -> None:
    """``path`` (a directory to write into) must not be an existing file; a ValueError naming ``name``
    otherwise. Costs one ``stat``."""
    check_path(name, path)
    if path is not None and os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"disttune: {name} {str(path)!r} is an existing file, not a directory")


def check_common(n_warmup: int, n_repeat: int, reduce: str, statistic: Statistic, timer: Optional[Timer]) -> None:
    """The checks both tuners make of their shared options; a clear ValueError or TypeError."""
    check_count("n_repeat", n_repeat, minimum=1)
    check_count("n_warmup", n_warmup, minimum=0)
    if reduce not in REDUCTIONS:
        raise ValueError(f"disttune: unknown reduce {reduce!r}; use one of {', '.join(REDUCTIONS)}")
    resolve_statistic(statistic)
    if timer is not None and not isinstance(timer, Timer):
        raise TypeError(f"disttune: timer must have a .time(launch, info) method, got {type(timer).__name__}")


def describe_value(value: Any) -> str:
    """A text for an option's value that is the same on every rank for the same setting (no addresses)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # settings such as ModelSearch
        return repr(value)
    base = getattr(value, "base_fn", None)  # a triton.autotune kernel: its function's name
    if base is not None:
        return f"kernel {base.__module__}.{base.__qualname__}"
    if callable(value):
        return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', type(value).__name__)}"
    try:
        return "[" + ", ".join(sorted(describe_value(item) for item in value)) + "]"
    except TypeError:
        return type(value).__name__


def describe_objective(objective: Any) -> str:
    """``objective=`` as text for the consensus: a function's name and the line it starts on, so that two
    lambdas of one module given on different ranks differ."""
    code = getattr(objective, "__code__", None)
    return describe_value(objective) + (f" (line {code.co_firstlineno})" if code is not None else "")


def describe_options(**options: Any) -> dict[str, str]:
    """``{name: text}`` for the consensus, with the ``DISTTUNE_*`` settings that change a tuning call
    (:func:`disttune.env.tuning_settings`): equal texts mean equal settings on every rank."""
    from .env import tuning_settings

    return {**{name: describe_objective(value) if name == "objective" else describe_value(value)
               for name, value in options.items()}, **tuning_settings()}
