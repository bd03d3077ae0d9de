"""Older exports quantize and compile like new ones: IR-3 files that list their weights as
graph inputs, and residual blocks written as one n-ary Sum."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from compiler.archive import read_archive
from compiler.compile import compile_model
from compiler.quantize import quantize_model
from compiler.quantize.prepare import prepare_model
from compiler.runtime.compare import reference_outputs
from compiler.runtime.pipeline import run_archive
from surgery.check import check_model

SHAPE = [1, 4, 8, 8]


def _legacy_residual_model() -> onnx.ModelProto:
    """x → two 1×1 convs, y = Sum(x, conv_a(x), conv_b(x)); IR 3 / opset 9, weights as inputs."""
    rng = np.random.default_rng(0)
    weights = [
        numpy_helper.from_array(rng.normal(0, 0.5, (4, 4, 1, 1)).astype(np.float32), name)
        for name in ("w_a", "w_b")
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w_a"], ["a"], name="conv_a"),
        helper.make_node("Conv", ["x", "w_b"], ["b"], name="conv_b"),
        helper.make_node("Sum", ["x", "a", "b"], ["y"], name="residual"),
    ]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, SHAPE)] + [
        helper.make_tensor_value_info(w.name, TensorProto.FLOAT, [4, 4, 1, 1]) for w in weights
    ]
    graph = helper.make_graph(
        nodes,
        "legacy",
        inputs,
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, SHAPE)],
        weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 9)])
    model.ir_version = 3
    return model


def _samples(count: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [{"x": rng.normal(0, 1, SHAPE).astype(np.float32)} for _ in range(count)]


@pytest.fixture(scope="module")
def quantized() -> onnx.ModelProto:
    return quantize_model(_legacy_residual_model(), _samples(4), target="mlsoc").model


def test_weights_listed_as_inputs_become_plain_initializers() -> None:
    prepared = prepare_model(_legacy_residual_model()).model
    assert [i.name for i in prepared.graph.input] == ["x"]
    assert prepared.ir_version >= 7  # what opset 13 needs
    onnx.checker.check_model(prepared)


def test_an_nary_sum_becomes_a_chain_of_adds_that_computes_the_same() -> None:
    original = _legacy_residual_model()
    prepared = prepare_model(original).model
    ops = [n.op_type for n in prepared.graph.node]
    assert "Sum" not in ops and ops.count("Add") == 2
    assert prepared.graph.node[-1].name == "residual"  # the user's name stays on the output
    feed = _samples(1)[0]
    (expected,) = ReferenceEvaluator(original).run(None, feed)
    (actual,) = ReferenceEvaluator(prepared).run(None, feed)
    np.testing.assert_allclose(actual, expected, rtol=1e-6, atol=1e-6)


def test_legacy_model_quantizes_to_a_checked_qdq_model(quantized) -> None:
    onnx.checker.check_model(quantized)
    assert [i.name for i in quantized.graph.input] == ["x"]


def test_legacy_model_compiles_to_the_segments_check_counts_and_runs_bit_exact(
    quantized, tmp_path
) -> None:
    segments = check_model(_legacy_residual_model(), "mlsoc").mla_segments
    assert segments == 1
    result = compile_model(quantized, tmp_path, model_name="legacy")
    assert len(result.elf_files) == segments
    feed = _samples(1)[0]
    archive = read_archive(result.archive)
    outputs, _ = run_archive(archive, feed)
    expected = reference_outputs(archive.manifest, quantized, feed)
    assert np.array_equal(outputs["y"], expected["y"])


def test_an_opset_upgrade_with_a_custom_domain_keeps_a_valid_ir_version() -> None:
    """find_min_ir_version_for rejects custom domains; only the default opset decides."""
    model = _legacy_residual_model()
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    prepared = prepare_model(model).model
    assert prepared.ir_version >= 7
