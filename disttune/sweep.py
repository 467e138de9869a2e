"""Sweeps: tune a wrapper over a list of cases before deployment, print what won, write a pinned table.

``step.sweep(cases)`` (a :func:`~disttune.contextual_autotune` wrapper) and ``fn.sweep(cases)`` (a
:func:`~disttune.autotune` function) walk ``cases``, an iterable of ``(args, kwargs)`` pairs that
every rank walks in the same order (each case is a tuning call, whose consensus checks that the
ranks agree). Each key the wrapper does not know yet is tuned, through the winner store as any
tuning call (a stored winner is used, a tuned one stored). Rank 0 prints one row per site and
case (key, winner, agreed time, the untuned first config's agreed time and the ratio) under a tqdm
progress bar on stderr.

The tables, one rule: global rank 0 writes every winner the sweep saw as a pinned winners table (the
format of ``disttune export``) to ``table=``; under ``disttune sweep --table FILE`` (which sets
``$DISTTUNE_SWEEP_TABLE``) it also writes FILE, which collects the winners of every sweep of the job.
So a script that passes ``table=`` and reads it back works the same under the command, and the command's
table is written by any sweep. Then all ranks pass a barrier, so the files are there for every rank when
the sweep returns. Deploy a table with ``pinned=`` and ``on_new_key="nearest"``.

Cost: one tuning call per case (``2 + C * (n_warmup + n_repeat)`` runs of the function when
something is new, 2 when the store answers for every site, 1 when the kernels' own caches do; for a
function tuner ``C * (n_warmup + n_repeat)`` calls of the function when its key is new, none when
it is known).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Union

from . import console, env
from . import store as stores
from .comm import global_rank
from .configs import describe_config, kwargs_text

Case = tuple  # (args tuple, kwargs dict)
PathLike = Union[str, "os.PathLike[str]"]


@dataclass(frozen=True)
class SweepRow:
    """One site of one case: what won and what it beat. Times are agreed ms (None: not timed here)."""

    case: int
    site: str
    key: str
    winner: str
    agreed_ms: Optional[float]
    first_ms: Optional[float]
    source: str  # "tuned", "store", "pinned", "cached" (known before this case)

    @property
    def speedup(self) -> Optional[float]:
        """How many times faster the winner ran than the first config (None when either was not timed)."""
        if self.agreed_ms is None or self.first_ms is None or not self.agreed_ms or math.isinf(self.agreed_ms):
            return None
        return self.first_ms / self.agreed_ms


def _pairs(cases: Iterable[Any]) -> Iterable[tuple[tuple, dict]]:
    for number, case in enumerate(cases):
        if not (isinstance(case, (tuple, list)) and len(case) == 2 and isinstance(case[1], dict)):
            raise TypeError(f"disttune: sweep case {number} must be an (args, kwargs) pair, got {case!r}")
        yield tuple(case[0]), dict(case[1])


def _stored_times(winners_store: stores.WinnerStore, entry: stores.EntryId) -> tuple:
    record = winners_store.load(entry)
    times = record.get("agreed_ms") if record is not None else None
    if not isinstance(times, list) or len(times) != len(entry.configs):
        return ()
    return tuple(float("inf") if t is None else float(t) for t in times)


def _timed(agreed: tuple, index: int) -> Optional[float]:
    return float(agreed[index]) if agreed and 0 <= index < len(agreed) else None


_DTYPES = re.compile(r", '(?:torch\.)?[a-z]+[0-9]*'(?=[,)])")  # the dtype texts Triton appends to a key


def format_table(rows: list[SweepRow]) -> str:
    """The sweep's table as text: one row per site and case (keys without the dtype texts Triton appends)."""
    def ms(value: Optional[float]) -> str:
        return "-" if value is None else "inf" if math.isinf(value) else f"{value:.4f}"

    header = ("case", "site", "key", "winner", "agreed ms", "first config ms", "ratio", "source")
    body = [(str(r.case), r.site, _DTYPES.sub("", r.key), r.winner, ms(r.agreed_ms), ms(r.first_ms),
             "-" if r.speedup is None else f"{r.speedup:.2f}x", r.source) for r in rows]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip()
                     for line in [header, *body])


#: The winners of every sweep of this process so far, for the command's table (``$DISTTUNE_SWEEP_TABLE``).
_JOB_RECORDS: dict[str, dict] = {}


def tables_to_write(table: Optional[PathLike], records: dict) -> list[tuple[str, list[dict]]]:
    """``(path, records)`` of each table a sweep writes (see the module doc): ``table=`` with this sweep's winners,
    and the command's table with the job's; one file when both name it."""
    targets: list[tuple[str, list[dict]]] = []
    command = env.sweep_table()
    if command is not None:
        _JOB_RECORDS.update(records)
        targets.append((command, list(_JOB_RECORDS.values())))
    if table is not None and (command is None or os.path.abspath(table) != os.path.abspath(command)):
        targets.insert(0, (os.fspath(table), list(records.values())))
    return targets


def _finish(rows: list[SweepRow], records: dict, comm: Any, name: str, table: Optional[PathLike],
            verbose: bool) -> list[SweepRow]:
    targets = tables_to_write(table, records)
    if targets:
        if global_rank(comm) == 0:
            for path, entries in targets:
                stores.write_table(path, entries)
        comm.barrier("sweep: pinned table written")
    if verbose and comm.rank == 0:
        where = "; pinned table: " + ", ".join(path for path, _ in targets) if targets else ""
        print(f"disttune: sweep of {name} over {comm.world_size} rank(s), {len(rows)} site(s){where}\n"
              + format_table(rows), file=sys.stdout, flush=True)
    return rows


def sweep_contextual(tuner: Any, cases: Iterable[Any], table: Optional[PathLike] = None,
                     verbose: bool = True) -> list[SweepRow]:
    """:meth:`ContextualAutotuner.sweep <disttune.contextual.ContextualAutotuner.sweep>`: see the module doc."""
    total = len(cases) if hasattr(cases, "__len__") else None  # type: ignore[arg-type]
    options, name = tuner.options, tuner.__qualname__
    comm = tuner.communicator()
    bar = console.progress_bar(verbose and comm.rank == 0, total, f"disttune sweep {name}", unit="case")
    rows: list[SweepRow] = []
    records: dict[str, dict] = {}
    fingerprint = stores.environment_fingerprint(comm.world_size, env.local_world_size())
    winners_store = stores.open_store(options.store, options.cache_dir, comm, options.store_check, options.timeout_s)
    try:
        for number, (args, kwargs) in enumerate(_pairs(cases)):
            tuner.tuning_call(args, kwargs, verbose=False)  # the sweep prints one table instead
            for result in tuner.report.results:
                site = tuner.known_sites[result.site]
                index = result.winner  # -1: a kernel's cached winner outside its candidate list
                config = site.preset if result.source == "cached" else result.config
                if result.source == "store" and winners_store is not None:  # the times it was stored with
                    result = dataclasses.replace(result, agreed_ms=_stored_times(winners_store, tuner.entry(site)))
                rows.append(SweepRow(number, result.site.kernel.rsplit(".", 1)[-1]
                                     + (f" #{result.site.occurrence}" if result.site.occurrence else ""),
                                     repr(result.site.key), describe_config(config),
                                     _timed(result.agreed_ms, result.winner), _timed(result.agreed_ms, 0),
                                     result.source))
                if index >= 0:
                    entry = tuner.entry(site)
                    records[entry.digest()] = stores.make_record(entry, index, list(result.agreed_ms), fingerprint,
                                                                 {"function": name, "source": result.source,
                                                                  "key_text": result.site.key_text()})
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return _finish(rows, records, comm, name, table, verbose)


def sweep_function(tuner: Any, cases: Iterable[Any], table: Optional[PathLike] = None, verbose: bool = True,
                   group: Any = None) -> list[SweepRow]:
    """:meth:`FunctionAutotuner.sweep <disttune.function.FunctionAutotuner.sweep>`: see the module doc."""

    total = len(cases) if hasattr(cases, "__len__") else None  # type: ignore[arg-type]
    name = f"{tuner.fn.__module__}.{tuner.__qualname__}"
    comm = tuner.communicator(group)
    bar = console.progress_bar(verbose and comm.rank == 0, total, f"disttune sweep {tuner.__qualname__}", unit="case")
    rows: list[SweepRow] = []
    records: dict[str, dict] = {}
    fingerprint = stores.environment_fingerprint(comm.world_size, env.local_world_size())
    try:
        for number, (args, kwargs) in enumerate(_pairs(cases)):
            key, configs = tuner.key(args, kwargs), tuner.pruned(args, kwargs)
            agreed: tuple = ()
            if key in tuner.cache:
                source = "cached"
            else:
                (result,) = tuner.tune_key(key, configs, args, kwargs, comm).results
                source, agreed = result.source, tuple(result.agreed_ms)
            winner = tuner.cache[key]
            index = configs.index(winner) if winner in configs else -1
            rows.append(SweepRow(number, tuner.__qualname__, repr(key), kwargs_text(winner), _timed(agreed, index),
                                 _timed(agreed, 0), source))
            if index >= 0:
                entry = tuner.entry(key, configs)
                records[entry.digest()] = stores.make_record(entry, index, list(agreed), fingerprint,
                                                             {"function": tuner.__qualname__, "source": source})
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return _finish(rows, records, comm, name, table, verbose)


__all__ = ["SweepRow", "format_table", "sweep_contextual", "sweep_function"]
