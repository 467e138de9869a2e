"""Merge the per-rank tuning logs of one log directory into a Markdown report with plots.

    report = build_report("logs")            # writes logs/report/report.md and site-<n>-*.png
    python -m disttune.report logs [OUT_DIR] [--all] [--all-runs]

Each rank appends ``<log_dir>/rank-<r>.log`` (see :mod:`disttune.logs`). For every tuning site
(function, kernel, key, occurrence) the report shows the *last* tuning call found in the logs
(``history=True``, ``disttune report --all``: every tuning call, oldest first), of the latest run (job)
that logged into the folder (``all_runs=True``, ``--all-runs``: every run, each in its own section).

This module runs the steps and writes the files; each step has a module of its own:
:mod:`disttune.report.logs` reads the rank logs, :mod:`disttune.report.sites` merges them into
site summaries, :mod:`disttune.report.diagnostics` explains each site's winner,
:mod:`disttune.report.markdown` renders the text and :mod:`disttune.report.plots` draws the figures.
:mod:`disttune.report.verify` is ``disttune verify``, which reads the same logs.

Nothing in a damaged log directory raises (except a directory without any ``rank-<r>.log``): missing
rank logs, empty files, lines that are neither a readable log line nor parsable JSON, records
lacking fields and ranks that disagree on a winner are listed in :attr:`Report.problems` and in
the report's "Problems" section, first of all a tuning call of the run that ended in an error (with it).
A site whose winner came from the store or a pinned table is shown with that winner, said to come from there.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

from ..logs import resolve_log_dir
from .diagnostics import attach as attach_diagnostics
from .logs import RankLogData, clip, find_rank_logs, load_rank_log
from .markdown import format_markdown
from .plots import agreed_figure, heatmap_figure
from .sites import (ConfigRow, SiteSummary, collect_sites, missing_rank_problems, of_run, runs_of,
                           world_size_of)

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["REPORT_NAME", "ConfigRow", "Report", "SiteSummary", "build_report", "main", "plot_site"]

REPORT_NAME = "report.md"


@dataclass
class Report:
    """What :func:`build_report` wrote and found: the Markdown file, the PNGs, the sites and the problems."""

    markdown_path: Path
    plots: list[Path]
    sites: list[SiteSummary]
    problems: list[str]


def _save(figure: Figure, path: Path) -> Path:
    """Render ``figure`` to a PNG at ``path`` (where the drawing cost is paid), then free what it holds."""
    try:
        figure.savefig(path, format="png", bbox_inches="tight", pad_inches=0.15)
    finally:
        figure.clear()
    return path


def plot_site(site: SiteSummary, out_dir: Path) -> list[Path]:
    """Both plots of one site (none when it has no config data): ``site-<n>-heatmap.png``, ``site-<n>-agreed.png``.

    In a history (``history=True``) the names carry the tuning's number: ``site-<n>-tuning-<k>-heatmap.png``.
    Cost: about 0.1-0.3 s a plot, growing with configs and ranks.
    """
    if not site.configs:
        return []
    return [_save(heatmap_figure(site), out_dir / f"{site.file_stem}-heatmap.png"),
            _save(agreed_figure(site), out_dir / f"{site.file_stem}-agreed.png")]


_PLOT_NAME = re.compile(r"^site-\d+(-tuning-\d+)?-(heatmap|agreed)\.png$")


def remove_stale_plots(out_dir: Path, kept: Sequence[Path]) -> None:
    """Remove the plots an earlier report left in ``out_dir`` that this one did not draw (its sites are gone or
    fewer), so every figure beside the report is of the run it describes. Only names the report gives its plots
    are touched; a link is removed, never followed."""
    names = {path.name for path in kept}
    for entry in out_dir.iterdir():
        if _PLOT_NAME.match(entry.name) and entry.name not in names:
            entry.unlink(missing_ok=True)


def failed_calls(logs: Sequence[RankLogData], runs: set[str]) -> list[str]:
    """A problem line per tuning call of ``runs`` that ended in an error: the function, the ranks that logged
    it and the error, the same text on every rank grouped in one line."""
    by_error: dict[tuple[str, str], list[int]] = {}
    for data in logs:
        for record in data.records:
            if record["event"] == "error" and str(record.get("run") or "") in runs:
                by_error.setdefault((record["function"], record["text"]), []).append(data.rank)
    lines = []
    for (function, text), ranks in by_error.items():
        where = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, sorted(set(ranks))))
        lines.append(f"the tuning call of {function} failed ({where}): {clip(text, 600)}")
    return lines


def build_report(log_dir: str | os.PathLike, out_dir: Optional[str | os.PathLike] = None,
                 history: bool = False, all_runs: bool = False) -> Report:
    """Merge ``<log_dir>/rank-<r>.log`` into ``<out_dir>/report.md`` plus two PNGs per tuned site.

    Each job that logged into the folder is a *run* (its records share rank 0's start and pid); the
    report covers the latest run, ``all_runs=True`` every run, each in a section of its own, oldest
    first. Within a run it covers each site's last tuning call; ``history=True`` covers every tuning
    call of every site, oldest first (two PNGs per tuning).

    ``out_dir`` defaults to ``<log_dir>/report`` (created; existing files of the same names are
    overwritten, and plots of an earlier report that this one does not draw are removed). Cost: reads every rank log three times (records, line scan, UTF-8 check),
    O(total log size) time and O(records) memory; renders two Agg figures per site with config data
    (about 0.1-0.3 s each, figure size growing with configs and ranks). Raises FileNotFoundError when
    ``log_dir`` does not exist or has no ``rank-<r>.log``; every other defect goes to
    ``Report.problems`` and the report.
    """
    log_dir = Path(log_dir)
    found = find_rank_logs(log_dir)
    out = Path(out_dir) if out_dir is not None else log_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    logs = [load_rank_log(rank, path) for rank, path in found.items()]
    problems = [p for data in logs for p in data.problems]
    world = world_size_of(logs)
    problems += missing_rank_problems(found, world, log_dir)
    runs = runs_of(logs)
    sites: list[SiteSummary] = []
    for run in (runs if all_runs else runs[-1:]):
        found_here, site_found = collect_sites(of_run(logs, run), history)
        for site in found_here:
            site.number += max((s.number for s in sites), default=0)
            site.run = run
        sites += found_here
        problems += site_found
    attach_diagnostics(sites, logs)
    present = [d.rank for d in logs if d.records]
    plots: list[Path] = []
    for site in sites:
        try:
            site.plots = plot_site(site, out)
        except Exception as err:  # a plot must not cost the report
            problems.append(f"{site.name.lower()}: plots failed: {type(err).__name__}: {err}")
        plots += site.plots
    remove_stale_plots(out, plots)
    markdown = out / REPORT_NAME
    shown = set(runs if all_runs else runs[-1:])
    fallbacks = [r for data in logs for r in data.records
                 if r["event"] == "fallback" and str(r.get("run") or "") in shown]
    problems = failed_calls(logs, shown) + problems
    markdown.write_text(format_markdown(log_dir, out, found, sites, problems, present, history, fallbacks,
                                        runs, all_runs), encoding="utf-8")
    return Report(markdown, plots, sites, problems)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m disttune.report", description=__doc__.splitlines()[0])
    parser.add_argument("log_dir", nargs="?", default=None, help="the tuner's log_dir (default: ./logs)")
    parser.add_argument("out_dir", nargs="?", default=None, help="where to write (default: LOG_DIR/report)")
    parser.add_argument("--all", action="store_true", help="every tuning call of each site, not only the last")
    parser.add_argument("--all-runs", action="store_true", help="every run (job) in the folder, not only the latest")
    options = parser.parse_args(argv)
    try:
        report = build_report(resolve_log_dir(options.log_dir), options.out_dir, history=options.all,
                              all_runs=options.all_runs)
    except OSError as err:  # FileNotFoundError: no rank logs there
        print(f"disttune report: {err}", file=sys.stderr)
        return 1
    print(f"report: {report.markdown_path} ({len(report.sites)} site(s), {len(report.plots)} plot(s), "
          f"{len(report.problems)} problem(s))")
    for problem in report.problems:
        print(f"  problem: {problem}")
    return 0
