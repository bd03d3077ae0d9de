"""Activation scales are floored at MIN_ACTIVATION_RANGE: a calibrated range of ~1e-25 (an
untrained network's LayerNorm of near-constant rows) must not give a scale so fine that no
31-bit requantization multiplier reaches it and the op leaves the MLA."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler.compile import compile_model
from compiler.defines import QuantizationScheme
from compiler.quantize.qparams import MIN_ACTIVATION_RANGE, activation_qparams
from compiler.quantize.ranges import Range
from surgery.model import load_model
from tests.lower_support import quantize_on

INT8 = QuantizationScheme(asymmetric=True, per_channel=False)
INT16 = QuantizationScheme(asymmetric=False, per_channel=False, bits=16)


@pytest.mark.parametrize("scheme", [INT8, INT16], ids=["int8", "int16"])
def test_a_vanishing_range_gets_the_floor_scale(scheme):
    qp = activation_qparams(Range(-1e-25, 1e-25), scheme)
    assert qp.scale == pytest.approx(MIN_ACTIVATION_RANGE / (scheme.qmax - scheme.qmin))


def test_an_ordinary_range_keeps_its_own_scale():
    qp = activation_qparams(Range(-1.0, 3.0), INT8)
    assert qp.scale == pytest.approx(4.0 / 255)


def test_a_zero_range_keeps_scale_one():
    assert activation_qparams(Range(0.0, 0.0), INT8).scale == 1.0


def _layernorm_of_tiny_values() -> onnx.ModelProto:
    """Conv → × 1e-20 → LayerNorm (gamma 1, beta 0) → Conv: the normalised values are ~1e-18,
    far below the LayerNorm's epsilon, as in a randomly initialised transformer."""
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w"], ["a"], pads=[1, 1, 1, 1]),
            helper.make_node("Mul", ["a", "tiny"], ["t"]),
            helper.make_node("LayerNormalization", ["t", "gamma", "beta"], ["n"], axis=1),
            helper.make_node("Conv", ["n", "w2"], ["y"]),
        ],
        "tiny_layernorm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [
            numpy_helper.from_array(rng.normal(0, 0.5, (8, 4, 3, 3)).astype(np.float32), "w"),
            numpy_helper.from_array(np.array(1e-20, np.float32), "tiny"),
            numpy_helper.from_array(np.ones(8, np.float32), "gamma"),
            numpy_helper.from_array(np.zeros(8, np.float32), "beta"),
            numpy_helper.from_array(rng.normal(0, 0.5, (8, 8, 1, 1)).astype(np.float32), "w2"),
        ],
    )
    return load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def test_a_layernorm_of_vanishing_values_compiles_into_one_elf(tmp_path):
    qdq = quantize_on(_layernorm_of_tiny_values(), "mlsoc")
    compiled = compile_model(qdq, tmp_path, target="mlsoc", model_name="tiny_layernorm")
    assert len(compiled.elf_files) == 1, compiled.notes
