"""where-to-mask-arith: torch's masked_fill (Where(mask, c, scores) before a Softmax, as
DistilBERT and HF attention export it) cuts the attention in two MLA segments; rewritten as
scores·keep + fill the mask arithmetic is a host pre-stage and the attention one segment."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from surgery.check import check_model
from surgery.model import load_model
from surgery.rules import Reference, apply_rule, find_matches


def _masked_attention(fill: float, fill_first: bool = True) -> onnx.ModelProto:
    """Conv → Where(mask, fill, ·) (or Where(mask, ·, fill)) → Softmax → Conv, the mask a
    bool input broadcast over channels and rows."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.3, (4, 4, 1, 1)).astype(np.float32), "w1"),
        numpy_helper.from_array(np.array(fill, np.float32), "fill"),
        numpy_helper.from_array(rng.normal(0, 0.3, (4, 4, 1, 1)).astype(np.float32), "w2"),
    ]
    branches = ["fill", "scores"] if fill_first else ["scores", "fill"]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["scores"], name="scores"),
        helper.make_node("Where", ["mask", *branches], ["masked"], name="masked_fill"),
        helper.make_node("Softmax", ["masked"], ["probs"], name="probs", axis=1),
        helper.make_node("Conv", ["probs", "w2"], ["y"], name="out"),
    ]
    graph = helper.make_graph(
        nodes,
        "masked_attention",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8]),
            helper.make_tensor_value_info("mask", TensorProto.BOOL, [1, 1, 1, 8]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        inits,
    )
    return load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def _reference(model: onnx.ModelProto) -> Reference:
    """Inputs with the mask both set and clear, so both branches of the Where are exercised."""
    rng = np.random.default_rng(3)
    feed = {
        "x": rng.normal(0, 2, (1, 4, 8, 8)).astype(np.float32),
        "mask": np.array([True, False, False, True, False, False, False, True]).reshape(1, 1, 1, 8),
    }
    return Reference.of(model, feed)


@pytest.mark.parametrize("fill_first", [True, False])
def test_masked_fill_becomes_mla_arithmetic_and_one_segment(fill_first: bool) -> None:
    model = _masked_attention(float(np.finfo(np.float32).min), fill_first)
    assert check_model(model, "mlsoc", suggest=False).mla_segments == 2
    (match,) = find_matches(model, "where-to-mask-arith", "mlsoc")
    assert match.blockers == ["masked_fill"]
    result = apply_rule(model, "where-to-mask-arith", "mlsoc", reference=_reference(model))
    assert result.verification.passed and result.verification.mode == "exact"
    assert result.verification.worst_max_abs == 0.0
    assert "Where" not in {n.op_type for n in result.model.graph.node}
    assert result.coverage_after.mla_segments == 1


def test_an_infinite_fill_is_left_alone() -> None:
    """x·0 + (−inf)·1 is −inf but x·1 + (−inf)·0 is NaN: not exact, so not matched."""
    model = _masked_attention(float("-inf"))
    assert find_matches(model, "where-to-mask-arith", "mlsoc") == []
