"""Generated config spaces: the product of the choices, pruned by rules before anything compiles.

    configs = disttune.space(BLOCK_M=[64, 128, 256], BLOCK_N=[64, 128, 256], BLOCK_K=[32, 64, 128],
                             GROUP_M=[1, 8], num_warps=[4, 8], num_stages=[2, 3, 4, 5],
                             problem={"M": 8192, "N": 4096, "K": 8192}, dtype=torch.bfloat16)
    print(configs.summary())   # generated 432, kept 272, pruned 160: shared memory 96 (e.g. ...); ...
    kernel = triton.autotune(list(configs), key=[...])(body)

Each rule returns why it rejects a config, or None; a config is pruned by the first rule that
rejects it, and :attr:`ConfigSpace.pruned` counts configs per rule. The rules, in order:

* ``tl.dot minimum``: every ``BLOCK_M/N/K`` at least 16;
* ``problem size``: a ``BLOCK_X`` no larger than ``X`` rounded up to a power of two, and dividing
  ``X`` exactly for the dimensions named in ``divisible``;
* ``shared memory``: ``num_stages * (BLOCK_M*BLOCK_K + BLOCK_K*BLOCK_N) * element size`` within
  the device's per-block limit (the pipelined estimate the shipped GEMMs prune by);
* ``registers``: the fp32 accumulator and one stage of operands spread over the block's threads,
  ``(BLOCK_M*BLOCK_N + (BLOCK_M*BLOCK_K + BLOCK_K*BLOCK_N) * element size / 4) / threads``, at
  most the 255 registers a thread can address (more would spill), and the block's total within
  the registers of one SM;
* ``predicate``: the user's ``predicate(config)``, False (or a text: the reason) to reject.

The budget comes from the device (:func:`device_budget`): ``torch.cuda.get_device_properties``
and Triton's driver. Without a GPU (or under ``TRITON_INTERPRET=1``) it is :data:`DEFAULT_BUDGET`,
an H100's numbers, so that a space generated on a CPU machine is the one an H100 would keep.

Cost: one pass over the product (microseconds a config), one device query.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")
DOT_MINIMUM = 16
REGISTERS_PER_THREAD = 255


@dataclass(frozen=True)
class DeviceBudget:
    """What one block of a kernel may use on a device, and what an SM holds (for occupancy)."""

    shared_per_block: int
    shared_per_sm: int
    registers_per_sm: int
    threads_per_sm: int
    sm_count: int
    source: str
    registers_per_thread: int = REGISTERS_PER_THREAD
    blocks_per_sm: int = 32
    warp_size: int = 32


#: The budget without a GPU: an H100 SXM's (227 KiB shared per block, 228 KiB per SM, 64 K registers).
DEFAULT_BUDGET = DeviceBudget(shared_per_block=232448, shared_per_sm=233472, registers_per_sm=65536,
                              threads_per_sm=2048, sm_count=132, source="default (no GPU: H100 numbers)")


def device_budget(device: Any = None) -> DeviceBudget:
    """The budget of ``device`` (default: the current CUDA device), or :data:`DEFAULT_BUDGET` without one."""
    import torch

    from .env import interpreting

    if interpreting() or not torch.cuda.is_available():
        return DEFAULT_BUDGET
    index = torch.device(device).index if device is not None else None
    if index is None:
        index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    shared = getattr(props, "shared_memory_per_block_optin", 0)
    try:
        import triton

        shared = int(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"]) or shared
    except Exception:  # an older driver module: torch's number stands
        pass
    return DeviceBudget(
        shared_per_block=int(shared or DEFAULT_BUDGET.shared_per_block),
        shared_per_sm=int(getattr(props, "shared_memory_per_multiprocessor", 0) or shared or 0),
        registers_per_sm=int(getattr(props, "regs_per_multiprocessor", 0) or DEFAULT_BUDGET.registers_per_sm),
        threads_per_sm=int(getattr(props, "max_threads_per_multi_processor", 0) or DEFAULT_BUDGET.threads_per_sm),
        sm_count=int(props.multi_processor_count),
        source=f"cuda:{index} {props.name}",
        warp_size=int(getattr(props, "warp_size", 32) or 32),
    )


def element_bytes(dtype: Any) -> int:
    """Bytes of one element: a torch dtype, or an int taken as the byte count."""
    if isinstance(dtype, int):
        return dtype
    import torch

    return torch.empty((), dtype=dtype).element_size()


# -- rules -----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Context:
    """What the rules know besides the config."""

    budget: DeviceBudget
    element_bytes: int
    problem: Mapping[str, int]
    divisible: tuple
    predicate: Optional[Callable[[Any], Union[bool, str]]]


Rule = Callable[[Any, Context], Optional[str]]


def _blocks(config: Any) -> tuple[Optional[int], Optional[int], Optional[int]]:
    kw = config.kwargs
    return kw.get("BLOCK_M"), kw.get("BLOCK_N"), kw.get("BLOCK_K")


def dot_minimum(config: Any, ctx: Context) -> Optional[str]:
    small = [f"{name}={value}" for name, value in config.kwargs.items()
             if name in ("BLOCK_M", "BLOCK_N", "BLOCK_K") and value < DOT_MINIMUM]
    return f"{', '.join(small)} below {DOT_MINIMUM}" if small else None


def problem_size(config: Any, ctx: Context) -> Optional[str]:
    for dim, size in ctx.problem.items():
        block = config.kwargs.get(f"BLOCK_{dim}")
        if block is None:
            continue
        padded = 1 << max(0, (int(size) - 1).bit_length())
        if block > padded:
            return f"BLOCK_{dim}={block} > {dim}={size}"
        if dim in ctx.divisible and size % block:
            return f"{dim}={size} not divisible by BLOCK_{dim}={block}"
    return None


def shared_memory(config: Any, ctx: Context) -> Optional[str]:
    bm, bn, bk = _blocks(config)
    if None in (bm, bn, bk):
        return None
    need = (config.num_stages or 1) * (bm * bk + bk * bn) * ctx.element_bytes
    limit = ctx.budget.shared_per_block
    return f"{need} B shared memory > {limit} B" if need > limit else None


def registers(config: Any, ctx: Context) -> Optional[str]:
    bm, bn, bk = _blocks(config)
    if None in (bm, bn, bk):
        return None
    threads = (config.num_warps or 4) * ctx.budget.warp_size
    per_thread = (bm * bn + (bm * bk + bk * bn) * ctx.element_bytes / 4) / threads
    if per_thread > ctx.budget.registers_per_thread:
        return f"~{per_thread:.0f} registers/thread > {ctx.budget.registers_per_thread} (would spill)"
    if per_thread * threads > ctx.budget.registers_per_sm:
        return f"~{per_thread * threads:.0f} registers/block > {ctx.budget.registers_per_sm} per SM"
    return None


def predicate(config: Any, ctx: Context) -> Optional[str]:
    if ctx.predicate is None:
        return None
    verdict = ctx.predicate(config)
    if isinstance(verdict, str):
        return verdict or None
    return None if verdict else "rejected by the predicate"


RULES: dict[str, Rule] = {"tl.dot minimum": dot_minimum, "problem size": problem_size,
                          "shared memory": shared_memory, "registers": registers, "predicate": predicate}


# -- the space -------------------------------------------------------------------------------------------------

@dataclass(eq=False)
class ConfigSpace(list):
    """The kept configs (a list of ``triton.Config``), with how many were generated and why the rest went."""

    generated: int = 0
    pruned: dict = field(default_factory=dict)  # rule -> count
    examples: dict = field(default_factory=dict)  # rule -> the first reason it gave
    budget: DeviceBudget = DEFAULT_BUDGET

    def __post_init__(self) -> None:
        list.__init__(self)

    def summary(self) -> str:
        """``generated 432, kept 272, pruned 160: shared memory 96 (e.g. ...); registers 64 (...) [budget: ...]``."""
        head = f"generated {self.generated}, kept {len(self)}, pruned {self.generated - len(self)}"
        parts = [f"{rule} {count} (e.g. {self.examples[rule]})" for rule, count in self.pruned.items() if count]
        return head + (": " + "; ".join(parts) if parts else "") + f" [budget: {self.budget.source}]"


def space(*, problem: Optional[Mapping[str, int]] = None, divisible: Iterable[str] = (), dtype: Any = 2,
          predicate: Optional[Callable[[Any], Union[bool, str]]] = None, device: Any = None,
          budget: Optional[DeviceBudget] = None, rules: Optional[Mapping[str, Rule]] = None,
          **choices: Sequence[Any]) -> ConfigSpace:
    """The product of ``choices`` as ``triton.Config``s, pruned by the rules (see the module doc).

    ``choices``: meta-parameters and ``num_warps``/``num_stages``/``num_ctas``/``maxnreg``, each a
    list of values (in the order given: the product's order is the configs' order). ``problem``:
    sizes by dimension (``{"M": 8192, "N": 4096, "K": 8192}`` checks ``BLOCK_M`` against ``M``...);
    ``divisible``: the dimensions whose size a block must divide; ``dtype``: the operands' dtype (or
    element bytes); ``budget``: instead of :func:`device_budget` of ``device``; ``rules``: instead of
    :data:`RULES`.
    """
    import triton

    if not choices:
        raise ValueError("disttune.space: give at least one choice, e.g. BLOCK_M=[64, 128]")
    for name, values in choices.items():
        if isinstance(values, (str, bytes)) or not isinstance(values, Iterable) or not list(values):
            raise ValueError(f"disttune.space: {name} must be a non-empty list of values, got {values!r}")
    ctx = Context(budget or device_budget(device), element_bytes(dtype), dict(problem or {}),
                  tuple(divisible), predicate)
    unknown = set(ctx.divisible) - set(ctx.problem)
    if unknown:
        raise ValueError(f"disttune.space: divisible names {sorted(unknown)}, which problem= does not size")
    rules = RULES if rules is None else rules
    out = ConfigSpace(budget=ctx.budget)
    out.pruned = {name: 0 for name in rules}
    names = list(choices)
    for values in itertools.product(*(list(choices[n]) for n in names)):
        picked = dict(zip(names, values))
        options = {n: picked.pop(n) for n in OPTIONS if n in picked}
        config = triton.Config(picked, **options)
        out.generated += 1
        for rule_name, rule in rules.items():
            reason = rule(config, ctx)
            if reason:
                out.pruned[rule_name] += 1
                out.examples.setdefault(rule_name, reason)
                break
        else:
            out.append(config)
    if not out:
        raise ValueError(f"disttune.space: every config was pruned: {out.summary()}")
    return out


def gemm_space(M: int, N: int, K: int, dtype: Any = 2, device: Any = None,
               predicate: Optional[Callable[[Any], Union[bool, str]]] = None,
               budget: Optional[DeviceBudget] = None, small: Optional[bool] = None) -> ConfigSpace:
    """The default space of the shipped tiled GEMMs (``kernels.matmul``, ``kernels.shard_gemm``) for one shape.

    On a GPU: BLOCK_M/N in 64..256, BLOCK_K in 32..128, GROUP_M 1 or 8, 4 or 8 warps, 2 to 5
    stages (432 generated; 272 kept within an H100's budget for large shapes). ``small`` (default: under
    the interpreter) gives 16 tiny configs that the interpreter runs quickly.
    """
    from .env import interpreting

    if small if small is not None else interpreting():
        choices: dict = dict(BLOCK_M=[16, 32], BLOCK_N=[16, 32], BLOCK_K=[16, 32], GROUP_M=[1, 4],
                             num_warps=[1], num_stages=[1])
    else:
        choices = dict(BLOCK_M=[64, 128, 256], BLOCK_N=[64, 128, 256], BLOCK_K=[32, 64, 128], GROUP_M=[1, 8],
                       num_warps=[4, 8], num_stages=[2, 3, 4, 5])
    return space(problem={"M": M, "N": N, "K": K}, dtype=dtype, predicate=predicate, device=device,
                 budget=budget, **choices)


def grouped_gemm_space(rows_per_expert: int, N: int, K: int, dtype: Any = 2, device: Any = None,
                       predicate: Optional[Callable[[Any], Union[bool, str]]] = None,
                       budget: Optional[DeviceBudget] = None, small: Optional[bool] = None) -> ConfigSpace:
    """The default space of the shipped grouped (MoE) GEMM, ``kernels.moe_gemm``, for one routing's size.

    Like :func:`gemm_space`, with BLOCK_M sized by the rows an expert gets on average (tiles never
    span two experts, so a tile much taller than that computes padding) and GROUP_M up to 16.
    """
    from .env import interpreting

    if small if small is not None else interpreting():
        choices: dict = dict(BLOCK_M=[16, 32], BLOCK_N=[16, 32], BLOCK_K=[16, 32], GROUP_M=[1, 4],
                             num_warps=[1], num_stages=[1])
    else:
        choices = dict(BLOCK_M=[32, 64, 128, 256], BLOCK_N=[64, 128, 256], BLOCK_K=[32, 64, 128],
                       GROUP_M=[1, 8, 16], num_warps=[4, 8], num_stages=[2, 3, 4])
    return space(problem={"M": rows_per_expert, "N": N, "K": K}, dtype=dtype, predicate=predicate,
                 device=device, budget=budget, **choices)
