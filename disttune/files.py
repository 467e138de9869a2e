"""Files disttune writes or trusts, opened without following symbolic links.

The store and the rank logs live in directories other users or jobs may share. A name there
that is a symbolic link, a FIFO or a device must never be read through (a FIFO blocks the
reader forever) or written through (the link's target would get our bytes). So:

* every file is opened relative to its directory's descriptor, with ``O_NOFOLLOW`` on the last
  component, and names are single components (no ``/``, no ``..``): the file stays inside its
  directory, whatever the path resolves to;
* a read opens with ``O_NONBLOCK`` and refuses anything but a regular file (:class:`NotRegularFile`);
* a write goes to a fresh temporary file (``O_EXCL``) and is renamed over the name, which replaces a
  link there rather than following it; an append (the logs) refuses a link (:class:`LinkRefused`).

The directory named by the caller (``cache_dir``, ``log_dir``) may itself be a link: that is the
user's choice. Each call costs a few system calls.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
from pathlib import Path
from typing import Optional

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
CLOEXEC = getattr(os, "O_CLOEXEC", 0)
NONBLOCK = getattr(os, "O_NONBLOCK", 0)
DIRECTORY = getattr(os, "O_DIRECTORY", 0)
MAX_READ_BYTES = 64 << 20  # a store entry or a winners table is a few kB; anything this big is not one


class LinkRefused(OSError):
    """A name that must be a plain file or folder is a symbolic link."""


class NotRegularFile(OSError):
    """A name that must be a regular file is a FIFO, a device, a socket or a folder."""


def check_name(name: str) -> str:
    """``name`` when it is one path component; an OSError otherwise (it could leave its directory)."""
    if not name or name in (".", "..") or "/" in name or "\0" in name or (os.sep != "/" and os.sep in name):
        raise OSError(errno.EINVAL, "is not a plain file name (it would leave its folder)", name)
    return name


def open_dir(path: str | os.PathLike, create: bool = False) -> int:
    """A descriptor of the directory ``path`` (links in ``path`` are the caller's choice and followed)."""
    if create:
        Path(path).mkdir(parents=True, exist_ok=True)
    return os.open(path, os.O_RDONLY | DIRECTORY | CLOEXEC)


def open_subdir(parent_fd: int, name: str, create: bool = False, replace_link: bool = False) -> int:
    """A descriptor of folder ``name`` inside ``parent_fd``, never through a link.

    ``create`` makes it when missing; ``replace_link`` removes a link found there (the link, not its
    target) and makes a folder in its place. Otherwise a link raises :class:`LinkRefused`.
    """
    check_name(name)
    if create:
        try:
            os.mkdir(name, 0o755, dir_fd=parent_fd)
        except FileExistsError:
            pass
    try:
        return os.open(name, os.O_RDONLY | DIRECTORY | NOFOLLOW | CLOEXEC, dir_fd=parent_fd)
    except OSError as err:
        if not is_link(parent_fd, name):
            raise
        if not replace_link:
            raise LinkRefused(errno.ELOOP, "is a symbolic link, not a folder", name) from err
    os.unlink(name, dir_fd=parent_fd)
    os.mkdir(name, 0o755, dir_fd=parent_fd)
    return os.open(name, os.O_RDONLY | DIRECTORY | NOFOLLOW | CLOEXEC, dir_fd=parent_fd)


def is_link(dir_fd: Optional[int], name: str | os.PathLike) -> bool:
    """Whether ``name`` (inside ``dir_fd``, or a path when None) is a symbolic link."""
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def read_regular(name: str | os.PathLike, dir_fd: Optional[int] = None, follow: bool = False) -> bytes:
    """The bytes of regular file ``name`` (inside ``dir_fd`` when given), never blocking on a FIFO.

    A link raises :class:`LinkRefused` unless ``follow``; anything but a regular file raises
    :class:`NotRegularFile`; a missing file raises FileNotFoundError.
    """
    flags = os.O_RDONLY | NONBLOCK | CLOEXEC | (0 if follow else NOFOLLOW)
    try:
        fd = os.open(name, flags, dir_fd=dir_fd)
    except OSError as err:
        if not follow and err.errno in (errno.ELOOP, errno.EMLINK) and is_link(dir_fd, name):
            raise LinkRefused(errno.ELOOP, "is a symbolic link, not a file", os.fspath(name)) from err
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFile(errno.EINVAL, f"is not a regular file ({file_kind(mode)})", os.fspath(name))
        chunks, size = [], 0
        while True:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return b"".join(chunks)
            size += len(chunk)
            if size > MAX_READ_BYTES:
                raise NotRegularFile(errno.EFBIG, f"is larger than {MAX_READ_BYTES >> 20} MiB", os.fspath(name))
            chunks.append(chunk)
    finally:
        os.close(fd)


def file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISDIR, "a folder"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return kind
    return "not a regular file"


def write_replacing(dir_fd: int, name: str, data: bytes, temp_prefix: Optional[str] = None) -> None:
    """Write ``data`` to a new temporary file in ``dir_fd``, fsync it, then rename it over ``name``.

    The rename replaces whatever ``name`` is (a link included) and never writes through it; a reader
    sees the old file or the new one, whole. The temporary file is ``.<name>.<random>.tmp``.
    """
    check_name(name)
    temp = f"{temp_prefix or '.' + name}.{secrets.token_hex(6)}.tmp"
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW | CLOEXEC, 0o644, dir_fd=dir_fd)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(temp, dir_fd=dir_fd)
        except OSError:
            pass
        raise


def append_no_follow(dir_fd: int, name: str, data: bytes) -> bool:
    """Append ``data`` to regular file ``name`` in ``dir_fd`` (created when missing).

    A link or a non-regular file there is not written through: a link is removed and a fresh file
    takes its place (returns True: the caller warns); a FIFO or device raises :class:`NotRegularFile`.
    """
    check_name(name)
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | NOFOLLOW | NONBLOCK | CLOEXEC
    replaced = False
    try:
        fd = os.open(name, flags, 0o644, dir_fd=dir_fd)
    except OSError:
        if not is_link(dir_fd, name):
            try:
                mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
            except OSError:
                mode = stat.S_IFREG
            if not stat.S_ISREG(mode):  # e.g. a FIFO nobody reads (ENXIO)
                raise NotRegularFile(errno.EINVAL, f"is not a regular file ({file_kind(mode)})", name) from None
            raise
        os.unlink(name, dir_fd=dir_fd)
        fd = os.open(name, flags | os.O_EXCL, 0o644, dir_fd=dir_fd)
        replaced = True
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFile(errno.EINVAL, f"is not a regular file ({file_kind(mode)})", name)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)
    return replaced
