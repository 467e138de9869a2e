"""What the MoE modules share: input checks, output buffers and the cross-rank signature's pieces.

Every function here is a few Python operations on tensor metadata, except :func:`empty_buffer`
(one allocation, NaN-filled when ``DISTTUNE_MOE_POISON=1``). :class:`PassedChecks` remembers the
layouts whose checks passed, so a call like an earlier one skips them.
"""

from __future__ import annotations

from typing import Any, Hashable, Optional

import torch

from disttune import env

from .matmul import SUPPORTED_DTYPES, interpreting

__all__ = ["POISON_ENV", "INTERPRETED", "empty_buffer", "check_float_tensor", "check_device",
           "DTYPE_CODES", "shape_of", "dtype_code", "tensor_layout", "PassedChecks"]

#: Whether Triton runs in the interpreter (read once at import, as ``triton.jit`` decides it for the
#: MoE kernels jitted right after).
INTERPRETED = interpreting()

#: Set to 1 to fill every buffer these functions allocate with NaN (tests: an unwritten
#: tile or row then shows up in the result instead of passing as stale memory).
POISON_ENV = env.MOE_POISON


def empty_buffer(shape, dtype, device) -> torch.Tensor:
    """``torch.empty``, or NaN-filled when :data:`POISON_ENV` is set."""
    if env.poison_buffers():
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def check_float_tensor(where: str, name: str, t: torch.Tensor) -> None:
    """TypeError unless ``t`` is a tensor of a dtype the kernels support."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{where}: {name} dtype {t.dtype} not supported (need one of {SUPPORTED_DTYPES})")


def check_device(where: str, ref: torch.Tensor, **tensors: Optional[torch.Tensor]) -> None:
    """ValueError unless every given tensor is on ``ref``'s device and Triton can run there."""
    for name, t in tensors.items():
        if t is not None and t.device != ref.device:
            raise ValueError(f"{where}: {name} is on {t.device} but the input is on {ref.device}; "
                             "move every tensor to one device")
    if ref.device.type != "cuda" and not INTERPRETED:
        raise ValueError(f"{where}: tensors are on {ref.device}; Triton needs CUDA tensors unless "
                         "TRITON_INTERPRET=1 was set before triton was imported")


#: Codes of the float dtypes in the cross-rank signature (0: no tensor, -1: not known).
DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3}


def shape_of(t, dims: int) -> Optional[tuple]:
    """``t``'s shape if it is a tensor with ``dims`` dimensions, else None (for messages and signatures)."""
    return tuple(t.shape) if isinstance(t, torch.Tensor) and t.dim() == dims else None


def dtype_code(t) -> int:
    """:data:`DTYPE_CODES` entry of ``t``'s dtype (0 for None, -1 for an unknown dtype)."""
    if t is None:
        return 0
    return DTYPE_CODES.get(getattr(t, "dtype", None), -1)


def tensor_layout(t) -> Optional[tuple]:
    """What checks read of a tensor, as a dictionary key: type, dtype, shape, strides, device and the start's
    16-byte alignment (None for None). Raises AttributeError for an object that is not tensor-like."""
    return None if t is None else (type(t), t.dtype, t.shape, t.stride(), t.device, t.data_ptr() % 16)


class PassedChecks:
    """The layouts (keys built from :func:`tensor_layout` and the call's other arguments) whose input
    checks passed, each with what the checks computed, so a call with a known layout skips them: one
    dictionary lookup. Holds at most ``limit`` layouts (all dropped when full: a workload has few)."""

    def __init__(self, limit: int = 256) -> None:
        self.limit = limit
        self._passed: dict = {}

    def get(self, key: Optional[Hashable]) -> Any:
        """What the checks of ``key``'s layout computed, or None if they have not passed (or ``key`` is None)."""
        return None if key is None else self._passed.get(key)

    def add(self, key: Optional[Hashable], value: Any) -> None:
        """Remember that ``key``'s checks passed, computing ``value`` (not None); a None key is not kept."""
        if key is None:
            return
        if len(self._passed) >= self.limit:
            self._passed.clear()
        self._passed[key] = value
