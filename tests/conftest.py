"""Shared pytest setup: run Triton kernels in the CPU interpreter when there is no GPU.

Must run before any test module imports triton (triton.jit picks the interpreter at
decoration time), which is why it lives at conftest import time.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy
import pytest
import triton


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int(minor)


def pytest_configure(config):
    """Stop at once, in one line, where Triton's interpreter cannot run with the installed numpy."""
    interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if interpreting and _version(triton.__version__) < (3, 7) and _version(numpy.__version__) >= (2, 4):
        raise pytest.UsageError(
            f"triton {triton.__version__}'s interpreter needs numpy < 2.4 (it calls int() on 1-element arrays, "
            f"which numpy {numpy.__version__} refuses): pip install 'numpy<2.4', or a newer triton")


@pytest.fixture(autouse=True)
def isolated_outputs(tmp_path, monkeypatch):
    """Each test gets its own winner store and log directory under its ``tmp_path``.

    So no test sees another's (or the user's) winners, and nothing a test runs, subprocesses
    included (they inherit the environment), writes logs or reports into the checkout.
    """
    monkeypatch.setenv("DISTTUNE_CACHE_DIR", str(tmp_path / "winner-store"))
    monkeypatch.setenv("DISTTUNE_LOG_DIR", str(tmp_path / "disttune-logs"))
    monkeypatch.delenv("DISTTUNE_PINNED", raising=False)
    monkeypatch.delenv("DISTTUNE_ALWAYS_TUNE", raising=False)


def pytest_terminal_summary(terminalreporter):
    from fault_tally import GPU_TALLY, TALLY, gpu_label, summary_line

    if TALLY["trials"]:
        terminalreporter.write_line(summary_line())
    if GPU_TALLY["trials"]:
        terminalreporter.write_line(summary_line(GPU_TALLY, gpu_label()))
