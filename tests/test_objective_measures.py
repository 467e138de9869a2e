"""Objectives over measurements beside time: a callable over Measurements, pareto(), their checks and report."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

import disttune
from disttune.contextual import Options
from disttune.logs import read_records
from disttune.objective import Measurements, NoProbe, Pareto, choose, default_probe, nvml_handle
from disttune.report import build_report
from helpers import run_cases
from tiny_kernels import DEV, TableProbe, TableTimer, launch_add, make_kernel, tuner

CASES = Path(__file__).with_name("measure_cases.py")


def _step(tmp_path, blocks, times, memory, **options):
    """A one-launch step over ``blocks``, timed from ``times`` and probed for ``memory`` (per config index)."""
    kernel = make_kernel(blocks=blocks)
    probe = TableProbe(lambda info: {"peak_memory_mb": memory[info.config_index], "energy_mj": None})

    @tuner(tmp_path, timer=TableTimer(lambda info: times[info.config_index]), probe=probe, store=False, **options)
    def step(x):
        y = torch.empty_like(x)
        launch_add(kernel, x, y)
        return y

    return step, probe


def _config_records(log_dir: Path) -> list[dict]:
    return [r for path in log_dir.rglob("rank-*.log") for r in read_records(path) if r.get("event") == "config"]


def test_callable_objective_picks_a_different_winner_than_time_alone(tmp_path):
    times, memory = (1.0, 2.0, 3.0), (100.0, 10.0, 10.0)
    by_time, _ = _step(tmp_path / "time", (16, 32, 64), times, memory)
    by_time(torch.randn(64, device=DEV))
    step, probe = _step(tmp_path / "score", (16, 32, 64), times, memory,
                        objective=lambda m: m.time_ms + 0.1 * m.peak_memory_mb)
    x = torch.randn(64, device=DEV)
    y = step(x)

    assert by_time.report.results[0].winner == 0
    (result,) = step.report.results
    assert result.winner == 1 and result.config.kwargs["BLOCK"] == 32
    assert result.scores == pytest.approx((11.0, 3.0, 4.0))
    assert [m.peak_memory_mb for m in result.measurements] == list(memory)
    assert all(m.energy_mj is None for m in result.measurements)
    assert len(probe.seen) == 3 * 2  # every timed launch was probed (n_repeat=2), no warm-up was
    assert torch.equal(y, x + 32)  # the final run used the winner (add_block writes x + BLOCK)
    logged = {r["config_index"]: r for r in _config_records(tmp_path / "score")}
    assert logged[1]["measures"] == {"peak_memory_mb": 10.0, "energy_mj": None}
    assert logged[1]["per_rank_measures"]["peak_memory_mb"] == [10.0]
    assert logged[0]["score"] == pytest.approx(11.0) and not logged[0]["on_front"]


def test_the_summary_names_the_winners_measurements_and_score(tmp_path, capsys):
    step, _ = _step(tmp_path, (16, 32), (1.0, 2.0), (30.0, 5.0), verbose=True,
                    objective=lambda m: m.time_ms + 0.1 * m.peak_memory_mb)
    step(torch.randn(64, device=DEV))
    out = capsys.readouterr().out
    assert "BLOCK=32" in out and "2.0000 ms agreed (max), peak memory 5 MB, energy n/a, score 2.5" in out


def test_pareto_picks_from_a_known_front_and_the_report_shows_it(tmp_path):
    times, memory = (1.0, 2.0, 3.0, 4.0), (40.0, 20.0, 30.0, 10.0)  # config 2 is dominated by config 1
    picks = {}
    for pick in ("balanced", "time_ms", "peak_memory_mb"):
        step, _ = _step(tmp_path / pick, (16, 32, 64, 128), times, memory,
                        objective=disttune.pareto("time_ms", "peak_memory_mb", pick=pick))
        step(torch.randn(64, device=DEV))
        (result,) = step.report.results
        assert result.front == (0, 1, 3)
        picks[pick] = result.winner
    # balanced: scaled sums 0+1, 1/3+1/3, 1+0 over the front
    assert picks == {"balanced": 1, "time_ms": 0, "peak_memory_mb": 3}

    out = tmp_path / "report"
    build_report(tmp_path / "balanced" / "logs", out)
    text = (out / "report.md").read_text()
    assert "agreed peak memory MB (max)" in text and "| score |" in text
    front = text.split("Pareto front")[1].split("Disagreement")[0]
    assert "config 0 " in front and "config 1 " in front and "config 3 " in front and "config 2 " not in front
    assert "peak memory MB 20" in front and "(**picked**)" in front.split("config 1 ")[1].split("\n")[0]


def test_pareto_leaves_out_a_measure_not_read_for_every_config():
    rows = [Measurements(2.0, None), Measurements(1.0, 5.0), Measurements(3.0, 1.0)]
    choice = choose(disttune.pareto("time_ms", "peak_memory_mb"), rows, [0, 1, 2])
    assert choice.front == (1,) and choice.winner == 1  # by time alone: config 0 has no memory reading


def test_without_pynvml_there_is_no_energy_counter(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError
    assert nvml_handle(0) is None


def test_on_the_cpu_a_callable_objective_sees_time_and_no_memory_or_energy(tmp_path):
    assert isinstance(default_probe(), NoProbe)
    kernel = make_kernel(blocks=(16, 32))
    seen = []

    def objective(m: Measurements) -> float:
        seen.append(m)
        return m.time_ms if m.peak_memory_mb is None else math.inf

    @tuner(tmp_path, timer=TableTimer(lambda info: (2.0, 1.0)[info.config_index]), objective=objective, store=False)
    def step(x):
        y = torch.empty_like(x)
        launch_add(kernel, x, y)
        return y

    step(torch.randn(64, device=DEV))
    assert step.report.results[0].winner == 1
    assert seen == [Measurements(2.0), Measurements(1.0)]


def test_function_tuner_scores_configs_with_a_callable_objective():
    memory = {1: 50.0, 2: 5.0}
    probe = TableProbe(lambda info: {"peak_memory_mb": memory[info.config["width"]], "energy_mj": 7.0})

    @disttune.autotune([{"width": 1}, {"width": 2}], key_fn=lambda n: n, store=False, n_warmup=0, n_repeat=1,
                       timer=TableTimer(lambda info: float(info.config["width"])), probe=probe,
                       objective=lambda m: m.time_ms + m.peak_memory_mb + m.energy_mj)
    def work(n, width):
        return n * width

    assert work(3) == 6
    timings = work.last_timings
    assert timings["winner"] == 1
    assert [m.energy_mj for m in timings["measurements"]] == [7.0, 7.0]


@pytest.mark.parametrize("objective, text", [
    ("fast", "objective must be one of"),
    (3, "objective must be one of"),
    (Measurements, "objective must be one of"),
])
def test_a_bad_objective_is_a_clear_error(objective, text):
    with pytest.raises(ValueError, match=text):
        Options(objective=objective)
    with pytest.raises(ValueError, match=text):
        disttune.autotune([{"a": 1}], key_fn=lambda: 0, objective=objective)(lambda a: a)


def test_measured_objectives_refuse_search_and_split():
    with pytest.raises(ValueError, match="cannot be combined"):
        Options(objective=lambda m: m.time_ms, search="screen")
    with pytest.raises(ValueError, match="cannot be combined"):
        Options(objective=disttune.pareto("time_ms"), split=True)
    with pytest.raises(ValueError, match="distinct measurement names"):
        disttune.pareto("time_ms", "bogus")
    with pytest.raises(ValueError, match="pick="):
        disttune.pareto("time_ms", pick="energy_mj")


@pytest.mark.parametrize("objective, text", [
    (lambda m: float("nan"), "gave nan for config"),
    (lambda m: m.energy_mj + 1.0, "objective failed for config\\[0\\].*TypeError"),
])
def test_an_objective_that_gives_no_number_fails_the_tuning_clearly(tmp_path, objective, text):
    step, _ = _step(tmp_path, (16, 32), (1.0, 2.0), (1.0, 1.0), objective=objective)
    with pytest.raises(disttune.TuningError, match=text):
        step(torch.randn(64, device=DEV))


def named_objective(m: Measurements) -> float:
    return m.time_ms


def test_the_objective_is_described_for_the_consensus_by_its_name_and_line():
    agreed = Options(objective=named_objective).agreed()["objective"]
    assert agreed == f"{__name__}.named_objective (line {named_objective.__code__.co_firstlineno})"
    first = lambda m: m.time_ms  # noqa: E731
    second = lambda m: 2 * m.time_ms  # noqa: E731
    texts = {Options(objective=f).agreed()["objective"] for f in (first, first, second)}
    assert len(texts) == 2  # one module, two lambdas: told apart by their lines
    assert Options(objective=disttune.pareto("time_ms")).agreed()["objective"] == repr(Pareto(("time_ms",)))
    assert Options().agreed()["objective"] == "'launch'"


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("measures2")
    return run_cases(CASES, ["memory", "energy", "energy_on_one_rank", "objective_differs"], out, 2, timeout=240,
                     extra_env={"DISTTUNE_TIMEOUT": "30"})


@pytest.mark.slow
def test_ranks_with_different_memory_readings_pick_the_same_winner_from_agreed_values(two_ranks):
    records = two_ranks["memory"]
    assert all(r["ok"] for r in records), records
    assert [r["winner"] for r in records] == [2, 2]  # rank 0 alone would pick 1, rank 1 alone 0
    assert [r["alone"] for r in records] == [1, 0]
    assert all(r["agreed_memory"] == [100.0, 100.0, 50.0] for r in records)


@pytest.mark.slow
def test_ranks_with_different_energy_readings_pick_the_same_winner(two_ranks):
    records = two_ranks["energy"]
    assert all(r["ok"] for r in records), records
    assert [r["winner"] for r in records] == [2, 2]
    assert [r["alone"] for r in records] == [1, 0]
    assert all(r["agreed_energy"] == [3.0, 3.0, 2.0] for r in records)


@pytest.mark.slow
def test_energy_read_on_one_rank_only_is_none_for_everyone(two_ranks):
    records = two_ranks["energy_on_one_rank"]
    assert all(r["ok"] for r in records), records
    assert all(r["agreed_energy"] == [None, None, None] for r in records)
    assert [r["winner"] for r in records] == [0, 0]  # the objective falls back to time


@pytest.mark.slow
def test_ranks_with_different_objective_callables_get_the_same_clear_error(two_ranks):
    records = two_ranks["objective_differs"]
    assert [r["error_type"] for r in records] == ["TuningError", "TuningError"]
    assert all("objective" in r["error_message"] and "rank_zero_objective" in r["error_message"]
               and "other_objective" in r["error_message"] for r in records)
