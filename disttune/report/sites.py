"""Merge the ranks' records into site summaries: one :class:`SiteSummary` per tuning site, a row per config.

    sites, problems = collect_sites(logs)                # logs: disttune.report.logs.load_rank_log per rank
    sites, problems = collect_sites(logs, history=True)  # every tuning of each site, oldest first

A site is (function, kernel, key, occurrence). In each rank's file, a tuning of a site is the ``config``
records that precede one of its ``winner`` records with source ``tuned``; the n-th last tuning of a rank
is matched with the n-th last of the others. Rank ``r``'s column comes from rank ``r``'s own file when it
has the record (every rank's ``per_rank_ms``, or its own ``rank_ms`` in a job of many ranks), else from the
``per_rank_ms`` that another rank logged. Column ``r`` is
taken to be global rank ``r``: logs of a tuner that agreed over a subgroup (``group=``) index
``per_rank_ms`` by group rank.

What does not add up (ranks that disagree on a winner or tuned at different times, a winner without
config records, a rank without times) is returned as problem lines, never raised.

Cost: one pass over every rank's records, then O(configs x ranks^2) per site at worst; no I/O.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from .logs import RankLogData
from ..configs import describe_config

_SAME_CALL_S = 300.0  # ranks' winner records of one tuning call are logged within this (clock skew included)


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
    #: with a measured objective: the agreed measurements beside the time ({name: value or None}), the
    #: config's score and whether it is on the Pareto front; empty / None / False otherwise
    measures: dict = field(default_factory=dict)
    score: Optional[float] = None
    on_front: bool = False
    samples_ms: list[float] = field(default_factory=list)  # every rank's timed samples of this tuning

    @property
    def sample_band(self) -> Optional[tuple[float, float, float]]:
        """(20th percentile, median, 80th percentile) of the samples of every rank; None without two samples."""
        finite = sorted(t for t in self.samples_ms if math.isfinite(t))
        if len(finite) < 2:
            return None
        import numpy as np

        low, middle, high = np.percentile(finite, [20, 50, 80])
        return float(low), float(middle), float(high)

    @property
    def label(self) -> str:
        """The config's one label (:func:`disttune.describe_config`), as the demo and ``show`` print it."""
        return describe_config(self.config)

    @property
    def rank_spread(self) -> float:
        """The *rank spread*: (max - min) / min over the ranks' times, ``nan`` unless every known rank time is
        finite and > 0. (A rank's own *noise* is the spread of its samples, :mod:`disttune.diagnostics`.)"""
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
    latest_config: Optional[str] = None  # that record's config text
    #: the tuning record of the call that logged the last winner when it was not tuned (a store hit)
    latest_call: Optional[dict] = None
    logged_ranks: list[int] = field(default_factory=list)  # ranks whose own log has this tuning
    plots: list[Path] = field(default_factory=list)
    tuning_number: int = 1  # which tuning of the site this is, oldest first
    tunings: int = 1  # how many tunings of the site the logs hold
    in_history: bool = False  # one of several tunings shown (``history=True``): named with its number
    diagnostics: Any = None  # disttune.diagnostics.SiteDiagnostics, set by diagnostics.attach

    key_text: str = ""  # the key with its argument names, where the logs give it
    run: Optional[str] = None  # the job's run the tuning belongs to (disttune.env.run_id)

    @property
    def decided_elsewhere(self) -> bool:
        """Whether the latest call took this site's winner from the store, a pinned table or the kernel's cache."""
        return self.latest_source not in (None, "tuned")

    @property
    def key_label(self) -> str:
        """The key as people read it: ``M=48 N=32 K=64 dtype=float16`` where the logs name it, else its repr."""
        return self.key_text or self.key

    @property
    def title(self) -> str:
        """``kernel M=48 N=32 dtype=float16``, with the occurrence when the key launches more than once."""
        return f"{self.kernel} {self.key_label}" + (f" (occurrence {self.occurrence})" if self.occurrence else "")

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


# --------------------------------------------------------------------------------------------
# One rank's view of each site
# --------------------------------------------------------------------------------------------
SiteKey = tuple  # (function, kernel, key, occurrence)


@dataclass
class RankSite:
    """One rank's view of one site: a tuning of it (by default its last), and its latest winner record."""

    configs: dict[int, dict] = field(default_factory=dict)  # config_index -> config record
    winner: Optional[dict] = None  # the tuning's winner record (source "tuned")
    tuning: Optional[dict] = None  # the tuning record of that call
    pending: dict[int, dict] = field(default_factory=dict)  # config records after the last tuned winner
    latest: Optional[dict] = None  # the last winner record of any source
    latest_call: Optional[dict] = None  # the tuning record after ``latest`` when it was not tuned
    waiting_for_tuning: bool = False
    waiting_for_call: bool = False
    earlier: list[tuple[dict, dict, Optional[dict]]] = field(default_factory=list)  # (configs, winner, tuning)
    pending_samples: dict[int, list[float]] = field(default_factory=dict)  # measure records not yet in a config
    samples_closed: bool = False  # the pending samples went to config records: the next sample starts anew

    def tunings(self) -> int:
        return len(self.earlier) + bool(self.configs or self.winner)

    def back(self, steps: int) -> Optional["RankSite"]:
        """The view of this rank's ``steps``-th last tuning (1: the last); None when it has fewer."""
        if steps == 1:
            return self
        if steps > self.tunings():
            return None
        configs, winner, tuning = self.earlier[-(steps - 1)]
        return RankSite(configs, winner, tuning, latest=self.latest, latest_call=self.latest_call)


def site_key(record: dict) -> SiteKey:
    return (record.get("function") or "?", record["kernel"], record["key"], record["occurrence"])


def _describe_key(key: SiteKey) -> str:
    function, kernel, site_key_text, occurrence = key
    return f"{function} / {kernel} key={site_key_text} occurrence={occurrence}"



def rank_sites(data: RankLogData) -> tuple[dict[SiteKey, RankSite], list[str]]:
    """Walk one rank's records in order and keep each site's last tuning. O(records)."""
    sites: dict[SiteKey, RankSite] = {}
    problems: list[str] = []
    label = data.path.name
    for record in data.records:
        event = record["event"]
        if event == "measure":
            state = sites.setdefault((record.get("function") or "?", record["kernel"], record["key"], None), RankSite())
            if state.samples_closed:  # the first sample of a new tuning
                state.pending_samples, state.samples_closed = {}, False
            if isinstance(record["ms"], (int, float)):
                state.pending_samples.setdefault(record["config_index"], []).append(float(record["ms"]))
        elif event == "config":
            state = sites.setdefault(site_key(record), RankSite())
            if record["config_index"] in state.pending:  # a new attempt that logged no winner before
                state.pending = {}
            samples = sites.get((record.get("function") or "?", record["kernel"], record["key"], None))
            if samples is not None:
                record = {**record, "samples": samples.pending_samples.get(record["config_index"], [])}
                samples.samples_closed = True
            state.pending[record["config_index"]] = record
        elif event == "winner":
            state = sites.setdefault(site_key(record), RankSite())
            state.latest = record
            state.latest_call, state.waiting_for_call = None, record["source"] != "tuned"
            if record["source"] == "tuned":
                if not state.pending:
                    problems.append(f"{label}: tuned winner of {_describe_key(site_key(record))} without config records")
                if state.winner is not None:
                    state.earlier.append((state.configs, state.winner, state.tuning))
                state.configs, state.winner, state.tuning = state.pending, record, None
                state.pending, state.waiting_for_tuning = {}, True
        elif event == "tuning":
            for key, state in sites.items():
                if key[0] not in (record["function"], "?"):
                    continue
                if state.waiting_for_tuning:
                    state.tuning, state.waiting_for_tuning = record, False
                if state.waiting_for_call:
                    state.latest_call, state.waiting_for_call = record, False
    sites = {key: state for key, state in sites.items() if key[3] is not None}  # the samples went to their configs
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
                world = max(world, len(record.get("per_rank_ms") or ()))
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
    """Rank ``rank``'s time in a config record (the caller checks the column exists: :func:`_holds`)."""
    failed = record.get("failed_ranks")
    value = record["per_rank_ms"][rank] if "per_rank_ms" in record else record.get("rank_ms")
    return _ms(value, failed=True if not isinstance(failed, list) else rank in failed)


def _holds(record: dict, rank: int, own: bool) -> bool:
    """Whether a config record has rank ``rank``'s time: every rank's (``per_rank_ms``), or the logging rank's own
    (``rank_ms``, a record of many ranks) where ``own``."""
    return len(record.get("per_rank_ms") or ()) > rank or (own and "rank_ms" in record)


def merge_site(number: int, key: SiteKey, per_rank: dict[int, RankSite], world: int) -> SiteSummary:
    """One site's summary from every rank's view of one tuning of it. O(configs x ranks^2) at worst."""
    function, kernel, site_key_text, occurrence = key
    # the site's own world (a log directory may hold runs of several world sizes); else the directory's
    width = max([s.tuning["world_size"] for s in per_rank.values() if s.tuning]
                + [len(rec.get("per_rank_ms") or ()) for s in per_rank.values() for rec in s.configs.values()],
                default=0)
    width = max(width or world, 1 + max((r for r, s in per_rank.items() if s.configs), default=-1))
    ranks = list(range(width))
    indices = sorted({i for s in per_rank.values() for i in s.configs})
    rows = []
    for index in indices:
        holders = [(r, s.configs[index]) for r, s in sorted(per_rank.items()) if index in s.configs]
        times = []
        for rank in ranks:
            own = per_rank.get(rank)
            mine = [own.configs[index]] if own and index in own.configs else []
            holder = next((rec for rec in mine if _holds(rec, rank, own=True)), None) or \
                next((rec for _, rec in holders if _holds(rec, rank, own=False)), None)
            times.append(_rank_ms(holder, rank) if holder is not None else math.nan)
        first = holders[0][1]
        # null without a failed rank: no rank timed it (a config the model search did not propose)
        not_timed = isinstance(first.get("failed_ranks"), list) and not first["failed_ranks"]
        agreed = _ms(first["agreed_ms"], failed=not not_timed) if "agreed_ms" in first else math.nan
        failures = {r: str(rec["failure"]) for r, rec in holders if rec.get("failure")}
        measures = first.get("measures") if isinstance(first.get("measures"), dict) else {}
        score = _ms(first["score"]) if measures and "score" in first else None
        samples = [float(t) for _, rec in holders for t in rec.get("samples", [])]
        rows.append(ConfigRow(index, first["config"], times, agreed, failures, measures, score,
                              bool(first.get("on_front")), samples))
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
        latest_config=latest["config"] if latest else None,
        latest_call=next((s.latest_call for _, s in sorted(per_rank.items()) if s.latest_call), None),
        logged_ranks=sorted(r for r, s in per_rank.items() if s.configs),
        key_text=next((str(rec["key_text"]) for s in per_rank.values() for rec in [s.winner or s.latest or {}]
                       if rec.get("key_text")), ""),
        run=next((rec.get("run") for s in per_rank.values() for rec in [s.winner or s.latest or {}] if rec.get("run")),
                 None),
    )


def site_problems(site: SiteSummary, per_rank: dict[int, RankSite], present: Iterable[int]) -> list[str]:
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


def runs_of(logs: Sequence[RankLogData]) -> list[str]:
    """The runs the logs hold (``run`` fields, :func:`disttune.env.run_id`), oldest first; ``""`` stands for
    records that name no run (logs of an older version)."""
    return sorted({str(r.get("run") or "") for data in logs for r in data.records})


def of_run(logs: Sequence[RankLogData], run: str) -> list[RankLogData]:
    """``logs`` with only the records of ``run``."""
    return [RankLogData(d.rank, d.path, [r for r in d.records if str(r.get("run") or "") == run], d.problems)
            for d in logs]


def collect_sites(logs: Sequence[RankLogData], history: bool = False) -> tuple[list[SiteSummary], list[str]]:
    """Every site of the directory, merged over ranks, in order of first appearance. O(records).

    One summary per site, of its last tuning; with ``history``, one per tuning, oldest first.
    """
    problems: list[str] = []
    per_site: dict[SiteKey, dict[int, RankSite]] = {}
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
                site.latest_source = site.latest_winner = site.latest_config = site.latest_call = None
            problems += site_problems(site, views, present)
            summaries.append(site)
    return summaries, problems


def missing_rank_problems(found: dict[int, Path], world: int, log_dir: Path) -> list[str]:
    """Rank logs that the world size (the largest any record shows) says should exist but do not."""
    return [f"rank-{r}.log is missing from {log_dir} (the logs show a world size of {world})"
            for r in range(world) if r not in found]

