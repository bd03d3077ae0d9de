"""A tiny hand-written code generator for emulator tests (no tests here).

It places tensors in DRAM or the arena with a bump allocator, stores constants in `.rodata`,
turns the reference kernels' output stages into `Requant` fields, and runs a program through
the full path: encode -> ELF bytes -> read_elf -> Emulator.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from compiler.elf import elf_bytes, read_elf
from compiler.intmath import RequantizationMode
from compiler.isa import (
    ConstantPool,
    Instruction,
    Layout,
    MlaProgram,
    ProgramMetadata,
    Requant,
    Space,
    Tensor,
    TensorInfo,
    layout_nbytes,
    layout_tensor,
)
from compiler.runtime.emulator import Emulator
from compiler.runtime.ops.base import OutputStage, Rescale
from compiler.runtime.qparams import QuantParams

ALIGN = 16


def qparams(scale: float, zero_point: int, dtype: str = "int8") -> QuantParams:
    return QuantParams(np.array(scale, np.float32), np.array(zero_point, np.int64), np.dtype(dtype))


def random_codes(rng: np.random.Generator, shape: Sequence[int], dtype: str) -> np.ndarray:
    info = np.iinfo(np.dtype(dtype))
    return rng.integers(info.min, int(info.max) + 1, size=tuple(shape)).astype(dtype)


class Codegen:
    """Bump-allocates tensors, collects constants and instructions, builds and runs a program."""

    def __init__(self, name: str = "test", quads: int = 4) -> None:
        self.name = name
        self.quads = quads
        self.pool = ConstantPool()
        self.cursor = {Space.DRAM: 0, Space.ARENA: 0}
        self.tensors: list[TensorInfo] = []
        self.instructions: list[Instruction] = []
        self.layers: list[str] = []

    def alloc(
        self,
        shape: Sequence[int],
        dtype: str | np.dtype,
        space: Space = Space.ARENA,
        layout: Layout = "NCHW",
    ) -> Tensor:
        offset = self.cursor[space]
        self.cursor[space] = offset + layout_nbytes(shape, dtype, layout)
        self.cursor[space] += -self.cursor[space] % ALIGN
        return layout_tensor(space, dtype, offset, tuple(shape), layout)

    def input(
        self,
        name: str,
        shape: Sequence[int],
        dtype: str | np.dtype,
        space: Space = Space.DRAM,
        layout: Layout = "NCHW",
    ) -> Tensor:
        tensor = self.alloc(shape, dtype, space, layout)
        self.tensors.append(TensorInfo(name, "input", tensor, layout))
        return tensor

    def output(
        self,
        name: str,
        shape: Sequence[int],
        dtype: str | np.dtype,
        space: Space = Space.DRAM,
        layout: Layout = "NCHW",
    ) -> Tensor:
        tensor = self.alloc(shape, dtype, space, layout)
        self.tensors.append(TensorInfo(name, "output", tensor, layout))
        return tensor

    def const(self, array: np.ndarray, dtype: str | np.dtype) -> Tensor:
        return self.pool.add(np.asarray(array), dtype)

    def requant(
        self,
        multiplier: np.ndarray,
        shift: np.ndarray,
        zero_point: int,
        low: int,
        high: int,
        mode: RequantizationMode,
        *,
        table_shape: Sequence[int] | None = None,
    ) -> Requant:
        """Scalars become immediates, arrays int32 CONST tables (reshaped to `table_shape`)."""
        multiplier, shift = np.asarray(multiplier), np.asarray(shift)
        if multiplier.size == 1 and shift.size == 1:
            scalar_multiplier = int(multiplier.reshape(-1)[0])
            scalar_shift = int(shift.reshape(-1)[0])
            return Requant(scalar_multiplier, scalar_shift, zero_point, low, high, mode)
        shape = tuple(table_shape) if table_shape is not None else multiplier.shape
        multiplier, shift = np.broadcast_arrays(multiplier, shift)
        return Requant(
            self.const(multiplier.reshape(shape), "int32"),
            self.const(shift.reshape(shape), "int32"),
            zero_point,
            low,
            high,
            mode,
        )

    def stage(self, stage: OutputStage, *, table_shape: Sequence[int] | None = None) -> Requant:
        return self.requant(
            stage.multiplier,
            stage.shift,
            stage.zero_point,
            stage.low,
            stage.high,
            stage.mode,
            table_shape=table_shape,
        )

    def rescale(self, rescale: Rescale) -> tuple[int, Requant | None]:
        """(input_zero_point, requant) of a reference Rescale (None when it is the identity)."""
        if rescale.stage is None:
            return rescale.input_zero_point, None
        return rescale.input_zero_point, self.stage(rescale.stage)

    def emit(self, *instructions: Instruction) -> None:
        self.instructions.extend(instructions)

    def program(self) -> MlaProgram:
        metadata = ProgramMetadata(
            name=self.name,
            tensors=tuple(self.tensors),
            arena_size=self.cursor[Space.ARENA] or ALIGN,
            dram_size=self.cursor[Space.DRAM] or ALIGN,
            quads=self.quads,
            layers=tuple(self.layers),
        )
        return MlaProgram(tuple(self.instructions), self.pool.to_bytes(), metadata)

    def run(self, inputs: dict[str, np.ndarray], *, compress: bool = False) -> dict:
        """Encode, write and re-read the ELF, then emulate it."""
        program = read_elf(elf_bytes(self.program(), compress=compress))
        return Emulator(program).run(inputs)


def run_single(
    build: Codegen,
    inputs: dict[str, np.ndarray],
    expected: np.ndarray,
) -> np.ndarray:
    """Run a one-output program and check it equals `expected` exactly (shape, dtype, values)."""
    (result,) = build.run(inputs).values()
    assert result.dtype == expected.dtype, (result.dtype, expected.dtype)
    np.testing.assert_array_equal(result, expected)
    return result
