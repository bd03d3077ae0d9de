"""Verifying an exact rewrite of a model whose outputs follow a TopK: float rounding flips the
selection's tie order, so the outputs differ by whole indices although the rewrite computes the
same scores; the model is then compared stage by stage, each stage fed the original's values."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from surgery.model import load_model
from surgery.rules import apply_rule
from surgery.rules.engine import RuleFailedError
from surgery.rules.replace_arith import SubDivToAddMul
from surgery.rules.selection import stage_crossings
from surgery.verify import make_inputs, run_model

WIDTH = 64


def _scores_then_topk() -> onnx.ModelProto:
    """scores = Concat(x/3, x/3) (every score tied with its twin) → TopK(WIDTH) → the picked
    indices (as floats) and a Gather of features by them."""
    nodes = [
        helper.make_node("Div", ["x", "three"], ["first"], name="first"),
        helper.make_node("Div", ["x", "three"], ["second"], name="second"),
        helper.make_node("Concat", ["first", "second"], ["scores"], name="scores", axis=1),
        helper.make_node("TopK", ["scores", "k"], ["best", "picked"], name="topk", axis=1),
        helper.make_node("Cast", ["picked"], ["order"], name="order", to=TensorProto.FLOAT),
        helper.make_node("Mul", ["x", "two"], ["features"], name="features"),
        helper.make_node("Concat", ["features", "x"], ["pool"], name="pool", axis=1),
        helper.make_node(
            "GatherElements", ["pool", "picked"], ["gathered"], name="gathered", axis=1
        ),
    ]
    inits = [
        numpy_helper.from_array(np.array(3.0, np.float32), "three"),
        numpy_helper.from_array(np.array(2.0, np.float32), "two"),
        numpy_helper.from_array(np.array([WIDTH], np.int64), "k"),
    ]
    graph = helper.make_graph(
        nodes,
        "ties",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, WIDTH])],
        [
            helper.make_tensor_value_info("order", TensorProto.FLOAT, [1, WIDTH]),
            helper.make_tensor_value_info("gathered", TensorProto.FLOAT, [1, WIDTH]),
        ],
        inits,
    )
    return load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def test_rounding_before_the_topk_flips_its_tie_order() -> None:
    """The premise: x·(1/3) for one twin differs from x/3 by an ulp, so the picks reorder."""
    model = _scores_then_topk()
    child = apply_rule(model, "sub-div-to-add-mul", nodes=["second"], verify=False).model
    feed = make_inputs(model, seed=0)
    a, b = run_model(model, feed), run_model(child, feed)
    assert np.abs(a["order"] - b["order"]).max() >= WIDTH


def test_an_exact_rewrite_before_a_topk_verifies_stage_by_stage() -> None:
    result = apply_rule(_scores_then_topk(), "sub-div-to-add-mul", nodes=["second"])
    verification = result.verification
    assert verification.passed and verification.mode == "exact"
    assert verification.note and "stage by stage" in verification.note
    compared = {o.name: o for o in verification.outputs}
    assert {"order", "gathered", "scores"} <= set(compared)
    assert 0 < compared["scores"].max_abs < 1e-6  # the rewrite's own rounding, seen
    assert compared["order"].max_abs == 0  # fed the original scores: the same picks


def test_a_wrong_rewrite_before_a_topk_still_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    edit = SubDivToAddMul.edit

    def off_by_a_bit(self, ed, match, params):  # x / 3 → x · 0.34
        done = edit(self, ed, match, params)
        node = ed.node_named(match.nodes[0])
        node.inputs[1] = ed.const("wrong", np.array(0.34, np.float32))
        return done

    monkeypatch.setattr(SubDivToAddMul, "edit", off_by_a_bit)
    with pytest.raises(RuleFailedError, match="beyond its bound"):
        apply_rule(_scores_then_topk(), "sub-div-to-add-mul", nodes=["second"])


def test_a_model_without_selections_has_one_stage() -> None:
    nodes = [helper.make_node("Relu", ["x"], ["y"]), helper.make_node("Neg", ["y"], ["z"])]
    graph = helper.make_graph(
        nodes,
        "plain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 4])],
    )
    assert stage_crossings(load_model(helper.make_model(graph))) == []
