"""Multi-rank correctness checks of AllGather-GEMM and GEMM-ReduceScatter (run under torchrun).

    python tests/tp_cases.py [CASE ...] [--out DIR] [--size tiny|small|large] [--dtypes float16,float32] [--tune]

Cases: ``ag_gemm`` and ``gemm_rs`` (the default), ``tuned_mlp`` (added by ``--tune``), and
``inconsistent_inputs`` and ``bad_input_one_rank`` (2 ranks: errors must reach every rank).
Every check draws fresh random inputs, poisons the output with NaN (an unwritten tile
fails), and compares with the torch reference (``all_gather`` + matmul, matmul +
``all_reduce``); relative Frobenius error must stay within the dtype's bound. A case
records how many checks it ran (``checks``) and fails listing every check that did not
pass. ``tuned_mlp`` wraps a TP-MLP step (AG-GEMM then GEMM-RS) in ``contextual_autotune``
and checks that every rank got the same winners. Each rank prints the harness's summary
line (see ``rank_cases``). On CPUs this runs on gloo under ``TRITON_INTERPRET=1``; on GPUs
on NCCL with the symmetric-memory designs.
"""

from __future__ import annotations

import argparse
import sys

from rank_cases import CaseFailed, Cases, Ranks, say

import torch  # noqa: E402

import disttune  # noqa: E402
from disttune.kernels.ag_gemm import AllGatherGEMM, ag_gemm_reference  # noqa: E402
from disttune.kernels.gemm_rs import GemmReduceScatter, gemm_rs_reference, padded_width  # noqa: E402
from disttune.kernels.matmul import HOPPER_GEMM_CONFIGS  # noqa: E402
from disttune.kernels.shard_gemm import make_shard_gemm_kernel  # noqa: E402
from disttune.kernels.tp_common import split_rows  # noqa: E402
from numerics import rel_error  # noqa: E402

TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 2e-3}  # fp32 on GPU is TF32

cases = Cases(__doc__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", choices=["tiny", "small", "large"], default="small")
    parser.add_argument("--dtypes", default="float16,float32")
    parser.add_argument("--tune", action="store_true", help="also run tuned_mlp")
    parser.add_argument("--trace", action="store_true", help="print each check before it runs (find a hang)")
    parser.add_argument("--all-configs", action="store_true",
                        help="GPU: stock-autotune the checked ops over the full Hopper space (default: 4 configs "
                             "of different tile shapes, so the check is not dominated by compiling)")


def default_cases(options: argparse.Namespace) -> list[str]:
    return ["ag_gemm", "gemm_rs"] + (["tuned_mlp"] if options.tune else [])


class Checks:
    """Counts checks and collects the failed ones; ``verdict`` raises listing them all."""

    def __init__(self, ranks: Ranks) -> None:
        self.ranks = ranks
        self.count = 0
        self.failures: list[str] = []
        self.generator = torch.Generator().manual_seed(100 + ranks.rank)

    def rand(self, *shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(*shape, generator=self.generator).to(self.ranks.device, dtype)

    def trace(self, what: str) -> None:
        if self.ranks.options.trace:
            say(f"rank {self.ranks.rank}: {what}")

    def within(self, what: str, err: float, bound: float) -> None:
        self.count += 1
        if not err <= bound:
            self.failures.append(f"{what}: rel. error {err:.2e}")

    def verdict(self, **fields) -> dict:
        if self.failures:
            raise CaseFailed(f"{len(self.failures)} of {self.count} checks failed:\n  " + "\n  ".join(self.failures))
        return {"checks": self.count, **fields}


def dtypes(ranks: Ranks) -> list[torch.dtype]:
    return [getattr(torch, name) for name in ranks.options.dtypes.split(",")]


def shard_kernel(ranks: Ranks):
    """The checked ops' kernel: on GPUs 4 configs of different tile shapes unless ``--all-configs``."""
    few = None if ranks.options.all_configs or ranks.device.type != "cuda" else \
        [HOPPER_GEMM_CONFIGS[i] for i in (0, 1, 9, 10)]
    return make_shard_gemm_kernel(few)


@cases.case
def case_ag_gemm(ranks: Ranks) -> dict:
    """Both AG-GEMM designs (and the fused one in 4 chunks over 2 streams), ragged shards, twice each."""
    world, size = ranks.world, ranks.options.size
    if size == "tiny":  # one ragged shape: the 8-rank code-path check
        shapes = [(tuple(split_rows(8 * world + 3, world)), 16, 16)]
    elif size == "small":
        shapes = [((8,) * world, 32, 16), (tuple(split_rows(37, world)), 24, 24), ((20,) * world, 40, 32)]
    else:
        shapes = [((1024,) * world, 4096, 2048), (tuple(split_rows(3001, world)), 2048, 1024)]
    if world > 1:  # rank 0 without rows: it sends nothing, and nobody waits for its shard
        shapes.append(((0,) + tuple(split_rows(shapes[-1][0][0] * world - 2, world - 1)), 32, 16))
    ops = {design: AllGatherGEMM(design=design, kernel=shard_kernel(ranks)) for design in ("fused", "decomposed")}
    # shards in 4 flagged pieces over 2 copy streams (GPU: 4 pushes per peer, 2 side streams)
    ops["fused, 4 chunks, 2 streams"] = AllGatherGEMM(design="fused", chunks=4, streams=2, kernel=shard_kernel(ranks))
    checks = Checks(ranks)
    for dtype in dtypes(ranks):
        for rows, K, n_local in shapes:
            for design, op in ops.items():
                for again in range(2):  # twice: the second call reuses the double-buffered workspace
                    a_shard = checks.rand(rows[ranks.rank], K, dtype=dtype)
                    b_local = checks.rand(K, n_local, dtype=dtype) / K ** 0.5
                    if again:  # B as the transpose of a row-major [N, K] weight (the K-major path)
                        b_local = b_local.t().contiguous().t()
                    out = torch.full((sum(rows), n_local), float("nan"), dtype=dtype, device=ranks.device)
                    checks.trace(f"AG-GEMM {design} rows={rows} K={K} {dtype} #{again}")
                    op(a_shard, b_local, out, shard_rows=rows)
                    checks.within(f"AG-GEMM {design} rows={rows} K={K} N_r={n_local} {dtype}",
                                  rel_error(out, ag_gemm_reference(a_shard, b_local, rows)), TOLERANCE[dtype])
    return checks.verdict()


@cases.case
def case_gemm_rs(ranks: Ranks) -> dict:
    """Both GEMM-RS designs, rows that do not divide by the ranks, twice each (the second with a K-major B); a
    width whose rows are not whole 16 bytes (``out`` padded, B K-major only: a row-major B needs aligned rows)."""
    world, size = ranks.world, ranks.options.size
    if size == "tiny":
        shapes = [(8 * world + 3, 16, 16)]
    elif size == "small":
        shapes = [(16 * world, 32, 16), (37, 24, 24), (41, 16, 40), (29, 16, 20)]
    else:
        shapes = [(4096, 2048, 4096), (3001, 1024, 2048), (2048, 1024, 1004)]
    ops = {design: GemmReduceScatter(design=design, kernel=shard_kernel(ranks)) for design in ("decomposed", "fused")}
    checks = Checks(ranks)
    for dtype in dtypes(ranks):
        for M, K_local, N in shapes:
            for design, op in ops.items():
                for again in range(2):
                    if not again and padded_width(N, dtype) != N:  # rows not whole 16 bytes
                        continue
                    a_local = checks.rand(M, K_local, dtype=dtype)
                    b_local = checks.rand(K_local, N, dtype=dtype) / (K_local * world) ** 0.5
                    if again:
                        b_local = b_local.t().contiguous().t()
                    mine = split_rows(M, world)[ranks.rank]
                    out = torch.full((mine, padded_width(N, dtype)), float("nan"), dtype=dtype,
                                     device=ranks.device)[:, :N]
                    checks.trace(f"GEMM-RS {design} M={M} K_r={K_local} N={N} {dtype} #{again}")
                    op(a_local, b_local, out)
                    checks.within(f"GEMM-RS {design} M={M} K_r={K_local} N={N} {dtype}",
                                  rel_error(out, gemm_rs_reference(a_local, b_local)), TOLERANCE[dtype] * 2)
    return checks.verdict()


@cases.case(default=False)
def case_tuned_fused_gemm_rs(ranks: Ranks) -> dict:
    """The fused GEMM-RS (its partials in one launch) tuned in context: right result, and every rank holds the
    same winners for its two sites (the partials, the own rows)."""
    world = ranks.world
    checks = Checks(ranks)
    dtype = dtypes(ranks)[0]
    # (rows that divide by the ranks: the own rows' GEMM keys on its row count, which must be the same everywhere)
    M, K_local, N = (16 * world, 32, 24) if ranks.options.size != "large" else (4096, 2048, 4096)
    a_local = checks.rand(M, K_local, dtype=dtype)
    b_local = checks.rand(K_local, N, dtype=dtype) / (K_local * world) ** 0.5
    out = torch.empty(split_rows(M, world)[ranks.rank], N, dtype=dtype, device=ranks.device)
    rs = GemmReduceScatter(design="fused")

    @disttune.contextual_autotune(is_dist=True, n_warmup=1, n_repeat=2, timeout_s=120)
    def step():
        out.fill_(float("nan"))
        return rs(a_local, b_local, out)

    checks.within("tuned fused GEMM-RS", rel_error(step(), gemm_rs_reference(a_local, b_local)), TOLERANCE[dtype] * 2)
    winners = agreed_winners(ranks, checks, step, lambda sites: sites == 2, "not one per site (partials, own rows)")
    return checks.verdict(winners=winners)


def agreed_winners(ranks: Ranks, checks: Checks, step, sites_ok, what: str) -> list:
    """``step``'s winners ([kernel, key, occurrence, config] per site), checked to be the same on every rank and
    their number to satisfy ``sites_ok`` (a failure saying ``what`` otherwise)."""
    winners = [[r.site.kernel, repr(r.site.key), r.site.occurrence, disttune.describe_config(r.config)]
               for r in step.report.results]
    everyone = ranks.all_gather_object(winners)
    checks.count += 1
    if any(w != everyone[0] for w in everyone) or not sites_ok(len(winners)):
        checks.failures.append(f"winners differ between ranks or {what}: {everyone}")
    return winners


@cases.case(default=False)
def case_tuned_mlp(ranks: Ranks) -> dict:
    """A TP-MLP step tuned in context: right result, and every rank holds the same winners (>= 2 sites)."""
    world, device = ranks.world, ranks.device
    checks = Checks(ranks)
    dtype = dtypes(ranks)[0]
    M, H, F = (16 * world, 32, 16 * world) if ranks.options.size != "large" else (4096, 4096, 8192)
    x_shard = checks.rand(M // world, H, dtype=dtype)
    w_up = checks.rand(H, F // world, dtype=dtype) / H ** 0.5
    w_down = checks.rand(F // world, H, dtype=dtype) / F ** 0.5
    hidden = torch.empty(M, F // world, dtype=dtype, device=device)
    y = torch.empty(M // world, H, dtype=dtype, device=device)
    ag, rs = AllGatherGEMM(), GemmReduceScatter()

    @disttune.contextual_autotune(is_dist=True, n_warmup=1, n_repeat=2, timeout_s=120)
    def tp_mlp():
        y.fill_(float("nan"))
        ag(x_shard, w_up, hidden)
        return rs(hidden, w_down, y)

    result = tp_mlp()
    want = gemm_rs_reference(ag_gemm_reference(x_shard, w_up), w_down)
    checks.within("tuned TP-MLP", rel_error(result, want), TOLERANCE[dtype] * 4)
    winners = agreed_winners(ranks, checks, tp_mlp, lambda sites: sites >= 2, "too few sites")
    if ranks.rank == 0:
        for kernel, key, occurrence, config in winners:
            say(f"winner {kernel.rsplit('.', 1)[-1]} key={key} #{occurrence}: {config}")
    return checks.verdict(winners=winners)


@cases.case(default=False)
def case_inconsistent_inputs(ranks: Ranks) -> dict:
    """Rank 1 has another inner size: AllGatherGEMM must raise the same ValueError on every rank."""
    K = 32 if ranks.rank == 0 else 48
    a = torch.randn(8, K, dtype=torch.float16, device=ranks.device)
    b = torch.randn(K, 16, dtype=torch.float16, device=ranks.device)
    AllGatherGEMM()(a, b)
    return {"unexpected": "no error"}


@cases.case(default=False)
def case_bad_input_one_rank(ranks: Ranks) -> dict:
    """Rank 1's A has 24-byte rows (a local error, raised on both ranks); then rank 1 owns no columns
    of B and must still serve its rows to rank 0."""
    dev = ranks.device
    K = 16 if ranks.rank == 0 else 12
    try:
        GemmReduceScatter()(torch.randn(8, K, dtype=torch.float16, device=dev),
                            torch.randn(K, 16, dtype=torch.float16, device=dev))
        raised = None
    except ValueError as err:
        raised = str(err).splitlines()[0]
    a = torch.randn(8, 16, dtype=torch.float16, device=dev)
    b = torch.randn(16, 16 if ranks.rank == 0 else 0, dtype=torch.float16, device=dev)
    out = AllGatherGEMM()(a, b)
    want = ag_gemm_reference(a, b)
    close = tuple(out.shape) == tuple(want.shape) and (
        out.numel() == 0 or rel_error(out, want) < TOLERANCE[torch.float16])
    return {"raised": raised, "gathered_shape": list(out.shape), "gathered_ok": bool(close)}


if __name__ == "__main__":
    sys.exit(cases.main(add_arguments=add_arguments, default_cases=default_cases))
