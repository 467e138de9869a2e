"""What a tuning call shows: per-rank logs, the progress bar, Triton's own autotuning printout (disttune.console).

Kernels run under TRITON_INTERPRET=1 on the CPU (see conftest.py); fake timers from
``tiny_kernels.TableTimer`` make the expected winners computable.
"""

from __future__ import annotations

import json

import torch

import disttune
from tiny_kernels import DEV, launch_add, make_kernel, TableTimer, tuner


def test_logs_append_and_honour_the_environment(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DISTTUNE_LOG_DIR", str(tmp_path / "envlogs"))
    for blocks in ((16, 32), (32, 64)):
        kernel = make_kernel(blocks=blocks)

        @disttune.contextual_autotune(n_warmup=0, n_repeat=1, timer=TableTimer(lambda i: 1.0))
        def step(x):
            launch_add(kernel, x, torch.empty_like(x))

        step(torch.randn(64, device=DEV))
    lines = (tmp_path / "envlogs" / "rank-0.log").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.startswith("{")]
    assert [r["function"] for r in records if r["event"] == "tuning"] == [step.__qualname__] * 2
    assert all({"rank", "host", "time"} <= r.keys() for r in records)
    printed = capsys.readouterr().out
    assert printed.count("disttune: tuned") == 2 and "rank-0.log" in printed


def test_progress_bar_only_on_a_terminal_and_not_when_disabled(monkeypatch):
    from disttune.console import progress_bar as _progress_bar

    class Terminal:
        def isatty(self):
            return True

        def write(self, text):
            return len(text)

        def flush(self):
            pass

    assert _progress_bar(True, 10, "x") is None  # pytest's stderr is not a terminal
    monkeypatch.setattr("sys.stderr", Terminal())
    bar = _progress_bar(True, 10, "x")
    assert bar is not None and bar.total == 10
    bar.close()
    assert _progress_bar(False, 10, "x") is None, "only rank 0 (wanted=True) shows a bar"
    monkeypatch.setenv("DISTTUNE_PROGRESS", "0")
    assert _progress_bar(True, 10, "x") is None


def test_triton_print_autotuning_is_honoured(tmp_path, monkeypatch, capsys):
    from triton import knobs

    monkeypatch.setattr(knobs.autotuning, "print", True)
    kernel = make_kernel()

    @tuner(tmp_path, timer=TableTimer(lambda i: float(i.config_index)))
    def step(x):
        launch_add(kernel, x, torch.empty_like(x))

    step(torch.randn(64, device=DEV))
    printed = capsys.readouterr().out
    assert "Triton autotuning for function tiny_kernels.add_block" in printed and "best config selected: BLOCK: 16" in printed
