"""Eight ranks on CPUs (gloo, ``TRITON_INTERPRET=1``): the code paths the 8-GPU benchmarks take.

A run on 8 GPUs measures something only if AG-GEMM, GEMM-RS and the MoE layer already
work with 8 ranks: these launches check them (the contextual tuner's 8-rank scenarios are in
``test_contextual_dist.py``). Ragged shards and uneven tokens per rank, outputs poisoned.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import checks_per_rank, failure, run_cases

TP_CASES = Path(__file__).with_name("tp_cases.py")
MOE_CASES = Path(__file__).with_name("moe_cases.py")

pytestmark = [pytest.mark.skipif(torch.cuda.is_available(), reason="CPU variant (8 ranks on one GPU host is not a test)"),
              pytest.mark.slow]


def test_tp_gemms_on_eight_ranks(tmp_path):
    records = run_cases(TP_CASES, ["ag_gemm", "gemm_rs"], tmp_path, 8, args=["--size", "tiny", "--dtypes", "float16"],
                        timeout=420)
    # AG-GEMM: 2 shapes (ragged; rank 0 without rows) x 3 ops (2 designs, fused in 4 chunks) x 2 calls,
    # then GEMM-RS: 2 designs x 2 calls
    assert checks_per_rank(records) == [16] * 8


def test_moe_layer_on_eight_ranks(tmp_path):
    (layer,) = run_cases(MOE_CASES, ["layer"], tmp_path, 8, timeout=420,
                         extra_env={"DISTTUNE_TIMEOUT": "120", "DISTTUNE_CACHE_DIR": str(tmp_path / "store")}).values()
    for rank, record in enumerate(layer):
        assert record["ok"], failure(record)
        for check in record["checks"]:
            assert check["gathered_ok"] and check["shape_ok"] and check["chunk_refused"], (rank, check)
            for name in ("ag_err", "expert_err", "rs_err", "rs_stacked_err", "layer_err"):
                assert check[name] < 2e-2, (rank, name, check)
