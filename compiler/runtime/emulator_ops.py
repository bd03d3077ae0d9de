"""What each MLA instruction computes, on operands read from the emulator's memory image.

These are written from docs/mla-isa.md and docs/integer-semantics.md, independently of the
reference kernels in `compiler.runtime.ops` (a tap-by-tap MAC-array convolution rather than
im2col, for instance), so the two cross-check each other. All integer arithmetic that the spec
defines (requantization, rounding shifts, exact products, tables, rsqrt) is imported from
`compiler.intmath`; the fixed-point widths of Softmax, LayerNorm and Resize are imported from the
reference ops that define them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from compiler.intmath import (
    INT32_MAX,
    apply_lut,
    divide_round_half_up,
    dtype_range,
    int_matmul,
    reciprocal_sqrt,
    requantize,
    rounding_right_shift,
)
from compiler.isa import (
    Conv,
    ConvTranspose,
    Eltwise,
    EltwiseOp,
    Fill,
    Instruction,
    LayerNorm,
    Load,
    Lut,
    MatMul,
    Move,
    Pool,
    PoolOp,
    Reduce,
    ReduceOp,
    Requant,
    Resize,
    ResizeMode,
    Softmax,
    Space,
    Store,
    Tensor,
)
from compiler.runtime.ops.normalization import NORMALISED_BITS
from compiler.runtime.ops.resize import WEIGHT_ONE
from compiler.runtime.ops.softmax import PROBABILITY_BITS, RECIPROCAL_BITS


class EmulatorError(RuntimeError):
    """The program is wrong: a bad operand, shape, address or value; the message says which."""


class MemoryPort(Protocol):
    """How an instruction reads and writes the memory image (see `emulator.Memory`)."""

    def read(self, tensor: Tensor) -> np.ndarray: ...

    def write(self, tensor: Tensor, values: np.ndarray) -> None: ...


def _expect_shape(what: str, actual: tuple[int, ...], expected: tuple[int, ...]) -> None:
    if tuple(actual) != tuple(expected):
        raise EmulatorError(f"{what} has shape {tuple(actual)}; expected {tuple(expected)}")


def _table(memory: MemoryPort, value: int | Tensor) -> np.ndarray | int:
    return memory.read(value).astype(np.int64) if isinstance(value, Tensor) else value


def _per_channel(values: np.ndarray | int, ndim: int) -> np.ndarray | int:
    """A rank-1 per-output-channel table as (C, 1, ..., 1) against an (N, C, ...) result."""
    if isinstance(values, np.ndarray) and values.ndim == 1:
        return values.reshape(-1, *[1] * (ndim - 2))
    return values


def output_stage(
    memory: MemoryPort, acc: np.ndarray, requant: Requant, *, per_channel: bool = False
) -> np.ndarray:
    """saturate int32 -> requantize (M, n) -> + zero point -> clamp [low, high]."""
    multiplier = _table(memory, requant.multiplier)
    shift = _table(memory, requant.shift)
    if per_channel:
        multiplier = _per_channel(multiplier, acc.ndim)
        shift = _per_channel(shift, acc.ndim)
    try:
        scaled = requantize(acc, multiplier, shift, requant.mode)
    except ValueError as error:
        raise EmulatorError(f"requantization tables do not fit the result: {error}") from error
    return np.clip(scaled + requant.zero_point, requant.low, requant.high)


def _same_dtype(what: str, source: Tensor, target: Tensor) -> None:
    """Without a rescale the codes are moved as they are, so the storage types must agree."""
    if source.dtype != target.dtype:
        raise EmulatorError(
            f"{what} without a rescale keeps the dtype: {source.dtype.name} -> {target.dtype.name}"
        )


def _centred(memory: MemoryPort, tensor: Tensor, zero_point: int) -> np.ndarray:
    return memory.read(tensor).astype(np.int64) - zero_point


def _copy(memory: MemoryPort, src: Tensor, dst: Tensor) -> None:
    _expect_shape("the destination", dst.shape, src.shape)
    if src.dtype != dst.dtype:
        raise EmulatorError(
            f"a plain copy keeps the dtype: {src.dtype.name} -> {dst.dtype.name} needs a rescale"
        )
    memory.write(dst, memory.read(src))


def execute_load(instruction: Load, memory: MemoryPort) -> None:
    if instruction.src.space not in (Space.DRAM, Space.CONST):
        raise EmulatorError("LOAD reads DRAM or CONST")
    if instruction.dst.space != Space.ARENA:
        raise EmulatorError("LOAD writes the arena")
    _copy(memory, instruction.src, instruction.dst)


def execute_store(instruction: Store, memory: MemoryPort) -> None:
    if instruction.src.space != Space.ARENA or instruction.dst.space != Space.DRAM:
        raise EmulatorError("STORE copies from the arena to DRAM")
    _copy(memory, instruction.src, instruction.dst)


def execute_move(instruction: Move, memory: MemoryPort) -> None:
    if instruction.requant is None:
        _copy(memory, instruction.src, instruction.dst)
        return
    _expect_shape("the destination", instruction.dst.shape, instruction.src.shape)
    centred = _centred(memory, instruction.src, instruction.input_zero_point)
    memory.write(instruction.dst, output_stage(memory, centred, instruction.requant))


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


def execute_conv(instruction: Conv, memory: MemoryPort) -> None:
    """The MAC array walks the kernel taps; each tap is a (positions x Cg) @ (Cg x Mg) product."""
    batch, channels, _, _ = _rank4("the CONV input", instruction.input)
    out_channels, group_channels, kh, kw = _rank4("the CONV weight", instruction.weight)
    group = instruction.group
    if group < 1 or channels != group_channels * group or out_channels % group:
        raise EmulatorError(
            f"CONV: {channels} input channels, weight {instruction.weight.shape}, group {group}"
        )
    if min(instruction.strides) < 1 or min(instruction.dilations) < 1:
        raise EmulatorError("CONV strides and dilations must be positive")
    x = _pad_hw(
        _centred(memory, instruction.input, instruction.input_zero_point), instruction.pads, 0
    )
    weight = memory.read(instruction.weight).astype(np.int64)
    (sh, sw), (dh, dw) = instruction.strides, instruction.dilations
    ho = _output_size(x.shape[2], kh, sh, dh)
    wo = _output_size(x.shape[3], kw, sw, dw)
    _expect_shape("the CONV output", instruction.output.shape, (batch, out_channels, ho, wo))
    group_out = out_channels // group
    grouped_x = x.reshape(batch, group, group_channels, *x.shape[2:])
    grouped_w = weight.reshape(group, group_out, group_channels, kh, kw)
    acc = np.zeros((batch, group, ho * wo, group_out), dtype=np.int64)
    for i in range(kh):
        for j in range(kw):
            rows = slice(i * dh, i * dh + sh * (ho - 1) + 1, sh)
            cols = slice(j * dw, j * dw + sw * (wo - 1) + 1, sw)
            patch = grouped_x[:, :, :, rows, cols].reshape(batch, group, group_channels, -1)
            tap = grouped_w[:, :, :, i, j].transpose(0, 2, 1)
            acc += int_matmul(patch.transpose(0, 1, 3, 2), tap)
    acc = acc.transpose(0, 1, 3, 2).reshape(batch, out_channels, ho, wo)
    acc += _bias(memory, instruction.bias, out_channels).reshape(-1, 1, 1)
    result = output_stage(memory, acc, instruction.requant, per_channel=True)
    memory.write(instruction.output, result)


def _bias(memory: MemoryPort, bias: Tensor | None, channels: int) -> np.ndarray:
    if bias is None:
        return np.zeros(channels, dtype=np.int64)
    _expect_shape("the bias", bias.shape, (channels,))
    return memory.read(bias).astype(np.int64)


def execute_conv_transpose(instruction: ConvTranspose, memory: MemoryPort) -> None:
    """Each tap scatters (x @ w[:, :, tap]) onto the full output grid, which is then cropped."""
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
    x = _centred(memory, instruction.input, instruction.input_zero_point)
    x = x.reshape(batch, group, group_in, height * width)
    weight = memory.read(instruction.weight).astype(np.int64)
    weight = weight.reshape(group, group_in, group_out, kh, kw)
    full = np.zeros((batch, group, group_out, full_h, full_w), dtype=np.int64)
    for i in range(kh):
        for j in range(kw):
            contribution = int_matmul(weight[:, :, :, i, j].transpose(0, 2, 1), x)
            rows = slice(i * dh, i * dh + sh * (height - 1) + 1, sh)
            cols = slice(j * dw, j * dw + sw * (width - 1) + 1, sw)
            full[:, :, :, rows, cols] += contribution.reshape(batch, group, group_out, height, -1)
    full = full.reshape(batch, out_channels, full_h, full_w)
    acc = full[:, :, top : full_h - bottom, left : full_w - right]
    acc = acc + _bias(memory, instruction.bias, out_channels).reshape(-1, 1, 1)
    result = output_stage(memory, acc, instruction.requant, per_channel=True)
    memory.write(instruction.output, result)


def execute_matmul(instruction: MatMul, memory: MemoryPort) -> None:
    a = _centred(memory, instruction.a, instruction.a_zero_point)
    b = _centred(memory, instruction.b, instruction.b_zero_point)
    if a.ndim < 1 or b.ndim < 1 or a.shape[-1] != b.shape[-2 if b.ndim > 1 else 0]:
        raise EmulatorError(f"MATMUL of {a.shape} and {b.shape}")
    try:
        acc = int_matmul(a, b)
    except ValueError as error:
        raise EmulatorError(f"MATMUL of {a.shape} and {b.shape}: {error}") from error
    if instruction.bias is not None:
        acc = acc + memory.read(instruction.bias).astype(np.int64)
    _expect_shape("the MATMUL output", instruction.output.shape, acc.shape)
    memory.write(instruction.output, output_stage(memory, acc, instruction.requant))


def _divide(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    """round_half_up(numerator / denominator); x / 0 saturates towards the sign of x."""
    sign = np.where(denominator < 0, -1, 1)
    magnitude = np.maximum(np.abs(denominator), 1)
    quotient = sign * divide_round_half_up(numerator * sign, magnitude)
    return np.where(denominator == 0, np.sign(numerator) * INT32_MAX, quotient)


def execute_eltwise(instruction: Eltwise, memory: MemoryPort) -> None:
    a = _centred(memory, instruction.a, instruction.a_zero_point)
    b = _centred(memory, instruction.b, instruction.b_zero_point)
    try:
        a, b = np.broadcast_arrays(a, b)
    except ValueError as error:
        raise EmulatorError(f"ELTWISE operands {a.shape} and {b.shape} do not broadcast") from error
    _expect_shape("the ELTWISE output", instruction.output.shape, a.shape)
    op, mode, shift = instruction.op, instruction.requant.mode, instruction.left_shift
    if op in (EltwiseOp.ADD, EltwiseOp.SUB):
        scaled_a = requantize(a << shift, instruction.a_multiplier, instruction.a_shift, mode)
        scaled_b = requantize(b << shift, instruction.b_multiplier, instruction.b_shift, mode)
        acc = scaled_a + scaled_b if op == EltwiseOp.ADD else scaled_a - scaled_b
    elif op == EltwiseOp.MUL:
        acc = a * b
    else:
        acc = _divide(a << shift, b)
    memory.write(instruction.output, output_stage(memory, acc, instruction.requant))


def execute_lut(instruction: Lut, memory: MemoryPort) -> None:
    _expect_shape("the LUT output", instruction.output.shape, instruction.input.shape)
    low, high = dtype_range(instruction.input.dtype.numpy)
    if instruction.table.size != high - low + 1 or instruction.input.itemsize > 2:
        raise EmulatorError(
            f"a {instruction.input.dtype.name} LUT needs {high - low + 1} entries, "
            f"not {instruction.table.size}"
        )
    table = memory.read(instruction.table).reshape(-1)
    x = memory.read(instruction.input)
    memory.write(instruction.output, apply_lut(table, x, instruction.input.dtype.numpy))


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


def execute_pool(instruction: Pool, memory: MemoryPort) -> None:
    _rank4("the POOL input", instruction.input)
    if min(instruction.kernel) < 1 or min(instruction.strides) < 1:
        raise EmulatorError("POOL kernel and strides must be positive")
    geometry = (instruction.kernel, instruction.strides, instruction.dilations)
    if instruction.op == PoolOp.MAX:
        x = memory.read(instruction.input).astype(np.int64)
        view = _windows(_pad_hw(x, instruction.pads, instruction.pad_value), *geometry)
        _expect_shape("the POOL output", instruction.output.shape, view.shape[:4])
        pooled = view.max(axis=(4, 5))
        if instruction.requant is not None:
            pooled = output_stage(
                memory, pooled - instruction.input_zero_point, instruction.requant
            )
        else:
            _same_dtype("a MAX POOL", instruction.input, instruction.output)
        memory.write(instruction.output, pooled)
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
        scaled = requantize(total, multipliers[count], shifts[count], stage.mode)
        result = np.clip(scaled + stage.zero_point, stage.low, stage.high)
    memory.write(instruction.output, result)


def execute_reduce(instruction: Reduce, memory: MemoryPort) -> None:
    ndim = instruction.input.ndim
    if instruction.axes <= 0 or instruction.axes >> ndim:
        raise EmulatorError(f"REDUCE axes mask {instruction.axes:#b} for a rank-{ndim} input")
    axes = tuple(a for a in range(ndim) if instruction.axes >> a & 1)
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


def execute_resize(instruction: Resize, memory: MemoryPort) -> None:
    x = memory.read(instruction.input).astype(np.int64)
    linear = instruction.mode == ResizeMode.LINEAR
    if linear:
        x = x - instruction.input_zero_point
    passes = [(instruction.axis0, instruction.table0), (instruction.axis1, instruction.table1)]
    for axis, table in passes:
        if axis < 0:
            continue
        if table is None or not 0 <= axis < x.ndim:
            raise EmulatorError(f"RESIZE axis {axis} without a valid index table")
        rows = memory.read(table).astype(np.int64)
        if rows.ndim != 2 or rows.shape[0] != (4 if linear else 1):
            raise EmulatorError(f"RESIZE table of shape {rows.shape}")
        indices = rows[:2] if linear else rows[:1]
        if indices.min(initial=0) < 0 or indices.max(initial=0) >= x.shape[axis]:
            raise EmulatorError(f"RESIZE index table points outside axis {axis}")
        if linear:
            x0, x1, w0, w1 = rows
            if np.any(w0 + w1 != WEIGHT_ONE):
                raise EmulatorError("RESIZE linear weights must sum to 1.0 in Q10")
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
    elif instruction.requant is not None:
        x = output_stage(memory, x - instruction.input_zero_point, instruction.requant)
    else:
        _same_dtype("a NEAREST RESIZE", instruction.input, instruction.output)
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
    _expect_shape("the LAYERNORM output", instruction.output.shape, instruction.input.shape)
    axis = instruction.axis % instruction.input.ndim
    normalised_shape = instruction.input.shape[axis:]
    axes = tuple(range(axis, instruction.input.ndim))
    count = int(np.prod(normalised_shape))
    params = {}
    for name in ("signs", "multipliers", "shifts", "offsets"):
        tensor = getattr(instruction, name)
        _expect_shape(f"LAYERNORM {name}", tensor.shape[-len(axes) :], normalised_shape)
        params[name] = memory.read(tensor).astype(np.int64)
    if instruction.epsilon_term < 1:
        raise EmulatorError("LAYERNORM epsilon_term must be at least 1")
    x = _centred(memory, instruction.input, instruction.input_zero_point)
    s1 = x.sum(axis=axes, keepdims=True)
    s2 = (x * x).sum(axis=axes, keepdims=True)
    reciprocal, shift = reciprocal_sqrt(count * s2 - s1 * s1 + instruction.epsilon_term)
    normalised = rounding_right_shift((count * x - s1) * reciprocal, shift - NORMALISED_BITS)
    fine = requantize(
        params["signs"] * normalised,
        params["multipliers"],
        params["shifts"],
        instruction.requant.mode,
    )
    result = output_stage(memory, fine + params["offsets"], instruction.requant)
    memory.write(instruction.output, result)


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
}
"""Instruction type -> function(instruction, memory) that executes it."""
