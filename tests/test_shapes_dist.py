"""Two ranks serving sizes after tuning: a size one rank alone meets never stalls either rank."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import failure, run_cases

CASES = Path(__file__).with_name("shapes_cases.py")
NAMES = ["one_rank_meets_a_new_size", "every_rank_meets_a_new_size", "a_new_size_that_cannot_be_tuned_keeps_its_fallback",
         "nearest_never_tunes_in_traffic",
         "function_tuner_new_sizes", "racy_config_scored_out", "step_objective_agreed"]
NEW = repr((100, "torch.float32", "torch.float32"))
TUNED = repr((64, "torch.float32", "torch.float32"))


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    out = tmp_path_factory.mktemp("shapes")
    found = run_cases(CASES, NAMES, out, 2, timeout=240, extra_env={"DISTTUNE_TIMEOUT": "30"})
    for per_rank in found.values():
        for record in per_rank:
            assert record["ok"], failure(record)
    return found


def _served(record):
    assert record["wrong_calls"] == [] and record["own_all_reduce_ok"] and record["tuned"], record
    assert record["slowest_call_s"] < 25, record  # a stall waits for the 30 s collective timeout


@pytest.mark.slow
def test_a_size_one_rank_meets_runs_on_the_fallback_and_both_ranks_keep_going(records):
    rank0, rank1 = records["one_rank_meets_a_new_size"]
    for record in (rank0, rank1):
        _served(record)
        assert record["tuned_keys"] == [TUNED] and record["timed_in_traffic"] == 0
    assert rank0["fallbacks"] == {}
    (served,) = rank1["fallbacks"].values()
    assert "BLOCK=32" in served and "nearest tuned key (64," in served


@pytest.mark.slow
def test_a_size_every_rank_meets_in_one_call_is_tuned_at_the_next_agreement(records):
    for record in records["every_rank_meets_a_new_size"]:
        _served(record)
        assert record["tuned_keys"] == sorted([TUNED, NEW])
        assert record["timed_in_traffic"] == 3 * 2  # 3 configs, n_repeat=2 timed runs each
        assert record["fallbacks"] == {}  # tuned now: no longer on a fallback


@pytest.mark.slow
def test_a_new_size_whose_tuning_fails_keeps_its_fallback_on_every_rank(records):
    for record in records["a_new_size_that_cannot_be_tuned_keeps_its_fallback"]:
        assert record["right"] and record["tuned_keys"] == [TUNED], record
        (served,) = record["fallbacks"].values()
        assert "nearest tuned key (64," in served, record
        assert record["notes"] >= 1, "the rank log says the tuning of the new keys failed"


@pytest.mark.slow
def test_nearest_serves_without_tuning_on_every_rank(records):
    rank0, rank1 = records["nearest_never_tunes_in_traffic"]
    for record in (rank0, rank1):
        _served(record)
        assert record["tuned_keys"] == [TUNED] and record["timed_in_traffic"] == 0
    assert len(rank0["fallbacks"]) == 2 and len(rank1["fallbacks"]) == 1


@pytest.mark.slow
def test_function_tuner_serves_new_keys_without_a_collective_and_tunes_shared_ones(records):
    rank0, rank1 = records["function_tuner_new_sizes"]
    for record in (rank0, rank1):
        assert record["slowest_call_s"] < 25, record  # not the 30 s collective timeout
        assert record["keys"] == [[64], [200]], record  # 200 was tuned at the agreement after the sixth call
        assert record["timed_in_traffic"] == 3
        # chunks=2 won for 64; 200 ran on it (nearest) until tuned; every call's own all-reduce summed 2
        assert record["outputs"] == [4.0] * 9, record
    assert rank0["fallbacks"] == {} and list(rank1["fallbacks"]) == ["(100,)"]
    assert "nearest tuned key (64,)" in rank1["fallbacks"]["(100,)"]


@pytest.mark.slow
def test_check_scores_out_a_config_of_the_shipped_gemm_that_skips_its_waits(records):
    """Host-clock timing: the racy config never waits for the shards, so it is the fastest and wins unchecked."""
    for record in records["racy_config_scored_out"]:
        if "skipped" in record:
            pytest.skip(record["skipped"])
        unchecked, checked = record["False"], record["True"]
        assert unchecked["winner"] == 1 and not unchecked["right"], record
        assert checked["winner"] == 0 and checked["right"] and checked["agreed_ms"][1] == float("inf"), record
        assert checked["log_names_it"] and not unchecked["log_names_it"]


@pytest.mark.slow
def test_step_objective_agrees_on_the_config_fastest_for_the_slowest_rank(records):
    for record in records["step_objective_agreed"]:
        assert record["launch"] == {"winner": 0, "agreed_ms": [1.0, 2.0, 3.0]}, record
        assert record["step"] == {"winner": 1, "agreed_ms": [9.0, 3.5, 4.0]}, record
