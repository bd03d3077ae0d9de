"""The emulator's compiled kernels (compiler/native) compute what its numpy code computes.

Each kernel is compared bit for bit with the numpy code it replaces, over random geometries,
dtypes, zero points and memory layouts (hypothesis), and whole compiled programs give the same
outputs with and without the kernels. `numpy_only` runs the emulator as if the extension were
not built. Where no C compiler was available at install the kernels are absent and these tests
skip, except the one that says a compiler was there and the build failed anyway.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import numpy as np
import onnx
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

import compiler.intmath
from compiler.archive import read_archive
from compiler.compile import compile_model
from compiler.intmath import FusedOutputStage, dtype_range, quantize_multiplier, requantize_clamp
from compiler.isa import Conv, Requant, Space, Tensor
from compiler.native import kernels, status
from compiler.quantize.quantizer import quantize_model
from compiler.runtime import emulator_ops
from compiler.runtime.compare import compare_with_reference
from compiler.runtime.pipeline import run_archive
from surgery.model import load_model
from tests.test_emulator_support import Codegen
from tests.test_intmath_fastpaths import stages

needs_kernels = pytest.mark.skipif(kernels is None, reason=f"compiled kernels: {status}")


@contextmanager
def numpy_only() -> Iterator[None]:
    """Within the block, the emulator runs its numpy code (as without the extension)."""
    with (
        mock.patch.object(compiler.intmath, "native_kernels", None),
        mock.patch.object(emulator_ops, "native_kernels", None),
    ):
        yield


def test_the_kernels_are_built_where_a_c_compiler_is() -> None:
    compiler_command = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler_command) is None:
        pytest.skip(f"no C compiler ({compiler_command}) on this machine")
    headers = Path(sysconfig.get_paths()["include"]) / "Python.h"
    if not headers.exists():
        pytest.skip(f"no Python headers ({headers}) on this machine")
    if os.environ.get("MODEL_SURGERY_NATIVE") == "0":
        pytest.skip("MODEL_SURGERY_NATIVE=0 switches the kernels off")
    assert kernels is not None, status
    assert kernels.instruction_set in ("avx2", "baseline")


# --- output stage -----------------------------------------------------------------------------

LAYOUTS = ["contiguous", "transposed", "rows of a wider array", "per-channel on axis 1 of 4-D"]


def _laid_out(acc: np.ndarray, layout: str) -> np.ndarray:
    """acc (channels, n) as the stage meets it in the emulator: a block of a feature map."""
    if layout == "transposed":
        return np.asfortranarray(acc)
    if layout == "rows of a wider array":
        wide = np.zeros((acc.shape[0], acc.shape[1] + 3), dtype=acc.dtype)
        wide[:, 1 : 1 + acc.shape[1]] = acc
        return wide[:, 1 : 1 + acc.shape[1]]
    return acc


@needs_kernels
@settings(max_examples=300, deadline=None)
@given(
    case=stages(),
    carrier=st.sampled_from(["float32", "float64", "int32", "int64"]),
    layout=st.sampled_from(LAYOUTS),
    data=st.data(),
)
def test_compiled_output_stage_writes_the_numpy_codes(
    case: dict, carrier: str, layout: str, data: st.DataObject
) -> None:
    stage = FusedOutputStage.prepare(
        case["multiplier"],
        case["shift"],
        case["zero_point"],
        case["low"],
        case["high"],
        case["addend"],
        case["dtype"],
    )
    assume(stage is not None)
    limit = {"float32": 2**24, "float64": 2**53, "int32": 2**31 - 1, "int64": 2**53}[carrier]
    channels = case["multiplier"].shape[0]
    width = data.draw(st.integers(1, 40))
    values = data.draw(
        st.lists(st.integers(-limit, limit), min_size=channels * width, max_size=channels * width)
    )
    acc = np.array(values, dtype=np.int64).reshape(channels, width).astype(carrier)
    acc = _laid_out(acc, layout)
    if layout == "per-channel on axis 1 of 4-D":
        acc = acc.reshape(1, channels, 1, width)
        tables = tuple(t.reshape(1, channels, 1, 1) for t in stage.tables())
    else:
        tables = None
    compiled = np.empty(acc.shape, dtype=case["dtype"])
    stage.apply(acc, compiled, tables)
    expected = np.empty(acc.shape, dtype=case["dtype"])
    with numpy_only():
        stage.apply(acc, expected, tables)
    np.testing.assert_array_equal(compiled, expected)
    exact = acc.reshape(channels, width).astype(np.int64) + case["addend"]
    definition = requantize_clamp(
        exact,
        case["multiplier"],
        case["shift"],
        "sima",
        case["zero_point"],
        case["low"],
        case["high"],
    )
    np.testing.assert_array_equal(compiled.reshape(channels, width), definition)


@needs_kernels
def test_compiled_output_stage_refuses_mismatched_operands() -> None:
    acc = np.zeros((2, 3), np.float32)
    table = np.zeros((2, 1))
    shifts = np.zeros((2, 1), np.int64)
    with pytest.raises(ValueError, match="same shape"):
        kernels.output_stage(
            acc, np.zeros((2, 4), np.uint8), table, table, table, table, shifts, True, 0.0, 255.0, 0
        )
    with pytest.raises(ValueError, match="does not broadcast"):
        kernels.output_stage(
            acc,
            np.zeros((2, 3), np.uint8),
            table,
            table,
            np.zeros((3, 1)),
            table,
            shifts,
            True,
            0.0,
            255.0,
            0,
        )
    with pytest.raises(TypeError, match="writable"):
        frozen = np.zeros((2, 3), np.uint8)
        frozen.flags.writeable = False
        kernels.output_stage(acc, frozen, table, table, table, table, shifts, True, 0.0, 255.0, 0)


# --- depthwise and im2col ---------------------------------------------------------------------


@st.composite
def conv_geometries(draw: st.DrawFn, *, depthwise: bool, wide_codes: bool = True) -> dict:
    """A CONV's input, kernel, strides, dilations and pads, its codes' dtype and zero point."""
    kernel = draw(
        st.sampled_from([(3, 3), (5, 5), (1, 1), (7, 1), (1, 7)])
        | st.tuples(st.integers(1, 4), st.integers(1, 4))
    )
    geometry = {
        "batch": draw(st.integers(1, 2)),
        "channels": draw(st.integers(1, 6)),
        "spatial": (draw(st.integers(1, 12)), draw(st.integers(1, 12))),
        "kernel": kernel,
        "strides": (draw(st.integers(1, 3)), draw(st.integers(1, 3))),
        "dilations": (draw(st.integers(1, 2)), draw(st.integers(1, 2))),
        "pads": tuple(draw(st.integers(0, 3)) for _ in range(4)),
        "dtype": draw(
            st.sampled_from(
                ["int8", "uint8", "int16"] if depthwise and wide_codes else ["int8", "uint8"]
            )
        ),
        "channel_last": draw(st.booleans()),
    }
    for axis in range(2):
        extent = (kernel[axis] - 1) * geometry["dilations"][axis] + 1
        padded = geometry["spatial"][axis] + geometry["pads"][axis] + geometry["pads"][axis + 2]
        assume(padded >= extent)
    return geometry


def _codes(geometry: dict, seed: int) -> tuple[np.ndarray, int]:
    """Random codes of the geometry (channel-last in memory where it says so), a zero point."""
    info = np.iinfo(geometry["dtype"])
    rng = np.random.default_rng(seed)
    shape = (geometry["batch"], geometry["channels"], *geometry["spatial"])
    codes = rng.integers(info.min, info.max + 1, size=shape).astype(geometry["dtype"])
    if geometry["channel_last"]:
        codes = np.ascontiguousarray(codes.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    return codes, int(rng.integers(info.min, info.max + 1))


def _output_size(size: int, pads: int, kernel: int, stride: int, dilation: int) -> int:
    return (size + pads - (kernel - 1) * dilation - 1) // stride + 1


def _depthwise_reference(codes, zero_point, weight, pads, strides, dilations) -> np.ndarray:
    """Tap by tap in int64, the padding holding the zero point (centred 0)."""
    top, left, bottom, right = pads
    x = np.pad(codes.astype(np.int64) - zero_point, ((0, 0), (0, 0), (top, bottom), (left, right)))
    (kh, kw), (sh, sw), (dh, dw) = weight.shape[1:], strides, dilations
    ho = _output_size(codes.shape[2], top + bottom, kh, sh, dh)
    wo = _output_size(codes.shape[3], left + right, kw, sw, dw)
    acc = np.zeros((codes.shape[0], codes.shape[1], ho, wo), np.int64)
    for i in range(kh):
        for j in range(kw):
            window = x[:, :, i * dh : i * dh + (ho - 1) * sh + 1 : sh, j * dw :: sw][..., :wo]
            acc += weight[None, :, i, j, None, None] * window
    return acc


@needs_kernels
@settings(max_examples=300, deadline=None)
@given(geometry=conv_geometries(depthwise=True), seed=st.integers(0, 2**32 - 1))
def test_compiled_depthwise_sums_are_the_exact_integers(geometry: dict, seed: int) -> None:
    codes, zero_point = _codes(geometry, seed)
    rng = np.random.default_rng(seed + 1)
    weight = rng.integers(-128, 128, size=(geometry["channels"], *geometry["kernel"]))
    expected = _depthwise_reference(
        codes, zero_point, weight, geometry["pads"], geometry["strides"], geometry["dilations"]
    )
    assert np.abs(expected).max(initial=0) < 2**31
    out = np.empty(expected.shape, np.int32)
    kernels.depthwise(
        codes,
        zero_point,
        weight.astype(np.int32),
        geometry["pads"],
        geometry["strides"],
        geometry["dilations"],
        out,
    )
    np.testing.assert_array_equal(out, expected)


@needs_kernels
@settings(max_examples=300, deadline=None)
@given(
    geometry=conv_geometries(depthwise=False),
    dtype=st.sampled_from([np.float32, np.float64]),
    seed=st.integers(0, 2**32 - 1),
    data=st.data(),
)
def test_compiled_im2col_columns_are_the_numpy_columns(
    geometry: dict, dtype: type, seed: int, data: st.DataObject
) -> None:
    codes, zero_point = _codes(geometry, seed)
    kernel, strides, dilations = geometry["kernel"], geometry["strides"], geometry["dilations"]
    top, left, bottom, right = geometry["pads"]
    ho = _output_size(codes.shape[2], top + bottom, kernel[0], strides[0], dilations[0])
    wo = _output_size(codes.shape[3], left + right, kernel[1], strides[1], dilations[1])
    first = data.draw(st.integers(0, ho - 1))
    rows = data.draw(st.integers(1, ho - first))
    padded = emulator_ops._centred_as(codes, zero_point, dtype, geometry["pads"])
    end = (first + rows - 1) * strides[0] + (kernel[0] - 1) * dilations[0] + 1
    window = padded[:, :, first * strides[0] : end]
    expected = np.array(emulator_ops._im2col(window, kernel, strides, dilations))
    out = np.empty((codes.shape[0], codes.shape[1], *kernel, rows, wo), dtype)
    kernels.im2col(codes, zero_point, kernel, geometry["pads"], strides, dilations, first, out)
    np.testing.assert_array_equal(out, expected.reshape(out.shape))


@needs_kernels
def test_compiled_depthwise_refuses_shapes_that_disagree() -> None:
    codes = np.zeros((1, 2, 5, 5), np.int8)
    weight = np.zeros((2, 3, 3), np.int32)
    with pytest.raises(ValueError, match="disagree"):
        kernels.depthwise(
            codes, 0, weight, (0, 0, 0, 0), (1, 1), (1, 1), np.zeros((1, 2, 4, 4), np.int32)
        )
    with pytest.raises(TypeError, match="int32"):
        kernels.depthwise(
            codes,
            0,
            weight.astype(np.int64),
            (0, 0, 0, 0),
            (1, 1),
            (1, 1),
            np.zeros((1, 2, 3, 3), np.int32),
        )


@needs_kernels
@pytest.mark.parametrize("item", [np.uint8, np.int16, np.int32, np.int64])
@pytest.mark.parametrize("pair", [False, True], ids=["one code", "code pair"])
def test_compiled_lookup_gathers_the_table_entries(item: type, pair: bool) -> None:
    rng = np.random.default_rng(3)
    info = np.iinfo(item)
    table = rng.integers(info.min, info.max, size=65536 if pair else 256, dtype=item)
    first = rng.integers(0, 256, size=1001).astype(np.uint8)
    second = rng.integers(0, 256, size=1001).astype(np.uint8) if pair else None
    out = np.empty(1001, item)
    kernels.lookup(table, first, second, out)
    index = first.astype(np.int64) * 256 + second if pair else first
    np.testing.assert_array_equal(out, table[index])
    with pytest.raises(ValueError, match="a table of every code"):
        kernels.lookup(table[:255], first, None, out)


# --- the int8 (VNNI) CONV kernels -------------------------------------------------------------

needs_vnni = pytest.mark.skipif(
    kernels is None or not kernels.vnni, reason="the int8 CONV kernels need AVX-512 VNNI"
)
"""(The kernels' own tests run wherever the CPU has VNNI, whatever MODEL_SURGERY_VNNI says.)"""


def _conv_instruction(geometry: dict, out_channels: int, group: int, zero_point: int) -> Conv:
    """A CONV carrying the geometry (its tensors are placeholders: the kernels read arrays)."""
    batch, channels = geometry["batch"], geometry["channels"]
    kernel = geometry["kernel"]
    source = Tensor.contiguous(
        Space.ARENA, geometry["dtype"], 0, (batch, channels, *geometry["spatial"])
    )
    weight = Tensor.contiguous(Space.CONST, "int8", 0, (out_channels, channels // group, *kernel))
    top, left, bottom, right = geometry["pads"]
    (sh, sw), (dh, dw) = geometry["strides"], geometry["dilations"]
    ho = _output_size(geometry["spatial"][0], top + bottom, kernel[0], sh, dh)
    wo = _output_size(geometry["spatial"][1], left + right, kernel[1], sw, dw)
    output = Tensor.contiguous(Space.ARENA, "int8", 0, (batch, out_channels, ho, wo))
    return Conv(
        input=source,
        weight=weight,
        output=output,
        requant=Requant(2**30, 0, 0, -128, 127, "sima"),
        input_zero_point=zero_point,
        strides=geometry["strides"],
        dilations=geometry["dilations"],
        pads=geometry["pads"],
        group=group,
    )


def _conv_reference(codes, zero_point, weight, geometry, group) -> np.ndarray:
    """The exact grouped CONV sums in int64, tap by tap, the padding holding the zero point."""
    top, left, bottom, right = geometry["pads"]
    x = np.pad(codes.astype(np.int64) - zero_point, ((0, 0), (0, 0), (top, bottom), (left, right)))
    (kh, kw), (sh, sw), (dh, dw) = weight.shape[2:], geometry["strides"], geometry["dilations"]
    ho = _output_size(codes.shape[2], top + bottom, kh, sh, dh)
    wo = _output_size(codes.shape[3], left + right, kw, sw, dw)
    out_channels, group_channels = weight.shape[:2]
    group_out = out_channels // group
    acc = np.zeros((codes.shape[0], out_channels, ho, wo), np.int64)
    for i in range(kh):
        for j in range(kw):
            window = x[:, :, i * dh : i * dh + (ho - 1) * sh + 1 : sh, j * dw :: sw][..., :wo]
            for g in range(group):
                part = window[:, g * group_channels : (g + 1) * group_channels]
                taps = weight[g * group_out : (g + 1) * group_out, :, i, j]
                acc[:, g * group_out : (g + 1) * group_out] += np.einsum(
                    "nchw,mc->nmhw", part, taps
                )
    return acc


@st.composite
def int8_convs(draw: st.DrawFn) -> tuple[dict, int, int]:
    """A CONV geometry with int8 or uint8 codes, its output channels and group (depthwise
    about one time in three)."""
    geometry = draw(conv_geometries(depthwise=True, wide_codes=False))
    channels = geometry["channels"]
    if draw(st.integers(0, 2)) == 0:
        return geometry, channels, channels
    group = draw(st.sampled_from([g for g in range(1, channels + 1) if channels % g == 0]))
    assume(channels > group)  # several input channels per group (else it is depthwise)
    return geometry, group * draw(st.integers(1, 9)), group


@needs_vnni
@settings(max_examples=300, deadline=None)
@given(case=int8_convs(), seed=st.integers(0, 2**32 - 1), data=st.data())
def test_int8_kernels_compute_the_exact_sums(case, seed: int, data: st.DataObject) -> None:
    """`conv_planes` / `depthwise_planes` accumulators over `_PhasePlanes` (a copy or the codes
    in place) equal the int64 sums, for any rows of a dense CONV's output."""
    geometry, out_channels, group = case
    codes, zero_point = _codes(geometry, seed)
    rng = np.random.default_rng(seed + 1)
    weight = rng.integers(
        -128, 128, size=(out_channels, geometry["channels"] // group, *geometry["kernel"])
    )
    expected = _conv_reference(codes, zero_point, weight, geometry, group)
    instruction = _conv_instruction(geometry, out_channels, group, zero_point)
    weights = emulator_ops._Weights(weight, (1, 2, 3))
    code = zero_point + (128 if codes.dtype == np.int8 else 0)
    quads, corrections = weights.int8_quads(group, code)
    planes = emulator_ops._PhasePlanes.of(codes, instruction, None, lambda n: np.empty(n, np.uint8))
    batch, _, ho, wo = expected.shape
    pitch = planes.pitch
    if geometry["channels"] == group == out_channels:
        first = data.draw(st.integers(0, out_channels - 1))
        count = data.draw(st.integers(1, out_channels - first))
        acc = np.empty((batch, count, (ho - 1) * pitch + wo), np.int32)
        kernels.depthwise_planes(
            *planes.operands(), quads.reshape(out_channels, -1), corrections.reshape(-1), first, acc
        )
        rows, wanted = range(ho), expected[:, first : first + count]
    else:
        start = data.draw(st.integers(0, ho - 1))
        rows = range(start, data.draw(st.integers(start + 1, ho)))
        acc = np.empty((batch, out_channels, (len(rows) - 1) * pitch + wo), np.int32)
        kernels.conv_planes(*planes.operands(), quads, corrections, group, rows.start, acc)
        wanted = expected[:, :, rows.start : rows.stop]
    got = emulator_ops._pitched(acc, len(rows), pitch, wo)
    np.testing.assert_array_equal(got, wanted)


@st.composite
def conv_stages(draw: st.DrawFn, channels: int, path: str) -> FusedOutputStage:
    """A per-channel CONV output stage into 8- or 16-bit codes, as the quantizer makes them
    (multipliers of real scales, a bias, a zero point and an activation's clamp), on the
    fused stage's float64 path (the usual scales) or its int64 one (small scales)."""
    # 16-bit codes span too much for the float path but with the largest scales; 8-bit codes
    # leave it for scales below about 2**-15
    wide = [] if path == "float64" else [np.int16, np.uint16]
    dtype = np.dtype(draw(st.sampled_from([np.int8, np.uint8, *wide])))
    dtype_low, dtype_high = dtype_range(dtype)
    if path == "float64":
        exponent = draw(st.integers(-14, -2))
    else:
        exponent = draw(st.integers(-20, -16) if dtype.itemsize == 1 else st.integers(-14, -8))
    reals = [draw(st.floats(0.5, 1.0)) * 2.0**exponent for _ in range(channels)]
    multiplier, shift = quantize_multiplier(reals)
    low = draw(st.sampled_from([dtype_low]) | st.integers(dtype_low, dtype_high))
    high = draw(st.sampled_from([dtype_high]) | st.integers(low, dtype_high))
    zero_point = draw(st.integers(dtype_low, dtype_high))
    bias = [draw(st.integers(-(2**20), 2**20)) for _ in range(channels)]
    stage = FusedOutputStage.prepare(
        np.asarray(multiplier).reshape(-1, 1, 1),
        np.asarray(shift).reshape(-1, 1, 1),
        zero_point,
        low,
        high,
        np.asarray(bias, np.int64).reshape(-1, 1, 1),
        dtype,
    )
    assume(stage is not None and stage.exact_float == (path == "float64"))
    return stage


@needs_vnni
@pytest.mark.parametrize("path", ["float64", "int64"])
@settings(max_examples=150, deadline=None)
@given(
    case=int8_convs(),
    layout=st.sampled_from(["NCHW", "a block of a wider map", "channel-last"]),
    seed=st.integers(0, 2**32 - 1),
    data=st.data(),
)
def test_int8_kernels_with_their_stage_write_the_numpy_codes(
    path: str, case, layout: str, seed: int, data: st.DataObject
) -> None:
    """The kernels' fused output stage (float64 or int64 path) writes the codes
    `FusedOutputStage` writes from the same sums, into destinations whose rows are contiguous
    (where the stage-fused path applies), whatever their channel and row strides."""
    geometry, out_channels, group = case
    stage = data.draw(conv_stages(out_channels, path))
    codes, zero_point = _codes(geometry, seed)
    rng = np.random.default_rng(seed + 2)
    weight = rng.integers(
        -128, 128, size=(out_channels, geometry["channels"] // group, *geometry["kernel"])
    )
    expected_acc = _conv_reference(codes, zero_point, weight, geometry, group)
    expected = np.empty(expected_acc.shape, stage.code_dtype)
    with numpy_only():
        stage.apply(expected_acc, expected)
    instruction = _conv_instruction(geometry, out_channels, group, zero_point)
    quads, corrections = emulator_ops._Weights(weight, (1, 2, 3)).int8_quads(
        group, zero_point + (128 if codes.dtype == np.int8 else 0)
    )
    planes = emulator_ops._PhasePlanes.of(codes, instruction, None, lambda n: np.empty(n, np.uint8))
    fused = emulator_ops.kernel_stage_tables(stage, out_channels)
    assert fused is not None
    shape = expected.shape
    if layout == "NCHW":
        out = np.zeros(shape, stage.code_dtype)
    elif layout == "a block of a wider map":
        wide = np.zeros((shape[0], shape[1] + 2, shape[2] + 3, shape[3]), stage.code_dtype)
        out = wide[:, 1 : 1 + shape[1], 2 : 2 + shape[2]]
    else:
        out = np.zeros((shape[0], shape[2], shape[1], shape[3]), stage.code_dtype).transpose(
            0, 2, 1, 3
        )
    if geometry["channels"] == group == out_channels:
        kernels.depthwise_planes(
            *planes.operands(),
            quads.reshape(out_channels, -1),
            corrections.reshape(-1),
            0,
            out,
            fused,
        )
    else:
        kernels.conv_planes(*planes.operands(), quads, corrections, group, 0, out, fused)
    np.testing.assert_array_equal(out, expected)


@needs_kernels
@settings(max_examples=200, deadline=None)
@given(geometry=conv_geometries(depthwise=True), seed=st.integers(0, 2**32 - 1))
def test_phase_planes_are_the_padded_codes_split_by_stride(geometry: dict, seed: int) -> None:
    assume(geometry["dtype"] != "int16")
    codes, zero_point = _codes(geometry, seed)
    (sh, sw), (top, left, bottom, right) = geometry["strides"], geometry["pads"]
    batch, channels, height, width = codes.shape
    rows, pitch = -(-(height + top + bottom) // sh), -(-(width + left + right) // sw)
    pad = zero_point & 0xFF
    padded = np.full((batch, channels, rows * sh, pitch * sw), pad, np.uint8)
    padded[:, :, top : top + height, left : left + width] = codes.view(np.uint8)
    expected = np.stack([padded[:, :, a::sh, b::sw] for a in range(sh) for b in range(sw)], axis=2)
    out = np.empty(expected.size, np.uint8)
    kernels.phase_planes(codes, (top, left), (sh, sw), 0, pad, (rows, pitch), out)
    np.testing.assert_array_equal(out.reshape(expected.shape), expected)


@needs_vnni
def test_int8_kernels_refuse_reads_past_their_planes() -> None:
    planes = np.zeros(2 * 3 * 3, np.uint8)
    phase, offset = np.zeros(4, np.int32), np.array([0, 1, 3, 4], np.int64)
    weights, corrections = np.zeros((1, 2, 1), np.int32), np.zeros((1, 2), np.int32)
    with pytest.raises(ValueError, match="disagree"):  # 2 rows of 3 + offset 4 > 9 elements
        kernels.conv_planes(
            planes,
            (1, 2, 1, 3, 3),
            0,
            phase,
            offset,
            weights,
            corrections,
            1,
            0,
            np.zeros((1, 2, 6), np.int32),
        )
    with pytest.raises(ValueError, match="outside its planes"):
        kernels.conv_planes(
            planes,
            (1, 2, 1, 3, 3),
            0,
            phase,
            offset + 9,
            weights,
            corrections,
            1,
            0,
            np.zeros((1, 2, 1), np.int32),
        )


@pytest.mark.parametrize("in_place", [False, True], ids=["apart", "output over the input"])
@pytest.mark.parametrize(("batch", "spatial"), [(37, (1, 1)), (5, (3, 5)), (3, (7, 9))])
def test_a_1x1_conv_over_a_batch_of_small_maps_is_the_numpy_result(
    batch: int, spatial: tuple[int, int], in_place: bool
) -> None:
    """A transformer's linear layer is a 1x1 CONV over a batch of tokens: the kernels take the
    batch's positions together (`_over_images`), also where the output overwrites the input."""
    rng = np.random.default_rng(batch)
    channels, out_channels = 24, 40
    codes = rng.integers(-128, 128, size=(batch, channels, *spatial)).astype(np.int8)
    multiplier, shift = quantize_multiplier(rng.uniform(0.5, 1.0, out_channels) * 2.0**-9)
    build = Codegen()
    source = build.input("x", codes.shape, "int8", Space.ARENA)
    shape = (batch, out_channels, *spatial)
    target = build.output("y", shape, "int8", Space.ARENA)
    if in_place:
        target = Tensor.contiguous(Space.ARENA, "int8", source.offset, shape)
        build.tensors[-1] = dataclasses.replace(build.tensors[-1], tensor=target)
        build.cursor[Space.ARENA] += target.nbytes
    build.emit(
        Conv(
            input=source,
            weight=build.const(
                rng.integers(-127, 128, size=(out_channels, channels, 1, 1)), "int8"
            ),
            bias=build.const(rng.integers(-3000, 3000, size=out_channels), "int32"),
            output=target,
            requant=build.requant(
                multiplier, shift, -3, -128, 127, "sima", table_shape=(out_channels,)
            ),
            input_zero_point=5,
        )
    )
    compiled = build.run({"x": codes})["y"]
    with numpy_only():
        expected = build.run({"x": codes})["y"]
    np.testing.assert_array_equal(compiled, expected)


# --- whole programs ---------------------------------------------------------------------------


def _mobile_block() -> onnx.ModelProto:
    """A MobileNet-style block on odd sizes: stem 3x3 stride 2 (padded), 1x1 expansion,
    depthwise 3x3 and 5x5 (strides 1 and 2), 1x1 projection, a residual Add, a grouped 3x3."""
    rng = np.random.default_rng(7)

    def weight(name: str, shape: tuple[int, ...]) -> onnx.TensorProto:
        return numpy_helper.from_array((0.2 * rng.standard_normal(shape)).astype(np.float32), name)

    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["c0"], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Relu", ["c0"], ["r0"]),
        helper.make_node("Conv", ["r0", "w1"], ["c1"]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2"], ["c2"], group=24, pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"]),
        helper.make_node("Conv", ["r2", "w3"], ["c3"]),
        helper.make_node("Add", ["c3", "r0"], ["a3"]),
        helper.make_node("Conv", ["a3", "w4"], ["c4"], group=8, pads=[2, 2, 2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["c4", "w5"], ["y"], group=2, pads=[1, 1, 1, 1]),
    ]
    initializers = [
        weight("w0", (8, 3, 3, 3)),
        weight("w1", (24, 8, 1, 1)),
        weight("w2", (24, 1, 3, 3)),
        weight("w3", (8, 24, 1, 1)),
        weight("w4", (8, 1, 5, 5)),
        weight("w5", (6, 4, 3, 3)),
    ]
    graph = helper.make_graph(
        nodes,
        "mobile_block",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 23, 19])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializers,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@contextmanager
def without_vnni() -> Iterator[None]:
    """Within the block, the compiled kernels run without the int8 CONV ones (no VNNI)."""
    with mock.patch.object(emulator_ops, "native_vnni", False):
        yield


@needs_kernels
def test_a_compiled_program_gives_the_same_outputs_with_and_without_the_kernels(
    tmp_path,
) -> None:
    model = load_model(_mobile_block())
    rng = np.random.default_rng(0)
    data = [{"x": rng.standard_normal((1, 3, 23, 19)).astype(np.float32)} for _ in range(4)]
    qdq = quantize_model(model, data, target="mlsoc").model
    archive = read_archive(compile_model(qdq, tmp_path, model_name="mobile_block").archive)
    feeds = {"x": rng.standard_normal((1, 3, 23, 19)).astype(np.float32)}
    compiled, stats = run_archive(archive, feeds, keep_tensors=True)
    comparison = compare_with_reference(archive.manifest, qdq, feeds, compiled, stats.tensors)
    assert comparison.bit_exact, comparison
    with numpy_only():
        plain, _ = run_archive(archive, feeds)
    with without_vnni():
        blas, _ = run_archive(archive, feeds)
    assert compiled.keys() == plain.keys() == blas.keys()
    for name in compiled:
        np.testing.assert_array_equal(compiled[name], plain[name])
        np.testing.assert_array_equal(blas[name], plain[name])


def test_without_the_built_extension_the_status_says_it_is_missing(tmp_path) -> None:
    source = Path(compiler.intmath.__file__).parent
    (tmp_path / "compiler" / "native").mkdir(parents=True)
    for part in ("__init__.py", "native/__init__.py"):
        (tmp_path / "compiler" / part).write_text((source / part).read_text())
    shown = subprocess.run(
        [sys.executable, "-c", "import compiler.native as n; print(n.status)"],
        cwd=tmp_path,
        env={"PYTHONPATH": str(tmp_path), "PATH": ""},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "no compiled _mla_kernels" in shown and "circular" not in shown
