"""``bench/tuning_cost_table.py``: the first-call, overhead and breakdown tables from a run's rows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
META = {"world": 1, "device": "test GPU", "torch": "t", "triton": "tr", "date": "d", "workload": "gemm"}


def row(variant, first, winner="A", **extra):
    return {**META, "variant": variant, "first_call_s": first, "plain_call_s": 0.01, "function_runs": 98,
            "source": "tuned", "winner": winner, "step_ms_median_of_100": 1.6, **extra}


@pytest.mark.slow
def test_tables_give_overheads_against_the_untuned_cold_call_and_each_variants_phases(tmp_path):
    phases = {"discovery run": 1.0, "tuning runs": 0.5, "collectives": 0.1, "python overhead": 0.1}
    rows = [row("baseline", 7.0, phases=phases, tuning_wall_s=1.7, background={}),
            row("parallel", 3.0, winner="B", phases={"compile wait": 2.0, "python overhead": 0.5},
                tuning_wall_s=2.5, background={"compile busy": 9.0}),
            row("untuned_cold", 2.0, function_runs=1, source="fixed")]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = subprocess.run([sys.executable, str(ROOT / "bench" / "tuning_cost_table.py"), str(path)],
                          capture_output=True, text=True, check=True).stdout
    lines = {line.split()[0]: line.split() for line in text.splitlines() if line.strip()}
    assert lines["baseline"][1:5] == ["7.000", "1.00x", "5.000", "1.00x"]
    assert lines["parallel"][1:5] == ["3.000", "0.43x", "1.000", "0.20x"], "overhead: 3.0 - 2.0 against 7.0 - 2.0"
    assert lines["parallel"][8] == "NO", "another winner than the exhaustive baseline's is flagged"
    assert lines["compile"][2:] == ["0.000", "2.000"] and lines["discovery"][2:] == ["1.000", "0.000"]
    assert lines["python"][2:] == ["0.100", "0.500"]
    assert lines["(compile"][2:] == ["0.000", "9.000"]
    assert text.index("discovery run") < text.index("compile wait") < text.index("python overhead")
