"""Per-rank tuning logs: ``<log_dir>/rank-<r>.log``, a readable line then a JSON line per event.

Each rank writes only its own file, in append mode, so several wrappers (or jobs)
never truncate one another; the file is opened without following a symbolic link. Events are buffered during tuning and written in one
append at the end, keeping file I/O out of the timed runs; each record keeps the
time of its own event (a ``measure`` record: when that sample was taken).

JSON lines start with ``{`` and carry ``"event"`` (``measure``, ``config``,
``winner``, ``tuning``, ``diagnostics``, ``verify``), ``rank``, ``host``, ``time`` (ISO 8601, UTC),
``function`` (the wrapped function's qualified name) and ``run`` (the job's run: rank 0's process start and
pid, the same on every rank, :func:`disttune.env.run_id`), so ``disttune report`` can read them back with
``json.loads`` line by line and group them by run. A record about a site also has ``key_text``, the key with
its argument names (``M=48 N=32 K=64 dtype=float16``).
Times in ms are numbers, or ``null`` where there is none: a config that failed
(or was pruned) on a rank, or one this rank did not time (a split site); a
``config`` record's ``failed_ranks`` tells the two apart. A ``config`` record holds every
rank's times (``per_rank_ms``) where this rank received them and logs them (every rank up to
64 ranks, rank 0 beyond), else this rank's own (``rank_ms``); always their ``spread`` over the
ranks (``min_ms``, ``median_ms``, ``max_ms``, ``slowest_rank``).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import socket
import warnings
from pathlib import Path
from typing import Any, Optional, Sequence

from . import env, files

DEFAULT_LOG_DIR = "logs"


class LogWarning(UserWarning):
    """Something in the way of a rank log (a link where the file belongs) was dealt with."""


def resolve_log_dir(log_dir: Optional[str | os.PathLike]) -> Path:
    """Where the rank logs go: ``log_dir`` if given, else ``$DISTTUNE_LOG_DIR``, else ``logs`` (relative)."""
    return Path(log_dir or env.log_dir() or DEFAULT_LOG_DIR)


def _json_ms(value: float) -> Optional[float]:
    """A time for JSON, which has no inf or nan: the number, or ``null`` when there is none."""
    return value if math.isfinite(value) else None


def _utc(seconds: Optional[float] = None) -> str:
    """ISO 8601 UTC with milliseconds, of ``seconds`` since the epoch (default: now)."""
    moment = (datetime.datetime.now(datetime.timezone.utc) if seconds is None
              else datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc))
    return moment.isoformat(timespec="milliseconds")


class RankLog:
    """Buffered writer of one rank's log. ``flush`` appends everything buffered so far."""

    def __init__(self, log_dir: Optional[str | os.PathLike], rank: int, function: str = "") -> None:
        self.path = resolve_log_dir(log_dir) / f"rank-{rank}.log"
        self.rank = rank
        self.function = function
        self.host = socket.gethostname()
        #: the job's run, the same on every rank (a tuning call sets rank 0's after its consensus)
        self.run = env.run_id()
        self.key_texts: dict[tuple[str, str], str] = {}  # (kernel, repr(key)) -> the key with its names
        self._lines: list[Any] = []  # readable lines, and records made into JSON lines when flushed

    def label_key(self, kernel: str, key: tuple, text: str) -> None:
        """How records about ``kernel``'s ``key`` name it for people (``key_text``)."""
        self.key_texts[(kernel, repr(key))] = text

    def _add(self, event: str, line: str, /, at: Optional[float] = None, **fields: Any) -> None:
        """Buffer one event: ``line`` for people, ``fields`` in its JSON record; ``at`` is when it happened
        (seconds since the epoch), default now."""
        stamp = _utc(at)
        self._lines.append(f"{stamp} rank={self.rank} host={self.host} {event}: {line}")
        self._lines.append({"event": event, "rank": self.rank, "host": self.host, "time": stamp,
                            "function": self.function, **fields})

    def _json(self, record: dict) -> str:
        text = self.key_texts.get((record.get("kernel"), record.get("key")))
        extra = {"run": self.run, **({"key_text": text} if text else {})}
        return json.dumps({**record, **extra}, default=str)

    def measure(self, site: str, key: tuple, config_index: int, config: str, iteration: int, ms: float,
                at: Optional[float] = None) -> None:
        """One timed sample; ``at``: when it was taken (seconds since the epoch), default now."""
        self._add(
            "measure",
            f"{site} key={key!r} config[{config_index}]={{{config}}} iteration={iteration} ms={ms:.6f}", at,
            kernel=site, key=repr(key), config_index=config_index, config=config, iteration=iteration,
            ms=_json_ms(ms),
        )

    def config_result(
        self, site: str, key: tuple, occurrence: int, config_index: int, config: str,
        per_rank_ms: Optional[list[float]], agreed_ms: float, failure: Optional[str], measures: Optional[dict] = None,
        own_ms: float = math.nan, spread: Optional[Sequence[float]] = None,
    ) -> None:
        """One config's agreed time and either every rank's (``per_rank_ms``) or, where that is None, this rank's
        own (``own_ms``); ``spread``: its min, median and max ms over the ranks and the slowest rank
        (:data:`disttune.agreement.SPREAD`). ``measures`` (a measured objective): ``{"agreed": {name: value},
        "per_rank": {name: [value per rank]} or None, "own": {name: value}, "score": float, "front": bool}``, None
        where not read. Costs O(len(per_rank_ms)) to format, O(1) without it."""
        extra: dict[str, Any] = {}
        text = ""
        if measures is not None:
            extra = {"measures": measures["agreed"], "score": _json_ms(measures["score"]),
                     "on_front": bool(measures["front"])}
            if measures.get("per_rank") is not None:
                extra["per_rank_measures"] = measures["per_rank"]
            else:
                extra["rank_measures"] = measures.get("own", {})
            text = " " + " ".join(f"{name}={value}" for name, value in measures["agreed"].items()) + \
                f" score={measures['score']:.4f}" + (" on the Pareto front" if measures["front"] else "")
        if spread is not None:
            low, middle, high, slowest = spread
            extra["spread"] = {"min_ms": _json_ms(low), "median_ms": _json_ms(middle), "max_ms": _json_ms(high),
                               "slowest_rank": None if math.isnan(slowest) else int(slowest)}
        if per_rank_ms is not None:
            shown = "per-rank ms [" + ", ".join(f"r{r}={t:.4f}" for r, t in enumerate(per_rank_ms)) + "]"
            times: dict[str, Any] = {"per_rank_ms": [_json_ms(t) for t in per_rank_ms],
                                     "failed_ranks": [r for r, t in enumerate(per_rank_ms) if math.isinf(t)]}
        else:  # this rank's own time; of the others' only the spread, and the slowest rank if it failed
            shown = f"this rank's ms={own_ms:.4f}"
            if spread is not None:
                shown += (f" ranks' min/median/max ms={spread[0]:.4f}/{spread[1]:.4f}/{spread[2]:.4f}"
                          + ("" if math.isnan(spread[3]) else f" slowest rank={int(spread[3])}"))
            failed = {self.rank} if math.isinf(own_ms) else set()
            if spread is not None and math.isinf(spread[2]) and not math.isnan(spread[3]):
                failed.add(int(spread[3]))
            times = {"rank_ms": _json_ms(own_ms), "failed_ranks": sorted(failed)}
        self._add(
            "config",
            f"{site} key={key!r} occurrence={occurrence} config[{config_index}]={{{config}}} {shown} "
            f"agreed={agreed_ms:.4f}" + text + (f" failed here: {failure}" if failure else ""),
            kernel=site, key=repr(key), occurrence=occurrence, config_index=config_index, config=config,
            **times, agreed_ms=_json_ms(agreed_ms), failure=failure, **extra,
        )

    def winner(
        self, site: str, key: tuple, occurrence: int, config_index: int, config: str, agreed_ms: float,
        source: str,
    ) -> None:
        self._add(
            "winner",
            f"{site} key={key!r} occurrence={occurrence} -> config[{config_index}]={{{config}}} "
            f"agreed={agreed_ms:.4f} ms ({source})",
            kernel=site, key=repr(key), occurrence=occurrence, config_index=config_index, config=config,
            agreed_ms=_json_ms(agreed_ms), source=source,
        )

    def tuning(self, function: str, wall_s: float, function_runs: int, sites: int, world_size: int,
               reduce: str, statistic: str) -> None:
        self._add(
            "tuning",
            f"{function}: {sites} site(s) tuned over {world_size} rank(s) in {wall_s:.3f} s, "
            f"{function_runs} function runs, reduce={reduce}, statistic={statistic}",
            function=function, wall_s=wall_s, function_runs=function_runs, sites=sites,
            world_size=world_size, reduce=reduce, statistic=statistic,
        )

    def diagnostics(self, site: str, key: tuple, occurrence: int, scope: str, **facts: Any) -> None:
        """What explains a config's time (``scope="config"``) or a site's verdict (``"site"``); see
        :mod:`disttune.diagnostics` for the fields."""
        shown = " ".join(f"{name}={value}" for name, value in facts.items() if name != "config")
        self._add("diagnostics", f"{site} key={key!r} occurrence={occurrence} {scope}: {shown}", kernel=site,
                  key=repr(key),
                  occurrence=occurrence, scope=scope, **facts)

    def verify(self, site: str, key: tuple, occurrence: int, config_index: int, config: str,
               recorded_ms: Optional[float], fresh_ms: float, threshold: float, regressed: bool, source: str,
               **judgement: Any) -> None:
        """A stored or pinned winner timed again (``disttune verify``): both agreed times and the verdict;
        ``judgement``: ``allowed`` (the slowdown allowed), ``judged`` (False on a CPU), ``noise`` (then, now)."""
        recorded = "none" if recorded_ms is None else f"{recorded_ms:.4f}"
        self._add(
            "verify",
            f"{site} key={key!r} occurrence={occurrence} config[{config_index}]={{{config}}} recorded={recorded} ms "
            f"fresh={fresh_ms:.4f} ms threshold={threshold} ({source})" + (" REGRESSED" if regressed else ""),
            kernel=site, key=repr(key), occurrence=occurrence, config_index=config_index, config=config,
            recorded_ms=recorded_ms, fresh_ms=_json_ms(fresh_ms), threshold=threshold, regressed=regressed,
            source=source, **judgement,
        )

    def fallback(self, site: str, key: tuple, occurrence: int, config: str, source: str) -> None:
        """A site met after tuning, served by a fallback (``on_new_key``) without tuning."""
        self._add("fallback", f"{site} key={key!r} occurrence={occurrence} -> {{{config}}} served by the {source}",
                  kernel=site, key=repr(key), occurrence=occurrence, config=config, source=source)

    def failure(self, text: str) -> None:
        """A tuning call that ended in an error (``text``: the error as it was raised), so the report of the run
        names it instead of an earlier run's winners."""
        self._add("error", f"{self.function}: the tuning call failed: {text}", text=text)

    def note(self, topic: str, text: str) -> None:
        """A line of prose about the tuner's own decisions (``topic``: what it is about)."""
        self._add("note", f"{topic}: {text}", topic=topic, text=text)

    def flush(self) -> None:
        """Append what is buffered, never through a link: a ``rank-<r>.log`` that is a symbolic link is
        replaced by a file of its own, a FIFO or device there is not opened (each with a LogWarning)."""
        if not self._lines:
            return
        folder = files.open_dir(self.path.parent, create=True)
        try:
            text = "\n".join(line if isinstance(line, str) else self._json(line) for line in self._lines) + "\n"
            if files.append_no_follow(folder, self.path.name, text.encode("utf-8")):
                warnings.warn(f"disttune: rank log {self.path} was a symbolic link; replaced by a file (its target "
                              "is left as it was)", LogWarning, stacklevel=2)
        except files.NotRegularFile as err:
            warnings.warn(f"disttune: rank log {self.path} {err.strerror}: not opened, {len(self._lines) // 2} "
                          "event(s) of this call are not logged", LogWarning, stacklevel=2)
        finally:
            os.close(folder)
        self._lines.clear()


def read_records(path: str | os.PathLike) -> list[dict]:
    """The JSON records of one rank log, skipping readable lines and lines that do not parse.

    Bytes that are not UTF-8 are replaced, so a damaged file still yields its good records. A path
    that is not a regular file (a FIFO, say) raises :class:`files.NotRegularFile` instead of blocking.
    """
    records = []
    for line in read_lines(path):
        if line.startswith("{"):
            try:
                records.append(json.loads(line))
            except (ValueError, RecursionError):  # not JSON, or nested too deeply to parse
                continue
    return records


def read_lines(path: str | os.PathLike) -> list[str]:
    """A rank log's lines (split as text-mode ``open`` splits them, undecodable bytes replaced).

    Never blocks on a FIFO: anything but a regular file raises :class:`files.NotRegularFile`.
    Links are followed. Reads the whole file at once.
    """
    text = files.read_regular(path, follow=True).decode("utf-8", errors="replace")
    return text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
