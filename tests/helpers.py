"""Subprocess helpers for tests that launch real multi-process jobs.

Every helper runs its command in a process group of its own (``setsid``) and, on timeout, kills the whole
process group (launcher *and* its workers), then raises :class:`CommandTimeout`
with the output so far, so a hung collective fails the test instead of the run.

Typical use::

    from helpers import run_launch, write_script, rank_lines

    script = write_script(tmp_path, '''
        from disttune.dist import init
        info = init()
        print(f"rank {info.rank} world {info.world_size}", flush=True)
    ''')
    proc = run_launch(["--nproc_per_node=2", str(script)], timeout=120)
    assert proc.returncode == 0, describe(proc)

A case file of the multi-rank harness (``rank_cases``) is launched with :func:`run_cases`,
which returns each rank's record per case::

    records = run_cases(REPO_ROOT / "tests" / "dist_cases.py", ["agree_max"], tmp_path, world=2, timeout=240)
    for record in records["agree_max"]:
        assert record["ok"], failure(record)
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
LAUNCH_SH = REPO_ROOT / "scripts" / "launch.sh"
DEFAULT_TIMEOUT_S = 120.0

# Variables a launcher sets. Scrubbed from children so that a test run under
# torchrun/mpiexec (or a shell with MASTER_PORT exported) starts clean jobs.
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                  "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
_LAUNCHER_PREFIXES = ("OMPI_", "PMI_", "PMIX_", "HYDRA_", "TORCHELASTIC_")


class CommandTimeout(subprocess.TimeoutExpired):
    """A command ran past its timeout; its process group was killed. ``str()`` shows the output."""

    def __str__(self) -> str:
        def tail(text: str | bytes | None) -> str:
            if isinstance(text, bytes):
                text = text.decode(errors="replace")
            return (text or "")[-4000:]

        return (
            f"command timed out after {self.timeout} s (process group killed): {self.cmd!r}\n"
            f"--- stdout (tail) ---\n{tail(self.output)}\n--- stderr (tail) ---\n{tail(self.stderr)}"
        )


def repo_env(extra: Mapping[str, str] | None = None, scrub_launcher: bool = True) -> dict[str, str]:
    """``os.environ`` plus PYTHONPATH=<repo root>:..., TRITON_INTERPRET=1 without a GPU, unbuffered output.

    ``PYTHON`` is set to this interpreter so ``scripts/launch.sh`` runs the same one.
    ``extra`` is applied last (a value of ``""`` still sets the variable).
    """
    env = dict(os.environ)
    if scrub_launcher:
        for name in list(env):
            if name in _LAUNCHER_VARS or name.startswith(_LAUNCHER_PREFIXES):
                del env[name]
    old = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + old if old else "")
    if not _cuda_available():
        env["TRITON_INTERPRET"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("PYTHON", sys.executable)
    env.setdefault("OMP_NUM_THREADS", "1")
    if extra:
        env.update(extra)
    return env


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def run_command(
    cmd: Sequence[str],
    timeout: float = DEFAULT_TIMEOUT_S,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    extra_env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` (text output captured) in its own process group, killed as a whole on timeout.

    ``env`` defaults to :func:`repo_env` (``extra_env`` added); ``cwd`` to the repo root.
    Never raises on a non-zero exit: check ``returncode`` (see :func:`describe`).
    """
    cmd = [str(c) for c in cmd]
    if env is None:
        env = repo_env(extra_env)
    elif extra_env:
        env = {**env, **extra_env}
    proc = subprocess.Popen(
        cmd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(env),
        cwd=str(cwd or REPO_ROOT),
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _terminate_tree(proc)
        try:
            stdout, stderr = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:  # a survivor still holds the pipes: stop reading
            stdout, stderr = "", "(output lost: a child kept the pipes open after SIGKILL)"
        raise CommandTimeout(cmd, timeout, output=stdout, stderr=stderr) from None
    except BaseException:  # e.g. KeyboardInterrupt: leave nothing behind
        _terminate_tree(proc, grace_s=0.0)
        raise
    _kill_group(proc.pid, signal.SIGKILL)  # stray members of our group, if any
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def _children_by_parent() -> dict[int, list[int]]:
    """Linux: parent pid -> child pids, from /proc (empty elsewhere)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            stat = entry.read_text()
        except OSError:
            continue
        # pid (comm) state ppid ...; comm may contain spaces and parentheses
        fields = stat[stat.rindex(")") + 2 :].split()
        children.setdefault(int(fields[1]), []).append(int(entry.parent.name))
    return children


def _descendants(pid: int) -> list[int]:
    tree = _children_by_parent()
    found, todo = [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _kill_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _terminate_tree(proc: subprocess.Popen[str], grace_s: float = 5.0) -> None:
    """SIGTERM the command's group and every descendant, then SIGKILL what is left.

    Descendants matter: torchrun starts each worker in a process group of its own, so
    killing our process group alone would leave workers holding ports and pipes.
    """
    pids = _descendants(proc.pid)
    _signal_all(proc.pid, pids, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    _signal_all(proc.pid, sorted(set(pids) | set(_descendants(proc.pid))), signal.SIGKILL)


def _signal_all(pgid: int, pids: Sequence[int], sig: signal.Signals) -> None:
    """Send ``sig`` to process group ``pgid`` and to each of ``pids`` (gone ones are skipped)."""
    _kill_group(pgid, sig)
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def run_launch(
    args: list[str],
    timeout: float = DEFAULT_TIMEOUT_S,
    extra_env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``bash scripts/launch.sh *args`` with :func:`repo_env`; a hang past ``timeout`` raises."""
    return run_command(["bash", str(LAUNCH_SH), *args], timeout=timeout, extra_env=extra_env)


def run_python(
    args: list[str],
    timeout: float = DEFAULT_TIMEOUT_S,
    extra_env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``<this python> *args`` plainly (no launcher), with :func:`repo_env`."""
    return run_command([sys.executable, *args], timeout=timeout, extra_env=extra_env)


def mpiexec_flags() -> list[str]:
    """Extra flags the local mpiexec needs to run as root / oversubscribed (Open MPI only)."""
    exe = shutil.which("mpiexec")
    if exe is None:
        return []
    try:
        version = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    if "Open MPI" in version or "OpenRTE" in version:
        flags = ["--allow-run-as-root", "--oversubscribe"]
        if not os.environ.get("OMPI_MCA_plm_rsh_agent") and not (shutil.which("ssh") or shutil.which("rsh")):
            flags += ["--mca", "plm_rsh_agent", "false"]  # as scripts/launch.sh: no ssh in containers
        return flags
    return []


def spawn_ranks(world: int, args: list[str], timeout: float, extra_env: Mapping[str, str] | None = None,
                env: Mapping[str, str] | None = None) -> list[subprocess.CompletedProcess[str]]:
    """Start ``world`` ranks of ``<this python> *args`` by hand, with torchrun's variables and a free port.

    No supervisor: when one rank dies the others go on (torchrun would kill them), and the launch costs
    no agent process. ``env`` defaults to :func:`repo_env` (``extra_env`` added). Past ``timeout`` every
    rank is killed and :class:`CommandTimeout` raised.
    """
    import socket
    import time

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    base = dict(env) if env is not None else repo_env()
    procs = []
    for rank in range(world):
        rank_env = {**base, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                    "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                    **(extra_env or {})}
        procs.append(subprocess.Popen([sys.executable, *args], env=rank_env, cwd=REPO_ROOT, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    deadline = time.monotonic() + timeout
    results = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            raise CommandTimeout(proc.args, timeout) from None
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return results


def run_mpiexec(
    nprocs: int,
    args: list[str],
    timeout: float = DEFAULT_TIMEOUT_S,
    extra_env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``mpiexec -n nprocs <this python> *args`` directly (not through launch.sh)."""
    exe = shutil.which("mpiexec")
    if exe is None:
        raise RuntimeError("mpiexec is not on PATH (decorate the test with helpers.requires_mpi)")
    return run_command([exe, *mpiexec_flags(), "-n", str(nprocs), sys.executable, *args],
                       timeout=timeout, extra_env=extra_env)


def run_cases(case_file: str | os.PathLike[str], cases: Sequence[str], out: Path, world: int = 2, *,
              mpi: bool = False, args: Sequence[str] = (), timeout: float = DEFAULT_TIMEOUT_S,
              extra_env: Mapping[str, str] | None = None) -> dict[str, list[dict]]:
    """Launch ``case_file``'s ``cases`` on ``world`` ranks and return ``{case: [rank 0's record, ...]}``.

    Runs ``scripts/launch.sh`` (torchrun, or mpiexec with ``mpi=True``) with ``--out out`` and
    the file's own ``args``; records are those of ``rank_cases`` (``ok``, ``error_type``,
    ``error_message``, ``traceback`` and the case's fields). A run past ``timeout`` raises
    :class:`CommandTimeout` with the ranks' output; a failed launch or a missing record fails
    the test with it. Costs one launch: a few seconds of imports per rank, then the cases.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    launcher = ["--mpi", "-n", str(world)] if mpi else [f"--nproc_per_node={world}"]
    mpi_flag = ["--mpi"] if mpi else []
    proc = run_launch([*launcher, str(case_file), *cases, "--out", str(out), *mpi_flag, *args], timeout=timeout,
                      extra_env=extra_env)
    assert proc.returncode == 0, describe(proc)
    return read_records(out, cases, range(world), proc)


def read_records(out: Path, cases: Sequence[str], ranks: Iterable[int],
                 proc: subprocess.CompletedProcess[str] | None = None) -> dict[str, list[dict]]:
    """``{case: [record of each of ranks]}`` from ``out``; a missing record fails with ``proc``'s output."""
    records = {}
    for case in cases:
        per_rank = []
        for rank in ranks:
            path = Path(out) / f"{case}.rank{rank}.json"
            assert path.exists(), f"rank {rank} wrote no record for {case}\n" + (describe(proc) if proc else "")
            per_rank.append(json.loads(path.read_text()))
        records[case] = per_rank
    return records


def checks_per_rank(records: dict[str, list[dict]]) -> list[int]:
    """Assert every case passed on every rank; return each rank's ``checks`` summed over the cases."""
    for per_rank in records.values():
        for record in per_rank:
            assert record["ok"], failure(record)
    return [sum(r["checks"] for r in rank_records) for rank_records in zip(*records.values())]


def failure(record: dict) -> str:
    """A failed record as an assertion message: case, rank, error and traceback."""
    return (f"{record['case']} on rank {record['rank']}: {record.get('error_type')}: {record.get('error_message')}\n"
            f"{record.get('traceback', '')}")


def write_script(tmp_path: Path, source: str, name: str = "script.py") -> Path:
    """Write ``source`` (dedented) to ``tmp_path / name`` and return the path."""
    path = Path(tmp_path) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source).lstrip("\n"))
    return path


def describe(proc: subprocess.CompletedProcess[str], limit: int = 6000) -> str:
    """Command, exit code and output tails: the message to attach to a failed assert."""
    return (
        f"command: {proc.args!r}\nexit code: {proc.returncode}\n"
        f"--- stdout ---\n{(proc.stdout or '')[-limit:]}\n--- stderr ---\n{(proc.stderr or '')[-limit:]}"
    )


def rank_lines(output: str, pattern: str) -> dict[int, re.Match[str]]:
    """Matches of ``pattern`` (a regex with a named group ``rank``) in ``output``, by rank.

    Searches the whole text rather than splitting lines, since output from several
    ranks sharing one pipe may interleave. A rank matching twice keeps its last match.
    """
    return {int(m.group("rank")): m for m in re.finditer(pattern, output)}


def mpi_missing_reason() -> str | None:
    """Why MPI tests cannot run here, or ``None`` when mpiexec and mpi4py are both present."""
    if shutil.which("mpiexec") is None:
        return "mpiexec not found on PATH (pip install mpich, or install Open MPI)"
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed (pip install mpi4py)"
    return None


_MPI_REASON = mpi_missing_reason()
if _MPI_REASON and os.environ.get("DISTTUNE_REQUIRE_MPI") == "1":  # CI: a missing MPI is a failure, not a skip
    raise RuntimeError(f"DISTTUNE_REQUIRE_MPI=1 but MPI tests cannot run: {_MPI_REASON}")

#: Decorator for tests that need mpiexec and mpi4py: marks them ``mpi`` and skips with the reason.
requires_mpi = pytest.mark.skipif(_MPI_REASON is not None, reason=_MPI_REASON or "")


def mpi(test):  # type: ignore[no-untyped-def]
    """``@mpi``: both the ``mpi`` marker and the skip when MPI is absent."""
    return pytest.mark.mpi(requires_mpi(test))
