"""The compile pool: every candidate compiled ahead on worker threads, the ranks of a node sharing the work.

Under the interpreter nothing compiles, so a recording stand-in takes ``precompile``'s place: it says
which configs were asked for, and fails one as a compile fault would.
"""

from __future__ import annotations

import threading

import pytest
import torch

from disttune import compile as compiling
from disttune import env
from disttune.comm import LocalComm
from disttune.sites import Site, SiteId
from tiny_kernels import make_kernel


@pytest.fixture
def recorded(monkeypatch):
    """(blocks asked for, on which threads); BLOCK 64 fails to compile."""
    calls: list = []

    def recording_precompile(autotuner, args, kwargs, config, device):
        calls.append((config.kwargs["BLOCK"], threading.current_thread().name))
        if config.kwargs["BLOCK"] == 64:
            raise RuntimeError("injected compile fault")
        return f"compiled BLOCK={config.kwargs['BLOCK']}"  # what the diagnostics read compiler facts from

    monkeypatch.setattr(compiling, "precompile", recording_precompile)
    monkeypatch.setattr(compiling, "can_precompile", lambda autotuner: True)
    return calls


def site_of(blocks, occurrence=0):
    kernel = make_kernel(blocks=blocks)
    return Site(SiteId("tiny_kernels.add_block", (64,), occurrence), kernel, list(kernel.configs))


def test_without_a_share_every_config_compiles_on_the_pool_and_failures_are_this_ranks(recorded):
    pool = compiling.CompilePool(2)
    site = site_of((16, 32, 64))
    futures = pool.start(site, (), {})
    assert len(futures) == 3 and all(f is not None for f in futures)
    pool.finish()
    pool.shutdown()
    assert sorted(block for block, _ in recorded) == [16, 32, 64]
    assert all(thread.startswith("disttune-compile") for _, thread in recorded)
    assert set(site.failures) == {2} and "injected compile fault" in site.failures[2]
    assert pool.compiled == {(site.id, 0): "compiled BLOCK=16", (site.id, 1): "compiled BLOCK=32"}


def test_configs_waited_for_at_their_first_launch_keep_their_compiled_kernel(recorded):
    """With the tuning runs overlapping the compiles, each launch waits for its config: the compiled
    kernel must still reach the diagnostics, and a failed compile is this rank's failure."""
    pool = compiling.CompilePool(2)
    site = site_of((16, 32, 64))
    pool.start(site, (), {})
    assert [pool.ready(site, index) for index in range(3)] == [True, True, False]
    pool.finish()
    pool.shutdown()
    assert pool.compiled == {(site.id, 0): "compiled BLOCK=16", (site.id, 1): "compiled BLOCK=32"}
    assert set(site.failures) == {2}


@pytest.mark.parametrize("rank", [0, 1])
def test_a_share_compiles_config_0_and_every_nth_config_then_the_rest_after_the_peers(recorded, rank):
    pool = compiling.CompilePool(2, share=(rank, 2))
    first, second = site_of((16, 32, 64, 128, 256)), site_of((16, 32, 64, 128), occurrence=1)
    pool.start(first, (), {})
    pool.start(second, (), {})  # the second shared site starts one further along: small sites spread out
    pool.finish()
    mine_first = [0] + [i for i in range(1, 5) if (i - 1) % 2 == rank]
    mine_second = [0] + [i for i in range(1, 4) if (i - 1 + 1) % 2 == rank]
    expected = sorted([first.configs[i].kwargs["BLOCK"] for i in mine_first]
                      + [second.configs[i].kwargs["BLOCK"] for i in mine_second])
    assert sorted(block for block, _ in recorded) == expected
    recorded.clear()
    rest = [first.configs[i].kwargs["BLOCK"] for i in range(5) if i not in mine_first]
    pool.compile_rest([first])  # the second site was decided without tuning: nothing more for it
    pool.shutdown()
    assert sorted(block for block, _ in recorded) == sorted(rest)
    assert 2 in first.failures, "BLOCK 64 failed, in this rank's share or in the rest"


def test_compile_share_is_the_nodes_where_the_launcher_says(monkeypatch):
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE",
                 "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "PMIX_LOCAL_RANK", "PMIX_LOCAL_SIZE", "SLURM_LOCALID",
                 "SLURM_STEP_TASKS_PER_NODE"):
        monkeypatch.delenv(name, raising=False)
    assert compiling.compile_share(LocalComm()) == (0, 1), "no launcher: the communicator's ranks"
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert compiling.compile_share(LocalComm()) == (3, 4)


def test_no_compile_threads_under_the_interpreter():
    interpreted = env.interpreting()
    assert (compiling.default_compile_threads() == 0) == (interpreted or not torch.cuda.is_available())
    assert compiling.can_precompile(make_kernel()) == (not interpreted)
