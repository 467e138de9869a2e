"""Benchmark: what the copy engines give the overlapped kernels, measured at 2 (or more) GPUs.

    torchrun --nproc_per_node=2 bench/transport.py [--mb 64] [--samples 15] [--out transport.jsonl]

Every rank pushes ``--mb`` MB into the symmetric memory of the rank after it (at 2 ranks: both ways at
once, as the AllGather-GEMM does) with ``cuMemcpyDtoDAsync`` on the copy engines, the transfer cut into
``pieces`` pieces spread over ``streams`` streams, exactly as ``kernels.symm.ShardPusher`` pushes. It prints:

* **push bandwidth** (GB/s per sender) for streams x pieces: how many copy engines one push really uses;
* **beside a GEMM**: the same push while cuBLAS runs the AG-GEMM's per-rank GEMM (``[M, K] @ [K, N/w]``)
  on the compute stream: the GEMM's slowdown is the HBM share the incoming copies take, and a push that
  slows down many times over would be running on the SMs, not on copy engines;
* **local copy beside a GEMM**: a device-to-device copy within one GPU, alone and beside the GEMM (the
  fused AllGather-GEMM copies its own shard so: whether such a copy needs SMs decides where it may go).

These are the inputs of the step-time model in docs/benchmarks.md ("The transport for N peers"). Each row
is the median of ``--samples`` samples (each after a device sync and a barrier, every rank pushing at
once), the slowest rank's. GPUs only.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.distributed as dist

from disttune import benchmark
from disttune import dist as dt_dist
from disttune.kernels.symm import SymmetricBuffer, copy_async, stream_handle


class Pusher:
    """Pushes of this rank's source into the next rank's symmetric buffer, timed with CUDA events."""

    def __init__(self, nbytes: int, max_streams: int) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.nbytes = nbytes
        self.buffer = SymmetricBuffer((nbytes,), torch.uint8)
        self.source = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
        self.local_dest = torch.empty_like(self.source)
        self.sides = [torch.cuda.Stream() for _ in range(max_streams)]
        self.handles = [stream_handle(side) for side in self.sides]
        self.peer = (self.rank + 1) % self.world

    def run(self, streams: int, pieces: int, work=None, local: bool = False) -> tuple[float, float]:
        """(ms until every piece landed, ms of ``work`` on the compute stream, 0 without), from one start;
        ``pieces=0`` copies nothing (``work`` alone)."""
        current = torch.cuda.current_stream()
        start, work_done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        pushed = [torch.cuda.Event(enable_timing=True) for _ in range(streams)]
        dest = self.local_dest.data_ptr() if local else self.buffer.peer(self.peer).data_ptr()
        size = -(-self.nbytes // max(1, pieces))
        start.record(current)
        for side in self.sides[:streams]:
            side.wait_event(start)
        for piece in range(pieces):
            offset = piece * size
            if offset < self.nbytes:
                copy_async(self.handles[piece % streams], dest + offset, self.source.data_ptr() + offset,
                           min(size, self.nbytes - offset))
        for side, event in zip(self.sides, pushed):
            event.record(side)
        if work is not None:
            work()
        work_done.record(current)
        for side in self.sides[:streams]:
            current.wait_stream(side)
        work_done.synchronize()
        for event in pushed:
            event.synchronize()
        return max(start.elapsed_time(e) for e in pushed), (start.elapsed_time(work_done) if work else 0.0)


def median_of(fn, samples: int) -> list[float]:
    """Per output of ``fn`` (a tuple of ms), the median over ``samples`` calls, each after a sync and a barrier;
    then the slowest rank's."""
    rows = []
    for _ in range(samples):
        torch.cuda.synchronize()
        dist.barrier()
        rows.append(fn())
    return benchmark.max_over_ranks([statistics.median(column) for column in zip(*rows)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=64, help="MB each rank pushes (the 2-GPU AG-GEMM shard: 64)")
    parser.add_argument("--samples", type=int, default=15)
    parser.add_argument("--gemm", default="8192,8192,4096", help="M,K,N of the GEMM beside the pushes")
    parser.add_argument("--out", default=None, help="append the rows as JSON lines to this file (rank 0)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/transport.py needs CUDA GPUs")
    info = dt_dist.init()
    nbytes = args.mb << 20
    pusher = Pusher(nbytes, max_streams=4)
    M, K, N = (int(x) for x in args.gemm.split(","))
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(N, K, device="cuda", dtype=torch.bfloat16).t()
    c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)

    def gemm():
        torch.matmul(a, b, out=c)

    for _ in range(3):  # warm-up: the peer mappings, cuBLAS's handle and heuristics
        pusher.run(2, 2, gemm)
    rows = []
    gb = nbytes / 1e9
    alone_gemm = median_of(lambda: (pusher.run(1, 0, gemm)[1],), args.samples)[0]
    for streams, pieces in ((1, 1), (1, 4), (2, 2), (2, 4), (2, 8), (3, 3), (4, 4), (4, 8)):
        push_ms, = median_of(lambda: (pusher.run(streams, pieces)[0],), args.samples)
        beside_push, beside_gemm = median_of(lambda: pusher.run(streams, pieces, gemm), args.samples)
        rows.append({"what": "push to the next rank", "streams": streams, "pieces": pieces, "push_ms": push_ms,
                     "push_gbs": gb / push_ms * 1e3, "beside_gemm_push_ms": beside_push,
                     "beside_gemm_push_gbs": gb / beside_push * 1e3, "gemm_alone_ms": alone_gemm,
                     "gemm_beside_push_ms": beside_gemm})
    for streams in (1, 2):
        local_ms, = median_of(lambda: (pusher.run(streams, streams, local=True)[0],), args.samples)
        beside_local, beside_gemm = median_of(lambda: pusher.run(streams, streams, gemm, local=True), args.samples)
        rows.append({"what": "local copy", "streams": streams, "pieces": streams, "push_ms": local_ms,
                     "push_gbs": gb / local_ms * 1e3, "beside_gemm_push_ms": beside_local,
                     "beside_gemm_push_gbs": gb / beside_local * 1e3, "gemm_alone_ms": alone_gemm,
                     "gemm_beside_push_ms": beside_gemm})
    if info.rank == 0:
        print(f"\n### {info.world_size} x {torch.cuda.get_device_name()}: {args.mb} MB per rank, every rank at once; "
              f"GEMM {M}x{K}x{N} bf16 (cuBLAS) alone {alone_gemm:.3f} ms (ms, median, max over ranks)\n")
        print("| copy | streams | pieces | alone ms | GB/s | beside the GEMM ms | GB/s | GEMM beside it ms | GEMM slowdown |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for r in rows:
            print(f"| {r['what']} | {r['streams']} | {r['pieces']} | {r['push_ms']:.3f} | {r['push_gbs']:.0f} | "
                  f"{r['beside_gemm_push_ms']:.3f} | {r['beside_gemm_push_gbs']:.0f} | {r['gemm_beside_push_ms']:.3f} | "
                  f"{r['gemm_beside_push_ms'] / r['gemm_alone_ms']:.3f} |")
    benchmark.append_rows(args.out, rows)
    dt_dist.destroy()


if __name__ == "__main__":
    main()
