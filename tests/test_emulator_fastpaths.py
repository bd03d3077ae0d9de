"""The emulator's fast paths change no bit: blocks, tables and caches, against the reference.

Real networks take the blockwise output stages (`BLOCK_ELEMENTS`), the tabulated 8-bit
elementwise functions (`TABLE_FACTOR`) and the per-tap CONV products (`TAP_PRODUCT_CHANNELS`) on
large tensors, which the small hypothesis cases of test_emulator_compute / test_emulator_movement
never reach. Here those same reference comparisons run again with blocks of a few elements,
tables for every size (one-code tables looked up two codes at a time, straight into strided
destinations), tap products for every single-image, single-group CONV with a spatial kernel and
broadcast tap sums for every depthwise CONV with one output per channel, so each case crosses many
block boundaries (CONV row and channel blocks, per-channel tables split between blocks, HWC and
HWC16 destinations) and every 8-bit MOVE rescale, ELTWISE and LUT is a table lookup. The rest checks what an ELF's decoded program and its CONST-derived
values, kept between runs, may not change: results, byte counts, and the cached values
themselves.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from compiler.elf import elf_bytes
from compiler.intmath import FusedOutputStage, quantize_multiplier
from compiler.isa import Conv, Eltwise, EltwiseOp, Lut, Move, Requant, Space
from compiler.runtime import emulator, emulator_ops, emulator_plans
from compiler.runtime.emulator import Emulator
from tests.test_emulator_compute import (
    test_average_pool_matches_reference as test_average_pool_in_blocks,
)
from tests.test_emulator_compute import (
    test_conv_matches_reference as test_conv_in_blocks,
)
from tests.test_emulator_compute import (
    test_conv_transpose_matches_reference as test_conv_transpose_in_blocks,
)
from tests.test_emulator_compute import (
    test_eltwise_matches_reference as test_eltwise_by_table,
)
from tests.test_emulator_compute import (
    test_lut_matches_reference as test_lut_by_table,
)
from tests.test_emulator_compute import (
    test_matmul_matches_reference as test_matmul_in_blocks,
)
from tests.test_emulator_compute import (
    test_max_pool_matches_reference as test_max_pool_in_blocks,
)
from tests.test_emulator_compute import (
    test_resize_matches_reference as test_resize_in_blocks,
)
from tests.test_emulator_movement import (
    test_concat_moves_each_rescaled_input_into_a_slice as test_rescaled_concat_by_table,
)
from tests.test_emulator_movement import (
    test_rescale_changes_dtype_and_load_store_round_trip as test_rescale_by_table,
)
from tests.test_emulator_support import Codegen, random_codes

__all__ = [
    "test_average_pool_in_blocks",
    "test_conv_in_blocks",
    "test_conv_transpose_in_blocks",
    "test_eltwise_by_table",
    "test_lut_by_table",
    "test_matmul_in_blocks",
    "test_max_pool_in_blocks",
    "test_rescale_by_table",
    "test_rescaled_concat_by_table",
    "test_resize_in_blocks",
]


@pytest.fixture(autouse=True, scope="module")
def tiny_blocks_and_tables_everywhere():
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(emulator_ops, "BLOCK_ELEMENTS", 5)
        patch.setattr(emulator_ops, "TABLE_FACTOR", 0)
        patch.setattr(emulator_ops, "PAIR_ELEMENTS", 0)
        patch.setattr(emulator_ops, "MIN_RUN", 0)
        patch.setattr(emulator_ops, "TAP_PRODUCT_CHANNELS", 0)
        patch.setattr(emulator_ops, "TAP_PRODUCT_RATIO", 0)
        patch.setattr(emulator_ops, "SCALAR_TAP_OUTPUTS", 0)
        # Planned steps compute a small result as one block; these cases need the blocks.
        patch.setattr(emulator_plans, "PLANNED", False)
        yield


@pytest.mark.parametrize("ratio", [0, 10**9], ids=["channel-last", "channel-first"])
def test_conv_in_blocks_channel_first_and_last(ratio: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every single-image depthwise CONV with one output per channel channel-last (its tap
    sums and stage on (positions, channels) blocks), then every one channel-first."""
    monkeypatch.setattr(emulator_ops, "CHANNEL_LAST_RATIO", ratio)
    monkeypatch.setattr(emulator_ops, "DEPTHWISE_LAST_CHANNELS", 10**9 if ratio else 0)
    test_conv_in_blocks()


def test_blocks_tile_the_result_exactly() -> None:
    for shape in [(), (0, 3), (7,), (2, 3, 4), (1, 5, 1, 9), (3, 1, 2, 2)]:
        covered = np.zeros(shape, dtype=np.int64)
        for block in emulator_ops._blocks(shape):
            assert len(block) == len(shape)
            covered[block] += 1
            assert covered[block].size <= max(
                emulator_ops.BLOCK_ELEMENTS, shape[-1] if shape else 1
            )
        assert np.all(covered == 1)


def _requant(zero_point: int = 3) -> Requant:
    return Requant(1518500250, 7, zero_point, -128, 127, "sima")


def test_tables_cover_every_code_of_both_operand_types(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 256 x 256 ELTWISE table over all int8 x uint8 pairs equals the direct evaluation."""
    a = np.arange(-128, 128, dtype=np.int8).reshape(1, 256, 1)
    b = np.arange(256, dtype=np.uint8).reshape(1, 1, 256)
    outputs = {}
    for factor in (0, 10**9):
        monkeypatch.setattr(emulator_ops, "TABLE_FACTOR", factor)
        build = Codegen()
        build.emit(
            Eltwise(
                op=EltwiseOp.MUL,
                a=build.input("a", a.shape, "int8", Space.ARENA),
                b=build.input("b", b.shape, "uint8", Space.ARENA),
                output=build.output("y", (1, 256, 256), "int8", Space.DRAM),
                requant=_requant(),
                a_zero_point=-5,
                b_zero_point=131,
            )
        )
        outputs[factor] = build.run({"a": a, "b": b})["y"]
    np.testing.assert_array_equal(outputs[0], outputs[10**9])


def _conv_program() -> tuple[bytes, dict[str, np.ndarray]]:
    rng = np.random.default_rng(3)
    build = Codegen()
    x = rng.integers(-128, 128, size=(1, 4, 6, 5)).astype(np.int8)
    source = build.input("x", x.shape, "int8", Space.DRAM, "HWC")
    hidden = build.alloc((1, 6, 6, 5), "int8")
    build.emit(
        Conv(
            input=source,
            weight=build.const(rng.integers(-127, 128, size=(6, 4, 3, 3)), "int8"),
            bias=build.const(rng.integers(-3000, 3000, size=6), "int32"),
            output=hidden,
            requant=Requant(
                build.const(rng.integers(2**30, 2**31, size=(6,)), "int32"),
                build.const(rng.integers(6, 10, size=(6,)), "int32"),
                -3,
                -128,
                127,
                "sima",
            ),
            input_zero_point=7,
            pads=(1, 1, 1, 1),
        ),
        Move(
            src=hidden,
            dst=build.output("y", hidden.shape, "int8", Space.DRAM, "HWC16"),
            input_zero_point=-3,
            requant=_requant(),
        ),
    )
    return elf_bytes(build.program()), {"x": x}


def test_an_elf_is_decoded_once_and_its_runs_agree() -> None:
    data, inputs = _conv_program()
    first, second = Emulator(data), Emulator(bytes(bytearray(data)))
    assert second.program is first.program
    assert second.instructions is first.instructions
    runs = [first.run(inputs)["y"], second.run(inputs)["y"], first.run(inputs)["y"]]
    fresh = Emulator(first.program)
    runs.append(fresh.run(inputs)["y"])
    for result in runs[1:]:
        np.testing.assert_array_equal(result, runs[0])
    assert second.stats.bytes_read == first.stats.bytes_read == fresh.stats.bytes_read
    assert second.stats.bytes_written == fresh.stats.bytes_written
    assert second.stats.static_cycles == fresh.stats.static_cycles


def test_values_derived_from_constants_are_read_only() -> None:
    data, inputs = _conv_program()
    emulator_instance = Emulator(data)
    emulator_instance.run(inputs)
    constants = emulator_instance.memory.constants
    assert constants
    for value in constants.values():
        if value is None:
            continue
        if isinstance(value, np.ndarray):
            arrays = [value]
        elif isinstance(value, FusedOutputStage):
            arrays = list(value.tables())
        elif isinstance(value, dict):  # a fused stage's tables per block, and its kernel's
            arrays = [
                table
                for tables in value.values()
                if tables is not None
                for table in tables
                if isinstance(table, np.ndarray)
            ]
        elif isinstance(value, emulator_ops._OutputStage):
            tables = (value.multiplier, value.shift, value.bias)
            arrays = [table for table in tables if isinstance(table, np.ndarray)]
        else:
            arrays = [value.values, value.astype(np.float32)]
        for array in arrays:
            assert not array.flags.writeable
            with pytest.raises(ValueError):
                array.reshape(-1)[0] = 1


def test_decoded_programs_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(emulator, "DECODED_PROGRAMS", 2)
    programs = []
    for quads in (1, 2, 3):
        build = Codegen(name=f"q{quads}", quads=quads)
        x = build.input("x", (1, 2), "int8", Space.ARENA)
        build.emit(Move(src=x, dst=build.output("y", (1, 2), "int8")))
        programs.append(elf_bytes(build.program()))
    decoded = [Emulator(p).program for p in programs]
    assert len(emulator._DECODED) <= 2
    assert Emulator(programs[2]).program is decoded[2]
    assert Emulator(programs[0]).program is not decoded[0]


@settings(max_examples=60, deadline=None)
@given(
    shape=st.tuples(st.integers(1, 5), st.integers(1, 4), st.integers(1, 9), st.integers(1, 9)),
    kernel=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    strides=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    dilations=st.tuples(st.integers(1, 2), st.integers(1, 2)),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_tap_products_sum_every_tap_of_every_output_row_range(
    shape: tuple[int, int, int, int],
    kernel: tuple[int, int],
    strides: tuple[int, int],
    dilations: tuple[int, int],
    seed: int,
    data: st.DataObject,
) -> None:
    """`_TapProducts` (implicit GEMM over stride phases) equals the direct integer sum
    out[m, h, w] = sum x[c, h*sh + i*dh, w*sw + j*dw] * weight[m, c, i, j], for any run of
    output rows."""
    channels, out_channels, height, width = shape
    extent = [(k - 1) * d + 1 for k, d in zip(kernel, dilations, strict=True)]
    assume(height >= extent[0] and width >= extent[1])
    rng = np.random.default_rng(seed)
    x = rng.integers(-128, 128, size=(1, channels, height, width)).astype(np.float32)
    weight = rng.integers(-127, 128, size=(out_channels, channels, *kernel))
    out_hw = tuple(
        (n - e) // s + 1 for n, e, s in zip((height, width), extent, strides, strict=True)
    )
    taps = np.ascontiguousarray(weight.transpose(2, 3, 0, 1)).astype(np.float32)
    products = emulator_ops._TapProducts(x, taps, strides, dilations, out_hw)
    first = data.draw(st.integers(0, out_hw[0] - 1))
    rows = range(first, data.draw(st.integers(first + 1, out_hw[0])))
    expected = np.zeros((1, out_channels, len(rows), out_hw[1]), dtype=np.int64)
    codes = x.astype(np.int64)[0]
    for i in range(kernel[0]):
        for j in range(kernel[1]):
            window = _tap_window(codes, (i, j), rows, strides, dilations, out_hw[1])
            expected[0] += np.einsum("mc,chw->mhw", weight[:, :, i, j], window)
    np.testing.assert_array_equal(products.rows(rows), expected)


def _tap_window(
    codes: np.ndarray,
    tap: tuple[int, int],
    rows: range,
    strides: tuple[int, int],
    dilations: tuple[int, int],
    width: int,
) -> np.ndarray:
    """The input elements kernel tap (i, j) meets for output `rows` and `width` columns (the
    last two axes of `codes` are H, W): what a direct convolution sums."""
    top, left = tap[0] * dilations[0], tap[1] * dilations[1]
    return codes[
        ...,
        top + rows.start * strides[0] : top + (rows.stop - 1) * strides[0] + 1 : strides[0],
        left : left + (width - 1) * strides[1] + 1 : strides[1],
    ]


def _eltwise_twice(build_program, inputs: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """The program's output by table lookups (one-code tables two codes at a time, written in
    place) and by the definition (no tables)."""
    outputs = []
    for factor in (0, 10**9):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(emulator_ops, "TABLE_FACTOR", factor)
            (output,) = build_program().run(inputs).values()
            outputs.append(output)
    return outputs[0], outputs[1]


@settings(max_examples=60, deadline=None)
@given(
    op=st.sampled_from(list(EltwiseOp)),
    dtypes=st.sampled_from(["int8", "uint8"]).flatmap(
        lambda a: st.tuples(st.just(a), st.sampled_from(["int8", "uint8"]))
    ),
    out_dtype=st.sampled_from(["int8", "uint8"]),
    constant_side=st.sampled_from(["a", "b"]),
    stored=st.sampled_from(["scalar", "broadcast", "full"]),
    shape=st.tuples(st.integers(1, 3), st.integers(1, 5), st.integers(1, 7)),
    seed=st.integers(0, 2**16),
)
def test_eltwise_with_a_one_code_operand_equals_the_definition(
    op: EltwiseOp,
    dtypes: tuple[str, str],
    out_dtype: str,
    constant_side: str,
    stored: str,
    shape: tuple[int, int, int],
    seed: int,
) -> None:
    """An operand that holds one code (a CONST scalar that numpy broadcasts, or a stride-0
    view) gives a one-code table of the other operand (a full CONST tensor of that code, the
    table of both): equal to the definition for every op, both 8-bit types, zero points and a
    saturating clamp."""
    rng = np.random.default_rng(seed)
    variable_dtype = dtypes[constant_side == "a"]
    constant_dtype = dtypes[constant_side == "b"]
    other = random_codes(rng, shape, variable_dtype)
    code = int(random_codes(rng, (1,), constant_dtype)[0])
    multiplier, shift = quantize_multiplier(float(rng.uniform(1e-3, 4.0)))
    bounds = rng.integers(np.iinfo(out_dtype).min, np.iinfo(out_dtype).max, endpoint=True, size=2)
    low, high = sorted(int(v) for v in bounds)
    zero_point = int(rng.integers(-20, 20)) + (128 if out_dtype == "uint8" else 0)
    requant = Requant(int(multiplier), int(shift), zero_point, low, high, "sima")
    pair = quantize_multiplier(float(rng.uniform(0.1, 0.9)))
    left_shift = {EltwiseOp.ADD: 20, EltwiseOp.SUB: 20, EltwiseOp.DIV: 16}.get(op, 0)
    zero_points = [int(rng.integers(-10, 10)) + (128 if d == "uint8" else 0) for d in dtypes]

    def build_program() -> Codegen:
        build = Codegen()
        variable = build.input("x", shape, variable_dtype, Space.ARENA)
        if stored == "full":
            constant = build.const(np.full(shape, code), constant_dtype)
        else:
            constant = build.const(np.array([code]), constant_dtype)
            if stored == "broadcast":
                constant = constant.broadcast_to(shape)
        a, b = (constant, variable) if constant_side == "a" else (variable, constant)
        build.emit(
            Eltwise(
                op=op,
                a=a,
                b=b,
                output=build.output("y", shape, out_dtype, Space.ARENA),
                requant=requant,
                a_zero_point=zero_points[0],
                b_zero_point=zero_points[1],
                left_shift=left_shift,
                a_multiplier=int(pair[0]),
                a_shift=int(pair[1]),
                b_multiplier=int(pair[0]),
                b_shift=int(pair[1]) + 1,
            )
        )
        return build

    tabulated, defined = _eltwise_twice(build_program, {"x": other})
    np.testing.assert_array_equal(tabulated, defined)


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("layout", ["NCHW", "HWC", "slice"])
def test_lookups_write_strided_and_aliased_destinations(layout: str, in_place: bool) -> None:
    """A lookup gathered straight into its destination (runs of a channel slice, an HWC
    tensor, the operand itself) writes what the definition writes; odd runs take the last
    code alone."""
    rng = np.random.default_rng(3)
    shape = (1, 3, 5, 7)
    x = rng.integers(-128, 128, size=shape).astype(np.int8)
    table = rng.integers(-128, 128, size=256)
    outputs = []
    for factor in (0, 10**9):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(emulator_ops, "TABLE_FACTOR", factor)
            build = Codegen()
            source = build.input("x", shape, "int8", layout="HWC" if layout == "HWC" else "NCHW")
            arena = build.alloc((1, 5, 5, 7), "int8", Space.ARENA)
            wide = arena.slice(1, 1, 4) if layout == "slice" else build.alloc(shape, "int8")
            if layout == "HWC":
                wide = build.alloc(shape, "int8", Space.ARENA, layout="HWC")
            build.emit(Move(src=source, dst=wide))
            lut = Lut(input=wide, table=build.const(table, "int8"), output=wide)
            if not in_place:
                lut = Lut(input=wide, table=lut.table, output=build.alloc(shape, "int8"))
            build.emit(lut)
            build.emit(
                Eltwise(
                    op=EltwiseOp.MUL,
                    a=lut.output,
                    b=wide,
                    output=lut.output if in_place else build.alloc(shape, "int8"),
                    requant=_requant(),
                    a_zero_point=1,
                    b_zero_point=-2,
                )
            )
            last = build.instructions[-1].output
            build.emit(Move(src=last, dst=build.output("y", shape, "int8")))
            outputs.append(build.run({"x": x})["y"])
    np.testing.assert_array_equal(outputs[0], outputs[1])


@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(1, 2),
    groups=st.integers(1, 5),
    group_out=st.integers(1, 2),
    size=st.tuples(st.integers(1, 9), st.integers(1, 9)),
    kernel=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    strides=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    dilations=st.tuples(st.integers(1, 2), st.integers(1, 2)),
    scalar=st.booleans(),
    last=st.booleans(),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_depthwise_taps_sum_every_tap_of_every_block(
    batch: int,
    groups: int,
    group_out: int,
    size: tuple[int, int],
    kernel: tuple[int, int],
    strides: tuple[int, int],
    dilations: tuple[int, int],
    scalar: bool,
    last: bool,
    seed: int,
    data: st.DataObject,
) -> None:
    """`_DepthwiseTaps` (per-channel products of tap columns, or broadcast tap sums) and, for one
    image and one output per channel, `_ChannelLastTaps` (on a channel-last input) equal the
    direct integer sum out[n, g, m, h, w] = sum x[n, g, h*sh + i*dh, w*sw + j*dw] *
    weight[g, m, i, j] for any block of channels and run of output rows."""
    extent = [(k - 1) * d + 1 for k, d in zip(kernel, dilations, strict=True)]
    assume(size[0] >= extent[0] and size[1] >= extent[1])
    rng = np.random.default_rng(seed)
    x = rng.integers(-128, 128, size=(batch, groups, *size)).astype(np.float32)
    weight = rng.integers(-127, 128, size=(groups, group_out, *kernel)).astype(np.float32)
    out_hw = tuple((n - e) // s + 1 for n, e, s in zip(size, extent, strides, strict=True))
    first_group = data.draw(st.integers(0, groups - 1))
    part = slice(first_group, data.draw(st.integers(first_group + 1, groups)))
    first = data.draw(st.integers(0, out_hw[0] - 1))
    rows = range(first, data.draw(st.integers(first + 1, out_hw[0])))
    if last and batch == 1 and group_out == 1:
        channel_last = np.ascontiguousarray(x.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
        windows = emulator_ops._windows(channel_last, kernel, strides, dilations)[0]
        taps = emulator_ops._ChannelLastTaps(windows, weight[:, 0])
        result = taps.rows(part, rows)[:, :, None]
    else:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(emulator_ops, "SCALAR_TAP_OUTPUTS", 0 if scalar else 10**9)
            taps = emulator_ops._DepthwiseTaps(x, weight, strides, dilations, out_hw)
            result = taps.rows(part, rows)
    codes = x.astype(np.int64)[:, part]
    expected = np.zeros((batch, codes.shape[1], group_out, len(rows), out_hw[1]), np.int64)
    for i in range(kernel[0]):
        for j in range(kernel[1]):
            window = _tap_window(codes, (i, j), rows, strides, dilations, out_hw[1])
            expected += window[:, :, None] * weight[part, :, i, j, None, None].astype(np.int64)
    np.testing.assert_array_equal(result, expected)
