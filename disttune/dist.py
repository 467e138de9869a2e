"""Start ``torch.distributed`` from whatever launched this process.

:func:`init` reads the launcher's environment and initialises the default
process group once:

* **torchrun** (or any ``env://`` launcher): ``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``;
* **MPI**: Open MPI (``OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE``),
  MPICH / Intel MPI Hydra (``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``,
  ``MPI_LOCALNRANKS``), a bare PMIx launcher (``PMIX_RANK``) or Slurm's ``srun``
  (``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``, ``SLURM_LOCALID``). Without
  ``MASTER_ADDR``/``MASTER_PORT``, rank 0 opens a ``TCPStore`` on a port the
  kernel picks (bind to port 0, so no other job can take it in between) and
  ``mpi4py`` broadcasts its host and port to every rank;
* **nothing** (``python script.py``): a world of one process on
  ``127.0.0.1`` and a free port, so the same script runs without a launcher.

The launcher's variables are read by :mod:`disttune.env`; this module turns them into a process group.
The backend is ``nccl`` when every local rank can have a GPU of its own and ``gloo`` otherwise; with CUDA
each rank is pinned to ``cuda:(local_rank % device_count)`` *before* the group
is created. The tuner's timeout comes from ``timeout_s``, else ``$DISTTUNE_TIMEOUT`` (seconds), else
300 s; the process group's own timeout (NCCL's watchdog, gloo's wait) is a little longer
(:func:`group_timeout_s`), so that a stalled rank ends in the tuner's :class:`~disttune.comm.CollectiveTimeout`
naming it: under NCCL :data:`GROUP_TIMEOUT_MARGIN_S` longer, before the watchdog tears the process down with no
cause; on gloo, whose collectives hold the host, only :data:`GLOO_TIMEOUT_MARGIN_S` longer, since its timeout is
what frees the peers waiting inside the function's own collective for a rank that stalled before it (the tuner
then names that rank, :mod:`disttune.ending`).

:func:`init` registers :func:`destroy` to run at exit, so a script that never calls it still leaves
its group cleanly (a process group left to the interpreter's exit can abort the process).

Cost: the first :func:`init` costs one rendezvous (a TCP round trip per rank,
plus NCCL communicator set-up with CUDA, typically well under a second on one
node); later calls return the cached :class:`DistInfo` at once.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import inspect
import socket
from typing import Any

import torch

from . import device, graphs, startup
from .comm import control_store
from .ending import abort_process_groups
from .env import DistEnvError, LaunchEnv, Launcher, check_mpi_agrees, detect, mpi_comm_world
from .env import timeout_s as timeout_seconds

__all__ = ["DistInfo", "DistEnvError", "init", "destroy", "mpi_comm_world", "is_initialized", "group_timeout_s"]

_LOOPBACK = "127.0.0.1"
#: How much longer than the tuner's timeout the process group's own timeout is under NCCL (and any backend but gloo).
GROUP_TIMEOUT_MARGIN_S = 30.0
#: The same on gloo: a stall before the function's collective ends when this margin frees the peers (module doc).
GLOO_TIMEOUT_MARGIN_S = 2.0
#: How long :func:`destroy` gives the GPU to finish before it aborts the group instead of destroying it.
DRAIN_AT_EXIT_S = 10.0


@dataclasses.dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job. Plain data: reading it costs nothing."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    device: torch.device
    launcher: Launcher

    @property
    def is_main(self) -> bool:
        """True on global rank 0 (the rank that should print and write files)."""
        return self.rank == 0


_INFO: DistInfo | None = None
_STORE: Any = None  # the TCPStore we created, kept alive as long as the group
_EXIT_HOOKED: list = []  # once registered, destroy() runs at exit


# --------------------------------------------------------------------------- rendezvous


def _rank0_host(launch: LaunchEnv) -> str:
    """Address other ranks use to reach rank 0: loopback on one node, else rank 0's hostname."""
    if launch.master_addr:
        return launch.master_addr
    if launch.local_world_size == launch.world_size:
        return _LOOPBACK
    return socket.gethostname()


# --------------------------------------------------------------------------- init / destroy


def _cuda_device_count() -> int:
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken driver must not stop a CPU run
        return 0


def _device_for(local_rank: int) -> torch.device:
    """``cuda:(local_rank % device_count)`` with CUDA devices, else the CPU."""
    count = _cuda_device_count()
    if count == 0:
        return torch.device("cpu")
    return torch.device("cuda", local_rank % count)  # pinned even under gloo: kernels need a GPU


def _supports_device_id() -> bool:
    """``init_process_group(device_id=...)`` exists from torch 2.3; check rather than trust a version."""
    import torch.distributed as dist

    try:
        return "device_id" in inspect.signature(dist.init_process_group).parameters
    except (TypeError, ValueError):
        return False


def _make_store(launch: LaunchEnv, timeout: datetime.timedelta) -> Any:
    """A TCPStore for rendezvous when no MASTER_ADDR/PORT pair exists (MPI or a single process).

    Rank 0 binds port 0 (or the given MASTER_PORT) so the kernel picks a free port that
    nobody can take before we use it; under MPI the address and port are broadcast.
    """
    import torch.distributed as dist

    if launch.world_size == 1:
        return dist.TCPStore(_LOOPBACK, 0, 1, True, timeout=timeout, wait_for_workers=False)
    comm = mpi_comm_world()
    check_mpi_agrees(comm, launch.rank, launch.world_size, launch.source)
    store = None
    payload: tuple[str, int] | str | None = None
    if launch.rank == 0:
        host = _rank0_host(launch)
        try:
            store = dist.TCPStore(
                host, launch.master_port or 0, launch.world_size, True, timeout=timeout, wait_for_workers=False
            )
            payload = (host, int(store.port))
        except Exception as err:  # tell the other ranks instead of leaving them waiting
            payload = f"rank 0 could not open a TCPStore on {host}:{launch.master_port or 0}: {err}"
    payload = comm.bcast(payload, root=0)
    if isinstance(payload, str):
        raise RuntimeError(f"disttune.dist: {payload}. Export MASTER_ADDR/MASTER_PORT to choose them yourself.")
    host, port = payload
    if store is None:
        store = dist.TCPStore(host, port, launch.world_size, False, timeout=timeout)
    return store


def group_timeout_s(backend: str, timeout_s: float) -> float:
    """The process group's own timeout for the tuner's ``timeout_s`` on ``backend`` (see the module doc)."""
    margin = GLOO_TIMEOUT_MARGIN_S if backend.lower() == "gloo" else GROUP_TIMEOUT_MARGIN_S
    return timeout_s + margin


def is_initialized() -> bool:
    """True when the default process group exists (a cheap check)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _info_from_group(launch: LaunchEnv) -> DistInfo:
    import torch.distributed as dist

    rank, world_size = dist.get_rank(), dist.get_world_size()
    backend = str(dist.get_backend())
    if launch.world_size == world_size and launch.rank == rank:
        local_rank, local_world_size = launch.local_rank, launch.local_world_size
    else:  # someone else built the group from other information
        local_rank, local_world_size = rank, world_size
    return DistInfo(
        rank, world_size, local_rank, local_world_size, backend, _device_for(local_rank), launch.launcher
    )


def init(backend: str | None = None, timeout_s: float | None = None) -> DistInfo:
    """Initialise the default ``torch.distributed`` process group from the launcher's environment.

    ``backend``: ``None`` picks ``nccl`` with CUDA devices, else ``gloo``; any string
    ``init_process_group`` accepts is passed on. ``timeout_s``: the tuner's per-collective timeout,
    default ``$DISTTUNE_TIMEOUT`` or 300 s; the group's own is a little longer (:func:`group_timeout_s`).

    Idempotent: if a default group already exists (ours or the caller's) this returns
    its :class:`DistInfo` without touching it. From its first call on, a disttune error ends the process in
    one line per job, and unknown ``DISTTUNE_*`` variables are named (:mod:`disttune.startup`). Cost of the first call: a rendezvous
    (one TCP connection per rank to rank 0's store) and, for NCCL, communicator set-up;
    on a GPU it also starts :func:`disttune.warm_up` on a background thread (Triton's
    one-time initialisation, off the first tuning call; ``DISTTUNE_WARM_UP=0`` turns it off).
    Raises :class:`DistEnvError` naming the variable when the environment is incomplete.
    """
    global _INFO, _STORE
    import torch.distributed as dist

    startup.start()  # a disttune error ends the job in one line; unknown DISTTUNE_* variables are named
    if not dist.is_available():
        raise RuntimeError("disttune.dist: this torch build has no torch.distributed support")
    if dist.is_initialized():
        if _INFO is None:
            _INFO = _info_from_group(detect())
            startup.watch(control_store(), _INFO.rank, _INFO.world_size)
        return _INFO

    launch = detect()
    device_count = _cuda_device_count()
    if backend is None:
        # NCCL needs a GPU of its own per rank; with more local ranks than GPUs fall back to gloo.
        backend = "nccl" if 0 < launch.local_world_size <= device_count else "gloo"
    timeout = datetime.timedelta(seconds=group_timeout_s(backend, timeout_seconds(timeout_s)))
    device = _device_for(launch.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before the group: NCCL binds to the current device
        from .warmup import start_if_enabled

        start_if_enabled(device.index)  # Triton's one-time initialisation, beside the rendezvous and the model load

    kwargs: dict[str, Any] = {
        "backend": backend,
        "timeout": timeout,
        "rank": launch.rank,
        "world_size": launch.world_size,
    }
    if device.type == "cuda" and "nccl" in backend.lower() and _supports_device_id():
        kwargs["device_id"] = device
    store = None
    if launch.master_addr is not None and launch.master_port is not None:
        kwargs["init_method"] = "env://"  # torchrun (or user-exported) rendezvous
    else:
        store = _make_store(launch, timeout)
        kwargs["store"] = store
    dist.init_process_group(**kwargs)
    if not _EXIT_HOOKED:
        atexit.register(_destroy_at_exit)
        _EXIT_HOOKED.append(True)
    # Connect every rank now: NCCL otherwise builds its communicator inside the first collective,
    # which blocks without a timeout if a peer never arrives.
    dist.barrier()
    _STORE = store
    startup.watch(control_store(), dist.get_rank(), dist.get_world_size())
    _INFO = DistInfo(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=launch.local_rank,
        local_world_size=launch.local_world_size,
        backend=str(dist.get_backend()),
        device=device,
        launcher=launch.launcher,
    )
    return _INFO


def destroy() -> None:
    """Destroy the default process group if it exists (frees communicators; no collective).

    Waits up to :data:`DRAIN_AT_EXIT_S` for this GPU's queued work (polled); a GPU still busy then
    (stuck behind a collective a peer never entered) has its group aborted instead, which cannot hang.
    The CUDA graphs of tuned steps (``contextual_autotune(cuda_graph=True)``) are dropped before either: NCCL
    cannot destroy a communicator that a live graph still uses."""
    global _INFO, _STORE
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        drained = device.drained(DRAIN_AT_EXIT_S)
        graphs.release_all()  # (a graph still running is freed when it finishes)
        if drained:
            dist.destroy_process_group()
        else:
            abort_process_groups()
    _INFO = None
    _STORE = None


def _destroy_at_exit() -> None:
    try:
        destroy()
    except Exception:  # noqa: BLE001 - at exit there is nobody left to tell
        pass
