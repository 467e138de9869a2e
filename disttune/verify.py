"""Regression check in the tuning call: time a step's stored or pinned winners and compare with the recorded times.

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

``disttune verify`` (:mod:`disttune.report.verify`) launches a step with ``$DISTTUNE_VERIFY`` set and
judges the records. The check needs no GPU: under the interpreter with an injected timer and
``DISTTUNE_VERIFY_CPU=1`` it runs in CI.

Cost in the step: ``n_warmup + n_repeat`` runs, two all-gathers, a store read per site.
"""

from __future__ import annotations

import math
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from . import env
from . import store as stores
from .configs import config_text, describe_config
from .sites import Schedule, Site, sample_spread

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
