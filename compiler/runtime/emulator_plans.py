"""Small instructions planned once per memory image, so that a run only does their arithmetic.

`Emulator.run` executes a program as one step per instruction, made the first time an image
runs it (`plan_program`). For a small instruction (a result below `SMALL_ELEMENTS`), what
does not depend on the data is done while planning: its shapes are checked, its CONST tables
read and derived (weights, output stages), numpy views bound to its operands at their planned
addresses in the image, and its work buffers allocated. A run of the step then reads its
operands through those views, computes with the same `compiler.intmath` calls on the same
values as the executor in `emulator_ops` (as one block), and writes its result straight into
the destination's place in the image. On a tiny model that bookkeeping, not the arithmetic,
was most of an instruction's time (a 16 -> 10 channel 1x1 CONV on one pixel took ~170 µs).

Everything else is a step that calls its executor: large instructions (whose blockwise,
cache-sized, optionally threaded execution pays), instructions whose tables are not CONST
(another instruction may write them), and any instruction whose operands are wrong (planning
stops at the first `EmulatorError`; the executor raises it when the instruction runs, in
program order).

Traffic: a planned step does not go through `Memory.read` / `write`, so its bytes are counted
once, from its operands (`Instruction.inputs` / `outputs`, each once), which is what an
executor counts.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from compiler.intmath import dtype_range
from compiler.isa import (
    Conv,
    Eltwise,
    Instruction,
    Load,
    Lut,
    MatMul,
    Move,
    Pool,
    PoolOp,
    Reduce,
    ReduceOp,
    Resize,
    ResizeMode,
    Space,
    Store,
    Tensor,
)
from compiler.runtime import emulator_ops
from compiler.runtime.emulator_ops import (
    EXECUTORS,
    PARALLEL_ELEMENTS,
    ConvGeometry,
    EmulatorError,
    MemoryPort,
    _ChannelLastTaps,
    _compiled_int8,
    _DepthwiseTaps,
    _exact_dtype,
    _in_place,
    _int8_conv,
    _largest_value,
    _OutputStage,
    _rank4,
    _single_code,
    _sums_tap_products,
    _TapProducts,
    _Weights,
    _window_max,
    _windows,
    check_copy,
    column_product,
    conv_geometry,
    conv_stage,
    conv_weights,
    depthwise_channel_last,
    eltwise_acc,
    eltwise_function,
    eltwise_key,
    function_table,
    lut_function,
    lut_tables,
    move_stage,
    resize_passes,
    table_pays,
)
from compiler.runtime.parallel import for_each

PLANNED = True
"""Whether `plan_program` plans small instructions (False: every step is its executor; for
tests that compare the two)."""

SMALL_ELEMENTS = PARALLEL_ELEMENTS
"""Results of fewer elements are planned. Below it the executors compute one block anyway, on
any number of threads, so a planned step does the same arithmetic in the same order."""

COPY_BYTES = 1 << 18
"""Copies of fewer bytes are planned (larger ones may be shared between threads)."""

Step = Callable[[], None]

SPACES = (Space.DRAM, Space.ARENA, Space.CONST)


class PlanPort(MemoryPort, Protocol):
    """What planning needs of the memory image beyond `MemoryPort` (see `emulator.Memory`)."""

    def place(self, tensor: Tensor, *, writable: bool = False) -> np.ndarray: ...


@dataclass(frozen=True)
class Plan:
    """A program's steps on one image, and the bytes its planned steps read and write per run
    (the others count their own)."""

    steps: tuple[Step, ...]
    reads: Mapping[Space, int]
    writes: Mapping[Space, int]
    planned: tuple[bool, bool, bool]
    """`plan_settings()` when it was made: a plan made under other settings is made again."""


def plan_settings() -> tuple[bool, bool, bool]:
    """What a plan depends on besides the program: whether small instructions are planned
    (`PLANNED`) and which compiled kernels are in use (tests switch them off)."""
    return (PLANNED, emulator_ops.native_kernels is not None, emulator_ops.native_vnni)


def plan_program(instructions: Sequence[Instruction], memory: PlanPort) -> Plan:
    """One step per instruction: planned where `PLANNERS` can, else its executor."""
    steps: list[Step] = []
    reads = dict.fromkeys(SPACES, 0)
    writes = dict.fromkeys(SPACES, 0)
    for instruction in instructions:
        step = _planned(instruction, memory) if PLANNED else None
        if step is None:
            step = functools.partial(EXECUTORS[type(instruction)], instruction, memory)
        else:
            _count(reads, instruction.inputs().values())
            _count(writes, instruction.outputs().values())
        steps.append(step)
    return Plan(tuple(steps), reads, writes, plan_settings())


def _planned(instruction: Instruction, memory: PlanPort) -> Step | None:
    """The instruction's planned step, or None (no planner, too large, or a wrong operand)."""
    planner = PLANNERS.get(type(instruction))
    if planner is None:
        return None
    try:
        return planner(instruction, memory)
    except EmulatorError:
        return None


def _count(totals: dict[Space, int], tensors: Iterable[Tensor]) -> None:
    for tensor in tensors:
        totals[tensor.space] += tensor.nbytes


def _tables_constant(instruction: Instruction, *data: str) -> bool:
    """Whether every operand the instruction reads, except the `data` fields, is CONST (so
    what planning derives from them holds for every run)."""
    inputs = instruction.inputs()
    return all(t.space == Space.CONST for name, t in inputs.items() if name not in data)


# --- copies ---------------------------------------------------------------------------------------


def _plan_copy(instruction: Load | Store | Move, memory: PlanPort) -> Step | None:
    """LOAD, STORE, plain MOVE: one assignment between the two places (numpy buffers an
    overlapping one, as `Memory.write` does)."""
    if isinstance(instruction, Move) and instruction.requant is not None:
        return None
    check_copy(instruction)
    if instruction.dst.nbytes >= COPY_BYTES:
        return None
    source = memory.place(instruction.src)
    target = memory.place(instruction.dst, writable=True)

    def copy() -> None:
        target[...] = source

    return copy


# --- CONV -----------------------------------------------------------------------------------------


def _plan_conv(instruction: Conv, memory: PlanPort) -> Step | None:
    """A CONV in the compiled int8 kernels (any size: `_plan_int8_conv`), or a small CONV:
    its input centred into a zero-padded buffer of its own (the padding is written once), the
    exact products of `execute_conv`'s algorithm for its shape, and the fused output stage
    written into the destination."""
    geometry = conv_geometry(instruction)
    shape = geometry.shape
    if not _tables_constant(instruction, "input"):
        return None
    stage = conv_stage(memory, instruction)
    target = memory.place(instruction.output, writable=True)
    weights = conv_weights(memory, instruction)
    zero_point = instruction.input_zero_point
    largest = _largest_value(_code_range(instruction.input), zero_point, weights.mass)
    codes = memory.place(instruction.input)
    int8 = _compiled_int8(geometry, codes, zero_point, weights, largest)
    if int8 is not None:
        return _plan_int8_conv(instruction, geometry, codes, stage, int8, target)
    if math.prod(shape) >= SMALL_ELEMENTS:
        return None
    apply = _stage_into(stage, target)
    if apply is None:
        return None
    dtype = _exact_dtype(largest)
    top, left, bottom, right = instruction.pads
    batch, channels, height, width = instruction.input.shape
    padded = (height + top + bottom, width + left + right)
    if depthwise_channel_last(geometry):
        # Channel-last input and accumulators (`execute_conv` takes the same path): the
        # stage writes codes in that layout, which are then transposed into the target.
        x = np.zeros((batch, *padded, channels), dtype).transpose(0, 3, 1, 2)
        inside = x[:, :, top : top + height, left : left + width]
        kh, kw = geometry.kernel
        taps = _ChannelLastTaps(
            _windows(x, (kh, kw), instruction.strides, instruction.dilations)[0],
            weights.astype(dtype).reshape(channels, kh, kw),
        )
        last = np.empty((batch, *geometry.out_hw, channels), target.dtype).transpose(0, 3, 1, 2)
        apply_last = _stage_into(stage, last)
        if apply_last is None:
            return None
        rows, everything = range(geometry.out_hw[0]), slice(None)

        def depthwise() -> None:
            np.subtract(codes, zero_point, out=inside, dtype=dtype)
            apply_last(taps.rows(everything, rows))
            np.copyto(target, last)

        return depthwise
    x = np.zeros((batch, channels, *padded), dtype)
    inside = x[:, :, top : top + height, left : left + width]
    accumulate = _conv_accumulator(instruction, x, weights, dtype)

    def conv() -> None:
        np.subtract(codes, zero_point, out=inside, dtype=dtype)
        apply(accumulate())

    return conv


def _plan_int8_conv(
    instruction: Conv,
    geometry: ConvGeometry,
    codes: np.ndarray,
    stage: _OutputStage,
    int8: tuple[np.ndarray, np.ndarray],
    target: np.ndarray,
) -> Step | None:
    """A CONV in the compiled int8 kernels with its output stage (`_int8_conv`): the phase
    planes (a buffer of the plan's), the blocks and their places in the destination made
    once, so that a run is the planes' refresh and one kernel call per block (on the
    emulator's threads); None where the kernels do not run the stage."""
    if stage.out_dtype != target.dtype or not stage.blockwise(target.shape):
        return None
    compiled = _int8_conv(
        instruction,
        geometry,
        codes,
        target,
        stage,
        *int8,
        planes_buffer=lambda size: np.empty(size, np.uint8),
    )
    write = compiled.codes
    if write is None:
        return None
    blocks, refresh = compiled.blocks, compiled.refresh
    places = [target[block] for block in blocks]
    unused = np.empty(1, np.int64)  # `write` takes no work memory
    indices = range(len(blocks))

    def conv() -> None:
        refresh()
        for_each(indices, lambda k: write(blocks[k], places[k], unused))

    return conv


def _code_range(tensor: Tensor) -> np.ndarray:
    """The least and greatest code of the tensor's dtype (bounds every value it can hold)."""
    return np.array(dtype_range(tensor.dtype.numpy), dtype=np.int64)


def _conv_accumulator(
    instruction: Conv, x: np.ndarray, weights: _Weights, dtype: type
) -> Callable[[], np.ndarray]:
    """A function of no arguments that computes the CONV's (N, M, Ho, Wo) accumulators from the
    centred, padded input `x` (a buffer the plan owns, so views of it are made once), with
    the algorithm `execute_conv` picks for its shape."""
    geometry = conv_geometry(instruction)
    batch, out_channels, ho, wo = geometry.shape
    group, group_out, (kh, kw) = geometry.group, geometry.group_out, geometry.kernel
    strides, dilations = instruction.strides, instruction.dilations
    weight = weights.astype(dtype)
    if geometry.channels == group:
        taps = _DepthwiseTaps(
            x, weight.reshape(group, group_out, kh, kw), strides, dilations, (ho, wo)
        )
        channels, rows = slice(0, group), range(ho)
        return lambda: taps.rows(channels, rows).reshape(geometry.shape)
    if _sums_tap_products(batch, group, (kh, kw), geometry.channels, out_channels):
        taps = weights.taps(dtype)
        return lambda: _TapProducts(x, taps, strides, dilations, (ho, wo)).rows(range(ho))
    return _im2col_accumulator(instruction, x, weight)


def _im2col_accumulator(
    instruction: Conv, x: np.ndarray, weight: np.ndarray
) -> Callable[[], np.ndarray]:
    """im2col columns copied from a window view of `x` made once (a 1x1 unit-stride kernel
    reads x itself), then `column_product` into a buffer of the plan's."""
    geometry = conv_geometry(instruction)
    batch, _, ho, wo = geometry.shape
    group, group_out, (kh, kw) = geometry.group, geometry.group_out, geometry.kernel
    (sh, _), (dh, _) = instruction.strides, instruction.dilations
    matrix = weight.reshape(group, group_out, -1)
    window = x[:, :, : (ho - 1) * sh + (kh - 1) * dh + 1]
    out = np.empty((1, group, group_out, ho * wo), weight.dtype) if batch == 1 else None
    if (kh, kw) == (1, 1) and instruction.strides == (1, 1) and window.flags.c_contiguous:
        direct = window[:, :, None, None]
        return lambda: column_product(matrix, direct, out)
    windows = _windows(window, (kh, kw), instruction.strides, instruction.dilations)
    windows = windows.transpose(0, 1, 4, 5, 2, 3)
    columns = np.empty(windows.shape, weight.dtype)

    def accumulate() -> np.ndarray:
        np.copyto(columns, windows)
        return column_product(matrix, columns, out)

    return accumulate


# --- output stages and lookups --------------------------------------------------------------------


def _stage_into(stage: _OutputStage, out: np.ndarray) -> Callable[[np.ndarray], object] | None:
    """stage(acc) written into `out` (a place in the image) as the fused stage of one whole
    block, as `output_stage` computes it; None where the stage is not fused or its codes are
    not of out's dtype (a range-checked write is needed)."""
    fused = stage.fused
    if fused is None or stage.out_dtype != out.dtype or not stage.blockwise(out.shape):
        return None
    return fused.bind(out, np.empty(max(1, out.size), np.int64))


def _lookup(table: np.ndarray, codes: np.ndarray, out: np.ndarray) -> Step | None:
    """out = table[code byte] for 8-bit codes (a table of `function_table`), gathered straight
    into `out` where it reads each code before it writes that place, else through a copy."""
    if table.dtype != out.dtype or codes.shape != out.shape:
        return None
    index = codes.view(np.uint8)
    if _in_place(out, (index,)):
        return lambda: np.take(table, index, out=out, mode="wrap")

    def lookup() -> None:
        out[...] = np.take(table, index, mode="wrap")

    return lookup


def _one_code_table(tensor: Tensor) -> bool:
    """Whether a tensor holds 8-bit integer codes (a table of 256 entries covers them)."""
    return tensor.itemsize == 1 and tensor.dtype.numpy.kind in "iu"


def _small(*tensors: Tensor) -> bool:
    return all(t.size < SMALL_ELEMENTS for t in tensors)


def _plan_move(instruction: Move, memory: PlanPort) -> Step | None:
    """A plain MOVE is a copy; a rescaling one with a per-tensor stage on 8-bit codes a lookup
    in the table of its stage over every code (`execute_move` takes the same table), other
    rescales the fused stage from the source's place into the destination's."""
    if instruction.requant is None:
        return _plan_copy(instruction, memory)
    src, dst = instruction.src, instruction.dst
    if src.shape != dst.shape or not _small(dst) or not _tables_constant(instruction, "src"):
        return None
    stage = move_stage(memory, instruction)
    codes = memory.place(src)
    out = memory.place(dst, writable=True)
    if stage.uniform(src.ndim) and _one_code_table(src):
        key = ("move", *stage.key())
        return _lookup(function_table(stage, stage.out_dtype, (codes.dtype,), key), codes, out)
    apply = _stage_into(stage, out)
    if apply is None or np.may_share_memory(codes, out):
        return None
    return lambda: apply(codes)


def _plan_lut(instruction: Lut, memory: PlanPort) -> Step | None:
    """A one-table LUT on 8-bit codes: a lookup in the table of its function over every code
    (the table `execute_lut` takes for larger inputs)."""
    if lut_tables(instruction) != 1 or instruction.table.space != Space.CONST:
        return None
    if not _one_code_table(instruction.input) or not _small(instruction.output):
        return None
    function, dtype, key = lut_function(memory, instruction)
    table = function_table(function, dtype, (instruction.input.dtype.numpy,), key)
    codes = memory.place(instruction.input)
    return _lookup(table, codes, memory.place(instruction.output, writable=True))


# --- POOL, REDUCE, RESIZE -------------------------------------------------------------------------


def _plan_pool(instruction: Pool, memory: PlanPort) -> Step | None:
    """A MAX POOL: the input copied into a buffer whose padding holds the pad value (written
    once), its running window maximum, then the optional output stage."""
    if instruction.op != PoolOp.MAX or not _small(instruction.input, instruction.output):
        return None
    if not _tables_constant(instruction, "input"):
        return None
    batch, channels, height, width = _rank4("the POOL input", instruction.input)
    if min(instruction.kernel) < 1 or min(instruction.strides) < 1 or min(instruction.pads) < 0:
        return None
    geometry = (instruction.kernel, instruction.strides, instruction.dilations)
    dtype = instruction.input.dtype.numpy
    low, high = dtype_range(dtype)
    if not low <= instruction.pad_value <= high:
        dtype = np.dtype(np.int64)
    top, left, bottom, right = instruction.pads
    padded = np.full(
        (batch, channels, height + top + bottom, width + left + right),
        instruction.pad_value,
        dtype,
    )
    inside = padded[:, :, top : top + height, left : left + width]
    pooled_shape = _window_max(padded, *geometry).shape
    if pooled_shape != instruction.output.shape:
        return None
    codes = memory.place(instruction.input)
    out = memory.place(instruction.output, writable=True)
    finish = _finish(memory, instruction, out, "a MAX POOL")
    if finish is None:
        return None

    def pool() -> None:
        inside[...] = codes
        finish(_window_max(padded, *geometry))

    return pool


def _finish(
    memory: PlanPort, instruction: Pool | Resize, out: np.ndarray, what: str
) -> Callable[[np.ndarray], object] | None:
    """What `_rescaled` does to selected codes, into `out`: its output stage if it has one,
    else the codes as they are (same dtype on both sides, else an error)."""
    if instruction.requant is None:
        if instruction.input.dtype != instruction.output.dtype:
            raise EmulatorError(f"{what} without a rescale keeps the dtype")

        def store(codes: np.ndarray) -> None:
            out[...] = codes

        return store
    stage = _OutputStage.read(
        memory,
        instruction.requant,
        out.ndim,
        zero_point=instruction.input_zero_point,
        target=instruction.output,
    )
    return _stage_into(stage, out)


def _plan_reduce(instruction: Reduce, memory: PlanPort) -> Step | None:
    """A summing REDUCE, or a MAX / MIN one with an output stage: the reduction of the input's
    place, the fused stage into a buffer of the kept-dimensions shape, copied to the output
    (`execute_reduce`'s values; its range-checked write is the stage's clamp)."""
    ndim, mask = instruction.input.ndim, instruction.axes
    if mask <= 0 or mask >> ndim or instruction.requant is None:
        return None
    if instruction.op not in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN):
        return None
    if not _small(instruction.input) or not _tables_constant(instruction, "input"):
        return None
    axes = tuple(a for a in range(ndim) if mask >> a & 1)
    kept = tuple(1 if a in axes else n for a, n in enumerate(instruction.input.shape))
    if math.prod(kept) != instruction.output.size:
        return None
    stage = _OutputStage.read(memory, instruction.requant, ndim, target=instruction.output)
    result = np.empty(kept, instruction.output.dtype.numpy)
    apply = _stage_into(stage, result)
    if apply is None:
        return None
    codes = memory.place(instruction.input)
    out = memory.place(instruction.output, writable=True)
    zero_point = instruction.input_zero_point
    reduce = {ReduceOp.MAX: np.max, ReduceOp.MIN: np.min}.get(instruction.op)

    def total() -> np.ndarray:
        return np.subtract(codes, zero_point, dtype=np.int64).sum(axis=axes, keepdims=True)

    def extreme() -> np.ndarray:
        return reduce(codes.astype(np.int64), axis=axes, keepdims=True) - zero_point

    accumulate = total if reduce is None else extreme

    def reduction() -> None:
        apply(accumulate())
        out[...] = result.reshape(out.shape)

    return reduction


def _plan_resize(instruction: Resize, memory: PlanPort) -> Step | None:
    """A NEAREST RESIZE: its gathers from the input's place along index tables read once, then
    the optional output stage into the output's place."""
    if instruction.mode != ResizeMode.NEAREST or not _small(instruction.input, instruction.output):
        return None
    if not _tables_constant(instruction, "input"):
        return None
    passes = [(axis, rows[0]) for axis, rows in resize_passes(memory, instruction)]
    if not passes:
        return None
    shape = list(instruction.input.shape)
    for axis, indices in passes:
        shape[axis] = indices.size
    if tuple(shape) != instruction.output.shape:
        return None
    codes = memory.place(instruction.input)
    out = memory.place(instruction.output, writable=True)
    finish = _finish(memory, instruction, out, "a NEAREST RESIZE")
    if finish is None:
        return None

    def resize() -> None:
        x = codes
        for axis, indices in passes:
            x = np.take(x, indices, axis=axis)
        finish(x)

    return resize


# --- ELTWISE, MATMUL ------------------------------------------------------------------------------


def _plan_eltwise(instruction: Eltwise, memory: PlanPort) -> Step | None:
    """An ELTWISE on the operands' places (broadcast once): with a per-tensor stage and one
    operand a CONST single code, a lookup in the table of the other operand's codes
    (`_tabulated_eltwise`'s table); otherwise the centred int64 accumulator and the fused
    stage into the output's place."""
    if not _small(instruction.output) or not _tables_constant(instruction, "a", "b"):
        return None
    try:
        a_codes, b_codes = np.broadcast_arrays(
            memory.place(instruction.a), memory.place(instruction.b)
        )
    except ValueError:
        return None
    out = memory.place(instruction.output, writable=True)
    if a_codes.shape != out.shape:
        return None
    stage = _OutputStage.read(memory, instruction.requant, out.ndim, target=instruction.output)
    if stage.uniform(out.ndim):
        lookup = _eltwise_lookup(instruction, stage, a_codes, b_codes, out)
        if lookup is not None:
            return lookup
    apply = _stage_into(stage, out)
    if apply is None:
        return None
    a_zero_point, b_zero_point = instruction.a_zero_point, instruction.b_zero_point

    def eltwise() -> None:
        a = np.subtract(a_codes, a_zero_point, dtype=np.int64)
        b = np.subtract(b_codes, b_zero_point, dtype=np.int64)
        apply(eltwise_acc(instruction, a, b))

    if (
        stage.uniform(out.ndim)
        and _one_code_table(instruction.a)
        and _one_code_table(instruction.b)
    ):
        return _pair_lookup(instruction, stage, a_codes, b_codes, out, eltwise)
    return eltwise


def _pair_lookup(
    instruction: Eltwise,
    stage: _OutputStage,
    a_codes: np.ndarray,
    b_codes: np.ndarray,
    out: np.ndarray,
    direct: Step,
) -> Step:
    """An ELTWISE of two 8-bit operands with a per-tensor stage: `direct` until a table of
    its values over every code pair pays (`table_pays`, counted per key over runs), then a
    lookup in that table (`function_table`, kept under the key `execute_eltwise` uses). The
    index (a's byte, then b's) is built whole before the gather writes, so `out` may overlap
    either operand."""
    dtypes = (a_codes.dtype, b_codes.dtype)
    key = eltwise_key(instruction, stage)
    demand_key = (key, tuple(d.str for d in dtypes), stage.out_dtype.str)
    function = eltwise_function(instruction, stage)
    high, low = a_codes.view(np.uint8), b_codes.view(np.uint8)
    index = np.empty(out.shape, np.uint16)

    def lookup() -> None:
        if not table_pays(demand_key, out.size, 256 * 256):
            direct()
            return
        table = function_table(function, stage.out_dtype, dtypes, key)
        np.left_shift(high, 8, out=index, dtype=np.uint16)
        np.bitwise_or(index, low, out=index)
        np.take(table, index, out=out, mode="wrap")

    return lookup


def _eltwise_lookup(
    instruction: Eltwise,
    stage: _OutputStage,
    a_codes: np.ndarray,
    b_codes: np.ndarray,
    out: np.ndarray,
) -> Step | None:
    """The ELTWISE as a lookup on one operand's 8-bit codes when the other is a CONST tensor
    holding one code, else None."""
    function = eltwise_function(instruction, stage)
    key = eltwise_key(instruction, stage)
    for single, other, tensor, side in (
        (b_codes, a_codes, instruction.b, "b"),
        (a_codes, b_codes, instruction.a, "a"),
    ):
        code = _single_code(single)
        if tensor.space != Space.CONST or code is None:
            continue
        if other.itemsize != 1 or other.dtype.kind not in "iu":
            return None
        value = np.int64(code)
        if side == "b":
            unary = functools.partial(_with_second, function, value)
        else:
            unary = functools.partial(function, value)
        side_key = (key, side, single.dtype.str, code)
        table = function_table(unary, stage.out_dtype, (other.dtype,), side_key)
        return _lookup(table, other, out)
    return None


def _with_second(
    function: Callable[..., np.ndarray], second: np.int64, first: np.ndarray
) -> np.ndarray:
    return function(first, second)


def _plan_matmul(instruction: MatMul, memory: PlanPort) -> Step | None:
    """A MATMUL: (a - za) in an exact dtype fixed by the codes' ranges (`_exact_dtype` of the
    largest value any codes could give), times b's centred values (made once when b is CONST),
    + bias, the fused stage into the output's place."""
    a_shape, b_shape = instruction.a.shape, instruction.b.shape
    depth_axis = -2 if len(b_shape) > 1 else 0
    if not a_shape or not b_shape or a_shape[-1] != b_shape[depth_axis]:
        return None
    if not _small(instruction.a, instruction.b, instruction.output):
        return None
    if not _tables_constant(instruction, "a", "b"):
        return None
    try:
        shape = np.matmul(np.empty(a_shape, np.int8), np.empty(b_shape, np.int8)).shape
    except ValueError:
        return None
    if shape != instruction.output.shape:
        return None
    bias = instruction.bias
    stage = _OutputStage.read(memory, instruction.requant, len(shape), target=instruction.output)
    out = memory.place(instruction.output, writable=True)
    apply = _stage_into(stage, out)
    if apply is None:
        return None
    biases = None
    if bias is not None:
        biases = memory.read_cached(bias, "int64", lambda codes: codes.astype(np.int64))
        if np.broadcast_shapes(shape, biases.shape) != shape:
            return None
    a_zero_point = instruction.a_zero_point
    right, dtype = _matmul_operand(memory, instruction)
    a_codes = memory.place(instruction.a)

    def matmul() -> None:
        a = np.subtract(a_codes, a_zero_point, dtype=dtype)
        acc = np.matmul(a, right()).astype(np.int64)
        if biases is not None:
            acc += biases
        apply(acc)

    return matmul


def _matmul_operand(memory: PlanPort, instruction: MatMul) -> tuple[Callable[[], np.ndarray], type]:
    """b - zb as a function of no arguments, and the dtype in which every partial sum of the
    product is exact for any codes of a: for a CONST b its values (`execute_matmul`'s, made
    once), else centred from b's place on each run, with the largest weight mass b's dtype
    allows."""
    b, b_zero_point = instruction.b, instruction.b_zero_point
    a_range = _code_range(instruction.a)
    if b.space == Space.CONST:
        depth_axis = -2 if b.ndim > 1 else 0
        weights = memory.read_cached(
            b,
            f"matmul/{b_zero_point}",
            lambda codes: _Weights(codes.astype(np.int64) - b_zero_point, (depth_axis,)),
        )
        dtype = _exact_dtype(_largest_value(a_range, instruction.a_zero_point, weights.mass))
        matrix = weights.astype(dtype)
        return lambda: matrix, dtype
    low, high = dtype_range(b.dtype.numpy)
    depth = instruction.a.shape[-1]
    mass = depth * max(abs(low - b_zero_point), abs(high - b_zero_point))
    dtype = _exact_dtype(_largest_value(a_range, instruction.a_zero_point, mass))
    codes = memory.place(b)
    return lambda: np.subtract(codes, b_zero_point, dtype=dtype), dtype


PLANNERS: dict[type[Instruction], Callable[..., Step | None]] = {
    Load: _plan_copy,
    Store: _plan_copy,
    Move: _plan_move,
    Conv: _plan_conv,
    Lut: _plan_lut,
    Pool: _plan_pool,
    Reduce: _plan_reduce,
    Resize: _plan_resize,
    Eltwise: _plan_eltwise,
    MatMul: _plan_matmul,
}
"""Instruction type -> planner(instruction, memory): its planned step, or None."""
