"""Keys met after tuning: served on a rank-independent fallback (``on_new_key``), logged, never tuned in traffic."""

import json

import pytest
import torch

from disttune import store as stores
from disttune.report import build_report
from disttune.unseen import UnseenKeyError
from tiny_kernels import DEV, TableTimer, launch_add, make_kernel, tuner


def _step(tmp_path, kernel, **options):
    options.setdefault("timer", TableTimer(lambda i: {0: 2.0, 1: 1.0, 2: 3.0}[i.config_index]))

    @tuner(tmp_path, **options)
    def step(x):
        y = torch.empty_like(x)
        launch_add(kernel, x, y)
        return y

    return step


def test_nearest_serves_a_new_key_with_the_nearest_winner_and_never_tunes(tmp_path):
    kernel = make_kernel(blocks=(16, 32, 64))
    runs = []
    step = _step(tmp_path, kernel, on_new_key="nearest")
    x = torch.randn(64, device=DEV)
    assert torch.equal(step(x), x + 32)  # tuned: BLOCK=32 wins
    for n in (80, 100, 80):
        z = torch.randn(n, device=DEV)
        assert torch.equal(step(z), z + 32)  # the nearest tuned key (64)'s winner
        runs.append(step.tuned)
    assert all(runs) and (100, "torch.float32", "torch.float32") not in kernel.cache
    served = step.fallbacks
    assert len(served) == 2 and all("nearest tuned key (64," in text for text in served.values()), served
    events = [json.loads(line) for path in (tmp_path / "logs").glob("rank-*.log")
              for line in path.read_text().splitlines() if line.startswith("{")]
    fallbacks = [e for e in events if e["event"] == "fallback"]
    assert sorted(e["key"] for e in fallbacks) == sorted([repr((80, "torch.float32", "torch.float32")),
                                                          repr((100, "torch.float32", "torch.float32"))])
    report = build_report(tmp_path / "logs")
    text = report.markdown_path.read_text()
    assert report.problems == [] and "## Keys served by a fallback" in text
    assert "(100, 'torch.float32', 'torch.float32')" in text and "nearest tuned key (64," in text


def test_nearest_without_a_candidate_serves_the_first_config_and_best_config_follows(tmp_path):
    kernel = make_kernel(blocks=(16, 32, 64))
    step = _step(tmp_path, kernel, on_new_key="nearest")
    step(torch.randn(64, device=DEV))
    assert kernel.best_config.kwargs["BLOCK"] == 32  # the tuned winner
    z = torch.randn(64, device=DEV, dtype=torch.float16)  # another dtype: no candidate
    assert torch.equal(step(z), z + 16)
    assert "first config" in next(iter(step.fallbacks.values()))
    assert kernel.best_config.kwargs["BLOCK"] == 16, "best_config names the config last chosen: the fallback's"


def test_error_refuses_a_new_key_before_launching(tmp_path):
    kernel = make_kernel()
    step = _step(tmp_path, kernel, on_new_key="error")
    step(torch.randn(64, device=DEV))
    with pytest.raises(UnseenKeyError, match="on_new_key='error'"):
        step(torch.randn(80, device=DEV))
    x = torch.randn(64, device=DEV)
    assert torch.equal(step(x), x + 32) and step.tuned


def test_nearest_with_a_pinned_table_serves_keys_the_table_lacks(tmp_path):
    kernel = make_kernel(blocks=(16, 32, 64))
    step = _step(tmp_path, kernel, cache_dir=tmp_path / "store")
    step(torch.randn(64, device=DEV))
    table = tmp_path / "table.json"
    assert stores.export_table(table, tmp_path / "store") == 1
    deployed = make_kernel(blocks=(16, 32, 64))
    served = _step(tmp_path, deployed, pinned=table, on_new_key="nearest",
                   timer=TableTimer(lambda i: pytest.fail("a pinned deployment never times")))
    z = torch.randn(100, device=DEV)
    assert torch.equal(served(z), z + 32)
    assert "pinned table's nearest tuned key (64," in next(iter(served.fallbacks.values()))
    with pytest.raises(Exception, match="has no winner"):
        _step(tmp_path, make_kernel(), pinned=table, on_new_key="error")(torch.randn(100, device=DEV))


def test_a_pinned_tuner_keeps_a_key_the_table_lacks_on_its_fallback_under_tune(tmp_path):
    """A pinned table is never re-tuned: with the default on_new_key="tune" a new key stays on its fallback."""
    kernel = make_kernel(blocks=(16, 32, 64))
    _step(tmp_path, kernel, cache_dir=tmp_path / "store")(torch.randn(64, device=DEV))
    table = tmp_path / "table.json"
    assert stores.export_table(table, tmp_path / "store") == 1
    served = _step(tmp_path, make_kernel(blocks=(16, 32, 64)), pinned=table,
                   timer=TableTimer(lambda i: pytest.fail("a pinned deployment never times")))
    x = torch.randn(64, device=DEV)
    assert torch.equal(served(x), x + 32)
    for _ in range(3):  # the same new key, again and again: served, never tuned, never an error
        z = torch.randn(100, device=DEV)
        assert torch.equal(served(z), z + 32) and served.tuned
    assert "nearest tuned key (64," in next(iter(served.fallbacks.values()))


@pytest.mark.parametrize("bad", [{"on_new_key": "guess"}, {"agree_every": 0}, {"agree_every": True}])
def test_bad_new_key_options_are_refused(tmp_path, bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        tuner(tmp_path, **bad)(lambda: None)
