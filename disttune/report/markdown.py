"""Render merged site summaries as the report's Markdown: header, Problems, summary table, one section per site.

    text = format_markdown(log_dir, out_dir, found, sites, problems, present)

Each site's section lists its facts (function, kernel, key, winner, the tuning call's wall time), the
configs x ranks table with the agreed time, spread and failures, what each rank alone would have
picked, and links to its plots. Text from the logs is escaped for table cells and code spans.

Cost: string building only, O(configs x ranks) per site; no I/O.
"""

from __future__ import annotations

import datetime
import math
import os
from pathlib import Path
from typing import Iterable, Optional, Sequence

from ..configs import describe_config
from .diagnostics import format_diagnostics
from .logs import clip
from .sites import ConfigRow, SiteSummary

# where a site's latest winner came from when it was not tuned in that call
_SOURCES = {"store": "the store", "pinned": "the pinned table", "cached": "the kernel's cache"}


def format_ms(value: float, failed: str = "failed") -> str:
    if math.isnan(value):
        return "n/a"
    if math.isinf(value):
        return failed
    return f"{value:.4f}"


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def _code(text: str) -> str:
    return f"`{text}`" if "`" not in text else _cell(text)


def failure_text(site: SiteSummary, row: ConfigRow, present: Iterable[int]) -> str:
    """Which ranks failed a config and why (a rank's own message, or what its absence tells)."""
    present = set(present)
    parts = [f"rank {r}: {clip(msg, 160)}" for r, msg in sorted(row.failures.items())]
    for column, rank in enumerate(site.ranks):
        if math.isinf(row.per_rank_ms[column]) and rank not in row.failures:
            why = "no message logged (pruned?)" if rank in present else "no message (no records from this rank)"
            parts.append(f"rank {rank}: inf, {why}")
    return "; ".join(parts)


#: the measurements a measured objective logs beside the time, as the report's columns name them
_MEASURE_COLUMNS = {"peak_memory_mb": "peak memory MB", "energy_mj": "energy mJ"}


def format_measure(value: object) -> str:
    return "n/a" if value is None else f"{float(value):.4g}"  # type: ignore[arg-type]


def format_site_table(site: SiteSummary, present: Iterable[int]) -> str:
    """The configs x ranks table of one site, winner marked; with a measured objective, the agreed
    measurements and the score beside the agreed time."""
    present = list(present)
    reduce = site.reduce or "?"
    measured = any(row.measures for row in site.configs)
    extra = [f"agreed {label} ({reduce})" for label in _MEASURE_COLUMNS.values()] + ["score"] if measured else []
    header = (["#", "config"] + [f"rank {r} ms" + ("" if r in present else " (no log)") for r in site.ranks]
              + [f"agreed ms ({reduce})"] + extra + ["samples ms (20th-80th %)", "rank spread", "failures", "winner"])
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join(["---:", "---"] + ["---:"] * len(site.ranks) + ["---:"] * (1 + len(extra))
                            + ["---:", "---:", "---", ":---:"]) + "|"]
    for row in site.configs:
        spread = "" if math.isnan(row.rank_spread) else f"{100 * row.rank_spread:.1f}%"
        band = row.sample_band
        samples = "" if band is None else f"{band[0]:#.4g}-{band[2]:#.4g}"
        mark = "**winner**" if row.index == site.winner else ""
        measures = ([format_measure(row.measures.get(name)) for name in _MEASURE_COLUMNS]
                    + [format_ms(row.score if row.score is not None else math.nan, failed="out")] if measured else [])
        cells = ([str(row.index), _code(row.label)] + [format_ms(t) for t in row.per_rank_ms]
                 + [format_ms(row.agreed_ms)] + measures
                 + [samples, spread, _cell(failure_text(site, row, present)), mark])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_front(site: SiteSummary) -> str:
    """The Pareto front of a site tuned with ``objective=pareto(...)``: its configs and agreed measurements
    (empty when no config is on a front)."""
    front = [row for row in site.configs if row.on_front]
    if not front:
        return ""
    lines = ["Pareto front (agreed measurements; no other config is as good in every one and better in one):", ""]
    for row in front:
        measures = ", ".join(f"{label} {format_measure(row.measures.get(name))}"
                             for name, label in _MEASURE_COLUMNS.items())
        mark = " (**picked**)" if row.index == site.winner else ""
        lines.append(f"- config {row.index} {_code(row.label)}: {format_ms(row.agreed_ms)} ms, {measures}{mark}")
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
             f"- kernel: {_code(site.kernel)}, key: {_code(site.key_label)}, occurrence {site.occurrence}"]
    winner = site.row(site.winner)
    if winner is not None:
        lines.append(f"- winner: config {winner.index} {_code(winner.label)}, agreed "
                     f"{format_ms(winner.agreed_ms)} ms (reduce={site.reduce or '?'}, "
                     f"statistic={site.statistic or '?'}), tuned at {site.tuned_at or '?'}")
    elif site.winner is not None:
        lines.append(f"- winner: config {site.winner} (no config records)")
    elif not site.configs and site.decided_elsewhere:
        lines.append(f"- winner: config {site.latest_winner} {_code(describe_config(site.latest_config or ''))}, "
                     f"from {_origin(site)}: not tuned in this run")
    else:
        lines.append("- winner: **none logged** (see Problems)")
    if site.function_runs is not None:
        slowest = max(site.wall_s.values()) if site.wall_s else math.nan
        per_rank = ", ".join(f"rank {r} {t:.3f} s" for r, t in sorted(site.wall_s.items()))
        in_call = f", {site.sites_in_call} site(s) tuned in that call" if site.sites_in_call is not None else ""
        lines.append(f"- tuning call: {slowest:.3f} s wall (slowest rank; {per_rank}), "
                     f"{site.function_runs} function runs{in_call}")
    elif site.decided_elsewhere and site.latest_call is not None:
        call = site.latest_call
        lines.append(f"- call: {float(call['wall_s']):.3f} s wall, {call['function_runs']} function runs, "
                     f"nothing tuned (the winner came from {_origin(site)})")
    elif not site.decided_elsewhere:
        lines.append("- tuning call: no tuning record found (wall time and run count unknown)")
    if site.tunings > 1 and not site.in_history:
        lines.append(f"- the logs hold {site.tunings} tunings of this site; this is the last "
                     "(`disttune report --all` shows each)")
    if site.decided_elsewhere and site.configs:
        same = "the same config" if site.latest_winner == site.winner else f"config {site.latest_winner}"
        lines.append(f"- latest call: winner from {_origin(site)} ({same}); the table shows the last "
                     "tuning in the logs")
    lines.append(f"- world size {len(site.ranks)}; rank logs present: {', '.join(map(str, present)) or 'none'}")
    lines.append("")
    if not site.configs:
        lines.append(f"No tuning of this site in this run: its winner came from {_origin(site)} "
                     "(`disttune report --all-runs` shows the run that tuned it, where this folder holds it)."
                     if site.decided_elsewhere else "No tuning of this site in the logs.")
        return "\n".join(lines)
    lines += [format_site_table(site, present), ""]
    front = format_front(site)
    if front:
        lines += [front, ""]
    by_time = ", by time" if any(row.measures for row in site.configs) else ""
    lines += [f"Disagreement (what each rank would have picked alone{by_time}):", "", format_disagreement(site), ""]
    diagnostics = format_diagnostics(site)
    if diagnostics:
        lines += [diagnostics, ""]
    for plot in site.plots:
        lines.append(f"![{plot.stem}]({os.path.relpath(plot, out_dir)})")
    return "\n".join(lines)


def _origin(site: SiteSummary) -> str:
    """Where the site's latest winner came from when it was not tuned: ``the store``, ``the pinned table``."""
    return _SOURCES.get(site.latest_source or "", f"the {site.latest_source}")


def format_summary(sites: Sequence[SiteSummary]) -> str:
    lines = ["| site | function | kernel | key | occurrence | winner | agreed ms | ranks alone picking differently |",
             "|---:|---|---|---|---:|---|---:|---:|"]
    for site in sites:
        row = site.row(site.winner)
        voters = sum(p is not None for p in site.alone_picks().values())
        alone = f"{len(site.disagreeing_ranks())} of {voters}"
        if row:
            winner = f"{row.index}: {_code(row.label)}"
        elif site.winner is None and not site.configs and site.decided_elsewhere:
            winner = f"{site.latest_winner}: {_code(describe_config(site.latest_config or ''))} ({_origin(site)})"
            alone = "not tuned"
        else:
            winner = "none" if site.winner is None else str(site.winner)
        number = f"{site.number}.{site.tuning_number}" if site.in_history else str(site.number)
        lines.append(f"| {number} | {_code(site.function)} | {_code(site.kernel)} | {_code(site.key_label)} | "
                     f"{site.occurrence} | {winner} | {format_ms(row.agreed_ms) if row else ''} | {alone} |")
    return "\n".join(lines)


def format_problems(problems: Sequence[str]) -> str:
    if not problems:
        return "No problems found."
    return "\n".join(f"- {_cell(p)}" for p in problems)


def format_fallbacks(fallbacks: Sequence[dict]) -> str:
    """One row per key served by a fallback after tuning (``on_new_key``): which ranks, which config, from where."""
    by_site: dict[tuple, dict] = {}
    for record in fallbacks:
        row = by_site.setdefault((record["kernel"], record["key"], record["occurrence"], record["config"],
                                  record["source"]), {"ranks": set()})
        row["ranks"].add(record.get("rank"))
    lines = ["| kernel | key | occurrence | ran | served by | ranks |", "| --- | --- | --- | --- | --- | --- |"]
    for (kernel, key, occurrence, config, source), row in sorted(by_site.items()):
        ranks = ", ".join(str(r) for r in sorted(row["ranks"], key=str))
        lines.append(f"| {_cell(kernel)} | {_code(key)} | {occurrence} | {_cell(describe_config(config))} | "
                     f"{_cell(source)} | {ranks} |")
    return "\n".join(lines)


def describe_run(run: Optional[str]) -> str:
    """A run as people read it: ``the run started 2026-11-26T12:00:00Z (pid 4242)``."""
    if not run:
        return "records that name no run (logged by an older version)"
    start, _, pid = str(run).rpartition("-")
    return f"the run started {start} (pid {pid})" if start and pid.isdigit() else f"run {run}"


def format_markdown(log_dir: Path, out_dir: Path, found: dict[int, Path], sites: Sequence[SiteSummary],
                    problems: Sequence[str], present: Sequence[int], history: bool = False,
                    fallbacks: Sequence[dict] = (), runs: Sequence[str] = (), all_runs: bool = False) -> str:
    """The whole report: header, Problems, summary table, one section per site (per tuning with ``history``),
    grouped by run with ``all_runs``."""
    scope = ("Each site shows every tuning in the logs, oldest first (site 2.1 is site 2's first tuning)."
             if history else "Each site shows its last tuning in the logs (`--all`: every tuning).")
    if all_runs:
        scope += f" Every run in the folder ({len(runs)}), oldest first."
    elif runs:
        others = f"; the folder holds {len(runs)} runs (`--all-runs`: every run)" if len(runs) > 1 else ""
        scope += f" It covers {describe_run(runs[-1])}{others}."
    stamp = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    parts = ["# disttune tuning report", "",
             f"Logs: `{log_dir}` ({len(found)} rank log(s): {', '.join(p.name for p in found.values())}); "
             f"{len({site.number for site in sites})} site(s); generated {stamp}.", "",
             f"{scope} Times in ms; `failed` = inf (the config failed or "
             "was pruned on that rank), `n/a` = not in any log. *Rank spread* = (max - min) / min of the ranks' "
             "times; *noise* = (max - min) / median of one rank's samples (the worst rank's); *samples* = the 20th "
             "to 80th percentile of every rank's timed samples.", "",
             "## Problems", "", format_problems(problems), ""]
    if sites:
        parts += ["## Summary", "", format_summary(sites), ""]
    else:
        parts += ["No tuning sites in the logs." if not runs or all_runs else "No tuning sites in this run.", ""]
    if fallbacks:
        parts += ["## Keys served by a fallback", "",
                  "Keys met after tuning that no tuning covered (`on_new_key`): each ran, with no collective, on "
                  "the config shown, the same on every rank that met it.", "", format_fallbacks(fallbacks), ""]
    run = None
    for site in sites:
        if all_runs and site.run != run:
            run = site.run
            heading = describe_run(run)
            parts += [f"# {heading[0].upper()}{heading[1:]}", ""]
        parts += [format_site(site, present, out_dir), ""]
    return "\n".join(parts)

