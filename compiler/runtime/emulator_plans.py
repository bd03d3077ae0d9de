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
from compiler.isa import Conv, Instruction, Load, Move, Space, Store, Tensor
from compiler.runtime.emulator_ops import (
    EXECUTORS,
    PARALLEL_ELEMENTS,
    EmulatorError,
    MemoryPort,
    _DepthwiseTaps,
    _exact_dtype,
    _largest_value,
    _sums_tap_products,
    _TapProducts,
    _Weights,
    _windows,
    check_copy,
    column_product,
    conv_geometry,
    conv_stage,
    conv_weights,
)

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
    planned: bool


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
    return Plan(tuple(steps), reads, writes, PLANNED)


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
    """A small CONV: its input centred into a zero-padded buffer of its own (the padding is
    written once), the exact products of `execute_conv`'s algorithm for its shape, and the
    fused output stage written into the destination."""
    geometry = conv_geometry(instruction)
    shape = geometry.shape
    if math.prod(shape) >= SMALL_ELEMENTS or not _tables_constant(instruction, "input"):
        return None
    stage = conv_stage(memory, instruction)
    fused = stage.fused
    if fused is None or stage.out_dtype != instruction.output.dtype.numpy:
        return None
    if not stage.blockwise(shape):
        return None
    weights = conv_weights(memory, instruction)
    zero_point = instruction.input_zero_point
    dtype = _exact_dtype(_largest_value(_code_range(instruction.input), zero_point, weights.mass))
    top, left, bottom, right = instruction.pads
    batch, channels, height, width = instruction.input.shape
    x = np.zeros((batch, channels, height + top + bottom, width + left + right), dtype)
    inside = x[:, :, top : top + height, left : left + width]
    codes = memory.place(instruction.input)
    target = memory.place(instruction.output, writable=True)
    accumulate = _conv_accumulator(instruction, x, weights, dtype)
    scratch = np.empty(math.prod(shape), np.int64)

    def conv() -> None:
        np.subtract(codes, zero_point, out=inside, dtype=dtype)
        fused.apply(accumulate(), target, None, scratch, overwrite=True)

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


PLANNERS: dict[type[Instruction], Callable[..., Step | None]] = {
    Load: _plan_copy,
    Store: _plan_copy,
    Move: _plan_copy,
    Conv: _plan_conv,
}
"""Instruction type -> planner(instruction, memory): its planned step, or None."""
