"""Multi-rank cases for measured objectives, run under torchrun (``test_objective_measures.py`` launches this file).

    python tests/measure_cases.py CASE [CASE ...] [--out DIR]

Every rank times the same (injected) times but reads its own (injected) memory or energy, chosen so
that each rank alone would pick a different config than the agreed (max over ranks) values give.
"""

from __future__ import annotations

import os
import sys

from rank_cases import Cases, Ranks

import torch  # noqa: E402

import disttune  # noqa: E402
from disttune.objective import Measurements  # noqa: E402
from tiny_kernels import TableProbe, TableTimer, launch_add, make_kernel  # noqa: E402

cases = Cases(__doc__)
TIMES = (1.0, 2.0, 3.0)


def tuned(ctx: Ranks, case: str, objective, readings: dict) -> tuple:
    """Tune a one-launch step with this rank's ``readings`` ({name: per config}); (result, objective's alone pick)."""
    kernel = make_kernel(blocks=(16, 32, 64))
    probe = TableProbe(lambda info: {name: values[info.config_index] for name, values in readings.items()})

    @disttune.contextual_autotune(is_dist=True, n_warmup=1, n_repeat=2, verbose=False, store=False, timeout_s=60,
                                  log_dir=os.path.join(ctx.work_dir, "logs", case), objective=objective,
                                  timer=TableTimer(lambda info: TIMES[info.config_index]), probe=probe)
    def step(x):
        y = torch.empty_like(x)
        launch_add(kernel, x, y)
        return y

    step(torch.randn(64, device=ctx.device))
    (result,) = step.report.results
    local = [objective(Measurements(t, **{name: values[c] for name, values in readings.items()}))
             for c, t in enumerate(TIMES)]
    return result, local.index(min(local))


def time_and_memory(m: Measurements) -> float:
    return m.time_ms + 0.1 * m.peak_memory_mb


def energy_only(m: Measurements) -> float:
    return m.energy_mj


def energy_or_time(m: Measurements) -> float:
    return m.time_ms if m.energy_mj is None else m.energy_mj


@cases.case
def memory(ctx: Ranks) -> dict:
    mine = [(100.0, 10.0, 50.0), (10.0, 100.0, 5.0)][ctx.rank]  # max over ranks: 100, 100, 50
    result, alone = tuned(ctx, "memory", time_and_memory, {"peak_memory_mb": mine, "energy_mj": (None,) * 3})
    return {"winner": result.winner, "alone": alone,
            "agreed_memory": [m.peak_memory_mb for m in result.measurements]}


@cases.case
def energy(ctx: Ranks) -> dict:
    mine = [(3.0, 1.0, 2.0), (1.0, 3.0, 2.0)][ctx.rank]  # max over ranks: 3, 3, 2
    result, alone = tuned(ctx, "energy", energy_only, {"energy_mj": mine})
    return {"winner": result.winner, "alone": alone, "agreed_energy": [m.energy_mj for m in result.measurements]}


@cases.case
def energy_on_one_rank(ctx: Ranks) -> dict:
    mine = (3.0, 1.0, 2.0) if ctx.rank == 0 else (None, None, None)  # no NVML on rank 1
    result, _ = tuned(ctx, "energy_on_one_rank", energy_or_time, {"energy_mj": mine})
    return {"winner": result.winner, "agreed_energy": [m.energy_mj for m in result.measurements]}


def rank_zero_objective(m: Measurements) -> float:
    return m.time_ms


def other_objective(m: Measurements) -> float:
    return m.time_ms


@cases.case
def objective_differs(ctx: Ranks) -> dict:
    objective = rank_zero_objective if ctx.rank == 0 else other_objective
    result, _ = tuned(ctx, "objective_differs", objective, {})
    return {"winner": result.winner}


if __name__ == "__main__":
    sys.exit(cases.main())
