"""What the tuner's control plane costs: µs per collective through the rendezvous store, beside the same
collective on the job's process group.

    torchrun --nproc_per_node=N bench/control_plane.py [--iters 300] [--out control_plane.jsonl]

Every collective of the tuner travels through the rendezvous store (:class:`disttune.comm.TorchComm`):
it shares nothing with the user's communicators and never waits on a GPU stream. Rows (µs per
collective, median of ``--rounds`` interleaved rounds of ``--iters`` back-to-back collectives, max over
ranks):

  set-up                       making the communicator (there is no group to create: the store exists)
  store: 1 float               ``all_gather_floats([x])``, a tuning run's status
  store: 1,000 floats          ``all_gather_floats``, the agreement's vector for ~1,000 site x config slots
  store: consensus object      ``all_gather_objects`` of a consensus-sized dict (12 configs' digests)
  store: new-key point         one agreement point on new keys (``start_gather_floats``, finished at the next)
  group: 1 float / 1,000 floats  ``torch.distributed.all_gather`` of the same tensor on the process group
                               (NCCL with a copy back to the host on GPUs, as the tuner's collectives were
                               before; gloo on CPUs)

With ``--out FILE`` rank 0 appends one JSON line (with device, versions and date) to FILE.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from disttune import benchmark
from disttune import dist as dt_dist
from disttune.comm import TorchComm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None)
    options = parser.parse_args()
    info = dt_dist.init()
    started = time.perf_counter()
    comm = TorchComm()
    setup_us = (time.perf_counter() - started) * 1e6
    device = info.device if info.backend == "nccl" else torch.device("cpu")
    consensus = {"error": None, "options": {f"option{i}": repr(i) for i in range(12)},
                 "sites": [("kernels.matmul.matmul_kernel", "(8192, 8192, 8192, 'torch.bfloat16')", 0,
                            tuple(f"BLOCK_M: 128, BLOCK_N: 256, BLOCK_K: 64, stages {i}" for i in range(12)))],
                 "lookups": [None], "failures": [{}], "split": [False]}
    one, thousand = [1.0], [0.5] * 1000

    def group_gather(values: list[float]):
        tensor = torch.tensor(values, dtype=torch.float64, device=device)
        parts = [torch.empty_like(tensor) for _ in range(info.world_size)]

        def gather() -> torch.Tensor:
            dist.all_gather(parts, tensor)
            return torch.stack(parts).cpu()

        return gather

    points = {"n": 0}

    def new_key_point():
        if "finish" in points:
            points["finish"]()
        points["n"] += 1
        points["finish"] = comm.start_gather_floats([-1.0], "bench point", "bench:new keys")

    rows = {
        "store: 1 float": lambda: comm.all_gather_floats(one, "bench"),
        "store: 1,000 floats": lambda: comm.all_gather_floats(thousand, "bench"),
        "store: consensus object": lambda: comm.all_gather_objects(consensus, "bench"),
        "store: new-key point": new_key_point,
        "group: 1 float": group_gather(one),
        "group: 1,000 floats": group_gather(thousand),
    }
    samples: dict[str, list[float]] = {name: [] for name in rows}
    for name, fn in rows.items():  # warm-up (NCCL's first all_gather builds its channels)
        for _ in range(10):
            fn()
    for _ in range(options.rounds):
        for name, fn in rows.items():
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(options.iters):
                fn()
            samples[name].append((time.perf_counter() - t0) / options.iters * 1e6)
    if "finish" in points:
        points["finish"]()
    medians = {name: statistics.median(values) for name, values in samples.items()}
    worst = dict(zip(medians, benchmark.max_over_ranks(list(medians.values()))))
    setup = benchmark.max_over_ranks(setup_us)
    if info.rank == 0:
        print(f"\n### control plane, {info.world_size} ranks ({info.backend}), µs, median of {options.rounds} rounds "
              f"of {options.iters}, max over ranks\n")
        print("| collective | µs |\n| --- | ---: |")
        print(f"| set-up (TorchComm()) | {setup:.0f} |")
        for name, us in worst.items():
            print(f"| {name} | {us:.0f} |")
    benchmark.append_rows(options.out, [{"bench": "control_plane", "setup_us": setup, **worst}])
    dist.barrier()
    dt_dist.destroy()


if __name__ == "__main__":
    main()
