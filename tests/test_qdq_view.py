"""`float_view`: a quantized model seen as the float model it quantizes, including activations
kept in fp16/bf16 (Cast → Cast pairs, as the rk3588 plan writes around LayerNormalization)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from surgery.check import check_model
from surgery.qdq import float_view

SHAPE = [1, 4, 8, 8]


def _model(narrow: int | None) -> onnx.ModelProto:
    """Conv → [Cast to `narrow` → Cast back] → Relu → Conv; without `narrow`, the float model."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.normal(size=(4, 4, 1, 1)).astype(np.float32), name)
        for name in ("w1", "w2")
    ]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"], name="conv1")]
    source = "a"
    if narrow is not None:
        nodes += [
            helper.make_node("Cast", ["a"], ["a_narrow"], name="narrow", to=narrow),
            helper.make_node("Cast", ["a_narrow"], ["a_back"], name="back", to=TensorProto.FLOAT),
        ]
        source = "a_back"
    nodes += [
        helper.make_node("Relu", [source], ["r"], name="relu"),
        helper.make_node("Conv", ["r", "w2"], ["y"], name="conv2"),
    ]
    graph = helper.make_graph(
        nodes,
        "casts",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, SHAPE)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, SHAPE)],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("narrow", [TensorProto.FLOAT16, TensorProto.BFLOAT16])
def test_narrow_float_cast_pairs_are_removed_like_qdq_pairs(narrow: int) -> None:
    view = float_view(_model(narrow))
    assert [n.name for n in view.graph.node] == ["conv1", "relu", "conv2"]
    assert list(view.graph.node[1].input) == ["a"]


def test_a_cast_pair_does_not_split_the_segment_check_counts() -> None:
    assert check_model(float_view(_model(TensorProto.FLOAT16))).mla_segments == 1
    assert check_model(_model(None)).mla_segments == 1


def test_a_cast_to_an_integer_and_back_stays() -> None:
    """Only fp16/bf16 round trips stand for a precision choice; Cast to int8 changes values."""
    view = float_view(_model(TensorProto.INT8))
    assert [n.op_type for n in view.graph.node].count("Cast") == 2
