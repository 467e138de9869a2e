"""AllGather-GEMM and GEMM-ReduceScatter: correctness on 2 and 4 ranks, tuning in context, bad input.

CPU: gloo + ``TRITON_INTERPRET=1`` at small sizes (both AG-GEMM designs run the same GEMM code as
on GPUs after a gloo gather). GPU (2 GPUs, NCCL, symmetric memory): bf16 and fp16 at larger sizes.
The checks themselves live in ``tests/tp_cases.py`` (poisoned outputs, fresh inputs per check,
ragged shards, references from torch collectives).
"""

from __future__ import annotations

import re

import pytest
import torch

from helpers import describe, run_launch, write_script

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def passed_ranks(output: str) -> dict[int, int]:
    return {int(r): int(n) for r, n in re.findall(r"^rank (\d+): (\d+) checks passed$", output, flags=re.M)}


@pytest.mark.skipif(GPUS > 0, reason="CPU (gloo, interpreter) variant; GPUs run test_tp_on_two_gpus")
@pytest.mark.slow
def test_two_ranks_both_dtypes_and_tuned_mlp_agree():
    proc = run_launch(["--nproc_per_node=2", "tests/tp_cases.py", "--tune"], timeout=240)
    assert proc.returncode == 0, describe(proc)
    ranks = passed_ranks(proc.stdout)
    assert sorted(ranks) == [0, 1] and min(ranks.values()) >= 30, describe(proc)
    assert len(re.findall(r"^winner shard_ordered_gemm", proc.stdout, flags=re.M)) == 4, describe(proc)


@pytest.mark.skipif(GPUS > 0, reason="CPU (gloo, interpreter) variant")
@pytest.mark.slow
def test_four_ranks_ragged_shards():
    proc = run_launch(["--nproc_per_node=4", "tests/tp_cases.py", "--dtypes", "float16"], timeout=300)
    assert proc.returncode == 0, describe(proc)
    assert sorted(passed_ranks(proc.stdout)) == [0, 1, 2, 3], describe(proc)


def test_inconsistent_inputs_give_the_same_error_on_every_rank(tmp_path):
    script = write_script(tmp_path, """
        import os, sys, torch
        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")
        from disttune import dist as dt_dist
        from disttune.kernels.ag_gemm import AllGatherGEMM
        info = dt_dist.init()
        K = 32 if info.rank == 0 else 48          # rank 1 has a different inner size
        a = torch.randn(8, K, dtype=torch.float16, device=info.device)
        b = torch.randn(K, 16, dtype=torch.float16, device=info.device)
        try:
            AllGatherGEMM()(a, b)
        except ValueError as err:
            sys.stdout.write(f"rank {info.rank} error: {str(err).splitlines()[0]}\\n")  # one write per line
        else:
            sys.stdout.write(f"rank {info.rank} no error\\n")
        sys.stdout.flush()
        dt_dist.destroy()
    """)
    proc = run_launch(["--nproc_per_node=2", str(script)], timeout=120)
    assert proc.returncode == 0, describe(proc)
    errors = re.findall(r"^rank (\d) error: (.*)$", proc.stdout, flags=re.M)
    assert sorted(r for r, _ in errors) == ["0", "1"], describe(proc)
    assert all("inconsistent inputs (ranks [1] differ from rank 0)" in msg for _, msg in errors), describe(proc)


def test_local_input_errors_name_the_problem():
    import torch.distributed as dist

    from disttune.kernels.shard_gemm import matmul_shards

    device = "cuda" if GPUS else "cpu"
    a = torch.randn(8, 12, dtype=torch.float16, device=device)  # 12 halves = 24 bytes per row: not 16-byte aligned
    b = torch.randn(12, 16, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match="rows aligned to 16 bytes"):
        matmul_shards(a, b)
    with pytest.raises(ValueError, match="shapes do not chain"):
        matmul_shards(torch.randn(8, 16, dtype=torch.float16, device=device), b)
    assert not dist.is_initialized()
    from disttune.kernels.ag_gemm import AllGatherGEMM

    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        AllGatherGEMM()


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA GPUs")
def test_tp_on_two_gpus():
    proc = run_launch(["--nproc_per_node=2", "tests/tp_cases.py", "--size", "large", "--dtypes", "bfloat16,float16",
                       "--tune"], timeout=540)
    assert proc.returncode == 0, describe(proc)
    assert sorted(passed_ranks(proc.stdout)) == [0, 1], describe(proc)
    print(proc.stdout[-3000:])


def test_tp_mlp_example_runs_and_checks_itself():
    proc = run_launch(["--nproc_per_node=2", "examples/tp_mlp.py"], timeout=240)
    assert proc.returncode == 0, describe(proc)
    assert "correct on every rank: True" in proc.stdout, describe(proc)
    assert len(re.findall(r"^  shard_ordered_gemm .*\(tuned\)$", proc.stdout, flags=re.M)) == 4, describe(proc)


def test_chunks_of_pushed_shards_start_on_tile_boundaries():
    from disttune.kernels.symm import CHUNK_ALIGN, chunk_rows

    assert chunk_rows([4096, 4096], 4) == 1024
    assert chunk_rows([1000, 999], 4) == 256  # 250 rows rounded up to the alignment
    assert chunk_rows([3001, 3000], 1) == 3072  # one chunk covers the largest shard
    for rows, chunks in (([4096, 4096], 4), ([1000, 999], 4), ([37, 5000, 12], 3)):
        size = chunk_rows(rows, chunks)
        assert size % CHUNK_ALIGN == 0 and -(-max(rows) // size) <= chunks


def test_one_ranks_bad_input_is_an_error_on_every_rank_and_a_rank_without_columns_still_gathers(tmp_path):
    script = write_script(tmp_path, """
        import os, sys, torch
        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")
        from disttune import dist as dt_dist
        from disttune.kernels.ag_gemm import AllGatherGEMM, ag_gemm_reference
        from disttune.kernels.gemm_rs import GemmReduceScatter
        info = dt_dist.init()
        dev = info.device
        # 1. rank 1's A has 12 fp16 columns (24-byte rows): a local error, raised on both ranks
        K = 16 if info.rank == 0 else 12
        try:
            GemmReduceScatter()(torch.randn(8, K, dtype=torch.float16, device=dev),
                                torch.randn(K, 16, dtype=torch.float16, device=dev))
        except ValueError as err:
            sys.stdout.write(f"rank {info.rank} error: {str(err).splitlines()[0]}\\n")
        # 2. rank 1 owns no columns of B: it still serves its rows to rank 0
        a = torch.randn(8, 16, dtype=torch.float16, device=dev)
        b = torch.randn(16, 16 if info.rank == 0 else 0, dtype=torch.float16, device=dev)
        out = AllGatherGEMM()(a, b)
        want = ag_gemm_reference(a, b)
        ok = tuple(out.shape) == tuple(want.shape) and (out.numel() == 0 or torch.allclose(out.float(), want.float(), atol=1e-2))
        sys.stdout.write(f"rank {info.rank} gathered {tuple(out.shape)} ok={ok}\\n")
        sys.stdout.flush()
        dt_dist.destroy()
    """)
    proc = run_launch(["--nproc_per_node=2", str(script)], timeout=120)
    assert proc.returncode == 0, describe(proc)
    errors = re.findall(r"^rank (\d) error: (.*)$", proc.stdout, flags=re.M)
    assert sorted(r for r, _ in errors) == ["0", "1"], describe(proc)
    assert all("invalid input on rank(s) [1]" in msg for _, msg in errors), describe(proc)
    assert re.search(r"^rank 0 gathered \(16, 16\) ok=True$", proc.stdout, flags=re.M), describe(proc)
    assert re.search(r"^rank 1 gathered \(16, 0\) ok=True$", proc.stdout, flags=re.M), describe(proc)


def test_configs_whose_tiles_could_span_two_pushed_chunks_are_pruned():
    import triton

    from disttune.kernels.shard_gemm import MAX_BLOCK_M, prune_shard_configs

    def config(bm):
        return triton.Config({"BLOCK_M": bm, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8}, num_stages=1, num_warps=4)

    args = {"a_ptr": torch.empty(1, 8, dtype=torch.float16), "b_ptr": torch.empty(8, 1, dtype=torch.float16)}
    kept = prune_shard_configs([config(64), config(2 * MAX_BLOCK_M)], args)
    assert [c.kwargs["BLOCK_M"] for c in kept] == [64]
    with pytest.raises(ValueError, match="a tile must not span two pushed chunks"):
        prune_shard_configs([config(2 * MAX_BLOCK_M)], args)
