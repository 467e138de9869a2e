"""Generated config spaces: the product, each pruning rule with its count and reason, the default spaces."""

from __future__ import annotations

import pytest
import torch
import triton

import disttune
from disttune.space import DEFAULT_BUDGET, DeviceBudget, device_budget, gemm_space, grouped_gemm_space

SMALL_GPU = DeviceBudget(shared_per_block=49152, shared_per_sm=65536, registers_per_sm=65536, threads_per_sm=2048,
                         sm_count=8, source="test budget")


def test_space_is_the_product_in_order_with_options_split_out():
    configs = disttune.space(BLOCK_M=[16, 32], BLOCK_N=[16], BLOCK_K=[16], num_warps=[1, 2], num_stages=[1])
    assert configs.generated == 4 and len(configs) == 4 and sum(configs.pruned.values()) == 0
    assert all(isinstance(c, triton.Config) for c in configs)
    assert [(c.kwargs["BLOCK_M"], c.num_warps) for c in configs] == [(16, 1), (16, 2), (32, 1), (32, 2)]
    assert "BLOCK_M" in configs[0].kwargs and "num_warps" not in configs[0].kwargs


def test_each_rule_prunes_and_says_why():
    configs = disttune.space(
        BLOCK_M=[8, 64, 256], BLOCK_N=[64, 128], BLOCK_K=[32, 64], num_warps=[1, 4], num_stages=[2, 6],
        problem={"M": 100, "N": 256, "K": 96}, divisible=["K"], dtype=torch.float16, budget=SMALL_GPU,
        predicate=lambda c: "GROUP odd" if c.kwargs["BLOCK_N"] == 128 and c.num_warps == 1 else True)
    assert configs.generated == 3 * 2 * 2 * 2 * 2
    pruned = configs.pruned
    assert pruned["tl.dot minimum"] == 16 and "BLOCK_M=8 below 16" in configs.examples["tl.dot minimum"]
    # BLOCK_M=256 > 128 (M=100 padded) and BLOCK_K=64 does not divide K=96
    assert pruned["problem size"] == 16 + 8
    assert configs.examples["problem size"] == "K=96 not divisible by BLOCK_K=64"  # the first config it pruned
    for config in configs:
        bm, bn, bk = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.kwargs["BLOCK_K"]
        assert config.num_stages * (bm * bk + bk * bn) * 2 <= SMALL_GPU.shared_per_block
        assert (bm * bn + (bm * bk + bk * bn) / 2) / (config.num_warps * 32) <= 255
        assert not (bn == 128 and config.num_warps == 1)
    assert pruned["shared memory"] > 0 and "B shared memory > 49152 B" in configs.examples["shared memory"]
    assert pruned["registers"] > 0 and "registers/thread > 255" in configs.examples["registers"]
    assert configs.examples.get("predicate") in (None, "GROUP odd")
    assert len(configs) + sum(pruned.values()) == configs.generated
    summary = configs.summary()
    assert summary.startswith(f"generated 48, kept {len(configs)}, pruned {48 - len(configs)}")
    assert "test budget" in summary


def test_the_predicate_may_reject_with_false():
    configs = disttune.space(BLOCK=[1, 2, 3, 4], predicate=lambda c: c.kwargs["BLOCK"] % 2 == 0)
    assert [c.kwargs["BLOCK"] for c in configs] == [2, 4]
    assert configs.pruned["predicate"] == 2 and configs.examples["predicate"] == "rejected by the predicate"


def test_bad_requests_are_clear_errors():
    with pytest.raises(ValueError, match="at least one choice"):
        disttune.space()
    with pytest.raises(ValueError, match="non-empty list"):
        disttune.space(BLOCK_M=[])
    with pytest.raises(ValueError, match="problem= does not size"):
        disttune.space(BLOCK_K=[16], divisible=["K"])
    with pytest.raises(ValueError, match="every config was pruned"):
        disttune.space(BLOCK_M=[8])


def test_without_a_gpu_the_budget_is_the_documented_default():
    if torch.cuda.is_available():
        assert device_budget().source.startswith("cuda:")
    else:
        assert device_budget() == DEFAULT_BUDGET and "no GPU" in DEFAULT_BUDGET.source


def test_default_gemm_spaces_fit_the_budget_and_the_shape():
    big = gemm_space(8192, 8192, 8192, dtype=torch.bfloat16, budget=DEFAULT_BUDGET, small=False)
    assert big.generated == 432 and len(big) >= 200
    assert big.pruned["shared memory"] > 0 and big.pruned["registers"] > 0
    narrow = gemm_space(96, 64, 64, small=False, budget=DEFAULT_BUDGET)
    assert all(c.kwargs["BLOCK_K"] <= 64 and c.kwargs["BLOCK_N"] <= 64 for c in narrow)
    assert narrow.pruned["problem size"] > 0
    tiny = gemm_space(96, 64, 64, small=True)
    assert tiny.generated == 16 and all(c.num_warps == 1 for c in tiny)
    experts = grouped_gemm_space(48, 2048, 1024, small=False, budget=SMALL_GPU)
    assert all(c.kwargs["BLOCK_M"] <= 64 for c in experts) and experts.pruned["shared memory"] > 0
