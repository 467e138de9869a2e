"""Persistent winners: one JSON file per tuning site, written once, atomically, under a file lock.

Where: ``cache_dir=`` argument, else ``$DISTTUNE_CACHE_DIR``, else the per-user cache
directory (``platformdirs.user_cache_dir("disttune")``, ``~/.cache/disttune`` on Linux).

An entry is named by two hashes: the *identity* of the site (kernel source as
Triton keys it, tuning key, occurrence, candidate configs) and the *environment*
(GPU name and count, compute capability, GPU driver, world size and ranks per node,
torch, triton, CUDA and NCCL versions, the environment variables Triton treats as
cache-invalidating). A different environment is a different file, so a miss; with
``check="warn"`` an entry of the same identity from another environment is used,
with a warning naming what differs. Each entry also records the hash of the kernel's
own source text (``source_digest``), which a pinned lookup checks: a table exported
before the kernel was edited is refused (:class:`PinnedTableError`).

This module only reads and writes; who reads, who writes and what is trusted is
decided by the tuners (every rank reads, the agreed decision is rank 0's entry).
Files are readable JSON with ``"schema": SCHEMA``. A corrupt, truncated or
foreign file (bytes that are not UTF-8, nesting too deep to parse, a field of the wrong
type, a winner that disagrees with its config) is reported and ignored, never trusted
and never fatal; in a pinned table the same damage is one PinnedTableError (a
ValueError) naming the file.
Nothing is read or written through a symbolic link, and nothing but a regular file is
opened (:mod:`disttune.files`): a linked kernel folder, entry or lock file is replaced,
a FIFO is never opened.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import os
import re
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

import filelock

from . import env, files
from .comm import Communicator, global_rank
from .configs import config_text
from .errors import StoreWarning

SCHEMA = 1
CHECKS = ("strict", "warn")


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


def kernel_source_digest(autotuner: Any) -> str:
    """The hash of the kernel's own source text: unlike :func:`kernel_source_key`, the same under
    every Triton version and line position, so a deployed pinned table can be checked against it."""
    fn = autotuner.fn
    while not hasattr(fn, "src") and hasattr(fn, "fn") and not inspect.isfunction(fn):
        fn = fn.fn
    source = getattr(fn, "src", None)
    if not isinstance(source, str):
        try:
            source = inspect.getsource(autotuner.base_fn)
        except (OSError, TypeError):
            source = getattr(autotuner.base_fn, "__qualname__", repr(autotuner.base_fn))
    return _sha(source)


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
    fingerprint["driver"] = gpu_driver_version()
    fingerprint["nccl"] = nccl_version()
    try:
        from triton._C.libtriton import get_cache_invalidating_env_vars

        fingerprint["triton_env"] = dict(sorted(get_cache_invalidating_env_vars().items()))
    except ImportError:
        fingerprint["triton_env"] = {}
    return fingerprint


def gpu_driver_version() -> Optional[str]:
    """The GPU driver's version (NVIDIA's kernel module, else the CUDA driver API's), None without a GPU."""
    import torch

    if not torch.cuda.is_available():
        return None
    try:
        text = files.read_regular("/proc/driver/nvidia/version", follow=True).decode("utf-8", "replace")
        found = re.search(r"Kernel Module\s+(?:for \S+\s+)?([0-9][0-9.]*)", text)
        if found:
            return found.group(1)
    except OSError:
        pass
    try:
        return f"cuda-driver-api {torch._C._cuda_getDriverVersion()}"
    except (AttributeError, RuntimeError):
        return None


def nccl_version() -> Optional[str]:
    """The NCCL torch was built with (``2.28.3``), None where torch has none (CPU builds)."""
    try:
        import torch.cuda.nccl as nccl

        version = nccl.version()
    except Exception:  # noqa: BLE001 - no NCCL in this build, in any of the ways torch says so
        return None
    return ".".join(str(part) for part in version) if isinstance(version, tuple) else str(version)


@dataclass(frozen=True)
class EntryId:
    """The identity of one stored site: same identity + same environment = valid entry."""

    kind: str  # "kernel" (contextual sites) or "function" (disttune.autotune), then " objective=..." or " checked"
    name: str
    source_key: str
    key: str
    occurrence: int
    configs: tuple
    source_digest: str = ""  # the kernel's own source text, hashed: recorded, checked by pinned lookups

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
        return self.root / entry.folder() / self.file_name(entry)

    def file_name(self, entry: EntryId) -> str:
        return f"{entry.digest()}-{self.env_hash}.json"

    def load(self, entry: EntryId) -> Optional[dict]:
        """The stored record for ``entry`` in this environment, or None (missing or unusable)."""
        folder = self._open_folder(entry)
        if folder is None:
            return None
        try:
            record = self._read(folder, entry.folder(), self.file_name(entry), entry)
            if record is not None or self.check != "warn":
                return record
            prefix = f"{entry.digest()}-"
            others = (n for n in os.listdir(folder) if n.startswith(prefix) and n.endswith(".json"))
            for name in sorted(n for n in others if n != self.file_name(entry)):
                record = self._read(folder, entry.folder(), name, entry, any_environment=True)
                if record is not None:
                    differs = sorted(k for k in set(record["fingerprint"]) | set(self.fingerprint)
                                     if record["fingerprint"].get(k) != self.fingerprint.get(k))
                    warnings.warn(f"disttune: using stored winner {self.root / entry.folder() / name} from another "
                                  f"environment (differs in: {', '.join(differs)})", StoreWarning, stacklevel=3)
                    return record
            return None
        finally:
            os.close(folder)

    def _open_folder(self, entry: EntryId) -> Optional[int]:
        """The entry's kernel folder, opened without following a link; None (after a warning) when unusable."""
        where = self.root / entry.folder()
        try:
            root = files.open_dir(self.root)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as err:
            warnings.warn(f"disttune: cannot open the store {self.root}: {err.strerror or err}; tuning instead",
                          StoreWarning)
            return None
        try:
            return files.open_subdir(root, entry.folder())
        except FileNotFoundError:
            return None
        except NotADirectoryError:
            warnings.warn(f"disttune: ignoring store folder {where}: not a folder; tuning instead", StoreWarning)
            return None
        except OSError as err:  # a symbolic link (LinkRefused) among them
            warnings.warn(f"disttune: ignoring store folder {where}: {err.strerror or err}; tuning instead",
                          StoreWarning)
            return None
        finally:
            os.close(root)

    def _read(self, folder: int, folder_name: str, name: str, entry: EntryId,
              any_environment: bool = False) -> Optional[dict]:
        path = self.root / folder_name / name
        try:
            data = files.read_regular(name, dir_fd=folder)
        except FileNotFoundError:
            return None
        except OSError as err:
            warnings.warn(f"disttune: ignoring store file {path}: {err.strerror or err}; tuning instead", StoreWarning)
            return None
        record, problem = decode_record(data)
        if problem is None:
            problem = validate_record(record, entry, None if any_environment else self.fingerprint)
        if problem:
            warnings.warn(f"disttune: ignoring store file {path}: {problem}; tuning instead", StoreWarning)
            return None
        return record

    def save(self, entry: EntryId, winner: int, agreed_ms: list[float], extra: Optional[dict] = None) -> Optional[Path]:
        """Write one entry atomically (temp file + rename) under a file lock. Failures warn once.

        A link where the kernel folder or the entry should be is replaced, never written through.
        """
        record = make_record(entry, winner, agreed_ms, self.fingerprint, extra)
        path = self.path(entry)
        try:
            write_entry(self.root, entry.folder(), path.name, record, self.lock_timeout_s)
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


def make_record(entry: EntryId, winner: int, agreed_ms: list[float], fingerprint: dict,
                extra: Optional[dict] = None) -> dict:
    """One store record (the content of one store file, and one entry of a winners table)."""
    return {
        "schema": SCHEMA,
        "kind": entry.kind,
        "name": entry.name,
        "source_key": entry.source_key,
        "source_digest": entry.source_digest,
        "key": entry.key,
        "occurrence": entry.occurrence,
        "configs": list(entry.configs),
        "winner": winner,
        "winner_config": entry.configs[winner],
        "agreed_ms": [t if t != float("inf") else None for t in agreed_ms],
        "fingerprint": fingerprint,
        "created": time.time(),
        **(extra or {}),
    }


def write_entry(root: Path, folder_name: str, name: str, record: Any, lock_timeout_s: float = 60.0) -> None:
    """Write one store file ``root/folder_name/name`` under its lock; a link in the way is replaced (a warning)."""
    root_fd = files.open_dir(root, create=True)
    try:
        if files.is_link(root_fd, folder_name):
            warnings.warn(f"disttune: store folder {root / folder_name} was a symbolic link; replaced by a folder",
                          StoreWarning, stacklevel=3)
        folder = files.open_subdir(root_fd, folder_name, create=True, replace_link=True)
    finally:
        os.close(root_fd)
    try:
        lock_name = name + ".lock"
        if files.is_link(folder, lock_name):
            warnings.warn(f"disttune: lock file {root / folder_name / lock_name} was a symbolic link; removed",
                          StoreWarning, stacklevel=3)
            os.unlink(lock_name, dir_fd=folder)
        with _locked(root / folder_name / name, lock_timeout_s):
            files.write_replacing(folder, name, encode_record(record))
    finally:
        os.close(folder)


def encode_record(record: Any) -> bytes:
    return json.dumps(record, indent=1, sort_keys=True).encode("utf-8")


def decode_record(data: bytes) -> tuple[Any, Optional[str]]:
    """(the parsed JSON, None), or (None, why it cannot be parsed): not UTF-8, not JSON, nested too deep."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        return None, f"not UTF-8 text (byte {data[err.start]:#04x} at offset {err.start})"
    try:
        return json.loads(text), None
    except json.JSONDecodeError as err:
        return None, f"not valid JSON ({err.msg} at char {err.pos}; truncated or corrupt?)"
    except RecursionError:
        return None, "JSON nested too deeply to be a disttune file"
    except ValueError as err:  # e.g. an integer longer than Python converts
        return None, f"not valid JSON ({err})"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate_record(record: Any, entry: Optional[EntryId], fingerprint: Optional[dict]) -> Optional[str]:
    """Why ``record`` cannot be trusted for ``entry`` (None when it can): each field's type and meaning."""
    if not isinstance(record, dict):
        return "not a JSON object"
    if not _is_int(record.get("schema")) or record["schema"] != SCHEMA:
        return f"schema {record.get('schema')!r}, this disttune reads schema {SCHEMA}"
    for field, kind in (("configs", list), ("name", str), ("key", str), ("source_key", str), ("fingerprint", dict)):
        if not isinstance(record.get(field), kind):
            return f"field {field!r} missing or not a {kind.__name__}"
    if not all(isinstance(config, str) for config in record["configs"]):
        return "field 'configs' holds something other than config texts"
    kind = record.get("kind", "kernel")
    if not isinstance(kind, str) or kind.split(" ", 1)[0] not in ("kernel", "function"):
        return f"field 'kind' is {kind!r}, not 'kernel' or 'function' (with an objective or 'checked' after it)"
    if not _is_int(record.get("occurrence", 0)) or record.get("occurrence", 0) < 0:
        return "field 'occurrence' not an int, or negative"
    if not _is_int(record.get("winner")):
        return f"field 'winner' is {record.get('winner')!r}, not an int"
    if not 0 <= record["winner"] < len(record["configs"]):
        return f"winner index {record['winner']} outside the {len(record['configs'])} configs"
    if "winner_config" in record and record["winner_config"] != record["configs"][record["winner"]]:
        return (f"winner_config {record['winner_config']!r} is not configs[{record['winner']}] "
                f"({record['configs'][record['winner']]!r})")
    agreed = record.get("agreed_ms", [])
    if not isinstance(agreed, list) or not all(t is None or (isinstance(t, (int, float)) and not isinstance(t, bool))
                                               for t in agreed):
        return "field 'agreed_ms' not a list of times"
    if entry is not None:
        for field in ("name", "source_key", "key", "occurrence"):
            if record.get(field, 0) != getattr(entry, field):
                return f"{field} differs from this site's ({record.get(field)!r} != {getattr(entry, field)!r})"
        if tuple(record["configs"]) != entry.configs:
            return "config list differs from this site's"
    if fingerprint is not None and record.get("fingerprint") != fingerprint:
        return "recorded for another environment"
    return None


def atomic_write_json(path: Path, record: Any) -> None:
    """Write ``record`` to a temporary file beside ``path``, fsync it, then rename over ``path``
    (which replaces a link there instead of writing through it)."""
    folder = files.open_dir(path.parent)
    try:
        files.write_replacing(folder, path.name, encode_record(record))
    finally:
        os.close(folder)


@contextlib.contextmanager
def _locked(path: Path, timeout_s: float = 60.0) -> Iterator[None]:
    """Hold ``path``'s lock file (``<path>.lock``) for at most ``timeout_s`` of waiting; filelock opens it
    with O_NOFOLLOW."""
    with filelock.FileLock(str(path) + ".lock", timeout=timeout_s):
        yield


TEMP_FILE = re.compile(r"^\.(?P<entry>.+\.json)\.[0-9a-z_]+\.tmp$")


def iter_records(cache_dir: Optional[str | os.PathLike] = None) -> Iterator[tuple[Path, Optional[dict], Optional[str]]]:
    """Every store file under the cache directory: (path, record or None, problem or None).

    Never follows a link and never opens anything but a regular file: a linked kernel folder or entry,
    or a FIFO named like an entry, is listed with its problem.
    """
    for folder in _store_folders(cache_dir):
        if folder.is_symlink():
            yield Path(folder.path), None, "a symbolic link where a kernel folder belongs"
            continue
        if not folder.is_dir(follow_symlinks=False):
            continue
        try:
            names = sorted(n for n in os.listdir(folder.path) if n.endswith(".json") and not n.startswith("."))
        except OSError as err:
            yield Path(folder.path), None, err.strerror or str(err)
            continue
        for name in names:
            path = Path(folder.path) / name
            try:
                data = files.read_regular(path)
            except FileNotFoundError:
                continue
            except OSError as err:
                yield path, None, err.strerror or str(err)
                continue
            record, problem = decode_record(data)
            yield path, record if problem is None else None, problem or validate_record(record, None, None)


def _store_folders(cache_dir: Optional[str | os.PathLike]) -> list[os.DirEntry]:
    """The entries directly under the store's root, by name (none when the root does not exist)."""
    try:
        return sorted(os.scandir(resolve_cache_dir(cache_dir)), key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):
        return []


def leftover_files(cache_dir: Optional[str | os.PathLike] = None) -> Iterator[Path]:
    """Temporary files under the store (``.<entry>.<random>.tmp``) whose writer is gone (its lock is free)."""
    from filelock import FileLock, Timeout

    for folder in _store_folders(cache_dir):
        if folder.is_symlink() or not folder.is_dir(follow_symlinks=False):
            continue
        for name in sorted(os.listdir(folder.path)):
            match = TEMP_FILE.match(name)
            if match is None:
                continue
            lock = Path(folder.path) / (match.group("entry") + ".lock")
            if files.is_link(None, lock) or not os.path.lexists(lock):  # a writer takes the lock before its temp file
                yield Path(folder.path) / name
                continue
            try:
                with FileLock(str(lock), timeout=0):  # a live writer holds it while its temp file exists
                    pass
            except (Timeout, OSError):
                continue
            yield Path(folder.path) / name


# -- pinned tables: export once, deploy everywhere ----------------------------------------------------

TABLE_SCHEMA = 1


def export_table(path: str | os.PathLike, cache_dir: Optional[str | os.PathLike] = None) -> int:
    """Write every valid store entry into one JSON table at ``path``; returns the entry count."""
    entries = [record for _, record, problem in iter_records(cache_dir) if record is not None and not problem]
    atomic_write_json(Path(path), {"schema": TABLE_SCHEMA, "entries": entries})
    return len(entries)


def write_table(path: str | os.PathLike, records: list[dict]) -> int:
    """Write ``records`` (see :func:`make_record`) as one winners table at ``path``; returns the entry count."""
    atomic_write_json(Path(path), {"schema": TABLE_SCHEMA, "entries": records})
    return len(records)


def import_table(path: str | os.PathLike, cache_dir: Optional[str | os.PathLike] = None) -> int:
    """Copy a table's entries into the store (each keeps its recorded environment)."""
    table = load_table(path, what="winners table")
    root = resolve_cache_dir(cache_dir)
    for record in table["entries"]:
        entry = entry_of(record)
        env_hash = _sha(json.dumps(record["fingerprint"], sort_keys=True, default=str))[:16]
        write_entry(root, entry.folder(), f"{entry.digest()}-{env_hash}.json", record)
    return len(table["entries"])


def entry_of(record: dict) -> EntryId:
    return EntryId(record.get("kind", "kernel"), record["name"], record.get("source_key", ""), record["key"],
                   int(record.get("occurrence", 0)), tuple(record["configs"]), record.get("source_digest", ""))


class WinnersTable(dict):
    """A loaded winners table (a dict, as in the file) that remembers where it was read from."""

    path: str = ""


class PinnedTableError(ValueError):
    """A pinned winners table that cannot be used for this job: damaged, or made for other kernels."""


def load_table(path: str | os.PathLike, what: str = "pinned winners table") -> WinnersTable:
    """Read and check a winners table (``what`` names it in errors); a PinnedTableError (a ValueError)
    naming the file when it is not one: unreadable, not a regular file, damaged or with a bad entry."""
    try:
        data = files.read_regular(path, follow=True)  # a deployed table may be a link; never a FIFO
    except OSError as err:
        raise PinnedTableError(f"disttune: cannot read {what} {path}: {err.strerror or err}") from err
    table, problem = decode_record(data)
    if problem:
        raise PinnedTableError(f"disttune: cannot read {what} {path}: {problem}")
    if not isinstance(table, dict) or not _is_int(table.get("schema")) or table["schema"] != TABLE_SCHEMA \
            or not isinstance(table.get("entries"), list):
        raise PinnedTableError(f"disttune: {path} is not a disttune winners table (schema {TABLE_SCHEMA})")
    for index, record in enumerate(table["entries"]):
        problem = validate_record(record, None, None)
        if problem:
            raise PinnedTableError(f"disttune: {what} {path} has a bad entry: {problem} (entries[{index}])")
    loaded = WinnersTable(table)
    loaded.path = os.fspath(path)
    return loaded


def table_digest(table: dict) -> str:
    return _sha(json.dumps(table, sort_keys=True, default=str))[:16]


def pinned_lookup(table: dict, entry: EntryId) -> Optional[int]:
    """The winner index a pinned table gives this site (matched without environment), or None.

    A matching entry recorded for another kernel source (its ``source_digest``, or its ``source_key``
    in tables without one) raises PinnedTableError: the table predates an edit of the kernel.
    """
    for record in table["entries"]:
        if (record["name"], record["key"], int(record.get("occurrence", 0)), tuple(record["configs"])) != (
                entry.name, entry.key, entry.occurrence, entry.configs):
            continue
        recorded, field = (record["source_digest"], "source digest") if record.get("source_digest") else (
            record.get("source_key", ""), "source key")
        current = entry.source_digest if field == "source digest" else entry.source_key
        if recorded != current:
            where = getattr(table, "path", "") or "the pinned winners table"
            raise PinnedTableError(
                f"disttune: {where} was made for another source of {entry.name} (its {field} {recorded[:12]}, "
                f"this kernel's {current[:12]}): tune again and export a new table")
        return int(record["winner"])
    return None


# -- what a tuning call asks of the store ------------------------------------------------------------------------

def open_store(use: bool, cache_dir: Any, comm: Communicator, check: str = "strict",
               timeout_s: float = env.DEFAULT_TIMEOUT_S) -> Optional[WinnerStore]:
    """The winner store of this environment (None when ``use`` is off).

    A write waits at most half the tuner's ``timeout_s`` for another process's lock on its entry, so
    that peers already in their next collective (which waits ``timeout_s``) still hear from the writer.
    """
    if not use:
        return None
    fingerprint = environment_fingerprint(comm.world_size, env.local_world_size())
    return WinnerStore(cache_dir, fingerprint, check, lock_timeout_s=timeout_s / 2)


def kernel_entry(site: Any, kind: str = "kernel") -> EntryId:
    """The store identity of a contextual tuner's site (a :class:`disttune.sites.Site`); ``kind`` tells winners of
    different objectives apart."""
    return EntryId(kind, site.id.kernel, kernel_source_key(site.autotuner), repr(site.id.key), site.id.occurrence,
                   tuple(config_text(c) for c in site.configs), kernel_source_digest(site.autotuner))


def lookup(winners_store: Optional[WinnerStore], table: Optional[dict], always_tune: bool,
           entry: Any = kernel_entry) -> Optional[Any]:
    """How this rank answers for a new site: ``site -> its pinned-table or stored winner index, or None`` (tune);
    None when nothing answers (no store, ``always_tune``, ``DISTTUNE_ALWAYS_TUNE=1``)."""
    if table is not None:  # a table made for another kernel source raises PinnedTableError here
        return lambda site: pinned_lookup(table, entry(site))
    if winners_store is None or always_tune or env.always_tune():
        return None

    def stored(site: Any) -> Optional[int]:
        record = winners_store.load(entry(site))
        return None if record is None else record["winner"]

    return stored


def save_winners(winners_store: WinnerStore, tuned: Any, function: str) -> None:
    """Store each tuned winner of ``tuned`` (``(entry, SiteResult, noise)`` triples) with its agreed times and its
    noise on this rank; the caller is the one writer (``disttune verify`` allows a later time the larger of
    that noise and its threshold)."""
    for entry, result, noise in tuned:
        if result.source == "tuned":
            winners_store.save(entry, result.winner, list(result.agreed_ms),
                               {"function": function, "noise": noise, "key_text": result.site.key_text()})


def is_store_writer(writer: str, comm: Communicator) -> bool:
    """``"global"``: global rank 0 writes; ``"node"``: local rank 0 of each node does."""
    return env.local_rank() == 0 if writer == "node" else global_rank(comm) == 0
