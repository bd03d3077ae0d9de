"""Max/Min with an infinite constant bound (JAX's softmax guard Max(−inf, ReduceMax(x))):
the bound is stored clipped just past the other operand's range, which changes no result."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler.compile import compile_model
from compiler.quantize import quantize_model
from compiler.quantize.calibrate import reference_session
from surgery.verify import make_inputs
from tests.lower_support import run_and_compare


def _conv_bounded_by(op: str, bound: float) -> onnx.ModelProto:
    """Conv → op(·, bound) → Conv, bound a scalar constant."""
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w1"], ["a"], pads=[1, 1, 1, 1]),
            helper.make_node(op, ["a", "bound"], ["b"]),
            helper.make_node("Conv", ["b", "w2"], ["y"]),
        ],
        "bounded",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        [
            numpy_helper.from_array(rng.normal(size=(4, 3, 3, 3)).astype(np.float32), "w1"),
            numpy_helper.from_array(np.array(bound, np.float32), "bound"),
            numpy_helper.from_array(rng.normal(size=(4, 4, 1, 1)).astype(np.float32), "w2"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def _quantized(model: onnx.ModelProto):
    frames = [make_inputs(model, seed=seed) for seed in range(4)]
    return quantize_model(model, frames, target="rk3588")


def _sqnr(quantized) -> float:
    reference, candidate = (reference_session(m) for m in (quantized.float_model, quantized.model))
    feed = make_inputs(quantized.float_model, seed=9)
    ref = reference.run(["y"], feed)[0].astype(np.float64)
    got = candidate.run(["y"], feed)[0].astype(np.float64)
    return 10 * np.log10(np.square(ref).sum() / np.square(ref - got).sum())


@pytest.mark.parametrize(("op", "bound"), [("Max", -np.inf), ("Min", np.inf)])
def test_an_infinite_bound_that_changes_nothing_quantizes(op, bound) -> None:
    quantized = _quantized(_conv_bounded_by(op, bound))
    stored = quantized.report["weights"]["bound"]
    assert np.isfinite(stored["scale_max"])
    assert _sqnr(quantized) > 30


def test_an_infinite_bound_compiles_to_one_elf_and_runs_bit_exact(tmp_path) -> None:
    quantized = _quantized(_conv_bounded_by("Max", -np.inf))
    result = compile_model(quantized.model, tmp_path, target="rk3588", model_name="bounded")
    assert len(result.elf_files) == 1
    comparison = run_and_compare(
        result, quantized.model, make_inputs(quantized.float_model, seed=5)
    )
    assert comparison.mla_stages and comparison.mla_bit_exact and comparison.bit_exact
