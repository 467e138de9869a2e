"""CPU-side cost of one call of a tuned function: disttune's fast path against the same body with the winner fixed.

    python bench/fast_path.py [--out fast_path.jsonl]   # GPU: null and tiny kernels, 10,000 calls, best of 7 rounds
    python bench/fast_path.py --smoke                   # quick CPU check (2,000 calls, 3 rounds, null kernels only)

The target: after tuning, one call of the wrapped function costs at most 2 us more than calling
its body with the winners fixed. Every variant below runs the same body (one launch of the same
kernel, same grid function, same winning config) in a loop of ``--calls`` calls, timed with
``time.perf_counter`` around the whole loop plus a final ``torch.cuda.synchronize()`` on GPUs
(``disttune.benchmark.host_and_wall_us``, the wall time); the rounds interleave the variants and
the best round counts (the least disturbed one, as ``timeit`` does; the median is printed too).

  direct       the body with the winner fixed: ``kernel[grid](x, y, n, **winner.all_kwargs())`` on the jitted kernel
  stock        the body launching a ``triton.autotune`` kernel after its own tuning (a cache hit every call)
  contextual   ``disttune.contextual_autotune`` around the body, after tuning (the intercepted fast path)
  fn-direct    a body taking the tunable as a keyword, called with the winner: ``body(x, y, BLOCK=winner)``
  function     ``disttune.autotune`` around that body, after tuning
  plain-empty / wrapped-empty   a body with no launch, bare and under ``contextual_autotune`` (per-call cost only)

Kernels (``--kernels``):
  null   a ``KernelInterface`` whose ``run`` returns at once: the pure Python dispatch cost, on CPUs and GPUs alike
  null-kw  the null kernel launched with its key argument by keyword (``kernel[grid](x, y, n=N)``), as
         launches that pass constexprs or sizes by name do
  tiny   ``add_block`` on 16 elements, a real launch (GPU only: under ``TRITON_INTERPRET=1`` a launch takes
         milliseconds, which would hide microseconds)

Overheads are differences of per-call microseconds: contextual - direct, function - fn-direct,
stock - direct, wrapped-empty - plain-empty. A table is printed; with ``--out FILE`` one JSON line per
kernel (with device, versions and date) is appended to FILE. ``--profile`` prints a cProfile of the
contextual fast path.

Cost: ``--rounds`` x ``--calls`` calls (after up to 200 warm-up calls) of each of 7 variants per
kernel, and one tuning of three configs per tuner.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch

if not torch.cuda.is_available():  # the interpreter must be chosen before triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime.jit import KernelInterface  # noqa: E402

import disttune  # noqa: E402
from disttune import benchmark  # noqa: E402
from disttune.timing import LaunchInfo  # noqa: E402

GPU = torch.cuda.is_available()
BLOCKS = (16, 32, 64)
N = 16


@triton.jit
def add_block(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(y_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + BLOCK, mask=mask)


def _null_body(x_ptr, y_ptr, n, BLOCK):  # noqa: N803 - the signature the null kernel reports
    """What the null kernel stands for (its source keys the winner store; it never runs)."""


class NullKernel(KernelInterface):
    """A launchable with the jitted kernel's signature whose launch does nothing: dispatch cost only."""

    def __init__(self) -> None:
        self.fn = _null_body
        self.arg_names = ["x_ptr", "y_ptr", "n", "BLOCK"]
        self.launches = 0

    def run(self, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        return None


class PreferTimer:
    """A disttune Timer under which ``winner`` is fastest: all tuners then launch the same config."""

    def __init__(self, winner: triton.Config) -> None:
        self.winner = dict(winner.kwargs)

    def time(self, launch: Callable[[], Any], info: LaunchInfo) -> Callable[[], float]:
        launch()
        tried = getattr(info.config, "kwargs", info.config)  # a triton.Config, or the function tuner's dict
        value = 1.0 if dict(tried) == self.winner else 2.0
        return lambda: value


def host_bench(kernel_call: Callable[[], Any], quantiles: Any = None) -> list[float]:
    """Stock autotune's benchmarker where no GPU is (or for the null kernel): config order decides."""
    kernel_call()
    return [1.0, 1.0, 1.0]


def grid(meta: dict) -> tuple:
    return (triton.cdiv(N, meta["BLOCK"]),)


def build(kind: str, workdir: Path) -> dict[str, Callable[[], Any]]:
    """The variants' bodies for one kernel kind, every tuner already tuned on the same winner."""
    jitted = NullKernel() if kind.startswith("null") else add_block
    keyword = kind.endswith("-kw")
    configs = [triton.Config({"BLOCK": b}, num_warps=1) for b in BLOCKS]
    x = torch.randn(N, device="cuda" if GPU else "cpu")
    y = torch.empty_like(x)

    stock_kernel = triton.autotune(configs, key=["n"], do_bench=None if (GPU and kind == "tiny") else host_bench)(jitted)
    stock_kernel[grid](x, y, N)  # stock Triton tunes here, with its own benchmarker
    (winner,) = stock_kernel.cache.values()
    fixed = winner.all_kwargs()

    ours = triton.autotune(configs, key=["n"])(jitted)
    options = dict(timer=PreferTimer(winner), n_warmup=1, n_repeat=1, verbose=False,
                   log_dir=workdir / "logs", cache_dir=workdir / "store")

    def launch(kernel: Any, **extra: Any) -> None:
        if keyword:
            kernel[grid](x, y, n=N, **extra)
        else:
            kernel[grid](x, y, N, **extra)

    def direct() -> None:
        launch(jitted, **fixed)

    def stock() -> None:
        launch(stock_kernel)

    @disttune.contextual_autotune(**options)
    def contextual() -> None:
        launch(ours)

    def fn_body(x: torch.Tensor, y: torch.Tensor, *, BLOCK: int) -> None:  # noqa: N803
        jitted[grid](x, y, N, BLOCK=BLOCK, num_warps=1)

    space = [{"BLOCK": b} for b in BLOCKS]
    function_tuned = disttune.autotune(space, key_fn=lambda x, y: x.numel(), n_warmup=1, n_repeat=1,
                                       timer=PreferTimer(winner), cache_dir=workdir / "fstore")(fn_body)
    block = fixed["BLOCK"]

    def fn_direct() -> None:
        fn_body(x, y, BLOCK=block)

    def function() -> None:
        function_tuned(x, y)

    contextual()  # tunes
    function()  # tunes
    assert contextual.report.results[0].config.kwargs == winner.kwargs, "the tuners must launch the same config"
    assert function_tuned.cache[N] == {"BLOCK": block}
    if kind == "tiny":
        y.zero_()
        contextual()
        sync()
        assert torch.equal(y, x + block), "the fast path launched the wrong config"
    return {"direct": direct, "stock": stock, "contextual": contextual, "fn-direct": fn_direct, "function": function}


def empty_bodies(workdir: Path) -> dict[str, Callable[[], Any]]:
    def plain_empty() -> None:
        return None

    wrapped_empty = disttune.contextual_autotune(verbose=False, log_dir=workdir / "logs")(plain_empty)
    wrapped_empty()
    return {"plain-empty": plain_empty, "wrapped-empty": wrapped_empty}


def sync() -> None:
    if GPU:
        torch.cuda.synchronize()


def measure(bodies: dict[str, Callable[[], Any]], calls: int, rounds: int) -> dict[str, dict[str, float]]:
    """Best and median µs per call of each body over interleaved rounds (each body warmed first:
    first-call compiles, lazy imports)."""
    samples = benchmark.host_and_wall_us(bodies, calls=calls, rounds=rounds, warmup=min(calls, 200))
    return {name: {"best_us": min(s.wall_us for s in runs), "median_us": statistics.median(s.wall_us for s in runs)}
            for name, runs in samples.items()}


OVERHEADS = {  # name: (variant, baseline)
    "contextual_over_direct_us": ("contextual", "direct"),
    "function_over_fn_direct_us": ("function", "fn-direct"),
    "stock_over_direct_us": ("stock", "direct"),
    "wrapped_empty_over_plain_us": ("wrapped-empty", "plain-empty"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--kernels", default=None, help="comma-separated: null,null-kw,tiny (default: all on GPU, null and null-kw on CPU)")
    parser.add_argument("--smoke", action="store_true", help="a quick CPU check: 2,000 calls, 3 rounds")
    parser.add_argument("--profile", action="store_true", help="cProfile the contextual fast path (null kernel)")
    parser.add_argument("--out", default=None, help="append one JSON line per kernel to this file")
    options = parser.parse_args()
    if options.smoke:
        options.calls, options.rounds = min(options.calls, 2000), min(options.rounds, 3)
    kinds = (options.kernels or ("null,null-kw,tiny" if GPU else "null,null-kw")).split(",")
    if "tiny" in kinds and not GPU:
        sys.exit("bench/fast_path.py: the tiny kernel needs a GPU (an interpreted launch takes milliseconds); "
                 "use --kernels null on CPUs")
    env = benchmark.environment()

    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        empty = measure(empty_bodies(workdir), options.calls, options.rounds)
        rows = []
        for kind in kinds:
            bodies = build(kind, workdir / kind)
            if options.profile and kind == "null":
                profile(bodies["contextual"], options.calls)
            times = {**measure(bodies, options.calls, options.rounds), **empty}
            overheads = {name: times[a]["best_us"] - times[b]["best_us"] for name, (a, b) in OVERHEADS.items()}
            rows.append({"bench": "fast_path", "kernel": kind, "calls": options.calls,
                         "rounds": options.rounds, "per_call_us": times, **overheads,
                         "target_us": 2.0, "meets_target": overheads["contextual_over_direct_us"] <= 2.0
                         and overheads["function_over_fn_direct_us"] <= 2.0})

    print(f"\nfast path, CPU-side us per call ({options.calls} calls, best of {options.rounds} rounds; median), "
          f"{env['device']}, torch {env['torch']}, triton {env['triton']}")
    names = list(rows[0]["per_call_us"])
    print(f"{'variant':<14}" + "".join(f"{row['kernel'] + ' kernel':>26}" for row in rows))
    for name in names:
        cells = "".join(f"{row['per_call_us'][name]['best_us']:14.2f} ({row['per_call_us'][name]['median_us']:8.2f})"
                        for row in rows)
        print(f"{name:<14}{cells}")
    for name in OVERHEADS:
        print(f"{name:<30}" + "".join(f"{row[name]:+10.2f}" for row in rows))
    print("target: contextual - direct and function - fn-direct <= 2 us per call: "
          + ", ".join(f"{row['kernel']}: {'met' if row['meets_target'] else 'NOT met'}" for row in rows))
    written = benchmark.append_rows(options.out, rows, meta=env)
    if written:
        print(f"rows appended to {written}")


def profile(body: Callable[[], Any], calls: int) -> None:
    """Print where the host time of ``calls`` calls of ``body`` goes (cProfile, top 15)."""
    host_ms, table = benchmark.cprofile(body, calls=calls, top=15)
    print(f"\ncProfile of the contextual fast path: {host_ms * 1e3:.2f} us per call (profiled)\n{table}")


if __name__ == "__main__":
    main()
