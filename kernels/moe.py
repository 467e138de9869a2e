"""Mixture-of-experts layers tuned in context, and the MoE API in one namespace.

The layers:

* :func:`moe_mlp` -- gate-up grouped GEMM (token-gathered A, sorted C), SiLU-gated product (one
  Triton launch), down grouped GEMM (sorted A, flat C, routing weight in the epilogue), top-k sum back to
  ``[T, H]`` (one Triton launch): four launches after the routing's torch ops.
* :func:`tp_moe_layer` -- the tensor-parallel MoE MLP over ranks: :func:`ag_moe` (gate-up),
  SiLU-gating, :func:`moe_rs_stacked` (down, one launch). ``graph_safe=True`` makes it capturable
  in a CUDA graph.
* references: :func:`moe_gemm_reference`, :func:`moe_mlp_reference` (per-expert torch loops).

The pieces they are built from live in their own modules and are re-exported here, so
``from disttune.kernels import moe`` reaches the whole API:

* ``kernels.moe_routing`` -- :func:`moe_align` and friends: rows sorted by expert (:class:`MoeRouting`);
* ``kernels.moe_gemm`` -- the grouped GEMM kernel, its configs, tuning key and launchers
  (:func:`moe_gemm`, :func:`make_moe_kernel`);
* ``kernels.moe_ag`` -- AllGather-MoE (:func:`ag_moe`);
* ``kernels.moe_rs`` -- MoE-ReduceScatter (:func:`moe_rs`, per destination; :func:`moe_rs_stacked`, one launch);
* ``kernels.moe_activation`` -- the SiLU gating between the two GEMMs (:func:`silu_and_mul`);
* ``kernels.moe_combine`` -- each token's top-k expert outputs summed (:func:`topk_sum`);
* ``kernels.moe_common`` -- the input checks and buffers they share.

Every host function here is what a user wraps with ``disttune.contextual_autotune``.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

# re-exported beside the MoE names: tests and benchmarks size and check MoE configs with them
from .matmul import gemm_config, interpreting, max_shared_memory, shared_memory_bytes  # noqa: F401
from .moe_activation import silu_and_mul
from .moe_ag import AG_MOE_LAYOUTS, AgMoeResult, ag_moe, ag_moe_for_caller, layout_for
from .moe_combine import topk_sum
from .moe_common import POISON_ENV, check_device, check_float_tensor
from .moe_gemm import (
    A_ORDERS,
    CPU_MOE_CONFIGS,
    HOPPER_MOE_CONFIGS,
    MOE_KEY,
    OUT_ORDERS,
    TILE_ORDERS,
    default_moe_configs,
    make_moe_kernel,
    moe_config_is_valid,
    moe_gemm,
    moe_gemm_jit,
    moe_gemm_kernel,
    moe_gemm_sorting,
    moe_gemm_with_config,
    next_power_of_2,
    prune_moe_configs,
)
from .moe_routing import (MoeRouting, check_token_routing, moe_align, moe_align_block_size, moe_align_gathered,
                          moe_align_stacked)
from .moe_rs import moe_rs, moe_rs_stacked

__all__ = [
    "HOPPER_MOE_CONFIGS",
    "CPU_MOE_CONFIGS",
    "A_ORDERS",
    "OUT_ORDERS",
    "TILE_ORDERS",
    "MOE_KEY",
    "POISON_ENV",
    "MoeRouting",
    "next_power_of_2",
    "default_moe_configs",
    "moe_config_is_valid",
    "prune_moe_configs",
    "moe_align",
    "moe_align_stacked",
    "moe_align_gathered",
    "AG_MOE_LAYOUTS",
    "layout_for",
    "moe_align_block_size",
    "make_moe_kernel",
    "moe_gemm_jit",
    "moe_gemm_kernel",
    "moe_gemm",
    "moe_gemm_sorting",
    "moe_gemm_with_config",
    "silu_and_mul",
    "moe_mlp",
    "ag_moe",
    "AgMoeResult",
    "moe_rs",
    "moe_rs_stacked",
    "tp_moe_layer",
    "moe_gemm_reference",
    "moe_mlp_reference",
]


def _check_mlp(x, topk_ids, topk_weights, w_gate_up, w_down, where):
    check_float_tensor(where, "x", x)
    if x.dim() != 2:
        raise ValueError(f"{where}: x must be 2-D [tokens, H], got shape {tuple(x.shape)}")
    for name, t in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        check_float_tensor(where, name, t)
        if t.dim() != 3:
            raise ValueError(f"{where}: {name} must be 3-D, got shape {tuple(t.shape)}")
    E, H, I2 = w_gate_up.shape
    if I2 % 2:
        raise ValueError(f"{where}: w_gate_up must be [E, H, 2 * I] (gate then up), got last dim {I2}")
    if tuple(w_down.shape) != (E, I2 // 2, H):
        raise ValueError(f"{where}: w_down must be [E, I, H] = {(E, I2 // 2, H)} to match w_gate_up "
                         f"{tuple(w_gate_up.shape)}, got {tuple(w_down.shape)}")
    if x.shape[1] != H:
        raise ValueError(f"{where}: x has H={x.shape[1]} but w_gate_up is [E, H={H}, 2I]")
    check_token_routing(where, x, topk_ids, topk_weights, E, check_range=False)
    check_device(where, x, topk_ids=topk_ids, topk_weights=topk_weights, w_gate_up=w_gate_up, w_down=w_down)
    return E


def moe_mlp(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: Optional[torch.Tensor],
            w_gate_up: torch.Tensor, w_down: torch.Tensor, *, kernel=None,
            routing: Optional[MoeRouting] = None, check_ids: bool = True,
            bucket: Callable[[int], int] = next_power_of_2) -> torch.Tensor:
    """The MoE MLP: ``sum_j w[t,j] * (silu(x[t] @ Wg[e]) * (x[t] @ Wu[e])) @ Wd[e]``, ``e = topk_ids[t, j]``.

    ``w_gate_up [E, H, 2I]`` (gate columns first), ``w_down [E, I, H]``; ``topk_weights``
    ``[T, top_k]`` or None (all ones). Two grouped GEMM launches (gate-up: token-gathered A,
    sorted C; down: sorted A, flat C, weight in the epilogue) plus the routing (torch), the
    SiLU gating and the top-k sum (one Triton launch each). Returns ``[T, H]`` in x's dtype. ``check_ids=False`` skips
    the range check of the expert ids (one host sync on a GPU).
    """
    E = _check_mlp(x, topk_ids, topk_weights, w_gate_up, w_down, "moe_mlp")
    routing = routing if routing is not None else moe_align(topk_ids, E, check_range=check_ids)
    T, k = topk_ids.shape
    h = moe_gemm(x, w_gate_up, routing, a_order="token", out_order="sorted", kernel=kernel, bucket=bucket)
    g = silu_and_mul(h)
    y = moe_gemm(g, w_down, routing, a_order="sorted", out_order="flat", weights=topk_weights,
                 kernel=kernel, bucket=bucket)
    return topk_sum(y, T, k, x.dtype)


def tp_moe_layer(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: Optional[torch.Tensor],
                 w_gate_up: torch.Tensor, w_down: torch.Tensor, *, group=None,
                 tokens_per_rank: Optional[Sequence[int]] = None, kernel=None, check_ids: bool = True,
                 bucket: Callable[[int], int] = next_power_of_2, graph_safe: bool = False) -> torch.Tensor:
    """Tensor-parallel MoE MLP: :func:`ag_moe` (gate-up) -> SiLU-gating -> :func:`moe_rs_stacked` (down).

    Each rank: its tokens ``x [T_r, H]`` with routing, its slice of every expert
    ``w_gate_up [E, H, 2 * I_r]`` (its gate columns then its up columns) and
    ``w_down [E, I_r, H]``. Returns ``[T_r, H]``: what :func:`moe_mlp` gives on the full weights.
    ``graph_safe``: as :func:`ag_moe` (the whole layer can then be captured in a CUDA graph). The gathered
    rows are grouped as ``ag_moe(layout="auto")`` picks: per expert over every rank where the ranks send
    each expert few rows, else per (rank, expert).
    """
    # the MLP check runs with ag_moe's own, so a bad input on one rank is an error on every rank; both are
    # skipped where the inputs' layout passed them before
    gathered = ag_moe_for_caller(x, topk_ids, w_gate_up, topk_weights=topk_weights, group=group,
                                 tokens_per_rank=tokens_per_rank, kernel=kernel, out=None, check_ids=check_ids,
                                 bucket=bucket, graph_safe=graph_safe, layout="auto", where="tp_moe_layer",
                                 extra_check=lambda: _check_mlp(x, topk_ids, topk_weights, w_gate_up, w_down,
                                                                "tp_moe_layer"),
                                 extra_inputs=(w_down,))
    g = silu_and_mul(gathered.out)
    return moe_rs_stacked(g, gathered.routing, gathered.topk_weights, w_down, group=group, kernel=kernel,
                          bucket=bucket)


# --------------------------------------------------------------------------- references


def moe_gemm_reference(x: torch.Tensor, topk_ids: torch.Tensor, w: torch.Tensor,
                       weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-expert torch loop: ``[T * top_k, N]`` in flat (token, choice) order, fp32 accumulate,
    result in x's dtype. ``x [T, K]``, ``w [E, K, N]``."""
    T, k = topk_ids.shape
    flat = topk_ids.reshape(-1).long()
    src = torch.arange(T * k, device=x.device) // k
    out = torch.zeros(T * k, w.shape[2], dtype=torch.float32, device=x.device)
    for e in range(w.shape[0]):
        rows = (flat == e).nonzero().flatten()
        if rows.numel():
            out[rows] = x[src[rows]].float() @ w[e].float()
    if weights is not None:
        out *= weights.reshape(-1, 1).float()
    return out.to(x.dtype)


def moe_mlp_reference(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: Optional[torch.Tensor],
                      w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """Per-expert torch reference of :func:`moe_mlp` (fp32 throughout, result in x's dtype)."""
    T, k = topk_ids.shape
    h = moe_gemm_reference(x.float(), topk_ids, w_gate_up.float())
    gate, up = h.chunk(2, dim=1)
    g = F.silu(gate) * up
    flat = topk_ids.reshape(-1).long()
    y = torch.zeros(T * k, w_down.shape[2], dtype=torch.float32, device=x.device)
    for e in range(w_down.shape[0]):
        rows = (flat == e).nonzero().flatten()
        if rows.numel():
            y[rows] = g[rows] @ w_down[e].float()
    if topk_weights is not None:
        y *= topk_weights.reshape(-1, 1).float()
    return y.view(T, k, -1).sum(1).to(x.dtype)
