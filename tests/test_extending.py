"""docs/extending.md's recipes, run as written there: each one's code, placed where the recipe says, works.

A registry recipe's code runs in the namespace of the one module it names (as if its line were added
there); the communicator's and the shipped kernel's run in a module of their own, beside the library.
Kernels run under TRITON_INTERPRET=1 on the CPU (see conftest.py); ``TableTimer`` makes the expected
winners computable.
"""

from __future__ import annotations

import importlib.util
import re
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import disttune
from disttune import agreement, search, sites, unseen
from tiny_kernels import DEV, TableTimer, key_of, launch_add, make_kernel, tuner

RECIPES = Path(__file__).resolve().parents[1] / "docs" / "extending.md"


def recipe(title: str) -> tuple[str, list[str]]:
    """The first Python block under the heading ``## title`` and the files its ``Files:`` line names."""
    text = RECIPES.read_text(encoding="utf-8")
    section = text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]
    files = re.findall(r"`([\w./]+\.py)`", section.split("Files:", 1)[1].split("\n\n", 1)[0])
    return section.split("```python\n", 1)[1].split("```", 1)[0], files


@pytest.fixture
def registries():
    """Every registry as it was before the test (a recipe adds to the real table, as its line would)."""
    tables = [sites.STATISTICS, agreement.REDUCERS, search.SEARCHES, unseen.NEW_KEY_POLICIES]
    saved = [dict(table) for table in tables]
    yield
    for table, before in zip(tables, saved):
        table.clear()
        table.update(before)


def add_line(title: str, module) -> None:
    """Run the recipe's code in ``module``'s namespace: what adding it to that file does."""
    code, files = recipe(title)
    assert files[:1] == [module.__name__.replace(".", "/") + ".py"], f"the recipe names {files}"
    exec(compile(code, f"{RECIPES.name}: {title}", "exec"), {**vars(module)})


def test_a_new_statistic(tmp_path, registries):
    add_line("A new statistic", sites)
    samples = {0: [1.0, 1.0, 1.0, 1.0, 10.0], 1: [2.0] * 5}  # config 0 has the better median, config 1 the better p90
    winners = {}
    for statistic in ("median", "p90"):
        kernel = make_kernel(blocks=(16, 32))

        @tuner(tmp_path, n_warmup=0, n_repeat=5, statistic=statistic, store=False,
               timer=TableTimer(lambda info: samples[info.config_index][info.run % 5]))
        def step(x):
            launch_add(kernel, x, torch.empty_like(x))

        step(torch.randn(64, device=DEV))
        winners[statistic] = step.report.results[0].winner
    assert winners == {"median": 0, "p90": 1}


def test_a_new_reduction(registries):
    add_line("A new reduction over ranks", agreement)
    per_rank = np.array([[1.0, 5.0], [2.0, 1.0], [9.0, 2.0]])  # max would pick config 0, the median config 1
    assert list(agreement.agree(per_rank, "median")) == [2.0, 2.0]
    assert list(agreement.agree(per_rank, "max")) == [9.0, 5.0]
    disttune.autotune([{"a": 1}], key_fn=lambda: 0, reduce="median")(lambda *, a: a)  # the option accepts it


def test_a_new_search(tmp_path, registries):
    add_line("A new search", search)
    kernel = make_kernel(blocks=(16, 32, 64, 128))
    runs = {"n": 0}

    @tuner(tmp_path, n_warmup=1, n_repeat=2, search="first_half",
           timer=TableTimer(lambda info: [3.0, 2.0, 1.0, 0.5][info.config_index]))
    def step(x):
        runs["n"] += 1
        launch_add(kernel, x, torch.empty_like(x))

    step(torch.randn(64, device=DEV))
    assert step.report.results[0].winner == 1, "only the first half could win"
    assert runs["n"] == 2 + 2 * (1 + 2)


def test_a_new_policy_for_keys_met_after_tuning(tmp_path, registries):
    add_line("A new policy for keys met after tuning", unseen)
    kernel = make_kernel(blocks=(16, 32, 64))

    @tuner(tmp_path, n_warmup=0, n_repeat=1, on_new_key="first",
           timer=TableTimer(lambda info: [3.0, 2.0, 1.0][info.config_index]))
    def step(x):
        y = torch.empty_like(x)
        launch_add(kernel, x, y)
        return y

    step(torch.randn(64, device=DEV))
    assert step.report.results[0].winner == 2
    x = torch.zeros(100, device=DEV)
    assert torch.equal(step(x), x + 16), "the new key ran on the first config, not the tuned key's winner"
    assert "first config" in next(iter(step.fallbacks.values()))
    assert key_of(x) not in kernel.cache


def load_module(tmp_path: Path, name: str, code: str):
    path = tmp_path / f"{name}.py"
    path.write_text(code, encoding="utf-8")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_a_new_communicator(tmp_path):
    code, files = recipe("A new communicator")
    assert files == [], "it touches no file of the library"
    comms = load_module(tmp_path, "thread_comm", "import numpy as np\n\n" + code)
    slots, gate = [None, None], threading.Barrier(2, timeout=30)  # a hang fails the test
    own = {0: [1.0, 3.0, 2.0], 1: [3.0, 1.0, 2.0]}  # alone each rank would pick another config; max picks 2
    outcomes = [None, None]

    def rank_main(rank):
        @disttune.autotune([{"choice": c} for c in range(3)], key_fn=lambda: 0, n_warmup=0, n_repeat=1,
                           group=comms.ThreadComm(rank, slots, gate), store=False,
                           timer=TableTimer(lambda info: own[rank][info.config_index]))
        def pick(*, choice):
            return choice

        try:
            outcomes[rank] = pick()
        except Exception as err:  # the outcome under test
            outcomes[rank] = err

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not any(thread.is_alive() for thread in threads), "a rank hung"
    assert outcomes == [2, 2], outcomes


def test_a_new_shipped_kernel(tmp_path):
    code, files = recipe("A new shipped kernel")
    assert all(not f.startswith("disttune/") for f in files) and "kernels/scale_rows.py" in files
    kernels = load_module(tmp_path, "scale_rows", code)

    @tuner(tmp_path, n_warmup=0, n_repeat=1, timer=TableTimer(lambda info: 1.0 if info.config_index == 3 else 2.0))
    def step(x, scale):
        return kernels.scale_rows(x, scale)

    x, scale = torch.randn(4, 300, device=DEV), torch.randn(4, device=DEV)
    torch.testing.assert_close(step(x, scale), x * scale[:, None])
    (result,) = step.report.results
    assert result.winner == 3 and result.site.kernel.endswith("scale_rows_kernel")
