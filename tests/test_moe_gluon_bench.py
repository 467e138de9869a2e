"""bench/moe_gluon.py's Gluon kernels compile for Hopper on a CPU machine, down to warpgroup MMAs.

Gluon has no interpreter, so CPUs cannot run these kernels; compiling them for ``sm_90a``
(Triton ships ptxas) still catches a Gluon API change or a kernel that no longer lowers to
``wgmma`` and, for the warp-specialized one, to a producer warp with its own register budget.
The bench checks their results on the GPU before timing them.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

BENCH = Path(__file__).resolve().parents[1] / "bench" / "moe_gluon.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("moe_gluon_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compile_for_hopper(jit_fn, constexprs: dict, num_warps: int):
    pointers = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", "weights_ptr": "*fp32",
                "sorted_ids_ptr": "*i32", "expert_offs_ptr": "*i32"}
    signature = {name: "constexpr" if name in constexprs else pointers.get(name, "i32") for name in jit_fn.arg_names}
    return triton.compile(GluonASTSource(jit_fn, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps})


@pytest.mark.parametrize("kind, k_major, flat", [("pipelined", False, False), ("pipelined", True, True),
                                                 ("warp-specialized", False, True), ("warp-specialized", True, False)])
def test_gluon_kernel_compiles_to_wgmma_for_hopper(bench, kind, k_major, flat):
    config = bench.gluon_config(128, 256, 64, 8, 3, 8)
    constexprs = dict(E_POW2=8, C_FLAT=flat, MUL_WEIGHT=flat, B_KMAJOR=k_major, NUM_SMS=132, **config.kwargs)
    if kind == "pipelined":
        constexprs["TMA_STORE"] = not flat
    else:
        constexprs["LOADER_REGS"] = 40
    compiled = compile_for_hopper(bench.KERNELS[kind], constexprs, config.num_warps)
    ptx = compiled.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx  # tensor cores fed by TMA
    slots = 3 * (128 + 256) * 64 * 2
    assert compiled.metadata.shared >= slots  # every slot lives in shared memory
    if kind == "warp-specialized":
        budgets = {int(n) for n in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}
        assert 40 in budgets and max(budgets) > 168  # a 40-register producer warp, the MMA warps get the rest
    if not flat and kind == "pipelined":
        assert "cp.async.bulk.tensor.2d.global.shared" in ptx  # the TMA store of full tiles


def test_weight_layouts_the_kernels_cannot_read_are_refused(bench):
    row_major = torch.empty(4, 128, 96)
    assert bench.weight_is_k_major(row_major) is False
    assert bench.weight_is_k_major(torch.empty(4, 96, 128).transpose(1, 2)) is True
    with pytest.raises(ValueError, match="K % 64 == 0"):
        bench.weight_is_k_major(torch.empty(4, 100, 96))
    with pytest.raises(ValueError, match="contiguous"):
        bench.weight_is_k_major(torch.empty(8, 128, 96)[::2])  # experts not adjacent
