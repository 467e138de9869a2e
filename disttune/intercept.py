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

``launch_config`` reproduces what Triton does for one tuning launch
(``Config.pre_hook``, the tuner's ``pre_hook``/``reset_to_zero``/``restore_value``,
the launch, ``post_hook``); ``launch_winner`` what it does for a cached launch.
"""

from __future__ import annotations

import contextlib
import contextvars
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
_open_scopes = 0
_triton_run: Optional[Callable[..., Any]] = None


def _reset_after_fork() -> None:
    global _install_lock
    _install_lock = threading.RLock()  # a fork while another thread held it must not leave the child locked


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


def _hooked_run(self: Autotuner, *args: Any, **kwargs: Any) -> Any:
    handler = _current.get()
    if handler is None:
        original = _triton_run or _stock_run()
        if _open_scopes == 0:
            restore_triton_run()  # outside every scope: later launches go straight to Triton
        return original(self, *args, **kwargs)  # type: ignore[misc]
    return handler.launch(self, args, kwargs)


def active_handler() -> Optional[LaunchHandler]:
    """The handler of the scope open on this thread, if any."""
    return _current.get()


def has_choice(autotuner: Autotuner) -> bool:
    """Whether the autotuner has configs to choose between; one with a single config is never a site
    (its launches are Triton's own, in tuning and fast calls alike)."""
    return len(autotuner.configs) > 1


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
    global _triton_run
    with _install_lock:
        if _open_scopes == 0 and _triton_run is not None and Autotuner.run is _hooked_run:
            Autotuner.run = _triton_run  # type: ignore[method-assign]
            _triton_run = None
        return _open_scopes == 0


def _stock_run() -> Callable[..., Any]:
    with _install_lock:  # install and restore change both names under this lock
        return _triton_run if _triton_run is not None else Autotuner.run


def triton_run(autotuner: Autotuner, *args: Any, **kwargs: Any) -> Any:
    """Triton's own ``Autotuner.run``, whether or not the hook is installed."""
    return (_triton_run or _stock_run())(autotuner, *args, **kwargs)


def open_scope(handler: LaunchHandler) -> contextvars.Token:
    """Start routing this thread's autotuned launches to ``handler``; pair with :func:`close_scope`.

    The bare pair behind :func:`intercept`, for the tuned fast path (no generator, no checks):
    the caller has made sure no scope is open on this thread and closes it in a ``finally``.
    """
    global _open_scopes, _triton_run
    _install_lock.acquire()  # acquire/release rather than ``with``: this runs on every tuned call
    try:
        current = Autotuner.run
        if current is not _hooked_run and not _reaches_hook(current):  # not installed, or replaced since
            _triton_run = current
            Autotuner.run = _hooked_run  # type: ignore[method-assign]
        _open_scopes += 1
    finally:
        _install_lock.release()
    return _current.set(handler)


def close_scope(token: contextvars.Token) -> None:
    """End the scope :func:`open_scope` began (Triton's ``run`` comes back lazily, see the module doc)."""
    global _open_scopes
    _current.reset(token)
    _install_lock.acquire()
    try:
        _open_scopes -= 1
    finally:
        _install_lock.release()


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


def tuning_key(autotuner: Autotuner, args: tuple, kwargs: dict) -> tuple:
    """The key Triton's ``Autotuner.run`` caches under: the ``key`` arguments, then every tensor's dtype."""
    nargs = dict(zip(autotuner.arg_names, args))
    all_args = {**nargs, **kwargs}
    named = {k: v for k, v in all_args.items() if k in autotuner.arg_names}
    key = [named[k] for k in autotuner.keys if k in named]
    key.extend(str(v.dtype) for v in named.values() if hasattr(v, "dtype"))
    return tuple(key)


def candidate_configs(autotuner: Autotuner, args: tuple, kwargs: dict) -> list:
    """The configs Triton would benchmark for this launch (``early_config_prune``, ``perf_model``/``top_k``)."""
    autotuner.nargs = dict(zip(autotuner.arg_names, args))
    try:
        return list(autotuner.prune_configs(kwargs))
    finally:
        autotuner.nargs = None


def check_conflicts(autotuner: Autotuner, kwargs: dict, config: Any) -> None:
    """Triton's rule: a meta-parameter set both by the caller and by a config is an error."""
    conflicts = kwargs.keys() & config.kwargs.keys()
    if conflicts:
        raise ValueError(
            f"Conflicting meta-parameters: {', '.join(sorted(conflicts))}."
            " Make sure that you don't re-define auto-tuned symbols."
        )


def launch_config(
    autotuner: Autotuner,
    args: tuple,
    kwargs: dict,
    config: Any,
    wrap: Callable[[Callable[[], Any]], Any] = lambda launch: launch(),
) -> Any:
    """One tuning launch with Triton's hook semantics; ``wrap`` surrounds the bare launch (a timer).

    Raises whatever the hooks or the launch raise (compile errors included), after
    the tuner's ``post_hook`` has run, as Triton does.
    """
    current = dict(kwargs, **config.all_kwargs())
    full_nargs = {**dict(zip(autotuner.arg_names, args)), **current}
    if config.pre_hook:
        config.pre_hook(full_nargs)
    autotuner.pre_hook(full_nargs)
    try:
        result = wrap(lambda: autotuner.fn.run(*args, **current))
    except Exception as err:
        autotuner.post_hook(full_nargs, exception=err)
        raise
    autotuner.post_hook(full_nargs, exception=None)
    return result


def launch_winner(autotuner: Autotuner, args: tuple, kwargs: dict, config: Any) -> Any:
    """A launch with a chosen config, exactly as Triton's cached path does it."""
    if config.pre_hook is not None:
        config.pre_hook({**dict(zip(autotuner.arg_names, args)), **kwargs, **config.all_kwargs()})
    return autotuner.fn.run(*args, **kwargs, **config.all_kwargs())


def reset_before_real_launch(autotuner: Autotuner, args: tuple, kwargs: dict, config: Any) -> None:
    """What Triton does once after benchmarking: ``pre_hook(reset_only=True)`` (zeroes ``reset_to_zero``)."""
    full_nargs = {**dict(zip(autotuner.arg_names, args)), **kwargs, **config.all_kwargs()}
    autotuner.pre_hook(full_nargs, reset_only=True)


def kernel_name(autotuner: Autotuner) -> str:
    """``module.qualname`` of the kernel's Python function (remembered on the autotuner)."""
    name = autotuner.__dict__.get("_disttune_name")
    if name is None:
        fn = autotuner.base_fn
        name = autotuner._disttune_name = f"{fn.__module__}.{fn.__qualname__}"
    return name


def can_precompile(autotuner: Autotuner) -> bool:
    """Whether the kernel can be compiled without a launch (a JITFunction on a real GPU backend)."""
    from triton.runtime.jit import JITFunction

    from .env import interpreting

    return isinstance(autotuner.fn, JITFunction) and not interpreting()


def current_cuda_device() -> Optional[int]:
    import torch

    return torch.cuda.current_device() if torch.cuda.is_available() else None


def default_compile_threads() -> int:
    """Compile threads when none are asked for: up to 16 per rank on a GPU backend, none in the interpreter."""
    from . import env

    if env.interpreting() or current_cuda_device() is None:
        return 0
    ranks_here = env.local_world_size()  # ranks of this node compile side by side
    return max(1, min(16, (os.cpu_count() or 2) // max(1, ranks_here)))


def precompile(autotuner: Autotuner, args: tuple, kwargs: dict, config: Any, device: Optional[int]) -> Any:
    """Compile one config of a launch on a worker thread (``JITFunction.warmup``), on the caller's GPU."""
    if device is not None:
        import torch

        torch.cuda.set_device(device)  # the CUDA device is per thread; compile for the launching rank's GPU
    meta = {k: v for k, v in kwargs.items() if k != "warmup"}  # discovery already checked for conflicts
    return autotuner.fn.warmup(*args, **meta, **config.all_kwargs())
