"""GEMM over row shards in a rank-rotated tile order, with optional per-shard ready flags.

One ``triton.autotune`` kernel serves three jobs:

* a plain GEMM ``C = A @ B`` (one shard, no flags);
* the GEMM of the *fused* AllGather-GEMM: ``A`` is the gathered ``[M, K]`` workspace whose
  row shards arrive while the kernel runs. Tiles are walked shard by shard starting with the
  launching rank's own, read where the caller holds it (``own``), in a loop of their own; then
  each tile spins on its piece's int32 ready flag (an acquire load) until it holds the call's
  epoch before it loads A. Flags are set by copy-engine streams
  (``kernels.symm.write_flag_at``), which need no SM, so spinning tiles cannot starve them;
* the per-shard GEMMs of the *decomposed* designs and of GEMM-ReduceScatter (one shard each);
  the own rows' GEMM of GEMM-ReduceScatter adds the other ranks' partials in its epilogue, each
  tile's once its piece's flag holds the epoch, read through a tensor descriptor.

Main loop (Hopper): persistent (``min(#SMs, #tiles)`` programs loop over the tiles; the loop
nest is flattened so the next tile's loads overlap this tile's epilogue; tiles wait on flags in
inline PTX on sm_90, which keeps the nest flat, and in a ``while`` loop elsewhere, which does not),
A and B loaded through device-side tensor descriptors (TMA; ``triton.set_allocator`` is set for
their scratch), B either row-major ``[K, N]`` or, faster, K-major (``w.t()`` of a
row-major ``[N, K]`` weight, as ``nn.Linear`` stores it), C stored through a descriptor in two
halves (epilogue subtiling) for one shard, or with a masked pointer store when a tile must
not write another shard's rows (shards may be ragged: any row counts). Within a shard,
GROUP_M row-tiles are walked together for L2 reuse of B. fp32 accumulation.

Constraints declared by :func:`config_is_valid` and :func:`prune_shard_configs`:
power-of-two blocks >= 16, GROUP_M >= 1, BLOCK_M <= MAX_BLOCK_M (256: a tile never spans two
pushed chunks), pipelined shared memory within the device limit (a config whose epilogue
buffer does not fit fails to compile and counts as failed).
Input constraints (:func:`check_gemm_inputs`): 2-D, same dtype, 16-byte aligned rows and
start, as tensor descriptors need.

Cost: one launch of ``min(#SMs, sum_s cdiv(rows_s, BLOCK_M) * cdiv(N, BLOCK_N))`` programs.
"""

from __future__ import annotations

import itertools
from typing import Any, Optional, Sequence

import torch
import triton
import triton.language as tl
from triton.runtime import _allocation  # Triton has no public way to ask whether an allocator is set

from disttune import cached_launch

from .matmul import (
    BF16_INTERPRETER_NOTE,
    CPU_GEMM_CONFIGS,
    HOPPER_GEMM_CONFIGS,
    SUPPORTED_DTYPES,
    cdiv,
    config_is_valid,
    interpreting,
    make_autotuner,
    prune_by_shared_memory,
)

__all__ = [
    "MAX_WORLD",
    "default_configs",
    "make_shard_gemm_kernel",
    "shard_gemm_jit",
    "shard_gemm_kernel",
    "shard_gemm",
    "partials_gemm",
    "matmul_shards",
    "check_gemm_inputs",
    "shard_offsets_tensor",
    "config_is_valid",
    "prune_shard_configs",
    "MAX_BLOCK_M",
    "num_sms",
    "b_is_kmajor",
]

#: Largest number of shards (ranks) the kernel's unrolled shard lookup handles.
MAX_WORLD = 8



def default_configs() -> list:
    """The 12-config Hopper space on a GPU, small configs under the interpreter."""
    if torch.cuda.is_available() and not interpreting():
        return list(HOPPER_GEMM_CONFIGS)
    return list(CPU_GEMM_CONFIGS)


@triton.jit
def _locate_tile(tile, rank, offsets_ptr, num_pid_n, WORLD: tl.constexpr, BLOCK_M: tl.constexpr,
                 GROUP_M: tl.constexpr, RS: tl.constexpr):
    """(shard, first row of the tile, rows left in the shard from there, pid_n, the tile's first row
    counted from the shard's start) of persistent tile ``tile``.

    Shards are visited in the order they arrive (``kernels.symm.arrival_order``): rank, rank-1, ...;
    with ``RS`` in the order GEMM-RS pushes them (``kernels.symm.push_order``): rank+1, rank+2, ..., and the
    own rows last. Each shard's tiles are grouped by GROUP_M row-tiles for L2 reuse of B.
    """
    first = 0
    shard = rank
    local = tile
    row_start = 0
    rows = 0
    for i in tl.static_range(WORLD):
        if RS:
            s = (rank + 1 + i) % WORLD
        else:
            s = (rank + WORLD - i) % WORLD
        s_start = tl.load(offsets_ptr + s)
        s_rows = tl.load(offsets_ptr + s + 1) - s_start
        count = tl.cdiv(s_rows, BLOCK_M) * num_pid_n
        hit = (tile >= first) & (tile < first + count)
        shard = tl.where(hit, s, shard)
        local = tl.where(hit, tile - first, local)
        row_start = tl.where(hit, s_start, row_start)
        rows = tl.where(hit, s_rows, rows)
        first += count
    num_pid_m = tl.cdiv(rows, BLOCK_M)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = local // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (local % num_pid_in_group) % group_size_m
    pid_n = (local % num_pid_in_group) // group_size_m
    return shard, row_start + pid_m * BLOCK_M, rows - pid_m * BLOCK_M, pid_n, pid_m * BLOCK_M


@triton.jit
def _count_tiles(offsets_ptr, num_pid_n, WORLD: tl.constexpr, BLOCK_M: tl.constexpr):
    total = 0
    for s in tl.static_range(WORLD):
        total += tl.cdiv(tl.load(offsets_ptr + s + 1) - tl.load(offsets_ptr + s), BLOCK_M) * num_pid_n
    return total


@triton.jit
def _count_piece_tile(signals_ptr, shard, row_in_shard, rows_left, chunk_rows, num_pid_n, epoch,
                      WORLD: tl.constexpr, CHUNKS: tl.constexpr, BLOCK_M: tl.constexpr):
    """One more tile of ``shard``'s piece stored. ``signals`` holds a tile count per piece
    (``[WORLD * CHUNKS]``) and then a ready flag per piece: the piece's last tile resets the count and sets
    the flag to ``epoch`` (a release at system scope, so a copy engine that waits on the flag reads the
    stored tiles)."""
    tl.debug_barrier()  # every thread's stores of the tile precede the count
    piece = row_in_shard // chunk_rows
    piece_rows = tl.minimum(chunk_rows, row_in_shard + rows_left - piece * chunk_rows)
    tiles = tl.cdiv(piece_rows, BLOCK_M) * num_pid_n
    index = shard * CHUNKS + piece
    if tl.atomic_add(signals_ptr + index, 1, sem="acq_rel", scope="gpu") == tiles - 1:
        tl.atomic_xchg(signals_ptr + index, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(signals_ptr + WORLD * CHUNKS + index, epoch, sem="release", scope="sys")


@triton.jit
def _wait_flag_ptx(flag_ptr, epoch):
    """Spin until the int32 at ``flag_ptr`` holds at least ``epoch`` (an acquire load at system scope), then fence
    the async proxy, so that tensor-descriptor reads see what the flag published. Returns 0, for the caller to
    add to the coordinates it reads next (the read then depends on the wait). Inline PTX (sm_90): unlike a
    ``while`` loop, it leaves the tile loop flattenable. Every thread of the program spins."""
    return tl.inline_asm_elementwise(
        """{
        .reg .pred not_yet;
        .reg .s32 seen;
        WAIT_FOR_FLAG:
        ld.global.acquire.sys.s32 seen, [$1];
        setp.lt.s32 not_yet, seen, $2;
        @not_yet bra WAIT_FOR_FLAG;
        fence.proxy.async.global;
        mov.s32 $0, 0;
        }""",
        "=r,l,r", [flag_ptr, epoch], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _tile_product(a_desc, b_desc, row, col, k_tiles, B_KMAJOR: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The fp32 ``[BLOCK_M, BLOCK_N]`` tile of ``A @ B`` at (``row``, ``col``), A and B read through descriptors."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ki in range(k_tiles):
        a = a_desc.load([row, ki * BLOCK_K])
        if B_KMAJOR:
            b = b_desc.load([col, ki * BLOCK_K]).T
        else:
            b = b_desc.load([ki * BLOCK_K, col])
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _store_rows(c_ptr, acc, row, rows_left, col, stride_cm, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Store the tile's first ``rows_left`` rows at (``row``, ``col``) of C with a masked pointer store (a tile at
    the end of a ragged shard must not write the next shard's rows)."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = col + tl.arange(0, BLOCK_N)
    c_ptrs = c_ptr + (row.to(tl.int64) + offs_m)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m < rows_left)[:, None] & (offs_n < N)[None, :])


def shard_ordered_gemm(
    a_ptr, own_ptr, b_ptr, c_ptr, flags_ptr, offsets_ptr, add_ptr, add_flags_ptr, signals_ptr,
    M, N, K,
    stride_am, stride_own, stride_b, stride_cm, stride_c_slot, stride_add_slot, stride_add_m,
    rank, chunk_rows, epoch, add_skip,
    WORLD: tl.constexpr, WAIT: tl.constexpr, CHUNKS: tl.constexpr, B_KMAJOR: tl.constexpr, ADD_SLOTS: tl.constexpr,
    RS: tl.constexpr, NUM_SMS: tl.constexpr, WAIT_PTX: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    SKIP_WAIT: tl.constexpr = False,  # for tests only (racy_config): tiles read their rows without waiting
):
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[stride_am, 1], block_shape=[BLOCK_M, BLOCK_K])
    if B_KMAJOR:  # B given as the transpose of a row-major [N, K] (an nn.Linear weight): TMA-friendly
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[stride_b, 1], block_shape=[BLOCK_N, BLOCK_K])
    else:
        b_desc = tl.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[stride_b, 1], block_shape=[BLOCK_K, BLOCK_N])
    if WORLD == 1:  # a tile cannot reach another shard's rows: store through a descriptor, in two halves
        c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[stride_cm, 1],
                                           block_shape=[BLOCK_M, BLOCK_N // 2])
    if ADD_SLOTS > 0:  # (one shard) the slots as one [slots x slot_rows, N] matrix; what lies past M is not stored
        slot_rows = stride_add_slot // stride_add_m
        add_desc = tl.make_tensor_descriptor(add_ptr, shape=[(ADD_SLOTS - 1) * slot_rows + M, N],
                                             strides=[stride_add_m, 1], block_shape=[BLOCK_M, BLOCK_N // 2])
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    num_tiles = _count_tiles(offsets_ptr, num_pid_n, WORLD, BLOCK_M)
    first_tile = tl.program_id(0)
    if WAIT:  # the own shard's tiles first, read from own_ptr where they already are: nothing to wait for
        own_start = tl.load(offsets_ptr + rank)
        own_rows = tl.load(offsets_ptr + rank + 1) - own_start
        own_desc = tl.make_tensor_descriptor(own_ptr, shape=[own_rows, K], strides=[stride_own, 1],
                                             block_shape=[BLOCK_M, BLOCK_K])
        own_out = tl.make_tensor_descriptor(c_ptr + own_start.to(tl.int64) * stride_cm, shape=[own_rows, N],
                                            strides=[stride_cm, 1], block_shape=[BLOCK_M, BLOCK_N // 2])
        own_tiles = tl.cdiv(own_rows, BLOCK_M) * num_pid_n
        for tile in tl.range(first_tile, own_tiles, NUM_SMS, flatten=True):
            _, _, _, pid_n, row_in_shard = _locate_tile(tile, rank, offsets_ptr, num_pid_n, WORLD, BLOCK_M, GROUP_M,
                                                        RS)
            col = pid_n * BLOCK_N
            acc = _tile_product(own_desc, b_desc, row_in_shard, col, k_tiles, B_KMAJOR, BLOCK_M, BLOCK_N, BLOCK_K)
            halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
            left, right = tl.split(halves)
            own_out.store([row_in_shard, col], left.to(c_ptr.dtype.element_ty))  # (clipped at the own rows' end)
            own_out.store([row_in_shard, col + BLOCK_N // 2], right.to(c_ptr.dtype.element_ty))
        # this program's next tile of the rank-rotated walk: the peers' shards, in the order they arrive
        first_tile += tl.cdiv(tl.maximum(own_tiles - first_tile, 0), NUM_SMS) * NUM_SMS
    if RS:  # the other ranks' partials only: the own rows' tiles, last in the walk, are left out
        own_rows = tl.load(offsets_ptr + rank + 1) - tl.load(offsets_ptr + rank)
        num_tiles -= tl.cdiv(own_rows, BLOCK_M) * num_pid_n
    # A spin loop inside the tile loop keeps the compiler from flattening the loop nest (the PTX spin does not).
    for tile in tl.range(first_tile, num_tiles, NUM_SMS,
                         flatten=not RS and ((not WAIT and ADD_SLOTS == 0) or WAIT_PTX)):
        shard, row, rows_left, pid_n, row_in_shard = _locate_tile(tile, rank, offsets_ptr, num_pid_n, WORLD,
                                                                  BLOCK_M, GROUP_M, RS)
        landed = 0
        if WAIT and not SKIP_WAIT:  # shards arrive in CHUNKS pieces of chunk_rows rows, each flagged with the epoch
            flag = flags_ptr + shard * CHUNKS + row_in_shard // chunk_rows
            if WAIT_PTX:
                landed = _wait_flag_ptx(flag, epoch)
            else:  # (no proxy fence: this runs only where descriptor reads are not TMA copies)
                while tl.atomic_add(flag, 0, sem="acquire", scope="sys") < epoch:
                    pass
        col = pid_n * BLOCK_N
        acc = _tile_product(a_desc, b_desc, row + landed, col, k_tiles, B_KMAJOR, BLOCK_M, BLOCK_N, BLOCK_K)
        if RS:  # shard s's rows into C's slot s, then one more tile of its piece done
            _store_rows(c_ptr + shard.to(tl.int64) * stride_c_slot, acc, row_in_shard, rows_left, col, stride_cm, N,
                        BLOCK_M, BLOCK_N)
            _count_piece_tile(signals_ptr, shard, row_in_shard, rows_left, chunk_rows, num_pid_n, epoch, WORLD,
                              CHUNKS, BLOCK_M)
        elif WORLD == 1:
            halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
            left, right = tl.split(halves)
            for slot in tl.static_range(ADD_SLOTS):  # C += the other ranks' partials of these rows, once flagged
                if slot != add_skip:
                    flag = add_flags_ptr + slot * CHUNKS + row_in_shard // chunk_rows
                    if WAIT_PTX:
                        added = _wait_flag_ptx(flag, epoch)
                    else:  # (no proxy fence: this runs only where descriptor reads are not TMA copies)
                        while tl.atomic_add(flag, 0, sem="acquire", scope="sys") < epoch:
                            pass
                        added = 0
                    add_row = slot * slot_rows + row + added
                    left += add_desc.load([add_row, col]).to(tl.float32)
                    right += add_desc.load([add_row, col + BLOCK_N // 2]).to(tl.float32)
            c_desc.store([row, col], left.to(c_ptr.dtype.element_ty))
            c_desc.store([row, col + BLOCK_N // 2], right.to(c_ptr.dtype.element_ty))
        else:
            _store_rows(c_ptr, acc, row, rows_left, col, stride_cm, N, BLOCK_M, BLOCK_N)


#: The jitted kernel without a tuner.
shard_gemm_jit = triton.jit(shard_ordered_gemm, do_not_specialize=["rank", "epoch", "add_skip"])

_AUTOTUNE_KEY = ["M", "N", "K", "WORLD", "WAIT", "B_KMAJOR", "ADD_SLOTS", "RS"]


#: Largest BLOCK_M: pushed shards arrive in chunks starting at multiples of this many rows
#: (``kernels.symm.CHUNK_ALIGN``), and a tile waits on the flag of its first row's chunk only.
MAX_BLOCK_M = 256


def prune_shard_configs(configs, named_args: dict, **kwargs) -> list:
    """``early_config_prune``: :func:`prune_by_shared_memory`, then drop configs with BLOCK_M > MAX_BLOCK_M."""
    kept = prune_by_shared_memory(configs, named_args, **kwargs)
    fitting = [c for c in kept if c.kwargs["BLOCK_M"] <= MAX_BLOCK_M]
    if not fitting:
        raise ValueError(f"shard GEMM: every config has BLOCK_M > {MAX_BLOCK_M}; a tile must not span two pushed "
                         f"chunks (BLOCK_M values: {sorted({c.kwargs['BLOCK_M'] for c in kept})})")
    return fitting


def racy_config(config: triton.Config) -> triton.Config:
    """``config`` with its tiles' flag waits skipped: a deliberately wrong config, for tests of output checks
    (``check=``): fast, because it never waits, and wrong whenever a shard arrives after its tiles ran."""
    return triton.Config({**config.kwargs, "SKIP_WAIT": True}, num_warps=config.num_warps,
                         num_stages=config.num_stages)


def make_shard_gemm_kernel(configs: Optional[Sequence[triton.Config]] = None, do_bench=None, **autotune_kwargs):
    """A NEW ``triton.autotune`` Autotuner over :data:`shard_gemm_jit` (own cache).

    ``configs`` defaults to :func:`default_configs`; configs are pruned by shared memory.
    Under the interpreter the benchmarker defaults to a host clock (Triton's needs a GPU).
    """
    return make_autotuner(shard_gemm_jit, default_configs() if configs is None else configs, _AUTOTUNE_KEY,
                          prune_shard_configs, "make_shard_gemm_kernel", do_bench, **autotune_kwargs)


#: The default autotuned kernel (what :func:`shard_gemm` launches when no ``kernel`` is given).
shard_gemm_kernel = make_shard_gemm_kernel()

_offsets_cache: dict = {}


def shard_offsets_tensor(rows: Sequence[int], device: torch.device) -> torch.Tensor:
    """int32 prefix sums ``[0, rows0, rows0+rows1, ...]`` of shard row counts on ``device`` (cached)."""
    key = (tuple(int(r) for r in rows), str(device))
    cached = _offsets_cache.get(key)
    if cached is None:
        offsets = list(itertools.accumulate(key[0], initial=0))
        cached = _offsets_cache[key] = torch.tensor(offsets, dtype=torch.int32, device=device)
    return cached


def b_is_kmajor(b: torch.Tensor) -> bool:
    """True when ``b`` ``[K, N]`` is the transpose of a row-major ``[N, K]`` (e.g. ``linear.weight.t()``)."""
    return b.stride(0) == 1 and b.stride(1) != 1


def check_gemm_inputs(a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor], who: str) -> None:
    """Raise a clear error unless ``a @ b -> out`` fits the kernel's tensor descriptors.

    ``out=None`` checks the operands only (for callers that write into buffers of their own). The
    verdict depends only on the tensors' layouts (shapes, strides, dtypes, devices, 16-byte alignment),
    so a layout that passed once passes at the cost of its key (up to 256 layouts are kept).
    """
    key = _gemm_layout(a, b, out)
    if key is not None and key in _passed_layouts:
        return
    _check_gemm_inputs(a, b, out, who)
    if key is not None:
        if len(_passed_layouts) >= 256:
            _passed_layouts.clear()
        _passed_layouts.add(key)


_passed_layouts: set = set()


def _gemm_layout(*tensors: Optional[torch.Tensor]) -> Optional[tuple]:
    """What :func:`_check_gemm_inputs` reads of each tensor; None where one is not a tensor."""
    key: list = [interpreting()]
    for t in tensors:
        if t is None:
            key.append(None)
        elif type(t) is torch.Tensor:
            key.append((t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr() % 16))
        else:
            return None
    return tuple(key)


def _check_gemm_inputs(a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor], who: str) -> None:
    tensors = (("a", a), ("b", b)) + ((("out", out),) if out is not None else ())
    for name, t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{who}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{who}: {name} must be 2-D, got shape {tuple(t.shape)}")
    if a.shape[1] != b.shape[0] or (out is not None and out.shape != (a.shape[0], b.shape[1])):
        wanted = f" -> out {tuple(out.shape)}" if out is not None else ""
        raise ValueError(f"{who}: shapes do not chain: a {tuple(a.shape)} @ b {tuple(b.shape)}{wanted}")
    if a.dtype != b.dtype or a.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{who}: a and b need one dtype among {SUPPORTED_DTYPES}, got {a.dtype} and {b.dtype}")
    if a.dtype == torch.bfloat16 and interpreting():
        raise TypeError(f"{who}: bf16 is not supported under TRITON_INTERPRET=1. " + BF16_INTERPRETER_NOTE)
    if len({t.device for _, t in tensors}) != 1:
        raise ValueError(f"{who}: " + ", ".join(name for name, _ in tensors) + " must be on one device, got "
                         + ", ".join(str(t.device) for _, t in tensors))
    if a.device.type != "cuda" and not interpreting():
        raise ValueError(f"{who}: tensors are on {a.device}; Triton needs CUDA tensors unless TRITON_INTERPRET=1")
    for name, t in tensors:
        if t.numel() == 0:
            continue  # nothing is loaded or stored
        elem = t.element_size()
        inner, outer = (0, 1) if name == "b" and b_is_kmajor(t) else (1, 0)
        if t.stride(inner) != 1 or (t.stride(outer) * elem) % 16 or t.data_ptr() % 16:
            raise ValueError(
                f"{who}: {name} (shape {tuple(t.shape)}, strides {t.stride()}) must be row-major"
                + (" (or, for b, the transpose of a row-major [N, K])" if name == "b" else "")
                + f" with rows aligned to 16 bytes (for {t.dtype}: a row stride that is a multiple of {16 // elem}) "
                "and a 16-byte aligned start, as Hopper's tensor descriptors need; pad the last dimension")


_facts_by_device: dict = {}


def device_facts(device: torch.device) -> tuple:
    """(streaming multiprocessors, whether flag waits run in inline PTX) of ``device``: read once per device, with
    the interpreter asked on every call; (4, False) under the interpreter or off CUDA."""
    if device.type != "cuda" or interpreting():
        return 4, False
    index = device.index if device.index is not None else torch.cuda.current_device()
    facts = _facts_by_device.get(index)
    if facts is None:
        props = torch.cuda.get_device_properties(index)
        facts = _facts_by_device[index] = (props.multi_processor_count, props.major >= 9 and torch.version.hip is None)
    return facts


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (4 under the interpreter: the persistent grid's size there)."""
    return device_facts(device)[0]


def waits_in_ptx(device: torch.device) -> bool:
    """Whether the kernel's reduction waits on its flags in inline PTX (sm_90 or newer NVIDIA GPUs, not under the
    interpreter): that keeps its tile loop flattened, so the next tile's loads overlap this tile's epilogue
    (GEMM-RS's own rows' GEMM, 4096 x 8192 x 4096 bf16, ran 3.5 % faster on one H200). Elsewhere a ``while``
    loop of atomic loads."""
    return device_facts(device)[1]


#: A scratch block per stream for the device-side descriptors, grown to the largest size asked: launches on one
#: stream run one after another, so each may reuse the block the last one used (what the caching allocator
#: would hand back anyway), without a tensor made per launch (4-5 µs of host on an H200 machine).
_scratch_blocks: dict = {}


def descriptor_scratch(size: int, alignment: int, stream: Optional[int]) -> torch.Tensor:
    """Scratch for one launch's descriptors on ``stream``. While the stream is being captured into a CUDA
    graph the block is the graph's own (allocated from its pool): a replay may run beside later launches."""
    if stream is None or torch.cuda.is_current_stream_capturing():
        return torch.empty(size, dtype=torch.int8, device="cuda")
    block = _scratch_blocks.get(stream)  # a stream belongs to one device: its handle names both
    if block is None or block.numel() < size:
        block = _scratch_blocks[stream] = torch.empty(max(size, 1 << 16), dtype=torch.int8, device="cuda")
    return block


def ensure_descriptor_allocator() -> None:
    """Device-side tensor descriptors need scratch memory from ``triton.set_allocator`` (set per thread)."""
    if _allocation._allocator.get() is _allocation._NULL_ALLOCATOR:
        triton.set_allocator(descriptor_scratch)


def shard_gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, rows: Sequence[int], rank: int,
               flags: Optional[torch.Tensor] = None, kernel=None, chunks: int = 1,
               chunk_rows: int = 1 << 30, epoch: int = 1, addend: Optional[torch.Tensor] = None,
               addend_flags: Optional[torch.Tensor] = None, addend_skip: int = -1,
               own: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``out = a @ b`` tile by tile, shard by shard from ``rank``'s shard on (see module doc).

    ``rows``: row count of each shard (``sum(rows) == a.shape[0]``, at most MAX_WORLD shards).
    ``flags``: int32 ``[len(rows) * chunks]``; when given, a tile of shard ``s`` whose
    first row is ``r`` rows into the shard waits for ``flags[s * chunks + r // chunk_rows] >= epoch``
    (``chunk_rows`` a multiple of 256, so no tile spans two chunks). With ``flags``, ``own``
    (``[rows[rank], K]``, 16-byte aligned rows) holds ``rank``'s shard: its tiles, first in the walk, read it
    there and wait for nothing; ``a``'s rows of that shard are not read (the workspace need not hold a copy).
    ``addend``: ``[slots, >= M, N]`` (one shard only): every slot but ``addend_skip`` is added to the fp32
    accumulator before the store, each tile once ``addend_flags[slot * chunks + r // chunk_rows] >= epoch``
    (the reduction of GEMM-RS).
    ``kernel``: an Autotuner from :func:`make_shard_gemm_kernel` (default :data:`shard_gemm_kernel`).
    Inputs are not re-validated here: call :func:`check_gemm_inputs` once per shape.
    """
    M, K = a.shape
    N = b.shape[1]
    if M == 0 or N == 0:
        return out
    if (flags is not None or addend is not None) and chunks > 1 and chunk_rows >= 1 << 30:
        raise ValueError("shard_gemm: chunks > 1 needs chunk_rows (kernels.symm.chunk_rows(rows, chunks))")
    if addend is not None and (len(rows) != 1 or addend_flags is None or addend.dim() != 3 or addend.stride(2) != 1
                               or addend.shape[1] < M or addend.shape[2] != N or addend.stride(1) < N
                               or addend.stride(0) % addend.stride(1)
                               or (addend.stride(1) * addend.element_size()) % 16 or addend.data_ptr() % 16):
        raise ValueError("shard_gemm: an addend must be [slots, >= M, N] with unit column stride, rows of 16-byte "
                         "multiples, a 16-byte aligned start and a slot stride that is a whole number of rows, for "
                         "one shard, with addend_flags")
    if flags is not None and (own is None or own.shape != (rows[rank], K) or own.dtype != a.dtype
                              or (own.numel() and (own.stride(1) != 1 or (own.stride(0) * own.element_size()) % 16
                                                   or own.data_ptr() % 16))):
        raise ValueError(f"shard_gemm: with flags, own must be rank {rank}'s shard: {a.dtype}, shape "
                         f"{(rows[rank], K)}, row-major with 16-byte aligned rows and start; got "
                         f"{None if own is None else (own.dtype, tuple(own.shape), own.stride())}")
    offsets = shard_offsets_tensor(rows, a.device)
    _launch(kernel, a, own if own is not None else a, b, out, rows, rank, flags if flags is not None else offsets,
            offsets,
            out if addend is None else addend, offsets if addend_flags is None else addend_flags, offsets,
            0, 0 if addend is None else addend.stride(0), 0 if addend is None else addend.stride(1),
            chunk_rows, epoch, addend_skip,
            dict(WAIT=flags is not None, CHUNKS=chunks, ADD_SLOTS=0 if addend is None else addend.shape[0], RS=False),
            skipped_rows=0)
    return out


def partials_gemm(a: torch.Tensor, b: torch.Tensor, partials: torch.Tensor, signals: torch.Tensor,
                  rows: Sequence[int], rank: int, kernel=None, chunks: int = 1, chunk_rows: int = 1 << 30,
                  epoch: int = 1) -> bool:
    """GEMM-RS's partials in one launch: for every shard ``s`` but ``rank``'s, ``partials[s, :rows[s]]`` =
    shard ``s``'s rows of ``a @ b``, the shards walked in ``kernels.symm.push_order``.

    ``partials``: ``[len(rows), >= max(rows), N]`` (slot ``rank`` untouched). ``signals``: int32
    ``[2 * len(rows) * chunks]``, zeros before the first call: a tile count per piece of ``chunk_rows`` rows
    (a multiple of :data:`MAX_BLOCK_M`, so no tile spans two pieces; at most ``chunks`` pieces per shard),
    then a flag per piece that the piece's last tile sets to ``epoch`` (a release at system scope), for a copy
    stream to wait on before it pushes the piece (``kernels.symm.push_pieces(ready=...)``); the counts are back
    at zero when the launch ends. Returns False where nothing was launched though there were rows to compute:
    a tuner launched no config on this rank (every one failed here), so no flag will be set. Cost: one launch
    of ``min(#SMs, tiles)`` programs over the other ranks' rows.
    """
    M, K = a.shape
    N = b.shape[1]
    world = len(rows)
    if (partials.dim() != 3 or partials.shape[0] != world or partials.shape[1] < max(rows) or partials.shape[2] != N
            or partials.stride(2) != 1 or signals.dtype != torch.int32 or signals.numel() < 2 * world * chunks):
        raise ValueError("partials_gemm: partials must be [shards, >= largest shard, N] with unit column stride, and "
                         "signals 2 * shards * chunks int32")
    if chunk_rows % MAX_BLOCK_M or max(cdiv(r, chunk_rows) for r in rows) > chunks:
        raise ValueError(f"partials_gemm: chunk_rows must be a multiple of {MAX_BLOCK_M} that cuts every shard into at "
                         f"most chunks={chunks} pieces (kernels.symm.chunk_rows(rows, chunks)), got {chunk_rows} for "
                         f"rows {list(rows)}")
    if M == rows[rank] or N == 0:
        return True
    offsets = shard_offsets_tensor(rows, a.device)
    modes = dict(WAIT=False, CHUNKS=chunks, ADD_SLOTS=0, RS=True)
    launched = _launch(kernel, a, a, b, partials, rows, rank, offsets, offsets, partials, offsets, signals,
                       partials.stride(0), 0, 0, chunk_rows, epoch, -1, modes, skipped_rows=rows[rank])
    return launched is not None or interpreting()  # (the interpreter's launches return None)


def _launch(kernel, a, own, b, c, rows, rank, flags, offsets, add, add_flags, signals, stride_c_slot, stride_add_slot,
            stride_add_m, chunk_rows, epoch, add_skip, modes: dict, skipped_rows: int) -> Any:
    """The kernel's launch (through ``disttune.cached_launch``) over the tiles of ``rows`` less ``skipped_rows``;
    returns what the launch returned (None where a tuner launched nothing)."""
    if a.device.type == "cuda":
        ensure_descriptor_allocator()
    M, K = a.shape
    N = b.shape[1]
    kmajor = b_is_kmajor(b)
    sms, wait_ptx = device_facts(a.device)

    def grid(meta):
        row_tiles = sum(cdiv(r, meta["BLOCK_M"]) for r in rows) - cdiv(skipped_rows, meta["BLOCK_M"])
        return (max(1, min(sms, row_tiles * cdiv(N, meta["BLOCK_N"]))),)

    return cached_launch.launch(kernel if kernel is not None else shard_gemm_kernel, grid, (
        a, own, b, c, flags, offsets, add, add_flags, signals, M, N, K, a.stride(0), own.stride(0),
        b.stride(1 if kmajor else 0),
        c.stride(-2), stride_c_slot, stride_add_slot, stride_add_m, rank, chunk_rows, epoch, add_skip),
        dict(WORLD=len(rows), B_KMAJOR=kmajor, NUM_SMS=sms, WAIT_PTX=wait_ptx, **modes))


def matmul_shards(a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None, kernel=None) -> torch.Tensor:
    """Plain ``a @ b`` with the shard-ordered GEMM (one shard, no flags)."""
    if out is None and isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() == b.dim() == 2:
        out = torch.empty(a.shape[0], b.shape[1], dtype=a.dtype, device=a.device)
    check_gemm_inputs(a, b, out, "matmul_shards")
    return shard_gemm(a, b, out, [a.shape[0]], rank=0, kernel=kernel)
