"""The host's view of the GPU during a tuning call: a marker to wait for, never a blind synchronisation.

The tuner waits for the GPU only where it needs the GPU's results (timing events, ``check=``
comparisons). It does so by recording an event on the current stream and polling it through the
communicator's wait loop (:func:`disttune.comm.wait_until`), with the same deadline and peer checks
as a collective: a GPU stuck behind a user collective that a peer never enters ends in that peer's
error, not in a hang. Without CUDA, or under ``TRITON_INTERPRET=1``, there is nothing to wait for.

Cost: one ``cudaEventRecord`` and a ``cudaEventQuery`` per poll (microseconds).
"""

from __future__ import annotations

import time
from typing import Any, Optional

from .env import interpreting


def in_use() -> bool:
    """Whether this process has initialised CUDA (and runs kernels on it, not in the interpreter)."""
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available() and torch.cuda.is_initialized() and not interpreting()


def marker() -> Optional[Any]:
    """An event recorded now on the current stream (done once the stream's work so far is done); None
    without CUDA."""
    if not in_use():
        return None
    import torch

    event = torch.cuda.Event()
    event.record()
    return event


def drained(within_s: float) -> bool:
    """Whether the current stream's work so far finishes within ``within_s`` seconds (polled, never blocking
    longer); True without CUDA."""
    event = marker()
    if event is None:
        return True
    deadline = time.monotonic() + within_s
    while not event.query():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True
