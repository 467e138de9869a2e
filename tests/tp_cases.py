"""Multi-rank correctness checks of AllGather-GEMM and GEMM-ReduceScatter (run under torchrun).

    python tests/tp_cases.py [--size small|large] [--dtypes float16,float32] [--tune]

Every check draws fresh random inputs, poisons the output with NaN (an unwritten tile
fails), and compares with the torch reference (``all_gather`` + matmul, matmul +
``all_reduce``); relative Frobenius error must stay within the dtype's bound. Each rank
prints ``rank R: N checks passed`` and exits 0, or prints what failed and exits 1.
``--tune`` also wraps a TP-MLP step (AG-GEMM then GEMM-RS) in ``contextual_autotune``
and checks that every rank got the same winners. On CPUs this runs on gloo under
``TRITON_INTERPRET=1``; on GPUs on NCCL with the symmetric-memory designs.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.distributed as dist  # noqa: E402

import disttune  # noqa: E402
from disttune import dist as dt_dist  # noqa: E402
from disttune.kernels.ag_gemm import AllGatherGEMM, ag_gemm_reference  # noqa: E402
from disttune.kernels.gemm_rs import GemmReduceScatter, gemm_rs_reference  # noqa: E402
from disttune.kernels.matmul import HOPPER_GEMM_CONFIGS  # noqa: E402
from disttune.kernels.shard_gemm import make_shard_gemm_kernel  # noqa: E402
from disttune.kernels.tp_common import split_rows  # noqa: E402

TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 2e-3}  # fp32 on GPU is TF32


def say(line: str) -> None:
    """One write per line, so lines of ranks sharing a pipe do not run into each other."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    if not bool(torch.isfinite(got).all()):
        return float("inf")
    want = want.float()
    return ((got.float() - want).norm() / want.norm().clamp_min(1e-12)).item()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", choices=["tiny", "small", "large"], default="small")
    parser.add_argument("--dtypes", default="float16,float32")
    parser.add_argument("--tune", action="store_true")
    parser.add_argument("--trace", action="store_true", help="print each case before it runs (find a hang)")
    parser.add_argument("--all-configs", action="store_true",
                        help="GPU: stock-autotune the checked ops over the full Hopper space (default: 4 configs "
                             "of different tile shapes, so the check is not dominated by compiling)")
    options = parser.parse_args()
    faulthandler.register(signal.SIGTERM, all_threads=True)  # a launcher's timeout shows where each rank was
    info = dt_dist.init()
    rank, world, device = info.rank, info.world_size, info.device
    generator = torch.Generator().manual_seed(100 + rank)
    failures: list[str] = []
    checks = 0

    def rand(*shape, dtype):
        return torch.randn(*shape, generator=generator).to(device, dtype)

    if options.size == "tiny":  # one ragged shape each: the 8-rank code-path check
        ag_shapes = [(tuple(split_rows(8 * world + 3, world)), 16, 16)]
        rs_shapes = [(8 * world + 3, 16, 16)]
    elif options.size == "small":
        ag_shapes = [((8,) * world, 32, 16), (tuple(split_rows(37, world)), 24, 24), ((20,) * world, 40, 32)]
        rs_shapes = [(16 * world, 32, 16), (37, 24, 24), (41, 16, 40)]
    else:
        ag_shapes = [((1024,) * world, 4096, 2048), (tuple(split_rows(3001, world)), 2048, 1024)]
        rs_shapes = [(4096, 2048, 4096), (3001, 1024, 2048)]

    if world > 1:  # rank 0 without rows: it sends nothing, and nobody waits for its shard
        ag_shapes.append(((0,) + tuple(split_rows(ag_shapes[-1][0][0] * world - 2, world - 1)), 32, 16))
    few = None if options.all_configs or device.type != "cuda" else [HOPPER_GEMM_CONFIGS[i] for i in (0, 1, 9, 10)]

    def kernel():
        return make_shard_gemm_kernel(few)

    ag_ops = {design: AllGatherGEMM(design=design, kernel=kernel()) for design in ("fused", "decomposed")}
    # shards in 4 flagged pieces over 2 copy streams (GPU: 4 pushes per peer, 2 side streams)
    ag_ops["fused, 4 chunks, 2 streams"] = AllGatherGEMM(design="fused", chunks=4, streams=2, kernel=kernel())
    rs_op = GemmReduceScatter(kernel=kernel())
    for dtype in [getattr(torch, name) for name in options.dtypes.split(",")]:
        for rows, K, n_local in ag_shapes:
            for design, op in ag_ops.items():
                for again in range(2):  # twice: the second call reuses the double-buffered workspace
                    a_shard = rand(rows[rank], K, dtype=dtype)
                    b_local = rand(K, n_local, dtype=dtype) / K ** 0.5
                    if again:  # B as the transpose of a row-major [N, K] weight (the K-major path)
                        b_local = b_local.t().contiguous().t()
                    out = torch.full((sum(rows), n_local), float("nan"), dtype=dtype, device=device)
                    if options.trace:
                        sys.stdout.write(f"rank {rank}: AG-GEMM {design} rows={rows} K={K} {dtype} #{again}\n")
                        sys.stdout.flush()
                    op(a_shard, b_local, out, shard_rows=rows)
                    err = rel_error(out, ag_gemm_reference(a_shard, b_local, rows))
                    checks += 1
                    if not err <= TOLERANCE[dtype]:
                        failures.append(f"AG-GEMM {design} rows={rows} K={K} N_r={n_local} {dtype}: rel. error {err:.2e}")
        for M, K_local, N in rs_shapes:
            for again in range(2):
                a_local = rand(M, K_local, dtype=dtype)
                b_local = rand(K_local, N, dtype=dtype) / (K_local * world) ** 0.5
                if again:
                    b_local = b_local.t().contiguous().t()
                mine = split_rows(M, world)[rank]
                out = torch.full((mine, N), float("nan"), dtype=dtype, device=device)
                if options.trace:
                    sys.stdout.write(f"rank {rank}: GEMM-RS M={M} K_r={K_local} N={N} {dtype} #{again}\n")
                    sys.stdout.flush()
                rs_op(a_local, b_local, out)
                err = rel_error(out, gemm_rs_reference(a_local, b_local))
                checks += 1
                if not err <= TOLERANCE[dtype] * 2:
                    failures.append(f"GEMM-RS M={M} K_r={K_local} N={N} {dtype}: rel. error {err:.2e}")

    if options.tune:
        dtype = getattr(torch, options.dtypes.split(",")[0])
        M, H, F = (16 * world, 32, 16 * world) if options.size == "small" else (4096, 4096, 8192)
        x_shard = rand(M // world, H, dtype=dtype)
        w_up = rand(H, F // world, dtype=dtype) / H ** 0.5
        w_down = rand(F // world, H, dtype=dtype) / F ** 0.5
        hidden = torch.empty(M, F // world, dtype=dtype, device=device)
        y = torch.empty(M // world, H, dtype=dtype, device=device)
        ag, rs = AllGatherGEMM(), GemmReduceScatter()

        @disttune.contextual_autotune(is_dist=True, n_warmup=1, n_repeat=2, timeout_s=120)
        def tp_mlp():
            y.fill_(float("nan"))
            ag(x_shard, w_up, hidden)
            return rs(hidden, w_down, y)

        result = tp_mlp()
        want = gemm_rs_reference(ag_gemm_reference(x_shard, w_up), w_down)
        err = rel_error(result, want)
        checks += 1
        if not err <= TOLERANCE[dtype] * 4:
            failures.append(f"tuned TP-MLP: rel. error {err:.2e}")
        winners = [(r.site.kernel, repr(r.site.key), r.site.occurrence, disttune.describe_config(r.config))
                   for r in tp_mlp.report.results]
        everyone: list = [None] * world
        dist.all_gather_object(everyone, winners)
        checks += 1
        if any(w != everyone[0] for w in everyone) or len(winners) < 2:
            failures.append(f"winners differ between ranks or too few sites: {everyone}")
        if rank == 0:
            for kernel, key, occurrence, config in winners:
                print(f"winner {kernel.rsplit('.', 1)[-1]} key={key} #{occurrence}: {config}", flush=True)

    verdicts: list = [None] * world
    dist.all_gather_object(verdicts, failures)
    dt_dist.destroy()
    if failures:
        say(f"rank {rank}: FAILED {len(failures)} of {checks} checks:\n  " + "\n  ".join(failures))
        return 1
    say(f"rank {rank}: {checks} checks passed")
    return 0 if not any(verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
