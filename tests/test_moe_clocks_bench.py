"""bench/moe_clocks.py's reading of ``nvidia-smi --query-gpu`` samples (the part that runs without a GPU)."""

from __future__ import annotations

from helpers import load_bench


def test_summarize_takes_medians_and_the_share_of_each_clock_event_reason():
    bench = load_bench("moe_clocks")
    # sm MHz, mem MHz, power W, power cap W, temp C, active reasons: 0x4 sw power cap, 0x20 sw thermal
    rows = [["1425", "3201", "692.5", "700.00", "62", "0x0000000000000004"],
            ["1410", "3201", "690.0", "700.00", "63", "0x0000000000000024"],
            ["1980", "3201", "[N/A]", "700.00", "61", "0x0000000000000000"],
            ["1395", "3201", "695.1"]]  # a line cut short: dropped
    got = bench.summarize(rows)
    assert got["samples"] == 3
    assert got["sm_mhz"] == 1425.0 and got["mem_mhz"] == 3201.0 and got["temp_c"] == 62.0
    assert got["power_w"] == (692.5 + 690.0) / 2  # the [N/A] reading is left out
    assert got["power_limit_w"] == 700.0
    assert got["reasons"] == {"sw power cap": round(2 / 3, 2), "sw thermal": round(1 / 3, 2)}


def test_summarize_of_no_samples_says_so():
    assert load_bench("moe_clocks").summarize([]) == {"samples": 0}
