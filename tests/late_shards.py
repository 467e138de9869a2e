"""The shard GEMM reading row shards that arrive while it runs, in a world of one: ``check=`` against a racy config.

A stand-in for the fused AllGather-GEMM's peers. Each call, the ``[SHARDS * rows, K]`` workspace is
poisoned with NaN (the rank's own shard, 0, stays so: the GEMM reads it from where the rank holds it), and the
other shards are delivered late by an *arrivals* object, each copy followed by its int32 ready flag set to the call's
epoch (the protocol of :func:`~disttune.kernels.shard_gemm.shard_gemm`: a tile spins until its
shard's flag holds the epoch). A config that waits computes ``A @ B``; its
:func:`~disttune.kernels.shard_gemm.racy_config` (``SKIP_WAIT``) reads NaN rows every call.

* :class:`HostThreadArrivals` (CPU, Triton's interpreter): a host thread sleeps, then copies and flags.
* :class:`SideStreamArrivals` (one GPU): a side CUDA stream sleeps on the GPU (``torch.cuda._sleep``,
  one thread on one SM), copies each shard from pinned host memory (``cudaMemcpyAsync``) and then
  sets its flag. The GEMM is kept to a few tiles, so its spinning programs leave SMs free for the
  side stream's sleep and flag writes; the delivery is enqueued before the GEMM, so a waiting config
  needs nothing the host does after its launch.

The timer is injected (the racy config 1 ms, the waiting one 2 ms), so without ``check`` the racy
config wins and with ``check=True`` only the check can be what scores it out.
"""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path
from typing import Protocol, Sequence

import torch
import triton

import disttune
from disttune.kernels.shard_gemm import make_shard_gemm_kernel, racy_config, shard_gemm
from numerics import rel_error
from tiny_kernels import TableTimer

SHARDS = 4
#: (destination rows in the workspace, source rows, ready flag) of each late shard.
Piece = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class Arrivals(Protocol):
    def start(self, pieces: Sequence[Piece], epoch: int) -> None:
        """Begin delivering ``pieces`` (each copy, then its flag set to ``epoch``) later than the GEMM starts."""

    def pending(self) -> bool:
        """Whether the delivery is still to come (asked without waiting)."""

    def join(self) -> None:
        """Wait until every piece has arrived (on the GPU: the current stream waits)."""


class HostThreadArrivals:
    """Pieces delivered by a host thread ``delay_s`` after :meth:`start`."""

    def __init__(self, delay_s: float = 0.5) -> None:
        self.delay_s = delay_s
        self._thread = threading.Thread()

    def start(self, pieces: Sequence[Piece], epoch: int) -> None:
        def deliver() -> None:
            time.sleep(self.delay_s)
            for dest, source, flag in pieces:
                dest.copy_(source)
                flag.fill_(epoch)

        self._thread = threading.Thread(target=deliver)
        self._thread.start()

    def pending(self) -> bool:
        return self._thread.is_alive()

    def join(self) -> None:
        self._thread.join()


class SideStreamArrivals:
    """Pieces delivered by a side CUDA stream: after the current stream's work so far, a GPU sleep of
    ``delay_cycles`` clock cycles (50M: about 25 ms on an H100, against microseconds for the GEMM and the host's
    launch of it), then each piece's copy and flag write."""

    def __init__(self, delay_cycles: int = 50_000_000) -> None:
        self.delay_cycles = delay_cycles
        self.side = torch.cuda.Stream()

    def start(self, pieces: Sequence[Piece], epoch: int) -> None:
        self.side.wait_stream(torch.cuda.current_stream())  # after the poison and the own shard
        with torch.cuda.stream(self.side):
            torch.cuda._sleep(self.delay_cycles)
            for dest, source, flag in pieces:
                dest.copy_(source, non_blocking=True)
                flag.fill_(epoch)

    def pending(self) -> bool:
        return not self.side.query()

    def join(self) -> None:
        torch.cuda.current_stream().wait_stream(self.side)


def check_scores_out_racy_config(arrivals: Arrivals, waiting: triton.Config, check: bool, work_dir: Path, *,
                                 rows: int, K: int, N: int, dtype: torch.dtype, device: str) -> dict:
    """Tune the shard GEMM over ``[waiting, racy_config(waiting)]`` with late shards; call it once more.

    Returns the winner, the agreed times and whether a call after tuning computes ``A @ B``.
    Cost: 9 runs of the step (the tuning call's 8: discovery, 1 warm-up and 2 timed runs per config, the
    final run; then one call), each lasting at least the arrivals' delay.
    """
    g = torch.Generator().manual_seed(7)
    a = torch.randn(SHARDS * rows, K, generator=g).to(dtype)
    b = torch.randn(K, N, generator=g).to(dtype)
    source = a.pin_memory() if device == "cuda" else a
    workspace = torch.empty(a.shape, dtype=dtype, device=device)
    own = a[:rows].to(device)
    flags = torch.zeros(SHARDS, dtype=torch.int32, device=device)
    out = torch.empty(SHARDS * rows, N, dtype=dtype, device=device)
    b_dev = b.to(device)
    pieces = [(workspace[s * rows:(s + 1) * rows], source[s * rows:(s + 1) * rows], flags[s]) for s in range(1, SHARDS)]
    kernel = make_shard_gemm_kernel([waiting, racy_config(waiting)])
    epochs = itertools.count(1)

    @disttune.contextual_autotune(n_warmup=1, n_repeat=2, timer=TableTimer(lambda info: (2.0, 1.0)[info.config_index]),
                                  check=check, log_dir=work_dir / "logs", store=False, verbose=False)
    def step() -> torch.Tensor:
        epoch = next(epochs)
        workspace.fill_(float("nan"))
        arrivals.start(pieces, epoch)
        shard_gemm(workspace, b_dev, out, [rows] * SHARDS, 0, flags=flags, kernel=kernel, epoch=epoch, own=own)
        arrivals.join()
        return out.clone()

    step()  # tunes
    after = step()
    (result,) = step.report.results
    error = rel_error(after.float().cpu(), a.float() @ b.float())
    return {"winner": result.winner, "agreed_ms": list(result.agreed_ms), "right": error < 1e-2}


def own_rows_gemm_with_late_partials(arrivals: Arrivals, config: triton.Config, *, rows: int, K: int, N: int,
                                     dtype: torch.dtype, device: str) -> dict:
    """GEMM-RS's own rows' GEMM, ``a @ b`` plus every slot of the peers' partials but the skipped one, with the
    partials landing late, piece by piece (two pieces of 256 rows at most).

    The partials sit in a ``[3, slot_rows, N]`` buffer cut to the own rows (``slot_rows > rows``), as the
    receive slots of :class:`~disttune.kernels.gemm_rs.GemmReduceScatter` are; every row is NaN until its piece
    lands, the rows past ``rows`` and the skipped slot stay NaN (the skipped slot's flags are set, so a kernel
    that reads it gets NaN instead of waiting forever): a tile that read a piece before its flag, a row of the
    wrong slot or the skipped slot would carry NaN into the output. A first call with every piece in place
    compiles the kernel, so the late call launches at once. Returns whether the output is right, whether it
    holds NaN, and whether the delivery was still to come when the GEMM was launched (on a GPU: after its
    launch returned; under the interpreter, whose launch runs the kernel, before it). Cost: two GEMM calls, the
    second at least the arrivals' delay.
    """
    g = torch.Generator().manual_seed(11)
    slots, skip, chunks, step, slot_rows = 3, 1, 2, 256, rows + 40
    a = torch.randn(rows, K, generator=g).to(dtype).to(device)
    b = torch.randn(K, N, generator=g).to(dtype).to(device)
    partials = torch.randn(slots, rows, N, generator=g).to(dtype)
    source = partials.pin_memory() if device == "cuda" else partials
    received = torch.full((slots, slot_rows, N), float("nan"), dtype=dtype, device=device)
    flags = torch.zeros(slots * chunks, dtype=torch.int32, device=device)
    out = torch.empty(rows, N, dtype=dtype, device=device)
    kernel = make_shard_gemm_kernel([config])
    pieces = [(received[s, c * step: min(rows, (c + 1) * step)], source[s, c * step: min(rows, (c + 1) * step)],
               flags[s * chunks + c]) for s in range(slots) if s != skip for c in range(-(-rows // step))]

    def call(epoch: int) -> None:
        shard_gemm(a, b, out, (rows,), 0, kernel=kernel, chunks=chunks, chunk_rows=step, epoch=epoch,
                   addend=received[:, :rows], addend_flags=flags, addend_skip=skip)

    flags.fill_(1)
    call(1)  # compiles; reads NaN, as nothing has landed
    epoch = 2
    flags[skip * chunks: (skip + 1) * chunks] = epoch
    arrivals.start(pieces, epoch)
    pending_before = arrivals.pending()
    call(epoch)
    late = arrivals.pending() if device == "cuda" else pending_before
    arrivals.join()
    want = a.float().cpu() @ b.float().cpu() + partials[0].float() + partials[2].float()
    got = out.float().cpu()
    return {"right": rel_error(got, want) < 1e-2, "nan": bool(got.isnan().any()), "late": late}
