"""Multi-rank cases where one rank fails somewhere the others do not: every rank must end the same way.

    python tests/ending_cases.py CASE [CASE ...] [--out DIR]

``test_endings.py`` launches this file on 2 ranks (torchrun, gloo under the interpreter) and asserts
that every rank returns the same winner or raises the same clear error, promptly. Each case injects
one fault on one rank: an exception in the final run, a stored or pinned winner that cannot run
there, a missing pinned table, a raising ``key_fn``, ``prune_fn`` or statistic, user code raising
before the step's own collective, a bad option, a store lock held by another process.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

from rank_cases import Cases, Ranks

import torch  # noqa: E402

import triton  # noqa: E402

import disttune  # noqa: E402
from disttune import wire  # noqa: E402
from tiny_kernels import TableTimer, add_block_limited, launch_add, make_kernel  # noqa: E402

cases = Cases(__doc__)

#: The rank each case injects its fault on: rank 1 of the 2-rank tests, rank 0 when a GPU test runs the
#: cases in a world of one (under NCCL).
FAULTY_RANK = int(os.environ.get("ENDING_FAULTY_RANK", "1"))
FAST_LAST = {0: 3.0, 1: 2.0, 2: 1.0}  # ms per config: config 2 (BLOCK 64) wins when it runs


def tuner_options(ctx: Ranks, case: str, **extra) -> dict:
    options = dict(is_dist=True, n_warmup=1, n_repeat=1, log_dir=os.path.join(ctx.work_dir, "logs", case),
                   cache_dir=os.path.join(ctx.work_dir, "store", case), timeout_s=20, verbose=False,
                   timer=TableTimer(lambda info: FAST_LAST[info.config_index]))
    options.update(extra)
    return options


def sum_across_ranks(ctx: Ranks, value: float) -> float:
    """A collective inside the user's function (the kind the schedule must keep paired)."""
    t = torch.tensor([value], dtype=torch.float64, device=ctx.device)
    torch.distributed.all_reduce(t)
    return float(t.item())


def attempt(call) -> dict:
    """What ``call()`` did on this rank: its return value, or its error's type and message."""
    try:
        return {"returned": call()}
    except Exception as err:  # noqa: BLE001 - the records compare what each rank saw
        return {"raised": type(err).__name__, "error": str(err)}


def store_step(ctx: Ranks, case: str, kernel, **options):
    """A step launching ``kernel`` beside a user collective, with a store (or a pinned table) of the case's."""
    x = torch.randn(64, device=ctx.device)
    limit = options.pop("limit", 1024)

    @disttune.contextual_autotune(**tuner_options(ctx, case, **options))
    def step():
        y = torch.full_like(x, float("nan"))
        if "LIMIT" in kernel.arg_names:
            kernel[lambda meta: (triton.cdiv(64, meta["BLOCK"]),)](x, y, 64, LIMIT=limit)
        else:
            launch_add(kernel, x, y)
        sum_across_ranks(ctx, 1.0)
        return y

    return step


def tune(step) -> dict:
    """Call ``step`` (a tuning call) and say how it ended."""
    step()
    return outcome(step)


def outcome(step) -> dict:
    (result,) = step.report.results
    return {"winner": result.winner, "source": result.source, "runs": step.report.function_runs}


@cases.case
def case_raise_in_final_run(ctx):
    """Rank 1 raises in the final run (after the step's collective): every rank raises, then both re-tune."""
    kernel = make_kernel()
    runs = {"n": 0, "fail_at": 2 + 3 * 2}  # discovery + 3 configs x (1 warm-up + 1 timed) + final
    x = torch.randn(64, device=ctx.device)

    @disttune.contextual_autotune(**tuner_options(ctx, "raise_in_final_run"))
    def step():
        runs["n"] += 1
        y = torch.empty_like(x)
        launch_add(kernel, x, y)
        sum_across_ranks(ctx, 1.0)
        if ctx.rank == FAULTY_RANK and runs["n"] == runs["fail_at"]:
            raise RuntimeError("injected fault in the final run")
        return y

    first = {}
    try:
        step()
        first = {"first": "returned"}
    except Exception as err:  # noqa: BLE001 - the record compares what each rank saw
        first = {"first": f"{type(err).__name__}: {err}"}
    step()  # tunes again on every rank (the first call did not finish anywhere)
    return {**first, **outcome(step), "tuned": step.tuned}



def _raise_before_collective(ctx, name: str, failing_run: int) -> dict:
    kernel = make_kernel()
    runs = {"n": 0}
    x = torch.randn(64, device=ctx.device)

    @disttune.contextual_autotune(**tuner_options(ctx, name, timeout_s=30))
    def step():
        runs["n"] += 1
        if ctx.rank == FAULTY_RANK and runs["n"] == failing_run:
            raise RuntimeError("injected fault before the collective")
        y = torch.empty_like(x)
        launch_add(kernel, x, y)
        sum_across_ranks(ctx, 1.0)
        return y

    step()
    return {"unexpected": "no error"}


@cases.case(breaks_group=True, default=False)
def case_raise_before_collective(ctx):
    """Rank 1 raises in tuning run 2 before the step's all_reduce, where rank 0 is waiting."""
    return _raise_before_collective(ctx, "raise_before_collective", 3)


@cases.case(breaks_group=True, default=False)
def case_raise_before_collective_in_discovery(ctx):
    """Rank 1 raises in the discovery run before the step's all_reduce, where rank 0 is waiting."""
    return _raise_before_collective(ctx, "raise_before_collective_in_discovery", 1)


# -- stored and pinned winners that cannot run on one rank --------------------------------------------------

def _fails_on_rank_1(nargs):
    if torch.distributed.get_rank() == FAULTY_RANK:
        raise RuntimeError(f"injected pre_hook fault on rank {FAULTY_RANK}")


@cases.case
def case_stored_winner_raising_pre_hook(ctx):
    """The stored winner (config 2) has a pre_hook that raises on rank 1: every rank tunes again without it."""
    store_step(ctx, "stored_pre_hook", make_kernel())()
    ctx.barrier()  # rank 0 has written the store: every rank's discovery run tries the stored winner
    step = store_step(ctx, "stored_pre_hook", make_kernel(pre_hooks={2: _fails_on_rank_1}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ending = attempt(lambda: tune(step))
    after = store_step(ctx, "stored_pre_hook", make_kernel())  # the store now holds the new agreed winner
    return {**ending, "warned": [str(w.message) for w in caught if "stored winner" in str(w.message)],
            "after": attempt(lambda: tune(after))}  # loads the store, which now holds the new agreed winner


@cases.case
def case_stored_winner_compile_error(ctx):
    """The stored winner (BLOCK 64) does not compile on rank 1 (static assertion): every rank tunes again."""
    store_step(ctx, "stored_compile", make_kernel(add_block_limited))()
    ctx.barrier()
    step = store_step(ctx, "stored_compile", make_kernel(add_block_limited),
                      limit=64 if ctx.rank == FAULTY_RANK else 1024)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return attempt(lambda: tune(step))


def _export_table(ctx, case: str) -> str:
    """Tune once into the case's store, then rank 0 exports it as a pinned table; returns its path."""
    store_step(ctx, case, make_kernel(add_block_limited))()
    table = os.path.join(ctx.work_dir, f"{case}-table.json")
    if ctx.rank == 0:
        disttune.store.export_table(table, os.path.join(ctx.work_dir, "store", case))
    ctx.barrier()
    return table


@cases.case
def case_pinned_winner_compile_error(ctx):
    """The pinned winner (BLOCK 64) does not compile on rank 1: the same TuningError on every rank."""
    table = _export_table(ctx, "pinned_compile")
    step = store_step(ctx, "pinned_compile", make_kernel(add_block_limited), pinned=table,
                      limit=64 if ctx.rank == FAULTY_RANK else 1024)
    return attempt(lambda: tune(step))


# -- a rank's own error before a collective ----------------------------------------------------------------

@cases.case
def case_pinned_table_missing_on_one_rank(ctx):
    """Rank 1's pinned table path does not exist: every rank raises at the consensus, not by timeout."""
    table = _export_table(ctx, "pinned_missing")
    if ctx.rank == FAULTY_RANK:
        table += ".missing"
    step = store_step(ctx, "pinned_missing", make_kernel(add_block_limited), pinned=table)
    started = time.monotonic()
    return {**attempt(lambda: tune(step)), "seconds": time.monotonic() - started}


def _function_tuner(ctx, case: str, key_fn=None, prune_fn=None):
    @disttune.autotune([{"variant": v} for v in range(3)], key_fn=key_fn or (lambda x: x.numel()),
                       prune_fn=prune_fn, n_warmup=0, n_repeat=1, timeout_s=20,
                       timer=TableTimer(lambda info: FAST_LAST[info.config_index]),
                       cache_dir=os.path.join(ctx.work_dir, "store", case))
    def pick(x, *, variant):
        sum_across_ranks(ctx, 1.0)
        return variant

    return pick


def _timed_attempt(call) -> dict:
    started = time.monotonic()
    return {**attempt(call), "seconds": time.monotonic() - started}


def _raises_on_rank_1(*args, **kwargs):
    if torch.distributed.get_rank() == FAULTY_RANK:
        raise KeyError("injected fault in a user callable on rank 1")
    return True


@cases.case
def case_function_key_fn_raises_on_one_rank(ctx):
    pick = _function_tuner(ctx, "key_fn_raises", key_fn=lambda x: _raises_on_rank_1() and x.numel())
    return _timed_attempt(lambda: pick(torch.ones(4)))


@cases.case
def case_function_prune_raises_on_one_rank(ctx):
    pick = _function_tuner(ctx, "prune_raises", prune_fn=lambda config, x: _raises_on_rank_1())
    return _timed_attempt(lambda: pick(torch.ones(4)))


@cases.case
def case_function_final_call_raises_on_one_rank(ctx):
    """Rank 1's call with the winner raises (after the function's own collective): every rank raises."""
    calls = {"n": 0}

    @disttune.autotune([{"variant": v} for v in range(3)], key_fn=lambda x: x.numel(), n_warmup=0, n_repeat=1,
                       timeout_s=20, timer=TableTimer(lambda info: FAST_LAST[info.config_index]),
                       cache_dir=os.path.join(ctx.work_dir, "store", "function_final"))
    def pick(x, *, variant):
        calls["n"] += 1
        sum_across_ranks(ctx, 1.0)
        if ctx.rank == FAULTY_RANK and calls["n"] == 4:
            raise RuntimeError("injected fault in the call with the winner")
        return variant

    return {**_timed_attempt(lambda: pick(torch.ones(4))), "second": attempt(lambda: pick(torch.ones(4)))}


@cases.case
def case_statistic_raises_on_one_rank(ctx):
    def statistic(samples):
        _raises_on_rank_1()
        return min(samples)

    step = store_step(ctx, "statistic_raises", make_kernel(), statistic=statistic, store=False)
    return _timed_attempt(lambda: tune(step))



@cases.case
def case_stored_winner_untried_on_one_rank(ctx):
    """Rank 1 reads its own, empty store, so it never tried rank 0's stored winner (BLOCK 64) before the
    final run, where it does not compile there: every rank raises, and the function's collectives stay paired."""
    rank_store = os.path.join(ctx.work_dir, "store", f"untried-rank{ctx.rank}")
    store_step(ctx, "untried", make_kernel(add_block_limited), cache_dir=rank_store)()
    ctx.barrier()
    if ctx.rank == FAULTY_RANK:
        import shutil

        shutil.rmtree(rank_store, ignore_errors=True)
    step = store_step(ctx, "untried", make_kernel(add_block_limited), cache_dir=rank_store,
                      limit=64 if ctx.rank == FAULTY_RANK else 1024)
    return {**attempt(lambda: tune(step)), "then": attempt(lambda: sum_across_ranks(ctx, 1.0))}



# -- bad inputs, refused before tuning starts ----------------------------------------------------------------

def _with_env(name: str, value: str, call):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        return call()
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


@cases.case
def case_bad_inputs(ctx):
    """Each bad input on every rank: refused with an error that names it, before any tuning run."""
    a_file = Path(ctx.work_dir) / f"not-a-directory-{ctx.rank}"
    a_file.write_text("a file\n")
    kernel = make_kernel()

    def contextual(**options):
        return lambda: tune(store_step(ctx, "bad_inputs", kernel, **options))

    def function(key_fn=lambda x: x.numel(), **options):
        options = {"n_warmup": 0, "n_repeat": 1, "timeout_s": 20,
                   "cache_dir": os.path.join(ctx.work_dir, "store", "bad_fn"), **options}
        tuner = disttune.autotune([{"variant": v} for v in range(3)], key_fn=key_fn,
                                  **options)(lambda x, *, variant: sum_across_ranks(ctx, variant))
        return tuner(torch.ones(2))

    attempts = {
        "log_dir is a file": contextual(log_dir=a_file),
        "DISTTUNE_LOG_DIR is a file": lambda: _with_env("DISTTUNE_LOG_DIR", str(a_file), contextual(log_dir=None)),
        "cache_dir not a path": contextual(cache_dir=123),
        "function cache_dir not a path": lambda: function(cache_dir=["a", "list"]),
        "timeout_s 0": contextual(timeout_s=0),
        "timeout_s -1": contextual(timeout_s=-1),
        "function timeout_s 0": lambda: function(timeout_s=0),
        "DISTTUNE_TIMEOUT text": lambda: _with_env("DISTTUNE_TIMEOUT", "soon", contextual(timeout_s=None)),
        "DISTTUNE_TIMEOUT 0": lambda: _with_env("DISTTUNE_TIMEOUT", "0", contextual(timeout_s=None)),
        "key_fn unhashable": lambda: function(key_fn=lambda x: [x.numel()]),
        "statistic gives nan": contextual(statistic=lambda samples: math.nan, store=False),
    }
    seen = {}
    for what, call in attempts.items():
        started = time.monotonic()
        seen[what] = {**attempt(call), "seconds": time.monotonic() - started}
    return {"attempts": seen}


@cases.case
def case_settings_on_one_rank(ctx):
    """A DISTTUNE_* setting that changes the tuning, set on rank 1 only: the same error on every rank, at once."""
    kernel = make_kernel()

    def contextual(case: str):
        return lambda: tune(store_step(ctx, case, kernel, timeout_s=None))

    seen = {}
    for name, value in (("DISTTUNE_ALWAYS_TUNE", "1"), ("DISTTUNE_TIMEOUT", "abc"), ("DISTTUNE_COMPILE_OVERLAP", "0")):
        call = contextual(f"settings_{name}")
        started = time.monotonic()
        ended = attempt(lambda: _with_env(name, value, call) if ctx.rank == FAULTY_RANK else call())
        seen[name] = {**ended, "seconds": time.monotonic() - started}
    return {"settings": seen}


class _Bomb:
    """Unpickling this runs ``Path.touch`` on its path: what a malicious note would do if notes were pickles."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


@cases.case(breaks_group=True, default=False)
def case_pickle_bomb_note(ctx):
    """Rank 1 writes a pickle into its note on the tuning call's channel (as any process that reaches the store's
    port could): no rank unpickles it; every rank raises the same error naming rank 1."""
    import pickle

    from torch.distributed import distributed_c10d

    touched = Path(ctx.work_dir) / "pickle-bomb-went-off"
    kernel = make_kernel()
    runs = {"n": 0}
    x = torch.randn(64, device=ctx.device)

    @disttune.contextual_autotune(**tuner_options(ctx, "pickle_bomb", store=False))
    def step():
        runs["n"] += 1
        if ctx.rank == FAULTY_RANK and runs["n"] == 1:
            store = distributed_c10d._get_default_store()
            channel = f"disttune/all/{step.__qualname__}#0"
            note = wire.pack_frame(ctx.rank, pickle.dumps(_Bomb(str(touched))))  # framed as a post is
            store.append(f"{channel}/note", note)
            store.add(f"{channel}/posts", 1)
            time.sleep(1.0)  # rank 0 is waiting in the consensus: it reads the note there
        y = torch.empty_like(x)
        launch_add(kernel, x, y)
        return y

    ended = _timed_attempt(lambda: tune(step))
    return {**ended, "went_off": touched.exists()}


@cases.case(breaks_group=True, default=False)
def case_keyboard_interrupt(ctx):
    """Rank 1 gets a KeyboardInterrupt in a tuning run (Ctrl-C in its terminal): it leaves with it; rank 0
    hears of it and raises a TuningError naming it, at once rather than at its timeout."""
    kernel = make_kernel()
    runs = {"n": 0}
    x = torch.randn(64, device=ctx.device)

    @disttune.contextual_autotune(**tuner_options(ctx, "interrupt", store=False))
    def step():
        runs["n"] += 1
        if ctx.rank == FAULTY_RANK and runs["n"] == 3:
            raise KeyboardInterrupt
        y = torch.empty_like(x)
        launch_add(kernel, x, y)
        return y

    started = time.monotonic()
    try:
        step()
        ended = {"returned": True}
    except BaseException as err:  # noqa: BLE001 - the record says what each rank saw, KeyboardInterrupt too
        ended = {"raised": type(err).__name__, "error": str(err)}
    return {**ended, "seconds": time.monotonic() - started}


# -- a store lock held by another process ---------------------------------------------------------------------

HOLD_LOCK = """
import sys, time, filelock
lock = filelock.FileLock(sys.argv[1])
lock.acquire()
print("held", flush=True)
time.sleep(120)
"""


@cases.case
def case_store_lock_held(ctx):
    """Another process holds the entry's lock when rank 0 writes the winner: the wait is bounded by the
    tuner's timeout (half of it), the warning names the lock file, and every rank ends with the winner."""
    store = os.path.join(ctx.work_dir, "store", "lock_held")
    store_step(ctx, "lock_held", make_kernel(), cache_dir=store)()  # the entry and its lock file exist now
    ctx.barrier()
    holder = None
    if ctx.rank == 0:
        (lock_file,) = Path(store).glob("*/*.json.lock")
        holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(lock_file)], stdout=subprocess.PIPE,
                                  text=True)
        assert holder.stdout.readline().strip() == "held"
    ctx.barrier()
    step = store_step(ctx, "lock_held", make_kernel(), cache_dir=store, always_tune=True, timeout_s=6)
    started = time.monotonic()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ending = attempt(lambda: tune(step))
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
    return {**ending, "seconds": time.monotonic() - started,
            "lock_warnings": [str(w.message) for w in caught if ".lock" in str(w.message)]}


if __name__ == "__main__":
    sys.exit(cases.main())
