"""Every rank ends the same way when one rank fails where the others do not.

Each test launches ``ending_cases.py`` on 2 gloo ranks with one fault injected on one rank (a raise
in the final run, a stored or pinned winner that cannot run there, a missing pinned table, a
raising ``key_fn``, ``prune_fn`` or statistic, user code raising before the step's own collective,
bad inputs, a store lock held by another process) and asserts that every rank returned the same
winner or raised the same clear error, well inside the collective timeout.

Every test measures what it adds to the fault suite's summary line (see ``fault_tally``): each call
whose ending every rank must share is one trial, read back with ``endings()``, and a fault counts
once its effect is seen on every rank (the planted error named in each rank's message, the stored
winner tuned again, the lock's wait warned about).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fault_tally import TALLY, endings, faults_seen, hang, timeout_waits, tracebacks_in
from helpers import CommandTimeout, describe, failure, read_records, run_launch

CASES = Path(__file__).with_name("ending_cases.py")
TIMEOUT_S = 60  # DISTTUNE_TIMEOUT of the launched ranks: "promptly" means well inside it, on a busy machine too


def launch(tmp_path: Path, cases: list[str], world: int = 2) -> dict:
    """Run ``cases`` of ending_cases.py on ``world`` ranks; a hang or a traceback in stderr counts, then fails."""
    out = tmp_path / f"run{len(list(tmp_path.glob('run*')))}"
    out.mkdir(parents=True)
    try:
        proc = run_launch([f"--nproc_per_node={world}", str(CASES), *cases, "--out", str(out)], timeout=240,
                          extra_env={"DISTTUNE_TIMEOUT": str(TIMEOUT_S)})
    except CommandTimeout:
        hang()
        raise
    assert proc.returncode == 0, describe(proc)
    assert tracebacks_in(proc.stderr) == 0, describe(proc)
    return read_records(out, cases, range(world), proc)


def call_ending(record: dict, call: str | None = None) -> dict:
    """How one rank's ``call`` ended: ``returned`` (with the call's fields), or ``raised`` and ``error``.

    ``call`` names the record's field holding the call's outcome (default: the case's own call, whose
    outcome sits in the record itself); text outcomes read "returned" or "Type: message". A case that
    raised outside the call ends with its own error. ``ending`` is the error's type and text together.
    """
    if not record["ok"]:
        outcome = {"raised": record["error_type"], "error": record["error_message"]}
    elif call is None:
        outcome = {key: value for key, value in record.items() if key != "ok"}
    elif isinstance(record[call], str):
        raised, _, error = record[call].partition(": ")
        outcome = {"returned": True} if record[call] == "returned" else {"raised": raised, "error": error}
    else:
        outcome = dict(record[call])
    if "error" in outcome:
        outcome["ending"] = f"{outcome.get('raised')}: {outcome['error']}"
    return outcome


def same_ending(per_rank: list[dict], *fields: str, call: str | None = None) -> dict:
    """One trial: every rank's ``call`` returned the same ``fields`` or raised the same clear error.

    The ending is counted (split ending, disagreement, stray error) before it is asserted, as is every
    rank's case having run to its end; returns rank 0's ending of the call.
    """
    calls = [call_ending(record, call) for record in per_rank]
    ending = endings(calls, *fields, error="ending", message="error")
    for record in per_rank:
        assert record["ok"], failure(record)
    assert not any(ending.values()), (ending, calls)
    return calls[0]


def named_everywhere(text: str, calls: list[dict]) -> bool:
    """Whether every rank's error names ``text`` (the planted fault's effect, seen on each rank)."""
    return all(text in str(call.get("error")) for call in calls)


FINAL_RUN_FAILED = "the final run (with the winners) failed on rank(s) 1:"


@pytest.mark.slow
def test_an_error_in_the_final_run_is_the_same_error_on_every_rank(tmp_path):
    """Both tuners: the same error on every rank, in the one wording (where, then the rank's own exception)."""
    results = launch(tmp_path, ["raise_in_final_run", "function_final_call_raises_on_one_rank"])
    per_rank = results["raise_in_final_run"]
    first = same_ending(per_rank, call="first")
    planted = "rank 1: RuntimeError: injected fault in the final run"
    faults_seen(named_everywhere(planted, [call_ending(r, "first") for r in per_rank]))
    assert first["raised"] == "TuningError"
    assert first["error"].splitlines()[:2] == [f"disttune: case_raise_in_final_run.<locals>.step: {FINAL_RUN_FAILED}",
                                               f"  {planted}"], first
    contextual = same_ending(per_rank, "winner", "tuned")  # the next call tunes again on every rank
    assert contextual["tuned"] and contextual["winner"] == 2, "the next call ends the same way everywhere"
    per_rank = results["function_final_call_raises_on_one_rank"]
    function = same_ending(per_rank, "returned")
    faults_seen(named_everywhere("injected fault in the call with the winner", [call_ending(r) for r in per_rank]))
    assert function["raised"] == "TuningError"
    assert function["error"].splitlines()[:2] == [
        f"disttune: case_function_final_call_raises_on_one_rank.<locals>.pick: {FINAL_RUN_FAILED}",
        "  rank 1: RuntimeError: injected fault in the call with the winner"], function
    same_ending(per_rank, "returned", call="second")
    assert function["second"] == {"returned": 2}


@pytest.mark.slow
def test_stored_and_pinned_winners_are_checked_on_every_rank(tmp_path):
    results = launch(tmp_path, ["stored_winner_raising_pre_hook", "stored_winner_compile_error",
                                "pinned_winner_compile_error", "stored_winner_untried_on_one_rank"])
    tuned_without_config_2 = {"winner": 1, "source": "tuned", "runs": 8}
    per_rank = results["stored_winner_raising_pre_hook"]
    hook = same_ending(per_rank, "returned", "warned")
    assert hook["returned"] == tuned_without_config_2, hook
    planted = "failed on rank 1: RuntimeError: injected pre_hook fault"
    faults_seen(all(r["warned"] and planted in r["warned"][0] for r in per_rank))
    assert hook["warned"] and planted in hook["warned"][0]
    same_ending(per_rank, "returned", call="after")
    assert hook["after"] == {"returned": {"winner": 1, "source": "store", "runs": 2}}, "the new winner was stored"
    per_rank = results["stored_winner_compile_error"]
    ending = same_ending(per_rank, "returned")
    faults_seen(all(r.get("returned") == tuned_without_config_2 for r in per_rank))  # tuned again, without it
    assert ending["returned"] == tuned_without_config_2, ending
    calls = [call_ending(r) for r in results["pinned_winner_compile_error"]]
    pinned = same_ending(results["pinned_winner_compile_error"])
    faults_seen(named_everywhere("rank 1: InterpreterError", calls)
                and named_everywhere("BLOCK must be smaller than LIMIT", calls))
    assert pinned["raised"] == "TuningError" and "pinned table" in pinned["error"]
    assert "rank 1: InterpreterError" in pinned["error"] and "BLOCK must be smaller than LIMIT" in pinned["error"]
    per_rank = results["stored_winner_untried_on_one_rank"]
    untried = same_ending(per_rank)
    faults_seen(named_everywhere("failed in the final run", [call_ending(r) for r in per_rank]))
    assert untried["raised"] == "TuningError" and "failed in the final run" in untried["error"]
    same_ending(per_rank, "returned", call="then")
    assert untried["then"] == {"returned": 2.0}, "the function's own collectives stayed paired"


def test_a_local_error_before_a_collective_reaches_the_peers_at_once(tmp_path):
    cases = ["pinned_table_missing_on_one_rank", "function_key_fn_raises_on_one_rank",
             "function_prune_raises_on_one_rank", "statistic_raises_on_one_rank"]
    results = launch(tmp_path, cases)
    for case, says in zip(cases, ("cannot read pinned winners table", "injected fault in a user callable",
                                  "injected fault in a user callable", "statistic")):
        ending = same_ending(results[case])
        calls = [call_ending(r) for r in results[case]]
        faults_seen(named_everywhere("rank 1: ", calls) and named_everywhere(says, calls))
        assert ending["raised"] == "TuningError" and "rank 1: " in ending["error"] and says in ending["error"], ending
        assert all(r["seconds"] < TIMEOUT_S / 4 for r in results[case]), results[case]
    for case, where in (("function_key_fn_raises_on_one_rank", "key_fn"), ("function_prune_raises_on_one_rank",
                                                                           "prune_fn")):
        first, cause = results[case][0]["error"].splitlines()
        assert first.endswith(": tuning could not start on rank(s) 1:"), first
        assert cause == f"  rank 1: KeyError: 'injected fault in a user callable on rank 1' (in {where})", cause


@pytest.mark.slow
@pytest.mark.parametrize("case", ["raise_before_collective", "raise_before_collective_in_discovery"])
def test_user_code_raising_before_the_steps_own_collective_is_named_on_every_rank(tmp_path, case):
    """Rank 1 raises before the all_reduce that rank 0 waits in (in a tuning run, in the discovery run): rank 0's
    watcher hears of the error and answers for it, every rank aborts the group (which frees rank 0 from gloo's
    wait at once, not at gloo's timeout), and every message names the error. The group is unusable afterwards,
    so each case has a launch of its own."""
    (per_rank,) = launch(tmp_path, [case]).values()
    # the case itself raises, so its record is the ending; each message adds what its own rank saw of the wait
    ending = endings(per_rank, error="error_type", message="error_message")
    planted = "rank 1: RuntimeError: injected fault before the collective"
    faults_seen(all(planted in str(r.get("error_message")) for r in per_rank))
    assert not any(ending.values()), (ending, per_rank)
    timeout_waits([r["elapsed_s"] for r in per_rank], 30.0)  # the case's own timeout_s
    for record in per_rank:
        assert record["error_type"] == "TuningError", failure(record)
        assert planted in record["error_message"], record
        assert "process groups were aborted" in record["error_message"], record
        assert record["elapsed_s"] < 30.0, "ended at once, not by the tuner's timeout (30 s) or gloo's"


@pytest.mark.slow
def test_bad_inputs_are_refused_before_tuning_on_every_rank(tmp_path):
    (per_rank,) = launch(tmp_path, ["bad_inputs"]).values()
    for record in per_rank:
        assert record["ok"], failure(record)
    attempts = [r["attempts"] for r in per_rank]
    expected = {
        "log_dir is a file": ("ValueError", "is an existing file, not a directory"),
        "DISTTUNE_LOG_DIR is a file": ("TuningError", "log_dir (resolved)"),
        "cache_dir not a path": ("TypeError", "cache_dir must be a path"),
        "function cache_dir not a path": ("TypeError", "cache_dir must be a path"),
        "timeout_s 0": ("DistEnvError", "timeout_s must be a positive number"),
        "timeout_s -1": ("DistEnvError", "timeout_s must be a positive number"),
        "function timeout_s 0": ("DistEnvError", "timeout_s must be a positive number"),
        "DISTTUNE_TIMEOUT text": ("TuningError", "DistEnvError: disttune: DISTTUNE_TIMEOUT='soon' is not a number"),
        "DISTTUNE_TIMEOUT 0": ("TuningError", "(DISTTUNE_TIMEOUT)"),
        "key_fn unhashable": ("TuningError", "returned an unhashable list"),
        "statistic gives nan": ("TuningError", "it gave nan for config[0]"),
    }
    assert all(set(seen) == set(expected) for seen in attempts), attempts
    for what, (error_type, says) in expected.items():
        calls = [seen[what] for seen in attempts]
        # an error agreed in a collective has the same text on every rank; a local one may name the rank's own file
        ending = endings(calls, error="error" if error_type == "TuningError" else "raised", message="error")
        faults_seen(all(call.get("raised") == error_type and says in str(call.get("error")) for call in calls))
        for rank, seen in enumerate(attempts):
            assert seen[what].get("raised") == error_type and says in seen[what]["error"], (rank, what, seen[what])
            assert seen[what]["seconds"] < TIMEOUT_S / 4, (rank, what, seen[what])
        assert not any(ending.values()), (what, ending, calls)


@pytest.mark.slow
def test_a_tuning_setting_on_one_rank_is_the_same_error_on_every_rank(tmp_path):
    """DISTTUNE_ALWAYS_TUNE, a bad DISTTUNE_TIMEOUT and DISTTUNE_COMPILE_OVERLAP set on rank 1 only: agreed in
    the consensus (or raised there), never a peer left waiting or a setting silently ignored."""
    (per_rank,) = launch(tmp_path, ["settings_on_one_rank"]).values()
    for record in per_rank:
        assert record["ok"], failure(record)
    says = {"DISTTUNE_ALWAYS_TUNE": "DISTTUNE_ALWAYS_TUNE: rank 0: False, rank 1: True",
            "DISTTUNE_TIMEOUT": "could not start on rank(s) 1:\n  rank 1: DistEnvError: disttune: DISTTUNE_TIMEOUT='abc'",
            "DISTTUNE_COMPILE_OVERLAP": "DISTTUNE_COMPILE_OVERLAP: rank 0: True, rank 1: False"}
    for name, text in says.items():
        calls = [r["settings"][name] for r in per_rank]
        ending = endings(calls, error="error", message="error")
        faults_seen(named_everywhere(text, calls))
        assert not any(ending.values()), (name, ending, calls)
        for call in calls:
            assert call.get("raised") == "TuningError" and text in call["error"], (name, call)
            assert call["seconds"] < TIMEOUT_S / 4, (name, call)


@pytest.mark.slow
def test_a_pickled_note_is_refused_and_named(tmp_path):
    (per_rank,) = launch(tmp_path, ["pickle_bomb_note"]).values()
    calls = [call_ending(r) for r in per_rank]
    ending = endings(calls, error="ending", message="error")
    refused = "rank 1 sent a message for 'note'"
    faults_seen(not any(r["went_off"] for r in per_rank) and named_everywhere(refused, calls))
    assert not any(ending.values()), (ending, calls)
    for record, call in zip(per_rank, calls):
        assert not record["went_off"], "a note was unpickled: the bomb's file exists"
        assert call["raised"] == "TuningError" and refused in call["error"] and "not disttune's plain data" in call["error"]


@pytest.mark.slow
def test_a_keyboard_interrupt_on_one_rank_reaches_its_peer(tmp_path):
    (per_rank,) = launch(tmp_path, ["keyboard_interrupt"]).values()
    waiting, interrupted = per_rank
    TALLY["trials"] += 1
    faults_seen(interrupted.get("raised") == "KeyboardInterrupt" and "rank 1: KeyboardInterrupt" in waiting["error"])
    timeout_waits([waiting["seconds"]], TIMEOUT_S)
    assert interrupted.get("raised") == "KeyboardInterrupt", interrupted
    assert waiting.get("raised") == "TuningError" and "rank 1: KeyboardInterrupt" in waiting["error"], waiting
    assert waiting["seconds"] < TIMEOUT_S / 4, waiting


@pytest.mark.slow
def test_a_held_store_lock_is_waited_for_within_the_tuners_timeout(tmp_path):
    (per_rank,) = launch(tmp_path, ["store_lock_held"]).values()
    ending = same_ending(per_rank, "returned")
    assert ending["returned"] == {"winner": 2, "source": "tuned", "runs": 8}
    writer = per_rank[0]
    held = [w for w in writer["lock_warnings"] if ".json.lock was held by another process for 3 s" in w]
    faults_seen(writer["seconds"] > 2.5 and len(held) == 1)
    # it waits half the tuner's 6 s timeout for the lock (the warning says how long), then goes on and tunes
    assert writer["seconds"] > 2.5, "rank 0 waits half the tuner's 6 s timeout for the lock"
    (warning,) = writer["lock_warnings"]
    assert ".json.lock was held by another process for 3 s" in warning and str(tmp_path) in warning


@pytest.mark.slow
def test_four_ranks_end_the_same_way(tmp_path):
    """The faults on rank 1 of 4: the three healthy ranks end exactly as it does."""
    results = launch(tmp_path, ["raise_in_final_run", "stored_winner_raising_pre_hook",
                                "pinned_table_missing_on_one_rank", "statistic_raises_on_one_rank"], world=4)
    per_rank = results["raise_in_final_run"]
    planted = "rank 1: RuntimeError: injected fault in the final run"
    same_ending(per_rank, call="first")
    faults_seen(named_everywhere(planted, [call_ending(r, "first") for r in per_rank]))
    final = same_ending(per_rank, "winner")
    assert planted in final["first"] and final["winner"] == 2
    per_rank = results["stored_winner_raising_pre_hook"]
    stored = same_ending(per_rank, "returned")
    faults_seen(all(r.get("returned", {}).get("winner") == 1 for r in per_rank))  # tuned again, without config 2
    same_ending(per_rank, "returned", call="after")
    assert stored["returned"]["source"] == "tuned" and stored["returned"]["winner"] == 1
    for case in ("pinned_table_missing_on_one_rank", "statistic_raises_on_one_rank"):
        ending = same_ending(results[case])
        faults_seen(named_everywhere("rank 1: ", [call_ending(r) for r in results[case]]))
        assert ending["raised"] == "TuningError" and "rank 1: " in ending["error"], ending
        assert all(r["seconds"] < TIMEOUT_S / 4 for r in results[case]), results[case]
