"""Why does one H200 favour the ``tl`` grouped GEMM and another ``torch._grouped_mm``? Clocks, power and L2.

The 8-expert grouped GEMM (T=4096, top-2, H=4096, I=7168, sorted A) is measured as in
``bench/moe_gluon.py`` (flushed and back to back), then each kernel runs sustained for ``--seconds``
while ``nvidia-smi`` samples the SM clock, the power draw and the active clock-event ("throttle")
reasons every 20 ms. Contenders: ``torch._grouped_mm`` and the ``tl`` kernel in both tile orders
(``moe.EXPERT_BANDS``), each with row-major and K-major weights, over ``--rounds`` rounds in
alternating order. The table gives, per kernel, its time, the median SM clock and power while it
ran, and how often the power cap or a thermal limit held the clock down. ``--only N`` runs
contender N five times and nothing else, for ``ncu`` (``scripts/gpu_bench.sh clocks`` reads each
kernel's L2 and DRAM bytes and SM clock that way).

What it showed (docs/gpu-runs/2026-11-25-h200x1.md): sustained, every contender sits at the 700 W
cap at 1440-1485 MHz, within 1% of the others; under ncu, one at a time, they take the same time
at the same clock. Cost: about 16 s of GPU time per kernel, layout and round at the defaults.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import triton

QUERY = "clocks.sm,clocks.mem,power.draw,power.limit,temperature.gpu,clocks_event_reasons.active"
# Bits of clocks_event_reasons.active (nvml.h: nvmlClocksEventReason*).
REASON_BITS = {"idle": 0x1, "app clocks": 0x2, "sw power cap": 0x4, "hw slowdown": 0x8, "sync boost": 0x10,
               "sw thermal": 0x20, "hw thermal": 0x40, "hw power brake": 0x80}


def summarize(rows: list[list[str]]) -> dict:
    """Medians of the ``QUERY`` fields over ``rows`` (one list of strings per sample; readings that are
    not numbers, such as ``[N/A]``, are left out) and the share of samples each clock-event reason
    was active in. Rows without all six fields (a line cut short) are dropped."""
    rows = [r for r in rows if len(r) == 6]
    if not rows:
        return {"samples": 0}

    def median(i):
        values = [float(r[i]) for r in rows if r[i].replace(".", "", 1).isdigit()]
        return statistics.median(values) if values else None

    reasons = [int(r[5], 16) if r[5].startswith("0x") else 0 for r in rows]
    share = {name: round(sum(1 for x in reasons if x & bit) / len(rows), 2)
             for name, bit in REASON_BITS.items() if any(x & bit for x in reasons)}
    return {"samples": len(rows), "sm_mhz": median(0), "mem_mhz": median(1), "power_w": median(2),
            "power_limit_w": median(3), "temp_c": median(4), "reasons": share}


class SmiSampler:
    """Samples ``nvidia-smi --query-gpu`` every ``period_ms`` in a background process; ``window``
    returns the samples taken between two host times. Costs one process, no GPU time."""

    def __init__(self, period_ms: int = 20, gpu: int = 0):
        self.samples: list[tuple[float, list[str]]] = []
        self.proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
                                      f"-lms={period_ms}", f"-i={gpu}"], stdout=subprocess.PIPE, text=True)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.samples.append((time.time(), [f.strip() for f in line.split(",")]))

    def window(self, start: float, stop: float) -> dict:
        return summarize([fields for t, fields in self.samples if start <= t <= stop])

    def close(self) -> None:
        self.proc.terminate()


def sustained(fn, seconds: float) -> tuple[float, float, float]:
    """Runs ``fn`` back to back for about ``seconds``; returns (host start, host stop, ms per call)."""
    fn()
    torch.cuda.synchronize()
    start_event, stop_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    calls, t0 = 0, time.time()
    start_event.record()
    while time.time() - t0 < seconds:
        for _ in range(20):
            fn()
        calls += 20
        torch.cuda.synchronize()  # keeps the host clock in step with the samples
    stop_event.record()
    torch.cuda.synchronize()
    return t0, time.time(), start_event.elapsed_time(stop_event) / calls


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=8.0, help="sustained run per kernel and layout")
    p.add_argument("--rounds", type=int, default=2, help="rounds over the kernels, every other one in reverse order "
                                                         "(whichever runs first after a rest may get higher clocks)")
    p.add_argument("--rest", type=float, default=3.0, help="idle seconds before each kernel's measurements")
    p.add_argument("--out", default=None, help="JSON lines file (default: $OUT/moe_clocks.jsonl)")
    p.add_argument("--only", default=None, help="run one contender by index (for ncu), no sampling")
    options = p.parse_args()
    if not torch.cuda.is_available():
        print("bench/moe_clocks.py needs a GPU", file=sys.stderr)
        return 2
    from disttune.kernels import moe

    sys.path.insert(0, str(Path(__file__).parent))
    from moe_gluon import append_rows, back_to_back_ms
    from moe_tile_order import in_tile_order

    torch.manual_seed(0)
    T, E, k, H, I = 4096, 8, 2, 4096, 7168
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    rt = moe.moe_align(torch.rand(T, E, device="cuda").topk(k, dim=1).indices.to(torch.int32), E)
    w_rows = (torch.randn(E, H, I, device="cuda") / H ** 0.5).to(torch.bfloat16)
    w_kmajor = w_rows.transpose(1, 2).contiguous().transpose(1, 2)
    xs = rt.permute(x)
    out = torch.empty(rt.num_rows, I, device="cuda", dtype=torch.bfloat16)
    config = moe.HOPPER_MOE_CONFIGS[0]
    tile = "x".join(str(config.kwargs[b]) for b in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))

    def tl_gemm(w, expert_bands: bool):
        return in_tile_order(lambda: moe.moe_gemm_with_config(xs, w, rt, config, a_order="sorted", out=out),
                             expert_bands)

    contenders = []
    for w_name, w in (("row-major", w_rows), ("K-major", w_kmajor)):
        contenders.append(("torch._grouped_mm", w_name, lambda w=w: torch._grouped_mm(
            xs, w, offs=rt.expert_offs[1:], out_dtype=torch.bfloat16)))
        contenders.append((f"tl {tile}, bands across experts", w_name, tl_gemm(w, False)))
        contenders.append((f"tl {tile}, bands inside experts", w_name, tl_gemm(w, True)))
    if options.only is not None:
        fn = contenders[int(options.only)][2]
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        return 0

    flops = 2 * rt.expert_offs[-1].item() * H * I
    gpu = torch.cuda.get_device_name()
    print(subprocess.run(["nvidia-smi", "-q", "-d", "CLOCK,POWER,PERFORMANCE,TEMPERATURE"],
                         capture_output=True, text=True).stdout, flush=True)
    sampler = SmiSampler()
    time.sleep(1.0)
    idle = sampler.window(time.time() - 0.8, time.time())
    print(f"idle: {idle}", flush=True)
    out_path = Path(options.out or Path(os.environ.get("OUT", ".")) / "moe_clocks.jsonl")
    rows = []
    print(f"\n### T={T} E={E} top-{k} H={H} I={I}, {gpu}: flushed (do_bench, L2 flushed before each call) "
          f"and {options.seconds:.0f} s sustained per kernel; SM clock and power are medians over each phase\n")
    print("| round | kernel | W | ms flushed | SM MHz | W drawn | ms b2b | ms sustained | SM MHz | W drawn / cap | temp C "
          "| held down by (sustained) |")
    print("| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    order = [(r, c) for r in range(options.rounds) for c in (contenders if r % 2 == 0 else contenders[::-1])]
    for round_, (name, w_name, fn) in order:
        time.sleep(options.rest)  # let the clocks, the power average and the temperature settle
        t0 = time.time()
        flushed = triton.testing.do_bench(fn, warmup=100, rep=1500)
        f = sampler.window(t0 + 0.3, time.time())
        b2b = back_to_back_ms(fn)
        time.sleep(2.0)
        t0, t1, ms = sustained(fn, options.seconds)
        # skip the first second: the clock ramps and the power averages over a window
        s = sampler.window(t0 + 1.0, t1)
        reasons = ", ".join(f"{r} {v:.0%}" for r, v in s.get("reasons", {}).items()) or "-"
        print(f"| {round_} | {name} | {w_name} | {flushed:.3f} | {f.get('sm_mhz')} | {f.get('power_w')} | {b2b:.3f} | {ms:.3f} | "
              f"{s.get('sm_mhz')} | {s.get('power_w')} / {s.get('power_limit_w')} | {s.get('temp_c')} | {reasons} |",
              flush=True)
        rows.append(dict(bench="moe_clocks", gpu=gpu, round=round_, kernel=name, w=w_name, ms_flushed=flushed, ms_b2b=b2b,
                         ms_sustained=ms, tflops_sustained=flops / ms / 1e9,
                         **{f"flushed_{key}": v for key, v in f.items()},
                         **{f"sustained_{key}": v for key, v in s.items()}))
    sampler.close()
    append_rows(out_path, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
