"""Diagnose compute/copy overlap on a GPU group: what does a GEMM cost while peers' shards are pulled?

    torchrun --nproc_per_node=2 bench/overlap_probe.py [--out DIR]

Times (CUDA events, median of 20, max over ranks), on the AG-GEMM 8192^3 shapes:

* the parts alone: cuBLAS GEMM, our GEMM (one fixed config), the local copy into the symmetric
  workspace, the symmetric-memory barrier, one peer pull on a side stream;
* a GEMM on the compute stream with the peer pull running beside it on a side stream (no
  dependency between them): if copy and GEMM really overlap this takes about max(GEMM, pull);
* the same with the persistent GEMM's grid a few SMs short of the device;
* our AG-GEMM step (both designs with one fixed config, and decomposed with cuBLAS per shard),
  torch's fused op, and all_gather then cuBLAS;

each three ways: one call from an idle GPU, 10 calls back to back (per call), and the host time
of one call. Prints a cProfile of the decomposed step's host side (rank 0).

Writes a Chrome trace per contender (3 calls, rank 0) to ``--out`` so the timeline shows which
stream ran what and when. A diagnostic for the README's overlap question, not a table of record.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import triton

from disttune import dist as dt_dist
from disttune.kernels import shard_gemm as sg
from disttune.kernels.ag_gemm import AllGatherGEMM
from disttune.kernels.symm import SymmetricBuffer

from ag_gemm import steady_ms, time_ms  # bench/ is the script's folder, first on sys.path


def host_us(fn, calls: int = 20) -> float:
    """Host time of one call, launches only (device synchronized before and after)."""
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    spent = (time.perf_counter() - started) / calls * 1e6
    torch.cuda.synchronize()
    return round(spent, 1)


def trace(fn, path: str, rank: int, calls: int = 3) -> None:
    torch.cuda.synchronize()
    dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    if rank == 0:
        prof.export_chrome_trace(path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "probe_out"))
    parser.add_argument("--M", type=int, default=8192)
    parser.add_argument("--K", type=int, default=8192)
    parser.add_argument("--N", type=int, default=8192)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    info = dt_dist.init()
    rank, world = info.rank, info.world_size
    import torch.distributed._symmetric_memory as symm_mem

    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        symm_mem.enable_symm_mem_for_group(dist.group.WORLD.group_name)
    dev = torch.device("cuda", torch.cuda.current_device())
    dtype = torch.bfloat16
    M, K, N = args.M, args.K, args.N
    rows = M // world
    g = torch.Generator().manual_seed(rank)
    a_shard = torch.randn(rows, K, generator=g).to(dev, dtype)
    b = (torch.randn(N // world, K, generator=g) / K ** 0.5).to(dev, dtype).t()
    a_full = torch.randn(M, K, generator=g).to(dev, dtype)
    c = torch.empty(M, N // world, device=dev, dtype=dtype)
    buf = SymmetricBuffer((M, K), dtype)
    peer = (rank + 1) % world
    mine, theirs = slice(rank * rows, (rank + 1) * rows), slice(peer * rows, (peer + 1) * rows)
    buf.local[mine].copy_(a_shard)
    buf.barrier()
    side = torch.cuda.Stream()
    one = [triton.Config({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8}, num_stages=3, num_warps=8)]
    kernel = sg.make_shard_gemm_kernel(one)
    sms = sg.num_sms(dev)

    def cublas():
        torch.matmul(a_full, b, out=c)

    def ours():
        sg.shard_gemm(a_full, b, c, [M], 0, kernel=kernel)

    def ours_short(short: int):
        def run():
            sg._sms_cache[dev.index] = sms - short
            try:
                ours()
            finally:
                sg._sms_cache[dev.index] = sms
        return run

    def pull():
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            buf.local[theirs].copy_(buf.peer(peer)[theirs])
        torch.cuda.current_stream().wait_stream(side)

    def beside(gemm):
        def run():
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                buf.local[theirs].copy_(buf.peer(peer)[theirs])
            gemm()
            torch.cuda.current_stream().wait_stream(side)
        return run

    contenders = {
        "cublas": cublas,
        "ours_gemm": ours,
        "ours_gemm_sms-8": ours_short(8),
        "local_copy": lambda: buf.local[mine].copy_(a_shard),
        "barrier": buf.barrier,
        "peer_pull": pull,
        "cublas+pull": beside(cublas),
        "ours+pull": beside(ours),
        "ours_sms-8+pull": beside(ours_short(8)),
        "ours_sms-16+pull": beside(ours_short(16)),
        "nccl_all_gather": lambda: dist.all_gather_into_tensor(a_full, a_shard),
    }
    gathered = torch.empty(M, K, device=dev, dtype=dtype)
    dist.all_gather_into_tensor(gathered, a_shard)
    want = torch.matmul(gathered, b)
    errors = {}
    for design, gemm in (("decomposed", "triton"), ("fused", "triton"), ("decomposed", "cublas")):
        op = AllGatherGEMM(design=design, kernel=kernel, gemm=gemm)
        out = torch.empty_like(c)
        name = f"ag_{design}_{gemm}"
        contenders[name] = (lambda op=op, out=out: op(a_shard, b, out))
        for trial in range(3):
            out.fill_(float("nan"))
            op(a_shard, b, out)
            err = float(((out.float() - want.float()).norm() / want.float().norm()).item())
            errors[f"{name}#{trial}"] = round(err, 6)
    group_name = dist.group.WORLD.group_name
    contenders["torch_fused"] = lambda: torch.ops.symm_mem.fused_all_gather_matmul(a_shard, [b], gather_dim=0,
                                                                                     group_name=group_name)
    contenders["sequential"] = lambda: (dist.all_gather_into_tensor(a_full, a_shard), cublas())
    results = {"errors": errors}
    for name, fn in contenders.items():
        try:
            results[name] = {"one_call_ms": round(time_ms(fn, 20, warmup=3), 4),
                             "back_to_back_ms": round(steady_ms(fn, 15), 4), "host_us": host_us(fn)}
        except Exception as err:  # noqa: BLE001 - a diagnostic: report and go on
            results[name] = f"{type(err).__name__}: {err}"[:160]
        if name.startswith("ag_") or name == "torch_fused":
            trace(fn, os.path.join(args.out, f"trace_{name}.json"), rank)
    import cProfile
    import pstats

    step = contenders["ag_decomposed_triton"]
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(50):
        step()
    profiler.disable()
    torch.cuda.synchronize()
    if rank == 0:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(22)
    if rank == 0:
        print(json.dumps({"M": M, "K": K, "N": N, "world": world, "device": torch.cuda.get_device_name(),
                          "sms": sms}), flush=True)
        for name, r in results.items():
            print(f"{name:22s} {json.dumps(r)}", flush=True)
        with open(os.path.join(args.out, "overlap_probe.json"), "w") as fh:
            json.dump(results, fh)
    dt_dist.destroy()


if __name__ == "__main__":
    main()
