"""The persistent winner store and pinned tables, and the function-level autotuner across ranks.

Single-process cases run here; multi-rank cases launch ``dist_cases.py`` (bounded in
wall time) with a per-rank store directory so ranks can hold different files.
"""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
import os
import signal
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

import disttune
from disttune import store
from helpers import failure, mpi, run_cases
from tiny_kernels import device, launch_add, make_kernel, preferring, tuned_step

CASES = Path(__file__).with_name("dist_cases.py")
DEV = device()


def store_files(root: Path) -> list[Path]:
    return sorted(root.glob("*/*.json"))


# -- single process ---------------------------------------------------------------------------------

def test_second_wrapper_loads_the_winner_without_timing(tmp_path):
    x = torch.randn(64, device=DEV)
    first = tuned_step(make_kernel(), preferring(2))
    first(x)
    (path,) = store_files(tmp_path / "winner-store")  # the conftest's per-test DISTTUNE_CACHE_DIR
    record = json.loads(path.read_text())
    assert record["schema"] == store.SCHEMA and record["winner"] == 2 and record["key"] == repr((64, "torch.float32", "torch.float32"))
    assert record["fingerprint"]["world_size"] == 1 and "triton" in record["fingerprint"]

    timer = preferring(0)
    runs = {"n": 0}
    kernel = make_kernel()  # a fresh kernel object: nothing in its own cache

    @disttune.contextual_autotune(timer=timer, verbose=False)
    def step(x):
        runs["n"] += 1
        y = torch.full_like(x, float("nan"))
        launch_add(kernel, x, y)
        return y

    y = step(x)
    assert timer.seen == [] and runs["n"] == 2, "a store hit costs the discovery run and the final run only"
    assert step.report.results[0].source == "store" and torch.equal(y, x + 64)


def test_always_tune_ignores_the_store(tmp_path, monkeypatch):
    x = torch.randn(64, device=DEV)
    tuned_step(make_kernel(), preferring(2))(x)
    monkeypatch.setenv("DISTTUNE_ALWAYS_TUNE", "1")
    timer = preferring(1)
    step = tuned_step(make_kernel(), timer)
    step(x)
    assert timer.seen and step.report.results[0].winner == 1


def test_config_list_change_is_a_miss(tmp_path):
    x = torch.randn(64, device=DEV)
    tuned_step(make_kernel(blocks=(16, 32, 64)), preferring(2))(x)
    timer = preferring(0)
    step = tuned_step(make_kernel(blocks=(16, 32)), timer)
    step(x)
    assert timer.seen and step.report.results[0].source == "tuned"


KERNEL_SOURCE = '''
import triton
import triton.language as tl


@triton.jit
def shifted(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(y_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + SHIFT, mask=mask)
'''


def load_kernel_module(tmp_path: Path, shift: float):
    path = tmp_path / f"kmod_{int(shift)}" / "kmod.py"
    path.parent.mkdir()
    path.write_text(KERNEL_SOURCE.replace("SHIFT", str(shift)))
    spec = importlib.util.spec_from_file_location("kmod", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["kmod"] = module
    spec.loader.exec_module(module)
    return module


def test_kernel_source_change_is_a_miss(tmp_path):
    x = torch.randn(64, device=DEV)
    old = load_kernel_module(tmp_path, 1.0)
    tuned_step(make_kernel(old.shifted), preferring(2))(x)
    new = load_kernel_module(tmp_path, 2.0)  # same module and function name, new body
    timer = preferring(1)
    step = tuned_step(make_kernel(new.shifted), timer)
    step(x)
    assert timer.seen and step.report.results[0].source == "tuned"
    assert len(store_files(tmp_path / "winner-store")) == 2


@pytest.mark.parametrize("damage", ["truncated", "not json", "wrong schema", "other version"])
def test_damaged_file_is_reported_and_retuned(tmp_path, damage):
    x = torch.randn(64, device=DEV)
    tuned_step(make_kernel(), preferring(2))(x)
    (path,) = store_files(tmp_path / "winner-store")
    text = path.read_text()
    record = json.loads(text)
    if damage == "truncated":
        path.write_text(text[: len(text) // 2])
    elif damage == "not json":
        path.write_text("\x00garbage")
    elif damage == "wrong schema":
        path.write_text(json.dumps({**record, "schema": 99}))
    else:
        path.write_text(json.dumps({**record, "fingerprint": {**record["fingerprint"], "triton": "0.0.1"}}))
    timer = preferring(1)
    step = tuned_step(make_kernel(), timer)
    with pytest.warns(store.StoreWarning, match="ignoring store file"):
        step(x)
    assert timer.seen and step.report.results[0].winner == 1
    assert json.loads(path.read_text())["winner"] == 1, "the re-tuned winner replaced the damaged file"


def test_warn_mode_uses_an_entry_from_another_environment(tmp_path):
    x = torch.randn(64, device=DEV)
    tuned_step(make_kernel(), preferring(2))(x)
    (path,) = store_files(tmp_path / "winner-store")
    record = json.loads(path.read_text())
    record["fingerprint"]["torch"] = "0.0.1"  # as if written by another torch: another file name
    path.with_name(path.name.split("-")[0] + "-0123456789abcdef.json").write_text(json.dumps(record))
    path.unlink()
    timer = preferring(1)
    step = tuned_step(make_kernel(), timer, store_check="warn")
    with pytest.warns(store.StoreWarning, match="another environment.*torch"):
        step(x)
    assert timer.seen == [] and step.report.results[0].winner == 2


def test_fingerprint_records_the_driver_and_nccl_and_a_change_is_a_miss(tmp_path, monkeypatch):
    fingerprint = store.environment_fingerprint(1, 1)
    assert "driver" in fingerprint and "nccl" in fingerprint
    if not torch.cuda.is_available():
        assert fingerprint["driver"] is None
    x = torch.randn(64, device=DEV)
    tuned_step(make_kernel(), preferring(2))(x)
    monkeypatch.setattr(store, "gpu_driver_version", lambda: "999.1")
    timer = preferring(1)
    step = tuned_step(make_kernel(), timer)
    step(x)
    assert timer.seen and step.report.results[0].source == "tuned", "another driver: tuned again"
    records = [json.loads(p.read_text()) for p in store_files(tmp_path / "winner-store")]
    assert sorted(r["fingerprint"]["driver"] or "" for r in records) == ["", "999.1"]


def test_a_fifo_where_the_rank_log_goes_is_a_warning(tmp_path):
    logs = tmp_path / "fifo-logs"
    logs.mkdir()
    os.mkfifo(logs / "rank-0.log")
    x = torch.randn(64, device=DEV)
    from disttune.logs import LogWarning

    with pytest.warns(LogWarning, match="not a regular file"):
        y = tuned_step(make_kernel(), preferring(2), log_dir=logs)(x)
    assert torch.equal(y, x + 64)


def test_unwritable_store_warns_once_and_tuning_succeeds(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    x = torch.randn(64, device=DEV)
    with pytest.warns(store.StoreWarning, match="could not write the store") as caught:
        step = tuned_step(make_kernel(), preferring(2), cache_dir=blocker / "store")
        y = step(x)
    assert len([w for w in caught if "could not write" in str(w.message)]) == 1
    assert torch.equal(y, x + 64)


def _hammer(root: str, winner: int, rounds: int) -> None:
    entry = store.EntryId("kernel", "k", "src", "key", 0, ("a", "b", "c", "d", "e"))
    target = store.WinnerStore(root, {"env": 1})
    for _ in range(rounds):
        target.save(entry, winner, [1.0] * 5, {"padding": "x" * 20000})


@pytest.mark.slow
def test_concurrent_writers_never_tear_a_file(tmp_path):
    root = str(tmp_path / "shared")
    context = multiprocessing.get_context("spawn")
    writers = [context.Process(target=_hammer, args=(root, w, 40)) for w in range(4)]
    for writer in writers:
        writer.start()
    entry = store.EntryId("kernel", "k", "src", "key", 0, ("a", "b", "c", "d", "e"))
    reader = store.WinnerStore(root, {"env": 1})
    seen, deadline = set(), time.monotonic() + 120
    with warnings.catch_warnings():
        warnings.simplefilter("error", store.StoreWarning)  # a torn file would warn: fail instead
        while any(w.is_alive() for w in writers):
            assert time.monotonic() < deadline, "writers hung"
            record = reader.load(entry)
            if record is not None:
                seen.add(record["winner"])
    for writer in writers:
        writer.join(30)
        assert writer.exitcode == 0
    assert reader.load(entry)["winner"] in range(4) and seen <= set(range(4))


def kill_a_writer_mid_write(tmp_path) -> int:
    """Kill a writer that rewrites one entry in a loop; check the entry is whole. Returns its exit status."""
    root = str(tmp_path / "shared")
    _hammer(root, 3, 1)
    context = multiprocessing.get_context("spawn")
    writer = context.Process(target=_hammer, args=(root, 1, 100000))
    writer.start()
    time.sleep(3)
    os.kill(writer.pid, signal.SIGKILL)
    writer.join(30)
    entry = store.EntryId("kernel", "k", "src", "key", 0, ("a", "b", "c", "d", "e"))
    record = store.WinnerStore(root, {"env": 1}).load(entry)
    assert record is not None and record["winner"] in (1, 3)
    assert [p.name for p in Path(root).glob("*/*.json")] == [store.WinnerStore(root, {"env": 1}).path(entry).name]
    return writer.exitcode


def test_writer_killed_mid_write_leaves_the_old_entry_whole(tmp_path):
    assert kill_a_writer_mid_write(tmp_path) == -signal.SIGKILL


def test_pinned_table_round_trip_and_missing_entry(tmp_path):
    x = torch.randn(64, device=DEV)
    tuned_step(make_kernel(), preferring(2))(x)
    table = tmp_path / "winners.json"
    assert store.export_table(table) == 1
    timer = preferring(0)
    step = tuned_step(make_kernel(), timer, pinned=table, cache_dir=tmp_path / "empty")
    assert torch.equal(step(x), x + 64) and timer.seen == []
    assert step.report.results[0].source == "pinned"

    other = tuned_step(make_kernel(), preferring(0), pinned=table, cache_dir=tmp_path / "empty")
    with pytest.raises(disttune.TuningError, match=r"has no winner for: .*key=\(80,"):
        other(torch.randn(80, device=DEV))

    assert store.import_table(table, tmp_path / "imported") == 1
    assert len(store_files(tmp_path / "imported")) == 1
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not a disttune winners table"):
        store.load_table(tmp_path / "bad.json")


@pytest.mark.parametrize("kind", ["kernel checked", "function objective='step'", "function checked"])
def test_a_table_of_checked_or_objective_winners_loads(tmp_path, kind):
    entry = store.EntryId(kind, "k", "source", repr((64,)), 0, ("A", "B"), "digest")
    store.write_table(tmp_path / "t.json", [store.make_record(entry, 1, [2.0, 1.0], {})])
    (record,) = store.load_table(tmp_path / "t.json")["entries"]
    assert record["kind"] == kind and record["winner"] == 1
    bad = store.EntryId("kernels", "k", "source", repr((64,)), 0, ("A", "B"), "digest")
    store.write_table(tmp_path / "bad.json", [store.make_record(bad, 1, [2.0, 1.0], {})])
    with pytest.raises(store.PinnedTableError, match="field 'kind' is 'kernels'"):
        store.load_table(tmp_path / "bad.json")


def test_looking_for_leftover_temp_files_writes_nothing(tmp_path):
    """A temp file whose entry has no lock is abandoned; finding it must not create that lock."""
    root = tmp_path / "store"
    entry = store.EntryId("kernel", "pkg.kernel", "src", "(64,)", 0, ("a", "b"))
    folder = store.WinnerStore(root, {"env": 1}).save(entry, 1, [2.0, 1.0]).parent
    orphan = folder / ".lost-0.json.0123456789ab.tmp"
    orphan.write_text("{")
    before = sorted(os.listdir(folder))
    assert list(store.leftover_files(root)) == [orphan]
    assert sorted(os.listdir(folder)) == before


# -- several ranks ------------------------------------------------------------------------------------------

def launch_cases(tmp_path: Path, world: int, cases: list[str], store_dir: Path, expect_errors: bool = False,
                 mpi: bool = False, **env) -> dict:
    out = tmp_path / f"run{len(list(tmp_path.glob('run*')))}"
    results = run_cases(CASES, cases, out, world, mpi=mpi, timeout=240,
                        extra_env={"DISTTUNE_TIMEOUT": "30", "DISTTUNE_TEST_STORE": str(store_dir), **env})
    for per_rank in results.values():
        for result in per_rank:
            assert expect_errors or result["ok"], failure(result)
    return results


@pytest.mark.slow
def test_second_process_hits_even_where_a_rank_lost_its_file(tmp_path):
    stores = tmp_path / "stores"
    (first,) = launch_cases(tmp_path, 2, ["store"], stores).values()
    assert [r["source"] for r in first] == ["tuned", "tuned"] and all(r["output_ok"] for r in first)
    assert store_files(stores / "rank0") and not (stores / "rank1").exists(), "rank 0 alone writes"

    (second,) = launch_cases(tmp_path, 2, ["store"], stores).values()
    for result in second:  # rank 1 has no file: rank 0's entry decides for both, same run count
        assert (result["source"], result["runs"], result["timed"], result["output_ok"]) == ("store", 2, 0, True)

    (path,) = store_files(stores / "rank0")
    good = path.read_text()
    path.write_text(good[:40])  # rank 0's file truncated: reported there, everyone re-tunes together
    (third,) = launch_cases(tmp_path, 2, ["store"], stores).values()
    assert [r["source"] for r in third] == ["tuned", "tuned"] and third[0]["runs"] == third[1]["runs"] == 11
    assert any("ignoring store file" in w for w in third[0]["warnings"])

    (stores / "rank1" / path.parent.name).mkdir(parents=True)
    (stores / "rank1" / path.parent.name / path.name).write_text("{corrupt")  # rank 1's copy corrupt, rank 0's good
    (fourth,) = launch_cases(tmp_path, 2, ["store"], stores).values()
    assert [r["source"] for r in fourth] == ["store", "store"]


@pytest.mark.slow
def test_world_size_change_invalidates_and_four_ranks_agree(tmp_path):
    stores = tmp_path / "stores"
    launch_cases(tmp_path, 2, ["store"], stores)
    (four,) = launch_cases(tmp_path, 4, ["store"], stores).values()
    assert [r["source"] for r in four] == ["tuned"] * 4 and {r["runs"] for r in four} == {11}
    (again,) = launch_cases(tmp_path, 4, ["store"], stores).values()
    assert [r["source"] for r in again] == ["store"] * 4


@pytest.mark.slow
def test_pinned_tables_must_match_on_every_rank(tmp_path):
    stores = tmp_path / "stores"
    launch_cases(tmp_path, 2, ["store"], stores)
    table = tmp_path / "winners.json"
    assert store.export_table(table, stores / "rank0") == 1
    (pinned,) = launch_cases(tmp_path, 2, ["pinned"], tmp_path / "none",
                             DISTTUNE_PINNED=str(table)).values()
    assert [(r["source"], r["timed"], r["output_ok"]) for r in pinned] == [("pinned", 0, True)] * 2

    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"schema": store.TABLE_SCHEMA, "entries": []}))
    (missing,) = launch_cases(tmp_path, 2, ["pinned"], tmp_path / "none", expect_errors=True,
                              DISTTUNE_PINNED=str(empty)).values()
    assert [r.get("error_type") for r in missing] == ["TuningError"] * 2
    assert all("has no winner for" in r["error_message"] for r in missing)


@pytest.mark.slow
def test_function_autotune_over_gloo_and_subgroups(tmp_path):
    results = launch_cases(tmp_path, 4, ["function", "function_subgroup"], tmp_path / "s")
    for result in results["function"]:
        # each rank alone prefers chunks=rank; the slowest-rank view prefers chunks=4 (3.0 ms)
        assert result["winner"] == 4 and result["agreed_ms"] == [5.0, 5.0, 5.0, 5.0, 3.0]
        assert result["out"] == [5.0] * 4 and result["first"] == [1.0] * 4
        assert result["calls"] == 5 * 3 + 1  # 5 configs x (1 warm-up + 2 timed), then the winner
    assert {(r["pair"], r["winner"]) for r in results["function_subgroup"]} == {(0, 0), (1, 2)}


@pytest.mark.slow
@mpi
def test_function_autotune_over_mpi(tmp_path):
    (per_rank,) = launch_cases(tmp_path, 2, ["function"], tmp_path / "s", mpi=True).values()
    assert [r["winner"] for r in per_rank] == [2, 2]


@pytest.mark.slow
def test_ranks_with_different_pinned_tables_fail_together(tmp_path):
    stores = tmp_path / "stores"
    launch_cases(tmp_path, 2, ["store"], stores)
    tables = tmp_path / "tables"
    tables.mkdir()
    store.export_table(tables / "table0.json", stores / "rank0")
    other = json.loads((tables / "table0.json").read_text())
    other["entries"][0]["winner"] = 0  # same site, another winner
    other["entries"][0]["winner_config"] = other["entries"][0]["configs"][0]
    (tables / "table1.json").write_text(json.dumps(other))
    (per_rank,) = launch_cases(tmp_path, 2, ["pinned_mismatch"], tmp_path / "none",
                               expect_errors=True, DISTTUNE_TEST_TABLES=str(tables)).values()
    assert [r.get("error_type") for r in per_rank] == ["TuningError"] * 2
    assert len({r["error_message"] for r in per_rank}) == 1 and "different pinned winner tables" in per_rank[0]["error_message"]


@pytest.mark.slow
def test_split_function_tuning_times_disjoint_shares(tmp_path):
    (per_rank,) = launch_cases(tmp_path, 2, ["function_split"], tmp_path / "s").values()
    table = per_rank[0]["table"]
    owners_time = [table[i] + 0.01 * (i % 2) for i in range(len(table))]
    expected = min(range(len(table)), key=lambda i: (owners_time[i], i))
    for rank, result in enumerate(per_rank):
        assert result["ok"], failure(result)
        assert result["timed"] == list(range(rank, len(table), 2)), "each rank times only its own share"
        assert result["agreed_ms"] == pytest.approx(owners_time)
        assert result["winner"] == expected
        assert result["calls"] == len(result["timed"]) * 3 + 1
