"""Launch handlers: every intercepted launch becomes a site (kernel, key, occurrence) and runs on the
arguments and grid of its own run.

Kernels run under TRITON_INTERPRET=1 on the CPU (see conftest.py); fake timers from
``tiny_kernels.TableTimer`` make the expected winners computable.
"""

from __future__ import annotations

import torch

from tiny_kernels import DEV, key_of, launch_add, make_kernel, TableTimer, tuner


def test_every_run_uses_its_own_arguments_and_grid(tmp_path):
    kernel = make_kernel()
    pairs = []

    @tuner(tmp_path, timer=TableTimer(lambda i: float(i.config_index)))
    def step(n):
        x = torch.randn(n, device=DEV)  # fresh inputs and a fresh output each run
        y = torch.full_like(x, float("nan"))
        launch_add(kernel, x, y)
        pairs.append((x, y))
        return y

    step(100)
    assert len(pairs) == step.report.function_runs == 2 + 3 * 3
    for x, y in pairs:
        assert not torch.isnan(y).any(), "a run's own output was left unwritten"
        assert any(torch.equal(y, x + b) for b in (16, 32, 64))


def test_each_kernel_key_and_occurrence_is_its_own_site(tmp_path):
    first, second = make_kernel(), make_kernel(blocks=(16, 32))
    # preferred config per (key size, occurrence); the second kernel prefers config 1
    preferred = {(64, 0): 2, (64, 1): 0, (80, 0): 1}

    def fake(info):
        wanted = preferred.get((info.key[0], info.occurrence), 1)
        return 1.0 if info.config_index == wanted else 2.0

    outputs = {}

    @tuner(tmp_path, timer=TableTimer(fake))
    def step(a, b):
        ya, yb, yc, yd = (torch.empty_like(t) for t in (a, a, b, a))
        launch_add(first, a, ya)       # key 64, occurrence 0
        launch_add(first, a, yb)       # key 64, occurrence 1
        launch_add(first, b, yc)       # key 80, occurrence 0
        launch_add(second, a, yd)      # another autotuner over the same body: key 64, occurrence 2
        outputs.update(ya=ya, yb=yb, yc=yc, yd=yd)
        return ya

    a, b = torch.randn(64, device=DEV), torch.randn(80, device=DEV)
    step(a, b)
    sites = {(r.site.key[0], r.site.occurrence): r for r in step.report.results}
    assert sorted(sites) == [(64, 0), (64, 1), (64, 2), (80, 0)]
    assert sites[(64, 0)].winner == 2 and sites[(64, 1)].winner == 0 and sites[(80, 0)].winner == 1
    assert torch.equal(outputs["ya"], a + 64) and torch.equal(outputs["yb"], a + 16)
    assert torch.equal(outputs["yc"], b + 32) and torch.equal(outputs["yd"], a + 32)
    # the fast path keeps per-occurrence winners too
    step(a, b)
    assert torch.equal(outputs["ya"], a + 64) and torch.equal(outputs["yb"], a + 16)
    # each kernel's own cache holds its first occurrence's winner
    assert first.cache[key_of(a)].kwargs["BLOCK"] == 64 and second.cache[key_of(a)].kwargs["BLOCK"] == 32
