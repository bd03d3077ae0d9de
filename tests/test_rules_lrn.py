"""lrn-to-conv: LRN (AlexNet, GoogLeNet, Inception v1) on a target whose MLA has none (rk3588)
becomes x / (Conv1×1(x²) + bias)^beta, the same function to float rounding."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from surgery.check import check_model
from surgery.model import load_model
from surgery.rules.engine import RuleNotApplicableError, apply_rule
from surgery.rules.replace_lrn import lrn_window

C = 8


def _conv_lrn_conv(beta: float, size: int = 5) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.5, (C, 3, 3, 3)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.normal(0, 0.5, (4, C, 1, 1)).astype(np.float32), "w2"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["a"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["a"], ["r"]),
        helper.make_node("LRN", ["r"], ["n"], size=size, alpha=2e-2, beta=beta, bias=2.0),
        helper.make_node("Conv", ["n", "w2"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "lrn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    return load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]))


def test_the_window_follows_onnx_lrn() -> None:
    """size 4: ⌊3/2⌋ = 1 channel below, ⌈3/2⌉ = 2 above, clipped at the edges."""
    weight, bias = lrn_window(5, 4, 0.4, 2.0)
    band = (weight[:, :, 0, 0] > 0).astype(int)
    assert band.tolist() == [
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0],
        [0, 1, 1, 1, 1],
        [0, 0, 1, 1, 1],
        [0, 0, 0, 1, 1],
    ]
    assert np.allclose(weight[weight > 0], 0.1) and np.all(bias == 2.0)


@pytest.mark.parametrize(("beta", "size"), [(0.75, 5), (0.5, 3), (1.0, 7)])
def test_lrn_becomes_ops_rk3588_runs(beta, size) -> None:
    model = _conv_lrn_conv(beta, size)
    assert check_model(model, "rk3588", suggest=False).mla_segments == 2
    step = apply_rule(model, "lrn-to-conv", "rk3588")
    assert step.verification.passed
    assert "LRN" not in [n.op_type for n in step.model.graph.node]
    assert step.coverage_after.mla_segments == 1 and not step.coverage_after.blockers


def test_other_betas_and_targets_with_lrn_are_left_alone() -> None:
    with pytest.raises(RuleNotApplicableError):
        apply_rule(_conv_lrn_conv(0.6), "lrn-to-conv", "rk3588")
    with pytest.raises(RuleNotApplicableError):
        apply_rule(_conv_lrn_conv(0.75), "lrn-to-conv", "mlsoc")  # its MLA runs LRN
