"""Shared pytest setup: run Triton kernels in the CPU interpreter when there is no GPU.

Must run before any test module imports triton (triton.jit picks the interpreter at
decoration time), which is why it lives at conftest import time.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest


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
    from fault_tally import TALLY

    if TALLY["trials"]:
        terminalreporter.write_line(
            "fault injection: {trials} trials, {faults} faults injected, {hangs} hangs, "
            "{disagreements} disagreements, {torn_files} torn files".format(**TALLY))
