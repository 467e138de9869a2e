"""Host time of AllGather-MoE per call, and of its pieces: is a step host-bound?

    torchrun --nproc_per_node=1 bench/moe_host.py             # one GPU: the host path alone (NCCL, 1 rank)
    torchrun --nproc_per_node=2 bench/moe_host.py --profile   # two GPUs, plus cProfiles of ag_moe and moe_gemm
    torchrun --nproc_per_node=2 bench/moe_host.py --out moe_host.jsonl   # also append the rows as JSON lines
    torchrun --nproc_per_node=2 bench/moe_host.py --phases    # plus ag_moe's host µs per phase, on every rank
    torchrun --nproc_per_node=1 bench/moe_host.py --launch-paths   # plus ag_moe launched disttune's way vs Triton's

A step whose host needs longer per call than its GPU work runs at the host's pace however fast its
kernels are. Each row calls its function ``--calls`` times back to back and synchronizes once, in
interleaved rounds (best round counts; ``disttune.benchmark.host_and_wall_us``); *host* is the time
to issue the calls, *wall* includes the final synchronization, and *GPU* is 10 calls back to back
between two CUDA events (``disttune.benchmark.steady_ms``). When host ~ wall the step is
host-bound; below 1.0 in the *host / GPU* column, the GPU sets the pace. Rows (every rank holds
``T / world`` tokens of the shape, as in ``bench/moe.py`` part b; max over ranks):

  ag_moe                 ``kernels.moe.ag_moe`` with a stock ``triton.autotune`` kernel (what part b times)
  ag_moe, contextual     the same under ``disttune.contextual_autotune`` (tuned first; the fast path)
  ag_moe, CUDA graph     ``ag_moe(graph_safe=True)`` captured once in a CUDA graph, the graph replayed
  sequential             all_gather of tokens and ids, routing, permutation, ``torch._grouped_mm``
  sequential, CUDA graph the same captured and replayed
  gather_tokens_and_routing  tokens, ids and weights in one collective (what an eager ag_moe gathers)
  moe_align_stacked      the rank-stacked sort
  moe_gemm               the grouped GEMM launch, arrival flags already set
  moe_gemm_sorting       the sort and the grouped GEMM in one launch (an eager ag_moe runs its launch, unchecked)
  pusher                 the token pushes and ``finish`` (symmetric memory, copy engines)

GPU only (NCCL, symmetric memory). Rank 0 prints one table per shape and, with ``--out FILE``,
appends one JSON line per row (with device, versions and date) to FILE.

``--phases``: where an eager ``ag_moe`` call's host time goes. ag_moe's helpers (the checks, the gather of
tokens and routing, the sort, the GEMM launch; the routing's gather and the pusher's gather / wait / finish
where a call pushes) are wrapped with timers for
``--calls`` calls, best of ``--rounds`` rounds, and every rank's µs per call are printed, with what the
helpers leave ("the rest": ag_moe's own lines); the wrappers add about 0.5 µs per phase.

``--launch-paths``: ag_moe with its Triton kernels launched disttune's way (``disttune.jit_launch``: the
binder, one lookup and the launcher; one descriptor scratch block per stream) against Triton's own way
(``JITFunction.run``; a scratch tensor per launch), the two switched call by call in interleaved rounds:
host and wall µs per call over ``--calls`` calls, and device ms per call over 10-call windows (median
[low-high]).

Cost: per shape, (1 + ``--rounds`` x ``--calls``) calls of each of 10 steps, 3 + 50 back-to-back
calls of 6 of them, two CUDA-graph captures and one contextual tuning of ag_moe (``--phases``:
``--rounds`` x ``--calls`` more calls of ag_moe).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import sys
import time
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

import triton

import disttune
import disttune.dist as dt_dist
from disttune import benchmark, jit_launch
from disttune.benchmark import capture_graph, max_over_ranks
from disttune.kernels import moe, moe_ag, shard_gemm

SHAPES = [dict(T=4096, E=64, k=6, H=2048, I=1408), dict(T=4096, E=8, k=2, H=4096, I=7168)]
#: What ``--phases`` times: ag_moe's helpers (module functions) and the token pusher's methods.
AG_MOE_PHASES = ("group_info", "_inputs_key", "_agree_on_inputs", "empty_buffer", "gather_tokens_and_routing",
                 "gather_routing", "token_pusher", "layout_for", "moe_align_ranks", "moe_gemm", "sorting_launch")
PUSHER_PHASES = ("gather", "wait_all", "finish")


@contextlib.contextmanager
def timed_phases(seconds: dict) -> Iterator[None]:
    """While open, ag_moe's helpers add the seconds they take to ``seconds[name]`` (restored on exit)."""
    def timed(name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - started
        return wrapper

    targets = [(moe_ag, name, name) for name in AG_MOE_PHASES]
    targets += [(moe_ag.ShardPusher, name, f"pusher.{name}") for name in PUSHER_PHASES]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in targets]
    try:
        for owner, name, label in targets:
            setattr(owner, name, timed(label, getattr(owner, name)))
        yield
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)


def phase_table(ag: Callable[[], Any], rank: int, world: int, calls: int, rounds: int) -> list[dict]:
    """Every rank's host µs per ag_moe call and per phase (best round by total); rank 0 prints the table."""
    best: tuple = (float("inf"), {})
    for _ in range(rounds):
        seconds: dict = {}
        benchmark.sync()
        dist.barrier()
        with timed_phases(seconds):
            started = time.perf_counter()
            for _ in range(calls):
                ag()
            total = (time.perf_counter() - started) / calls * 1e6
        benchmark.sync()
        if total < best[0]:
            best = (total, {name: value / calls * 1e6 for name, value in seconds.items()})
    total, phases = best
    phases["the rest"] = total - sum(phases.values())
    phases["ag_moe, timed"] = total
    gathered: list = [None] * world
    dist.all_gather_object(gathered, phases)
    names = sorted(gathered[0], key=lambda n: (n.startswith(("the rest", "ag_moe")), -gathered[0][n]))
    if rank == 0:
        print(f"\n#### ag_moe's host µs per call by phase ({calls} calls, best of {rounds} rounds), each rank\n")
        print("| phase | " + " | ".join(f"rank {r}" for r in range(world)) + " |")
        print("| --- |" + " ---: |" * world)
        for name in names:
            print(f"| {name} | " + " | ".join(f"{per_rank.get(name, 0.0):.1f}" for per_rank in gathered) + " |")
    return [dict(bench="moe_host", step=f"ag_moe phase: {name}", host_us_per_rank=[p.get(name) for p in gathered])
            for name in names]


def _scratch_per_launch(size: int, alignment: int, stream: Any) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def launch_paths_table(ag: Callable[[], Any], rank: int, options: argparse.Namespace) -> list[dict]:
    """ag_moe launched disttune's way against Triton's way, interleaved (see the module doc); rank 0 prints."""
    def switched(ours: bool) -> Callable[[], Any]:
        def call() -> Any:
            jit_launch.enabled = ours
            triton.set_allocator(shard_gemm.descriptor_scratch if ours else _scratch_per_launch)
            return ag()
        return call

    paths = {"disttune.jit_launch": switched(True), "JITFunction.run": switched(False)}
    try:
        samples = benchmark.host_and_wall_us(paths, calls=options.calls, rounds=max(options.rounds, 7), warmup=3)
        windows = benchmark.interleaved(paths, rounds=21, calls=10, warmup=2)
    finally:
        switched(True)
    rows = []
    if rank == 0:
        print("\n#### ag_moe's launches, disttune's way or Triton's (interleaved; rank 0's host)\n")
        print("| launched through | host µs per call, median [low-high] | wall µs | device ms per call in 10-call "
              "windows | host ms per call there |\n| --- | ---: | ---: | ---: | ---: |")
    for name, runs in samples.items():
        host = sorted(run.host_us for run in runs)
        wall = statistics.median(run.wall_us for run in runs)
        if rank == 0:
            print(f"| {name} | {statistics.median(host):.1f} [{host[0]:.1f}-{host[-1]:.1f}] | {wall:.1f} "
                  f"| {windows[name].text()} | {windows[name].host:.3f} |")
        rows.append(dict(bench="moe_host", step=f"ag_moe launched through {name}", host_us=statistics.median(host),
                         wall_us=wall, steady_ms=windows[name].median))
    return rows


def bench_shape(s: dict, rank: int, world: int, options: argparse.Namespace) -> list[dict]:
    T, E, k, H, I = s["T"], s["E"], s["k"], s["H"], s["I"]
    T_r, N = T // world, I // world
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(T_r, H, generator=g).to("cuda", torch.bfloat16)
    weights, ids = torch.rand(T_r, E, generator=g).topk(k, dim=1)
    ids, weights = ids.to("cuda", torch.int32), (weights / weights.sum(1, keepdim=True)).to("cuda")
    w = (torch.randn(E, H, N, generator=g) / H ** 0.5).to("cuda", torch.bfloat16)
    tpr = [T_r] * world
    kernel, ctx_kernel = moe.make_moe_kernel(), moe.make_moe_kernel()

    def ag() -> Any:
        return moe.ag_moe(x, ids, w, topk_weights=weights, tokens_per_rank=tpr, kernel=kernel, check_ids=False,
                          layout="auto")

    @disttune.contextual_autotune(is_dist=True, n_warmup=1, n_repeat=2, verbose=False, store=False)
    def ag_contextual() -> Any:
        return moe.ag_moe(x, ids, w, topk_weights=weights, tokens_per_rank=tpr, kernel=ctx_kernel, check_ids=False,
                          layout="auto")

    result = ag()
    ag_contextual()
    x_all = torch.empty(T, H, device="cuda", dtype=x.dtype)
    ids_all = torch.empty(T, k, device="cuda", dtype=ids.dtype)

    def sequential() -> Any:
        dist.all_gather_into_tensor(x_all, x)
        dist.all_gather_into_tensor(ids_all, ids)
        routing = moe.moe_align(ids_all, E, check_range=False)
        return torch._grouped_mm(routing.permute(x_all), w, offs=routing.expert_offs[1:], out_dtype=x.dtype)

    ag_graph = capture_graph(lambda: moe.ag_moe(x, ids, w, topk_weights=weights, tokens_per_rank=tpr, kernel=kernel,
                                                check_ids=False, graph_safe=True, layout="auto"))
    seq_graph = capture_graph(sequential)
    arrived = (torch.ones(world, dtype=torch.int32, device="cuda"), 1)
    x_gathered = torch.zeros(T, H, device="cuda", dtype=x.dtype)
    pusher = moe_ag.token_pusher(None)

    def push() -> None:
        pusher.gather(x, tpr, include_own=True)
        pusher.finish()

    fns = {
        "ag_moe": ag,
        "ag_moe, contextual": ag_contextual,
        "ag_moe, CUDA graph": ag_graph.replay,
        "sequential": sequential,
        "sequential, CUDA graph": seq_graph.replay,
        "gather_tokens_and_routing": lambda: moe_ag.gather_tokens_and_routing(x, ids, weights, tuple(tpr), None),
        "moe_align_stacked": lambda: moe.moe_align_stacked(result.topk_ids, E, tpr),
        "moe_gemm": lambda: moe.moe_gemm(x_gathered, w, result.routing, a_order="token", out=result.out,
                                         kernel=kernel, rows_bucket=moe.next_power_of_2(T * k),
                                         first_group=rank * E, wait=arrived),
        "moe_gemm_sorting": lambda: moe.moe_gemm_sorting(x_gathered, w, result.topk_ids, tpr, out=result.out,
                                                         kernel=kernel, rows_bucket=moe.next_power_of_2(T * k),
                                                         first_group=rank * E),
        "pusher": push,
    }
    samples = benchmark.host_and_wall_us(fns, calls=options.calls, rounds=options.rounds)
    best = {name: min(runs, key=lambda run: run.wall_us) for name, runs in samples.items()}
    gpu_max = {name: max_over_ranks(benchmark.steady_ms(fns[name], calls=10, runs=5))
               for name in ("ag_moe", "ag_moe, contextual", "ag_moe, CUDA graph", "sequential", "sequential, CUDA graph",
                            "moe_gemm", "moe_gemm_sorting")}
    names = list(fns)
    host = max_over_ranks([best[n].host_us for n in names])
    wall = max_over_ranks([best[n].wall_us for n in names])
    if options.profile:
        for name in ("ag_moe", "moe_gemm"):
            host_ms, table = benchmark.cprofile(fns[name], calls=options.calls, top=25)
            if rank == 0:
                print(f"\n#### cProfile of {name}, {options.calls} calls, rank 0: {host_ms:.3f} ms host per call "
                      f"(profiled)\n{table}")
    rows = phase_table(ag, rank, world, options.calls, options.rounds) if options.phases else []
    if options.launch_paths:
        rows += launch_paths_table(ag, rank, options)
    for row in rows:
        row["shape"] = s
    if rank == 0:
        print(f"\n### world {world}: T={T} E={E} top-{k} H={H} N={N} per rank, bf16, {torch.cuda.get_device_name()}; "
              f"µs per call ({options.calls} calls back to back, best of {options.rounds} rounds, max over ranks)\n")
        print("| step | host µs | GPU µs back to back | host / GPU | wall µs |\n| --- | ---: | ---: | ---: | ---: |")
        for name, h, wl in zip(names, host, wall):
            g_us = f"{gpu_max[name] * 1e3:.1f}" if name in gpu_max else ""
            ratio = f"{h / (gpu_max[name] * 1e3):.2f}" if name in gpu_max else ""
            print(f"| {name} | {h:.1f} | {g_us} | {ratio} | {wl:.1f} |")
            rows.append(dict(bench="moe_host", shape=s, step=name, host_us=h, wall_us=wl, gpu_ms=gpu_max.get(name),
                             calls=options.calls, rounds=options.rounds))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--shapes", default="64,8", help="expert counts of the shapes to run (64 and/or 8)")
    parser.add_argument("--profile", action="store_true", help="print cProfiles of ag_moe and moe_gemm on rank 0")
    parser.add_argument("--phases", action="store_true", help="print ag_moe's host µs per phase on every rank")
    parser.add_argument("--launch-paths", action="store_true",
                        help="print ag_moe launched through disttune.jit_launch against JITFunction.run")
    parser.add_argument("--out", default=None, help="append the rows as JSON lines to this file (rank 0)")
    options = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/moe_host.py needs CUDA GPUs (NCCL, symmetric memory); CPU runs of ag_moe are in tests/")
    info = dt_dist.init()
    rank, world = info.rank, info.world_size
    wanted = {int(e) for e in options.shapes.split(",")}
    rows = [row for s in SHAPES if s["E"] in wanted for row in bench_shape(s, rank, world, options)]
    written = benchmark.append_rows(options.out, rows)
    if written:
        print(f"\nrows appended to {written}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
