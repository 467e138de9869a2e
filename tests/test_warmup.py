"""``disttune.warm_up``: Triton's one-time initialisation paid ahead; nothing to pay without a GPU compiler."""

from __future__ import annotations

import concurrent.futures

import pytest
import torch

import disttune
from disttune import warmup


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU case: the interpreter compiles nothing")
def test_under_the_interpreter_a_warm_up_does_nothing_and_says_so():
    assert disttune.warm_up() == 0.0
    future = disttune.warm_up(background=True)
    assert isinstance(future, concurrent.futures.Future) and future.result(timeout=1) == 0.0
    assert warmup.wait_for_warm_up() == 0.0, "nothing was started"


def test_the_init_warm_up_is_off_with_the_switch(monkeypatch):
    started = []
    monkeypatch.setattr(warmup, "warm_up", lambda background=False, device=None: started.append((background, device)))
    monkeypatch.setenv("DISTTUNE_WARM_UP", "0")
    warmup.start_if_enabled(0)
    assert started == []
    monkeypatch.setenv("DISTTUNE_WARM_UP", "1")
    warmup.start_if_enabled(0)
    assert started == [(True, 0)], "in the background, on the pinned GPU"


def test_a_failed_warm_up_is_ignored_and_runs_once_per_device(monkeypatch):
    calls = []

    def failing_run(device):
        calls.append(device)
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(warmup, "_available", lambda: True)
    monkeypatch.setattr(warmup, "_run", failing_run)
    monkeypatch.setattr(warmup, "_started", {})
    assert warmup.warm_up(device=3) == 0.0
    assert warmup.warm_up(background=True, device=3).result(timeout=5) == 0.0
    assert calls == [3], "once per device and process"
    assert warmup.wait_for_warm_up() == 0.0
