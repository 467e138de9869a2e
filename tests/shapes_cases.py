"""Multi-rank cases for shapes met after tuning (``on_new_key``), run under torchrun or mpiexec (``--mpi``).

    python tests/shapes_cases.py CASE [CASE ...] [--out DIR] [--mpi]

``test_shapes_dist.py`` launches this file and asserts on the records (see ``rank_cases``).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from rank_cases import Cases, Ranks

import torch  # noqa: E402

import disttune  # noqa: E402
from dist_cases import sum_across_ranks, tuner_options  # noqa: E402
from tiny_kernels import TableTimer, launch_add, make_kernel  # noqa: E402

cases = Cases(__doc__)

TIMES = {0: 3.0, 1: 1.0, 2: 2.0}  # config 1 (BLOCK=32) wins every tuning


def _serving(ctx: Ranks, case: str, sizes_of_call, calls: int, **options) -> dict:
    """Tune on size 64, then serve ``calls`` calls whose size ``sizes_of_call(call, rank)`` gives; every call
    also runs the user's own all-reduce. Returns what each call took and whether it was right."""
    kernel = make_kernel()
    timer = TableTimer(lambda info: TIMES[info.config_index])

    @disttune.contextual_autotune(**tuner_options(ctx, case, timer=timer, **options))
    def step(x):
        y = torch.empty_like(x)
        launch_add(kernel, x, y)
        return y, sum_across_ranks(ctx, float(x.numel()))

    step(torch.randn(64, device=ctx.device))
    timed_after_first_tuning = len(timer.seen)
    slowest, wrong, totals_ok = 0.0, [], True
    for call in range(calls):
        sizes = [sizes_of_call(call, r) for r in range(ctx.world)]
        x = torch.randn(sizes[ctx.rank], device=ctx.device)
        started = time.monotonic()
        y, total = step(x)
        slowest = max(slowest, time.monotonic() - started)
        if not torch.equal(y, x + 32):
            wrong.append(call)
        totals_ok = totals_ok and total == float(sum(sizes))
    return {"slowest_call_s": slowest, "wrong_calls": wrong, "own_all_reduce_ok": totals_ok,
            "tuned": step.tuned, "fallbacks": step.fallbacks,
            "tuned_keys": sorted(repr(k) for k in kernel.cache),
            "timed_in_traffic": len(timer.seen) - timed_after_first_tuning}


@cases.case
def one_rank_meets_a_new_size(ctx: Ranks) -> dict:
    """After tuning, rank 1 alone gets size 100 in three calls: it runs on the fallback, nobody stalls."""
    return _serving(ctx, "one_rank_meets_a_new_size",
                    lambda call, rank: 100 if rank == 1 and call in (2, 3, 7) else 64, calls=12, agree_every=4)


@cases.case
def every_rank_meets_a_new_size(ctx: Ranks) -> dict:
    """Every rank gets size 100 in the fifth call: served on the fallback, then tuned at the agreement
    after the eighth."""
    return _serving(ctx, "every_rank_meets_a_new_size",
                    lambda call, rank: 100 if call in (5, 10) else 64, calls=12, agree_every=4)


@cases.case
def a_new_size_that_cannot_be_tuned_keeps_its_fallback(ctx: Ranks) -> dict:
    """Every rank meets size 100, but timing any config at that size fails (the timer raises): the tuning at the
    agreement point fails alike on every rank, the size stays on its fallback and the rank log says so."""
    kernel = make_kernel()

    def table(info):
        if info.key[0] == 100:
            raise RuntimeError("injected: no config can be timed at size 100")
        return TIMES[info.config_index]

    @disttune.contextual_autotune(**tuner_options(ctx, "untunable_size", timer=TableTimer(table), agree_every=2))
    def step(x):
        y = torch.empty_like(x)
        launch_add(kernel, x, y)
        return y

    step(torch.randn(64, device=ctx.device))
    right = all(torch.equal(y, x + 32) for x in (torch.randn(100, device=ctx.device) for _ in range(8))
                for y in [step(x)])
    notes = [line for line in Path(ctx.work_dir, "logs", "untunable_size", f"rank-{ctx.rank}.log").read_text()
             .splitlines() if "tuning the new keys failed" in line and not line.startswith("{")]
    return {"right": right, "fallbacks": step.fallbacks, "notes": len(notes), "tuned_keys": sorted(map(repr, kernel.cache))}


@cases.case
def nearest_never_tunes_in_traffic(ctx: Ranks) -> dict:
    """``on_new_key="nearest"``: sizes every rank or one rank meets are served, and never tuned."""
    return _serving(ctx, "nearest_never_tunes_in_traffic",
                    lambda call, rank: {3: 100, 5: 48}.get(call, 64) if rank == 0 or call == 3 else 64, calls=8,
                    on_new_key="nearest")


@cases.case
def step_objective_agreed(ctx: Ranks) -> dict:
    """``objective="step"`` over two ranks: each rank's step times differ, the max over ranks decides; the
    launch-level winner (config 0) is the one that slows the step on rank 1."""
    kernel = make_kernel()
    used = {}
    step_ms = {0: {16: 2.0, 32: 3.0, 64: 4.0}, 1: {16: 9.0, 32: 3.5, 64: 4.0}}[min(ctx.rank, 1)]

    def table(info):
        return step_ms[used["block"]] if info.kernel == "<step>" else {0: 1.0, 1: 2.0, 2: 3.0}[info.config_index]

    found = {}
    for objective in ("launch", "step"):
        @disttune.contextual_autotune(**tuner_options(ctx, f"step_objective_{objective}", timer=TableTimer(table),
                                                      objective=objective))
        def step(x):
            y = torch.empty_like(x)
            launch_add(kernel, x, y)
            used["block"] = int(round(float((y - x)[0])))
            return y, sum_across_ranks(ctx, 1.0)

        kernel.cache.clear()
        step(torch.randn(64, device=ctx.device))
        (result,) = step.report.results
        found[objective] = {"winner": result.winner, "agreed_ms": list(result.agreed_ms)}
    return found


@cases.case
def function_tuner_new_sizes(ctx: Ranks) -> dict:
    """``disttune.autotune`` after its first key: rank 1 alone meets size 100 (fallback, no stall), then every
    rank meets size 200 in the same call (tuned at the next agreement)."""
    table = {1: 3.0, 2: 1.0, 4: 2.0}
    timer = TableTimer(lambda info: table[info.config["chunks"]])

    @disttune.autotune([{"chunks": c} for c in (1, 2, 4)], key_fn=lambda x: (x.numel(),), n_warmup=0, n_repeat=1,
                       timer=timer, agree_every=3, comm=ctx.mpi if ctx.use_mpi else None, store=False)
    def scaled(x, *, chunks):
        return x * chunks + sum_across_ranks(ctx, 1.0)

    scaled(torch.ones(64))
    timed = len(timer.seen)
    outputs, slowest = [], 0.0
    for call in range(9):
        n = 100 if (call == 1 and ctx.rank == 1) else 200 if call == 4 else 64
        started = time.monotonic()
        outputs.append(float(scaled(torch.ones(n))[0]))
        slowest = max(slowest, time.monotonic() - started)
    return {"outputs": outputs, "slowest_call_s": slowest, "timed_in_traffic": len(timer.seen) - timed,
            "keys": sorted(scaled.cache), "fallbacks": {repr(k): v[1] for k, v in scaled.fallbacks.items()}}


ARRIVAL_S = 1.0  # how long the emulated copy engine takes to deliver a peer's shard


def _fused_ag_gemm_step(ctx: Ranks, kernel, **options):
    """AllGather-GEMM with the fused design's flag waits, on gloo: the shards are gathered (the user's own
    collective), then a thread standing in for the copy engines writes each peer's shard into the workspace
    ``ARRIVAL_S`` later and raises its flag, while the shipped shard GEMM runs; its tiles wait on the flags."""
    import threading

    from disttune.kernels.shard_gemm import shard_gemm

    rows, K, N = 16, 16, 16
    g = torch.Generator().manual_seed(11 + ctx.rank)
    a_shard = torch.randn(rows, K, generator=g)
    b_local = torch.randn(K, N, generator=g)
    world, rank = ctx.world, ctx.rank
    workspace = torch.empty(world * rows, K)
    flags = torch.zeros(world, dtype=torch.int32)
    out = torch.empty(world * rows, N)

    @disttune.contextual_autotune(**tuner_options(ctx, options.pop("case"), **options))
    def step():
        gathered = [torch.empty_like(a_shard) for _ in range(world)]
        torch.distributed.all_gather(gathered, a_shard)
        workspace.fill_(float("nan"))  # the own rows stay so: the GEMM reads them from a_shard
        flags.zero_()

        def copy_engine() -> None:
            time.sleep(ARRIVAL_S)
            for peer in range(world):
                if peer != rank:
                    workspace[peer * rows:(peer + 1) * rows] = gathered[peer]
                    flags[peer] = 1

        engine = threading.Thread(target=copy_engine)
        engine.start()
        shard_gemm(workspace, b_local, out, [rows] * world, rank, flags=flags, kernel=kernel, epoch=1, own=a_shard)
        engine.join()
        return out.clone()

    return step, a_shard, b_local


@cases.case
def racy_config_scored_out(ctx: Ranks) -> dict:
    """A config of the shipped shard GEMM that skips its flag waits is the fastest and wrong: without check=
    it wins, with check=True it scores inf on every rank and the waiting config wins."""
    from disttune.kernels.matmul import gemm_config
    from disttune.kernels.shard_gemm import make_shard_gemm_kernel, racy_config

    if torch.cuda.is_available():  # the stand-in copy engine is a host thread writing host memory
        return {"skipped": "the racy-config case runs on the CPU (gloo, Triton's interpreter) only"}

    waiting = gemm_config(16, 16, 16, 1, 1, 1)
    found = {}
    for checked in (False, True):
        kernel = make_shard_gemm_kernel([waiting, racy_config(waiting)])
        step, a_shard, b_local = _fused_ag_gemm_step(ctx, kernel, case=f"racy_check_{checked}", n_warmup=0,
                                                     n_repeat=2, check=checked)
        out = step()
        gathered = [torch.empty_like(a_shard) for _ in range(ctx.world)]
        torch.distributed.all_gather(gathered, a_shard)
        right = bool(torch.allclose(out, torch.cat(gathered) @ b_local, rtol=1e-3, atol=1e-3))
        (result,) = step.report.results
        log = "\n".join(p.read_text() for p in Path(step.options.log_dir).glob("rank-*.log"))
        found[str(checked)] = {"winner": result.winner, "agreed_ms": list(result.agreed_ms), "right": right,
                               "log_names_it": "output differs from the reference config's" in log}
    return found


if __name__ == "__main__":
    sys.exit(cases.main())
