"""Benchmark: AllGather-GEMM and GEMM-ReduceScatter against NCCL + cuBLAS and torch's fused ops.

    torchrun --nproc_per_node=2 bench/ag_gemm.py [--shapes square,llama] [--rounds 10] [--streams 1,2]
                                                  [--timeline] [--host-profile] [--out ag_gemm.jsonl]

Per shape (totals over the ranks; bf16; B the transpose of a row-major weight, ``nn.Linear``'s layout, for
every contender), all measured in this run, **interleaved**: each round times every contender once, in an
order that rotates from round to round (``disttune.benchmark.interleaved``), so a drift of the machine hits
all alike. Every time is a round's slowest rank; the tables give the median over the rounds with the
spread (lowest-highest) beside it.

* AG-GEMM: NCCL ``all_gather_into_tensor`` alone, cuBLAS alone (``[M, K] @ [K, N/w]``), the sequential form
  (all_gather then cuBLAS), ``torch.ops.symm_mem.fused_all_gather_matmul``, ours: the decomposed design for
  each ``--streams`` value and the fused design, each tuned in context with ``contextual_autotune`` and
  timed twice, as the wrapped step and as its kernels called bare with the same winners (the wrapped
  step must cost what its kernels cost); the decomposed schedule with cuBLAS per shard (what the
  transport gives a perfect GEMM); the decomposed kernel tuned alone by stock ``triton.autotune`` on each
  rank, timed in the step; and the overlap limit ``max(GEMM alone, all_gather alone)``.
* GEMM-RS: cuBLAS alone (``[M, K/w] @ [K/w, N]``), NCCL ``reduce_scatter_tensor`` alone, the sequential form,
  ``torch.ops.symm_mem.fused_matmul_reduce_scatter``, ours: the decomposed design per ``--streams`` and
  ``--rs-launches`` value and the fused design per ``--streams`` and ``--rs-chunks`` value (wrapped and bare),
  the overlap limit.

Two modes: *steady state* (10 calls back to back between two CUDA events, per call: the host runs ahead, as
in a model) and *one call from an idle GPU* (each call after a device sync and a barrier: host launch latency
included). The host column is the time the host took to issue a call: close to the GPU time means the step
runs at the host's pace. ``--timeline`` prints, per rank, where one steady-state call of ours spends its GPU
time (``kernels.symm.Timeline``); ``--host-profile`` where the bare calls of ours spend the host's (cProfile).
Rank 0 prints markdown; ``--out FILE`` appends one JSON line per shape and workload (with device, versions and
date).

Cost per shape: ~15 contenders x (3 + 2 x ``--rounds`` x 10 calls), plus the tuning of each of ours (seconds).
GPUs only (NCCL, symmetric memory).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Callable

import torch
import torch.distributed as dist

import disttune
from disttune import benchmark
from disttune import dist as dt_dist
from disttune.benchmark import Spread, rel_error
from disttune.kernels.ag_gemm import AllGatherGEMM
from disttune.kernels.gemm_rs import GemmReduceScatter
from disttune.kernels.shard_gemm import make_shard_gemm_kernel, shard_gemm
from disttune.kernels.symm import Timeline

SHAPES = {"square": (8192, 8192, 8192, 8192, 8192), "llama": (8192, 8192, 28672, 28672, 8192)}
# name -> (M, K_ag, N_ag, K_rs, N_rs): AG-GEMM [M, K_ag] x [K_ag, N_ag]; GEMM-RS [M, K_rs] x [K_rs, N_rs]

Step = Callable[[], object]


def tuned_in_context(fn: Step, store: str) -> tuple[disttune.ContextualAutotuner, float, list]:
    """``fn`` wrapped and tuned (its first call): (the wrapped step, seconds the tuning call took, winners)."""
    wrapped = disttune.contextual_autotune(is_dist=True, n_warmup=3, n_repeat=5, cache_dir=store, verbose=False)(fn)
    started = time.perf_counter()
    wrapped()
    seconds = time.perf_counter() - started
    return wrapped, seconds, [disttune.describe_config(r.config) for r in wrapped.report.results]


class Contest:
    """The contenders of one workload and shape, what each was checked against, and its tuning facts."""

    def __init__(self, want: torch.Tensor) -> None:
        self.steps: dict[str, Step] = {}
        self.facts: dict = {}
        self.want = want
        self.ours: list[str] = []  # contenders that are ours (their per-rank medians are printed)
        self.timelines: dict[str, object] = {}  # contender -> the op whose .timeline marks one call

    def add(self, name: str, step: Step) -> None:
        self.steps[name] = step

    def add_if_it_runs(self, name: str, step: Step) -> None:
        """``name`` if one call of ``step`` succeeds here (torch's fused ops need symmetric memory at this
        world size); otherwise the reason goes into the facts and the tables leave it out."""
        try:
            step()
        except Exception as err:  # noqa: BLE001 - a contender that cannot run here is reported, not fatal
            self.facts[name] = {"error": f"{type(err).__name__}: {err}"[:200]}
        else:
            self.steps[name] = step

    def add_ours(self, name: str, op, call: Callable[[], torch.Tensor], out: torch.Tensor, store: str) -> None:
        """``name`` (the wrapped step, tuned here) and ``name + ", bare"`` (its kernels with the winners,
        called without the wrapper); checks the wrapped step's output against the reference."""
        wrapped, seconds, winners = tuned_in_context(call, store)
        self.steps[name] = wrapped
        self.steps[name + ", bare"] = call
        out.fill_(float("nan"))
        wrapped()
        self.facts[name] = {"tuning_s": round(seconds, 2), "winners": winners, "rel_err": rel_error(out, self.want)}
        self.ours += [name, name + ", bare"]
        self.timelines[name] = op


def bench_ag(name: str, M: int, K: int, N: int, args, rank: int, world: int, group_name: str, store: str) -> tuple:
    dtype, dev = torch.bfloat16, torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device="cpu").manual_seed(rank)
    a_shard = torch.randn(M // world, K, generator=g).to(dev, dtype)
    b_local = (torch.randn(N // world, K, generator=g) / K ** 0.5).to(dev, dtype).t()
    a_full = torch.empty(M, K, device=dev, dtype=dtype)
    c = torch.empty(M, N // world, device=dev, dtype=dtype)

    def sequential():
        dist.all_gather_into_tensor(a_full, a_shard)
        return torch.matmul(a_full, b_local, out=c)

    contest = Contest(sequential().clone())
    contest.add("NCCL all-gather", lambda: dist.all_gather_into_tensor(a_full, a_shard))
    contest.add("cuBLAS", lambda: torch.matmul(a_full, b_local, out=c))
    contest.add("sequential", sequential)
    fused_op = getattr(torch.ops.symm_mem, "fused_all_gather_matmul", None)
    if fused_op is not None:
        contest.add_if_it_runs("torch fused", lambda: fused_op(a_shard, [b_local], gather_dim=0,
                                                               group_name=group_name))
    for streams in args.streams:
        op = AllGatherGEMM(design="decomposed", streams=streams)
        out = torch.empty_like(c)
        contest.add_ours(f"ours decomposed, {streams} stream(s)", op, lambda op=op, out=out: op(a_shard, b_local, out),
                         out, os.path.join(store, f"ag-decomposed-{streams}"))
    op = AllGatherGEMM(design="fused", chunks=args.chunks)
    out = torch.empty_like(c)
    contest.add_ours("ours fused", op, lambda: op(a_shard, b_local, out), out, os.path.join(store, "ag-fused"))
    cublas_op = AllGatherGEMM(design="decomposed", gemm="cublas")
    out_cublas = torch.empty_like(c)
    contest.add("ours decomposed, cuBLAS per shard", lambda: cublas_op(a_shard, b_local, out_cublas))
    # The decomposed kernel tuned alone: stock triton.autotune on the local shard's GEMM, on each rank separately.
    alone = make_shard_gemm_kernel()
    shard_gemm(a_shard, b_local, torch.empty(M // world, N // world, device=dev, dtype=dtype), (M // world,), 0,
               kernel=alone)
    per_rank: list = [None] * world
    dist.all_gather_object(per_rank, disttune.describe_config(alone.best_config))
    pinned = AllGatherGEMM(design="decomposed", kernel=make_shard_gemm_kernel([alone.best_config]))
    out_alone = torch.empty_like(c)
    contest.add("ours decomposed, winner tuned alone", lambda: pinned(a_shard, b_local, out_alone))
    contest.facts["ours decomposed, winner tuned alone"] = {"winners": per_rank}
    return contest, ("NCCL all-gather", "cuBLAS")


def bench_rs(name: str, M: int, K: int, N: int, args, rank: int, world: int, group_name: str, store: str) -> tuple:
    dtype, dev = torch.bfloat16, torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device="cpu").manual_seed(10 + rank)
    a_local = torch.randn(M, K // world, generator=g).to(dev, dtype)
    b_local = (torch.randn(N, K // world, generator=g) / K ** 0.5).to(dev, dtype).t()
    partial = torch.empty(M, N, device=dev, dtype=dtype)
    out = torch.empty(M // world, N, device=dev, dtype=dtype)

    def sequential():
        torch.matmul(a_local, b_local, out=partial)
        dist.reduce_scatter_tensor(out, partial)
        return out

    contest = Contest(sequential().clone())
    contest.add("cuBLAS", lambda: torch.matmul(a_local, b_local, out=partial))
    contest.add("NCCL reduce-scatter", lambda: dist.reduce_scatter_tensor(out, partial))
    contest.add("sequential", sequential)
    fused_op = getattr(torch.ops.symm_mem, "fused_matmul_reduce_scatter", None)
    if fused_op is not None:
        contest.add_if_it_runs("torch fused", lambda: fused_op(a_local, b_local, "sum", 0, group_name))
    ours = [(f"ours decomposed, {streams} stream(s), last partial in {launches}", f"rs-{streams}-{launches}",
             GemmReduceScatter(design="decomposed", streams=streams, last_launches=launches))
            for streams in args.streams for launches in args.rs_launches]
    fused = [(streams, chunks, GemmReduceScatter(design="fused", streams=streams, chunks=chunks))
             for streams in args.streams for chunks in args.rs_chunks]
    ours += [(f"ours fused, {streams} stream(s), {op.chunks} piece(s)", f"rs-fused-{streams}-{chunks}", op)
             for streams, chunks, op in fused]
    for name, folder, op in ours:
        mine = torch.empty_like(out)
        contest.add_ours(name, op, lambda op=op, mine=mine: op(a_local, b_local, mine), mine,
                         os.path.join(store, folder))
    return contest, ("NCCL reduce-scatter", "cuBLAS")


def timeline_of(op, step: Step, rank: int, world: int) -> list:
    """Every rank's marks of one call in steady state (two calls before it, back to back), ms after its start."""
    step()
    step()
    op.timeline = Timeline()
    step()
    marks = op.timeline.read()
    op.timeline = None
    everyone: list = [None] * world
    dist.all_gather_object(everyone, marks)
    return everyone


def host_profile(step: Step, world: int) -> dict:
    """Where one of ours spends the host's time: every rank's host ms per call under cProfile (an upper bound)
    and rank 0's table of its functions by own time (20 calls back to back)."""
    host_ms, table = benchmark.cprofile(step, calls=20, top=20)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, host_ms)
    return {"host_ms": [round(ms, 3) for ms in everyone], "table": table}


def measure(contest: Contest, limit_of: tuple, args, rank: int, world: int) -> dict:
    """Steady state and one call from idle, interleaved; the limit; the timelines (``--timeline``); the host
    profiles (``--host-profile``)."""
    steady = benchmark.interleaved(contest.steps, rounds=args.rounds, calls=10)
    idle = benchmark.interleaved(contest.steps, rounds=args.rounds * 2, calls=1, warmup=1)
    row: dict = {"steady": {k: spread_row(v) for k, v in steady.items()},
                 "idle": {k: spread_row(v) for k, v in idle.items()}, "facts": contest.facts}
    for mode, spreads in (("steady", steady), ("idle", idle)):
        row[mode]["limit"] = max(spreads[k].median for k in limit_of)
    if args.timeline:
        row["timelines"] = {name: timeline_of(op, contest.steps[name], rank, world)
                            for name, op in contest.timelines.items()}
    if args.host_profile:
        row["host_profiles"] = {name + ", bare": host_profile(contest.steps[name + ", bare"], world)
                                for name in contest.ours[::2]}
    row["spreads"] = {"steady": steady, "idle": idle}
    return row


def spread_row(spread: Spread) -> dict:
    return {"median": spread.median, "low": spread.low, "high": spread.high, "per_rank": list(spread.per_rank),
            "host": spread.host}


def print_workload(title: str, row: dict, ours: list[str]) -> None:
    for mode, what in (("steady", "steady state, 10 calls back to back, per call"),
                       ("idle", "one call from an idle GPU")):
        spreads, limit = row["spreads"][mode], row[mode]["limit"]
        sequential, fused = spreads["sequential"].median, spreads.get("torch fused")
        print(f"\n#### {title}: {what} (ms, median [lowest-highest] over rounds of the slowest rank)\n")
        print("| contender | ms | host ms | / limit | vs sequential | vs torch fused | per-rank medians |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
        for name, spread in spreads.items():
            ranks = " / ".join(f"{v:.3f}" for v in spread.per_rank) if name in ours else ""
            versus = f"{fused.median / spread.median:.2f}x" if fused is not None else "n/a"
            print(f"| {name} | {spread.text()} | {spread.host:.3f} | {spread.median / limit:.3f} | "
                  f"{sequential / spread.median:.2f}x | {versus} | {ranks} |")
        print(f"| overlap limit | {limit:.3f} | | 1.000 | {sequential / limit:.2f}x | | |")
        for name in ours[::2]:  # the wrapped step against its kernels called bare
            print(f"wrapped / bare, {name}: {spreads[name].median / spreads[name + ', bare'].median:.3f}")
    for name, facts in row["facts"].items():
        print(f"{name}: {json.dumps(facts)}")
    for name, ranks in row.get("timelines", {}).items():
        print(f"\ntimeline of one steady-state call, {name} (ms after the call's first mark on that rank):")
        for r, marks in enumerate(ranks):
            print(f"  rank {r}: " + "; ".join(f"{label} {ms:.3f}" for label, ms in marks))
    for name, profile in row.get("host_profiles", {}).items():
        print(f"\nhost profile of {name}: ms per call under cProfile, per rank {profile['host_ms']}; rank 0:")
        print(profile["table"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="square,llama")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds (one call from idle: twice that)")
    parser.add_argument("--only", choices=["ag", "rs", "both"], default="both")
    parser.add_argument("--chunks", type=int, default=1, help="fused AG-GEMM: flagged pieces per pushed shard")
    parser.add_argument("--streams", default="1,2", help="copy streams, a comma-separated list: one contender each")
    parser.add_argument("--rs-launches", default="2",
                        help="GEMM-RS: GEMMs the last partial is computed in, a comma-separated list: one contender each")
    parser.add_argument("--rs-chunks", default="default",
                        help="fused GEMM-RS: flagged pieces per partial, a comma-separated list of counts or 'default' "
                             "(GemmReduceScatter's): one contender each")
    parser.add_argument("--timeline", action="store_true", help="print where one call of ours spends GPU time")
    parser.add_argument("--host-profile", action="store_true",
                        help="print where the host's time goes in the bare calls of ours (cProfile)")
    parser.add_argument("--out", default=None, help="append the rows as JSON lines to this file (rank 0)")
    args = parser.parse_args()
    args.streams = [int(s) for s in args.streams.split(",")]
    args.rs_launches = [int(s) for s in args.rs_launches.split(",")]
    args.rs_chunks = [None if s == "default" else int(s) for s in args.rs_chunks.split(",")]
    if not torch.cuda.is_available():
        sys.exit("bench/ag_gemm.py needs CUDA GPUs (NCCL, symmetric memory); CPU runs of AllGatherGEMM are in tests/")
    benchmark.stacks_on_termination()
    info = dt_dist.init()
    rank, world = info.rank, info.world_size
    group = dist.group.WORLD
    import torch.distributed._symmetric_memory as symm_mem

    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        symm_mem.enable_symm_mem_for_group(group.group_name)
    store = tempfile.mkdtemp(prefix=f"disttune-bench-r{rank}-")
    rows = []
    device = torch.cuda.get_device_name()
    for name in args.shapes.split(","):
        M, K_ag, N_ag, K_rs, N_rs = SHAPES[name]
        workloads = []
        if args.only in ("ag", "both"):
            workloads.append(("AG-GEMM", (M, K_ag, N_ag), bench_ag(name, M, K_ag, N_ag, args, rank, world,
                                                                    group.group_name, store)))
        if args.only in ("rs", "both"):
            workloads.append(("GEMM-RS", (M, K_rs, N_rs), bench_rs(name, M, K_rs, N_rs, args, rank, world,
                                                                    group.group_name, store)))
        for workload, (m, k, n), (contest, limit_of) in workloads:
            row = measure(contest, limit_of, args, rank, world)
            if rank == 0:
                print_workload(f"{world} x {device}, {workload} {m}x{k}x{n} bf16", row, contest.ours)
            row.pop("spreads")
            rows.append({"bench": workload, "shape": name, "M": m, "K": k, "N": n, "world": world, **row})
    if rank == 0:
        written = benchmark.append_rows(args.out, rows)
        if written:
            print(f"\nrows appended to {written}")
    dt_dist.destroy()


if __name__ == "__main__":
    main()
