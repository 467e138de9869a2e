"""Regression check: rerun a step with its stored or pinned winners and compare their times with the recorded ones.

    disttune verify [--threshold 0.1] [--nproc N] [--pinned winners.json] my_step.py [ARGS ...]
    DISTTUNE_VERIFY=0.1 torchrun --nproc_per_node=8 my_step.py && disttune verify --logs logs

With ``$DISTTUNE_VERIFY`` set (a threshold: 0.1 allows 10 % slower), a contextual tuner whose sites
are decided by the winner store or a pinned table times each such winner in place before going on:
``n_warmup + n_repeat`` runs of the step (all decided sites at once), one agreement over the ranks
like a tuning's, so the fresh time is the agreed one (``reduce`` over ranks of the ``statistic``).
Rank 0's record gives the time recorded when the winner was chosen. Each rank logs a ``verify``
record per site (site, config, recorded and fresh ms, whether it regressed) and rank 0 prints one
line per site. A winner that now fails, or runs slower than ``recorded * (1 + threshold)``, has
regressed.

``disttune verify SCRIPT`` launches the script like ``disttune demo`` (``scripts/launch.sh``: one
rank per GPU, 2 on a CPU machine) with ``$DISTTUNE_VERIFY`` set, then reads the ``verify`` records
this run wrote and exits 1 naming each regressed site, its config and both times (or when nothing
was verified: no site had a stored or pinned winner). ``--logs DIR`` only reads the records of an
earlier run. The check needs no GPU: under the interpreter with an injected timer it runs in CI.

Cost in the step: ``n_warmup + n_repeat`` runs, two all-gathers, a store read per site.
"""

from __future__ import annotations

import datetime
import math
import os
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from . import env
from . import store as stores
from .compat import config_text
from .report_logs import find_rank_logs, load_rank_log
from .sites import Schedule, Site, describe_config

VERIFY = "DISTTUNE_VERIFY"
DEFAULT_THRESHOLD = 0.1


def requested() -> Optional[float]:
    """The threshold ``$DISTTUNE_VERIFY`` asks for, or None when it is unset (a ValueError when it is not a number >= 0)."""
    text = env.verify_threshold_text()
    if not text:
        return None
    try:
        threshold = float(text)
    except ValueError:
        raise ValueError(f"disttune: {VERIFY} must be a threshold such as 0.1 (10 % slower allowed), got {text!r}") from None
    if not threshold >= 0:
        raise ValueError(f"disttune: {VERIFY} must be >= 0, got {text!r}")
    return threshold


def recorded_ms(site: Site, winners_store: Optional[stores.WinnerStore], table: Optional[dict],
                entry: Callable[[Site], stores.EntryId]) -> Optional[float]:
    """The agreed time recorded with ``site``'s decided winner: its pinned table entry's, or the record that
    ``entry(site)`` (the tuner's store identity, which carries its objective) names in the store."""
    record = None
    if site.decided_by == "pinned" and table is not None:
        configs = tuple(config_text(c) for c in site.configs)
        record = next((r for r in table["entries"] if (r["name"], r["key"], int(r.get("occurrence", 0)),
                                                          tuple(r["configs"])) == (site.id.kernel, repr(site.id.key),
                                                                                   site.id.occurrence, configs)), None)
    elif winners_store is not None:
        record = winners_store.load(entry(site))
    times = record.get("agreed_ms") if isinstance(record, dict) else None
    if not isinstance(times, list) or not 0 <= site.decided < len(times) or times[site.decided] is None:  # type: ignore[operator]
        return None
    return float(times[site.decided])  # type: ignore[index]


def not_for_the_step_objective(log: Any, name: str) -> None:
    """Say, in a warning and the rank log, that ``objective="step"`` winners are not verified."""
    text = (f"{VERIFY} is set, but {name} tunes with objective='step': its recorded times are whole-run "
            "times and verify times each launch, so its winners are not verified")
    log.note("verify", text)
    warnings.warn(f"disttune: {text}", RuntimeWarning, stacklevel=3)


def verify_decided(sites: Sequence[Site], runs: Any, agreement: Any, n_warmup: int, n_repeat: int,
                   winners_store: Optional[stores.WinnerStore], table: Optional[dict], log: Any, threshold: float,
                   entry: Callable[[Site], stores.EntryId], verbose: bool = True) -> int:
    """Time every decided site's winner in place, agree, compare with the recorded times; returns the runs made.

    ``entry`` maps a site to its identity in ``winners_store`` (the tuner's, with its objective and check)."""
    decided = [s for s in sites if s.decided is not None]
    if not decided:
        return 0
    for site in decided:
        site.active = [site.decided]
    made = runs.stage(Schedule(1, n_warmup, n_repeat), "verify run")
    for site in sites:
        if site.decided is None:  # still to be tuned: the verify runs timed its first config, keep no extra samples
            site.clear_samples()
    fresh = agreement.gather_agreed(decided, "verify agreement")
    comm = agreement.comm
    recorded = comm.all_gather_objects([recorded_ms(s, winners_store, table, entry) for s in decided],
                                       "verify (recorded times)")[0]
    lines = []
    for site, (_, agreed), before in zip(decided, fresh, recorded):
        now = float(agreed[site.decided])
        regressed = not math.isfinite(now) or (before is not None and now > before * (1 + threshold))
        config = config_text(site.configs[site.decided])
        log.verify(site.id.kernel, site.id.key, site.id.occurrence, site.decided, config, before, now, threshold,
                   regressed, site.decided_by)
        lines.append(describe(site.id.describe(), config, before, now, threshold, regressed))
    if verbose and comm.rank == 0:
        print("\n".join(f"disttune verify: {line}" for line in lines), file=sys.stdout, flush=True)
    return made


def describe(site: str, config: str, before: Optional[float], now: float, threshold: float, regressed: bool) -> str:
    """``SITE config ...: 1.2300 ms now, 1.1000 ms recorded (+11.8 %, threshold 10 %): REGRESSED``."""
    shown = f"{now:.4f} ms now" if math.isfinite(now) else "fails now"
    if before is None:
        return f"{site} {{{describe_config(config)}}}: {shown}, no recorded time" + (": REGRESSED" if regressed else "")
    change = f"{100 * (now / before - 1):+.1f} %" if math.isfinite(now) and before > 0 else "n/a"
    verdict = "REGRESSED" if regressed else "ok"
    return (f"{site} {{{describe_config(config)}}}: {shown}, {before:.4f} ms recorded "
            f"({change}, threshold {100 * threshold:g} %): {verdict}")


# -- the command -----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Verified:
    """One ``verify`` record as the command reads it back."""

    site: str
    config: str
    recorded_ms: Optional[float]
    fresh_ms: Optional[float]
    threshold: float
    regressed: bool

    def line(self) -> str:
        now = self.fresh_ms if self.fresh_ms is not None else math.inf
        return describe(self.site, self.config, self.recorded_ms, now, self.threshold, self.regressed)


def read_verified(log_dir: str | os.PathLike, since: Optional[datetime.datetime] = None) -> list[Verified]:
    """The ``verify`` records of ``log_dir`` at or after ``since``: each site's latest, from the lowest rank
    that has it."""
    seen: dict[tuple, Verified] = {}
    for rank, path in sorted(find_rank_logs(log_dir).items()):
        latest: dict[tuple, Verified] = {}  # rank logs are appended across runs: a later record replaces an earlier
        for record in load_rank_log(rank, path).records:
            if record.get("event") != "verify":
                continue
            if since is not None and datetime.datetime.fromisoformat(record["time"]) < since:
                continue
            key = (record.get("function"), record["kernel"], record["key"], record["occurrence"])
            latest[key] = Verified(f"{record['kernel']} key={record['key']} occurrence={record['occurrence']}",
                                   record["config"], record.get("recorded_ms"), record.get("fresh_ms"),
                                   float(record.get("threshold", DEFAULT_THRESHOLD)), bool(record["regressed"]))
        for key, found in latest.items():
            seen.setdefault(key, found)
    return list(seen.values())


def verdict(verified: Sequence[Verified]) -> tuple[int, str]:
    """(exit status, text): 1 when a winner regressed or nothing was verified."""
    if not verified:
        return 1, ("nothing was verified: no site had a stored or pinned winner (tune once first, or pass "
                   "--pinned / --cache-dir where the winners are)")
    regressed = [v for v in verified if v.regressed]
    lines = [v.line() for v in verified]
    summary = (f"{len(regressed)} of {len(verified)} winner(s) regressed" if regressed
               else f"all {len(verified)} winner(s) within their threshold")
    return (1 if regressed else 0), "\n".join(lines + [summary])


def run_command(script: Optional[str], script_args: Sequence[str], threshold: float, nproc: Optional[int],
                log_dir: Path, pinned: Optional[str], cache_dir: Optional[str], repo_root: Path) -> int:
    """``disttune verify``: launch ``script`` with ``$DISTTUNE_VERIFY`` (unless None), then judge its records."""
    since = None
    if script is not None:
        launcher = repo_root / "scripts" / "launch.sh"
        if not launcher.exists():
            raise FileNotFoundError(f"needs a source checkout (missing {launcher})")
        child = env.environ_with_log_dir(log_dir)
        child[VERIFY] = repr(threshold)
        if pinned:
            child[env.PINNED] = os.fspath(pinned)
        if cache_dir:
            child[env.CACHE_DIR] = os.fspath(cache_dir)
        since = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=1)
        command = ["bash", str(launcher)] + ([f"--nproc_per_node={nproc}"] if nproc else []) + [script, *script_args]
        code = subprocess.call(command, env=child)
        if code != 0:
            print(f"disttune verify: {script} exited with status {code}", file=sys.stderr)
            return code
    status, text = verdict(read_verified(log_dir, since))
    print(text, file=sys.stdout if status == 0 else sys.stderr, flush=True)
    return status
