"""Merge the per-rank tuning logs of one log directory into a Markdown report with plots.

    report = build_report("logs")            # writes logs/report/report.md and site-<n>-*.png
    python -m disttune.report logs [OUT_DIR] [--all]

Each rank appends ``<log_dir>/rank-<r>.log`` (see :mod:`disttune.logs`). For every tuning site
(function, kernel, key, occurrence) the report shows the *last* tuning call found in the logs
(``history=True``, ``disttune report --all``: every tuning call, oldest first). In each rank's
file, a tuning of a site is the ``config`` records that precede one of its ``winner`` records with
source ``tuned``; the n-th last tuning of a rank is matched with the n-th last of the others.
Rank ``r``'s column comes from rank ``r``'s own file when it has the record, else from the
all-gathered ``per_rank_ms`` that another rank logged. Column ``r`` is taken to be global rank ``r``:
logs of a tuner that agreed over a subgroup (``group=``) index ``per_rank_ms`` by group rank.

Nothing in a damaged log directory raises (except a directory without any ``rank-<r>.log``): missing
rank logs, empty files, lines that are neither a readable log line nor parsable JSON, records
lacking fields and ranks that disagree on a winner are listed in :attr:`Report.problems` and in
the report's "Problems" section.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from .logs import read_records
from .sites import describe_config

REPORT_NAME = "report.md"
_RANK_LOG = re.compile(r"^rank-(\d+)\.log$")
_READABLE_LINE = re.compile(r"^\d{4}-\d{2}-\d{2}T\S+ rank=-?\d+ ")
_MAX_LINE_PROBLEMS = 20  # per file; the rest are counted
_SAME_CALL_S = 300.0  # ranks' winner records of one tuning call are logged within this (clock skew included)
_REQUIRED = {
    "measure": {"kernel": str, "key": str, "config_index": int, "ms": (int, float, type(None))},
    "config": {"kernel": str, "key": str, "occurrence": int, "config_index": int, "config": str,
               "per_rank_ms": list},
    "winner": {"kernel": str, "key": str, "occurrence": int, "config_index": int, "config": str, "source": str},
    "tuning": {"function": str, "wall_s": (int, float), "function_runs": int, "world_size": int},
}


# --------------------------------------------------------------------------------------------
# Data model
# --------------------------------------------------------------------------------------------
@dataclass
class ConfigRow:
    """One candidate config of a site. Times in ms: ``inf`` = failed (or pruned), ``nan`` = not in the logs."""

    index: int
    config: str
    per_rank_ms: list[float]  # one per rank column (SiteSummary.ranks)
    agreed_ms: float
    failures: dict[int, str] = field(default_factory=dict)  # rank -> that rank's own failure message

    @property
    def label(self) -> str:
        """The config's one label (:func:`disttune.describe_config`), as the demo and ``show`` print it."""
        return describe_config(self.config)

    @property
    def spread(self) -> float:
        """(max - min) / min over the ranks, ``nan`` unless every known rank time is finite and > 0."""
        known = [t for t in self.per_rank_ms if not math.isnan(t)]
        if not known or not all(math.isfinite(t) for t in known) or min(known) <= 0:
            return math.nan
        return (max(known) - min(known)) / min(known)

    @property
    def failed(self) -> bool:
        return math.isinf(self.agreed_ms) or any(math.isinf(t) for t in self.per_rank_ms)


@dataclass
class SiteSummary:
    """One tuning of one site (function, kernel, key, occurrence), merged over ranks: by default its last."""

    number: int  # 1-based, in order of first appearance; names the plot files
    function: str
    kernel: str
    key: str
    occurrence: int
    ranks: list[int]  # rank columns, 0 .. world_size - 1
    configs: list[ConfigRow]
    winner: Optional[int]  # config index of the last tuned winner; None when no rank logged one
    tuned_at: Optional[str] = None  # UTC time of that winner record (lowest rank that has it)
    reduce: Optional[str] = None
    statistic: Optional[str] = None
    wall_s: dict[int, float] = field(default_factory=dict)  # rank -> wall time of that tuning call
    function_runs: Optional[int] = None
    sites_in_call: Optional[int] = None
    latest_source: Optional[str] = None  # source of the site's last winner record: tuned/store/pinned
    latest_winner: Optional[int] = None
    logged_ranks: list[int] = field(default_factory=list)  # ranks whose own log has this tuning
    plots: list[Path] = field(default_factory=list)
    tuning_number: int = 1  # which tuning of the site this is, oldest first
    tunings: int = 1  # how many tunings of the site the logs hold
    in_history: bool = False  # one of several tunings shown (``history=True``): named with its number

    @property
    def title(self) -> str:
        """``kernel key=(...) (occurrence n)``: the key tells apart two sites of one kernel."""
        return f"{self.kernel} key={self.key} (occurrence {self.occurrence})"

    @property
    def name(self) -> str:
        """``Site 3`` or, in a history, ``Site 3, tuning 2 of 4``."""
        return f"Site {self.number}" + (f", tuning {self.tuning_number} of {self.tunings}" if self.in_history else "")

    @property
    def file_stem(self) -> str:
        """Start of the plot file names: ``site-3`` or, in a history, ``site-3-tuning-2``."""
        return f"site-{self.number}" + (f"-tuning-{self.tuning_number}" if self.in_history else "")

    def row(self, index: Optional[int]) -> Optional[ConfigRow]:
        return next((r for r in self.configs if r.index == index), None)

    def alone_pick(self, rank: int) -> Optional[int]:
        """The config ``rank`` would have picked from its own times alone (argmin, ties to the lowest index)."""
        column = self.ranks.index(rank)
        best, best_ms = None, math.inf
        for row in self.configs:
            t = row.per_rank_ms[column]
            if not math.isnan(t) and t < best_ms:
                best, best_ms = row.index, t
        return best

    def alone_picks(self) -> dict[int, Optional[int]]:
        return {r: self.alone_pick(r) for r in self.ranks}

    def disagreeing_ranks(self) -> list[int]:
        """Ranks whose own pick exists and differs from the agreed winner."""
        if self.winner is None:
            return []
        return [r for r, pick in self.alone_picks().items() if pick is not None and pick != self.winner]


@dataclass
class Report:
    markdown_path: Path
    plots: list[Path]
    sites: list[SiteSummary]
    problems: list[str]


@dataclass
class RankLogData:
    """What one rank's file holds: its valid records in file order, and what was wrong with it."""

    rank: int
    path: Path
    records: list[dict]
    problems: list[str]


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------
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
        if match and not entry.is_dir():
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
    with open(path, encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, 1):
            text = line.rstrip("\r\n")
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
            elif _READABLE_LINE.match(text):
                continue
            else:
                what = "not a disttune log line"
            bad += 1
            if bad <= _MAX_LINE_PROBLEMS:
                problems.append(f"{label} line {number}: {what}, skipped: {_clip(text)}")
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
            return f"{event} record with a bad {name!r}: {_clip(repr(value), 40)}"
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


# --------------------------------------------------------------------------------------------
# One rank's view of each site
# --------------------------------------------------------------------------------------------
SiteKey = tuple  # (function, kernel, key, occurrence)


@dataclass
class _RankSite:
    """One rank's view of one site: a tuning of it (by default its last), and its latest winner record."""

    configs: dict[int, dict] = field(default_factory=dict)  # config_index -> config record
    winner: Optional[dict] = None  # the tuning's winner record (source "tuned")
    tuning: Optional[dict] = None  # the tuning record of that call
    pending: dict[int, dict] = field(default_factory=dict)  # config records after the last tuned winner
    latest: Optional[dict] = None  # the last winner record of any source
    waiting_for_tuning: bool = False
    earlier: list[tuple[dict, dict, Optional[dict]]] = field(default_factory=list)  # (configs, winner, tuning)

    def tunings(self) -> int:
        return len(self.earlier) + bool(self.configs or self.winner)

    def back(self, steps: int) -> Optional["_RankSite"]:
        """The view of this rank's ``steps``-th last tuning (1: the last); None when it has fewer."""
        if steps == 1:
            return self
        if steps > self.tunings():
            return None
        configs, winner, tuning = self.earlier[-(steps - 1)]
        return _RankSite(configs, winner, tuning, latest=self.latest)


def site_key(record: dict) -> SiteKey:
    return (record.get("function") or "?", record["kernel"], record["key"], record["occurrence"])


def rank_sites(data: RankLogData) -> tuple[dict[SiteKey, _RankSite], list[str]]:
    """Walk one rank's records in order and keep each site's last tuning. O(records)."""
    sites: dict[SiteKey, _RankSite] = {}
    problems: list[str] = []
    label = data.path.name
    for record in data.records:
        event = record["event"]
        if event == "config":
            state = sites.setdefault(site_key(record), _RankSite())
            if record["config_index"] in state.pending:  # a new attempt that logged no winner before
                state.pending = {}
            state.pending[record["config_index"]] = record
        elif event == "winner":
            state = sites.setdefault(site_key(record), _RankSite())
            state.latest = record
            if record["source"] == "tuned":
                if not state.pending:
                    problems.append(f"{label}: tuned winner of {_describe_key(site_key(record))} without config records")
                if state.winner is not None:
                    state.earlier.append((state.configs, state.winner, state.tuning))
                state.configs, state.winner, state.tuning = state.pending, record, None
                state.pending, state.waiting_for_tuning = {}, True
        elif event == "tuning":
            for key, state in sites.items():
                if state.waiting_for_tuning and key[0] in (record["function"], "?"):
                    state.tuning, state.waiting_for_tuning = record, False
    for key, state in sites.items():
        if state.pending and state.winner is None:
            problems.append(f"{label}: {_describe_key(key)} has config records but no winner record "
                            "(tuning failed, or the log is truncated)")
            state.configs = state.pending
        elif state.pending:
            problems.append(f"{label}: a later tuning of {_describe_key(key)} logged no winner; "
                            "the earlier tuning is reported")
    return sites, problems


# --------------------------------------------------------------------------------------------
# Merging ranks
# --------------------------------------------------------------------------------------------
def world_size_of(logs: Sequence[RankLogData]) -> int:
    """The largest world size any record shows (tuning records, per_rank_ms lengths, rank numbers)."""
    world = 0
    for data in logs:
        world = max(world, data.rank + 1)
        for record in data.records:
            if record["event"] == "tuning":
                world = max(world, record["world_size"])
            elif record["event"] == "config":
                world = max(world, len(record["per_rank_ms"]))
    return world


def _ms(value: Any, failed: bool = True) -> float:
    """A logged time: a number; ``null`` is inf when ``failed``, else nan (not timed)."""
    if value is None:
        return math.inf if failed else math.nan
    try:
        return float(value)  # logs before ``failed_ranks`` wrote "nan" for a time not taken
    except (TypeError, ValueError):
        return math.nan


def _rank_ms(record: dict, rank: int) -> float:
    """Rank ``rank``'s time in a config record (the caller checks the column exists)."""
    failed = record.get("failed_ranks")
    return _ms(record["per_rank_ms"][rank], failed=True if not isinstance(failed, list) else rank in failed)


def merge_site(number: int, key: SiteKey, per_rank: dict[int, _RankSite], world: int) -> SiteSummary:
    """One site's summary from every rank's view of one tuning of it. O(configs x ranks^2) at worst."""
    function, kernel, site_key_text, occurrence = key
    # the site's own world (a log directory may hold runs of several world sizes); else the directory's
    width = max([s.tuning["world_size"] for s in per_rank.values() if s.tuning]
                + [len(rec["per_rank_ms"]) for s in per_rank.values() for rec in s.configs.values()], default=0)
    width = max(width or world, 1 + max((r for r, s in per_rank.items() if s.configs), default=-1))
    ranks = list(range(width))
    indices = sorted({i for s in per_rank.values() for i in s.configs})
    rows = []
    for index in indices:
        holders = [(r, s.configs[index]) for r, s in sorted(per_rank.items()) if index in s.configs]
        times = []
        for rank in ranks:
            own = per_rank.get(rank)
            sources = ([own.configs[index]] if own and index in own.configs else []) + [rec for _, rec in holders]
            holder = next((rec for rec in sources if len(rec["per_rank_ms"]) > rank), None)
            times.append(_rank_ms(holder, rank) if holder is not None else math.nan)
        agreed = _ms(holders[0][1]["agreed_ms"]) if "agreed_ms" in holders[0][1] else math.nan
        failures = {r: str(rec["failure"]) for r, rec in holders if rec.get("failure")}
        rows.append(ConfigRow(index, holders[0][1]["config"], times, agreed, failures))
    with_winner = [(r, s) for r, s in sorted(per_rank.items()) if s.winner is not None]
    first = with_winner[0][1] if with_winner else None
    tuning = next((s.tuning for _, s in with_winner if s.tuning), None)
    latest = next((s.latest for _, s in sorted(per_rank.items()) if s.latest), None)
    return SiteSummary(
        number=number, function=function, kernel=kernel, key=site_key_text, occurrence=occurrence, ranks=ranks,
        configs=rows,
        winner=first.winner["config_index"] if first else None,
        tuned_at=first.winner.get("time") if first else None,
        reduce=tuning.get("reduce") if tuning else None,
        statistic=tuning.get("statistic") if tuning else None,
        wall_s={r: float(s.tuning["wall_s"]) for r, s in with_winner if s.tuning},
        function_runs=tuning["function_runs"] if tuning else None,
        sites_in_call=tuning.get("sites") if tuning else None,
        latest_source=latest["source"] if latest else None,
        latest_winner=latest["config_index"] if latest else None,
        logged_ranks=sorted(r for r, s in per_rank.items() if s.configs),
    )


def site_problems(site: SiteSummary, per_rank: dict[int, _RankSite], present: Iterable[int]) -> list[str]:
    """Ranks that disagree on the winner, logged no records for the site, or whose data is missing."""
    problems = []
    name = f"{site.name.lower()} ({_describe_key((site.function, site.kernel, site.key, site.occurrence))})"
    winners = {r: s.winner["config_index"] for r, s in per_rank.items() if s.winner is not None}
    if len(set(winners.values())) > 1:
        shown = ", ".join(f"rank {r}: config {c}" for r, c in sorted(winners.items()))
        problems.append(f"{name}: ranks logged different winners ({shown}); rank {min(winners)}'s is reported")
    stamps = {r: _parse_time(s.winner.get("time")) for r, s in per_rank.items() if s.winner is not None}
    stamps = {r: t for r, t in stamps.items() if t is not None}
    if stamps and (max(stamps.values()) - min(stamps.values())).total_seconds() > _SAME_CALL_S:
        shown = ", ".join(f"rank {r}: {t.isoformat(timespec='seconds')}" for r, t in sorted(stamps.items()))
        which = "tunings" if site.in_history else "last tunings"
        problems.append(f"{name}: the ranks' {which} are from different times ({shown}); "
                        "a rank log may lack a run")
    if site.configs and site.winner is None:
        problems.append(f"{name}: no rank logged a tuned winner")
    if site.winner is not None and site.row(site.winner) is None:
        problems.append(f"{name}: the winner config {site.winner} has no config records")
    for rank in present:
        if rank < len(site.ranks) and rank not in per_rank:
            problems.append(f"{name}: rank-{rank}.log has no records of this site "
                            "(its column comes from the other ranks' logs)")
    unknown = [r for i, r in enumerate(site.ranks) if all(math.isnan(row.per_rank_ms[i]) for row in site.configs)]
    if site.configs and unknown:
        problems.append(f"{name}: no times for rank(s) {', '.join(map(str, unknown))} in any log")
    if site.winner is not None and site.function_runs is None:
        problems.append(f"{name}: no tuning record after the winner (wall time and run count unknown)")
    return problems


def _parse_time(text: Any) -> Optional[datetime.datetime]:
    try:
        stamp = datetime.datetime.fromisoformat(str(text))
    except ValueError:
        return None
    return stamp if stamp.tzinfo else stamp.replace(tzinfo=datetime.timezone.utc)


def collect_sites(logs: Sequence[RankLogData], history: bool = False) -> tuple[list[SiteSummary], list[str]]:
    """Every site of the directory, merged over ranks, in order of first appearance. O(records).

    One summary per site, of its last tuning; with ``history``, one per tuning, oldest first.
    """
    problems: list[str] = []
    per_site: dict[SiteKey, dict[int, _RankSite]] = {}
    for data in logs:
        sites, found = rank_sites(data)
        problems += found
        for key, state in sites.items():
            per_site.setdefault(key, {})[data.rank] = state
    world = world_size_of(logs)
    present = [d.rank for d in logs if d.records]
    summaries = []
    for number, (key, per_rank) in enumerate(per_site.items(), 1):
        tunings = max(1, max(state.tunings() for state in per_rank.values()))
        for steps in range(tunings if history else 1, 0, -1):
            views = {r: view for r, state in per_rank.items() if (view := state.back(steps)) is not None}
            site = merge_site(number, key, views, world)
            site.tuning_number, site.tunings, site.in_history = tunings - steps + 1, tunings, history
            if steps > 1:  # what a later call did is told with the last tuning only
                site.latest_source = site.latest_winner = None
            problems += site_problems(site, views, present)
            summaries.append(site)
    return summaries, problems


def missing_rank_problems(found: dict[int, Path], world: int, log_dir: Path) -> list[str]:
    """Rank logs that the world size (the largest any record shows) says should exist but do not."""
    return [f"rank-{r}.log is missing from {log_dir} (the logs show a world size of {world})"
            for r in range(world) if r not in found]


# --------------------------------------------------------------------------------------------
# Markdown
# --------------------------------------------------------------------------------------------
def format_ms(value: float, failed: str = "failed") -> str:
    if math.isnan(value):
        return "n/a"
    if math.isinf(value):
        return failed
    return f"{value:.4f}"


def _clip(text: str, limit: int = 80) -> str:
    text = "".join(ch if ch.isprintable() else "?" for ch in text.replace("\n", " "))
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def _code(text: str) -> str:
    return f"`{text}`" if "`" not in text else _cell(text)


def _describe_key(key: SiteKey) -> str:
    function, kernel, site_key_text, occurrence = key
    return f"{function} / {kernel} key={site_key_text} occ={occurrence}"


def failure_text(site: SiteSummary, row: ConfigRow, present: Iterable[int]) -> str:
    """Which ranks failed a config and why (a rank's own message, or what its absence tells)."""
    present = set(present)
    parts = [f"rank {r}: {_clip(msg, 160)}" for r, msg in sorted(row.failures.items())]
    for column, rank in enumerate(site.ranks):
        if math.isinf(row.per_rank_ms[column]) and rank not in row.failures:
            why = "no message logged (pruned?)" if rank in present else "no message (no records from this rank)"
            parts.append(f"rank {rank}: inf, {why}")
    return "; ".join(parts)


def format_site_table(site: SiteSummary, present: Iterable[int]) -> str:
    """The configs x ranks table of one site, winner marked."""
    present = list(present)
    reduce = site.reduce or "?"
    header = (["#", "config"] + [f"rank {r} ms" + ("" if r in present else " (no log)") for r in site.ranks]
              + [f"agreed ms ({reduce})", "spread", "failures", "winner"])
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join(["---:", "---"] + ["---:"] * len(site.ranks) + ["---:", "---:", "---", ":---:"]) + "|"]
    for row in site.configs:
        spread = "" if math.isnan(row.spread) else f"{100 * row.spread:.1f}%"
        mark = "**winner**" if row.index == site.winner else ""
        cells = ([str(row.index), _code(row.label)] + [format_ms(t) for t in row.per_rank_ms]
                 + [format_ms(row.agreed_ms), spread, _cell(failure_text(site, row, present)), mark])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_disagreement(site: SiteSummary) -> str:
    """Per rank: the config it alone would have picked; then "k of w ranks ..." (w: ranks with a pick)."""
    picks = site.alone_picks()
    lines = []
    for rank, pick in picks.items():
        if pick is None:
            lines.append(f"- rank {rank} alone: no finite time, no pick")
            continue
        row = site.row(pick)
        column = site.ranks.index(rank)
        verdict = "same as the agreed winner" if pick == site.winner else "**differs** from the agreed winner"
        lines.append(f"- rank {rank} alone would pick config {pick} {_code(row.label)} "
                     f"({format_ms(row.per_rank_ms[column])} ms): {verdict}")
    voters = sum(pick is not None for pick in picks.values())
    k = len(site.disagreeing_ranks())
    lines.append("")
    lines.append(f"**{k} of {voters} ranks alone would have picked a different winner.**")
    return "\n".join(lines)


def format_site(site: SiteSummary, present: Iterable[int], out_dir: Path) -> str:
    """One site's section: facts, table, disagreement, plots."""
    present = list(present)
    lines = [f"## {site.name}: {_cell(site.title)}", "",
             f"- function: {_code(site.function)}",
             f"- kernel: {_code(site.kernel)}, key: {_code(site.key)}, occurrence {site.occurrence}"]
    winner = site.row(site.winner)
    if winner is not None:
        lines.append(f"- winner: config {winner.index} {_code(winner.label)}, agreed "
                     f"{format_ms(winner.agreed_ms)} ms (reduce={site.reduce or '?'}, "
                     f"statistic={site.statistic or '?'}), tuned at {site.tuned_at or '?'}")
    elif site.winner is not None:
        lines.append(f"- winner: config {site.winner} (no config records)")
    else:
        lines.append("- winner: **none logged** (see Problems)")
    if site.function_runs is not None:
        slowest = max(site.wall_s.values()) if site.wall_s else math.nan
        per_rank = ", ".join(f"rank {r} {t:.3f} s" for r, t in sorted(site.wall_s.items()))
        in_call = f", {site.sites_in_call} site(s) tuned in that call" if site.sites_in_call is not None else ""
        lines.append(f"- tuning call: {slowest:.3f} s wall (slowest rank; {per_rank}), "
                     f"{site.function_runs} function runs{in_call}")
    else:
        lines.append("- tuning call: no tuning record found (wall time and run count unknown)")
    if site.tunings > 1 and not site.in_history:
        lines.append(f"- the logs hold {site.tunings} tunings of this site; this is the last "
                     "(`disttune report --all` shows each)")
    if site.latest_source and site.latest_source != "tuned":
        same = "the same config" if site.latest_winner == site.winner else f"config {site.latest_winner}"
        origin = _SOURCES.get(site.latest_source, f"the {site.latest_source}")
        lines.append(f"- latest call: winner from {origin} ({same}); the table shows the last "
                     "tuning in the logs")
    lines.append(f"- world size {len(site.ranks)}; rank logs present: {', '.join(map(str, present)) or 'none'}")
    lines.append("")
    if not site.configs:
        lines.append("No tuning of this site in the logs (its winners came from the store or a pinned table).")
        return "\n".join(lines)
    lines += [format_site_table(site, present), "", "Disagreement (what each rank would have picked alone):", "",
              format_disagreement(site), ""]
    for plot in site.plots:
        lines.append(f"![{plot.stem}]({os.path.relpath(plot, out_dir)})")
    return "\n".join(lines)


_SOURCES = {"store": "the store", "pinned": "the pinned table", "cached": "the kernel's cache"}


def format_summary(sites: Sequence[SiteSummary]) -> str:
    lines = ["| site | function | kernel | key | occ | winner | agreed ms | ranks alone picking differently |",
             "|---:|---|---|---|---:|---|---:|---:|"]
    for site in sites:
        row = site.row(site.winner)
        winner = f"{row.index}: {_code(row.label)}" if row else ("none" if site.winner is None else str(site.winner))
        voters = sum(p is not None for p in site.alone_picks().values())
        number = f"{site.number}.{site.tuning_number}" if site.in_history else str(site.number)
        lines.append(f"| {number} | {_code(site.function)} | {_code(site.kernel)} | {_code(site.key)} | "
                     f"{site.occurrence} | {winner} | {format_ms(row.agreed_ms) if row else ''} | "
                     f"{len(site.disagreeing_ranks())} of {voters} |")
    return "\n".join(lines)


def format_problems(problems: Sequence[str]) -> str:
    if not problems:
        return "No problems found."
    return "\n".join(f"- {_cell(p)}" for p in problems)


def format_markdown(log_dir: Path, out_dir: Path, found: dict[int, Path], sites: Sequence[SiteSummary],
                    problems: Sequence[str], present: Sequence[int], history: bool = False) -> str:
    """The whole report: header, Problems, summary table, one section per site (per tuning with ``history``)."""
    scope = ("Each site shows every tuning in the logs, oldest first (site 2.1 is site 2's first tuning)."
             if history else "Each site shows its last tuning in the logs (`--all`: every tuning).")
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    parts = ["# disttune tuning report", "",
             f"Logs: `{log_dir}` ({len(found)} rank log(s): {', '.join(p.name for p in found.values())}); "
             f"{len({site.number for site in sites})} site(s); generated {stamp}.", "",
             f"{scope} Times in ms; `failed` = inf (the config failed or "
             "was pruned on that rank), `n/a` = not in any log. Spread = (max - min) / min over ranks.", "",
             "## Problems", "", format_problems(problems), ""]
    if sites:
        parts += ["## Summary", "", format_summary(sites), ""]
    else:
        parts += ["No tuning sites in the logs.", ""]
    for site in sites:
        parts += [format_site(site, present, out_dir), ""]
    return "\n".join(parts)


# --------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------
def _figure(width: float, height: float) -> Any:
    """A Figure drawn by the Agg canvas, without pyplot: no global backend switch, nothing to leak."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(figure)
    return figure


def _save(figure: Any, path: Path) -> Path:
    try:
        figure.savefig(path, format="png", bbox_inches="tight", pad_inches=0.15)
    finally:
        figure.clear()
    return path


def _config_labels(site: SiteSummary, width: int = 44) -> list[str]:
    """Tick labels ``[i] short config`` wrapped at ``width`` characters (at most 3 lines), winner marked."""
    labels = []
    for row in site.configs:
        text = f"[{row.index}] {row.label}" + ("  (winner)" if row.index == site.winner else "")
        lines = textwrap.wrap(text, width) or [""]
        if len(lines) > 3:
            lines = lines[:2] + [_clip(" ".join(lines[2:]), width)]
        labels.append("\n".join(lines))
    return labels


def _label_size(labels: Sequence[str]) -> tuple[float, int]:
    """(inches the widest label line needs at 9 pt, most lines in one label)."""
    lines = [line for label in labels for line in label.split("\n")]
    return 0.075 * max(map(len, lines), default=1), max((label.count("\n") + 1 for label in labels), default=1)


def _wrap_title(text: str, width_in: float) -> str:
    return "\n".join(textwrap.wrap(text, max(30, int(width_in * 11))))


def plot_heatmap(site: SiteSummary, path: Path) -> Path:
    """Configs x ranks heat map of each rank's time (annotated, failed cells hatched). ~0.1-0.3 s."""
    import numpy as np
    from matplotlib.patches import Rectangle

    n_configs, n_ranks = len(site.configs), len(site.ranks)
    data = np.array([row.per_rank_ms for row in site.configs], dtype=float).reshape(n_configs, n_ranks)
    labels = _config_labels(site)
    label_in, label_lines = _label_size(labels)
    width = min(40.0, 2.2 + label_in + 0.95 * n_ranks)
    height = min(40.0, 1.7 + (0.3 + 0.16 * label_lines) * n_configs)
    figure = _figure(width, height)
    axes = figure.add_subplot()
    masked = np.ma.masked_invalid(data)
    cmap = _colormap("YlOrRd")
    finite = data[np.isfinite(data)]
    low, high = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    if high <= low:
        high = low + (abs(low) or 1.0) * 1e-3
    image = axes.imshow(masked, cmap=cmap, aspect="auto", interpolation="nearest", vmin=low, vmax=high)
    colorbar = figure.colorbar(image, ax=axes, fraction=0.046 if n_ranks > 2 else 0.08, pad=0.03)
    colorbar.set_label("time (ms)")
    axes.set_xticks(range(n_ranks), [f"rank {r}" + ("" if r in site.logged_ranks else "\n(not in its log)")
                                     for r in site.ranks],
                    rotation=45 if n_ranks > 8 else 0, ha="right" if n_ranks > 8 else "center")
    axes.set_yticks(range(n_configs), labels)
    for tick, row in zip(axes.get_yticklabels(), site.configs):
        if row.index == site.winner:
            tick.set_fontweight("bold")
    annotate = n_ranks <= 32 and n_configs * n_ranks <= 800
    size = 9 if n_ranks <= 8 else 7
    for i in range(n_configs):
        for j in range(n_ranks):
            value = data[i, j]
            if math.isinf(value):
                axes.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor="#dddddd", edgecolor="#777777",
                                         hatch="//", linewidth=0))
                text, color = "failed", "black"
            elif math.isnan(value):
                axes.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, facecolor="white", edgecolor="none"))
                text, color = "n/a", "#555555"
            else:
                text = f"{value:#.4g}"
                color = "white" if (value - low) / (high - low) > 0.6 else "black"
            if annotate:
                axes.text(j, i, text, ha="center", va="center", fontsize=size, color=color)
    if site.winner is not None and site.row(site.winner) is not None:
        w = [row.index for row in site.configs].index(site.winner)
        axes.add_patch(Rectangle((-0.5, w - 0.5), n_ranks, 1, fill=False, edgecolor="#1f4e9e", linewidth=2.5))
    axes.set_xlabel("rank")
    axes.set_ylabel("config")
    axes.set_title(_wrap_title(f"{site.name}: {site.title}: each rank's time (ms)", width), fontsize=10)
    return _save(figure, path)


def plot_agreed(site: SiteSummary, path: Path) -> Path:
    """Horizontal bars of the agreed time per config, winner highlighted, failed configs hatched. ~0.1-0.3 s."""
    from matplotlib.patches import Patch

    n_configs = len(site.configs)
    labels = _config_labels(site)
    label_in, label_lines = _label_size(labels)
    width = min(30.0, 6.5 + label_in)
    height = min(40.0, 1.6 + (0.27 + 0.16 * label_lines) * n_configs)
    figure = _figure(width, height)
    axes = figure.add_subplot()
    finite = [row.agreed_ms for row in site.configs if math.isfinite(row.agreed_ms)]
    top = max(finite) if finite else 1.0
    right = top * 1.22  # room for the value labels
    for y, row in enumerate(site.configs):
        value = row.agreed_ms
        if math.isfinite(value):
            color = "#2ca02c" if row.index == site.winner else "#7f9fbf"
            axes.barh(y, value, color=color, edgecolor="black", linewidth=0.6, height=0.7)
            axes.text(value + top * 0.01, y, f"{value:#.4g} ms", va="center", ha="left", fontsize=9)
        else:  # no bar: a hatched band across the whole axis, labelled
            axes.barh(y, right, color="#f2f2f2", edgecolor="#aaaaaa", hatch="//", linewidth=0.6, height=0.7)
            if math.isinf(value):
                who = ", ".join(f"rank {r}" for r in sorted(row.failures))
                text = f"failed on {who}" if who else "failed"
            else:
                text = "no data"
            axes.text(right / 2, y, text, va="center", ha="center", fontsize=9,
                      bbox={"facecolor": "white", "edgecolor": "#aaaaaa", "boxstyle": "round,pad=0.3"})
    axes.set_yticks(range(n_configs), labels)
    for tick, row in zip(axes.get_yticklabels(), site.configs):
        if row.index == site.winner:
            tick.set_fontweight("bold")
    axes.invert_yaxis()  # config 0 on top, as in the table and the heat map
    axes.set_xlim(0, right)
    axes.set_xlabel(f"agreed time (ms, reduce={site.reduce or '?'})")
    axes.grid(axis="x", linestyle=":", alpha=0.6)
    axes.set_axisbelow(True)
    handles = [Patch(facecolor="#2ca02c", edgecolor="black", label="winner"),
               Patch(facecolor="#7f9fbf", edgecolor="black", label="other configs")]
    if any(not math.isfinite(row.agreed_ms) for row in site.configs):
        handles.append(Patch(facecolor="#f2f2f2", edgecolor="#aaaaaa", hatch="//", label="failed / no data"))
    axes.legend(handles=handles, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False, fontsize=9)
    axes.set_title(_wrap_title(f"{site.name}: {site.title}: agreed time per config", width), fontsize=10)
    return _save(figure, path)


def _colormap(name: str) -> Any:
    import matplotlib

    return matplotlib.colormaps[name].with_extremes(bad="white")


def plot_site(site: SiteSummary, out_dir: Path) -> list[Path]:
    """Both plots of one site (none when it has no config data): ``site-<n>-heatmap.png``, ``site-<n>-agreed.png``.

    In a history (``history=True``) the names carry the tuning's number: ``site-<n>-tuning-<k>-heatmap.png``.
    """
    if not site.configs:
        return []
    return [plot_heatmap(site, out_dir / f"{site.file_stem}-heatmap.png"),
            plot_agreed(site, out_dir / f"{site.file_stem}-agreed.png")]


# --------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------
def build_report(log_dir: str | os.PathLike, out_dir: Optional[str | os.PathLike] = None,
                 history: bool = False) -> Report:
    """Merge ``<log_dir>/rank-<r>.log`` into ``<out_dir>/report.md`` plus two PNGs per tuned site.

    The report covers each site's last tuning call; ``history=True`` covers every tuning call of
    every site, oldest first (two PNGs per tuning).

    ``out_dir`` defaults to ``<log_dir>/report`` (created; existing files of the same names are
    overwritten). Cost: reads every rank log twice (records, then a line scan), O(total log size) time
    and O(records) memory; renders two Agg figures per site with config data (about 0.1-0.3 s each,
    figure size growing with configs and ranks). Raises FileNotFoundError when ``log_dir`` does not
    exist or has no ``rank-<r>.log``; every other defect goes to ``Report.problems`` and the report.
    """
    log_dir = Path(log_dir)
    found = find_rank_logs(log_dir)
    out = Path(out_dir) if out_dir is not None else log_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    logs = [load_rank_log(rank, path) for rank, path in found.items()]
    problems = [p for data in logs for p in data.problems]
    world = world_size_of(logs)
    problems += missing_rank_problems(found, world, log_dir)
    sites, site_found = collect_sites(logs, history)
    problems += site_found
    present = [d.rank for d in logs if d.records]
    plots: list[Path] = []
    for site in sites:
        try:
            site.plots = plot_site(site, out)
        except Exception as err:  # a plot must not cost the report
            problems.append(f"{site.name.lower()}: plots failed: {type(err).__name__}: {err}")
        plots += site.plots
    markdown = out / REPORT_NAME
    markdown.write_text(format_markdown(log_dir, out, found, sites, problems, present, history), encoding="utf-8")
    return Report(markdown, plots, sites, problems)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m disttune.report", description=__doc__.splitlines()[0])
    parser.add_argument("log_dir", nargs="?", default=None, help="the tuner's log_dir (default: ./logs)")
    parser.add_argument("out_dir", nargs="?", default=None, help="where to write (default: LOG_DIR/report)")
    parser.add_argument("--all", action="store_true", help="every tuning call of each site, not only the last")
    options = parser.parse_args(argv)
    from .logs import resolve_log_dir

    try:
        report = build_report(resolve_log_dir(options.log_dir), options.out_dir, history=options.all)
    except OSError as err:  # FileNotFoundError: no rank logs there
        print(f"disttune report: {err}", file=sys.stderr)
        return 1
    print(f"report: {report.markdown_path} ({len(report.sites)} site(s), {len(report.plots)} plot(s), "
          f"{len(report.problems)} problem(s))")
    for problem in report.problems:
        print(f"  problem: {problem}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
