"""Tests for disttune.kernels.moe: routing, the grouped GEMM, the MLP, AG-MoE / MoE-RS over ranks.

Without a GPU kernels run in the Triton interpreter (fp16/fp32; bf16 is wrong there) and
ranks are gloo processes under torchrun, each launch bounded in wall time. Every check
uses a fresh random routing that leaves some experts without tokens, and NaN-poisoned
outputs so an unwritten tile fails.
"""

from __future__ import annotations

import ast

import os
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first `import triton`

import pytest  # noqa: E402
import triton  # noqa: E402

from disttune.kernels import moe, moe_activation, moe_combine, moe_common, moe_gemm, moe_routing  # noqa: E402
from helpers import failure, run_cases  # noqa: E402
from numerics import rel_error  # noqa: E402

INTERPRET = moe.interpreting()
DEVICE = "cpu" if INTERPRET else "cuda"
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
TOL = {torch.float16: 1e-2, torch.bfloat16: 2e-2, torch.float32: 1e-4 if INTERPRET else 5e-3}
CASES = Path(__file__).with_name("moe_cases.py")
# on GPUs each case compiles its kernels' configs for several keys first (minutes for the 2-rank set)
LAUNCH_TIMEOUT_S = 200 if INTERPRET else 420


def _routing(T, E, k, seed, empty=2):
    """Distinct experts per token; experts E-empty..E-1 get no token."""
    g = torch.Generator().manual_seed(seed)
    weights, ids = torch.rand(T, E - empty, generator=g).topk(k, dim=1)
    return ids.to(DEVICE, torch.int32), (weights / weights.sum(1, keepdim=True)).to(DEVICE)


def _tensors(T, H, N, E, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(DEVICE, dtype)
    w = (torch.randn(E, H, N, generator=g) / H ** 0.5).to(DEVICE, dtype)
    return x, w


# --------------------------------------------------------------------------- routing


@pytest.mark.parametrize("E,k", [(8, 2), (64, 6)])
def test_moe_align_sorts_stably_by_expert(E, k):
    ids, _ = _routing(40, E, k, seed=E + k, empty=3)
    rt = moe.moe_align(ids, E)
    flat = ids.flatten().long()
    sid = rt.sorted_ids.long()
    assert sorted(sid.tolist()) == list(range(40 * k))  # a permutation of the rows
    experts = flat[sid]
    assert (experts[1:] >= experts[:-1]).all()
    assert rt.counts.tolist() == torch.bincount(flat, minlength=E).tolist()
    assert rt.counts[-3:].sum() == 0
    assert rt.expert_offs.tolist() == [0] + torch.cumsum(rt.counts, 0).tolist()
    for e in range(E):  # stable: within an expert, rows keep their (token, choice) order
        seg = sid[rt.expert_offs[e]: rt.expert_offs[e + 1]]
        assert (seg[1:] > seg[:-1]).all()
    assert torch.equal(rt.token_rows(), sid // k)


@pytest.mark.parametrize("groups", [1, 200, 255, 256, 40_000])
def test_routing_sorts_like_a_stable_argsort_for_every_key_width(groups):
    """The sort keys are narrowed to one byte (up to 255 groups), two, or kept: the order and the group
    starts must be a stable argsort's whatever the width, for int64 ids (what torch.topk gives) and for
    the rank-stacked routing, whose groups are ranks x experts."""
    g = torch.Generator().manual_seed(groups)
    ids = torch.randint(0, groups, (301, 3), generator=g).to(DEVICE)
    flat = ids.reshape(-1)
    rt = moe.moe_align(ids, groups)
    assert torch.equal(rt.sorted_ids.long(), torch.sort(flat, stable=True).indices)
    assert rt.expert_offs.tolist() == [0] + torch.cumsum(torch.bincount(flat, minlength=groups), 0).tolist()
    if groups % 2 == 0:  # the same ids as two ranks' of groups / 2 experts each
        experts, tokens = groups // 2, (150, 151)
        local = ids % experts
        stacked = moe.moe_align_stacked(local.to(torch.int32), experts, tokens)
        keys = local.reshape(-1) + torch.repeat_interleave(torch.tensor([0, experts], device=DEVICE),
                                                          torch.tensor(tokens, device=DEVICE) * 3)
        assert torch.equal(stacked.sorted_ids.long(), torch.sort(keys, stable=True).indices)
        assert stacked.expert_offs.tolist() == [0] + torch.cumsum(torch.bincount(keys, minlength=groups), 0).tolist()


@pytest.mark.parametrize("T,k,E,rank_tokens", [(301, 3, 8, None), (90, 6, 64, (40, 0, 50)), (1, 1, 1, None),
                                                (0, 2, 4, None), (40, 2, 1365, (10, 20, 10)),
                                                pytest.param(1400, 6, 64, (500, 0, 900), marks=pytest.mark.slow)])
def test_group_sort_kernel_is_a_stable_argsort(T, k, E, rank_tokens):
    """The routing kernel GPUs use (run here in the interpreter, which moe_align itself does not use):
    several chunks, more rows than one step of the scan counts, a rank without tokens, a strided int64 view,
    and three ids out of range (one in range after a wrap to int32), which go after every group and leave the
    groups' starts as they are."""
    from disttune.kernels.moe_routing import group_sort

    g = torch.Generator().manual_seed(T + E)
    ids = torch.randint(0, E, (T, k + 2), generator=g)[:, 1:k + 1].to(DEVICE)  # int64, row stride k + 2
    keys = ids.reshape(-1).clone()
    if rank_tokens:
        keys += torch.repeat_interleave(torch.arange(len(rank_tokens)) * E, torch.tensor(rank_tokens) * k).to(DEVICE)
    groups = E * len(rank_tokens or (1,))
    if T > 2:  # out of range, one of them only after a wrap to int32
        ids[0, 0], ids[T // 2, 0], ids[T - 1, k - 1] = -1, 2**32 + 1, E
        keys[0], keys[T // 2 * k], keys[-1] = groups, groups, groups
    sorted_ids, offs = group_sort(ids, E, rank_tokens)
    assert sorted_ids.dtype == offs.dtype == torch.int32
    assert torch.equal(sorted_ids.long(), torch.sort(keys, stable=True).indices)
    counts = torch.bincount(keys, minlength=groups + 1)[:groups]
    assert offs.tolist() == [0] + torch.cumsum(counts, 0).tolist()


def test_moe_align_block_size_layout():
    E, k, bm = 8, 2, 16
    ids, _ = _routing(30, E, k, seed=5, empty=2)
    sorted_ids, expert_ids, total = moe.moe_align_block_size(ids, E, bm)
    R = 30 * k
    assert int(total) == sorted_ids.numel() and sorted_ids.numel() % bm == 0
    assert expert_ids.numel() == sorted_ids.numel() // bm
    real = sorted_ids[sorted_ids != R].long()
    assert sorted(real.tolist()) == list(range(R))  # every row once, the rest is the sentinel
    flat = ids.flatten().long()
    for b, e in enumerate(expert_ids.tolist()):
        block = sorted_ids[b * bm:(b + 1) * bm].long()
        block = block[block != R]
        assert block.numel() > 0 and (flat[block] == e).all()
    assert set(expert_ids.tolist()) == set(flat.tolist())  # experts without tokens own no block


def test_routing_errors():
    ids = torch.tensor([[0, 8]], device=DEVICE)
    with pytest.raises(ValueError, match=r"expert ids must lie in \[0, 8\)"):
        moe.moe_align(ids, 8)
    with pytest.raises(ValueError, match="2-D"):
        moe.moe_align(ids[0], 8)
    with pytest.raises(TypeError, match="integer"):
        moe.moe_align(ids.float(), 8)
    with pytest.raises(ValueError, match="num_experts"):
        moe.moe_align(ids, 0)


# --------------------------------------------------------------------------- grouped GEMM

# (E, top_k, a_order, out_order, weighted, dtype, config index): every mode, both expert
# counts and top-ks, each CPU config.
GEMM_CASES = [
    (8, 2, "token", "sorted", False, torch.float16, 0),
    (64, 6, "token", "flat", True, torch.float16, 1),
    (8, 6, "flat", "sorted", True, torch.float32, 2),
    (64, 2, "sorted", "flat", False, torch.float16, 0),
    (64, 6, "sorted", "sorted", True, torch.float16, 2),
    (8, 2, "flat", "flat", False, torch.float32, 1),
]


@pytest.mark.parametrize("E,k,a_order,out_order,weighted,dtype,ci", GEMM_CASES)
def test_moe_gemm_with_config_matches_reference(E, k, a_order, out_order, weighted, dtype, ci):
    T, H, N = 24, 40, 48  # K, N not multiples of the blocks: masked edges
    x, w = _tensors(T, H, N, E, dtype, seed=E * 10 + k)
    ids, wts = _routing(T, E, k, seed=E + 7 * k, empty=E // 4)
    rt = moe.moe_align(ids, E)
    a = {"token": x, "flat": x.repeat_interleave(k, 0), "sorted": rt.permute(x)}[a_order]
    out = torch.full((T * k, N), float("nan"), dtype=dtype, device=DEVICE)
    res = moe.moe_gemm_with_config(a, w, rt, moe.CPU_MOE_CONFIGS[ci], a_order=a_order, out=out,
                                   out_order=out_order, weights=wts if weighted else None)
    assert res is out
    got = out if out_order == "flat" else rt.unsort(out)
    ref = moe.moe_gemm_reference(x, ids, w, wts if weighted else None)
    assert rel_error(got, ref) < TOL[dtype]


@pytest.mark.parametrize("rank_tokens,by_rank,E,k,modes", [
    ((), True, 8, 2, False), ((61, 0, 39), True, 4, 3, False), ((61, 0, 39), False, 4, 3, False),
    ((24,), True, 64, 6, False), ((61, 0, 39), True, 4, 3, True),
    pytest.param((2048, 0, 2048), True, 64, 6, False,  # 24,576 rows: 24 chunks, a grid of every SM
                 marks=pytest.mark.skipif(INTERPRET, reason="GPU only: many programs wait on each other there"))])
def test_the_gemm_that_sorts_its_routing_matches_sort_then_gemm(rank_tokens, by_rank, E, k, modes):
    """moe_gemm_sorting (one launch: the programs sort the routing, wait for every chunk, then multiply) gives
    the routing and the rows that the sort and moe_gemm give, bit for bit with one config: a plain routing,
    every rank's ids stacked by rank (a rank without tokens) or grouped by expert, 300 rows in two chunks of
    the sort; the ids a strided int64 view; A in flat order, routing weights and rows stored in flat order.
    Launched twice; the chunk count and the programs' count, one pair for every launch on the stream, are back
    at zero after each launch (the last program through resets them, so the next launch waits again). A in
    sorted order is refused (it needs the routing first). On a GPU, a full-size case: many chunk programs and
    many waiting ones."""
    T = sum(rank_tokens) or 150
    H, N = 40, 48
    x, w = _tensors(T, H, N, E, torch.float16, seed=T + E)
    ids, wts = _routing(T, E, k, seed=k, empty=1)
    a, orders = (x.repeat_interleave(k, 0), dict(a_order="flat", out_order="flat", weights=wts)) if modes else (x, {})
    ids = torch.stack([ids.long(), ids.long()], dim=2).flatten(1)[:, ::2]  # int64, column stride 2
    kernel = moe.make_moe_kernel([moe.gemm_config(32, 32, 32, 2, 1, 1)])
    if not rank_tokens:
        routing = moe.moe_align(ids, E, check_range=False)
    elif by_rank:
        routing = moe.moe_align_stacked(ids, E, rank_tokens)
    else:
        routing = moe.moe_align_gathered(ids, E, rank_tokens)
    want = moe.moe_gemm(a, w, routing, kernel=kernel, **orders)
    for _ in range(2):
        out = torch.full((T * k, N), float("nan"), dtype=torch.float16, device=DEVICE)
        got, got_routing = moe.moe_gemm_sorting(a, w, ids, rank_tokens, by_rank=by_rank, out=out, kernel=kernel,
                                                **orders)
        assert got is out
        assert torch.equal(got_routing.sorted_ids, routing.sorted_ids)
        assert torch.equal(got_routing.expert_offs, routing.expert_offs)
        assert (got_routing.rank_tokens, got_routing.by_rank, got_routing.groups) == (
            routing.rank_tokens, routing.by_rank, routing.groups)
        assert torch.equal(got, want)
        counters = moe_routing.sort_counters(x.device)
        assert counters is moe_routing.sort_counters(x.device), "one pair of counts per stream"
        assert moe_routing.SortPlan.make(ids, E, rank_tokens, by_rank, counted=True).sync is counters
        assert counters.tolist() == [0, 0], "the sort's counts were not reset"
    flat = want if modes else routing.unsort(want)
    assert rel_error(flat, moe.moe_gemm_reference(x, ids, w, wts if modes else None)) < TOL[torch.float16]
    with pytest.raises(ValueError, match="a_order='sorted' needs the routing before the launch"):
        moe.moe_gemm_sorting(routing.permute(x), w, ids, rank_tokens, by_rank=by_rank, a_order="sorted")


@pytest.mark.parametrize("tile_order", moe.TILE_ORDERS)
@pytest.mark.parametrize("first_group", [0, 3])
def test_every_tile_order_computes_every_tile_once(tile_order, first_group):
    """Both tile orders, walked from group 0 and from group 3 on, on a skewed routing: expert 0 gets
    7 M-tiles (GROUP_M=2: bands of 3, 2 and 2 M-tiles), experts 4-5 none, the rest a few rows each."""
    E, k, T, H, N = 6, 2, 100, 40, 72  # 3 N-tiles of 32, the last one masked
    x, w = _tensors(T, H, N, E, torch.float16, seed=21)
    others, _ = _routing(T, E - 1, 1, seed=22, empty=2)  # experts 0..2 of the other E - 1
    ids = torch.cat([torch.zeros_like(others), others + 1], dim=1)  # expert 0 first for every token
    rt = moe.moe_align(ids, E)
    assert rt.expert_offs[1].item() == T and rt.expert_offs[-1].item() == rt.expert_offs[4].item()
    kernel = moe.make_moe_kernel([moe.gemm_config(16, 32, 32, 2, 1, 1)])
    out = torch.full((T * k, N), float("nan"), dtype=torch.float16, device=DEVICE)
    moe.moe_gemm(x, w, rt, out=out, out_order="flat", kernel=kernel, first_group=first_group, tile_order=tile_order)
    assert rel_error(out, moe.moe_gemm_reference(x, ids, w)) < TOL[torch.float16]


def test_unknown_tile_order_is_refused():
    x, w = _tensors(8, 32, 32, 2, torch.float16, seed=1)
    ids, _ = _routing(8, 2, 1, seed=2, empty=0)
    with pytest.raises(ValueError, match="tile_order must be one of"):
        moe.moe_gemm(x, w, moe.moe_align(ids, 2), tile_order="rows")


@pytest.mark.parametrize("layout", ["aligned", "transposed", "unaligned"])
def test_moe_gemm_reads_every_weight_layout(layout):
    """Descriptor loads for 16-byte aligned rows ([E, K, N] and the transpose of [E, N, K]), pointer loads
    for the rest (36 fp16 columns are 72 bytes): the same result either way."""
    E, k, T = 8, 2, 24
    H, N = (36, 36) if layout == "unaligned" else (40, 48)
    x, w = _tensors(T, H, N, E, torch.float16, seed=11)
    if layout == "transposed":
        w = w.transpose(1, 2).contiguous().transpose(1, 2)
    ids, _ = _routing(T, E, k, seed=12, empty=2)
    rt = moe.moe_align(ids, E)
    a = rt.permute(x)
    _, _, _, meta = moe_gemm.prepare_launch(a, w, rt, "sorted", None, "sorted", None, "test")
    assert (meta["A_TMA"], meta["B_TMA"]) == {"aligned": (True, 1), "transposed": (True, 2),
                                              "unaligned": (False, 0)}[layout]
    out = moe.moe_gemm_with_config(a, w, rt, moe.CPU_MOE_CONFIGS[0], a_order="sorted")
    assert rel_error(rt.unsort(out), moe.moe_gemm_reference(x, ids, w)) < TOL[torch.float16]


def test_moe_gemm_checks_a_layout_once_and_still_refuses_an_aliased_out(monkeypatch):
    """A call with a known layout skips the layout checks (kept per layout) but not the aliasing check,
    which depends on the tensors; a new layout is checked in full."""
    E, k, T, H, N = 8, 2, 16, 32, 32
    x, w = _tensors(T, H, N, E, torch.float16, seed=21)
    ids, _ = _routing(T, E, k, seed=22)
    rt = moe.moe_align(ids, E)
    checked = []
    real = moe_gemm._check_layout
    monkeypatch.setattr(moe_gemm, "_check_layout", lambda *a: checked.append(a[3]) or real(*a))
    monkeypatch.setattr(moe_gemm, "_checked_layouts", moe_common.PassedChecks())
    first = moe_gemm.prepare_launch(x, w, rt, "token", None, "sorted", None, "test")
    second = moe_gemm.prepare_launch(x.clone(), w, rt, "token", None, "sorted", None, "test")
    assert checked == ["token"] and first[3] == second[3] and first[2] == second[2]
    assert second[1][0] is not first[1][0], "the arguments are the call's own tensors"
    a = rt.permute(x)
    moe_gemm.prepare_launch(a, w, rt, "sorted", None, "sorted", None, "test")
    assert checked == ["token", "sorted"], "another layout: checked in full"
    buf, other = (torch.empty(T * k, H + N, dtype=torch.float16, device=DEVICE) for _ in range(2))
    a_view = buf[:, :H]
    moe_gemm.prepare_launch(a_view, w, rt, "sorted", other[:, H:], "sorted", None, "test")
    assert len(checked) == 3
    with pytest.raises(ValueError, match="shares storage"):  # the same layout, known now: the check still runs
        moe_gemm.prepare_launch(a_view, w, rt, "sorted", buf[:, H:], "sorted", None, "test")
    assert len(checked) == 3, "the layout was not checked again"


def test_moe_gemm_writes_only_its_rows_and_strided_weights():
    """A transposed weight view ([E, N, K] storage) and an output view inside a NaN buffer."""
    E, k, T, H, N = 8, 2, 20, 32, 40
    x, _ = _tensors(T, H, N, E, torch.float16, seed=3)
    w = (torch.randn(E, N, H) / H ** 0.5).to(DEVICE, torch.float16).transpose(1, 2)  # [E, H, N], strides (NH, 1, H)
    ids, _ = _routing(T, E, k, seed=4)
    rt = moe.moe_align(ids, E)
    buf = torch.full((T * k + 6, N + 5), float("nan"), dtype=torch.float16, device=DEVICE)
    out = buf[3:3 + T * k, 2:2 + N]
    moe.moe_gemm_with_config(x, w, rt, moe.CPU_MOE_CONFIGS[0], out=out, out_order="flat")
    assert rel_error(out, moe.moe_gemm_reference(x, ids, w)) < TOL[torch.float16]
    mask = torch.ones_like(buf, dtype=torch.bool)
    mask[3:3 + T * k, 2:2 + N] = False
    assert torch.isnan(buf[mask]).all(), "kernel wrote outside the output view"


def test_autotuned_gemm_keys_on_the_row_bucket_not_the_routing():
    """Two routings with different per-expert counts but the same bucketed row total hit one
    cache entry of the autotuner; a total in another bucket is a new key."""
    E, k, H, N = 8, 2, 32, 32
    kernel = moe.make_moe_kernel(moe.CPU_MOE_CONFIGS[:2])
    for i, T in enumerate((20, 26, 40)):  # rows 40, 52 -> bucket 64; 80 -> 128
        x, w = _tensors(T, H, N, E, torch.float16, seed=20 + i)
        ids, wts = _routing(T, E, k, seed=30 + i, empty=1 + i)
        rt = moe.moe_align(ids, E)
        out = torch.full((T * k, N), float("nan"), dtype=torch.float16, device=DEVICE)
        moe.moe_gemm(x, w, rt, out=out, out_order="flat", weights=wts, kernel=kernel)
        assert rel_error(out, moe.moe_gemm_reference(x, ids, w, wts)) < TOL[torch.float16]
        assert len(kernel.cache) == (1 if i < 2 else 2)
    buckets = sorted(key[moe.MOE_KEY.index("ROWS_BUCKET")] for key in kernel.cache)
    assert buckets == [64, 128]
    assert kernel.keys == moe.MOE_KEY


@pytest.mark.parametrize("rows, half, strided", [(37, 48, False), (5, 300, True), (0, 16, False)])
def test_silu_and_mul_kernel_matches_the_torch_form(rows, half, strided):
    """The one-launch gating (Triton, interpreted here) against the torch ops, on row counts and widths
    that are not multiples of its blocks and on rows that are not contiguous."""
    g = torch.Generator().manual_seed(rows + half)
    h = torch.randn(rows, 2 * half + (3 if strided else 0), generator=g).to(DEVICE, torch.float16)
    if strided:
        h = h[:, 3:]
    got = moe.silu_and_mul(h)
    want = moe_activation.silu_and_mul_torch(h)
    assert got.shape == (rows, half) and got.dtype == h.dtype
    if rows:
        assert rel_error(got, want) < 2e-3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens, k, cols, strided", [(37, 2, 300, False), (9, 6, 40, True), (0, 3, 16, False)])
def test_topk_sum_kernel_matches_the_torch_form(tokens, k, cols, strided, dtype, monkeypatch):
    """The one-launch top-k sum (Triton, interpreted here) against the torch ops, in every dtype the layer takes,
    on token counts and widths that are not multiples of its blocks, on rows that are not contiguous, and into a
    NaN-filled output."""
    monkeypatch.setenv(moe.POISON_ENV, "1")
    g = torch.Generator().manual_seed(tokens + k + cols)
    y = torch.randn(tokens * k, cols + (5 if strided else 0), generator=g).to(DEVICE, dtype)
    if strided:
        y = y[:, 5:]
    got = moe_combine.topk_sum(y, tokens, k, dtype)
    want = moe_combine.topk_sum_torch(y, tokens, k, dtype)
    assert got.shape == (tokens, cols) and got.dtype == dtype
    # the interpreter truncates fp32 to bf16 where a GPU rounds to nearest: one bf16 step (2**-8) apart
    tolerance = 8e-3 if dtype == torch.bfloat16 and INTERPRET else 2e-3
    if tokens:
        assert not got.isnan().any() and rel_error(got, want) < tolerance
    with pytest.raises(ValueError, match="must be"):
        moe_combine.topk_sum(y, tokens + 1, k, dtype)


@pytest.mark.parametrize("E,k,dtype", [(8, 2, torch.float16), (64, 6, torch.float32)])
def test_moe_mlp_matches_reference(E, k, dtype, monkeypatch):
    monkeypatch.setenv(moe.POISON_ENV, "1")  # every internal buffer starts as NaN
    T, H, I = 24, 32, 32
    g = torch.Generator().manual_seed(E + k)
    x = torch.randn(T, H, generator=g).to(DEVICE, dtype)
    w_gu = (torch.randn(E, H, 2 * I, generator=g) / H ** 0.5).to(DEVICE, dtype)
    w_d = (torch.randn(E, I, H, generator=g) / I ** 0.5).to(DEVICE, dtype)
    kernel = moe.make_moe_kernel(moe.CPU_MOE_CONFIGS[:1])  # one config: no benchmarking
    for check in range(2):  # fresh routing each time
        ids, wts = _routing(T, E, k, seed=100 * check + E, empty=3)
        y = moe.moe_mlp(x, ids, wts, w_gu, w_d, kernel=kernel)
        assert y.shape == (T, H) and y.dtype == dtype
        assert rel_error(y, moe.moe_mlp_reference(x, ids, wts, w_gu, w_d)) < TOL[dtype]
    y = moe.moe_mlp(x, ids, None, w_gu, w_d, kernel=kernel)  # no routing weights: plain sum
    assert rel_error(y, moe.moe_mlp_reference(x, ids, None, w_gu, w_d)) < TOL[dtype]


def test_host_errors():
    E, k, T, H, N = 8, 2, 8, 16, 16
    x, w = _tensors(T, H, N, E, torch.float32, seed=1)
    ids, wts = _routing(T, E, k, seed=2)
    rt = moe.moe_align(ids, E)
    cfg = moe.CPU_MOE_CONFIGS[0]
    with pytest.raises(ValueError, match="w has 4 experts but the routing was built for 8"):
        moe.moe_gemm_with_config(x, w[:4], rt, cfg)
    with pytest.raises(ValueError, match="a has 15 columns"):
        moe.moe_gemm_with_config(x[:, :15], w, rt, cfg)
    with pytest.raises(ValueError, match="a_order='sorted' needs a with 16 rows"):
        moe.moe_gemm_with_config(x, w, rt, cfg, a_order="sorted")
    with pytest.raises(TypeError, match="same dtype"):
        moe.moe_gemm_with_config(x.half(), w, rt, cfg)
    with pytest.raises(ValueError, match="out has shape"):
        moe.moe_gemm_with_config(x, w, rt, cfg, out=torch.empty(T, N, device=DEVICE))
    with pytest.raises(ValueError, match="weights must have shape"):
        moe.moe_gemm_with_config(x, w, rt, cfg, weights=wts[:, :1])
    with pytest.raises(ValueError, match="a_order must be one of"):
        moe.moe_gemm_with_config(x, w, rt, cfg, a_order="gather")
    with pytest.raises(ValueError, match="invalid config"):
        moe.moe_gemm_with_config(x, w, rt, triton.Config({"BLOCK_M": 24, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 1}))
    with pytest.raises(TypeError, match="routing must be a MoeRouting"):
        moe.moe_gemm(x, w, ids)
    I = 8
    w_gu, w_d = torch.zeros(E, H, 2 * I, device=DEVICE), torch.zeros(E, I, H, device=DEVICE)
    with pytest.raises(ValueError, match=r"w_down must be \[E, I, H\]"):
        moe.moe_mlp(x, ids, wts, w_gu, torch.zeros(E, H, I, device=DEVICE))
    with pytest.raises(ValueError, match="topk_ids has 7 rows but x has 8 tokens"):
        moe.moe_mlp(x, ids[:7], None, w_gu, w_d)
    with pytest.raises(ValueError, match="expert ids must lie"):
        moe.moe_mlp(x, ids + E, None, w_gu, w_d)
    if INTERPRET:
        with pytest.raises(TypeError, match="bf16"):
            moe.moe_gemm_with_config(x.bfloat16(), w.bfloat16(), rt, cfg)


def test_default_configs_and_pruning():
    if INTERPRET or not torch.cuda.is_available():
        assert moe.default_moe_configs() == moe.CPU_MOE_CONFIGS
    assert isinstance(moe.moe_gemm_kernel, triton.runtime.Autotuner)
    x = torch.zeros(4, 4, dtype=torch.bfloat16)
    kept = moe.prune_moe_configs(moe.HOPPER_MOE_CONFIGS, {"a_ptr": x, "b_ptr": x})
    assert kept == moe.HOPPER_MOE_CONFIGS  # all fit H100/H200 shared memory in bf16
    x32 = torch.zeros(4, 4, dtype=torch.float32)
    kept32 = moe.prune_moe_configs(moe.HOPPER_MOE_CONFIGS, {"a_ptr": x32, "b_ptr": x32})
    for cfg in moe.HOPPER_MOE_CONFIGS:
        fits = moe.shared_memory_bytes(cfg, torch.float32) <= moe.max_shared_memory(None)
        assert (cfg in kept32) == fits
    assert len(kept32) < len(moe.HOPPER_MOE_CONFIGS)
    with pytest.raises(ValueError, match="all 1 GEMM configs were pruned"):
        moe.prune_moe_configs([triton.Config({"BLOCK_M": 8, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 1})],
                              {"a_ptr": x, "b_ptr": x})


# --------------------------------------------------------------------------- multi-rank


def _launch(out: Path, nproc: int, cases: list[str]) -> dict:
    return run_cases(CASES, cases, out, nproc, timeout=LAUNCH_TIMEOUT_S,
                     extra_env={"DISTTUNE_TIMEOUT": "60", "DISTTUNE_CACHE_DIR": str(out / "store")})


@pytest.fixture(scope="module")
def gloo2(tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("moe2"), 2, ["layer", "agree_dp", "agree_tp", "keys_differ", "graph",
                                                        "inconsistent", "cached_checks", "recover", "eager_gather"])


@pytest.fixture(scope="module")
def gloo2_tuned_layer(tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("moe2_tuned"), 2, ["fast_layer"])


@pytest.fixture(scope="module")
def gloo4(tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("moe4"), 4, ["layer"])


@pytest.fixture(scope="module")
def nccl1(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("CUDA graph capture needs a GPU (one rank under NCCL)")
    return _launch(tmp_path_factory.mktemp("moe1"), 1, ["graph", "recover", "eager_gather"])


def _values(per_rank: list[dict]) -> list[dict]:
    for record in per_rank:
        assert record["ok"], failure(record)
    return per_rank


def _check_layer(per_rank):
    for rank, value in enumerate(_values(per_rank)):
        for check in value["checks"][:2]:
            assert len(set(check["tokens"])) == len(check["tokens"]), "tokens per rank should be uneven"
        assert len(set(value["checks"][2]["tokens"])) == 1, "tokens per rank should be even"
        for check in value["checks"]:
            assert check["gathered_ok"], f"rank {rank}: gathered routing differs ({check})"
            assert check["shape_ok"], f"rank {rank}: {check}"
            assert check["chunk_refused"], f"rank {rank}: chunk() of an expert-grouped gather should raise"
            for name in ("ag_err", "expert_err", "rs_err", "rs_stacked_err", "layer_err"):
                assert check[name] < 2e-2, f"rank {rank} E={check['E']} k={check['k']}: {name}={check[name]}"
        assert [(c["E"], c["k"]) for c in value["checks"]] == [(8, 2), (64, 6), (8, 2)]
        # the layer groups these few rows per expert: its result above checks that grouping
        assert {c["layer_layout"] for c in value["checks"]} == {"expert"}


def _check_eager_gather(per_rank: list[dict]) -> None:
    for rank, value in enumerate(_values(per_rank)):
        assert [(c["dtype"], c["H"], c["weights"], c["strided"]) for c in value["checks"]] == [
            ("torch.float32", 12, "torch.float32", False), ("torch.float32", 12, "None", False),
            ("torch.float16", 8, "torch.float16", True), ("torch.float16", 7, "torch.float32", False)]
        for check in value["checks"]:
            assert check["x"] and check["ids"] and check["weights_back"], f"rank {rank}: {check}"
            assert check["x_dtype"] == check["dtype"] and check["ids_dtype"] == "torch.int32", f"rank {rank}: {check}"
            assert check["weights_dtype"] == (None if check["weights"] == "None" else check["weights"]), check
            assert check["x_contiguous"] and check["routing_alone_same"], f"rank {rank}: {check}"
        strided = value["checks"][2]["given_strides"]
        assert strided[0][1] != 1 and strided[1][0] == 1, f"rank {rank}: the strided inputs were not strided: {strided}"


def test_the_eager_gather_returns_every_ranks_tokens_and_routing(gloo2):
    """The gather every call without graph_safe uses (tokens, ids and weights in one collective): tokens, ids and
    weights back bit for bit on every rank, uneven counts with an empty rank, without weights, int64 ids and
    float16 weights, strided inputs, an odd hidden size in float16; the tokens contiguous; the routing's own
    gather agrees. On two GPUs the ranks run NCCL, where the three travel in one grouped all-gather."""
    _check_eager_gather(gloo2["eager_gather"])


def test_the_eager_gather_under_nccl_on_one_gpu(nccl1):
    """One rank under NCCL: the tokens, ids and weights (three dtypes, strided and converted inputs) in one
    grouped all-gather (uneven counts under NCCL: the 2-rank case on two GPUs)."""
    _check_eager_gather(nccl1["eager_gather"])


@pytest.mark.slow
def test_ag_moe_moe_rs_layer_2_ranks(gloo2):
    _check_layer(gloo2["layer"])


@pytest.mark.slow
def test_ag_moe_moe_rs_layer_4_ranks(gloo4):
    _check_layer(gloo4["layer"])


@pytest.mark.slow
def test_contextual_winner_agreed_despite_different_routings(gloo2):
    """moe_mlp on each rank's own tokens (different counts, same row bucket) and routing: every
    site is tuned on every rank and every rank holds the same winner."""
    values = _values(gloo2["agree_dp"])
    assert values[0]["counts"] != values[1]["counts"], "the ranks' routings should differ"
    winners = [v["winners"] for v in values]
    assert len(winners[0]) == 2 and all(w[4] == "tuned" for w in winners[0])  # gate-up and down sites
    assert winners[0] == winners[1]
    assert all(v["err"] < 2e-2 for v in values)
    assert all(v["runs"] == 2 + v["candidates"] for v in values)  # n_warmup=0, n_repeat=1
    if not torch.cuda.is_available():
        assert values[0]["candidates"] == len(moe.CPU_MOE_CONFIGS)


@pytest.mark.slow
def test_contextual_tp_layer_agreed(gloo2):
    values = _values(gloo2["agree_tp"])
    assert values[0]["local_ids"] != values[1]["local_ids"]
    winners = [v["winners"] for v in values]
    # ag_moe and the down projection: one launch each over every rank's tokens (as few rows as these group
    # per expert over both ranks), both keyed on the global bucket
    assert len(winners[0]) == 2 and [w[2] for w in winners[0]] == [0, 0]
    keys = [ast.literal_eval(w[1]) for w in winners[0]]
    groups, experts = moe.MOE_KEY.index("E"), moe.MOE_KEY.index("B_EXPERTS")
    assert values[0]["groups_per_expert"] == 1
    assert all(key[groups] == key[experts] for key in keys)
    assert winners[0] == winners[1]
    assert all(v["err"] < 2e-2 and v["again_err"] < 2e-2 for v in values)


@pytest.mark.slow
def test_per_rank_keys_are_a_clear_error(gloo2):
    """Keying on the exact local row count (bucket=identity) with uneven tokens: a TuningError on
    every rank naming the kernel, both keys and the ranks, instead of a hang."""
    for rank, result in enumerate(gloo2["keys_differ"]):
        assert not result["ok"], f"rank {rank} did not raise"
        assert result["error_type"] == "TuningError"
        msg = result["error_message"]
        assert "ranks disagree on what to tune" in msg
        assert "_moe_gemm_body" in msg
        assert "ranks [0]: kernel" in msg and "ranks [1]: kernel" in msg
        assert "(64, 32, 8, 8, 2, 32," in msg and "(64, 32, 8, 8, 2, 48," in msg  # rows 16*2 vs 24*2
        assert "rank-independent" in msg


def test_tuned_layer_with_new_routing_every_call_launches_its_winners_and_nothing_else(gloo2_tuned_layer):
    """The TP layer wrapped whole and tuned, then called with fresh routing every call (every expert's row
    count changes): after the call that learns the launch sequence, no call reads a key the general way,
    takes a fallback, writes to the rank log, touches the control plane, tunes or reads a value back from
    the device, on any rank. A new row bucket (twice the tokens) is served by the same fallback on every
    rank, logged on its first call only."""
    values = _values(gloo2_tuned_layer["fast_layer"])
    for rank, value in enumerate(values):
        assert value["tuned"] and [site[2] for site in value["tuned_sites"]] == [0, 0]  # AG; RS, one launch
        first, *later = value["calls"]
        assert first["work"] and all(kind.startswith("general path") for kind in first["work"]), first["work"]
        rows = [c["expert_rows"] for c in value["calls"]]
        assert all(a != b for a, b in zip(rows, rows[1:])), f"the routing should change every call: {rows}"
        for i, c in enumerate(later, 1):
            assert c["work"] == {} and c["log_grew"] == 0, f"rank {rank}, call {i} after tuning: {c['work']}"
        for c in value["calls"] + value["new_bucket"]:
            assert c["err"] < 2e-2, f"rank {rank}: {c}"
        seen, again = value["new_bucket"]
        assert seen["work"]["fallback: NewKeys.launch"] == 2 and seen["work"]["log write: RankLog.fallback"] == 2
        assert seen["log_grew"] > 0
        assert again["work"]["fallback: NewKeys.launch"] == 2 and again["log_grew"] == 0
        assert not [kind for kind in again["work"] if kind.startswith(("log write", "control plane", "agreement"))]
    assert values[0]["fallbacks"] == values[1]["fallbacks"] and len(values[0]["fallbacks"]) == 2


def _check_graph(per_rank, must_capture: bool):
    for rank, value in enumerate(_values(per_rank)):
        no_tokens, checked = value["refused"]
        assert "tokens_per_rank" in no_tokens and "must not synchronize" in no_tokens, no_tokens
        assert "check_ids=False" in checked and "got True" in checked, checked
        assert value["eager_equal"], f"rank {rank}: graph_safe=True gave another result than the default path"
        assert value["varied_equal"] == [True] * 4, f"rank {rank}: changing rows (one call with idle ranks): {value}"
        if not (must_capture or value["captured"]):
            continue
        assert value["captured"], f"rank {rank}: not captured on a GPU"
        assert len(value["replays"]) == 6
        for i, replay in enumerate(value["replays"]):
            assert replay["layer_err"] < 2e-2, f"rank {rank} replay {i}: {replay}"
            assert replay["ag_equal"], f"rank {rank} replay {i}: the replayed ag_moe differs from the eager one"
        assert "pass graph_safe=True" in value["unsafe_capture"], value["unsafe_capture"]
        assert value["flags_left_set"] == 0, "finish should clear every arrival flag a replay set"
        assert value["wrapped_graphs"] == [1, 3], f"rank {rank}: cuda_graph=True should capture once, then replay"
        assert max(value["wrapped_errors"]) < 2e-2, f"rank {rank}: the replayed wrapper's results {value}"
        assert "captured in a CUDA graph but is not tuned" in value["untuned_capture"], value["untuned_capture"]
        for name, message in zip(("AllGatherGEMM", "GemmReduceScatter"), value["refused_ops"]):
            assert message.startswith(f"{name} cannot be captured in a CUDA graph") and "epoch" in message, message


#: What every rank's error must say, per scenario of ``case_inconsistent`` (rank 1 differs in each).
INCONSISTENT = {
    "hidden size": "ranks were called with inconsistent inputs (ranks [1] differ from rank 0)",
    "dtype": "ranks were called with inconsistent inputs (ranks [1] differ from rank 0)",
    "x and w dtypes": "invalid input on rank(s) [1]:\n  rank 1: TypeError: ag_moe: x and w must have the same dtype",
    "weights on one rank": "ranks were called with inconsistent inputs (ranks [1] differ from rank 0)",
    "experts": "ranks were called with inconsistent inputs (ranks [1] differ from rank 0)",
    "tokens_per_rank values": "ranks were called with inconsistent inputs (ranks [1] differ from rank 0)",
    "tokens_per_rank on one rank": "ranks were called with inconsistent inputs (ranks [1] differ from rank 0)",
    "expert ids": "expert ids must lie in [0, 8), got values in [0, 14] from rank(s) [1]",
    "local input": "invalid input on rank(s) [1]:\n  rank 1: ValueError: ag_moe: topk_ids has",
    "out rows": "but rank(s) [1] passed",
    "layer weights": "invalid input on rank(s) [1]:\n  rank 1: ValueError: tp_moe_layer: w_down must be [E, I, H]",
    "moe_rs hidden size": "moe_rs: ranks were called with inconsistent inputs (ranks [1] differ from rank 0)",
    "moe_rs weights on one rank": "moe_rs: ranks were called with inconsistent inputs (ranks [1] differ from rank 0)",
    "moe_rs token counts": "moe_rs: ranks were called with inconsistent inputs (ranks [1] differ from rank 0)",
    "moe_rs local input": "invalid input on rank(s) [1]:\n  rank 1: ValueError: moe_rs: h has",
}


@pytest.mark.slow
def test_inputs_inconsistent_across_ranks_are_an_error_on_every_rank(gloo2):
    """Valid on each rank, inconsistent across ranks (hidden size, dtype, weights given or not, expert
    count, token counts), or bad on one rank only (tokens and expert weights of two dtypes, expert ids, shapes, out
    buffer, the layer's weights): every rank raises a ValueError saying which rank and what, none hangs, and a valid
    call afterwards is right."""
    values = _values(gloo2["inconsistent"])
    for rank, value in enumerate(values):
        assert set(value["raised"]) == set(INCONSISTENT)
        for name, expected in INCONSISTENT.items():
            got = value["raised"][name]
            assert got is not None, f"rank {rank}, {name}: no error"
            assert got.startswith("ValueError: "), f"rank {rank}, {name}: {got}"
            assert expected in got, f"rank {rank}, {name}: {got}"
        assert value["after_err"] < 2e-2 and value["after_rs_err"] < 2e-2, value
    assert values[0]["raised"] == values[1]["raised"]  # the same message on both ranks



#: What every rank's error must say, per bad call of ``case_cached_checks`` after a call with cached checks.
AFTER_CACHED_CHECKS = {
    "layer weights": "invalid input on rank(s) [1]:\n  rank 1: ValueError: tp_moe_layer: w_down must be [E, I, H]",
    "layer routing rows": "invalid input on rank(s) [1]:\n  rank 1: ValueError: tp_moe_layer: topk_ids has",
    "moe_rs_stacked local input": "ValueError: moe_rs: h has",
}


@pytest.mark.slow
def test_layer_checks_run_once_per_layout_and_bad_calls_still_raise_everywhere(gloo2):
    """A layer call with the inputs' layout of an earlier good call skips the input checks; a bad call after it
    (on one rank, or on every rank) raises the same ValueError on every rank, and a valid call afterwards is right."""
    values = _values(gloo2["cached_checks"])
    for rank, value in enumerate(values):
        assert value["first"] == {"check: disttune.kernels.moe._check_mlp": 1,
                                  "check: disttune.kernels.moe_ag._check_locally": 1,
                                  "check: disttune.kernels.moe_rs._check_stacked": 1}, value["first"]
        assert value["second"] == {}, f"rank {rank}: a call with a known layout ran checks {value['second']}"
        assert set(value["raised"]) == set(AFTER_CACHED_CHECKS)
        for name, expected in AFTER_CACHED_CHECKS.items():
            got = value["raised"][name]
            assert got is not None and expected in got, f"rank {rank}, {name}: {got}"
        assert all(err < 2e-2 for err in value["errs"]), value["errs"]
    assert values[0]["raised"] == values[1]["raised"]  # the same message on both ranks


def _check_recover(per_rank: list[dict], world: int) -> None:
    for rank, value in enumerate(_values(per_rank)):
        assert value["raised"] is not None, f"rank {rank}: the bad expert ids raised nothing"
        assert "expert ids must lie in [0, 8)" in value["raised"] and f"from rank(s) [{world - 1}]" in value["raised"]
        assert all(err < 2e-2 for err in value["errs"]), f"rank {rank}: calls after the error are wrong: {value}"


@pytest.mark.slow
def test_an_error_mid_call_leaves_ag_moe_usable_2_ranks(gloo2):
    _check_recover(gloo2["recover"], 2)


def test_an_error_mid_call_leaves_ag_moe_usable_on_one_gpu(nccl1):
    """Under NCCL, after the ids of a gathered call were refused on every rank: the next three calls
    compute the right rows."""
    _check_recover(nccl1["recover"], 1)


@pytest.mark.slow
def test_graph_safe_ag_moe_2_ranks(gloo2):
    """Argument checks and eager equality everywhere; capture and replays where the ranks run NCCL on GPUs."""
    _check_graph(gloo2["graph"], must_capture=False)


def test_graph_safe_ag_moe_and_layer_replay_on_one_gpu(nccl1):
    _check_graph(nccl1["graph"], must_capture=True)
