"""A one-kernel step for ``disttune verify`` tests: a fake timer whose winner (config 1) can be slowed down.

    python tests/verify_step.py [SLOWDOWN]       # under scripts/launch.sh, any number of ranks

Config times: 2, 1 and 3 ms, rank r's scaled by 1 + r/10 (so the agreed max is rank w-1's); config 1's
multiplied by SLOWDOWN (default 1). Store, pinned table and logs come from the environment.
"""

from __future__ import annotations

import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import disttune  # noqa: E402
from disttune import dist as dt_dist  # noqa: E402
from tiny_kernels import TableTimer, launch_add, make_kernel  # noqa: E402

TIMES = {0: 2.0, 1: 1.0, 2: 3.0}


def main() -> int:
    slowdown = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
    info = dt_dist.init()
    kernel = make_kernel()
    timer = TableTimer(lambda launch: TIMES[launch.config_index] * (slowdown if launch.config_index == 1 else 1.0)
                       * (1 + info.rank / 10))
    x = torch.randn(64, device=info.device)

    @disttune.contextual_autotune(is_dist=True, n_warmup=0, n_repeat=2, timer=timer, timeout_s=60)
    def step():
        y = torch.empty_like(x)
        launch_add(kernel, x, y)
        return y

    ok = torch.equal(step(), x + 32)
    dt_dist.destroy()
    return 0 if ok else 3


if __name__ == "__main__":
    sys.exit(main())
