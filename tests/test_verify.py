"""``disttune verify``: stored or pinned winners timed again in place, compared with their recorded times."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

import disttune
from disttune import store, verify
from disttune.cli import main
from disttune.report import build_report
from helpers import describe, run_command, run_launch
from tiny_kernels import DEV, TableTimer, launch_add, make_kernel, tuned_step

STEP = Path(__file__).with_name("verify_step.py")
KERNEL = "tiny_kernels.add_block"


@pytest.mark.slow
def test_two_ranks_pass_then_a_slower_winner_fails_naming_site_config_and_times(tmp_path):
    paths = {"DISTTUNE_CACHE_DIR": str(tmp_path / "store"), "DISTTUNE_LOG_DIR": str(tmp_path / "logs")}
    tuned = run_launch(["--nproc_per_node=2", str(STEP)], timeout=180, extra_env=paths)
    assert tuned.returncode == 0, describe(tuned)
    # the tuning's diagnostics, merged over both ranks: rank 1 is 10 % slower, its samples are steady
    report = build_report(tmp_path / "logs").markdown_path.read_text()
    assert "rank spread 10.0 %; noise 0.0 %" in report
    assert "the winner is ahead of the runner-up config 0" in report

    def verify_run(slowdown: str, *flags: str):
        return run_command([sys.executable, "-m", "disttune", "verify", "--nproc", "2", "--threshold", "0.2",
                            "--cache-dir", paths["DISTTUNE_CACHE_DIR"], "--log-dir", str(tmp_path / "verify-logs"),
                            *flags, str(STEP), slowdown], timeout=180)

    # the injected timer's times mean something on a CPU: --judge-cpu asks for a verdict on them
    same = verify_run("1.1", "--judge-cpu")  # 10 % slower: inside the 20 % threshold
    assert same.returncode == 0, describe(same)
    assert "all 1 winner(s) within their threshold" in same.stdout
    allowed = "allowed 20.0 %: the threshold 20 % or the noise, if larger"
    assert f"1.2100 ms now, 1.1000 ms recorded (+10.0 %, {allowed}): ok" in same.stdout  # rank 1's (max)

    slower = verify_run("1.5", "--judge-cpu")
    assert slower.returncode == 1, describe(slower)
    assert f"{KERNEL} n=64 dtype=float32 occurrence=0" in slower.stderr and "{BLOCK=32 w1 s3}" in slower.stderr
    assert f"1.6500 ms now, 1.1000 ms recorded (+50.0 %, {allowed}): REGRESSED" in slower.stderr
    assert "1 of 1 winner(s) regressed" in slower.stderr
    # the earlier, passing verification in the same log directory is not counted again
    assert "ok" not in slower.stderr.replace("REGRESSED", "")

    unjudged = verify_run("1.5")  # a CPU's timings, not asked to judge them: reported, not a regression
    assert unjudged.returncode == 0, describe(unjudged)
    assert "+50.0 %" in unjudged.stdout and "slower, but timings on a CPU cannot show a regression" in unjudged.stdout


def test_pinned_winners_in_one_process_and_the_logs_only_check(tmp_path, monkeypatch, capsys):
    times = {0: 2.0, 1: 1.0, 2: 3.0}
    kernel = make_kernel()
    step = tuned_step(kernel, TableTimer(lambda i: times[i.config_index]), n_repeat=2, log_dir=tmp_path / "logs",
                      cache_dir=tmp_path / "store")
    step(torch.randn(64, device=DEV))
    store.export_table(tmp_path / "winners.json", tmp_path / "store")

    monkeypatch.setenv(verify.VERIFY, "0.05")
    monkeypatch.setenv("DISTTUNE_VERIFY_CPU", "1")  # the injected times are meant: judge them
    times[1] = 1.2
    timer = TableTimer(lambda i: times[i.config_index])
    pinned = tuned_step(make_kernel(), timer, n_repeat=2, log_dir=tmp_path / "verify-logs",
                        pinned=tmp_path / "winners.json", store=False)
    pinned(torch.randn(64, device=DEV))
    assert sorted({i.config_index for i in timer.seen}) == [1], "only the pinned winner is timed"
    assert pinned.report.function_runs == 1 + 3 + 1  # discovery, 1 warm-up + 2 timed, final
    assert main(["verify", "--logs", str(tmp_path / "verify-logs")]) == 1
    err = capsys.readouterr().err
    assert "1.2000 ms now, 1.0000 ms recorded (+20.0 %, allowed 5.0 %: the threshold 5 % or the noise" in err
    assert err.splitlines()[0].endswith("): REGRESSED")

    times[1] = 1.0  # fixed: the same log directory now reports the latest verdict, not the first
    fixed = tuned_step(make_kernel(), TableTimer(lambda i: times[i.config_index]), n_repeat=2,
                       log_dir=tmp_path / "verify-logs", pinned=tmp_path / "winners.json", store=False)
    fixed(torch.randn(64, device=DEV))
    assert main(["verify", "--logs", str(tmp_path / "verify-logs")]) == 0
    out = capsys.readouterr().out
    assert "1.0000 ms now, 1.0000 ms recorded (+0.0 %, allowed 5.0 %" in out and "REGRESSED" not in out


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


def same_shape(reference, output) -> bool:  # the tiny kernel adds its block size: a stricter check scores out configs
    return reference.shape == output.shape


@pytest.mark.parametrize("options", [dict(check=same_shape), dict(objective="step")], ids=["checked", "step-objective"])
def test_winners_stored_with_a_check_or_an_objective_are_loaded_again(tmp_path, options):
    """Such winners are stored under their own kind, and the store takes them back."""
    timer = TableTimer(lambda i: {0: 2.0, 1: 1.0, 2: 3.0}[i.config_index])
    tuned_step(make_kernel(), timer, n_repeat=2, cache_dir=tmp_path / "store", **options)(torch.randn(64, device=DEV))
    assert timer.seen, "the first call tunes"
    again = TableTimer(lambda i: 1.0)
    step = tuned_step(make_kernel(), again, n_repeat=2, cache_dir=tmp_path / "store", **options)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a stored record refused as damaged would warn and re-tune
        step(torch.randn(64, device=DEV))
    assert step.report.results[0].source == "store" and step.report.results[0].winner == 1 and again.seen == []


def test_a_checked_winner_is_verified_against_its_own_record(tmp_path, monkeypatch, capsys):
    times = {0: 2.0, 1: 1.0, 2: 3.0}
    paths = dict(log_dir=tmp_path / "logs", cache_dir=tmp_path / "store", check=same_shape)
    tuned_step(make_kernel(), TableTimer(lambda i: times[i.config_index]), n_repeat=2, **paths)(
        torch.randn(64, device=DEV))
    monkeypatch.setenv(verify.VERIFY, "0.05")
    again = TableTimer(lambda i: times[i.config_index])
    tuned_step(make_kernel(), again, n_repeat=2, **paths)(torch.randn(64, device=DEV))
    assert sorted({i.config_index for i in again.seen}) == [1], "only the stored winner is timed again"
    assert main(["verify", "--logs", str(tmp_path / "logs")]) == 0
    out = capsys.readouterr().out
    assert "1.0000 ms now, 1.0000 ms recorded (+0.0 %, allowed 5.0 %: the threshold 5 % or the noise, if larger): ok" in out, out


def test_step_objective_winners_are_not_verified_and_say_so(tmp_path, monkeypatch, capsys):
    """Verify times launches; the step objective recorded whole-run times: no comparison, a warning, exit 1."""
    paths = dict(log_dir=tmp_path / "logs", cache_dir=tmp_path / "store", objective="step")
    tuned_step(make_kernel(), TableTimer(lambda i: 1.0 + i.config_index), **paths)(torch.randn(64, device=DEV))
    monkeypatch.setenv(verify.VERIFY, "0.05")
    again = TableTimer(lambda i: 1.0)
    with pytest.warns(RuntimeWarning, match="objective='step'.*not verified"):
        tuned_step(make_kernel(), again, **paths)(torch.randn(64, device=DEV))
    assert again.seen == []
    assert main(["verify", "--logs", str(tmp_path / "logs")]) == 1
    assert "nothing was verified" in capsys.readouterr().err


def test_verify_runs_leave_no_samples_on_sites_still_to_be_tuned(tmp_path, monkeypatch):
    """One site is stored, one is new: the verify runs launch the new one's first config too, and that
    launch's time must not count in its tuning (here it would make config 0 win)."""
    times = {0: 2.0, 1: 1.5, 2: 3.0}
    kernel = make_kernel()
    x, z = torch.randn(64, device=DEV), torch.randn(128, device=DEV)
    first = tuned_step(kernel, TableTimer(lambda i: times[i.config_index]), cache_dir=tmp_path / "store")
    first(x)
    monkeypatch.setenv(verify.VERIFY, "0.5")
    seen_new = []

    def table(info):
        if info.key[0] == 128 and info.config_index == 0 and not seen_new:
            seen_new.append(info)
            return 0.1  # the verify stage's launch of the new site
        return times[info.config_index]

    fresh = make_kernel()  # nothing in its own cache: the store answers for x's site

    @disttune.contextual_autotune(timer=TableTimer(table), verbose=False, n_warmup=0, n_repeat=1,
                                  cache_dir=tmp_path / "store")
    def both(x, z):
        y, w = torch.empty_like(x), torch.empty_like(z)
        launch_add(fresh, x, y)
        launch_add(fresh, z, w)
        return y, w

    both(x, z)
    results = {r.site.key[0]: r for r in both.report.results}
    assert seen_new, "the verify stage launched the new site's first config"
    assert results[64].source == "store" and results[128].source == "tuned"
    assert results[128].winner == 1 and results[128].agreed_ms[0] == 2.0


def test_a_change_within_the_noise_is_not_a_regression(tmp_path, monkeypatch, capsys):
    """The winner's samples then spread 40 % (noise 0.4): a fresh time 25 % slower is within it, 60 % is not."""
    samples = iter([0.8, 1.2, 1.0] * 1000)
    times = {0: 2.0, 2: 3.0}
    step = tuned_step(make_kernel(), TableTimer(lambda i: times.get(i.config_index) or next(samples)), n_repeat=3,
                      log_dir=tmp_path / "logs", cache_dir=tmp_path / "store")
    step(torch.randn(64, device=DEV))
    (record,) = [r for _, r, _ in store.iter_records(tmp_path / "store")]
    assert record["winner"] == 1 and abs(record["noise"] - 0.4) < 1e-9
    monkeypatch.setenv(verify.VERIFY, "0.1")
    monkeypatch.setenv("DISTTUNE_VERIFY_CPU", "1")
    for slowdown, status in ((1.25, 0), (1.6, 1)):
        again = tuned_step(make_kernel(), TableTimer(lambda i, s=slowdown: s if i.config_index == 1 else 9.0),
                           n_repeat=3, log_dir=tmp_path / f"logs-{slowdown}", cache_dir=tmp_path / "store")
        again(torch.randn(64, device=DEV))
        assert main(["verify", "--logs", str(tmp_path / f"logs-{slowdown}")]) == status
        text = capsys.readouterr()
        assert "allowed 40.0 %" in (text.out + text.err), text


def test_logs_without_verify_records_are_checked_against_the_store(tmp_path, capsys):
    """Right after a tuning run (no DISTTUNE_VERIFY), --logs compares the winners it tuned with the store's times."""
    step = tuned_step(make_kernel(), TableTimer(lambda i: {0: 2.0, 1: 1.0, 2: 3.0}[i.config_index]), n_repeat=2,
                      log_dir=tmp_path / "logs", cache_dir=tmp_path / "store")
    step(torch.randn(64, device=DEV))
    assert main(["verify", "--logs", str(tmp_path / "logs"), "--cache-dir", str(tmp_path / "store")]) == 0
    out = capsys.readouterr().out
    assert f"{KERNEL} n=64 dtype=float32 occurrence=0 {{BLOCK=32 w1 s3}}: 1.0000 ms now, 1.0000 ms recorded" in out
    assert "all 1 winner(s) within their threshold" in out
