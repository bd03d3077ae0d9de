"""Code generation: MLA layers (integer steps) -> `compiler.isa` instructions and `.rodata`.

Each integer step's kernel (`compiler.runtime.ops`) holds exactly the build-time constants the
MLA needs: centred weights, integer biases, per-channel (M, n), clamp bounds, tables. The
emitters below copy them into the constant pool and describe every operand with a `Tensor`
descriptor at the address the memory plan gave it. Data movement (Transpose, Slice, Concat,
DepthToSpace, Tile, Pad, …) becomes strided MOVEs: the layout is in the descriptors.

Batches: a layer whose instruction treats axis 0 as independent samples (Conv, pools, tables,
elementwise, LRN, GridSample; Resize, Softmax, LayerNorm (integer or fp16), ArgMax and CumSum off axis 0;
MatMul on rank >= 3)
is emitted once over all frames, so its weights are fetched once per batch; any other layer is
emitted once per frame on that frame's view. Frames of one tensor are consecutive (see
`layout`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from itertools import pairwise

import numpy as np

from compiler.intmath import (
    INT32_MAX,
    INT32_MIN,
    normalisation_epsilon,
    quantize_multiplier,
)
from compiler.isa import (
    ConstantPool,
    Conv,
    ConvTranspose,
    Eltwise,
    EltwiseOp,
    Fill,
    GridSampleBf16,
    Instruction,
    LayerNorm,
    Layout,
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
    float16_bits,
    float32_bits,
    layout_tensor,
)
from compiler.lower.errors import CompileError
from compiler.lower.fusion import VIEW_OPS, Layer
from compiler.runtime.ops.base import OutputStage, Rescale
from compiler.runtime.ops.conv import ConvKernel, ConvTransposeKernel
from compiler.runtime.ops.elementwise import (
    QUOTIENT_BITS,
    AddKernel,
    DivKernel,
    ExtremumKernel,
    MulKernel,
)
from compiler.runtime.ops.geometry import resolve_pads
from compiler.runtime.ops.grid_sample import GridSampleKernel
from compiler.runtime.ops.lut import LookupKernel
from compiler.runtime.ops.matmul import (
    AxisView,
    CumSumKernel,
    EinsumKernel,
    EinsumSumKernel,
    MatMulKernel,
    prefix_matrix,
)
from compiler.runtime.ops.movement import (
    ConcatKernel,
    MoveKernel,
    SplitKernel,
    TabulatedMoveKernel,
)
from compiler.runtime.ops.normalization import (
    OUTPUT_FRACTION_BITS,
    Fp16NormKernel,
    LayerNormKernel,
    LrnKernel,
)
from compiler.runtime.ops.pool import (
    AveragePoolKernel,
    AverageStage,
    GlobalAveragePoolKernel,
    GlobalMaxPoolKernel,
    MaxPoolKernel,
)
from compiler.runtime.ops.reduce import ArgMaxKernel, ReduceExtremumKernel, ReduceSumKernel
from compiler.runtime.ops.resize import (
    ResizeKernel,
    input_coordinates,
    linear_taps,
    nearest_indices,
)
from compiler.runtime.ops.softmax import SoftmaxKernel

# --- where tensors live --------------------------------------------------------------------------


@dataclass(frozen=True)
class Storage:
    """A tensor of the segment: `batch` frames of logical `shape`, at `offset` in `space`.

    Arena and scratch tensors are C-ordered, frame after frame. DRAM boundary tensors use
    their `layout` (HWC / HWC16 strides for 4-D tensors).
    """

    name: str
    space: Space
    dtype: np.dtype
    offset: int
    shape: tuple[int, ...]
    batch: int
    layout: Layout = "NCHW"

    @property
    def frame_bytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize

    def stacked(self) -> Tensor:
        """All frames stacked along axis 0: shape (batch * shape[0], *shape[1:])."""
        head = self.shape[0] if self.shape else 1
        shape = (self.batch * head, *self.shape[1:]) if self.shape else (self.batch,)
        if self.layout != "NCHW" and len(self.shape) == 4:
            return layout_tensor(self.space, self.dtype, self.offset, shape, self.layout)
        return Tensor.contiguous(self.space, self.dtype, self.offset, shape)

    def frame(self, index: int) -> Tensor:
        """Frame `index` with the tensor's own logical shape."""
        if not self.shape:
            return Tensor.contiguous(
                self.space, self.dtype, self.offset + index * self.frame_bytes, ()
            )
        head = self.shape[0]
        return self.stacked().slice(0, index * head, (index + 1) * head)

    def batched(self) -> Tensor | None:
        """(batch, *shape[1:]) when the logical batch axis is 1, else None."""
        if self.shape and self.shape[0] == 1:
            return self.stacked()
        return None


# --- descriptor helpers --------------------------------------------------------------------------


def insert_axis(tensor: Tensor, axis: int) -> Tensor:
    """A size-1 axis at `axis` (its stride is irrelevant)."""
    shape = list(tensor.shape)
    strides = list(tensor.strides)
    shape.insert(axis, 1)
    strides.insert(axis, 0)
    return replace(tensor, shape=tuple(shape), strides=tuple(strides))


def split_axis(tensor: Tensor, axis: int, sizes: Sequence[int]) -> Tensor:
    """View axis `axis` of size prod(sizes) as the axes `sizes` (C order), for any strides."""
    axis %= tensor.ndim
    if math.prod(sizes) != tensor.shape[axis]:
        raise CompileError(f"cannot split an axis of {tensor.shape[axis]} into {tuple(sizes)}")
    stride = tensor.strides[axis]
    inner = []
    step = stride
    for size in reversed(sizes):
        inner.append(step)
        step *= size
    shape = (*tensor.shape[:axis], *sizes, *tensor.shape[axis + 1 :])
    strides = (*tensor.strides[:axis], *reversed(inner), *tensor.strides[axis + 1 :])
    return replace(tensor, shape=tuple(shape), strides=tuple(strides))


def reshape_view(tensor: Tensor, shape: Sequence[int]) -> Tensor:
    """Reinterpret a C-ordered tensor with another shape."""
    shape = tuple(int(s) for s in shape)
    if tensor.is_contiguous:
        return tensor.reshape(shape)
    raise CompileError(f"a {tensor.shape} tensor with strides {tensor.strides} is not C-ordered")


def select(tensor: Tensor, axis: int, index: int) -> Tensor:
    """tensor[..., index, ...] with the axis removed."""
    axis %= tensor.ndim
    offset = tensor.offset + index * tensor.strides[axis]
    shape = tensor.shape[:axis] + tensor.shape[axis + 1 :]
    strides = tensor.strides[:axis] + tensor.strides[axis + 1 :]
    return replace(tensor, offset=offset, shape=shape, strides=strides)


def stepped(tensor: Tensor, axis: int, start: int, count: int, step: int) -> Tensor:
    """`count` elements from `start` every `step` (any sign) along `axis`."""
    axis %= tensor.ndim
    shape = list(tensor.shape)
    strides = list(tensor.strides)
    offset = tensor.offset + (start * strides[axis] if count else 0)
    shape[axis] = count
    strides[axis] *= step
    return replace(tensor, offset=offset, shape=tuple(shape), strides=tuple(strides))


# --- constants and output stages ------------------------------------------------------------------


class Constants:
    """The `.rodata` of one program: integer arrays in the narrowest type that holds them."""

    def __init__(self) -> None:
        self.pool = ConstantPool()

    def add(self, array: np.ndarray, dtype: np.dtype | None = None) -> Tensor:
        array = np.asarray(array)
        if dtype is None:
            dtype = narrowest(array)
        return self.pool.add(array, dtype)

    def to_bytes(self) -> bytes:
        return self.pool.to_bytes()


def narrowest(array: np.ndarray) -> np.dtype:
    values = np.asarray(array, dtype=np.int64)
    low = int(values.min(initial=0))
    high = int(values.max(initial=0))
    for dtype in (np.int8, np.int16, np.int32):
        info = np.iinfo(dtype)
        if info.min <= low and high <= info.max:
            return np.dtype(dtype)
    return np.dtype(np.int64)


def _table_or_immediate(values: np.ndarray, constants: Constants, shape: tuple[int, ...]):
    values = np.asarray(values, dtype=np.int64)
    flat = values.reshape(-1)
    if flat.size and np.all(flat == flat[0]):
        return int(flat[0])
    return constants.add(values.reshape(shape), np.int32)


def requant_of(
    stage: OutputStage, constants: Constants, *, table_shape: tuple[int, ...] | None = None
) -> Requant:
    """An `OutputStage` as an ISA `Requant` (per-channel tables go to `.rodata`)."""
    multiplier = np.asarray(stage.multiplier)
    shift = np.asarray(stage.shift)
    shape = table_shape if table_shape is not None else multiplier.shape
    return Requant(
        _table_or_immediate(multiplier, constants, shape),
        _table_or_immediate(shift, constants, shape),
        stage.zero_point,
        stage.low,
        stage.high,
        stage.mode,
    )


def rescale_requant(rescale: Rescale, constants: Constants) -> Requant | None:
    return None if rescale.stage is None else requant_of(rescale.stage, constants)


def average_requant(stage: AverageStage, count: int) -> Requant:
    real = stage.input_scale / (stage.output_scale * float(count))
    multiplier, shift = quantize_multiplier(real)
    return Requant(int(multiplier), int(shift), stage.zero_point, stage.low, stage.high, stage.mode)


# --- emitters ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Emission:
    """One layer on one set of operand views (one frame, or every frame stacked).

    `inputs` are aligned with the step's kernel arguments (constants as CONST views, with their
    values in `values`), `outputs` with the step's outputs (None for an unused output).
    """

    layer: Layer
    index: int
    inputs: tuple[Tensor, ...]
    values: tuple[np.ndarray | None, ...]
    outputs: tuple[Tensor | None, ...]
    frame_shapes: tuple[tuple[int, ...], ...]
    constants: Constants

    @property
    def kernel(self):
        return self.layer.step.kernel

    @property
    def output(self) -> Tensor:
        out = self.outputs[0]
        if out is None:
            raise CompileError(f"{self.layer.name}: its output is never used")
        return out


def _spatial_2d(x: Tensor, rank: int) -> Tensor:
    if rank == 2:
        return x
    if rank == 1:
        return insert_axis(x, 2)
    raise CompileError(f"the MLA has 1-D and 2-D windows, not {rank}-D")


def _pads_2d(begin: Sequence[int], end: Sequence[int]) -> tuple[int, int, int, int]:
    if len(begin) == 1:
        return (0, begin[0], 0, end[0])
    return (begin[0], begin[1], end[0], end[1])


def _pair(values: Sequence[int]) -> tuple[int, int]:
    values = tuple(int(v) for v in values)
    return (1, values[0]) if len(values) == 1 else (values[0], values[1])


def _bias(bias: np.ndarray | int, constants: Constants) -> Tensor | None:
    bias = np.asarray(bias, dtype=np.int64)
    if not np.any(bias):
        return None
    dtype = np.int32 if bias.min() >= INT32_MIN and bias.max() <= INT32_MAX else np.int64
    return constants.add(bias, dtype)


def emit_conv(e: Emission) -> list[Instruction]:
    kernel: ConvKernel = e.kernel
    rank = kernel.weight.ndim - 2
    begin, end = resolve_pads(
        e.frame_shapes[0][2:],
        kernel.weight.shape[2:],
        kernel.strides,
        kernel.dilations,
        kernel.pads,
        kernel.auto_pad,
    )
    weight = kernel.weight if rank == 2 else kernel.weight[:, :, None, :]
    channels = kernel.weight.shape[0]
    return [
        Conv(
            layer=e.index,
            input=_spatial_2d(e.inputs[0], rank),
            weight=e.constants.add(weight),
            bias=_bias(kernel.bias, e.constants),
            output=_spatial_2d(e.output, rank),
            requant=requant_of(kernel.stage, e.constants, table_shape=(channels,)),
            input_zero_point=kernel.input_zero_point,
            strides=_pair(kernel.strides),
            dilations=_pair(kernel.dilations),
            pads=_pads_2d(begin, end),
            group=kernel.group,
        )
    ]


def emit_conv_transpose(e: Emission) -> list[Instruction]:
    kernel: ConvTransposeKernel = e.kernel
    rank = kernel.weight.ndim - 2
    _, begin, end = kernel._geometry(tuple(e.frame_shapes[0][2:]))
    weight = kernel.weight if rank == 2 else kernel.weight[:, :, None, :]
    channels = kernel.bias.shape[0]
    padding = tuple(int(p) for p in kernel.output_padding)
    return [
        ConvTranspose(
            layer=e.index,
            input=_spatial_2d(e.inputs[0], rank),
            weight=e.constants.add(weight),
            bias=_bias(kernel.bias, e.constants),
            output=_spatial_2d(e.output, rank),
            requant=requant_of(kernel.stage, e.constants, table_shape=(channels,)),
            input_zero_point=kernel.input_zero_point,
            strides=_pair(kernel.strides),
            dilations=_pair(kernel.dilations),
            crop=_pads_2d(begin, end),
            output_padding=(0, padding[0]) if rank == 1 else (padding[0], padding[1]),
            group=kernel.group,
        )
    ]


def _swap_last(tensor: Tensor) -> Tensor:
    perm = list(range(tensor.ndim))
    perm[-1], perm[-2] = perm[-2], perm[-1]
    return tensor.transpose(perm)


def emit_matmul(e: Emission) -> list[Instruction]:
    return _matmul(e, e.kernel, *e.inputs, e.values[1], e.output)


def axis_view(tensor: Tensor, view: AxisView) -> Tensor:
    """`view` (an Einsum operand's MATMUL view) as a descriptor: the permuted tensor with each
    group of axes merged, which only strides can do when the group is laid out in C order."""
    permuted = tensor.transpose(view.perm)
    shape: list[int] = []
    strides: list[int] = []
    start = 0
    for count in view.groups:
        axes = range(start, start + count)
        start += count
        sized = [a for a in axes if permuted.shape[a] != 1]
        for outer, inner in pairwise(sized):
            if permuted.strides[outer] != permuted.strides[inner] * permuted.shape[inner]:
                raise CompileError(
                    f"axes of shape {permuted.shape} with strides {permuted.strides} do not "
                    "merge into one MATMUL axis"
                )
        shape.append(math.prod(permuted.shape[a] for a in axes))
        strides.append(permuted.strides[sized[-1]] if sized else 0)
    return replace(permuted, shape=tuple(shape), strides=tuple(strides))


def emit_einsum(e: Emission) -> list[Instruction]:
    """The MATMUL of the plan's views: operands read as (batch…, M, K) and (batch…, K, N) with
    broadcast row / column axes, the product written through the view of the output that has
    the product's axis order. A constant B is read through the same view of its stored codes
    when strides can express it (one copy in `.rodata`), else stored already permuted; a
    per-column zero point is folded into a centred copy as for MatMul."""
    kernel: EinsumKernel = e.kernel
    plan = kernel.plan
    a, b = e.inputs
    value = e.values[1]
    if value is not None and not np.ndim(kernel.matmul.b_zero_point):
        try:
            b, value = axis_view(b, plan.b), None
        except CompileError:
            value = plan.b(value)
    elif value is not None:
        value = plan.b(value)
    else:
        b = axis_view(b, plan.b)
    out = axis_view(e.output, plan.output)
    return _matmul(e, kernel.matmul, axis_view(a, plan.a), b, value, out)


def emit_einsum_sum(e: Emission) -> list[Instruction]:
    """A one-operand Einsum: REDUCE SUM over the trailing axes of the permuted input view (the
    kept ones already in output order), or a MOVE with its rescale for a transposition."""
    kernel: EinsumSumKernel = e.kernel
    x = e.inputs[0].transpose(kernel.perm)
    requant = average_requant(kernel.reduce.stage, 1)
    zero_point = kernel.reduce.input_zero_point
    if not kernel.summed:
        return [
            Move(layer=e.index, src=x, dst=e.output, input_zero_point=zero_point, requant=requant)
        ]
    return [
        Reduce(
            layer=e.index,
            op=ReduceOp.SUM,
            input=x,
            output=e.output,
            requant=requant,
            axes=_axes_mask(tuple(range(x.ndim - kernel.summed, x.ndim))),
            input_zero_point=zero_point,
        )
    ]


def emit_cumsum(e: Emission) -> list[Instruction]:
    """CumSum: a MATMUL of the input (the summed axis moved last, a view) with the constant
    `prefix_matrix`, written through the same view of the output."""
    kernel: CumSumKernel = e.kernel
    x, y = e.inputs[0], e.output
    axis = kernel.axis % x.ndim
    perm = [a for a in range(x.ndim) if a != axis] + [axis]
    matrix = prefix_matrix(x.shape[axis], exclusive=kernel.exclusive, reverse=kernel.reverse)
    return [
        MatMul(
            layer=e.index,
            a=x.transpose(perm),
            b=e.constants.add(matrix, np.dtype(np.int8)),
            output=y.transpose(perm),
            requant=requant_of(kernel.stage, e.constants),
            a_zero_point=kernel.input_zero_point,
        )
    ]


def _matmul(
    e: Emission,
    kernel: MatMulKernel,
    a: Tensor,
    b: Tensor,
    b_value: np.ndarray | None,
    out: Tensor,
) -> list[Instruction]:
    if kernel.trans_a:
        a = _swap_last(a)
    zero_b = np.asarray(kernel.b_zero_point, dtype=np.int64)
    if b_value is not None:
        value = np.asarray(b_value, dtype=np.int64)
        if kernel.trans_b:
            value = np.swapaxes(value, -1, -2)
        if zero_b.ndim:
            b = e.constants.add(value - zero_b)
            zero_b = np.int64(0)
        else:
            b = e.constants.add(np.ascontiguousarray(value), np.dtype(b_value.dtype))
    else:
        if zero_b.ndim:
            raise CompileError(f"{e.layer.name}: per-column zero point on a run-time operand")
        if kernel.trans_b:
            b = _swap_last(b)
    per_column = np.asarray(kernel.stage.multiplier).size > 1
    columns = out.shape[-1] if out.shape else 1
    return [
        MatMul(
            layer=e.index,
            a=a,
            b=b,
            bias=_bias(kernel.bias, e.constants),
            output=out,
            requant=requant_of(
                kernel.stage, e.constants, table_shape=(columns,) if per_column else None
            ),
            a_zero_point=kernel.a_zero_point,
            b_zero_point=int(zero_b),
        )
    ]


def _common_scale(kernel: AddKernel) -> dict[str, int]:
    """The ELTWISE fields of an Add-style operand rescale."""
    (a_m, a_s), (b_m, b_s) = kernel.a_multiplier, kernel.b_multiplier
    return {
        "a_zero_point": kernel.a_zero_point,
        "b_zero_point": kernel.b_zero_point,
        "left_shift": kernel.left_shift,
        "a_multiplier": int(a_m),
        "a_shift": int(a_s),
        "b_multiplier": int(b_m),
        "b_shift": int(b_s),
    }


def emit_eltwise(e: Emission) -> list[Instruction]:
    kernel = e.kernel
    out = e.output
    a, b = (t.broadcast_to(out.shape) for t in e.inputs)
    requant = requant_of(kernel.stage, e.constants)
    common = {"layer": e.index, "a": a, "b": b, "output": out, "requant": requant}
    zero_points = {"a_zero_point": kernel.a_zero_point, "b_zero_point": kernel.b_zero_point}
    if isinstance(kernel, AddKernel):
        op = EltwiseOp.SUB if kernel.subtract else EltwiseOp.ADD
        return [Eltwise(op=op, **_common_scale(kernel), **common)]
    if isinstance(kernel, MulKernel):
        return [Eltwise(op=EltwiseOp.MUL, **zero_points, **common)]
    return [Eltwise(op=EltwiseOp.DIV, left_shift=QUOTIENT_BITS, **zero_points, **common)]


def emit_extremum(e: Emission) -> list[Instruction]:
    """Max / Min: one ELTWISE per pair, folding every further input into the output in place
    (each instruction reads an element of the output before it writes it)."""
    kernel: ExtremumKernel = e.kernel
    out = e.output
    op = EltwiseOp.MAX if kernel.maximum else EltwiseOp.MIN
    operands = [t.broadcast_to(out.shape) for t in e.inputs]
    instructions: list[Instruction] = []
    for index, pair in enumerate(kernel.pairs):
        a = operands[0] if index == 0 else out
        instructions.append(
            Eltwise(
                layer=e.index,
                op=op,
                a=a,
                b=operands[index + 1],
                output=out,
                requant=requant_of(pair.stage, e.constants),
                **_common_scale(pair),
            )
        )
    return instructions


def emit_lut(e: Emission) -> list[Instruction]:
    kernel: LookupKernel = e.kernel
    if kernel.table.ndim == 2 and kernel.axis(len(e.inputs[0].shape)) != 1:
        raise CompileError(
            f"{e.layer.name}: per-channel tables along axis {kernel.axis(len(e.inputs[0].shape))} of a "
            f"{list(e.inputs[0].shape)} input; the LUT instruction's run along the channel axis (1)"
        )
    table = e.constants.add(kernel.table, np.dtype(kernel.table.dtype))
    return [Lut(layer=e.index, input=e.inputs[0], table=table, output=e.output)]


def emit_max_pool(e: Emission) -> list[Instruction]:
    kernel: MaxPoolKernel = e.kernel
    rank = len(kernel.kernel)
    begin, end = resolve_pads(
        e.frame_shapes[0][2:],
        kernel.kernel,
        kernel.strides,
        kernel.dilations,
        kernel.pads,
        kernel.auto_pad,
        ceil_mode=kernel.ceil_mode,
    )
    return [
        Pool(
            layer=e.index,
            op=PoolOp.MAX,
            input=_spatial_2d(e.inputs[0], rank),
            output=_spatial_2d(e.output, rank),
            requant=rescale_requant(kernel.rescale, e.constants),
            kernel=_pair(kernel.kernel),
            strides=_pair(kernel.strides),
            dilations=_pair(kernel.dilations),
            pads=_pads_2d(begin, end),
            pad_value=kernel.pad_value,
            input_zero_point=kernel.rescale.input_zero_point,
        )
    ]


def emit_average_pool(e: Emission) -> list[Instruction]:
    kernel: AveragePoolKernel = e.kernel
    rank = len(kernel.kernel)
    begin, end, count_include_pad = kernel.resolved_pads(e.frame_shapes[0][2:])
    window = math.prod(kernel.kernel)
    stage = kernel.stage
    tables: dict[str, Tensor] = {}
    if not count_include_pad and any(begin + end):
        counts = np.arange(window + 1, dtype=np.float64)
        real = stage.input_scale / (stage.output_scale * np.maximum(counts, 1.0))
        multipliers, shifts = quantize_multiplier(np.where(counts > 0, real, 0.0))
        tables = {
            "count_multipliers": e.constants.add(multipliers, np.int32),
            "count_shifts": e.constants.add(shifts, np.int32),
        }
    return [
        Pool(
            layer=e.index,
            op=PoolOp.AVG,
            input=_spatial_2d(e.inputs[0], rank),
            output=_spatial_2d(e.output, rank),
            requant=average_requant(stage, window),
            kernel=_pair(kernel.kernel),
            strides=_pair(kernel.strides),
            dilations=_pair(kernel.dilations),
            pads=_pads_2d(begin, end),
            input_zero_point=kernel.input_zero_point,
            **tables,
        )
    ]


def _axes_mask(axes: Sequence[int]) -> int:
    return sum(1 << a for a in axes)


def emit_global_pool(e: Emission) -> list[Instruction]:
    kernel = e.kernel
    x = e.inputs[0]
    axes = _axes_mask(range(2, x.ndim))
    if isinstance(kernel, GlobalAveragePoolKernel):
        count = math.prod(e.frame_shapes[0][2:])
        requant = average_requant(kernel.stage, count)
        return [
            Reduce(
                layer=e.index,
                op=ReduceOp.SUM,
                input=x,
                output=e.output,
                requant=requant,
                axes=axes,
                input_zero_point=kernel.input_zero_point,
            )
        ]
    pool: GlobalMaxPoolKernel = kernel
    return [
        Reduce(
            layer=e.index,
            op=ReduceOp.MAX,
            input=x,
            output=e.output,
            requant=rescale_requant(pool.rescale, e.constants),
            axes=axes,
            input_zero_point=pool.rescale.input_zero_point,
        )
    ]


def emit_reduce(e: Emission) -> list[Instruction]:
    kernel = e.kernel
    x, y = e.inputs[0], e.output
    axes = kernel.reduction.resolve(len(e.frame_shapes[0]))
    if isinstance(kernel, ReduceSumKernel):
        count = math.prod(e.frame_shapes[0][a] for a in axes) if kernel.average else 1
        requant: Requant | None = average_requant(kernel.stage, count)
        zero_point = kernel.input_zero_point
        op = ReduceOp.SUM
    else:
        extremum: ReduceExtremumKernel = kernel
        requant = rescale_requant(extremum.rescale, e.constants)
        zero_point = extremum.rescale.input_zero_point
        op = ReduceOp.MAX if extremum.maximum else ReduceOp.MIN
    if not axes:
        return [Move(layer=e.index, src=x, dst=y, input_zero_point=zero_point, requant=requant)]
    return [
        Reduce(
            layer=e.index,
            op=op,
            input=x,
            output=y,
            requant=requant,
            axes=_axes_mask(axes),
            input_zero_point=zero_point,
        )
    ]


def emit_argmax(e: Emission) -> list[Instruction]:
    """ArgMax: REDUCE ARGMAX (first index) or ARGMAX_LAST (select_last_index) over one axis,
    the indices written in the output tensor's type (int64, as ONNX gives them)."""
    kernel: ArgMaxKernel = e.kernel
    axis = kernel.axis % len(e.frame_shapes[0])
    return [
        Reduce(
            layer=e.index,
            op=ReduceOp.ARGMAX_LAST if kernel.select_last else ReduceOp.ARGMAX,
            input=e.inputs[0],
            output=e.output,
            axes=_axes_mask((axis,)),
        )
    ]


def resized_axes(kernel: ResizeKernel, shape: tuple[int, ...]) -> list[tuple[int, int, int, float]]:
    """(axis, in size, out size, scale) of every axis a Resize changes, for a frame's shape."""
    return kernel._geometry(tuple(shape))


def emit_resize(e: Emission) -> list[Instruction]:
    kernel: ResizeKernel = e.kernel
    x, y = e.inputs[0], e.output
    resized = resized_axes(kernel, e.frame_shapes[0])
    if len(resized) > 2:
        raise CompileError(f"{e.layer.name}: the MLA resizes at most two axes at once")
    linear = kernel.mode == "linear"
    tables: dict[str, object] = {}
    for slot, (axis, in_size, out_size, scale) in enumerate(resized):
        coordinates = input_coordinates(out_size, in_size, scale, kernel.coordinate_mode)
        if linear:
            rows = np.stack(linear_taps(coordinates, in_size))
        else:
            rows = nearest_indices(coordinates, in_size, kernel.nearest_mode)[None, :]
        tables[f"axis{slot}"] = axis
        tables[f"table{slot}"] = e.constants.add(rows, np.int32)
    if linear:
        if len(resized) not in kernel.linear_stages:
            raise CompileError(f"{e.layer.name}: linear Resize over {len(resized)} axes overflows")
        requant: Requant | None = requant_of(kernel.linear_stages[len(resized)], e.constants)
        zero_point = kernel.input_zero_point
    else:
        requant = rescale_requant(kernel.rescale, e.constants)
        zero_point = kernel.rescale.input_zero_point
    if not resized:
        return [Move(layer=e.index, src=x, dst=y, input_zero_point=zero_point, requant=requant)]
    return [
        Resize(
            layer=e.index,
            mode=ResizeMode.LINEAR if linear else ResizeMode.NEAREST,
            input=x,
            output=y,
            requant=requant,
            input_zero_point=zero_point,
            **tables,
        )
    ]


def emit_softmax(e: Emission) -> list[Instruction]:
    kernel: SoftmaxKernel = e.kernel
    x, y = e.inputs[0], e.output
    axis = kernel.axis % x.ndim
    if kernel.flatten:
        rows = math.prod(x.shape[:axis])
        x = reshape_view(x, (rows, x.size // max(rows, 1)))
        y = reshape_view(y, x.shape)
        axis = 1
    return [
        Softmax(
            layer=e.index,
            input=x,
            table=e.constants.add(kernel.table, np.int32),
            output=y,
            requant=requant_of(kernel.stage, e.constants),
            axis=axis,
        )
    ]


def emit_layernorm(e: Emission) -> list[Instruction]:
    """LAYERNORM from axis on; per-element tables at the normalised shape, per-channel ones
    (InstanceNormalization) at (C, 1, ..., 1)."""
    kernel: LayerNormKernel = e.kernel
    shape = e.frame_shapes[0]
    axis = kernel.axis % len(shape)
    normalised = tuple(shape[axis:])
    epsilon = normalisation_epsilon(kernel.epsilon, math.prod(normalised), kernel.input_scale)
    unit, unit_shift = quantize_multiplier(2.0**-OUTPUT_FRACTION_BITS)
    signs, multipliers, shifts, offsets = kernel.parameters(len(shape))

    def table(values: np.ndarray, dtype: np.dtype | None = None) -> Tensor:
        if not kernel.per_channel:
            values = np.broadcast_to(values, normalised)
        return e.constants.add(values, dtype)

    return [
        LayerNorm(
            layer=e.index,
            input=e.inputs[0],
            output=e.output,
            signs=table(signs, np.dtype(np.int8)),
            multipliers=table(multipliers, np.dtype(np.int32)),
            shifts=table(shifts, np.dtype(np.int32)),
            offsets=table(offsets, max(narrowest(offsets), np.dtype(np.int32))),
            requant=Requant(
                int(unit), int(unit_shift), kernel.zero_point, kernel.low, kernel.high, kernel.mode
            ),
            input_zero_point=kernel.input_zero_point,
            axis=axis,
            epsilon_term=epsilon,
        )
    ]


def emit_norm_fp16(e: Emission) -> list[Instruction]:
    """NORM_FP16 from axis on; gamma and beta as fp16 tables of the normalised shape, the scale
    and epsilon the kernel derives for this element count as float bit patterns."""
    kernel: Fp16NormKernel = e.kernel
    shape = e.frame_shapes[0]
    axis = kernel.axis % len(shape)
    normalised = tuple(shape[axis:])
    scale, epsilon = kernel.scaled(math.prod(normalised))

    def table(values: np.ndarray | None) -> Tensor | None:
        if values is None:
            return None
        return e.constants.add(np.broadcast_to(values, normalised), np.dtype(np.float16))

    return [
        NormFp16(
            layer=e.index,
            op=NormOp.LAYER if kernel.centre else NormOp.RMS,
            input=e.inputs[0],
            output=e.output,
            gamma=table(kernel.gamma),
            beta=table(kernel.beta),
            input_zero_point=kernel.input_zero_point,
            input_scale=float32_bits(scale),
            axis=axis,
            epsilon=float16_bits(epsilon),
            output_scale=float32_bits(kernel.output_scale),
            output_zero_point=kernel.zero_point,
            low=kernel.low,
            high=kernel.high,
        )
    ]


_SAMPLE_MODES = {"nearest": SampleMode.NEAREST, "bilinear": SampleMode.BILINEAR}
_SAMPLE_PADDINGS = {
    "zeros": SamplePadding.ZEROS,
    "border": SamplePadding.BORDER,
    "reflection": SamplePadding.REFLECTION,
}


def emit_grid_sample(e: Emission) -> list[Instruction]:
    """GRID_SAMPLE_BF16 reading the image and grid codes; the scales as float32 bit patterns."""
    kernel: GridSampleKernel = e.kernel
    return [
        GridSampleBf16(
            layer=e.index,
            mode=_SAMPLE_MODES[kernel.mode],
            padding=_SAMPLE_PADDINGS[kernel.padding],
            input=e.inputs[0],
            grid=e.inputs[1],
            output=e.output,
            align_corners=int(kernel.align_corners),
            input_zero_point=kernel.input_zero_point,
            input_scale=float32_bits(kernel.input_scale),
            grid_zero_point=kernel.grid_zero_point,
            grid_scale=float32_bits(kernel.grid_scale),
            output_scale=float32_bits(kernel.output_scale),
            output_zero_point=kernel.zero_point,
            low=kernel.low,
            high=kernel.high,
        )
    ]


def emit_lrn(e: Emission) -> list[Instruction]:
    kernel: LrnKernel = e.kernel
    return [
        Lrn(
            layer=e.index,
            input=e.inputs[0],
            table=e.constants.add(kernel.table, np.dtype(np.int32)),
            output=e.output,
            requant=requant_of(kernel.stage, e.constants),
            input_zero_point=kernel.input_zero_point,
            size=kernel.size,
            index_shift=kernel.index_shift,
        )
    ]


# --- data movement --------------------------------------------------------------------------------


def _move(e: Emission, src: Tensor, dst: Tensor, rescale: Rescale) -> Move:
    return Move(
        layer=e.index,
        src=src,
        dst=dst,
        input_zero_point=rescale.input_zero_point,
        requant=rescale_requant(rescale, e.constants),
    )


def emit_movement(e: Emission) -> list[Instruction]:
    kernel = e.kernel
    if isinstance(kernel, Rescale):
        return [_move(e, e.inputs[0], e.output, kernel)]
    if isinstance(kernel, ConcatKernel):
        return _emit_concat(e, kernel)
    if isinstance(kernel, SplitKernel):
        return _emit_split(e, kernel)
    move_kernel: MoveKernel = kernel
    op = e.layer.step.pattern
    x, y = e.inputs[0], e.output
    move = move_kernel.move
    args = dict(move.keywords) if isinstance(move, partial) else {}
    rescale = move_kernel.rescale
    if op in VIEW_OPS:
        return [_move(e, reshape_view(x, y.shape), y, rescale)]
    if op == "Transpose":
        perm = args.get("perm") or list(reversed(range(x.ndim)))
        return [_move(e, x.transpose(perm), y, rescale)]
    if op == "Slice":
        return [_move(e, _slice_view(x, **args), y, rescale)]
    if op == "Gather":
        return _emit_gather(e, x, y, args["indices"], int(args["axis"]), rescale)
    if op == "DepthToSpace":
        return [_move(e, *_depth_to_space(x, y, int(args["blocksize"]), args["mode"]), rescale)]
    if op == "SpaceToDepth":
        return [_move(e, *_space_to_depth(x, y, int(args["blocksize"])), rescale)]
    if op == "Expand":
        return [_move(e, x.broadcast_to(y.shape), y, rescale)]
    if op == "Tile":
        return [_move(e, *_tile_views(x, y, args["repeats"]), rescale)]
    if op == "Pad":
        return _emit_pad(e, x, y, args, rescale)
    raise CompileError(f"{e.layer.name}: no MLA code for data movement {op}")


def _slice_view(x: Tensor, starts, ends, axes, steps) -> Tensor:
    """ONNX Slice (clamping rules of `compiler.runtime.ops.movement.slice_axes`) as a view."""
    axes = axes if axes is not None else list(range(len(starts)))
    steps = steps if steps is not None else [1] * len(starts)
    for start, end, axis, step in zip(starts, ends, axes, steps, strict=True):
        axis %= x.ndim
        dim = x.shape[axis]
        low, high = (0, dim) if step > 0 else (-1, dim - 1)
        start = min(max(start + dim if start < 0 else start, low), high)
        end = min(max(end + dim if end < 0 else end, low), high)
        x = stepped(x, axis, start, len(range(start, end, step)), step)
    return x


def _emit_gather(
    e: Emission, x: Tensor, y: Tensor, indices: np.ndarray, axis: int, rescale: Rescale
) -> list[Instruction]:
    return [_move(e, src, dst, rescale) for src, dst in _gather_views(e, x, y, indices, axis)]


def _gather_views(
    e: Emission, x: Tensor, y: Tensor, indices: np.ndarray, axis: int
) -> list[tuple[Tensor, Tensor]]:
    """Constant-index Gather as (source, destination) view pairs: one strided view when the
    indices step evenly, else one per index."""
    indices = np.asarray(indices, dtype=np.int64)
    axis %= x.ndim
    dim = x.shape[axis]
    flat = np.where(indices < 0, indices + dim, indices).reshape(-1)
    if flat.size and (flat.min() < 0 or flat.max() >= dim):
        raise CompileError(f"{e.layer.name}: Gather index out of range")
    if indices.ndim == 0:
        return [(select(x, axis, int(flat[0])), y)]
    dst = y
    if indices.ndim != 1:
        dst = reshape_view(y, (*x.shape[:axis], flat.size, *x.shape[axis + 1 :]))
    if flat.size == 1 or (flat.size > 1 and np.all(np.diff(flat) == flat[1] - flat[0])):
        step = int(flat[1] - flat[0]) if flat.size > 1 else 1
        return [(stepped(x, axis, int(flat[0]), flat.size, step), dst)]
    return [
        (stepped(x, axis, int(index), 1, 1), stepped(dst, axis, k, 1, 1))
        for k, index in enumerate(flat)
    ]


def emit_tabulated_move(e: Emission) -> list[Instruction]:
    """A move through a code table (a bf16 Gather): LUT instructions that read the source
    views and write the destination views."""
    kernel: TabulatedMoveKernel = e.kernel
    op = e.layer.step.pattern
    move = kernel.move
    args = dict(move.keywords) if isinstance(move, partial) else {}
    if op.partition("(")[0] != "Gather":
        raise CompileError(f"{e.layer.name}: no MLA code for a tabulated {op}")
    table = e.constants.add(kernel.table, np.dtype(kernel.table.dtype))
    views = _gather_views(e, e.inputs[0], e.output, args["indices"], int(args["axis"]))
    return [Lut(layer=e.index, input=src, table=table, output=dst) for src, dst in views]


def _depth_to_space(x: Tensor, y: Tensor, block: int, mode: str) -> tuple[Tensor, Tensor]:
    _, channels, height, width = x.shape
    depth = channels // (block * block)
    if mode == "DCR":
        src = split_axis(x, 1, (block, block, depth)).transpose((0, 3, 4, 1, 5, 2))
    else:
        src = split_axis(x, 1, (depth, block, block)).transpose((0, 1, 4, 2, 5, 3))
    dst = split_axis(split_axis(y, 3, (width, block)), 2, (height, block))
    return src, dst


def _space_to_depth(x: Tensor, y: Tensor, block: int) -> tuple[Tensor, Tensor]:
    _, channels, height, width = x.shape
    src = split_axis(split_axis(x, 3, (width // block, block)), 2, (height // block, block))
    src = src.transpose((0, 3, 5, 1, 2, 4))
    dst = split_axis(y, 1, (block, block, channels))
    return src, dst


def _tile_views(x: Tensor, y: Tensor, repeats: Sequence[int]) -> tuple[Tensor, Tensor]:
    """np.tile as one MOVE: y viewed as (r0, x0, r1, x1, …), x broadcast over the r axes."""
    src, dst = x, y
    for axis in reversed(range(x.ndim)):
        count = int(repeats[axis])
        src = insert_axis(src, axis)
        src = replace(src, shape=(*src.shape[:axis], count, *src.shape[axis + 1 :]))
        dst = split_axis(dst, axis, (count, x.shape[axis]))
    return src, dst


def _emit_pad(e: Emission, x: Tensor, y: Tensor, args: dict, rescale: Rescale) -> list[Instruction]:
    """Pad: the interior is one MOVE; constant mode FILLs first, other modes copy edges after.

    Edge / reflect / wrap follow np.pad: axis by axis, each pass reading the output written so
    far (earlier axes already padded, later axes still interior).
    """
    mode = args["mode"]
    pads = [int(p) for p in args["pads"]]
    axes = args.get("axes")
    axes = [a % x.ndim for a in axes] if axes is not None else list(range(x.ndim))
    widths = [(0, 0)] * x.ndim
    for i, axis in enumerate(axes):
        widths[axis] = (pads[i], pads[i + len(axes)])
    if mode != "constant" and any(b < 0 or a < 0 for a, b in widths):
        raise CompileError(f"{e.layer.name}: a cropping Pad in {mode} mode")
    src, interior = x, y
    for axis, (begin, end) in enumerate(widths):
        crop_begin, crop_end = max(-begin, 0), max(-end, 0)
        count = src.shape[axis] - crop_begin - crop_end
        src = stepped(src, axis, crop_begin, count, 1)
        interior = stepped(interior, axis, max(begin, 0), count, 1)
    grows = any(b > 0 or a > 0 for a, b in widths)
    instructions: list[Instruction] = []
    if mode == "constant":
        if grows:
            code = np.asarray([args["value"]], dtype=x.dtype.numpy)
            instructions.append(Fill(layer=e.index, dst=y, value=int(rescale(code)[0])))
        instructions.append(_move(e, src, interior, rescale))
        return instructions
    instructions.append(_move(e, src, interior, rescale))
    for axis, (begin, end) in enumerate(widths):
        size = interior.shape[axis]
        if max(begin, end) > (size - 1 if mode == "reflect" else size):
            raise CompileError(f"{e.layer.name}: {mode} padding wider than the tensor")
        base = y
        for other in range(axis + 1, y.ndim):
            base = stepped(base, other, widths[other][0], interior.shape[other], 1)
        for target, count, (source, step) in _pad_sources(mode, size, begin, end):
            instructions.append(
                Move(
                    layer=e.index,
                    src=stepped(base, axis, source, count, step),
                    dst=stepped(base, axis, target, count, 1),
                )
            )
    return instructions


def _pad_sources(mode: str, size: int, begin: int, end: int) -> list[tuple[int, int, tuple]]:
    """(target start, count, (source start, step)) of each pad region along one axis."""
    last = begin + size - 1
    regions = []
    if begin > 0:
        source = {"edge": (begin, 0), "reflect": (2 * begin, -1), "wrap": (size, 1)}[mode]
        regions.append((0, begin, source))
    if end > 0:
        source = {"edge": (last, 0), "reflect": (last - 1, -1), "wrap": (begin, 1)}[mode]
        regions.append((last + 1, end, source))
    return regions


def _emit_concat(e: Emission, kernel: ConcatKernel) -> list[Instruction]:
    y = e.output
    axis = kernel.axis % y.ndim
    instructions = []
    offset = 0
    for x, rescale in zip(e.inputs, kernel.rescales, strict=True):
        count = x.shape[axis]
        instructions.append(_move(e, x, stepped(y, axis, offset, count, 1), rescale))
        offset += count
    return instructions


def _emit_split(e: Emission, kernel: SplitKernel) -> list[Instruction]:
    x = e.inputs[0]
    axis = kernel.axis % x.ndim
    count = len(kernel.rescales)
    sizes = kernel.sizes
    if sizes is None:
        chunk = -(-x.shape[axis] // count)
        sizes = tuple(min(chunk, x.shape[axis] - i * chunk) for i in range(count))
    instructions = []
    offset = 0
    for y, size, rescale in zip(e.outputs, sizes, kernel.rescales, strict=True):
        if y is not None:
            instructions.append(_move(e, stepped(x, axis, offset, size, 1), y, rescale))
        offset += size
    return instructions


EMITTERS: dict[type, Callable[[Emission], list[Instruction]]] = {
    ConvKernel: emit_conv,
    ConvTransposeKernel: emit_conv_transpose,
    MatMulKernel: emit_matmul,
    EinsumKernel: emit_einsum,
    EinsumSumKernel: emit_einsum_sum,
    CumSumKernel: emit_cumsum,
    AddKernel: emit_eltwise,
    MulKernel: emit_eltwise,
    DivKernel: emit_eltwise,
    ExtremumKernel: emit_extremum,
    LookupKernel: emit_lut,
    MaxPoolKernel: emit_max_pool,
    AveragePoolKernel: emit_average_pool,
    GlobalAveragePoolKernel: emit_global_pool,
    GlobalMaxPoolKernel: emit_global_pool,
    ReduceSumKernel: emit_reduce,
    ReduceExtremumKernel: emit_reduce,
    ArgMaxKernel: emit_argmax,
    ResizeKernel: emit_resize,
    SoftmaxKernel: emit_softmax,
    LayerNormKernel: emit_layernorm,
    Fp16NormKernel: emit_norm_fp16,
    GridSampleKernel: emit_grid_sample,
    LrnKernel: emit_lrn,
    MoveKernel: emit_movement,
    TabulatedMoveKernel: emit_tabulated_move,
    ConcatKernel: emit_movement,
    SplitKernel: emit_movement,
    Rescale: emit_movement,
}

_PER_SAMPLE = (
    ConvKernel,
    ConvTransposeKernel,
    LookupKernel,
    MaxPoolKernel,
    AveragePoolKernel,
    GlobalAveragePoolKernel,
    GlobalMaxPoolKernel,
    AddKernel,
    MulKernel,
    DivKernel,
    ExtremumKernel,
    LrnKernel,
    GridSampleKernel,
)


def writes_c_order_only(layer: Layer) -> bool:
    """Layers whose output must be C-ordered (they reshape it): never written to HWC DRAM."""
    kernel = layer.step.kernel
    if isinstance(kernel, SoftmaxKernel):
        return kernel.flatten
    gather = layer.step.pattern.partition("(")[0] == "Gather"
    if isinstance(kernel, MoveKernel | TabulatedMoveKernel) and gather:
        move = kernel.move
        indices = move.keywords.get("indices") if isinstance(move, partial) else None
        return indices is not None and np.ndim(indices) > 1
    return False


def batches_over_axis0(layer: Layer, frame_shapes: Sequence[tuple[int, ...]]) -> bool:
    """Whether one instruction may process every frame (axis 0 = independent samples)."""
    kernel = layer.step.kernel
    shape = frame_shapes[0]
    if isinstance(kernel, _PER_SAMPLE):
        return True
    if isinstance(kernel, ResizeKernel):
        return all(axis != 0 for axis, *_ in resized_axes(kernel, shape))
    if isinstance(kernel, SoftmaxKernel):
        return not kernel.flatten and kernel.axis % len(shape) != 0
    if isinstance(kernel, LayerNormKernel | Fp16NormKernel):
        return kernel.axis % len(shape) != 0
    if isinstance(kernel, ReduceSumKernel | ReduceExtremumKernel):
        return 0 not in kernel.reduction.resolve(len(shape))
    if isinstance(kernel, ArgMaxKernel | CumSumKernel):
        return kernel.axis % len(shape) != 0
    if isinstance(kernel, MatMulKernel):
        return not kernel.trans_a and len(shape) >= 2
    return False


def emit_layer(
    layer: Layer,
    index: int,
    storages: Mapping[str, Storage],
    values: Mapping[str, np.ndarray],
    constants: Constants,
    batch: int,
) -> list[Instruction]:
    """Every instruction of one layer, over all frames at once when the layer allows it."""
    step = layer.step
    emitter = EMITTERS.get(type(step.kernel))
    if emitter is None:
        raise CompileError(f"{layer.name}: no MLA code for {type(step.kernel).__name__}")
    names = [n for n in step.inputs]
    frame_shapes = tuple(
        tuple(storages[n].shape) if n in storages else tuple(np.shape(values[n])) for n in names
    )
    run_time = [storages[n] for n in (*names, *step.outputs) if n and n in storages]
    together = batch > 1 and batches_over_axis0(layer, frame_shapes)
    together = together and all(s.batched() is not None for s in run_time)
    if isinstance(step.kernel, MatMulKernel):
        if names[1] in storages:
            together = together and len(storages[names[1]].shape) >= 3
    elif run_time:
        rank = len(run_time[-1].shape)
        together = together and all(len(s.shape) == rank for s in run_time)
    frames = [None] if batch == 1 or together else list(range(batch))
    instructions: list[Instruction] = []
    for frame in frames:

        def view(name: str, frame: int | None = frame) -> Tensor:
            storage = storages[name]
            if frame is None:
                return storage.batched() if batch > 1 else storage.frame(0)
            return storage.frame(frame)

        inputs = []
        input_values = []
        for name in names:
            if name in storages:
                inputs.append(view(name))
                input_values.append(None)
            else:
                array = np.asarray(values[name])
                inputs.append(constants.add(array, array.dtype))
                input_values.append(array)
        outputs = tuple(view(n) if n else None for n in step.outputs)
        emission = Emission(
            layer, index, tuple(inputs), tuple(input_values), outputs, frame_shapes, constants
        )
        instructions.extend(emitter(emission))
    return instructions


def emit_copy(src: Tensor, dst: Tensor, index: int) -> Instruction:
    """DMA between memories: LOAD into the arena, STORE out of it, MOVE DRAM to DRAM."""
    if dst.space == Space.ARENA and src.space in (Space.DRAM, Space.CONST):
        return Load(layer=index, src=src, dst=dst)
    if src.space == Space.ARENA and dst.space == Space.DRAM:
        return Store(layer=index, src=src, dst=dst)
    return Move(layer=index, src=src, dst=dst)
