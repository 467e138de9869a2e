"""AllGather-GEMM and GEMM-ReduceScatter: correctness on 2 and 4 ranks, tuning in context, bad input.

CPU: gloo + ``TRITON_INTERPRET=1`` at small sizes (both AG-GEMM designs run the same GEMM code as
on GPUs after a gloo gather). GPU (2 GPUs, NCCL, symmetric memory): bf16 and fp16 at larger sizes.
The checks themselves live in ``tests/tp_cases.py`` (poisoned outputs, fresh inputs per check,
ragged shards, references from torch collectives).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from helpers import checks_per_rank, describe, failure, run_cases, run_launch, run_python, write_script

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
CASES = Path(__file__).with_name("tp_cases.py")


@pytest.mark.skipif(GPUS > 0, reason="CPU (gloo, interpreter) variant; GPUs run test_tp_on_two_gpus")
@pytest.mark.slow
def test_two_ranks_both_dtypes_and_tuned_mlp_agree(tmp_path):
    records = run_cases(CASES, ["ag_gemm", "gemm_rs", "tuned_mlp"], tmp_path, 2, timeout=240)
    assert min(checks_per_rank(records)) >= 30
    winners = records["tuned_mlp"][0]["winners"]
    assert len([w for w in winners if w[0].endswith(".shard_ordered_gemm")]) == 4, winners


@pytest.mark.skipif(GPUS > 0, reason="CPU (gloo, interpreter) variant")
@pytest.mark.slow
def test_four_ranks_ragged_shards_and_the_fused_gemm_rs_tuned_in_context(tmp_path):
    records = run_cases(CASES, ["ag_gemm", "gemm_rs", "tuned_fused_gemm_rs"], tmp_path, 4, args=["--dtypes", "float16"],
                        timeout=400)
    assert all(n > 0 for n in checks_per_rank(records))
    assert len(records["tuned_fused_gemm_rs"][0]["winners"]) == 2


@pytest.mark.slow
def test_inconsistent_inputs_give_the_same_error_on_every_rank(tmp_path):
    (per_rank,) = run_cases(CASES, ["inconsistent_inputs"], tmp_path, 2, timeout=120).values()
    for record in per_rank:
        assert record["error_type"] == "ValueError", failure(record)
        first_line = record["error_message"].splitlines()[0]
        assert "inconsistent inputs (ranks [1] differ from rank 0)" in first_line, failure(record)


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


def test_group_facts_asked_once_follow_a_new_default_group(tmp_path):
    """group_info keeps each group's facts, and a process group made again (destroyed, re-initialized under
    another backend name) gets its own, as does a subgroup; the facts kept do not keep a destroyed group alive
    (a group freed at exit instead aborts the process); after destroy it raises again."""
    script = write_script(tmp_path, """
        import gc, json, weakref
        import torch.distributed as dist
        from disttune.kernels.symm import uses_nccl
        from disttune.kernels.tp_common import group_info
        seen = []
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
        seen.append([group_info(None).world_size, group_info(None).group is None, uses_nccl()])
        sub = dist.new_group([0])
        seen.append([group_info(sub).world_size, group_info(sub).group is sub])
        world = weakref.ref(dist.GroupMember.WORLD)
        del sub
        dist.destroy_process_group()
        gc.collect()
        seen.append(world() is None)  # the facts kept do not keep the group alive
        try:
            group_info(None)
            seen.append("no error")
        except RuntimeError as err:
            seen.append(str(err)[:37])
        # a new default group, another backend name
        dist.init_process_group("cpu:gloo", rank=0, world_size=1, store=dist.HashStore())
        seen.append([group_info(None).backend, uses_nccl()])
        dist.destroy_process_group()
        print(json.dumps(seen))
    """)
    proc = run_python([str(script)], timeout=60)
    assert proc.returncode == 0, describe(proc)
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen == [[1, True, False], [1, True], True, "torch.distributed is not initialized:",
                    ["cpu:gloo", False]], seen


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA GPUs")
def test_tp_on_two_gpus(tmp_path):
    records = run_cases(CASES, ["ag_gemm", "gemm_rs", "tuned_mlp", "tuned_fused_gemm_rs"], tmp_path, 2, timeout=540,
                        args=["--size", "large", "--dtypes", "bfloat16,float16"])
    assert all(n > 0 for n in checks_per_rank(records))
    for kernel, key, occurrence, config in records["tuned_mlp"][0]["winners"]:
        print(f"winner {kernel.rsplit('.', 1)[-1]} key={key} #{occurrence}: {config}")


@pytest.mark.slow
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


def test_auto_runs_one_persistent_gemm_on_gpus_from_three_ranks_and_a_launch_per_shard_below():
    from disttune.kernels.ag_gemm import auto_design

    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert [auto_design(world, gpu) for world in (1, 2, 3, 4, 8)] == ["decomposed"] * 2 + ["fused"] * 3
    assert {auto_design(world, cpu) for world in (1, 2, 4, 8)} == {"decomposed"}  # both designs gather first there


def test_gemm_rs_auto_computes_the_partials_in_one_launch_on_gpus_from_two_ranks():
    from disttune.kernels.gemm_rs import auto_design, default_pieces

    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert [auto_design(world, gpu) for world in (1, 2, 3, 4, 8)] == ["decomposed"] + ["fused"] * 4
    assert {auto_design(world, cpu) for world in (1, 2, 4, 8)} == {"decomposed"}
    assert [default_pieces(world, fused=True) for world in (1, 2, 3, 4, 8)] == [2, 2, 1, 1, 1]
    assert {default_pieces(world, fused=False) for world in (1, 2, 4, 8)} == {4}


@pytest.mark.slow
def test_one_ranks_bad_input_is_an_error_on_every_rank_and_a_rank_without_columns_still_gathers(tmp_path):
    (per_rank,) = run_cases(CASES, ["bad_input_one_rank"], tmp_path, 2, timeout=120).values()
    for record in per_rank:
        assert record["ok"], failure(record)
        assert record["raised"] is not None and "invalid input on rank(s) [1]" in record["raised"], record
    assert [(r["gathered_shape"], r["gathered_ok"]) for r in per_rank] == [([16, 16], True), ([16, 0], True)]


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


@pytest.mark.parametrize("last_launches", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("rows", [(4096, 4096), (2048,) * 4, (3001, 0, 2999, 5), (100, 300)], ids=str)
def test_gemm_rs_computes_each_partial_once_and_the_last_in_pieces_pushed_as_they_are_done(rows, last_launches):
    """The partial GEMMs GEMM-RS launches cover every destination's rows exactly once, in push order; the last
    destination's partial comes in up to ``last_launches`` GEMMs of whole pieces, each pushing its own pieces."""
    from disttune.kernels.gemm_rs import launch_groups
    from disttune.kernels.symm import chunk_rows, push_order

    chunks = 4
    step = chunk_rows(rows, chunks)
    for rank in range(len(rows)):
        pushes = [(d, f"free {d}", [f"piece {d}.{c}" for c in range(-(-rows[d] // step))])
                  for d in push_order(rank, len(rows)) if rows[d]]
        groups = launch_groups(pushes, rows, step, last_launches)
        assert [d for d, *_ in groups] == sorted((d for d, *_ in groups), key=[d for d, _, _ in pushes].index)
        for d, free, pieces in pushes:
            mine = [(first, end, part) for dest, f, first, end, part in groups if dest == d and f == free]
            assert [piece for _, _, part in mine for piece in part] == pieces  # each piece pushed once, in order
            assert [first for first, _, _ in mine] == [0] + [end for _, end, _ in mine[:-1]]  # rows contiguous
            assert mine[-1][1] == rows[d]
            for first, end, part in mine:  # a launch computes exactly the rows of the pieces it pushes
                assert first == pieces.index(part[0]) * step and end == min(rows[d], (pieces.index(part[-1]) + 1) * step)
            last = d == pushes[-1][0]
            per_launch = -(-len(pieces) // last_launches)  # pieces per GEMM: at most last_launches GEMMs
            assert len(mine) == (-(-len(pieces) // per_launch) if last else 1)
            if last:
                assert all(len(part) == per_launch for _, _, part in mine[:-1])


@pytest.mark.parametrize("rows", [(300, 0, 270, 20), (512, 512), (17, 300, 0)], ids=str)
def test_partials_gemm_writes_every_other_ranks_rows_and_flags_each_piece_once_done(rows):
    """The fused GEMM-RS launch: every shard but the launching rank's lands in its slot (the own slot untouched),
    each piece's ready flag holds the epoch, and every tile count is back at zero for the next call."""
    import triton
    from disttune.kernels.shard_gemm import make_shard_gemm_kernel, partials_gemm

    kernel = make_shard_gemm_kernel([triton.Config({"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "GROUP_M": 2})])
    device = "cuda" if GPUS else "cpu"
    torch.manual_seed(0)
    world, K, N, chunks, step = len(rows), 32, 24, 2, 256
    a = torch.randn(sum(rows), K, dtype=torch.float16, device=device)
    b = torch.randn(K, N, dtype=torch.float16, device=device)
    full, starts = a.float() @ b.float(), [sum(rows[:r]) for r in range(world)]
    for rank in range(world):
        partials = torch.full((world, max(rows), N), float("nan"), dtype=torch.float16, device=device)
        signals = torch.zeros(2 * world * chunks, dtype=torch.int32, device=device)
        for epoch in (5, 6):  # a second call: the counts start from zero again
            assert partials_gemm(a, b, partials, signals, rows, rank, kernel=kernel, chunks=chunks, chunk_rows=step,
                                 epoch=epoch)
            counts, ready = signals.view(2, world, chunks).cpu()
            assert not counts.any(), counts
            for d in range(world):
                pieces = -(-rows[d] // step) if d != rank else 0
                assert ready[d].tolist() == [epoch if c < pieces else 0 for c in range(chunks)], (rank, d, ready)
                if d != rank:
                    torch.testing.assert_close(partials[d, :rows[d]].float(), full[starts[d]:starts[d] + rows[d]],
                                               atol=1e-2, rtol=1e-2)
        assert partials[rank].isnan().all()


def test_partials_gemm_refuses_pieces_a_tile_could_span_or_more_pieces_than_flags():
    from disttune.kernels.shard_gemm import partials_gemm

    a, b = torch.zeros(600, 16, dtype=torch.float16), torch.zeros(16, 16, dtype=torch.float16)
    partials, signals = torch.zeros(2, 300, 16, dtype=torch.float16), torch.zeros(8, dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple of 256"):
        partials_gemm(a, b, partials, signals, (300, 300), 0, chunks=2, chunk_rows=160)
    with pytest.raises(ValueError, match="at most chunks=1 pieces"):
        partials_gemm(a, b, partials, signals, (300, 300), 0, chunks=1, chunk_rows=256)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_descriptor_scratch_is_one_block_per_stream_and_the_graphs_own_under_capture():
    from disttune.kernels import shard_gemm

    stream = torch.cuda.current_stream().cuda_stream
    first = shard_gemm.descriptor_scratch(1024, 128, stream)
    assert shard_gemm.descriptor_scratch(512, 128, stream) is first
    bigger = shard_gemm.descriptor_scratch(first.numel() + 1, 128, stream)
    assert bigger is not first and bigger.numel() > first.numel()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert shard_gemm.descriptor_scratch(512, 128, side.cuda_stream) is not bigger
    graph, captured = torch.cuda.CUDAGraph(), []
    with torch.cuda.graph(graph):
        captured.append(shard_gemm.descriptor_scratch(512, 128, torch.cuda.current_stream().cuda_stream))
    assert all(captured[0] is not block for block in shard_gemm._scratch_blocks.values())
