"""Multi-rank behaviour of contextual_autotune: 2 and 4 ranks over torch.distributed, 2 under mpiexec.

Each fixture launches ``tests/dist_cases.py`` once for a set of cases (bounded in
wall time: a hang fails the test) and the tests assert on what every rank wrote.
Expected winners are computed here from the same fake-timer tables the ranks used.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from helpers import describe, mpi, run_launch

CASES = Path(__file__).with_name("dist_cases.py")
LAUNCH_TIMEOUT_S = 240
COMMON_CASES = ["agree_max", "agree_mean", "agree_min", "fail_one_rank", "mismatch_configs", "keys_differ",
                "all_fail", "raise_in_run", "second_call", "early_stop"]


def _launch(out: Path, launcher: list[str], cases: list[str]) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    mpi_flag = ["--mpi"] if launcher[0] == "--mpi" else []
    proc = run_launch([*launcher, str(CASES), str(out), *mpi_flag, *cases], timeout=LAUNCH_TIMEOUT_S,
                      extra_env={"DISTTUNE_TIMEOUT": "30"})
    assert proc.returncode == 0, describe(proc)
    world = int(launcher[-1].split("=")[-1])
    results = {}
    for case in cases:
        per_rank = []
        for rank in range(world):
            path = out / f"{case}.rank{rank}.json"
            assert path.exists(), f"rank {rank} wrote no result for {case}\n" + describe(proc)
            per_rank.append(json.loads(path.read_text()))
        results[case] = per_rank
    return results


@pytest.fixture(scope="module")
def gloo2(tmp_path_factory):
    out = tmp_path_factory.mktemp("gloo2")
    return _launch(out, ["--nproc_per_node=2"], COMMON_CASES), out


@pytest.fixture(scope="module")
def gloo4(tmp_path_factory):
    out = tmp_path_factory.mktemp("gloo4")
    return _launch(out, ["--nproc_per_node=4"], ["agree_max", "agree_mean", "fail_one_rank", "subgroup",
                                                   "mismatch_configs"]), out


@pytest.fixture(scope="module")
def mpi2(tmp_path_factory):
    out = tmp_path_factory.mktemp("mpi2")
    return _launch(out, ["--mpi", "-n", "2"], ["agree_max", "fail_one_rank", "keys_differ", "raise_in_run"]), out


def expected_disagreement_winner(world: int, reduce: str) -> tuple[int, list[float]]:
    """Rebuild the fake per-rank table of dist_cases.disagreement_times and agree it by hand."""
    table = np.array([[3.0 if c == world else (1.0 if c == r else 5.0) for c in range(world + 1)]
                      for r in range(world)])
    agreed = {"max": table.max(0), "mean": table.mean(0), "min": table.min(0)}[reduce]
    return int(np.argmin(agreed)), list(agreed)  # np.argmin breaks ties to the lowest index


def check_agreement(per_rank: list[dict], reduce: str) -> None:
    world = len(per_rank)
    winner, agreed = expected_disagreement_winner(world, reduce)
    for result in per_rank:
        assert "error" not in result, result.get("traceback")
        (site,) = result["winners"]
        assert site["winner"] == winner, (reduce, site)
        assert site["block"] == result["blocks"][winner]
        assert site["agreed_ms"] == pytest.approx(agreed)
        assert result["output_ok"], "final run did not use the agreed winner or left the output unwritten"
        assert result["runs"] == result["expected_runs"] == 2 + (world + 1) * (1 + 2)
        assert result["timed_configs"] == list(range(world + 1))


def test_each_rank_alone_would_pick_differently_and_max_picks_a_third(gloo2):
    results, _ = gloo2
    per_rank = results["agree_max"]
    # rank r's own fastest config is r; the agreed (slowest-rank) winner is neither
    for result in per_rank:
        own = result["winners"][0]["per_rank_ms"][result["rank"]]
        assert int(np.argmin(own)) == result["rank"]
    check_agreement(per_rank, "max")
    assert per_rank[0]["winners"][0]["winner"] not in (0, 1)


@pytest.mark.parametrize("reduce", ["mean", "min"])
def test_mean_and_min_reductions(gloo2, reduce):
    check_agreement(gloo2[0][f"agree_{reduce}"], reduce)


def check_one_rank_failure(per_rank: list[dict]) -> None:
    world = len(per_rank)
    for result in per_rank:
        assert "error" not in result, result.get("traceback")
        first, second = result["winners"]
        # config 1 is fastest (0.5 ms) but fails on rank 1: inf for everyone, config 2 wins
        assert first["agreed_ms"][1] == float("inf")
        assert first["winner"] == 2 and second["winner"] == 1
        assert result["runs"] == result["expected_runs"] == result["collectives"]
        assert result["total"] == world
        assert result["output_ok"]
    assert len({r["runs"] for r in per_rank}) == 1, "ranks ran the function a different number of times"


def test_config_failing_on_one_rank_keeps_run_counts_paired(gloo2):
    check_one_rank_failure(gloo2[0]["fail_one_rank"])


def check_error(per_rank: list[dict], error_type: str, *fragments: str) -> None:
    messages = set()
    for result in per_rank:
        assert result.get("error_type") == error_type, result
        for fragment in fragments:
            assert fragment in result["error"], (fragment, result["error"])
        messages.add(result["error"])
    assert len(messages) == 1, "ranks raised different messages"


def test_mismatched_config_list_is_an_error_on_every_rank(gloo2):
    check_error(gloo2[0]["mismatch_configs"], "TuningError", "tiny_kernels.add_block", "ranks [0]", "ranks [1]",
                "config list")


def test_rank_dependent_keys_are_named_in_the_error(gloo2):
    check_error(gloo2[0]["keys_differ"], "TuningError", "key=(64,", "key=(80,")


def test_all_configs_failing_names_every_config_and_rank(gloo2):
    check_error(gloo2[0]["all_fail"], "AllConfigsFailed", "config[0]", "config[1]", "rank 0: RuntimeError: injected fault")


def test_exception_inside_the_function_reaches_every_rank(gloo2):
    check_error(gloo2[0]["raise_in_run"], "TuningError", "rank 1: ValueError: user code failed in run 5", "tuning run 4/")


def test_second_call_does_not_tune(gloo2):
    for result in gloo2[0]["second_call"]:
        assert result == {**result, "runs_added": 1, "timed_added": 0, "output_ok": True, "tuned": True}


def test_per_rank_logs_hold_every_rank_time(gloo2):
    _, out = gloo2
    for rank in range(2):
        path = out / "logs" / "agree_max" / f"rank-{rank}.log"
        lines = path.read_text().splitlines()
        records = [json.loads(line) for line in lines if line.startswith("{")]
        assert len(records) * 2 == len(lines), "each event is a readable line followed by a JSON line"
        configs = [r for r in records if r["event"] == "config"]
        assert [c["per_rank_ms"] for c in configs] == [[1.0, 5.0], [5.0, 1.0], [3.0, 3.0]]
        assert sum(r["event"] == "measure" for r in records) == 3 * 2  # configs x n_repeat
        (winner,) = [r for r in records if r["event"] == "winner"]
        assert winner["config_index"] == 2 and winner["rank"] == rank and winner["host"]
        (tuning,) = [r for r in records if r["event"] == "tuning"]
        assert tuning["function_runs"] == 11 and tuning["wall_s"] > 0


def test_four_ranks_agree(gloo4):
    results, _ = gloo4
    check_agreement(results["agree_max"], "max")
    check_agreement(results["agree_mean"], "mean")
    check_one_rank_failure(results["fail_one_rank"])
    check_error(results["mismatch_configs"], "TuningError", "ranks [0, 2, 3]", "ranks [1]")


def test_subgroups_agree_within_themselves(gloo4):
    results, _ = gloo4
    by_pair = {}
    for result in results["subgroup"]:
        assert "error" not in result, result.get("traceback")
        assert result["world_in_report"] == 2
        by_pair.setdefault(result["pair"], set()).add(result["winners"][0]["winner"])
    assert by_pair == {0: {0}, 1: {2}}


@mpi
def test_mpi_communicator(mpi2):
    results, _ = mpi2
    check_agreement(results["agree_max"], "max")
    check_one_rank_failure(results["fail_one_rank"])
    check_error(results["keys_differ"], "TuningError", "key=(64,", "key=(80,")
    check_error(results["raise_in_run"], "TuningError", "rank 1: ValueError")


def test_a_rank_that_never_arrives_is_a_timeout_not_a_hang(tmp_path):
    results = _launch(tmp_path, ["--nproc_per_node=2"], ["timeout"])
    waiting = results["timeout"][0]
    assert waiting["error_type"] == "CollectiveTimeout", waiting
    assert "consensus" in waiting["error"] and "rank 0" in waiting["error"]
    assert 2.5 < waiting["elapsed_s"] < 20


def test_one_rank_over_torch_distributed(tmp_path):
    results = _launch(tmp_path, ["--nproc_per_node=1"], ["agree_max", "second_call"])
    check_agreement(results["agree_max"], "max")
    (second,) = results["second_call"]
    assert (second["runs_added"], second["timed_added"], second["output_ok"]) == (1, 0, True)


def test_early_stopping_drops_the_same_configs_on_every_rank(gloo2):
    per_rank = gloo2[0]["early_stop"]
    for result in per_rank:
        assert "error" not in result, result.get("traceback")
        # agreed (max) screening times [5, 5, 3]: the two fastest, configs 2 and 0, go on; 2 wins
        assert result["full_configs"] == [0, 2] and result["winners"][0]["winner"] == 2
        assert result["runs"] == 1 + 3 * 2 + 2 * (1 + 2) + 1
