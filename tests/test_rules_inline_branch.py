"""inline-if-branch: an If on a boolean graph input, as the model for one value of it.

The fixture is an Optimum-style merged decoder: one If on `use_cache`; its then_branch reads
`past` (concatenated before the new tokens), its else_branch does not. Both branches use the
same local tensor names, as Optimum's two exports of one module do.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from surgery.check import check_model
from surgery.rules.engine import RuleFailedError, apply_rule
from surgery.rules.fix import fix_model
from surgery.verify import run_model

TOKENS, PAST, WIDTH = 2, 3, 4


def _branch(name: str, use_past: bool) -> onnx.GraphProto:
    first = (
        helper.make_node("Concat", ["past", "x"], ["k"], axis=1)
        if use_past
        else helper.make_node("Identity", ["x"], ["k"])
    )
    nodes = [
        first,
        helper.make_node("Relu", ["k"], ["present"]),
        helper.make_node("ReduceSum", ["k", "axes"], ["logits"], keepdims=1),
    ]
    outputs = [
        helper.make_tensor_value_info("present", TensorProto.FLOAT, [1, None, WIDTH]),
        helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 1, WIDTH]),
    ]
    return helper.make_graph(nodes, name, [], outputs)


def merged_decoder(ifs: int = 1) -> onnx.ModelProto:
    """`ifs` If nodes on one condition (their local names clash when there are two)."""
    nodes, outputs = [], []
    for k in range(ifs):
        names = [f"present_{k}", f"logits_{k}"]
        nodes.append(
            helper.make_node(
                "If",
                ["use_cache"],
                names,
                name=f"if_{k}",
                then_branch=_branch("with_past", True),
                else_branch=_branch("without_past", False),
            )
        )
        outputs += [
            helper.make_tensor_value_info(names[0], TensorProto.FLOAT, [1, None, WIDTH]),
            helper.make_tensor_value_info(names[1], TensorProto.FLOAT, [1, 1, WIDTH]),
        ]
    graph = helper.make_graph(
        nodes,
        "merged",
        [
            helper.make_tensor_value_info("use_cache", TensorProto.BOOL, [1]),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, TOKENS, WIDTH]),
            helper.make_tensor_value_info("past", TensorProto.FLOAT, [1, PAST, WIDTH]),
        ],
        outputs,
        [onnx.numpy_helper.from_array(np.array([1], np.int64), "axes")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _inputs(model: onnx.ModelProto) -> list[str]:
    return [i.name for i in model.graph.input]


@pytest.mark.parametrize("value", [True, False])
def test_the_branch_taken_computes_what_the_if_did(value: bool) -> None:
    merged = merged_decoder()
    result = apply_rule(merged, "inline-if-branch", params={"value": value})
    assert "If" not in [n.op_type for n in result.model.graph.node]
    assert result.verification.passed
    rng = np.random.default_rng(0)
    feed = {
        "x": rng.standard_normal((1, TOKENS, WIDTH)).astype(np.float32),
        "past": rng.standard_normal((1, PAST, WIDTH)).astype(np.float32),
    }
    want = run_model(merged, {**feed, "use_cache": np.array([value])})
    got = run_model(result.model, feed)
    for name, array in want.items():
        np.testing.assert_array_equal(got[name], array)


def test_the_condition_and_the_inputs_only_the_other_branch_read_go() -> None:
    with_past = apply_rule(merged_decoder(), "inline-if-branch", params={"value": True}).model
    without = apply_rule(merged_decoder(), "inline-if-branch", params={"value": False}).model
    assert _inputs(with_past) == ["x", "past"]
    assert _inputs(without) == ["x"]


def test_two_ifs_with_the_same_local_names_inline_into_a_valid_graph() -> None:
    result = apply_rule(merged_decoder(ifs=2), "inline-if-branch", params={"value": True})
    onnx.checker.check_model(result.model, full_check=True)
    assert [n.op_type for n in result.model.graph.node].count("Concat") == 2


def test_applying_without_a_value_says_which_param_to_give() -> None:
    with pytest.raises(RuleFailedError, match="--param value=true"):
        apply_rule(merged_decoder(), "inline-if-branch")


def test_check_suggests_it_for_the_if_and_fix_never_applies_it() -> None:
    (blocker,) = check_model(merged_decoder()).blockers
    assert blocker.op_type == "If" and "inline-if-branch" in blocker.suggested_rules
    result = fix_model(merged_decoder(), "mlsoc")
    assert "inline-if-branch" not in [s["rule"] for s in result.steps]
    assert any("inline-if-branch --param value=true" in note for note in result.notes)


def test_a_condition_that_drives_no_if_is_named_with_the_ones_that_do() -> None:
    with pytest.raises(RuleFailedError, match="'x' is not the boolean condition.*use_cache"):
        apply_rule(merged_decoder(), "inline-if-branch", params={"value": True, "condition": "x"})
