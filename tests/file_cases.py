"""Multi-rank cases about the files disttune reads and writes: damaged store entries and pinned tables,
planted symbolic links, the store's lock, and jobs spread over two nodes.

    python tests/file_cases.py CASE [CASE ...] --out DIR

Each rank runs the named cases (see ``rank_cases``) and writes one record per case into DIR;
``test_file_faults.py`` and ``test_nodes.py`` launch this file and assert on the records. Every
directory a case writes lies under DIR (``work_dir``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
import time
import warnings
from pathlib import Path

from rank_cases import Cases, Ranks

import torch  # noqa: E402

import disttune  # noqa: E402
from disttune import store  # noqa: E402
from tiny_kernels import TableTimer, launch_add, make_kernel  # noqa: E402

cases = Cases(__doc__)

#: What each damage does to a good store entry (``text``: the file's JSON text).
DAMAGES = {
    "not utf-8": lambda text: text.encode("utf-8")[:20] + b"\xff\xfe\x80" + text.encode("utf-8")[20:],
    "deep nesting": lambda text: b"[" * 200_000 + b"]" * 200_000,
    "winner true": lambda text: json.dumps({**json.loads(text), "winner": True}).encode(),
    "winner_config disagrees": lambda text: json.dumps(
        {**json.loads(text), "winner_config": json.loads(text)["configs"][0]}).encode(),
    "winner a string": lambda text: json.dumps({**json.loads(text), "winner": "1"}).encode(),
    "configs not texts": lambda text: json.dumps({**json.loads(text), "configs": [1, 2, 3]}).encode(),
}
TIMES = {0: 3.0, 1: 1.0, 2: 2.0}  # config 1 wins


def tuned(ctx: Ranks, cache_dir, log_dir, kernel=None, **options):
    """A fresh tuner around a fresh 3-config kernel, with a user collective in the step."""
    kernel = kernel or make_kernel(blocks=(16, 32, 64))
    x = torch.randn(128, device=ctx.device)

    @disttune.contextual_autotune(is_dist=True, n_warmup=1, n_repeat=2, timeout_s=60, verbose=False,
                                  timer=TableTimer(lambda info: TIMES[info.config_index]),
                                  cache_dir=cache_dir, log_dir=log_dir, **options)
    def step():
        total = torch.ones(1, device=ctx.device)
        torch.distributed.all_reduce(total)  # a collective of the user's: the schedules must stay paired
        y = torch.full_like(x, float("nan"))
        launch_add(kernel, x, y)
        return y

    return step, x


def call(step, x) -> dict:
    """Call ``step`` once: its source, winner, warnings and output check, or the error it raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            y = step()
        except Exception as err:  # noqa: BLE001 - the record says what it was
            return {"error_type": type(err).__name__, "error": str(err), "warnings": [str(w.message) for w in caught]}
    (result,) = step.report.results
    return {"source": result.source, "winner": result.winner, "output_ok": bool(torch.equal(y, x + 32)),
            "warnings": [str(w.message) for w in caught]}


def entry_files(root: Path) -> list[Path]:
    return sorted(p for p in root.glob("*/*.json") if not p.name.startswith("."))


@cases.case(default=False)
def case_damaged_store(ctx):
    """Per damage: tune into a per-rank store, damage rank 0's entry, tune again, then load."""
    results = {}
    for damage in [*DAMAGES, "fifo"]:
        base = ctx.work_dir / "damaged" / damage.replace(" ", "_") / f"rank{ctx.rank}"
        logs = ctx.work_dir / "damaged-logs" / f"rank{ctx.rank}"
        first = call(*tuned(ctx, base, logs))
        if ctx.rank == 0:
            (path,) = entry_files(base)
            if damage == "fifo":
                path.unlink()
                os.mkfifo(path)
            else:
                path.write_bytes(DAMAGES[damage](path.read_text()))
        ctx.barrier()
        second = call(*tuned(ctx, base, logs))
        third = call(*tuned(ctx, base, logs))
        results[damage] = {"first": first, "second": second, "third": third}
    return {"damages": results}


@cases.case(default=False)
def case_damaged_pinned(ctx):
    """Per damage: every rank is given the same damaged pinned table; each must raise one clear error."""
    good = ctx.work_dir / "pinned-good"  # shared: rank 0 writes it once the final run agreed
    call(*tuned(ctx, good, ctx.work_dir / "pinned-logs"))
    ctx.barrier()
    (path,) = entry_files(good)
    record_text = path.read_text()
    good_table = json.dumps({"schema": store.TABLE_SCHEMA, "entries": [json.loads(record_text)]})
    results = {}
    for damage in [*DAMAGES, "fifo"]:  # one table for all ranks, written by rank 0
        table = ctx.work_dir / "tables" / f"{damage.replace(' ', '_')}.json"
        table.parent.mkdir(parents=True, exist_ok=True)
        if ctx.rank != 0:
            pass
        elif damage == "fifo":
            os.mkfifo(table)
        elif damage in ("not utf-8", "deep nesting"):
            table.write_bytes(DAMAGES[damage](good_table))
        else:
            table.write_text(json.dumps({"schema": store.TABLE_SCHEMA,
                                         "entries": [json.loads(DAMAGES[damage](record_text))]}))
        ctx.barrier()
        started = time.monotonic()
        outcome = call(*tuned(ctx, ctx.work_dir / "unused-store", ctx.work_dir / "pinned-logs", pinned=table))
        results[damage] = {**outcome, "table": str(table), "elapsed_s": time.monotonic() - started}
    return {"damages": results}


KERNEL_SOURCE = '''
import triton
import triton.language as tl


@triton.jit
def shifted(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(y_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + BLOCK + SHIFT, mask=mask)
'''


def kernel_module(folder: Path, shift: int):
    """The module ``kmod`` with ``shifted`` adding ``shift``: same module and kernel name, another source."""
    path = folder / f"kmod_{shift}" / "kmod.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(KERNEL_SOURCE.replace("SHIFT", str(shift)))
    spec = importlib.util.spec_from_file_location("kmod", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["kmod"] = module
    spec.loader.exec_module(module)
    return module


@cases.case(default=False)
def case_pinned_other_source(ctx):
    """A table exported for one kernel source, pinned after the kernel was edited: an error on every rank."""
    folder = ctx.work_dir / "kernels" / f"rank{ctx.rank}"
    old = kernel_module(folder, 0)
    cache = ctx.work_dir / "source-store" / f"rank{ctx.rank}"
    before = call(*tuned(ctx, cache, ctx.work_dir / "source-logs", kernel=make_kernel(old.shifted)))
    table = ctx.work_dir / "source-table.json"
    if ctx.rank == 0:
        store.export_table(table, cache)
    ctx.barrier()
    same = call(*tuned(ctx, ctx.work_dir / "unused", ctx.work_dir / "source-logs", kernel=make_kernel(old.shifted),
                       pinned=table))
    new = kernel_module(folder, 1)
    edited = call(*tuned(ctx, ctx.work_dir / "unused", ctx.work_dir / "source-logs", kernel=make_kernel(new.shifted),
                         pinned=table))
    return {"before": before, "same": same, "edited": edited, "table": str(table)}


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@cases.case(default=False)
def case_planted_links(ctx):
    """Links planted where the rank log, the kernel folder, the entry and its lock file go: none is written through.

    Every victim (a file or folder the links point at) is hashed before and after; the record gives both.
    """
    work = ctx.work_dir / "links" / f"rank{ctx.rank}"
    victims = work / "victims"
    victims.mkdir(parents=True)
    for name in ("log", "entry", "lock"):
        (victims / name).write_text(f"{name} victim of rank {ctx.rank}\n")
    outside = victims / "folder"
    outside.mkdir()
    logs, cache = work / "logs", work / "store"

    scout = ctx.work_dir / "links" / "scout"  # where the kernel's folder goes: a first tuning, rank 0 writes
    call(*tuned(ctx, scout, work / "scout-logs"))
    ctx.barrier()  # rank 0 writes once the final run agreed
    folder_name = entry_files(scout)[0].parent.name
    entry_name = entry_files(scout)[0].name

    logs.mkdir()
    (logs / f"rank-{ctx.rank}.log").symlink_to(victims / "log")
    cache.mkdir()
    (cache / folder_name).symlink_to(outside, target_is_directory=True)
    before = {name: digest(victims / name) for name in ("log", "entry", "lock")}
    first = call(*tuned(ctx, cache, logs))  # tunes; rank 0 writes the store through the planted folder link?

    if ctx.rank == 0:  # the folder is a real one now (or the write went outside): plant entry and lock links
        folder = cache / folder_name
        if folder.is_dir() and not folder.is_symlink():
            (folder / entry_name).unlink(missing_ok=True)
            (folder / entry_name).symlink_to(victims / "entry")
            (folder / (entry_name + ".lock")).unlink(missing_ok=True)
            (folder / (entry_name + ".lock")).symlink_to(victims / "lock")
    ctx.barrier()
    second = call(*tuned(ctx, cache, logs))
    third = call(*tuned(ctx, cache, logs))
    after = {name: digest(victims / name) for name in ("log", "entry", "lock")}
    folder = cache / folder_name
    return {"first": first, "second": second, "third": third,
            "changed": sorted(name for name in before if before[name] != after[name]),
            "outside": sorted(p.name for p in outside.iterdir()),
            "folder_is_link": folder.is_symlink(), "log_is_link": (logs / f"rank-{ctx.rank}.log").is_symlink(),
            "entry_is_link": (folder / entry_name).is_symlink(),
            "log_has_records": (logs / f"rank-{ctx.rank}.log").exists()
            and '"event": "winner"' in (logs / f"rank-{ctx.rank}.log").read_text()}


@cases.case(default=False)
def case_held_lock(ctx):
    """Rank 0 saves into a shared store while the test holds the entry's lock (see test_file_faults.py).

    Rank 0 announces the lock it is about to take in ``lock-wanted`` and waits for ``lock-held`` (the
    test holding it), then takes it as usual: its write can only land once the test lets go.
    """
    signals = Path(os.environ["DISTTUNE_TEST_SIGNALS"])
    if ctx.rank == 0:
        real_locked = store._locked

        def announced(path, *args, **kwargs):
            (signals / "lock-wanted").write_text(str(path))
            deadline = time.monotonic() + 60
            while not (signals / "lock-held").exists() and time.monotonic() < deadline:
                time.sleep(0.02)
            return real_locked(path, *args, **kwargs)

        store._locked = announced
    started = time.monotonic()
    try:
        outcome = call(*tuned(ctx, ctx.work_dir / "shared-store", ctx.work_dir / "lock-logs"))
    finally:
        if ctx.rank == 0:
            store._locked = real_locked
    return {**outcome, "tuning_s": time.monotonic() - started}


def node_of(ctx: Ranks) -> int:
    return int(os.environ.get("GROUP_RANK", "0"))


def _two_nodes(ctx: Ranks, writer: str) -> dict:
    """Tune with compile_split on and ``store_writer=writer``, each node with a store folder of its own.

    Compiles are recorded by a stand-in for the compiler (under the interpreter nothing compiles):
    which configs this rank compiled, and when, so the test sees each node's ranks share the work.
    """
    from disttune import compile as compiling
    from disttune import env

    blocks = (16, 32, 64, 128, 256)
    table = [5.0, 2.0, 1.0, 3.0, 4.0]
    calls: list = []
    real_precompile, real_can = compiling.precompile, compiling.can_precompile
    interpreted = not torch.cuda.is_available()

    def recording_precompile(autotuner, args, kwargs, config, device):
        started = time.monotonic()
        try:
            if interpreted:
                time.sleep(0.05 + 0.1 * env.local_rank())
                return None
            return real_precompile(autotuner, args, kwargs, config, device)
        finally:
            calls.append((config.kwargs["BLOCK"], started, time.monotonic()))

    compiling.precompile = recording_precompile
    if interpreted:
        compiling.can_precompile = lambda autotuner: True
    node_store = ctx.work_dir / f"nodes-{writer}" / f"node{node_of(ctx)}"
    kernel = make_kernel(blocks=blocks)
    x = torch.randn(256, device=ctx.device)
    try:
        @disttune.contextual_autotune(is_dist=True, n_warmup=1, n_repeat=2, timeout_s=60, verbose=False,
                                      timer=TableTimer(lambda info: table[info.config_index]),
                                      cache_dir=node_store, log_dir=ctx.work_dir / "node-logs",
                                      store_writer=writer, compile_threads=2, compile_split=True)
        def step():
            y = torch.full_like(x, float("nan"))
            launch_add(kernel, x, y)
            return y

        y = step()
    finally:
        compiling.precompile, compiling.can_precompile = real_precompile, real_can
    (result,) = step.report.results
    ctx.barrier()  # every writer has written
    return {"node": node_of(ctx), "local_rank": env.local_rank(), "local_world": env.local_world_size(),
            "calls": calls, "blocks": list(blocks), "winner": result.winner, "source": result.source,
            "output_ok": bool(torch.equal(y, x + blocks[result.winner])),
            "store_files": [str(p.relative_to(ctx.work_dir)) for p in entry_files(node_store)]}


@cases.case(default=False)
def case_nodes_node_writer(ctx):
    return _two_nodes(ctx, "node")


@cases.case(default=False)
def case_nodes_global_writer(ctx):
    return _two_nodes(ctx, "global")


if __name__ == "__main__":
    sys.exit(cases.main())
