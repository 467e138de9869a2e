"""Multi-rank behaviour of contextual_autotune: 1, 2, 4 and 8 ranks over torch.distributed, 2 under mpiexec.

Each fixture launches ``tests/dist_cases.py`` once for a set of cases (bounded in
wall time: a hang fails the test) and the tests assert on what every rank wrote.
Expected winners are computed here from the same fake-timer tables the ranks used.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import failure, mpi, run_cases

CASES = Path(__file__).with_name("dist_cases.py")
LAUNCH_TIMEOUT_S = 240
COMMON_CASES = ["agree_max", "agree_mean", "agree_min", "fail_one_rank", "mismatch_configs", "keys_differ",
                "options_differ", "all_fail", "raise_in_run", "second_call", "early_stop", "capture_fails_on_one_rank"]
SPLIT_CASES = ["split", "split_early", "split_compile_fault", "split_store", "compile_split"]


def _launch(out: Path, world: int, cases: list[str], mpi: bool = False) -> dict:
    return run_cases(CASES, cases, out, world, mpi=mpi, timeout=LAUNCH_TIMEOUT_S, extra_env={"DISTTUNE_TIMEOUT": "30"})


@pytest.fixture(scope="module")
def gloo2(tmp_path_factory):
    out = tmp_path_factory.mktemp("gloo2")
    return _launch(out, 2, COMMON_CASES + SPLIT_CASES), out


@pytest.fixture(scope="module")
def gloo4(tmp_path_factory):
    out = tmp_path_factory.mktemp("gloo4")
    return _launch(out, 4, ["agree_max", "agree_mean", "fail_one_rank", "subgroup",
                                                   "mismatch_configs", *SPLIT_CASES]), out


@pytest.fixture(scope="module")
def mpi2(tmp_path_factory):
    out = tmp_path_factory.mktemp("mpi2")
    return _launch(out, 2, ["agree_max", "fail_one_rank", "keys_differ", "raise_in_run"], mpi=True), out


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
        assert result["ok"], failure(result)
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
        assert result["ok"], failure(result)
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
            assert fragment in result["error_message"], (fragment, result["error_message"])
        messages.add(result["error_message"])
    assert len(messages) == 1, "ranks raised different messages"


def test_mismatched_config_list_is_an_error_on_every_rank(gloo2):
    check_error(gloo2[0]["mismatch_configs"], "TuningError", "tiny_kernels.add_block", "ranks [0]", "ranks [1]",
                "config list")


def test_options_that_differ_between_ranks_are_named_with_every_ranks_value(gloo2):
    check_error(gloo2[0]["options_differ"], "TuningError", "different tuning options",
                "reduce: rank 0: 'max', rank 1: 'min'", "statistic: rank 0: 'median', rank 1: 'mean'",
                "DISTTUNE_VERIFY: rank 0: None, rank 1: 0.1")


def test_rank_dependent_keys_are_named_in_the_error(gloo2):
    check_error(gloo2[0]["keys_differ"], "TuningError", "key=(64,", "key=(80,")


def test_all_configs_failing_names_every_config_and_rank(gloo2):
    check_error(gloo2[0]["all_fail"], "AllConfigsFailed", "config[0]", "config[1]", "rank 0: RuntimeError: injected fault")


def test_exception_inside_the_function_reaches_every_rank(gloo2):
    check_error(gloo2[0]["raise_in_run"], "TuningError", "rank 1: ValueError: user code failed in run 5", "tuning run 4/")


def test_a_capture_that_fails_on_one_rank_is_the_same_error_on_every_rank_then_every_rank_runs_eagerly(gloo2):
    per_rank = gloo2[0]["capture_fails_on_one_rank"]
    for result in per_rank:
        assert result["ok"], failure(result)
        assert result["error"] is not None, f"rank {result['rank']} did not raise"
        assert "failed on rank 1 (rank 1: CaptureFailed: operation not permitted" in result["error"], result["error"]
        assert "run as they are on every rank" in result["error"]
        assert result["later_ok"], "a later call's result or its user collective went wrong"
        assert (result["captures"], result["replays"]) == (0, 0), "a rank replayed a signature its peer runs eagerly"
    assert len({r["error"] for r in per_rank}) == 1, "ranks raised different messages"


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


@pytest.mark.slow
def test_four_ranks_agree(gloo4):
    results, _ = gloo4
    check_agreement(results["agree_max"], "max")
    check_agreement(results["agree_mean"], "mean")
    check_one_rank_failure(results["fail_one_rank"])
    check_error(results["mismatch_configs"], "TuningError", "ranks [0, 2, 3]", "ranks [1]")


@pytest.mark.slow
def test_subgroups_agree_within_themselves(gloo4):
    results, _ = gloo4
    by_pair = {}
    for result in results["subgroup"]:
        assert result["ok"], failure(result)
        assert result["world_in_report"] == 2
        by_pair.setdefault(result["pair"], set()).add(result["winners"][0]["winner"])
    assert by_pair == {0: {0}, 1: {2}}


@pytest.mark.slow
@mpi
def test_mpi_communicator(mpi2):
    results, _ = mpi2
    check_agreement(results["agree_max"], "max")
    check_one_rank_failure(results["fail_one_rank"])
    check_error(results["keys_differ"], "TuningError", "key=(64,", "key=(80,")
    check_error(results["raise_in_run"], "TuningError", "rank 1: ValueError")


@pytest.mark.slow
def test_a_rank_that_never_arrives_is_a_timeout_not_a_hang(tmp_path):
    results = _launch(tmp_path, 2, ["timeout"])
    waiting = results["timeout"][0]
    assert waiting["error_type"] == "CollectiveTimeout", waiting
    assert "consensus" in waiting["error_message"] and "rank(s) [1] did not arrive" in waiting["error_message"]
    assert "process groups were aborted" in waiting["error_message"], "rank 1 never settled: the group is dead"
    assert 2.5 < waiting["elapsed_s"] < 60, "the 3 s timeout, not a hang"


@pytest.mark.slow
def test_one_rank_over_torch_distributed(tmp_path):
    results = _launch(tmp_path, 1, ["agree_max", "second_call"])
    check_agreement(results["agree_max"], "max")
    (second,) = results["second_call"]
    assert (second["runs_added"], second["timed_added"], second["output_ok"]) == (1, 0, True)


def test_early_stopping_drops_the_same_configs_on_every_rank(gloo2):
    per_rank = gloo2[0]["early_stop"]
    for result in per_rank:
        assert result["ok"], failure(result)
        # agreed (max) screening times [5, 5, 3]: the two fastest, configs 2 and 0, go on; 2 wins
        assert result["full_configs"] == [0, 2] and result["winners"][0]["winner"] == 2
        assert result["runs"] == 1 + 3 * 2 + 2 * (1 + 2) + 1


# -- split sites: ranks time disjoint shares of the configs ----------------------------------------

SPLIT_TABLE = [5.0, 4.0, 6.0, 1.5, 3.0, 2.0, 7.0, 2.5, 9.0]  # dist_cases.SPLIT_TABLE; rank r adds 0.01 ms * r
RUNS_PER_CONFIG = 1 + 2  # dist_cases: n_warmup=1, n_repeat=2


def expected_split(world: int, early: bool) -> dict:
    """The split schedule by hand: position p of the running list is timed by rank p % world only."""
    n = len(SPLIT_TABLE)

    def owned(active):
        return {c: (p % world, SPLIT_TABLE[c] + 0.01 * (p % world)) for p, c in enumerate(active)}

    screen = owned(list(range(n)))
    if not early:
        final, runs = screen, 1 + math.ceil(n / world) * RUNS_PER_CONFIG + 1
    else:
        keep = sorted(sorted(range(n), key=lambda c: (screen[c][1], c))[: max(2, math.ceil(n / 4))])
        final = {**screen, **owned(keep)}
        runs = 1 + math.ceil(n / world) * 2 + math.ceil(len(keep) / world) * RUNS_PER_CONFIG + 1
    agreed = [final[c][1] for c in range(n)]
    return {"agreed": agreed, "winner": int(np.argmin(agreed)), "runs": runs,
            "owner": {c: final[c][0] for c in range(n)}}


def check_split(per_rank: list[dict]) -> None:
    world = len(per_rank)
    expected = expected_split(world, early=False)
    for result in per_rank:
        assert result["ok"], failure(result)
        rank = result["rank"]
        assert result["split"] and result["winner"] == expected["winner"] == 3
        assert result["agreed_ms"] == pytest.approx(expected["agreed"])
        # every rank ran the function the same, reduced number of times (the user collective stayed paired)
        assert result["runs"] == result["function_runs"] == expected["runs"]
        assert result["runs"] - 2 == math.ceil(len(SPLIT_TABLE) / world) * RUNS_PER_CONFIG < len(SPLIT_TABLE) * 3
        mine = [c for c in range(len(SPLIT_TABLE)) if c % world == rank]
        assert result["timed"] == mine * 2, "rank r times configs r, r + w, ... only, in rounds"
        for r, row in enumerate(result["per_rank_ms"]):
            for c, t in enumerate(row):
                if c % world == r:
                    assert t == pytest.approx(SPLIT_TABLE[c] + 0.01 * r)
                else:
                    assert t == "nan", "a config another rank timed is nan in this rank's row"
        assert result["output_ok"], "the final run did not launch the agreed winner"


def check_split_early(per_rank: list[dict]) -> None:
    expected = expected_split(len(per_rank), early=True)
    for result in per_rank:
        assert result["ok"], failure(result)
        assert result["winner"] == expected["winner"]
        assert result["agreed_ms"] == pytest.approx(expected["agreed"])
        assert result["runs"] == expected["runs"]
        assert result["output_ok"]


def check_split_compile_fault(per_rank: list[dict]) -> None:
    """Configs 2 and 3 (BLOCK 64, 128) fail to compile on rank 1; whoever owns them elsewhere times them fine."""
    world = len(per_rank)
    # Faster than the winner and timed by a rank where they compile: only the final-run check can catch
    # them. On GPUs every rank compiles every candidate up front (parallel compile), so rank 1's
    # compile failures are known before timing and nothing is hidden.
    hidden = [] if torch.cuda.is_available() else [c for c in (2, 3) if c % world != 1]
    for result in per_rank:
        assert result["ok"], failure(result)
        assert result["winner"] == 1, result
        assert result["agreed_ms"][:2] == [3.0, 2.0] and math.isinf(result["agreed_ms"][2]) and math.isinf(result["agreed_ms"][3])
        # one final run, plus one more for each hidden failure the final-run check caught
        assert result["runs"] == result["function_runs"] == 1 + math.ceil(4 / world) * RUNS_PER_CONFIG + 1 + len(hidden)
        assert result["output_ok"]


def check_split_store(per_rank: list[dict]) -> None:
    for result in per_rank:
        assert result["ok"], failure(result)
        first, second = result["first"], result["second"]
        assert first["source"] == "tuned" and first["winner"] == 3
        assert (second["source"], second["winner"], second["runs"], second["timed"]) == ("store", 3, 2, [])
        assert second["output_ok"]


def check_compile_split(per_rank: list[dict]) -> None:
    """Each rank compiled config 0 and its share of the others first, each other config once after the
    consensus (none before every rank had finished its share), and kept a second-pass compile fault."""
    blocks = [16, 32, 64, 128, 256]
    for result in per_rank:
        assert result["ok"], failure(result)
        assert result["share"] == sorted(result["expected_share"])
        assert result["rest"] == sorted(set(blocks) - set(result["share"])), "each other config exactly once"
    assert max(r["share_ended"] for r in per_rank) <= min(r["rest_started"] for r in per_rank)
    for result in per_rank:
        if result["interpreted"]:  # BLOCK 64 failed on every rank but its owner (rank 1), in the second pass
            assert [math.isinf(ms) for ms in result["per_rank_ms_64"]] == [r != 1 for r in range(len(per_rank))]
            assert math.isinf(result["agreed_ms"][2]) and result["winner_block"] == 32
        else:
            assert result["winner_block"] == 64
        assert result["output_ok"]


def check_all_split_cases(results: dict) -> None:
    check_split(results["split"])
    check_split_early(results["split_early"])
    check_split_compile_fault(results["split_compile_fault"])
    check_split_store(results["split_store"])
    check_compile_split(results["compile_split"])


def test_split_sites_on_two_ranks(gloo2):
    check_all_split_cases(gloo2[0])


@pytest.mark.slow
def test_split_sites_on_four_ranks(gloo4):
    check_all_split_cases(gloo4[0])


def test_split_log_marks_configs_a_rank_did_not_time(gloo2):
    _, out = gloo2
    for rank in range(2):
        records = [json.loads(line) for line in (out / "logs" / "split" / f"rank-{rank}.log").read_text().splitlines()
                   if line.startswith("{")]
        configs = [r for r in records if r["event"] == "config"]
        assert [c["per_rank_ms"][1 - c["config_index"] % 2] for c in configs] == [None] * 9  # no time ...
        assert all(1 - c["config_index"] % 2 not in c["failed_ranks"] for c in configs)  # ... but no failure
        (winner,) = [r for r in records if r["event"] == "winner"]
        assert winner["config_index"] == 3


@pytest.mark.slow
def test_eight_ranks_tune_agree_split_and_store(tmp_path):
    """The core multi-rank paths with 8 ranks on gloo, in one launch (8 processes importing torch)."""
    results = _launch(tmp_path, 8, ["agree_max", *SPLIT_CASES])
    check_agreement(results["agree_max"], "max")
    check_all_split_cases(results)
