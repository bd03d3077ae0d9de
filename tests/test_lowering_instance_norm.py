"""InstanceNormalization: LayerNorm's integer form over the spatial axes of each (n, c), with a
gamma and beta per channel, run by the LAYERNORM instruction with (C, 1, ..., 1) tables."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import helper

from compiler.intmath import normalisation_epsilon, quantize_multiplier
from compiler.isa import LayerNorm, Space
from compiler.runtime import IntegerExecutor
from compiler.runtime.emulator_ops import EmulatorError
from compiler.runtime.ops.base import OpContext
from compiler.runtime.ops.normalization import (
    OUTPUT_FRACTION_BITS,
    LayerNormKernel,
    lower_instance_normalization,
    lower_layer_normalization,
)
from compiler.runtime.qparams import ConstOperand, NotLowerable, QuantOperand
from tests.test_emulator_support import Codegen, qparams, random_codes, run_single
from tests.test_reference_support import quantized_single_op, steps_apart

SEEDS = st.integers(0, 2**32 - 1)


def _lowered(gamma: np.ndarray, beta: np.ndarray, mode: str = "sima") -> LayerNormKernel:
    ctx = OpContext(
        node=helper.make_node("InstanceNormalization", ["x", "g", "b"], ["y"], epsilon=1e-5),
        opset=17,
        mode=mode,
        inputs=(
            QuantOperand("x", qparams(0.04, -6), None),
            ConstOperand("g", gamma.astype(np.float32)),
            ConstOperand("b", beta.astype(np.float32)),
        ),
        outputs=(qparams(0.03, 5),),
    )
    return lower_instance_normalization(ctx).kernel


def _layernorm(build: Codegen, kernel: LayerNormKernel, x: np.ndarray) -> LayerNorm:
    """The LAYERNORM that codegen writes for `kernel` on input `x`."""
    signs, multipliers, shifts, offsets = kernel.parameters(x.ndim)
    count = math.prod(x.shape[kernel.axis :])
    unit, unit_shift = quantize_multiplier(2.0**-OUTPUT_FRACTION_BITS)
    return LayerNorm(
        input=build.input("x", x.shape, "int8", Space.DRAM),
        output=build.output("y", x.shape, "int8", Space.ARENA),
        signs=build.const(signs, "int8"),
        multipliers=build.const(multipliers, "int32"),
        shifts=build.const(shifts, "int32"),
        offsets=build.const(offsets, "int32"),
        requant=build.requant(unit, unit_shift, kernel.zero_point, -128, 127, kernel.mode),
        input_zero_point=kernel.input_zero_point,
        axis=kernel.axis,
        epsilon_term=normalisation_epsilon(kernel.epsilon, count, kernel.input_scale),
    )


@settings(max_examples=25, deadline=None)
@given(
    shape=st.lists(st.integers(1, 6), min_size=3, max_size=5),
    mode=st.sampled_from(["sima", "tflite"]),
    seed=SEEDS,
)
def test_emulator_matches_the_reference(shape: list, mode: str, seed: int) -> None:
    """Ranks 3-5 (N, C, spatial...), gammas of both signs and zero."""
    rng = np.random.default_rng(seed)
    channels = shape[1]
    gamma = rng.uniform(-2.0, 2.0, channels)
    gamma[rng.random(channels) < 0.2] = 0.0
    kernel = _lowered(gamma, rng.uniform(-1.0, 1.0, channels), mode)
    x = random_codes(rng, shape, "int8")
    expected = kernel(x)
    build = Codegen()
    build.emit(_layernorm(build, kernel, x))
    run_single(build, {"x": x}, expected)


def test_one_channel_is_layer_normalization_over_the_same_axes() -> None:
    """With C = 1 both ops normalise the same groups with the same gamma and beta."""
    rng = np.random.default_rng(4)
    x = random_codes(rng, (3, 1, 5, 7), "int8")
    instance = _lowered(np.array([1.3]), np.array([-0.2]))
    ctx = OpContext(
        node=helper.make_node("LayerNormalization", ["x", "g", "b"], ["y"], axis=1),
        opset=17,
        mode="sima",
        inputs=(
            QuantOperand("x", qparams(0.04, -6), None),
            ConstOperand("g", np.full((1, 5, 7), 1.3, np.float32)),
            ConstOperand("b", np.full((1, 5, 7), -0.2, np.float32)),
        ),
        outputs=(qparams(0.03, 5),),
    )
    layer = lower_layer_normalization(ctx).kernel
    np.testing.assert_array_equal(instance(x), layer(x))


def test_per_channel_tables_must_broadcast_against_the_input() -> None:
    rng = np.random.default_rng(5)
    kernel = _lowered(np.ones(4), np.zeros(4))
    x = random_codes(rng, (1, 4, 3, 3), "int8")
    build = Codegen()
    instruction = _layernorm(build, kernel, x)
    wrong = build.const(np.zeros((3, 1, 1)), "int32")
    build.emit(replace(instruction, offsets=wrong))
    with pytest.raises(EmulatorError, match="offsets"):
        build.run({"x": x})


@pytest.mark.parametrize("shape", [(2, 3, 8, 8), (1, 4, 16)])
def test_matches_onnx_runtime_within_two_steps(shape: tuple) -> None:
    rng = np.random.default_rng(23)
    channels = shape[1]
    params = {
        "gamma": (1 + 0.3 * rng.standard_normal(channels)).astype(np.float32),
        "beta": (0.2 * rng.standard_normal(channels)).astype(np.float32),
    }
    node = helper.make_node("InstanceNormalization", ["x", "gamma", "beta"], ["y"])
    qdq, feeds = quantized_single_op(node, {"x": shape}, params, rng=rng)
    executor = IntegerExecutor(qdq, strict=True)
    assert executor.float_nodes == ()
    assert steps_apart(executor, qdq, feeds)["y"] <= 2


def test_gamma_and_beta_must_be_constants() -> None:
    ctx = OpContext(
        node=helper.make_node("InstanceNormalization", ["x", "g", "b"], ["y"]),
        opset=17,
        mode="sima",
        inputs=(
            QuantOperand("x", qparams(0.04, 0), None),
            QuantOperand("g", qparams(0.1, 0), None),
        ),
        outputs=(qparams(0.03, 5),),
    )
    with pytest.raises(NotLowerable, match="constant"):
        lower_instance_normalization(ctx)
