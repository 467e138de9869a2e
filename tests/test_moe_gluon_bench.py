"""bench/moe_gluon.py's Gluon kernels compile for Hopper on a CPU machine, down to warpgroup MMAs.

Gluon has no interpreter, so CPUs cannot run these kernels; compiling them for ``sm_90a``
(Triton ships ptxas) still catches a Gluon API change or a kernel that no longer lowers to
``wgmma`` and, for the warp-specialized one, to a producer warp with its own register budget.
The bench checks their results on the GPU before timing them.

The compiles run in a fresh process without ``TRITON_INTERPRET``: in this test process the
interpreter has patched ``triton.language`` for the other tests, and Gluon's code generator
then fails.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from helpers import describe, load_bench, repo_env, run_command, write_script

BENCH = Path(__file__).resolve().parents[1] / "bench" / "moe_gluon.py"

# (kernel, K-major W, flat output with the routing weight)
VARIANTS = [("pipelined", False, False), ("pipelined", True, True),
            ("warp-specialized", False, True), ("warp-specialized", True, False)]

COMPILE_SCRIPT = """
import importlib.util, json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

spec = importlib.util.spec_from_file_location("moe_gluon_bench", sys.argv[1])
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)
POINTERS = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", "weights_ptr": "*fp32",
            "sorted_ids_ptr": "*i32", "expert_offs_ptr": "*i32"}
config = bench.gluon_config(128, 256, 64, 8, 3, 8)
for kind, k_major, flat in json.loads(sys.argv[2]):
    constexprs = dict(E_POW2=8, C_FLAT=flat, MUL_WEIGHT=flat, B_KMAJOR=k_major, NUM_SMS=132, **config.kwargs)
    if kind == "pipelined":
        constexprs["TMA_STORE"] = not flat
    else:
        constexprs["LOADER_REGS"] = 40
    fn = bench.KERNELS[kind]
    signature = {n: "constexpr" if n in constexprs else POINTERS.get(n, "i32") for n in fn.arg_names}
    compiled = triton.compile(GluonASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": config.num_warps})
    ptx = compiled.asm["ptx"]
    print(json.dumps(dict(
        variant=[kind, k_major, flat], shared=compiled.metadata.shared,
        wgmma="wgmma.mma_async" in ptx, tma_load="cp.async.bulk.tensor.2d.shared::cluster.global" in ptx,
        tma_store="cp.async.bulk.tensor.2d.global.shared" in ptx,
        register_budgets=sorted({int(n) for n in re.findall(r"setmaxnreg\\.\\w+\\.sync\\.aligned\\.u32\\s+(\\d+)", ptx)}))))
"""


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    script = write_script(tmp_path_factory.mktemp("gluon"), COMPILE_SCRIPT, "compile_gluon.py")
    env = repo_env()
    env.pop("TRITON_INTERPRET", None)
    proc = run_command([sys.executable, str(script), str(BENCH), json.dumps(VARIANTS)], timeout=300, env=env)
    assert proc.returncode == 0, describe(proc)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return {tuple(row["variant"]): row for row in rows}


@pytest.mark.parametrize("kind, k_major, flat", VARIANTS)
def test_gluon_kernel_compiles_to_wgmma_for_hopper(compiled, kind, k_major, flat):
    row = compiled[(kind, k_major, flat)]
    assert row["wgmma"] and row["tma_load"]  # tensor cores fed by TMA
    assert row["shared"] >= 3 * (128 + 256) * 64 * 2  # every operand slot lives in shared memory
    if kind == "warp-specialized":
        budgets = row["register_budgets"]
        assert 40 in budgets and max(budgets) > 168  # a 40-register producer warp, the MMA warps get more
    else:
        assert row["register_budgets"] == []
        assert row["tma_store"] == (not flat)  # the TMA store of full tiles, only where asked


@pytest.fixture(scope="module")
def bench():
    return load_bench("moe_gluon")


def test_weight_layouts_the_kernels_cannot_read_are_refused(bench):
    assert bench.weight_is_k_major(torch.empty(4, 128, 96)) is False
    assert bench.weight_is_k_major(torch.empty(4, 96, 128).transpose(1, 2)) is True
    with pytest.raises(ValueError, match="K % 64 == 0"):
        bench.weight_is_k_major(torch.empty(4, 100, 96))
    with pytest.raises(ValueError, match="contiguous"):
        bench.weight_is_k_major(torch.empty(8, 128, 96)[::2])  # experts not adjacent


def test_append_rows_adds_json_lines_and_makes_the_folder(bench, tmp_path):
    path = tmp_path / "new" / "rows.jsonl"
    bench.append_rows(path, [{"kernel": "a", "ms": 1.5}])
    bench.append_rows(path, [{"kernel": "b", "ms": 2.0}])
    assert [json.loads(line) for line in path.read_text().splitlines()] == [{"kernel": "a", "ms": 1.5},
                                                                           {"kernel": "b", "ms": 2.0}]
