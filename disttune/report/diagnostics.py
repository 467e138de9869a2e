"""The report's half of the diagnostics (:mod:`disttune.diagnostics` logs them at tuning time): the ranks'
``diagnostics`` records merged per site, the noise, the winner's margin and one line per loser.

The noise of a config is its relative sample spread, ``(max - min) / median`` of one rank's timed
samples, on the worst rank; the margin is ``(runner-up - winner) / winner`` of the agreed times. A
winner is *not distinguishable* when the margin is no larger than the noise of either of the two.
Cost: a pass over the records.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from ..diagnostics import margin_over_runner_up

@dataclass
class ConfigFacts:
    """One config's diagnostics merged over ranks: compiler facts (the lowest rank's) and the worst noise."""

    n_regs: Optional[int] = None
    n_spills: Optional[int] = None
    shared_bytes: Optional[int] = None
    blocks_per_sm: Optional[int] = None
    occupancy_limit: Optional[str] = None
    sample_spread: Optional[float] = None  # the worst rank's
    samples: int = 0

    @property
    def known(self) -> bool:
        return self.n_regs is not None


@dataclass
class SiteDiagnostics:
    """What the report says about one site beyond its times."""

    configs: dict[int, ConfigFacts] = field(default_factory=dict)
    device: Optional[str] = None


def attach(sites: Sequence[Any], logs: Sequence[Any]) -> None:
    """Set ``site.diagnostics`` of each report site (its last tuning) from the ranks' ``diagnostics`` records."""
    merged: dict[tuple, SiteDiagnostics] = {}
    for data in sorted(logs, key=lambda d: d.rank):
        pending: dict[tuple, dict] = {}  # config records since the site's last site record
        done: dict[tuple, tuple] = {}  # the site's last complete tuning: (site record, config records)
        for record in data.records:
            if record.get("event") != "diagnostics":
                continue
            key = (record.get("function") or "?", record["kernel"], record["key"], record["occurrence"])
            if record.get("scope") == "site":
                done[key] = (record, pending.pop(key, {}))
            else:
                pending.setdefault(key, {})[record.get("config_index")] = record
        for key in set(done) | set(pending):
            site_record, configs = done.get(key, (None, pending.get(key, {})))
            into = merged.setdefault(key, SiteDiagnostics())
            if site_record is not None:
                into.device = into.device or site_record.get("device")
            for index, record in configs.items():
                _merge(into.configs.setdefault(index, ConfigFacts()), record)
    for site in sites:
        if not getattr(site, "in_history", False) or site.tuning_number == site.tunings:
            site.diagnostics = merged.get((site.function, site.kernel, site.key, site.occurrence))


def _merge(facts: ConfigFacts, record: dict) -> None:
    """One rank's record into a config's facts: the compiler's from the first rank that has them, the worst spread."""
    if not facts.known and record.get("n_regs") is not None:
        facts.n_regs, facts.n_spills = record.get("n_regs"), record.get("n_spills")
        facts.shared_bytes = record.get("shared_bytes")
        facts.blocks_per_sm, facts.occupancy_limit = record.get("blocks_per_sm"), record.get("occupancy_limit")
    spread = record.get("sample_spread")
    if isinstance(spread, (int, float)):
        facts.sample_spread = max(spread, facts.sample_spread or 0.0)
    facts.samples = max(facts.samples, int(record.get("samples") or 0))


def noise_of(row: Any, facts: Optional[ConfigFacts]) -> Optional[float]:
    """A config's noise: its worst rank's relative sample spread (None with fewer than two samples)."""
    return None if facts is None else facts.sample_spread


def loser_line(row: Any, winner_row: Any, facts: Optional[ConfigFacts], winner_facts: Optional[ConfigFacts],
               noise: Optional[float]) -> str:
    """One line on why ``row`` lost to the winner."""
    if row.failed:
        reason = next(iter(row.failures.values()), "inf on some rank")
        return f"failed: {reason}"
    if math.isnan(row.agreed_ms):
        return "not timed (the search did not propose it)"
    slower = row.agreed_ms / winner_row.agreed_ms - 1 if winner_row.agreed_ms > 0 else math.nan
    parts = []
    if facts is not None and facts.n_spills:
        parts.append(f"spills {facts.n_spills} registers")
    if facts is not None and facts.blocks_per_sm is not None:
        blocks = facts.blocks_per_sm
        theirs = winner_facts.blocks_per_sm if winner_facts is not None else None
        if blocks <= 1 or (theirs is not None and blocks < theirs):
            against = f"winner {theirs}, " if theirs is not None else ""
            parts.append(f"occupancy {blocks} block{'' if blocks == 1 else 's'}/SM "
                         f"({against}limited by {facts.occupancy_limit})")
    speed = f"{100 * slower:.1f} % slower" if math.isfinite(slower) else "slower"
    if noise is not None and math.isfinite(slower) and slower <= noise:
        speed += " (within noise)"
    return "; ".join([speed] + parts)


def format_diagnostics(site: Any) -> str:
    """The report's diagnostics of one site: noise and margin verdict, compiler facts per config, losers."""
    diag: Optional[SiteDiagnostics] = getattr(site, "diagnostics", None)
    winner = site.row(site.winner)
    if winner is None or not site.configs:
        return ""
    facts = diag.configs if diag is not None else {}
    lines = ["Diagnostics:", ""]
    agreed = [row.agreed_ms for row in site.configs]
    position = [row.index for row in site.configs].index(winner.index)
    runner_position, margin = margin_over_runner_up(agreed, position)
    runner = site.configs[runner_position] if runner_position is not None else None
    spreads = [noise_of(r, facts.get(r.index)) for r in (winner, runner) if r is not None]
    known = [s for s in spreads if s is not None]
    noise = max(known) if known else None
    rank_spread = "n/a" if math.isnan(winner.rank_spread) else f"{100 * winner.rank_spread:.1f} %"
    sample_text = "unknown (one sample)" if noise is None else f"{100 * noise:.1f} %"
    lines.append(f"- winner's agreed time: rank spread {rank_spread}; noise {sample_text} "
                 "(the worst rank's, of the winner and the runner-up)")
    if runner is None:
        lines.append("- no runner-up: the winner is the only config with a finite time")
    else:
        verdict = (f"**not distinguishable** from the runner-up config {runner.index} {_code(runner.label)}"
                   if noise is None or margin <= noise else f"ahead of the runner-up config {runner.index} "
                   f"{_code(runner.label)} by more than the noise")
        basis = "no noise to compare with" if noise is None else f"noise {100 * noise:.1f} %"
        lines.append(f"- margin over the runner-up: {100 * margin:.1f} % ({basis}): the winner is {verdict}")
    where = diag.device if diag is not None and diag.device else "?"
    lines += ["", f"Compiler facts (device budget: {where}); `unknown` where no compiler ran (interpreter):", "",
              "| config | registers | spills | shared B | occupancy (blocks/SM) | noise | why it lost |",
              "|---|---:|---:|---:|---|---:|---|"]
    winner_facts = facts.get(winner.index)
    ordered = sorted(site.configs, key=lambda r: (r.index != winner.index, _sort_time(r.agreed_ms), r.index))
    for row in ordered:
        f = facts.get(row.index)
        known = f is not None and f.known

        def show(value: Any) -> str:
            return "unknown" if not known or value is None else str(value)

        occupancy = (f"{f.blocks_per_sm} ({f.occupancy_limit})" if known and f.blocks_per_sm is not None
                     else "unknown")
        config_noise = f"{100 * f.sample_spread:.1f} %" if f is not None and f.sample_spread is not None else "n/a"
        why = "the winner" if row.index == winner.index else _cell(loser_line(row, winner, f, winner_facts, noise))
        lines.append(f"| {row.index}: {_code(row.label)} | {show(f and f.n_regs)} | {show(f and f.n_spills)} | "
                     f"{show(f and f.shared_bytes)} | {occupancy} | {config_noise} | {why} |")
    return "\n".join(lines)


def _sort_time(ms: float) -> float:
    return math.inf if math.isnan(ms) else ms


def _cell(text: str) -> str:
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def _code(text: str) -> str:
    return f"`{text}`" if "`" not in text else _cell(text)
