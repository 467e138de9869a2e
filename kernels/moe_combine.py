"""The MoE MLP's last step: each token's ``top_k`` expert outputs summed into one row, in one Triton launch.

The torch form (a sum over the choices in fp32, then a cast back) writes an fp32 ``[T, N]`` intermediate and
reads it again, in two launches; the kernel here reads the ``[T * top_k, N]`` rows once and writes the
``[T, N]`` result once, adding the choices in fp32 in their order. On CPU tensors without Triton's interpreter
the torch form runs instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from disttune.jit_launch import launch

from .matmul import cdiv
from .moe_common import INTERPRETED, empty_buffer

__all__ = ["topk_sum", "topk_sum_torch"]

_BLOCK_TOKENS = 16
_BLOCK_COLS = 256


@triton.jit
def _topk_sum_kernel(y_ptr, out_ptr, tokens, cols, stride_y, stride_out, TOP_K: tl.constexpr,
                     BLOCK_TOKENS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    token = tl.program_id(0) * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)
    col = tl.program_id(1) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    mask = (token[:, None] < tokens) & (col[None, :] < cols)
    acc = tl.zeros((BLOCK_TOKENS, BLOCK_COLS), dtype=tl.float32)
    for choice in tl.static_range(TOP_K):
        row = token.to(tl.int64) * TOP_K + choice
        acc += tl.load(y_ptr + row[:, None] * stride_y + col[None, :], mask=mask, other=0.0).to(tl.float32)
    out_at = out_ptr + token[:, None].to(tl.int64) * stride_out + col[None, :]
    tl.store(out_at, acc.to(out_ptr.dtype.element_ty), mask=mask)


def topk_sum(y_flat: torch.Tensor, T: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``[T * k, N]`` in flat (token, choice) order summed over the choices: ``[T, N]`` in ``dtype``, fp32
    sum. One launch reading ``y_flat`` once (a copy first if its rows are not contiguous)."""
    if y_flat.dim() != 2 or y_flat.shape[0] != T * k:
        raise ValueError(f"topk_sum: y_flat must be [T * k = {T * k}, N], got shape {tuple(y_flat.shape)}")
    if y_flat.device.type != "cuda" and not INTERPRETED:
        return topk_sum_torch(y_flat, T, k, dtype)
    if y_flat.stride(1) != 1:
        y_flat = y_flat.contiguous()
    N = y_flat.shape[1]
    out = empty_buffer((T, N), dtype, y_flat.device)
    if out.numel():
        grid = (cdiv(T, _BLOCK_TOKENS), cdiv(N, _BLOCK_COLS))
        launch(_topk_sum_kernel, grid, y_flat, out, T, N, y_flat.stride(0), out.stride(0), TOP_K=k,
               BLOCK_TOKENS=_BLOCK_TOKENS, BLOCK_COLS=_BLOCK_COLS, num_warps=4)
    return out


def topk_sum_torch(y_flat: torch.Tensor, T: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """The same in torch ops (two launches on a GPU): what :func:`topk_sum` is checked against."""
    return y_flat.reshape(T, k, y_flat.shape[1]).sum(dim=1, dtype=torch.float32).to(dtype)
