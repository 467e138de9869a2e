"""A tensor-parallel MLP (AllGather-GEMM, then GEMM-ReduceScatter) tuned in context.

Each rank holds a row shard of the activations ``x`` (``[T/w, H]``), a column shard of the up
projection (``[H, F/w]``) and a row shard of the down projection (``[F/w, H]``):

    hidden = all_gather(x) @ W_up_r           # AllGatherGEMM: the gather overlaps the GEMM
    y_r    = rows_r( sum_r hidden_r @ W_down_r )   # GemmReduceScatter: the reduction overlaps it

``contextual_autotune`` tunes both GEMMs while the communication really runs (with the
default decomposed AG-GEMM every per-shard launch is a tuning site: 2w of them), and every
rank ends with the same winners. Run it with

    bash scripts/launch.sh --nproc_per_node=2 examples/tp_mlp.py            # GPUs (NCCL) or CPUs (gloo)
    bash scripts/launch.sh --mpi -n 2 examples/tp_mlp.py

(the activation between the two GEMMs is left out: it does not change what is tuned).
Exits non-zero if any rank's result differs from the torch reference.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.distributed as dist  # noqa: E402

import disttune  # noqa: E402
from demo_common import run  # noqa: E402
from disttune import dist as dt_dist  # noqa: E402
from disttune.kernels.ag_gemm import DESIGNS, AllGatherGEMM, ag_gemm_reference  # noqa: E402
from disttune.kernels.gemm_rs import GemmReduceScatter, gemm_rs_reference  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    gpu = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--T", type=int, default=8192 if gpu else 64, help="tokens, all ranks")
    parser.add_argument("--H", type=int, default=8192 if gpu else 32, help="model width")
    parser.add_argument("--F", type=int, default=28672 if gpu else 64, help="MLP width, all ranks")
    parser.add_argument("--design", choices=DESIGNS, default="auto")
    return parser.parse_args(argv)


def sizes_error(options: argparse.Namespace, world: int) -> str | None:
    """What makes the sizes impossible at ``world`` ranks (``disttune demo`` asks before it launches any)."""
    if options.T % world or options.F % world:
        return f"--T ({options.T}) and --F ({options.F}) must be multiples of the world size {world}"
    return None


def main() -> int:
    gpu = torch.cuda.is_available()
    options = parse_args()
    info = dt_dist.init()
    rank, world, device = info.rank, info.world_size, info.device
    dtype = torch.bfloat16 if gpu else torch.float16
    if sizes_error(options, world):
        raise SystemExit(sizes_error(options, world))
    g = torch.Generator().manual_seed(7 + rank)
    x_shard = torch.randn(options.T // world, options.H, generator=g).to(device, dtype)
    # nn.Linear layout ([out, in], row-major): the GEMMs read B = weight.t() K-major, the fast path
    w_up = (torch.randn(options.F // world, options.H, generator=g) / options.H ** 0.5).to(device, dtype).t()
    w_down = (torch.randn(options.H, options.F // world, generator=g) / options.F ** 0.5).to(device, dtype).t()
    hidden = torch.empty(options.T, options.F // world, device=device, dtype=dtype)
    y = torch.empty(options.T // world, options.H, device=device, dtype=dtype)
    up, down = AllGatherGEMM(design=options.design), GemmReduceScatter()

    @disttune.contextual_autotune(is_dist=True, n_warmup=3, n_repeat=5)
    def tp_mlp() -> torch.Tensor:
        y.fill_(float("nan"))  # poison: an unwritten tile fails the check
        up(x_shard, w_up, hidden)
        return down(hidden, w_down, y)

    started = time.perf_counter()
    out = tp_mlp()
    tuning_s = time.perf_counter() - started
    want = gemm_rs_reference(ag_gemm_reference(x_shard, w_up), w_down).float()
    error = ((out.float() - want).norm() / want.norm()).item()
    ok = bool(torch.isfinite(out).all()) and error < (2e-2 if dtype == torch.bfloat16 else 5e-3)
    verdicts: list = [None] * world
    dist.all_gather_object(verdicts, (ok, error))
    if rank == 0:
        print(f"TP-MLP T={options.T} H={options.H} F={options.F} {dtype} on {world} rank(s) ({info.backend}, "
              f"{up.design_for(device)} AG-GEMM)")
        for result in tp_mlp.report.results:
            print(f"  {result.site.kernel.rsplit('.', 1)[-1]} key={result.site.key[:5]} #{result.site.occurrence}: "
                  f"{disttune.describe_config(result.config)} ({result.source})")
        print(f"tuning call: {tuning_s:.2f} s, {tp_mlp.report.function_runs} runs")
        print("correct on every rank:", all(v[0] for v in verdicts),
              "max rel. error:", f"{max(v[1] for v in verdicts):.2e}")
    dt_dist.destroy()
    return 0 if all(v[0] for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(run(main))
