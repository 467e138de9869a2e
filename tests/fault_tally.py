"""The fault suite's counters, each measured by the test that reports it; conftest.py prints them at the end.

A fault test launches a job with faults injected and then *looks*: it counts what it observed, never
what it meant to cause. The columns:

* ``trials``: jobs (or tunings inside one job) whose outcome was read back, one per case record set;
* ``faults``: injected faults whose effect was seen (a failed config scored ``inf``, the planted
  error named in the message, a damaged file warned about, a dead rank's exit status);
* ``hangs``: launches killed at their wall-clock bound;
* ``split_endings``: trials where some rank returned and another raised;
* ``disagreements``: trials where the ranks that returned report different results, or the ranks that
  raised report different errors;
* ``torn_files``: store files left behind (regular files, not planted links) that do not decode or validate;
* ``link_writes``: targets of planted symbolic links whose bytes changed;
* ``tracebacks``: a Python traceback where a clear error was due: a rank's error that is not one of
  disttune's own (``disttune...`` messages), or ``Traceback`` in a launch's stderr;
* ``timeout_waits``: ranks that ended only after waiting out a timeout although a rank's error was
  known (posted) long before it.

Each helper returns what it counted, so a test can also assert on it. ``TALLY`` is the CPU suite's;
the fault suite under NCCL (``test_stranded.py``, on GPUs) keeps its own, :data:`GPU_TALLY`, and prints
its own line with the GPUs it ran on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Sequence

COLUMNS = ("trials", "faults", "hangs", "split_endings", "disagreements", "torn_files", "link_writes", "tracebacks",
           "timeout_waits")
TALLY = dict.fromkeys(COLUMNS, 0)
GPU_TALLY = dict.fromkeys(COLUMNS, 0)
TRACEBACK = "Traceback (most recent call last)"


def summary_line(tally: dict = TALLY, label: str = "fault injection") -> str:
    return (label + ": {trials} trials, {faults} faults injected, {hangs} hangs, {split_endings} split endings, "
            "{disagreements} disagreements, {torn_files} torn files, {link_writes} writes through links, "
            "{tracebacks} tracebacks, {timeout_waits} timeout waits".format(**tally))


#: The GPU counts the fault suite under NCCL ran at (its line names them).
GPU_WORLDS: set = set()


def gpu_label() -> str:
    """The NCCL suite's label: ``fault injection under NCCL on 2 and 4 x <GPU model>``."""
    import torch

    model = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    worlds = " and ".join(str(w) for w in sorted(GPU_WORLDS))
    return f"fault injection under NCCL on {worlds} x {model}"


def faults_seen(count: int, tally: dict = TALLY) -> int:
    """Add ``count`` faults whose effect the caller checked."""
    tally["faults"] += count
    return count


def timeout_waits(ended_after_s: Sequence[float], timeout_s: float, tally: dict = TALLY) -> int:
    """Count the ranks that ended ``timeout_s`` or more after a fault whose error was posted at once."""
    waited = sum(seconds >= timeout_s for seconds in ended_after_s)
    tally["timeout_waits"] += waited
    return waited


def is_clear_error(record: dict) -> bool:
    """Whether a failed record's error is one of disttune's clear errors (not a stray exception)."""
    return str(record.get("error_message", "")).startswith("disttune")


def endings(per_rank: Sequence[dict], *fields: str, ok: str = "ok", error: str = "error_message",
            message: str = "", tally: dict = TALLY) -> dict:
    """One trial's ending over its ranks: counts a trial, a split ending, a disagreement and tracebacks.

    ``per_rank``: each rank's outcome; ``ok`` names its success flag (a missing flag: success when it
    has no ``error``), ``fields`` what the successful ranks must agree on, ``error`` what the failed
    ranks must agree on, ``message`` (default: ``error``) the text that must be a clear error.
    """
    tally["trials"] += 1
    message = message or error
    succeeded = [r for r in per_rank if r.get(ok, message not in r)]
    failed = [r for r in per_rank if not r.get(ok, message not in r)]
    split = bool(succeeded and failed)
    disagree = (len({json.dumps([r.get(f) for f in fields], default=str) for r in succeeded}) > 1
                or len({str(r.get(error)) for r in failed}) > 1)
    stray = sum(not str(r.get(message, "")).startswith("disttune") for r in failed)
    tally["split_endings"] += split
    tally["disagreements"] += disagree
    tally["tracebacks"] += stray
    return {"split": split, "disagree": disagree, "tracebacks": stray}


def tracebacks_in(text: str, tally: dict = TALLY) -> int:
    """Tracebacks printed in a launch's stderr (where every failure was due to be a clear error)."""
    found = text.count(TRACEBACK)
    tally["tracebacks"] += found
    return found


def torn_files(roots: Iterable[Path]) -> list[Path]:
    """Store entries under ``roots`` that do not decode or validate (and none is expected to)."""
    from disttune import store

    torn = []
    for root in roots:
        for path, record, problem in store.iter_records(root):
            if problem is not None and path.is_file() and not path.is_symlink():  # a planted link is not torn
                torn.append(path)
    TALLY["torn_files"] += len(torn)
    return torn


def link_writes(changed: Iterable[str]) -> list[str]:
    """Planted links' targets that changed (the caller compared their bytes before and after)."""
    changed = list(changed)
    TALLY["link_writes"] += len(changed)
    return changed


def hang(tally: dict = TALLY) -> None:
    tally["hangs"] += 1
