"""The disttune command: demo end to end on 2 CPU ranks, argument handling, store subcommands, errors."""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch

import disttune
import disttune.cli
from disttune.cli import build_parser, main
from disttune.logs import RankLog
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
    assert "shard_ordered_gemm" in open(report).read()  # the shipped AllGatherGEMM's kernel


@pytest.mark.slow
def test_moe_demo_tunes_the_layer_and_checks_itself(tmp_path):
    proc = run_command([sys.executable, "-m", "disttune", "demo", "--kernel", "moe", "--log-dir", str(tmp_path / "logs"),
                        "--samples", "3"], timeout=600, extra_env={"DISTTUNE_CACHE_DIR": str(tmp_path / "store")})
    assert proc.returncode == 0, describe(proc)
    assert "TP MoE layer" in proc.stdout and "correct on every rank: True" in proc.stdout, describe(proc)
    assert proc.stdout.count("<- winner") >= 2, describe(proc)  # the gate-up and the down projection


def test_unknown_demo_is_a_clear_error(capsys):
    assert main(["demo", "--kernel", "nope"]) == 2
    assert "there is no 'nope' demo; available: ag_gemm, tp_mlp, moe" in capsys.readouterr().err


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
    assert "tiny_kernels.add_block n=64 dtype=float32 occurrence=0 -> " in shown and "world 1" in shown  # as the report
    assert "-> BLOCK=64 w1 s3  [" in shown and "maxnreg" not in shown  # the one config label
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


@pytest.mark.parametrize("argv, example_args, nproc", [
    (["--M", "192"], ["--M", "192"], None),
    (["--M", "192", "--nproc", "2", "--N=64"], ["--M", "192", "--N=64"], 2),
    (["--n", "4"], ["--n", "4"], None),  # not an abbreviation of --nproc
    (["--nproc", "2", "--", "--nproc", "3", "--help"], ["--nproc", "3", "--help"], 2),  # after --: all the example's
])
def test_demo_passes_what_it_does_not_know_to_the_example(argv, example_args, nproc, monkeypatch, tmp_path):
    launched = []
    monkeypatch.setattr(disttune.cli, "sizes_problem", lambda example, argv, world, parser: None)
    monkeypatch.setattr(disttune.cli, "launch_demo", lambda command, env: launched.append(command) or 3)
    assert main(["demo", "--log-dir", str(tmp_path), *argv]) == 3  # the example's exit status
    (command,) = launched
    example = command.index(str(disttune.cli.REPO_ROOT / "examples" / "ag_gemm.py"))
    assert command[example + 1:] == example_args
    assert ("--nproc_per_node=2" in command[:example]) == (nproc == 2)


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"disttune {disttune.__version__} (torch ")


@pytest.mark.parametrize("argv", [["show", "--bogus"], ["report", "--bogus"], ["export"], ["import", "a", "b"],
                                  ["clear", "--kernel"], ["demo", "--nproc", "two"]])
def test_argument_errors_print_the_subcommands_usage(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.startswith(f"usage: disttune {argv[0]} ") and f"disttune {argv[0]}: error: " in err, err


def test_an_argument_the_example_refuses_gets_the_demos_usage(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--M", "abc"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    usage, error = err.strip().splitlines()
    assert usage.startswith("usage: disttune demo ") and "--nproc N" in usage and "--kernel NAME" in usage, err
    assert error == ("disttune demo: error: argument --M: invalid int value: 'abc' (`disttune demo -- --help` lists "
                     "the example's arguments)"), err


def entry(**changes) -> dict:
    """One winners-table entry, as export_table writes it."""
    record = {"schema": 1, "kind": "kernel", "name": "pkg.kernel", "source_key": "abc", "key": "(64,)",
              "occurrence": 0, "configs": ["BLOCK: 16, num_warps: 1, num_ctas: 1, num_stages: 3, maxnreg: None"],
              "winner": 0, "agreed_ms": [1.0], "fingerprint": {"gpu": None, "world_size": 1}, "created": 0.0}
    return {key: value for key, value in {**record, **changes}.items() if value is not ...}


def write_table(path, *entries) -> str:
    path.write_text(json.dumps({"schema": 1, "entries": list(entries)}))
    return str(path)


@pytest.mark.parametrize("case, expected", [
    ("no fingerprint", "has a bad entry: field 'fingerprint' missing or not a dict"),
    ("string fingerprint", "has a bad entry: field 'fingerprint' missing or not a dict"),
    ("string occurrence", "has a bad entry: field 'occurrence' not an int"),
    ("missing file", "cannot read winners table"),
    ("unwritable store", "cannot write the store under"),
])
def test_import_errors_are_one_line(case, expected, tmp_path, capsys):
    (tmp_path / "a-file").write_text("")
    table = {"no fingerprint": lambda: write_table(tmp_path / "t.json", entry(fingerprint=...)),
             "string fingerprint": lambda: write_table(tmp_path / "t.json", entry(fingerprint="H100")),
             "string occurrence": lambda: write_table(tmp_path / "t.json", entry(occurrence="first")),
             "missing file": lambda: str(tmp_path / "none.json"),
             "unwritable store": lambda: write_table(tmp_path / "t.json", entry())}[case]()
    store = tmp_path / "a-file" / "store" if case == "unwritable store" else tmp_path / "store"
    assert main(["import", table, "--cache-dir", str(store)]) == 1
    out, err = capsys.readouterr()
    assert err.startswith("disttune import: ") and expected in err and err.count("\n") == 1, err
    assert "pinned" not in err and "Traceback" not in err and out == ""


def test_export_to_an_unwritable_path_is_one_line(tmp_path, capsys):
    (tmp_path / "a-file").write_text("")
    for target in (tmp_path / "a-file" / "winners.json", tmp_path / "no-such-dir" / "winners.json"):
        assert main(["export", str(target)]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"disttune export: cannot write {target}: ") and err.count("\n") == 1, err


def test_show_lists_a_damaged_entry_instead_of_failing(tmp_path, capsys):
    folder = tmp_path / "store" / "pkg.kernel"
    folder.mkdir(parents=True)
    (folder / "good.json").write_text(json.dumps(entry()))
    (folder / "string-fingerprint.json").write_text(json.dumps(entry(fingerprint="H100", created="yesterday")))
    assert main(["show", "--cache-dir", str(tmp_path / "store")]) == 0
    shown = capsys.readouterr().out
    assert "pkg.kernel key=(64,) occurrence=0 -> BLOCK=16 w1 s3  [cpu, world 1" in shown
    assert "DAMAGED" in shown and "string-fingerprint.json: field 'fingerprint' missing or not a dict" in shown


def test_report_errors_carry_one_prefix(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nowhere")]) == 1
    err = capsys.readouterr().err
    assert err.count("disttune report:") == 1 and err.count("\n") == 1 and "does not exist" in err


def test_report_all_covers_every_tuning(tmp_path, capsys):
    configs = [f"BLOCK: {b}, num_warps: 1, num_ctas: 1, num_stages: 3, maxnreg: None, ir_override: None"
               for b in (16, 32)]
    for times in ([1.0, 2.0], [2.0, 1.0]):  # tuned twice: config 0, then config 1 wins
        log = RankLog(tmp_path / "logs", 0, "step")
        for c, ms in enumerate(times):
            log.config_result("pkg.kernel", (64,), 0, c, configs[c], [ms], ms, None)
        winner = times.index(min(times))
        log.winner("pkg.kernel", (64,), 0, winner, configs[winner], min(times), "tuned")
        log.tuning("step", 0.1, 5, 1, 1, "max", "median")
        log.flush()
    assert main(["report", str(tmp_path / "logs"), "--out", str(tmp_path / "last")]) == 0
    plots = [line for line in capsys.readouterr().out.splitlines() if line.startswith("plot: ")]
    assert len(plots) == 2
    assert main(["report", str(tmp_path / "logs"), "--all", "--out", str(tmp_path / "all")]) == 0
    plots = [line for line in capsys.readouterr().out.splitlines() if line.startswith("plot: ")]
    assert len(plots) == 4 and sum("site-1-tuning-2-" in p for p in plots) == 2
    markdown = (tmp_path / "all" / "report.md").read_text()
    assert "| `BLOCK=16 w1 s3` |" in markdown and "ir_override" not in markdown


@pytest.mark.parametrize("argv, environment, says", [
    (["--nproc", "0"], {}, "argument --nproc: must be an integer >= 1, got 0"),
    (["--nproc", "-1"], {}, "argument --nproc: must be an integer >= 1, got -1"),
    (["--M", "97"], {}, "disttune demo: --M (97) and --N (64) must be multiples of the world size 2"),
    ([], {"DISTTUNE_TIMEOUT": "abc"}, "disttune demo: DISTTUNE_TIMEOUT='abc' is not a number of seconds"),
    ([], {"DISTTUNE_VERIFY": "soon"}, "disttune demo: DISTTUNE_VERIFY='soon' is not a threshold >= 0"),
])
def test_demo_refuses_bad_settings_before_any_rank_starts(argv, environment, says, tmp_path):
    """One line (two with argparse's usage), no traceback, no rank launched (no log written)."""
    extra = {"DISTTUNE_CACHE_DIR": str(tmp_path / "store"), **environment}
    proc = run_command([sys.executable, "-m", "disttune", "demo", "--nproc", "2", "--log-dir", str(tmp_path / "logs"),
                        *argv], timeout=120, extra_env=extra)
    assert proc.returncode in (1, 2), describe(proc)
    assert says in proc.stderr and "Traceback" not in proc.stderr, describe(proc)
    assert len(proc.stderr.strip().splitlines()) <= 2, describe(proc)
    assert not (tmp_path / "logs").exists(), "no rank was launched"


def test_an_unknown_disttune_variable_is_a_warning_naming_the_likely_one(monkeypatch, capsys):
    monkeypatch.setenv("DISTTUNE_TIMEOUT", "30")  # known and valid: nothing to say
    disttune.cli.check_environment("demo")
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("DISTTUNE_TIMOUT", "30")
    disttune.cli.check_environment("demo")
    assert capsys.readouterr().err == ("disttune demo: warning: DISTTUNE_TIMOUT is not a disttune setting "
                                       "(did you mean DISTTUNE_TIMEOUT?)\n")


@pytest.mark.slow
def test_a_ranks_error_is_printed_once_in_rank_order(tmp_path):
    """Both ranks fail alike inside the layer (top-k larger than the experts): one line naming both, not two
    tracebacks and torchrun's ChildFailedError report."""
    proc = run_command([sys.executable, "-m", "disttune", "demo", "--kernel", "moe", "--top-k", "9", "--log-dir",
                        str(tmp_path / "logs")], timeout=300, extra_env={"DISTTUNE_CACHE_DIR": str(tmp_path / "store")})
    assert proc.returncode != 0, describe(proc)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("disttune demo: ")]
    assert lines == ["disttune demo: ranks 0, 1: RuntimeError: selected index k out of range "
                     "(DISTTUNE_TRACEBACK=1 prints the tracebacks)"], describe(proc)
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr, describe(proc)


def test_launch_sh_help_names_examples_that_exist():
    proc = run_command(["bash", "scripts/launch.sh", "--help"], timeout=120)  # a hang bound, generous for a busy machine
    named = set(re.findall(r"(examples/\w+\.py)", proc.stdout))
    assert proc.returncode == 0 and named, describe(proc)
    assert all((disttune.cli.REPO_ROOT / path).is_file() for path in named), named
