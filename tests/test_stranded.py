"""Every rank ends alike when one rank's failure strands its peers inside the step's own collective.

Launches ``stranded_cases.py`` with torchrun: on 2 gloo ranks on CPUs (counted in the CPU suite's
fault line), and under NCCL on 2 and 4 GPUs (``gpu`` tests, skipped without them; their own fault
line, printed at the end with the GPU model). Each case injects one fault on the last rank: a raise
before the step's all_reduce in a tuning run and in the final run, a raise after it, a config and a
stored winner that fail there only, a stall, a SIGKILL, a new key on one rank and on every rank; and
the same raises and stalls in a function tuned by ``disttune.autotune`` (the ``function_`` cases).

What must hold, each counted before it is asserted: every rank returns the same result or raises the
same clear error; every rank has left within :data:`PROMPT_S` of a fault whose error it could hear of,
and within the tuner's timeout + :data:`PROMPT_S` of a stall or a death (on gloo too, where a stall before the
function's own collective holds the peers inside it until the process group's own timeout); nothing hangs.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from fault_tally import GPU_TALLY, GPU_WORLDS, TALLY, endings, faults_seen, hang, timeout_waits, tracebacks_in
from helpers import CommandTimeout, describe, read_records, run_launch

CASES = Path(__file__).with_name("stranded_cases.py")
TIMEOUT_S = 10.0  # the tuner's timeout in the launched ranks
PROMPT_S = 8.0  # below the 10 s timeout: an ending that waited for it takes longer, a busy machine not
KEPT = ["raise_after_collective", "config_fails_on_one_rank", "stored_winner_fails_on_one_rank",
        "new_key_on_one_rank", "new_key_on_every_rank", "function_raise_after_collective",
        "function_raise_after_collective_in_final_run"]

#: The name the function tuner's errors give the function of the ``function_`` cases.
FUNCTION = "function_with.<locals>.step"
#: Where each stranding case's fault strikes, as the error's first line says it.
WHERE = {"raise_before_collective": "tuning run 3/9 failed",
         "raise_before_collective_in_final_run": "the final run (with the winners) failed",
         "function_raise_before_collective": "tuning run 4/9 failed",
         "function_raise_before_collective_in_final_run": "the final run (with the winners) failed"}


def gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def launch(tmp_path: Path, world: int, cases: list[str], tally: dict, allow_failure: bool = False,
           extra_env: dict | None = None):
    """Run ``cases`` on ``world`` ranks; returns (records by case, the launch, its seconds, when it ended)."""
    out = tmp_path / f"run{len(list(tmp_path.glob('run*')))}"
    started = time.monotonic()
    try:
        proc = run_launch([f"--nproc_per_node={world}", str(CASES), *cases, "--out", str(out),
                           "--timeout", str(TIMEOUT_S)], timeout=240 + 3 * TIMEOUT_S, extra_env=extra_env)
    except CommandTimeout:
        hang(tally)
        raise
    ended = time.time()
    if not allow_failure:
        assert proc.returncode == 0, describe(proc)
        tracebacks_in(proc.stderr, tally)
        return read_records(out, cases, range(world), proc), proc, time.monotonic() - started, ended
    return out, proc, time.monotonic() - started, ended


def outcomes(per_rank: list[dict]) -> list[dict]:
    for record in per_rank:
        assert record["ok"], record  # the cases catch the tuner's errors: a failed record is a broken case
    return per_rank


def same(per_rank: list[dict], tally: dict, *fields: str) -> dict:
    """One trial: the same returned ``fields`` or the same error text on every rank; returns rank 0's."""
    records = [{**r, "ok": r["ended"] == "returned"} for r in per_rank]
    ending = endings(records, *fields, error="error", message="error", tally=tally)
    assert not any(ending.values()), (ending, per_rank)
    return per_rank[0]


def check_stranding(per_rank: list[dict], world: int, tally: dict, *, stall: bool = False) -> None:
    """A raise (or a stall) on the last rank that strands the others: the same error on every rank, naming the
    last rank, promptly after the fault."""
    per_rank = outcomes(per_rank)
    last = world - 1
    fault_at = per_rank[last]["fault_at"]
    first = same(per_rank, tally)
    assert first["ended"] == "raised", per_rank
    if stall:
        assert first["raised"] == "CollectiveTimeout" and f"rank(s) [{last}]" in first["error"], first
        late = [r["ended_at"] - fault_at for r in per_rank[:last]]  # the stalled rank itself ends when it wakes
        faults_seen(all(f"rank(s) [{last}]" in r["error"] for r in per_rank), tally)
        assert max(late) < TIMEOUT_S + PROMPT_S, late
    else:
        named = f"rank {last}: RuntimeError: injected fault"
        assert first["raised"] == "TuningError" and named in first["error"], first
        late = [r["ended_at"] - fault_at for r in per_rank]
        faults_seen(all(named in r["error"] for r in per_rank), tally)
        timeout_waits(late, TIMEOUT_S, tally)
        assert max(late) < PROMPT_S, late


def run_stranding(tmp_path: Path, world: int, tally: dict, case: str, stall: bool = False,
                  extra_env: dict | None = None) -> list[dict]:
    results, _, _, _ = launch(tmp_path, world, [case], tally, extra_env=extra_env)
    check_stranding(results[case], world, tally, stall=stall)
    return results[case]


def check_first_line(per_rank: list[dict], case: str, world: int) -> None:
    """The error's first line says where the last rank failed, in the one wording of both tuners; the next is the
    cause, the planted exception (nothing that followed from it comes first)."""
    first, cause = per_rank[0]["error"].splitlines()[:2]
    name = FUNCTION if case.startswith("function_") else "step_with.<locals>.step"
    assert first == f"disttune: {name}: {WHERE[case]} on rank(s) {world - 1}:", first
    assert cause == f"  rank {world - 1}: RuntimeError: injected fault", cause


def check_kept_cases(results: dict, world: int, tally: dict) -> None:
    """The faults that strand nobody: the group outlives them."""
    last = world - 1
    per_rank = outcomes(results["raise_after_collective"])
    check_stranding(per_rank, world, tally)
    assert "aborted" not in per_rank[0]["error"], "every GPU drained: the group was kept"
    then = same([r["then"] for r in per_rank], tally, "returned")
    assert then["returned"] == float(world), then

    per_rank = outcomes(results["config_fails_on_one_rank"])
    chose = same(per_rank, tally, "returned")
    faults_seen(chose["returned"]["winner"] != 2, tally)
    assert chose["ended"] == "returned" and chose["returned"]["winner"] != 2, per_rank

    per_rank = outcomes(results["stored_winner_fails_on_one_rank"])
    first = same([r["first"] for r in per_rank], tally, "returned")
    second = same([r["second"] for r in per_rank], tally, "returned")
    stored = first["returned"]["winner"]
    faults_seen(second["returned"]["winner"] != stored, tally)
    assert second["returned"]["source"] == "tuned" and second["returned"]["winner"] != stored, (first, second)

    per_rank = outcomes(results["new_key_on_one_rank"])
    same([r["tuned"] for r in per_rank], tally, "returned")
    after = [r["after"] for r in per_rank]
    assert all(a["ended"] == "returned" and a["returned"]["right"] for a in after), after
    assert [a["returned"]["fallbacks"] for a in after] == [0] * last + [1], after

    per_rank = outcomes(results["new_key_on_every_rank"])
    same([r["tuned"] for r in per_rank], tally, "returned")
    after = same([r["after"] for r in per_rank], tally, "returned")
    assert any("96" in key for key in after["returned"]["sizes"]), after

    for case, where in (("function_raise_after_collective", "tuning run 4/9 failed"),
                        ("function_raise_after_collective_in_final_run", "the final run (with the winners) failed")):
        per_rank = outcomes(results[case])
        check_stranding(per_rank, world, tally)
        assert per_rank[0]["error"].startswith(f"disttune: {FUNCTION}: {where} on rank(s) {last}:"), per_rank[0]
        assert "aborted" not in per_rank[0]["error"], "every rank drained: the group was kept"
        then = same([r["then"] for r in per_rank], tally, "returned")
        assert then["returned"] == float(world), then
    again = same([r["again"] for r in results["function_raise_after_collective_in_final_run"]], tally, "returned")
    assert again["returned"] == float(world), "the next call tuned again and returned on every rank"


def check_killed(tmp_path: Path, world: int, tally: dict) -> None:
    """A rank killed in a tuning run: the launcher (torchrun, as users run it) or the tuner ends every survivor,
    well inside the tuner's timeout + PROMPT_S of the kill; records that survivors wrote agree."""
    out, proc, _, ended = launch(tmp_path, world, ["killed_rank"], tally, allow_failure=True)
    killed_at = float((out / "killed_at").read_text())
    tally["trials"] += 1
    faults_seen(proc.returncode != 0, tally)
    assert proc.returncode != 0, describe(proc)
    assert ended - killed_at < TIMEOUT_S + PROMPT_S, (ended - killed_at, describe(proc))
    survivors = [Path(out) / f"killed_rank.rank{r}.json" for r in range(world - 1)]
    written = [read_records(out, ["killed_rank"], [r])["killed_rank"][0] for r, p in enumerate(survivors) if p.exists()]
    errors = {r.get("error") for r in written if r.get("ended") == "raised"}
    assert len(errors) <= 1, written


# -- on CPUs: 2 gloo ranks ------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the gloo run is the CPU suite's (GPU machines run NCCL's)")
def test_faults_that_strand_nobody_on_gloo(tmp_path):
    results, _, _, _ = launch(tmp_path, 2, KEPT, TALLY)
    check_kept_cases(results, 2, TALLY)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the gloo run is the CPU suite's (GPU machines run NCCL's)")
@pytest.mark.parametrize("case", list(WHERE))
def test_a_raise_before_the_steps_collective_ends_every_gloo_rank_at_once(tmp_path, case):
    """The peer blocked in gloo's all_reduce is released by the aborted group, not by gloo's own timeout; both
    tuners, in a tuning run and in the final run."""
    per_rank = run_stranding(tmp_path, 2, TALLY, case)
    check_first_line(per_rank, case, 2)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the gloo run is the CPU suite's (GPU machines run NCCL's)")
@pytest.mark.parametrize("case", ["stall_before_collective", "stall_after_collective",
                                  "function_stall_before_collective", "function_stall_after_collective",
                                  "unfenced_stall_after_collective"])
def test_a_stalled_gloo_rank_is_named_at_the_tuners_timeout(tmp_path, case):
    """After the function's own collective the peers wait in the tuner, which names the stalled rank at its timeout.
    Before it (or, with the runs unfenced, in the next run's) they wait inside that gloo collective, which holds the
    host until the process group's own timeout (``disttune.dist.init`` makes it the tuner's, here from
    DISTTUNE_TIMEOUT as a user sets it, + a few seconds): the error that timeout raises comes after the stalled
    rank, which the first line names."""
    per_rank = run_stranding(tmp_path, 2, TALLY, case, stall=True, extra_env={"DISTTUNE_TIMEOUT": str(TIMEOUT_S)})
    if case.startswith("unfenced") or "before" in case:
        name = FUNCTION if case.startswith("function_") else "step_with.<locals>.step"
        first, cause = per_rank[0]["error"].splitlines()[:2]
        assert first.startswith(f"disttune: {name}: step 'tuning run ") and \
            f"rank(s) [1] did not arrive within {TIMEOUT_S:g} s" in first and "rank(s) [0] waited" in first, first
        assert cause.startswith("  rank 0: RuntimeError: ") and "Timed out" in cause, cause


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the gloo run is the CPU suite's (GPU machines run NCCL's)")
def test_a_killed_gloo_rank_ends_the_job(tmp_path):
    check_killed(tmp_path, 2, TALLY)


# -- on GPUs: NCCL at 2 and 4 GPUs ----------------------------------------------------------------------------

WORLDS = [pytest.param(w, marks=pytest.mark.skipif(gpus() < w, reason=f"needs {w} CUDA GPUs")) for w in (2, 4)]
STRANDING = ["raise_before_collective", "raise_before_collective_in_final_run", "stall_before_collective",
             "function_raise_before_collective", "function_raise_before_collective_in_final_run",
             "function_stall_before_collective"]


@pytest.mark.gpu
@pytest.mark.parametrize("world", WORLDS)
def test_nccl_faults_that_strand_nobody(tmp_path, world):
    GPU_WORLDS.add(world)
    results, _, seconds, _ = launch(tmp_path, world, KEPT, GPU_TALLY)
    check_kept_cases(results, world, GPU_TALLY)
    print(f"NCCL, {world} GPUs: {', '.join(KEPT)}: same endings on every rank ({seconds:.1f} s launch)")


@pytest.mark.gpu
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", STRANDING)
def test_nccl_a_stranded_gpu_ends_with_its_peers(tmp_path, world, case):
    """The peers' GPUs wait in the all_reduce the last rank never entered: every rank still leaves promptly with
    the same error, and the group is aborted (it could never complete a collective again)."""
    GPU_WORLDS.add(world)
    results, _, seconds, _ = launch(tmp_path, world, [case], GPU_TALLY)
    per_rank = results[case]
    stall = "stall" in case
    check_stranding(per_rank, world, GPU_TALLY, stall=stall)
    if not stall:
        check_first_line(per_rank, case, world)
    assert all("aborted" in r["error"] for r in per_rank), per_rank[0]["error"]
    late = max(r["ended_at"] for r in per_rank[:-1]) - per_rank[-1]["fault_at"]
    print(f"NCCL, {world} GPUs, {case}: every peer left {late:.2f} s after the fault with "
          f"{per_rank[0]['raised']}: {per_rank[0]['error'].splitlines()[0]}")


@pytest.mark.gpu
@pytest.mark.parametrize("world", WORLDS)
def test_nccl_a_killed_rank_ends_the_job(tmp_path, world):
    GPU_WORLDS.add(world)
    check_killed(tmp_path, world, GPU_TALLY)


@pytest.mark.gpu
def test_nccl_fault_line(capsys):
    """Print this suite's own fault line (the GPU tests above filled it), in the CPU suite's columns."""
    from fault_tally import gpu_label, summary_line

    if not GPU_TALLY["trials"]:
        pytest.skip("no NCCL fault case ran here")
    with capsys.disabled():
        print("\n" + summary_line(GPU_TALLY, gpu_label()))
    assert GPU_TALLY["hangs"] == GPU_TALLY["split_endings"] == GPU_TALLY["disagreements"] == 0


# -- beyond FENCED_RUNS_MAX_RANKS ranks: runs without a barrier ------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="the gloo run is the CPU suite's (GPU machines run NCCL's)")
def test_unfenced_runs_make_three_collectives_and_pick_the_same_winner(tmp_path):
    """A tuning call makes its tuning runs + 3 collectives with its runs fenced, 3 without: the consensus, the
    timing vector and the final run's status."""
    results, _, _, _ = launch(tmp_path, 2, ["unfenced_collectives"], TALLY)
    per_rank = outcomes(results["unfenced_collectives"])
    for record in per_rank:
        fenced, unfenced = record["fenced"], record["unfenced"]
        assert unfenced["collectives"] == 3, record
        tuning_runs = fenced["runs"] - 2  # the discovery run and the final run are not fenced
        assert fenced["collectives"] == tuning_runs + 3 and tuning_runs > 0, record
        assert unfenced["runs"] == fenced["runs"], record
    assert len({(r["fenced"]["winner"], r["unfenced"]["winner"]) for r in per_rank}) == 1, per_rank


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the gloo run is the CPU suite's (GPU machines run NCCL's)")
def test_a_raise_after_the_steps_collective_in_unfenced_runs_ends_every_gloo_rank_at_once(tmp_path):
    """Without a barrier after the run, the raising rank's peers are stranded in the next run's all_reduce: the
    same error on every rank, naming it and where it failed, promptly."""
    per_rank = run_stranding(tmp_path, 2, TALLY, "unfenced_raise_after_collective")
    first, cause = per_rank[0]["error"].splitlines()[:2]
    assert first == "disttune: step_with.<locals>.step: tuning run 3/9 failed on rank(s) 1:", first
    assert cause == "  rank 1: RuntimeError: injected fault", cause
