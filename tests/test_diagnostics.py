"""Diagnostics: compiler facts and occupancy, noise against the winner's margin, one-line loser explanations,
in the rank logs and in the merged report."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import torch

from disttune import diagnostics
from disttune.agreement import SiteResult
from disttune.logs import RankLog
from disttune.report import build_report
from disttune.sites import Site, SiteId
from disttune.space import DEFAULT_BUDGET
from tiny_kernels import DEV, TableTimer, make_kernel, tuned_step


def fake_kernel(n_regs, n_spills, shared, warps):
    return SimpleNamespace(n_regs=n_regs, n_spills=n_spills, metadata=SimpleNamespace(shared=shared, num_warps=warps))


def test_occupancy_follows_registers_shared_memory_and_threads():
    assert diagnostics.occupancy(255, 0, 8, DEFAULT_BUDGET) == (1, "registers")  # 32 x 256 regs per warp x 8 warps
    assert diagnostics.occupancy(64, 0, 4, DEFAULT_BUDGET) == (8, "registers")
    assert diagnostics.occupancy(32, 100000, 4, DEFAULT_BUDGET) == (2, "shared memory")
    assert diagnostics.occupancy(16, 0, 1, DEFAULT_BUDGET) == (32, "blocks")
    assert diagnostics.occupancy(None, 0, 4, DEFAULT_BUDGET) == (None, None)


def test_kernel_facts_read_the_compiled_kernel_and_say_none_without_one():
    assert diagnostics.kernel_facts(fake_kernel(96, 0, 49152, 4)) == {
        "n_regs": 96, "n_spills": 0, "shared_bytes": 49152, "num_warps": 4}
    assert diagnostics.kernel_facts(None) == {"n_regs": None, "n_spills": None, "shared_bytes": None,
                                              "num_warps": None}


def test_sample_spread_and_margin():
    assert diagnostics.sample_spread([1.0, 1.2, 1.1]) == (1.2 - 1.0) / 1.1
    assert diagnostics.sample_spread([1.0]) is None
    runner, margin = diagnostics.margin_over_runner_up([2.0, 1.0, float("inf"), 1.05, float("nan")], 1)
    assert runner == 3 and math.isclose(margin, 0.05)
    assert diagnostics.margin_over_runner_up([1.0, float("inf")], 0) == (None, None)


def _log_tuning(log_dir, rank, samples, facts):
    """One rank's records of a two-config site tuned with ``samples`` per config and ``facts`` per config."""
    site = Site(SiteId("kern", (64,), 0), None, ["BLOCK: 16, num_warps: 4", "BLOCK: 32, num_warps: 8"])
    for index, values in enumerate(samples):
        for ms in values:
            site.add_sample(index, ms, 0.0)
    agreed = (1.0, 1.04)
    result = SiteResult(site.id, tuple(site.configs), (agreed, agreed), agreed, 0, "tuned")
    log = RankLog(log_dir, rank, "step")
    for index, config in enumerate(site.configs):
        log.config_result("kern", (64,), 0, index, config, list(agreed), agreed[index], None)
    log.winner("kern", (64,), 0, 0, site.configs[0], agreed[0], "tuned")
    diagnostics.log_site(log, site, result, facts, DEFAULT_BUDGET)
    log.tuning("step", 1.0, 10, 1, 2, "max", "median")
    log.flush()


def test_report_merges_ranks_flags_noise_and_explains_losers(tmp_path):
    logs = tmp_path / "logs"
    compiled = {0: fake_kernel(64, 0, 32768, 4), 1: fake_kernel(255, 48, 65536, 8)}
    _log_tuning(logs, 0, [[1.0, 1.01, 1.0], [1.04, 1.05, 1.04]], compiled)
    _log_tuning(logs, 1, [[1.0, 1.10, 0.98], [1.04, 1.04, 1.04]], compiled)  # rank 1 is the noisy one
    records = [json.loads(line) for line in (logs / "rank-1.log").read_text().splitlines() if line.startswith("{")]
    per_config = [r for r in records if r["event"] == "diagnostics" and r["scope"] == "config"]
    assert [(r["n_regs"], r["n_spills"], r["blocks_per_sm"]) for r in per_config] == [(64, 0, 7), (255, 48, 1)]
    report = build_report(logs)
    assert not report.problems, report.problems
    text = report.markdown_path.read_text()
    assert "not distinguishable** from the runner-up config 1 `BLOCK=32 w8`" in text
    noise = (1.10 - 0.98) / 1.0
    assert f"noise {100 * noise:.1f} %" in text, "the worst rank's sample spread is the noise"
    assert "4.0 % slower (within noise); spills 48 registers; occupancy 1 block/SM (winner 7, limited by registers)" \
        in text


def test_a_margin_beyond_the_noise_is_called_ahead(tmp_path):
    logs = tmp_path / "logs"
    _log_tuning(logs, 0, [[1.0, 1.001, 1.0], [1.04, 1.041, 1.04]], {})
    text = build_report(logs).markdown_path.read_text()
    assert "ahead of the runner-up config 1" in text and "not distinguishable" not in text
    assert "| 0: `BLOCK=16 w4` | unknown | unknown | unknown | unknown |" in text


def test_a_tuning_in_the_interpreter_logs_unknown_compiler_facts(tmp_path):
    kernel = make_kernel()
    samples = {0: iter([3.0, 3.3]), 1: iter([1.0, 1.2]), 2: iter([1.1, 1.15])}
    step = tuned_step(kernel, TableTimer(lambda info: next(samples[info.config_index])), n_warmup=0, n_repeat=2,
                      log_dir=tmp_path / "logs", store=False)
    step(torch.randn(64, device=DEV))
    text = build_report(tmp_path / "logs").markdown_path.read_text()
    # winner 1 (median 1.1) vs runner-up 2 (1.125): margin 2.3 % inside a sample spread of 18 %
    assert "not distinguishable** from the runner-up config 2" in text
    assert "unknown" in text and "spills" not in text.split("Compiler facts")[1].split("\n\n")[1].replace(
        "| spills |", "")
