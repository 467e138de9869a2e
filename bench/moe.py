"""MoE benchmark: the Triton grouped GEMM vs torch, AG-MoE / MoE-RS vs sequential, contextual vs alone.

    torchrun --nproc_per_node=2 bench/moe.py [--out moe.jsonl]   # GPUs: all three parts at world size 2
    torchrun --nproc_per_node=1 bench/moe.py --parts a [--tile-order grouped] [--split-columns 2]
    python bench/moe.py --smoke                                   # CPU, interpreter, tiny shapes: code paths only

Parts (``--parts``, default ``abc``):

a. Up projection only, bf16, on every rank's own GPU (rank 0 reported): the Triton grouped
   GEMM (stock ``triton.autotune`` over the Hopper space) vs ``torch._grouped_mm`` vs a
   per-expert torch loop, on (T=4096, E=8, top-2, H=4096, I=7168) and (T=4096, E=64, top-6,
   H=2048, I=1408). Same x, routing and weights for all. The routing (``moe_align``: sort +
   histogram) is *outside* the timed region for everyone. The token permutation (``x[perm]``,
   R x H elements) is *inside* for every contender that needs a permuted A (grouped_mm, the
   loop, Triton "sorted"); Triton "gather" loads rows through the routing and needs none.
   "GEMM only" rows time grouped_mm and Triton "sorted" on a pre-permuted A as well. "K-major W"
   rows give grouped_mm and Triton the same weights stored as ``[E, N, K]`` (``w.transpose(1, 2)``
   of a contiguous copy), the layout tensor-descriptor loads favour. ``--tile-order`` chooses the
   order in which the Triton kernel walks its tiles (``moe.TILE_ORDERS``); ``--split-columns N`` times the
   GEMM one rank of an N-rank layer runs (every token, I / N columns). Each contender's host µs per
   call (the time to issue it, 50 calls back to back, best of 3 rounds) is printed beside its GPU µs
   (back to back) and its one call from idle, which is at least the larger of the two.
b. AG-MoE and MoE-RS at the launched world size (tokens T/w per rank, expert columns I/w):
   ``moe.ag_moe`` / ``moe.moe_rs_stacked`` (the layer's MoE-RS) vs the sequential forms (NCCL
   all_gather of tokens and routing, then routing + permutation + ``torch._grouped_mm``; ``torch._grouped_mm`` +
   weighting + un-permute + top-k sum, then ``reduce_scatter_tensor``). Max over ranks. On 2 GPUs or
   more a third AG-MoE contender is ``ag_moe(graph_safe=True)`` called eagerly (the tokens pushed on the
   copy engines while the routing is sorted, instead of all-gathered). On GPUs
   a second table times the same steps captured in CUDA graphs and replayed (``ag_moe`` with
   ``graph_safe=True``): a few µs of host per call, so the GPU work and the overlap decide.
c. The TP layer (``moe.tp_moe_layer``: AG-MoE gate-up, SiLU-gating, MoE-RS down) with the
   winners of ``disttune.contextual_autotune`` (tuned inside the layer, agreed by all ranks)
   vs the winners of stock ``triton.autotune`` tuned alone (each GEMM by itself, outside the
   layer, on this rank's gathered inputs), each called bare inside the layer, and the wrapped
   call itself: one call from idle each, interleaved round by round (``disttune.benchmark.interleaved``:
   median [low-high] and host ms per call, max over ranks). The bare rows launch a key's cached
   winner at every occurrence, the wrapped call each occurrence's own: the occurrences that differ
   are listed (then the two run different kernels and the host column compares the calls). On GPUs a
   fourth row is the wrapped call with ``cuda_graph=True`` (tuned on a kernel of its own, then each call a
   CUDA graph replay).

Timing (``disttune.benchmark``): CUDA events around each call (the host clock on CPUs),
``--warmup`` calls first. Part a: ``--iters`` samples, median. Parts b and c time their contenders in
interleaved rounds (``disttune.benchmark.interleaved``: each round times every contender once, in a rotating
order, so a drift of the host or the GPUs hits them alike): ``--iters`` rounds of one call from idle, and on
GPUs (parts a and b) ``--iters`` / 2 rounds of a steady state, 10 calls back to back between two events, per
call; a round's time is the slowest rank's, and the tables print the median [low-high] over the rounds and
the host's time to issue a call. Multi-rank samples start after a barrier. Rank 0 prints markdown tables and,
with ``--out FILE``, appends one JSON line per contender (with device, versions and date) to FILE.

Cost on GPUs, per shape: part a 9 contenders, part b 4 steps and their 4 parts (plus 4 CUDA
graphs), part c 3 layer variants (4 on GPUs), each ``--warmup`` + ``--iters`` single calls and, where a
steady state is reported, 3 + 10 x ``--iters`` / 2 back-to-back calls; plus stock tuning of the
grouped GEMM (12 configs per key) and one contextual tuning of the layer (two on GPUs).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Callable, Optional

import torch

SMOKE = "--smoke" in sys.argv
if SMOKE or not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.distributed as dist  # noqa: E402

import disttune  # noqa: E402
from disttune import benchmark  # noqa: E402
from disttune import dist as dt_dist  # noqa: E402
from disttune.benchmark import rel_error  # noqa: E402
from disttune.kernels import moe  # noqa: E402

FULL_SHAPES = [dict(T=4096, E=8, k=2, H=4096, I=7168), dict(T=4096, E=64, k=6, H=2048, I=1408)]
SMOKE_SHAPES = [dict(T=32, E=8, k=2, H=32, I=64), dict(T=32, E=16, k=6, H=32, I=32)]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU/interpreter, tiny shapes, 2 samples")
    p.add_argument("--parts", default="abc", help="subset of 'abc'")
    p.add_argument("--shapes", default="0,1", help="indices into the shape list")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--split-columns", type=int, default=1, metavar="N",
                   help="part a: the GEMM one rank of N runs in the layer (every token, I / N columns)")
    p.add_argument("--tile-order", default="expert_bands", choices=moe.TILE_ORDERS,
                   help="part a: the order in which the Triton grouped GEMM walks its tiles")
    p.add_argument("--out", default=None, help="append the rows as JSON lines to this file (rank 0)")
    p.add_argument("--host-profile", action="store_true",
                   help="part b: rank 0 prints a cProfile of 50 ag_moe calls (where its host time goes)")
    o = p.parse_args()
    o.warmup = o.warmup if o.warmup is not None else (1 if o.smoke else 10)
    o.iters = o.iters if o.iters is not None else (2 if o.smoke else 50)
    return o


class Bench:
    def __init__(self, o: argparse.Namespace) -> None:
        self.o = o
        info = dt_dist.init()
        self.rank, self.world, self.device = info.rank, info.world_size, info.device
        self.gpu = self.device.type == "cuda" and not moe.interpreting()
        self.dtype = torch.bfloat16 if self.gpu else torch.float16  # bf16 dot is wrong in the interpreter
        self.configs = moe.HOPPER_MOE_CONFIGS if self.gpu else moe.CPU_MOE_CONFIGS
        self.shapes = [(SMOKE_SHAPES if o.smoke else FULL_SHAPES)[int(i)] for i in o.shapes.split(",")]
        self.rows: list[dict] = []
        self.meta = benchmark.environment(smoke=o.smoke)

    # -- timing -----------------------------------------------------------------------------
    def sync(self) -> None:
        if self.gpu:
            torch.cuda.synchronize()

    def time_ms(self, fn: Callable[[], object], collective: bool = False) -> float:
        """One call from idle: median ms of ``iters`` calls after ``warmup``; with ``collective`` each sample
        starts after a barrier and the result is the max over ranks."""
        ms = benchmark.one_call_ms(fn, samples=self.o.iters, warmup=self.o.warmup, barrier=collective)
        return benchmark.max_over_ranks(ms) if collective else ms

    def steady_ms(self, fn: Callable[[], object], calls: int = 10) -> float:
        """Per call over ``calls`` back-to-back calls (the host runs ahead, as in a model), median of
        ``iters // 3`` runs, max over ranks."""
        return benchmark.max_over_ranks(benchmark.steady_ms(fn, calls=calls, runs=max(3, self.o.iters // 3)))

    def host_profile(self, fn: Callable[[], object], title: str, calls: int = 50) -> None:
        """cProfile of ``calls`` calls on every rank (no sync in between); rank 0 prints the top 25."""
        for _ in range(3):
            fn()
        host_ms, table = benchmark.cprofile(fn, calls=calls, top=25)
        if self.rank == 0:
            print(f"\n#### host profile: {title}, {calls} calls, {host_ms:.3f} ms host per call (profiled)\n\n{table}")

    def record(self, part: str, shape: dict, name: str, ms: float, **extra) -> None:
        row = dict(bench="moe", part=part, shape=shape, contender=name, ms=ms, **extra)
        self.rows.append(row)

    # -- inputs -----------------------------------------------------------------------------
    def problem(self, s: dict, tokens: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(tokens, s["H"], generator=g).to(self.device, self.dtype)
        scores = torch.rand(tokens, s["E"], generator=g)
        w, ids = scores.topk(s["k"], dim=1)
        return x, ids.to(self.device, torch.int32), (w / w.sum(1, keepdim=True)).to(self.device)

    def weights(self, E: int, K: int, N: int, seed: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(E, K, N, generator=g) / K ** 0.5).to(self.device, self.dtype)

    # -- part a -----------------------------------------------------------------------------
    def part_a(self) -> None:
        for s in self.shapes:
            T, E, k, H, I = s["T"], s["E"], s["k"], s["H"], s["I"]
            if I % self.o.split_columns:
                raise SystemExit(f"I={I} is not a multiple of --split-columns {self.o.split_columns}")
            I //= self.o.split_columns
            x, ids, _ = self.problem(s, T, seed=1)
            w = self.weights(E, H, I, seed=2)
            rt = moe.moe_align(ids, E)
            perm = rt.token_rows()
            offs = rt.expert_offs[1:].contiguous()
            bounds = rt.expert_offs.tolist()
            x_perm = x.index_select(0, perm)
            out = torch.empty(T * k, I, device=self.device, dtype=self.dtype)
            kernel = moe.make_moe_kernel(self.configs)  # stock triton.autotune (do_bench on GPU)

            def loop():
                xp = x.index_select(0, perm)
                for e in range(E):
                    if bounds[e + 1] > bounds[e]:
                        torch.mm(xp[bounds[e]:bounds[e + 1]], w[e], out=out[bounds[e]:bounds[e + 1]])

            w_kmajor = w.transpose(1, 2).contiguous().transpose(1, 2)  # same values, [E, N, K] storage

            def triton_gemm(a, weights, a_order):
                return moe.moe_gemm(a, weights, rt, a_order=a_order, out=out, kernel=kernel,
                                    tile_order=self.o.tile_order)

            def grouped(xp=None, weights=w):
                xp = x.index_select(0, perm) if xp is None else xp
                return torch._grouped_mm(xp, weights, offs=offs, out_dtype=self.dtype)

            contenders = [
                ("torch per-expert loop (+perm)", loop),
                ("torch._grouped_mm (+perm)", grouped),
                ("torch._grouped_mm (GEMM only)", lambda: grouped(x_perm)),
                ("triton gather A (no perm)", lambda: triton_gemm(x, w, "token")),
                ("triton sorted A (+perm)", lambda: triton_gemm(rt.permute(x), w, "sorted")),
                ("triton sorted A (GEMM only)", lambda: triton_gemm(x_perm, w, "sorted")),
                ("torch._grouped_mm K-major W (+perm)", lambda: grouped(weights=w_kmajor)),
                ("triton gather A, K-major W (no perm)", lambda: triton_gemm(x, w_kmajor, "token")),
                ("triton sorted A, K-major W (+perm)", lambda: triton_gemm(rt.permute(x), w_kmajor, "sorted")),
            ]
            # correctness before timing (the first Triton calls also tune)
            ref = grouped().float()
            errors = {}
            for name, fn in contenders[3:]:
                if not name.startswith("triton"):
                    continue
                out.fill_(float("nan"))
                fn()
                errors[name] = rel_error(out, ref)
            flops = 2.0 * T * k * H * I
            results = {}
            # host µs to issue one call (calls back to back, best round): beside the GPU times below
            host = benchmark.host_and_wall_us(dict(contenders), calls=2 if self.o.smoke else 50,
                                              rounds=1 if self.o.smoke else 3)
            host_us = {name: min(run.host_us for run in runs) for name, runs in host.items()}
            for name, fn in contenders:
                one_call = self.time_ms(fn)
                # back to back is the GPU time a model sees (its host runs ahead); one call from idle adds
                # the contender's host launch time, which differs between the Triton and torch paths
                ms = self.steady_ms(fn) if self.gpu else one_call
                results[name] = ms
                winner = None
                if name.startswith("triton"):
                    b_tma = 2 if "K-major" in name else 1
                    winner = next((disttune.describe_config(c) for key, c in kernel.cache.items()
                                   if key[moe.MOE_KEY.index("A_MODE")] == (0 if "gather" in name else 2)
                                   and key[moe.MOE_KEY.index("B_TMA")] == b_tma), None)
                self.record("a", s, name, ms, one_call_ms=one_call, host_us=host_us[name], tflops=flops / ms / 1e9,
                            split_columns=self.o.split_columns,
                            rel_err=errors.get(name),
                            winner=winner, tile_order=self.o.tile_order if name.startswith("triton") else None)
            if self.rank == 0:
                loop_ms = results["torch per-expert loop (+perm)"]
                gm_ms = results["torch._grouped_mm (+perm)"]
                split = "" if self.o.split_columns == 1 else f" (one rank's columns of {self.o.split_columns})"
                print(f"\n### (a) up projection T={T} E={E} top-{k} H={H} I={I}{split} {self.meta['device']} "
                      f"({str(self.dtype).split('.')[-1]}, tile order {self.o.tile_order})\n")
                print("| contender | ms back to back | ms one call | host µs | GPU µs | TFLOP/s | vs loop "
                      "| vs grouped_mm (+perm) | one call vs grouped_mm (+perm) | rel. err vs grouped_mm | winner |")
                print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
                gm_one = next(r["one_call_ms"] for r in self.rows[-len(contenders):]
                              if r["contender"] == "torch._grouped_mm (+perm)")
                for row in self.rows[-len(contenders):]:
                    err = f"{row['rel_err']:.1e}" if row["rel_err"] is not None else ""
                    print(f"| {row['contender']} | {row['ms']:.3f} | {row['one_call_ms']:.3f} | {row['host_us']:.1f} "
                          f"| {row['ms'] * 1e3:.1f} | {row['tflops']:.0f} "
                          f"| {loop_ms / row['ms']:.2f}x "
                          f"| {gm_ms / row['ms']:.2f}x | {gm_one / row['one_call_ms']:.2f}x | {err} "
                          f"| {row['winner'] or ''} |")

    # -- part b -----------------------------------------------------------------------------
    def tp_inputs(self, s: dict, seed: int):
        T, E, k, H, I, w = s["T"], s["E"], s["k"], s["H"], s["I"], self.world
        if T % w or I % w:
            raise SystemExit(f"T={T} and I={I} must be multiples of the world size {w}")
        x, ids, wts = self.problem(s, T // w, seed=seed + self.rank)
        Ir = I // w
        return dict(x=x, ids=ids, wts=wts, T=T, E=E, k=k, H=H, Ir=Ir, tpr=[T // w] * w,
                    w_up=self.weights(E, H, Ir, seed=10 + self.rank), w_gu=self.weights(E, H, 2 * Ir, seed=20 + self.rank),
                    w_down=self.weights(E, Ir, H, seed=30 + self.rank))

    def part_b(self) -> None:
        w = self.world
        for s in self.shapes:
            p = self.tp_inputs(s, seed=100)
            T, E, k, H, Ir, tpr = p["T"], p["E"], p["k"], p["H"], p["Ir"], p["tpr"]
            kernel = moe.make_moe_kernel(self.configs)
            x_all = torch.empty(T, H, device=self.device, dtype=self.dtype)
            ids_all = torch.empty(T, k, device=self.device, dtype=torch.int32)

            def gather(out, inp):
                if self.gpu:
                    dist.all_gather_into_tensor(out, inp)
                else:
                    dist.all_gather(list(out.chunk(w)), inp)

            def ag_fused(graph_safe: bool = False):
                return moe.ag_moe(p["x"], p["ids"], p["w_up"], topk_weights=p["wts"], tokens_per_rank=tpr,
                                  kernel=kernel, check_ids=False, graph_safe=graph_safe, layout="auto")

            def ag_comm():
                gather(x_all, p["x"])
                gather(ids_all, p["ids"])

            def ag_compute():
                rt = moe.moe_align(ids_all, E, check_range=False)
                return torch._grouped_mm(rt.permute(x_all), p["w_up"], offs=rt.expert_offs[1:], out_dtype=self.dtype)

            def ag_seq():
                ag_comm()
                return ag_compute()

            # MoE-RS inputs: the up-projection output in each contender's own layout (prepared untimed)
            ag = ag_fused()  # (tunes the AG sites with stock autotune on first use)
            h_chunks = ag.out
            wts_all = ag.topk_weights
            gather(ids_all, p["ids"])
            rt_all = moe.moe_align(ids_all, E, check_range=False)
            h_joint = ag.routing.unsort(ag.out)[rt_all.sorted_ids.long()]
            w_sorted = wts_all.reshape(-1)[rt_all.sorted_ids.long()].to(self.dtype)
            rs_out = torch.empty(T // w, H, device=self.device, dtype=self.dtype)

            def rs_fused():  # the layer's form: one launch over every destination's rows
                return moe.moe_rs_stacked(h_chunks, ag.routing, wts_all, p["w_down"], kernel=kernel)

            full = torch.empty(T, H, device=self.device, dtype=self.dtype)

            def rs_compute():
                y = torch._grouped_mm(h_joint, p["w_down"], offs=rt_all.expert_offs[1:], out_dtype=self.dtype)
                y = y * w_sorted[:, None]
                y_flat = torch.empty_like(y)
                y_flat[rt_all.sorted_ids.long()] = y
                full.copy_(y_flat.view(T, k, H).sum(1, dtype=torch.float32))

            def rs_comm():
                if self.gpu:
                    dist.reduce_scatter_tensor(rs_out, full)
                else:  # gloo has no reduce_scatter: all_reduce + slice
                    dist.all_reduce(full)
                    rs_out.copy_(full[self.rank * (T // w):(self.rank + 1) * (T // w)])
                return rs_out

            def rs_seq():
                rs_compute()
                return rs_comm()

            if self.o.host_profile:
                self.host_profile(ag_fused, f"ag_moe E={E} top-{k}")
            err = rel_error(rs_fused(), rs_seq())
            ag_seq_name, rs_seq_name = "AG-MoE: all_gather then grouped_mm", "MoE-RS: grouped_mm then reduce_scatter"
            # table row -> (the step whose comm and compute bound it, the sequential contender, ours)
            rows = {"AG-MoE": ("AG-MoE", ag_seq_name, "AG-MoE: disttune ag_moe"),
                    "MoE-RS": ("MoE-RS", rs_seq_name, "MoE-RS: disttune moe_rs")}
            contenders = {ag_seq_name: ag_seq, rows["AG-MoE"][2]: ag_fused, rs_seq_name: rs_seq,
                          rows["MoE-RS"][2]: rs_fused}
            if self.gpu and w > 1:  # the graph-safe form called eagerly: tokens pushed on the copy engines
                pushed = "AG-MoE: disttune ag_moe(graph_safe=True), eager"
                rows["AG-MoE, tokens pushed"] = ("AG-MoE", ag_seq_name, pushed)
                contenders[pushed] = lambda: ag_fused(graph_safe=True)
            idle, steady = self.interleave(s, contenders, rel_err={rows["MoE-RS"][2]: err})
            # The overlap limit: the sequential form's communication and computation timed apart; an
            # overlapped step can at best take the longer of the two, so sequential / limit bounds its speed-up.
            parts = {}
            for name, fn in [("AG-MoE comm", ag_comm), ("AG-MoE compute", ag_compute),
                             ("MoE-RS comm", rs_comm), ("MoE-RS compute", rs_compute)]:
                parts[name] = self.steady_ms(fn) if self.gpu else self.time_ms(fn, collective=True)
                self.record("b", s, name, parts[name], steady_ms=parts[name] if self.gpu else None)
            if self.rank == 0:
                print(f"\n### (b) world {w}: T={T} E={E} top-{k} H={H} I={Ir * w} (I/w={Ir} per rank), "
                      f"{self.o.iters} interleaved rounds from idle"
                      + ("" if steady is None else f", {self.steady_rounds} steady") + ", max over ranks\n")
                print("| step | from idle: sequential | disttune | speed-up | steady: sequential | disttune "
                      "| speed-up | host ms: sequential / disttune | comm | compute | limit "
                      "| best possible (sequential / limit) |")
                print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
                timed = steady if steady is not None else idle
                for label, (step, seq, fused) in rows.items():
                    st = ("n/a | n/a | n/a" if steady is None else f"{steady[seq].text()} | {steady[fused].text()} "
                          f"| {steady[seq].median / steady[fused].median:.2f}x")
                    comm, compute = parts[f"{step} comm"], parts[f"{step} compute"]
                    limit = max(comm, compute)
                    print(f"| {label} | {idle[seq].text()} | {idle[fused].text()} "
                          f"| {idle[seq].median / idle[fused].median:.2f}x | {st} "
                          f"| {timed[seq].host:.3f} / {timed[fused].host:.3f} | {comm:.3f} | {compute:.3f} "
                          f"| {limit:.3f} | {timed[seq].median / limit:.2f}x |")
                print("\nTimes: median [low-high] over the rounds, ms per call; host: the median time to issue a "
                      "round's calls (steady rounds on GPUs), per call. comm / compute / limit: steady state on GPUs "
                      "(median with a barrier on CPUs); the best possible speed-up divides the sequential time by "
                      "the limit.")
                print(f"\nMoE-RS rel. err vs sequential: {err:.1e}")
            if self.gpu:
                self.part_b_graphs(s, [("AG-MoE", ag_seq, lambda: ag_fused(graph_safe=True)), ("MoE-RS", rs_seq, rs_fused)])

    def part_b_graphs(self, s: dict, steps: list) -> None:
        """Part b with each step captured in a CUDA graph and replayed: a few µs of host per call, so the
        GPU work (and the overlap) decides; what a serving engine that captures its layers sees."""
        replays = {}
        for label, seq, fused in steps:
            replays[f"{label}: sequential (CUDA graph)"] = self.graphed(seq)
            replays[f"{label}: disttune (CUDA graph)"] = self.graphed(fused)
        idle, steady = self.interleave(s, replays)
        if self.rank == 0:
            print(f"\n### (b, CUDA graphs) world {self.world}: each step captured once and replayed, interleaved "
                  "rounds, max over ranks\n")
            print("| step | from idle: sequential | disttune | speed-up | steady: sequential | disttune | speed-up |")
            print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
            for label, _, _ in steps:
                seq, fused = f"{label}: sequential (CUDA graph)", f"{label}: disttune (CUDA graph)"
                print(f"| {label} | {idle[seq].text()} | {idle[fused].text()} "
                      f"| {idle[seq].median / idle[fused].median:.2f}x | {steady[seq].text()} | {steady[fused].text()} "
                      f"| {steady[seq].median / steady[fused].median:.2f}x |")

    @property
    def steady_rounds(self) -> int:
        """Part b's steady rounds: half the rounds from idle (each is 10 calls), at least 3."""
        return max(3, self.o.iters // 2)

    def interleave(self, s: dict, contenders: dict, rel_err: Optional[dict] = None) -> tuple[dict, Optional[dict]]:
        """Part b's timing: ``contenders`` in the same interleaved rounds (a drift of the host or the GPUs hits all
        alike), ``--iters`` rounds of one call from idle and, on GPUs, :attr:`steady_rounds` steady ones; one row
        recorded per contender (``rel_err``: by name, None for the others). Returns the spreads (steady: None on
        CPUs)."""
        idle = benchmark.interleaved(contenders, rounds=self.o.iters, calls=1, warmup=self.o.warmup, barrier=True)
        steady = benchmark.interleaved(contenders, rounds=self.steady_rounds, calls=10) if self.gpu else None
        for name in contenders:
            extra = {} if steady is None else dict(
                steady_ms=steady[name].median, steady_low_ms=steady[name].low, steady_high_ms=steady[name].high,
                steady_host_ms=steady[name].host)
            self.record("b", s, name, idle[name].median, low_ms=idle[name].low, high_ms=idle[name].high,
                        host_ms=idle[name].host, rel_err=(rel_err or {}).get(name), **extra)
        return idle, steady

    def graphed(self, fn: Callable[[], object]) -> Callable[[], None]:
        """``fn`` captured in a CUDA graph (``disttune.benchmark.capture_graph``: a warm-up on a side stream,
        every rank in the same order, collectives captured too); returns the replay."""
        graph = benchmark.capture_graph(fn)
        self._graphs = getattr(self, "_graphs", []) + [graph]  # keep it (and its memory pool) alive
        return graph.replay

    # -- part c -----------------------------------------------------------------------------
    def part_c(self) -> None:
        for s in self.shapes:
            p = self.tp_inputs(s, seed=200)
            E, k = p["E"], p["k"]
            ctx_kernel = moe.make_moe_kernel(self.configs)
            alone_kernel = moe.make_moe_kernel(self.configs)

            def layer(kernel, graph_safe: bool = False):
                return moe.tp_moe_layer(p["x"], p["ids"], p["wts"], p["w_gu"], p["w_down"], kernel=kernel,
                                        tokens_per_rank=p["tpr"], check_ids=False, graph_safe=graph_safe)

            @disttune.contextual_autotune(is_dist=True, n_warmup=2, n_repeat=3, verbose=False, store=False)
            def tuned_layer():
                return layer(ctx_kernel)

            t0 = time.perf_counter()
            tuned_layer()
            ctx_tuning_s = time.perf_counter() - t0
            # alone: stock triton.autotune on each GEMM by itself, outside the layer, same keys
            ag = moe.ag_moe(p["x"], p["ids"], p["w_gu"], topk_weights=p["wts"], tokens_per_rank=p["tpr"],
                            kernel=moe.make_moe_kernel(self.configs[:1]), layout="auto")
            g = moe.silu_and_mul(ag.out)
            t0 = time.perf_counter()
            rows_bucket = moe.next_power_of_2(ag.out.shape[0])
            # the AG GEMM: one launch over every rank's tokens, as in the layer (on GPUs with arrival flags
            # that are already set, so its key is the layer's and nothing waits)
            arrived = (torch.ones(self.world, dtype=torch.int32, device=self.device), 1) if self.gpu else None
            moe.moe_gemm(self._gathered_tokens(p), p["w_gu"], ag.routing, a_order="token", kernel=alone_kernel,
                         rows_bucket=rows_bucket, first_group=self.rank * E, wait=arrived)
            # the down GEMM: one launch over every destination's rows, as in the layer
            moe.moe_gemm(g, p["w_down"], ag.routing, a_order="sorted", out_order="flat", weights=ag.topk_weights,
                         kernel=alone_kernel, rows_bucket=rows_bucket)
            self.sync()
            alone_tuning_s = time.perf_counter() - t0
            n_key = len(moe.MOE_KEY)
            ctx_winners = {str(key[:n_key]): disttune.describe_config(c) for key, c in ctx_kernel.cache.items()}
            alone_winners = {str(key[:n_key]): disttune.describe_config(c) for key, c in alone_kernel.cache.items()}
            everyone = [None] * self.world
            dist.all_gather_object(everyone, alone_winners)
            alone_agree = all(w_ == everyone[0] for w_ in everyone)
            # The bare rows launch each key's cached winner at every occurrence; the wrapped call launches each
            # occurrence's own (a key launched more than once has an occurrence per launch). Where they differ, the
            # wrapped call runs other kernels than the bare row, and the host column alone compares the calls.
            differs = [f"{r.site.describe()}: wrapped `{disttune.describe_config(r.config)}`, bare "
                       f"`{disttune.describe_config(ctx_kernel.cache[r.site.key])}`"
                       for r in tuned_layer.report.results
                       if disttune.describe_config(r.config) != disttune.describe_config(ctx_kernel.cache[r.site.key])]
            contenders = {"layer, winners tuned alone (stock triton.autotune)": lambda: layer(alone_kernel),
                          "layer, contextual winners (disttune)": lambda: layer(ctx_kernel),
                          "layer, contextual (wrapped call)": tuned_layer}
            if self.gpu:  # the wrapped call replayed from a CUDA graph: tuned anew, on a kernel of its own
                replay_kernel = moe.make_moe_kernel(self.configs)

                @disttune.contextual_autotune(is_dist=True, n_warmup=2, n_repeat=3, verbose=False, store=False,
                                             cuda_graph=True)
                def replayed_layer():
                    return layer(replay_kernel, graph_safe=True)

                replayed_layer()
                contenders["layer, contextual, replayed (cuda_graph=True)"] = replayed_layer
            # one call from idle each, the contenders interleaved round by round: drift hits them alike
            spreads = benchmark.interleaved(contenders, rounds=self.o.iters, calls=1, warmup=self.o.warmup)
            for name, spread in spreads.items():
                self.record("c", s, name, spread.median, low_ms=spread.low, high_ms=spread.high, host_ms=spread.host,
                            ctx_winners=ctx_winners, alone_winners=alone_winners,
                            alone_winners_agree_across_ranks=alone_agree, ctx_tuning_s=ctx_tuning_s,
                            alone_tuning_s=alone_tuning_s, ctx_runs=tuned_layer.report.function_runs,
                            occurrence_winners_differ=differs)
            if self.rank == 0:
                print(f"\n### (c) TP MoE layer, world {self.world}: T={p['T']} E={E} top-{k} H={p['H']} "
                      f"I={p['Ir'] * self.world}, one call from idle, {self.o.iters} interleaved rounds, "
                      "max over ranks\n")
                print("| winners | layer ms, median [low-high] | host ms per call | vs alone |")
                print("| --- | ---: | ---: | ---: |")
                base = spreads["layer, winners tuned alone (stock triton.autotune)"].median
                for name, spread in spreads.items():
                    print(f"| {name} | {spread.text()} | {spread.host:.3f} | {base / spread.median:.2f}x |")
                bare, wrapped = spreads["layer, contextual winners (disttune)"], spreads["layer, contextual (wrapped call)"]
                print(f"\nwrapped call vs the same winners bare: {wrapped.median / bare.median - 1:+.1%} time, "
                      f"{wrapped.host / bare.host - 1:+.1%} host")
                print("occurrences whose winner differs from the one the bare rows launch: "
                      + ("none (the wrapped call runs the bare row's kernels)" if not differs else "; ".join(differs)))
                print(f"\ncontextual tuning: {ctx_tuning_s:.1f} s, {tuned_layer.report.function_runs} runs; "
                      f"alone: {alone_tuning_s:.1f} s; ranks' alone winners identical: {alone_agree}")
                for key in sorted(set(ctx_winners) | set(alone_winners)):
                    print(f"- key {key}: contextual `{ctx_winners.get(key)}`, alone (rank 0) `{alone_winners.get(key)}`")

    def _gathered_tokens(self, p: dict) -> torch.Tensor:
        if "x_all" not in p:
            x_all = torch.empty(p["T"], p["H"], device=self.device, dtype=self.dtype)
            if self.gpu:
                dist.all_gather_into_tensor(x_all, p["x"])
            else:
                dist.all_gather(list(x_all.chunk(self.world)), p["x"])
            p["x_all"] = x_all
        return p["x_all"]

    # -- output -----------------------------------------------------------------------------
    def close(self) -> None:
        """Drop the CUDA graphs of part b, which captured NCCL collectives, while their communicators live:
        NCCL cannot destroy a communicator that a live graph still uses, and the process would not exit."""
        self._graphs = []
        if self.gpu:
            torch.cuda.synchronize()

    def write(self) -> None:
        """Rank 0 appends the rows to ``--out`` (nothing without it)."""
        written = benchmark.append_rows(self.o.out, self.rows, meta=self.meta)
        if written:
            print(f"\nrows appended to {written}")


def main() -> int:
    benchmark.stacks_on_termination()
    o = parse_args()
    b = Bench(o)
    started = time.perf_counter()
    if "a" in o.parts:
        b.part_a()
    if "b" in o.parts:
        b.part_b()
    if "c" in o.parts:
        b.part_c()
    b.write()
    if b.rank == 0:
        print(f"total {time.perf_counter() - started:.1f} s")
    b.close()
    dist.barrier()
    dt_dist.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
