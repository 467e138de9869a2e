"""Which tile loop and load path the MoE grouped GEMM should use: variants of one kernel, one GPU.

    python bench/moe_variants.py            # the two shapes of bench/moe.py part a, bf16
    python bench/moe_variants.py --variants "persistent + flatten, TMA W" "persistent + flatten + expert bands, TMA W"

Every variant is ``moe.moe_gemm_jit`` with the same arguments but for the constexprs that shape
its loop: persistent or one program per tile, the flattened loop nest, the tile order (GROUP_M
bands across all experts' M-tiles, or bands inside each expert: ``moe.EXPERT_BANDS``) and weights
through TMA descriptors or pointer loads. Each variant runs every config of a small space (the Hopper space's
usual winners) and keeps its fastest (``triton.testing.do_bench``: mean ms, L2 flushed before each
call, so no back-to-back power throttling either); ``torch._grouped_mm``
on the same pre-permuted (sorted) A and the same weights is the reference in the same run.
"""

from __future__ import annotations

import argparse

import torch
import triton

from disttune.kernels import moe

SHAPES = [dict(T=4096, E=8, k=2, H=4096, I=7168), dict(T=4096, E=64, k=6, H=2048, I=1408)]
CONFIGS = [moe.gemm_config(128, 256, 64, 8, 3, 8), moe.gemm_config(128, 256, 64, 8, 4, 8),
           moe.gemm_config(128, 128, 64, 8, 4, 4), moe.gemm_config(128, 128, 128, 8, 3, 8),
           moe.gemm_config(64, 128, 64, 8, 4, 4)]
# name: (PERSISTENT, FLATTEN, weights through descriptors, EXPERT_BANDS)
VARIANTS = {
    "one program per tile, pointer W": (False, False, False, False),
    "one program per tile, TMA W": (False, False, True, False),
    "persistent, TMA W": (True, False, True, False),
    "persistent + flatten, TMA W": (True, True, True, False),
    "persistent + flatten + expert bands, TMA W": (True, True, True, True),
}
# (A, W) pairs timed: gathered A with both weight layouts, sorted A with the K-major one
PAIRS = [("gathered", "row-major W"), ("gathered", "K-major W"), ("sorted", "K-major W")]


def best_ms(a, w, rt, a_order: str, variant: tuple) -> tuple[float, str]:
    persistent, flatten, tma, bands = variant
    out, args, strides, meta = moe._prepare(a, w, rt, a_order, None, "sorted", None, "moe_variants")
    meta.update(PERSISTENT=persistent, FLATTEN=flatten, EXPERT_BANDS=bands)
    if not tma:
        meta["B_TMA"] = 0
    R, N = out.shape
    best = (float("inf"), "")
    for config in CONFIGS:
        grid = moe._grid(R, N, rt, meta["NUM_SMS"])({**config.kwargs, **meta})

        def launch():
            moe.moe_gemm_jit[grid](*args, moe.next_power_of_2(R), 0, 0, *strides, **meta, **config.kwargs,
                                   num_warps=config.num_warps, num_stages=config.num_stages)

        try:
            ms = triton.testing.do_bench(launch, warmup=25, rep=100)
        except Exception as err:  # noqa: BLE001 - a config that does not compile is skipped
            print(f"  {config}: {type(err).__name__}")
            continue
        best = min(best, (ms, str(config)))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS),
                        help="the variants to time (default: all)")
    chosen = {name: VARIANTS[name] for name in parser.parse_args().variants}
    torch.manual_seed(0)
    for s in SHAPES:
        T, E, k, H, I = s["T"], s["E"], s["k"], s["H"], s["I"]
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        ids = torch.rand(T, E, device="cuda").topk(k, dim=1).indices.to(torch.int32)
        rt = moe.moe_align(ids, E)
        w = (torch.randn(E, H, I, device="cuda") / H ** 0.5).to(torch.bfloat16)
        weights = {"row-major W": w, "K-major W": w.transpose(1, 2).contiguous().transpose(1, 2)}
        x_sorted = rt.permute(x)
        print(f"\n### T={T} E={E} top-{k} H={H} I={I}, {torch.cuda.get_device_name()}, ms (best config)\n")
        print("| variant | A | W | ms | vs grouped_mm | config |")
        print("| --- | --- | --- | ---: | ---: | --- |")
        refs = {}
        for w_name, ww in weights.items():
            refs[w_name] = triton.testing.do_bench(lambda: torch._grouped_mm(
                x_sorted, ww, offs=rt.expert_offs[1:], out_dtype=torch.bfloat16), warmup=25, rep=100)
            print(f"| torch._grouped_mm | sorted | {w_name} | {refs[w_name]:.3f} | 1.00x | |")
        operands = {"gathered": (x, "token"), "sorted": (x_sorted, "sorted")}
        for a_name, w_name in PAIRS:
            a, a_order = operands[a_name]
            for name, variant in chosen.items():
                ms, config = best_ms(a, weights[w_name], rt, a_order, variant)
                print(f"| {name} | {a_name} | {w_name} | {ms:.3f} | {refs[w_name] / ms:.2f}x | {config} |",
                      flush=True)


if __name__ == "__main__":
    main()
