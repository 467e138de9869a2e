"""Multi-rank cases for the searches, run under torchrun (or mpiexec with ``--mpi``).

    python tests/search_cases.py CASE [CASE ...] [--out DIR] [--mpi]

``test_search_dist.py`` launches this file and asserts on the records (see ``rank_cases``).
"""

from __future__ import annotations

import math
import os
import sys

from rank_cases import Cases, Ranks

import numpy as np  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402

import disttune  # noqa: E402
from disttune.search import config_features, propose  # noqa: E402
from tiny_kernels import TableTimer, add_block, grid  # noqa: E402

cases = Cases(__doc__)

CONFIGS = [triton.Config({"BLOCK": b}, num_warps=w, num_stages=s)
           for b in (16, 32, 64, 128) for w in (1, 2, 4, 8) for s in (1, 2, 3)]


def rank_time(rank: int, config: triton.Config) -> float:
    """Each rank sees a different landscape: its own best BLOCK is 16 << rank, the max over ranks another."""
    b, w = math.log2(config.kwargs["BLOCK"]), math.log2(config.num_warps)
    return 1.0 + 0.4 * (b - 4 - rank) ** 2 + 0.2 * (w - 1 - rank) ** 2 + 0.05 * config.num_stages * (rank + 1)


@cases.case
def case_model_proposals(ctx: Ranks):
    """Model search over agreed times: the same batches on every rank though local times differ."""
    kernel = triton.autotune(CONFIGS, key=["n"])(add_block)
    timer = TableTimer(lambda info: rank_time(ctx.rank, CONFIGS[info.config_index]))
    runs = {"n": 0}
    x = torch.randn(64, device=ctx.device)
    options = dict(is_dist=True, n_warmup=0, n_repeat=1, timer=timer, verbose=False, store=False, timeout_s=60,
                   log_dir=os.path.join(ctx.work_dir, "logs", "model_proposals"),
                   search=disttune.ModelSearch(batch=4, patience=2, budget=0.5, seed=7))
    if ctx.use_mpi:
        options["comm"] = ctx.mpi

    @disttune.contextual_autotune(**options)
    def step():
        runs["n"] += 1
        y = torch.empty_like(x)
        kernel[grid(x.numel())](x, y, x.numel())
        return y

    step()
    (result,) = step.report.results
    batches = step.search_trace.batches[result.site]
    # what this rank would have proposed after the first batch from its own times alone
    first = batches[0]
    own = {i: result.per_rank_ms[ctx.rank][i] for i in first}
    alone = propose(config_features(CONFIGS), own, 4, np.random.default_rng(7))
    return {"batches": batches, "mismatches": step.search_trace.mismatches, "winner": result.winner,
            "runs": runs["n"], "alone_second_batch": alone, "timed": len(timer.seen)}


if __name__ == "__main__":
    sys.exit(cases.main())
