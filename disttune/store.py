"""Persistent winners: one JSON file per tuning site, written once, atomically, under a file lock.

Where: ``cache_dir=`` argument, else ``$DISTTUNE_CACHE_DIR``, else the per-user cache
directory (``platformdirs.user_cache_dir("disttune")``, ``~/.cache/disttune`` on Linux).

An entry is named by two hashes: the *identity* of the site (kernel source as
Triton keys it, tuning key, occurrence, candidate configs) and the *environment*
(GPU name and count, compute capability, world size and ranks per node, torch,
triton and CUDA versions, the environment variables Triton treats as
cache-invalidating). A different environment is a different file, so a miss; with
``check="warn"`` an entry of the same identity from another environment is used,
with a warning naming what differs.

This module only reads and writes; who reads, who writes and what is trusted is
decided by the tuners (every rank reads, the agreed decision is rank 0's entry).
Files are readable JSON with ``"schema": SCHEMA``. A corrupt, truncated or
foreign file is reported and ignored, never trusted and never fatal.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import os
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import filelock

from . import env

SCHEMA = 1
CHECKS = ("strict", "warn")


class StoreWarning(UserWarning):
    """A store file could not be used or written; tuning goes on without it."""


def default_cache_dir() -> Path:
    try:
        import platformdirs

        return Path(platformdirs.user_cache_dir("disttune"))
    except ImportError:  # platformdirs is optional: the XDG rule it applies on Linux
        return Path(env.xdg_cache_home() or Path.home() / ".cache") / "disttune"


def resolve_cache_dir(cache_dir: Optional[str | os.PathLike]) -> Path:
    return Path(cache_dir or env.cache_dir() or default_cache_dir())


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def kernel_source_key(autotuner: Any) -> str:
    """Triton's own cache key of the kernel's JITFunction (source and dependencies).

    Under ``TRITON_INTERPRET=1`` there is no JITFunction: the hash of the Python source stands in.
    """
    from triton.runtime.jit import JITFunction

    fn = autotuner.fn
    while not isinstance(fn, JITFunction) and hasattr(fn, "fn") and not inspect.isfunction(fn):
        fn = fn.fn
    if isinstance(fn, JITFunction):
        return fn.cache_key
    return _sha(inspect.getsource(autotuner.base_fn))


def function_source_key(fn: Any) -> str:
    try:
        return _sha(inspect.getsource(fn))
    except (OSError, TypeError):
        return _sha(f"{fn.__module__}.{fn.__qualname__}")


def environment_fingerprint(world_size: int, local_world_size: int) -> dict:
    """Everything outside the kernel that makes a stored winner invalid when it changes."""
    import torch
    import triton

    fingerprint: dict[str, Any] = {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "world_size": world_size,
        "ranks_per_node": local_world_size,
        "interpreter": env.interpreting(),
    }
    if torch.cuda.is_available():
        fingerprint["gpu"] = torch.cuda.get_device_name()
        fingerprint["gpu_count"] = torch.cuda.device_count()
        fingerprint["capability"] = list(torch.cuda.get_device_capability())
    else:
        fingerprint.update(gpu=None, gpu_count=0, capability=None)
    try:
        from triton._C.libtriton import get_cache_invalidating_env_vars

        fingerprint["triton_env"] = dict(sorted(get_cache_invalidating_env_vars().items()))
    except ImportError:
        fingerprint["triton_env"] = {}
    return fingerprint


@dataclass(frozen=True)
class EntryId:
    """The identity of one stored site: same identity + same environment = valid entry."""

    kind: str  # "kernel" (contextual sites) or "function" (disttune.autotune)
    name: str
    source_key: str
    key: str
    occurrence: int
    configs: tuple

    def digest(self) -> str:
        return _sha(json.dumps([self.kind, self.name, self.source_key, self.key, self.occurrence,
                                list(self.configs)]))[:32]

    def folder(self) -> str:
        return "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in self.name)[:120]


class WinnerStore:
    """Reads and writes winners under ``root``; every method is safe to call on any rank."""

    def __init__(self, cache_dir: Optional[str | os.PathLike], fingerprint: dict, check: str = "strict",
                 lock_timeout_s: float = 60.0) -> None:
        if check not in CHECKS:
            raise ValueError(f"disttune: store check must be one of {CHECKS}, got {check!r}")
        self.root = resolve_cache_dir(cache_dir)
        self.fingerprint = fingerprint
        self.env_hash = _sha(json.dumps(fingerprint, sort_keys=True, default=str))[:16]
        self.check = check
        self.lock_timeout_s = lock_timeout_s  # how long a write waits for another writer's lock
        self._write_failed = False

    def path(self, entry: EntryId) -> Path:
        return self.root / entry.folder() / f"{entry.digest()}-{self.env_hash}.json"

    def load(self, entry: EntryId) -> Optional[dict]:
        """The stored record for ``entry`` in this environment, or None (missing or unusable)."""
        path = self.path(entry)
        record = self._read(path, entry)
        if record is not None or self.check != "warn":
            return record
        for other in sorted(path.parent.glob(f"{entry.digest()}-*.json")):
            record = self._read(other, entry, any_environment=True)
            if record is not None:
                differs = sorted(k for k in set(record["fingerprint"]) | set(self.fingerprint)
                                 if record["fingerprint"].get(k) != self.fingerprint.get(k))
                warnings.warn(f"disttune: using stored winner {other} from another environment "
                              f"(differs in: {', '.join(differs)})", StoreWarning, stacklevel=3)
                return record
        return None

    def _read(self, path: Path, entry: EntryId, any_environment: bool = False) -> Optional[dict]:
        try:
            text = path.read_text(encoding="utf-8")
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as err:
            warnings.warn(f"disttune: cannot read store file {path}: {err}; tuning instead", StoreWarning)
            return None
        problem = None
        try:
            record = json.loads(text)
        except json.JSONDecodeError as err:
            record, problem = None, f"not valid JSON ({err.msg} at char {err.pos}; truncated or corrupt?)"
        if record is not None:
            problem = validate_record(record, entry, None if any_environment else self.fingerprint)
        if problem:
            warnings.warn(f"disttune: ignoring store file {path}: {problem}; tuning instead", StoreWarning)
            return None
        return record

    def save(self, entry: EntryId, winner: int, agreed_ms: list[float], extra: Optional[dict] = None) -> Optional[Path]:
        """Write one entry atomically (temp file + rename) under a file lock. Failures warn once."""
        record = {
            "schema": SCHEMA,
            "kind": entry.kind,
            "name": entry.name,
            "source_key": entry.source_key,
            "key": entry.key,
            "occurrence": entry.occurrence,
            "configs": list(entry.configs),
            "winner": winner,
            "winner_config": entry.configs[winner],
            "agreed_ms": [t if t != float("inf") else None for t in agreed_ms],
            "fingerprint": self.fingerprint,
            "created": time.time(),
            **(extra or {}),
        }
        path = self.path(entry)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with _locked(path, self.lock_timeout_s):
                atomic_write_json(path, record)
        except filelock.Timeout as err:
            warnings.warn(f"disttune: the store's lock file {err.lock_file} was held by another process for "
                          f"{self.lock_timeout_s:.0f} s; the winners are used in this process but not stored",
                          StoreWarning, stacklevel=2)
            return None
        except OSError as err:
            if not self._write_failed:
                self._write_failed = True
                warnings.warn(f"disttune: could not write the store under {self.root}: {err}; the winners are "
                              "used in this process but the next one will tune again", StoreWarning, stacklevel=2)
            return None
        return path


def validate_record(record: Any, entry: Optional[EntryId], fingerprint: Optional[dict]) -> Optional[str]:
    """Why ``record`` cannot be trusted for ``entry`` (None when it can)."""
    if not isinstance(record, dict):
        return "not a JSON object"
    if record.get("schema") != SCHEMA:
        return f"schema {record.get('schema')!r}, this disttune reads schema {SCHEMA}"
    for field, kind in (("configs", list), ("winner", int), ("name", str), ("key", str), ("fingerprint", dict)):
        if not isinstance(record.get(field), kind):
            return f"field {field!r} missing or not a {kind.__name__}"
    if not isinstance(record.get("occurrence", 0), int):
        return "field 'occurrence' not an int"
    if not 0 <= record["winner"] < len(record["configs"]):
        return f"winner index {record['winner']} outside the {len(record['configs'])} configs"
    if entry is not None:
        for field in ("name", "source_key", "key", "occurrence"):
            if record.get(field) != getattr(entry, field):
                return f"{field} differs from this site's ({record.get(field)!r} != {getattr(entry, field)!r})"
        if tuple(record["configs"]) != entry.configs:
            return "config list differs from this site's"
    if fingerprint is not None and record.get("fingerprint") != fingerprint:
        return "recorded for another environment"
    return None


def atomic_write_json(path: Path, record: Any) -> None:
    """Write ``record`` to a temporary file beside ``path``, fsync it, then rename over ``path``."""
    handle, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            json.dump(record, out, indent=1, sort_keys=True)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


@contextlib.contextmanager
def _locked(path: Path, timeout_s: float = 60.0) -> Iterator[None]:
    with filelock.FileLock(str(path) + ".lock", timeout=timeout_s):
        yield


def iter_records(cache_dir: Optional[str | os.PathLike] = None) -> Iterator[tuple[Path, Optional[dict], Optional[str]]]:
    """Every store file under the cache directory: (path, record or None, problem or None)."""
    root = resolve_cache_dir(cache_dir)
    for path in sorted(root.glob("*/*.json")):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as err:
            yield path, None, str(err)
            continue
        yield path, record, validate_record(record, None, None)


# -- pinned tables: export once, deploy everywhere ----------------------------------------------------

TABLE_SCHEMA = 1


def export_table(path: str | os.PathLike, cache_dir: Optional[str | os.PathLike] = None) -> int:
    """Write every valid store entry into one JSON table at ``path``; returns the entry count."""
    entries = [record for _, record, problem in iter_records(cache_dir) if record is not None and not problem]
    atomic_write_json(Path(path), {"schema": TABLE_SCHEMA, "entries": entries})
    return len(entries)


def import_table(path: str | os.PathLike, cache_dir: Optional[str | os.PathLike] = None) -> int:
    """Copy a table's entries into the store (each keeps its recorded environment)."""
    table = load_table(path, what="winners table")
    root = resolve_cache_dir(cache_dir)
    for record in table["entries"]:
        entry = entry_of(record)
        env_hash = _sha(json.dumps(record["fingerprint"], sort_keys=True, default=str))[:16]
        target = root / entry.folder() / f"{entry.digest()}-{env_hash}.json"
        target.parent.mkdir(parents=True, exist_ok=True)
        with _locked(target):
            atomic_write_json(target, record)
    return len(table["entries"])


def entry_of(record: dict) -> EntryId:
    return EntryId(record.get("kind", "kernel"), record["name"], record.get("source_key", ""), record["key"],
                   int(record.get("occurrence", 0)), tuple(record["configs"]))


def load_table(path: str | os.PathLike, what: str = "pinned winners table") -> dict:
    """Read and check a winners table (``what`` names it in errors); a clear ValueError when it is not one."""
    try:
        table = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"disttune: cannot read {what} {path}: {getattr(err, 'strerror', None) or err}") from err
    if not isinstance(table, dict) or table.get("schema") != TABLE_SCHEMA or not isinstance(table.get("entries"), list):
        raise ValueError(f"disttune: {path} is not a disttune winners table (schema {TABLE_SCHEMA})")
    for record in table["entries"]:
        problem = validate_record(record, None, None)
        if problem:
            raise ValueError(f"disttune: {what} {path} has a bad entry: {problem}")
    return table


def table_digest(table: dict) -> str:
    return _sha(json.dumps(table, sort_keys=True, default=str))[:16]


def pinned_lookup(table: dict, name: str, key: str, occurrence: int, configs: tuple) -> Optional[int]:
    """The winner index a pinned table gives this site (matched without environment), or None."""
    for record in table["entries"]:
        if (record["name"], record["key"], int(record.get("occurrence", 0)), tuple(record["configs"])) == (
                name, key, occurrence, configs):
            return int(record["winner"])
    return None
