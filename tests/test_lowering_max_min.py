"""Max and Min: the integer lowering (`ExtremumKernel`), its ELTWISE MAX / MIN program and the
float op it stands for.

The kernels come from the real lowering (`lower_extremum` on an `OpContext`); the programs are
written by hand the way `compiler.lower.codegen.emit_extremum` writes them (one ELTWISE per
pair, every further input folded into the output in place) and run encode -> ELF -> emulator.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import helper

from compiler.intmath import dequantize_linear, quantize_linear
from compiler.isa import Eltwise, EltwiseOp, Space, Tensor
from compiler.quantize import quantize_model
from compiler.runtime import IntegerExecutor
from compiler.runtime.ops.base import OpContext, Rescale
from compiler.runtime.ops.elementwise import ExtremumKernel, lower_extremum
from compiler.runtime.qparams import QuantOperand, QuantParams
from tests.test_emulator_support import Codegen, qparams, random_codes, run_single
from tests.test_reference_support import float_model, ort_run, random_feeds, steps_apart

SEEDS = st.integers(0, 2**32 - 1)


def _lowered(op: str, params: list[QuantParams], output: QuantParams, mode: str = "sima"):
    """The kernel `lower_extremum` builds for `op` over inputs with `params`."""
    names = [f"x{i}" for i in range(len(params))]
    ctx = OpContext(
        node=helper.make_node(op, names, ["y"]),
        opset=13,
        mode=mode,
        inputs=tuple(QuantOperand(n, p, None) for n, p in zip(names, params, strict=True)),
        outputs=(output,),
    )
    return lower_extremum(ctx)


def _program(
    kernel: ExtremumKernel, codes: list[np.ndarray], out_shape: tuple[int, ...], dtype: str
) -> tuple[Codegen, dict[str, np.ndarray]]:
    """ELTWISE MAX / MIN per pair into one output, operands broadcast by stride-0 views."""
    build = Codegen()
    spaces = [Space.DRAM, Space.ARENA]
    views: list[Tensor] = []
    for index, array in enumerate(codes):
        tensor = build.input(f"x{index}", array.shape, array.dtype, spaces[index % 2])
        views.append(tensor.broadcast_to(out_shape))
    out = build.output("y", out_shape, dtype, Space.ARENA)
    op = EltwiseOp.MAX if kernel.maximum else EltwiseOp.MIN
    for index, pair in enumerate(kernel.pairs):
        (a_m, a_s), (b_m, b_s) = pair.a_multiplier, pair.b_multiplier
        build.emit(
            Eltwise(
                op=op,
                a=views[0] if index == 0 else out,
                b=views[index + 1],
                output=out,
                requant=build.stage(pair.stage),
                a_zero_point=pair.a_zero_point,
                b_zero_point=pair.b_zero_point,
                left_shift=pair.left_shift,
                a_multiplier=int(a_m),
                a_shift=int(a_s),
                b_multiplier=int(b_m),
                b_shift=int(b_s),
            )
        )
    return build, {f"x{i}": c for i, c in enumerate(codes)}


@st.composite
def broadcast_shapes(draw: st.DrawFn) -> list[tuple[int, ...]]:
    """2-4 shapes that broadcast together (some axes 1, some leading axes dropped)."""
    full = draw(st.lists(st.integers(1, 5), min_size=1, max_size=4))
    shapes = []
    for _ in range(draw(st.integers(2, 4))):
        shape = [d if draw(st.booleans()) else 1 for d in full]
        shapes.append(tuple(shape[draw(st.integers(0, len(shape) - 1)) :]))
    return shapes


@settings(max_examples=40, deadline=None)
@given(
    shapes=broadcast_shapes(),
    op=st.sampled_from(["Max", "Min"]),
    dtype=st.sampled_from(["int8", "uint8", "int16"]),
    mode=st.sampled_from(["sima", "tflite"]),
    seed=SEEDS,
)
def test_emulator_matches_the_reference(
    shapes: list, op: str, dtype: str, mode: str, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    low, high = np.iinfo(np.dtype(dtype)).min, np.iinfo(np.dtype(dtype)).max
    params = [
        qparams(float(rng.uniform(0.01, 0.2)), int(rng.integers(low // 4, high // 4)), dtype)
        for _ in shapes
    ]
    output = qparams(float(rng.uniform(0.01, 0.2)), int(rng.integers(low // 4, high // 4)), dtype)
    kernel = _lowered(op, params, output, mode).kernel
    codes = [random_codes(rng, shape, dtype) for shape in shapes]
    expected = kernel(*codes)
    build, inputs = _program(kernel, codes, expected.shape, dtype)
    run_single(build, inputs, expected)


@pytest.mark.parametrize("op", ["Max", "Min"])
@pytest.mark.parametrize(
    "shapes",
    [
        [(1, 8, 64, 64), (1, 8, 64, 64), (1, 8, 64, 64)],  # table of code pairs, in place
        [(1, 8, 64, 64), (1, 1, 1, 1), (1, 8, 64, 64)],  # one-code operand: 256-entry table
        [(1, 1, 64, 64), (1, 8, 1, 1)],  # broadcast both ways
    ],
)
def test_emulator_matches_the_reference_on_feature_maps(op: str, shapes: list) -> None:
    """Sizes at which the emulator looks results up in tables and writes them in place."""
    rng = np.random.default_rng(3)
    params = [qparams(0.03 + 0.01 * i, i - 1) for i in range(len(shapes))]
    kernel = _lowered(op, params, qparams(0.04, 2)).kernel
    codes = [random_codes(rng, shape, "int8") for shape in shapes]
    expected = kernel(*codes)
    build, inputs = _program(kernel, codes, expected.shape, "int8")
    run_single(build, inputs, expected)


@settings(max_examples=20, deadline=None)
@given(
    shapes=broadcast_shapes(),
    op=st.sampled_from(["Max", "Min"]),
    dtype=st.sampled_from(["int8", "uint8"]),
    seed=SEEDS,
)
def test_operands_at_the_output_quantization_give_the_extremum_of_their_codes(
    shapes: list, op: str, dtype: str, seed: int
) -> None:
    """The common case (a quantizer that shares one scale): exact, on codes."""
    rng = np.random.default_rng(seed)
    shared = qparams(0.05, 3, dtype)
    kernel = _lowered(op, [shared] * len(shapes), shared).kernel
    codes = [random_codes(rng, shape, dtype) for shape in shapes]
    extremum = np.maximum if op == "Max" else np.minimum
    expected = codes[0]
    for array in codes[1:]:
        expected = extremum(expected, array)
    np.testing.assert_array_equal(kernel(*codes), expected)


@pytest.mark.parametrize("op", ["Max", "Min"])
@pytest.mark.parametrize("count", [2, 3])
def test_differing_scales_round_the_real_extremum(op: str, count: int) -> None:
    """Requantizing is monotone, so the result is the real extremum quantized once: at most one
    step from quantize(max(dequantize(a), dequantize(b), ...)), and almost always equal."""
    rng = np.random.default_rng(7)
    params = [qparams(0.02 * (i + 1), 2 - 3 * i) for i in range(count)]
    output = qparams(0.045, -5)
    kernel = _lowered(op, params, output).kernel
    codes = [random_codes(rng, (2, 3, 16, 16), "int8") for _ in params]
    reals = [
        dequantize_linear(c, p.scale, p.zero_point) for c, p in zip(codes, params, strict=True)
    ]
    real = np.maximum.reduce(reals) if op == "Max" else np.minimum.reduce(reals)
    expected = quantize_linear(real, output.scale, output.zero_point, np.int8)
    difference = np.abs(kernel(*codes).astype(np.int64) - expected)
    assert difference.max() <= 1
    assert np.mean(difference != 0) < 0.01


def test_one_input_is_a_requantization() -> None:
    lowered = _lowered("Max", [qparams(0.1, 4)], qparams(0.05, -2))
    assert isinstance(lowered.kernel, Rescale)
    np.testing.assert_array_equal(
        lowered.kernel(np.array([-128, 4, 10, 127], np.int8)), [-128, -2, 10, 127]
    )


@pytest.mark.parametrize("op", ["Max", "Min"])
def test_the_quantized_op_matches_onnx_runtime_within_one_step(op: str) -> None:
    """Our quantizer (rk3588 puts Max / Min on the MLA) and ONNX Runtime running the QDQ graph
    in float (dequantize, op, quantize)."""
    rng = np.random.default_rng(11)
    node = helper.make_node(op, ["a", "b", "c"], ["y"])
    model = float_model([node], {"a": (1, 4, 6, 6), "b": (1, 4, 1, 6)}, ["y"], {"c": _c()}, 13)
    feeds = random_feeds(model, rng, 8)
    for feed in feeds:
        feed["b"] = 2 * feed["b"]
    qdq = quantize_model(model, feeds[:6], target="rk3588").model
    executor = IntegerExecutor(qdq, strict=True)
    assert executor.float_nodes == ()
    assert steps_apart(executor, qdq, feeds[6:])["y"] <= 1
    assert ort_run(qdq, feeds[6])["y"].shape == (1, 4, 6, 6)


def _c() -> np.ndarray:
    return np.array([-0.5, 0.0, 0.25, 1.0], np.float32).reshape(4, 1, 1)
