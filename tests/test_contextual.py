"""contextual_autotune end to end in one process (no torch.distributed): run counts, the statistic,
caches, early stopping, split on one rank.

Kernels run under TRITON_INTERPRET=1 on the CPU (see conftest.py); fake timers from
``tiny_kernels.TableTimer`` make the expected winners computable.
"""

from __future__ import annotations

import torch

from tiny_kernels import DEV, counting_step, device, key_of, launch_add, make_kernel, TableTimer, tuner


def test_host_timer_by_default_and_counts_and_statistic(tmp_path):
    kernel = make_kernel()

    @tuner(tmp_path, n_warmup=2, n_repeat=3)
    def step(x):
        y = torch.empty_like(x)
        launch_add(kernel, x, y)
        return y

    step(torch.randn(64, device=DEV))
    (result,) = step.report.results
    assert all(0 < t < float("inf") for t in result.agreed_ms)
    assert step.report.function_runs == 2 + 3 * (2 + 3)

    samples = {0: [5.0, 1.0, 1.0], 1: [2.0, 2.0, 2.0]}
    calls = {}

    def fake(info):
        n = calls.get(info.config_index, 0)
        calls[info.config_index] = n + 1
        return samples[info.config_index][n]

    fresh = make_kernel(blocks=(16, 32))

    def run(statistic):
        calls.clear()
        fresh.cache.clear()

        @tuner(tmp_path, n_warmup=0, n_repeat=3, timer=TableTimer(fake), statistic=statistic, store=False)
        def g(x):
            launch_add(fresh, x, torch.empty_like(x))

        g(torch.randn(32, device=DEV))
        return g.report.results[0]

    assert run("median").winner == 0          # median 1.0 vs 2.0
    assert run("mean").winner == 1           # mean 2.33 vs 2.0
    assert run(max).winner == 1              # a callable statistic: worst sample 5.0 vs 2.0


def test_single_process_needs_no_torch_distributed(tmp_path):
    assert not torch.distributed.is_initialized()
    kernel = make_kernel()
    timer = TableTimer(lambda i: {0: 2.0, 1: 3.0, 2: 1.0}[i.config_index])
    step, runs = counting_step(tmp_path, kernel, timer=timer)

    x = torch.randn(64, device=DEV)
    y = step(x)
    assert runs["n"] == step.expected_runs(3) == 11
    assert len(timer.seen) == 3 * 2, "only the n_repeat runs after the n_warmup ones are timed"
    assert torch.equal(y, x + 64) and kernel.cache[key_of(x)].kwargs["BLOCK"] == 64
    step(x)
    assert runs["n"] == 12
    step.retune()
    step(x)
    assert runs["n"] == 12 + 1, "winners already in the kernel's cache are reused: one discovery run only"
    assert step.report.results[0].source == "cached"


def test_device_helper_is_cpu_here():
    assert device().type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_same_kernel_wrapped_by_two_functions_tuned_once(tmp_path):
    kernel = make_kernel()
    timer = TableTimer(lambda i: {0: 2.0, 1: 1.0, 2: 3.0}[i.config_index])
    x = torch.randn(64, device=DEV)

    def body():
        y = torch.empty_like(x)
        launch_add(kernel, x, y)
        return y

    first, second = tuner(tmp_path, timer=timer)(body), tuner(tmp_path, timer=timer)(body)
    first()
    timed = len(timer.seen)
    assert torch.equal(second(), x + 32)
    assert len(timer.seen) == timed and second.report.results[0].source == "cached"


def test_early_stopping_screens_then_tunes_the_best_quarter(tmp_path):
    blocks = tuple(16 << i for i in range(8))
    kernel = make_kernel(blocks=blocks)
    table = [5.0, 4.0, 1.0, 6.0, 2.0, 7.0, 8.0, 3.0]
    timer = TableTimer(lambda i: table[i.config_index])
    step, runs = counting_step(tmp_path, kernel, timer=timer, early_stop=True)

    x = torch.randn(64, device=DEV)
    y = step(x)
    (result,) = step.report.results
    assert result.winner == 2 and torch.equal(y, x + 64)
    # 1 discovery + 8 configs x (1 warm-up + 1 timed) + 2 survivors x (1 + 2) + 1 final
    assert runs["n"] == step.report.function_runs == 1 + 8 * 2 + 2 * 3 + 1
    screening, full = timer.seen[:8], timer.seen[8:]
    assert sorted(i.config_index for i in screening) == list(range(8))
    assert sorted({i.config_index for i in full}) == [2, 4] and len(full) == 2 * 2
    assert list(result.agreed_ms) == table, "screened-out configs keep their agreed screening time"


def test_split_on_one_rank_is_plain_tuning(tmp_path):
    kernel = make_kernel()
    timer = TableTimer(lambda i: {0: 2.0, 1: 3.0, 2: 1.0}[i.config_index])
    step, runs = counting_step(tmp_path, kernel, timer=timer, split=True)
    x = torch.randn(64, device=DEV)
    assert torch.equal(step(x), x + 64)
    (result,) = step.report.results
    assert runs["n"] == 11 and not result.split and result.per_rank_ms == ((2.0, 3.0, 1.0),)


def test_a_tuned_kernel_carries_what_triton_autotune_leaves_on_it(tmp_path):
    """best_config, cache, configs_timings (agreed ms, then this rank's 20th and 80th percentile) and bench_time,
    as Triton sets them after benchmarking; the report prints as a table with the named key."""
    kernel = make_kernel()
    times = {0: 3.0, 1: 2.0, 2: 1.0}

    @tuner(tmp_path, n_warmup=1, n_repeat=3, timer=TableTimer(lambda info: times[info.config_index]), store=False)
    def step(x):
        launch_add(kernel, x, torch.empty_like(x))

    assert not hasattr(kernel, "best_config")
    step(torch.randn(64, device=DEV))
    (result,) = step.report.results
    assert kernel.best_config is result.config is kernel.configs[2]
    assert kernel.cache[result.site.key] is result.config
    assert {id(config): timings for config, timings in kernel.configs_timings.items()} == {
        id(config): [times[c]] * 3 for c, config in enumerate(kernel.configs)}
    assert min(kernel.configs_timings, key=kernel.configs_timings.get) is kernel.best_config  # Triton's own pick
    assert 0 < kernel.bench_time <= step.report.wall_s
    text = str(step.report)
    assert "| kernel | key | winner | agreed ms | from |" in text
    assert "| tiny_kernels.add_block | n=64 dtype=float32 | BLOCK=64 w1 s3 | 1.0000 | tuned |" in text
