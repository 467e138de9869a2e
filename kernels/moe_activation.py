"""The MoE MLP's gating between its two grouped GEMMs: ``silu(gate) * up`` in one Triton launch.

The torch form (``h.float()``, ``silu``, a multiply, a cast back) makes four passes over the
``[rows, 2I]`` activations and takes four launches; the kernel here reads ``h`` once and writes the
``[rows, I]`` result once, in fp32 arithmetic. On CPU tensors without Triton's interpreter the torch
form runs instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from disttune.jit_launch import launch

from .matmul import cdiv
from .moe_common import INTERPRETED

__all__ = ["silu_and_mul", "silu_and_mul_torch"]

_BLOCK_ROWS = 16
_BLOCK_COLS = 256


@triton.jit
def _silu_and_mul_kernel(h_ptr, out_ptr, rows, half, stride_h, stride_out,
                         BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    col = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    mask = (row[:, None] < rows) & (col[None, :] < half)
    gate_at = h_ptr + row[:, None].to(tl.int64) * stride_h + col[None, :]
    gate = tl.load(gate_at, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_at + half, mask=mask, other=0.0).to(tl.float32)
    gated = gate * tl.sigmoid(gate) * up
    out_at = out_ptr + row[:, None].to(tl.int64) * stride_out + col[None, :]
    tl.store(out_at, gated.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(h: torch.Tensor) -> torch.Tensor:
    """``silu(h[:, :I]) * h[:, I:]`` for ``h [R, 2I]`` (gate first, then up), computed in fp32, returned
    in ``h``'s dtype. One launch reading ``h`` once (a copy first if its rows are not contiguous)."""
    if h.dim() != 2 or h.shape[1] % 2:
        raise ValueError(f"silu_and_mul: h must be [rows, 2 * I], got shape {tuple(h.shape)}")
    if h.device.type != "cuda" and not INTERPRETED:
        return silu_and_mul_torch(h)
    rows, half = h.shape[0], h.shape[1] // 2
    if h.stride(1) != 1:
        h = h.contiguous()
    out = torch.empty(rows, half, dtype=h.dtype, device=h.device)
    if out.numel():
        grid = (cdiv(rows, _BLOCK_ROWS), cdiv(half, _BLOCK_COLS))
        launch(_silu_and_mul_kernel, grid, h, out, rows, half, h.stride(0), out.stride(0),
               BLOCK_ROWS=_BLOCK_ROWS, BLOCK_COLS=_BLOCK_COLS, num_warps=4)
    return out


def silu_and_mul_torch(h: torch.Tensor) -> torch.Tensor:
    """The same in torch ops (four launches on a GPU): what :func:`silu_and_mul` is checked against."""
    gate, up = h.float().chunk(2, dim=1)
    return (F.silu(gate) * up).to(h.dtype)
