"""Searches over a site's configs: exhaustive, screen (early_stop) and the agreed model search, in one process.

Kernels run under TRITON_INTERPRET=1; a fake timer gives every config a time from a smooth function of
its parameters, so how close the model search gets to the best config is computable.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import triton

import disttune
from disttune.report import build_report
from disttune.search import ModelSearch, config_features, propose, resolve_search
from tiny_kernels import DEV, TableTimer, add_block, grid, tuner

BLOCKS, WARPS, STAGES = (16, 32, 64, 128), (1, 2, 4, 8), (1, 2, 3)
CONFIGS = [triton.Config({"BLOCK": b}, num_warps=w, num_stages=s) for b in BLOCKS for w in WARPS for s in STAGES]


def landscape(config: triton.Config) -> float:
    """A smooth time (ms) over the parameters, best at BLOCK=64, 4 warps, 2 stages."""
    b, w, s = math.log2(config.kwargs["BLOCK"]), math.log2(config.num_warps), config.num_stages
    return 1.0 + 0.5 * (b - 6) ** 2 + 0.3 * (w - 2) ** 2 + 0.1 * (s - 2) ** 2


TIMES = [landscape(c) for c in CONFIGS]


def model_step(tmp_path, search, **options):
    kernel = triton.autotune(CONFIGS, key=["n"])(add_block)
    timer = TableTimer(lambda info: TIMES[info.config_index])
    runs = {"n": 0}

    @tuner(tmp_path, timer=timer, n_warmup=1, n_repeat=1, search=search, store=False, **options)
    def step(x):
        runs["n"] += 1
        y = torch.empty_like(x)
        kernel[grid(x.numel())](x, y, x.numel())
        return y

    return step, runs, timer


def test_config_features_scale_numbers_by_log_and_drop_constants():
    configs = [triton.Config({"BLOCK": b, "MODE": m}, num_warps=4) for b, m in ((16, "a"), (64, "b"), (32, "a"))]
    features = config_features(configs)
    # BLOCK as log2 scaled to [0, 1]; MODE one-hot (2 columns); num_warps constant, dropped
    assert features.shape == (3, 3)
    assert sorted(features[:, 0]) == [0.0, 0.5, 1.0]
    assert features[:, 1:].sum(axis=1).tolist() == [1.0, 1.0, 1.0]


def test_proposals_depend_only_on_the_observed_times_and_the_seed():
    features = config_features(CONFIGS)
    observed = {i: TIMES[i] for i in (0, 7, 20, 33, 47)}
    first = propose(features, observed, 4, np.random.default_rng(0))
    again = propose(features, dict(observed), 4, np.random.default_rng(0))
    assert first == again and len(set(first)) == 4 and not set(first) & set(observed)
    other = propose(features, {**observed, 7: 100.0}, 4, np.random.default_rng(0))
    assert other != first, "the proposals follow the observed times"


def test_search_options_are_checked_and_early_stop_is_screen():
    assert resolve_search(None, early_stop=True) == "screen"
    assert resolve_search("model") == ModelSearch()
    with pytest.raises(ValueError, match="contradicts"):
        resolve_search("model", early_stop=True)
    with pytest.raises(ValueError, match="search must be one of"):
        resolve_search("bayes")
    with pytest.raises(ValueError, match="patience"):
        ModelSearch(patience=0)
    assert disttune.contextual_autotune(early_stop=True)(lambda: None).options.search == "screen"


def test_model_search_reaches_the_best_config_in_a_quarter_of_the_runs(tmp_path):
    step, runs, timer = model_step(tmp_path, ModelSearch(batch=4, patience=2, budget=0.25, seed=3))
    x = torch.randn(64, device=DEV)
    y = step(x)
    (result,) = step.report.results
    timed = sorted({i.config_index for i in timer.seen})
    assert len(timer.seen) == len(timed), "a config is timed in one batch only"
    assert len(timed) <= math.ceil(0.25 * len(CONFIGS))
    assert TIMES[result.winner] <= 1.02 * min(TIMES)
    assert torch.equal(y, x + CONFIGS[result.winner].kwargs["BLOCK"])
    assert runs["n"] == step.report.function_runs == 1 + len(timed) * 2 + 1
    batches = step.search_trace.batches[result.site]
    assert sorted(i for b in batches for i in b) == timed and step.search_trace.mismatches == 0
    # untimed configs read "not timed" (nan), timed ones keep their agreed time
    assert all(math.isnan(result.agreed_ms[i]) for i in range(len(CONFIGS)) if i not in timed)
    assert all(result.agreed_ms[i] == TIMES[i] for i in timed)
    report = build_report(tmp_path / "logs")
    assert not report.problems, report.problems
    rows = {row.index: row for row in report.sites[0].configs}
    assert all(math.isnan(rows[i].agreed_ms) and not rows[i].failed for i in rows if i not in timed)
    assert "not timed (the search did not propose it)" in report.markdown_path.read_text()


def test_model_search_stops_on_patience(tmp_path):
    flat = [1.0] * len(CONFIGS)
    kernel = triton.autotune(CONFIGS, key=["n"])(add_block)
    timer = TableTimer(lambda info: flat[info.config_index])

    @tuner(tmp_path, timer=timer, n_warmup=0, n_repeat=1, search=ModelSearch(batch=3, patience=2, budget=1.0))
    def step(x):
        y = torch.empty_like(x)
        kernel[grid(x.numel())](x, y, x.numel())
        return y

    step(torch.randn(32, device=DEV))
    # nothing improves after the first batch: two more batches, then stop
    assert [len(b) for b in step.search_trace.batches[step.report.results[0].site]] == [3, 3, 3]


def test_screen_and_exhaustive_find_the_same_winner(tmp_path):
    results = {}
    for search in ("exhaustive", "screen"):
        step, runs, _ = model_step(tmp_path / search, search)
        step(torch.randn(64, device=DEV))
        results[search] = (step.report.results[0].winner, runs["n"])
    best = int(np.argmin(TIMES))
    assert results["exhaustive"] == (best, 1 + len(CONFIGS) * 2 + 1)
    assert results["screen"] == (best, 1 + len(CONFIGS) * 2 + 12 * 2 + 1)


def test_function_tuner_model_search(tmp_path):
    space = [{"a": a, "b": b} for a in range(8) for b in range(8)]
    cost = {(c["a"], c["b"]): 1.0 + (c["a"] - 5) ** 2 + 0.5 * (c["b"] - 2) ** 2 for c in space}
    timer = TableTimer(lambda info: cost[(info.config["a"], info.config["b"])])
    calls = []

    @disttune.autotune(space, key_fn=lambda: "k", n_warmup=0, n_repeat=1, timer=timer, cache_dir=tmp_path,
                       search=ModelSearch(batch=4, budget=0.25))
    def f(a, b):
        calls.append((a, b))
        return a, b

    assert f() == (5, 2)
    assert len(calls) <= 16 + 1
    assert f.search_trace.timed and f.search_trace.mismatches == 0


def test_function_tuner_screen(tmp_path):
    space = [{"a": a} for a in range(8)]
    timer = TableTimer(lambda info: abs(info.config["a"] - 6) + 1.0)
    calls = []

    @disttune.autotune(space, key_fn=lambda: "k", n_warmup=1, n_repeat=2, timer=timer, cache_dir=tmp_path,
                       search="screen")
    def f(a):
        calls.append(a)
        return a

    assert f() == 6
    assert len(calls) == 8 * 2 + 2 * 3 + 1


def test_model_search_over_two_sites_of_different_sizes(tmp_path):
    big = triton.autotune(CONFIGS, key=["n"])(add_block)
    small = triton.autotune([triton.Config({"BLOCK": b}, num_warps=1) for b in (16, 32, 64)], key=["n"])(add_block)
    small_times = {0: 3.0, 1: 1.0, 2: 2.0}

    # one kernel body, one key: the small kernel's launch is occurrence 0, the big one's occurrence 1
    timer = TableTimer(lambda info: small_times[info.config_index] if info.occurrence == 0 else TIMES[info.config_index])

    @tuner(tmp_path, timer=timer, n_warmup=0, n_repeat=1, store=False, search=ModelSearch(batch=4, seed=1))
    def step(x):
        y, z = torch.empty_like(x), torch.empty_like(x)
        small[grid(x.numel())](x, y, x.numel())
        big[grid(x.numel())](x, z, x.numel())
        return y, z

    x = torch.randn(64, device=DEV)
    y, z = step(x)
    by_kernel = {len(r.configs): r for r in step.report.results}
    assert by_kernel[3].winner == 1 and torch.equal(y, x + 32)
    assert TIMES[by_kernel[len(CONFIGS)].winner] <= 1.02 * min(TIMES)
    assert step.search_trace.batches[by_kernel[3].site] == [[0, 1, 2]], "the small site is done after one batch"
    assert len(step.search_trace.batches[by_kernel[len(CONFIGS)].site]) > 1
