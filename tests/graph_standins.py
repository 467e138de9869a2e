"""Stand-ins for CUDA graph capture where there is no GPU.

``ReplayByRerun`` plays a capture: its "replay" runs the captured step again on the graph's own inputs and
copies the results into the captured outputs, as a graph's replay writes them in place. So a test sees stale
results if a call's tensors were not copied into the graph's inputs, or if a result aliased the graph's
outputs. ``fail=True`` plays a capture that fails when it ends (as ``cudaStreamEndCapture`` or the graph's
instantiation fails after the step's launches were recorded): the step runs, then the capture raises.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves


class CaptureFailed(RuntimeError):
    """What a failing stand-in capture raises."""


class ReplayByRerun:
    """Stands in for CUDA graph capture (see the module doc)."""

    def __init__(self, fail: bool = False) -> None:
        self.fail = fail

    def __call__(self, step):
        outputs = step()
        if self.fail:
            raise CaptureFailed("operation not permitted when stream is capturing (injected)")

        def replay() -> None:
            for mine, fresh in zip(tree_leaves(outputs), tree_leaves(step())):
                if isinstance(mine, torch.Tensor):
                    mine.copy_(fresh)

        return replay, outputs
