"""disttune.env: the one reader of DISTTUNE_* settings and launcher variables.

Launchers are told apart by their variables (torchrun, Open MPI, MPICH/Hydra, PMIx, Slurm's srun),
and every bad value is one clear error that names the variable.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest

from disttune import env


def test_env_errors_name_the_variable(monkeypatch) -> None:
    cases = [
        ({"RANK": "0"}, "WORLD_SIZE"),
        ({"WORLD_SIZE": "2"}, "RANK"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "not an integer"),
        ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "[0, world size)"),
        ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "29500"}, "MASTER_ADDR"),
        ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, "MASTER_PORT"),
        ({"PMI_RANK": "abc", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}, "PMI_RANK"),
    ]
    for variables, needle in cases:
        with pytest.raises(env.DistEnvError, match=re.escape(needle)):
            env.detect(variables)
    monkeypatch.setenv("DISTTUNE_TIMEOUT", "soon")
    with pytest.raises(env.DistEnvError, match="DISTTUNE_TIMEOUT"):
        env.timeout_s(None)
    monkeypatch.setenv("DISTTUNE_TIMEOUT", "7.5")
    assert env.timeout_s(None) == 7.5
    assert env.timeout_s(3) == 3.0


def test_env_detection() -> None:
    tr = env.detect({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                       "MASTER_ADDR": "node0", "MASTER_PORT": "29501"})
    assert (tr.launcher, tr.rank, tr.world_size, tr.local_rank, tr.local_world_size) == ("torchrun", 3, 8, 1, 2)
    assert (tr.master_addr, tr.master_port) == ("node0", 29501)
    ompi = env.detect({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "6",
                         "OMPI_COMM_WORLD_LOCAL_RANK": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "3"})
    assert (ompi.launcher, ompi.rank, ompi.world_size, ompi.local_rank, ompi.local_world_size) == ("mpi", 5, 6, 2, 3)
    hydra = env.detect({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"})
    assert (hydra.launcher, hydra.rank, hydra.world_size, hydra.local_rank) == ("mpi", 1, 2, 1)
    assert hydra.master_addr is None and hydra.master_port is None
    single = env.detect({})
    assert (single.launcher, single.rank, single.world_size) == ("single", 0, 1)


@pytest.mark.parametrize("variables, expected", [
    ({"RANK": "3", "WORLD_SIZE": "8"}, (3, 8)),
    ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "6"}, (5, 6)),
    ({"PMI_RANK": "1", "PMI_SIZE": "2"}, (1, 2)),
    ({"SLURM_PROCID": "2", "SLURM_STEP_NUM_TASKS": "4"}, (2, 4)),  # no local size: detect() would ask MPI
    ({"SLURM_PROCID": "2"}, (0, 1)),  # a batch script's own shell
    ({"RANK": "x", "WORLD_SIZE": "2"}, (0, 1)),
])
def test_the_launchers_rank_is_read_without_starting_anything(variables, expected):
    assert env.launcher_rank(variables) == expected


@pytest.mark.parametrize("raw", ["0", "-5", "soon", "nan", "inf"])
def test_a_bad_timeout_in_the_environment_is_a_value_error_never_the_default(monkeypatch, raw):
    monkeypatch.setenv("DISTTUNE_TIMEOUT", raw)
    with pytest.raises(ValueError, match="DISTTUNE_TIMEOUT"):
        env.timeout_s()


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), "30", True])
def test_a_bad_timeout_argument_is_a_value_error(value):
    with pytest.raises(ValueError, match="timeout_s must be a positive number"):
        env.timeout_s(value)


def test_timeout_defaults_to_300_seconds_and_an_explicit_value_wins(monkeypatch):
    monkeypatch.delenv("DISTTUNE_TIMEOUT", raising=False)
    assert env.timeout_s() == env.DEFAULT_TIMEOUT_S == 300.0
    monkeypatch.setenv("DISTTUNE_TIMEOUT", " ")
    assert env.timeout_s() == 300.0, "an empty variable means unset"
    monkeypatch.setenv("DISTTUNE_TIMEOUT", "12")
    assert env.timeout_s(4) == 4.0 and env.timeout_s() == 12.0


def test_both_tuners_reject_a_zero_timeout(monkeypatch):
    """A bad DISTTUNE_TIMEOUT is raised by the first tuning call's consensus (on every rank alike, not only on
    the rank that has it); a bad timeout_s argument at once."""
    import disttune

    monkeypatch.setenv("DISTTUNE_TIMEOUT", "0")
    step = disttune.contextual_autotune(verbose=False)(lambda: None)
    with pytest.raises(disttune.TuningError, match=r"DistEnvError: .*\(DISTTUNE_TIMEOUT\)"):
        step()
    pick = disttune.autotune([{"a": 1}, {"a": 2}], key_fn=lambda: 0)(lambda *, a: a)
    with pytest.raises(disttune.TuningError, match=r"DistEnvError: .*\(DISTTUNE_TIMEOUT\)"):
        pick()
    monkeypatch.delenv("DISTTUNE_TIMEOUT")
    with pytest.raises(ValueError, match="timeout_s must be a positive"):
        disttune.autotune([{"a": 1}], key_fn=lambda: 0, timeout_s=0)(lambda *, a: a)


@pytest.mark.parametrize("variables, local", [
    ({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}, (1, 4)),
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "3"}, (2, 3)),
    ({"MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}, (0, 2)),
    ({"PMIX_LOCAL_RANK": "3", "PMIX_LOCAL_SIZE": "8"}, (3, 8)),
    ({"SLURM_LOCALID": "1", "SLURM_STEP_TASKS_PER_NODE": "4,2(x2)", "SLURM_NODEID": "2"}, (1, 2)),
    ({}, (7, 1)),
])
def test_local_rank_and_size_of_every_launcher(variables, local):
    assert (env.local_rank(default=7, environ=variables), env.local_world_size(environ=variables)) == local


def test_slurm_srun_is_detected_but_a_batch_shell_is_not():
    srun = env.detect({"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "1",
                       "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_NODEID": "1"})
    assert (srun.launcher, srun.rank, srun.world_size, srun.local_rank, srun.local_world_size) == ("mpi", 3, 4, 1, 2)
    assert srun.source == "Slurm (srun)"
    batch = env.detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "4"})  # the batch script's own shell
    assert (batch.launcher, batch.world_size) == ("single", 1)


def test_interpreter_flag_follows_triton(monkeypatch):
    import torch
    from triton import knobs

    assert env.interpreting() == (not torch.cuda.is_available()), "conftest interprets where there is no GPU"
    monkeypatch.setattr(knobs.runtime, "interpret", True)
    assert env.interpreting()

    monkeypatch.setattr(knobs.runtime, "interpret", False)
    assert not env.interpreting()


def test_log_dir_comes_from_the_environment_and_an_argument_wins(monkeypatch, tmp_path):
    from disttune.logs import RankLog, resolve_log_dir

    monkeypatch.setenv("DISTTUNE_LOG_DIR", str(tmp_path / "from-env"))
    assert env.log_dir() == str(tmp_path / "from-env")
    assert resolve_log_dir(None) == tmp_path / "from-env"
    assert resolve_log_dir(tmp_path / "given") == tmp_path / "given"
    assert RankLog(None, 3).path == tmp_path / "from-env" / "rank-3.log"
    for unset in ("", None):
        if unset is None:
            monkeypatch.delenv("DISTTUNE_LOG_DIR")
        else:
            monkeypatch.setenv("DISTTUNE_LOG_DIR", unset)
        assert env.log_dir() is None and resolve_log_dir(None) == Path("logs"), f"{unset!r} means unset"


def test_a_child_environment_sends_its_logs_where_asked(monkeypatch, tmp_path):
    parent = {"PATH": "/bin", "DISTTUNE_LOG_DIR": "old"}
    assert env.environ_with_log_dir(tmp_path, parent) == {"PATH": "/bin", "DISTTUNE_LOG_DIR": str(tmp_path)}
    assert parent["DISTTUNE_LOG_DIR"] == "old", "the parent's mapping is left alone"
    monkeypatch.setenv("DISTTUNE_MARKER", "kept")
    child = env.environ_with_log_dir(tmp_path / "child")
    assert child["DISTTUNE_MARKER"] == "kept" and child["DISTTUNE_LOG_DIR"] == str(tmp_path / "child")
    assert os.environ["DISTTUNE_LOG_DIR"] != child["DISTTUNE_LOG_DIR"], "this process's environment is left alone"


def _write_one_tuning(log_dir: Path) -> None:
    from disttune.logs import RankLog

    log = RankLog(log_dir, 0, "step")
    for index, ms in enumerate((2.0, 1.0)):
        log.config_result("add_kernel", (64,), 0, index, f"BLOCK: {64 << index}", [ms], ms, None)
    log.winner("add_kernel", (64,), 0, 1, "BLOCK: 128", 1.0, "tuned")
    log.tuning("step", 0.1, 5, 1, 1, "max", "median")
    log.flush()


def test_the_report_command_finds_the_logs_where_the_tuner_writes_them(monkeypatch, tmp_path, capsys):
    from disttune.cli import main

    _write_one_tuning(tmp_path / "chosen")
    monkeypatch.setenv("DISTTUNE_LOG_DIR", str(tmp_path / "chosen"))
    assert main(["report"]) == 0, capsys.readouterr().err
    assert f"report: {tmp_path / 'chosen' / 'report' / 'report.md'}" in capsys.readouterr().out
    monkeypatch.setenv("DISTTUNE_LOG_DIR", "")  # unset, as for the tuner: ./logs
    monkeypatch.chdir(tmp_path)
    assert main(["report"]) == 1
    assert "'logs' does not exist" in capsys.readouterr().err


def test_the_demo_sends_its_ranks_logs_to_the_log_dir(monkeypatch, tmp_path):
    import disttune.cli

    launched = []
    monkeypatch.setattr(disttune.cli, "sizes_problem", lambda example, argv, world, parser: None)
    monkeypatch.setattr(disttune.cli, "launch_demo", lambda command, env: launched.append(env) or 3)
    monkeypatch.setenv("DISTTUNE_LOG_DIR", str(tmp_path / "from-env"))
    assert disttune.cli.main(["demo"]) == 3
    monkeypatch.chdir(tmp_path)
    assert disttune.cli.main(["demo", "--log-dir", "given"]) == 3
    expected = [str((tmp_path / "from-env").resolve()), str((tmp_path / "given").resolve())]
    assert [child["DISTTUNE_LOG_DIR"] for child in launched] == expected


def test_the_store_falls_back_on_the_xdg_cache_root_without_platformdirs(monkeypatch, tmp_path):
    from disttune import store

    monkeypatch.setitem(sys.modules, "platformdirs", None)  # import platformdirs now raises ImportError
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert store.default_cache_dir() == tmp_path / "xdg" / "disttune"
    monkeypatch.setenv("XDG_CACHE_HOME", "")
    assert store.default_cache_dir() == Path.home() / ".cache" / "disttune"


def test_detect_reads_this_processs_environment_by_default(monkeypatch):
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                        "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    launch = env.detect()
    assert (launch.launcher, launch.rank, launch.world_size, launch.master_port) == ("torchrun", 1, 2, 29500)


def _reads_the_environment(tree: ast.AST) -> list[int]:
    """Lines that touch ``os.environ`` / ``os.getenv`` (or import them from ``os``)."""
    names = {"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"}
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "os":
            if node.attr in names:
                lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            if any(alias.name in names for alias in node.names):
                lines.append(node.lineno)
    return lines


def test_only_the_env_module_reads_the_environment():
    packages = [Path(env.__file__).parent, Path(importlib.util.find_spec("disttune.kernels").origin).parent]
    readers = {}
    for package in packages:
        for path in sorted(package.glob("*.py")):
            if path != Path(env.__file__):
                lines = _reads_the_environment(ast.parse(path.read_text(encoding="utf-8")))
                if lines:
                    readers[f"{package.name}/{path.name}"] = lines
    assert len(list(packages[0].glob("*.py"))) > 10, "the scan must see the package's modules"
    assert readers == {}, f"read the environment through disttune.env instead: {readers}"
