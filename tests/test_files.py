"""disttune.files: nothing is read or written through a symbolic link, and only regular files are opened."""

from __future__ import annotations

import os

import pytest

from disttune import files


@pytest.fixture
def folder(tmp_path):
    fd = files.open_dir(tmp_path / "folder", create=True)
    yield tmp_path / "folder", fd
    os.close(fd)


@pytest.fixture
def victim(tmp_path):
    path = tmp_path / "victim"
    path.write_text("untouched\n")
    return path


def test_a_fifo_is_refused_without_blocking(folder):
    path, fd = folder
    os.mkfifo(path / "entry.json")
    with pytest.raises(files.NotRegularFile, match="FIFO"):
        files.read_regular("entry.json", dir_fd=fd)
    with pytest.raises(files.NotRegularFile, match="FIFO"):
        files.append_no_follow(fd, "entry.json", b"x")


def test_a_link_is_read_only_when_asked(folder, victim):
    path, fd = folder
    (path / "entry.json").symlink_to(victim)
    with pytest.raises(files.LinkRefused):
        files.read_regular("entry.json", dir_fd=fd)
    assert files.read_regular(path / "entry.json", follow=True) == b"untouched\n"


def test_writes_replace_a_link_and_leave_its_target(folder, victim):
    path, fd = folder
    (path / "entry.json").symlink_to(victim)
    files.write_replacing(fd, "entry.json", b"new")
    (path / "rank-0.log").symlink_to(victim)
    assert files.append_no_follow(fd, "rank-0.log", b"line\n") is True
    assert files.append_no_follow(fd, "rank-0.log", b"line\n") is False
    assert victim.read_text() == "untouched\n"
    assert not (path / "entry.json").is_symlink() and (path / "entry.json").read_bytes() == b"new"
    assert (path / "rank-0.log").read_text() == "line\nline\n"
    assert sorted(p.name for p in path.iterdir()) == ["entry.json", "rank-0.log"], "no temporary file left"


def test_a_linked_folder_is_refused_or_replaced(folder, tmp_path):
    path, fd = folder
    outside = tmp_path / "outside"
    outside.mkdir()
    (path / "kernel").symlink_to(outside, target_is_directory=True)
    with pytest.raises(files.LinkRefused):
        files.open_subdir(fd, "kernel")
    inner = files.open_subdir(fd, "kernel", create=True, replace_link=True)
    try:
        files.write_replacing(inner, "entry.json", b"{}")
    finally:
        os.close(inner)
    assert list(outside.iterdir()) == [] and (path / "kernel" / "entry.json").read_bytes() == b"{}"


@pytest.mark.parametrize("name", ["..", ".", "a/b", ""])
def test_names_cannot_leave_their_folder(folder, name):
    _, fd = folder
    with pytest.raises(OSError, match="plain file name"):
        files.write_replacing(fd, name, b"x")
