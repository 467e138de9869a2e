"""Multi-rank cases for the contextual tuner, run under torchrun or mpiexec (``--mpi``).

    python tests/dist_cases.py CASE [CASE ...] [--out DIR] [--mpi]

Each rank runs the named cases in order and writes one record per case (see ``rank_cases``):
what the case returned, or the exception it raised. ``test_contextual_dist.py``,
``test_faults.py``, ``test_store.py`` and ``test_report.py`` launch this file and assert on
the records. Runs on GPUs (NCCL, CUDA events where no fake timer is given) and on CPUs
(gloo, ``TRITON_INTERPRET=1``) alike.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from rank_cases import Cases, Ranks

import numpy as np  # noqa: E402
import torch  # noqa: E402

import disttune  # noqa: E402
from tiny_kernels import TableTimer, launch_add, make_kernel  # noqa: E402

cases = Cases(__doc__)


def tuner_options(ctx: Ranks, case: str, **extra) -> dict:
    options = dict(is_dist=True, n_warmup=1, n_repeat=2, log_dir=os.path.join(ctx.work_dir, "logs", case),
                   cache_dir=os.path.join(ctx.work_dir, "store", case), timeout_s=60, verbose=False)
    if ctx.use_mpi:
        options["comm"] = ctx.mpi
    options.update(extra)
    return options


def sum_across_ranks(ctx: Ranks, value: float) -> float:
    """A collective inside the user's function (the kind the schedule must keep paired)."""
    if ctx.use_mpi:
        return float(ctx.mpi.allreduce(value))
    t = torch.tensor([value], dtype=torch.float64, device=ctx.device)
    torch.distributed.all_reduce(t)
    return float(t.item())


def winners_of(tuner) -> list[dict]:
    return [
        {"kernel": r.site.kernel, "key": repr(r.site.key), "occurrence": r.site.occurrence, "winner": r.winner,
         "block": r.config.kwargs["BLOCK"], "agreed_ms": list(r.agreed_ms), "per_rank_ms": [list(x) for x in r.per_rank_ms]}
        for r in tuner.report.results
    ]


def disagreement_times(rank: int, world: int, config_index: int) -> float:
    """Each rank alone prefers its own config; the slowest-rank (max) view prefers config ``world``."""
    if config_index == world:
        return 3.0
    return 1.0 if config_index == rank else 5.0


def _agree_case(ctx: Ranks, reduce: str) -> dict:
    blocks = [16 << i for i in range(ctx.world + 1)]
    kernel = make_kernel(blocks=blocks)
    timer = TableTimer(lambda info: disagreement_times(ctx.rank, ctx.world, info.config_index))
    runs = {"n": 0}
    x = torch.randn(200, device=ctx.device)

    @disttune.contextual_autotune(**tuner_options(ctx, f"agree_{reduce}", timer=timer, reduce=reduce))
    def step():
        runs["n"] += 1
        y = torch.full_like(x, float("nan"))  # allocated inside: every run must write it
        launch_add(kernel, x, y)
        return y

    y = step()
    winner_block = kernel.cache[(200, str(x.dtype), str(x.dtype))].kwargs["BLOCK"]
    return {
        "winners": winners_of(step),
        "runs": runs["n"],
        "expected_runs": step.expected_runs(len(blocks)),
        "output_ok": bool(torch.equal(y, x + winner_block)),
        "timed_configs": sorted({i.config_index for i in timer.seen}),
        "blocks": blocks,
    }


@cases.case
def case_agree_max(ctx):
    return _agree_case(ctx, "max")


@cases.case
def case_agree_mean(ctx):
    return _agree_case(ctx, "mean")


@cases.case
def case_agree_min(ctx):
    return _agree_case(ctx, "min")


@cases.case
def case_early_stop(ctx):
    """Screening is decided on agreed times: every rank keeps the same survivors and runs equally often."""
    blocks = [16 << i for i in range(ctx.world + 1)]
    kernel = make_kernel(blocks=blocks)
    timer = TableTimer(lambda info: disagreement_times(ctx.rank, ctx.world, info.config_index))
    runs = {"n": 0}
    x = torch.randn(200, device=ctx.device)

    @disttune.contextual_autotune(**tuner_options(ctx, "early_stop", timer=timer, early_stop=True))
    def step():
        runs["n"] += 1
        y = torch.empty_like(x)
        launch_add(kernel, x, y)
        sum_across_ranks(ctx, 1.0)
        return y

    step()
    return {"winners": winners_of(step), "runs": runs["n"],
            "full_configs": sorted({i.config_index for i in timer.seen[len(blocks):]})}


@cases.case
def case_fail_one_rank(ctx):
    """Config 1 of the first kernel fails on rank 1 only; a user collective sits between two kernels."""

    def fault(nargs):
        if ctx.rank == 1:
            raise RuntimeError("injected fault: config 1 cannot run on rank 1")

    first = make_kernel(blocks=(16, 32, 64), pre_hooks={1: fault})
    second = make_kernel(blocks=(16, 32, 64))
    fake_ms = {0: 2.0, 1: 0.5, 2: 1.0}
    timer = TableTimer(lambda info: fake_ms[info.config_index])
    counts = {"runs": 0, "collectives": 0}
    x = torch.randn(300, device=ctx.device)

    @disttune.contextual_autotune(**tuner_options(ctx, "fail_one_rank", timer=timer))
    def step():
        counts["runs"] += 1
        y = torch.full_like(x, float("nan"))
        z = torch.full_like(x, float("nan"))
        launch_add(first, x, y)
        total = sum_across_ranks(ctx, 1.0)
        counts["collectives"] += 1
        launch_add(second, y, z)
        return z, total

    z, total = step()
    first_block = first.cache[(300, str(x.dtype), str(x.dtype))].kwargs["BLOCK"]
    second_block = second.cache[(300, str(x.dtype), str(x.dtype))].kwargs["BLOCK"]
    return {
        "winners": winners_of(step),
        "runs": counts["runs"],
        "collectives": counts["collectives"],
        "expected_runs": step.expected_runs(3),
        "total": total,
        "output_ok": bool(torch.equal(z, x + first_block + second_block)),
    }


def _tune_once(ctx, case: str, kernel, x, **options) -> dict:
    """Tune one launch of ``kernel`` on ``x``; the cases using it expect an error on every rank."""

    @disttune.contextual_autotune(**tuner_options(ctx, case, timer=TableTimer(lambda i: 1.0), **options))
    def step():
        y = torch.empty_like(x)
        launch_add(kernel, x, y)
        return y

    step()
    return {"unexpected": "no error"}


@cases.case
def case_mismatch_configs(ctx):
    """Rank 1 prunes a config that the others keep: an error naming kernel and ranks, not a hang."""

    def prune(configs, named_args, **kwargs):
        return configs[:-1] if ctx.rank == 1 else configs

    kernel = make_kernel(blocks=(16, 32, 64), prune_configs_by={"early_config_prune": prune})
    return _tune_once(ctx, "mismatch_configs", kernel, torch.randn(64, device=ctx.device))


@cases.case
def case_keys_differ(ctx):
    """Each rank launches with a different size (the tuning key): the error names the key."""
    return _tune_once(ctx, "keys_differ", make_kernel(), torch.randn(64 + 16 * ctx.rank, device=ctx.device))


@cases.case
def case_options_differ(ctx):
    """Rank 1 asks for another reduce and statistic, and alone sets DISTTUNE_VERIFY (verify runs would pair
    with the others' tuning runs): one error naming the three and every rank's value."""
    odd = ctx.rank % 2 == 1
    if odd:
        os.environ["DISTTUNE_VERIFY"] = "0.1"
    try:
        return _tune_once(ctx, "options_differ", make_kernel(), torch.randn(64, device=ctx.device),
                          reduce="min" if odd else "max", statistic="mean" if odd else "median")
    finally:
        os.environ.pop("DISTTUNE_VERIFY", None)


@cases.case
def case_all_fail(ctx):
    """Every config fails on rank 0: the same AllConfigsFailed, with per-config errors, on every rank."""

    def fault(nargs):
        if ctx.rank == 0:
            raise RuntimeError("injected fault on rank 0")

    kernel = make_kernel(blocks=(16, 32), pre_hooks={0: fault, 1: fault})
    return _tune_once(ctx, "all_fail", kernel, torch.randn(64, device=ctx.device))


@cases.case
def case_raise_in_run(ctx):
    """The last rank raises inside the function (after its collective) in its 5th run: every rank raises."""
    kernel = make_kernel()
    runs = {"n": 0}
    x = torch.randn(64, device=ctx.device)

    @disttune.contextual_autotune(**tuner_options(ctx, "raise_in_run", timer=TableTimer(lambda i: 1.0)))
    def step():
        runs["n"] += 1
        y = torch.empty_like(x)
        launch_add(kernel, x, y)
        sum_across_ranks(ctx, 1.0)
        if ctx.rank == ctx.world - 1 and runs["n"] == 5:
            raise ValueError("user code failed in run 5")
        return y

    step()
    return {"unexpected": "no error"}


@cases.case
def case_second_call(ctx):
    """After tuning, a call runs the function once and launches the winner; no tuning, no collective."""
    kernel = make_kernel()
    runs = {"n": 0}
    x = torch.randn(128, device=ctx.device)
    timer = TableTimer(lambda info: {0: 3.0, 1: 2.0, 2: 1.0}[info.config_index])

    @disttune.contextual_autotune(**tuner_options(ctx, "second_call", timer=timer))
    def step():
        runs["n"] += 1
        y = torch.full_like(x, float("nan"))
        launch_add(kernel, x, y)
        return y

    step()
    after_tuning, timed = runs["n"], len(timer.seen)
    y = step()
    return {"runs_added": runs["n"] - after_tuning, "timed_added": len(timer.seen) - timed,
            "output_ok": bool(torch.equal(y, x + 64)), "tuned": step.tuned}


@cases.case
def case_capture_fails_on_one_rank(ctx):
    """With ``cuda_graph=True`` the second call's capture fails on rank 1 only (a stand-in capture, see
    ``graph_standins``; the step holds a user collective): every rank raises the same error, and later calls
    run as they are on every rank, their collectives still paired."""
    from disttune import graphs
    from graph_standins import ReplayByRerun

    capture = ReplayByRerun(fail=ctx.rank == 1)
    saved = graphs.why_unavailable, graphs.CudaGraphCapture
    graphs.why_unavailable, graphs.CudaGraphCapture = (lambda: ""), (lambda: capture)
    try:
        kernel = make_kernel()
        x = torch.randn(128, device=ctx.device)
        timer = TableTimer(lambda info: {0: 3.0, 1: 2.0, 2: 1.0}[info.config_index])

        @disttune.contextual_autotune(**tuner_options(ctx, "capture_fails_on_one_rank", timer=timer), cuda_graph=True)
        def step(x_in):
            y = torch.full_like(x_in, float("nan"))
            launch_add(kernel, x_in, y)
            return y, sum_across_ranks(ctx, 1.0)

        step(x)  # the tuning call: the signature's first call
        try:
            step(x)  # captured: fails on rank 1
            error = None
        except RuntimeError as err:
            error = str(err)
        later = [step(x) for _ in range(3)]
    finally:
        graphs.why_unavailable, graphs.CudaGraphCapture = saved
    return {"error": error, "later_ok": all(bool(torch.equal(y, x + 64)) and total == ctx.world for y, total in later),
            "captures": step.graphs.captures, "replays": step.graphs.replays}


@cases.case(default=False)
def case_subgroup(ctx):
    """Ranks split into pairs; each pair agrees over its own group (world 4)."""
    import torch.distributed as dist

    pairs = [dist.new_group([r, r + 1]) for r in range(0, ctx.world, 2)]
    mine = pairs[ctx.rank // 2]
    pair_index = ctx.rank // 2
    kernel = make_kernel()
    # pair 0 prefers config 0, pair 1 prefers config 2; within a pair ranks disagree on the runner-up
    table = {0: {0: 1.0, 1: 2.0 + ctx.rank, 2: 4.0}, 1: {0: 4.0, 1: 2.0 + ctx.rank, 2: 1.0}}[pair_index % 2]
    x = torch.randn(96, device=ctx.device)

    # each pair its own winner store: a pair that finds the other's stored winner would load it, not tune
    @disttune.contextual_autotune(**tuner_options(ctx, f"subgroup-{pair_index}", group=mine,
                                                  timer=TableTimer(lambda i: table[i.config_index])))
    def step():
        y = torch.empty_like(x)
        launch_add(kernel, x, y)
        return y

    step()
    return {"pair": pair_index, "winners": winners_of(step), "world_in_report": step.report.world_size}


def _store_case(ctx, name: str) -> dict:
    """Tune (or load) one site with a per-rank winner store: only rank 0's directory gets the file."""
    kernel = make_kernel(blocks=(16, 32, 64))
    timer = TableTimer(lambda info: {0: 3.0, 1: 1.0, 2: 2.0}[info.config_index])
    runs = {"n": 0}
    x = torch.randn(128, device=ctx.device)
    cache_dir = os.path.join(os.environ["DISTTUNE_TEST_STORE"], f"rank{ctx.rank}")

    @disttune.contextual_autotune(**tuner_options(ctx, name, timer=timer, cache_dir=cache_dir))
    def step():
        runs["n"] += 1
        sum_across_ranks(ctx, 1.0)  # a user collective: every rank must run step equally often
        y = torch.full_like(x, float("nan"))
        launch_add(kernel, x, y)
        return y

    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = step()
    (result,) = step.report.results
    return {"runs": runs["n"], "source": result.source, "winner": result.winner, "timed": len(timer.seen),
            "output_ok": bool(torch.equal(y, x + 32)), "warnings": [str(w.message) for w in caught]}


@cases.case(default=False)
def case_store(ctx):
    return _store_case(ctx, "store")


@cases.case(default=False)
def case_pinned(ctx):
    """Every rank runs with the pinned table named by DISTTUNE_PINNED: no tuning at all."""
    return _store_case(ctx, "pinned")


@cases.case(default=False)
def case_pinned_mismatch(ctx):
    """Even ranks load one pinned table, odd ranks another: an error on every rank, before any tuning."""
    table = os.path.join(os.environ["DISTTUNE_TEST_TABLES"], f"table{ctx.rank % 2}.json")
    return _tune_once(ctx, "pinned_mismatch", make_kernel(blocks=(16, 32, 64)), torch.randn(128, device=ctx.device),
                      pinned=table)


SPLIT_TABLE = [5.0, 4.0, 6.0, 1.5, 3.0, 2.0, 7.0, 2.5, 9.0]  # ms per config of the split cases (9 configs)


def split_kernel():
    """9 distinct configs (3 block sizes x 3 warp counts) of add_block: not a multiple of 2, 4 or 8 ranks."""
    import triton
    from tiny_kernels import add_block

    configs = [triton.Config({"BLOCK": b}, num_warps=w) for b in (16, 32, 64) for w in (1, 2, 4)]
    return triton.autotune(configs, key=["n"])(add_block)


def _split_case(ctx, name: str, kernel=None, **options) -> dict:
    """A split site beside a user collective; each rank's time is the table's plus 0.01 ms * rank."""
    kernel = kernel or split_kernel()
    timer = TableTimer(lambda info: SPLIT_TABLE[info.config_index] + 0.01 * ctx.rank)
    runs = {"n": 0}
    x = torch.randn(100, device=ctx.device)

    @disttune.contextual_autotune(**tuner_options(ctx, name, timer=timer, split=True, **options))
    def step():
        runs["n"] += 1
        y = torch.full_like(x, float("nan"))
        launch_add(kernel, x, y)
        sum_across_ranks(ctx, 1.0)  # a user collective: every rank must run step equally often
        return y

    y = step()
    (result,) = step.report.results
    return {"runs": runs["n"], "function_runs": step.report.function_runs, "winner": result.winner,
            "source": result.source, "split": result.split, "agreed_ms": list(result.agreed_ms),
            "per_rank_ms": [["nan" if t != t else t for t in row] for row in result.per_rank_ms],
            "timed": [i.config_index for i in timer.seen],
            "output_ok": bool(torch.equal(y, x + result.config.kwargs["BLOCK"]))}


@cases.case
def case_split(ctx):
    """split=True: in each slot rank r runs config j*w + r; every rank computes the owner-time winner."""
    return _split_case(ctx, "split")


@cases.case
def case_split_early(ctx):
    """split with early stopping: screening and the full stage are both divided among the ranks."""
    return _split_case(ctx, "split_early", early_stop=True)


@cases.case
def case_split_store(ctx):
    """A split tuning writes the store; a fresh kernel over the same configs then loads it, tuning nothing."""
    first = _split_case(ctx, "split_store")
    second = _split_case(ctx, "split_store")
    return {"first": first, "second": second}


@cases.case
def case_split_compile_fault(ctx):
    """BLOCK >= 64 fails to compile on rank 1 only; rank 1 times none of them, so the final run must catch it."""
    return _compile_fault_case(ctx, lambda rank: 64 if rank == 1 else 1024, blocks=(16, 32, 64, 128),
                               name="split_compile_fault", split=["add_block_limited"])


@cases.case
def case_function(ctx):
    """disttune.autotune over gloo/MPI: each rank alone prefers its own config, max picks the last."""
    space = [{"chunks": c} for c in range(ctx.world + 1)]
    timer = TableTimer(lambda info: disagreement_times(ctx.rank, ctx.world, info.config_index))
    calls = []

    @disttune.autotune(space, key_fn=lambda x: (x.shape[0],), n_warmup=1, n_repeat=2, timer=timer,
                       comm=ctx.mpi if ctx.use_mpi else None,
                       cache_dir=os.path.join(ctx.work_dir, "store", "function"))
    def scaled(x, *, chunks):
        calls.append(chunks)
        return x * (chunks + 1) + sum_across_ranks(ctx, 0.0)

    x = torch.ones(4, device=ctx.device)
    out = scaled(x)
    return {"winner": scaled.last_timings["winner"], "agreed_ms": scaled.last_timings["agreed_ms"],
            "calls": len(calls), "out": out.tolist(), "first": scaled(x, autotune=False).tolist()}


@cases.case
def case_function_split(ctx):
    """split=True: rank r times configs r, r+w, ...; each config's time is its owner's."""
    space = [{"variant": v} for v in range(2 * ctx.world + 1)]
    table = [5.0, 4.0, 6.0, 1.5, 3.0, 2.0, 7.0, 8.0, 9.0][: len(space)]
    timer = TableTimer(lambda info: table[info.config_index] + 0.01 * ctx.rank)
    calls = []

    @disttune.autotune(space, key_fn=lambda x: x.numel(), n_warmup=1, n_repeat=2, timer=timer, split=True,
                       comm=ctx.mpi if ctx.use_mpi else None,
                       cache_dir=os.path.join(ctx.work_dir, "store", "function_split"))
    def pick(x, *, variant):
        calls.append(variant)
        return variant

    winner = pick(torch.ones(5))
    return {"winner": winner, "timed": sorted({i.config_index for i in timer.seen}),
            "agreed_ms": pick.last_timings["agreed_ms"], "calls": len(calls), "table": table}


@cases.case(default=False)
def case_function_subgroup(ctx):
    """disttune.autotune agreeing over pairs of ranks (autotune_pg)."""
    import torch.distributed as dist

    pairs = [dist.new_group([r, r + 1]) for r in range(0, ctx.world, 2)]
    pair = ctx.rank // 2
    table = {0: {0: 1.0, 1: 2.0 + ctx.rank, 2: 4.0}, 1: {0: 4.0, 1: 2.0 + ctx.rank, 2: 1.0}}[pair % 2]

    @disttune.autotune([{"variant": v} for v in range(3)], key_fn=lambda x: x.numel(), n_warmup=0, n_repeat=1,
                       timer=TableTimer(lambda i: table[i.config_index]),
                       cache_dir=os.path.join(ctx.work_dir, "store", f"function_pair{pair}"))
    def pick(x, *, variant):
        return variant

    winner = pick(torch.ones(3), autotune_pg=pairs[pair])
    return {"pair": pair, "winner": winner}


def _compile_fault_case(ctx, limit_for_rank, blocks=(16, 32, 64), name: str = "compile_fault", **tuner) -> dict:
    """The kernel's static assertion fails for BLOCK >= LIMIT; LIMIT differs per rank. The fake
    timer makes later configs faster (3, 2, 1, 0.5 ms), so a config that fails somewhere would win."""
    from tiny_kernels import add_block_limited, grid

    kernel = make_kernel(add_block_limited, blocks=blocks)
    table = [3.0, 2.0, 1.0, 0.5]
    timer = TableTimer(lambda info: table[info.config_index])
    runs = {"n": 0}
    x = torch.randn(128, device=ctx.device)
    limit = limit_for_rank(ctx.rank)

    @disttune.contextual_autotune(**tuner_options(ctx, name, timer=timer, store=False, **tuner))
    def step():
        runs["n"] += 1
        y = torch.full_like(x, float("nan"))
        kernel[grid(128)](x, y, 128, LIMIT=limit)
        sum_across_ranks(ctx, 1.0)
        return y

    y = step()
    (result,) = step.report.results
    return {"runs": runs["n"], "function_runs": step.report.function_runs, "winner": result.winner,
            "agreed_ms": list(result.agreed_ms), "timed": sorted({i.config_index for i in timer.seen}),
            "output_ok": bool(torch.equal(y, x + result.config.kwargs["BLOCK"]))}


@cases.case
def case_compile_fault_one_rank(ctx):
    return _compile_fault_case(ctx, lambda rank: 64 if rank == 1 else 1024)  # BLOCK 64 fails on rank 1


@cases.case
def case_compile_fault_all_ranks(ctx):
    return _compile_fault_case(ctx, lambda rank: 64)


@cases.case
def case_compile_fault_every_config_one_rank(ctx):
    return _compile_fault_case(ctx, lambda rank: 16 if rank == 0 else 1024)


@cases.case
def case_compile_split(ctx):
    """``compile_split=True`` over 5 configs: which configs each rank compiled before and after the consensus.

    On GPUs the real compiler runs, wrapped to record each call. Under the interpreter nothing is
    compiled, so a recording stand-in takes the compiler's place (its only job: say which configs were
    asked for, when). It fails BLOCK 64 on every rank but the one whose share holds it, as a compile
    fault would; so only a failure recorded in the second pass keeps BLOCK 64 (the fastest in the fake
    timer's table) from winning."""
    from disttune import compile as compiling

    blocks = (16, 32, 64, 128, 256)
    owner_of_64 = (2 - 1) % ctx.world
    kernel = make_kernel(blocks=blocks)
    table = [5.0, 2.0, 1.0, 3.0, 4.0]
    timer = TableTimer(lambda info: table[info.config_index])
    calls: list = []
    real_precompile, real_can = compiling.precompile, compiling.can_precompile
    interpreted = not torch.cuda.is_available()

    def recording_precompile(autotuner, args, kwargs, config, device):
        started = time.monotonic()
        try:
            if interpreted:
                time.sleep(0.05 + 0.1 * ctx.rank)  # later ranks compile slower: only a collective keeps the order
                if config.kwargs["BLOCK"] == 64 and ctx.rank != owner_of_64:
                    raise RuntimeError("injected compile fault for BLOCK 64")
                return None
            return real_precompile(autotuner, args, kwargs, config, device)
        finally:
            calls.append((config.kwargs["BLOCK"], started, time.monotonic()))

    compiling.precompile = recording_precompile
    if interpreted:
        compiling.can_precompile = lambda autotuner: True
    x = torch.randn(256, device=ctx.device)
    try:
        @disttune.contextual_autotune(**tuner_options(ctx, "compile_split", timer=timer, store=False,
                                                          compile_threads=2, compile_split=True))
        def step():
            y = torch.full_like(x, float("nan"))
            launch_add(kernel, x, y)
            return y

        y = step()
    finally:
        compiling.precompile, compiling.can_precompile = real_precompile, real_can
    (result,) = step.report.results
    mine = [blocks[0]] + [b for i, b in enumerate(blocks) if i >= 1 and (i - 1) % ctx.world == ctx.rank]
    share = [c for c in calls if c[0] in mine]
    rest = [c for c in calls if c[0] not in mine]
    return {"share": sorted(c[0] for c in share), "rest": sorted(c[0] for c in rest), "expected_share": mine,
            "share_ended": max(c[2] for c in share), "rest_started": min((c[1] for c in rest), default=float("inf")),
            "winner_block": result.config.kwargs["BLOCK"], "agreed_ms": list(result.agreed_ms),
            "per_rank_ms_64": [row[2] for row in result.per_rank_ms],
            "output_ok": bool(torch.equal(y, x + result.config.kwargs["BLOCK"])), "interpreted": interpreted}


def _raise_at(ctx, name: str, failing_run: int) -> dict:
    kernel = make_kernel()
    runs = {"n": 0}
    x = torch.randn(64, device=ctx.device)

    @disttune.contextual_autotune(**tuner_options(ctx, name, timer=TableTimer(lambda i: 1.0), store=False))
    def step():
        runs["n"] += 1
        y = torch.empty_like(x)
        launch_add(kernel, x, y)
        sum_across_ranks(ctx, 1.0)
        if ctx.rank == ctx.world - 1 and runs["n"] == failing_run:
            raise RuntimeError(f"injected failure in run {failing_run}")
        return y

    step()
    return {"unexpected": "no error"}


@cases.case
def case_raise_first_run(ctx):
    return _raise_at(ctx, "raise_first_run", 1)


@cases.case
def case_raise_last_config(ctx):
    return _raise_at(ctx, "raise_last_config", 2 + 2 * 3)  # a run of the last of 3 configs (1 warm-up + 2)


@cases.case(breaks_group=True, default=False)
def case_rank_killed(ctx):
    """The last rank dies (SIGKILL) in the middle of tuning: the others raise within the timeout."""
    import signal

    kernel = make_kernel()
    runs = {"n": 0}
    x = torch.randn(64, device=ctx.device)

    @disttune.contextual_autotune(**tuner_options(ctx, "rank_killed", timer=TableTimer(lambda i: 1.0), store=False,
                                                      timeout_s=5))
    def step():
        runs["n"] += 1
        if ctx.rank == ctx.world - 1 and runs["n"] == 4:
            os.kill(os.getpid(), signal.SIGKILL)
        y = torch.empty_like(x)
        launch_add(kernel, x, y)
        return y

    step()  # the record's elapsed_s says how soon the survivors raised
    return {"unexpected": "no error"}


def _store_host_killed(ctx, tuner: str) -> dict:
    """Rank 0, which hosts the rendezvous store when no torchrun agent does, dies (SIGKILL) in tuning run 2; it
    leaves the time of the kill in ``killed_at``. The survivors say how their tuning call ended, and when."""
    import signal

    marker = Path(ctx.work_dir) / "killed_at"
    runs = {"n": 0}

    def run() -> None:
        runs["n"] += 1  # the contextual tuner's discovery run, then tuning runs; the function tuner's tuning runs
        if ctx.rank == 0 and runs["n"] == (3 if tuner == "contextual" else 2):
            marker.write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)

    options = dict(timer=TableTimer(lambda i: 1.0), store=False, timeout_s=30)
    if tuner == "contextual":
        kernel, x = make_kernel(), torch.randn(64, device=ctx.device)

        @disttune.contextual_autotune(**tuner_options(ctx, "store_host_killed", **options))
        def step():
            run()
            y = torch.empty_like(x)
            launch_add(kernel, x, y)
            return y
    else:
        @disttune.autotune([{"variant": v} for v in range(3)], key_fn=lambda: 0, n_warmup=1, n_repeat=1, **options)
        def step(*, variant):
            run()
            return variant

    try:
        step()
        return {"ended": "returned"}
    except Exception as err:  # noqa: BLE001 - the test reads what each survivor raised
        return {"ended": "raised", "raised": type(err).__name__, "error": str(err), "ended_at": time.time(),
                "chained": type(err.__cause__).__name__ if err.__cause__ is not None else None}


@cases.case(breaks_group=True, default=False)
def case_store_host_killed_contextual(ctx):
    return _store_host_killed(ctx, "contextual")


@cases.case(breaks_group=True, default=False)
def case_store_host_killed_function(ctx):
    return _store_host_killed(ctx, "function")


@cases.case(default=False)
def case_soak(ctx):
    """200 tunings of a small AG-GEMM-like step with random per-rank timing noise: winners always agree."""
    import random
    import resource

    rng = random.Random(1000 + ctx.rank)
    disagreements, rss, fds, tunings, noisy = 0, [], [], 0, 0
    x = torch.randn(96, device=ctx.device)
    for trial in range(int(os.environ.get("DISTTUNE_SOAK_TRIALS", "200"))):
        kernel = make_kernel()
        base = {0: 1.0, 1: 1.05, 2: 1.1}

        @disttune.contextual_autotune(**tuner_options(ctx, "soak", n_warmup=0, n_repeat=1, store=False,
                                                          timer=TableTimer(lambda i: base[i.config_index]
                                                                           * rng.uniform(0.8, 1.25))))
        def step():
            full = torch.empty(x.numel() * ctx.world, device=ctx.device)
            if ctx.use_mpi:
                full.copy_(torch.from_numpy(np.concatenate(ctx.mpi.allgather(x.cpu().numpy()))))
            else:
                torch.distributed.all_gather(list(full.chunk(ctx.world)), x)
            y = torch.empty_like(full)
            launch_add(kernel, full, y)
            return y

        step()
        tunings += 1
        winners = ctx.all_gather_object(step.report.results[0].winner)
        disagreements += len(set(winners)) != 1
        noisy += len({tuple(row) for row in step.report.results[0].per_rank_ms}) > 1  # the noise reached the times
        if trial in (20, 199):
            rss.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
            fds.append(len(os.listdir("/proc/self/fd")))
    return {"disagreements": disagreements, "rss_kb": rss, "fds": fds, "tunings": tunings, "noisy": noisy}


@cases.case(breaks_group=True, default=False)
def case_timeout(ctx):
    """Rank 1 never calls the wrapped function: rank 0 must raise CollectiveTimeout quickly."""
    kernel = make_kernel()
    x = torch.randn(64, device=ctx.device)

    @disttune.contextual_autotune(**tuner_options(ctx, "timeout", timer=TableTimer(lambda i: 1.0), timeout_s=3))
    def step():
        y = torch.empty_like(x)
        launch_add(kernel, x, y)
        return y

    if ctx.rank == 1:
        time.sleep(8)
        return {"skipped": True}
    step()  # raises CollectiveTimeout; the record's elapsed_s says how soon
    return {"unexpected": "no error"}


if __name__ == "__main__":
    sys.exit(cases.main())
