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
  disttune's own (``disttune...`` messages), or ``Traceback`` in a launch's stderr.

Each helper returns what it counted, so a test can also assert on it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Sequence

COLUMNS = ("trials", "faults", "hangs", "split_endings", "disagreements", "torn_files", "link_writes", "tracebacks")
TALLY = dict.fromkeys(COLUMNS, 0)
TRACEBACK = "Traceback (most recent call last)"


def summary_line() -> str:
    return ("fault injection: {trials} trials, {faults} faults injected, {hangs} hangs, {split_endings} split endings, "
            "{disagreements} disagreements, {torn_files} torn files, {link_writes} writes through links, "
            "{tracebacks} tracebacks".format(**TALLY))


def faults_seen(count: int) -> int:
    """Add ``count`` faults whose effect the caller checked."""
    TALLY["faults"] += count
    return count


def is_clear_error(record: dict) -> bool:
    """Whether a failed record's error is one of disttune's clear errors (not a stray exception)."""
    return str(record.get("error_message", "")).startswith("disttune")


def endings(per_rank: Sequence[dict], *fields: str, ok: str = "ok", error: str = "error_message",
            message: str = "") -> dict:
    """One trial's ending over its ranks: counts a trial, a split ending, a disagreement and tracebacks.

    ``per_rank``: each rank's outcome; ``ok`` names its success flag (a missing flag: success when it
    has no ``error``), ``fields`` what the successful ranks must agree on, ``error`` what the failed
    ranks must agree on, ``message`` (default: ``error``) the text that must be a clear error.
    """
    TALLY["trials"] += 1
    message = message or error
    succeeded = [r for r in per_rank if r.get(ok, message not in r)]
    failed = [r for r in per_rank if not r.get(ok, message not in r)]
    split = bool(succeeded and failed)
    disagree = (len({json.dumps([r.get(f) for f in fields], default=str) for r in succeeded}) > 1
                or len({str(r.get(error)) for r in failed}) > 1)
    stray = sum(not str(r.get(message, "")).startswith("disttune") for r in failed)
    TALLY["split_endings"] += split
    TALLY["disagreements"] += disagree
    TALLY["tracebacks"] += stray
    return {"split": split, "disagree": disagree, "tracebacks": stray}


def tracebacks_in(text: str) -> int:
    """Tracebacks printed in a launch's stderr (where every failure was due to be a clear error)."""
    found = text.count(TRACEBACK)
    TALLY["tracebacks"] += found
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


def hang() -> None:
    TALLY["hangs"] += 1
