"""scripts/launch.sh and disttune.dist, end to end: real 2-rank jobs on this machine.

Each job is a subprocess with a timeout (helpers.run_command kills the whole tree),
so a hang fails the test instead of the run. Jobs shared by several tests run once
per module (fixtures) to keep the file fast on a small CPU machine.
"""

from __future__ import annotations

import json
import re
import subprocess

import pytest
import torch

from helpers import (
    describe,
    mpi,
    rank_lines,
    run_launch,
    run_mpiexec,
    run_python,
    write_script,
)

TIMEOUT_S = 120.0

# Arguments that a shell or a launcher could mangle: spaces, quotes, globs, $, empty.
TRICKY_ARGS = ["a b", "c'd", 'e "f"', "$HOME", "*", "--opt=1 2", "", "x\\y"]

ALLREDUCE_SCRIPT = """
    import json, sys
    import torch
    import torch.distributed as dist
    from disttune.dist import init, destroy

    info = init()
    assert init() is info, "a second init() must return the cached info"
    t = torch.tensor([float(info.rank + 1)], device=info.device)
    dist.all_reduce(t)
    line = (f"rank {info.rank} world {info.world_size} sum {int(t.item())} "
            f"backend {info.backend} launcher {info.launcher} "
            f"local {info.local_rank}/{info.local_world_size} argv {json.dumps(sys.argv[1:])}\\n")
    sys.stdout.write(line)  # one write per line: ranks share the pipe
    sys.stdout.flush()
    destroy()
"""

LINE_RE = (
    r"rank (?P<rank>\d+) world (?P<world>\d+) sum (?P<sum>\d+) backend (?P<backend>\S+) "
    r"launcher (?P<launcher>\S+) local (?P<local>\d+)/(?P<local_world>\d+) argv (?P<argv>\[.*\])"
)


def expected_backend(local_ranks: int) -> str:
    """What dist.init must pick: NCCL when each local rank can have its own GPU, gloo otherwise."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return "nccl" if 0 < local_ranks <= gpus else "gloo"


def _check_allreduce(proc: subprocess.CompletedProcess[str], world: int, launcher: str) -> dict[int, re.Match[str]]:
    assert proc.returncode == 0, describe(proc)
    lines = rank_lines(proc.stdout, LINE_RE)
    assert sorted(lines) == list(range(world)), describe(proc)
    expected_sum = world * (world + 1) // 2
    for rank, m in lines.items():
        assert int(m["world"]) == world, describe(proc)
        assert int(m["sum"]) == expected_sum, describe(proc)
        assert m["launcher"] == launcher, describe(proc)
        assert m["backend"] == expected_backend(world), describe(proc)
        assert int(m["local"]) == rank and int(m["local_world"]) == world, describe(proc)
    return lines


@pytest.fixture(scope="module")
def allreduce_script(tmp_path_factory: pytest.TempPathFactory):
    return write_script(tmp_path_factory.mktemp("allreduce"), ALLREDUCE_SCRIPT)


@pytest.fixture(scope="module")
def torchrun_job(allreduce_script) -> subprocess.CompletedProcess[str]:
    return run_launch(["--nproc_per_node=2", str(allreduce_script), *TRICKY_ARGS], timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def mpi_job(allreduce_script) -> subprocess.CompletedProcess[str]:
    return run_launch(["--mpi", "-n", "2", str(allreduce_script), *TRICKY_ARGS], timeout=TIMEOUT_S)


# --------------------------------------------------------------------------- launch.sh


def test_help_exits_zero() -> None:
    proc = run_launch(["--help"], timeout=120)
    assert proc.returncode == 0, describe(proc)
    assert "Usage:" in proc.stdout and "--nproc_per_node" in proc.stdout and "--mpi" in proc.stdout


def test_bad_usage_is_a_clear_error(tmp_path) -> None:
    script = write_script(tmp_path, "print('should not run')\n")
    for args, needle in (
        ([], "no script given"),
        (["--bogus", str(script)], "unknown option '--bogus'"),
        (["--nproc_per_node=zero", str(script)], "positive integer"),
        ([str(tmp_path / "missing.py")], "not found"),
    ):
        proc = run_launch(args, timeout=120)
        assert proc.returncode == 2, describe(proc)
        assert needle in proc.stderr, describe(proc)
        assert "should not run" not in proc.stdout


def test_torchrun_two_ranks_allreduce(torchrun_job) -> None:
    _check_allreduce(torchrun_job, world=2, launcher="torchrun")


def test_torchrun_passes_arguments_intact(torchrun_job) -> None:
    lines = _check_allreduce(torchrun_job, world=2, launcher="torchrun")
    for m in lines.values():
        assert json.loads(m["argv"]) == TRICKY_ARGS, describe(torchrun_job)


@mpi
def test_mpi_two_ranks_allreduce(mpi_job) -> None:
    _check_allreduce(mpi_job, world=2, launcher="mpi")


@mpi
def test_mpi_passes_arguments_intact(mpi_job) -> None:
    lines = _check_allreduce(mpi_job, world=2, launcher="mpi")
    for m in lines.values():
        assert json.loads(m["argv"]) == TRICKY_ARGS, describe(mpi_job)


def test_plain_python_is_a_world_of_one(allreduce_script) -> None:
    proc = run_python([str(allreduce_script), "a b"], timeout=TIMEOUT_S)
    lines = _check_allreduce(proc, world=1, launcher="single")
    assert json.loads(lines[0]["argv"]) == ["a b"]


# --------------------------------------------------------------------------- communicators

MPICOMM_SCRIPT = """
    import json, sys
    from mpi4py import MPI
    from disttune.comm import MpiComm

    comm = MpiComm(MPI.COMM_WORLD, timeout_s=30)
    r = comm.rank
    floats = comm.all_gather_floats([r, 10.0 * r, 0.5], step="floats")
    # Different sizes per rank: rank 1 sends a far larger object.
    mine = {"rank": r, "text": "x" * (10 + 20000 * r), "nested": [1, 2.5, None, {"k": r}]}
    objects = comm.all_gather_objects(mine, step="objects")
    comm.barrier(step="barrier")
    out = {"rank": r, "world": comm.world_size, "floats": floats.tolist(), "shape": list(floats.shape),
           "objects": objects}
    # a file per rank: 40 kB lines from two ranks interleave in a shared pipe (Open MPI forwards 4 kB chunks)
    with open(f"{sys.argv[1]}/result-{r}.json", "w") as handle:
        json.dump(out, handle)
"""


@pytest.mark.slow
@mpi
def test_mpicomm_collectives(tmp_path) -> None:
    script = write_script(tmp_path, MPICOMM_SCRIPT)
    proc = run_mpiexec(2, [str(script), str(tmp_path)], timeout=TIMEOUT_S)
    assert proc.returncode == 0, describe(proc)
    results = {}
    for path in tmp_path.glob("result-*.json"):
        res = json.loads(path.read_text())
        results[res["rank"]] = res
    assert sorted(results) == [0, 1], describe(proc)
    expected_objects = [
        {"rank": r, "text": "x" * (10 + 20000 * r), "nested": [1, 2.5, None, {"k": r}]} for r in range(2)
    ]
    for res in results.values():
        assert res["world"] == 2
        assert res["shape"] == [2, 3]
        assert res["floats"] == [[0.0, 0.0, 0.5], [1.0, 10.0, 0.5]]
        assert res["objects"] == expected_objects


# Rank 1 skips the collective; rank 0 must raise CollectiveTimeout naming the step.
# Rank 1 stays alive (so this is a true timeout, not a dead peer) until rank 0
# writes the flag file; os._exit avoids tearing down a group with a pending op.
TIMEOUT_SCRIPT = """
    import os, sys, time
    from pathlib import Path
    from disttune.comm import CollectiveTimeout

    flag = Path(sys.argv[2])
    if sys.argv[1] == "mpi":
        from mpi4py import MPI
        from disttune.comm import MpiComm
        comm = MpiComm(MPI.COMM_WORLD, timeout_s=2)
    else:
        from disttune.dist import init
        from disttune.comm import TorchComm
        init()
        comm = TorchComm(timeout_s=2)
    comm.barrier(step="warm-up")
    if comm.rank == 0:
        start = time.monotonic()
        try:
            comm.all_gather_floats([1.0], step="gather-timings")
            print("NO TIMEOUT", flush=True)
        except CollectiveTimeout as err:
            elapsed = time.monotonic() - start
            print(f"TIMEOUT after {elapsed:.2f} s: {err}", flush=True)
        flag.write_text("done")
    else:
        deadline = time.monotonic() + 60
        while not flag.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    print(f"rank {comm.rank} done", flush=True)
    if sys.argv[1] != "mpi":
        os._exit(0)
"""


def _check_timeout(proc: subprocess.CompletedProcess[str], names: str) -> None:
    assert "NO TIMEOUT" not in proc.stdout, describe(proc)
    m = re.search(r"TIMEOUT after (?P<elapsed>[\d.]+) s: (?P<msg>.*)", proc.stdout)
    assert m, describe(proc)
    assert "'gather-timings'" in m["msg"], describe(proc)  # the message names the step
    assert names in m["msg"], describe(proc)
    assert 1.5 <= float(m["elapsed"]) < 60.0, describe(proc)  # waited ~timeout_s, then gave up: no hang
    assert "rank 0 done" in proc.stdout and "rank 1 done" in proc.stdout, describe(proc)
    assert proc.returncode == 0, describe(proc)


@pytest.mark.slow
@mpi
def test_mpicomm_timeout_names_the_step(tmp_path) -> None:
    script = write_script(tmp_path, TIMEOUT_SCRIPT)
    proc = run_mpiexec(2, [str(script), "mpi", str(tmp_path / "flag")], timeout=TIMEOUT_S)
    _check_timeout(proc, "rank 0: ")  # MPI cannot tell who is missing: the waiting rank is named


@pytest.mark.slow
def test_torchcomm_timeout_names_the_step_and_the_missing_rank(tmp_path) -> None:
    script = write_script(tmp_path, TIMEOUT_SCRIPT)
    proc = run_launch(["--nproc_per_node", "2", str(script), "torch", str(tmp_path / "flag")], timeout=TIMEOUT_S)
    _check_timeout(proc, "rank(s) [1] did not arrive")  # the rendezvous store tells who is missing
