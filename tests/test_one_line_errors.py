"""A disttune error is one line per job wherever the job is launched from, then the exit status; the traceback
only on request. Real 2-rank jobs on gloo: under scripts/launch.sh, bare torchrun and mpiexec."""

from __future__ import annotations

import re
import sys

import pytest

from helpers import REPO_ROOT, describe, mpi, run_command, run_launch, run_python, write_script

TESTS = str(REPO_ROOT / "tests")

#: Each rank launches its own size: the tuner's consensus fails alike on every rank. STALL=1: rank 1 sleeps
#: instead of tuning, so rank 0 alone times out. RAISE=1: a plain ValueError, not a disttune error.
SCRIPT = f"""
    import os, sys, time
    os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.path.insert(0, {TESTS!r})
    import torch, disttune
    from tiny_kernels import launch_add, make_kernel

    info = disttune.dist.init()
    if os.environ.get("RAISE") == "1":
        raise ValueError("not disttune's")
    kernel = make_kernel()
    x = torch.randn(64 + 16 * info.rank)

    @disttune.contextual_autotune(is_dist=True, verbose=False, n_warmup=0, n_repeat=1)
    def step():
        launch_add(kernel, x, torch.empty_like(x))

    if os.environ.get("STALL") == "1" and info.rank == 1:
        time.sleep(60)
    step()
"""


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    return write_script(tmp_path_factory.mktemp("one-line"), SCRIPT, "disagree.py")


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "disttune: " in line and "warning" not in line]


def one_error_line(proc) -> str:
    """The one disttune error line of a job's stderr (failing with the job's output where there is not one)."""
    lines = error_lines(proc.stderr)
    assert len(lines) == 1, describe(proc)
    return lines[0]


def test_under_launch_sh_a_disttune_error_is_one_line_then_the_exit_status(script):
    proc = run_launch(["--nproc_per_node=2", str(script)], timeout=240)
    assert proc.returncode == 1, describe(proc)
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("launch.sh: no GPU here")]
    assert len(lines) == 2, describe(proc)
    assert lines[0].startswith("disttune: ranks 0, 1: TuningError: step: ranks disagree on what to tune: "), lines
    assert lines[0].endswith("(DISTTUNE_TRACEBACK=1 prints the traceback)"), lines
    # both ranks accounted for: both failed, or torchrun stopped the one that had not exited yet
    assert re.fullmatch(r"launch\.sh: (ranks 0, 1 exited with status 1|rank (0|1) exited with status 1 \(then torchrun "
                        r"stopped rank (0|1)\)); exit status 1", lines[1]), lines


@pytest.mark.slow
def test_the_traceback_comes_on_request(script):
    proc = run_launch(["--nproc_per_node=2", str(script)], timeout=240, extra_env={"DISTTUNE_TRACEBACK": "1"})
    assert proc.returncode == 1, describe(proc)
    assert proc.stderr.count("Traceback (most recent call last)") >= 2, describe(proc)  # the ranks' and torchrun's
    assert "ranks disagree on what to tune" in proc.stderr and "ChildFailedError" in proc.stderr


@pytest.mark.slow
def test_under_bare_torchrun_disttunes_part_is_one_line(script):
    """torchrun's own failure report follows (scripts/launch.sh makes it one line); the ranks say theirs once."""
    proc = run_command([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        str(script)], timeout=240)
    assert proc.returncode != 0, describe(proc)
    line = one_error_line(proc)
    assert line.startswith("disttune: ranks 0, 1: TuningError: "), describe(proc)
    assert not any(text.startswith("[rank") for text in proc.stderr.splitlines()), "no rank's traceback"


@mpi
@pytest.mark.slow
def test_under_mpiexec_a_disttune_error_is_one_line(script):
    proc = run_launch(["--mpi", "-n", "2", str(script)], timeout=240)
    assert proc.returncode != 0, describe(proc)
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("launch.sh: no GPU here")]
    assert len(lines) == 1 and lines[0].startswith("disttune: ranks 0, 1: TuningError: "), describe(proc)


@pytest.mark.slow
def test_a_rank_that_times_out_alone_is_the_one_named(script):
    """Rank 1 never reaches the tuner: rank 0's timeout is the job's one line, naming rank 0 alone."""
    proc = run_launch(["--nproc_per_node=2", str(script)], timeout=240,
                      extra_env={"STALL": "1", "DISTTUNE_TIMEOUT": "3"})
    assert proc.returncode == 1, describe(proc)
    line = one_error_line(proc)
    assert line.startswith("disttune: rank 0: CollectiveTimeout: ") and "rank(s) [1]" in line, describe(proc)
    assert "then torchrun stopped rank 1" in proc.stderr, describe(proc)


def test_a_bad_setting_is_one_line_from_a_plain_script_and_once_per_job_under_the_launcher(script):
    plain = run_python([str(script)], timeout=120, extra_env={"DISTTUNE_TIMEOUT": "abc"})
    assert plain.returncode == 1, describe(plain)
    assert plain.stderr.strip().splitlines() == [
        "disttune: DistEnvError: DISTTUNE_TIMEOUT='abc' is not a number of seconds; e.g. export DISTTUNE_TIMEOUT=300 "
        "(DISTTUNE_TRACEBACK=1 prints the traceback)"], describe(plain)
    launched = run_launch(["--nproc_per_node=2", str(script)], timeout=240, extra_env={"DISTTUNE_TIMEOUT": "abc"})
    assert launched.returncode == 1, describe(launched)
    line = one_error_line(launched)
    assert line.startswith("disttune: DistEnvError: DISTTUNE_TIMEOUT='abc'"), describe(launched)


def test_other_errors_keep_their_traceback_and_a_misspelled_setting_is_named_once(script):
    proc = run_launch(["--nproc_per_node=2", str(script)], timeout=240,
                      extra_env={"RAISE": "1", "DISTTUNE_TIMOUT": "30"})
    assert proc.returncode == 1, describe(proc)
    assert proc.stderr.count("ValueError: not disttune's") == 2, describe(proc)  # each rank's traceback, as ever
    assert proc.stderr.count("Traceback (most recent call last)") == 2, describe(proc)
    warnings = [line for line in proc.stderr.splitlines() if "DISTTUNE_TIMOUT" in line]
    assert warnings == ["disttune: warning: DISTTUNE_TIMOUT is not a disttune setting (did you mean "
                        "DISTTUNE_TIMEOUT?)"], describe(proc)


def settled(monkeypatch, texts: dict[int, str], world: int, late: dict[int, float] | None = None
            ) -> dict[int, list[str]]:
    """What each rank of ``texts`` prints when they end at once (``late``: seconds a rank ends after the others),
    each a thread with its own client of one real TCPStore."""
    import datetime
    import threading
    import time

    import torch.distributed as dist

    from disttune import startup

    monkeypatch.setattr(startup, "SETTLE_S", 1.5)  # room for the threads to connect on a busy host
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
    printed: dict[int, list[str]] = {}

    def rank(r: int) -> None:
        time.sleep((late or {}).get(r, 0.0))
        client = dist.TCPStore("127.0.0.1", server.port, 1, False, timeout=datetime.timedelta(seconds=30))
        printed[r] = startup.settle(client, r, world, texts[r])

    threads = [threading.Thread(target=rank, args=(r,)) for r in texts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads), "settling must end"
    return printed


def test_the_lowest_rank_that_failed_prints_each_distinct_line_once_with_its_ranks(monkeypatch):
    hint = " (DISTTUNE_TRACEBACK=1 prints the traceback)"
    printed = settled(monkeypatch, {0: "TuningError: A", 1: "TuningError: A", 2: "CollectiveTimeout: B"}, 3)
    assert printed == {0: ["disttune: ranks 0, 1: TuningError: A" + hint, "disttune: rank 2: CollectiveTimeout: B" + hint],
                       1: [], 2: []}
    printed = settled(monkeypatch, {1: "TuningError: A", 2: "TuningError: A"}, 3)  # rank 0 carries on elsewhere
    assert printed == {1: ["disttune: ranks 1, 2: TuningError: A" + hint], 2: []}
    printed = settled(monkeypatch, {0: "TuningError: A", 1: "TuningError: C"}, 2, late={1: 3.5})
    assert printed == {0: ["disttune: rank 0: TuningError: A" + hint], 1: ["disttune: rank 1: TuningError: C" + hint]}
