"""Fault injection: no hang, no disagreement, no torn file, under every fault we can inject on CPUs.

Covers compile failures on one rank / all ranks / every config of one rank (a real
``tl.static_assert``), exceptions inside the function at the first run, mid-tuning and
in the last config, a rank killed mid-tuning, per-rank keys and config lists, 8 ranks,
a writer killed mid-write, and a 200-tuning soak with random timing noise over 4 ranks.
Every launch is bounded in wall time. The test run ends with one summary line (see
``fault_tally``): trials, faults injected, hangs, split endings, disagreements, torn files,
writes through links and tracebacks, each counted from what the test observed.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from fault_tally import TALLY, endings, faults_seen, hang, torn_files, tracebacks_in
from helpers import CommandTimeout, describe, failure, mpi, read_records, run_launch, spawn_ranks

CASES = Path(__file__).with_name("dist_cases.py")


def launch(tmp_path: Path, world: int, cases: list[str], mpi: bool = False, **env) -> dict:
    """Run ``cases`` on ``world`` ranks: a hang is counted (and fails), as is a traceback in the job's stderr."""
    out = tmp_path / f"run{len(list(tmp_path.glob('run*')))}"
    launcher = ["--mpi", "-n", str(world)] if mpi else [f"--nproc_per_node={world}"]
    try:
        proc = run_launch([*launcher, str(CASES), *cases, "--out", str(out), *(["--mpi"] if mpi else [])],
                          timeout=300, extra_env={"DISTTUNE_TIMEOUT": "30", **env})
    except CommandTimeout:
        hang()
        raise
    assert proc.returncode == 0, describe(proc)
    tracebacks_in(proc.stderr)
    return read_records(out, cases, range(world), proc)


def agreed(per_rank: list[dict], *fields: str) -> None:
    """One trial: every rank ends the same way (no split ending), with the same values for ``fields``
    (or the same error message), and no stray exception; each failure is counted, then asserted."""
    ending = endings(per_rank, *fields)
    assert not any(ending.values()), (ending, per_rank)


@pytest.mark.slow
def test_compile_failures_on_one_rank_all_ranks_and_every_config(tmp_path):
    results = launch(tmp_path, 2, ["compile_fault_one_rank", "compile_fault_all_ranks",
                                                        "compile_fault_every_config_one_rank"])
    for case in ("compile_fault_one_rank", "compile_fault_all_ranks"):
        per_rank = results[case]
        agreed(per_rank, "winner", "runs")
        # config 2 (BLOCK 64, the fastest) cannot compile somewhere: inf everywhere, config 1 wins
        faults_seen(all(r.get("agreed_ms", [0, 0, 0])[2] == float("inf") for r in per_rank))
        for result in per_rank:
            assert result["ok"], failure(result)
            assert result["agreed_ms"][2] == float("inf") and result["winner"] == 1
            assert result["runs"] == 2 + 3 * 3 and result["output_ok"]
    every = results["compile_fault_every_config_one_rank"]
    agreed(every, "error_type", "error_message")
    faults_seen("BLOCK must be smaller than LIMIT" in str(every[0].get("error_message")))
    assert every[0]["error_type"] == "AllConfigsFailed"
    assert "rank 0:" in every[0]["error_message"] and "BLOCK must be smaller than LIMIT" in every[0]["error_message"]


@pytest.mark.slow
def test_exceptions_inside_the_function_at_any_point(tmp_path):
    results = launch(tmp_path, 2, ["raise_first_run", "raise_in_run", "raise_last_config"])
    for case, where in (("raise_first_run", "discovery run"), ("raise_in_run", "tuning run 4/"),
                        ("raise_last_config", "tuning run 7/")):
        per_rank = results[case]
        agreed(per_rank, "error_type", "error_message")
        faults_seen(all("rank 1:" in str(r.get("error_message")) for r in per_rank))
        assert per_rank[0]["error_type"] == "TuningError" and where in per_rank[0]["error_message"], per_rank[0]
        assert "rank 1:" in per_rank[0]["error_message"]


@pytest.mark.slow
def test_rank_dependent_keys_and_config_lists_on_eight_ranks(tmp_path):
    results = launch(tmp_path, 8, ["keys_differ", "mismatch_configs", "fail_one_rank",
                                                        "agree_max"])
    agreed(results["keys_differ"], "error_message")
    faults_seen(all(f"key=({64 + 16 * r}," in str(results["keys_differ"][0].get("error_message")) for r in range(8)))
    assert all(f"key=({64 + 16 * r}," in results["keys_differ"][0]["error_message"] for r in range(8))
    agreed(results["mismatch_configs"], "error_message")
    faults_seen("ranks [1]" in str(results["mismatch_configs"][0].get("error_message")))
    assert "ranks [1]" in results["mismatch_configs"][0]["error_message"]
    agreed(results["fail_one_rank"], "winners", "runs")
    faults_seen(any(float("inf") in row for r in results["fail_one_rank"][:1] for w in r.get("winners", [])
                    for row in w["per_rank_ms"]))
    agreed(results["agree_max"], "winners")
    rows = results["agree_max"][0].get("winners", [{}])[0].get("per_rank_ms", [])  # [rank][config]
    faults_seen(len({min(range(len(row)), key=row.__getitem__) for row in rows}) > 1)  # each rank prefers another
    assert results["agree_max"][0]["winners"][0]["winner"] == 8  # every rank alone prefers its own config


def run_ranks_without_supervisor(world: int, args: list[str], timeout: float) -> list[subprocess.CompletedProcess]:
    """Start ``world`` ranks by hand (torchrun would kill the survivors when one rank dies); a hang is counted."""
    try:
        return spawn_ranks(world, args, timeout, extra_env={"DISTTUNE_TIMEOUT": "30"})
    except CommandTimeout:
        hang()
        raise


@pytest.mark.slow
def test_a_rank_killed_mid_tuning_is_an_error_on_the_others(tmp_path):
    procs = run_ranks_without_supervisor(3, [str(CASES), "rank_killed", "--out", str(tmp_path)], timeout=120)
    faults_seen(procs[2].returncode == -9)
    assert procs[2].returncode == -9, "the last rank was meant to die by SIGKILL"
    for proc in procs[:2]:
        tracebacks_in(proc.stderr)
    (survivors,) = read_records(tmp_path, ["rank_killed"], (0, 1)).values()
    ending = endings(survivors, error="error_type", message="error_message")  # each message names its own rank
    assert not any(ending.values()), (ending, survivors)
    for result in survivors:
        assert result.get("error_type") in ("CollectiveTimeout", "TuningError"), result
        assert "rank" in result["error_message"] and "tuning run" in result["error_message"]
        assert result["elapsed_s"] < 60


@pytest.mark.parametrize("tuner", ["contextual", "function"])
def test_the_store_host_killed_mid_tuning_is_one_disttune_error_on_every_survivor(tmp_path, tuner):
    """Without torchrun rank 0 hosts the rendezvous store: when it dies, each survivor raises disttune's own error
    (not torch's), naming the step and that the store's host is gone, within seconds, and torch's TCPStore logs at
    most three C++ stacks per survivor (one per connection it holds; disttune tries the dead host no more)."""
    case = f"store_host_killed_{tuner}"
    procs = run_ranks_without_supervisor(3, [str(CASES), case, "--out", str(tmp_path)], timeout=120)
    faults_seen(procs[0].returncode == -9)
    assert procs[0].returncode == -9, "rank 0 was meant to die by SIGKILL"
    killed_at = float((tmp_path / "killed_at").read_text())
    survivors = [read_records(tmp_path, [case], [r])[case][0] for r in (1, 2)]
    # nothing can be agreed without the store: each names the step it was in (a rank may be one behind), else alike
    alike = [{**r, "error": re.sub(r"step '[^']*'", "step '...'", str(r.get("error")))} for r in survivors]
    ending = endings(alike, ok="returned", error="error", message="error")
    assert not any(ending.values()), (ending, survivors)
    for proc, record in zip(procs[1:], survivors):
        tracebacks_in(proc.stderr)
        assert record["raised"] == "ControlPlaneLost" and record["chained"] is None, record
        assert record["error"].startswith("disttune: "), record
        assert re.search(r"step 'tuning run [12]/", record["error"]), record
        assert "the rendezvous store is unreachable" in record["error"] and "its host is gone" in record["error"]
        assert record["ended_at"] - killed_at < 5.0, record
        # TCPStore logs a C++ stack for each connection that finds the host gone: the control plane's own and its two
        # spares (a collective's wait blocks on one, the housekeeping deletes on the other); after that disttune
        # tries the dead host no more
        assert proc.stderr.count("Exception raised from") <= 3, proc.stderr


def test_writer_killed_mid_write_leaves_no_torn_file(tmp_path):
    from test_store import kill_a_writer_mid_write

    TALLY["trials"] += 1
    faults_seen(kill_a_writer_mid_write(tmp_path) == -9)  # the writer's exit status: killed by SIGKILL
    assert torn_files([tmp_path / "shared"]) == []


@pytest.mark.slow
def test_soak_200_tunings_on_four_ranks_always_agree(tmp_path):
    (per_rank,) = launch(tmp_path, 4, ["soak"]).values()
    agreed(per_rank, "tunings", "disagreements")
    TALLY["trials"] += per_rank[0]["tunings"] - 1  # endings() counted the launch as one trial
    faults_seen(per_rank[0]["noisy"])
    for result in per_rank:
        assert result["ok"], failure(result)
        TALLY["disagreements"] += result["disagreements"]
        assert result["disagreements"] == 0 and result["tunings"] == 200 and result["noisy"] == 200
        early, late = result["rss_kb"]
        assert late - early < 64 * 1024, f"resident memory grew by {late - early} kB over 180 tunings"
        assert result["fds"][1] <= result["fds"][0] + 2, f"open files grew: {result['fds']}"


@pytest.mark.slow
@mpi
def test_faults_under_mpi(tmp_path):
    results = launch(tmp_path, 2, ["compile_fault_one_rank", "raise_first_run"], mpi=True)
    agreed(results["compile_fault_one_rank"], "winner", "runs")
    faults_seen(results["compile_fault_one_rank"][0].get("agreed_ms", [0, 0, 0])[2] == float("inf"))
    assert results["compile_fault_one_rank"][0]["winner"] == 1
    agreed(results["raise_first_run"], "error_message")
    faults_seen("rank 1:" in str(results["raise_first_run"][0].get("error_message")))
    assert results["raise_first_run"][0]["error_type"] == "TuningError"
