"""Data movement as strided MOVE / FILL / LOAD / STORE, bit for bit against the reference ops.

Every ONNX data-movement op the MLA runs is a descriptor view plus MOVE (with a rescale when the
quantizations differ); these tests build the views by hand and compare with
`compiler.runtime.ops.movement`.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compiler.intmath import quantize_constant
from compiler.isa import Fill, Load, Move, Space, Store, Tensor
from compiler.runtime.ops.base import Rescale
from compiler.runtime.ops.movement import (
    ConcatKernel,
    SplitKernel,
    depth_to_space,
    expand,
    gather,
    pad,
    slice_axes,
    space_to_depth,
    tile,
    transpose,
)
from tests.test_emulator_support import Codegen, qparams, random_codes, run_single

SEEDS = st.integers(0, 2**32 - 1)
SHAPES = st.lists(st.integers(1, 5), min_size=1, max_size=5)


def _move(build: Codegen, src: Tensor, dst: Tensor, rescale: Rescale) -> Move:
    input_zero_point, requant = build.rescale(rescale)
    return Move(src=src, dst=dst, input_zero_point=input_zero_point, requant=requant)


def _rescale(rescaled: bool) -> Rescale:
    source = qparams(0.05, 3)
    return Rescale.build(source, qparams(0.07, -9) if rescaled else source, "sima")


@settings(max_examples=30, deadline=None)
@given(shape=SHAPES, rescaled=st.booleans(), data=st.data(), seed=SEEDS)
def test_transpose_is_a_strided_move(
    shape: list, rescaled: bool, data: st.DataObject, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    perm = data.draw(st.permutations(range(len(shape))))
    rescale = _rescale(rescaled)
    x = random_codes(rng, shape, "int8")
    expected = rescale(transpose(x, list(perm)))
    build = Codegen()
    source = build.input("x", x.shape, "int8", Space.ARENA)
    build.emit(
        _move(build, source.transpose(perm), build.output("y", expected.shape, "int8"), rescale)
    )
    run_single(build, {"x": x}, expected)


@settings(max_examples=40, deadline=None)
@given(shape=SHAPES, data=st.data(), seed=SEEDS)
def test_slice_with_onnx_clamping_and_negative_steps(
    shape: list, data: st.DataObject, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    axes = data.draw(st.lists(st.integers(0, len(shape) - 1), min_size=1, unique=True))
    starts = [data.draw(st.integers(-7, 7)) for _ in axes]
    ends = [data.draw(st.integers(-7, 7)) for _ in axes]
    steps = [data.draw(st.sampled_from([-2, -1, 1, 2, 3])) for _ in axes]
    x = random_codes(rng, shape, "int8")
    expected = slice_axes(x, starts, ends, axes, steps)
    build = Codegen()
    view = build.input("x", x.shape, "int8", Space.DRAM)
    for start, end, axis, step in zip(starts, ends, axes, steps, strict=True):
        dim = view.shape[axis]
        low, high = (0, dim) if step > 0 else (-1, dim - 1)
        start = min(max(start + dim if start < 0 else start, low), high)
        end = min(max(end + dim if end < 0 else end, low), high)
        view = view.slice(axis, start, end, step)
    build.emit(Move(src=view, dst=build.output("y", expected.shape, "int8", Space.ARENA)))
    run_single(build, {"x": x}, expected)


@pytest.mark.parametrize("mode", ["DCR", "CRD"])
@pytest.mark.parametrize("block", [2, 3])
def test_depth_to_space_is_one_six_d_move(mode: str, block: int) -> None:
    rng = np.random.default_rng(block)
    n, depth, h, w = 2, 3, 4, 5
    x = random_codes(rng, (n, depth * block * block, h, w), "uint8")
    expected = depth_to_space(x, block, mode)
    build = Codegen()
    source = build.input("x", x.shape, "uint8", Space.ARENA)
    target = build.output("y", expected.shape, "uint8", Space.DRAM)
    if mode == "DCR":
        view = source.reshape((n, block, block, depth, h, w)).transpose((0, 3, 4, 1, 5, 2))
    else:
        view = source.reshape((n, depth, block, block, h, w)).transpose((0, 1, 4, 2, 5, 3))
    build.emit(Move(src=view, dst=target.reshape((n, depth, h, block, w, block))))
    run_single(build, {"x": x}, expected)


def test_space_to_depth_is_one_six_d_move() -> None:
    rng = np.random.default_rng(5)
    block, n, c, h, w = 2, 1, 3, 4, 6
    x = random_codes(rng, (n, c, h, w), "int8")
    expected = space_to_depth(x, block)
    build = Codegen()
    source = build.input("x", x.shape, "int8", Space.ARENA)
    target = build.output("y", expected.shape, "int8", Space.ARENA)
    view = source.reshape((n, c, h // block, block, w // block, block))
    view = view.transpose((0, 3, 5, 1, 2, 4))
    build.emit(Move(src=view, dst=target.reshape((n, block, block, c, h // block, w // block))))
    run_single(build, {"x": x}, expected)


@settings(max_examples=25, deadline=None)
@given(
    count=st.integers(1, 4),
    axis=st.integers(1, 3),
    sizes=st.lists(st.integers(1, 4), min_size=4, max_size=4),
    seed=SEEDS,
)
def test_concat_moves_each_rescaled_input_into_a_slice(
    count: int, axis: int, sizes: list, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    target = qparams(0.06, 2)
    params = [
        qparams(float(rng.uniform(0.02, 0.1)), int(rng.integers(-20, 20))) for _ in range(count)
    ]
    params[0] = target
    rescales = tuple(Rescale.build(p, target, "tflite") for p in params)
    base = [2, 3, 4, 3]
    inputs = []
    for i in range(count):
        shape = list(base)
        shape[axis] = sizes[i]
        inputs.append(random_codes(rng, shape, "int8"))
    expected = ConcatKernel(axis, rescales)(*inputs)
    build = Codegen()
    out = build.output("y", expected.shape, "int8", Space.DRAM, "HWC")
    position = 0
    for i, x in enumerate(inputs):
        source = build.input(f"x{i}", x.shape, "int8", Space.ARENA)
        size = x.shape[axis]
        build.emit(_move(build, source, out.slice(axis, position, position + size), rescales[i]))
        position += size
    run_single(build, {f"x{i}": x for i, x in enumerate(inputs)}, expected)


def test_split_moves_slices_out() -> None:
    rng = np.random.default_rng(11)
    x = random_codes(rng, (1, 7, 3, 2), "int8")
    rescales = (_rescale(False), _rescale(True), _rescale(False))
    kernel = SplitKernel(1, (2, 4, 1), rescales)
    expected = kernel(x)
    build = Codegen()
    source = build.input("x", x.shape, "int8", Space.DRAM, "HWC")
    position = 0
    for i, part in enumerate(expected):
        out = build.output(f"y{i}", part.shape, "int8", Space.ARENA)
        size = part.shape[1]
        build.emit(_move(build, source.slice(1, position, position + size), out, rescales[i]))
        position += size
    results = build.run({"x": x})
    for i, part in enumerate(expected):
        np.testing.assert_array_equal(results[f"y{i}"], part)


@settings(max_examples=25, deadline=None)
@given(
    shape=st.lists(st.integers(1, 4), min_size=4, max_size=4),
    pads=st.lists(st.integers(-1, 2), min_size=8, max_size=8),
    value=st.floats(-1.0, 1.0),
    seed=SEEDS,
)
def test_constant_pad_is_fill_then_move(shape: list, pads: list, value: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    if any(shape[a] + pads[a] + pads[a + 4] < 1 for a in range(4)):
        pads = [max(p, 0) for p in pads]
    x = random_codes(rng, shape, "int8")
    code = int(quantize_constant(value, 0.05, 3, np.int8))
    expected = pad(x, pads, None, "constant", code)
    build = Codegen()
    source = build.input("x", x.shape, "int8", Space.ARENA)
    target = build.output("y", expected.shape, "int8", Space.ARENA)
    interior, window = target, source
    for axis in range(4):
        begin, end = pads[axis], pads[axis + 4]
        interior = interior.slice(axis, max(begin, 0), expected.shape[axis] - max(end, 0))
        window = window.slice(axis, max(-begin, 0), shape[axis] - max(-end, 0))
    build.emit(Fill(dst=target, value=code), Move(src=window, dst=interior))
    run_single(build, {"x": x}, expected)


def test_expand_tile_and_gather() -> None:
    rng = np.random.default_rng(3)
    x = random_codes(rng, (1, 3, 1, 2), "int8")
    expanded = expand(x, [2, 3, 4, 2])
    tiled = tile(x, [1, 2, 3, 1])
    gathered = gather(x, np.array([2, 0, 2]), axis=1)
    build = Codegen()
    source = build.input("x", x.shape, "int8", Space.DRAM)
    out_expand = build.output("expand", expanded.shape, "int8", Space.ARENA)
    out_tile = build.output("tile", tiled.shape, "int8", Space.DRAM)
    out_gather = build.output("gather", gathered.shape, "int8", Space.ARENA)
    build.emit(Move(src=source.broadcast_to(expanded.shape), dst=out_expand))
    for i in range(2):
        for j in range(3):
            block = out_tile.slice(1, 3 * i, 3 * i + 3).slice(2, j, j + 1)
            build.emit(Move(src=source, dst=block))
    for k, index in enumerate([2, 0, 2]):
        build.emit(Move(src=source.slice(1, index, index + 1), dst=out_gather.slice(1, k, k + 1)))
    results = build.run({"x": x})
    np.testing.assert_array_equal(results["expand"], expanded)
    np.testing.assert_array_equal(results["tile"], tiled)
    np.testing.assert_array_equal(results["gather"], gathered)


def test_rescale_changes_dtype_and_load_store_round_trip() -> None:
    """DQ -> Q between uint8 and int8 (a MOVE with requant), then LOAD / STORE through the arena."""
    rng = np.random.default_rng(4)
    x = random_codes(rng, (1, 4, 3, 3), "uint8")
    rescale = Rescale.build(qparams(0.05, 128, "uint8"), qparams(0.04, -5, "int8"), "sima")
    expected = rescale(x)
    build = Codegen()
    source = build.input("x", x.shape, "uint8", Space.DRAM, "HWC")
    staged = build.alloc(x.shape, "uint8")
    converted = build.alloc(x.shape, "int8")
    out = build.output("y", x.shape, "int8", Space.DRAM, "HWC16")
    build.emit(
        Load(src=source, dst=staged),
        _move(build, staged, converted, rescale),
        Store(src=converted, dst=out),
    )
    run_single(build, {"x": x}, expected)
