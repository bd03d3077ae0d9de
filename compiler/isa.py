"""The virtual MLA instruction set: tensor descriptors, instructions, binary encoding, programs.

This module is the contract between the code generator (`compiler.lower`), the ELF writer
(`compiler.elf`), the emulator (`compiler.runtime.emulator`) and the cost model
(`compiler.costmodel`). docs/mla-isa.md is its prose version; the two must agree.

Every operand is a `Tensor` descriptor: (memory space, byte offset, logical shape, byte strides,
dtype). Logical shapes are in ONNX order (NCHW for 4-D activations); the physical layout (NCHW,
HWC, HWC16, a transposed or sliced view, a broadcast) is entirely in the strides, so data
movement ops (Transpose, Slice, DepthToSpace, Expand, Concat, Split, Pad) are strided MOVEs and
need no instruction of their own.

Every instruction carries exactly the build-time constants of one reference kernel in
`compiler.runtime.ops` (centred weights, int32/int64 biases, per-channel (M, n), lookup tables,
clamp bounds), as immediates or as descriptors into the read-only CONST space (`.rodata`).

Binary form (little-endian, versioned): a 16-byte stream header, then per instruction a 16-byte
header, `n_imm` int64 immediates and `n_desc` 80-byte descriptors, in the order the dataclass
fields are declared. `decode(encode(x)) == x` exactly.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, ClassVar, Literal

import numpy as np
import numpy.typing as npt

from compiler.intmath import REQUANTIZATION_MODES, RequantizationMode

ISA_VERSION = 4
"""Bumped whenever the binary encoding or the meaning of a field changes (3: NORM_FP16 and the
FLOAT16 dtype; 4: GRID_SAMPLE_BF16)."""

TEXT_MAGIC = b"MLAT"
MAX_RANK = 8
STREAM_HEADER = struct.Struct("<4sHHII")
"""magic, version, header size, instruction count, reserved (0)."""
INSTRUCTION_HEADER = struct.Struct("<HHIIBBH")
"""opcode, flags (0), size in bytes (header included), layer index, n_imm, n_desc, reserved (0)."""
DESCRIPTOR = struct.Struct(f"<BBBBIQ{MAX_RANK}I{MAX_RANK}i")
"""space, dtype, rank, reserved, reserved, offset, shape[MAX_RANK], strides[MAX_RANK] (bytes)."""
IMMEDIATE = struct.Struct("<q")


class IsaError(ValueError):
    """An instruction cannot be encoded, or bytes are not a valid instruction stream."""


# --- enumerations --------------------------------------------------------------------------------


class Space(IntEnum):
    """Memory spaces. CONST is the program's `.rodata`, read-only, addressed from its start."""

    NONE = 0
    DRAM = 1
    ARENA = 2
    CONST = 3


class DType(IntEnum):
    """Element types a descriptor can hold (int64 only for wide constants such as big biases;
    FLOAT16 only for the gamma / beta constants of NORM_FP16)."""

    INT8 = 1
    UINT8 = 2
    INT16 = 3
    UINT16 = 4
    INT32 = 5
    UINT32 = 6
    INT64 = 7
    FLOAT16 = 8

    @property
    def numpy(self) -> np.dtype:
        return _NUMPY_DTYPES[self]

    @property
    def itemsize(self) -> int:
        return self.numpy.itemsize

    @classmethod
    def of(cls, dtype: DType | npt.DTypeLike) -> DType:
        """The DType of a numpy dtype (or a DType, returned unchanged)."""
        if isinstance(dtype, DType):
            return dtype
        name = np.dtype(dtype).name
        for member, numpy_name in _NUMPY_NAMES.items():
            if numpy_name == name:
                return member
        raise IsaError(f"the MLA has no {name} tensors")


_NUMPY_NAMES = {
    DType.INT8: "int8",
    DType.UINT8: "uint8",
    DType.INT16: "int16",
    DType.UINT16: "uint16",
    DType.INT32: "int32",
    DType.UINT32: "uint32",
    DType.INT64: "int64",
    DType.FLOAT16: "float16",
}

_NUMPY_DTYPES = {member: np.dtype(name).newbyteorder("<") for member, name in _NUMPY_NAMES.items()}
"""The little-endian numpy dtype of every DType, made once (the emulator asks per operand)."""


class Opcode(IntEnum):
    LOAD = 0x01
    STORE = 0x02
    MOVE = 0x03
    FILL = 0x04
    CONV = 0x10
    CONV_TRANSPOSE = 0x11
    MATMUL = 0x12
    ELTWISE = 0x20
    LUT = 0x21
    POOL = 0x22
    REDUCE = 0x23
    RESIZE = 0x24
    SOFTMAX = 0x30
    LAYERNORM = 0x31
    LRN = 0x32
    NORM_FP16 = 0x33
    GRID_SAMPLE_BF16 = 0x34


class EltwiseOp(IntEnum):
    ADD = 0
    SUB = 1
    MUL = 2
    DIV = 3
    MAX = 4
    MIN = 5


class PoolOp(IntEnum):
    MAX = 0
    AVG = 1


class ReduceOp(IntEnum):
    SUM = 0
    MAX = 1
    MIN = 2
    ARGMAX = 3
    ARGMAX_LAST = 4


class ResizeMode(IntEnum):
    NEAREST = 0
    LINEAR = 1


class NormOp(IntEnum):
    """What NORM_FP16 normalises: LAYER subtracts the mean and adds beta, RMS does neither."""

    LAYER = 0
    RMS = 1


class SampleMode(IntEnum):
    """How GRID_SAMPLE_BF16 reads the image at a sampling point."""

    NEAREST = 0
    BILINEAR = 1


class SamplePadding(IntEnum):
    """What GRID_SAMPLE_BF16 reads outside the image (ONNX GridSample's padding_mode)."""

    ZEROS = 0
    BORDER = 1
    REFLECTION = 2


def float32_bits(value: float) -> int:
    """The IEEE binary32 bit pattern of `value` (rounded to float32), for an immediate."""
    return int(np.array(value, dtype=np.float32).view(np.uint32))


def float32_value(bits: int) -> np.float32:
    """The float32 whose bit pattern is the low 32 bits of `bits`."""
    return np.array(bits & 0xFFFFFFFF, dtype=np.uint32).view(np.float32)[()]


def float16_bits(value: float) -> int:
    """The IEEE binary16 bit pattern of `value` (rounded to fp16, half to even)."""
    return int(np.array(value, dtype=np.float16).view(np.uint16))


def float16_value(bits: int) -> np.float16:
    """The fp16 whose bit pattern is the low 16 bits of `bits`."""
    return np.array(bits & 0xFFFF, dtype=np.uint16).view(np.float16)[()]


Layout = Literal["NCHW", "HWC", "HWC16"]
LAYOUTS: tuple[Layout, ...] = ("NCHW", "HWC", "HWC16")


# --- tensor descriptors --------------------------------------------------------------------------


@dataclass(frozen=True)
class Tensor:
    """Where a tensor lives: element (i0, i1, ...) is at `offset + sum(i_k * strides[k])` bytes.

    Strides are in bytes and may be negative (reversed slices) or zero (broadcasts). The offset
    is relative to the start of the memory space.
    """

    space: Space
    dtype: DType
    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "space", Space(self.space))
        object.__setattr__(self, "dtype", DType.of(self.dtype))
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        object.__setattr__(self, "strides", tuple(int(s) for s in self.strides))
        object.__setattr__(self, "offset", int(self.offset))
        if len(self.shape) != len(self.strides):
            raise IsaError(f"shape {self.shape} and strides {self.strides} differ in rank")
        if len(self.shape) > MAX_RANK:
            raise IsaError(f"rank {len(self.shape)} exceeds the MLA maximum of {MAX_RANK}")
        if any(s < 0 for s in self.shape):
            raise IsaError(f"negative dimension in {self.shape}")
        if self.space == Space.NONE:
            raise IsaError("a tensor must live in DRAM, ARENA or CONST")

    @classmethod
    def contiguous(
        cls,
        space: Space,
        dtype: DType | npt.DTypeLike,
        offset: int,
        shape: Sequence[int],
    ) -> Tensor:
        """A C-ordered (row-major) tensor."""
        dtype = DType.of(dtype)
        return cls(space, dtype, offset, tuple(shape), contiguous_strides(shape, dtype.itemsize))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def size(self) -> int:
        """Number of logical elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the logical elements (what an instruction reads or writes)."""
        return self.size * self.itemsize

    @property
    def is_contiguous(self) -> bool:
        return self.strides == contiguous_strides(self.shape, self.itemsize)

    def span(self) -> tuple[int, int]:
        """[first, last + 1) byte range of the space the tensor touches (empty: (offset, offset))."""
        if self.size == 0:
            return self.offset, self.offset
        low = self.offset + sum(
            min(0, (n - 1) * s) for n, s in zip(self.shape, self.strides, strict=True)
        )
        high = self.offset + sum(
            max(0, (n - 1) * s) for n, s in zip(self.shape, self.strides, strict=True)
        )
        return low, high + self.itemsize

    def slice(self, axis: int, start: int, stop: int, step: int = 1) -> Tensor:
        """The elements range(start, stop, step) along `axis` (no negative-index wrapping).

        Indices are taken literally, like np.arange, so a negative step can run down to index 0
        with stop = -1; every index must lie inside the axis (resolve ONNX clamping first).
        """
        axis %= self.ndim
        if step == 0:
            raise IsaError("slice step must not be 0")
        indices = range(start, stop, step)
        if len(indices) and not (
            0 <= indices[0] < self.shape[axis] and 0 <= indices[-1] < self.shape[axis]
        ):
            raise IsaError(
                f"slice {start}:{stop}:{step} leaves axis {axis} of size {self.shape[axis]}"
            )
        shape = list(self.shape)
        strides = list(self.strides)
        offset = self.offset + (indices[0] * strides[axis] if len(indices) else 0)
        shape[axis] = len(indices)
        strides[axis] *= step
        return dataclasses.replace(self, offset=offset, shape=tuple(shape), strides=tuple(strides))

    def transpose(self, perm: Sequence[int]) -> Tensor:
        """The view np.transpose(x, perm)."""
        if sorted(perm) != list(range(self.ndim)):
            raise IsaError(f"{tuple(perm)} is not a permutation of {self.ndim} axes")
        return dataclasses.replace(
            self,
            shape=tuple(self.shape[p] for p in perm),
            strides=tuple(self.strides[p] for p in perm),
        )

    def reshape(self, shape: Sequence[int]) -> Tensor:
        """The same bytes with another C-ordered shape (the tensor must be contiguous)."""
        shape = tuple(int(s) for s in shape)
        if math.prod(shape) != self.size:
            raise IsaError(f"cannot reshape {self.shape} to {shape}")
        if not self.is_contiguous:
            raise IsaError("only a contiguous tensor can be reshaped in place; MOVE it first")
        return Tensor.contiguous(self.space, self.dtype, self.offset, shape)

    def broadcast_to(self, shape: Sequence[int]) -> Tensor:
        """The view np.broadcast_to(x, shape): broadcast axes get stride 0."""
        shape = tuple(int(s) for s in shape)
        lead = len(shape) - self.ndim
        if lead < 0:
            raise IsaError(f"cannot broadcast {self.shape} to {shape}")
        strides = [0] * lead
        for own, stride, target in zip(self.shape, self.strides, shape[lead:], strict=True):
            if own == target:
                strides.append(stride)
            elif own == 1:
                strides.append(0)
            else:
                raise IsaError(f"cannot broadcast {self.shape} to {shape}")
        return dataclasses.replace(self, shape=shape, strides=tuple(strides))

    def to_json(self) -> dict[str, Any]:
        return {
            "space": self.space.name,
            "dtype": self.dtype.numpy.name,
            "offset": self.offset,
            "shape": list(self.shape),
            "strides": list(self.strides),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Tensor:
        return cls(
            Space[data["space"]],
            DType.of(data["dtype"]),
            int(data["offset"]),
            tuple(data["shape"]),
            tuple(data["strides"]),
        )


def contiguous_strides(shape: Sequence[int], itemsize: int) -> tuple[int, ...]:
    """Byte strides of a C-ordered array."""
    strides = []
    step = itemsize
    for dim in reversed(tuple(shape)):
        strides.append(step)
        step *= max(int(dim), 1)
    return tuple(reversed(strides))


HWC16_CHANNEL_ALIGN = 16


def layout_strides(
    shape: Sequence[int], dtype: DType | npt.DTypeLike, layout: Layout
) -> tuple[int, ...]:
    """Byte strides of a logical NCHW tensor stored in DRAM layout `layout`.

    NCHW is C order. HWC stores N, H, W, C in C order (channels innermost). HWC16 is HWC with the
    channel pitch rounded up to a multiple of 16 elements (the padding lanes are never read).
    Tensors of rank other than 4 are always C order.
    """
    if layout not in LAYOUTS:
        raise IsaError(f"unknown DRAM layout {layout!r}; expected one of {LAYOUTS}")
    itemsize = DType.of(dtype).itemsize
    shape = tuple(shape)
    if layout == "NCHW" or len(shape) != 4:
        return contiguous_strides(shape, itemsize)
    _, c, h, w = shape
    pitch = -(-c // HWC16_CHANNEL_ALIGN) * HWC16_CHANNEL_ALIGN if layout == "HWC16" else c
    return (h * w * pitch * itemsize, itemsize, w * pitch * itemsize, pitch * itemsize)


def layout_nbytes(shape: Sequence[int], dtype: DType | npt.DTypeLike, layout: Layout) -> int:
    """Bytes a tensor occupies in `layout` (HWC16 includes the channel padding)."""
    shape = tuple(shape)
    itemsize = DType.of(dtype).itemsize
    if layout == "HWC16" and len(shape) == 4:
        n, c, h, w = shape
        return n * h * w * (-(-c // HWC16_CHANNEL_ALIGN) * HWC16_CHANNEL_ALIGN) * itemsize
    return math.prod(shape) * itemsize


def layout_tensor(
    space: Space,
    dtype: DType | npt.DTypeLike,
    offset: int,
    shape: Sequence[int],
    layout: Layout,
) -> Tensor:
    """Descriptor of a logical NCHW tensor stored in `layout` at `offset`."""
    dtype = DType.of(dtype)
    return Tensor(space, dtype, offset, tuple(shape), layout_strides(shape, dtype, layout))


# --- the output stage ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Requant:
    """acc -> saturate to int32 -> requantize by (M, n) -> + zero_point -> clamp [low, high].

    `multiplier` / `shift` are immediates for a per-tensor multiplier, or int32 CONST tensors
    that broadcast (numpy rules) against the instruction's output, e.g. shape (C, 1, 1) for a
    per-output-channel Conv, (N,) for a per-column MatMul. `low`/`high` are the output type range
    narrowed by a fused Relu/Clip. This is `compiler.runtime.ops.base.OutputStage`.
    """

    multiplier: int | Tensor
    shift: int | Tensor
    zero_point: int
    low: int
    high: int
    mode: RequantizationMode = "sima"

    def __post_init__(self) -> None:
        if self.mode not in REQUANTIZATION_MODES:
            raise IsaError(f"requantization mode {self.mode!r}; expected {REQUANTIZATION_MODES}")
        for name in ("multiplier", "shift"):
            value = getattr(self, name)
            if not isinstance(value, Tensor):
                object.__setattr__(self, name, int(value))
        for name in ("zero_point", "low", "high"):
            object.__setattr__(self, name, int(getattr(self, name)))


# --- instructions --------------------------------------------------------------------------------

_KIND = "isa_kind"


def _tensor() -> Any:
    return field(metadata={_KIND: "tensor"})


def _optional_tensor() -> Any:
    return field(default=None, metadata={_KIND: "tensor?"})


def _int(default: int | None = None) -> Any:
    if default is None:
        return field(metadata={_KIND: "int"})
    return field(default=default, metadata={_KIND: "int"})


def _ints(count: int, default: tuple[int, ...] | None = None) -> Any:
    kind = ("ints", count)
    if default is None:
        return field(metadata={_KIND: kind})
    return field(default=default, metadata={_KIND: kind})


def _enum(enum: type[IntEnum], default: IntEnum | None = None) -> Any:
    if default is None:
        return field(metadata={_KIND: ("enum", enum)})
    return field(default=default, metadata={_KIND: ("enum", enum)})


def _requant() -> Any:
    return field(metadata={_KIND: "requant"})


def _optional_requant() -> Any:
    return field(default=None, metadata={_KIND: "requant?"})


@dataclass(frozen=True, kw_only=True)
class Instruction:
    """Base of every instruction. `layer` indexes `ProgramMetadata.layers` (the ONNX op name)."""

    OPCODE: ClassVar[Opcode]
    layer: int = 0

    def __post_init__(self) -> None:
        for item in dataclasses.fields(self):
            kind = item.metadata.get(_KIND)
            value = getattr(self, item.name)
            if isinstance(kind, tuple) and kind[0] == "ints":
                value = tuple(int(v) for v in value)
                if len(value) != kind[1]:
                    raise IsaError(f"{type(self).__name__}.{item.name} needs {kind[1]} integers")
                object.__setattr__(self, item.name, value)
            elif isinstance(kind, tuple) and kind[0] == "enum":
                object.__setattr__(self, item.name, kind[1](value))
            elif kind == "int":
                object.__setattr__(self, item.name, int(value))

    @property
    def mnemonic(self) -> str:
        return self.OPCODE.name

    def operands(self) -> dict[str, Tensor]:
        """Every tensor the instruction touches, by field name (requant tables included)."""
        found: dict[str, Tensor] = {}
        for item in dataclasses.fields(self):
            value = getattr(self, item.name)
            if isinstance(value, Tensor):
                found[item.name] = value
            elif isinstance(value, Requant):
                for part in ("multiplier", "shift"):
                    if isinstance(getattr(value, part), Tensor):
                        found[f"{item.name}.{part}"] = getattr(value, part)
        return found

    def outputs(self) -> dict[str, Tensor]:
        """The tensors the instruction writes."""
        return {name: t for name, t in self.operands().items() if name in _OUTPUT_FIELDS}

    def inputs(self) -> dict[str, Tensor]:
        """The tensors the instruction reads."""
        return {name: t for name, t in self.operands().items() if name not in _OUTPUT_FIELDS}


_OUTPUT_FIELDS = frozenset({"output", "dst"})


@dataclass(frozen=True, kw_only=True)
class Load(Instruction):
    """DMA copy DRAM or CONST -> ARENA. `src` and `dst` have the same shape and dtype."""

    OPCODE: ClassVar[Opcode] = Opcode.LOAD
    src: Tensor = _tensor()
    dst: Tensor = _tensor()


@dataclass(frozen=True, kw_only=True)
class Store(Instruction):
    """DMA copy ARENA -> DRAM. `src` and `dst` have the same shape and dtype."""

    OPCODE: ClassVar[Opcode] = Opcode.STORE
    src: Tensor = _tensor()
    dst: Tensor = _tensor()


@dataclass(frozen=True, kw_only=True)
class Move(Instruction):
    """Strided copy with an optional rescale: Reshape, Transpose, Slice, Concat, Split, Pad, ...

    Without `requant` the codes are copied (same dtype). With it every element becomes
    requant(src - input_zero_point): `compiler.runtime.ops.base.Rescale`.
    """

    OPCODE: ClassVar[Opcode] = Opcode.MOVE
    src: Tensor = _tensor()
    dst: Tensor = _tensor()
    input_zero_point: int = _int(0)
    requant: Requant | None = _optional_requant()


@dataclass(frozen=True, kw_only=True)
class Fill(Instruction):
    """Set every element of `dst` to `value` (the pad code of a constant Pad)."""

    OPCODE: ClassVar[Opcode] = Opcode.FILL
    dst: Tensor = _tensor()
    value: int = _int()


@dataclass(frozen=True, kw_only=True)
class Conv(Instruction):
    """2-D grouped convolution (N, C, H, W) * (M, C/group, kh, kw) with fused bias and stage.

    acc = sum (x - input_zero_point) * weight + bias (int64, padding holds the zero point), then
    `requant`. `weight` holds centred codes (w - z_w); `pads` = (top, left, bottom, right),
    already resolved from auto_pad. 1-D convolutions use H = kh = 1.
    """

    OPCODE: ClassVar[Opcode] = Opcode.CONV
    input: Tensor = _tensor()
    weight: Tensor = _tensor()
    bias: Tensor | None = _optional_tensor()
    output: Tensor = _tensor()
    requant: Requant = _requant()
    input_zero_point: int = _int(0)
    strides: tuple[int, int] = _ints(2, (1, 1))
    dilations: tuple[int, int] = _ints(2, (1, 1))
    pads: tuple[int, int, int, int] = _ints(4, (0, 0, 0, 0))
    group: int = _int(1)


@dataclass(frozen=True, kw_only=True)
class ConvTranspose(Instruction):
    """2-D transposed convolution, weight (C, M/group, kh, kw) centred, fused bias and stage.

    Every tap scatters x @ w[:, :, tap] to tap * dilation + i * stride of the full result
    (size stride*(in-1) + output_padding + (k-1)*dilation + 1), which is then cropped by
    `crop` = (top, left, bottom, right) (resolved from pads / output_shape / auto_pad).
    """

    OPCODE: ClassVar[Opcode] = Opcode.CONV_TRANSPOSE
    input: Tensor = _tensor()
    weight: Tensor = _tensor()
    bias: Tensor | None = _optional_tensor()
    output: Tensor = _tensor()
    requant: Requant = _requant()
    input_zero_point: int = _int(0)
    strides: tuple[int, int] = _ints(2, (1, 1))
    dilations: tuple[int, int] = _ints(2, (1, 1))
    crop: tuple[int, int, int, int] = _ints(4, (0, 0, 0, 0))
    output_padding: tuple[int, int] = _ints(2, (0, 0))
    group: int = _int(1)


@dataclass(frozen=True, kw_only=True)
class MatMul(Instruction):
    """Batched matrix product with numpy broadcasting, fused bias and stage (MatMul, Gemm).

    acc = (a - a_zero_point) @ (b - b_zero_point) + bias. Transposed operands (Gemm transA /
    transB) are transposed views; a per-column weight zero point is folded into a centred
    constant `b` (int16) with b_zero_point = 0. `bias` broadcasts against the output.
    """

    OPCODE: ClassVar[Opcode] = Opcode.MATMUL
    a: Tensor = _tensor()
    b: Tensor = _tensor()
    bias: Tensor | None = _optional_tensor()
    output: Tensor = _tensor()
    requant: Requant = _requant()
    a_zero_point: int = _int(0)
    b_zero_point: int = _int(0)


@dataclass(frozen=True, kw_only=True)
class Eltwise(Instruction):
    """Binary Add / Sub / Mul / Div / Max / Min with numpy broadcasting (TFLite formulation).

    ADD/SUB: a' = rq((a - za) << left_shift, a_multiplier, a_shift), b' likewise, acc = a' +- b'.
    MAX/MIN: a', b' as for ADD, acc = max(a', b') / min(a', b').
    MUL: acc = (a - za) * (b - zb).
    DIV: acc = round_half_up(((a - za) << left_shift) / (b - zb)), x / 0 -> sign(x) * INT32_MAX.
    Then `requant`. The a/b multipliers use `requant.mode`.
    """

    OPCODE: ClassVar[Opcode] = Opcode.ELTWISE
    op: EltwiseOp = _enum(EltwiseOp)
    a: Tensor = _tensor()
    b: Tensor = _tensor()
    output: Tensor = _tensor()
    requant: Requant = _requant()
    a_zero_point: int = _int(0)
    b_zero_point: int = _int(0)
    left_shift: int = _int(0)
    a_multiplier: int = _int(0)
    a_shift: int = _int(0)
    b_multiplier: int = _int(0)
    b_shift: int = _int(0)


@dataclass(frozen=True, kw_only=True)
class Lut(Instruction):
    """y = table[x - min(input dtype)]; 256 entries for 8-bit inputs, 65536 for 16-bit."""

    OPCODE: ClassVar[Opcode] = Opcode.LUT
    input: Tensor = _tensor()
    table: Tensor = _tensor()
    output: Tensor = _tensor()


@dataclass(frozen=True, kw_only=True)
class Pool(Instruction):
    """2-D MaxPool / AveragePool over (N, C, H, W); global pools use kernel = (H, W).

    MAX: padding holds `pad_value` (the type minimum), window max, then the optional rescale
    requant(max - input_zero_point). AVG: acc = window sum of (x - input_zero_point) (padding
    0) and requant; with `count_multipliers` / `count_shifts` (int32 tables indexed by the
    number of non-padding elements under the window, count_include_pad=0) the (M, n) pair is
    taken from the tables instead of `requant`. `pads` = (top, left, bottom, right).
    """

    OPCODE: ClassVar[Opcode] = Opcode.POOL
    op: PoolOp = _enum(PoolOp)
    input: Tensor = _tensor()
    output: Tensor = _tensor()
    requant: Requant | None = _optional_requant()
    kernel: tuple[int, int] = _ints(2)
    strides: tuple[int, int] = _ints(2, (1, 1))
    dilations: tuple[int, int] = _ints(2, (1, 1))
    pads: tuple[int, int, int, int] = _ints(4, (0, 0, 0, 0))
    pad_value: int = _int(0)
    input_zero_point: int = _int(0)
    count_multipliers: Tensor | None = _optional_tensor()
    count_shifts: Tensor | None = _optional_tensor()


@dataclass(frozen=True, kw_only=True)
class Reduce(Instruction):
    """ReduceSum/Mean/Max/Min over the axes in the bit mask `axes` (bit k = input axis k).

    SUM: acc = sum (x - input_zero_point), then `requant` (ReduceMean folds 1/count into it).
    MAX/MIN: integer extremum, then the optional rescale requant(ext - input_zero_point).
    ARGMAX / ARGMAX_LAST: over exactly one axis, the index of the first / last largest code,
    written as int32 or int64 (no requant). The result (keepdims shape) is written to `output`
    in C order, so `output` may drop the reduced axes.
    """

    OPCODE: ClassVar[Opcode] = Opcode.REDUCE
    op: ReduceOp = _enum(ReduceOp)
    input: Tensor = _tensor()
    output: Tensor = _tensor()
    requant: Requant | None = _optional_requant()
    axes: int = _int()
    input_zero_point: int = _int(0)


@dataclass(frozen=True, kw_only=True)
class Resize(Instruction):
    """Nearest or linear resampling along up to two axes, with build-time index tables.

    `table0` / `table1` (int32, CONST) resample axes `axis0` / `axis1` (-1: unused), in that
    order. NEAREST: table shape (1, out): the input index of every output index; then the
    optional rescale requant(x - input_zero_point). LINEAR: table shape (4, out): rows x0, x1,
    w0, w1 (weights in Q10); acc starts as x - input_zero_point and each axis computes
    acc[x0] * w0 + acc[x1] * w1 with no rounding; then `requant` (which folds 2**-(10*axes)).
    """

    OPCODE: ClassVar[Opcode] = Opcode.RESIZE
    mode: ResizeMode = _enum(ResizeMode)
    input: Tensor = _tensor()
    output: Tensor = _tensor()
    requant: Requant | None = _optional_requant()
    input_zero_point: int = _int(0)
    axis0: int = _int(-1)
    table0: Tensor | None = _optional_tensor()
    axis1: int = _int(-1)
    table1: Tensor | None = _optional_tensor()


@dataclass(frozen=True, kw_only=True)
class Softmax(Instruction):
    """Integer Softmax along `axis`: d = x - max, e = table[d + len - 1], p in Q30, requant.

    `table` is the int32 exp table of `compiler.runtime.ops.softmax.exp_table` (2**bits
    entries); the reciprocal and probability use the constants of that module.
    """

    OPCODE: ClassVar[Opcode] = Opcode.SOFTMAX
    input: Tensor = _tensor()
    table: Tensor = _tensor()
    output: Tensor = _tensor()
    requant: Requant = _requant()
    axis: int = _int(-1)


@dataclass(frozen=True, kw_only=True)
class LayerNorm(Instruction):
    """Integer LayerNormalization over the axes from `axis` to the end.

    Moments of x = q - input_zero_point, V = N*s2 - s1**2 + epsilon_term, rsqrt (intmath),
    z in Q16; f = rq(sign * z, multipliers, shifts) per normalised element; finally
    `requant`(f + offsets) with the scalar 2**-8 multiplier, zero point and clamp. `signs`
    (int8), `multipliers`, `shifts`, `offsets` (int32) have the normalised shape.
    """

    OPCODE: ClassVar[Opcode] = Opcode.LAYERNORM
    input: Tensor = _tensor()
    output: Tensor = _tensor()
    signs: Tensor = _tensor()
    multipliers: Tensor = _tensor()
    shifts: Tensor = _tensor()
    offsets: Tensor = _tensor()
    requant: Requant = _requant()
    input_zero_point: int = _int(0)
    axis: int = _int(-1)
    epsilon_term: int = _int(1)


@dataclass(frozen=True, kw_only=True)
class Lrn(Instruction):
    """Integer LRN across channels (axis 1): acc = x * table[i] with x = input - input_zero_point,
    i = round_half_up(S / 2**index_shift) (capped at the table's last entry), S the sum of x**2
    over the `size` channels around each channel; then `requant`. `table` (int32) holds the
    factor 1 / (bias + alpha / size * s_in**2 * i * 2**index_shift)**beta in fixed point
    (`compiler.runtime.ops.normalization.lrn_factors`; `compiler.intmath.lrn_accumulator`).
    """

    OPCODE: ClassVar[Opcode] = Opcode.LRN
    input: Tensor = _tensor()
    table: Tensor = _tensor()
    output: Tensor = _tensor()
    requant: Requant = _requant()
    input_zero_point: int = _int(0)
    size: int = _int()
    index_shift: int = _int(0)


@dataclass(frozen=True, kw_only=True)
class NormFp16(Instruction):
    """LayerNormalization (op LAYER) or RMSNormalization (op RMS) in fp16, codes in and out.

    Over the axes from `axis` to the end (N elements, C order), every step rounded half to
    even to fp16 (`compiler.intmath.fp16_normalisation`): x = fp16(float32(input -
    input_zero_point) * S), S the float32 with bits `input_scale`; m = tree sum of x / N (LAYER;
    0 for RMS); d = x - m; v = tree sum of d * d / N; r = 1 / sqrt(v + epsilon) (`epsilon`: fp16
    bits); y = (d * r) * gamma + beta (LAYER); then output = clamp(round_half_even(float32(y) /
    s_out) + output_zero_point, low, high), s_out the float32 with bits `output_scale`. `gamma`
    and `beta` are FLOAT16 CONST tensors that broadcast against the normalised shape.
    """

    OPCODE: ClassVar[Opcode] = Opcode.NORM_FP16
    op: NormOp = _enum(NormOp)
    input: Tensor = _tensor()
    output: Tensor = _tensor()
    gamma: Tensor = _tensor()
    beta: Tensor | None = _optional_tensor()
    input_zero_point: int = _int(0)
    input_scale: int = _int()
    axis: int = _int(-1)
    epsilon: int = _int()
    output_scale: int = _int()
    output_zero_point: int = _int(0)
    low: int = _int()
    high: int = _int()


@dataclass(frozen=True, kw_only=True)
class GridSampleBf16(Instruction):
    """GridSample of a 4-D image at an (N, Ho, Wo, 2) grid on the bf16 sampling unit, codes in
    and out (`compiler.intmath.bf16_grid_sample`): image and grid codes become
    bf16(float32(code - zero_point) * scale) (`input_scale` / `grid_scale`: float32 bits),
    coordinates, weights and the weighted sum are float32 in a fixed order, the result is rounded
    to bf16, then output = clamp(round_half_even(float32(y) / s_out) + output_zero_point, low,
    high), s_out the float32 with bits `output_scale`. `align_corners` is 0 or 1.
    """

    OPCODE: ClassVar[Opcode] = Opcode.GRID_SAMPLE_BF16
    mode: SampleMode = _enum(SampleMode)
    padding: SamplePadding = _enum(SamplePadding)
    input: Tensor = _tensor()
    grid: Tensor = _tensor()
    output: Tensor = _tensor()
    align_corners: int = _int(0)
    input_zero_point: int = _int(0)
    input_scale: int = _int()
    grid_zero_point: int = _int(0)
    grid_scale: int = _int()
    output_scale: int = _int()
    output_zero_point: int = _int(0)
    low: int = _int()
    high: int = _int()


INSTRUCTION_TYPES: dict[Opcode, type[Instruction]] = {
    cls.OPCODE: cls
    for cls in (
        Load,
        Store,
        Move,
        Fill,
        Conv,
        ConvTranspose,
        MatMul,
        Eltwise,
        Lut,
        Pool,
        Reduce,
        Resize,
        Softmax,
        LayerNorm,
        Lrn,
        NormFp16,
        GridSampleBf16,
    )
}


# --- binary encoding -----------------------------------------------------------------------------

_MODE_CODES = {mode: index for index, mode in enumerate(REQUANTIZATION_MODES)}
_INT64 = (-(2**63), 2**63 - 1)


def _encode_descriptor(tensor: Tensor | None) -> bytes:
    if tensor is None:
        return DESCRIPTOR.pack(0, 0, 0, 0, 0, 0, *([0] * MAX_RANK), *([0] * MAX_RANK))
    pad = MAX_RANK - tensor.ndim
    try:
        return DESCRIPTOR.pack(
            tensor.space,
            tensor.dtype,
            tensor.ndim,
            0,
            0,
            tensor.offset,
            *tensor.shape,
            *([0] * pad),
            *tensor.strides,
            *([0] * pad),
        )
    except struct.error as error:
        raise IsaError(f"tensor {tensor} does not fit a descriptor: {error}") from error


def _decode_descriptor(data: bytes, where: str) -> Tensor | None:
    space, dtype, rank, _, _, offset, *rest = DESCRIPTOR.unpack(data)
    if space == Space.NONE:
        return None
    if space not in Space._value2member_map_:
        raise IsaError(f"{where}: unknown memory space {space}")
    if dtype not in DType._value2member_map_:
        raise IsaError(f"{where}: unknown dtype code {dtype}")
    if rank > MAX_RANK:
        raise IsaError(f"{where}: rank {rank} exceeds {MAX_RANK}")
    shape, strides = rest[:MAX_RANK], rest[MAX_RANK:]
    return Tensor(Space(space), DType(dtype), offset, tuple(shape[:rank]), tuple(strides[:rank]))


def _flatten(instruction: Instruction) -> tuple[list[int], list[Tensor | None]]:
    """The immediates and descriptors of an instruction, in field order."""
    immediates: list[int] = []
    descriptors: list[Tensor | None] = []
    for item in dataclasses.fields(instruction):
        kind = item.metadata.get(_KIND)
        value = getattr(instruction, item.name)
        if kind in ("tensor", "tensor?"):
            if value is None and kind == "tensor":
                raise IsaError(f"{instruction.mnemonic}.{item.name} is required")
            descriptors.append(value)
        elif kind == "int" or (isinstance(kind, tuple) and kind[0] == "enum"):
            immediates.append(int(value))
        elif isinstance(kind, tuple) and kind[0] == "ints":
            immediates.extend(value)
        elif kind in ("requant", "requant?"):
            if value is None and kind == "requant":
                raise IsaError(f"{instruction.mnemonic}.{item.name} is required")
            immediates.extend(_requant_immediates(value))
            descriptors.extend(_requant_descriptors(value))
    return immediates, descriptors


def _requant_immediates(requant: Requant | None) -> list[int]:
    if requant is None:
        return [0] * 7
    multiplier = 0 if isinstance(requant.multiplier, Tensor) else requant.multiplier
    shift = 0 if isinstance(requant.shift, Tensor) else requant.shift
    return [
        1,
        multiplier,
        shift,
        requant.zero_point,
        requant.low,
        requant.high,
        _MODE_CODES[requant.mode],
    ]


def _requant_descriptors(requant: Requant | None) -> list[Tensor | None]:
    if requant is None:
        return [None, None]
    return [
        requant.multiplier if isinstance(requant.multiplier, Tensor) else None,
        requant.shift if isinstance(requant.shift, Tensor) else None,
    ]


def encode_instruction(instruction: Instruction) -> bytes:
    """One instruction: header, immediates, descriptors."""
    immediates, descriptors = _flatten(instruction)
    for value in immediates:
        if not _INT64[0] <= value <= _INT64[1]:
            raise IsaError(f"{instruction.mnemonic}: immediate {value} does not fit int64")
    size = INSTRUCTION_HEADER.size + IMMEDIATE.size * len(immediates)
    size += DESCRIPTOR.size * len(descriptors)
    if not 0 <= instruction.layer < 2**32:
        raise IsaError(f"{instruction.mnemonic}: layer index {instruction.layer} out of range")
    header = INSTRUCTION_HEADER.pack(
        instruction.OPCODE, 0, size, instruction.layer, len(immediates), len(descriptors), 0
    )
    body = b"".join(IMMEDIATE.pack(v) for v in immediates)
    return header + body + b"".join(_encode_descriptor(d) for d in descriptors)


def encode(instructions: Iterable[Instruction]) -> bytes:
    """The `.text` image: stream header, then every instruction in order."""
    encoded = [encode_instruction(i) for i in instructions]
    header = STREAM_HEADER.pack(TEXT_MAGIC, ISA_VERSION, STREAM_HEADER.size, len(encoded), 0)
    return header + b"".join(encoded)


def _build(
    cls: type[Instruction],
    layer: int,
    immediates: list[int],
    descriptors: list[Tensor | None],
    where: str,
) -> Instruction:
    imm = iter(immediates)
    desc = iter(descriptors)
    values: dict[str, Any] = {"layer": layer}
    for item in dataclasses.fields(cls):
        kind = item.metadata.get(_KIND)
        if kind in ("tensor", "tensor?"):
            value = next(desc)
            if value is None and kind == "tensor":
                raise IsaError(f"{where}: {cls.__name__}.{item.name} is missing")
            values[item.name] = value
        elif kind == "int":
            values[item.name] = next(imm)
        elif isinstance(kind, tuple) and kind[0] == "enum":
            code = next(imm)
            if code not in kind[1]._value2member_map_:
                raise IsaError(f"{where}: {cls.__name__}.{item.name} has no value {code}")
            values[item.name] = kind[1](code)
        elif isinstance(kind, tuple) and kind[0] == "ints":
            values[item.name] = tuple(next(imm) for _ in range(kind[1]))
        elif kind in ("requant", "requant?"):
            present, multiplier, shift, zero_point, low, high, mode = (next(imm) for _ in range(7))
            tables = (next(desc), next(desc))
            if not present:
                if kind == "requant":
                    raise IsaError(f"{where}: {cls.__name__}.{item.name} is missing")
                values[item.name] = None
                continue
            if mode not in range(len(REQUANTIZATION_MODES)):
                raise IsaError(f"{where}: unknown requantization mode code {mode}")
            values[item.name] = Requant(
                tables[0] if tables[0] is not None else multiplier,
                tables[1] if tables[1] is not None else shift,
                zero_point,
                low,
                high,
                REQUANTIZATION_MODES[mode],
            )
    return cls(**values)


def _counts(cls: type[Instruction]) -> tuple[int, int]:
    """(immediates, descriptors) an instruction of this type encodes."""
    immediates = descriptors = 0
    for item in dataclasses.fields(cls):
        kind = item.metadata.get(_KIND)
        if kind in ("tensor", "tensor?"):
            descriptors += 1
        elif kind == "int" or (isinstance(kind, tuple) and kind[0] == "enum"):
            immediates += 1
        elif isinstance(kind, tuple) and kind[0] == "ints":
            immediates += kind[1]
        elif kind in ("requant", "requant?"):
            immediates += 7
            descriptors += 2
    return immediates, descriptors


def encoding_layout(cls: type[Instruction]) -> tuple[list[str], list[str]]:
    """(immediate names, descriptor names) of an instruction type, in encoding order.

    A requant field contributes 7 immediates (present, multiplier, shift, zero_point, low, high,
    mode) and 2 descriptors (multiplier table, shift table); `?` marks an optional part.
    """
    immediates: list[str] = []
    descriptors: list[str] = []
    for item in dataclasses.fields(cls):
        kind = item.metadata.get(_KIND)
        if kind in ("tensor", "tensor?"):
            descriptors.append(item.name + ("?" if kind == "tensor?" else ""))
        elif kind == "int":
            immediates.append(item.name)
        elif isinstance(kind, tuple) and kind[0] == "enum":
            immediates.append(f"{item.name}:{kind[1].__name__}")
        elif isinstance(kind, tuple) and kind[0] == "ints":
            immediates.append(f"{item.name}[{kind[1]}]")
        elif kind in ("requant", "requant?"):
            optional = "?" if kind == "requant?" else ""
            immediates.append(f"{item.name}{optional}{{7}}")
            descriptors.extend([f"{item.name}.multiplier?", f"{item.name}.shift?"])
    return immediates, descriptors


def encoding_table() -> str:
    """Markdown table of every opcode's operand order (docs/mla-isa.md embeds it verbatim)."""
    lines = ["| opcode | mnemonic | immediates (int64, in order) | descriptors (in order) |"]
    lines.append("|---|---|---|---|")
    for opcode, cls in INSTRUCTION_TYPES.items():
        immediates, descriptors = encoding_layout(cls)
        lines.append(
            f"| 0x{opcode:02x} | {opcode.name} | {', '.join(immediates) or '-'} "
            f"| {', '.join(descriptors)} |"
        )
    return "\n".join(lines)


def decode(data: bytes) -> list[Instruction]:
    """Instructions from a `.text` image; every malformed byte gives an `IsaError` saying where."""
    data = bytes(data)
    if len(data) < STREAM_HEADER.size:
        raise IsaError(f"instruction stream of {len(data)} bytes is shorter than its header")
    magic, version, header_size, count, _ = STREAM_HEADER.unpack_from(data)
    if magic != TEXT_MAGIC:
        raise IsaError(f"not an MLA instruction stream (magic {magic!r}, expected {TEXT_MAGIC!r})")
    if version != ISA_VERSION:
        raise IsaError(f"instruction stream version {version}; this toolkit reads {ISA_VERSION}")
    position = header_size
    instructions: list[Instruction] = []
    for index in range(count):
        where = f"instruction {index} at byte {position}"
        if position + INSTRUCTION_HEADER.size > len(data):
            raise IsaError(f"{where}: stream truncated ({len(data)} bytes)")
        opcode, _, size, layer, n_imm, n_desc, _ = INSTRUCTION_HEADER.unpack_from(data, position)
        if opcode not in INSTRUCTION_TYPES:
            raise IsaError(f"{where}: unknown opcode 0x{opcode:02x}")
        cls = INSTRUCTION_TYPES[Opcode(opcode)]
        if (n_imm, n_desc) != _counts(cls):
            raise IsaError(
                f"{where}: {cls.__name__} needs {_counts(cls)} immediates/descriptors, "
                f"found {(n_imm, n_desc)}"
            )
        expected = INSTRUCTION_HEADER.size + IMMEDIATE.size * n_imm + DESCRIPTOR.size * n_desc
        if size != expected or position + size > len(data):
            raise IsaError(f"{where}: size {size} is inconsistent (expected {expected})")
        cursor = position + INSTRUCTION_HEADER.size
        immediates = [IMMEDIATE.unpack_from(data, cursor + 8 * k)[0] for k in range(n_imm)]
        cursor += IMMEDIATE.size * n_imm
        descriptors = [
            _decode_descriptor(
                data[cursor + DESCRIPTOR.size * k : cursor + DESCRIPTOR.size * (k + 1)], where
            )
            for k in range(n_desc)
        ]
        try:
            instructions.append(_build(cls, layer, immediates, descriptors, where))
        except IsaError:
            raise
        except (ValueError, TypeError) as error:
            raise IsaError(f"{where}: {error}") from error
        position += size
    if position != len(data):
        raise IsaError(f"{len(data) - position} trailing bytes after {count} instructions")
    return instructions


# --- programs ------------------------------------------------------------------------------------

TensorRole = Literal["input", "output", "intermediate"]


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the program's tensor table (inputs and outputs at least).

    `tensor` is where the program reads or writes it (logical NCHW shape, layout in the strides);
    `scale` / `zero_point` are its quantization (per tensor: one value each).
    """

    name: str
    role: TensorRole
    tensor: Tensor
    layout: Layout = "NCHW"
    scale: tuple[float, ...] = (1.0,)
    zero_point: tuple[int, ...] = (0,)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "role": self.role,
            "layout": self.layout,
            "scale": [float(s) for s in self.scale],
            "zero_point": [int(z) for z in self.zero_point],
            **self.tensor.to_json(),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TensorInfo:
        return cls(
            name=str(data["name"]),
            role=data["role"],
            tensor=Tensor.from_json(data),
            layout=data.get("layout", "NCHW"),
            scale=tuple(float(s) for s in data.get("scale", (1.0,))),
            zero_point=tuple(int(z) for z in data.get("zero_point", (0,))),
        )


@dataclass(frozen=True)
class ProgramMetadata:
    """What the runtime needs besides the instructions: memory sizes, I/O, names, options.

    `layers[i]` names the ONNX op(s) behind instructions whose `layer` is i (for stats);
    `extra` is free JSON for the compiler (e.g. tessellation parameters).
    """

    name: str
    tensors: tuple[TensorInfo, ...]
    arena_size: int
    dram_size: int
    batch_size: int = 1
    quads: int = 4
    custom_string: str = ""
    requantization_mode: RequantizationMode = "sima"
    layers: tuple[str, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def inputs(self) -> tuple[TensorInfo, ...]:
        return tuple(t for t in self.tensors if t.role == "input")

    @property
    def outputs(self) -> tuple[TensorInfo, ...]:
        return tuple(t for t in self.tensors if t.role == "output")

    def tensor(self, name: str) -> TensorInfo:
        for info in self.tensors:
            if info.name == name:
                return info
        raise KeyError(f"no tensor {name!r} in program {self.name!r}")

    def to_json(self) -> dict[str, Any]:
        return {
            "format": "mla-program",
            "isa_version": ISA_VERSION,
            "name": self.name,
            "batch_size": self.batch_size,
            "quads": self.quads,
            "custom_string": self.custom_string,
            "requantization_mode": self.requantization_mode,
            "arena_size": self.arena_size,
            "dram_size": self.dram_size,
            "tensors": [t.to_json() for t in self.tensors],
            "layers": list(self.layers),
            "extra": self.extra,
        }

    def to_bytes(self) -> bytes:
        """Canonical JSON (sorted keys, no whitespace): identical metadata, identical bytes."""
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ProgramMetadata:
        if data.get("format") != "mla-program":
            raise IsaError("metadata is not an MLA program description")
        if data.get("isa_version") != ISA_VERSION:
            raise IsaError(
                f"metadata ISA version {data.get('isa_version')}; this toolkit reads {ISA_VERSION}"
            )
        return cls(
            name=str(data["name"]),
            tensors=tuple(TensorInfo.from_json(t) for t in data["tensors"]),
            arena_size=int(data["arena_size"]),
            dram_size=int(data["dram_size"]),
            batch_size=int(data.get("batch_size", 1)),
            quads=int(data.get("quads", 4)),
            custom_string=str(data.get("custom_string", "")),
            requantization_mode=data.get("requantization_mode", "sima"),
            layers=tuple(data.get("layers", ())),
            extra=dict(data.get("extra", {})),
        )


@dataclass(frozen=True)
class MlaProgram:
    """One MLA segment: instructions, the read-only constants they address, and metadata."""

    instructions: tuple[Instruction, ...]
    rodata: bytes
    metadata: ProgramMetadata

    def __post_init__(self) -> None:
        object.__setattr__(self, "instructions", tuple(self.instructions))
        object.__setattr__(self, "rodata", bytes(self.rodata))

    @property
    def text(self) -> bytes:
        return encode(self.instructions)

    def layer_name(self, instruction: Instruction) -> str:
        layers = self.metadata.layers
        return layers[instruction.layer] if instruction.layer < len(layers) else ""


class ConstantPool:
    """Builds `.rodata`: appends constant arrays, aligned, and returns CONST descriptors.

    Identical arrays (same dtype, shape and bytes) are stored once.
    """

    def __init__(self, alignment: int = 16) -> None:
        self.alignment = alignment
        self._data = bytearray()
        self._seen: dict[tuple[str, tuple[int, ...], str], Tensor] = {}

    def add(self, array: npt.ArrayLike, dtype: DType | npt.DTypeLike | None = None) -> Tensor:
        """Store `array` (cast to `dtype`, exactly: values must fit) and return its descriptor."""
        array = np.asarray(array)
        target = DType.of(dtype if dtype is not None else array.dtype)
        cast = array.astype(target.numpy)
        if target == DType.FLOAT16:
            if array.dtype != np.float16:
                raise IsaError(
                    f"FLOAT16 constants must be rounded to fp16 first, not {array.dtype}"
                )
        elif not np.array_equal(cast.astype(np.int64), array.astype(np.int64)):
            raise IsaError(f"constant values do not fit {target.numpy.name}")
        raw = np.ascontiguousarray(cast).tobytes()
        key = (target.numpy.name, cast.shape, hashlib.sha256(raw).hexdigest())
        if key in self._seen:
            return self._seen[key]
        self._data.extend(b"\0" * (-len(self._data) % self.alignment))
        tensor = Tensor.contiguous(Space.CONST, target, len(self._data), cast.shape)
        self._data.extend(raw)
        self._seen[key] = tensor
        return tensor

    def to_bytes(self) -> bytes:
        return bytes(self._data)

    def __len__(self) -> int:
        return len(self._data)
