"""Model search on 2 gloo ranks whose local times differ: every rank proposes the same configs."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import failure, run_cases

CASES = Path(__file__).with_name("search_cases.py")


@pytest.mark.slow
def test_model_search_proposes_the_same_configs_on_every_rank(tmp_path):
    records = run_cases(CASES, ["model_proposals"], tmp_path, 2, timeout=240,
                        extra_env={"DISTTUNE_TIMEOUT": "30"})["model_proposals"]
    for record in records:
        assert record["ok"], failure(record)
    rank0, rank1 = records
    assert len(rank0["batches"]) >= 2
    assert rank0["batches"] == rank1["batches"], "each rank's own proposals, before any exchange"
    assert rank0["mismatches"] == rank1["mismatches"] == 0
    assert rank0["winner"] == rank1["winner"] and rank0["runs"] == rank1["runs"] == rank0["timed"] + 2
    # the ranks' own times would have led elsewhere: the agreement is what keeps them together
    assert rank0["alone_second_batch"] != rank1["alone_second_batch"]
