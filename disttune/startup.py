"""What disttune does to the process it starts in: a word on the settings, and an ending of one line per job.

:func:`start` runs once per process, where disttune starts (``disttune.dist.init``, a tuner's construction):

* each node's local rank 0 warns on stderr of every ``DISTTUNE_*`` variable disttune does not read (a
  misspelling, with the name it is closest to), unless ``disttune`` itself checked them before launching;
* it installs a :data:`sys.excepthook` that ends the process on a *disttune error* (an exception of a disttune
  class, or one whose text starts with ``disttune``) with one line instead of a traceback, then exit status 1:
  ``disttune: ranks 0, 1: TuningError: ... (DISTTUNE_TRACEBACK=1 prints the traceback)``. Every other
  exception goes to the hook that was there before; ``DISTTUNE_TRACEBACK=1`` keeps every traceback.

A job's ranks are processes that fail alike, so the line is printed once per job. Where the ranks are
connected (:func:`watch`: ``disttune.dist.init`` hands over the job's rendezvous store, or the default process
group has one), each failing rank posts its line in the store and waits up to :data:`SETTLE_S` for its peers'
lines; the lowest rank that posted prints each distinct line once, with the ranks that raised it, and the
others print only a line it did not cover. Before the ranks are connected each prints its own line, except a
bad ``DISTTUNE_*`` setting, the same on every rank of a node, which each node's local rank 0 prints.

Cost: :func:`start` reads the environment once; the hook costs nothing until an error ends the process, then
a few store round trips and at most :data:`SETTLE_S` of waiting for the peers.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from . import env

__all__ = ["SETTLE_S", "TRACEBACK_HINT", "error_text", "is_disttune_error", "settle", "start", "watch",
           "warn_of_settings"]

#: How long a failing rank waits for its peers' errors before the job's line is printed.
SETTLE_S = 2.0
#: How the line says where the traceback went.
TRACEBACK_HINT = "DISTTUNE_TRACEBACK=1 prints the traceback"
_POLL_S = 0.02
_KEYS = "disttune/exit"  # the store keys of the ending: <_KEYS>/<rank>, /printed, /seen


@dataclass
class _Job:
    """Where this process's ending reports: the hook it replaced, and the job's store once the ranks connect."""

    previous: Callable[..., Any]
    store: Any = None
    rank: int = 0
    world_size: int = 1
    #: the hook ``torch.distributed`` put around ours when it created the group (it prefixes each line with the
    #: rank), kept for the other exceptions; ``in_wrapper`` while it runs, when it calls ours back
    wrapper: Optional[Callable[..., Any]] = None
    in_wrapper: bool = False


_JOB: Optional[_Job] = None


def start() -> None:
    """Once per process: warn of unknown ``DISTTUNE_*`` variables and install the one-line ending (see the module
    doc). Later calls return at once."""
    global _JOB
    if _JOB is not None:
        return
    _JOB = _Job(previous=sys.excepthook)
    sys.excepthook = _excepthook
    if env.local_rank() == 0 and not env.settings_checked():
        warn_of_settings()


def warn_of_settings() -> None:
    """One line on stderr per ``DISTTUNE_*`` variable that disttune does not read."""
    for warning in env.check_settings()[1]:
        print(f"disttune: warning: {warning}", file=sys.stderr, flush=True)


def watch(store: Any, rank: int, world_size: int) -> None:
    """The ranks are connected: a failing rank reports through ``store`` (kept by reference, so it outlives an
    aborted process group) as ``rank`` of ``world_size``."""
    start()
    assert _JOB is not None
    _JOB.store, _JOB.rank, _JOB.world_size = store, rank, world_size
    if sys.excepthook is not _excepthook:  # init_process_group wrapped ours: our line needs no rank prefix
        _JOB.wrapper, sys.excepthook = sys.excepthook, _excepthook


def is_disttune_error(error: BaseException) -> bool:
    """An exception of a disttune class, or whose text starts with ``disttune`` (the library's own errors)."""
    return (isinstance(error, Exception)
            and (type(error).__module__.split(".")[0] == "disttune" or str(error).startswith("disttune")))


def error_text(error: BaseException) -> str:
    """``TuningError: step: ...``: the class and the message on one line, without the ``disttune:`` prefix."""
    message = " ".join(str(error).split()).removeprefix("disttune: ")
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


def _excepthook(kind: type, error: BaseException, traceback: Any) -> None:
    job = _JOB
    assert job is not None
    if env.traceback_requested() or not is_disttune_error(error):
        if job.wrapper is None or job.in_wrapper:
            job.previous(kind, error, traceback)
            return
        job.in_wrapper = True
        try:
            job.wrapper(kind, error, traceback)
        finally:
            job.in_wrapper = False
        return
    text = error_text(error)
    try:
        lines = _job_lines(job, text, bool(getattr(error, "from_settings", False)))
    except Exception:  # noqa: BLE001 - the store is gone: this rank says it alone
        lines = [_line(text, _where(job)[1:])]
    for line in lines:
        sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _where(job: _Job) -> tuple[Any, int, int]:
    """(the job's store or None, this rank, the world size)."""
    if job.store is not None:
        return job.store, job.rank, job.world_size
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            from .comm import control_store

            return control_store(), dist.get_rank(), dist.get_world_size()
    except Exception:  # noqa: BLE001 - a group torn down: the launcher's word below
        pass
    return (None, *env.launcher_rank())


def _line(text: str, where: tuple[int, int]) -> str:
    rank, world_size = where
    return _lines({text: [rank] if world_size > 1 else []})[0]


def _lines(ranks_by_text: dict[str, list[int]]) -> list[str]:
    lines = []
    for text, ranks in ranks_by_text.items():
        who = "" if not ranks else f"rank {ranks[0]}: " if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}: "
        lines.append(f"disttune: {who}{text} ({TRACEBACK_HINT})")
    return lines


def _job_lines(job: _Job, text: str, setting: bool) -> list[str]:
    """What this rank prints of the job's ending (see the module doc)."""
    store, rank, world_size = _where(job)
    if store is None and setting:  # the same on every rank of the node: said once, naming no rank
        return [_line(text, (0, 1))] if env.local_rank() == 0 else []
    if store is None or world_size == 1:
        return [_line(text, (rank, world_size))]
    return settle(store, rank, world_size, text)


def settle(store: Any, rank: int, world_size: int, text: str) -> list[str]:
    """The lines ``rank`` prints of its job's ending, ``text`` being its own error (see the module doc): every
    distinct line of the ranks that posted within :data:`SETTLE_S`, each with its ranks, on the lowest of them;
    on the others, their own line only where the lowest did not cover it. A few store round trips."""
    keys = [f"{_KEYS}/{r}" for r in range(world_size)]
    store.set(keys[rank], text)
    deadline = time.monotonic() + SETTLE_S
    while not store.check(keys) and time.monotonic() < deadline:
        time.sleep(_POLL_S)
    posted = [r for r in range(world_size) if store.check([keys[r]])]
    printed, seen = f"{_KEYS}/printed", f"{_KEYS}/seen"
    if posted[0] == rank:
        by_text: dict[str, list[int]] = {}
        for r in posted:
            by_text.setdefault(store.get(keys[r]).decode("utf-8", "replace"), []).append(r)
        store.set(printed, json.dumps(posted))
        # the peers read "printed" before this process (which may host the store) exits
        while store.add(seen, 0) < len(posted) - 1 and time.monotonic() < deadline + SETTLE_S:
            time.sleep(_POLL_S)
        return _lines(by_text)
    while not store.check([printed]) and time.monotonic() < deadline + SETTLE_S:
        time.sleep(_POLL_S)
    covered = json.loads(store.get(printed)) if store.check([printed]) else []
    store.add(seen, 1)
    return [] if rank in covered else [_line(text, (rank, world_size))]
