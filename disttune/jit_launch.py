"""A Triton JIT kernel's launch at a cache hit, cut to what decides which compiled kernel runs.

``JITFunction.run`` does more per launch than finding the compiled kernel and launching it: it copies
its keywords, reads the runtime knobs into them, runs Triton's binder (which specializes every
argument, in C), turns the options into a string for its cache key, looks that key up twice, builds
launch metadata for the launch hooks and calls the hooks, installed or not. On a 1 x H200 host the
MoE GEMM's 40-argument launch took 56 µs that way, of which the binder took 15 and the launcher 17.

:func:`runner` returns a function with ``JITFunction.run``'s signature that keeps the binder (so a
launch is specialized exactly as Triton specializes it), keys the compiled kernel on the binder's
output, the options and the knobs that reach the compiled code, and launches it with its own
launcher. Anything that could make Triton's launch differ takes ``JITFunction.run`` itself: a key not
seen yet (Triton compiles or finds the kernel; it is remembered after), ``warmup``, launch hooks or
``pre_run_hooks`` installed (a profiler sees every launch), a stage-inspection hook, an asynchronous
compile, arguments the key cannot hold, the interpreter, Triton versions this was not checked against
(3.6 to 3.9), and any launch while :data:`enabled` is False. Cost on a hit: the binder, one tuple of the
specialization and one dictionary lookup, then the launcher.
"""

from __future__ import annotations

from typing import Any, Callable

import triton
from triton import knobs
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

__all__ = ["enabled", "launch", "runner"]

#: Set to False to send every launch through ``JITFunction.run`` (read at each launch).
enabled = True

#: Triton releases whose ``JITFunction.run`` this module's hit path reproduces.
_CHECKED = ((3, 6), (3, 7), (3, 8), (3, 9))


def _version() -> tuple:
    parts = triton.__version__.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


_PLANNED = _version() in _CHECKED


def _hooks_installed() -> bool:
    """Whether a launch hook is installed (a ``HookChain`` with calls, or any other non-None hook)."""
    for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


def _knob_state(jit: JITFunction) -> tuple:
    """The knobs ``JITFunction.run`` adds to a launch's options (they reach the compiled code)."""
    compilation = knobs.compilation
    return (bool(jit.debug or knobs.runtime.debug), getattr(compilation, "instrumentation_mode", None),
            getattr(compilation, "fpsan_homomorphic_casts", None))


class _Runner:
    """``JITFunction.run`` for one kernel, with the hit path described in the module doc."""

    __slots__ = ("jit", "kernels")

    def __init__(self, jit: JITFunction) -> None:
        self.jit = jit
        self.kernels: dict = {}  # (device, specialization, options, knobs) -> compiled kernel

    def __call__(self, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        jit = self.jit
        if (not enabled or warmup or jit.pre_run_hooks or _hooks_installed()
                or getattr(knobs.runtime, "add_stages_inspection_hook", None) is not None):
            return jit.run(*args, grid=grid, warmup=warmup, **kwargs)
        active = driver.active
        device = active.get_current_device()
        bound, specialization, options = jit.device_caches[device][4](*args, **kwargs)
        try:
            key = (device, tuple(specialization), tuple(options.items()), _knob_state(jit))
            kernel = self.kernels.get(key)
        except TypeError:  # an argument or option the key cannot hold: Triton's own path
            return jit.run(*args, grid=grid, warmup=False, **kwargs)
        if kernel is None:
            kernel = jit.run(*args, grid=grid, warmup=False, **kwargs)
            if kernel is not None and not hasattr(kernel, "result"):  # not a future of an asynchronous compile
                self.kernels[key] = kernel
            return kernel
        missing = _MISSING
        for (name, _), (value, globals_dict) in jit.used_global_vals.items():
            if globals_dict.get(name, missing) != value:  # Triton raises its own error for it
                return jit.run(*args, grid=grid, warmup=False, **kwargs)
        if callable(grid):
            grid = grid(bound)
        size = len(grid)
        kernel.run(grid[0], grid[1] if size > 1 else 1, grid[2] if size > 2 else 1, active.get_current_stream(device),
                   kernel.function, kernel.packed_metadata, None, None, None, *bound.values())
        return kernel


_MISSING = object()


def runner(kernel: Any) -> Callable[..., Any]:
    """A function with ``JITFunction.run``'s signature (``*args, grid=, warmup=, **kwargs``) for ``kernel``:
    the cut launch of the module doc for a :class:`~triton.runtime.jit.JITFunction` on a checked Triton,
    ``kernel.run`` itself for anything else (an interpreted kernel, another launchable). Made once per kernel
    and kept on it."""
    if not _PLANNED or type(kernel) is not JITFunction:
        return kernel.run
    made = kernel.__dict__.get("_disttune_runner")
    if made is None:
        made = kernel._disttune_runner = _Runner(kernel)
    return made


def launch(kernel: Any, grid: Any, *args: Any, **kwargs: Any) -> Any:
    """``kernel[grid](*args, **kwargs)`` through :func:`runner`."""
    return runner(kernel)(*args, grid=grid, warmup=False, **kwargs)
