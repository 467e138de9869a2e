"""Every option of both tuners in one frozen dataclass, :class:`Options`: each checked once, when a tuner is
built, and the text of those every rank must share.

Options that change the schedule (``n_warmup``, ``n_repeat``, ``search``, ``split``,
``compile_split``, ``on_new_key``, ``agree_every``, ``objective``, ``flush_l2``) or the verdict (``reduce``,
``statistic``, ``check``, ``timeout_s``), and the ``DISTTUNE_*`` settings that do the same
(``DISTTUNE_ALWAYS_TUNE``, ``DISTTUNE_COMPILE_OVERLAP``, ``DISTTUNE_VERIFY``, ``DISTTUNE_TIMEOUT``), must be
the same on every rank: the consensus (:meth:`disttune.agreement.Agreement.consensus`) compares
:meth:`Options.agreed` of each rank's and names the option and every rank's value where they differ.

``contextual_autotune`` takes every option; ``disttune.autotune`` those in :data:`FUNCTION_OPTIONS`
(the others are about intercepted kernels: compile threads, rank logs, the store's writer). A bad
value is a ValueError or TypeError that names the option, raised where the tuner is made.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Iterable, Optional, Union

from . import env, graphs
from .agreement import REDUCERS
from .checks import CheckSpec, check_spec
from .comm import is_comm
from .objective import Objective, Probe, check_objective, describe_objective
from .search import Search, resolve_search
from .sites import SiteId, Statistic, resolve_statistic
from .store import CHECKS as STORE_CHECKS
from .timing import Timer
from .unseen import DEFAULT_AGREE_EVERY, NEW_KEY_POLICIES

#: The options that change the schedule or the verdict (compared across ranks by the consensus).
AGREED = ("n_warmup", "n_repeat", "reduce", "statistic", "search", "split", "compile_split", "on_new_key",
          "agree_every", "objective", "flush_l2", "check", "timeout_s")

#: The options ``disttune.autotune`` takes (``contextual_autotune`` takes every field of :class:`Options`).
FUNCTION_OPTIONS = ("n_warmup", "n_repeat", "timer", "reduce", "statistic", "group", "comm", "timeout_s", "cache_dir",
                    "store", "split", "search", "on_new_key", "agree_every", "objective", "flush_l2", "check", "pinned",
                    "probe")

#: What ``split=`` accepts: True/False, kernel names or autotuned kernels, or a predicate over a site (the
#: function tuner: True/False).
SplitSpec = Union[bool, str, Any, Iterable[Any], Callable[[SiteId], bool]]


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


def check_choice(name: str, value: Any, choices: Iterable[str]) -> None:
    """``value`` must be one of ``choices``; a ValueError naming ``name`` and them otherwise."""
    choices = tuple(choices)
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"disttune: {name} must be one of {', '.join(map(repr, choices))}, got {value!r}")


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


@dataclasses.dataclass(frozen=True)
class Options:
    """Every option of both tuners (see :func:`disttune.contextual_autotune` and :func:`disttune.autotune`),
    checked once when it is built; ``tuner`` is ``"contextual"`` or ``"function"``.

    Resolved here: ``timeout_s`` (``$DISTTUNE_TIMEOUT`` or 300 s when not given: a bad variable is kept in
    ``env_error`` and raised on every rank by the first tuning call's consensus), ``pinned`` (from
    ``$DISTTUNE_PINNED``), ``search`` (``early_stop`` is ``search="screen"``) and ``check``.
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
    cuda_graph: bool = False
    tuner: str = "contextual"
    env_error: Optional[Exception] = dataclasses.field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def for_function(cls, **options: Any) -> "Options":
        """The options of ``disttune.autotune``: a TypeError names one it does not take."""
        foreign = sorted(set(options) - set(FUNCTION_OPTIONS))
        if foreign:
            raise TypeError(f"disttune.autotune: no option {foreign[0]}= (it is contextual_autotune's); it takes "
                            + ", ".join(FUNCTION_OPTIONS))
        return cls(**options, tuner="function", verbose=False)

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 - a frozen dataclass
        check_count("n_repeat", self.n_repeat, minimum=1)
        check_count("n_warmup", self.n_warmup, minimum=0)
        check_choice("reduce", self.reduce, REDUCERS)
        resolve_statistic(self.statistic)
        if self.timer is not None and not isinstance(self.timer, Timer):
            raise TypeError(f"disttune: timer must have a .time(launch, info) method, got {type(self.timer).__name__}")
        check_choice("on_new_key", self.on_new_key, NEW_KEY_POLICIES)
        check_count("agree_every", self.agree_every, minimum=1)
        if self.tuner == "function" and not isinstance(self.split, bool):
            raise TypeError(f"disttune.autotune: split must be True or False, got {self.split!r}")
        set_("search", resolve_search(self.search, bool(self.early_stop)))
        set_("early_stop", self.search == "screen")
        check_objective(self.objective, self.search, self.split)
        set_("check", check_spec(self.check))
        set_("flush_l2", bool(self.flush_l2))
        timeout, env_error = env.timeout_or_error(self.timeout_s)
        set_("timeout_s", timeout)
        set_("env_error", env_error)
        if self.tuner == "contextual" and not self.is_dist and self.group is not None and not is_comm(self.group):
            raise ValueError("disttune: group= was given but is_dist=False; pass is_dist=True to agree over it")
        check_choice("store_check", self.store_check, STORE_CHECKS)
        check_choice("store_writer", self.store_writer, ("global", "node"))
        if self.compile_threads is not None:
            check_count("compile_threads", self.compile_threads, minimum=0)
        check_directory("log_dir", self.log_dir)
        check_path("cache_dir", self.cache_dir)
        check_path("pinned", self.pinned)
        set_("pinned", self.pinned or env.pinned_table())
        set_("compile_split", bool(self.compile_split))
        if not isinstance(self.cuda_graph, bool):
            raise TypeError(f"disttune: cuda_graph must be True or False, got {self.cuda_graph!r}")
        if self.cuda_graph and graphs.why_unavailable():
            raise ValueError(f"disttune: cuda_graph=True, but {graphs.why_unavailable()}; pass "
                             "cuda_graph=not disttune.graphs.why_unavailable() to replay only where it can")

    def objective_text(self) -> str:
        """``objective`` as text: what the consensus compares and what keeps winners of one score apart in the store."""
        return describe_objective(self.objective, describe_value)

    def agreed(self) -> dict[str, str]:
        """The options every rank must share, as text for the consensus (with the ``DISTTUNE_*`` settings)."""
        names = AGREED if self.tuner == "contextual" else [n for n in AGREED if n in FUNCTION_OPTIONS]
        texts = {name: self.objective_text() if name == "objective" else describe_value(getattr(self, name))
                 for name in names}
        return {**texts, **env.tuning_settings()}
