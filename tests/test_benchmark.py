"""disttune.benchmark on CPUs: the host-clock timings, the max over 1 and 2 gloo ranks, the result rows.

The CUDA-event and CUDA-graph paths need a GPU; here the host clock measures steps of known length
(``time.sleep``), so a helper that times the wrong thing, calls a step the wrong number of times or
writes rows nobody asked for fails.
"""

from __future__ import annotations

import datetime
import json
import platform
import sys
import time

import pytest
import torch

from disttune import benchmark
from helpers import REPO_ROOT, describe, run_command, run_launch, write_script


class Counter:
    """A step that sleeps ``seconds`` and counts its calls."""

    def __init__(self, seconds: float = 0.0) -> None:
        self.seconds, self.calls = seconds, 0

    def __call__(self) -> None:
        self.calls += 1
        if self.seconds:
            time.sleep(self.seconds)


def test_one_call_ms_is_the_median_of_single_calls_on_the_host_clock():
    step = Counter(0.004)
    ms = benchmark.one_call_ms(step, samples=5, warmup=2)
    assert step.calls == 7
    assert 4.0 <= ms < 40.0


def test_steady_ms_divides_back_to_back_calls():
    step = Counter(0.002)
    ms = benchmark.steady_ms(step, calls=4, runs=3, warmup=1)
    assert step.calls == 1 + 3 * 4
    assert 2.0 <= ms < 20.0  # per call, not per run of 4 (8 ms or more)


def test_host_and_wall_interleaves_rounds_of_every_step():
    order: list[str] = []
    fast, slow = Counter(), Counter(0.001)
    steps = {"fast": lambda: (order.append("fast"), fast()), "slow": lambda: (order.append("slow"), slow())}
    samples = benchmark.host_and_wall_us(steps, calls=3, rounds=2, warmup=1)
    assert fast.calls == slow.calls == 1 + 2 * 3
    assert order[2:] == ["fast"] * 3 + ["slow"] * 3 + ["fast"] * 3 + ["slow"] * 3
    assert [len(s) for s in samples.values()] == [2, 2]
    for sample in samples["fast"] + samples["slow"]:
        assert 0 < sample.host_us <= sample.wall_us
    assert min(s.wall_us for s in samples["slow"]) >= 1000.0 > min(s.wall_us for s in samples["fast"])


def test_interleaved_rotates_the_contenders_and_reports_median_spread_and_host_time():
    order: list[str] = []
    steps = {name: (lambda name=name, step=Counter(seconds): (order.append(name), step()))
             for name, seconds in (("a", 0.0), ("b", 0.002), ("c", 0.0))}
    spreads = benchmark.interleaved(steps, rounds=3, calls=2, warmup=1)
    assert order[:3] == ["a", "b", "c"]  # the warm-up calls
    rounds = [order[3 + 6 * r: 3 + 6 * (r + 1)][::2] for r in range(3)]  # each timing is 2 calls of one contender
    assert rounds == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert all(len(spread.rounds) == 3 and len(spread.per_rank) == 1 for spread in spreads.values())
    slow = spreads["b"]
    assert 2.0 <= slow.low <= slow.median <= slow.high < 40.0  # per call, not per timing of 2 calls
    assert slow.per_rank == (slow.median,)
    assert slow.host >= 2.0 > spreads["a"].median  # on the host clock, issuing is the whole call
    assert slow.text().startswith(f"{slow.median:.3f} [")


def test_max_over_ranks_without_torch_distributed_is_the_value():
    assert not benchmark.distributed()
    assert benchmark.max_over_ranks(1.5) == 1.5
    assert benchmark.max_over_ranks((1.0, 2.0)) == [1.0, 2.0]


@pytest.mark.slow
def test_max_over_ranks_on_two_gloo_ranks(tmp_path):
    """Each rank offers its own values; every rank gets the larger, element-wise, and only rank 0 writes."""
    script = write_script(tmp_path, f'''
        import json
        from disttune import benchmark, dist
        info = dist.init()
        r = info.rank
        scalar = benchmark.max_over_ranks(1.0 + r)
        values = benchmark.max_over_ranks([5.0 - r, 1.0 + 10 * r])
        ms = benchmark.one_call_ms(lambda: None, samples=3, warmup=0)  # a barrier per sample
        import time
        spread = benchmark.interleaved({{"fast": lambda: None, "slower on rank 1": lambda: time.sleep(0.001 + 0.01 * r)}},
                                       rounds=3, calls=2, warmup=0)["slower on rank 1"]
        written = benchmark.append_rows({str(tmp_path / "rows.jsonl")!r}, [{{"rank": r}}])
        env = benchmark.environment()
        result = dict(rank=r, scalar=scalar, values=values, written=written is not None, world=env["world"], ms=ms,
                      rounds=spread.rounds, per_rank=spread.per_rank)
        with open({str(tmp_path)!r} + f"/result.rank{{r}}.json", "w") as out:
            json.dump(result, out)
        dist.destroy()
    ''')
    proc = run_launch(["--nproc_per_node=2", str(script)], timeout=120)  # a hang past 120 s raises
    assert proc.returncode == 0, describe(proc)
    # One file per rank: two ranks printing at once can share a line of the launcher's stdout.
    results = {}
    for path in tmp_path.glob("result.rank*.json"):
        result = json.loads(path.read_text())
        results[result["rank"]] = result
    assert sorted(results) == [0, 1], describe(proc)
    for r, result in results.items():
        assert result["scalar"] == 2.0
        assert result["values"] == [5.0, 11.0]
        assert result["world"] == 2
        assert result["written"] == (r == 0)
        assert result["ms"] >= 0
        # each round is the slowest rank's (rank 1 sleeps 11 ms a call); the ranks' own medians tell them apart
        assert len(result["rounds"]) == 3 and min(result["rounds"]) >= 11.0
        assert result["per_rank"][0] < 11.0 <= result["per_rank"][1]
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert [row["rank"] for row in rows] == [0] and rows[0]["world"] == 2


def expected_device() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"cpu ({platform.processor() or platform.machine()})"


def test_environment_names_device_versions_and_date():
    import triton

    env = benchmark.environment(bench="x")
    assert env["world"] == 1 and env["bench"] == "x"
    assert env["torch"] == torch.__version__ and env["triton"] == triton.__version__
    assert env["device"] == expected_device() and "cuda" in env
    assert env["interpreter"] is (not torch.cuda.is_available())
    assert datetime.datetime.fromisoformat(env["date"]).tzinfo is not None


def test_append_rows_writes_only_where_asked(tmp_path):
    assert benchmark.append_rows(None, [{"a": 1}]) is None
    assert list(tmp_path.iterdir()) == []
    path = tmp_path / "deeper" / "rows.jsonl"
    assert benchmark.append_rows(path, [{"a": 1}, {"a": 2}]) == path
    benchmark.append_rows(path, [{"a": 3, "device": "mine"}], meta={"device": "given", "world": 4})
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [row["a"] for row in rows] == [1, 2, 3]
    assert rows[0]["device"] == expected_device() and rows[0]["torch"] == torch.__version__
    assert rows[2]["device"] == "mine" and rows[2]["world"] == 4 and "torch" not in rows[2]


def test_rel_error():
    want = torch.tensor([3.0, 4.0])
    assert benchmark.rel_error(want.half(), want) == 0.0
    assert benchmark.rel_error(torch.tensor([3.0, 4.5]), want) == pytest.approx(0.1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal applies without a GPU")
def test_capture_graph_refuses_without_a_gpu():
    with pytest.raises(RuntimeError, match="CUDA graphs"):
        benchmark.capture_graph(lambda: None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_capture_graph_replays_the_step():
    x = torch.zeros(4, device="cuda")
    graph = benchmark.capture_graph(lambda: x.add_(1))  # warm-up runs and the capture itself count too
    before = x.clone()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(x, before + 1)


def test_cprofile_names_the_profiled_function():
    def profiled_step() -> None:
        sum(range(100))

    host_ms, text = benchmark.cprofile(profiled_step, calls=20, top=5)
    assert host_ms > 0 and "profiled_step" in text


@pytest.mark.slow
def test_fast_path_bench_writes_rows_only_with_out(tmp_path):
    """The CPU mode of bench/fast_path.py: a table on stdout; a JSON file only where --out points."""
    before = sorted(p.name for p in (REPO_ROOT / "bench").iterdir())
    quick = ["bench/fast_path.py", "--smoke", "--calls", "200", "--rounds", "2", "--kernels", "null"]
    proc = run_command([sys.executable, *quick], timeout=240, extra_env={"DISTTUNE_LOG_DIR": str(tmp_path / "logs")})
    assert proc.returncode == 0, describe(proc)
    assert "contextual_over_direct_us" in proc.stdout and "rows appended" not in proc.stdout
    assert sorted(p.name for p in (REPO_ROOT / "bench").iterdir()) == before
    out = tmp_path / "rows" / "fast_path.jsonl"
    proc = run_command([sys.executable, *quick, "--out", str(out)], timeout=240,
                       extra_env={"DISTTUNE_LOG_DIR": str(tmp_path / "logs")})
    assert proc.returncode == 0, describe(proc)
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["bench"] == "fast_path" and row["kernel"] == "null" and row["calls"] == 200
    assert {"device", "world", "torch", "triton", "cuda", "date"} <= set(row)
