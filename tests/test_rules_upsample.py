"""Old exports (opset ≤ 10) upsample with Upsample / Resize-10, whose coordinates are
asymmetric. ONNX's version converter turns them into a Resize with the half_pixel default, which
changes a linear upsample; `convert_opset` (used by rules, the quantizer and merge) keeps the
old semantics, and `upsample-to-resize` moves an Upsample the MLA cannot run onto it."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper, version_converter

from compiler.quantize.prepare import prepare_model
from surgery.check import check_model
from surgery.model import convert_opset, load_model
from surgery.rules import Reference, apply_rule


def _upsample_between_convs(op: str, opset: int, mode: str) -> onnx.ModelProto:
    """Conv → Upsample/Resize(×2, `mode`) → Conv at `opset` (scales as an input)."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.3, (4, 3, 1, 1)).astype(np.float32), "w1"),
        numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales"),
        numpy_helper.from_array(rng.normal(0, 0.3, (4, 4, 1, 1)).astype(np.float32), "w2"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c"], name="c1"),
        helper.make_node(op, ["c", "scales"], ["u"], name="up", mode=mode),
        helper.make_node("Conv", ["u", "w2"], ["y"], name="c2"),
    ]
    graph = helper.make_graph(
        nodes,
        "upsample",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 12, 12])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]


X = np.random.default_rng(1).normal(0, 1, (1, 3, 6, 6)).astype(np.float32)


@pytest.mark.parametrize(("op", "opset"), [("Upsample", 9), ("Resize", 10)])
def test_convert_opset_keeps_a_linear_upsample(op: str, opset: int) -> None:
    model = _upsample_between_convs(op, opset, "linear")
    raw = version_converter.convert_version(model, 13)
    assert np.abs(_run(raw, X) - _run(model, X)).max() > 1e-2  # the converter's half_pixel
    converted = convert_opset(model, 13)
    np.testing.assert_array_equal(_run(converted, X), _run(model, X))
    (resize,) = [n for n in converted.graph.node if n.op_type == "Resize"]
    assert resize.name == "up"


def test_the_quantizer_prepares_an_old_linear_resize_unchanged() -> None:
    model = _upsample_between_convs("Resize", 10, "linear")
    prepared = prepare_model(model, opset=13).model
    np.testing.assert_allclose(_run(prepared, X), _run(model, X), atol=1e-6)


@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_upsample_to_resize_joins_the_segments_exactly(mode: str) -> None:
    model = load_model(_upsample_between_convs("Upsample", 9, mode))
    assert check_model(model, "mlsoc", suggest=False).mla_segments == 2
    result = apply_rule(
        model, "upsample-to-resize", "mlsoc", reference=Reference.of(model, {"x": X})
    )
    assert result.verification.passed and result.verification.worst_max_abs == 0.0
    ops = [n.op_type for n in result.model.graph.node]
    assert "Upsample" not in ops and ops.count("Resize") == 1
    assert result.coverage_after.mla_segments == 1
