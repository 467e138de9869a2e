"""Host time of one AG-GEMM call, piece by piece, against a plain launch of the same Triton kernel.

    python bench/launch_host.py [--M 8192 --K 8192 --N 8192] [--profile] [--out launch_host.jsonl]   # one GPU

One GPU, one rank (the AG-GEMM of a world of one: its GEMM, its flags and its bookkeeping, nothing to
gather). The decomposed AG-GEMM's GEMM kernel is tuned in context first (12 configs); every row then
launches that winner. Rows (µs per call, ``--calls`` calls back to back, best of ``--rounds`` interleaved
rounds, ``disttune.benchmark.host_and_wall_us``; *host* is the time to issue the calls, *wall* adds the
final synchronisation):

  torch.matmul                  cuBLAS on the same operands: the host floor of a library GEMM
  plain JIT launch              ``shard_gemm_jit[grid](*args, **winner)`` with the arguments prepared once:
                                Triton's own launch path alone
  shard_gemm, plain JIT kernel  ``kernels.shard_gemm.shard_gemm`` launching that JIT function (its Python)
  shard_gemm, fixed config      ``kernels.shard_gemm.shard_gemm`` on a one-config ``triton.autotune`` kernel
  AllGatherGEMM, fixed config   the whole AG-GEMM call on that kernel (checks, pusher, flags, the GEMM)
  AllGatherGEMM, contextual     the step tuned with ``contextual_autotune``, on its fast path

``--profile`` prints a cProfile of the last two rows (where their host time goes). With ``--out FILE``
one JSON line per row (with device, versions and date) is appended to FILE.

Cost: one contextual tuning (12 compiles, 98 runs of the step), then (1 + rounds x calls) calls of
each row.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--M", type=int, default=8192)
    parser.add_argument("--K", type=int, default=8192)
    parser.add_argument("--N", type=int, default=8192)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="cProfile the AG-GEMM calls")
    parser.add_argument("--out", default=None, help="append one JSON line per row to this file")
    options = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/launch_host.py needs a GPU (it times Triton's real launch path)")

    import disttune
    from disttune import benchmark
    from disttune import dist as dt_dist
    from disttune.kernels.ag_gemm import AllGatherGEMM
    from disttune.kernels.shard_gemm import make_shard_gemm_kernel, shard_gemm, shard_gemm_jit

    info = dt_dist.init()
    if info.world_size != 1:
        sys.exit("bench/launch_host.py runs on one rank")
    M, K, N = options.M, options.K, options.N
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    b = (torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5).t()  # nn.Linear's layout
    out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)

    tuned_op = AllGatherGEMM(kernel=make_shard_gemm_kernel())

    @disttune.contextual_autotune(is_dist=True, verbose=False, store=False)
    def step() -> Any:
        return tuned_op(a, b, out)

    step()
    winner = step.report.results[0].config
    fixed_kernel = make_shard_gemm_kernel([winner])  # one config: Triton launches it without benchmarking
    fixed_op = AllGatherGEMM(kernel=fixed_kernel)

    captured: dict = {}

    class Plain:
        """``shard_gemm_jit`` with the winner's meta-parameters, launched as ``kernel[grid](...)``; the first
        launch's arguments are kept for the bare launch."""

        def __getitem__(self, grid: Any) -> Any:
            launch = shard_gemm_jit[grid]
            meta = winner.all_kwargs()

            def go(*args: Any, **kwargs: Any) -> Any:
                captured.setdefault("call", (grid, args, {**kwargs, **meta}))
                return launch(*args, **kwargs, **meta)

            return go

    plain = Plain()
    shard_gemm(a, b, out, (M,), 0, kernel=plain)
    grid_fn, jit_args, jit_kwargs = captured["call"]
    fixed_grid = grid_fn(jit_kwargs)
    fns = {
        "torch.matmul": lambda: torch.matmul(a, b, out=out),
        "plain JIT launch": lambda: shard_gemm_jit[fixed_grid](*jit_args, **jit_kwargs),
        "shard_gemm, plain JIT kernel": lambda: shard_gemm(a, b, out, (M,), 0, kernel=plain),
        "shard_gemm, fixed config": lambda: shard_gemm(a, b, out, (M,), 0, kernel=fixed_kernel),
        "AllGatherGEMM, fixed config": lambda: fixed_op(a, b, out),
        "AllGatherGEMM, contextual": step,
    }
    samples = benchmark.host_and_wall_us(fns, calls=options.calls, rounds=options.rounds)
    best = {name: min(runs, key=lambda run: run.host_us) for name, runs in samples.items()}
    env = benchmark.environment()
    print(f"\nhost µs per call, {M}x{K}x{N} bf16, one rank, {env['device']} (torch {env['torch']}, triton "
          f"{env['triton']}); winner {disttune.describe_config(winner)}; {options.calls} calls back to back, "
          f"best of {options.rounds} rounds\n")
    print("| call | host µs | over plain JIT launch | wall µs |\n| --- | ---: | ---: | ---: |")
    floor = best["plain JIT launch"].host_us
    rows = []
    for name, sample in best.items():
        print(f"| {name} | {sample.host_us:.1f} | {sample.host_us - floor:+.1f} | {sample.wall_us:.1f} |")
        rows.append({"bench": "launch_host", "call": name, "host_us": sample.host_us, "wall_us": sample.wall_us,
                     "M": M, "K": K, "N": N, "winner": disttune.describe_config(winner)})
    if options.profile:
        for name in ("AllGatherGEMM, fixed config", "AllGatherGEMM, contextual"):
            host_ms, table = benchmark.cprofile(fns[name], calls=options.calls, top=20)
            print(f"\n#### cProfile of {name}: {host_ms * 1e3:.1f} µs host per call (profiled)\n{table}")
    out.zero_()
    step()
    error = benchmark.rel_error(out, (a.float() @ b.float()).to(out.dtype))
    print(f"\ncontextual AG-GEMM against torch: rel. error {error:.1e}")
    written = benchmark.append_rows(options.out, rows, meta=env)
    if written:
        print(f"rows appended to {written}")
    dt_dist.destroy()


if __name__ == "__main__":
    main()
