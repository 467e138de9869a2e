"""disttune: tune Triton kernels across many ranks, in context, so every rank agrees on the winners.

The public entry points:

* :func:`contextual_autotune` wraps a function and tunes every ``triton.autotune``
  kernel launched inside it, agreed across ranks;
* :func:`autotune` tunes a function over keyword-argument configs, agreed across ranks;
* :mod:`disttune.store` keeps winners on disk so the next process tunes nothing;
* :mod:`disttune.dist` starts ``torch.distributed`` from torchrun's or MPI's environment;
* :func:`warm_up` pays Triton's one-time initialisation before the first tuning call.
"""

from . import dist
from .comm import CollectiveTimeout, LocalComm, MpiComm, TorchComm
from .agreement import SiteResult, TuningError, TuningReport
from .contextual import ContextualAutotuner, contextual_autotune
from .function import FunctionAutotuner, autotune
from .sites import AllConfigsFailed, SiteId, describe_config
from .timing import CudaEventTimer, HostTimer, LaunchInfo, Timer
from .warmup import warm_up

__all__ = [
    "dist",
    "AllConfigsFailed",
    "CollectiveTimeout",
    "ContextualAutotuner",
    "CudaEventTimer",
    "HostTimer",
    "LaunchInfo",
    "LocalComm",
    "MpiComm",
    "SiteId",
    "SiteResult",
    "Timer",
    "TorchComm",
    "TuningError",
    "TuningReport",
    "FunctionAutotuner",
    "autotune",
    "contextual_autotune",
    "describe_config",
    "warm_up",
]
__version__ = "0.1.0"
