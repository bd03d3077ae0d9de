"""The instruction set: exact encode/decode round trips, clear decode errors, views, the doc table."""

from __future__ import annotations

import dataclasses
import re
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compiler.isa import (
    DESCRIPTOR,
    INSTRUCTION_HEADER,
    INSTRUCTION_TYPES,
    MAX_RANK,
    STREAM_HEADER,
    ConstantPool,
    Conv,
    DType,
    Fill,
    Instruction,
    IsaError,
    Load,
    Move,
    Requant,
    Space,
    Tensor,
    decode,
    encode,
    encoding_table,
    layout_nbytes,
    layout_strides,
    layout_tensor,
)

DOC = Path(__file__).resolve().parents[1] / "docs" / "mla-isa.md"
SPACES = st.sampled_from([Space.DRAM, Space.ARENA, Space.CONST])


@st.composite
def tensors(draw: st.DrawFn) -> Tensor:
    rank = draw(st.integers(0, MAX_RANK))
    return Tensor(
        draw(SPACES),
        draw(st.sampled_from(list(DType))),
        draw(st.integers(0, 2**40)),
        tuple(draw(st.lists(st.integers(0, 2**20), min_size=rank, max_size=rank))),
        tuple(draw(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=rank, max_size=rank))),
    )


IMMEDIATES = st.integers(-(2**63), 2**63 - 1)


@st.composite
def requants(draw: st.DrawFn) -> Requant:
    return Requant(
        draw(st.one_of(IMMEDIATES, tensors())),
        draw(st.one_of(IMMEDIATES, tensors())),
        draw(IMMEDIATES),
        draw(IMMEDIATES),
        draw(IMMEDIATES),
        draw(st.sampled_from(["sima", "tflite"])),
    )


@st.composite
def instructions(draw: st.DrawFn) -> Instruction:
    """Any instruction, every field drawn from its encoding kind."""
    cls = draw(st.sampled_from(list(INSTRUCTION_TYPES.values())))
    values = {"layer": draw(st.integers(0, 2**32 - 1))}
    for item in dataclasses.fields(cls):
        kind = item.metadata.get("isa_kind")
        if kind is None:
            continue
        if kind == "tensor":
            values[item.name] = draw(tensors())
        elif kind == "tensor?":
            values[item.name] = draw(st.none() | tensors())
        elif kind == "int":
            values[item.name] = draw(IMMEDIATES)
        elif kind == "requant":
            values[item.name] = draw(requants())
        elif kind == "requant?":
            values[item.name] = draw(st.none() | requants())
        elif kind[0] == "ints":
            values[item.name] = tuple(draw(IMMEDIATES) for _ in range(kind[1]))
        elif kind[0] == "enum":
            values[item.name] = draw(st.sampled_from(list(kind[1])))
    return cls(**values)


@settings(max_examples=40, deadline=None)
@given(program=st.lists(instructions(), max_size=6))
def test_decode_inverts_encode_exactly(program: list[Instruction]) -> None:
    data = encode(program)
    assert decode(data) == program
    assert encode(decode(data)) == data


def test_every_opcode_is_in_the_encoding_table_of_the_doc() -> None:
    """docs/mla-isa.md embeds compiler.isa.encoding_table() verbatim between two markers."""
    text = DOC.read_text()
    embedded = re.search(r"<!-- encoding-table -->\n(.*?)\n<!-- /encoding-table -->", text, re.S)
    assert embedded is not None
    assert embedded.group(1) == encoding_table()


def _conv() -> Conv:
    x = Tensor.contiguous(Space.ARENA, "int8", 0, (1, 2, 3, 3))
    return Conv(
        input=x,
        weight=Tensor.contiguous(Space.CONST, "int8", 0, (2, 2, 1, 1)),
        output=x,
        requant=Requant(1 << 30, 0, 0, -128, 127),
    )


def test_decode_errors_name_the_problem() -> None:
    good = encode([Fill(dst=Tensor.contiguous(Space.ARENA, "int8", 0, (4,)), value=1), _conv()])
    with pytest.raises(IsaError, match="magic"):
        decode(b"XXXX" + good[4:])
    with pytest.raises(IsaError, match="version 9"):
        decode(good[:4] + struct.pack("<H", 9) + good[6:])
    with pytest.raises(IsaError, match="truncated|inconsistent"):
        decode(good[:-10])
    with pytest.raises(IsaError, match="trailing"):
        decode(good + b"\0")
    with pytest.raises(IsaError, match="shorter than its header"):
        decode(b"MLA")
    first = STREAM_HEADER.size
    bad_opcode = bytearray(good)
    bad_opcode[first : first + 2] = struct.pack("<H", 0x7F)
    with pytest.raises(IsaError, match=r"instruction 0 at byte 16: unknown opcode 0x7f"):
        decode(bytes(bad_opcode))
    bad_space = bytearray(good)
    descriptor = first + INSTRUCTION_HEADER.size + 8
    bad_space[descriptor] = 9
    with pytest.raises(IsaError, match="unknown memory space 9"):
        decode(bytes(bad_space))
    missing = bytearray(good)
    missing[descriptor] = 0
    with pytest.raises(IsaError, match="Fill.dst is missing"):
        decode(bytes(missing))


def test_encoding_rejects_what_does_not_fit() -> None:
    tensor = Tensor(Space.ARENA, DType.INT8, -1, (4,), (1,))
    with pytest.raises(IsaError, match="descriptor"):
        encode([Fill(dst=tensor, value=0)])
    with pytest.raises(IsaError, match="int64"):
        encode([Fill(dst=Tensor.contiguous(Space.ARENA, "int8", 0, (4,)), value=2**70)])
    with pytest.raises(IsaError, match="rank 9"):
        Tensor.contiguous(Space.ARENA, "int8", 0, (1,) * 9)
    with pytest.raises(IsaError, match="mode"):
        Requant(1, 0, 0, 0, 0, "nearest")  # type: ignore[arg-type]
    with pytest.raises(IsaError, match="float32"):
        DType.of(np.float32)


def test_instruction_sizes_follow_the_documented_formula() -> None:
    conv = _conv()
    data = encode([conv])
    _, _, size, _, n_imm, n_desc, _ = INSTRUCTION_HEADER.unpack_from(data, STREAM_HEADER.size)
    assert (n_imm, n_desc) == (17, 6)
    assert size == INSTRUCTION_HEADER.size + 8 * n_imm + DESCRIPTOR.size * n_desc
    assert DESCRIPTOR.size == 80 and INSTRUCTION_HEADER.size == 16 and STREAM_HEADER.size == 16


def test_views_address_the_same_bytes_as_numpy() -> None:
    """slice / transpose / reshape / broadcast_to agree with numpy on an index array."""
    shape = (2, 3, 4, 5)
    base = Tensor.contiguous(Space.ARENA, "int16", 6, shape)
    array = np.arange(np.prod(shape)).reshape(shape)

    def addressed(view: Tensor) -> np.ndarray:
        index = np.zeros(view.shape, dtype=np.int64) + view.offset
        for axis, stride in enumerate(view.strides):
            steps = np.arange(view.shape[axis]).reshape(
                [-1 if a == axis else 1 for a in range(view.ndim)]
            )
            index = index + steps * stride
        return (index - base.offset) // base.itemsize

    np.testing.assert_array_equal(addressed(base.slice(2, 3, 0, -2)), array[:, :, 3:0:-2])
    np.testing.assert_array_equal(addressed(base.slice(1, 2, -1, -1)), array[:, 2::-1])
    np.testing.assert_array_equal(
        addressed(base.transpose((0, 2, 3, 1))), array.transpose(0, 2, 3, 1)
    )
    np.testing.assert_array_equal(addressed(base.reshape((6, 20))), array.reshape(6, 20))
    column = base.slice(3, 1, 2)
    np.testing.assert_array_equal(
        addressed(column.broadcast_to((2, 3, 4, 7))), np.broadcast_to(array[..., 1:2], (2, 3, 4, 7))
    )
    assert base.slice(2, 3, 0, -2).span() == (16, 246)
    with pytest.raises(IsaError, match="leaves axis"):
        base.slice(1, 0, 4)
    with pytest.raises(IsaError, match="contiguous"):
        base.transpose((0, 2, 1, 3)).reshape((24, 5))
    with pytest.raises(IsaError, match="broadcast"):
        base.broadcast_to((2, 3, 4, 6))


def test_dram_layouts() -> None:
    shape = (2, 20, 3, 4)
    assert layout_strides(shape, "int8", "NCHW") == (240, 12, 4, 1)
    assert layout_strides(shape, "int8", "HWC") == (240, 1, 80, 20)
    assert layout_strides(shape, "int16", "HWC16") == (768, 2, 256, 64)
    assert layout_nbytes(shape, "int8", "HWC16") == 2 * 3 * 4 * 32
    tensor = layout_tensor(Space.DRAM, "int8", 0, shape, "HWC16")
    assert tensor.span() == (0, layout_nbytes(shape, "int8", "HWC16") - 12)
    assert layout_strides((3, 5), "int8", "HWC") == (5, 1)


def test_constant_pool_aligns_deduplicates_and_checks_ranges() -> None:
    pool = ConstantPool(alignment=16)
    first = pool.add(np.arange(3), "int8")
    second = pool.add(np.arange(5), "int32")
    again = pool.add(np.arange(3), "int8")
    assert first == again and second.offset == 16 and len(pool) == 36
    raw = pool.to_bytes()
    assert np.frombuffer(raw[16:36], "<i4").tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(IsaError, match="do not fit int8"):
        pool.add([300], "int8")


def test_instructions_know_their_inputs_and_outputs() -> None:
    source = Tensor.contiguous(Space.DRAM, "int8", 0, (4,))
    target = Tensor.contiguous(Space.ARENA, "int8", 0, (4,))
    load = Load(src=source, dst=target)
    assert load.inputs() == {"src": source} and load.outputs() == {"dst": target}
    table = Tensor.contiguous(Space.CONST, "int32", 0, (4,))
    move = Move(src=source, dst=target, requant=Requant(table, 3, 0, -128, 127))
    assert set(move.inputs()) == {"src", "requant.multiplier"}
    assert move.mnemonic == "MOVE"
