"""How a stall before the function's own collective ends: when each rank raises, and what its error says first.

    torchrun --nproc_per_node=2 bench/stall_ending.py [--tuner function|contextual] [--timeout 5] [--stall 60]
                                                      [--call 4]

The last rank sleeps ``--stall`` seconds in its ``--call``-th call of the tuned function (the 4th: a tuning run;
the final run, with the winner, is the 10th of the function tuner and the 11th of the contextual one), before the
function's ``all_reduce``, which its peers have entered; ``disttune.dist.init`` gets the same ``--timeout`` as the
tuner, so the process group's own timeout is that plus its margin (:func:`disttune.dist.group_timeout_s`).
``--tuner function`` tunes the function over 3 variants with ``disttune.autotune``; ``contextual`` tunes a small
Triton kernel launched after the collective with ``disttune.contextual_autotune``. Each rank prints one line:
the seconds from the start of that call (when the stall began: every rank starts it together, after the
previous run's collective) to its exception, the exception's type and its first line. On CPUs the kernel runs in
Triton's interpreter; under NCCL the same script measures the GPU path.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

if not torch.cuda.is_available():  # the interpreter must be chosen before triton loads
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import disttune  # noqa: E402
from disttune import dist as dt_dist  # noqa: E402


@triton.autotune([triton.Config({"BLOCK": b}, num_warps=1) for b in (16, 32, 64)], key=["n"])
@triton.jit
def add_one(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(y_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + 1, mask=mask)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tuner", choices=("function", "contextual"), default="function")
    parser.add_argument("--timeout", type=float, default=5.0, help="the tuner's and dist.init's timeout_s")
    parser.add_argument("--stall", type=float, default=60.0, help="seconds the last rank sleeps")
    parser.add_argument("--call", type=int, default=4, help="the call of the function the last rank stalls in")
    args = parser.parse_args()
    info = dt_dist.init(timeout_s=args.timeout)
    stalls = info.rank == info.world_size - 1
    calls = {"n": 0, "started": 0.0}

    def body() -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == args.call:
            calls["started"] = time.monotonic()
            if stalls:
                time.sleep(args.stall)
        total = torch.ones(1, device=info.device)
        torch.distributed.all_reduce(total)
        return total

    store = tempfile.mkdtemp(prefix="disttune-stall-")
    common = dict(timeout_s=args.timeout, n_warmup=1, n_repeat=2, cache_dir=store)
    if args.tuner == "function":
        @disttune.autotune([{"variant": v} for v in range(3)], key_fn=lambda: 0, **common)
        def step(*, variant: int) -> torch.Tensor:
            return body()
    else:
        x = torch.zeros(64, device=info.device)

        @disttune.contextual_autotune(is_dist=True, verbose=False, **common)
        def step() -> torch.Tensor:
            total = body()
            y = torch.empty_like(x)
            add_one[lambda meta: (triton.cdiv(x.numel(), meta["BLOCK"]),)](x, y, x.numel())
            return y + total

    try:
        step()
        print(f"rank {info.rank}: {args.tuner} tuner: returned", flush=True)
    except Exception as err:  # noqa: BLE001 - what each rank raised is the measurement
        seconds = time.monotonic() - calls["started"] if calls["started"] else float("nan")
        first = str(err).splitlines()[0] if str(err) else ""
        print(f"rank {info.rank}: {args.tuner} tuner: {seconds:.1f} s after the stall began: "
              f"{type(err).__name__}: {first}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
