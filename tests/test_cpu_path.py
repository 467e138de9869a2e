"""The first hour on a machine without a GPU: the README's example runs as written, a launch picks Triton's
interpreter by itself, a script that forgot it fails at once with one line, and every process exits cleanly."""

from __future__ import annotations

import re
import sys

import pytest
import torch

from helpers import REPO_ROOT, describe, repo_env, run_command, spawn_ranks, write_script

needs_no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="what a machine without a GPU does")


def readme_example() -> str:
    """The README's example, as a user copies it: the first Python block under "## Example"."""
    text = (REPO_ROOT / "README.md").read_text()
    section = text[text.index("## Example"):]
    return re.search(r"```python\n(.*?)```", section, flags=re.S).group(1)


def cpu_env(**extra: str) -> dict[str, str]:
    """The tests' environment without the interpreter switch: what a user's shell holds."""
    env = repo_env(extra)
    env.pop("TRITON_INTERPRET", None)
    return env


@needs_no_gpu
def test_the_readme_example_runs_on_two_cpu_ranks_as_written(tmp_path):
    script = write_script(tmp_path, readme_example() + "print(f'rank {info.rank}: out {tuple(out.shape)}')\n",
                          "example.py")
    proc = run_command(["bash", "scripts/launch.sh", "--nproc_per_node=2", str(script)], timeout=300,
                       env=cpu_env(DISTTUNE_CACHE_DIR=str(tmp_path / "store")))
    assert proc.returncode == 0, describe(proc)
    assert "rank 0: out (128, 64)" in proc.stdout and "rank 1: out (128, 64)" in proc.stdout, describe(proc)
    assert "terminate called" not in proc.stderr and "Traceback" not in proc.stderr, describe(proc)


@needs_no_gpu
def test_launch_sh_picks_the_interpreter_without_a_gpu(tmp_path):
    script = write_script(tmp_path, "import os; print('TRITON_INTERPRET=' + os.environ.get('TRITON_INTERPRET', ''))\n")
    proc = run_command(["bash", "scripts/launch.sh", "--nproc_per_node=1", str(script)], timeout=120, env=cpu_env())
    assert proc.returncode == 0 and "TRITON_INTERPRET=1" in proc.stdout, describe(proc)
    assert "no GPU here: Triton's kernels run in its CPU interpreter (TRITON_INTERPRET=1)" in proc.stderr


FORGOT = """
    import sys
    sys.path.insert(0, {tests!r})
    import torch, disttune
    from tiny_kernels import launch_add, make_kernel

    kernel = make_kernel()
    x = torch.randn(64)

    @disttune.contextual_autotune(verbose=False)
    def step():
        launch_add(kernel, x, torch.empty_like(x))

    step()
"""


@needs_no_gpu
def test_a_script_without_the_interpreter_fails_at_once_in_one_line(tmp_path):
    script = write_script(tmp_path, FORGOT.format(tests=str(REPO_ROOT / "tests")))
    proc = run_command([sys.executable, str(script)], timeout=120, env=cpu_env())
    assert proc.returncode == 1
    (line,) = proc.stderr.strip().splitlines()  # disttune's one line, no traceback
    assert line.startswith("disttune: RuntimeError: ") and line.endswith("(DISTTUNE_TRACEBACK=1 prints the traceback)")
    assert "TRITON_INTERPRET=1" in line and "no GPU driver" in line, describe(proc)
    assert "active drivers" not in proc.stderr, "the error is ours, not every config's"


EXIT_SCRIPT = """
    import os, torch
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import sys
    sys.path.insert(0, {tests!r})
    import disttune
    from tiny_kernels import launch_add, make_kernel

    info = disttune.dist.init()
    kernel = make_kernel()
    x = torch.randn(64)

    @disttune.contextual_autotune(is_dist=True, verbose=False, n_warmup=0, n_repeat=1)
    def step():
        launch_add(kernel, x, torch.empty_like(x))

    step()
    print(f"rank {{info.rank}} done", flush=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(3000)  # a hundred 2-rank launches, each bounded by its own 120 s: not a budget, a bound
@needs_no_gpu
def test_a_script_without_teardown_exits_cleanly_a_hundred_times(tmp_path):
    """No destroy() in the script: disttune.dist.init() registered its own teardown. The ranks are started by
    hand (no launcher process to pay for) and tune from the store after the first run."""
    script = write_script(tmp_path, EXIT_SCRIPT.format(tests=str(REPO_ROOT / "tests")))
    env = cpu_env(DISTTUNE_CACHE_DIR=str(tmp_path / "store"), DISTTUNE_LOG_DIR=str(tmp_path / "logs"))
    bad = []
    for _ in range(100):
        for rank, proc in enumerate(spawn_ranks(2, [str(script)], timeout=120, env=env)):
            if proc.returncode != 0 or f"rank {rank} done" not in proc.stdout or "terminate called" in proc.stderr:
                bad.append(f"rank {rank}: exit {proc.returncode}\n{proc.stdout[-500:]}\n{proc.stderr[-1500:]}")
    assert not bad, f"{len(bad)} rank exits of 200 were not clean; the first:\n{bad[0]}"
