"""Communicators: the few collectives the tuner needs, each bounded by a timeout.

The tuner talks to its peers through three operations only: an all-gather of a
fixed-length float vector (timings), an all-gather of small picklable objects
(digests, error messages) and a barrier. Three implementations share that
protocol:

* :class:`TorchComm` over any ``torch.distributed`` process group (NCCL, gloo, ...);
* :class:`MpiComm` over an ``mpi4py`` communicator;
* :class:`LocalComm` for a single process (no collective at all).

Every collective waits at most ``timeout`` seconds. A timeout becomes a
:class:`CollectiveTimeout` that names the step, so a missing peer is an error on
each rank that is still alive, never a hang.

:class:`TorchComm` also carries *notes* through the process group's rendezvous store
(the c10d store every rank is connected to): a rank that fails where its peers may be
waiting elsewhere (inside the user's own collective, say) posts its error there with
:meth:`TorchComm.post_note`; a rank waiting in one of these collectives on a watched
channel checks the store every 0.1 s once the wait has lasted 0.1 s, and leaves with
:class:`PeerFailed` when a peer has posted. A collective that completes in time never
touches the store. MPI and custom communicators have no notes: their waits end by timeout.
"""

from __future__ import annotations

import pickle
import time
from typing import Any, Optional, Protocol, Sequence, runtime_checkable

import numpy as np

from .env import DEFAULT_TIMEOUT_S


class CollectiveTimeout(RuntimeError):
    """A collective did not complete in time (a peer died, hung or skipped it)."""


class PeerFailed(RuntimeError):
    """A peer posted a note on the watched channel while this rank waited in a collective."""

    def __init__(self, message: str, notes: dict[int, dict]) -> None:
        super().__init__(message)
        self.notes = notes


@runtime_checkable
class Communicator(Protocol):
    """What the tuner needs from its peers. ``step`` names the caller's step in errors."""

    rank: int
    world_size: int

    def all_gather_floats(self, values: Sequence[float], step: str) -> np.ndarray:
        """Gather one equal-length float vector per rank; returns ``[world_size, len(values)]``."""
        ...

    def all_gather_objects(self, obj: Any, step: str) -> list[Any]:
        """Gather one small picklable object per rank, in rank order."""
        ...

    def barrier(self, step: str) -> None:
        ...


class LocalComm:
    """A world of one process: every collective returns at once."""

    rank = 0
    world_size = 1

    def all_gather_floats(self, values: Sequence[float], step: str) -> np.ndarray:
        return np.asarray(values, dtype=np.float64).reshape(1, -1)

    def all_gather_objects(self, obj: Any, step: str) -> list[Any]:
        return [obj]

    def barrier(self, step: str) -> None:
        return None

    def describe(self) -> str:
        return "local (1 process)"


class TorchComm:
    """Collectives over a ``torch.distributed`` process group, with a timeout on each.

    Tensors live on the current CUDA device for NCCL and on the CPU otherwise. Each
    call costs one or two small collectives (tens of microseconds on NVLink).
    """

    def __init__(self, group: Any = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "disttune: is_dist=True needs an initialised torch.distributed process group. "
                "Call disttune.dist.init() (or torch.distributed.init_process_group) first, "
                "pass comm=<mpi4py communicator>, or use is_dist=False for a single process."
            )
        self._dist = dist
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.timeout_s = float(timeout_s)
        self._channel: Optional[str] = None
        backend = str(dist.get_backend(group)).lower()
        import torch

        self._torch = torch
        self._device = (
            torch.device("cuda", torch.cuda.current_device())
            if "nccl" in backend and torch.cuda.is_available()
            else torch.device("cpu")
        )

    def describe(self) -> str:
        return f"torch.distributed ({self._dist.get_backend(self.group)}, {self.world_size} ranks)"

    # -- notes through the rendezvous store -------------------------------------------------------------

    _NOTE_POLL_S = 0.1

    def watch(self, channel: Optional[str]) -> None:
        """Leave a wait with :class:`PeerFailed` when a peer posts on ``channel`` (None: stop watching)."""
        self._channel = channel

    def _store(self) -> Any:
        try:
            from torch.distributed import distributed_c10d

            return distributed_c10d._get_default_store()
        except (ImportError, AttributeError, RuntimeError, ValueError):
            return None

    def _note_key(self, channel: str, rank: int | str) -> str:
        ranks = "all" if self.group is None else ",".join(map(str, self._dist.get_process_group_ranks(self.group)))
        return f"disttune/{ranks}/{channel}/{rank}"

    def post_note(self, channel: str, note: dict) -> None:
        """Post this rank's ``note`` (a small picklable dict) on ``channel``, for peers waiting anywhere."""
        store = self._store()
        if store is None:
            return
        try:
            store.set(self._note_key(channel, self.rank), pickle.dumps(note))
            store.add(self._note_key(channel, "posted"), 1)
        except RuntimeError:
            pass  # the store is gone with the job: the collectives' timeouts still end every wait

    def peer_notes(self, channel: str) -> dict[int, dict]:
        """The notes the other ranks have posted on ``channel`` so far, by rank (one store read per rank)."""
        store = self._store()
        notes: dict[int, dict] = {}
        if store is None:
            return notes
        try:
            if not store.add(self._note_key(channel, "posted"), 0):
                return notes
            for rank in range(self.world_size):
                key = self._note_key(channel, rank)
                if rank != self.rank and store.check([key]):
                    notes[rank] = pickle.loads(store.get(key))
        except RuntimeError:
            pass
        return notes

    def _wait(self, work: Any, step: str) -> None:
        # Poll rather than trust wait(timeout): NCCL ignores that timeout unless blocking wait is on.
        started = time.monotonic()
        deadline = started + self.timeout_s
        next_look = started + self._NOTE_POLL_S
        pause = 0.0
        try:
            while not work.is_completed():
                now = time.monotonic()
                if self._channel is not None and now > next_look:
                    next_look = now + self._NOTE_POLL_S
                    notes = self.peer_notes(self._channel)
                    if notes:
                        raise PeerFailed(f"disttune: rank {self.rank}: left step '{step}': rank(s) "
                                         f"{sorted(notes)} posted a note (an error, or leaving after one)", notes)
                if now > deadline:
                    raise CollectiveTimeout(
                        f"disttune: rank {self.rank}: collective in step '{step}' did not complete within "
                        f"{self.timeout_s:.0f} s (a peer rank died, raised, or skipped this step)"
                    )
                time.sleep(pause)
                pause = min(pause * 2 or 1e-5, 1e-3)
            work.wait()
        except (CollectiveTimeout, PeerFailed):
            raise
        except RuntimeError as err:
            raise CollectiveTimeout(
                f"disttune: rank {self.rank}: collective in step '{step}' failed "
                f"(a peer rank died, raised, or skipped this step): {err}"
            ) from err

    def _all_gather_tensor(self, tensor: Any, step: str) -> Any:
        torch = self._torch
        tensor = tensor.to(self._device).reshape(-1)
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        work = self._dist.all_gather(parts, tensor, group=self.group, async_op=True)
        self._wait(work, step)
        return torch.stack(parts).cpu()

    def all_gather_floats(self, values: Sequence[float], step: str) -> np.ndarray:
        tensor = self._torch.tensor(np.asarray(values, dtype=np.float64))
        return self._all_gather_tensor(tensor, step).numpy()

    def all_gather_objects(self, obj: Any, step: str) -> list[Any]:
        torch = self._torch
        payload = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
        sizes = self._all_gather_tensor(torch.tensor([payload.size], dtype=torch.int64), step)
        longest = int(sizes.max())
        padded = np.zeros(longest, dtype=np.uint8)
        padded[: payload.size] = payload
        gathered = self._all_gather_tensor(torch.from_numpy(padded), step).numpy()
        return [pickle.loads(gathered[r, : int(sizes[r, 0])].tobytes()) for r in range(self.world_size)]

    def barrier(self, step: str) -> None:
        self.all_gather_floats([0.0], step)


class MpiComm:
    """Collectives over an ``mpi4py`` communicator, non-blocking and polled until ``timeout``.

    MPI has no timeout of its own, so each collective is started with its
    non-blocking form and tested in a short sleep loop.
    """

    _POLL_S = 0.0005

    def __init__(self, comm: Any, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.comm = comm
        self.rank = comm.Get_rank()
        self.world_size = comm.Get_size()
        self.timeout_s = float(timeout_s)

    def describe(self) -> str:
        return f"MPI ({self.world_size} ranks)"

    def _wait(self, request: Any, step: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not request.Test():
            if time.monotonic() > deadline:
                raise CollectiveTimeout(
                    f"disttune: rank {self.rank}: MPI collective in step '{step}' did not complete "
                    f"within {self.timeout_s:.0f} s (a peer rank died, raised, or skipped this step)"
                )
            time.sleep(self._POLL_S)

    def all_gather_floats(self, values: Sequence[float], step: str) -> np.ndarray:
        send = np.ascontiguousarray(values, dtype=np.float64)
        recv = np.empty((self.world_size, send.size), dtype=np.float64)
        self._wait(self.comm.Iallgather(send, recv), step)
        return recv

    def all_gather_objects(self, obj: Any, step: str) -> list[Any]:
        payload = np.frombuffer(bytearray(pickle.dumps(obj)), dtype=np.uint8)
        sizes = self.all_gather_floats([float(payload.size)], step)[:, 0].astype(np.int64)
        recv = np.empty(int(sizes.sum()), dtype=np.uint8)
        displacements = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        from mpi4py import MPI

        request = self.comm.Iallgatherv(payload, [recv, sizes, displacements, MPI.BYTE])
        self._wait(request, step)
        return [
            pickle.loads(recv[start : start + size].tobytes())
            for start, size in zip(displacements, sizes)
        ]

    def barrier(self, step: str) -> None:
        self._wait(self.comm.Ibarrier(), step)


def is_comm(group: Any) -> bool:
    """Whether ``group`` is an mpi4py communicator or a :class:`Communicator`, rather than a torch process group."""
    return isinstance(group, Communicator) or hasattr(group, "Iallgather")


def make_communicator(
    is_dist: bool, group: Any = None, comm: Any = None, timeout_s: float = DEFAULT_TIMEOUT_S
) -> Communicator:
    """Pick the communicator the caller asked for; a clear error when it is not there.

    ``group``: a torch process group (with ``is_dist``), an mpi4py communicator, or None (the default
    torch group with ``is_dist``, else a world of one); ``comm`` is the older name for an mpi4py one.
    """
    if comm is None and is_comm(group):
        comm, group = group, None
    if comm is not None:
        if isinstance(comm, Communicator):
            return comm
        return MpiComm(comm, timeout_s)
    if not is_dist:
        if group is not None:
            raise ValueError("disttune: group= was given but is_dist=False; pass is_dist=True to agree over it")
        return LocalComm()
    return TorchComm(group, timeout_s)
