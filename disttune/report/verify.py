"""``disttune verify``: launch a step with ``$DISTTUNE_VERIFY`` set and judge the ``verify`` records its ranks
log (the in-call stage is :mod:`disttune.verify`), or judge an earlier run's logs.

``disttune verify SCRIPT`` launches the script like ``disttune demo`` (``scripts/launch.sh``: one
rank per GPU, 2 on a CPU machine) with ``$DISTTUNE_VERIFY`` set, then reads the ``verify`` records
this run wrote and exits 1 naming each regressed site, its config and both times (or when nothing
was verified: no site had a stored or pinned winner). ``--logs DIR`` only reads the records of an
earlier run; where that run logged no ``verify`` records, the winners its tuning calls logged are
compared with the times the winner store recorded for them.
"""

from __future__ import annotations

import datetime
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from .. import env
from .. import store as stores
from ..verify import DEFAULT_THRESHOLD, VERIFY, Judgement, describe, judge, recorded_times
from .logs import find_rank_logs, load_rank_log

@dataclass(frozen=True)
class Verified:
    """One ``verify`` record as the command reads it back."""

    site: str
    config: str
    recorded_ms: Optional[float]
    fresh_ms: Optional[float]
    threshold: float
    regressed: bool

    allowed: Optional[float] = None
    judged: bool = True

    def line(self) -> str:
        now = self.fresh_ms if self.fresh_ms is not None else math.inf
        slower = (self.recorded_ms is not None and math.isfinite(now)
                  and now > self.recorded_ms * (1 + (self.allowed if self.allowed is not None else self.threshold)))
        verdict = Judgement(self.allowed if self.allowed is not None else self.threshold, slower, self.regressed,
                            self.judged)
        return describe(self.site, self.config, self.recorded_ms, now, self.threshold, verdict)


def site_text(record: dict) -> str:
    """A logged site as the verify lines name it: ``kernel M=48 N=32 dtype=float16 occurrence=0``."""
    key = record.get("key_text") or f"key={record['key']}"
    return f"{record['kernel']} {key} occurrence={record['occurrence']}"


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
            allowed = record.get("allowed")
            latest[key] = Verified(site_text(record), record["config"], record.get("recorded_ms"),
                                   record.get("fresh_ms"), float(record.get("threshold", DEFAULT_THRESHOLD)),
                                   bool(record["regressed"]), allowed if isinstance(allowed, (int, float)) else None,
                                   bool(record.get("judged", True)))
        for key, found in latest.items():
            seen.setdefault(key, found)
    return list(seen.values())


def logged_against_store(log_dir: str | os.PathLike, cache_dir: Optional[str], threshold: float,
                         judge_cpu: bool = False) -> list[Verified]:
    """Without ``verify`` records: each site's last tuned winner in ``log_dir`` (its agreed time) against the time
    the winner store recorded for that site and config (``cache_dir``, default the usual store), judged as
    :func:`verify_decided` judges (timings taken on a CPU are reported, not judged)."""
    logged: dict[tuple, dict] = {}
    for rank, path in sorted(find_rank_logs(log_dir).items(), reverse=True):  # the lowest rank's record stays
        for record in load_rank_log(rank, path).records:
            if record.get("event") == "winner" and record.get("source") == "tuned":
                logged[(record["kernel"], record["key"], record["occurrence"], record["config"])] = record
    stored = {}
    for _, entry, problem in stores.iter_records(cache_dir):
        if entry is not None and not problem:
            stored[(entry["name"], entry["key"], int(entry.get("occurrence", 0)), entry["configs"][entry["winner"]])] = entry
    found = []
    for key, record in logged.items():
        entry = stored.get(key)
        if entry is None:
            continue
        before, noise = recorded_times(entry, entry["winner"])
        now = record.get("agreed_ms")
        now = float(now) if isinstance(now, (int, float)) else math.inf
        verdict = judge(before, now, threshold, (noise,), not entry.get("fingerprint", {}).get("gpu"), judge_cpu)
        found.append(Verified(site_text(record), record["config"], before, now, threshold, verdict.regressed,
                              verdict.allowed, verdict.judged))
    return found


def verdict(verified: Sequence[Verified]) -> tuple[int, str]:
    """(exit status, text): 1 when a winner regressed or nothing was verified."""
    if not verified:
        return 1, ("nothing was verified: no site had a stored or pinned winner with a recorded time (tune once "
                   "first, or pass --pinned / --cache-dir where the winners are)")
    regressed = [v for v in verified if v.regressed]
    lines = [v.line() for v in verified]
    summary = (f"{len(regressed)} of {len(verified)} winner(s) regressed" if regressed
               else f"all {len(verified)} winner(s) within their threshold")
    return (1 if regressed else 0), "\n".join(lines + [summary])


def run_command(script: Optional[str], script_args: Sequence[str], threshold: float, nproc: Optional[int],
                log_dir: Path, pinned: Optional[str], cache_dir: Optional[str], repo_root: Path,
                judge_cpu: bool = False) -> int:
    """``disttune verify``: launch ``script`` with ``$DISTTUNE_VERIFY`` (unless None), then judge its records;
    ``judge_cpu``: timings taken on a CPU are judged too (``DISTTUNE_VERIFY_CPU=1`` for the ranks)."""
    since = None
    if script is not None:
        launcher = repo_root / "scripts" / "launch.sh"
        if not launcher.exists():
            raise FileNotFoundError(f"needs a source checkout (missing {launcher})")
        child = env.environ_with_log_dir(log_dir)
        child[VERIFY] = repr(threshold)
        if judge_cpu:
            child["DISTTUNE_VERIFY_CPU"] = "1"
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
    verified = read_verified(log_dir, since)
    if not verified and script is None:  # an earlier run that did not verify: its tuned winners against the store
        verified = logged_against_store(log_dir, cache_dir, threshold, judge_cpu or env.verify_cpu_timings())
    status, text = verdict(verified)
    print(text, file=sys.stdout if status == 0 else sys.stderr, flush=True)
    return status
