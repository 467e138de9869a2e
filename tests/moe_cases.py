"""Multi-rank MoE cases, run under torchrun (gloo on CPU with TRITON_INTERPRET=1, NCCL on GPUs).

    python tests/moe_cases.py [CASE ...] [--out DIR]

Each rank runs the cases in order and writes one record per case (see ``rank_cases``).
``test_moe.py`` and ``test_eight_ranks.py`` launch this file and assert on the records.
Every buffer the MoE functions allocate is NaN-poisoned (DISTTUNE_MOE_POISON=1, set here),
so an unwritten row fails the check.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections import Counter

from rank_cases import Cases, Ranks

os.environ["DISTTUNE_MOE_POISON"] = "1"

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import disttune  # noqa: E402
from disttune import contextual, fast_path, handlers, logs, unseen  # noqa: E402
from disttune.kernels import moe, moe_ag, moe_rs  # noqa: E402
from numerics import rel_error  # noqa: E402

GPU = torch.cuda.is_available()
DTYPE = torch.bfloat16 if GPU else torch.float16
TOL = 2e-2

cases = Cases(__doc__)


def tuner_options(ctx: Ranks, case: str, **extra) -> dict:
    options = dict(is_dist=True, n_warmup=0, n_repeat=1, log_dir=os.path.join(ctx.work_dir, "logs", case),
                   cache_dir=os.path.join(ctx.work_dir, "store", case), timeout_s=60, verbose=False)
    options.update(extra)
    return options


def routing_for(T: int, E: int, k: int, seed: int, device, skip: int = 0):
    """Random top-k routing (distinct experts per token) that leaves experts ``E-skip..E-1`` empty."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(T, E - skip, generator=g)
    weights, ids = scores.topk(k, dim=1)
    weights = weights / weights.sum(1, keepdim=True)
    return ids.to(device=device, dtype=torch.int32), weights.to(device)


def full_problem(ctx: Ranks, tokens: list[int], E: int, k: int, H: int, I: int, seed: int):
    """Every rank builds the same global tokens, routing and weights; returns its shard + the whole."""
    g = torch.Generator().manual_seed(seed)
    total = sum(tokens)
    x = (torch.randn(total, H, generator=g)).to(ctx.device, DTYPE)
    ids, weights = routing_for(total, E, k, seed + 1, ctx.device, skip=max(1, E // 8))
    w_gate_up = (torch.randn(E, H, 2 * I, generator=g) / H ** 0.5).to(ctx.device, DTYPE)
    w_down = (torch.randn(E, I, H, generator=g) / I ** 0.5).to(ctx.device, DTYPE)
    start = sum(tokens[: ctx.rank])
    mine = slice(start, start + tokens[ctx.rank])
    # rank r holds columns [r*I/w, (r+1)*I/w) of gate and of up, and those rows of down
    Ir = I // ctx.world
    cols = slice(ctx.rank * Ir, (ctx.rank + 1) * Ir)
    w_gu_local = torch.cat([w_gate_up[:, :, :I][:, :, cols], w_gate_up[:, :, I:][:, :, cols]], dim=2).contiguous()
    w_d_local = w_down[:, cols].contiguous()
    return dict(x=x, ids=ids, weights=weights, w_gate_up=w_gate_up, w_down=w_down, mine=mine,
                w_gu_local=w_gu_local, w_d_local=w_d_local)


@cases.case
def case_layer(ctx: Ranks) -> dict:
    """ag_moe, moe_rs and the whole TP layer against per-expert torch references, uneven tokens,
    E in (8, 64) and top-k in (2, 6), then even tokens (the layer's reduce-scatter under NCCL), fresh
    routing per check."""
    checks = []
    for i, (E, k, even) in enumerate([(8, 2, False), (64, 6, False), (8, 2, True)]):
        tokens = [8] * ctx.world if even else [6 + 5 * r + 3 * i for r in range(ctx.world)]
        H, I = 32, 16 * ctx.world
        p = full_problem(ctx, tokens, E, k, H, I, seed=100 + i)
        kernel = moe.make_moe_kernel(moe.CPU_MOE_CONFIGS[1:2] if not GPU else None)
        x, ids, wts = p["x"][p["mine"]], p["ids"][p["mine"]], p["weights"][p["mine"]]
        # AG-MoE: gate-up rows of every rank's tokens (this rank's column slice)
        out = torch.full((sum(tokens) * k, p["w_gu_local"].shape[2]), float("nan"), device=ctx.device, dtype=DTYPE)
        ag = moe.ag_moe(x, ids, p["w_gu_local"], topk_weights=wts, kernel=kernel, out=out)
        ref_h = moe.moe_gemm_reference(p["x"], p["ids"], p["w_gu_local"])
        row = 0
        ag_err = 0.0
        for r in range(ctx.world):
            got = ag.routings[r].unsort(ag.chunk(r))
            ag_err = max(ag_err, rel_error(got, ref_h[row: row + tokens[r] * k]))
            row += tokens[r] * k
        gathered_ok = bool(torch.equal(ag.topk_ids, p["ids"]) and torch.allclose(ag.topk_weights, p["weights"]))
        # the same rows grouped per expert over every rank (tiles that read several ranks' tokens)
        by_expert = moe.ag_moe(x, ids, p["w_gu_local"], topk_weights=wts, kernel=kernel, layout="expert")
        expert_err = rel_error(by_expert.routing.unsort(by_expert.out), ref_h)
        try:
            by_expert.chunk(0)
            chunk_refused = False
        except ValueError:
            chunk_refused = True
        # MoE-RS on the activation, and the whole layer, against the full-weight reference
        rs = moe.moe_rs(moe.silu_and_mul(ag.out), ag.routings, ag.topk_weights, p["w_d_local"], kernel=kernel)
        ref = moe.moe_mlp_reference(p["x"], p["ids"], p["weights"], p["w_gate_up"], p["w_down"])[p["mine"]]
        # the one-launch MoE-RS over the rank-stacked routing (the layer below groups these rows per expert)
        rs_stacked = moe.moe_rs_stacked(moe.silu_and_mul(ag.out), ag.routing, ag.topk_weights, p["w_d_local"],
                                        kernel=kernel)
        layer = moe.tp_moe_layer(x, ids, wts, p["w_gu_local"], p["w_d_local"], kernel=kernel,
                                 tokens_per_rank=tokens)
        checks.append({"E": E, "k": k, "tokens": tokens, "ag_err": ag_err, "gathered_ok": gathered_ok,
                       "expert_err": expert_err, "chunk_refused": chunk_refused,
                       "layer_layout": moe.layout_for(tokens, k, E),
                       "rs_err": rel_error(rs, ref), "rs_stacked_err": rel_error(rs_stacked, ref),
                       "layer_err": rel_error(layer, ref),
                       "shape_ok": tuple(layer.shape) == (tokens[ctx.rank], H)})
    return {"checks": checks}


@cases.case
def case_eager_gather(ctx: Ranks) -> dict:
    """The gather of a call without graph_safe alone (tokens, ids and weights in one collective): every rank's
    tokens, ids and weights back bit for bit, in rank order, for uneven counts with one rank holding none, with
    and without weights, in float32 and float16 (int64 ids converted to int32, float16 weights kept; column-strided
    tokens and top-1 routing transposed from a row, the empty rank's too), and in float16 with an odd hidden
    size; the tokens contiguous. The routing's own gather (what a graph-safe call uses) returns the same ids
    and weights."""
    tokens = [0 if r == 1 else 3 + 2 * r for r in range(ctx.world)]
    mine = slice(sum(tokens[:ctx.rank]), sum(tokens[:ctx.rank + 1]))
    checks = []
    for dtype, H, k, weights, ids_dtype, strided in [(torch.float32, 12, 3, torch.float32, torch.int32, False),
                                                     (torch.float32, 12, 3, None, torch.int32, False),
                                                     (torch.float16, 8, 1, torch.float16, torch.int64, True),
                                                     (torch.float16, 7, 3, torch.float32, torch.int32, False)]:
        g = torch.Generator().manual_seed(7)
        x = torch.randn(sum(tokens), H, generator=g).to(dtype)
        ids = torch.randint(0, 64, (sum(tokens), k), generator=g).to(ids_dtype)
        wts = torch.rand(sum(tokens), k, generator=g).to(weights or torch.float32)
        x_r, ids_r, wts_r = x[mine].to(ctx.device), ids[mine].to(ctx.device), wts[mine].to(ctx.device)
        if strided:  # every other column of a wider tensor; [T, 1] routing as the transpose of a [1, T] row
            x_r = torch.stack([x_r, torch.zeros_like(x_r)], dim=2).flatten(1)[:, ::2]
            ids_r, wts_r = ids_r.t().contiguous().t(), wts_r.t().contiguous().t()
        x_all, ids_all, wts_all = moe_ag.gather_tokens_and_routing(x_r, ids_r, wts_r if weights else None,
                                                                   tuple(tokens), None)
        ids_alone, wts_alone = moe_ag.gather_routing(ids_r, wts_r if weights else None, tuple(tokens), None)
        checks.append({"dtype": str(dtype), "H": H, "weights": str(weights), "strided": strided,
                       "given_strides": [x_r.stride(), ids_r.stride()],
                       "x": torch.equal(x_all.cpu(), x), "ids": torch.equal(ids_all.cpu(), ids.to(torch.int32)),
                       "ids_dtype": str(ids_all.dtype),
                       "weights_back": torch.equal(wts_all.cpu(), wts) if weights else wts_all is None,
                       "x_dtype": str(x_all.dtype), "x_contiguous": x_all.is_contiguous(),
                       "weights_dtype": str(wts_all.dtype) if weights else None,
                       "routing_alone_same": torch.equal(ids_alone, ids_all) and (
                           torch.equal(wts_alone, wts_all) if weights else wts_alone is None)})
    return {"checks": checks}


def site_winners(tuner) -> list:
    return [[r.site.kernel, repr(r.site.key), r.site.occurrence, disttune.describe_config(r.config), r.source]
            for r in tuner.report.results]


@cases.case
def case_agree_dp(ctx: Ranks) -> dict:
    """Data-parallel moe_mlp: each rank its own tokens (uneven counts, same row bucket) and its own
    routing; the key has the bucketed row total only, so all ranks tune the same sites and agree."""
    E, k, H, I = 8, 2, 32, 32
    T = 24 + 3 * ctx.rank  # 48..66 rows at 4 ranks: bucket 64 up to rank 2; keep to 2 ranks in the test
    g = torch.Generator().manual_seed(700 + ctx.rank)
    x = torch.randn(T, H, generator=g).to(ctx.device, DTYPE)
    ids, wts = routing_for(T, E, k, 800 + ctx.rank, ctx.device, skip=ctx.rank + 1)
    w_gu = (torch.randn(E, H, 2 * I, generator=torch.Generator().manual_seed(1)) / H ** 0.5).to(ctx.device, DTYPE)
    w_d = (torch.randn(E, I, H, generator=torch.Generator().manual_seed(2)) / I ** 0.5).to(ctx.device, DTYPE)
    kernel = moe.make_moe_kernel(None)
    counts = torch.bincount(ids.flatten().long().cpu(), minlength=E).tolist()

    @disttune.contextual_autotune(**tuner_options(ctx, "agree_dp"))
    def step():
        return moe.moe_mlp(x, ids, wts, w_gu, w_d, kernel=kernel)

    y = step()
    ref = moe.moe_mlp_reference(x, ids, wts, w_gu, w_d)
    return {"winners": site_winners(step), "err": rel_error(y, ref), "counts": counts,
            "runs": step.report.function_runs,
            "candidates": max(len(r.configs) for r in step.report.results)}


@cases.case
def case_agree_tp(ctx: Ranks) -> dict:
    """The TP layer (AG-MoE + MoE-RS) wrapped whole: per-rank local routings differ, all agree."""
    tokens = [10 + 4 * r for r in range(ctx.world)]
    p = full_problem(ctx, tokens, 8, 2, 32, 16 * ctx.world, seed=900)
    x, ids, wts = p["x"][p["mine"]], p["ids"][p["mine"]], p["weights"][p["mine"]]
    kernel = moe.make_moe_kernel(None)

    @disttune.contextual_autotune(**tuner_options(ctx, "agree_tp"))
    def layer():
        return moe.tp_moe_layer(x, ids, wts, p["w_gu_local"], p["w_d_local"], kernel=kernel, tokens_per_rank=tokens)

    y = layer()
    ref = moe.moe_mlp_reference(p["x"], p["ids"], p["weights"], p["w_gate_up"], p["w_down"])[p["mine"]]
    again = layer()  # tuned: one plain run
    return {"winners": site_winners(layer), "err": rel_error(y, ref), "again_err": rel_error(again, ref),
            "local_ids": ids.flatten().tolist(), "groups_per_expert": 1 if moe.layout_for(tokens, 2, 8) == "expert"
            else ctx.world}


#: What a tuned call may do beyond launching its winners, by kind: each entry is a real function, counted
#: where it is called (``count_calls``), never replaced. The control plane's store operations are counted
#: by ``CountingStore``.
PER_CALL_WORK = {
    "general path": [(fast_path.FastLaunch, "_launch_by_site"), (fast_path.FastLaunch, "_leave_sequence"),
                     (fast_path.FastPlan, "finish"), (fast_path.FastPlan, "new_handler")],
    "fallback": [(unseen.NewKeys, "launch"), (handlers.Fast, "launch_site"), (handlers, "launch_fast")],
    "log write": [(logs.RankLog, "fallback"), (logs.RankLog, "note"), (logs.RankLog, "flush")],
    "agreement": [(unseen.NewKeyVotes, "point"), (contextual.ContextualAutotuner, "tuning_call")],
    "host sync": [(torch.Tensor, name) for name in ("tolist", "item", "__int__", "__float__", "__bool__")]
                 + [(torch.cuda, "synchronize")],
}


class CountingStore:
    """The communicator's rendezvous store, every operation counted into ``tally`` and then made on the real one."""

    def __init__(self, store, tally: Counter) -> None:
        self._store, self._tally = store, tally

    def __getattr__(self, name: str):
        real = getattr(self._store, name)

        def operation(*args, **kwargs):
            self._tally[f"control plane: store.{name}"] += 1
            return real(*args, **kwargs)
        return operation


@contextlib.contextmanager
def count_calls(work: dict):
    """Count the calls of every function in ``work`` (kind -> [(owner, name)]) into a Counter keyed
    ``kind: owner.name``; each function still runs as it is, and is put back at the end."""
    tally: Counter = Counter()
    saved = []

    def counted(label: str, real):
        @functools.wraps(real)
        def call(*args, **kwargs):
            tally[label] += 1
            return real(*args, **kwargs)
        return call

    for kind, functions in work.items():
        for owner, name in functions:
            own = vars(owner).get(name)  # None: inherited (a tensor method from torch._C), put back by deleting
            saved.append((owner, name, own))
            label = f"{kind}: {getattr(owner, '__name__', owner)}.{name}"
            setattr(owner, name, counted(label, getattr(owner, name)))
    try:
        yield tally
    finally:
        for owner, name, own in reversed(saved):
            if own is None:
                delattr(owner, name)
            else:
                setattr(owner, name, own)


@cases.case
def case_fast_layer(ctx: Ranks) -> dict:
    """The TP layer wrapped whole and tuned once, then called with fresh routing every call (16 experts,
    top-6, 4 tokens per rank: every expert's row count changes from call to call, as in a real MoE layer).
    Per call: what the tuner did beyond launching its winners (``PER_CALL_WORK``), the rank log's size,
    the experts' row counts and the error against the per-expert reference. Then calls with twice the
    tokens (a row bucket no tuning call met): they run on a fallback, logged on first sight only."""
    E, k, H, T = 16, 6, 32, 4
    I = 16 * ctx.world
    weights = full_problem(ctx, [T] * ctx.world, E, k, H, I, seed=1700)
    log_dir = os.path.join(ctx.work_dir, "logs", "fast_layer")
    log = os.path.join(log_dir, f"rank-{ctx.rank}.log")
    kernel = moe.make_moe_kernel(None)

    @disttune.contextual_autotune(**tuner_options(ctx, "fast_layer", log_dir=log_dir))
    def layer(x, ids, wts, tokens):
        return moe.tp_moe_layer(x, ids, wts, weights["w_gu_local"], weights["w_d_local"], kernel=kernel,
                                tokens_per_rank=tokens, check_ids=False)

    def call(seed: int, tokens: int, tally: Counter) -> dict:
        g = torch.Generator().manual_seed(seed)
        counts = [tokens] * ctx.world
        x_all = torch.randn(sum(counts), H, generator=g).to(ctx.device, DTYPE)
        ids_all, wts_all = routing_for(sum(counts), E, k, seed + 1, ctx.device)
        mine = slice(ctx.rank * tokens, (ctx.rank + 1) * tokens)
        size = os.path.getsize(log)
        tally.clear()
        y = layer(x_all[mine], ids_all[mine], wts_all[mine], counts)
        work = dict(tally)
        ref = moe.moe_mlp_reference(x_all, ids_all, wts_all, weights["w_gate_up"], weights["w_down"])[mine]
        return {"work": work, "log_grew": os.path.getsize(log) - size, "err": rel_error(y, ref),
                "expert_rows": torch.bincount(ids_all.flatten().long(), minlength=E).tolist()}

    with count_calls(PER_CALL_WORK) as tally:
        layer(weights["x"][weights["mine"]], weights["ids"][weights["mine"]], weights["weights"][weights["mine"]],
              [T] * ctx.world)  # the tuning call
        plane = layer.communicator()
        plane.store = CountingStore(plane.store, tally)
        tuned_sites = [[r.site.kernel, repr(r.site.key), r.site.occurrence] for r in layer.report.results]
        calls = [call(1800 + 10 * i, T, tally) for i in range(5)]
        new_bucket = [call(1900 + 10 * i, 2 * T, tally) for i in range(2)]
    return {"tuned_sites": tuned_sites, "calls": calls, "new_bucket": new_bucket, "fallbacks": layer.fallbacks,
            "tuned": layer.tuned}


@cases.case
def case_keys_differ(ctx: Ranks) -> dict:
    """A user keys on per-rank data (exact local row count): the ranks' sites differ -> TuningError."""
    E, k, H, I = 8, 2, 32, 32
    T = 16 + 8 * ctx.rank
    g = torch.Generator().manual_seed(40 + ctx.rank)
    x = torch.randn(T, H, generator=g).to(ctx.device, DTYPE)
    ids, wts = routing_for(T, E, k, 50 + ctx.rank, ctx.device)
    w_gu = (torch.randn(E, H, 2 * I, generator=g) / H ** 0.5).to(ctx.device, DTYPE)
    w_d = (torch.randn(E, I, H, generator=g) / I ** 0.5).to(ctx.device, DTYPE)
    kernel = moe.make_moe_kernel(None)

    @disttune.contextual_autotune(**tuner_options(ctx, "keys_differ"))
    def step():
        return moe.moe_mlp(x, ids, wts, w_gu, w_d, kernel=kernel, bucket=lambda rows: rows)

    step()
    return {"raised": False}


@cases.case
def case_graph(ctx: Ranks) -> dict:
    """``graph_safe=True``: the host-sync arguments are refused; eagerly it gives the default path's
    result; on NCCL GPUs ag_moe and the whole TP layer (tuned in context first) are captured in CUDA
    graphs and replayed on fresh inputs copied into the captured ones, with default-path (eager) calls
    in between, each replay checked against the per-expert reference."""
    tokens = [12 + 4 * r for r in range(ctx.world)]
    E, k, H, I = 8, 2, 32, 16 * ctx.world
    kernel = moe.make_moe_kernel(moe.CPU_MOE_CONFIGS[1:2] if not GPU else None)
    p = full_problem(ctx, tokens, E, k, H, I, seed=1200)
    x, ids, wts = (p[n][p["mine"]].clone() for n in ("x", "ids", "weights"))
    refused = []
    for bad in (dict(tokens_per_rank=None, check_ids=False), dict(tokens_per_rank=tokens, check_ids=True)):
        try:
            moe.ag_moe(x, ids, p["w_gu_local"], topk_weights=wts, kernel=kernel, graph_safe=True, **bad)
            refused.append("")
        except ValueError as err:
            refused.append(str(err))

    def ag(graph_safe: bool) -> torch.Tensor:
        return moe.ag_moe(x, ids, p["w_gu_local"], topk_weights=wts, kernel=kernel, tokens_per_rank=tokens,
                          check_ids=False, graph_safe=graph_safe).out

    eager_equal = bool(torch.equal(ag(True), ag(False)))
    # eager graph-safe calls whose rows change, one with ranks sending nothing: the handshake must still pair up
    varied = []
    for i, counts in enumerate((tokens, [tokens[0]] + [0] * (ctx.world - 1), tokens, [t + 3 for t in tokens])):
        q = full_problem(ctx, counts, E, k, H, I, seed=1400 + i)
        args = [q[n][q["mine"]] for n in ("x", "ids", "weights")]
        outs = [moe.ag_moe(args[0], args[1], q["w_gu_local"], topk_weights=args[2], kernel=kernel,
                           tokens_per_rank=counts, check_ids=False, graph_safe=safe).out for safe in (True, False)]
        varied.append(bool(torch.equal(*outs)))
    result = {"refused": refused, "eager_equal": eager_equal, "varied_equal": varied, "captured": False}
    if not (GPU and dist.get_backend() == "nccl"):
        return result

    @disttune.contextual_autotune(**tuner_options(ctx, "graph"))
    def layer() -> torch.Tensor:
        return moe.tp_moe_layer(x, ids, wts, p["w_gu_local"], p["w_d_local"], kernel=kernel, tokens_per_rank=tokens,
                                check_ids=False, graph_safe=True)

    layer()  # tuned here, before capture; then the usual warm-up on a side stream
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        layer(), ag(True)
    torch.cuda.current_stream().wait_stream(side)
    layer_graph, ag_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(layer_graph):
        layer_out = layer()
    with torch.cuda.graph(ag_graph):
        ag_out = ag(True)
    errors = []
    for replay in range(6):  # fresh routing and tokens each replay, an eager call in between
        q = full_problem(ctx, tokens, E, k, H, I, seed=1300 + 10 * replay)
        x.copy_(q["x"][q["mine"]]), ids.copy_(q["ids"][q["mine"]]), wts.copy_(q["weights"][q["mine"]])
        layer_graph.replay()
        ref = moe.moe_mlp_reference(q["x"], q["ids"], q["weights"], p["w_gate_up"], p["w_down"])[q["mine"]]
        layer_err = rel_error(layer_out, ref)
        eager = ag(False).clone()
        ag_graph.replay()
        errors.append({"layer_err": layer_err, "ag_equal": bool(torch.equal(ag_out, eager))})
    torch.cuda.synchronize()
    result.update(captured=True, replays=errors,
                  flags_left_set=int(moe_ag.token_pusher(None, True).arrival_flags.count_nonzero()))

    @disttune.contextual_autotune(**tuner_options(ctx, "graph_replayed"), cuda_graph=True)
    def replayed(x_in, ids_in, wts_in) -> torch.Tensor:
        return moe.tp_moe_layer(x_in, ids_in, wts_in, p["w_gu_local"], p["w_d_local"], kernel=kernel,
                                tokens_per_rank=tokens, check_ids=False, graph_safe=True)

    wrapped_errors = []  # tuned, then captured, then replayed on fresh inputs passed as arguments
    for call in range(4):
        q = full_problem(ctx, tokens, E, k, H, I, seed=1600 + 10 * call)
        out = replayed(*(q[n][q["mine"]] for n in ("x", "ids", "weights")))
        ref = moe.moe_mlp_reference(q["x"], q["ids"], q["weights"], p["w_gate_up"], p["w_down"])[q["mine"]]
        wrapped_errors.append(rel_error(out, ref))
    result.update(wrapped_errors=wrapped_errors, wrapped_graphs=(replayed.graphs.captures, replayed.graphs.replays))
    try:
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            ag(False)
        result["unsafe_capture"] = ""
    except RuntimeError as err:
        result["unsafe_capture"] = str(err)

    from disttune.kernels.ag_gemm import AllGatherGEMM
    from disttune.kernels.gemm_rs import GemmReduceScatter
    from disttune.kernels.matmul import gemm_config
    from disttune.kernels.shard_gemm import make_shard_gemm_kernel

    a, b = torch.randn(64, 64, device=ctx.device, dtype=DTYPE), torch.randn(64, 32, device=ctx.device, dtype=DTYPE)
    refused_ops = []
    one_config = [gemm_config(64, 64, 32, 1, 3, 4)]
    for op in (AllGatherGEMM(kernel=make_shard_gemm_kernel(one_config)),
               GemmReduceScatter(kernel=make_shard_gemm_kernel(one_config))):
        op(a, b)  # warm-up outside the graph: fine
        try:
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                op(a, b)
            refused_ops.append("")
        except RuntimeError as err:
            refused_ops.append(str(err))
    result["refused_ops"] = refused_ops

    @disttune.contextual_autotune(**tuner_options(ctx, "graph_untuned"))
    def untuned() -> torch.Tensor:
        return ag(True)

    try:
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            untuned()
        result["untuned_capture"] = ""
    except disttune.TuningError as err:
        result["untuned_capture"] = str(err)
    return result


def errors_of(scenarios: dict) -> dict:
    """Run each scenario in turn: ``{name: "ErrorType: message"}``, or None for a scenario that raised nothing."""
    raised = {}
    for name, call in scenarios.items():
        try:
            call()
            raised[name] = None
        except Exception as err:  # noqa: BLE001 - recorded for the test
            raised[name] = f"{type(err).__name__}: {err}"
    return raised


@cases.case
def case_inconsistent(ctx: Ranks) -> dict:
    """Inputs valid on each rank but inconsistent across ranks, or bad on one rank only: every rank
    must raise the same kind of error (no hang, no silently wrong result), and the group must still
    work afterwards. Rank 1 is the odd one out in every scenario."""
    tokens = [6 + 3 * r for r in range(ctx.world)]
    E, k, H, I = 8, 2, 32, 16 * ctx.world
    kernel = moe.make_moe_kernel(moe.CPU_MOE_CONFIGS[1:2] if not GPU else None)
    p = full_problem(ctx, tokens, E, k, H, I, seed=1500)
    x, ids, wts, w = p["x"][p["mine"]], p["ids"][p["mine"]], p["weights"][p["mine"]], p["w_gu_local"]
    odd = ctx.rank == 1
    other_dtype = torch.float32 if DTYPE == torch.float16 else torch.float16  # on GPUs: same size as bf16
    wider = dict(x=torch.cat([x, x[:, :8]], dim=1), w=torch.cat([w, w[:, :8]], dim=1))
    # moe_rs's inputs: the activation of a valid AG-MoE call (the ranks agree on its routings)
    ag = moe.ag_moe(x, ids, w, topk_weights=wts, kernel=kernel)
    g, w_d, routings, gathered_wts = moe.silu_and_mul(ag.out), p["w_d_local"], ag.routings, ag.topk_weights
    scenarios = {
        "hidden size": lambda: moe.ag_moe(wider["x"] if odd else x, ids, wider["w"] if odd else w, topk_weights=wts,
                                          kernel=kernel),
        "dtype": lambda: moe.ag_moe(x.to(other_dtype) if odd else x, ids, w.to(other_dtype) if odd else w,
                                    topk_weights=wts, kernel=kernel),
        "x and w dtypes": lambda: moe.ag_moe(x.to(other_dtype) if odd else x, ids, w, topk_weights=wts, kernel=kernel),
        "weights on one rank": lambda: moe.ag_moe(x, ids, w, topk_weights=None if odd else wts, kernel=kernel),
        "experts": lambda: moe.ag_moe(x, ids % 4 if odd else ids, w[:4] if odd else w, kernel=kernel),
        "tokens_per_rank values": lambda: moe.ag_moe(
            x, ids, w, kernel=kernel,
            tokens_per_rank=[t + (1 if odd and r != ctx.rank else 0) for r, t in enumerate(tokens)]),
        "tokens_per_rank on one rank": lambda: moe.ag_moe(x, ids, w, kernel=kernel,
                                                          tokens_per_rank=None if odd else tokens),
        "expert ids": lambda: moe.ag_moe(x, ids + E if odd else ids, w, kernel=kernel),
        "local input": lambda: moe.ag_moe(x, ids[:-1] if odd else ids, w, kernel=kernel),
        "out rows": lambda: moe.ag_moe(x, ids, w, kernel=kernel, out=torch.empty(
            sum(tokens) * k + (1 if odd else 0), w.shape[2], device=ctx.device, dtype=DTYPE)),
        "layer weights": lambda: moe.tp_moe_layer(x, ids, wts, w, p["w_d_local"][:, :, :-1] if odd else p["w_d_local"],
                                                  kernel=kernel),
        "moe_rs hidden size": lambda: moe.moe_rs(g, routings, gathered_wts, w_d[:, :, :-1] if odd else w_d,
                                                 kernel=kernel),
        "moe_rs weights on one rank": lambda: moe.moe_rs(g, routings, None if odd else gathered_wts, w_d,
                                                         kernel=kernel),
        "moe_rs token counts": lambda: moe.moe_rs(g, routings[::-1] if odd else routings, gathered_wts, w_d,
                                                  kernel=kernel),
        "moe_rs local input": lambda: moe.moe_rs(g[:-1] if odd else g, routings, gathered_wts, w_d, kernel=kernel),
    }
    raised = errors_of(scenarios)
    # the group still works: a valid call afterwards gives the right rows
    ag = moe.ag_moe(x, ids, w, topk_weights=wts, kernel=kernel)
    ref = moe.moe_gemm_reference(p["x"], p["ids"], w)
    row, err = 0, 0.0
    for r in range(ctx.world):
        err = max(err, rel_error(ag.routings[r].unsort(ag.chunk(r)), ref[row: row + tokens[r] * k]))
        row += tokens[r] * k
    rs = moe.moe_rs(moe.silu_and_mul(ag.out), ag.routings, ag.topk_weights, p["w_d_local"], kernel=kernel)
    ref_rs = moe.moe_mlp_reference(p["x"], p["ids"], p["weights"], p["w_gate_up"], p["w_down"])[p["mine"]]
    return {"raised": raised, "after_err": err, "after_rs_err": rel_error(rs, ref_rs)}


#: The input checks a layer call runs, counted by ``case_cached_checks``.
LAYER_CHECKS = {"check": [(moe, "_check_mlp"), (moe_ag, "_check_locally"), (moe_rs, "_check_stacked")]}


@cases.case
def case_cached_checks(ctx: Ranks) -> dict:
    """The layer's input checks run once per layout of its inputs: a second call like the first (new tensors,
    same layout) runs none of them. Bad calls after it, each differing from it in one input, on rank 1 only
    (the down weights, the token count of its routing) or on every rank (moe_rs_stacked's activation), still
    raise on every rank; a valid call afterwards is right."""
    tokens = [5 + 2 * r for r in range(ctx.world)]
    E, k, H, I = 8, 2, 48, 16 * ctx.world  # H: a layout no earlier case has checked
    kernel = moe.make_moe_kernel(moe.CPU_MOE_CONFIGS[1:2] if not GPU else None)
    p = full_problem(ctx, tokens, E, k, H, I, seed=1550)
    # fresh tensors (aligned as the clones below are): a bad call differs from the good ones in its bad input only
    x, ids, wts = (p[name][p["mine"]].clone() for name in ("x", "ids", "weights"))
    w_gu, w_d = p["w_gu_local"], p["w_d_local"]
    odd = ctx.rank == 1
    ref = moe.moe_mlp_reference(p["x"], p["ids"], p["weights"], p["w_gate_up"], p["w_down"])[p["mine"]]

    def layer(x_in, ids_in, w_down):
        return moe.tp_moe_layer(x_in, ids_in, wts if ids_in.shape == ids.shape else wts[:-1], w_gu, w_down,
                                kernel=kernel)

    with count_calls(LAYER_CHECKS) as tally:
        errs = [rel_error(layer(x, ids, w_d), ref)]
        first = dict(tally)
        tally.clear()
        errs.append(rel_error(layer(x.clone(), ids.clone(), w_d.clone()), ref))
        second = dict(tally)
    ag = moe.ag_moe(x, ids, w_gu, topk_weights=wts, kernel=kernel, layout="expert")
    g = moe.silu_and_mul(ag.out)
    moe.moe_rs_stacked(g, ag.routing, ag.topk_weights, w_d, kernel=kernel)  # its layout passes the checks
    scenarios = {
        "layer weights": lambda: layer(x, ids, w_d[:, :, :-1] if odd else w_d),
        "layer routing rows": lambda: layer(x, ids[:-1] if odd else ids, w_d),
        "moe_rs_stacked local input": lambda: moe.moe_rs_stacked(g[:-1], ag.routing, ag.topk_weights, w_d,
                                                                 kernel=kernel),
    }
    raised = errors_of(scenarios)
    errs.append(rel_error(layer(x, ids, w_d), ref))
    return {"first": first, "second": second, "raised": raised, "errs": errs}


@cases.case
def case_recover(ctx: Ranks) -> dict:
    """An error raised on every rank in the middle of ``ag_moe`` (expert ids out of range, found after the
    tokens were gathered) leaves the next calls working and right."""
    tokens = [10 + 2 * r for r in range(ctx.world)]
    E, k, H, I = 8, 2, 32, 16 * ctx.world
    kernel = moe.make_moe_kernel(moe.CPU_MOE_CONFIGS[1:2] if not GPU else None)
    p = full_problem(ctx, tokens, E, k, H, I, seed=1600)
    x, ids, wts, w = p["x"][p["mine"]], p["ids"][p["mine"]], p["weights"][p["mine"]], p["w_gu_local"]
    try:
        moe.ag_moe(x, ids + E * (ctx.rank == ctx.world - 1), w, topk_weights=wts, kernel=kernel)
        raised = None
    except ValueError as err:
        raised = str(err)
    ref = moe.moe_gemm_reference(p["x"], p["ids"], w)
    errs = []
    for _ in range(3):
        ag = moe.ag_moe(x, ids, w, topk_weights=wts, kernel=kernel)
        row, err = 0, 0.0
        for r in range(ctx.world):
            err = max(err, rel_error(ag.routings[r].unsort(ag.chunk(r)), ref[row: row + tokens[r] * k]))
            row += tokens[r] * k
        errs.append(err)
    return {"raised": raised, "errs": errs}


if __name__ == "__main__":
    sys.exit(cases.main())
