"""What the control plane costs at N ranks, simulated on one host: wall ms per collective, the store host's CPU
per collective, store requests per collective, and the agreement of a whole tuning call.

    python bench/control_plane_scale.py [--ranks 8,32,128,512,1024] [--per-node 8] [--workers 8] [--iters 20]
                                        [--out FILE]

One ``torch.distributed.TCPStore`` server (libuv) in its own process, as a job's rendezvous store; N simulated
ranks as threads spread over ``--workers`` processes (8, at most one per node), each rank with its own client
(keys prefixed as under torchrun) and its own :class:`disttune.nodeplane.NodeStorePlane`, the code :class:`disttune.comm.TorchComm` runs,
told its node: ``--per-node`` consecutive ranks share one (8 by default; a node's ranks run in one worker process,
and its lowest rank's process holds the node's relay). ``--per-node 0`` runs the flat protocol
(:class:`disttune.storeplane.StorePlane`: every rank talks to the rendezvous store only), as every job did before
the node-level step, and as jobs below :data:`disttune.nodeplane.NODE_STEP_MIN_RANKS` ranks still do.
The store host's CPU is the serial part a real job cannot spread; the simulated clients share this host's
cores, so at large N the wall times are bound by them, not by the store. A job runs one rank per process; here
N / workers rank threads share each process's GIL, and every store request a rank makes hands that GIL over
twice (2 workers: 512 threads a process at 1024 ranks, whose handovers cost the clients 1.7x the CPU per
collective of 8 workers' 128).

Rows, per N (``--iters`` collectives back to back after one to warm up; wall ms at rank 0, median / p90):

  1 float                 ``all_gather_floats([x])``: every rank receives the N values
  barrier                 a tuning run's status point
  1000 floats combined    ``combine_floats`` of a 1,000-slot vector reduced by ``max`` (the agreement's form)
  1000 floats gathered    every rank receives every rank's 1,000 floats: N^2 x 8 KB from the store host,
                          so only up to ``--gather-max`` ranks
  consensus object        ``all_gather_objects`` of a consensus-sized digest, the same on every rank
  tuning call             the agreement of the main job's tuning call (``disttune.agreement.Agreement`` inside its
                          ending, watcher threads included): the consensus, a status point after each of 96
                          tuning runs, the timing vector of 4 sites x 12 configs, the final run's status (98 runs)

Store CPU: the rendezvous store's process's CPU time over the collectives, per collective (the node relays run in
the worker processes, as they run in their hosts' processes in a job). Clients' CPU: the worker processes' CPU
time over the collectives, per collective: every simulated rank's own work (its Python, its store clients, the
threads of the plane and of a call's ending) and the node relays' threads. Requests: every request the clients sent
the rendezvous store (a ``get`` counts two: the store answers a wait, then the read), per collective.
With ``--out FILE`` one JSON line per row is appended to FILE.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

#: The rows of the table, in order; the tuning call is its own table.
KINDS = ("1 float", "barrier", "1000 floats combined", "1000 floats gathered", "consensus object")
RUNS, SITES, CONFIGS = 96, 4, 12  # the main job: 98 runs = discovery + 12 configs x (3 + 5) + final


def serve(conn: Any) -> None:
    """The rendezvous store: a TCPStore server (libuv); answers its process's CPU seconds until the parent closes."""
    import socket

    import torch.distributed as dist

    # An IPv4 listener: some container network stacks resolve the names of IPv6-mapped loopback peers slowly,
    # which makes thousands of connections take minutes; the protocol is the same.
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(8192)
    port = listener.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, use_libuv=True,
                          master_listen_fd=listener.fileno())
    conn.send(port)
    while conn.recv() is not None:
        conn.send((time.process_time(), store.num_keys()))


class CountingStore:
    """A store client that counts the requests it sends (``clone()`` counts on its own), with no lock of its own: a
    list append (atomic under the GIL) per request, which a job's client does not pay for."""

    TWO = {"get", "multi_get"}  # the client waits for the key, then reads it
    LOCAL = {"set_timeout", "clone"}  # the client's own settings: no request

    def __init__(self, store: Any) -> None:
        self.store, self.sent = store, []  # each request's count
        self.clones: list[CountingStore] = []

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self.store, name)
        if name in self.LOCAL:
            return method
        cost, sent = 2 if name in self.TWO else 1, self.sent

        def counted(*args: Any, **kwargs: Any) -> Any:
            sent.append(cost)
            return method(*args, **kwargs)

        setattr(self, name, counted)  # the next call skips __getattr__
        return counted

    def clone(self) -> "CountingStore":
        self.clones.append(CountingStore(self.store.clone()))
        return self.clones[-1]

    def reset(self) -> None:
        for store in [self, *self.clones]:
            store.sent.clear()

    def total(self) -> int:
        return sum(self.sent) + sum(clone.total() for clone in self.clones)


def tuning_sites() -> list:
    """The main job's sites: 4 GEMMs of 12 configs, each config with 5 timed samples."""
    import triton

    from disttune.sites import Site, SiteId

    sites = []
    for number in range(SITES):
        configs = [triton.Config({"BLOCK_M": 64 << (c % 2), "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8},
                                 num_warps=4 << (c % 2), num_stages=2 + c // 2) for c in range(CONFIGS)]
        site = Site(SiteId("shard_ordered_gemm", (4096, 1024, 8192, "torch.bfloat16", number), number), None, configs)
        for c in range(CONFIGS):
            for sample in range(5):
                site.add_sample(c, 1.0 + 0.01 * c + 0.001 * sample, time.time())
        sites.append(site)
    return sites


def tuning_call(plane: Any, call: int) -> None:
    """One tuning call's agreement, as the pipeline makes it (the step's runs themselves cost nothing here)."""
    from disttune.agreement import Agreement
    from disttune.ending import Ending

    agreement = Agreement(plane, "step")
    agreement.channel = f"step#{call}"  # one process per rank numbers its calls; here ranks share a process
    agreement.ending = Ending(plane, "step", agreement.channel)
    sites = tuning_sites()
    with agreement.ending:
        agreement.consensus(sites, None, {"reduce": "'max'"}, [False] * len(sites))
        for run in range(RUNS):
            agreement.check_run([], f"tuning run {run + 1}/{RUNS}")
        results = agreement.results(agreement.verdicts(sites))
        agreement.final_run_status(results, None, {}, "final run 1")


def calls(plane: Any) -> Callable[[], None]:
    """Tuning calls one after the other, each on its own channel."""
    numbers = iter(range(1 << 30))
    return lambda: tuning_call(plane, next(numbers))


def collective(kind: str, plane: Any, rank: int) -> Callable[[], Any]:
    """One collective of ``kind`` on ``plane``, as a function to call again and again."""
    if kind == "1 float":
        return lambda: plane.all_gather_floats([float(rank)], "1 float")
    if kind == "barrier":
        return lambda: plane.barrier("tuning run")
    vector = [0.5 + rank * 1e-3] * 1000
    if kind == "1000 floats combined":
        return lambda: plane.combine_floats(vector, "agreement", lambda matrix: matrix.max(axis=0))
    if kind == "1000 floats gathered":
        return lambda: plane.all_gather_floats(vector, "agreement")
    digest = {"error": None, "options": {f"option{i}": repr(i) for i in range(12)},
              "sites": [("shard_ordered_gemm", "(4096, 1024, 8192, 'torch.bfloat16')", s,
                         tuple(f"BLOCK_M: 128, BLOCK_N: 256, BLOCK_K: 64, stages {i}" for i in range(12)))
                        for s in range(SITES)],
              "lookups": [None] * SITES, "failures": [{}] * SITES, "split": [False] * SITES}
    return lambda: plane.all_gather_objects(digest, "consensus (site digest)")


def work(conn: Any, port: int, ranks: list[int], world: int, per_node: int) -> None:
    """A worker process: one thread per simulated rank, each phase started by the parent."""
    import torch.distributed as dist

    from disttune.nodeplane import NodeStorePlane
    from disttune.storeplane import StorePlane

    threading.stack_size(1 << 20)
    with ThreadPoolExecutor(32) as pool:
        clients = list(pool.map(lambda _: dist.TCPStore("127.0.0.1", port, is_master=False, timeout=_days(1)), ranks))
    stores = [CountingStore(dist.PrefixStore("default_pg", client)) for client in clients]
    planes = [NodeStorePlane(store, rank, world, timeout_s=900, node=f"node{rank // per_node}") if per_node else
              StorePlane(store, rank, world, timeout_s=900) for store, rank in zip(stores, ranks)]
    gate = threading.Barrier(len(ranks) + 1)
    order: dict[str, Any] = {}
    report: dict[str, Any] = {"errors": []}

    def rank_thread(index: int) -> None:
        rank, plane = ranks[index], planes[index]
        while True:
            gate.wait()  # a phase: prepare (warm up) or run
            if order["what"] == "stop":
                return
            try:
                if order["what"] == "prepare":  # one collective to warm up (a barrier before tuning calls)
                    kind = order["kind"]
                    step = calls(plane) if kind == "tuning call" else collective(kind, plane, rank)
                    (plane.barrier("warm up") if kind == "tuning call" else step())
                    order.setdefault("steps", {})[index] = step
                else:
                    step, times = order["steps"][index], []
                    for _ in range(order["iters"]):
                        started = time.perf_counter()
                        step()
                        times.append(time.perf_counter() - started)
                    if rank == 0:
                        report["times"] = times
            except Exception as err:  # noqa: BLE001 - reported to the parent, which stops
                report["errors"].append(f"rank {rank}: {type(err).__name__}: {err}")
            gate.wait()

    threads = [threading.Thread(target=rank_thread, args=(i,), daemon=True) for i in range(len(ranks))]
    for thread in threads:
        thread.start()
    conn.send("connected")
    while (message := conn.recv()) is not None:
        order.update(message)
        cpu = time.process_time()
        if message["what"] == "run":
            for store in stores:
                store.reset()
        gate.wait()
        gate.wait()
        conn.send({"errors": report["errors"], "times": report.pop("times", None),
                   "requests": sum(store.total() for store in stores), "cpu": time.process_time() - cpu})
    order["what"] = "stop"
    gate.wait()


def _days(days: int) -> Any:
    import datetime

    return datetime.timedelta(days=days)


def worker_ranks(world: int, workers: int, per_node: int, index: int) -> list[int]:
    """The simulated ranks of worker ``index``: whole nodes (``per_node`` ranks each), else every ``workers``-th."""
    if per_node:
        return [rank for rank in range(world) if rank // per_node % workers == index]
    return list(range(index, world, workers))


def measure(world: int, workers: int, kinds: list[str], iters: dict[str, int], per_node: int = 0) -> dict[str, dict]:
    """Every kind of collective at ``world`` simulated ranks: a row per kind."""
    context = mp.get_context("spawn")
    server_end, server_conn = context.Pipe()
    server = context.Process(target=serve, args=(server_conn,), daemon=True)
    server.start()
    port = server_end.recv()
    ends, processes = [], []
    for index in range(workers):
        end, worker_conn = context.Pipe()
        process = context.Process(target=work, args=(worker_conn, port, worker_ranks(world, workers, per_node, index),
                                                     world, per_node), daemon=True)
        process.start()
        ends.append(end)
        processes.append(process)
    for end in ends:
        assert end.recv() == "connected"

    def everyone(message: dict) -> list[dict]:
        for end in ends:
            end.send(message)
        answers = [end.recv() for end in ends]
        errors = [e for answer in answers for e in answer["errors"]]
        if errors:
            raise RuntimeError(f"{len(errors)} rank(s) failed at {world} ranks: {errors[:3]}")
        return answers

    def store_state() -> tuple[float, int]:
        server_end.send("cpu")
        return server_end.recv()

    rows = {}
    try:
        for kind in kinds:
            everyone({"what": "prepare", "kind": kind})
            cpu, _ = store_state()
            answers = everyone({"what": "run", "iters": iters[kind]})
            cpu_after, keys = store_state()
            (times,) = [answer["times"] for answer in answers if answer["times"] is not None]
            rows[kind] = {"ranks": world, "kind": kind, "iters": iters[kind], "per_node": per_node, "workers": workers,
                          "wall_ms_median": statistics.median(times) * 1e3,
                          "wall_ms_p90": sorted(times)[int(0.9 * (len(times) - 1))] * 1e3,
                          "store_cpu_ms": (cpu_after - cpu) / iters[kind] * 1e3,
                          "requests": sum(answer["requests"] for answer in answers) / iters[kind],
                          "client_cpu_ms": sum(answer["cpu"] for answer in answers) / iters[kind] * 1e3,
                          "keys_after": keys}
            print(_line(rows[kind]), file=sys.stderr, flush=True)
    finally:
        for end in ends:
            end.send(None)
        for process in processes:
            process.join(60)
        server_end.send(None)
        server.join(10)
    return rows


def _line(row: dict) -> str:
    return (f"{row['ranks']:5d} ranks ({row['per_node'] or 'flat'}), {row['kind']:24s}: "
            f"{row['wall_ms_median']:9.2f} / {row['wall_ms_p90']:9.2f} ms, store CPU {row['store_cpu_ms']:8.3f} ms, "
            f"clients' CPU {row['client_cpu_ms']:9.1f} ms, "
            f"{row['requests']:8.0f} requests, {row['keys_after']} keys")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="8,32,128,512,1024")
    parser.add_argument("--workers", type=int, default=8, help="worker processes (at most one per node)")
    parser.add_argument("--per-node", type=int, default=8, help="simulated ranks per node; 0: the flat protocol")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--calls", type=int, default=1, help="tuning calls per N")
    parser.add_argument("--gather-max", type=int, default=128, help="largest N for the gathered 1,000 floats")
    parser.add_argument("--kinds", default=",".join(KINDS + ("tuning call",)))
    parser.add_argument("--out", default=None)
    options = parser.parse_args()
    wanted = options.kinds.split(",")
    all_rows = []
    for world in map(int, options.ranks.split(",")):
        kinds = [k for k in wanted if k != "1000 floats gathered" or world <= options.gather_max]
        iters = {kind: options.calls if kind == "tuning call" else options.iters for kind in kinds}
        workers = max(1, min(options.workers, -(-world // options.per_node) if options.per_node else world))
        all_rows.extend(measure(world, workers, kinds, iters, options.per_node).values())
    nodes = f"{options.per_node} ranks per node" if options.per_node else "flat: no node relays"
    print(f"\n### control plane at N simulated ranks ({options.workers} worker processes at most, one TCPStore server, "
          f"{nodes}), per collective\n")
    print("| N | collective | wall ms (median / p90) | store-host CPU ms | clients' CPU ms | store requests |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    for row in all_rows:
        if row["kind"] != "tuning call":
            print(f"| {row['ranks']} | {row['kind']} | {row['wall_ms_median']:.2f} / {row['wall_ms_p90']:.2f} | "
                  f"{row['store_cpu_ms']:.2f} | {row['client_cpu_ms']:.1f} | {row['requests']:.0f} |")
    calls = [row for row in all_rows if row["kind"] == "tuning call"]
    if calls:
        print(f"\n### the agreement of one tuning call ({RUNS + 2} runs, {SITES} sites of {CONFIGS} configs)\n")
        print("| N | wall s | store-host CPU s | clients' CPU s | store requests |")
        print("| ---: | ---: | ---: | ---: | ---: |")
        for row in calls:
            print(f"| {row['ranks']} | {row['wall_ms_median'] / 1e3:.2f} | {row['store_cpu_ms'] / 1e3:.3f} | "
                  f"{row['client_cpu_ms'] / 1e3:.2f} | {row['requests']:.0f} |")
    if options.out:
        from disttune import benchmark

        benchmark.append_rows(options.out, [{"bench": "control_plane_scale", **row} for row in all_rows])


if __name__ == "__main__":
    main()
