"""Simulated ranks for the control plane's protocol tests: one TCPStore server listening on IPv4 only (some
container stacks name IPv6-mapped loopback peers slowly), a client per rank, and a job run on every rank at once
by threads of this process, joined within a wall-clock bound so that a hang fails the test.
"""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

import torch.distributed as dist

#: How long every rank thread of one job may take, together.
WALL_S = 90.0


def store_and_clients(world: int) -> Iterator[tuple[Any, list[Any]]]:
    """A fixture's body: the server and ``world`` clients of it, until the fixture ends."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(4 * world)
    port = listener.getsockname()[1]
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                           master_listen_fd=listener.fileno())
    with ThreadPoolExecutor(16) as pool:
        clients = list(pool.map(lambda _: dist.TCPStore("127.0.0.1", port, is_master=False), range(world)))
    yield server, clients
    listener.close()


def on_every_rank(world: int, job: Callable[[int], Any]) -> list[Any]:
    """``job(rank)`` on every simulated rank at once; what each returned (or raised), in rank order."""
    results: list[Any] = [None] * world

    def rank(r: int) -> None:
        try:
            results[r] = job(r)
        except Exception as err:  # noqa: BLE001 - the test looks at what each rank raised
            results[r] = err

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(world)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + WALL_S
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    assert not any(thread.is_alive() for thread in threads), f"ranks still waiting after {WALL_S} s: a hang"
    return results
