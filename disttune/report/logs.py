"""Read a log directory back for the report: find each ``rank-<r>.log``, keep its usable records, name its defects.

    found = find_rank_logs("logs")                       # {rank: path}
    logs = [load_rank_log(r, p) for r, p in found.items()]

A rank log (written by :class:`disttune.logs.RankLog`) holds a readable line and a JSON line per event.
Nothing here raises on a damaged file: an empty file, a line that is neither a readable log line nor
parsable JSON, bytes that are not UTF-8 and a record that lacks a field or holds a bad one each become a
line of :attr:`RankLogData.problems`. Only a directory without any rank log raises.

Cost: one directory listing, then three passes over each file (records, line scan, UTF-8 check):
O(file size) time, O(records) memory.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ..logs import read_lines, read_records

_RANK_LOG = re.compile(r"^rank-(\d+)\.log$")
_READABLE_LINE = re.compile(r"^\d{4}-\d{2}-\d{2}T\S+ rank=-?\d+ ")
_MAX_LINE_PROBLEMS = 20  # per file; the rest are counted
_REQUIRED = {
    "measure": {"kernel": str, "key": str, "config_index": int, "ms": (int, float, type(None))},
    "config": {"kernel": str, "key": str, "occurrence": int, "config_index": int, "config": str},
    "winner": {"kernel": str, "key": str, "occurrence": int, "config_index": int, "config": str, "source": str},
    "tuning": {"function": str, "wall_s": (int, float), "function_runs": int, "world_size": int},
    "diagnostics": {"kernel": str, "key": str, "occurrence": int, "scope": str},
    "verify": {"kernel": str, "key": str, "occurrence": int, "config": str, "regressed": bool},
    "fallback": {"kernel": str, "key": str, "occurrence": int, "config": str, "source": str},
    "note": {"topic": str, "text": str},
    "error": {"function": str, "text": str},
}


@dataclass
class RankLogData:
    """What one rank's file holds: its valid records in file order, and what was wrong with it."""

    rank: int
    path: Path
    records: list[dict]
    problems: list[str]



def clip(text: str, limit: int = 80) -> str:
    """``text`` on one line of printable characters, cut to ``limit`` with an ellipsis: safe to quote from a log."""
    text = "".join(ch if ch.isprintable() else "?" for ch in text.replace("\n", " "))
    return text if len(text) <= limit else text[: limit - 1] + "…"


def find_rank_logs(log_dir: str | os.PathLike) -> dict[int, Path]:
    """``rank -> path`` of every ``rank-<r>.log`` in ``log_dir`` (one directory listing).

    Raises FileNotFoundError, naming the directory, when it does not exist or holds no rank log.
    """
    directory = Path(log_dir)
    if not directory.is_dir():
        raise FileNotFoundError(f"log directory {str(directory)!r} does not exist")
    found = {}
    for entry in directory.iterdir():
        match = _RANK_LOG.match(entry.name)
        if match and entry.is_file():  # a regular file (through a link): never a FIFO that would block
            found[int(match.group(1))] = entry
    if not found:
        raise FileNotFoundError(
            f"no rank logs (rank-<r>.log) in {str(directory)!r}; "
            "point it at the tuner's log_dir (default ./logs, or $DISTTUNE_LOG_DIR)")
    return dict(sorted(found.items()))


def scan_log_lines(path: Path, label: str) -> list[str]:
    """Problems with the lines of one log: neither a readable line nor parsable JSON. One pass over the file."""
    problems: list[str] = []
    bad = 0
    for number, text in enumerate(read_lines(path), 1):
        if not text.strip():
            continue
        if text.startswith("{"):
            try:
                json.loads(text)
                continue
            except json.JSONDecodeError as err:
                end = len(text.rstrip())
                cut = err.pos >= end - 1 or err.msg.startswith("Unterminated string")
                what = "truncated JSON" if cut else f"invalid JSON ({err.msg})"
            except (RecursionError, ValueError):
                what = "invalid JSON (nested too deeply, or a number too long)"
        elif _READABLE_LINE.match(text):
            continue
        else:
            what = "not a disttune log line"
        bad += 1
        if bad <= _MAX_LINE_PROBLEMS:
            problems.append(f"{label} line {number}: {what}, skipped: {clip(text)}")
    if bad > _MAX_LINE_PROBLEMS:
        problems.append(f"{label}: {bad - _MAX_LINE_PROBLEMS} more bad line(s) not listed")
    return problems


def validate_record(record: Any) -> Optional[str]:
    """Why a parsed JSON line is not a usable record, or None when it is."""
    if not isinstance(record, dict):
        return "not a JSON object"
    event = record.get("event")
    if event not in _REQUIRED:
        return f"unknown event {event!r}"
    for name, kind in _REQUIRED[event].items():
        if name not in record:
            return f"{event} record without {name!r}"
        value = record[name]
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
            return f"{event} record with a bad {name!r}: {clip(repr(value), 40)}"
    if event == "config":  # every rank's times, or (a job of many ranks) the logging rank's own
        if "per_rank_ms" in record and not isinstance(record["per_rank_ms"], list):
            return f"config record with a bad 'per_rank_ms': {clip(repr(record['per_rank_ms']), 40)}"
        if "per_rank_ms" not in record and "rank_ms" not in record:
            return "config record without 'per_rank_ms'"
        if "rank_ms" in record and not isinstance(record["rank_ms"], (int, float, type(None))):
            return f"config record with a bad 'rank_ms': {clip(repr(record['rank_ms']), 40)}"
    return None


def load_rank_log(rank: int, path: Path) -> RankLogData:
    """Read one rank's log (:func:`disttune.logs.read_records` plus a line scan): three passes, O(file size)."""
    label = path.name
    try:
        if path.stat().st_size == 0:
            return RankLogData(rank, path, [], [f"{label} is empty"])
        problems = scan_log_lines(path, label)
        if "\ufffd" in path.read_text(encoding="utf-8", errors="replace"):
            problems.append(f"{label}: not valid UTF-8; read with the bad bytes replaced")
        raw = read_records(path)
    except OSError as err:
        return RankLogData(rank, path, [], [f"{label} cannot be read: {err}"])
    records = []
    for record in raw:
        why = validate_record(record)
        if why is not None:
            problems.append(f"{label}: record skipped ({why})")
            continue
        if record.get("rank", rank) != rank:
            problems.append(f"{label}: holds a record of rank {record.get('rank')!r} (kept as rank {rank})")
        records.append(record)
    if not records and not problems:
        problems.append(f"{label} has no JSON records")
    elif not records:
        problems.append(f"{label} has no usable records")
    return RankLogData(rank, path, records, problems)

