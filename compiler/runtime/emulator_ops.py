"""What each MLA instruction computes, on operands read from the emulator's memory image.

These are written from docs/mla-isa.md and docs/integer-semantics.md, independently of the
reference kernels in `compiler.runtime.ops` (none of them is called), so the two cross-check each
other. The integer arithmetic that the spec defines (requantization, rounding shifts,
tables, the common-scale operands of ADD / SUB / MAX / MIN, the normalisation of LAYERNORM,
the fp16 arithmetic of NORM_FP16, the LRN accumulator, ARGMAX) is imported from
`compiler.intmath`; the fixed-point widths of Softmax and Resize are
imported from the reference ops that define them.

Speed without changing a bit (the emulator runs whole networks):

* where the optional compiled kernels are built (`compiler.native`, docs/mla-isa.md), an int8
  CONV runs in them on the host's int8 dot products (AVX-512 VNNI) with its output stage
  (`_int8_conv`), and the output stage, depthwise tap sums and im2col columns elsewhere; they
  compute the same integers as the numpy code below, which stays the definition and the
  fallback;
* exact integer products (CONV, CONV_TRANSPOSE, MATMUL) run through BLAS on integers carried in
  float32 or float64, whichever provably represents every partial sum (`_exact_dtype`);
* CONV is im2col and a matrix product per group (on a block of output rows at a time), or a
  sum of one product per kernel tap reading the input in place (`_TapProducts`, when that
  copies less), or, for depthwise, one product per channel of its weights and its tap columns,
  contiguous slices of its flattened rows (`_DepthwiseTaps`);
* a depthwise CONV of 64 channels or more, or of more channels than output positions,
  computes channel-last, as one einsum over the kernel windows of its channel-last input
  (`_ChannelLastTaps`): numpy's passes then loop over runs of channels instead of short runs
  of positions;
* output stages run in cache-sized blocks (`_blockwise`), fused with the CONV block that
  produced them (over the contiguous pitch-wide rows of tap sums, `_pitched_stage`), as
  `compiler.intmath.FusedOutputStage` (a few in-place passes, proven and tested equal to
  `compiler.intmath.requantize_clamp`) where it applies, else as that definition; a CONV's
  codes go straight into its destination;
* elementwise functions of 8-bit codes (MOVE rescale, ELTWISE, LUT) are evaluated once per
  possible code (pair) and gathered (`_tabulated`, once the table pays over the runs:
  `table_pays`), straight into the destination where its layout allows; an ELTWISE operand that holds one code (a broadcast constant) leaves a
  function of one code, whose table is looked up two codes at a time (`_pairs`); tables keyed
  by their parameters are kept;
* what derives from read-only CONST operands (int64 tables, weight bounds, float weights, fused
  output stages) is made once per program (`MemoryPort.read_cached`);
* operands are read in place (`MemoryPort.view`) where the result is complete before it is
  written;
* small instructions skip all of the above bookkeeping: `emulator_plans` makes each a step
  once per memory image from the same helpers (`conv_geometry`, `function_table`, ...).
"""

from __future__ import annotations

import functools
import math
import sys
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np

from compiler.intmath import (
    INT32_MAX,
    FusedOutputStage,
    apply_lut,
    argmax_codes,
    bf16_grid_sample,
    divide_round_half_up,
    dtype_range,
    fp16_normalisation,
    laid_out_like,
    lrn_accumulator,
    normalise,
    requantize,
    requantize_clamp,
    rescale_operand,
    rounding_right_shift,
)
from compiler.isa import (
    Conv,
    ConvTranspose,
    Eltwise,
    EltwiseOp,
    Fill,
    GridSampleBf16,
    Instruction,
    LayerNorm,
    Load,
    Lrn,
    Lut,
    MatMul,
    Move,
    NormFp16,
    NormOp,
    Pool,
    PoolOp,
    Reduce,
    ReduceOp,
    Requant,
    Resize,
    ResizeMode,
    SampleMode,
    SamplePadding,
    Softmax,
    Space,
    Store,
    Tensor,
    float16_value,
    float32_value,
)
from compiler.native import kernels as native_kernels
from compiler.native import vnni as native_vnni
from compiler.runtime.cache import LruCache
from compiler.runtime.ops.resize import WEIGHT_ONE
from compiler.runtime.ops.softmax import PROBABILITY_BITS, RECIPROCAL_BITS
from compiler.runtime.parallel import for_each, worker_count


class EmulatorError(RuntimeError):
    """The program is wrong: a bad operand, shape, address or value; the message says which."""


T = TypeVar("T")

_dtype_range = functools.cache(dtype_range)
"""`compiler.intmath.dtype_range`, remembered (numpy's iinfo is slow for a per-instruction call)."""


class MemoryPort(Protocol):
    """How an instruction reads and writes the memory image (see `emulator.Memory`)."""

    def read(self, tensor: Tensor) -> np.ndarray: ...

    def view(self, tensor: Tensor) -> np.ndarray: ...

    def read_cached(
        self, tensor: Tensor, key: Hashable, derive: Callable[[np.ndarray], T]
    ) -> T: ...

    def constant(self, tensor: Tensor, key: Hashable, build: Callable[[], T]) -> T: ...

    def target(self, tensor: Tensor) -> np.ndarray: ...

    def write(self, tensor: Tensor, values: np.ndarray) -> None: ...


def _expect_shape(what: str, actual: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if tuple(actual) != tuple(expected):
        raise EmulatorError(f"{what} has shape {tuple(actual)}; expected {tuple(expected)}")


def _frozen(values: np.ndarray) -> np.ndarray:
    """values, read-only: what `MemoryPort.read_cached` keeps is shared by every run."""
    values.flags.writeable = False
    return values


def _int64(memory: MemoryPort, tensor: Tensor) -> np.ndarray:
    """A table operand (bias, multipliers, shifts) as int64; read-only."""
    return memory.read_cached(tensor, "int64", lambda codes: _frozen(codes.astype(np.int64)))


def _table(memory: MemoryPort, value: int | Tensor) -> np.ndarray | int:
    return _int64(memory, value) if isinstance(value, Tensor) else value


def _per_channel(values: np.ndarray | int, ndim: int) -> np.ndarray | int:
    """A rank-1 per-output-channel table as (C, 1, ..., 1) against an (N, C, ...) result."""
    if isinstance(values, np.ndarray) and values.ndim == 1:
        return values.reshape(-1, *[1] * (ndim - 2))
    return values


BLOCK_ELEMENTS = 1 << 16
"""Elements per block of blockwise elementwise work (`_blockwise`). The dozen int64 temporaries
of an output stage then stay in the L2 cache instead of streaming a whole feature map through
memory once per numpy operation, and are recycled by the allocator instead of being mapped
(and page-faulted) afresh."""

Block = tuple[slice, ...]

_WHOLE = slice(None)


class _ScratchPool(threading.local):
    """Work buffers kept per thread and purpose (`_scratch`)."""

    def __init__(self) -> None:
        self.buffers: dict[str, np.ndarray] = {}


_SCRATCH = _ScratchPool()


def _scratch(name: str, shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
    """An uninitialised C-contiguous array in the buffer this thread keeps for `name` (grown
    when too small), valid until the next `_scratch(name, ...)`: each name serves one step of
    one instruction at a time, like a runtime's preallocated work memory. Fresh arrays of
    feature-map size are mapped anew and page-faulted on first touch, which on a virtual
    machine costs about as much as the arithmetic on them."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    buffer = _SCRATCH.buffers.get(name)
    if buffer is None or buffer.size < nbytes:
        buffer = np.empty(max(nbytes, 1), dtype=np.uint8)
        _SCRATCH.buffers[name] = buffer
    return buffer[:nbytes].view(dtype).reshape(shape)


PARALLEL_ELEMENTS = 1 << 15
"""Results of at least this many elements are split into a block per worker thread even when
they fit one `BLOCK_ELEMENTS` block (`_block_elements`); smaller ones are not worth handing
out (a hand-off costs some tens of µs)."""


def _block_elements(total: int) -> int:
    """Elements per block of a result of `total` elements: BLOCK_ELEMENTS, or fewer so that a
    result worth sharing (`PARALLEL_ELEMENTS`) splits into a multiple of the worker count of
    blocks of about equal size (three blocks on two threads would take two blocks' time)."""
    workers = worker_count()
    if workers < 2 or total < PARALLEL_ELEMENTS:
        return BLOCK_ELEMENTS
    parts = -(-total // BLOCK_ELEMENTS)
    parts = -(-parts // workers) * workers
    return max(1, -(-total // parts))


def _step(extent: int, unit: int, total: int) -> int:
    """How many of `extent` rows (or channels) of `unit` elements each go in a block of a
    result of `total` elements: about `_block_elements(total)`, evened out so the blocks are
    of (nearly) equal size, and their count a multiple of the workers if they are shared."""
    size = _block_elements(total)
    blocks = -(-extent // max(1, size // max(unit, 1)))
    workers = worker_count()
    if workers > 1 and total >= PARALLEL_ELEMENTS:
        blocks = -(-blocks // workers) * workers
    return max(1, -(-extent // max(blocks, 1)))


def _blocks(shape: tuple[int, ...]) -> list[Block]:
    """Index tuples of slices (so no axis is dropped) that tile `shape` in blocks of about
    `_block_elements`: whole trailing axes, a run along one axis, single indices before it."""
    total = math.prod(shape)
    size = _block_elements(total)
    if total <= size:
        return [tuple(slice(None) for _ in shape)]
    axis = 0
    while math.prod(shape[axis + 1 :]) > size:
        axis += 1
    step = _step(shape[axis], math.prod(shape[axis + 1 :]), total)
    tail = tuple(slice(None) for _ in shape[axis + 1 :])
    return [
        (*(slice(i, i + 1) for i in lead), slice(start, start + step), *tail)
        for lead in np.ndindex(*shape[:axis])
        for start in range(0, shape[axis], step)
    ]


def kernel_stage_tables(fused: FusedOutputStage, channels: int) -> tuple[object, ...] | None:
    """A fused stage as the compiled int8 CONV kernels run it in their epilogue (mla_vnni.h):
    one entry per output channel (axis 1 of the result) of each table, (scale, offset,
    code_low, code_high, excess) for the float64 path, (lower, upper, multiplier, offset,
    shift, excess) for the int64 one; None where the codes are wider than 16 bits or a table
    varies along another axis."""
    if fused.code_dtype.itemsize > 2:
        return None
    if fused.exact_float:
        tables, dtype = (fused.scale, fused.offset), np.float64
    else:
        tables = (fused.lower, fused.upper, fused.scale, fused.offset, fused.total_shift)
        dtype = np.int64
    vectors = [_channel_vector(table, channels, dtype) for table in tables]
    if any(v is None for v in vectors):
        return None
    vectors = [_frozen(v) for v in vectors]  # kept per program with the stage: read-only
    if fused.exact_float:
        return (*vectors, fused.code_low, fused.code_high, fused.excess)
    return (*vectors, fused.excess)


def _channel_vector(table: np.ndarray, channels: int, dtype: type) -> np.ndarray | None:
    """A table that broadcasts against a rank-4 result and varies only along axis 1, as one
    contiguous `dtype` value per channel; None for any other table."""
    if table.ndim > 4:
        return None
    shape = (1,) * (4 - table.ndim) + table.shape
    if shape[0] != 1 or shape[2:] != (1, 1) or shape[1] not in (1, channels):
        return None
    return np.ascontiguousarray(np.broadcast_to(table.reshape(shape[1]), (channels,)), dtype)


def _block_of(table: np.ndarray | int | None, block: Block) -> np.ndarray | int | None:
    """The part of a table, broadcast against the whole result, that one block of it needs
    (the table itself where the block spans all of its axes)."""
    if not isinstance(table, np.ndarray) or table.ndim == 0 or table.ndim > len(block):
        return table
    index = tuple(
        part if n > 1 else _WHOLE
        for part, n in zip(block[len(block) - table.ndim :], table.shape, strict=True)
    )
    if all(part == _WHOLE for part in index):
        return table
    return table[index]


def _empty(
    shape: tuple[int, ...], dtype: np.dtype | type, like: Tensor | None, pool: str | None = None
) -> np.ndarray:
    """np.empty laid out in the memory order of `like` (largest stride outermost), so that
    writing it there copies in order instead of transposing byte by byte (HWC tensors); in
    the `_scratch` buffer `pool` if given."""

    def empty(dims: tuple[int, ...]) -> np.ndarray:
        return np.empty(dims, dtype=dtype) if pool is None else _scratch(pool, dims, dtype)

    if like is None or like.shape != shape:
        return empty(shape)
    order = sorted(range(len(shape)), key=lambda axis: -abs(like.strides[axis]))
    return empty(tuple(shape[axis] for axis in order)).transpose(np.argsort(order))


def _blockwise(
    shape: tuple[int, ...],
    dtype: np.dtype | type,
    compute: Callable[[Block, np.ndarray, np.ndarray], object],
    blocks: list[Block] | None = None,
    like: Tensor | None = None,
    pool: str | None = None,
    into: np.ndarray | None = None,
) -> np.ndarray:
    """A result of `shape` (laid out like `like`; in the `_scratch` buffer `pool` if given; or
    `into`, an array of that shape and dtype, such as the destination's place) filled block by
    block by compute(block, out, scratch), which writes result[block] into `out`, over
    `blocks` (by default `_blocks(shape)`), which must tile the result. `scratch` is one flat
    buffer of 8-byte items as large as the largest block, one per thread.

    The blocks run on the emulator's threads (`parallel.for_each`): `compute` must write only
    `out` and keep its temporaries in `_scratch` buffers (which are per thread)."""
    result = _empty(shape, dtype, like, pool) if into is None else into
    blocks = _blocks(shape) if blocks is None else blocks
    largest = max((_block_size(shape, block) for block in blocks), default=0)

    def run(block: Block) -> None:
        compute(block, result[block], _scratch("stage", (largest,), np.int64))

    for_each(blocks, run)
    return result


def _block_size(shape: tuple[int, ...], block: Block) -> int:
    """Number of elements of result[block] for a result of `shape`."""
    return math.prod(len(range(n)[index]) for n, index in zip(shape, block, strict=True))


TABLE_FACTOR = 2
"""`_tabulated` pays once the data has this many elements per table entry (building a table
costs about one direct evaluation per entry; a gather, a fraction of one). A kept table (one
with a key) counts the elements of every evaluation under its key (`table_pays`)."""

_DEMAND: dict[Hashable, int] = {}
"""Elements evaluated so far per table key (`table_pays`)."""


def table_pays(key: Hashable | None, size: int, entries: int) -> bool:
    """Whether evaluating a function of `size` elements as a lookup in a table of `entries`
    values pays: the data has TABLE_FACTOR elements per entry, or, for a table kept under
    `key` (built once, then shared by every instruction and run with that key), all the
    evaluations under that key so far, this one included, have (a residual ADD of a 56x56 map
    runs once per frame, each time on fewer elements than a table of every code pair)."""
    needed = TABLE_FACTOR * entries
    if size >= needed or key is None:
        return size >= needed
    if len(_DEMAND) > 4 * TABLES_KEPT:
        _DEMAND.clear()
    _DEMAND[key] = _DEMAND.get(key, 0) + size
    return _DEMAND[key] >= needed


TABLES_KEPT = 1024
"""Tables of `_tabulated` kept between instructions and runs (least recently used first out)."""

_TABLES: LruCache[np.ndarray] = LruCache()


def _kept(key: Hashable | None, build: Callable[[], np.ndarray]) -> np.ndarray:
    """build(), or the table kept under `key` (`TABLES_KEPT`); never kept without a key."""
    return build() if key is None else _TABLES.get(key, build, TABLES_KEPT)


def _tabulated(
    memory: MemoryPort,
    target: Tensor,
    function: Callable[..., np.ndarray],
    dtype: np.dtype | type,
    *codes: np.ndarray,
    key: Hashable | None = None,
) -> bool:
    """Write function(*codes) into `target` for an elementwise function of one or two arrays of
    8-bit codes, looked up in a table of its values over every code (tuple); False (nothing
    written) where that does not pay.

    Such a function takes at most 256 (or 65536) distinct arguments, so evaluating it once on
    each, with the same compiler.intmath calls on the same int64 values, and gathering gives
    the result of evaluating it on the data, for one gather per element instead of a dozen
    int64 passes. `function` gets int64 codes (its arguments broadcast: (256,) or (256, 1) and
    (1, 256)) and must be elementwise with scalar parameters; `dtype` must hold its values.
    `key`, if given, must determine the function and dtype completely (every parameter, as
    values): the table is then built once and kept (`TABLES_KEPT`), as a runtime would keep a
    kernel's constants, instead of once per instruction and run.
    """
    if len(codes) > 2 or any(c.dtype.itemsize != 1 or c.dtype.kind not in "iu" for c in codes):
        return False
    shape = np.broadcast_shapes(*(c.shape for c in codes))
    size = math.prod(shape)
    full_key = None
    if key is not None:
        full_key = (key, tuple(c.dtype.str for c in codes), np.dtype(dtype).str)
    if not table_pays(full_key, size, 256 ** len(codes)):
        return False
    table = function_table(function, dtype, tuple(c.dtype for c in codes), key)
    pairs = None
    if len(codes) == 1 and size >= PAIR_ELEMENTS and table.itemsize <= 2 and _LITTLE_ENDIAN:
        pairs = _kept(None if full_key is None else (full_key, "pairs"), lambda: _pairs(table))
    _lookup(memory, target, table, codes, shape, pairs)
    return True


def function_table(
    function: Callable[..., np.ndarray],
    dtype: np.dtype | type,
    code_dtypes: tuple[np.dtype, ...],
    key: Hashable | None = None,
) -> np.ndarray:
    """function's values, as `dtype`, over every code (pair) of 8-bit dtypes `code_dtypes`, at
    the index the codes' bytes spell (see `_tabulated`); kept under `key` if given."""

    def build() -> np.ndarray:
        domains = [np.arange(256, dtype=np.uint8).view(d).astype(np.int64) for d in code_dtypes]
        if len(domains) == 1:
            table = function(domains[0])
        else:
            table = function(domains[0][:, None], domains[1][None, :])
        return _frozen(np.asarray(table).reshape(-1).astype(dtype))

    full_key = None
    if key is not None:
        full_key = (key, tuple(np.dtype(d).str for d in code_dtypes), np.dtype(dtype).str)
    return _kept(full_key, build)


PAIR_ELEMENTS = 1 << 16
"""Codes from which a one-code table of 1- or 2-byte values is looked up two codes at a time
(`_pairs`: a table of 65536 entries, which then pays for itself)."""

_LITTLE_ENDIAN = sys.byteorder == "little"


def _pairs(table: np.ndarray) -> np.ndarray:
    """The 256-entry `table` for every pair of codes, as items of twice its width: entry
    c0 + 256·c1 holds (table[c0], table[c1]). Two adjacent codes, read as one little-endian
    16-bit word, index it, so one gather gives two results (numpy's gather costs about the same
    per item whatever the item's width)."""
    pairs = np.empty((256, 256, 2), dtype=table.dtype)
    pairs[:, :, 0] = table[None, :]
    pairs[:, :, 1] = table[:, None]
    return _frozen(pairs.view(f"u{2 * table.itemsize}").reshape(-1))


MIN_RUN = 1 << 10
"""Contiguous elements from which a lookup runs over each of the operands' and destination's
common runs in place (`_lookup`) rather than over contiguous copies."""


def _contiguous_tail(arrays: list[np.ndarray]) -> int:
    """The fewest leading axes k such that every array is C-contiguous over axes k onwards
    (all arrays have one shape)."""
    shape = arrays[0].shape
    k = len(shape)
    expected = [a.itemsize for a in arrays]
    while k > 0:
        n = shape[k - 1]
        if n != 1:
            if any(a.strides[k - 1] != e for a, e in zip(arrays, expected, strict=True)):
                break
            expected = [e * n for e in expected]
        k -= 1
    return k


def _in_place(out: np.ndarray, codes: tuple[np.ndarray, ...]) -> bool:
    """Whether a lookup may write `out` while it reads `codes`: no code array shares memory
    with it, or one shares it exactly, element for element (each block reads its codes
    before it writes them)."""
    address = out.__array_interface__["data"][0]
    return all(
        not np.may_share_memory(out, c)
        or (c.__array_interface__["data"][0] == address and c.strides == out.strides)
        for c in codes
    )


def _lookup(
    memory: MemoryPort,
    target: Tensor,
    table: np.ndarray,
    codes: tuple[np.ndarray, ...],
    shape: tuple[int, ...],
    pairs: np.ndarray | None = None,
) -> None:
    """target = table[index] for the index the 8-bit codes spell (one code, or the first code's
    byte then the second's; `pairs` is `_pairs(table)` or None), gathered straight into the
    target where its layout and the operands' allow, else into a new array that is written."""
    if any(c.shape != shape for c in codes):
        codes = tuple(np.broadcast_to(c, shape) for c in codes)
    _expect_shape("the destination", target.shape, shape)
    if target.dtype.numpy != table.dtype:
        result = np.empty(shape, dtype=table.dtype)
        _gather(table, tuple(np.ascontiguousarray(c) for c in codes), result, 0, pairs)
        memory.write(target, result)
        return
    out = memory.target(target)
    lead = _contiguous_tail([out, *codes])
    if math.prod(shape[lead:]) >= min(MIN_RUN, math.prod(shape)) and _in_place(out, codes):
        _gather(table, codes, out, lead, pairs)
        return
    result = np.empty(shape, dtype=table.dtype)
    _gather(table, tuple(np.ascontiguousarray(c) for c in codes), result, 0, pairs)
    out[...] = result


def _gather(
    table: np.ndarray,
    codes: tuple[np.ndarray, ...],
    out: np.ndarray,
    lead: int,
    pairs: np.ndarray | None,
) -> None:
    """out = table[index] (see `_lookup`) for arrays that are C-contiguous over every axis from
    `lead` on, one run of those axes at a time, in blocks of `_block_elements`: numpy converts
    a gather's index to an intp array (eight bytes per element) first, which for a whole
    feature map is a large fresh temporary. Every index is below 256 ** len(codes), the size of
    a table of every code (tuple), so mode="wrap" never wraps there: it only skips the bounds
    check that the default mode makes per element (some 25% of the gather). The blocks run on
    the emulator's threads (`parallel.for_each`)."""
    size = math.prod(out.shape[lead:])
    step = _block_elements(math.prod(out.shape))
    step += step % 2
    mode = "wrap" if table.size >= 256 ** len(codes) else "raise"
    items = [
        (index, start) for index in np.ndindex(*out.shape[:lead]) for start in range(0, size, step)
    ]

    compiled = native_kernels is not None and table.size >= 256 ** len(codes)

    def gather(item: tuple[tuple[int, ...], int]) -> None:
        index, start = item
        stop = min(size, start + step)
        part = out[(*index, ...)].reshape(-1)[start:stop]
        flat = [c[(*index, ...)].reshape(-1)[start:stop].view(np.uint8) for c in codes]
        if compiled:
            native_kernels.lookup(table, flat[0], flat[1] if len(flat) == 2 else None, part)
            return
        if len(flat) == 2:
            word = _scratch("gather-index", (stop - start,), np.uint16)
            np.left_shift(flat[0], 8, out=word, dtype=np.uint16)
            np.bitwise_or(word, flat[1], out=word)
            np.take(table, word, out=part, mode=mode)
            return
        even = (stop - start) & ~1
        wide = part[:even].view(pairs.dtype) if pairs is not None and even else None
        if wide is not None and wide.flags.aligned:
            np.take(pairs, flat[0][:even].view(np.uint16), out=wide, mode="wrap")
            if even < stop - start:
                part[even:] = table[flat[0][even:]]
            return
        np.take(table, flat[0], out=part, mode=mode)

    for_each(items, gather)


@dataclass(frozen=True)
class _OutputStage:
    """An instruction's output stage, its tables read once: - input zero point + per-channel
    bias -> saturate int32 -> requantize (M, n) -> + zero point -> clamp [low, high].

    Where `compiler.intmath.FusedOutputStage` is provably identical ("sima" mode, tables in
    range) it runs as that (`fused`), writing codes straight into the result; otherwise
    through `compiler.intmath.requantize_clamp`, the definition.
    """

    requant: Requant
    multiplier: np.ndarray | int
    shift: np.ndarray | int
    bias: np.ndarray | None
    zero_point: int
    out_dtype: np.dtype
    fused: FusedOutputStage | None
    parts: dict[tuple[tuple[int | None, int | None, int | None], ...], tuple[np.ndarray, ...]]
    """The fused tables of each block of the result seen so far (`_block_of`), kept with the
    fused stage (per program where that is)."""

    @classmethod
    def read(
        cls,
        memory: MemoryPort,
        requant: Requant,
        ndim: int,
        *,
        per_channel: bool = False,
        bias: Tensor | None = None,
        channels: int = 0,
        zero_point: int = 0,
        target: Tensor | None = None,
    ) -> _OutputStage:
        """The stage of a rank-`ndim` result; `bias` (a tensor of `channels` values) and
        per-channel tables apply along axis 1. The result has the dtype of `target` when
        [low, high] fits it (narrowing then loses nothing, and a write still range-checks),
        else int64.

        With every table a CONST tensor (which no instruction can change) the stage is made
        once per program (`MemoryPort.constant`), its tables still read, and counted, on
        every call: making it again took some 60 µs per CONV."""
        operands = [t for t in (requant.multiplier, requant.shift, bias) if isinstance(t, Tensor)]
        built: list[bool] = []

        def build() -> _OutputStage:
            built.append(True)
            return cls._build(
                memory, requant, ndim, per_channel, bias, channels, zero_point, target
            )

        if not operands or any(t.space != Space.CONST for t in operands):
            return build()
        dtype = None if target is None else target.dtype.numpy.str
        key = ("stage object", requant, bias, ndim, per_channel, channels, zero_point, dtype)
        stage = memory.constant(operands[0], key, build)
        if not built:
            for tensor in operands:
                _int64(memory, tensor)
        return stage

    @classmethod
    def _build(
        cls,
        memory: MemoryPort,
        requant: Requant,
        ndim: int,
        per_channel: bool,
        bias: Tensor | None,
        channels: int,
        zero_point: int,
        target: Tensor | None,
    ) -> _OutputStage:
        """`read`'s stage, made from its tables."""
        multiplier = _table(memory, requant.multiplier)
        shift = _table(memory, requant.shift)
        if per_channel:
            multiplier = _per_channel(multiplier, ndim)
            shift = _per_channel(shift, ndim)
        biases = None
        if bias is not None:
            _expect_shape("the bias", bias.shape, (channels,))
            biases = _per_channel(_int64(memory, bias), ndim)
        out_dtype = np.dtype(np.int64)
        if target is not None:
            low, high = _dtype_range(target.dtype.numpy)
            if low <= requant.low and requant.high <= high:
                out_dtype = np.dtype(target.dtype.numpy)

        def prepare() -> FusedOutputStage | None:
            addend = -zero_point if biases is None else biases - zero_point
            return FusedOutputStage.prepare(
                multiplier, shift, requant.zero_point, requant.low, requant.high, addend, out_dtype
            )

        operands = [t for t in (requant.multiplier, requant.shift, bias) if isinstance(t, Tensor)]
        if requant.mode != "sima":
            fused = None
        elif not operands:
            fused = _scalar_stage(
                int(multiplier),
                int(shift),
                requant.zero_point,
                requant.low,
                requant.high,
                -zero_point,
                out_dtype.str,
            )
        elif all(t.space == Space.CONST for t in operands):
            key = ("stage", requant, bias, ndim, per_channel, zero_point, out_dtype.str)
            fused = memory.constant(operands[0], key, prepare)
            parts = memory.constant(operands[0], (*key, "parts"), dict)
            return cls(requant, multiplier, shift, biases, zero_point, out_dtype, fused, parts)
        else:
            fused = prepare()
        return cls(requant, multiplier, shift, biases, zero_point, out_dtype, fused, {})

    def kernel_stage(self, channels: int) -> tuple[object, ...] | None:
        """`kernel_stage_tables` of the fused stage, kept with it (in `parts`, under a key of
        its own); None where the stage is not fused."""
        if self.fused is None:
            return None
        key = ("kernel stage", channels)
        if key not in self.parts:
            self.parts[key] = kernel_stage_tables(self.fused, channels)
        return self.parts[key]

    def blockwise(self, shape: tuple[int, ...]) -> bool:
        """Whether the tables broadcast to `shape` (else one whole evaluation decides what
        shape the result, or the error, has)."""
        tables = [
            t.shape for t in (self.multiplier, self.shift, self.bias) if isinstance(t, np.ndarray)
        ]
        try:
            return np.broadcast_shapes(shape, *tables) == shape
        except ValueError:
            return False

    def uniform(self, ndim: int) -> bool:
        """Whether the stage is the same scalar function everywhere on a rank-`ndim` result
        (no bias, single-valued tables that do not add axes), as `_tabulated` needs."""
        tables = (self.multiplier, self.shift)
        return self.bias is None and all(np.size(t) == 1 and np.ndim(t) <= ndim for t in tables)

    def key(self) -> tuple[object, ...]:
        """Values that determine a `uniform` stage completely (for `_tabulated`)."""
        scalars = (int(np.asarray(t).reshape(-1)[0]) for t in (self.multiplier, self.shift))
        requant = self.requant
        return (
            requant.mode,
            *scalars,
            requant.zero_point,
            requant.low,
            requant.high,
            self.zero_point,
            self.out_dtype.str,
        )

    def __call__(
        self,
        acc: np.ndarray,
        block: Block | None = None,
        *,
        out: np.ndarray | None = None,
        scratch: np.ndarray | None = None,
    ) -> np.ndarray:
        """The stage on `acc` (integers, in any integer dtype or exactly in a float one),
        written into `out` (a new array of `out_dtype` if None), which is returned. `block`
        says which part of the result acc is, to pick the table entries; `scratch` is a flat
        8-byte-item buffer of at least acc.size elements for the intermediate values."""
        fused = self.fused
        if fused is not None and (block is not None or self.blockwise(acc.shape)):
            if out is None:
                out = np.empty(acc.shape, dtype=self.out_dtype)
            tables = None
            if block is not None and any(part != _WHOLE for part in block):
                key = tuple((part.start, part.stop, part.step) for part in block)
                tables = self.parts.get(key)
                if tables is None:
                    tables = self.parts[key] = tuple(_block_of(t, block) for t in fused.tables())
            return fused.apply(acc, out, tables, scratch)
        result = self._definition(acc, block)
        if out is None:
            return result
        out[...] = result
        return out

    def _definition(self, acc: np.ndarray, block: Block | None) -> np.ndarray:
        """The stage through `compiler.intmath.requantize_clamp` (any mode, any tables)."""

        def part(table: np.ndarray | int | None) -> np.ndarray | int | None:
            return table if block is None else _block_of(table, block)

        if self.bias is None:
            acc = acc.astype(np.int64)
        else:
            acc = np.add(acc, part(self.bias), dtype=np.int64, casting="unsafe")
        if self.zero_point:
            acc -= self.zero_point
        requant = self.requant
        try:
            return requantize_clamp(
                acc,
                part(self.multiplier),
                part(self.shift),
                requant.mode,
                requant.zero_point,
                requant.low,
                requant.high,
            )
        except ValueError as error:
            raise EmulatorError(f"requantization tables do not fit the result: {error}") from error


@functools.lru_cache(maxsize=4096)
def _scalar_stage(
    multiplier: int, shift: int, zero_point: int, low: int, high: int, addend: int, dtype: str
) -> FusedOutputStage | None:
    """`FusedOutputStage.prepare` of a per-tensor stage (immediates only), remembered: it is
    exact integer work that costs far more than a small MOVE or ELTWISE it serves."""
    return FusedOutputStage.prepare(multiplier, shift, zero_point, low, high, addend, dtype)


def output_stage(
    memory: MemoryPort,
    acc: np.ndarray,
    requant: Requant,
    *,
    per_channel: bool = False,
    zero_point: int = 0,
    bias: Tensor | None = None,
    target: Tensor | None = None,
) -> np.ndarray:
    """acc - zero_point + bias -> saturate int32 -> requantize (M, n) -> + zero point -> clamp.

    `acc` holds integers, in an integer dtype or exactly in a float one; `bias` has one value
    per output channel (axis 1). The stage is elementwise, so it runs blockwise
    (`_blockwise`). The result is int64, or of the dtype and layout of `target` (the tensor
    it is for) when [low, high] fits that dtype.
    """
    channels = acc.shape[1] if acc.ndim > 1 else 0
    stage = _OutputStage.read(
        memory,
        requant,
        acc.ndim,
        per_channel=per_channel,
        bias=bias,
        channels=channels,
        zero_point=zero_point,
        target=target,
    )
    if not stage.blockwise(acc.shape):
        return stage(acc)
    return _blockwise(
        acc.shape,
        stage.out_dtype,
        lambda block, out, scratch: stage(acc[block], block, out=out, scratch=scratch),
        like=target,
    )


def _rescaled(
    memory: MemoryPort, instruction: Pool | Resize, codes: np.ndarray, what: str
) -> np.ndarray:
    """Selected input codes through the instruction's optional output stage (centred on its
    input zero point); without one they are stored as they are, in the same dtype."""
    if instruction.requant is None:
        _same_dtype(what, instruction.input, instruction.output)
        return codes
    return output_stage(
        memory,
        codes,
        instruction.requant,
        zero_point=instruction.input_zero_point,
        target=instruction.output,
    )


def _same_dtype(what: str, source: Tensor, target: Tensor) -> None:
    """Without a rescale the codes are moved as they are, so the storage types must agree."""
    if source.dtype != target.dtype:
        raise EmulatorError(
            f"{what} without a rescale keeps the dtype: {source.dtype.name} -> {target.dtype.name}"
        )


def _centred(memory: MemoryPort, tensor: Tensor, zero_point: int) -> np.ndarray:
    return memory.read(tensor).astype(np.int64) - zero_point


def check_copy(instruction: Load | Store | Move) -> None:
    """What a LOAD, STORE or plain MOVE needs: the spaces its kind moves between, and one shape
    and dtype on both sides."""
    src, dst = instruction.src, instruction.dst
    if isinstance(instruction, Load):
        if src.space not in (Space.DRAM, Space.CONST):
            raise EmulatorError("LOAD reads DRAM or CONST")
        if dst.space != Space.ARENA:
            raise EmulatorError("LOAD writes the arena")
    if isinstance(instruction, Store) and (src.space != Space.ARENA or dst.space != Space.DRAM):
        raise EmulatorError("STORE copies from the arena to DRAM")
    _expect_shape("the destination", dst.shape, src.shape)
    if src.dtype != dst.dtype:
        raise EmulatorError(
            f"a plain copy keeps the dtype: {src.dtype.name} -> {dst.dtype.name} needs a rescale"
        )


def _copy(memory: MemoryPort, instruction: Load | Store | Move) -> None:
    check_copy(instruction)
    memory.write(instruction.dst, memory.view(instruction.src))


def execute_load(instruction: Load, memory: MemoryPort) -> None:
    _copy(memory, instruction)


def execute_store(instruction: Store, memory: MemoryPort) -> None:
    _copy(memory, instruction)


def move_stage(memory: MemoryPort, instruction: Move) -> _OutputStage:
    """A rescaling MOVE's output stage (centred on its input zero point)."""
    assert instruction.requant is not None
    return _OutputStage.read(
        memory,
        instruction.requant,
        instruction.src.ndim,
        zero_point=instruction.input_zero_point,
        target=instruction.dst,
    )


def execute_move(instruction: Move, memory: MemoryPort) -> None:
    if instruction.requant is None:
        _copy(memory, instruction)
        return
    _expect_shape("the destination", instruction.dst.shape, instruction.src.shape)
    codes = memory.view(instruction.src)
    stage = move_stage(memory, instruction)
    key = ("move", *stage.key()) if stage.uniform(codes.ndim) else None
    if key is not None and _tabulated(
        memory, instruction.dst, stage, stage.out_dtype, codes, key=key
    ):
        return
    result = output_stage(
        memory,
        codes,
        instruction.requant,
        zero_point=instruction.input_zero_point,
        target=instruction.dst,
    )
    memory.write(instruction.dst, result)


def execute_fill(instruction: Fill, memory: MemoryPort) -> None:
    memory.write(instruction.dst, np.full(instruction.dst.shape, instruction.value, np.int64))


def _pad_hw(x: np.ndarray, pads: tuple[int, int, int, int], value: int) -> np.ndarray:
    top, left, bottom, right = pads
    if min(pads) < 0:
        raise EmulatorError(f"negative padding {pads}")
    return np.pad(
        x, ((0, 0), (0, 0), (top, bottom), (left, right)), mode="constant", constant_values=value
    )


def _output_size(size: int, kernel: int, stride: int, dilation: int) -> int:
    extent = (kernel - 1) * dilation + 1
    if size < extent:
        raise EmulatorError(f"a window of {extent} does not fit a padded extent of {size}")
    return (size - extent) // stride + 1


def _rank4(what: str, tensor: Tensor) -> tuple[int, int, int, int]:
    if tensor.ndim != 4:
        raise EmulatorError(f"{what} must be 4-D (N, C, H, W), not {tensor.shape}")
    return tensor.shape  # type: ignore[return-value]


# --- exact integer products on the floating-point units ------------------------------------------
#
# The MAC array sums int8/int16 products exactly in its accumulator. numpy's integer matmul does
# not use BLAS and is some 30x slower than a float one, so CONV, CONV_TRANSPOSE and MATMUL carry
# the centred integers in a floating-point dtype instead, chosen per instruction so that nothing
# ever rounds:
#
# * a float with a p-bit significand represents every integer of magnitude <= 2**p exactly
#   (p = 24 for float32, 53 for float64);
# * the stored codes, the zero point, the centred codes and the weights are integers, and so is
#   every product and every partial sum of products, whatever order or blocking BLAS uses;
# * every partial sum of a dot product sum_k x_k * w_k is bounded by
#   sum_k |x_k| |w_k| <= max|x| * sum_k |w_k|, and so is every single product;
# * so if all those magnitudes are <= 2**p, each rounding step (conversion, product, sum or fused
#   multiply-add) rounds an exact integer of magnitude <= 2**p to itself: the float result is
#   the exact integer result, which converts to int64 without loss.
#
# `_exact_dtype` picks float32 when that bound is <= 2**24 (twice the BLAS speed of float64 and
# half the memory traffic: int8 data times typical int8 weights over K up to a few thousand),
# float64 when it is <= 2**53 (int8 x int8 for any K below 2**37), and int64 arithmetic (numpy's
# own loops, exact while the sums fit int64, as the accumulator semantics assume) beyond that. tests/test_emulator_exact.py checks the boundary with all-extreme operands.

FLOAT32_EXACT = 2**24
"""Every integer of magnitude <= 2**24 is a float32."""

FLOAT64_EXACT = 2**53
"""Every integer of magnitude <= 2**53 is a float64."""


def _exact_dtype(largest: int) -> type[np.float32] | type[np.float64] | type[np.int64]:
    """The cheapest dtype in which integers of magnitude <= `largest` add and multiply exactly."""
    if largest <= FLOAT32_EXACT:
        return np.float32
    if largest <= FLOAT64_EXACT:
        return np.float64
    return np.int64


def _largest_value(codes: np.ndarray, zero_point: int, weight_mass: int) -> int:
    """Largest magnitude an integer product-sum of `codes - zero_point` with weights can reach.

    `weight_mass` is max over outputs of sum |w| (which is >= max |w|); the result also covers
    the stored codes and the zero point themselves, which are converted before centring.
    """
    if codes.size == 0:
        return max(abs(zero_point), weight_mass)

    def bound(low: int, high: int) -> int:
        centred = max(abs(low - zero_point), abs(high - zero_point))
        return max(abs(low), abs(high), abs(zero_point), weight_mass, centred * max(weight_mass, 1))

    if codes.dtype.kind in "iu":
        # Every code of the dtype bounds the codes too: where that already picks float32,
        # the two passes of min and max over the codes cannot pick anything cheaper.
        every_code = bound(*_dtype_range(codes.dtype))
        if every_code <= FLOAT32_EXACT:
            return every_code
    return bound(int(codes.min()), int(codes.max()))


def _weight_mass(weight: np.ndarray, axes: tuple[int, ...]) -> int:
    """max over the other axes of sum |weight| over `axes` (the reduction axes), exactly."""
    if weight.size == 0:
        return 0
    return int(np.abs(weight.astype(np.int64)).sum(axis=axes).max())


class _Weights:
    """The weight operand of an exact product: its centred integer values, their mass (see
    `_weight_mass`) and copies cast for the matrix products. For a CONST weight it is made once
    per program (`MemoryPort.read_cached`), so all of it is read-only."""

    def __init__(self, values: np.ndarray, axes: tuple[int, ...]) -> None:
        self.values = _frozen(values)
        self.mass = _weight_mass(values, axes)
        self._cast: dict[Hashable, np.ndarray] = {}

    def astype(self, dtype: type) -> np.ndarray:
        if dtype not in self._cast:
            self._cast[dtype] = _frozen(self.values.astype(dtype))
        return self._cast[dtype]

    def int8_quads(self, group: int, zero_point_code: int) -> tuple[np.ndarray, np.ndarray] | None:
        """A (M, C/G, kh, kw) CONV weight as the compiled int8 kernel reads it (`compiler.native`
        conv_planes, depthwise_planes): per group, each output channel's weights in im2col order, zero-padded to a
        multiple of four and packed four bytes to an int32, and the corrections c * sum(w)
        (wrapped to int32) for codes read with c = `zero_point_code` at the zero point; None
        where a weight does not fit a signed byte."""
        key = ("int8 quads", group, zero_point_code)
        if key not in self._cast:
            values = self.values
            if values.size and (values.min() < -128 or values.max() > 127):
                self._cast[key] = None
                return None
            out_channels = values.shape[0]
            rows = values.reshape(group, out_channels // group, -1)
            depth = rows.shape[2]
            padded = np.zeros((*rows.shape[:2], -(-depth // 4) * 4), np.int8)
            padded[:, :, :depth] = rows
            quads = _frozen(padded.view("<i4"))
            sums = rows.astype(np.int64).sum(axis=2)
            corrections = _frozen((zero_point_code * sums).astype(np.int32))
            self._cast[key] = (quads, corrections)
        return self._cast[key]

    def taps(self, dtype: type) -> np.ndarray:
        """A (M, C, kh, kw) CONV weight as contiguous (kh, kw, M, C) `dtype` matrices, one
        per kernel tap (`_TapProducts`)."""
        key = ("taps", dtype)
        if key not in self._cast:
            taps = self.astype(dtype).transpose(2, 3, 0, 1)
            self._cast[key] = _frozen(np.ascontiguousarray(taps))
        return self._cast[key]


def _centred_as(
    codes: np.ndarray,
    zero_point: int,
    dtype: type,
    pads: tuple[int, int, int, int] | None = None,
    pool: str | None = None,
    *,
    channel_last: bool = False,
) -> np.ndarray:
    """codes - zero_point in `dtype`, zero-padded (N, C, H, W) -> (N, C, H + t + b, W + l + r),
    in the `_scratch` buffer `pool` if given; with `channel_last`, laid out as
    (N, H + t + b, W + l + r, C) in memory (the same array, transposed in place).

    One pass from the stored codes: the subtraction runs in `dtype` (never in the codes' own
    narrow type, where it would wrap), and the padding holds centred 0, i.e. the zero point.
    The pass is shared by the threads in runs of rows (`_row_runs`).
    """
    if pads is None:
        return np.subtract(codes, zero_point, dtype=dtype)
    top, left, bottom, right = pads
    if min(pads) < 0:
        raise EmulatorError(f"negative padding {pads}")
    batch, channels, height, width = codes.shape
    padded = (batch, channels, height + top + bottom, width + left + right)
    if channel_last:
        memory_order = (batch, *padded[2:], channels)
        x = _scratch(pool, memory_order, dtype) if pool else np.empty(memory_order, dtype)
        x = x.transpose(0, 3, 1, 2)
    else:
        x = np.empty(padded, dtype) if pool is None else _scratch(pool, padded, dtype)
    x[:, :, :top] = 0
    x[:, :, top + height :] = 0
    x[:, :, top : top + height, :left] = 0
    x[:, :, top : top + height, left + width :] = 0
    inside = x[:, :, top : top + height, left : left + width]

    def centre(rows: slice) -> None:
        np.subtract(codes[:, :, rows], zero_point, out=inside[:, :, rows], dtype=dtype)

    def centre_transposed(rows: slice) -> None:
        # The codes transposed first (one byte per element), then centred along the channel
        # runs: half the time of one pass that converts and transposes at once.
        part = codes[:, :, rows].transpose(0, 2, 3, 1)
        copied = _scratch("channel-last-codes-in", part.shape, codes.dtype)
        np.copyto(copied, part)
        np.subtract(copied, zero_point, out=inside[:, :, rows].transpose(0, 2, 3, 1), dtype=dtype)

    for_each(_row_runs(height, codes.size), centre_transposed if channel_last else centre)
    return x


def _row_runs(height: int, total: int) -> list[slice]:
    """Runs of rows that split an (N, C, height, W) array of `total` elements into blocks of
    about `_block_elements` (whole rows), to share a pass over it between the threads; one run
    when there is one thread, or too little to share."""
    if height == 0 or total < PARALLEL_ELEMENTS or worker_count() < 2:
        return [slice(0, height)]
    step = -(-height // min(height, -(-total // _block_elements(total))))
    return [slice(start, min(height, start + step)) for start in range(0, height, step)]


def _im2col(
    x: np.ndarray,
    kernel: tuple[int, int],
    strides: tuple[int, int],
    dilations: tuple[int, int],
) -> np.ndarray:
    """(N, C, kh, kw, Ho, Wo) columns of a padded (N, C, H, W) array, contiguous.

    Row (c, i, j) is channel c shifted by tap (i, j), so a (M, C·kh·kw) weight matrix times the
    (C·kh·kw, Ho·Wo) columns is the whole convolution in one matrix product. For a 1x1 kernel
    with unit strides the view already is the input, and no copy is made.
    """
    if kernel == (1, 1) and strides == (1, 1):
        return x[:, :, None, None]
    windows = _windows(x, kernel, strides, dilations).transpose(0, 1, 4, 5, 2, 3)
    columns = _scratch("im2col", windows.shape, x.dtype)
    np.copyto(columns, windows)
    return columns


def _stride_phases(
    x: np.ndarray, strides: tuple[int, int], phases: set[tuple[int, int]], pool: str
) -> tuple[dict[tuple[int, int], np.ndarray], int]:
    """The stride phases x[..., a::sh, b::sw] of a (..., H, W) array, each contiguous (in
    `_scratch` buffers named after `pool`) and zero-padded to one shape (ceil(H / sh),
    ceil(W / sw)) and flattened to (..., rows · pitch), and that pitch. With unit strides the
    one phase is x itself (flattened in place when it can be)."""
    (sh, sw), (height, width) = strides, x.shape[-2:]
    if (sh, sw) == (1, 1):
        return {(0, 0): x.reshape(*x.shape[:-2], height * width)}, width
    rows, pitch = -(-height // sh), -(-width // sw)
    flat = {}
    for a, b in phases:
        part = x[..., a::sh, b::sw]
        phase = _scratch(f"{pool}/{a},{b}", (*x.shape[:-2], rows, pitch), x.dtype)
        phase[..., : part.shape[-2], : part.shape[-1]] = part
        phase[..., part.shape[-2] :, :] = 0
        phase[..., : part.shape[-2], part.shape[-1] :] = 0
        flat[a, b] = phase.reshape(*x.shape[:-2], rows * pitch)
    return flat, pitch


def _pitched(flat: np.ndarray, rows: int, pitch: int, width: int) -> np.ndarray:
    """The (..., rows, width) view of rows stored `pitch` elements apart along the last axis of
    `flat` (..., span), span = (rows - 1) * pitch + width: what the tap sums compute for every
    column of the pitch, without the columns between the rows."""
    strides = (*flat.strides[:-1], pitch * flat.itemsize, flat.strides[-1])
    return np.lib.stride_tricks.as_strided(flat, (*flat.shape[:-1], rows, width), strides)


SCALAR_TAP_OUTPUTS = 1 << 13
"""Outputs per channel and block from which a depthwise CONV with one output per channel sums
its taps in numpy, each the block's shifted slices times their channels' weights (two
broadcasting passes per tap that run at full speed on such long slices), instead of copying
tap columns for a matrix product (`_DepthwiseTaps.rows`)."""


class _DepthwiseTaps:
    """Grouped convolution with one input channel per group, as one small matrix product per
    channel: its weights (M/G, kh·kw) times its kh·kw tap columns.

    x is the padded (N, G, H, W) input, weight (G, M/G, kh, kw). Each channel's padded rows are
    flattened to one line: tap (i, j) of output (h, w) reads element (h + r) · pitch + w + c of
    one stride phase of the input (`_stride_phases`; r, c the tap's offset in it), so a tap's
    column for a run of output rows is one contiguous range of every channel, copied with one
    slice assignment for a block of channels. The products (per channel, depth kh·kw) then run
    in BLAS, where scaling every shifted slice by its per-channel weight in numpy took two
    broadcasting passes per tap (about three times as long). The sums are exact for the same
    reason as im2col's (`_exact_dtype`: every partial sum is bounded by the weight mass).
    Outputs are computed for every column of the pitch; `rows` keeps the valid `wo` (the
    others read the next row's start and are dropped).
    """

    def __init__(
        self,
        x: np.ndarray,
        weight: np.ndarray,
        strides: tuple[int, int],
        dilations: tuple[int, int],
        out_hw: tuple[int, int],
    ) -> None:
        (sh, sw), (dh, dw) = strides, dilations
        groups, group_out, kh, kw = weight.shape
        self.x = x
        self.weight = weight.reshape(groups, group_out, kh * kw)
        self.strides = strides
        self.out_hw = out_hw
        self.extent = (kh - 1) * dh + 1
        reads = [(i, j, (i * dh % sh, j * dw % sw)) for i in range(kh) for j in range(kw)]
        self.phases = {phase for _, _, phase in reads}
        self.pitch = -(-x.shape[3] // sw)
        self.reads = [(phase, i * dh // sh * self.pitch + j * dw // sw) for i, j, phase in reads]

    def rows(self, groups: slice, rows: range) -> np.ndarray:
        """The (N, len(groups), M/G, len(rows), wo) accumulators of a block of channels (a
        slice of the groups) and a run of output rows (a view of `padded`'s)."""
        return _pitched(self.padded(groups, rows), len(rows), self.pitch, self.out_hw[1])

    def padded(self, groups: slice, rows: range) -> np.ndarray:
        """The accumulators of a block of channels (a slice of the groups) and a run of output
        rows computed for every column of the pitch, as (N, len(groups), M/G, span): row r of
        the block is [r * pitch, r * pitch + wo), the columns between hold finite sums of
        products of the same bound (`rows` drops them). The stride phases are split from the
        input rows that block reads, while they are in cache."""
        wo, pitch, sh = self.out_hw[1], self.pitch, self.strides[0]
        window = self.x[:, groups, rows.start * sh : (rows.stop - 1) * sh + self.extent]
        lines, _ = _stride_phases(window, self.strides, self.phases, "depthwise-phase")
        weight = self.weight[groups]
        batch = self.x.shape[0]
        count, group_out, taps = weight.shape
        span = (len(rows) - 1) * pitch + wo
        shape = (batch, count, group_out, len(rows) * pitch)
        acc = _scratch("depthwise-acc", shape, weight.dtype)
        if group_out == 1 and span >= SCALAR_TAP_OUTPUTS:
            valid = acc[:, :, 0, :span]
            product = _scratch("depthwise-product", (batch, count, span), weight.dtype)
            for tap, (phase, start) in enumerate(self.reads):
                operand = lines[phase][:, :, start : start + span]
                scale = weight[None, :, 0, tap, None]
                np.multiply(operand, scale, out=product if tap else valid)
                if tap:
                    valid += product
            return acc[..., :span]
        cols = _scratch("depthwise-cols", (batch, count, taps, span), weight.dtype)
        for tap, (phase, start) in enumerate(self.reads):
            cols[:, :, tap] = lines[phase][:, :, start : start + span]
        np.matmul(weight, cols, out=acc[..., :span])
        return acc[..., :span]


CHANNEL_LAST_RATIO = 1
"""A single-image depthwise CONV computes channel-last (`depthwise_channel_last`) when its
output has more than this many channels per output position (a 14x14 or 7x7 map of a few
hundred channels): numpy's passes loop over the innermost axis of their operands at some
0.1-0.2 µs per run, and channel-first a run is one channel's part of a block (ho·wo
positions at most: 49 for a 7x7 map), channel-last one position's channels. (Dense CONVs
stay channel-first: computed channel-last, a 1x1 CONV of a 14x14 or 7x7 map measured 10-20%
slower, its transposed product and codes costing more than the short runs.)"""


DEPTHWISE_LAST_CHANNELS = 64
"""A single-image depthwise CONV (one output per channel) with at least this many channels
computes channel-last (`_ChannelLastTaps`) whatever its map size: its einsum loops over the
channels, and from some 64 of them on that takes less time per output than the channel-first
tap columns and products (measured, 3x3: 96 channels at stride 2, 144 at stride 1 or 2,
about half the time, input transposition included; 32 channels at 112x112: slower)."""


def depthwise_channel_last(geometry: ConvGeometry) -> bool:
    """Whether a CONV is depthwise with one output per channel and computes channel-last
    (`_ChannelLastTaps`, its output stage on (positions, channels) blocks whose codes are then
    transposed once into the destination): for one image, with `DEPTHWISE_LAST_CHANNELS`
    channels or more, or more than `CHANNEL_LAST_RATIO` channels per output position."""
    if geometry.channels != geometry.group or geometry.group_out != 1 or geometry.batch != 1:
        return False
    positions = geometry.out_hw[0] * geometry.out_hw[1]
    return (
        geometry.channels >= DEPTHWISE_LAST_CHANNELS
        or geometry.channels > CHANNEL_LAST_RATIO * positions
    )


class _ChannelLastTaps:
    """A depthwise CONV (one input channel and one output per group) of one image on a
    channel-last input, as one `np.einsum` over the view of its kernel windows (`_windows`):
    out[h, w, c] = sum_ij x[c, h·sh + i·dh, w·sw + j·dw] · weight[c, i, j], no window copied.
    einsum's loops run over the channels, contiguous in the input, the weights and the
    result, and multiply-add without a temporary (two numpy passes per tap otherwise).

    The sums are exact for the same reason as im2col's product (`_exact_dtype`: every partial
    sum, in any order and at float32 or higher precision, is an integer bounded by the weight
    mass times the largest centred code).
    """

    def __init__(self, windows: np.ndarray, weight: np.ndarray) -> None:
        """`windows`: the (C, Ho, Wo, kh, kw) kernel windows of the image, channel-last in
        memory; `weight`: (C, kh, kw)."""
        self.windows = windows
        self.weight = np.ascontiguousarray(weight.transpose(1, 2, 0)).transpose(2, 0, 1)

    def rows(self, channels: slice, rows: range) -> np.ndarray:
        """The (1, len(channels), len(rows), wo) accumulators of a block of channels and a run of
        output rows, laid out channel-last."""
        windows = self.windows[channels, rows.start : rows.stop]
        weight = self.weight[channels]
        shape = (len(rows), windows.shape[2], weight.shape[0])
        acc = _scratch("channel-last-acc", shape, weight.dtype)
        np.einsum("chwij,cij->hwc", windows, weight, out=acc)
        return acc.transpose(2, 0, 1)[None]


TAP_PRODUCT_CHANNELS = 16
"""Input channels from which a CONV with a spatial kernel may sum one matrix product per tap
(`_TapProducts`) instead of building im2col columns (each product then has depth >= 16)."""

TAP_PRODUCT_RATIO = 2
"""... and only if it has at most 1 / TAP_PRODUCT_RATIO as many output channels."""


def _sums_tap_products(
    batch: int, group: int, kernel: tuple[int, int], channels: int, out_channels: int
) -> bool:
    """Whether `_TapProducts` beats im2col: im2col copies kh·kw·C values per output position
    for M outputs, the tap products add kh·kw·M; with M <= C / 2 the copy dominates (measured:
    96 -> 24 channels 3x3 takes 0.6x the time; 32 -> 32, about 1.2x)."""
    spatial = kernel[0] * kernel[1] > 1
    wide = channels >= TAP_PRODUCT_CHANNELS and TAP_PRODUCT_RATIO * out_channels <= channels
    return batch == 1 and group == 1 and spatial and wide


class _TapProducts:
    """A CONV (one image, one group) as a sum over kernel taps of matrix products that read the
    padded input in place ("implicit GEMM").

    With the input flattened to (C, rows · pitch), output position (h, w) of tap (i, j) reads
    element (h + r) · pitch + w + c of a fixed phase of the input, so every tap's operand for
    a run of output rows is one contiguous column range, which BLAS reads without a copy. The
    result is computed for every column of the pitch (`rows` returns the valid `wo`); the
    extra columns read the next row's start and are dropped. For strides > 1 the input is
    split once into its stride phases (x[a::sh, b::sw], zero-padded to a common shape), in
    which every tap reads with unit stride. The sum is exact for the same reason as im2col's
    product: every partial sum is bounded by the weight mass (`_exact_dtype`).
    """

    def __init__(
        self,
        x: np.ndarray,
        taps: np.ndarray,
        strides: tuple[int, int],
        dilations: tuple[int, int],
        out_hw: tuple[int, int],
    ) -> None:
        (sh, sw), (dh, dw) = strides, dilations
        kh, kw = taps.shape[:2]
        self.taps = taps
        self.out_hw = out_hw
        self.reads = [(i, j, (i * dh % sh, j * dw % sw)) for i in range(kh) for j in range(kw)]
        phases = {phase for _, _, phase in self.reads}
        self.phases, self.pitch = _stride_phases(x[0], strides, phases, "tap-phase")
        self.offsets = [i * dh // sh * self.pitch + j * dw // sw for i, j, _ in self.reads]

    def rows(self, rows: range) -> np.ndarray:
        """The (1, M, len(rows), wo) accumulators of a run of output rows (a view of
        `padded`'s)."""
        return _pitched(self.padded(rows), len(rows), self.pitch, self.out_hw[1])

    def padded(self, rows: range) -> np.ndarray:
        """The (1, M, span) accumulators of a run of output rows computed for every column of
        the pitch: row r is [r * pitch, r * pitch + wo); the columns between hold finite sums
        of products of the same bound (`rows` drops them)."""
        wo = self.out_hw[1]
        span = (len(rows) - 1) * self.pitch + wo
        out_channels = self.taps.shape[2]
        acc = _scratch("tap-acc", (out_channels, len(rows) * self.pitch), self.taps.dtype)
        product = _scratch("tap-product", (out_channels, span), self.taps.dtype)
        for index, ((i, j, phase), offset) in enumerate(zip(self.reads, self.offsets, strict=True)):
            start = rows.start * self.pitch + offset
            operand = self.phases[phase][:, start : start + span]
            if index == 0:
                np.matmul(self.taps[i, j], operand, out=acc[:, :span])
            else:
                np.matmul(self.taps[i, j], operand, out=product)
                acc[:, :span] += product
        return acc[None, :, :span]


@dataclass(frozen=True)
class ConvGeometry:
    """A CONV's validated shapes: (N, C) input, M outputs in `group` groups, kernel, output."""

    batch: int
    channels: int
    out_channels: int
    group: int
    kernel: tuple[int, int]
    out_hw: tuple[int, int]

    @property
    def group_out(self) -> int:
        return self.out_channels // self.group

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.out_channels, *self.out_hw)


def conv_geometry(instruction: Conv) -> ConvGeometry:
    """The CONV's shapes, checked against each other (an `EmulatorError` says what is wrong)."""
    batch, channels, height, width = _rank4("the CONV input", instruction.input)
    out_channels, group_channels, kh, kw = _rank4("the CONV weight", instruction.weight)
    group = instruction.group
    if group < 1 or channels != group_channels * group or out_channels % group:
        raise EmulatorError(
            f"CONV: {channels} input channels, weight {instruction.weight.shape}, group {group}"
        )
    if min(instruction.strides) < 1 or min(instruction.dilations) < 1:
        raise EmulatorError("CONV strides and dilations must be positive")
    if min(instruction.pads) < 0:
        raise EmulatorError(f"negative padding {instruction.pads}")
    (sh, sw), (dh, dw) = instruction.strides, instruction.dilations
    top, left, bottom, right = instruction.pads
    ho = _output_size(height + top + bottom, kh, sh, dh)
    wo = _output_size(width + left + right, kw, sw, dw)
    _expect_shape("the CONV output", instruction.output.shape, (batch, out_channels, ho, wo))
    return ConvGeometry(batch, channels, out_channels, group, (kh, kw), (ho, wo))


def conv_weights(memory: MemoryPort, instruction: Conv) -> _Weights:
    """The CONV's weights, made once per program (`MemoryPort.read_cached`)."""
    return memory.read_cached(instruction.weight, "conv", lambda codes: _Weights(codes, (1, 2, 3)))


def conv_stage(memory: MemoryPort, instruction: Conv) -> _OutputStage:
    """The CONV's output stage: per-channel tables and bias along axis 1 of its output."""
    return _OutputStage.read(
        memory,
        instruction.requant,
        instruction.output.ndim,
        per_channel=True,
        bias=instruction.bias,
        channels=instruction.output.shape[1],
        target=instruction.output,
    )


def column_product(weight: np.ndarray, cols: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    """The (N, M, rows, wo) accumulators of (N, C, kh, kw, rows, wo) im2col columns and a
    (G, M/G, C/G·kh·kw) weight: one exact product per group. For one image it is computed into
    `out`, a (1, G, M/G, rows·wo) buffer of the weight's dtype."""
    batch, rows, wo = cols.shape[0], cols.shape[-2], cols.shape[-1]
    group, group_out, depth = weight.shape
    positions = rows * wo
    if batch == 1:
        np.matmul(weight, cols.reshape(1, group, depth, positions), out=out)
        return out.reshape(1, group * group_out, rows, wo)
    # The batch joins the columns: one product per group, not one per image (a transformer's
    # linear layers are 1x1 CONVs over a batch of tokens).
    cols = cols.reshape(batch, group, depth, positions).transpose(1, 2, 0, 3)
    acc = np.matmul(weight, cols.reshape(group, depth, batch * positions))
    acc = acc.reshape(group, group_out, batch, positions).transpose(2, 0, 1, 3)
    return acc.reshape(batch, group * group_out, rows, wo)


def execute_conv(instruction: Conv, memory: MemoryPort) -> None:
    """im2col (or per-tap) exact matrix products; a depthwise CONV multiplies each channel's
    weights by its tap columns (`_DepthwiseTaps`).

    The output is computed in blocks (`BLOCK_ELEMENTS`) that go through the output stage while
    they are in cache: runs of output rows for the matrix products (each one product per
    group on that part of the columns), runs of channels (or of one channel's rows) for the
    depthwise products.
    """
    geometry = conv_geometry(instruction)
    batch, out_channels, ho, wo = shape = geometry.shape
    channels, group, group_out = geometry.channels, geometry.group, geometry.group_out
    kh, kw = geometry.kernel
    group_channels = channels // group
    strides, dilations = instruction.strides, instruction.dilations
    sh, dh = strides[0], dilations[0]
    codes = memory.view(instruction.input)
    weights = conv_weights(memory, instruction)
    zero_point = instruction.input_zero_point
    largest = _largest_value(codes, zero_point, weights.mass)
    stage = conv_stage(memory, instruction)
    into = _direct_destination(memory, instruction, stage, shape)
    int8 = _compiled_int8(geometry, codes, zero_point, weights, largest)
    if int8 is None and into is not None and _compiled_depthwise(geometry, codes, largest):
        _depthwise_compiled(instruction, geometry, codes, weights, stage, into)
        return
    dtype = _exact_dtype(largest)
    compiled_columns = int8 is None and _compiled_columns(geometry, codes, dtype)
    depthwise_last = depthwise_channel_last(geometry)
    everything = slice(None)
    pads = instruction.pads
    if compiled_columns:
        # The kernel reads the codes block by block (not a centred copy made first), so codes
        # the destination overlaps are copied before any block is written.
        if into is not None:
            codes = _unaliased(codes, into, "conv-codes")
    elif int8 is None:
        x = _centred_as(codes, zero_point, dtype, pads, "conv-input", channel_last=depthwise_last)

    if int8 is not None:
        compiled = _int8_conv(instruction, geometry, codes, into, stage, *int8)
        if compiled.codes is not None and into is not None:
            _blockwise(shape, stage.out_dtype, compiled.codes, compiled.blocks, into=into)
            return
        blocks, accumulate, pitch = compiled.blocks, compiled.accumulate, compiled.pitch

    elif depthwise_last:
        last_taps = _ChannelLastTaps(
            _windows(x, (kh, kw), strides, dilations)[0],
            weights.astype(dtype).reshape(group, kh, kw),
        )
        step = _step(ho, out_channels * wo, out_channels * ho * wo)
        blocks = [
            (everything, everything, slice(r, r + step), everything) for r in range(0, ho, step)
        ]

        def accumulate(block: Block) -> np.ndarray:
            return last_taps.rows(everything, range(ho)[block[2]])

    elif group_channels == 1:
        taps = _DepthwiseTaps(
            x, weights.astype(dtype).reshape(group, group_out, kh, kw), strides, dilations, (ho, wo)
        )
        per_group = batch * group_out * ho * wo
        total = per_group * group
        if per_group > _block_elements(total):
            step = _step(ho, batch * group_out * wo, total)
            blocks = [
                (
                    everything,
                    slice(g * group_out, (g + 1) * group_out),
                    slice(r, r + step),
                    everything,
                )
                for g in range(group)
                for r in range(0, ho, step)
            ]
        else:
            step = _step(group, per_group, total)
            blocks = [
                (everything, slice(g * group_out, (g + step) * group_out), everything, everything)
                for g in range(0, group, step)
            ]

        pitch = taps.pitch

        def accumulate(block: Block) -> np.ndarray:
            outputs = range(out_channels)[block[1]]
            part = slice(outputs.start // group_out, outputs.stop // group_out)
            acc = taps.padded(part, range(ho)[block[2]])
            return acc.reshape(batch, len(outputs), acc.shape[-1])

    elif not compiled_columns and _sums_tap_products(
        batch, group, (kh, kw), channels, out_channels
    ):
        products = _TapProducts(x, weights.taps(dtype), strides, dilations, (ho, wo))
        step = _step(ho, out_channels * products.pitch, out_channels * ho * wo)
        blocks = [
            (everything, everything, slice(r, r + step), everything) for r in range(0, ho, step)
        ]

        pitch = products.pitch

        def accumulate(block: Block) -> np.ndarray:
            return products.padded(range(ho)[block[2]])

    else:
        depth = group_channels * kh * kw
        weight = weights.astype(dtype).reshape(group, group_out, depth)
        pitch = wo
        step = _step(ho, batch * out_channels * wo, batch * out_channels * ho * wo)
        blocks = [
            (everything, everything, slice(r, r + step), everything) for r in range(0, ho, step)
        ]

        def accumulate(block: Block) -> np.ndarray:
            rows = range(ho)[block[2]]
            if compiled_columns:  # from the codes, centred and padded on the way
                cols = _scratch("im2col", (batch, channels, kh, kw, len(rows), wo), dtype)
                native_kernels.im2col(
                    codes, zero_point, (kh, kw), pads, strides, dilations, rows.start, cols
                )
            else:
                window = x[:, :, rows.start * sh : (rows.stop - 1) * sh + (kh - 1) * dh + 1]
                cols = _im2col(window, (kh, kw), strides, dilations)
            out = None
            if batch == 1:
                out = _scratch("gemm", (1, group, group_out, len(rows) * wo), weight.dtype)
            return column_product(weight, cols, out)

    def compute(block: Block, out: np.ndarray, scratch: np.ndarray) -> None:
        acc = accumulate(block)
        if acc.ndim == 3:
            _pitched_stage(stage, acc, block, out, pitch)
        elif acc.strides[1] < acc.strides[-1]:
            codes = laid_out_like(acc, lambda dims: _scratch("channel-last-codes", dims, out.dtype))
            stage(acc, block, out=codes, scratch=scratch)
            np.copyto(out, codes)
        else:
            stage(acc, block, out=out, scratch=scratch)

    if into is not None:
        # Every block reads only the centred copy `x`, made before the first block runs, so
        # the codes go straight into the destination, even where it overlaps the input.
        _blockwise(shape, stage.out_dtype, compute, blocks, into=into)
        return
    if stage.blockwise(shape):
        result = _blockwise(
            shape, stage.out_dtype, compute, blocks, like=instruction.output, pool="conv-result"
        )
    else:
        acc = accumulate((everything,) * 4)
        if acc.ndim == 3:
            acc = _pitched(acc, ho, pitch, wo)
        result = stage(acc)
    memory.write(instruction.output, result)


def _direct_destination(
    memory: MemoryPort, instruction: Conv, stage: _OutputStage, shape: tuple[int, ...]
) -> np.ndarray | None:
    """The destination's place, when the stage's codes can go straight into it block by block
    (its tables broadcast to the result and its codes have the destination's dtype)."""
    if stage.blockwise(shape) and stage.out_dtype == instruction.output.dtype.numpy:
        return memory.target(instruction.output)
    return None


def _unaliased(codes: np.ndarray, into: np.ndarray, pool: str) -> np.ndarray:
    """`codes`, or a copy of them (in the `_scratch` buffer `pool`) where they may share memory
    with `into`: blocks that read the codes as they write `into` would otherwise read what
    earlier blocks wrote."""
    if not np.may_share_memory(codes, into):
        return codes
    copied = _scratch(pool, codes.shape, codes.dtype)
    np.copyto(copied, codes)
    return copied


DEPTHWISE_INT8_TAPS = 64
"""The most kernel taps of a depthwise CONV in the compiled int8 kernel (`depthwise_planes`)."""


def _compiled_int8(
    geometry: ConvGeometry,
    codes: np.ndarray,
    zero_point: int,
    weights: _Weights,
    largest: int,
) -> tuple[np.ndarray, np.ndarray] | None:
    """The packed weights and corrections of the compiled int8 CONV (`_Weights.int8_quads`)
    where it computes this CONV, else None: the CPU has VNNI, the CONV has several input
    channels per group or is depthwise with at most `DEPTHWISE_INT8_TAPS` taps, its codes are int8 or uint8 with the zero point among them, every
    weight fits a signed byte and every exact sum fits int32 (`_largest_value`: the kernel's
    int32 lanes wrap, so a sum that fits comes out exact)."""
    if native_kernels is None or not native_vnni:
        return None
    depthwise = geometry.channels == geometry.group == geometry.out_channels
    taps = geometry.kernel[0] * geometry.kernel[1]
    if geometry.channels <= geometry.group and not (depthwise and taps <= DEPTHWISE_INT8_TAPS):
        return None
    if codes.dtype not in (np.int8, np.uint8) or largest > INT32_MAX:
        return None
    code = zero_point + (128 if codes.dtype == np.int8 else 0)
    if not 0 <= code <= 255:
        return None
    return weights.int8_quads(geometry.group, code)


@dataclass(frozen=True)
class _PhasePlanes:
    """A CONV's codes as the compiled int8 kernels read them (mla_vnni.h): bytes that XORed
    with `flip` are u = code + 128 for int8 codes (the code itself for uint8), zero-padded
    with the zero point and split into the stride phases x[a::sh, b::sw] of each channel,
    (N, C, sh·sw, PHp, PWp); and for each kernel tap (i, j) its phase and the flat offset of
    its first element there, so that output (oh, ow) of that tap reads flat element
    oh·PWp + ow + offset of that phase: every tap reads its phase with unit stride.

    `planes` is the codes themselves (`source` is None) or a copy of them, which `refresh`
    makes from `source` (the codes' view, whose memory holds each run's codes)."""

    planes: np.ndarray
    shape: tuple[int, int, int, int, int]
    flip: int
    tap_phase: np.ndarray
    tap_offset: np.ndarray
    source: np.ndarray | None
    pads: tuple[int, int]
    strides: tuple[int, int]
    pad: int

    @classmethod
    def of(
        cls,
        codes: np.ndarray,
        instruction: Conv,
        into: np.ndarray | None,
        buffer: Callable[[int], np.ndarray],
    ) -> _PhasePlanes:
        """The planes of the CONV's codes: the codes themselves where a 1x1 unit-stride CONV
        without padding reads contiguous codes that the destination `into` does not overlap,
        else a copy in `buffer(size)` (a flat uint8 array), made now."""
        batch, channels, height, width = codes.shape
        (kh, kw), (sh, sw) = instruction.weight.shape[2:], instruction.strides
        dh, dw = instruction.dilations
        top, left, bottom, right = instruction.pads
        rows, pitch = -(-(height + top + bottom) // sh), -(-(width + left + right) // sw)
        taps = [(i * dh, j * dw) for i in range(kh) for j in range(kw)]
        tap_phase = np.array([(r % sh) * sw + c % sw for r, c in taps], np.int32)
        tap_offset = np.array([(r // sh) * pitch + c // sw for r, c in taps], np.int64)
        shape = (batch, channels, sh * sw, rows, pitch)
        flip = 128 if codes.dtype == np.int8 else 0
        pad = (instruction.input_zero_point + flip) ^ flip  # the zero point's stored byte
        in_place = (
            (kh, kw, sh, sw) == (1, 1, 1, 1)
            and not any(instruction.pads)
            and codes.flags.c_contiguous
            and (into is None or not np.may_share_memory(codes, into))
        )
        planes = codes.view(np.uint8).reshape(-1) if in_place else buffer(math.prod(shape))
        made = cls(
            planes,
            shape,
            flip,
            tap_phase,
            tap_offset,
            None if in_place else codes,
            (top, left),
            (sh, sw),
            pad,
        )
        made.refresh()
        return made

    @property
    def pitch(self) -> int:
        return self.shape[4]

    def refresh(self) -> None:
        """The copy made anew from the codes (`phase_planes`); nothing for planes in place."""
        if self.source is not None:
            native_kernels.phase_planes(
                self.source, self.pads, self.strides, 0, self.pad, self.shape[3:], self.planes
            )

    def operands(self) -> tuple[object, ...]:
        """The kernels' leading arguments."""
        return (self.planes, self.shape, self.flip, self.tap_phase, self.tap_offset)


def _scratch_planes(size: int) -> np.ndarray:
    return _scratch("int8-planes", (size,), np.uint8)


@dataclass(frozen=True)
class _Int8Conv:
    """A CONV in the compiled int8 kernels (`_compiled_int8`): its blocks, a function giving a
    block's accumulators (`_valid_span`) and their pitch, and, where the kernels also run its
    output stage (`_OutputStage.kernel_stage`), a `_blockwise` compute that writes a block's
    codes."""

    blocks: list[Block]
    accumulate: Callable[[Block], np.ndarray]
    pitch: int
    codes: Callable[[Block, np.ndarray, np.ndarray], None] | None
    refresh: Callable[[], None]
    """Makes the kernels' copy of the input anew (a planned step calls it on every run)."""


def _int8_conv(
    instruction: Conv,
    geometry: ConvGeometry,
    codes: np.ndarray,
    into: np.ndarray | None,
    stage: _OutputStage,
    quads: np.ndarray,
    corrections: np.ndarray,
    planes_buffer: Callable[[int], np.ndarray] = _scratch_planes,
) -> _Int8Conv:
    """`_Int8Conv` of the CONV: a depthwise CONV in blocks of channels (`depthwise_planes`),
    others in blocks of output rows (`conv_planes`), both over the codes' phase planes (made
    now, in `planes_buffer(size)` where they are a copy); a 1x1 CONV of a batch of small maps
    over the batch (`_int8_conv_over_images`)."""
    if _over_images(instruction, geometry):
        return _int8_conv_over_images(geometry, codes, stage, quads, corrections, planes_buffer)
    planes = _PhasePlanes.of(codes, instruction, into, planes_buffer)
    batch, out_channels, ho, wo = geometry.shape
    pitch, everything = planes.pitch, slice(None)
    operands = planes.operands()
    fused = stage.kernel_stage(out_channels)
    code_dtype = None if fused is None else stage.fused.code_dtype
    if geometry.channels == geometry.group == out_channels:
        weights, sums = quads.reshape(out_channels, -1), corrections.reshape(out_channels)
        step = _step(out_channels, batch * ho * wo, batch * out_channels * ho * wo)
        blocks = [
            (everything, slice(c, min(out_channels, c + step)), everything, everything)
            for c in range(0, out_channels, step)
        ]

        def run(block: Block, out: np.ndarray, *fused_stage: object) -> None:
            first = range(out_channels)[block[1]].start
            native_kernels.depthwise_planes(*operands, weights, sums, first, out, *fused_stage)

        def acc_shape(block: Block) -> tuple[int, ...]:
            return (batch, len(range(out_channels)[block[1]]), _span(ho, pitch, wo))

    else:
        step = _step(ho, batch * out_channels * pitch, batch * out_channels * ho * wo)
        blocks = [
            (everything, everything, slice(r, r + step), everything) for r in range(0, ho, step)
        ]
        group = geometry.group

        def run(block: Block, out: np.ndarray, *fused_stage: object) -> None:
            first = range(ho)[block[2]].start
            native_kernels.conv_planes(
                *operands, quads, corrections, group, first, out, *fused_stage
            )

        def acc_shape(block: Block) -> tuple[int, ...]:
            return (batch, out_channels, _span(len(range(ho)[block[2]]), pitch, wo))

    def accumulate(block: Block) -> np.ndarray:
        acc = _scratch("int8-acc", acc_shape(block), np.int32)
        run(block, acc)
        return _valid_span(acc, len(range(ho)[block[2]]), pitch, wo)

    def write_codes(block: Block, out: np.ndarray, scratch: np.ndarray) -> None:
        # The kernels write rows of codes where they are contiguous, else a copy is made.
        codes = out.view(code_dtype)
        if codes.shape[3] == 1 or codes.strides[3] == codes.itemsize:
            run(block, codes, fused)
            return
        staged = _scratch("int8-codes", out.shape, code_dtype)
        run(block, staged, fused)
        np.copyto(codes, staged)

    return _Int8Conv(
        blocks, accumulate, pitch, None if fused is None else write_codes, planes.refresh
    )


def _over_images(instruction: Conv, geometry: ConvGeometry) -> bool:
    """Whether a CONV runs over its batch (`_int8_conv_over_images`): a 1x1 unit-stride CONV
    without padding of several maps, each smaller than a panel of the kernels (a
    transformer's linear layer is one over a batch of tokens)."""
    batch, _, ho, wo = geometry.shape
    return (
        batch > 1
        and ho * wo < IMAGE_ROWS_BELOW
        and geometry.kernel == (1, 1)
        and instruction.strides == (1, 1)
        and not any(instruction.pads)
    )


IMAGE_ROWS_BELOW = 64
"""Positions per map below which a batch of 1x1 CONVs runs over the batch: the kernels take 64
output positions at a time, so per map they would fill a fraction of their lanes."""


def _int8_conv_over_images(
    geometry: ConvGeometry,
    codes: np.ndarray,
    stage: _OutputStage,
    quads: np.ndarray,
    corrections: np.ndarray,
    planes_buffer: Callable[[int], np.ndarray],
) -> _Int8Conv:
    """`_Int8Conv` of a 1x1 CONV over a batch of small maps (`_over_images`): the codes copied
    to one plane per channel whose rows are the images, (C, N, H·W), so that `conv_planes`
    takes the whole batch's positions together, in blocks of images; the results (acc, or
    codes) come out (M, images, H·W) and are seen, or copied, as (images, M, H, W). The copy is
    made before any block writes, so the destination may overlap the input."""
    batch, out_channels, ho, wo = geometry.shape
    channels, positions, everything = geometry.channels, ho * wo, slice(None)
    flip = 128 if codes.dtype == np.int8 else 0
    joined = planes_buffer(channels * batch * positions)
    stored = codes.view(np.uint8).reshape(batch, channels, positions)
    operands = (
        joined,
        (1, channels, 1, batch, positions),
        flip,
        np.zeros(1, np.int32),
        np.zeros(1, np.int64),
    )
    group = geometry.group
    step = _step(batch, out_channels * positions, batch * out_channels * positions)
    blocks = [
        (slice(n, min(batch, n + step)), everything, everything, everything)
        for n in range(0, batch, step)
    ]
    fused = stage.kernel_stage(out_channels)

    def refresh() -> None:
        np.copyto(joined.reshape(channels, batch, positions), stored.transpose(1, 0, 2))

    def as_images(result: np.ndarray, images: int) -> np.ndarray:
        return result.reshape(out_channels, images, ho, wo).transpose(1, 0, 2, 3)

    def accumulate(block: Block) -> np.ndarray:
        images = range(batch)[block[0]]
        acc = _scratch("int8-acc", (1, out_channels, len(images) * positions), np.int32)
        native_kernels.conv_planes(*operands, quads, corrections, group, images.start, acc)
        return as_images(acc, len(images))

    def write_codes(block: Block, out: np.ndarray, scratch: np.ndarray) -> None:
        images = range(batch)[block[0]]
        dtype = stage.fused.code_dtype
        staged = _scratch("int8-codes", (1, out_channels, len(images), positions), dtype)
        native_kernels.conv_planes(
            *operands, quads, corrections, group, images.start, staged, fused
        )
        np.copyto(out.view(dtype), as_images(staged, len(images)))

    refresh()
    return _Int8Conv(blocks, accumulate, wo, None if fused is None else write_codes, refresh)


def _span(rows: int, pitch: int, width: int) -> int:
    """Flat positions from the start of the first of `rows` rows `pitch` apart to the last
    row's `width`-th element."""
    return (rows - 1) * pitch + width


def _valid_span(acc: np.ndarray, rows: int, pitch: int, width: int) -> np.ndarray:
    """Accumulators of `rows` rows computed for every column of the pitch, (N, M, span): the
    (N, M, rows, width) result itself where the pitch is the width, else the span as it is,
    whose rows `_pitched_stage` takes `pitch` apart (the stage then runs over one contiguous
    run per channel)."""
    if pitch == width:
        return acc.reshape(*acc.shape[:2], rows, width)
    return acc


def _compiled_columns(geometry: ConvGeometry, codes: np.ndarray, dtype: type) -> bool:
    """Whether the compiled kernel builds the im2col columns of this CONV (the matrix products
    stay in BLAS): it is built, the CONV has several input channels per group, the codes are
    8- to 32-bit integers and the products run in float32 or float64."""
    return (
        native_kernels is not None
        and geometry.channels > geometry.group
        and codes.dtype.kind in "iu"
        and codes.dtype.itemsize <= 4
        and dtype in (np.float32, np.float64)
    )


def _compiled_depthwise(geometry: ConvGeometry, codes: np.ndarray, largest: int) -> bool:
    """Whether the compiled depthwise kernel computes this CONV: it is built, the CONV has one
    input channel and one output per group, the codes are 8- to 32-bit integers and every
    partial sum fits the kernel's int32 accumulators (`_largest_value`)."""
    return (
        native_kernels is not None
        and geometry.channels == geometry.group == geometry.out_channels
        and codes.dtype.kind in "iu"
        and codes.dtype.itemsize <= 4
        and largest <= INT32_MAX
    )


def _depthwise_compiled(
    instruction: Conv,
    geometry: ConvGeometry,
    codes: np.ndarray,
    weights: _Weights,
    stage: _OutputStage,
    into: np.ndarray,
) -> None:
    """A depthwise CONV in the compiled kernel (`compiler.native`), in blocks of channels whose
    int32 accumulators go through the output stage while they are in cache. The sums are the
    exact integers the numpy paths compute (`_compiled_depthwise` proves they fit int32)."""
    batch, channels, ho, wo = geometry.shape
    kh, kw = geometry.kernel
    weight = weights.astype(np.int32).reshape(channels, kh, kw)
    step = _step(channels, batch * ho * wo, batch * channels * ho * wo)
    blocks = [
        (_WHOLE, slice(c, min(channels, c + step)), _WHOLE, _WHOLE)
        for c in range(0, channels, step)
    ]
    pads, strides, dilations = instruction.pads, instruction.strides, instruction.dilations
    codes = _unaliased(codes, into, "depthwise-codes")

    def compute(block: Block, out: np.ndarray, scratch: np.ndarray) -> None:
        part = block[1]
        acc = _scratch("depthwise-int32", out.shape, np.int32)
        native_kernels.depthwise(
            codes[:, part],
            instruction.input_zero_point,
            weight[part],
            pads,
            strides,
            dilations,
            acc,
        )
        stage(acc, block, out=out, scratch=scratch)

    _blockwise(geometry.shape, stage.out_dtype, compute, blocks, into=into)


def _pitched_stage(
    stage: _OutputStage, acc: np.ndarray, block: Block, out: np.ndarray, pitch: int
) -> None:
    """out = stage(the (N, M, rows, wo) accumulators of a block), from the (N, M, span) tap sums
    of its rows `pitch` apart (`_pitched`): the stage runs over the whole contiguous span, into
    a buffer of codes whose rows are then copied out. On the (N, M, rows, wo) view itself each
    numpy pass would loop over runs of only wo elements (7 to 112), and numpy's per-run cost
    made the stage of a 14x14 depthwise CONV several times slower than on contiguous data. The
    extra columns are finite integers (`padded`), and the stage is elementwise, so the rows'
    codes are the same."""
    codes = _scratch("pitched-codes", acc.shape, out.dtype)
    work = _scratch("pitched-stage", (acc.size,), np.int64)
    stage(acc[:, :, None], block, out=codes[:, :, None], scratch=work)
    np.copyto(out, _pitched(codes, out.shape[2], pitch, out.shape[3]))


def execute_conv_transpose(instruction: ConvTranspose, memory: MemoryPort) -> None:
    """One exact matrix product gives every tap's x @ w[:, :, tap]; each is scattered onto the
    full output grid (tap·d + i·s), which is then cropped."""
    batch, channels, height, width = _rank4("the CONV_TRANSPOSE input", instruction.input)
    in_channels, group_out, kh, kw = _rank4("the CONV_TRANSPOSE weight", instruction.weight)
    group = instruction.group
    if group < 1 or in_channels != channels or channels % group:
        raise EmulatorError(
            f"CONV_TRANSPOSE: input {instruction.input.shape}, weight "
            f"{instruction.weight.shape}, group {group}"
        )
    (sh, sw), (dh, dw) = instruction.strides, instruction.dilations
    (ph, pw), (top, left, bottom, right) = instruction.output_padding, instruction.crop
    full_h = sh * (height - 1) + ph + (kh - 1) * dh + 1
    full_w = sw * (width - 1) + pw + (kw - 1) * dw + 1
    out_channels = group_out * group
    expected = (batch, out_channels, full_h - top - bottom, full_w - left - right)
    _expect_shape("the CONV_TRANSPOSE output", instruction.output.shape, expected)
    group_in = channels // group
    codes = memory.read(instruction.input)
    # An output position sums a subset of one output channel's (input channel, tap) products.
    weights = memory.read_cached(
        instruction.weight,
        f"conv_transpose/{group}",
        lambda codes: _Weights(codes.reshape(group, group_in, group_out, kh, kw), (1, 3, 4)),
    )
    dtype = _exact_dtype(_largest_value(codes, instruction.input_zero_point, weights.mass))
    x = _centred_as(codes, instruction.input_zero_point, dtype)
    x = x.reshape(batch, group, group_in, height * width)
    taps = weights.astype(dtype).reshape(group, group_in, group_out * kh * kw).transpose(0, 2, 1)
    contributions = np.matmul(taps, x).reshape(batch, group, group_out, kh, kw, height, width)
    full = np.zeros((batch, group, group_out, full_h, full_w), dtype=dtype)
    for i in range(kh):
        for j in range(kw):
            rows = slice(i * dh, i * dh + sh * (height - 1) + 1, sh)
            cols = slice(j * dw, j * dw + sw * (width - 1) + 1, sw)
            full[:, :, :, rows, cols] += contributions[:, :, :, i, j]
    full = full.reshape(batch, out_channels, full_h, full_w)
    result = output_stage(
        memory,
        full[:, :, top : full_h - bottom, left : full_w - right],
        instruction.requant,
        per_channel=True,
        bias=instruction.bias,
        target=instruction.output,
    )
    memory.write(instruction.output, result)


def execute_matmul(instruction: MatMul, memory: MemoryPort) -> None:
    """(a - za) @ (b - zb) as one exact matrix product (see `_exact_dtype`)."""
    a_codes = memory.read(instruction.a)
    b_shape, b_zero_point = instruction.b.shape, instruction.b_zero_point
    depth_axis = -2 if len(b_shape) > 1 else 0
    if a_codes.ndim < 1 or not b_shape or a_codes.shape[-1] != b_shape[depth_axis]:
        raise EmulatorError(f"MATMUL of {a_codes.shape} and {b_shape}")
    weights = memory.read_cached(
        instruction.b,
        f"matmul/{b_zero_point}",
        lambda codes: _Weights(codes.astype(np.int64) - b_zero_point, (depth_axis,)),
    )
    dtype = _exact_dtype(_largest_value(a_codes, instruction.a_zero_point, weights.mass))
    a = _centred_as(a_codes, instruction.a_zero_point, dtype)
    try:
        acc = np.matmul(a, weights.astype(dtype)).astype(np.int64)
    except ValueError as error:
        raise EmulatorError(f"MATMUL of {a.shape} and {b_shape}: {error}") from error
    if instruction.bias is not None:
        acc = acc + _int64(memory, instruction.bias)
    _expect_shape("the MATMUL output", instruction.output.shape, acc.shape)
    memory.write(instruction.output, output_stage(memory, acc, instruction.requant))


def _divide(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    """round_half_up(numerator / denominator); x / 0 saturates towards the sign of x."""
    sign = np.where(denominator < 0, -1, 1)
    magnitude = np.maximum(np.abs(denominator), 1)
    quotient = sign * divide_round_half_up(numerator * sign, magnitude)
    return np.where(denominator == 0, np.sign(numerator) * INT32_MAX, quotient)


_COMMON_SCALE: dict[EltwiseOp, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    EltwiseOp.ADD: np.add,
    EltwiseOp.SUB: np.subtract,
    EltwiseOp.MAX: np.maximum,
    EltwiseOp.MIN: np.minimum,
}
"""The ELTWISE ops that combine both operands at their common scale (`rescale_operand`)."""


def eltwise_acc(instruction: Eltwise, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The accumulator of ELTWISE from centred int64 operands of the same shape."""
    op, mode, shift = instruction.op, instruction.requant.mode, instruction.left_shift
    if op in _COMMON_SCALE:
        scaled_a = rescale_operand(a, shift, instruction.a_multiplier, instruction.a_shift, mode)
        scaled_b = rescale_operand(b, shift, instruction.b_multiplier, instruction.b_shift, mode)
        return _COMMON_SCALE[op](scaled_a, scaled_b)
    if op == EltwiseOp.MUL:
        return a * b
    return _divide(a << shift, b)


def eltwise_function(
    instruction: Eltwise, stage: _OutputStage
) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    """The ELTWISE as a function of int64 codes (a, b), its stage included (for tables)."""

    def function(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        centred = (a - instruction.a_zero_point, b - instruction.b_zero_point)
        return stage(eltwise_acc(instruction, *centred))

    return function


def eltwise_key(instruction: Eltwise, stage: _OutputStage) -> tuple[object, ...]:
    """Values that determine `eltwise_function` of a `uniform` stage completely."""
    return (
        "eltwise",
        instruction.op,
        instruction.a_zero_point,
        instruction.b_zero_point,
        instruction.left_shift,
        instruction.a_multiplier,
        instruction.a_shift,
        instruction.b_multiplier,
        instruction.b_shift,
        *stage.key(),
    )


def execute_eltwise(instruction: Eltwise, memory: MemoryPort) -> None:
    """Elementwise: looked up in a table of all code pairs (`_tabulated`) for 8-bit operands
    with a per-tensor stage, else computed blockwise (`_blockwise`)."""
    a_codes = memory.view(instruction.a)
    b_codes = memory.view(instruction.b)
    try:
        a_codes, b_codes = np.broadcast_arrays(a_codes, b_codes)
    except ValueError as error:
        raise EmulatorError(
            f"ELTWISE operands {a_codes.shape} and {b_codes.shape} do not broadcast"
        ) from error
    shape = a_codes.shape
    _expect_shape("the ELTWISE output", instruction.output.shape, shape)
    stage = _OutputStage.read(memory, instruction.requant, len(shape), target=instruction.output)

    def compute(
        block: Block | None, out: np.ndarray | None = None, scratch: np.ndarray | None = None
    ) -> np.ndarray:
        where = Ellipsis if block is None else block
        a = a_codes[where].astype(np.int64) - instruction.a_zero_point
        b = b_codes[where].astype(np.int64) - instruction.b_zero_point
        return stage(eltwise_acc(instruction, a, b), block, out=out, scratch=scratch)

    if stage.uniform(len(shape)):
        function, key = eltwise_function(instruction, stage), eltwise_key(instruction, stage)
        if _tabulated_eltwise(
            memory, instruction, function, stage.out_dtype, a_codes, b_codes, key
        ):
            return
    if stage.blockwise(shape):
        result = _blockwise(shape, stage.out_dtype, compute, like=instruction.output)
    else:
        result = compute(None)
    memory.write(instruction.output, result)


def _single_code(codes: np.ndarray) -> int | None:
    """The one code a broadcast operand holds everywhere (all its strides zero), else None."""
    if codes.size and all(
        s == 0 or n == 1 for s, n in zip(codes.strides, codes.shape, strict=True)
    ):
        return int(codes[(0,) * codes.ndim])
    return None


def _tabulated_eltwise(
    memory: MemoryPort,
    instruction: Eltwise,
    function: Callable[[np.ndarray, np.ndarray], np.ndarray],
    dtype: np.dtype,
    a_codes: np.ndarray,
    b_codes: np.ndarray,
    key: Hashable,
) -> bool:
    """`_tabulated` for ELTWISE; an operand that holds one code (a broadcast constant: x + 3,
    x / 6 of a hard swish) makes it a function of the other operand alone, with a table of 256
    entries instead of 65536 and a one-code gather (no index to build, no broadcast copy)."""
    a_single, b_single = _single_code(a_codes), _single_code(b_codes)
    target = instruction.output
    if b_single is not None:
        b_value = np.int64(b_single)

        def unary(a: np.ndarray) -> np.ndarray:
            return function(a, b_value)

        b_key = (key, "b", b_codes.dtype.str, b_single)
        return _tabulated(memory, target, unary, dtype, a_codes, key=b_key)
    if a_single is not None:
        a_value = np.int64(a_single)

        def unary_b(b: np.ndarray) -> np.ndarray:
            return function(a_value, b)

        a_key = (key, "a", a_codes.dtype.str, a_single)
        return _tabulated(memory, target, unary_b, dtype, b_codes, key=a_key)
    return _tabulated(memory, target, function, dtype, a_codes, b_codes, key=key)


def lut_tables(instruction: Lut) -> int:
    """How many tables a LUT holds: one for every code, or (8-bit inputs) one 256-entry table
    per channel (axis 1); an `EmulatorError` if it fits neither."""
    _expect_shape("the LUT output", instruction.output.shape, instruction.input.shape)
    low, high = _dtype_range(instruction.input.dtype.numpy)
    entries = high - low + 1
    shape = instruction.input.shape
    channels = shape[1] if len(shape) > 1 and instruction.input.itemsize == 1 else 1
    if instruction.table.size not in (entries, entries * channels) or (
        instruction.input.itemsize > 2
    ):
        raise EmulatorError(
            f"a {instruction.input.dtype.name} LUT needs {entries} entries"
            f"{f' (or {entries} per channel, {entries * channels})' if channels > 1 else ''}, "
            f"not {instruction.table.size}"
        )
    return 1 if instruction.table.size == entries else channels


def lut_function(
    memory: MemoryPort, instruction: Lut
) -> tuple[Callable[[np.ndarray], np.ndarray], np.dtype, Hashable]:
    """A one-table LUT as (function of int64 codes, its values' dtype, the key of its table)."""
    dtype = instruction.input.dtype.numpy
    table = memory.read(instruction.table).reshape(-1)
    key = ("lut", table.tobytes(), table.dtype.str, np.dtype(dtype).str)
    return functools.partial(apply_lut, table, input_dtype=dtype), table.dtype, key


def execute_lut(instruction: Lut, memory: MemoryPort) -> None:
    """One table for every code, or (8-bit inputs) one 256-entry table per channel (axis 1)."""
    tables = lut_tables(instruction)
    x = memory.view(instruction.input)
    dtype = instruction.input.dtype.numpy
    if tables > 1:
        table = memory.read(instruction.table).reshape(tables, -1)
        memory.write(instruction.output, apply_lut(table, x, dtype, axis=1))
        return
    function, table_dtype, key = lut_function(memory, instruction)
    if not _tabulated(memory, instruction.output, function, table_dtype, x, key=key):
        memory.write(instruction.output, function(x))


def _windows(
    x: np.ndarray,
    kernel: tuple[int, int],
    strides: tuple[int, int],
    dilations: tuple[int, int],
) -> np.ndarray:
    """(N, C, Ho, Wo, kh, kw) view of every pooling window of a padded (N, C, H, W) array."""
    (kh, kw), (sh, sw), (dh, dw) = kernel, strides, dilations
    ho = _output_size(x.shape[2], kh, sh, dh)
    wo = _output_size(x.shape[3], kw, sw, dw)
    extent = ((kh - 1) * dh + 1, (kw - 1) * dw + 1)
    view = np.lib.stride_tricks.sliding_window_view(x, extent, axis=(2, 3))
    return view[:, :, : (ho - 1) * sh + 1 : sh, : (wo - 1) * sw + 1 : sw, ::dh, ::dw]


def _window_max(
    x: np.ndarray,
    kernel: tuple[int, int],
    strides: tuple[int, int],
    dilations: tuple[int, int],
) -> np.ndarray:
    """Max over every pooling window of a padded (N, C, H, W) array: a running maximum of one
    shifted slice per tap (numpy reduces a strided window view far more slowly)."""
    (kh, kw), (sh, sw), (dh, dw) = kernel, strides, dilations
    ho = _output_size(x.shape[2], kh, sh, dh)
    wo = _output_size(x.shape[3], kw, sw, dw)
    result = np.empty((*x.shape[:2], ho, wo), dtype=x.dtype)
    for i in range(kh):
        for j in range(kw):
            tap = x[
                :,
                :,
                i * dh : i * dh + sh * (ho - 1) + 1 : sh,
                j * dw : j * dw + sw * (wo - 1) + 1 : sw,
            ]
            if i == j == 0:
                result[...] = tap
            else:
                np.maximum(result, tap, out=result)
    return result


def execute_pool(instruction: Pool, memory: MemoryPort) -> None:
    _rank4("the POOL input", instruction.input)
    if min(instruction.kernel) < 1 or min(instruction.strides) < 1:
        raise EmulatorError("POOL kernel and strides must be positive")
    geometry = (instruction.kernel, instruction.strides, instruction.dilations)
    if instruction.op == PoolOp.MAX:
        x = memory.read(instruction.input)
        low, high = _dtype_range(x.dtype)
        if not low <= instruction.pad_value <= high:
            x = x.astype(np.int64)
        pooled = _window_max(_pad_hw(x, instruction.pads, instruction.pad_value), *geometry)
        _expect_shape("the POOL output", instruction.output.shape, pooled.shape)
        memory.write(instruction.output, _rescaled(memory, instruction, pooled, "a MAX POOL"))
        return
    if instruction.requant is None:
        raise EmulatorError("an average POOL needs its output stage")
    x = _centred(memory, instruction.input, instruction.input_zero_point)
    view = _windows(_pad_hw(x, instruction.pads, 0), *geometry)
    _expect_shape("the POOL output", instruction.output.shape, view.shape[:4])
    total = view.sum(axis=(4, 5))
    tables = (instruction.count_multipliers, instruction.count_shifts)
    if tables == (None, None):
        result = output_stage(memory, total, instruction.requant)
    elif None in tables:
        raise EmulatorError("POOL needs both count_multipliers and count_shifts, or neither")
    else:
        inside = np.ones((1, 1, *instruction.input.shape[2:]), dtype=np.int64)
        count = _windows(_pad_hw(inside, instruction.pads, 0), *geometry).sum(axis=(4, 5))
        multipliers = memory.read(tables[0]).astype(np.int64).reshape(-1)
        shifts = memory.read(tables[1]).astype(np.int64).reshape(-1)
        if count.max() >= min(multipliers.size, shifts.size):
            raise EmulatorError(f"POOL count tables stop before count {int(count.max())}")
        stage = instruction.requant
        result = requantize_clamp(
            total,
            multipliers[count],
            shifts[count],
            stage.mode,
            stage.zero_point,
            stage.low,
            stage.high,
        )
    memory.write(instruction.output, result)


def execute_reduce(instruction: Reduce, memory: MemoryPort) -> None:
    ndim = instruction.input.ndim
    if instruction.axes <= 0 or instruction.axes >> ndim:
        raise EmulatorError(f"REDUCE axes mask {instruction.axes:#b} for a rank-{ndim} input")
    axes = tuple(a for a in range(ndim) if instruction.axes >> a & 1)
    if instruction.op in (ReduceOp.ARGMAX, ReduceOp.ARGMAX_LAST):
        _execute_argmax(instruction, memory, axes)
        return
    if instruction.op == ReduceOp.SUM:
        if instruction.requant is None:
            raise EmulatorError("a summing REDUCE needs its output stage")
        total = _centred(memory, instruction.input, instruction.input_zero_point).sum(
            axis=axes, keepdims=True
        )
        result = output_stage(memory, total, instruction.requant)
    else:
        x = memory.read(instruction.input).astype(np.int64)
        reduce = np.max if instruction.op == ReduceOp.MAX else np.min
        result = reduce(x, axis=axes, keepdims=True)
        if instruction.requant is not None:
            result = output_stage(
                memory, result - instruction.input_zero_point, instruction.requant
            )
        else:
            _same_dtype("a MAX/MIN REDUCE", instruction.input, instruction.output)
    if result.size != instruction.output.size:
        raise EmulatorError(
            f"REDUCE gives {result.shape}; the output {instruction.output.shape} differs in size"
        )
    memory.write(instruction.output, result.reshape(instruction.output.shape))


def _execute_argmax(instruction: Reduce, memory: MemoryPort, axes: tuple[int, ...]) -> None:
    """REDUCE ARGMAX / ARGMAX_LAST: one axis, raw codes, int32 or int64 indices, no stage."""
    if len(axes) != 1:
        raise EmulatorError(f"an ARGMAX REDUCE takes one axis, not {len(axes)}")
    if instruction.requant is not None:
        raise EmulatorError("an ARGMAX REDUCE has no output stage")
    if instruction.output.dtype.numpy not in (np.dtype(np.int32), np.dtype(np.int64)):
        raise EmulatorError(f"ARGMAX writes int32 or int64, not {instruction.output.dtype.name}")
    select_last = instruction.op == ReduceOp.ARGMAX_LAST
    result = argmax_codes(memory.read(instruction.input), axes[0], select_last=select_last)
    if result.size != instruction.output.size:
        raise EmulatorError(
            f"REDUCE gives {result.shape}; the output {instruction.output.shape} differs in size"
        )
    memory.write(instruction.output, result.reshape(instruction.output.shape))


def resize_passes(memory: MemoryPort, instruction: Resize) -> list[tuple[int, np.ndarray]]:
    """The RESIZE's gathers, in order: (axis, its int64 table: a row of indices, or for LINEAR
    rows x0, x1, w0, w1), each checked against the input's shape as the passes before it left
    it."""
    linear = instruction.mode == ResizeMode.LINEAR
    shape = list(instruction.input.shape)
    passes = []
    for axis, table in (
        (instruction.axis0, instruction.table0),
        (instruction.axis1, instruction.table1),
    ):
        if axis < 0:
            continue
        if table is None or not 0 <= axis < len(shape):
            raise EmulatorError(f"RESIZE axis {axis} without a valid index table")
        rows = memory.read(table).astype(np.int64)
        if rows.ndim != 2 or rows.shape[0] != (4 if linear else 1):
            raise EmulatorError(f"RESIZE table of shape {rows.shape}")
        indices = rows[:2] if linear else rows[:1]
        if indices.min(initial=0) < 0 or indices.max(initial=0) >= shape[axis]:
            raise EmulatorError(f"RESIZE index table points outside axis {axis}")
        if linear and np.any(rows[2] + rows[3] != WEIGHT_ONE):
            raise EmulatorError("RESIZE linear weights must sum to 1.0 in Q10")
        shape[axis] = rows.shape[1]
        passes.append((axis, rows))
    return passes


def execute_resize(instruction: Resize, memory: MemoryPort) -> None:
    """NEAREST gathers the stored codes as they are; LINEAR interpolates centred int64 codes."""
    x = memory.read(instruction.input)
    linear = instruction.mode == ResizeMode.LINEAR
    if linear:
        x = x.astype(np.int64) - instruction.input_zero_point
    for axis, rows in resize_passes(memory, instruction):
        if linear:
            x0, x1, w0, w1 = rows
            shape = [1] * x.ndim
            shape[axis] = rows.shape[1]
            x = np.take(x, x0, axis=axis) * w0.reshape(shape) + np.take(
                x, x1, axis=axis
            ) * w1.reshape(shape)
        else:
            x = np.take(x, rows[0], axis=axis)
    _expect_shape("the RESIZE output", instruction.output.shape, x.shape)
    if linear:
        if instruction.requant is None:
            raise EmulatorError("a linear RESIZE needs its output stage")
        x = output_stage(memory, x, instruction.requant)
    else:
        x = _rescaled(memory, instruction, x, "a NEAREST RESIZE")
    memory.write(instruction.output, x)


def execute_softmax(instruction: Softmax, memory: MemoryPort) -> None:
    _expect_shape("the SOFTMAX output", instruction.output.shape, instruction.input.shape)
    bits = instruction.input.itemsize * 8
    if bits > 16 or instruction.table.size != 1 << bits:
        raise EmulatorError(f"SOFTMAX on {bits}-bit data needs a {1 << bits}-entry exp table")
    table = memory.read(instruction.table).astype(np.int64).reshape(-1)
    axis = instruction.axis % instruction.input.ndim
    q = np.moveaxis(memory.read(instruction.input).astype(np.int64), axis, -1)
    e = table[q - q.max(axis=-1, keepdims=True) + table.size - 1]
    total = e.sum(axis=-1, keepdims=True)
    reciprocal = divide_round_half_up(1 << RECIPROCAL_BITS, total)
    probability = rounding_right_shift(e * reciprocal, RECIPROCAL_BITS - PROBABILITY_BITS)
    result = output_stage(memory, probability, instruction.requant)
    memory.write(instruction.output, np.moveaxis(result, -1, axis))


def execute_layernorm(instruction: LayerNorm, memory: MemoryPort) -> None:
    """Normalise over the axes from `axis` on (`compiler.intmath.normalise`), then the
    per-element or per-channel tables, which broadcast against the input."""
    shape = instruction.input.shape
    _expect_shape("the LAYERNORM output", instruction.output.shape, shape)
    axes = tuple(range(instruction.axis % len(shape), len(shape)))
    params = {}
    for name in ("signs", "multipliers", "shifts", "offsets"):
        tensor = getattr(instruction, name)
        if _broadcast_shape(tensor.shape, shape) != shape:
            raise EmulatorError(f"LAYERNORM {name} {tensor.shape} do not broadcast to {shape}")
        params[name] = memory.read(tensor).astype(np.int64)
    if instruction.epsilon_term < 1:
        raise EmulatorError("LAYERNORM epsilon_term must be at least 1")
    x = _centred(memory, instruction.input, instruction.input_zero_point)
    normalised = normalise(x, axes, instruction.epsilon_term)
    fine = requantize(
        params["signs"] * normalised,
        params["multipliers"],
        params["shifts"],
        instruction.requant.mode,
    )
    result = output_stage(memory, fine + params["offsets"], instruction.requant)
    memory.write(instruction.output, result)


def execute_lrn(instruction: Lrn, memory: MemoryPort) -> None:
    """LRN across axis 1: `compiler.intmath.lrn_accumulator`, then the output stage."""
    shape = instruction.input.shape
    _expect_shape("the LRN output", instruction.output.shape, shape)
    if len(shape) < 2 or instruction.size < 1 or instruction.index_shift < 0:
        raise EmulatorError(
            f"LRN of a rank-{len(shape)} input with size {instruction.size} and index shift "
            f"{instruction.index_shift}: it needs rank >= 2, size >= 1 and a shift >= 0"
        )
    if instruction.input.itemsize > 1 or instruction.table.size < 1:
        raise EmulatorError("LRN takes 8-bit data and a non-empty factor table")
    table = memory.read(instruction.table).astype(np.int64).reshape(-1)
    x = _centred(memory, instruction.input, instruction.input_zero_point)
    acc = lrn_accumulator(x, instruction.size, instruction.index_shift, table)
    memory.write(instruction.output, output_stage(memory, acc, instruction.requant))


def execute_norm_fp16(instruction: NormFp16, memory: MemoryPort) -> None:
    """LayerNormalization / RMSNormalization in fp16 over the axes from `axis` on
    (`compiler.intmath.fp16_normalisation`); gamma and beta are fp16 CONST tables."""
    shape = instruction.input.shape
    _expect_shape("the NORM_FP16 output", instruction.output.shape, shape)
    if not 0 <= instruction.axis < len(shape):
        raise EmulatorError(f"NORM_FP16 axis {instruction.axis} of a rank-{len(shape)} input")
    if instruction.input.itemsize != 1 or instruction.output.dtype.numpy.kind not in "iu":
        raise EmulatorError("NORM_FP16 reads 8-bit codes and writes integer codes")
    normalised = shape[instruction.axis :]
    centre = instruction.op == NormOp.LAYER
    if centre != (instruction.beta is not None):
        raise EmulatorError("NORM_FP16 LAYER takes a beta table, RMS none")
    tables = {}
    for name in ("gamma", "beta"):
        tensor = getattr(instruction, name)
        if tensor is None:
            continue
        if tensor.dtype.numpy != np.float16:
            raise EmulatorError(f"NORM_FP16 {name} must be FLOAT16, not {tensor.dtype.name}")
        if _broadcast_shape(tensor.shape, normalised) != normalised:
            raise EmulatorError(f"NORM_FP16 {name} {tensor.shape} do not broadcast to {normalised}")
        tables[name] = memory.read(tensor)
    result = fp16_normalisation(
        memory.read(instruction.input),
        instruction.axis,
        input_zero_point=instruction.input_zero_point,
        input_scale=float32_value(instruction.input_scale),
        gamma=tables["gamma"],
        beta=tables.get("beta"),
        epsilon=float16_value(instruction.epsilon),
        centre=centre,
        output_scale=float32_value(instruction.output_scale),
        output_zero_point=instruction.output_zero_point,
        low=instruction.low,
        high=instruction.high,
        dtype=np.int64,
    )
    memory.write(instruction.output, result)


_SAMPLE_MODES = {SampleMode.NEAREST: "nearest", SampleMode.BILINEAR: "bilinear"}
_SAMPLE_PADDINGS = {
    SamplePadding.ZEROS: "zeros",
    SamplePadding.BORDER: "border",
    SamplePadding.REFLECTION: "reflection",
}


def execute_grid_sample_bf16(instruction: GridSampleBf16, memory: MemoryPort) -> None:
    """GridSample on the bf16 sampling unit (`compiler.intmath.bf16_grid_sample`): image
    (N, C, H, W) and grid (N, Ho, Wo, 2) codes in, (N, C, Ho, Wo) codes out."""
    image, grid = instruction.input.shape, instruction.grid.shape
    if len(image) != 4 or len(grid) != 4 or grid[3] != 2 or grid[0] != image[0]:
        raise EmulatorError(f"GRID_SAMPLE_BF16 of a {image} image at a {grid} grid")
    _expect_shape("the GRID_SAMPLE_BF16 output", instruction.output.shape, (*image[:2], *grid[1:3]))
    for name in ("input", "grid"):
        if getattr(instruction, name).itemsize > 2:
            raise EmulatorError(f"GRID_SAMPLE_BF16 reads 8- or 16-bit {name} codes")
    if instruction.output.dtype.numpy.kind not in "iu" or instruction.align_corners not in (0, 1):
        raise EmulatorError("GRID_SAMPLE_BF16 writes integer codes; align_corners is 0 or 1")
    result = bf16_grid_sample(
        memory.read(instruction.input),
        memory.read(instruction.grid),
        mode=_SAMPLE_MODES[instruction.mode],
        padding=_SAMPLE_PADDINGS[instruction.padding],
        align_corners=bool(instruction.align_corners),
        input_zero_point=instruction.input_zero_point,
        input_scale=float32_value(instruction.input_scale),
        grid_zero_point=instruction.grid_zero_point,
        grid_scale=float32_value(instruction.grid_scale),
        output_scale=float32_value(instruction.output_scale),
        output_zero_point=instruction.output_zero_point,
        low=instruction.low,
        high=instruction.high,
        dtype=np.int64,
    )
    memory.write(instruction.output, result)


def _broadcast_shape(*shapes: tuple[int, ...]) -> tuple[int, ...] | None:
    """numpy's broadcast of `shapes`, or None where they do not broadcast."""
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError:
        return None


EXECUTORS: dict[type[Instruction], Callable[..., None]] = {
    Load: execute_load,
    Store: execute_store,
    Move: execute_move,
    Fill: execute_fill,
    Conv: execute_conv,
    ConvTranspose: execute_conv_transpose,
    MatMul: execute_matmul,
    Eltwise: execute_eltwise,
    Lut: execute_lut,
    Pool: execute_pool,
    Reduce: execute_reduce,
    Resize: execute_resize,
    Softmax: execute_softmax,
    LayerNorm: execute_layernorm,
    Lrn: execute_lrn,
    NormFp16: execute_norm_fp16,
    GridSampleBf16: execute_grid_sample_bf16,
}
"""Instruction type -> function(instruction, memory) that executes it."""
