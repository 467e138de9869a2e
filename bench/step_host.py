"""Host time per call of a tuned multi-rank step, wrapped by disttune against the same body with the winner fixed.

    torchrun --nproc_per_node=N bench/step_host.py [--M 8192 --K 8192 --N 8192] [--calls 300] [--out step_host.jsonl]

The step: ``all_gather`` of A's row shards (NCCL on GPUs, gloo on CPUs), then the Triton GEMM
``[M, K] @ [K, N/w]`` (``kernels.matmul``, the 12-config Hopper space on GPUs). It is tuned once with
``contextual_autotune`` (screening search), then two bodies run ``--calls`` calls back to back, in
interleaved rounds (``disttune.benchmark.host_and_wall_us``):

  plain     the body on a one-config ``triton.autotune`` kernel holding the winner (no tuner)
  wrapped   the tuned ``contextual_autotune`` step on its fast path, with its agreement on new keys
            every ``agree_every`` calls (the default, 128: two such points in 300 calls)

*host* is the time to issue the calls (the fast path must wait for nothing: no peer, no GPU), *wall*
adds the final synchronisation. Per call, best round, max over ranks; the ratio is wrapped / plain.
With ``--out FILE`` rank 0 appends one JSON line (with device, versions and date) to FILE.
"""

from __future__ import annotations

import argparse
import os

import torch

if not torch.cuda.is_available():  # CPU smoke runs: the interpreter must be chosen before triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.distributed as dist  # noqa: E402

import disttune  # noqa: E402
from disttune import benchmark  # noqa: E402
from disttune import dist as dt_dist  # noqa: E402
from disttune.kernels.matmul import CPU_GEMM_CONFIGS, HOPPER_GEMM_CONFIGS, make_matmul_kernel, matmul  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--M", type=int, default=None, help="default 8192 on GPUs, 64 on CPUs")
    parser.add_argument("--K", type=int, default=None)
    parser.add_argument("--N", type=int, default=None)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None)
    options = parser.parse_args()
    info = dt_dist.init()
    world, device = info.world_size, info.device
    gpu = device.type == "cuda"
    M, K, N = (options.M or (8192 if gpu else 64), options.K or (8192 if gpu else 32),
               options.N or (8192 if gpu else 32 * world))
    dtype = torch.bfloat16 if gpu else torch.float16
    a_local = torch.randn(M // world, K, device=device, dtype=dtype)
    b_local = torch.randn(K, N // world, device=device, dtype=dtype) / K ** 0.5
    a_full = torch.empty(M, K, device=device, dtype=dtype)
    c = torch.empty(M, N // world, device=device, dtype=dtype)

    def body(kernel):
        dist.all_gather(list(a_full.chunk(world)), a_local)
        matmul(a_full, b_local, out=c, kernel=kernel)
        return c

    kernel = make_matmul_kernel(HOPPER_GEMM_CONFIGS if gpu else CPU_GEMM_CONFIGS)

    @disttune.contextual_autotune(is_dist=True, verbose=False, search="screen", store=False)
    def wrapped():
        return body(kernel)

    wrapped()  # the tuning call
    (result,) = wrapped.report.results
    fixed = make_matmul_kernel([result.config])
    samples = benchmark.host_and_wall_us({"plain": lambda: body(fixed), "wrapped": wrapped},
                                         calls=options.calls, rounds=options.rounds, warmup=3, barrier=True)
    best = {name: min(rounds, key=lambda s: s.host_us) for name, rounds in samples.items()}
    host = dict(zip(best, benchmark.max_over_ranks([best[name].host_us for name in best])))
    wall = dict(zip(best, benchmark.max_over_ranks([best[name].wall_us for name in best])))
    row = {"bench": "step_host", "M": M, "K": K, "N": N, "calls": options.calls, "winner": disttune.describe_config(
        result.config), "host_us": host, "wall_us": wall, "host_ratio": host["wrapped"] / host["plain"]}
    if info.rank == 0:
        print(f"\n### host per call, AG + GEMM {M}x{K}x{N}, {world} ranks ({info.backend}), {options.calls} calls "
              f"back to back, best of {options.rounds} rounds, max over ranks\n")
        print("| step | host µs | wall µs |\n| --- | ---: | ---: |")
        for name in best:
            print(f"| {name} | {host[name]:.1f} | {wall[name]:.1f} |")
        print(f"\nwrapped / plain host: {row['host_ratio']:.3f}; winner {row['winner']}")
    benchmark.append_rows(options.out, [row])
    dist.barrier()
    dt_dist.destroy()


if __name__ == "__main__":
    main()
