"""Sweep, pin, serve: the MoE grouped GEMM tuned over batch sizes, then sizes never tuned served from the table.

    bash scripts/launch.sh --nproc_per_node=2 examples/sweep_moe.py              # GPUs: batch 1 to 4096
    bash scripts/launch.sh --nproc_per_node=2 examples/sweep_moe.py --small      # CPU, Triton interpreter
    disttune sweep --nproc 2 --table moe_winners.json examples/sweep_moe.py --small

The step is a row-parallel MoE down projection: every rank holds the same tokens' activations for its
slice of the expert width (``x [T, I/w]``) and its slice of every expert's weights (``w [E, I/w, H]``);
the grouped GEMM (``disttune.kernels.moe_gemm``) gives each rank a partial ``[T * top_k, H]`` and an
all-reduce sums them. 1. ``step.sweep`` tunes the GEMM in context (beside the all-reduce) for each batch
size of ``--sizes`` and writes the winners as a pinned table (``--table``, or the one ``disttune sweep``
names). 2. A second wrapper, ``pinned=`` that table and ``on_new_key="nearest"``, serves the sizes of
``--serve``: each runs at once on the table's winner for its key, or on the nearest tuned key's winner
(the key holds the routed row count rounded up to a power of two), with no tuning and no collective of
disttune's. Exits non-zero if a served output differs from a torch reference.
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
from disttune import dist as dt_dist  # noqa: E402
from disttune import env  # noqa: E402
from disttune.kernels import moe  # noqa: E402
from disttune.kernels.moe_routing import moe_align  # noqa: E402
from disttune.logs import resolve_log_dir  # noqa: E402


def bucket_of(text: str) -> str:
    """The ROWS_BUCKET of the first grouped-GEMM key in ``text`` (its sixth part)."""
    parts = text.split("(", 1)[1].split(", ") if "(" in text else []
    return parts[5] if len(parts) > 5 else ""


def sizes(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", default=not torch.cuda.is_available(),
                        help="small sizes and CPU configs (the default without a GPU: Triton's interpreter)")
    parser.add_argument("--sizes", type=sizes, default=None,
                        help="batch sizes to sweep (default 1,4,16,...,4096; --small: 1,4,16,64)")
    parser.add_argument("--serve", type=sizes, default=None,
                        help="batch sizes to serve afterwards (default 2,8,100,3000; --small: 2,8,40)")
    parser.add_argument("--table", default=None,
                        help="the pinned table (default: $DISTTUNE_SWEEP_TABLE, else LOG_DIR/moe_winners.json)")
    parser.add_argument("--n-warmup", type=int, default=2)
    parser.add_argument("--n-repeat", type=int, default=5)
    return parser.parse_args()


def main() -> int:
    o = parse_args()
    info = dt_dist.init()
    rank, world, device = info.rank, info.world_size, info.device
    gpu = device.type == "cuda" and not o.small
    E, top_k, H, I = (64, 6, 2048, 1408) if gpu else (4, 2, 32, 64)
    dtype = torch.bfloat16 if gpu else torch.float16
    configs = moe.HOPPER_MOE_CONFIGS if gpu else moe.CPU_MOE_CONFIGS
    swept = o.sizes or ([4 ** i for i in range(7)] if gpu else [1, 4, 16, 64])
    served = o.serve or ([2, 8, 100, 3000] if gpu else [2, 8, 40])
    table = o.table or env.sweep_table() or str(resolve_log_dir(None) / "moe_winners.json")
    if I % world:
        raise SystemExit(f"the expert width {I} must be a multiple of the world size {world}")
    g = torch.Generator().manual_seed(7 + rank)
    w = (torch.randn(E, I // world, H, generator=g) / I ** 0.5).to(device, dtype)
    shared = torch.Generator().manual_seed(7)  # the same routing on every rank: it is one batch

    def batch(tokens: int) -> tuple:
        x = torch.randn(tokens, I // world, generator=g).to(device, dtype)
        ids = torch.stack([torch.randperm(E, generator=shared)[:top_k] for _ in range(tokens)]).to(device, torch.int32)
        return x, ids, moe_align(ids, E)

    def down_projection(kernel):
        def step(x, routing):
            out = moe.moe_gemm(x, w, routing, kernel=kernel, out_order="flat")
            dist.all_reduce(out)  # the row-parallel sum: communication beside the tuned GEMM
            return out

        return step

    tuned = disttune.contextual_autotune(is_dist=True, n_warmup=o.n_warmup, n_repeat=o.n_repeat)(
        down_projection(moe.make_moe_kernel(configs)))
    started = time.perf_counter()
    tuned.sweep([((x, routing), {}) for x, _, routing in map(batch, swept)], table=table)
    sweep_s = time.perf_counter() - started

    serve = disttune.contextual_autotune(is_dist=True, pinned=table, on_new_key="nearest", verbose=False)(
        down_projection(moe.make_moe_kernel(configs)))
    ok, lines = True, []
    for tokens in served:
        x, ids, routing = batch(tokens)
        started = time.perf_counter()
        out = serve(x, routing)
        if gpu:
            torch.cuda.synchronize()
        took_ms = (time.perf_counter() - started) * 1e3
        reference = moe.moe_gemm_reference(x, ids, w).float()
        dist.all_reduce(reference)
        error = float((out.float() - reference).abs().max() / reference.abs().max().clamp_min(1e-6))
        ok = ok and error < 2e-2
        first = " (the first call: loads the table, compiles)" if not lines else ""
        lines.append(f"  batch {tokens:5d}: {took_ms:9.2f} ms, rel. error {error:.1e}{first}")
    verdicts: list = [None] * world
    dist.all_gather_object(verdicts, ok)
    if rank == 0:
        where = torch.cuda.get_device_name() if gpu else "CPU, Triton interpreter"
        print(f"grouped GEMM E={E} top-{top_k} K={I // world} N={H} {dtype} on {world} rank(s) "
              f"({info.backend}, {where}): swept batch sizes {swept} in {sweep_s:.1f} s, pinned table {table}")
        print("served, never tuned, with on_new_key='nearest':\n" + "\n".join(lines))
        for site, source in sorted(serve.fallbacks.items()):
            buckets = [bucket_of(text) for text in (site, source)]  # the key's ROWS_BUCKET
            print(f"  rows bucket {buckets[0]} (never tuned) ran {source.split(' <- ')[0]}, "
                  f"the winner of rows bucket {buckets[1] or '-'} ({source.split(' <- ')[1].split(' (')[0]})")
        print(f"correct on every rank: {all(verdicts)}")
    dt_dist.destroy()
    return 0 if all(verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
