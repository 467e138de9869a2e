"""``disttune verify``: stored or pinned winners timed again in place, compared with their recorded times."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from disttune import store, verify
from disttune.cli import main
from disttune.report import build_report
from helpers import describe, run_command, run_launch
from tiny_kernels import DEV, TableTimer, make_kernel, tuned_step

STEP = Path(__file__).with_name("verify_step.py")
KERNEL = "tiny_kernels.add_block"


@pytest.mark.slow
def test_two_ranks_pass_then_a_slower_winner_fails_naming_site_config_and_times(tmp_path):
    paths = {"DISTTUNE_CACHE_DIR": str(tmp_path / "store"), "DISTTUNE_LOG_DIR": str(tmp_path / "logs")}
    tuned = run_launch(["--nproc_per_node=2", str(STEP)], timeout=180, extra_env=paths)
    assert tuned.returncode == 0, describe(tuned)
    # the tuning's diagnostics, merged over both ranks: rank 1 is 10 % slower, its samples are steady
    report = build_report(tmp_path / "logs").markdown_path.read_text()
    assert "spread across ranks 10.0 %; across samples 0.0 %" in report
    assert "the winner is ahead of the runner-up config 0" in report

    def verify_run(slowdown: str):
        return run_command([sys.executable, "-m", "disttune", "verify", "--nproc", "2", "--threshold", "0.2",
                            "--cache-dir", paths["DISTTUNE_CACHE_DIR"], "--log-dir", str(tmp_path / "verify-logs"),
                            str(STEP), slowdown], timeout=180)

    same = verify_run("1.1")  # 10 % slower: inside the 20 % threshold
    assert same.returncode == 0, describe(same)
    assert "all 1 winner(s) within their threshold" in same.stdout
    assert "1.2100 ms now, 1.1000 ms recorded (+10.0 %, threshold 20 %): ok" in same.stdout  # rank 1's (max)

    slower = verify_run("1.5")
    assert slower.returncode == 1, describe(slower)
    assert f"{KERNEL} key=" in slower.stderr and "{BLOCK=32 w1 s3}" in slower.stderr
    assert "1.6500 ms now, 1.1000 ms recorded (+50.0 %, threshold 20 %): REGRESSED" in slower.stderr
    assert "1 of 1 winner(s) regressed" in slower.stderr
    # the earlier, passing verification in the same log directory is not counted again
    assert "ok" not in slower.stderr.replace("REGRESSED", "")


def test_pinned_winners_in_one_process_and_the_logs_only_check(tmp_path, monkeypatch, capsys):
    times = {0: 2.0, 1: 1.0, 2: 3.0}
    kernel = make_kernel()
    step = tuned_step(kernel, TableTimer(lambda i: times[i.config_index]), n_repeat=2, log_dir=tmp_path / "logs",
                      cache_dir=tmp_path / "store")
    step(torch.randn(64, device=DEV))
    store.export_table(tmp_path / "winners.json", tmp_path / "store")

    monkeypatch.setenv(verify.VERIFY, "0.05")
    times[1] = 1.2
    timer = TableTimer(lambda i: times[i.config_index])
    pinned = tuned_step(make_kernel(), timer, n_repeat=2, log_dir=tmp_path / "verify-logs",
                        pinned=tmp_path / "winners.json", store=False)
    pinned(torch.randn(64, device=DEV))
    assert sorted({i.config_index for i in timer.seen}) == [1], "only the pinned winner is timed"
    assert pinned.report.function_runs == 1 + 3 + 1  # discovery, 1 warm-up + 2 timed, final
    assert main(["verify", "--logs", str(tmp_path / "verify-logs")]) == 1
    err = capsys.readouterr().err
    assert "1.2000 ms now, 1.0000 ms recorded (+20.0 %, threshold 5 %): REGRESSED" in err


def test_nothing_verified_is_a_failure_and_a_bad_threshold_a_clear_error(tmp_path, monkeypatch, capsys):
    step = tuned_step(make_kernel(), TableTimer(lambda i: 1.0), log_dir=tmp_path / "logs", store=False)
    monkeypatch.setenv(verify.VERIFY, "0.1")
    step(torch.randn(64, device=DEV))  # nothing stored: it tunes, nothing to verify
    assert main(["verify", "--logs", str(tmp_path / "logs")]) == 1
    assert "nothing was verified" in capsys.readouterr().err
    monkeypatch.setenv(verify.VERIFY, "ten percent")
    with pytest.raises(ValueError, match="DISTTUNE_VERIFY must be a threshold"):
        tuned_step(make_kernel(), TableTimer(lambda i: 1.0), log_dir=tmp_path / "logs", store=False)(
            torch.randn(64, device=DEV))
