"""GPU checks: NCCL, CUDA events, the AG-GEMM example tuned in context on two GPUs, and ``check=`` against a
config of the shard GEMM that reads shards a side stream is still delivering.

Skipped on machines without CUDA GPUs (CI); run on a GPU machine with ``bash scripts/gpu_check.sh``.
The rest of the suite also runs there, under NCCL.
"""

from __future__ import annotations

import re
import statistics
import time

import pytest
import torch

from disttune.timing import CudaEventTimer, default_timer
from helpers import describe, failure, run_cases, run_launch

needs_two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_events_are_the_default_timer():
    assert isinstance(default_timer(), CudaEventTimer)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_launch_issued_slowly_on_an_idle_stream_is_timed_at_its_gpu_time():
    """The host takes 1 ms to issue a 2-element add on an idle stream: from the second timing of the site on, the
    sleep before the start event covers that, so the time is the kernel's (µs), not the host's (1 ms)."""
    from disttune.timing import LaunchInfo

    x = torch.ones(2, device="cuda")

    def slow_to_issue():
        time.sleep(1e-3)
        x.add_(1)

    timer, info = CudaEventTimer(), LaunchInfo("add", (2,), 0, 0, None, 0, 0)
    torch.cuda.synchronize()
    readers = [timer.time(slow_to_issue, info) for _ in range(4)]
    times = [read() for read in readers]
    assert max(times[1:]) < 0.3, f"host time counted as GPU time: {times} ms"
    assert x[0].item() == 5.0


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("launcher", [["--nproc_per_node=2"], ["--mpi", "-n", "2"]])
def test_ag_gemm_tuned_in_context_with_the_12_config_space(launcher, tmp_path):
    proc = run_launch([*launcher, "examples/ag_gemm.py", "--M", "8192", "--K", "8192", "--N", "8192"], timeout=540,
                      extra_env={"DISTTUNE_CACHE_DIR": str(tmp_path / "store")})
    assert proc.returncode == 0, describe(proc)
    assert "correct on every rank: True" in proc.stdout, describe(proc)
    rows = re.findall(r"^BLOCK_M=.*$", proc.stdout, flags=re.M)
    assert len(rows) == 2 * 12, describe(proc)  # decomposed design: one GEMM site per shard
    assert sum("<- winner" in row for row in rows) == 2
    assert re.search(r"NCCL all-gather then cuBLAS: [0-9.]+ ms", proc.stdout), describe(proc)
    print(proc.stdout)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_ag_gemm_demo_on_one_gpu_then_from_the_store(tmp_path):
    env = {"DISTTUNE_CACHE_DIR": str(tmp_path / "store")}
    shape = ["--M", "4096", "--K", "4096", "--N", "4096", "--samples", "10"]
    first = run_launch(["--nproc_per_node=1", "examples/ag_gemm.py", *shape], timeout=540, extra_env=env)
    second = run_launch(["--nproc_per_node=1", "examples/ag_gemm.py", *shape], timeout=540, extra_env=env)
    for proc in (first, second):
        assert proc.returncode == 0 and "correct on every rank: True" in proc.stdout, describe(proc)
        assert "one GPU: there is no communication to overlap" in proc.stdout, describe(proc)
    rows = re.findall(r"^BLOCK_M=.*$", first.stdout, flags=re.M)
    assert len(rows) >= 2 and sum("<- winner" in row for row in rows) == 1, describe(first)
    assert "winner from the store (no tuning)" in second.stdout, describe(second)
    print(first.stdout, second.stdout)


@pytest.mark.gpu
@needs_two_gpus
def test_second_launch_starts_without_tuning(tmp_path):
    env = {"DISTTUNE_CACHE_DIR": str(tmp_path / "store")}
    shape = ["--M", "8192", "--K", "8192", "--N", "8192"]
    first = run_launch(["--nproc_per_node=2", "examples/ag_gemm.py", *shape], timeout=540, extra_env=env)
    second = run_launch(["--nproc_per_node=2", "examples/ag_gemm.py", *shape], timeout=540, extra_env=env)
    for proc in (first, second):
        assert proc.returncode == 0 and "correct on every rank: True" in proc.stdout, describe(proc)
    assert "winner from the store (no tuning)" in second.stdout, describe(second)
    timings = [re.search(r"tuning call: ([0-9.]+) s, (\d+) runs", p.stdout).groups() for p in (first, second)]
    assert timings[1][1] == "2", "a store hit costs the discovery run and the final run"
    print(f"first launch tuning call {timings[0][0]} s ({timings[0][1]} runs); "
          f"second launch {timings[1][0]} s ({timings[1][1]} runs)")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_sweep_example_on_one_gpu_pins_and_serves(tmp_path):
    """The grouped GEMM swept over batch sizes 1 to 4096 with the Hopper configs, then sizes never tuned served."""
    table = tmp_path / "moe_winners.json"
    proc = run_launch(["--nproc_per_node=1", "examples/sweep_moe.py", "--table", str(table)], timeout=540,
                      extra_env={"DISTTUNE_CACHE_DIR": str(tmp_path / "store"), "DISTTUNE_PROGRESS": "0"})
    assert proc.returncode == 0 and "correct on every rank: True" in proc.stdout, describe(proc)
    assert len(re.findall(r"^\d+ +_moe_gemm_body ", proc.stdout, flags=re.M)) == 7, describe(proc)
    assert proc.stdout.count("(never tuned) ran") == 3, describe(proc)
    print(proc.stdout)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_final_run_and_stored_winners_under_nccl_on_one_gpu(tmp_path):
    """The ending cases in a world of one under NCCL, the fault on its only rank: an error in the final
    run is the user's own, a stored winner that fails is tuned again without it and the new winner stored,
    a pinned winner that does not compile is one TuningError."""
    from pathlib import Path

    cases = ["raise_in_final_run", "stored_winner_raising_pre_hook", "stored_winner_compile_error",
             "pinned_winner_compile_error"]
    results = run_cases(Path(__file__).with_name("ending_cases.py"), cases, tmp_path / "run", 1, timeout=300,
                        extra_env={"ENDING_FAULTY_RANK": "0", "DISTTUNE_TIMEOUT": "60"})
    (final,) = results["raise_in_final_run"]
    assert final["ok"], failure(final)
    assert final["first"] == "RuntimeError: injected fault in the final run", final
    assert final["tuned"] and final["winner"] == 2, final
    for case in ("stored_winner_raising_pre_hook", "stored_winner_compile_error"):
        (ending,) = results[case]
        assert ending["ok"], failure(ending)
        assert ending["returned"] == {"winner": 1, "source": "tuned", "runs": 8}, ending
    (hook,) = results["stored_winner_raising_pre_hook"]
    assert hook["warned"] and "injected pre_hook fault" in hook["warned"][0], hook
    assert hook["after"] == {"returned": {"winner": 1, "source": "store", "runs": 2}}, hook
    (pinned,) = results["pinned_winner_compile_error"]
    assert pinned["ok"], failure(pinned)
    assert pinned["raised"] == "TuningError" and "pinned table" in pinned["error"], pinned
    print({case: {k: v for k, v in results[case][0].items() if k not in ("ok",)} for case in cases})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("check", [False, True])
def test_check_scores_out_a_shard_gemm_config_that_reads_shards_a_side_stream_still_delivers(check, tmp_path):
    """One GPU: the peers' shards land in a NaN-poisoned workspace from a side stream, about 25 ms late (see
    ``late_shards``); the racy config, timed the fastest, wins unchecked and scores inf with check=True."""
    from disttune.kernels.matmul import gemm_config
    from late_shards import SideStreamArrivals, check_scores_out_racy_config

    found = check_scores_out_racy_config(SideStreamArrivals(), gemm_config(128, 128, 32, 8, 4, 4), check, tmp_path,
                                         rows=256, K=256, N=256, dtype=torch.float16, device="cuda")
    if check:
        assert found["winner"] == 0 and found["right"] and found["agreed_ms"][1] == float("inf"), found
    else:
        assert found["winner"] == 1 and not found["right"], found


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [40, 300], ids=str)
def test_the_own_rows_gemm_adds_each_peers_partial_only_once_a_side_stream_delivered_it(rows):
    """One GPU: GEMM-RS's reduction (its flag waits in inline PTX on sm_90) with the peers' partials landing
    about 25 ms late from a side stream into NaN-poisoned slots (see ``late_shards``)."""
    from disttune.kernels.matmul import gemm_config
    from late_shards import SideStreamArrivals, own_rows_gemm_with_late_partials

    found = own_rows_gemm_with_late_partials(SideStreamArrivals(), gemm_config(64, 64, 32, 8, 3, 4), rows=rows,
                                             K=256, N=192, dtype=torch.float16, device="cuda")
    assert found == {"right": True, "nan": False, "late": True}, found


def _gemm(n: int = 8192):
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    c = torch.empty_like(a)
    return lambda: torch.matmul(a, b, out=c)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_energy_of_a_gemm_is_its_power_draw_times_its_time():
    """One GEMM of known length (8192^3 bf16, ~1-2 ms): the probe's energy per launch, read over its window of
    repeats, is neither 0 nor off by more than 2x from the board's power draw times the GEMM's time (CUDA
    events). The draw is NVML's power reading, which averages over about a second: it is sampled in the last
    second of 3 s of the same GEMMs back to back."""
    from disttune.objective import DeviceProbe, counter_period_s, energy_window_s
    from disttune.timing import LaunchInfo

    probe = DeviceProbe()
    if probe._nvml is None:
        pytest.skip("pynvml or the GPU's energy counter is missing")
    pynvml, handle = probe._nvml
    gemm = _gemm()
    for _ in range(20):
        gemm()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(200):
        gemm()
    end.record()
    end.synchronize()
    gemm_ms = start.elapsed_time(end) / 200
    began, watts = time.monotonic(), []
    while time.monotonic() - began < 3.0:  # 3 s of GEMMs back to back (the host waits when the queue is full)
        for _ in range(10):
            gemm()
        if time.monotonic() - began > 2.0:  # the last second: NVML's average covers only GEMMs
            watts.append(pynvml.nvmlDeviceGetPowerUsage(handle) / 1e3)
    torch.cuda.synchronize()
    info = LaunchInfo("gemm", (8192,), 0, 0, None, 0, 0, repeat=gemm)
    started = probe.start(info)
    gemm()
    energy = probe.stop(started, info)["energy_mj"]
    power = statistics.median(watts) if watts else float("nan")
    expected = power * gemm_ms  # W x ms = mJ
    period = counter_period_s(probe._nvml, torch.cuda.current_device())
    print(f"\nNVML energy counter step {period * 1e3:.1f} ms, window {energy_window_s(period) * 1e3:.0f} ms; GEMM "
          f"{gemm_ms:.3f} ms at {power:.0f} W: {energy:.1f} mJ per launch read, {expected:.1f} mJ expected")
    assert energy > 0 and expected / 2 <= energy <= expected * 2, (energy, expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_pareto_front_over_time_and_energy_of_the_12_config_gemm(tmp_path):
    """``objective=pareto("time_ms", "energy_mj")`` on the 12-config Hopper GEMM at 4096^3: every config's energy is
    read (none is 0), and the front is printed."""
    import disttune
    from disttune.kernels.matmul import HOPPER_GEMM_CONFIGS, make_matmul_kernel, matmul
    from disttune.objective import nvml_handle

    if nvml_handle(torch.cuda.current_device()) is None:
        pytest.skip("pynvml or the GPU's energy counter is missing")
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    kernel = make_matmul_kernel(HOPPER_GEMM_CONFIGS)

    @disttune.contextual_autotune(objective=disttune.pareto("time_ms", "energy_mj"), store=False, verbose=False,
                                  log_dir=tmp_path)
    def step():
        return matmul(a, b, kernel=kernel)

    step()
    (result,) = step.report.results
    rows = [(disttune.describe_config(c), m.time_ms, m.energy_mj, c_index in result.front)
            for c_index, (c, m) in enumerate(zip(result.configs, result.measurements))]
    print("\n| config | ms | mJ | on the front |\n| --- | ---: | ---: | --- |")
    for label, ms, mj, front in rows:
        print(f"| {label} | {ms:.4f} | {mj if mj is None else round(mj, 1)} | {'yes' if front else ''} |")
    assert all(mj is not None and mj > 0 for _, ms, mj, _ in rows if ms < float("inf")), rows
    assert result.winner in result.front


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_readme_example_runs_on_gpus_as_written(tmp_path):
    from test_cpu_path import readme_example

    script = tmp_path / "example.py"
    script.write_text(readme_example() + "print(f'rank {info.rank}: out {tuple(out.shape)} {out.dtype}')\n")
    ranks = min(2, torch.cuda.device_count())
    proc = run_launch([f"--nproc_per_node={ranks}", str(script)], timeout=300,
                      extra_env={"DISTTUNE_CACHE_DIR": str(tmp_path / "store")})
    assert proc.returncode == 0, describe(proc)
    for rank in range(ranks):
        assert f"rank {rank}: out (8192, {8192 // ranks}) torch.bfloat16" in proc.stdout, describe(proc)
    assert "terminate called" not in proc.stderr, describe(proc)
