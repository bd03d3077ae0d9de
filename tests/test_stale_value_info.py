"""Shapes a model records (value_info) that contradict its graph — an input size edited
without clearing them — give way to the shapes the graph computes, as in ONNX Runtime."""

from __future__ import annotations

import logging

import onnx
from onnx import TensorProto, helper, shape_inference

from surgery import examples
from surgery.check import check_model
from surgery.model import load_model


def _resized_input(model: onnx.ModelProto, dims: list[int]) -> onnx.ModelProto:
    for dim, value in zip(model.graph.input[0].type.tensor_type.shape.dim, dims, strict=True):
        dim.dim_value = value
    return model


def _stale_cnn() -> onnx.ModelProto:
    """plain_cnn with the value_info of a 32×32 input, then its input made 64×64."""
    return _resized_input(shape_inference.infer_shapes(examples.plain_cnn()), [1, 3, 64, 64])


def _dims(model: onnx.ModelProto, name: str) -> list[int]:
    info = next(v for v in model.graph.value_info if v.name == name)
    return [d.dim_value for d in info.type.tensor_type.shape.dim]


def test_the_shapes_the_graph_computes_replace_stale_recorded_ones():
    assert _dims(load_model(_stale_cnn()), "conv_3_out") == [1, 8, 32, 32]


def test_check_counts_the_macs_of_the_model_as_it_now_is():
    fresh = _resized_input(examples.plain_cnn(), [1, 3, 64, 64])
    assert check_model(_stale_cnn()).total_macs == check_model(fresh).total_macs


def test_a_contradiction_is_reported_in_one_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="surgery.model"):
        load_model(_stale_cnn())
    (record,) = caplog.records
    assert "recorded shapes contradict its graph" in record.getMessage()
    assert "conv_3" in record.getMessage()


def test_recorded_shapes_that_agree_are_kept_without_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="surgery.model"):
        model = load_model(shape_inference.infer_shapes(examples.plain_cnn()))
    assert caplog.records == []
    assert _dims(model, "conv_3_out") == [1, 8, 16, 16]


def test_the_recorded_shape_of_a_custom_op_output_survives_the_reinference():
    """Only its value_info says what a custom op makes; stale shapes elsewhere do not lose it."""
    model = _stale_cnn()
    conv = model.graph.node[0]
    custom = helper.make_node("Mystery", [conv.output[0]], ["m"], domain="com.example")
    model.graph.node.insert(1, custom)
    model.graph.node[2].input[0] = "m"
    model.opset_import.append(helper.make_opsetid("com.example", 1))
    model.graph.value_info.append(
        helper.make_tensor_value_info("m", TensorProto.FLOAT, [1, 8, 32, 32])
    )
    inferred = load_model(model)
    assert _dims(inferred, "m") == [1, 8, 32, 32]
    assert _dims(inferred, "conv_3_out") == [1, 8, 32, 32]
