"""Triton's one-time initialisation, paid before the first tuning call instead of inside it.

The first kernel a process compiles pays for more than itself: Triton's compiler and driver modules,
the GPU backend, the host compiler that builds the driver's helper module and each kernel's launcher,
the assembler. That is most of a first compile, and it lands inside the first tuning call.
:func:`warm_up` compiles and loads a tiny kernel on the current GPU to pay it early, ideally in the
background while the process loads its model; :func:`disttune.dist.init` starts it in the background
after pinning the GPU, and so does every new tuner (:func:`start_for_tuner`), for scripts that make
their own process group (``DISTTUNE_WARM_UP=0`` turns both off). The compile pool waits for a warm-up
in progress before compiling, so the two never initialise Triton side by side.

Cost: one compile and one load of a one-argument kernel, on the calling thread or a daemon thread;
nothing under ``TRITON_INTERPRET=1`` or without a GPU.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Optional, Union

import triton

from . import env

__all__ = ["warm_up", "wait_for_warm_up"]

_lock = threading.Lock()
_started: dict = {}  # device index -> Future of the warm-up's seconds


@triton.jit
def _warm_up_kernel(value):
    pass


def _available() -> bool:
    if env.interpreting():
        return False
    import torch

    return torch.cuda.is_available()


def _run(device: int) -> float:
    import torch

    started = time.perf_counter()
    torch.cuda.set_device(device)
    compiled = _warm_up_kernel.warmup(1, grid=(1,))
    if hasattr(compiled, "result"):  # a Triton that compiles asynchronously hands back a future
        compiled = compiled.result()
    getattr(compiled, "run", None)  # builds the launcher and loads the binary (Triton does it lazily)
    return time.perf_counter() - started


def warm_up(background: bool = False, device: Optional[int] = None) -> Union[float, concurrent.futures.Future]:
    """Pay Triton's one-time initialisation on ``device`` (default: the current GPU) now.

    Returns the seconds it took, or with ``background=True`` a future of them (a daemon thread does
    the work). Once per device and process: later calls return the first one's result. A warm-up
    that fails is ignored (0.0): the first real compile then pays the initialisation as it would have.
    Nothing happens (0.0) under ``TRITON_INTERPRET=1`` or without a GPU.
    """
    if not _available():
        return _done(0.0) if background else 0.0
    import torch

    index = torch.cuda.current_device() if device is None else int(device)
    run_here = False
    with _lock:
        future = _started.get(index)
        if future is None:
            future = _started[index] = concurrent.futures.Future()
            if background:
                threading.Thread(target=_fill, args=(future, index), name="disttune-warm-up", daemon=True).start()
            else:
                run_here = True
    if run_here:
        _fill(future, index)
    return future if background else future.result()


def _fill(future: concurrent.futures.Future, device: int) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(_run(device))
    except Exception:  # noqa: BLE001 - a failed warm-up changes nothing: the first compile pays instead
        future.set_result(0.0)


def _done(value: float) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_result(value)
    return future


def wait_for_warm_up() -> float:
    """Wait for every warm-up started in this process; returns their seconds (0.0 where none ran)."""
    with _lock:
        futures = list(_started.values())
    return sum(future.result() for future in futures)


def start_if_enabled(device: Optional[int] = None) -> None:
    """The warm-up :func:`disttune.dist.init` starts: in the background, unless ``DISTTUNE_WARM_UP=0``."""
    if env.warm_up_enabled():
        warm_up(background=True, device=device)


def start_for_tuner() -> None:
    """The warm-up a new tuner starts, so that a script that makes its own process group gets it too: in the
    background on the GPU this process will use (the current one where CUDA is already in use, else the
    launcher's local rank modulo the GPUs, as :func:`disttune.dist.init` pins it), unless
    ``DISTTUNE_WARM_UP=0``. Nothing under the interpreter or without a GPU; a no-op once started."""
    if not env.warm_up_enabled() or not _available():
        return
    import torch

    device = (torch.cuda.current_device() if torch.cuda.is_initialized()
              else env.local_rank() % max(1, torch.cuda.device_count()))
    warm_up(background=True, device=device)
