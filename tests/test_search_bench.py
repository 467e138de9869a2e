"""bench/search.py in its CPU mode (one rank, interpreter): the code path a GPU run measures."""

from __future__ import annotations

import json
import sys

import pytest

from helpers import describe, run_command


@pytest.mark.slow
def test_the_three_searches_tune_the_ag_gemm_step_and_write_a_row_each(tmp_path):
    rows_file = tmp_path / "rows.jsonl"
    proc = run_command([sys.executable, "bench/search.py", "--cpu", "--samples", "1", "--out", str(rows_file),
                        "--log-dir", str(tmp_path / "logs")], timeout=300)
    assert proc.returncode == 0, describe(proc)
    rows = {row["search"]: row for row in map(json.loads, rows_file.read_text().splitlines())}
    assert set(rows) == {"exhaustive", "screen", "model"}
    assert all(row["configs"] == 96 and row["rel_error"] < 2e-2 for row in rows.values())
    assert rows["exhaustive"]["configs_timed"] == 96 and rows["exhaustive"]["runs"] == 2 + 96
    assert rows["model"]["configs_timed"] <= 20 and rows["model"]["runs"] == 2 + rows["model"]["configs_timed"]
    assert "| model |" in proc.stdout and "space: generated 96, kept 96" in proc.stdout


@pytest.mark.slow
def test_the_searches_run_on_two_ranks_with_a_site_per_shard(tmp_path):
    """The decomposed step has one tuning site per rank's shard: every search tunes both, on two gloo ranks."""
    from helpers import run_launch

    rows_file = tmp_path / "rows.jsonl"
    proc = run_launch(["--nproc_per_node=2", "bench/search.py", "--cpu", "--samples", "1", "--searches",
                       "exhaustive,model", "--out", str(rows_file), "--log-dir", str(tmp_path / "logs")], timeout=600)
    assert proc.returncode == 0, describe(proc)
    rows = {row["search"]: row for row in map(json.loads, rows_file.read_text().splitlines())}
    assert rows["exhaustive"]["sites"] == 2 and rows["exhaustive"]["configs_timed"] == 2 * 96
    assert rows["model"]["sites"] == 2 and rows["model"]["configs_timed"] <= 2 * 20
