"""What the demos print: each tuned site's per-rank and agreed times, and the step against its baseline.

Shared by ``examples/ag_gemm.py``, ``examples/moe_layer.py`` and ``examples/tp_mlp.py``; rank 0 prints,
every rank calls. :func:`run` runs a demo's ``main`` so that ``disttune demo`` can print each rank's
error once, in rank order, instead of every rank's traceback and the launcher's report.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable

import torch.distributed as dist

import disttune
from disttune import benchmark
from disttune import dist as dt_dist
from disttune.logs import resolve_log_dir
from disttune.agreement import winner_index


def run(main: Callable[[], int]) -> int:
    """``main()``; where ``disttune demo`` launched it (``$DISTTUNE_DEMO_ERRORS`` names a folder), an error ends
    the rank with its one-line message written to ``rank-<r>.txt`` there, and exit status 1."""
    folder = os.environ.get("DISTTUNE_DEMO_ERRORS")
    if not folder:
        return main()
    try:
        return main()
    except (Exception, SystemExit) as err:  # noqa: BLE001 - the command prints it, once per rank
        if isinstance(err, SystemExit) and not isinstance(err.code, str):
            raise
        text = err.code if isinstance(err, SystemExit) else f"{type(err).__name__}: {err}"
        path = Path(folder) / f"rank-{os.environ.get('RANK', os.environ.get('PMI_RANK', '0'))}.txt"
        path.write_text(str(text))
        sys.stderr.flush()
        return 1


def print_sites(report: disttune.TuningReport) -> None:
    """One table per tuned site: each config's time on every rank, the agreed time, the winner.

    Where a rank alone (its own times only) would have picked another config, a line says so:
    that is the disagreement the agreement step removes.
    """
    for result in report.results:
        key = result.site.key_text()  # the key with its argument names
        name = result.site.kernel.rsplit(".", 1)[-1]
        if result.source != "tuned":
            source = "pinned table" if result.source == "pinned" else result.source
            print(f"{name} {key}, occurrence {result.site.occurrence}: winner from the {source} (no tuning): "
                  f"{disttune.describe_config(result.config)}")
            continue
        labels = [disttune.describe_config(config) for config in result.configs]
        width = max(len(label) for label in labels) + 2
        ranks = len(result.per_rank_ms)
        print(f"{name} {key}, occurrence {result.site.occurrence}: ms per launch, in context")
        print(f"{'config':<{width}}" + "".join(f"{'rank ' + str(r):>10}" for r in range(ranks)) + f"{'agreed':>10}")
        for index, label in enumerate(labels):
            times = "".join(f"{row[index]:10.4f}" for row in result.per_rank_ms)
            mark = "  <- winner" if index == result.winner else ""
            print(f"{label:<{width}}{times}{result.agreed_ms[index]:10.4f}{mark}")
        for rank, row in enumerate(result.per_rank_ms):
            alone = winner_index(row)  # None where the rank timed nothing (split sites: nan)
            if alone is not None and alone != result.winner:
                print(f"  rank {rank} alone would have picked {labels[alone]}")


def compare(tuned: Callable[[], object], baseline: Callable[[], object], baseline_name: str,
            gpu: bool, world: int, samples: int) -> dict:
    """Time the tuned step against ``baseline`` in this run and return what rank 0 prints.

    On GPUs both are timed in steady state (10 calls back to back between CUDA events), in ``samples``
    interleaved rounds (``disttune.benchmark.interleaved``: a drift of the machine hits both alike), each
    round's time the slowest rank's; the medians are compared and their spread printed. Under the CPU
    interpreter a speed ratio means nothing, so only the tuned step's host time is given.
    """
    if not gpu:
        ms = benchmark.max_over_ranks(benchmark.one_call_ms(tuned, samples=max(3, samples // 10), warmup=1))
        return {"line": f"tuned step: {ms:.1f} ms per call (host clock, CPU interpreter: not a speed "
                        f"comparison; run on GPUs for one)"}
    spreads = benchmark.interleaved({"baseline": baseline, "tuned": tuned}, rounds=samples, calls=10)
    ours, theirs = spreads["tuned"], spreads["baseline"]
    line = (f"tuned step: {ours.median:.3f} ms per call; {baseline_name}: {theirs.median:.3f} ms "
            f"({theirs.median / ours.median:.2f}x), steady state, max over ranks, median of {samples} interleaved "
            f"rounds (spread {ours.low:.3f}-{ours.high:.3f} and {theirs.low:.3f}-{theirs.high:.3f})")
    if world == 1:
        line += "\n(one GPU: there is no communication to overlap, so this compares the GEMMs alone)"
    return {"line": line, "ours_ms": ours.median, "baseline_ms": theirs.median}


def check_output(out, reference, tolerance: float) -> tuple[bool, float]:
    """Every rank's verdict on its output: (all finite and within ``tolerance`` everywhere, largest rel. error)."""
    error = benchmark.rel_error(out, reference)
    ok = bool(out.isfinite().all()) and error < tolerance
    verdicts: list = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, (ok, error))
    return all(v[0] for v in verdicts), max(v[1] for v in verdicts)


def finish(title: str, step: disttune.ContextualAutotuner, tuning_s: float, timing: dict, ok: bool,
           worst: float) -> int:
    """Rank 0 prints the run's summary; every rank leaves the process group. Returns the exit status."""
    if dist.get_rank() == 0:
        print(title)
        print_sites(step.report)
        print(f"tuning call: {tuning_s:.2f} s, {step.report.function_runs} runs of the step")
        print(timing["line"])
        print(f"correct on every rank: {ok} (largest rel. error {worst:.2e})")
        print(f"per-rank logs: {resolve_log_dir(None).resolve()}/rank-*.log")
    dist.barrier()
    dt_dist.destroy()
    return 0 if ok else 1
