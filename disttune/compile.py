"""Compiling every candidate up front, on a thread pool, with the ranks of a node sharing the work.

The discovery run (see :mod:`disttune.handlers`) hands each new site to :meth:`CompilePool.start`,
which compiles its candidates with ``JITFunction.warmup`` (no launch) while the run goes on. With a
*compile share* ``(r, n)`` (local rank ``r`` of ``n`` ranks that share Triton's cache) a rank compiles
config 0 (the discovery run launches it at once) and configs ``i >= 1`` with ``(i - 1 + s) % n == r``
for the ``s``-th shared site; once every rank has finished its share (after the consensus),
:meth:`CompilePool.compile_rest` loads the others' from the cache, or compiles them where the cache is
not shared. A config that does not compile fails on this rank (scored ``inf`` by the agreement).

Under ``TRITON_INTERPRET`` nothing is compiled ahead (there is no compiler): the pool is not used.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from typing import Any, Optional, Sequence

from triton.runtime.autotuner import Autotuner

from . import env
from .comm import Communicator
from .sites import Site, SiteId
from .warmup import wait_for_warm_up


def can_precompile(autotuner: Autotuner) -> bool:
    """Whether the kernel can be compiled without a launch (a JITFunction on a real GPU backend)."""
    from triton.runtime.jit import JITFunction

    return isinstance(autotuner.fn, JITFunction) and not env.interpreting()


def current_cuda_device() -> Optional[int]:
    import torch

    return torch.cuda.current_device() if torch.cuda.is_available() else None


def default_compile_threads() -> int:
    """Compile threads when none are asked for: up to 16 per rank on a GPU backend, none in the interpreter."""
    if env.interpreting() or current_cuda_device() is None:
        return 0
    ranks_here = env.local_world_size()  # ranks of this node compile side by side
    return max(1, min(16, (os.cpu_count() or 2) // max(1, ranks_here)))


def precompile(autotuner: Autotuner, args: tuple, kwargs: dict, config: Any, device: Optional[int]) -> Any:
    """Compile one config of a launch on a worker thread (``JITFunction.warmup``), on the caller's GPU, and
    load it: Triton builds the launcher and loads the binary at a kernel's first launch, which would
    otherwise land on the calling thread (a config the GPU cannot run fails here, as it would there)."""
    if device is not None:
        import torch

        torch.cuda.set_device(device)  # the CUDA device is per thread; compile for the launching rank's GPU
    wait_for_warm_up()  # Triton initialises once: never beside a warm-up still doing it
    meta = {k: v for k, v in kwargs.items() if k != "warmup"}  # discovery already checked for conflicts
    compiled = autotuner.fn.warmup(*args, **meta, **config.all_kwargs())
    if hasattr(compiled, "result"):  # a Triton that compiles asynchronously hands back a future
        compiled = compiled.result()
    with _loading:  # configs of one kernel share a launcher: one worker builds it, the others find it cached
        getattr(compiled, "run", None)  # CompiledKernel.run: the launcher and the loaded binary
    return compiled


_loading = threading.Lock()


def compile_share(comm: Communicator) -> tuple[int, int]:
    """(this rank's index, ranks) among the ranks that share a Triton cache: the node's, where the
    launcher says (see :func:`disttune.env.local_rank`), else the communicator's."""
    local_world, local_rank = env.local_world_size(), env.local_rank(default=-1)
    if 0 <= local_rank < local_world:
        return local_rank, local_world
    return comm.rank, comm.world_size


class CompilePool:
    """The candidates of every site, compiled on ``threads`` worker threads, this rank's share first.

    ``share``: ``(rank, ranks)`` of the node (see the module doc), or None to compile everything here.
    Costs nothing on the launching thread but a ``submit`` per config; :meth:`finish` waits.
    """

    def __init__(self, threads: int, share: Optional[tuple[int, int]] = None) -> None:
        self.executor = concurrent.futures.ThreadPoolExecutor(threads, "disttune-compile")
        self.share = share
        self.pending: dict[SiteId, tuple[Site, list]] = {}  # site -> (site, a future per config or None)
        self.later: dict[SiteId, tuple] = {}  # with a share: what compile_rest needs of each site
        self.compiled: dict[tuple[SiteId, int], Any] = {}  # (site, config index) -> compiled kernel (diagnostics)
        self.spans: list[tuple[float, float]] = []  # (start, end) of every compile, perf_counter seconds

    def start(self, site: Site, args: tuple, kwargs: dict) -> list:
        """Start compiling ``site``'s candidates for this launch; returns a future per config (None: left
        to a peer, or to :meth:`compile_rest`), or [] when the kernel cannot be compiled ahead."""
        if not can_precompile(site.autotuner):
            return []
        configs, device = site.configs, current_cuda_device()
        if self.share is None:
            mine: Sequence[int] = range(len(configs))
        else:
            rank, ranks = self.share
            offset = len(self.later)
            mine = [0, *(i for i in range(1, len(configs)) if (i - 1 + offset) % ranks == rank)]
            self.later[site.id] = (args, kwargs, device, set(mine))
        futures = self._submit(site, args, kwargs, device, mine)
        self.pending[site.id] = (site, futures)
        return futures

    def _submit(self, site: Site, args: tuple, kwargs: dict, device: Optional[int], indices: Any) -> list:
        futures: list = [None] * len(site.configs)
        for index in indices:
            futures[index] = self.executor.submit(self._timed, site.autotuner, args, kwargs, site.configs[index],
                                                  device)
        return futures

    def _timed(self, *job: Any) -> Any:
        started = time.perf_counter()
        try:
            return precompile(*job)
        finally:
            self.spans.append((started, time.perf_counter()))  # list.append: atomic across the workers

    def ready(self, site: Site, index: int) -> bool:
        """Wait until config ``index`` of ``site`` is compiled; False (the failure recorded) if it did not
        compile. For launches made before :meth:`finish`: a config's first launch must not compile it a
        second time on the calling thread."""
        pending = self.pending.get(site.id)
        future = pending[1][index] if pending is not None else None
        if future is None:
            return index not in site.failures
        try:
            self.compiled[(site.id, index)] = future.result()
        except Exception as err:
            site.record_failure(index, err)
            return False
        finally:
            pending[1][index] = None  # type: ignore[index]
        return True

    def idle(self) -> bool:
        """Whether no compile is running or queued."""
        return all(f is None or f.done() for _, futures in self.pending.values() for f in futures)

    def busy_s(self) -> dict[str, float]:
        """``compile busy``: seconds of compile summed over the workers; ``compile span``: first start to last end."""
        spans = list(self.spans)
        if not spans:
            return {}
        return {"compile busy": sum(end - start for start, end in spans),
                "compile span": max(end for _, end in spans) - min(start for start, _ in spans)}

    def compile_rest(self, tuned: Sequence[Site]) -> None:
        """With a share: the configs of the ``tuned`` sites left to the peers, once every rank has finished
        its share (call it after a collective that follows :meth:`finish` on every rank). They load from
        Triton's cache where the ranks share it and compile here otherwise. Sites decided without tuning
        (store, pinned, cached) need nothing more."""
        for site in tuned:
            later = self.later.get(site.id)
            if later is None:
                continue
            args, kwargs, device, done = later
            rest = [i for i in range(len(site.configs)) if i not in done and i not in site.failures]
            self.pending[site.id] = (site, self._submit(site, args, kwargs, device, rest))
        self.later.clear()
        self.finish()

    def finish(self) -> None:
        """Wait for every compile started; a config that did not compile fails on this rank (inf)."""
        for site, futures in self.pending.values():
            for index, future in enumerate(futures):
                if future is None:
                    continue
                try:
                    self.compiled[(site.id, index)] = future.result()
                except Exception as err:
                    site.record_failure(index, err)
        self.pending.clear()

    def shutdown(self) -> None:
        """Stop the workers; compiles not yet started are dropped."""
        self.executor.shutdown(wait=True, cancel_futures=True)
