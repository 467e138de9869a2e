"""Benchmark: exhaustive vs screen vs model search, tuning the AG-GEMM step over a generated space.

    python bench/search.py                                  # one GPU (world of one), 8192^3 bf16
    torchrun --nproc_per_node=4 bench/search.py --M 8192    # several GPUs: the step overlaps the gather
    python bench/search.py --cpu                            # a smoke run in Triton's interpreter (seconds)

The step is the shipped overlapped ``AllGatherGEMM`` (decomposed design), its shard GEMM given the
hardware-aware default space :func:`disttune.space.gemm_space` of the shape (on an H100 at 8192^3:
432 generated, 272 kept). Each search tunes a fresh kernel (no store, empty caches) with the same
``n_warmup``/``n_repeat``; a compile pass first tunes once with one run per config, so that every
search finds Triton's cache warm and the tuning times compare searches, not compilers.

Printed per search (rank 0; ``--out FILE`` appends one JSON line per search): runs of the step,
configs timed (summed over the tuning sites: the decomposed step has one shard GEMM per rank, each a
site), tuning wall time, the winners, the step's time in steady state with them (10 calls back to back
between CUDA events, median of ``--samples`` runs, max over ranks; the host clock on CPUs) and its gap
to the exhaustive winners' time. With several ranks the model search's proposals are agreed (rank 0's).

Cost on one H100 at 8192^3: the compile pass (272 compiles on 16 threads, 272 runs), then about
2200 + 1100 + 400 runs of a ~2 ms step, and 3 x 10 x ``--samples`` calls to time the winners.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

if "--cpu" in sys.argv or not torch.cuda.is_available():  # the interpreter must be chosen before triton loads
    os.environ["TRITON_INTERPRET"] = "1"

import disttune  # noqa: E402
from disttune import benchmark  # noqa: E402
from disttune import dist as dt_dist  # noqa: E402
from disttune.kernels.ag_gemm import AllGatherGEMM, ag_gemm_reference  # noqa: E402
from disttune.kernels.shard_gemm import make_shard_gemm_kernel  # noqa: E402
from disttune.space import gemm_space  # noqa: E402

SEARCHES = ("exhaustive", "screen", "model")


def parse_args() -> argparse.Namespace:
    cpu = "--cpu" in sys.argv or not torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="tiny shape and space in the interpreter (smoke run)")
    parser.add_argument("--M", type=int, default=64 if cpu else 8192, help="rows of A, all ranks together")
    parser.add_argument("--K", type=int, default=32 if cpu else 8192)
    parser.add_argument("--N", type=int, default=32 if cpu else 8192, help="columns of B, all ranks together")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="float16" if cpu else "bfloat16")
    parser.add_argument("--n-warmup", type=int, default=0 if cpu else 3)
    parser.add_argument("--n-repeat", type=int, default=1 if cpu else 5)
    parser.add_argument("--searches", default=",".join(SEARCHES), help="comma-separated, of " + ", ".join(SEARCHES))
    parser.add_argument("--seed", type=int, default=0, help="the model search's seed")
    parser.add_argument("--samples", type=int, default=3 if cpu else 30, help="timing runs of each winner")
    parser.add_argument("--log-dir", default=None, help="the tuners' rank logs (default: a temporary directory)")
    parser.add_argument("--out", default=None, help="append one JSON line per search to this file")
    return parser.parse_args()


def cpu_space() -> disttune.ConfigSpace:
    """96 small configs the interpreter runs in milliseconds each."""
    return disttune.space(BLOCK_M=[16, 32, 64], BLOCK_N=[16, 32], BLOCK_K=[16, 32], GROUP_M=[1, 2, 4, 8],
                          num_warps=[1, 2], num_stages=[1], problem={"M": 64, "N": 32, "K": 32})


def main() -> int:
    options = parse_args()
    info = dt_dist.init()
    rank, world, device = info.rank, info.world_size, info.device
    gpu = device.type == "cuda" and not options.cpu
    dtype = getattr(torch, options.dtype)
    generator = torch.Generator().manual_seed(1234 + rank)
    a_shard = torch.randn(options.M // world, options.K, generator=generator).to(device, dtype)
    b_local = (torch.randn(options.K, options.N // world, generator=generator) / options.K ** 0.5).to(device, dtype)
    c = torch.empty(options.M, options.N // world, device=device, dtype=dtype)
    configs = gemm_space(options.M, options.N // world, options.K, dtype, device) if gpu else cpu_space()
    op = AllGatherGEMM()
    log_dir = options.log_dir or os.path.join(os.environ.get("TMPDIR", "/tmp"), f"disttune-search-bench-{os.getpid()}")

    def tune(search, n_warmup: int, n_repeat: int) -> tuple:
        op.kernel = make_shard_gemm_kernel(list(configs))
        step = disttune.contextual_autotune(is_dist=True, n_warmup=n_warmup, n_repeat=n_repeat, search=search,
                                            store=False, verbose=False, log_dir=log_dir)(
            lambda: op(a_shard, b_local, out=c))
        started = time.perf_counter()
        step()
        benchmark.sync()
        return step, benchmark.max_over_ranks(time.perf_counter() - started)

    if rank == 0:
        print(f"AG-GEMM step M={options.M} K={options.K} N={options.N} {options.dtype}, {world} rank(s), "
              f"{torch.cuda.get_device_name() if gpu else 'CPU, Triton interpreter'}", flush=True)
        print(f"space: {configs.summary()}", flush=True)
    _, compile_s = tune("exhaustive", 0, 1)
    if rank == 0:
        print(f"compile pass (every config once, 1 run each): {compile_s:.1f} s", flush=True)
    rows = []
    for name in options.searches.split(","):
        search = disttune.ModelSearch(seed=options.seed) if name == "model" else name
        step, tuning_s = tune(search, options.n_warmup, options.n_repeat)
        # the decomposed step launches one shard GEMM per rank's shard: a tuning site each, searched alike
        results = [r for r in step.report.results if r.source == "tuned"]
        error = benchmark.rel_error(step(), ag_gemm_reference(a_shard, b_local))
        ms = (benchmark.max_over_ranks(benchmark.steady_ms(step, calls=10, runs=options.samples)) if gpu else
              benchmark.max_over_ranks(benchmark.one_call_ms(step, samples=options.samples, warmup=1)))
        timed = sum(1 for r in results for t in r.agreed_ms if t == t)  # not nan: timed (inf: failed)
        winners = sorted({disttune.describe_config(r.config) for r in results})
        rows.append({"search": name, "runs": step.report.function_runs, "sites": len(results), "configs_timed": timed,
                     "configs": sum(len(r.configs) for r in results), "tuning_s": tuning_s,
                     "winner": "; ".join(winners), "winner_ms": ms,
                     "agreed_ms": sum(r.agreed_ms[r.winner] for r in results), "rel_error": error})
    if rank == 0:
        best = next((r["winner_ms"] for r in rows if r["search"] == "exhaustive"), None)
        runs_all = next((r["runs"] for r in rows if r["search"] == "exhaustive"), None)
        print(f"\n| search | runs of the step | configs timed ({rows[0]['sites']} site(s)) | tuning s | winners | "
              "step ms | vs exhaustive |")
        print("|---|---:|---:|---:|---|---:|---:|")
        for row in rows:
            gap = f"{100 * (row['winner_ms'] / best - 1):+.1f} %" if best else "-"
            share = f" ({row['runs'] / runs_all:.0%})" if runs_all else ""
            print(f"| {row['search']} | {row['runs']}{share} | {row['configs_timed']} of {row['configs']} | "
                  f"{row['tuning_s']:.1f} | {row['winner']} | {row['winner_ms']:.3f} | {gap} |")
        if not gpu:
            print("(CPU interpreter: host-clock times, a smoke run, not a speed comparison)")
        if options.out:
            benchmark.append_rows(options.out, [{**row, "shape": [options.M, options.K, options.N],
                                                 "dtype": options.dtype, "world": world} for row in rows])
    bad = [r for r in rows if not r["rel_error"] < 2e-2]
    if bad:
        print(f"rank {rank}: wrong result from {[r['search'] for r in bad]}", file=sys.stderr)
    dt_dist.destroy()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
