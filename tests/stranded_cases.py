"""One rank fails where its peers are stranded: the step calls ``all_reduce`` on a one-element tensor
before its tuned launch, so a peer that skips or stalls leaves the others waiting inside it (on the
GPU under NCCL, on the host under gloo).

    python tests/stranded_cases.py CASE [CASE ...] [--out DIR] [--timeout S]

``test_stranded.py`` launches this file with torchrun: on 2 gloo ranks on CPUs, and on 2 and 4 GPUs
under NCCL (its ``gpu`` tests). The fault is injected on the last rank. Each case returns what every
rank saw: how the tuning call ended (its result, or its error's type and text) and the wall-clock
time (``time.time()``) it ended at; the faulty rank adds when it injected the fault, so the test can
tell how long after the fault every rank had left.

The ``function_`` cases inject the same faults into a function tuned by ``disttune.autotune`` that
calls the same ``all_reduce``, before (or after) which its fault strikes.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
import warnings
from pathlib import Path

from rank_cases import Cases, Ranks

import torch  # noqa: E402

import disttune  # noqa: E402
from tiny_kernels import launch_add, make_kernel  # noqa: E402

cases = Cases(__doc__)
FAULT_RUN = 4  # the run of the wrapped function the fault is injected in: discovery, then tuning runs 1, 2, 3


def faulty(ctx: Ranks) -> bool:
    return ctx.rank == ctx.world - 1


def options(ctx: Ranks, case: str, **extra) -> dict:
    return dict(is_dist=True, n_warmup=1, n_repeat=2, verbose=False, timeout_s=ctx.options.timeout,
                log_dir=os.path.join(ctx.work_dir, "logs", case), cache_dir=os.path.join(ctx.work_dir, "store", case),
                **extra)


def all_reduce_one(ctx: Ranks) -> float:
    """The step's own collective: a one-element tensor on the rank's device."""
    t = torch.ones(1, device=ctx.device)
    torch.distributed.all_reduce(t)
    return t


def step_with(ctx: Ranks, case: str, fault=None, kernel=None, n: int = 64, **extra):
    """A tuned step: ``all_reduce`` of one element, then the tuned launch; ``fault(run, where)`` is called on the
    faulty rank before (``where="before"``) and after (``"after"``) the collective of each run."""
    kernel = kernel or make_kernel()
    x = torch.randn(n, device=ctx.device)
    runs = {"n": 0}

    @disttune.contextual_autotune(**options(ctx, case, **extra))
    def step(size: int = n):
        runs["n"] += 1
        if fault is not None and faulty(ctx):
            fault(runs["n"], "before")
        total = all_reduce_one(ctx)
        if fault is not None and faulty(ctx):
            fault(runs["n"], "after")
        source = x if size == n else torch.randn(size, device=ctx.device)
        y = torch.empty_like(source)
        launch_add(kernel, source, y)
        return y, total

    return step


def ending(call) -> dict:
    """How ``call()`` ended on this rank, and when (wall clock, shared by the ranks of one host)."""
    try:
        returned = call()
        return {"ended": "returned", "returned": returned, "ended_at": time.time()}
    except Exception as err:  # noqa: BLE001 - the test compares what every rank saw
        return {"ended": "raised", "raised": type(err).__name__, "error": str(err), "ended_at": time.time()}


class Fault:
    """Injects ``action`` once, on the faulty rank, in run ``run`` at ``where``; remembers when."""

    def __init__(self, action, run: int = FAULT_RUN, where: str = "before") -> None:
        self.action, self.run, self.where = action, run, where
        self.at: float | None = None

    def __call__(self, run: int, where: str) -> None:
        if run == self.run and where == self.where:
            self.at = time.time()
            self.action()

    def fields(self) -> dict:
        return {} if self.at is None else {"fault_at": self.at}


def _raise() -> None:
    raise RuntimeError("injected fault")


def _tuned(step) -> dict:
    y, total = step()
    (result,) = step.report.results
    return {"winner": result.winner, "source": result.source, "total": float(total.item())}


def _stranding(ctx: Ranks, case: str, fault: Fault) -> dict:
    step = step_with(ctx, case, fault)
    return {**ending(lambda: _tuned(step)), **fault.fields()}


@cases.case(breaks_group=True, default=False)
def case_raise_before_collective(ctx):
    """The last rank raises in a tuning run before the step's all_reduce, which its peers have entered."""
    return _stranding(ctx, "raise_before_collective", Fault(_raise))


@cases.case(breaks_group=True, default=False)
def case_raise_before_collective_in_final_run(ctx):
    """The same in the final run (discovery, 3 configs x 3 tuning runs, then the run with the winners)."""
    return _stranding(ctx, "raise_before_collective_in_final_run", Fault(_raise, run=2 + 3 * 3))


@cases.case(breaks_group=True, default=False)
def case_stall_before_collective(ctx):
    """The last rank sleeps 2.5 timeouts in a tuning run before the step's all_reduce."""
    return _stranding(ctx, "stall_before_collective", Fault(lambda: time.sleep(2.5 * ctx.options.timeout)))


@cases.case(breaks_group=True, default=False)
def case_stall_after_collective(ctx):
    """The last rank sleeps 2.5 timeouts in a tuning run after the step's all_reduce (before its launch)."""
    return _stranding(ctx, "stall_after_collective",
                      Fault(lambda: time.sleep(2.5 * ctx.options.timeout), where="after"))


@cases.case(breaks_group=True, default=False)
def case_killed_rank(ctx):
    """The last rank kills itself (SIGKILL) in a tuning run before the step's all_reduce; it leaves the time of
    the kill in ``killed_at`` under the work directory."""
    marker = Path(ctx.work_dir) / "killed_at"

    def kill() -> None:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)

    return _stranding(ctx, "killed_rank", Fault(kill))


@cases.case
def case_raise_after_collective(ctx):
    """The last rank raises in a tuning run after the step's all_reduce: nobody is stranded, every rank raises
    the same error, and the group still works."""
    fault = Fault(_raise, where="after")
    result = _stranding(ctx, "raise_after_collective", fault)
    return {**result, "then": ending(lambda: float(all_reduce_one(ctx).item()))}


def _fails_on_the_last_rank(nargs):
    if torch.distributed.get_rank() == torch.distributed.get_world_size() - 1:
        raise RuntimeError("injected pre_hook fault on the last rank")


@cases.case
def case_config_fails_on_one_rank(ctx):
    """Config 2 cannot launch on the last rank (its pre_hook raises there): every rank picks the same other one."""
    kernel = make_kernel(pre_hooks={2: _fails_on_the_last_rank})
    step = step_with(ctx, "config_fails_on_one_rank", kernel=kernel, store=False)
    return ending(lambda: _tuned(step))


@cases.case
def case_stored_winner_fails_on_one_rank(ctx):
    """The stored winner's pre_hook raises on the last rank: every rank tunes again without it."""
    first = ending(lambda: _tuned(step_with(ctx, "stored_winner_fails", always_tune=False)))
    ctx.barrier()  # rank 0 has written the store
    stored = first.get("returned", {}).get("winner")
    kernel = make_kernel(pre_hooks={stored: _fails_on_the_last_rank} if stored is not None else None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        second = ending(lambda: _tuned(step_with(ctx, "stored_winner_fails", kernel=kernel)))
    return {"first": first, "second": second}


@cases.case
def case_new_key_on_one_rank(ctx):
    """After tuning, the last rank alone meets a new size for a few calls: no collective, no hang, right results."""
    step = step_with(ctx, "new_key_on_one_rank", agree_every=2)
    tuned = ending(lambda: _tuned(step))
    size = 96 if faulty(ctx) else 64

    def calls() -> dict:
        right = True
        for _ in range(5):
            y, _ = step(size)
            right = right and y.numel() == size
        return {"right": right, "fallbacks": len(step.fallbacks)}

    return {"tuned": tuned, "after": ending(calls)}


@cases.case
def case_new_key_on_every_rank(ctx):
    """After tuning, every rank meets a new size in the same calls: tuned at an agreement point, alike everywhere."""
    step = step_with(ctx, "new_key_on_every_rank", agree_every=2)
    tuned = ending(lambda: _tuned(step))

    def calls() -> dict:
        for _ in range(8):  # the agreement points every 2 calls: the key is tuned two points after it was met
            step(96)
        winners = sorted(str(result.config) for result in step.report.results)
        return {"winners": winners, "sizes": sorted(str(result.site.key) for result in step.report.results)}

    return {"tuned": tuned, "after": ending(calls)}


# -- the function tuner: the same faults in a function that disttune.autotune tunes ----------------------------

FUNCTION_FINAL_RUN = 3 * 3 + 1  # 3 configs x (1 warm-up + 2 timed) tuning runs, then the final run


def function_with(ctx: Ranks, case: str, fault: Fault):
    """A function tuned over 3 variants: ``all_reduce`` of one element, with ``fault(run, where)`` called on the
    faulty rank before and after it in each of its calls (tuning runs, then the final run). It returns the
    reduced tensor without reading it, as a step of a model does: under NCCL the tuner's own wait on the GPU is
    where a stall shows; on gloo, whose collective holds the host, the process group's own timeout ends the wait
    inside the function, and the tuner then names the stalled rank."""
    runs = {"n": 0}

    @disttune.autotune([{"variant": v} for v in range(3)], key_fn=lambda: 0, n_warmup=1, n_repeat=2,
                       timeout_s=ctx.options.timeout, cache_dir=os.path.join(ctx.work_dir, "store", case))
    def step(*, variant):
        runs["n"] += 1
        if faulty(ctx):
            fault(runs["n"], "before")
        total = all_reduce_one(ctx)
        if faulty(ctx):
            fault(runs["n"], "after")
        return total

    return step


def _function_stranding(ctx: Ranks, case: str, fault: Fault) -> dict:
    step = function_with(ctx, case, fault)
    return {**ending(lambda: {"total": float(step())}), **fault.fields()}


@cases.case(breaks_group=True, default=False)
def case_function_raise_before_collective(ctx):
    """The last rank's function raises in its 4th tuning run before its all_reduce, which its peers have entered."""
    return _function_stranding(ctx, "function_raise_before_collective", Fault(_raise))


@cases.case(breaks_group=True, default=False)
def case_function_raise_before_collective_in_final_run(ctx):
    """The same in the final run (the call with the winner, whose result the caller gets)."""
    return _function_stranding(ctx, "function_raise_before_collective_in_final_run",
                               Fault(_raise, run=FUNCTION_FINAL_RUN))


@cases.case(breaks_group=True, default=False)
def case_function_stall_before_collective(ctx):
    """The last rank's function sleeps 2.5 timeouts in a tuning run before its all_reduce."""
    return _function_stranding(ctx, "function_stall_before_collective",
                               Fault(lambda: time.sleep(2.5 * ctx.options.timeout)))


@cases.case(breaks_group=True, default=False)
def case_function_stall_after_collective(ctx):
    """The last rank's function sleeps 2.5 timeouts in a tuning run after its all_reduce."""
    return _function_stranding(ctx, "function_stall_after_collective",
                               Fault(lambda: time.sleep(2.5 * ctx.options.timeout), where="after"))


@cases.case
def case_function_raise_after_collective(ctx):
    """The last rank's function raises in a tuning run after its all_reduce: nobody is stranded, every rank raises
    the same error, and the group still works."""
    result = _function_stranding(ctx, "function_raise_after_collective", Fault(_raise, where="after"))
    return {**result, "then": ending(lambda: float(all_reduce_one(ctx).item()))}


@cases.case
def case_function_raise_after_collective_in_final_run(ctx):
    """The same in the final run: every rank raises, the group still works, and the next call tunes again."""
    fault = Fault(_raise, run=FUNCTION_FINAL_RUN, where="after")
    step = function_with(ctx, "function_raise_after_collective_in_final_run", fault)
    result = {**ending(lambda: {"total": float(step())}), **fault.fields()}
    return {**result, "then": ending(lambda: float(all_reduce_one(ctx).item())), "again": ending(lambda: float(step()))}


@contextlib.contextmanager
def unfenced():
    """Within it, the tuner ends its runs without a barrier, as it does beyond ``FENCED_RUNS_MAX_RANKS`` ranks."""
    import disttune.agreement

    kept, disttune.agreement.FENCED_RUNS_MAX_RANKS = disttune.agreement.FENCED_RUNS_MAX_RANKS, 0
    try:
        yield
    finally:
        disttune.agreement.FENCED_RUNS_MAX_RANKS = kept


@cases.case(default=False)
def case_unfenced_collectives(ctx):
    """How many collectives of the control plane a tuning call makes with its runs fenced and without (each call
    tunes a kernel of its own), and the winners each picked (the test checks that every rank agrees on them)."""
    from disttune.storeplane import StorePlane

    started, made = StorePlane._start, {"n": 0}

    def counted(self, *args, **kwargs):
        made["n"] += 1
        return started(self, *args, **kwargs)

    counts = {}
    StorePlane._start = counted
    try:
        for fenced in (True, False):
            step, made["n"] = step_with(ctx, f"unfenced_collectives_{fenced}"), 0
            with contextlib.nullcontext() if fenced else unfenced():
                tuned = _tuned(step)
            counts["fenced" if fenced else "unfenced"] = {"collectives": made["n"], "winner": tuned["winner"],
                                                          "runs": step.report.function_runs}
    finally:
        StorePlane._start = started
    return counts


@cases.case(breaks_group=True, default=False)
def case_unfenced_raise_after_collective(ctx):
    """The last rank raises in a tuning run after the step's all_reduce with the runs unfenced: its peers go on into
    the next run's all_reduce, where it strands them, and every rank ends with the same error naming it."""
    with unfenced():
        return _stranding(ctx, "unfenced_raise_after_collective", Fault(_raise, where="after"))


@cases.case(breaks_group=True, default=False)
def case_unfenced_stall_after_collective(ctx):
    """The last rank sleeps 2.5 timeouts in a tuning run after the step's all_reduce with the runs unfenced: its
    peers go on into the next run's all_reduce and wait there for it."""
    with unfenced():
        return _stranding(ctx, "unfenced_stall_after_collective",
                          Fault(lambda: time.sleep(2.5 * ctx.options.timeout), where="after"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--timeout", type=float, default=10.0, help="the tuner's timeout_s (seconds)")


if __name__ == "__main__":
    sys.exit(cases.main(add_arguments=add_arguments))
