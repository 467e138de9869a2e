"""Which tile order should the MoE grouped GEMM use: GROUP_M bands across experts, or inside each expert?

    python bench/moe_tile_order.py                     # interleaved timing table, one GPU
    ncu --clock-control base --csv --page raw --print-units base -k regex:'device_kernel|moe_gemm' \\
        --metrics gpu__time_duration.sum,dram__bytes_read.sum,sm__cycles_elapsed.avg.per_second \\
        python bench/moe_tile_order.py --launch-only > ncu.csv
    python bench/moe_tile_order.py --parse ncu.csv     # the counters per contender

Contenders, on the two shapes of ``bench/moe.py`` part a (bf16): ``torch._grouped_mm`` on the
sorted A, and ``moe.moe_gemm_with_config`` with the Hopper space's first config (128x256x64, 3
stages, 8 warps) in both tile orders (``moe.EXPERT_BANDS``), on gathered A (``a_order="token"``,
what ``ag_moe`` runs) and sorted A, with row-major ``[E, K, N]`` and K-major weights.

The timing table runs ``triton.testing.do_bench`` (L2 flushed before each call) over every
contender of one (shape, W) cell, ``--rounds`` times in alternating order, and reports medians:
an H200 at its 700 W cap drifts by a few per cent within seconds, and alternating spreads that
drift over every contender instead of favouring whichever ran first. ``--launch-only`` launches
each contender ``LAUNCHES`` times in a fixed order and nothing else, for ``ncu``; ``--parse`` maps
the ncu rows back to contenders by that order. With ``--clock-control base`` ncu locks the SM
clock, so its times compare the kernels' work, not what the power governor granted.
Cost: about 2 minutes of GPU time for the table, 1 for the ncu run.
"""
from __future__ import annotations

import argparse
import csv
import statistics
import sys
from typing import Callable, Optional

import torch
import triton

SHAPES = [dict(T=4096, E=8, k=2, H=4096, I=7168), dict(T=4096, E=64, k=6, H=2048, I=1408)]
LAUNCHES = 3  # per contender in --launch-only
METRICS = ("gpu__time_duration.sum", "dram__bytes_read.sum", "sm__cycles_elapsed.avg.per_second")


def in_tile_order(launch: Callable[[], object], expert_bands: bool) -> Callable[[], None]:
    """``launch`` with ``moe.EXPERT_BANDS`` set to ``expert_bands`` while it runs (the launch reads it)."""
    from disttune.kernels import moe

    def run() -> None:
        default, moe.EXPERT_BANDS = moe.EXPERT_BANDS, expert_bands
        try:
            launch()
        finally:
            moe.EXPERT_BANDS = default
    return run


def specs() -> list[tuple[str, str, Optional[str], bool]]:
    """(name, weight layout, a_order or None for ``torch._grouped_mm``, expert bands) in launch order."""
    rows = []
    for w_name in ("row-major", "K-major"):
        rows.append(("torch._grouped_mm, sorted A", w_name, None, False))
        for a_name, a_order in (("gathered A", "token"), ("sorted A", "sorted")):
            for bands in (False, True):
                rows.append((f"tl, {a_name}, bands {'inside' if bands else 'across'} experts", w_name, a_order, bands))
    return rows


def contenders(shape: dict) -> list[tuple[str, str, Callable[[], object]]]:
    """(name, weight layout, launch) for every spec on one shape; inputs built once, seeded."""
    from disttune.kernels import moe

    torch.manual_seed(0)
    T, E, k, H, I = shape["T"], shape["E"], shape["k"], shape["H"], shape["I"]
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    rt = moe.moe_align(torch.rand(T, E, device="cuda").topk(k, dim=1).indices.to(torch.int32), E)
    w_rows = (torch.randn(E, H, I, device="cuda") / H ** 0.5).to(torch.bfloat16)
    layouts = {"row-major": w_rows, "K-major": w_rows.transpose(1, 2).contiguous().transpose(1, 2)}
    a_for = {"token": x, "sorted": rt.permute(x)}
    out = torch.empty(rt.num_rows, I, device="cuda", dtype=torch.bfloat16)
    config = moe.HOPPER_MOE_CONFIGS[0]

    def launch(w, a_order: Optional[str], expert_bands: bool):
        if a_order is None:
            return lambda: torch._grouped_mm(a_for["sorted"], w, offs=rt.expert_offs[1:], out_dtype=torch.bfloat16)
        return in_tile_order(lambda: moe.moe_gemm_with_config(a_for[a_order], w, rt, config, a_order=a_order,
                                                              out=out), expert_bands)

    return [(name, w_name, launch(layouts[w_name], a_order, bands)) for name, w_name, a_order, bands in specs()]


def timing_table(rounds: int) -> None:
    gpu = torch.cuda.get_device_name()
    for shape in SHAPES:
        print(f"\n### T={shape['T']} E={shape['E']} top-{shape['k']} H={shape['H']} I={shape['I']}, {gpu}: "
              f"do_bench ms (L2 flushed), median of {rounds} alternating rounds\n")
        print("| contender | W | ms median | min | max | vs grouped_mm |")
        print("| --- | --- | ---: | ---: | ---: | ---: |")
        rows = contenders(shape)
        for w_name in ("row-major", "K-major"):
            cell = [r for r in rows if r[1] == w_name]
            samples: dict[str, list[float]] = {name: [] for name, _, _ in cell}
            for r in range(rounds):
                for name, _, fn in (cell if r % 2 == 0 else cell[::-1]):
                    samples[name].append(triton.testing.do_bench(fn, warmup=25, rep=200))
            ref = statistics.median(samples[cell[0][0]])
            for name, values in samples.items():
                med = statistics.median(values)
                print(f"| {name} | {w_name} | {med:.3f} | {min(values):.3f} | {max(values):.3f} | {ref / med:.2f}x |",
                      flush=True)


def launch_only() -> None:
    for shape in SHAPES:
        for _, _, fn in contenders(shape):
            for _ in range(LAUNCHES):
                fn()
    torch.cuda.synchronize()


#: ncu's units (``--print-units base`` or auto) -> the factor to the table's µs, MB and GHz.
UNITS = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3,
         "byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3,
         "cycle/nsecond": 1.0, "cycle/usecond": 1e-3, "cycle/second": 1e-9, "hz": 1e-9, "Khz": 1e-6, "Mhz": 1e-3, "Ghz": 1.0}


def parse(path: str) -> None:
    """The ncu CSV (``--csv --page raw``) as one row per contender: medians over its launches."""
    with open(path) as f:
        lines = [line for line in f if line.startswith('"')]  # ncu's own messages are not CSV
    table = list(csv.DictReader(lines))
    units = next((row for row in table if not row.get("ID", "").isdigit()), {})
    table = [row for row in table if row.get("ID", "").isdigit()]
    unknown = {units.get(m) for m in METRICS} - set(UNITS)
    if unknown:
        raise SystemExit(f"{path}: unknown units {sorted(map(str, unknown))} for {METRICS}")
    names = [(shape, name, w) for shape in SHAPES for name, w, _, _ in specs()]
    if len(table) != len(names) * LAUNCHES:
        raise SystemExit(f"{path}: {len(table)} profiled kernels, expected {len(names) * LAUNCHES} "
                         f"({len(names)} contenders x {LAUNCHES} launches)")
    print("| shape | contender | W | µs | DRAM read MB | SM GHz |")
    print("| --- | --- | --- | ---: | ---: | ---: |")
    for i, (shape, name, w) in enumerate(names):
        rows = table[i * LAUNCHES:(i + 1) * LAUNCHES]
        med = [statistics.median(float(r[m].replace(",", "")) for r in rows) * UNITS[units[m]] for m in METRICS]
        print(f"| E={shape['E']} | {name} | {w} | {med[0]:.1f} | {med[1]:.0f} | {med[2]:.2f} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds per table cell")
    p.add_argument("--launch-only", action="store_true", help="launch every contender, for ncu")
    p.add_argument("--parse", metavar="CSV", help="print the table of an ncu --csv --page raw run")
    options = p.parse_args()
    if options.parse:
        parse(options.parse)
        return 0
    if not torch.cuda.is_available():
        print("bench/moe_tile_order.py needs a GPU (except --parse)", file=sys.stderr)
        return 2
    launch_only() if options.launch_only else timing_table(options.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
