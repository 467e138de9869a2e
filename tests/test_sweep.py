"""Sweeps: every new key of a list of cases tuned, a table printed, a pinned table written and served from."""

from __future__ import annotations

import json
import sys

import pytest
import torch

import disttune
from tiny_kernels import DEV, TableTimer, launch_add, make_kernel, tuner

TIMES = {0: 3.0, 1: 1.0, 2: 2.0}  # config 1 (BLOCK=32) wins


def _step(tmp_path, kernel, timer, **options):
    @tuner(tmp_path, timer=timer, **options)
    def step(x):
        y = torch.empty_like(x)
        launch_add(kernel, x, y)
        return y

    return step


def test_contextual_sweep_tunes_new_keys_prints_and_pins(tmp_path, capsys):
    kernel = make_kernel(blocks=(16, 32, 64))
    timer = TableTimer(lambda info: TIMES[info.config_index] * (2 if info.key[0] == 128 else 1))
    step = _step(tmp_path, kernel, timer)
    table = tmp_path / "deploy" / "winners.json"
    table.parent.mkdir()
    cases = [((torch.randn(n, device=DEV),), {}) for n in (64, 128, 64)]
    rows = step.sweep(cases, table=table)
    assert [(r.case, r.source, r.winner.split()[0]) for r in rows] == [(0, "tuned", "BLOCK=32"),
                                                                       (1, "tuned", "BLOCK=32"),
                                                                       (2, "cached", "BLOCK=32")]
    assert rows[0].agreed_ms == 1.0 and rows[0].first_ms == 3.0 and rows[0].speedup == 3.0
    assert rows[1].agreed_ms == 2.0 and rows[1].first_ms == 6.0 and rows[2].agreed_ms is None
    printed = capsys.readouterr().out
    assert "sweep of" in printed and "first config ms" in printed and "3.00x" in printed
    entries = json.loads(table.read_text())["entries"]
    assert sorted(e["key"] for e in entries) == sorted(repr((n, "torch.float32", "torch.float32")) for n in (64, 128))
    assert all(e["configs"][e["winner"]].startswith("BLOCK: 32") for e in entries)

    served = _step(tmp_path, make_kernel(blocks=(16, 32, 64)), TableTimer(lambda i: pytest.fail("timed a pinned run")),
                   pinned=table, on_new_key="nearest")
    for n in (64, 128, 100, 1000):
        z = torch.randn(n, device=DEV)
        assert torch.equal(served(z), z + 32)
    assert sorted(served.fallbacks) == sorted(f"tiny_kernels.add_block key={(n, 'torch.float32', 'torch.float32')!r} "
                                              "occurrence=0" for n in (100, 1000)), served.fallbacks


def test_under_disttune_sweep_a_sweep_writes_its_table_and_the_commands_which_collects_the_jobs(tmp_path, monkeypatch):
    """The README's rule: ``table=`` is written as asked; ``--table`` (``$DISTTUNE_SWEEP_TABLE``) too, with the
    winners of every sweep of the job; one file where both name it."""
    from disttune import sweep

    monkeypatch.setattr(sweep, "_JOB_RECORDS", {})
    command, own = tmp_path / "command.json", tmp_path / "own.json"
    monkeypatch.setenv("DISTTUNE_SWEEP_TABLE", str(command))
    timer = TableTimer(lambda info: TIMES[info.config_index])
    first = _step(tmp_path, make_kernel(blocks=(16, 32, 64)), timer)
    first.sweep([((torch.randn(64, device=DEV),), {})], table=own, verbose=False)
    second = _step(tmp_path, make_kernel(blocks=(16, 32, 64)), timer)
    second.sweep([((torch.randn(128, device=DEV),), {})], verbose=False)

    def sizes(path):
        return sorted(int(e["key"][1:].split(",")[0]) for e in json.loads(path.read_text())["entries"])

    assert sizes(own) == [64]  # the first sweep's own table: its winners
    assert sizes(command) == [64, 128]  # the command's: the job's
    entry = json.loads(own.read_text())["entries"][0]
    assert entry["key_text"] == "n=64 dtype=float32", entry  # as the report and `disttune show` name it
    assert sweep.tables_to_write(str(command), {}) == [(str(command), list(sweep._JOB_RECORDS.values()))]


def test_sweep_rejects_cases_that_are_not_pairs(tmp_path):
    step = _step(tmp_path, make_kernel(), TableTimer(lambda i: 1.0))
    with pytest.raises(TypeError, match=r"\(args, kwargs\) pair"):
        step.sweep([(torch.randn(4, device=DEV),)])


def test_function_sweep_tunes_each_key_once_and_pins(tmp_path, capsys):
    times = {1: 3.0, 2: 1.0, 4: 2.0}
    timer = TableTimer(lambda info: times[info.config["chunks"]])

    @disttune.autotune([{"chunks": c} for c in (1, 2, 4)], key_fn=lambda x: (x.numel(),), n_warmup=0, n_repeat=1,
                       timer=timer, store=False)
    def scaled(x, *, chunks):
        return x * chunks

    table = tmp_path / "function.json"
    rows = scaled.sweep([((torch.ones(n),), {}) for n in (8, 16, 8)], table=table)
    assert [(r.source, r.winner, r.agreed_ms, r.first_ms) for r in rows] == [
        ("tuned", "{chunks=2}", 1.0, 3.0), ("tuned", "{chunks=2}", 1.0, 3.0), ("cached", "{chunks=2}", None, None)]
    assert len(timer.seen) == 6 and "{chunks=2}" in capsys.readouterr().out
    entries = json.loads(table.read_text())["entries"]
    assert [e["key"] for e in entries] == ["(8,)", "(16,)"] and {e["winner"] for e in entries} == {1}


@pytest.mark.slow
def test_disttune_sweep_runs_the_moe_example_on_two_ranks_and_serves_from_its_table(tmp_path):
    from helpers import REPO_ROOT, describe, run_command

    table = tmp_path / "moe.json"
    proc = run_command([sys.executable, "-m", "disttune", "sweep", "--nproc", "2", "--table", str(table),
                        str(REPO_ROOT / "examples" / "sweep_moe.py"), "--small", "--sizes", "1,16", "--serve", "4,16",
                        "--n-warmup", "0", "--n-repeat", "1"], timeout=400, extra_env={"DISTTUNE_PROGRESS": "0"})
    assert proc.returncode == 0, describe(proc)
    out = proc.stdout
    assert "first config ms" in out and out.count("_moe_gemm_body") >= 2, describe(proc)
    assert "rows bucket 8 (never tuned)" in out and "the winner of rows bucket 2" in out, describe(proc)
    assert "correct on every rank: True" in out and "pinned table: " in out
    assert len(json.loads(table.read_text())["entries"]) == 2


def test_disttune_sweep_names_a_missing_script_or_a_script_that_did_not_sweep(tmp_path):
    from helpers import describe, run_command, write_script

    missing = run_command([sys.executable, "-m", "disttune", "sweep", str(tmp_path / "nope.py")], timeout=120)
    assert missing.returncode == 1 and "disttune sweep: no such script" in missing.stderr, describe(missing)
    script = write_script(tmp_path, "print('no sweep here')\n")
    (tmp_path / "t.json").write_text('{"schema": 1, "entries": []}')  # an earlier run's table is not this run's
    idle = run_command([sys.executable, "-m", "disttune", "sweep", "--nproc", "1", "--table", str(tmp_path / "t.json"),
                        str(script)], timeout=120)
    assert idle.returncode == 1 and "finished without a sweep writing" in idle.stderr, describe(idle)
    usage = run_command([sys.executable, "-m", "disttune", "sweep"], timeout=120)
    assert usage.returncode == 2 and "the following arguments are required: script\n" in usage.stderr, describe(usage)
    assert "SCRIPT [SCRIPT ARGS ...]" in usage.stderr  # the script's arguments: optional


def test_function_tuner_serves_a_swept_table_without_tuning(tmp_path):
    def build(**options):
        @disttune.autotune([{"chunks": c} for c in (1, 2, 4)], key_fn=lambda x: (x.numel(),), n_warmup=0, n_repeat=1,
                           store=False, **options)
        def scaled(x, *, chunks):
            return x * chunks

        return scaled

    times = {(8, 1): 3.0, (8, 2): 1.0, (8, 4): 2.0, (64, 1): 3.0, (64, 2): 2.0, (64, 4): 1.0}
    swept = build(timer=TableTimer(lambda info: times[(int(info.key[0].strip("(,)")), info.config["chunks"])]))
    table = tmp_path / "function.json"
    swept.sweep([((torch.ones(n),), {}) for n in (8, 64)], table=table, verbose=False)
    deployed = build(pinned=table, on_new_key="nearest", timer=TableTimer(lambda info: pytest.fail("tuned")))
    assert [float(deployed(torch.ones(n))[0]) for n in (8, 64, 10, 50)] == [2.0, 4.0, 2.0, 4.0]
    assert sorted(deployed.fallbacks) == [(10,), (50,)]
    assert "nearest tuned key (64,)" in deployed.fallbacks[(50,)][1]
    strict = build(pinned=table, on_new_key="error")
    assert float(strict(torch.ones(8))[0]) == 2.0
    with pytest.raises(disttune.UnseenKeyError):
        strict(torch.ones(9))
