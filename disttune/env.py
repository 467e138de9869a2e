"""The environment, read in one place: ``DISTTUNE_*`` settings and what the launcher says about this rank.

Every other module asks here rather than reading ``os.environ`` itself, so a setting means the same
everywhere and a bad value is one clear error:

* :func:`timeout_s`: the per-collective timeout, ``timeout_s=`` else ``$DISTTUNE_TIMEOUT`` else 300 s;
  zero, negative or non-numeric is a :class:`DistEnvError` (a ``ValueError``) naming its source;
* :func:`interpreting`: whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET``);
* :func:`cuda_devices_narrowed`: whether ``CUDA_VISIBLE_DEVICES`` renumbers CUDA's devices (the
  energy probe then finds its GPU in NVML by UUID only);
* :func:`detect`: the launcher and this process's rank, world size, local rank and local world size, for
  **torchrun** (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR/PORT``),
  **Open MPI** (``OMPI_COMM_WORLD_*``), **MPICH / Intel MPI Hydra** (``PMI_RANK``, ``PMI_SIZE``,
  ``MPI_LOCALRANKID``, ``MPI_LOCALNRANKS``), **PMIx** (``PMIX_RANK``, ...) and **Slurm's srun**
  (``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``, ``SLURM_LOCALID``, ``SLURM_STEP_TASKS_PER_NODE``);
  gaps are filled by asking MPI through mpi4py;
* :func:`local_rank` / :func:`local_world_size`: the same variables, read without starting anything
  (the tuners use them to share compiles and store writes among the ranks of a node);
* :func:`node_name`: the node a rank runs on (``$DISTTUNE_NODE``, else the host name), for the control
  plane's node relays;
* :func:`log_dir`, :func:`environ_with_log_dir`: where the rank logs go, and a child process's
  environment that sends them elsewhere;
* the store's (and the user cache root it falls back on), the progress bar's, the Triton warm-up's, the compile
  overlap's and the MoE test switches.

Reading costs a dictionary lookup or two; nothing is cached, so a test can change a variable.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import re
from typing import Any, Literal, Mapping, Optional

__all__ = [
    "DEFAULT_TIMEOUT_S", "DistEnvError", "LaunchEnv", "always_tune", "cache_dir", "detect", "environ_with_log_dir",
    "interpreting", "local_rank", "local_world_size", "log_dir", "mpi_comm_world", "node_name", "pinned_table",
    "poison_buffers", "progress_enabled", "sweep_table", "verify_threshold_text", "timeout_s", "triton_prints_autotuning", "xdg_cache_home", "warm_up_enabled",
    "compile_overlap", "timeout_or_error", "tuning_settings", "run_id", "check_settings", "setting_error", "launcher_rank",
    "traceback_requested", "settings_checked",
]

Launcher = Literal["torchrun", "mpi", "single"]

DEFAULT_TIMEOUT_S = 300.0
TIMEOUT = "DISTTUNE_TIMEOUT"
CACHE_DIR = "DISTTUNE_CACHE_DIR"
LOG_DIR = "DISTTUNE_LOG_DIR"
ALWAYS_TUNE = "DISTTUNE_ALWAYS_TUNE"
PINNED = "DISTTUNE_PINNED"
PROGRESS = "DISTTUNE_PROGRESS"
WARM_UP = "DISTTUNE_WARM_UP"
COMPILE_OVERLAP = "DISTTUNE_COMPILE_OVERLAP"
MOE_POISON = "DISTTUNE_MOE_POISON"
NODE = "DISTTUNE_NODE"


class DistEnvError(RuntimeError, ValueError):
    """A launcher or ``DISTTUNE_*`` variable is missing, malformed or inconsistent (the message says which)."""

    #: True where the error follows from a setting alone (a ``DISTTUNE_*`` variable, the timeout): then it is
    #: the same on every rank that shares the environment and the code
    from_settings: bool = False


def setting_error(message: str) -> DistEnvError:
    """A :class:`DistEnvError` about a setting (``from_settings``)."""
    error = DistEnvError(message)
    error.from_settings = True
    return error


# --------------------------------------------------------------------------- settings


def timeout_s(value: Optional[float] = None, environ: Mapping[str, str] = os.environ) -> float:
    """The per-collective timeout in seconds: ``value`` if given, else ``$DISTTUNE_TIMEOUT``, else 300.

    Raises :class:`DistEnvError` (a ``ValueError``, ``from_settings``) for zero, a negative number, infinity, NaN or text
    that is not a number, naming where the value came from: never a silent default.
    """
    source = "timeout_s"
    if value is None:
        raw = environ.get(TIMEOUT)
        if raw is None or not raw.strip():
            return DEFAULT_TIMEOUT_S
        source = TIMEOUT
        try:
            value = float(raw)
        except ValueError:
            raise setting_error(f"disttune: {TIMEOUT}={raw!r} is not a number of seconds; e.g. "
                                f"export {TIMEOUT}=300") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise setting_error(f"disttune: timeout_s must be a positive number of seconds, got {value!r} ({source})")
    return float(value)


TRACEBACK = "DISTTUNE_TRACEBACK"
SETTINGS_CHECKED = "DISTTUNE_SETTINGS_CHECKED"

#: Every DISTTUNE_* variable disttune reads, and the test suite's DISTTUNE_REQUIRE_MPI.
KNOWN = (TIMEOUT, CACHE_DIR, LOG_DIR, ALWAYS_TUNE, PINNED, PROGRESS, WARM_UP, COMPILE_OVERLAP, MOE_POISON,
         NODE, TRACEBACK, SETTINGS_CHECKED, "DISTTUNE_VERIFY", "DISTTUNE_VERIFY_CPU", "DISTTUNE_SWEEP_TABLE",
         "DISTTUNE_DEMO_ERRORS", "DISTTUNE_REQUIRE_MPI")


def check_settings(environ: Mapping[str, str] = os.environ) -> tuple[list[str], list[str]]:
    """What is wrong with the ``DISTTUNE_*`` settings before any rank starts: (errors, warnings), each one line.

    Errors: a timeout or a verify threshold that is not a number (what the tuner would raise on every rank at
    its first call); warnings: a ``DISTTUNE_*`` name disttune does not read (a typo, with the name it is
    closest to). Costs a few string operations."""
    import difflib

    errors: list[str] = []
    try:
        timeout_s(None, environ)
    except DistEnvError as err:
        errors.append(str(err).removeprefix("disttune: "))
    verify = environ.get("DISTTUNE_VERIFY", "").strip()
    if verify:
        try:
            if not float(verify) >= 0:
                raise ValueError(verify)
        except ValueError:
            errors.append(f"DISTTUNE_VERIFY={verify!r} is not a threshold >= 0, such as 0.1 (10 % slower allowed)")
    warnings = []
    for name in sorted(n for n in environ if n.startswith("DISTTUNE_") and n not in KNOWN):
        close = difflib.get_close_matches(name, KNOWN, n=1)
        warnings.append(f"{name} is not a disttune setting" + (f" (did you mean {close[0]}?)" if close else ""))
    return errors, warnings


def traceback_requested() -> bool:
    """``DISTTUNE_TRACEBACK=1``: a disttune error ends the process with its traceback, not in one line."""
    return os.environ.get(TRACEBACK, "0") not in ("", "0")


def settings_checked() -> bool:
    """Whether the ``disttune`` command checked the ``DISTTUNE_*`` settings before launching this process (it
    sets ``DISTTUNE_SETTINGS_CHECKED=1``), so the ranks need not warn again."""
    return os.environ.get(SETTINGS_CHECKED, "0") not in ("", "0")


def timeout_or_error(value: Optional[float] = None) -> tuple[float, Optional[DistEnvError]]:
    """:func:`timeout_s`, but a bad ``$DISTTUNE_TIMEOUT`` comes back as the error beside the default, for the
    tuner to raise on every rank through its consensus (a bad ``value`` argument still raises here)."""
    if value is not None:
        return timeout_s(value), None
    try:
        return timeout_s(None), None
    except DistEnvError as err:
        return DEFAULT_TIMEOUT_S, err


def tuning_settings() -> dict[str, str]:
    """The ``DISTTUNE_*`` settings that change how a tuning call runs, as text every rank must share
    (the consensus compares them; ``DISTTUNE_VERIFY`` and ``DISTTUNE_TIMEOUT`` come with the options)."""
    return {ALWAYS_TUNE: repr(always_tune()), COMPILE_OVERLAP: repr(compile_overlap())}


_STARTED = datetime.datetime.now(datetime.timezone.utc)


def run_id() -> str:
    """This process's run: when it imported disttune (UTC, to the second) and its pid, ``2026-11-26T12:00:00Z-4242``.
    A tuning call logs rank 0's on every rank, so the records of one job share it and sort by start."""
    return f"{_STARTED.strftime('%Y-%m-%dT%H:%M:%SZ')}-{os.getpid()}"


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter: Triton's own knob, else ``TRITON_INTERPRET``."""
    try:
        from triton import knobs

        return bool(knobs.runtime.interpret)
    except (ImportError, AttributeError):  # a triton without knobs
        return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def cache_dir() -> Optional[str]:
    """``$DISTTUNE_CACHE_DIR``: where the winner store lives (None: the platform's cache folder)."""
    return os.environ.get(CACHE_DIR) or None


def xdg_cache_home() -> Optional[str]:
    """``$XDG_CACHE_HOME``: the user's cache root, for when platformdirs is not installed (None: ``~/.cache``)."""
    return os.environ.get("XDG_CACHE_HOME") or None


def log_dir() -> Optional[str]:
    """``$DISTTUNE_LOG_DIR``: where each rank writes its tuning log (None: ``logs``, see :mod:`disttune.logs`)."""
    return os.environ.get(LOG_DIR) or None


def environ_with_log_dir(path: str | os.PathLike, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """A copy of ``environ`` for a child process, with ``DISTTUNE_LOG_DIR`` set to ``path``."""
    return {**environ, LOG_DIR: os.fspath(path)}


def always_tune() -> bool:
    """``DISTTUNE_ALWAYS_TUNE=1``: ignore stored winners and tune again."""
    return os.environ.get(ALWAYS_TUNE, "0") not in ("", "0")


def pinned_table() -> Optional[str]:
    """``$DISTTUNE_PINNED``: a winners table to use instead of tuning (None: tune)."""
    return os.environ.get(PINNED) or None


def sweep_table() -> Optional[str]:
    """``$DISTTUNE_SWEEP_TABLE``: where a sweep writes its pinned table when it is not told (``disttune sweep``)."""
    return os.environ.get("DISTTUNE_SWEEP_TABLE") or None


def verify_threshold_text() -> str:
    """``$DISTTUNE_VERIFY`` as written (empty when unset): the regression threshold ``disttune verify`` asks for."""
    return os.environ.get("DISTTUNE_VERIFY", "").strip()


def verify_cpu_timings() -> bool:
    """``DISTTUNE_VERIFY_CPU=1``: let ``disttune verify`` judge timings taken on a CPU (which cannot show a
    regression otherwise)."""
    return os.environ.get("DISTTUNE_VERIFY_CPU", "0") not in ("", "0")


def progress_enabled() -> bool:
    """False when ``DISTTUNE_PROGRESS=0`` turns the tuning progress bar off."""
    return os.environ.get(PROGRESS, "1") != "0"


def warm_up_enabled() -> bool:
    """False when ``DISTTUNE_WARM_UP=0``: ``disttune.dist.init`` then starts no background Triton warm-up."""
    return os.environ.get(WARM_UP, "1") != "0"


def compile_overlap() -> bool:
    """False when ``DISTTUNE_COMPILE_OVERLAP=0``: a tuning call waits for every compile before its
    tuning runs, instead of starting the untimed ones while the compiles finish."""
    return os.environ.get(COMPILE_OVERLAP, "1") != "0"


def triton_prints_autotuning() -> bool:
    """Whether Triton is asked to print its autotuning (``TRITON_PRINT_AUTOTUNING=1``, through its knob)."""
    try:
        from triton import knobs

        return bool(knobs.autotuning.print)
    except (ImportError, AttributeError):  # a triton without knobs
        return os.environ.get("TRITON_PRINT_AUTOTUNING", "0") == "1"


def cuda_devices_narrowed() -> bool:
    """Whether ``CUDA_VISIBLE_DEVICES`` narrows CUDA's view (then CUDA's device numbers are not NVML's)."""
    return bool(os.environ.get("CUDA_VISIBLE_DEVICES"))


def node_name(node: Optional[str] = None, environ: Mapping[str, str] = os.environ) -> str:
    """The name of the node this rank runs on: ``node`` else ``$DISTTUNE_NODE`` else the host name. Ranks that give
    the same name share a node relay (:mod:`disttune.nodeplane`): they must run on one host. A simulation names
    its nodes here."""
    import socket

    return node or environ.get(NODE) or socket.gethostname()


def poison_buffers() -> bool:
    """``DISTTUNE_MOE_POISON=1``: the MoE host functions fill what they allocate with NaN (tests)."""
    return os.environ.get(MOE_POISON) == "1"


# --------------------------------------------------------------------------- launchers


@dataclasses.dataclass(frozen=True)
class LaunchEnv:
    """What the environment says, before any process group exists."""

    launcher: Launcher
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str | None
    master_port: int | None
    source: str  # e.g. "torchrun", "Open MPI", "MPICH/Hydra (PMI)", for error messages


#: (local rank, local size) variables of each launcher, in the order :func:`detect` tries them
LOCAL_RANK_VARS = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "PMIX_LOCAL_RANK", "SLURM_LOCALID")
LOCAL_SIZE_VARS = ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "PMIX_LOCAL_SIZE")


def local_rank(default: int = 0, environ: Mapping[str, str] = os.environ) -> int:
    """This rank's index among the ranks of its node, as the launcher says; ``default`` without one."""
    for name in LOCAL_RANK_VARS:
        if environ.get(name, "").isdigit():
            return int(environ[name])
    return default


def local_world_size(environ: Mapping[str, str] = os.environ) -> int:
    """How many ranks run on this node, as the launcher says; 1 without one."""
    for name in LOCAL_SIZE_VARS:
        if environ.get(name, "").isdigit():
            return int(environ[name])
    return _slurm_local_size(environ) or 1


def launcher_rank(environ: Mapping[str, str] = os.environ) -> tuple[int, int]:
    """(rank, world size) as the launcher's variables give them, read without starting MPI (so it is safe where
    the peers are elsewhere, as at exit); (0, 1) without a launcher or where they do not parse."""
    for rank, size in (("RANK", "WORLD_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE"),
                       ("PMIX_RANK", "PMIX_SIZE"), ("SLURM_PROCID", "SLURM_STEP_NUM_TASKS")):
        if environ.get(rank, "").isdigit() and environ.get(size, "").isdigit():
            return int(environ[rank]), int(environ[size])
    return 0, 1


def _slurm_local_size(environ: Mapping[str, str]) -> Optional[int]:
    """This node's task count from srun's ``SLURM_STEP_TASKS_PER_NODE`` (``2(x3),1``) and ``SLURM_NODEID``."""
    layout, node = environ.get("SLURM_STEP_TASKS_PER_NODE", ""), environ.get("SLURM_NODEID", "")
    if not layout or not node.isdigit():
        return None
    counts: list[int] = []
    for part in layout.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            return None
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts[int(node)] if int(node) < len(counts) else None


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


def _check_ranks(env: LaunchEnv, hint: str) -> LaunchEnv:
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


def _torchrun_env(env: Mapping[str, str]) -> LaunchEnv:
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
    launch = LaunchEnv("torchrun", rank, world_size, local_rank, local_world_size, addr, port, "torchrun")
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
    # srun sets SLURM_STEP_NUM_TASKS in each task of a step (a batch script's own shell has SLURM_PROCID only)
    ("Slurm (srun)", "SLURM_PROCID", ("SLURM_STEP_NUM_TASKS",), ("SLURM_LOCALID",), ()),
)


def _mpi_env(env: Mapping[str, str]) -> LaunchEnv | None:
    """Rank and sizes from an MPI launcher's variables; gaps are filled by mpi4py (which starts MPI)."""
    for source, rank_var, size_vars, local_rank_vars, local_size_vars in _MPI_FLAVOURS:
        if rank_var not in env or (rank_var == "SLURM_PROCID" and "SLURM_STEP_NUM_TASKS" not in env):
            continue
        hint = (
            f"This process looks launched by {source} ({rank_var} is set). Launch with "
            "`bash scripts/launch.sh --mpi -n N script.py` or `mpiexec -n N python script.py`, "
            f"or unset {rank_var} to run as a single process."
        )
        rank = _env_int(env, rank_var, hint)
        world_size = _env_opt_int(env, size_vars, hint, minimum=1)
        local_rank = _env_opt_int(env, local_rank_vars, hint)
        local_world_size = _env_opt_int(env, local_size_vars, hint, minimum=1) or _slurm_local_size(env)
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
                check_mpi_agrees(comm, rank, world_size, source)
                world_size = comm.Get_size() if world_size is None else world_size
                if local_rank is None or local_world_size is None:
                    from mpi4py import MPI

                    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
                    local_rank = node.Get_rank() if local_rank is None else local_rank
                    local_world_size = node.Get_size() if local_world_size is None else local_world_size
                    node.Free()
        addr, port = _master_from_env(env, hint)
        launch = LaunchEnv("mpi", rank, world_size, local_rank, local_world_size, addr, port, source)
        return _check_ranks(launch, hint)
    return None


def detect(env: Mapping[str, str] = os.environ) -> LaunchEnv:
    """Which launcher started us and what it says (``env``: default this process's environment).

    Pure env parsing, except mpi4py for gaps.
    """
    if "RANK" in env or "WORLD_SIZE" in env:
        return _torchrun_env(env)
    mpi = _mpi_env(env)
    if mpi is not None:
        return mpi
    return LaunchEnv("single", 0, 1, 0, 1, None, None, "no launcher")



# --------------------------------------------------------------------------- MPI


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


def check_mpi_agrees(comm: Any, rank: int, world_size: int | None, source: str) -> None:
    """Catch mpi4py built against a different MPI than the launcher: each rank then sees a world of 1."""
    mpi_rank, mpi_size = comm.Get_rank(), comm.Get_size()
    if mpi_rank != rank or (world_size is not None and mpi_size != world_size):
        raise DistEnvError(
            f"disttune.dist: the launcher's environment ({source}) says rank {rank} of "
            f"{world_size if world_size is not None else '?'} but mpi4py says rank {mpi_rank} of {mpi_size}. mpi4py is probably "
            "linked against a different MPI than the `mpiexec` that started this job; use the mpiexec "
            "of the MPI that mpi4py was built with (`python -c 'import mpi4py; print(mpi4py.get_config())'`)."
        )
