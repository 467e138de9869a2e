"""CUDA graphs of a tuned step (``disttune.graphs``, ``contextual_autotune(cuda_graph=True)``): which call runs
eagerly, which captures, which replays, and what a replay returns.

Without a GPU the capture is played by ``graph_standins.ReplayByRerun``, whose replay reruns the step on the
graph's own inputs (so missing copies and aliased results show as stale values). A capture that fails on one
rank of several runs in ``tests/dist_cases.py`` (``test_contextual_dist.py``). The real capture runs in the GPU
tests (``tests/test_moe.py``, the graph case).
"""

from __future__ import annotations

import pytest
import torch

import disttune
from disttune import graphs
from disttune.graphs import StepGraphs
from graph_standins import ReplayByRerun
from tiny_kernels import DEV, counting_step, make_kernel


def eager(args, kwargs):
    x, = args
    return {"doubled": x * 2, "scale": kwargs.get("scale", 1)}


def test_first_call_runs_second_captures_later_ones_replay_on_their_own_inputs():
    step_graphs = StepGraphs("step", capture=ReplayByRerun())
    outs = [step_graphs(eager, (torch.full((4,), float(i)),), {"scale": 3}) for i in range(4)]
    assert [out["doubled"].tolist() for out in outs] == [[2.0 * i] * 4 for i in range(4)]
    assert (step_graphs.captures, step_graphs.replays, len(step_graphs)) == (1, 3, 1)
    assert outs[2]["doubled"].data_ptr() != outs[3]["doubled"].data_ptr(), "results are clones, not the graph's"
    assert all(out["scale"] == 3 for out in outs)


def test_each_signature_gets_its_own_graph_and_unhashable_arguments_run_eagerly():
    step_graphs = StepGraphs("step", capture=ReplayByRerun(), capacity=2)
    for _ in range(3):
        for shape in ((4,), (8,), (2, 2)):  # three signatures, room for two graphs
            step_graphs(eager, (torch.ones(shape),), {})
    # first round eager, second captured (the third capture drops the first graph), third: (4,) eager again
    assert (step_graphs.captures, step_graphs.replays, len(step_graphs)) == (3, 3 + 2, 2)
    for n in range(10, 30):  # signatures met once do not push graphs out
        step_graphs(eager, (torch.ones(n),), {})
    step_graphs(eager, (torch.ones(8),), {}), step_graphs(eager, (torch.ones(2, 2),), {})
    assert (step_graphs.captures, step_graphs.replays) == (3, 7)
    dtypes = StepGraphs("step", capture=ReplayByRerun())
    for _ in range(3):
        dtypes(eager, (torch.ones(4),), {})
        dtypes(eager, (torch.ones(4, dtype=torch.float64),), {})
    assert dtypes.replays == 2 * 2
    unhashable = StepGraphs("step", capture=ReplayByRerun())
    for _ in range(3):
        out = unhashable(eager, (torch.ones(2),), {"scale": {1, 2}})  # a set: a leaf, not hashable
        assert out["scale"] == {1, 2}
    assert (unhashable.captures, unhashable.replays) == (0, 0)


def test_arguments_the_step_writes_into_see_the_writes_and_shared_or_grad_arguments_run_eagerly():
    def fill(args, kwargs):
        x, out = args
        out.copy_(x * 3)
        return out.sum()

    step_graphs = StepGraphs("step", capture=ReplayByRerun())
    for i in range(4):
        x, out = torch.full((4,), float(i)), torch.zeros(4)
        total = step_graphs(fill, (x, out), {})
        assert out.tolist() == [3.0 * i] * 4 and total.item() == 12.0 * i
    assert (step_graphs.captures, step_graphs.replays) == (1, 3)
    shared = torch.ones(8)
    for _ in range(3):  # two views of one tensor: a graph's clones would not share it
        step_graphs(fill, (shared[:4], shared[4:]), {})
    needs_grad = torch.ones(4, requires_grad=True)
    for _ in range(3):
        step_graphs(eager, (needs_grad,), {})
    assert (step_graphs.captures, step_graphs.replays) == (1, 3)


def test_keyword_order_does_not_matter_and_results_holding_objects_run_eagerly():
    step_graphs = StepGraphs("step", capture=ReplayByRerun())
    for i in range(3):
        kwargs = {"scale": 2, "bias": 1} if i % 2 else {"bias": 1, "scale": 2}
        step_graphs(lambda args, kw: args[0] * kw["scale"] + kw["bias"], (torch.ones(2),), kwargs)
    assert (step_graphs.captures, step_graphs.replays) == (1, 2)

    class Holder:
        def __init__(self, tensor):
            self.tensor = tensor

    objects = StepGraphs("step", capture=ReplayByRerun())
    results = [objects(lambda args, kw: Holder(args[0] + 1), (torch.full((2,), float(i)),), {}) for i in range(4)]
    assert [r.tensor.tolist() for r in results] == [[1.0 + i] * 2 for i in range(4)]
    assert len({id(r.tensor) for r in results}) == 4 and objects.replays == 0


def test_a_capture_that_fails_says_what_a_replayed_step_must_not_do():
    def syncing(step):
        raise RuntimeError("operation not permitted when stream is capturing")

    step_graphs = StepGraphs("layer_step", capture=syncing)
    step_graphs(eager, (torch.ones(2),), {})
    with pytest.raises(RuntimeError, match=r"capturing layer_step in a CUDA graph failed .*must not synchronize"):
        step_graphs(eager, (torch.ones(2),), {})
    assert step_graphs(eager, (torch.ones(2),), {})["doubled"].tolist() == [2.0, 2.0], "then it runs as it is"
    assert len(step_graphs) == 0


def test_cuda_graph_needs_a_gpu_and_a_bool(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # kernels on the CPU, even where there is a GPU
    why = "Triton runs in its interpreter" if torch.cuda.is_available() else "there is no CUDA GPU here"
    with pytest.raises(ValueError, match=f"cuda_graph=True, but {why}"):
        disttune.contextual_autotune(cuda_graph=True)(lambda: None)
    with pytest.raises(TypeError, match="cuda_graph must be True or False"):
        disttune.contextual_autotune(cuda_graph="yes")(lambda: None)
    with pytest.raises(TypeError, match="no option cuda_graph="):
        disttune.autotune([{}], key_fn=lambda: 0, cuda_graph=True)(lambda: None)


@pytest.fixture
def replayed_step(tmp_path, monkeypatch):
    """A step wrapped with ``cuda_graph=True`` launching ``add_block`` on its argument, its graphs captured by
    ``ReplayByRerun``."""
    capture = ReplayByRerun()
    monkeypatch.setattr(graphs, "why_unavailable", lambda: "")
    monkeypatch.setattr(graphs, "CudaGraphCapture", lambda: capture)
    step, _ = counting_step(tmp_path, make_kernel(blocks=(16, 32)), cuda_graph=True)
    return step


def test_the_wrapper_replays_its_winners_after_tuning_and_drops_its_graphs_when_it_tunes_again(replayed_step):
    step = replayed_step
    values = [torch.full((64,), float(i), device=DEV) for i in range(4)]
    first = step(values[0])  # the tuning call: the signature's first call
    block = step.report.results[0].config.kwargs["BLOCK"]
    outs = [step(v) for v in values[1:]]
    assert torch.equal(first, values[0] + block)
    assert all(torch.equal(out, v + block) for out, v in zip(outs, values[1:]))
    assert (step.graphs.captures, step.graphs.replays) == (1, 3)
    step.retune()
    assert len(step.graphs) == 0
    report = step.report
    step(values[0])
    assert step.report is not report, "retune() makes the next call a tuning call"
    step(values[1]), step(values[2])
    assert (step.graphs.captures, step.graphs.replays) == (2, 5)


def test_a_new_shape_after_replays_is_tuned_and_every_graph_is_captured_again(replayed_step):
    step = replayed_step
    small, large = torch.zeros(64, device=DEV), torch.zeros(256, device=DEV)
    for x in (small, small, small):  # tuned, captured, replayed
        step(x)
    assert (step.graphs.captures, step.graphs.replays, len(step.graphs)) == (1, 2, 1)
    report = step.report
    small_block = report.results[0].config.kwargs["BLOCK"]
    with pytest.warns(RuntimeWarning, match="not tuned for") as warned:
        first_large = step(large)  # a new signature runs eagerly; its new key makes the next call tune
    assert warned[0].filename == __file__, "the warning names the caller's line, not disttune's"
    assert step.report is report and step.graphs.replays == 2
    step(large)  # the tuning call for the new key: every graph goes, with the winners it captured
    assert step.report is not report and len(step.graphs) == 0
    outs = [step(x) for x in (large, large, small, small, small)]
    (large_site,) = step.report.results
    blocks = {64: small_block, 256: large_site.config.kwargs["BLOCK"]}
    assert torch.equal(first_large, large + 16), "the untuned key ran its first config"
    assert all(torch.equal(out, x + blocks[x.numel()]) for out, x in zip(outs, (large, large, small, small, small)))
    assert (step.graphs.captures, step.graphs.replays) == (3, 6)  # small runs eagerly once more after the drop
