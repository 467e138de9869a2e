"""The disttune command: demo end to end on 2 CPU ranks, store subcommands, report errors."""

from __future__ import annotations

import json
import sys

import pytest
import torch

import disttune
from disttune.cli import build_parser, main
from helpers import describe, run_command
from tiny_kernels import TableTimer, device, launch_add, make_kernel


@pytest.mark.parametrize("command", ["demo", "report", "show", "export", "import", "clear"])
def test_every_subcommand_has_help(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([command, "--help"])
    assert exit_info.value.code == 0 and "usage: disttune" in capsys.readouterr().out


def test_demo_runs_two_ranks_and_writes_logs_and_report(tmp_path):
    proc = run_command([sys.executable, "-m", "disttune", "demo", "--nproc", "2", "--log-dir", str(tmp_path / "logs")],
                       timeout=300, extra_env={"DISTTUNE_CACHE_DIR": str(tmp_path / "store")})
    assert proc.returncode == 0, describe(proc)
    assert "correct on every rank: True" in proc.stdout and "<- winner" in proc.stdout, describe(proc)
    assert (tmp_path / "logs" / "rank-0.log").exists() and (tmp_path / "logs" / "rank-1.log").exists()
    report_line = [line for line in proc.stdout.splitlines() if line.startswith("report: ")]
    assert report_line, describe(proc)
    report = report_line[0].split("report: ", 1)[1].split(" (")[0]
    assert "_matmul_body" in open(report).read()


def test_unknown_demo_is_a_clear_error(capsys):
    assert main(["demo", "--kernel", "nope"]) == 2
    assert "there is no 'nope' demo; available: ag_gemm, tp_mlp" in capsys.readouterr().err


def test_store_subcommands_round_trip(tmp_path, capsys):
    kernel = make_kernel()
    x = torch.randn(64, device=device())

    @disttune.contextual_autotune(timer=TableTimer(lambda i: float(3 - i.config_index)), verbose=False,
                                  log_dir=tmp_path / "logs")
    def step():
        launch_add(kernel, x, torch.empty_like(x))

    step()
    capsys.readouterr()
    assert main(["show"]) == 0
    shown = capsys.readouterr().out
    assert "tiny_kernels.add_block key=(64," in shown and "BLOCK: 64" in shown and "world 1" in shown
    table = tmp_path / "winners.json"
    assert main(["export", str(table)]) == 0 and len(json.loads(table.read_text())["entries"]) == 1
    assert main(["clear", "--kernel", "not-this-one"]) == 0 and "removed 0 entries" in capsys.readouterr().out
    assert main(["clear"]) == 0 and "removed 1 entry" in capsys.readouterr().out
    assert main(["show"]) == 0 and "no stored winners" in capsys.readouterr().out
    assert main(["import", str(table)]) == 0 and "imported 1 winner" in capsys.readouterr().out
    assert main(["show"]) == 0 and "tiny_kernels.add_block" in capsys.readouterr().out
    (tmp_path / "bad.json").write_text("[]")
    assert main(["import", str(tmp_path / "bad.json")]) == 1
    assert "not a disttune winners table" in capsys.readouterr().err


def test_report_of_an_empty_directory_is_an_error_not_a_crash(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 1
    assert str(tmp_path) in capsys.readouterr().err
