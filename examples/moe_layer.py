"""A tensor-parallel MoE layer tuned in context: ``disttune demo --kernel moe``.

Each rank holds its own tokens ``x [T/w, H]`` with their routing (top-k experts and weights) and a
slice of every expert's weights (``w_gate_up [E, H, 2 I/w]``, ``w_down [E, I/w, H]``). The shipped
``tp_moe_layer`` runs ``ag_moe`` (every rank's tokens are pushed to every rank while the grouped
GEMM starts on the local ones), SiLU-gating in one launch, and ``moe_rs_stacked`` (every
destination's rows in one GEMM, then one reduce-scatter). ``contextual_autotune`` tunes
its grouped-GEMM launches while that communication runs, and every rank agrees on the winners.
Then the tuned layer is timed against the sequential form (all-gather the tokens, the same MoE MLP,
then reduce-scatter), itself tuned in context with the same configs. On GPUs both steps are replayed
from CUDA graphs after tuning (``cuda_graph=True``: the eager layer's dozen launches and collectives
cost more host time than its GPU work), so the comparison is of the GPU work; ``--no-cuda-graph``
compares them called eagerly. Run it with

    bash scripts/launch.sh --nproc_per_node=2 examples/moe_layer.py   # GPUs (NCCL) or CPUs (gloo)

On a machine without a GPU it runs in Triton's interpreter at a small size. Exits non-zero if any
rank's output differs from a per-expert torch reference.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.distributed as dist  # noqa: E402

import disttune  # noqa: E402
from demo_common import check_output, compare, finish, run  # noqa: E402
from disttune import dist as dt_dist  # noqa: E402
from disttune.kernels import moe  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    gpu = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--T", type=int, default=4096 if gpu else 32, help="tokens, all ranks together")
    parser.add_argument("--E", type=int, default=64 if gpu else 8, help="experts")
    parser.add_argument("--top-k", type=int, default=6 if gpu else 2)
    parser.add_argument("--H", type=int, default=2048 if gpu else 32, help="model width")
    parser.add_argument("--I", type=int, default=1408 if gpu else 64, help="expert MLP width, all ranks together")
    parser.add_argument("--n-warmup", type=int, default=2)
    parser.add_argument("--n-repeat", type=int, default=3)
    parser.add_argument("--samples", type=int, default=30, help="timing rounds of the tuned layer and the baseline")
    parser.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=gpu,
                        help="replay both steps from CUDA graphs after tuning (default on GPUs)")
    return parser.parse_args(argv)


def sizes_error(o: argparse.Namespace, world: int) -> str | None:
    """What makes the sizes impossible at ``world`` ranks (``disttune demo`` asks before it launches any)."""
    if o.T % world or o.I % world:
        return f"--T ({o.T}) and --I ({o.I}) must be multiples of the world size {world}"
    return None


def main() -> int:
    o = parse_args()
    info = dt_dist.init()
    rank, world, device = info.rank, info.world_size, info.device
    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float16  # the interpreter's bf16 dot is not exact
    if sizes_error(o, world):
        raise SystemExit(sizes_error(o, world))
    T_r, I_r = o.T // world, o.I // world
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(T_r, o.H, generator=g).to(device, dtype)
    scores, ids = torch.rand(T_r, o.E, generator=g).topk(o.top_k, dim=1)
    ids, weights = ids.to(device, torch.int32), (scores / scores.sum(1, keepdim=True)).to(device)
    w_gate_up = (torch.randn(o.E, o.H, 2 * I_r, generator=g) / o.H ** 0.5).to(device, dtype)
    w_down = (torch.randn(o.E, I_r, o.H, generator=g) / o.I ** 0.5).to(device, dtype)
    configs = moe.HOPPER_MOE_CONFIGS if gpu else moe.CPU_MOE_CONFIGS

    layer_kernel = moe.make_moe_kernel(configs)

    @disttune.contextual_autotune(is_dist=True, n_warmup=o.n_warmup, n_repeat=o.n_repeat, cuda_graph=o.cuda_graph,
                                 verbose=False)  # the table below says more
    def moe_layer_step() -> torch.Tensor:
        # every rank holds T/w tokens and the router's ids are trusted, as the sequential form below
        # assumes too: no host sync for the token counts or the id range (so it can be captured)
        return moe.tp_moe_layer(x, ids, weights, w_gate_up, w_down, kernel=layer_kernel,
                                tokens_per_rank=[T_r] * world, check_ids=False, graph_safe=o.cuda_graph)

    x_all = torch.empty(o.T, o.H, device=device, dtype=dtype)
    ids_all = torch.empty(o.T, o.top_k, device=device, dtype=ids.dtype)
    weights_all = torch.empty(o.T, o.top_k, device=device, dtype=weights.dtype)
    y_local = torch.empty(T_r, o.H, device=device, dtype=dtype)
    sequential_kernel = moe.make_moe_kernel(configs)

    def gather(out: torch.Tensor, inp: torch.Tensor) -> None:
        if gpu:
            dist.all_gather_into_tensor(out, inp)
        else:
            dist.all_gather(list(out.chunk(world)), inp)

    @disttune.contextual_autotune(is_dist=True, n_warmup=o.n_warmup, n_repeat=o.n_repeat, cuda_graph=o.cuda_graph,
                                 verbose=False)
    def sequential_step() -> torch.Tensor:
        gather(x_all, x), gather(ids_all, ids), gather(weights_all, weights)
        partial = moe.moe_mlp(x_all, ids_all, weights_all, w_gate_up, w_down, kernel=sequential_kernel,
                              check_ids=False)
        if gpu:
            dist.reduce_scatter_tensor(y_local, partial)
        else:  # gloo has no reduce-scatter
            dist.all_reduce(partial)
            y_local.copy_(partial[rank * T_r:(rank + 1) * T_r])
        return y_local

    started = time.perf_counter()
    out = moe_layer_step()
    tuning_s = time.perf_counter() - started

    gather(x_all, x), gather(ids_all, ids), gather(weights_all, weights)
    reference = moe.moe_mlp_reference(x_all, ids_all, weights_all, w_gate_up, w_down).float()
    dist.all_reduce(reference)  # each rank's slice of the experts adds its part
    ok, worst = check_output(out, reference[rank * T_r:(rank + 1) * T_r], tolerance=2e-2)
    alike = "tuned alike" + (", replayed alike" if o.cuda_graph else "")
    timing = compare(moe_layer_step, sequential_step, f"all-gather, MoE MLP, reduce-scatter ({alike})",
                     gpu, world, o.samples)
    where = torch.cuda.get_device_name() if gpu else "CPU, Triton interpreter"
    title = (f"TP MoE layer T={o.T} E={o.E} top-{o.top_k} H={o.H} I={o.I} {dtype} on {world} rank(s) "
             f"({info.backend}, {where}; " + ("steps replayed from CUDA graphs" if o.cuda_graph else "eager steps")
             + ")")
    return finish(title, moe_layer_step, tuning_s, timing, ok, worst)

if __name__ == "__main__":
    sys.exit(run(main))
