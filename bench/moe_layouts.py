"""The TP MoE layer's two grouped GEMMs under each grouping of the gathered rows, on one GPU.

    python bench/moe_layouts.py                       # 64 and 8 experts, the 2- and 4-rank slices
    python bench/moe_layouts.py --experts 64 --ranks 2

``ag_moe`` can group every rank's gathered rows per (source rank, expert) (``layout="rank"``) or per
expert over every rank (``layout="expert"``, what ``tp_moe_layer`` picks where ranks send each expert
few rows; docs/moe.md, "Grouping the gathered rows"). This times the layer's GEMMs of one rank on
all T=4096 tokens under both, with the arrival flags already set (what is left is the tiling, the
group table and the per-tile wait), against one rank's plain routing that never waits:

  up, per (rank, expert)   gate-up GEMM, ``moe_align_stacked`` routing, waiting per group
  up, per expert           gate-up GEMM, ``moe_align_gathered`` routing, waiting per tile
  up, plain                gate-up GEMM, ``moe_align`` routing, no wait
  down, per (rank, expert) / down, per expert   the down GEMM (weight in the epilogue) on each routing

Each GEMM has its own stock ``triton.autotune`` kernel (tuned on its first call); ms per call, 10 calls
back to back (``disttune.benchmark.steady_ms``), the contenders interleaved in ``--rounds`` rounds,
median and range. Cost: per shape, 5 tunings of 12 configs and ``rounds x 5 x 60`` GEMM calls.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from disttune.benchmark import steady_ms
from disttune.kernels import moe

SHAPES = {64: dict(k=6, H=2048, I=1408), 8: dict(k=2, H=4096, I=7168)}
T = 4096


def m_tiles(routing: moe.MoeRouting, block_m: int = 128) -> int:
    """M-tiles of ``block_m`` rows over the routing's groups (one partly filled tile per group end)."""
    return int(((routing.counts + block_m - 1) // block_m).sum())


def bench_shape(E: int, world: int, rounds: int) -> None:
    k, H, I = SHAPES[E]["k"], SHAPES[E]["H"], SHAPES[E]["I"]
    N_up, I_r = 2 * I // world, I // world
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
    scores, ids = torch.rand(T, E, device="cuda", generator=g).topk(k, dim=1)
    ids, weights = ids.to(torch.int32), scores / scores.sum(1, keepdim=True)
    w_up = torch.randn(E, H, N_up, device="cuda", dtype=torch.bfloat16, generator=g) / H ** 0.5
    w_down = torch.randn(E, I_r, H, device="cuda", dtype=torch.bfloat16, generator=g) / I_r ** 0.5
    h = torch.randn(T * k, I_r, device="cuda", dtype=torch.bfloat16, generator=g)
    tokens = (T // world,) * world
    stacked = moe.moe_align_stacked(ids, E, tokens)
    gathered = moe.moe_align_gathered(ids, E, tokens)
    plain = moe.moe_align(ids, E, check_range=False)
    arrived = (torch.ones(world, dtype=torch.int32, device="cuda"), 1)
    rows_bucket = moe.next_power_of_2(T * k)
    up_out = torch.empty(T * k, N_up, device="cuda", dtype=torch.bfloat16)

    def up(routing, wait):
        kernel = moe.make_moe_kernel(moe.HOPPER_MOE_CONFIGS)
        return lambda: moe.moe_gemm(x, w_up, routing, a_order="token", out=up_out, kernel=kernel,
                                    rows_bucket=rows_bucket, wait=wait)

    def down(routing):
        kernel = moe.make_moe_kernel(moe.HOPPER_MOE_CONFIGS)
        return lambda: moe.moe_gemm(h, w_down, routing, a_order="sorted", out_order="flat", weights=weights,
                                    kernel=kernel, rows_bucket=rows_bucket)

    contenders = {"up, per (rank, expert)": up(stacked, arrived), "up, per expert": up(gathered, arrived),
                  "up, plain": up(plain, None), "down, per (rank, expert)": down(stacked),
                  "down, per expert": down(gathered)}
    for step in contenders.values():
        step()  # tunes
    times: dict[str, list] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, step in contenders.items():
            times[name].append(steady_ms(step, calls=10, runs=5))
    print(f"\n### E={E} top-{k} H={H}, the {world}-rank slice (gate-up N={N_up}, down K={I_r}), T={T}: "
          f"M-tiles of 128 rows: per (rank, expert) {m_tiles(stacked)}, per expert {m_tiles(gathered)}\n")
    print("| GEMM | ms, median [low-high] |\n| --- | ---: |")
    for name, values in times.items():
        print(f"| {name} | {statistics.median(values):.4f} [{min(values):.4f}-{max(values):.4f}] |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", default="64,8", help="expert counts of the shapes (64 and/or 8)")
    parser.add_argument("--ranks", default="2,4", help="the layers' world sizes whose slices to time")
    parser.add_argument("--rounds", type=int, default=5)
    options = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/moe_layouts.py needs a CUDA GPU (the waits read flags with system-scope atomics)")
    for E in (int(e) for e in options.experts.split(",")):
        for world in (int(w) for w in options.ranks.split(",")):
            bench_shape(E, world, options.rounds)


if __name__ == "__main__":
    main()
