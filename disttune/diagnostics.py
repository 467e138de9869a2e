"""Why a config wins or loses: compiler facts, occupancy, noise, margins, one-line explanations.

Two halves, one for each side of the logs:

* at tuning time (:func:`log_site`), each rank logs a ``diagnostics`` record per config: what the
  compiler reported for it (registers ``n_regs``, spilled registers ``n_spills``, shared memory
  bytes) with the occupancy these imply, and the spread of this rank's timed samples; and one per
  site with the winner, the runner-up and the margin between their agreed times. On a GPU the facts
  come from the compiled kernels of the compile pool; under the interpreter there is no compiler
  and they are logged as ``null`` (the report says "unknown");
* in the report (:mod:`disttune.report.diagnostics`), the ranks' records are merged per site:
  the agreed time's spread across ranks and across samples (the noise), the winner's margin over
  the runner-up against that noise ("not distinguishable" when the margin is inside it, naming the
  runner-up), and one line per loser: "spills 48 registers", "occupancy 1 block/SM (winner 2,
  limited by registers)", or how much slower it was.

The noise of a config is its relative sample spread, ``(max - min) / median`` of one rank's timed
samples, on the worst rank; the margin is ``(runner-up - winner) / winner`` of the agreed times. A
winner is *not distinguishable* when the margin is no larger than the noise of either of the two.

Cost at tuning time: a pass over the samples and, on a GPU, loading each compiled kernel's handle
(microseconds each, done by the first launch anyway); in the report, a pass over the records.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

from .configs import config_text
from .sites import sample_spread
from .space import DeviceBudget

# -- at tuning time ----------------------------------------------------------------------------------------


def kernel_facts(compiled: Any) -> dict:
    """``n_regs``, ``n_spills``, ``shared_bytes`` and ``num_warps`` of a compiled kernel (None where unknown)."""
    if compiled is None:
        return {"n_regs": None, "n_spills": None, "shared_bytes": None, "num_warps": None}
    try:
        if getattr(compiled, "n_regs", None) is None:
            compiled._init_handles()  # what the first launch does: loads the binary, reads its registers
    except Exception:
        pass
    metadata = getattr(compiled, "metadata", None)

    def number(value: Any) -> Optional[int]:
        return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    return {"n_regs": number(getattr(compiled, "n_regs", None)), "n_spills": number(getattr(compiled, "n_spills", None)),
            "shared_bytes": number(getattr(metadata, "shared", None)),
            "num_warps": number(getattr(metadata, "num_warps", None))}


def occupancy(n_regs: Optional[int], shared_bytes: Optional[int], num_warps: Optional[int],
              budget: DeviceBudget) -> tuple[Optional[int], Optional[str]]:
    """(blocks per SM, what limits it: "registers", "shared memory", "threads" or "blocks"), or (None, None).

    Registers are allocated per warp in units of 256 (a thread's count rounded up to 8).
    """
    if n_regs is None or num_warps is None:
        return None, None
    threads = num_warps * budget.warp_size
    per_warp = -(-max(n_regs, 1) * budget.warp_size // 256) * 256
    limits = {"blocks": budget.blocks_per_sm, "threads": budget.threads_per_sm // threads,
              "registers": budget.registers_per_sm // (per_warp * num_warps)}
    if shared_bytes:
        limits["shared memory"] = budget.shared_per_sm // shared_bytes
    limiter = min(limits, key=lambda name: (limits[name], name != "registers"))
    return limits[limiter], limiter


def margin_over_runner_up(agreed: Sequence[float], winner: int) -> tuple[Optional[int], Optional[float]]:
    """(runner-up index, ``(runner-up - winner) / winner``) over finite agreed times; (None, None) alone."""
    ranked = sorted((t, i) for i, t in enumerate(agreed) if i != winner and math.isfinite(t))
    if not ranked or not math.isfinite(agreed[winner]) or agreed[winner] <= 0:
        return None, None
    runner_time, runner = ranked[0]
    return runner, (runner_time - agreed[winner]) / agreed[winner]


def log_site(log: Any, site: Any, result: Any, compiled: dict, budget: DeviceBudget) -> None:
    """This rank's ``diagnostics`` records of one tuned site (see the module doc).

    ``compiled``: ``config index -> compiled kernel`` of this site (empty under the interpreter).
    """
    ident = site.id
    for index, config in enumerate(site.configs):
        facts = kernel_facts(compiled.get(index))
        warps = facts["num_warps"] or getattr(config, "num_warps", None)
        blocks, limiter = occupancy(facts["n_regs"], facts["shared_bytes"], warps, budget)
        spread = sample_spread(site.samples[index])
        log.diagnostics(ident.kernel, ident.key, ident.occurrence, "config", config_index=index,
                        config=config_text(config), samples=len(site.samples[index]), sample_spread=spread,
                        n_regs=facts["n_regs"], n_spills=facts["n_spills"], shared_bytes=facts["shared_bytes"],
                        blocks_per_sm=blocks, occupancy_limit=limiter)
    runner, margin = margin_over_runner_up(result.agreed_ms, result.winner)
    log.diagnostics(ident.kernel, ident.key, ident.occurrence, "site", winner=result.winner, runner_up=runner,
                    margin=margin, device=budget.source)


def log_tuned(log: Any, sites: dict, results: Sequence[Any], compiled: dict) -> None:
    """:func:`log_site` for every tuned result; ``compiled``: ``(site id, config index) -> compiled kernel``."""
    from .space import device_budget

    tuned = [r for r in results if r.source == "tuned"]
    if not tuned:
        return
    budget = device_budget()
    for result in tuned:
        mine = {index: kernel for (ident, index), kernel in compiled.items() if ident == result.site}
        log_site(log, sites[result.site], result, mine, budget)
