"""Regression check: rerun a step with its stored or pinned winners and compare their times with the recorded ones.

    disttune verify [--threshold 0.1] [--nproc N] [--pinned winners.json] my_step.py [ARGS ...]
    DISTTUNE_VERIFY=0.1 torchrun --nproc_per_node=8 my_step.py && disttune verify --logs logs

With ``$DISTTUNE_VERIFY`` set (a threshold: 0.1 allows 10 % slower), a contextual tuner whose sites
are decided by the winner store or a pinned table times each such winner in place before going on:
``n_warmup + n_repeat`` runs of the step (all decided sites at once), one agreement over the ranks
like a tuning's, so the fresh time is the agreed one (``reduce`` over ranks of the ``statistic``).
Rank 0's record gives the time recorded when the winner was chosen, and its noise then
(``(max - min) / median`` of the writer's samples). Each rank logs a ``verify`` record per site (site,
config, recorded and fresh ms, the allowance, whether it regressed) and rank 0 prints one line per site.
A winner that now fails has regressed; so has one slower than ``recorded * (1 + allowed)``, where
``allowed`` is the largest of the threshold, the recorded noise and the fresh noise (the worst rank's):
a change within the noise of either measurement is not a regression. Timings on a CPU (Triton's
interpreter, or no GPU) cannot show one: there a slower winner is reported, not judged, unless
``DISTTUNE_VERIFY_CPU=1`` (``disttune verify --judge-cpu``) asks for it.

``disttune verify SCRIPT`` launches the script like ``disttune demo`` (``scripts/launch.sh``: one
rank per GPU, 2 on a CPU machine) with ``$DISTTUNE_VERIFY`` set, then reads the ``verify`` records
this run wrote and exits 1 naming each regressed site, its config and both times (or when nothing
was verified: no site had a stored or pinned winner). ``--logs DIR`` only reads the records of an
earlier run; where that run logged no ``verify`` records, the winners its tuning calls logged are
compared with the times the winner store recorded for them. The check needs no GPU: under the
interpreter with an injected timer and ``DISTTUNE_VERIFY_CPU=1`` it runs in CI.

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
from .sites import Schedule, Site, describe_config, sample_spread

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


def recorded(site: Site, winners_store: Optional[stores.WinnerStore], table: Optional[dict],
             entry: Callable[[Site], stores.EntryId]) -> tuple[Optional[float], Optional[float]]:
    """(agreed ms, noise) recorded with ``site``'s decided winner: its pinned table entry's, or the record that
    ``entry(site)`` (the tuner's store identity, which carries its objective) names in the store."""
    record = None
    if site.decided_by == "pinned" and table is not None:
        configs = tuple(config_text(c) for c in site.configs)
        record = next((r for r in table["entries"] if (r["name"], r["key"], int(r.get("occurrence", 0)),
                                                          tuple(r["configs"])) == (site.id.kernel, repr(site.id.key),
                                                                                   site.id.occurrence, configs)), None)
    elif winners_store is not None:
        record = winners_store.load(entry(site))
    return recorded_times(record, site.decided)  # type: ignore[arg-type]


def recorded_times(record: Any, winner: int) -> tuple[Optional[float], Optional[float]]:
    """(agreed ms of ``winner``, noise) of a store record or table entry; None where it holds none."""
    if not isinstance(record, dict):
        return None, None
    times, noise = record.get("agreed_ms"), record.get("noise")
    ms = None
    if isinstance(times, list) and 0 <= winner < len(times) and isinstance(times[winner], (int, float)):
        ms = float(times[winner])
    return ms, (float(noise) if isinstance(noise, (int, float)) else None)


@dataclass(frozen=True)
class Judgement:
    """How a fresh time compares with the recorded one: ``allowed`` is the slowdown allowed (the largest of
    the threshold and both noises), ``slower`` whether it went beyond, ``regressed`` the verdict (a failure, or
    slower where timings can tell: not on a CPU unless asked)."""

    allowed: float
    slower: bool
    regressed: bool
    judged: bool  # False: a CPU's timings, reported and not judged


def judge(before: Optional[float], now: float, threshold: float, noises: Sequence[Optional[float]],
          on_cpu: bool, judge_cpu: bool) -> Judgement:
    """The verdict on ``now`` against ``before``; ``judge_cpu``: judge timings taken on a CPU too."""
    allowed = max([threshold] + [n for n in noises if n is not None and math.isfinite(n)])
    slower = before is not None and math.isfinite(now) and now > before * (1 + allowed)
    judged = not on_cpu or judge_cpu
    return Judgement(allowed, slower, not math.isfinite(now) or (slower and judged), judged)


def timings_on_cpu() -> bool:
    """Whether this process times on a CPU (Triton's interpreter, or no GPU): such timings cannot show a
    regression."""
    from . import device

    return env.interpreting() or not device.in_use()


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
    mine = [[*recorded(s, winners_store, table, entry), sample_spread(s.samples[s.decided])] for s in decided]
    everyone = comm.all_gather_objects(mine, "verify (recorded times and noise)")
    on_cpu = timings_on_cpu()
    lines = []
    for index, (site, (_, agreed)) in enumerate(zip(decided, fresh)):
        now = float(agreed[site.decided])
        before, recorded_noise = everyone[0][index][:2]  # rank 0's record decides, as in the consensus
        fresh_noise = max((ranks[index][2] for ranks in everyone if ranks[index][2] is not None), default=None)
        verdict = judge(before, now, threshold, (recorded_noise, fresh_noise), on_cpu, env.verify_cpu_timings())
        config = config_text(site.configs[site.decided])
        log.verify(site.id.kernel, site.id.key, site.id.occurrence, site.decided, config, before, now, threshold,
                   verdict.regressed, site.decided_by, allowed=verdict.allowed, judged=verdict.judged,
                   noise=[recorded_noise, fresh_noise])
        lines.append(describe(f"{site.id.kernel} {site.id.key_text()} occurrence={site.id.occurrence}", config, before,
                              now, threshold, verdict))
    if verbose and comm.rank == 0:
        print("\n".join(f"disttune verify: {line}" for line in lines), file=sys.stdout, flush=True)
    return made


def describe(site: str, config: str, before: Optional[float], now: float, threshold: float,
             verdict: Judgement) -> str:
    """``SITE config ...: 1.2300 ms now, 1.1000 ms recorded (+11.8 %, allowed 10 %: threshold 10 %, noise 3.1 %
    then, 2.0 % now): REGRESSED``."""
    shown = f"{now:.4f} ms now" if math.isfinite(now) else "fails now"
    if before is None:
        return (f"{site} {{{describe_config(config)}}}: {shown}, no recorded time"
                + (": REGRESSED" if verdict.regressed else ""))
    change = f"{100 * (now / before - 1):+.1f} %" if math.isfinite(now) and before > 0 else "n/a"
    if verdict.regressed:
        outcome = "REGRESSED"
    elif verdict.slower and not verdict.judged:
        outcome = "slower, but timings on a CPU cannot show a regression (--judge-cpu to judge them)"
    else:
        outcome = "ok"
    return (f"{site} {{{describe_config(config)}}}: {shown}, {before:.4f} ms recorded ({change}, allowed "
            f"{100 * verdict.allowed:.1f} %: the threshold {100 * threshold:g} % or the noise, if larger): {outcome}")


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
