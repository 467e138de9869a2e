"""Benchmark: AllGather-GEMM and GEMM-ReduceScatter against NCCL + cuBLAS and torch's fused ops.

    torchrun --nproc_per_node=2 bench/ag_gemm.py [--shapes square,llama] [--samples 30] [--out ag_gemm.jsonl]

Per shape (totals over the ranks; bf16), one table with, all measured in this run:

* AG-GEMM: NCCL ``all_gather_into_tensor`` alone, cuBLAS GEMM alone (``[M, K] @ [K, N/w]``),
  all_gather then cuBLAS, ``torch.ops.symm_mem.fused_all_gather_matmul``, ours (fused and
  decomposed, each tuned in context with ``contextual_autotune``; and decomposed with cuBLAS
  per shard, to separate the transport from the GEMM), and the overlap limit
  ``max(GEMM alone, all_gather alone)``;
* GEMM-RS: cuBLAS alone (``[M, K/w] @ [K/w, N]``), NCCL ``reduce_scatter_tensor`` alone, matmul
  then reduce_scatter, ``torch.ops.symm_mem.fused_matmul_reduce_scatter``, ours, overlap limit;
* tuning in context vs alone: the default (decomposed) AG-GEMM kernel tuned by stock
  ``triton.autotune`` on the local shard's GEMM alone (on each rank separately) and by
  ``contextual_autotune`` inside the overlapped function; both winners timed inside the function.

B is given as the transpose of a row-major weight (``nn.Linear``'s ``[out, in]``), for every
contender. Two times per contender, each the max over ranks of a median (``disttune.benchmark``):
*steady state*, 10 calls back to back between two CUDA events (the host runs ahead, as in a model),
per call; and *one call from an idle GPU*, each sample started after a device sync and a barrier
(host launch latency included). Rank 0 prints the tables as markdown and, with ``--out FILE``, appends one
JSON line per shape and workload (with device, versions and date) to FILE.

Cost: per shape, 13 contenders x (5 + ``--samples`` single calls + 3 + 10 x ``--samples`` / 3
back-to-back calls), plus contextual tuning of two AG-GEMM designs and GEMM-RS (seconds each).
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
from disttune.benchmark import rel_error
from disttune.kernels.ag_gemm import AllGatherGEMM
from disttune.kernels.shard_gemm import make_shard_gemm_kernel, shard_gemm
from disttune.kernels.gemm_rs import GemmReduceScatter

SHAPES = {"square": (8192, 8192, 8192, 8192, 8192), "llama": (8192, 8192, 28672, 28672, 8192)}
# name -> (M, K_ag, N_ag, K_rs, N_rs): AG-GEMM [M, K_ag] x [K_ag, N_ag]; GEMM-RS [M, K_rs] x [K_rs, N_rs]


def measure(row: dict, name: str, fn: Callable[[], object], samples: int) -> None:
    """``row[name + "_ms"]`` (one call from idle) and ``row[name + "_steady_ms"]`` (10 calls back to back,
    per call): medians, then the max over ranks."""
    row[f"{name}_ms"] = benchmark.max_over_ranks(benchmark.one_call_ms(fn, samples=samples))
    row[f"{name}_steady_ms"] = benchmark.max_over_ranks(benchmark.steady_ms(fn, calls=10, runs=max(3, samples // 3)))


def print_profile(fn: Callable[[], object], title: str, rank: int, calls: int = 5) -> None:
    """Rank 0 prints where ``calls`` calls spend GPU and host time (torch profiler; every rank runs them)."""
    torch.cuda.synchronize()
    dist.barrier()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    if rank == 0:
        print(f"\n#### profile: {title}, {calls} calls\n", flush=True)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12), flush=True)


def tuned_in_context(fn: Callable[[], torch.Tensor], store: str) -> tuple[Callable[[], torch.Tensor], float, list]:
    wrapped = disttune.contextual_autotune(is_dist=True, n_warmup=3, n_repeat=5, cache_dir=store, verbose=False)(fn)
    started = time.perf_counter()
    wrapped()
    seconds = time.perf_counter() - started
    winners = [disttune.describe_config(r.config) for r in wrapped.report.results]
    return wrapped, seconds, winners


def bench_ag(name: str, M: int, K: int, N: int, args, rank: int, world: int, group_name: str, store: str) -> dict:
    dtype, dev = torch.bfloat16, torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device="cpu").manual_seed(rank)
    a_shard = torch.randn(M // world, K, generator=g).to(dev, dtype)
    # B_r as the transpose of a row-major [N/w, K] weight (nn.Linear's layout): K-major for the GEMMs
    b_local = (torch.randn(N // world, K, generator=g) / K ** 0.5).to(dev, dtype).t()
    a_full = torch.empty(M, K, device=dev, dtype=dtype)
    c = torch.empty(M, N // world, device=dev, dtype=dtype)
    row = {"bench": "ag_gemm", "shape": name, "M": M, "K": K, "N": N, "world": world}
    measure(row, "nccl_ag", lambda: dist.all_gather_into_tensor(a_full, a_shard), args.samples)
    measure(row, "cublas", lambda: torch.matmul(a_full, b_local, out=c), args.samples)

    def sequential():
        dist.all_gather_into_tensor(a_full, a_shard)
        return torch.matmul(a_full, b_local, out=c)

    measure(row, "sequential", sequential, args.samples)
    want = sequential().clone()
    try:
        fused_op = torch.ops.symm_mem.fused_all_gather_matmul
        measure(row, "torch_fused", lambda: fused_op(a_shard, [b_local], gather_dim=0, group_name=group_name),
                args.samples)
    except Exception as err:  # noqa: BLE001 - report, do not stop the table
        row["torch_fused_ms"] = row["torch_fused_steady_ms"] = None
        row["torch_fused_error"] = f"{type(err).__name__}: {err}"[:200]
    row["chunks"], row["streams"] = args.chunks, args.streams
    for design in ("fused", "decomposed"):
        op = AllGatherGEMM(design=design, chunks=args.chunks if design == "fused" else 1, streams=args.streams)
        out = torch.empty_like(c)
        step, seconds, winners = tuned_in_context(lambda: op(a_shard, b_local, out), os.path.join(store, design))
        measure(row, f"ours_{design}", step, args.samples)
        row[f"ours_{design}_tuning_s"] = round(seconds, 2)
        row[f"ours_{design}_winners"] = winners
        out.fill_(float("nan"))
        step()
        row[f"ours_{design}_rel_err"] = rel_error(out, want)
        if args.profile:
            print_profile(step, f"AG-GEMM {name} {design}", rank)
    # The same schedule and transport with cuBLAS per shard: what the transport gives a perfect GEMM.
    cublas_op = AllGatherGEMM(design="decomposed", gemm="cublas", streams=args.streams)
    out = torch.empty_like(c)
    measure(row, "ours_cublas", lambda: cublas_op(a_shard, b_local, out), args.samples)
    out.fill_(float("nan"))
    cublas_op(a_shard, b_local, out)
    row["ours_cublas_rel_err"] = rel_error(out, want)
    # The default (decomposed) kernel tuned alone: stock triton.autotune on the local shard's GEMM,
    # on each rank separately, then pinned and timed inside the function.
    alone = make_shard_gemm_kernel()
    shard_gemm(a_shard, b_local, torch.empty(M // world, N // world, device=dev, dtype=dtype), (M // world,), 0,
               kernel=alone)
    alone_winner = alone.best_config
    per_rank: list = [None] * world
    dist.all_gather_object(per_rank, disttune.describe_config(alone_winner))
    pinned = AllGatherGEMM(design="decomposed", kernel=make_shard_gemm_kernel([alone_winner]), streams=args.streams)
    out = torch.empty_like(c)
    row["alone_winners_per_rank"] = per_rank
    measure(row, "alone_in_function", lambda: pinned(a_shard, b_local, out), args.samples)
    for suffix in ("_ms", "_steady_ms"):
        row["limit" + suffix] = max(row["cublas" + suffix], row["nccl_ag" + suffix])
    return row


def bench_rs(name: str, M: int, K: int, N: int, args, rank: int, world: int, group_name: str, store: str) -> dict:
    dtype, dev = torch.bfloat16, torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device="cpu").manual_seed(10 + rank)
    a_local = torch.randn(M, K // world, generator=g).to(dev, dtype)
    b_local = (torch.randn(N, K // world, generator=g) / K ** 0.5).to(dev, dtype).t()
    partial = torch.empty(M, N, device=dev, dtype=dtype)
    out = torch.empty(M // world, N, device=dev, dtype=dtype)
    row = {"bench": "gemm_rs", "shape": name, "M": M, "K": K, "N": N, "world": world}
    measure(row, "cublas", lambda: torch.matmul(a_local, b_local, out=partial), args.samples)
    measure(row, "nccl_rs", lambda: dist.reduce_scatter_tensor(out, partial), args.samples)

    def sequential():
        torch.matmul(a_local, b_local, out=partial)
        dist.reduce_scatter_tensor(out, partial)
        return out

    measure(row, "sequential", sequential, args.samples)
    want = sequential().clone()
    try:
        fused_op = torch.ops.symm_mem.fused_matmul_reduce_scatter
        measure(row, "torch_fused", lambda: fused_op(a_local, b_local, "sum", 0, group_name), args.samples)
    except Exception as err:  # noqa: BLE001
        row["torch_fused_ms"] = row["torch_fused_steady_ms"] = None
        row["torch_fused_error"] = f"{type(err).__name__}: {err}"[:200]
    op = GemmReduceScatter()
    mine = torch.empty_like(out)
    step, seconds, winners = tuned_in_context(lambda: op(a_local, b_local, mine), os.path.join(store, "rs"))
    measure(row, "ours", step, args.samples)
    row["ours_tuning_s"] = round(seconds, 2)
    row["ours_winners"] = winners
    mine.fill_(float("nan"))
    step()
    row["ours_rel_err"] = rel_error(mine, want)
    for suffix in ("_ms", "_steady_ms"):
        row["limit" + suffix] = max(row["cublas" + suffix], row["nccl_rs" + suffix])
    return row


def fmt(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _table(rows: list[dict], bench: str, title: str, columns: list, best: list, suffix: str) -> None:
    """One markdown table: ``columns`` (label, key) and ratios of the best of ``best`` keys."""
    print(f"\n| {title} | " + " | ".join(label for label, _ in columns)
          + " | limit | ours / limit | vs sequential | vs torch fused |")
    print("| --- |" + " ---: |" * (len(columns) + 4))
    for r in rows:
        if r["bench"] != bench:
            continue
        ours = min(r[k + suffix] for k in best)
        torch_fused = r["torch_fused" + suffix]
        print(f"| {r['M']}x{r['K']}x{r['N']} | " + " | ".join(fmt(r[k + suffix]) for _, k in columns)
              + f" | {fmt(r['limit' + suffix])} | {ours / r['limit' + suffix]:.3f} | "
              f"{r['sequential' + suffix] / ours:.2f}x | "
              + ("n/a" if torch_fused is None else f"{torch_fused / ours:.2f}x") + " |")


def print_tables(rows: list[dict], world: int, device: str) -> None:
    ag_columns = [("NCCL AG", "nccl_ag"), ("cuBLAS", "cublas"), ("AG then cuBLAS", "sequential"),
                  ("torch fused", "torch_fused"), ("ours fused", "ours_fused"),
                  ("ours decomposed", "ours_decomposed"), ("ours, cuBLAS per shard", "ours_cublas")]
    rs_columns = [("cuBLAS", "cublas"), ("NCCL RS", "nccl_rs"), ("cuBLAS then RS", "sequential"),
                  ("torch fused", "torch_fused"), ("ours", "ours")]
    for suffix, what in (("_steady_ms", "steady state: 10 calls back to back, per call"),
                         ("_ms", "one call from an idle GPU (host launch latency included)")):
        print(f"\n### {world} x {device}, bf16, {what} (ms, median, max over ranks)")
        _table(rows, "ag_gemm", "AG-GEMM", ag_columns, ["ours_fused", "ours_decomposed"], suffix)
        _table(rows, "gemm_rs", "GEMM-RS", rs_columns, ["ours"], suffix)
    print("\n| AG-GEMM shape | tuned in context: winners | in-function ms (steady / one call) | "
          "tuned alone: winner per rank | in-function ms (steady / one call) |")
    print("| --- | --- | ---: | --- | ---: |")
    for r in rows:
        if r["bench"] == "ag_gemm":
            print(f"| {r['M']}x{r['K']}x{r['N']} | {'; '.join(r['ours_decomposed_winners'])} | "
                  f"{fmt(r['ours_decomposed_steady_ms'])} / {fmt(r['ours_decomposed_ms'])} | "
                  f"{' / '.join(r['alone_winners_per_rank'])} | "
                  f"{fmt(r['alone_in_function_steady_ms'])} / {fmt(r['alone_in_function_ms'])} |")
    for r in rows:
        errs = {k: f"{v:.1e}" for k, v in r.items() if k.endswith("rel_err")}
        print(f"{r['bench']} {r['shape']}: rel. errors {errs}; tuning s "
              f"{ {k: v for k, v in r.items() if k.endswith('tuning_s')} }")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="square,llama")
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--only", choices=["ag", "rs", "both"], default="both")
    parser.add_argument("--chunks", type=int, default=1, help="fused AG-GEMM: flagged pieces per pushed shard")
    parser.add_argument("--streams", type=int, default=1, help="AG-GEMM: copy streams pulling the shards")
    parser.add_argument("--profile", action="store_true", help="print a torch profile of ours (5 calls per design)")
    parser.add_argument("--out", default=None, help="append the rows as JSON lines to this file (rank 0)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/ag_gemm.py needs CUDA GPUs (NCCL, symmetric memory); CPU runs of AllGatherGEMM are in tests/")
    info = dt_dist.init()
    rank, world = info.rank, info.world_size
    group = dist.group.WORLD
    import torch.distributed._symmetric_memory as symm_mem

    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        symm_mem.enable_symm_mem_for_group(group.group_name)
    store = tempfile.mkdtemp(prefix=f"disttune-bench-r{rank}-")
    rows = []
    for name in args.shapes.split(","):
        M, K_ag, N_ag, K_rs, N_rs = SHAPES[name]
        if args.only in ("ag", "both"):
            rows.append(bench_ag(name, M, K_ag, N_ag, args, rank, world, group.group_name, store))
        if args.only in ("rs", "both"):
            rows.append(bench_rs(name, M, K_rs, N_rs, args, rank, world, group.group_name, store))
        if rank == 0:
            print(json.dumps(rows[-1]), flush=True)
    if rank == 0:
        print_tables(rows, world, torch.cuda.get_device_name())
        written = benchmark.append_rows(args.out, rows)
        if written:
            print(f"\nrows appended to {written}")
    dt_dist.destroy()


if __name__ == "__main__":
    main()
