"""bench/tuning_cost.py's MoE workload on 2 CPU ranks (gloo, interpreter): the code path a GPU run measures.

The "all" variant tunes the grouped GEMM in context (parallel compile, early stopping, store) and
the "untuned" variant reads that winner back and fixes it; both rows must describe the same step
(one row per variant: rank 0 alone writes).
"""

from __future__ import annotations

import json

import pytest

from helpers import describe, run_launch


@pytest.mark.slow
def test_moe_workload_tunes_and_the_untuned_variant_fixes_its_winner(tmp_path):
    rows_file = tmp_path / "rows.jsonl"
    env = {"DISTTUNE_CACHE_DIR": str(tmp_path / "store"), "DISTTUNE_LOG_DIR": str(tmp_path / "logs")}
    for variant in ("all", "untuned"):
        proc = run_launch(["--nproc_per_node=2", "bench/tuning_cost.py", "--variant", variant, "--workload", "moe",
                           "--out", str(rows_file)], timeout=240, extra_env=env)
        assert proc.returncode == 0, describe(proc)
    tuned, fixed = [json.loads(line) for line in rows_file.read_text().splitlines()]
    assert (tuned["variant"], fixed["variant"]) == ("all", "untuned")
    assert tuned["workload"] == fixed["workload"] == "moe"
    assert tuned["source"] == "tuned" and tuned["function_runs"] > 3  # the discovery run, then config runs
    assert fixed["winner"] == tuned["winner"] and fixed["function_runs"] == 1
    assert tuned["step_ms_median_of_100"] > 0 and fixed["step_ms_median_of_100"] > 0
    for row in (tuned, fixed):  # where it ran: disttune.benchmark.environment, written by rank 0 only
        assert row["world"] == 2 and row["device"].startswith("cpu") and {"torch", "triton", "date"} <= set(row)
