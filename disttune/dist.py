"""Start ``torch.distributed`` from whatever launched this process.

:func:`init` reads the launcher's environment and initialises the default
process group once:

* **torchrun** (or any ``env://`` launcher): ``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``;
* **MPI**: Open MPI (``OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE``),
  MPICH / Intel MPI Hydra (``PMI_RANK``, ``PMI_SIZE``, ``MPI_LOCALRANKID``,
  ``MPI_LOCALNRANKS``) or a bare PMIx launcher (``PMIX_RANK``). Without
  ``MASTER_ADDR``/``MASTER_PORT``, rank 0 opens a ``TCPStore`` on a port the
  kernel picks (bind to port 0, so no other job can take it in between) and
  ``mpi4py`` broadcasts its host and port to every rank;
* **nothing** (``python script.py``): a world of one process on
  ``127.0.0.1`` and a free port, so the same script runs without a launcher.

The backend is ``nccl`` when every local rank can have a GPU of its own and ``gloo`` otherwise; with CUDA
each rank is pinned to ``cuda:(local_rank % device_count)`` *before* the group
is created. Every collective's timeout comes from ``timeout_s``, else
``$DISTTUNE_TIMEOUT`` (seconds), else 300 s.

Cost: the first :func:`init` costs one rendezvous (a TCP round trip per rank,
plus NCCL communicator set-up with CUDA, typically well under a second on one
node); later calls return the cached :class:`DistInfo` at once.
"""

from __future__ import annotations

import dataclasses
import datetime
import inspect
import os
import socket
from typing import Any, Literal, Mapping

import torch

__all__ = ["DistInfo", "DistEnvError", "init", "destroy", "mpi_comm_world", "is_initialized"]

Launcher = Literal["torchrun", "mpi", "single"]

DEFAULT_TIMEOUT_S = 300.0
TIMEOUT_ENV = "DISTTUNE_TIMEOUT"
_LOOPBACK = "127.0.0.1"


class DistEnvError(RuntimeError):
    """The launcher's environment is incomplete or inconsistent (the message says what to set)."""


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


@dataclasses.dataclass(frozen=True)
class _LaunchEnv:
    """What the environment says, before any process group exists."""

    launcher: Launcher
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str | None
    master_port: int | None
    source: str  # e.g. "torchrun", "Open MPI", "MPICH/Hydra (PMI)", for error messages


_INFO: DistInfo | None = None
_STORE: Any = None  # the TCPStore we created, kept alive as long as the group


# --------------------------------------------------------------------------- env parsing


def _env_int(env: Mapping[str, str], name: str, hint: str, minimum: int = 0) -> int:
    """Parse ``env[name]`` as an int >= ``minimum``; ``DistEnvError`` naming the variable otherwise."""
    raw = env.get(name)
    if raw is None:
        raise DistEnvError(f"disttune.dist: environment variable {name} is not set. {hint}")
    try:
        value = int(raw.strip())
    except ValueError:
        raise DistEnvError(f"disttune.dist: {name}={raw!r} is not an integer. {hint}") from None
    if value < minimum:
        raise DistEnvError(f"disttune.dist: {name}={value} must be >= {minimum}. {hint}")
    return value


def _env_opt_int(env: Mapping[str, str], names: tuple[str, ...], hint: str, minimum: int = 0) -> int | None:
    """The first of ``names`` that is set, parsed as an int; ``None`` when none is set."""
    for name in names:
        if name in env:
            return _env_int(env, name, hint, minimum)
    return None


def _check_ranks(env: _LaunchEnv, hint: str) -> _LaunchEnv:
    if not 0 <= env.rank < env.world_size:
        raise DistEnvError(
            f"disttune.dist: {env.source} gives rank {env.rank} but world size {env.world_size}; "
            f"the rank must lie in [0, world size). {hint}"
        )
    if not 0 <= env.local_rank < env.local_world_size:
        raise DistEnvError(
            f"disttune.dist: {env.source} gives local rank {env.local_rank} but local world size "
            f"{env.local_world_size}; the local rank must lie in [0, local world size). {hint}"
        )
    if env.local_world_size > env.world_size:
        raise DistEnvError(
            f"disttune.dist: {env.source} gives local world size {env.local_world_size} > world size "
            f"{env.world_size}. {hint}"
        )
    return env


def _master_from_env(env: Mapping[str, str], hint: str) -> tuple[str | None, int | None]:
    addr = env.get("MASTER_ADDR") or None
    port = _env_opt_int(env, ("MASTER_PORT",), hint, minimum=1) if env.get("MASTER_PORT") else None
    if port is not None and port > 65535:
        raise DistEnvError(f"disttune.dist: MASTER_PORT={port} is not a TCP port (1..65535). {hint}")
    return addr, port


def _torchrun_env(env: Mapping[str, str]) -> _LaunchEnv:
    hint = (
        "Launch with `bash scripts/launch.sh script.py` or `torchrun --nproc_per_node=N script.py`, "
        "which set RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT; "
        "or unset RANK/WORLD_SIZE to run as a single process."
    )
    if "RANK" in env and "WORLD_SIZE" not in env:
        raise DistEnvError(
            f"disttune.dist: RANK={env['RANK']!r} is set but WORLD_SIZE is not; export WORLD_SIZE "
            f"(the total number of processes) as well. {hint}"
        )
    if "WORLD_SIZE" in env and "RANK" not in env:
        raise DistEnvError(
            f"disttune.dist: WORLD_SIZE={env['WORLD_SIZE']!r} is set but RANK is not; export RANK "
            f"(this process's global rank, 0..WORLD_SIZE-1) as well. {hint}"
        )
    rank = _env_int(env, "RANK", hint)
    world_size = _env_int(env, "WORLD_SIZE", hint, minimum=1)
    # Launchers other than torchrun sometimes leave the local values out; assume one node then.
    local_rank = _env_opt_int(env, ("LOCAL_RANK",), hint)
    local_world_size = _env_opt_int(env, ("LOCAL_WORLD_SIZE",), hint, minimum=1)
    if local_rank is None:
        local_rank = rank if local_world_size is None else rank % local_world_size
    if local_world_size is None:
        local_world_size = world_size
    addr, port = _master_from_env(env, hint)
    if world_size > 1:
        for name, value in (("MASTER_ADDR", addr), ("MASTER_PORT", port)):
            if value is None:
                raise DistEnvError(
                    f"disttune.dist: RANK and WORLD_SIZE={world_size} are set but {name} is not; every "
                    f"rank needs MASTER_ADDR (host of rank 0) and MASTER_PORT (a free TCP port there). "
                    f"{hint}"
                )
    launch = _LaunchEnv("torchrun", rank, world_size, local_rank, local_world_size, addr, port, "torchrun")
    return _check_ranks(launch, hint)


_MPI_FLAVOURS: tuple[tuple[str, str, tuple[str, ...], tuple[str, ...], tuple[str, ...]], ...] = (
    # (source, rank var, size vars, local rank vars, local size vars)
    (
        "Open MPI",
        "OMPI_COMM_WORLD_RANK",
        ("OMPI_COMM_WORLD_SIZE",),
        ("OMPI_COMM_WORLD_LOCAL_RANK",),
        ("OMPI_COMM_WORLD_LOCAL_SIZE",),
    ),
    ("MPICH/Hydra (PMI)", "PMI_RANK", ("PMI_SIZE",), ("MPI_LOCALRANKID",), ("MPI_LOCALNRANKS",)),
    ("PMIx", "PMIX_RANK", ("PMIX_SIZE",), ("PMIX_LOCAL_RANK",), ("PMIX_LOCAL_SIZE",)),
)


def _mpi_env(env: Mapping[str, str]) -> _LaunchEnv | None:
    """Rank and sizes from an MPI launcher's variables; gaps are filled by mpi4py (which starts MPI)."""
    for source, rank_var, size_vars, local_rank_vars, local_size_vars in _MPI_FLAVOURS:
        if rank_var not in env:
            continue
        hint = (
            f"This process looks launched by {source} ({rank_var} is set). Launch with "
            "`bash scripts/launch.sh --mpi -n N script.py` or `mpiexec -n N python script.py`, "
            f"or unset {rank_var} to run as a single process."
        )
        rank = _env_int(env, rank_var, hint)
        world_size = _env_opt_int(env, size_vars, hint, minimum=1)
        local_rank = _env_opt_int(env, local_rank_vars, hint)
        local_world_size = _env_opt_int(env, local_size_vars, hint, minimum=1)
        if world_size is None or local_rank is None or local_world_size is None:
            comm = _mpi_world_or_none()
            if comm is None:
                if world_size is None:
                    raise DistEnvError(
                        f"disttune.dist: {rank_var} is set but {'/'.join(size_vars)} is not, and mpi4py "
                        f"is not installed to ask MPI for the world size. `pip install mpi4py`, or "
                        f"export {size_vars[0]}. {hint}"
                    )
                # No way to learn the node layout: assume one node.
                local_world_size = world_size if local_world_size is None else local_world_size
                local_rank = rank % local_world_size if local_rank is None else local_rank
            else:
                _check_mpi_agrees(comm, rank, world_size, source)
                world_size = comm.Get_size() if world_size is None else world_size
                if local_rank is None or local_world_size is None:
                    from mpi4py import MPI

                    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
                    local_rank = node.Get_rank() if local_rank is None else local_rank
                    local_world_size = node.Get_size() if local_world_size is None else local_world_size
                    node.Free()
        addr, port = _master_from_env(env, hint)
        launch = _LaunchEnv("mpi", rank, world_size, local_rank, local_world_size, addr, port, source)
        return _check_ranks(launch, hint)
    return None


def _detect(env: Mapping[str, str]) -> _LaunchEnv:
    """Which launcher started us and what it says. Pure env parsing, except mpi4py for gaps."""
    if "RANK" in env or "WORLD_SIZE" in env:
        return _torchrun_env(env)
    mpi = _mpi_env(env)
    if mpi is not None:
        return mpi
    return _LaunchEnv("single", 0, 1, 0, 1, None, None, "no launcher")


# --------------------------------------------------------------------------- MPI helpers


def mpi_comm_world() -> Any:
    """``mpi4py.MPI.COMM_WORLD``. The first call imports mpi4py, which initialises MPI (milliseconds)."""
    try:
        from mpi4py import MPI
    except ImportError as err:
        raise ImportError(
            "disttune.dist: mpi4py is needed for MPI launches (mpiexec/mpirun/srun --mpi) but is not "
            "importable. Install it with `pip install mpi4py` (plus an MPI, e.g. `pip install mpich` or "
            "your system's Open MPI), or launch with torchrun / `bash scripts/launch.sh` instead. "
            f"Import error: {err}"
        ) from err
    return MPI.COMM_WORLD


def _mpi_world_or_none() -> Any:
    try:
        return mpi_comm_world()
    except ImportError:
        return None


def _check_mpi_agrees(comm: Any, rank: int, world_size: int | None, source: str) -> None:
    """Catch mpi4py built against a different MPI than the launcher: each rank then sees a world of 1."""
    mpi_rank, mpi_size = comm.Get_rank(), comm.Get_size()
    if mpi_rank != rank or (world_size is not None and mpi_size != world_size):
        raise DistEnvError(
            f"disttune.dist: the launcher's environment ({source}) says rank {rank} of "
            f"{world_size if world_size is not None else '?'} but mpi4py says rank {mpi_rank} of {mpi_size}. mpi4py is probably "
            "linked against a different MPI than the `mpiexec` that started this job; use the mpiexec "
            "of the MPI that mpi4py was built with (`python -c 'import mpi4py; print(mpi4py.get_config())'`)."
        )


def _rank0_host(launch: _LaunchEnv) -> str:
    """Address other ranks use to reach rank 0: loopback on one node, else rank 0's hostname."""
    if launch.master_addr:
        return launch.master_addr
    if launch.local_world_size == launch.world_size:
        return _LOOPBACK
    return socket.gethostname()


# --------------------------------------------------------------------------- init / destroy


def _timeout_s(timeout_s: float | None) -> float:
    if timeout_s is None:
        raw = os.environ.get(TIMEOUT_ENV)
        if raw is None or not raw.strip():
            return DEFAULT_TIMEOUT_S
        try:
            timeout_s = float(raw)
        except ValueError:
            raise DistEnvError(
                f"disttune.dist: {TIMEOUT_ENV}={raw!r} is not a number of seconds; e.g. "
                f"export {TIMEOUT_ENV}=300"
            ) from None
    if not timeout_s > 0:
        raise DistEnvError(f"disttune.dist: timeout must be > 0 seconds, got {timeout_s!r} (timeout_s / {TIMEOUT_ENV})")
    return float(timeout_s)


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


def _make_store(launch: _LaunchEnv, timeout: datetime.timedelta) -> Any:
    """A TCPStore for rendezvous when no MASTER_ADDR/PORT pair exists (MPI or a single process).

    Rank 0 binds port 0 (or the given MASTER_PORT) so the kernel picks a free port that
    nobody can take before we use it; under MPI the address and port are broadcast.
    """
    import torch.distributed as dist

    if launch.world_size == 1:
        return dist.TCPStore(_LOOPBACK, 0, 1, True, timeout=timeout, wait_for_workers=False)
    comm = mpi_comm_world()
    _check_mpi_agrees(comm, launch.rank, launch.world_size, launch.source)
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


def is_initialized() -> bool:
    """True when the default process group exists (a cheap check)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _info_from_group(launch: _LaunchEnv) -> DistInfo:
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
    ``init_process_group`` accepts is passed on. ``timeout_s``: per-collective timeout,
    default ``$DISTTUNE_TIMEOUT`` or 300 s.

    Idempotent: if a default group already exists (ours or the caller's) this returns
    its :class:`DistInfo` without touching it. Cost of the first call: a rendezvous
    (one TCP connection per rank to rank 0's store) and, for NCCL, communicator set-up.
    Raises :class:`DistEnvError` naming the variable when the environment is incomplete.
    """
    global _INFO, _STORE
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("disttune.dist: this torch build has no torch.distributed support")
    if dist.is_initialized():
        if _INFO is None:
            _INFO = _info_from_group(_detect(os.environ))
        return _INFO

    timeout = datetime.timedelta(seconds=_timeout_s(timeout_s))
    launch = _detect(os.environ)
    device_count = _cuda_device_count()
    if backend is None:
        # NCCL needs a GPU of its own per rank; with more local ranks than GPUs fall back to gloo.
        backend = "nccl" if 0 < launch.local_world_size <= device_count else "gloo"
    device = _device_for(launch.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before the group: NCCL binds to the current device

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
    # Connect every rank now: NCCL otherwise builds its communicator inside the first collective,
    # which blocks without a timeout if a peer never arrives.
    dist.barrier()
    _STORE = store
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
    """Destroy the default process group if it exists (frees communicators; no collective)."""
    global _INFO, _STORE
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _INFO = None
    _STORE = None
