"""disttune: tune Triton kernels across many ranks, in context, so every rank agrees on the winners.

The public entry points:

* :func:`contextual_autotune` wraps a function and tunes every ``triton.autotune``
  kernel launched inside it, agreed across ranks;
* :func:`autotune` tunes a function over keyword-argument configs, agreed across ranks;
* :func:`space` generates a config space pruned by the device's budget and the problem's size;
* ``step.sweep(cases)`` tunes a list of shapes before deployment and writes a pinned table
  (:mod:`disttune.sweep`); ``on_new_key=`` serves shapes never tuned (:mod:`disttune.unseen`);
* :mod:`disttune.store` keeps winners on disk so the next process tunes nothing;
* :mod:`disttune.dist` starts ``torch.distributed`` from torchrun's or MPI's environment;
* :func:`warm_up` pays Triton's one-time initialisation before the first tuning call.
"""

from . import dist
from .comm import CollectiveTimeout, LocalComm, MpiComm, TorchComm
from .agreement import SiteResult, TuningError, TuningReport
from .contextual import ContextualAutotuner, contextual_autotune
from .function import FunctionAutotuner, autotune
from .objective import Measurements, Pareto, pareto
from .search import ModelSearch
from .space import ConfigSpace, space
from .sites import AllConfigsFailed, SiteId
from .configs import describe_config
from .sweep import SweepRow
from .timing import CudaEventTimer, HostTimer, LaunchInfo, Timer
from .unseen import UnseenKeyError
from .warmup import warm_up

__all__ = [
    "dist",
    "AllConfigsFailed",
    "ConfigSpace",
    "CollectiveTimeout",
    "ContextualAutotuner",
    "CudaEventTimer",
    "HostTimer",
    "LaunchInfo",
    "LocalComm",
    "Measurements",
    "ModelSearch",
    "Pareto",
    "MpiComm",
    "SiteId",
    "SiteResult",
    "SweepRow",
    "Timer",
    "TorchComm",
    "TuningError",
    "TuningReport",
    "UnseenKeyError",
    "FunctionAutotuner",
    "autotune",
    "contextual_autotune",
    "describe_config",
    "pareto",
    "space",
    "warm_up",
]
__version__ = "0.1.0"
