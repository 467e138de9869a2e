"""disttune.report: merged Markdown report and plots from per-rank logs.

One real 2-rank launch (gloo, interpreter, fake timer tables) supplies logs for the main tests;
damaged directories are written here with disttune.logs.RankLog and then corrupted by hand.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import re
from pathlib import Path

import pytest
import triton

from disttune.logs import RankLog
from disttune.logs import read_records as read_rank_records
from disttune.report import build_report
from disttune.configs import describe_config
from helpers import failure, read_records, run_cases

CASES = Path(__file__).with_name("dist_cases.py")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
KERNEL = "tiny_kernels.add_block"
KEY = (128, "torch.float32", "torch.float32")
CONFIGS = [f"BLOCK: {b}, num_warps: 1, num_ctas: 1, num_stages: 3, maxnreg: None" for b in (16, 32, 64)]


@pytest.fixture(scope="module")
def real_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("report-run")
    run_cases(CASES, ["agree_max", "fail_one_rank", "keys_differ"], out, 2, timeout=240,
              extra_env={"DISTTUNE_TIMEOUT": "30"})
    return out


def expected_winners(out: Path, case: str) -> dict[int, int]:
    """occurrence -> winner index, from what each rank returned (all ranks must agree)."""
    (per_rank,) = read_records(out, [case], range(2)).values()
    for result in per_rank:
        assert result["ok"], failure(result)
    winners = [{w["occurrence"]: w["winner"] for w in result["winners"]} for result in per_rank]
    assert winners[0] == winners[1]
    return winners[0]


def site_sections(markdown: str) -> dict[int, str]:
    """occurrence -> that site's Markdown section."""
    sections = {}
    for part in markdown.split("\n## Site ")[1:]:
        occurrence = int(re.search(r"^- kernel: .*, occurrence (\d+)$", part, flags=re.M).group(1))
        sections[occurrence] = part
    return sections


def table_row(section: str, index: int) -> str:
    (row,) = [line for line in section.splitlines() if line.startswith(f"| {index} | `")]
    return row


def check_pngs(paths: list[Path]) -> None:
    from matplotlib.image import imread

    assert paths
    for path in paths:
        data = path.read_bytes()
        assert len(data) > 1000 and data.startswith(PNG_SIGNATURE), path
        image = imread(path)
        height, width = image.shape[:2]
        assert 150 <= height <= 4000 and 300 <= width <= 4000, (path, image.shape)
        assert image.shape[2] in (3, 4)
        assert image.std() > 0.01, f"{path} looks blank"
        assert re.fullmatch(r"site-\d+-(heatmap|agreed)\.png", path.name)


def test_agree_max_report(real_run, tmp_path):
    winners = expected_winners(real_run, "agree_max")
    report = build_report(real_run / "logs" / "agree_max", tmp_path / "report")
    markdown = report.markdown_path.read_text()
    assert report.markdown_path == tmp_path / "report" / "report.md"
    assert report.problems == [] and "No problems found." in markdown
    assert [(s.occurrence, s.winner) for s in report.sites] == sorted(winners.items())
    (site,) = report.sites
    assert site.reduce == "max" and site.function_runs and site.function_runs > 2 and set(site.wall_s) == {0, 1}
    # each rank alone prefers its own config; the agreed (max) winner is neither
    assert site.alone_picks() == {0: 0, 1: 1} and site.disagreeing_ranks() == [0, 1]
    section = site_sections(markdown)[0]
    assert "**winner**" in table_row(section, winners[0])
    assert sum("**winner**" in line for line in section.splitlines()) == 1
    assert table_row(section, 0).split("|")[3:6] == [" 1.0000 ", " 5.0000 ", " 5.0000 "]  # rank 0, rank 1, agreed
    assert "400.0%" in table_row(section, 0)
    assert "**2 of 2 ranks alone would have picked a different winner.**" in section
    assert "tuning call:" in section and f"{site.function_runs} function runs" in section
    assert {p.name for p in report.plots} == {"site-1-heatmap.png", "site-1-agreed.png"}
    assert "![site-1-heatmap](site-1-heatmap.png)" in markdown
    check_pngs(report.plots)


def test_fail_one_rank_report(real_run, tmp_path):
    winners = expected_winners(real_run, "fail_one_rank")
    log_dir = real_run / "logs" / "fail_one_rank"
    report = build_report(log_dir)  # default out_dir
    assert report.markdown_path == log_dir / "report" / "report.md"
    markdown = report.markdown_path.read_text()
    assert report.problems == []
    assert [(s.occurrence, s.winner) for s in report.sites] == sorted(winners.items())
    sections = site_sections(markdown)
    for occurrence, winner in winners.items():
        assert "**winner**" in table_row(sections[occurrence], winner)
    failed = table_row(sections[0], 1)  # config 1 of the first kernel fails on rank 1 only
    cells = [c.strip() for c in failed.split("|")]
    assert cells[3:6] == ["0.5000", "failed", "failed"]
    assert "rank 1: RuntimeError: injected fault: config 1 cannot run on rank 1" in failed
    assert "rank 0:" not in failed
    first = report.sites[0]
    assert first.row(1).failures == {1: "RuntimeError: injected fault: config 1 cannot run on rank 1"}
    assert math.isinf(first.row(1).agreed_ms) and first.row(1).per_rank_ms == [0.5, math.inf]
    assert "**1 of 2 ranks alone would have picked a different winner.**" in sections[0]  # rank 0 prefers config 1
    assert "**0 of 2 ranks alone would have picked a different winner.**" in sections[1]
    assert len(report.plots) == 4
    check_pngs(report.plots)


def test_a_call_that_failed_is_in_the_rank_logs_and_the_reports_problems(real_run, tmp_path):
    """The ranks launched different keys: every rank logged the error it raised, and the report names it."""
    log_dir = real_run / "logs" / "keys_differ"
    for rank in (0, 1):
        (error,) = [r for r in read_rank_records(log_dir / f"rank-{rank}.log") if r["event"] == "error"]
        assert error["text"].startswith("TuningError: disttune: ") and "ranks disagree on what to tune" in error["text"]
    report = build_report(log_dir, tmp_path / "report")
    assert report.sites == [] and len(report.problems) == 1, report.problems
    assert re.match(r"the tuning call of \S+ failed \(ranks 0, 1\): TuningError: disttune: .*ranks disagree on what "
                    r"to tune", report.problems[0]), report.problems
    markdown = report.markdown_path.read_text()
    assert "ranks disagree on what to tune" in markdown and "No problems found" not in markdown


# -- hand-made logs ------------------------------------------------------------------------------
def write_tuning(log_dir: Path, rank: int, times: list[list[float]], function: str = "step",
                 failures: dict[int, str] | None = None) -> None:
    """One tuning call as rank ``rank`` logs it: times[c][r] for every rank, agreed by max."""
    log = RankLog(log_dir, rank, function)
    agreed = [max(row) for row in times]
    for c, row in enumerate(times):
        log.config_result(KERNEL, KEY, 0, c, CONFIGS[c], row, agreed[c], (failures or {}).get(c))
    winner = min(range(len(times)), key=lambda c: agreed[c])
    log.winner(KERNEL, KEY, 0, winner, CONFIGS[winner], agreed[winner], "tuned")
    log.tuning(function, 1.5, 11, 1, len(times[0]), "max", "median")
    log.flush()


TIMES_3 = [[4.0, 4.5, 4.2], [2.0, 2.2, 2.1], [1.0, 3.0, 1.5]]  # winner config 1 (max 2.2); ranks 0, 2 prefer 2


def test_corrupt_and_missing_rank_logs(tmp_path):
    log_dir = tmp_path / "logs"
    write_tuning(log_dir, 0, TIMES_3)
    write_tuning(log_dir, 1, TIMES_3)  # rank 2 never wrote its log
    path = log_dir / "rank-1.log"
    lines = path.read_text().splitlines()  # 3 configs, winner, tuning: 10 lines
    assert len(lines) == 10 and lines[5].startswith('{"event": "config"')
    lines.insert(4, "@@@ garbage that is not a log line @@@")  # line 5
    lines[6] = lines[6][: len(lines[6]) // 2]  # line 7: config 2's JSON cut in half
    lines[10] = lines[10][:40]  # line 11: the tuning record, cut off at the end of the file
    path.write_text("\n".join(lines))

    report = build_report(log_dir, tmp_path / "out")
    problems = "\n".join(report.problems)
    assert "rank-1.log line 5: not a disttune log line" in problems
    assert "rank-1.log line 7: truncated JSON" in problems
    assert "rank-1.log line 11: truncated JSON" in problems
    assert "rank-2.log is missing" in problems and "world size of 3" in problems
    markdown = report.markdown_path.read_text()
    section = markdown.split("## Problems")[1].split("## Summary")[0]
    for needle in ("rank-1.log line 5", "rank-1.log line 7", "rank-1.log line 11", "rank-2.log is missing"):
        assert needle in section
    (site,) = report.sites
    assert site.winner == 1 and site.ranks == [0, 1, 2]
    # rank 2's column and rank 1's lost config 2 come from the all-gathered copies the others logged
    assert [row.per_rank_ms for row in site.configs] == TIMES_3
    assert "| 1 | `BLOCK=32 w1 s3` | 2.0000 | 2.2000 | 2.1000 | 2.2000 |  | 10.0% |  | **winner** |" in markdown
    assert site.alone_picks() == {0: 2, 1: 1, 2: 2}
    assert "**2 of 3 ranks alone would have picked a different winner.**" in markdown
    assert site.wall_s == {0: 1.5}  # rank 1's tuning record was lost
    check_pngs(report.plots)


def test_empty_rank_log_and_binary_garbage(tmp_path):
    write_tuning(tmp_path, 0, [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]])
    (tmp_path / "rank-1.log").write_bytes(b"")
    (tmp_path / "rank-2.log").write_bytes(b"\xff\xfe\x00garbage\n{\"event\": \xff}\n")
    report = build_report(tmp_path, tmp_path / "out")
    problems = "\n".join(report.problems)
    assert "rank-1.log is empty" in problems
    assert "rank-2.log: not valid UTF-8" in problems and "rank-2.log line 1" in problems
    assert "rank-2.log has no usable records" in problems
    assert report.sites[0].winner == 0
    assert "rank-1.log is empty" in report.markdown_path.read_text()


def test_a_rank_log_nested_too_deeply_is_a_problem_not_a_crash(tmp_path):
    write_tuning(tmp_path, 0, [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]])
    (tmp_path / "rank-1.log").write_text("{\"a\": " + "[" * 100_000 + "]" * 100_000 + "}\n")
    report = build_report(tmp_path, tmp_path / "out")
    problems = "\n".join(report.problems)
    assert "rank-1.log line 1" in problems and "nested too deeply" in problems
    assert report.sites[0].winner == 0


@pytest.mark.timeout(60)
def test_a_fifo_rank_log_is_missing_not_a_hang_and_a_note_is_a_record(tmp_path):
    """A FIFO named like a rank log would block a reader: the report skips it. A note is a valid record."""
    write_tuning(tmp_path, 0, [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]])
    log = RankLog(tmp_path, 0, "step")
    log.note("new keys", "tuning the new keys failed, they stay on their fallback")
    log.flush()
    os.mkfifo(tmp_path / "rank-1.log")
    report = build_report(tmp_path, tmp_path / "out")
    problems = "\n".join(report.problems)
    assert "rank-1.log is missing" in problems and "line" not in problems, problems
    assert report.sites[0].winner == 0
    (note,) = [r for r in read_rank_records(tmp_path / "rank-0.log") if r["event"] == "note"]
    assert note["topic"] == "new keys" and note["text"].startswith("tuning the new keys failed")


def test_appended_runs_report_the_last_tuning(tmp_path):
    write_tuning(tmp_path, 0, [[1.0], [2.0], [3.0]])  # first tuning: config 0 wins
    write_tuning(tmp_path, 0, [[3.0], [2.0], [1.0]])  # re-tuned later: config 2 wins
    log = RankLog(tmp_path, 0, "step")  # a third call hit the store
    log.winner(KERNEL, KEY, 0, 2, CONFIGS[2], math.nan, "store")
    log.tuning("step", 0.01, 2, 0, 1, "max", "median")
    log.flush()
    report = build_report(tmp_path, tmp_path / "out")
    assert report.problems == []
    (site,) = report.sites
    assert site.winner == 2 and [row.per_rank_ms for row in site.configs] == [[3.0], [2.0], [1.0]]
    assert site.function_runs == 11 and site.latest_source == "store"
    assert "winner from the store (the same config)" in report.markdown_path.read_text()


def test_a_winner_from_a_pinned_table_is_named_so(tmp_path):
    write_tuning(tmp_path, 0, [[3.0], [2.0], [1.0]])
    log = RankLog(tmp_path, 0, "step")
    log.winner(KERNEL, KEY, 0, 1, CONFIGS[1], math.nan, "pinned")
    log.flush()
    markdown = build_report(tmp_path, tmp_path / "out").markdown_path.read_text()
    assert "latest call: winner from the pinned table (config 1)" in markdown


def test_report_covers_the_last_tuning_unless_asked_for_all(tmp_path):
    write_tuning(tmp_path, 0, [[1.0, 1.5], [2.0, 2.5], [3.0, 3.5]])  # first tuning: config 0 wins
    write_tuning(tmp_path, 1, [[1.0, 1.5], [2.0, 2.5], [3.0, 3.5]])
    write_tuning(tmp_path, 0, [[3.0, 3.5], [2.0, 2.5], [1.0, 1.5]])  # re-tuned: config 2 wins
    write_tuning(tmp_path, 1, [[3.0, 3.5], [2.0, 2.5], [1.0, 1.5]])

    latest = build_report(tmp_path, tmp_path / "latest")
    assert latest.problems == []
    (site,) = latest.sites
    assert (site.winner, site.tuning_number, site.tunings) == (2, 2, 2)
    assert {p.name for p in latest.plots} == {"site-1-heatmap.png", "site-1-agreed.png"}
    assert "the logs hold 2 tunings of this site; this is the last" in latest.markdown_path.read_text()

    history = build_report(tmp_path, tmp_path / "all", history=True)
    assert history.problems == []
    assert [(s.number, s.tuning_number, s.winner) for s in history.sites] == [(1, 1, 0), (1, 2, 2)]
    assert [row.per_rank_ms for row in history.sites[0].configs] == [[1.0, 1.5], [2.0, 2.5], [3.0, 3.5]]
    assert {p.name for p in history.plots} == {f"site-1-tuning-{k}-{kind}.png" for k in (1, 2)
                                                for kind in ("heatmap", "agreed")}
    markdown = history.markdown_path.read_text()
    assert "## Site 1, tuning 1 of 2: " in markdown and "## Site 1, tuning 2 of 2: " in markdown
    assert "1 site(s)" in markdown
    check_pngs(latest.plots)


def test_titles_carry_the_named_key_so_two_sites_of_one_kernel_differ(tmp_path, monkeypatch):
    import disttune.report as report_module

    other_key = (256, "torch.float32", "torch.float32")
    log = RankLog(tmp_path, 0, "step")
    for key in (KEY, other_key):
        log.label_key(KERNEL, key, f"n={key[0]} dtype=float32")
        for c, config in enumerate(CONFIGS):
            log.config_result(KERNEL, key, 0, c, config, [float(c + 1)], float(c + 1), None)
        log.winner(KERNEL, key, 0, 0, CONFIGS[0], 1.0, "tuned")
    log.tuning("step", 0.5, 11, 2, 1, "max", "median")
    log.flush()
    titles = []
    real_save = report_module._save
    monkeypatch.setattr(report_module, "_save",
                        lambda figure, path: (titles.append(figure.axes[0].get_title()), real_save(figure, path))[1])

    report = build_report(tmp_path, tmp_path / "out")
    assert len(report.sites) == 2 and len(titles) == 4
    markdown = report.markdown_path.read_text()
    for number, key in ((1, KEY), (2, other_key)):
        assert f"## Site {number}: {KERNEL} n={key[0]} dtype=float32\n" in markdown
        assert f"| {number} | `step` | `{KERNEL}` | `n={key[0]} dtype=float32` | 0 |" in markdown
        shown = [" ".join(t.split()) for t in titles if t.startswith(f"Site {number}:")]
        assert len(shown) == 2 and all(f"n={key[0]} dtype=float32" in t for t in shown), titles
        assert all(len(t.splitlines()) <= 2 for t in titles), titles  # a named key keeps titles short


def test_json_logs_write_null_for_missing_times_and_name_the_failed_ranks(tmp_path):
    log = RankLog(tmp_path, 0, "step")
    for c, row in enumerate([[1.0, math.nan, 2.0], [1.5, 1.0, math.inf], [3.0, 3.0, 3.0]]):
        log.config_result(KERNEL, KEY, 0, c, CONFIGS[c], row, math.inf if c == 1 else max(row), None)
    log.winner(KERNEL, KEY, 0, 0, CONFIGS[0], 2.0, "tuned")
    log.winner(KERNEL, KEY, 0, 0, CONFIGS[0], math.nan, "store")
    log.measure(KERNEL, KEY, 0, CONFIGS[0], 0, math.inf)
    log.tuning("step", 0.5, 5, 1, 3, "max", "median")
    log.flush()
    text = (tmp_path / "rank-0.log").read_text()
    assert '"nan"' not in text and "NaN" not in text and "Infinity" not in text

    def no_constants(name):
        raise AssertionError(f"{name} in a JSON log")

    records = [json.loads(line, parse_constant=no_constants) for line in text.splitlines() if line.startswith("{")]
    configs = [r for r in records if r["event"] == "config"]
    assert [r["per_rank_ms"] for r in configs] == [[1.0, None, 2.0], [1.5, 1.0, None], [3.0, 3.0, 3.0]]
    assert [r["failed_ranks"] for r in configs] == [[], [2], []]
    assert configs[1]["agreed_ms"] is None
    assert [r["agreed_ms"] for r in records if r["event"] == "winner"] == [2.0, None]
    assert [r["ms"] for r in records if r["event"] == "measure"] == [None]

    (site,) = build_report(tmp_path, tmp_path / "out").sites
    first, second = site.configs[0].per_rank_ms, site.configs[1].per_rank_ms
    assert first[0] == 1.0 and math.isnan(first[1]) and second == [1.5, 1.0, math.inf]


def test_beyond_64_ranks_only_rank_0_logs_every_ranks_times_and_the_report_merges_the_others_own(tmp_path):
    import numpy as np

    from disttune.agreement import TimingVector, Verdict
    from disttune.pipeline import log_verdicts
    from disttune.sites import Site, SiteId

    world = 100
    times = np.tile([[4.0, 2.0, 1.0]], (world, 1)) + np.arange(world)[:, None] * 0.01  # the last rank is slowest
    times[7, 2] = math.inf  # config 2 failed on rank 7
    vector = TimingVector([Site(SiteId(KERNEL, KEY, 0), None, CONFIGS)], (), "max", world)
    combined = vector.combine(np.hstack([np.zeros((world, 1)), times]))
    own_5 = times[5] + 0.5  # what rank 5's own file says wins over rank 0's copy in the report
    for rank, own in ((0, times[0]), (5, own_5)):
        (site_times,) = vector.split(combined, own, rank)
        site = Site(SiteId(KERNEL, KEY, 0), None, CONFIGS)
        log = RankLog(tmp_path, rank, "step")
        log_verdicts(log, [Verdict(site, site_times.rows, site_times.agreed, 1, own=site_times.own,
                                   spread=site_times.spread, rank=rank, world=world)], ())
        log.tuning("step", 1.5, 11, 1, world, "max", "median")
        log.flush()

    def configs(rank):
        return [r for r in read_rank_records(tmp_path / f"rank-{rank}.log") if r["event"] == "config"]

    assert [len(r["per_rank_ms"]) for r in configs(0)] == [world] * 3
    mine = configs(5)
    assert all("per_rank_ms" not in r for r in mine), "a rank beyond 0 logs its own time, not every rank's"
    assert [r["rank_ms"] for r in mine] == [4.55, 2.55, 1.55]
    assert [r["spread"]["slowest_rank"] for r in mine] == [world - 1, world - 1, 7]
    assert [r["spread"]["max_ms"] for r in mine] == [4.99, 2.99, None]  # JSON has no inf
    assert [r["spread"]["min_ms"] for r in mine] == [4.0, 2.0, 1.0]
    assert [r["failed_ranks"] for r in mine] == [[], [], [7]]  # the failure the spread names
    assert "ranks' min/median/max ms=4.0000/4.4950/4.9900 slowest rank=99" in (tmp_path / "rank-5.log").read_text()

    report = build_report(tmp_path, tmp_path / "out")
    assert report.problems == [f"rank-{r}.log is missing from {tmp_path} (the logs show a world size of {world})"
                               for r in range(world) if r not in (0, 5)]
    (site,) = report.sites
    times[5] = own_5
    np.testing.assert_array_equal([row.per_rank_ms for row in site.configs], times.T)


def test_each_measure_record_carries_the_time_of_its_sample(tmp_path):
    import time

    import torch

    import disttune
    from tiny_kernels import TableTimer, device, launch_add, make_kernel

    kernel = make_kernel()
    x = torch.randn(64, device=device())

    @disttune.contextual_autotune(timer=TableTimer(lambda info: 1.0), n_warmup=1, n_repeat=2, verbose=False,
                                  log_dir=tmp_path, cache_dir=tmp_path / "store")
    def step():
        launch_add(kernel, x, torch.empty_like(x))
        time.sleep(0.03)

    step()
    records = [json.loads(line) for line in (tmp_path / "rank-0.log").read_text().splitlines()
               if line.startswith("{")]
    stamps = [datetime.datetime.fromisoformat(r["time"]) for r in records if r["event"] == "measure"]
    assert len(stamps) == 6  # 3 configs x 2 timed runs, in the order they ran
    gaps = [(later - earlier).total_seconds() for earlier, later in zip(stamps, stamps[1:])]
    assert all(gap >= 0.025 for gap in gaps), gaps
    (tuning,) = [datetime.datetime.fromisoformat(r["time"]) for r in records if r["event"] == "tuning"]
    assert tuning > stamps[-1]


def test_no_logs_raise_naming_the_directory(tmp_path):
    empty = tmp_path / "empty-log-dir"
    empty.mkdir()
    (empty / "notes.txt").write_text("not a rank log")
    with pytest.raises(FileNotFoundError, match=re.escape(str(empty))):
        build_report(empty)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_report(tmp_path / "nowhere")
    assert not (empty / "report").exists()


def test_config_label_of_logged_text_leaves_out_defaults():
    assert describe_config(CONFIGS[1]) == "BLOCK=32 w1 s3"
    assert describe_config("BLOCK_M: 128, num_warps: 8, num_ctas: 2, num_stages: 4, maxnreg: 128") == \
        "BLOCK_M=128 w8 s4 ctas2 maxnreg128"
    # newer Triton prints ir_override (and may add more options): left out at their default
    assert describe_config(CONFIGS[1] + ", ir_override: None") == "BLOCK=32 w1 s3"
    assert describe_config(CONFIGS[1] + ", ir_override: /tmp/x.ttgir") == "BLOCK=32 w1 s3 ir_override=/tmp/x.ttgir"
    assert describe_config("something else") == "something else"


class _NewerConfig(triton.Config):
    """A Config with an option a later Triton might add."""

    def __init__(self, kwargs, num_warps=4, num_stages=3, fast_math=False, **options):
        super().__init__(kwargs, num_warps=num_warps, num_stages=num_stages, **options)
        self.fast_math = fast_math


@pytest.mark.parametrize("config, label", [
    (triton.Config({"BLOCK": 32}, num_warps=1), "BLOCK=32 w1 s3"),
    (triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=8, num_stages=2, num_ctas=2, maxnreg=128),
     "BLOCK_M=64 BLOCK_N=32 w8 s2 ctas2 maxnreg128"),
    (triton.Config({"BLOCK": 16}, num_warps=2, num_stages=1, pre_hook=lambda args: None), "BLOCK=16 w2 s1"),
    (_NewerConfig({"BLOCK": 16}, num_warps=2), "BLOCK=16 w2 s3"),
    (_NewerConfig({"BLOCK": 16}, num_warps=2, fast_math=True), "BLOCK=16 w2 s3 fast_math=True"),
    ({"chunks": 4, "order": "ring"}, "chunks=4 order=ring"),
])
def test_config_label_is_the_same_for_a_config_and_its_logged_text(config, label):
    assert describe_config(config) == label
    if isinstance(config, triton.Config) and not isinstance(config, _NewerConfig):
        assert describe_config(str(config)) == label  # what the logs and the store hold


def test_ranks_whose_last_tunings_differ_in_time(tmp_path):
    times = [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]
    write_tuning(tmp_path, 0, times)
    write_tuning(tmp_path, 1, times)
    path = tmp_path / "rank-1.log"  # rank 1's log lost the latest run: its tuning is a day older
    path.write_text(path.read_text().replace('"time": "', '"time": "1999-01-01T00:00:00.000+00:00", "old": "'))
    report = build_report(tmp_path, tmp_path / "out")
    assert any("last tunings are from different times" in p for p in report.problems), report.problems


def test_the_report_covers_the_latest_run_unless_asked_for_every_run(tmp_path, monkeypatch):
    """Two jobs logged into one folder: the report shows the later one, ``all_runs`` both, each under its run."""
    from disttune import env

    for run, times in (("2026-11-26T10:00:00Z-100", TIMES_3), ("2026-11-26T11:00:00Z-200", [[1.0], [3.0], [2.0]])):
        monkeypatch.setattr(env, "run_id", lambda run=run: run)
        write_tuning(tmp_path, 0, times)
    latest = build_report(tmp_path, tmp_path / "latest")
    (site,) = latest.sites
    assert site.run == "2026-11-26T11:00:00Z-200" and site.winner == 0 and len(site.ranks) == 1
    markdown = latest.markdown_path.read_text()
    assert "It covers the run started 2026-11-26T11:00:00Z (pid 200); the folder holds 2 runs" in markdown
    every = build_report(tmp_path, tmp_path / "every", all_runs=True)
    assert [(s.number, s.run, s.winner) for s in every.sites] == [(1, "2026-11-26T10:00:00Z-100", 1),
                                                                  (2, "2026-11-26T11:00:00Z-200", 0)]
    markdown = every.markdown_path.read_text()
    first, second = (markdown.index(f"# The run started {start}") for start in ("2026-11-26T10", "2026-11-26T11"))
    assert first < markdown.index("## Site 1") < second < markdown.index("## Site 2")


def in_run(monkeypatch, run: str) -> None:
    """Records logged from now on belong to the job ``run`` (as if another job logged them)."""
    from disttune import env

    monkeypatch.setattr(env, "run_id", lambda: run)


def test_a_run_that_failed_is_reported_with_its_error_not_an_earlier_runs_winners(tmp_path, monkeypatch):
    in_run(monkeypatch, "2026-11-26T10:00:00Z-100")
    for rank in (0, 1):
        write_tuning(tmp_path, rank, [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]])
    first = build_report(tmp_path, tmp_path / "report")
    assert first.problems == [] and len(first.plots) == 2
    in_run(monkeypatch, "2026-11-26T11:00:00Z-200")
    for rank in (0, 1):
        log = RankLog(tmp_path, rank, "step")
        log.failure("TuningError: disttune: step: ranks disagree on what to tune: key=(64,) on rank 0, (80,) on rank 1")
        log.flush()
    report = build_report(tmp_path, tmp_path / "report")
    assert report.sites == [] and report.plots == []
    assert report.problems == ["the tuning call of step failed (ranks 0, 1): TuningError: disttune: step: ranks "
                               "disagree on what to tune: key=(64,) on rank 0, (80,) on rank 1"]
    markdown = report.markdown_path.read_text()
    assert "It covers the run started 2026-11-26T11:00:00Z (pid 200)" in markdown
    assert "No tuning sites in this run." in markdown and "No problems found" not in markdown
    assert sorted(p.name for p in (tmp_path / "report").iterdir()) == ["report.md"], "the first run's plots are gone"


def test_a_store_hit_shows_the_stored_winner_and_says_it_came_from_the_store(tmp_path, monkeypatch):
    in_run(monkeypatch, "2026-11-26T10:00:00Z-100")
    write_tuning(tmp_path, 0, [[3.0], [2.0], [1.0]])  # the first run tunes: config 2 wins
    (tmp_path / "report").mkdir()
    (tmp_path / "report" / "notes.png").write_bytes(b"not ours")  # a file the report did not draw stays
    assert len(build_report(tmp_path, tmp_path / "report").plots) == 2
    in_run(monkeypatch, "2026-11-26T11:00:00Z-200")
    log = RankLog(tmp_path, 0, "step")  # the second run finds config 2 in the store
    log.label_key(KERNEL, KEY, "n_elements=128 dtype=float32")
    log.winner(KERNEL, KEY, 0, 2, CONFIGS[2], math.nan, "store")
    log.tuning("step", 0.25, 2, 0, 1, "max", "median")
    log.flush()
    report = build_report(tmp_path, tmp_path / "report")
    assert report.problems == [] and report.plots == []
    (site,) = report.sites
    assert (site.latest_source, site.latest_winner, site.configs) == ("store", 2, [])
    markdown = report.markdown_path.read_text()
    assert "No problems found." in markdown and "none logged" not in markdown
    assert "- winner: config 2 `BLOCK=64 w1 s3`, from the store: not tuned in this run" in markdown
    assert "- call: 0.250 s wall, 2 function runs, nothing tuned (the winner came from the store)" in markdown
    (row,) = [line for line in markdown.splitlines() if line.startswith("| 1 | `step`")]
    assert "| 2: `BLOCK=64 w1 s3` (the store) |" in row and row.endswith("| not tuned |"), row
    assert sorted(p.name for p in (tmp_path / "report").iterdir()) == ["notes.png", "report.md"]
