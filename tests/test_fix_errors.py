"""`surgery fix` on a model ONNX Runtime cannot run: one clear error, not every rule rejected."""

from __future__ import annotations

import pytest
from onnx import TensorProto, helper

from surgery import examples
from surgery.errors import VerifyError
from surgery.model import load_model
from surgery.rules.fix import fix_model


def _split_with_num_outputs_at_opset17():
    """torch 2.14's dynamo exporter writes Split's opset-18 `num_outputs` into opset-17
    models (GPT-2's qkv split): the checker lets it pass, ONNX Runtime refuses to load it."""
    nodes = [
        helper.make_node("Split", ["x"], ["a", "b"], name="split", axis=2, num_outputs=2),
        helper.make_node("Transpose", ["b"], ["b_t"], name="b_t", perm=[0, 2, 1]),
        helper.make_node("MatMul", ["a", "b_t"], ["y"], name="scores"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 4])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_fix_names_why_onnx_runtime_cannot_run_the_model():
    with pytest.raises(VerifyError, match="ONNX Runtime cannot load it.*num_outputs") as info:
        fix_model(_split_with_num_outputs_at_opset17(), "mlsoc")
    assert "re-export" in (info.value.hint or "")


def test_fix_names_the_rules_that_match_its_remaining_blockers():
    """As `surgery check` of the result would: yolo_head's decode reshape is cut-postprocess's."""
    result = fix_model(load_model(examples.yolo_head()))
    pinned, group = sorted(
        result.coverage_after.blocker_groups(), key=lambda g: "pinned" not in g["reason"]
    )
    assert pinned["op_types"] == ["Concat"]  # output-concat-to-host's pin
    assert group["suggested_rules"] == ["cut-postprocess"]
