"""Every rank ends the same way when one rank fails where the others do not.

Each test launches ``ending_cases.py`` on 2 gloo ranks with one fault injected on one rank (a raise
in the final run, a stored or pinned winner that cannot run there, a missing pinned table, a
raising ``key_fn``, ``prune_fn`` or statistic, user code raising before the step's own collective,
bad inputs, a store lock held by another process) and asserts that every rank returned the same
winner or raised the same clear error, well inside the collective timeout. The faults count in the
fault tally that the test run prints at its end.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fault_tally import TALLY
from helpers import CommandTimeout, failure, read_records, run_cases, run_launch

CASES = Path(__file__).with_name("ending_cases.py")
TIMEOUT_S = 20  # DISTTUNE_TIMEOUT of the launched ranks: "promptly" means well inside it


def launch(tmp_path: Path, cases: list[str], faults_per_case: int = 1, world: int = 2) -> dict:
    TALLY["trials"] += len(cases)
    TALLY["faults"] += faults_per_case * len(cases)
    try:
        return run_cases(CASES, cases, tmp_path / "run", world, timeout=240,
                         extra_env={"DISTTUNE_TIMEOUT": str(TIMEOUT_S)})
    except CommandTimeout:
        TALLY["hangs"] += 1
        raise


def same_ending(per_rank: list[dict], *fields: str) -> dict:
    """Every rank's record passed and holds the same ``fields``; a difference counts as a disagreement."""
    for record in per_rank:
        assert record["ok"], failure(record)
    values = {json.dumps([r.get(f) for f in fields]) for r in per_rank}
    if len(values) != 1:
        TALLY["disagreements"] += 1
    assert len(values) == 1, per_rank
    return per_rank[0]


def test_an_error_in_the_final_run_is_the_same_error_on_every_rank(tmp_path):
    results = launch(tmp_path, ["raise_in_final_run", "function_final_call_raises_on_one_rank"])
    contextual = same_ending(results["raise_in_final_run"], "first", "winner", "tuned")
    assert contextual["first"].startswith("TuningError: ") and "final run" in contextual["first"]
    assert "rank 1: RuntimeError: injected fault in the final run" in contextual["first"]
    assert contextual["tuned"] and contextual["winner"] == 2, "the next call ends the same way everywhere"
    function = same_ending(results["function_final_call_raises_on_one_rank"], "raised", "error", "second")
    assert function["raised"] == "TuningError" and "injected fault in the call with the winner" in function["error"]
    assert function["second"] == {"returned": 2}


def test_stored_and_pinned_winners_are_checked_on_every_rank(tmp_path):
    results = launch(tmp_path, ["stored_winner_raising_pre_hook", "stored_winner_compile_error",
                                "pinned_winner_compile_error", "stored_winner_untried_on_one_rank"])
    for case in ("stored_winner_raising_pre_hook", "stored_winner_compile_error"):
        ending = same_ending(results[case], "returned", "raised")
        assert ending["returned"] == {"winner": 1, "source": "tuned", "runs": 8}, ending  # tuned without config 2
    hook = same_ending(results["stored_winner_raising_pre_hook"], "warned", "after")
    assert hook["warned"] and "failed on rank 1: RuntimeError: injected pre_hook fault" in hook["warned"][0]
    assert hook["after"] == {"returned": {"winner": 1, "source": "store", "runs": 2}}, "the new winner was stored"
    pinned = same_ending(results["pinned_winner_compile_error"], "raised", "error")
    assert pinned["raised"] == "TuningError" and "pinned table" in pinned["error"]
    assert "rank 1: InterpreterError" in pinned["error"] and "BLOCK must be smaller than LIMIT" in pinned["error"]
    untried = same_ending(results["stored_winner_untried_on_one_rank"], "raised", "error", "then")
    assert untried["raised"] == "TuningError" and "failed in the final run" in untried["error"]
    assert untried["then"] == {"returned": 2.0}, "the function's own collectives stayed paired"


def test_a_local_error_before_a_collective_reaches_the_peers_at_once(tmp_path):
    cases = ["pinned_table_missing_on_one_rank", "function_key_fn_raises_on_one_rank",
             "function_prune_raises_on_one_rank", "statistic_raises_on_one_rank"]
    results = launch(tmp_path, cases)
    for case, says in zip(cases, ("cannot read pinned winners table", "injected fault in a user callable",
                                  "injected fault in a user callable", "statistic")):
        ending = same_ending(results[case], "raised", "error")
        assert ending["raised"] == "TuningError" and "rank 1: " in ending["error"] and says in ending["error"], ending
        assert all(r["seconds"] < TIMEOUT_S / 4 for r in results[case]), results[case]


@pytest.mark.parametrize("case", ["raise_before_collective", "raise_before_collective_in_discovery"])
def test_user_code_raising_before_the_steps_own_collective_is_named_on_every_rank(tmp_path, case):
    """Rank 1 raises before the all_reduce that rank 0 waits in (in a tuning run, in the discovery run):
    disttune cannot end that wait, but the error posted through the process group's store is named in
    every rank's message. The group is unusable afterwards, so each case has a launch of its own."""
    TALLY["trials"] += 1
    TALLY["faults"] += 1
    try:
        proc = run_launch(["--nproc_per_node=2", str(CASES), case, "--out", str(tmp_path)],
                          timeout=240, extra_env={"DISTTUNE_TIMEOUT": str(TIMEOUT_S)})
    except CommandTimeout:
        TALLY["hangs"] += 1
        raise
    (per_rank,) = read_records(tmp_path, [case], (0, 1), proc).values()
    for record in per_rank:
        assert record["error_type"] == "TuningError", failure(record)
        assert "rank 1: RuntimeError: injected fault before the collective" in record["error_message"], record
        assert record["elapsed_s"] < TIMEOUT_S, "ended by the tuner's own timeout (6 s), not the group's"


def test_bad_inputs_are_refused_before_tuning_on_every_rank(tmp_path):
    (per_rank,) = launch(tmp_path, ["bad_inputs"], faults_per_case=11).values()
    ending = same_ending(per_rank, "ok")
    attempts = [r["attempts"] for r in per_rank]
    expected = {
        "log_dir is a file": ("ValueError", "is an existing file, not a directory"),
        "DISTTUNE_LOG_DIR is a file": ("TuningError", "log_dir (resolved)"),
        "cache_dir not a path": ("TypeError", "cache_dir must be a path"),
        "function cache_dir not a path": ("TypeError", "cache_dir must be a path"),
        "timeout_s 0": ("DistEnvError", "timeout_s must be a positive number"),
        "timeout_s -1": ("DistEnvError", "timeout_s must be a positive number"),
        "function timeout_s 0": ("DistEnvError", "timeout_s must be a positive number"),
        "DISTTUNE_TIMEOUT text": ("DistEnvError", "DISTTUNE_TIMEOUT='soon' is not a number"),
        "DISTTUNE_TIMEOUT 0": ("DistEnvError", "(DISTTUNE_TIMEOUT)"),
        "key_fn unhashable": ("TuningError", "returned an unhashable list"),
        "statistic gives nan": ("TuningError", "it gave nan for config[0]"),
    }
    assert ending and set(attempts[0]) == set(expected)
    for what, (error_type, says) in expected.items():
        for rank, seen in enumerate(attempts):
            assert seen[what].get("raised") == error_type and says in seen[what]["error"], (rank, what, seen[what])
            assert seen[what]["seconds"] < TIMEOUT_S / 4, (rank, what, seen[what])
        if error_type == "TuningError":  # an error agreed in a collective: the same text on every rank
            same = len({seen[what]["error"] for seen in attempts}) == 1
            TALLY["disagreements"] += not same
            assert same, [seen[what] for seen in attempts]


def test_a_held_store_lock_is_waited_for_within_the_tuners_timeout(tmp_path):
    (per_rank,) = launch(tmp_path, ["store_lock_held"]).values()
    ending = same_ending(per_rank, "returned", "raised")
    assert ending["returned"] == {"winner": 2, "source": "tuned", "runs": 8}
    writer = per_rank[0]
    assert 2.5 < writer["seconds"] < 6, "rank 0 waits half the tuner's 6 s timeout for the lock, then goes on"
    (warning,) = writer["lock_warnings"]
    assert ".json.lock was held by another process for 3 s" in warning and str(tmp_path) in warning


@pytest.mark.slow
def test_four_ranks_end_the_same_way(tmp_path):
    """The faults on rank 1 of 4: the three healthy ranks end exactly as it does."""
    results = launch(tmp_path, ["raise_in_final_run", "stored_winner_raising_pre_hook",
                                "pinned_table_missing_on_one_rank", "statistic_raises_on_one_rank"], world=4)
    final = same_ending(results["raise_in_final_run"], "first", "winner")
    assert "rank 1: RuntimeError: injected fault in the final run" in final["first"] and final["winner"] == 2
    stored = same_ending(results["stored_winner_raising_pre_hook"], "returned", "after")
    assert stored["returned"]["source"] == "tuned" and stored["returned"]["winner"] == 1
    for case in ("pinned_table_missing_on_one_rank", "statistic_raises_on_one_rank"):
        ending = same_ending(results[case], "raised", "error")
        assert ending["raised"] == "TuningError" and "rank 1: " in ending["error"], ending
        assert all(r["seconds"] < TIMEOUT_S / 4 for r in results[case]), results[case]
