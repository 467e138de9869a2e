"""Faults in the files around the tuner: damaged store entries and pinned tables, planted symbolic links,
a held lock, and the CLI on a damaged store. Each job runs 2 gloo ranks, bounded in wall time.

Every test measures what it adds to the fault suite's summary line (see ``fault_tally``).
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from fault_tally import TALLY, endings, faults_seen, link_writes, torn_files, tracebacks_in
from helpers import CommandTimeout, describe, failure, read_records, run_launch

CASES = Path(__file__).with_name("file_cases.py")
DAMAGES = ("not utf-8", "deep nesting", "winner true", "winner_config disagrees", "winner a string",
           "configs not texts", "fifo")


def launch(tmp_path: Path, cases: list[str], world: int = 2, timeout: float = 300, **env) -> dict:
    """Run ``cases`` of file_cases.py on ``world`` ranks; a hang counts and fails, stderr tracebacks count."""
    out = tmp_path / f"run{len(list(tmp_path.glob('run*')))}"
    try:
        proc = run_launch([f"--nproc_per_node={world}", str(CASES), *cases, "--out", str(out)], timeout=timeout,
                          extra_env={"DISTTUNE_TIMEOUT": "30", **env})
    except CommandTimeout:
        TALLY["hangs"] += 1
        raise
    assert proc.returncode == 0, describe(proc)
    assert tracebacks_in(proc.stderr) == 0, describe(proc)
    return read_records(out, cases, range(world), proc)


@pytest.mark.slow
def test_damaged_store_entries_are_a_warning_and_a_retune(tmp_path):
    (per_rank,) = launch(tmp_path, ["damaged_store"]).values()
    for result in per_rank:
        assert result["ok"], failure(result)
    for damage in DAMAGES:
        outcomes = [r["damages"][damage] for r in per_rank]
        for call in ("first", "second", "third"):
            ending = endings([o[call] for o in outcomes], "source", "winner", ok="source", error="error")
            assert ending == {"split": False, "disagree": False, "tracebacks": 0}, (damage, call, outcomes)
        assert [o["first"]["source"] for o in outcomes] == ["tuned", "tuned"], (damage, outcomes)
        warned = [w for w in outcomes[0]["second"]["warnings"] if "ignoring store file" in w]
        faults_seen(bool(warned))
        assert warned, (damage, outcomes[0]["second"])
        assert [o["second"]["source"] for o in outcomes] == ["tuned", "tuned"], (damage, outcomes)
        assert all(o["second"]["winner"] == 1 and o["second"]["output_ok"] for o in outcomes), (damage, outcomes)
        # the re-tuned winner replaced the damaged file: the next job loads it
        assert [o["third"]["source"] for o in outcomes] == ["store", "store"], (damage, outcomes)
    assert torn_files((tmp_path / "run0" / "damaged").glob("*/rank*")) == []


@pytest.mark.slow
def test_damaged_pinned_tables_are_one_clear_error_naming_the_file(tmp_path):
    (per_rank,) = launch(tmp_path, ["damaged_pinned"]).values()
    for result in per_rank:
        assert result["ok"], failure(result)
    for damage in DAMAGES:
        outcomes = [r["damages"][damage] for r in per_rank]
        ending = endings(outcomes, ok="source", error="error")
        assert not any(ending.values()), (damage, outcomes)
        for rank, outcome in enumerate(outcomes):
            # every rank's load fails alike, and the consensus makes it one TuningError naming each rank's
            assert outcome.get("error_type") == "TuningError" and "PinnedTableError" in outcome["error"], (damage, outcome)
            assert outcome["error"].startswith("disttune: ") and outcome["table"] in outcome["error"], (damage, outcome)
            assert outcome["elapsed_s"] < 30, f"{damage}: the error came after the 30 s timeout"
        faults_seen(1)


@pytest.mark.slow
def test_pinned_table_made_for_another_kernel_source_is_refused(tmp_path):
    (per_rank,) = launch(tmp_path, ["pinned_other_source"]).values()
    for result in per_rank:
        assert result["ok"], failure(result)
    assert [r["same"].get("source") for r in per_rank] == ["pinned", "pinned"], per_rank
    edited = [r["edited"] for r in per_rank]
    ending = endings(edited, ok="source", error="error")
    assert not ending["split"] and not ending["disagree"], edited
    for outcome in edited:
        assert outcome.get("error_type") == "TuningError", outcome
        assert "made for another source of" in outcome["error"] and per_rank[0]["table"] in outcome["error"], outcome
    faults_seen(1)


def test_planted_links_are_never_written_through(tmp_path):
    (per_rank,) = launch(tmp_path, ["planted_links"]).values()
    for result in per_rank:
        assert result["ok"], failure(result)
    for call in ("first", "second", "third"):
        ending = endings([r[call] for r in per_rank], "source", "winner", ok="source", error="error")
        assert not any(ending.values()), [r[call] for r in per_rank]
    for result in per_rank:
        assert link_writes(result["changed"]) == [], f"rank {result['rank']} wrote through a link: {result['changed']}"
        assert link_writes(f"outside/{name}" for name in result["outside"]) == [], result["outside"]
        assert not result["log_is_link"] and result["log_has_records"], "the log was replaced by a file of its own"
    rank0 = per_rank[0]
    handled = [any("rank log" in w and "symbolic link" in w for w in r["first"]["warnings"]) for r in per_rank] + [
        any("store folder" in w and "symbolic link" in w for w in rank0["first"]["warnings"]),
        any("ignoring store file" in w and "symbolic link" in w for w in rank0["second"]["warnings"]),
        any("lock file" in w and "symbolic link" in w for w in rank0["second"]["warnings"])]
    faults_seen(sum(handled))  # a log link per rank; rank 0's folder, entry and lock links
    assert all(handled), (handled, rank0)
    assert not rank0["folder_is_link"] and not rank0["entry_is_link"], rank0
    assert [r["first"]["source"] for r in per_rank] == ["tuned", "tuned"]
    assert any("ignoring store file" in w for w in rank0["second"]["warnings"]), rank0["second"]
    assert [r["second"]["source"] for r in per_rank] == ["tuned", "tuned"]
    assert [r["third"]["source"] for r in per_rank] == ["store", "store"], "the linked entry was replaced by a file"
    assert torn_files((tmp_path / "run0" / "links").glob("rank*/store")) == []


@pytest.mark.slow
def test_the_file_lock_is_what_keeps_writers_apart(tmp_path):
    """Rank 0 reaches its store write while this test holds the entry's lock: nothing may land until it lets go."""
    from filelock import FileLock

    signals = tmp_path / "signals"
    signals.mkdir()
    job: dict = {}

    def run_job():
        try:
            job["records"] = launch(tmp_path, ["held_lock"], DISTTUNE_TEST_SIGNALS=str(signals))
        except BaseException as err:  # noqa: BLE001 - re-raised by the test below
            job["error"] = err

    runner = threading.Thread(target=run_job)
    runner.start()
    deadline = time.monotonic() + 240
    while not (signals / "lock-wanted").exists():
        assert time.monotonic() < deadline and runner.is_alive(), job.get("error", "rank 0 never reached its write")
        time.sleep(0.05)
    entry = Path((signals / "lock-wanted").read_text())
    held_s = 3.0
    with FileLock(str(entry) + ".lock", timeout=10):
        (signals / "lock-held").write_text("held")
        until = time.monotonic() + held_s
        seen_while_held = set()
        while time.monotonic() < until:
            seen_while_held.update(p.name for p in entry.parent.iterdir() if not p.name.endswith(".lock"))
            time.sleep(0.02)
    runner.join(240)
    assert not runner.is_alive(), "the job did not end"
    if "error" in job:
        raise job["error"]
    TALLY["trials"] += 1
    assert seen_while_held == set(), f"written while another process held the lock: {seen_while_held}"
    (per_rank,) = job["records"].values()
    ending = endings(per_rank, "source", "winner")
    assert not any(ending.values()), per_rank
    assert [r["source"] for r in per_rank] == ["tuned", "tuned"], per_rank
    assert per_rank[0]["tuning_s"] >= held_s, "rank 0 finished before the lock was released"
    assert entry.exists() and json.loads(entry.read_text())["winner"] == 1
    faults_seen(1)


def test_the_cli_lists_and_clears_a_damaged_store(tmp_path, capsys):
    """show, export and clear on every kind of damage at once: no traceback, all of it removed."""
    from disttune import store
    from disttune.cli import main

    root = tmp_path / "store"
    entry = store.EntryId("kernel", "pkg.kernel", "src", "(64,)", 0, ("a", "b"))
    target = store.WinnerStore(root, {"env": 1})
    good = target.save(entry, 1, [2.0, 1.0])
    folder = good.parent
    text = good.read_text()
    (folder / "utf8-0.json").write_bytes(b"\xff\xfe" + text.encode())
    (folder / "deep-0.json").write_bytes(b"[" * 100_000 + b"]" * 100_000)
    (folder / "true-0.json").write_text(json.dumps({**json.loads(text), "winner": True}))
    os.mkfifo(folder / "fifo-0.json")
    (folder / f".{good.name}.0123456789ab.tmp").write_text(text[:30])  # a killed writer's leftover
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.json").write_text("{}")
    (root / "linked.kernel").symlink_to(outside, target_is_directory=True)

    def run(*argv: str) -> tuple[int, str]:
        """The command in this process: an exception escaping it is a traceback where one line was due."""
        try:
            code = main([*argv, "--cache-dir", str(root)])
        except BaseException:
            TALLY["tracebacks"] += 1
            raise
        out, err = capsys.readouterr()
        assert not err or err.count("\n") == 1, err
        return code, out

    code, shown = run("show")
    assert code == 0 and shown.count("DAMAGED") == 5 and "LEFTOVER" in shown, shown
    assert "not UTF-8" in shown and "nested too deeply" in shown and "not a regular file" in shown, shown
    code, exported = run("export", str(tmp_path / "table.json"))
    assert code == 0 and "exported 1 winner" in exported, exported
    code, cleared = run("clear")
    assert code == 0 and "removed 6 entries" in cleared and "1 leftover" in cleared, cleared
    assert sorted(p.name for p in folder.iterdir()) == [] and not (root / "linked.kernel").exists()
    assert link_writes([] if (outside / "keep.json").read_text() == "{}" else ["outside/keep.json"]) == []
    TALLY["trials"] += 1
    faults_seen(6)
