"""The multi-rank case harness: a case registry, the per-rank runner and its one record format.

A case file registers functions that run on every rank and return a dict of their own fields::

    from rank_cases import Cases

    cases = Cases(__doc__)

    @cases.case
    def agree(ranks):
        ...
        return {"winner": 2}

    if __name__ == "__main__":
        sys.exit(cases.main())

and is launched on N ranks (torchrun, or mpiexec with ``--mpi``)::

    python tests/X_cases.py [CASE ...] [--out DIR] [--mpi] [the file's own options]

Each rank initialises torch.distributed (``disttune.dist.init``) or takes MPI's
COMM_WORLD, runs the named cases (default: the file's default cases) in order, with a
barrier after each, and writes one JSON record per case to ``DIR/<case>.rank<r>.json``::

    {"case": "agree", "rank": 0, "world": 2, "ok": true, "elapsed_s": 0.8, "winner": 2}
    {"case": "agree", "rank": 1, "world": 2, "ok": false, "elapsed_s": 0.1,
     "error_type": "TuningError", "error_message": "...", "traceback": "..."}

The case's fields sit beside the harness's (a case may not return a harness key). A
raising case is a record, not a crash, so tests can assert on expected errors. Every rank
prints one summary line (``rank 0 of 2: 3 of 3 cases passed``, then each failure). Exit
status: with ``--out`` 0 once every record is written (the records are the verdict);
without it (by hand) 1 when a case failed on this rank.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

if not torch.cuda.is_available():  # before anything imports triton: kernels run in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

#: Keys the harness writes into every record; a case's own fields must use other names.
RECORD_KEYS = ("case", "rank", "world", "ok", "elapsed_s", "error_type", "error_message", "traceback")


class Ranks:
    """This rank's view of the job, handed to every case: who it is, the device, the parsed options.

    ``mpi`` is MPI's COMM_WORLD under ``--mpi``, else ``None`` (torch.distributed is initialised).
    ``work_dir`` is for what cases leave behind (tuner logs, winner stores): ``--out``, else a
    fresh temporary directory of this rank's.
    """

    def __init__(self, options: argparse.Namespace) -> None:
        self.options = options
        self.out_dir: Path | None = Path(options.out) if options.out else None
        self.work_dir = self.out_dir or Path(tempfile.mkdtemp(prefix="disttune-cases-"))
        self.mpi: Any = None
        if options.mpi:
            from mpi4py import MPI

            self.mpi = MPI.COMM_WORLD
            self.rank, self.world = self.mpi.Get_rank(), self.mpi.Get_size()
            self.device = torch.device("cpu")
            if torch.cuda.is_available():
                torch.cuda.set_device(self.rank % torch.cuda.device_count())
                self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            from disttune import dist as dt_dist

            info = dt_dist.init()
            self.rank, self.world, self.device = info.rank, info.world_size, info.device

    @property
    def use_mpi(self) -> bool:
        return self.mpi is not None

    def all_gather_object(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order (one collective)."""
        if self.use_mpi:
            return list(self.mpi.allgather(value))
        gathered: list[Any] = [None] * self.world
        torch.distributed.all_gather_object(gathered, value)
        return gathered

    def barrier(self) -> None:
        if self.use_mpi:
            self.mpi.Barrier()
        else:
            torch.distributed.barrier()

    def close(self) -> None:
        """Leave the group (torch.distributed only; mpi4py finalises at exit)."""
        if not self.use_mpi:
            from disttune import dist as dt_dist

            self.barrier()
            dt_dist.destroy()


Case = Callable[[Ranks], "dict[str, Any] | None"]


@dataclass(frozen=True)
class _Entry:
    run: Case
    default: bool
    breaks_group: bool


class CaseFailed(AssertionError):
    """Raised by a case whose own checks failed; its message lists every failed check."""


class Cases:
    """A case file's registry and its command line (see the module docstring)."""

    def __init__(self, description: str | None = None) -> None:
        self.description = description
        self.entries: dict[str, _Entry] = {}

    def case(self, run: Case | None = None, *, name: str | None = None, default: bool = True,
             breaks_group: bool = False) -> Any:
        """Register ``run`` under ``name`` (default: its name without a ``case_`` prefix).

        ``default=False`` leaves it out when no case is named. ``breaks_group=True`` says the case
        leaves the collectives unusable (a rank killed, a collective timed out): no barrier after
        it, and the process exits without tearing the group down.
        """

        def register(fn: Case) -> Case:
            key = name or fn.__name__.removeprefix("case_")
            if key in self.entries:
                raise ValueError(f"case {key!r} is registered twice")
            self.entries[key] = _Entry(fn, default, breaks_group)
            return fn

        return register(run) if run is not None else register

    def main(self, argv: list[str] | None = None,
             add_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
             default_cases: Callable[[argparse.Namespace], Iterable[str]] | None = None) -> int:
        """Parse the command line, run the cases on this rank, write the records, print the summary.

        ``add_arguments`` adds the file's own options; ``default_cases`` picks the cases to run
        when none is named (default: those registered with ``default=True``). Beyond the cases
        themselves this costs the group's setup, one barrier per case and one small file per record.
        """
        parser = argparse.ArgumentParser(description=self.description,
                                         formatter_class=argparse.RawDescriptionHelpFormatter)
        parser.add_argument("cases", nargs="*", metavar="CASE", help=f"cases to run: {', '.join(self.entries)}")
        parser.add_argument("--out", help="directory for the records (<case>.rank<r>.json)")
        parser.add_argument("--mpi", action="store_true", help="run under mpiexec (mpi4py's COMM_WORLD)")
        if add_arguments:
            add_arguments(parser)
        options = parser.parse_args(argv)
        names = options.cases or list(default_cases(options) if default_cases else
                                      (n for n, e in self.entries.items() if e.default))
        unknown = [n for n in names if n not in self.entries]
        if unknown:
            parser.error(f"unknown case(s) {unknown}; known: {list(self.entries)}")
        # a launcher's timeout shows where each rank was, then SIGTERM ends the rank as usual
        faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
        ranks = Ranks(options)
        records, broken = [], False
        for name in names:
            entry = self.entries[name]
            record = run_case(ranks, name, entry.run)
            if ranks.out_dir is not None:
                write_record(ranks.out_dir, record)
            records.append(record)
            broken = broken or entry.breaks_group
            if not broken:
                ranks.barrier()
        say(summary(ranks, records))
        status = 0 if ranks.out_dir is not None or all(r["ok"] for r in records) else 1
        if broken:
            os._exit(status)  # the group cannot be torn down after a dead rank or a timed-out collective
        ranks.close()
        return status


def run_case(ranks: Ranks, name: str, run: Case) -> dict[str, Any]:
    """Run one case and return its record; an exception becomes ``ok: false`` with type, message, traceback."""
    record: dict[str, Any] = {"case": name, "rank": ranks.rank, "world": ranks.world}
    started = time.monotonic()
    try:
        fields = run(ranks) or {}
        clash = sorted(set(fields) & set(RECORD_KEYS))
        if clash:
            raise ValueError(f"case {name!r} returned harness key(s) {clash}")
        record.update(ok=True, elapsed_s=time.monotonic() - started, **fields)
    except Exception as err:  # noqa: BLE001 - recorded for the test to assert on
        record.update(ok=False, elapsed_s=time.monotonic() - started, error_type=type(err).__name__,
                      error_message=str(err), traceback=traceback.format_exc())
    return record


def record_path(out_dir: str | os.PathLike[str], case: str, rank: int) -> Path:
    return Path(out_dir) / f"{case}.rank{rank}.json"


def write_record(out_dir: Path, record: dict[str, Any]) -> None:
    """Write the record whole: to a temporary name, then renamed, so a reader never sees half of one."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = record_path(out_dir, record["case"], record["rank"])
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(record))
    partial.replace(path)


def summary(ranks: Ranks, records: list[dict[str, Any]]) -> str:
    """``rank R of W: P of N cases passed``, then one line per failed case (its error's first line).

    Cases that count their checks in an int field ``checks`` get the total added: ``(46 checks)``.
    """
    passed = sum(r["ok"] for r in records)
    checks = sum(r["checks"] for r in records if isinstance(r.get("checks"), int))
    counted = f" ({checks} checks)" if checks else ""
    lines = [f"rank {ranks.rank} of {ranks.world}: {passed} of {len(records)} cases passed{counted}"]
    for r in records:
        if not r["ok"]:
            first_line = (r["error_message"].splitlines() or [""])[0]
            lines.append(f"rank {ranks.rank}: FAILED {r['case']}: {r['error_type']}: {first_line}")
    return "\n".join(lines)


def say(text: str) -> None:
    """One write per call, so the lines of ranks sharing a pipe do not run into each other."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()
