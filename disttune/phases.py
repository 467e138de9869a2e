"""Where the time of one tuning call goes: exclusive wall-clock spans on the calling thread.

A tuning call opens spans around its steps (``with phases.span("tuning runs"): ...``); a span opened
inside another is subtracted from it, so every second of the call is counted once and the spans
plus :data:`OTHER` (the Python between them) add up to the call's wall time. Compiles run on worker
threads beside the call: :meth:`Phases.add_background` keeps their busy time apart, as a figure
that is not part of the sum.

Cost: two ``time.perf_counter`` reads and a dictionary update per span (about 1 µs); spans are
only opened while tuning, never on the tuned fast path.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator, Optional

#: The remainder of the wall time that no span covers: the tuner's own Python between steps.
OTHER = "python overhead"

#: The spans a contextual tuning call opens, in the order of its walk (see ``disttune.contextual``).
#: ``compile wait``: the calling thread waiting for compiles; ``first launches``: each config's first
#: launch in this process (loading its binary, building Triton's launcher); ``collectives``: every
#: agreement between ranks; ``tuning runs``, ``discovery run`` and ``final run``: the rest of those
#: runs (the function body, its own communication, the timed launches).
SPANS = ("discovery run", "compile wait", "first launches", "tuning runs", "collectives", "store", "final run")


class Phases:
    """Exclusive seconds per named span, and background (compile thread) seconds beside them."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.background: dict[str, float] = {}
        self._inner: list[float] = []  # per open span: seconds spent in spans nested inside it
        self._launched: set = set()

    def first(self, launch: object) -> bool:
        """Whether this is the first time ``launch`` (a site and config) is asked about: its first launch."""
        if launch in self._launched:
            return False
        self._launched.add(launch)
        return True

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        self._inner.append(0.0)
        try:
            yield
        finally:
            elapsed = time.perf_counter() - started
            inner = self._inner.pop()
            self.seconds[name] = self.seconds.get(name, 0.0) + elapsed - inner
            if self._inner:
                self._inner[-1] += elapsed

    def add_background(self, name: str, seconds: float) -> None:
        self.background[name] = self.background.get(name, 0.0) + seconds

    def breakdown(self, wall_s: float) -> dict[str, float]:
        """Seconds per span in :data:`SPANS` order (then any other span), :data:`OTHER` last: they sum to
        ``wall_s``."""
        ordered = {name: self.seconds[name] for name in SPANS if name in self.seconds}
        ordered.update({name: s for name, s in self.seconds.items() if name not in ordered})
        ordered[OTHER] = max(0.0, wall_s - sum(ordered.values()))
        return ordered


def span(phases: Optional[Phases], name: str) -> "contextlib.AbstractContextManager[None]":
    """``phases.span(name)``, or a no-op where no breakdown is kept."""
    return contextlib.nullcontext() if phases is None else phases.span(name)
