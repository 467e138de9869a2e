"""The scoped hook on ``triton.runtime.autotuner.Autotuner.run``, and Triton-faithful launches.

While at least one scope is open, ``Autotuner.run`` is replaced by a thin function
that looks up the *current thread's* handler in a context variable. Launches on
other threads, or on this thread outside the scope, go to Triton's own ``run``.
Triton's method is put back by the first launch made while no scope is open on any
thread (or by :func:`restore_triton_run`), not when the last scope closes: a tuned
function called in a loop then installs the hook once rather than on every call
(assigning a class attribute costs little itself, but it invalidates every specialized
lookup on the class, about 0.25 us per call in all). A launch outside every scope pays
one forwarding call before stock Triton runs it. Other code that patches
``Autotuner.run`` meanwhile is respected: a ``functools.wraps`` wrapper around the hook
is kept (launches reach the hook through it), and a method put in its place makes the
next scope install the hook again over it.

This is the first step of the walk: the launch is intercepted here and handed to a launch handler
(:mod:`disttune.handlers`), which turns it into a site. What Triton itself would do with the launch
(its key, its candidates, a tuning or a cached launch) lives in :mod:`disttune.triton_launch`.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import os
import threading
from typing import Any, Callable, Iterator, Optional, Protocol

from triton.runtime.autotuner import Autotuner


class LaunchHandler(Protocol):
    def launch(self, autotuner: Autotuner, args: tuple, kwargs: dict) -> Any:
        """Called instead of ``Autotuner.run`` for launches inside the scope."""
        ...


_current: contextvars.ContextVar[Optional[LaunchHandler]] = contextvars.ContextVar(
    "disttune_launch_handler", default=None
)
_install_lock = threading.RLock()  # re-entrant: a launch from a finalizer may come while this thread holds it
_triton_run: Optional[Callable[..., Any]] = None
# Scopes opened and closed so far: ``next()`` on a count is atomic, so a scope costs no lock. Putting
# Triton's run back (under the lock) raises ``_restoring`` before it counts the open scopes; a scope
# counts itself before it looks at ``_restoring``, so either the restorer sees the scope, or the scope
# sees the restorer and waits for the lock to install the hook again.
_opened = itertools.count()
_closed = itertools.count()
_restoring = False


def _times_called(counter: "itertools.count[int]") -> int:
    return int(repr(counter)[6:-1])  # "count(N)": the next value, read without taking it


def _scopes_open() -> int:
    """Scopes open now, or more (never fewer): the closes are read before the opens."""
    closed = _times_called(_closed)
    return _times_called(_opened) - closed


def _reset_after_fork() -> None:
    global _install_lock
    _install_lock = threading.RLock()  # a fork while another thread held it must not leave the child locked


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


def _hooked_run(self: Autotuner, *args: Any, **kwargs: Any) -> Any:
    handler = _current.get()
    if handler is None:
        original = _triton_run or _stock_run()
        if _scopes_open() == 0:
            restore_triton_run()  # outside every scope: later launches go straight to Triton
        return original(self, *args, **kwargs)  # type: ignore[misc]
    return handler.launch(self, args, kwargs)


#: The handler of the scope open on this thread, if any (the context variable's own ``get``: the tuned
#: fast path asks on every call, and a bound builtin costs no Python frame).
active_handler: Callable[[], Optional[LaunchHandler]] = _current.get


def hook_installed() -> bool:
    return Autotuner.run is _hooked_run


def _reaches_hook(run: Any) -> bool:
    """Whether ``run`` is the hook or a ``functools.wraps`` wrapper around it (a profiler's, say)."""
    for _ in range(8):
        if run is _hooked_run:
            return True
        run = getattr(run, "__wrapped__", None)
        if run is None:
            return False
    return False


def restore_triton_run() -> bool:
    """Put back the ``Autotuner.run`` the hook replaced, if no scope is open; returns whether none is.

    Where something else has replaced or wrapped the hook since, its method stays (a wrapper still
    reaches the hook, which forwards to the saved method)."""
    global _triton_run, _restoring
    with _install_lock:
        _restoring = True
        try:
            idle = _scopes_open() == 0
            if idle and _triton_run is not None and Autotuner.run is _hooked_run:
                Autotuner.run = _triton_run  # type: ignore[method-assign]
                _triton_run = None
        finally:
            _restoring = False
        return idle


def _stock_run() -> Callable[..., Any]:
    with _install_lock:  # install and restore change both names under this lock
        return _triton_run if _triton_run is not None else Autotuner.run


def triton_run(autotuner: Autotuner, *args: Any, **kwargs: Any) -> Any:
    """Triton's own ``Autotuner.run``, whether or not the hook is installed."""
    return (_triton_run or _stock_run())(autotuner, *args, **kwargs)


def open_scope(handler: LaunchHandler) -> contextvars.Token:
    """Start routing this thread's autotuned launches to ``handler``; pair with :func:`close_scope`.

    The bare pair behind :func:`intercept`, for the tuned fast path (no generator, no checks):
    the caller has made sure no scope is open on this thread and closes it in a ``finally``. Where the
    hook is in place it takes no lock (see ``_restoring``).
    """
    next(_opened)
    if _restoring or Autotuner.run is not _hooked_run:
        _install()
    return _current.set(handler)


def _install() -> None:
    """Install the hook unless it, or a wrapper that reaches it, is in place."""
    global _triton_run
    with _install_lock:
        current = Autotuner.run
        if current is not _hooked_run and not _reaches_hook(current):  # not installed, or replaced since
            _triton_run = current
            Autotuner.run = _hooked_run  # type: ignore[method-assign]


def close_scope(token: contextvars.Token) -> None:
    """End the scope :func:`open_scope` began (Triton's ``run`` comes back lazily, see the module doc)."""
    _current.reset(token)
    next(_closed)


@contextlib.contextmanager
def intercept(handler: LaunchHandler) -> Iterator[None]:
    """Route this thread's autotuned launches to ``handler`` for the duration of the block."""
    if _current.get() is not None:
        raise RuntimeError("disttune: an interception scope is already open on this thread")
    token = open_scope(handler)
    try:
        yield
    finally:
        close_scope(token)
