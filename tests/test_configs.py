"""What Triton versions print differently must not change which configs disttune matches.

Triton 3.6 prints a ``Config`` without ``ir_override``; newer versions print ``ir_override: None``.
Stored winners, pinned tables and logs name configs in one form under every version.
"""

from __future__ import annotations

import json

import torch
import triton

from disttune import store
from disttune.configs import config_text
from tiny_kernels import TableTimer, device, make_kernel, preferring, tuned_step

# Triton 3.6's str() of tiny_kernels' configs: what a table exported there holds.
TRITON_36_CONFIGS = [f"BLOCK: {b}, num_warps: 1, num_ctas: 1, num_stages: 3, maxnreg: None" for b in (16, 32, 64)]


def test_config_text_is_one_form_and_names_ir_override_only_when_set():
    assert config_text(triton.Config({"BLOCK": 16}, num_warps=1)) == TRITON_36_CONFIGS[0]
    tuned = triton.Config({"BLOCK_M": 128, "GROUP_M": 8}, num_warps=8, num_stages=4, num_ctas=2, maxnreg=128,
                          ir_override="kernel.ttgir")
    assert config_text(tuned) == ("BLOCK_M: 128, GROUP_M: 8, num_warps: 8, num_ctas: 2, num_stages: 4, maxnreg: 128, "
                                  "ir_override: kernel.ttgir")


def test_a_table_exported_in_the_triton_36_form_pins_under_this_triton(tmp_path):
    x = torch.randn(64, device=device())
    tuned_step(make_kernel(), preferring(2))(x)
    table_path = tmp_path / "winners.json"
    assert store.export_table(table_path) == 1
    table = json.loads(table_path.read_text())
    assert table["entries"][0]["configs"] == TRITON_36_CONFIGS
    log = tmp_path / "disttune-logs" / "rank-0.log"  # conftest points DISTTUNE_LOG_DIR there
    records = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    assert [r["config"] for r in records if r["event"] == "config"] == TRITON_36_CONFIGS

    timer = TableTimer(lambda info: 1.0)
    pinned = tuned_step(make_kernel(), timer, pinned=table_path, cache_dir=tmp_path / "empty")
    assert torch.equal(pinned(x), x + 64) and timer.seen == []
    assert pinned.report.results[0].source == "pinned"
