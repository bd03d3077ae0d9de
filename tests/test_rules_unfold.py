"""gather-table-to-transpose and col2im-to-transpose: F.unfold / F.fold of non-overlapping
patches (Gathers by index tables, Col2Im) rewritten as the 4-D transposes they are."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from surgery.model import load_model
from surgery.rules.engine import RuleNotApplicableError, apply_rule
from surgery.rules.fix import fix_model

C, SIDE = 4, 8


def _model(nodes, inits, out_shape, opset: int = 18) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "unfold",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, SIDE, SIDE])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)],
        inits,
    )
    return load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]))


def _conv_weight(name: str, cout: int, cin: int) -> onnx.TensorProto:
    values = np.random.default_rng(0).normal(0, 0.5, (cout, cin, 1, 1)).astype(np.float32)
    return numpy_helper.from_array(values, name)


def _gathered(table: np.ndarray) -> onnx.ModelProto:
    """Conv → Gather(axis 2, table) → Reshape back to 4-D → Conv."""
    rows = table.size
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["a"]),
        helper.make_node("Gather", ["a", "table"], ["g"], axis=2),
        helper.make_node("Reshape", ["g", "view"], ["r"]),
        helper.make_node("Conv", ["r", "w2"], ["y"]),
    ]
    inits = [
        _conv_weight("w1", C, 3),
        _conv_weight("w2", C, C),
        numpy_helper.from_array(table.astype(np.int64), "table"),
        numpy_helper.from_array(np.array([1, C, rows, SIDE], np.int64), "view"),
    ]
    return _model(nodes, inits, [1, C, rows, SIDE])


@pytest.mark.parametrize(
    "table",
    [
        np.arange(SIDE).reshape(SIDE // 2, 2).T,  # the unfold table: a reshape and a swap
        np.arange(SIDE).reshape(2, SIDE // 2),  # a plain reshape of the axis
    ],
    ids=["unfold", "reshape"],
)
def test_a_gather_by_a_permuting_table_becomes_data_movement(table) -> None:
    step = apply_rule(_gathered(table), "gather-table-to-transpose", "mlsoc")
    assert step.verification.passed and step.verification.worst_max_abs == 0
    assert "Gather" not in [n.op_type for n in step.model.graph.node]


def test_fix_carries_an_unfolded_map_on_the_mla() -> None:
    model = _gathered(np.arange(SIDE).reshape(SIDE // 2, 2).T)
    result = fix_model(model, "mlsoc")
    assert result.coverage_after.mla_segments == 1 and not result.coverage_after.blockers
    assert "gather-table-to-transpose" in [step["rule"] for step in result.steps]


def test_a_gather_that_repeats_positions_stays() -> None:
    overlapping = np.array([[0, 1, 2, 3], [1, 2, 3, 4]])  # an overlapping unfold (stride 1)
    with pytest.raises(RuleNotApplicableError):
        apply_rule(_gathered(overlapping), "gather-table-to-transpose", "mlsoc")


def _folded(stride: int, pad: int = 0) -> onnx.ModelProto:
    """Conv → Reshape to columns [1, C·4, L] → Col2Im(2×2 blocks, `stride`, `pad`) → Conv."""
    blocks = ((SIDE + 2 * pad - 2) // stride + 1) ** 2
    fold = helper.make_node(
        "Col2Im", ["c", "image", "block"], ["f"], strides=[stride, stride], pads=[pad] * 4
    )
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["a"]),
        helper.make_node("Reshape", ["a", "cols"], ["c"]),
        fold,
        helper.make_node("Conv", ["f", "w2"], ["y"]),
    ]
    side = int(np.sqrt(blocks))
    inits = [
        _conv_weight("w1", 4 * C, 3),
        _conv_weight("w2", C, C),
        numpy_helper.from_array(np.array([1, 4 * C, blocks], np.int64), "cols"),
        numpy_helper.from_array(np.array([SIDE, SIDE], np.int64), "image"),
        numpy_helper.from_array(np.array([2, 2], np.int64), "block"),
    ]
    graph_in = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, side, side])
    model = _model(nodes, inits, [1, C, SIDE, SIDE])
    model.graph.input[0].CopyFrom(graph_in)
    return load_model(model)


def test_col2im_of_side_by_side_blocks_becomes_4d_transposes() -> None:
    step = apply_rule(_folded(stride=2), "col2im-to-transpose", "mlsoc")
    assert step.verification.passed and step.verification.worst_max_abs == 0
    ops = [n.op_type for n in step.model.graph.node]
    assert "Col2Im" not in ops and "Transpose" in ops
    result = fix_model(_folded(stride=2), "mlsoc")
    assert result.coverage_after.mla_segments == 1 and not result.coverage_after.blockers


def test_col2im_of_overlapping_blocks_stays() -> None:
    with pytest.raises(RuleNotApplicableError):
        apply_rule(_folded(stride=1), "col2im-to-transpose", "mlsoc")


OVERLAPPING = np.arange(3)[:, None] + np.arange(SIDE - 2)[None, :]
"""The table of a stride-1 unfold with kernel 3 (ConvBERT's span convolution): windows overlap."""


def test_a_gather_of_overlapping_windows_becomes_slices_and_a_concat() -> None:
    step = apply_rule(_gathered(OVERLAPPING), "gather-windows-to-slices", "mlsoc")
    assert step.verification.passed and step.verification.worst_max_abs == 0
    ops = [n.op_type for n in step.model.graph.node]
    assert "Gather" not in ops and ops.count("Slice") == 3 and "Concat" in ops
    assert not step.coverage_after.blockers


def test_a_permuting_table_is_not_taken_as_windows() -> None:
    model = _gathered(np.arange(SIDE).reshape(2, SIDE // 2))
    with pytest.raises(RuleNotApplicableError):
        apply_rule(model, "gather-windows-to-slices", "mlsoc")


def test_a_table_whose_rows_step_differently_is_left_alone() -> None:
    uneven = np.array([[0, 1, 2], [1, 3, 5]])
    with pytest.raises(RuleNotApplicableError):
        apply_rule(_gathered(uneven), "gather-windows-to-slices", "mlsoc")


def test_strided_windows_become_strided_slices() -> None:
    strided = np.arange(3)[:, None] + 2 * np.arange(SIDE // 2 - 1)[None, :]  # kernel 3, stride 2
    step = apply_rule(_gathered(strided), "gather-windows-to-slices", "mlsoc")
    assert step.verification.passed and step.verification.worst_max_abs == 0
    steps = [n for n in step.model.graph.node if n.op_type == "Slice" and len(n.input) == 5]
    assert len(steps) == 3


@pytest.mark.parametrize(("stride", "pad"), [(1, 0), (2, 1)], ids=["overlapping", "padded"])
def test_col2im_of_overlapping_blocks_becomes_one_hot_conv_transposes(stride, pad) -> None:
    step = apply_rule(_folded(stride, pad), "col2im-to-conv-transpose", "mlsoc")
    assert step.verification.passed
    ops = [n.op_type for n in step.model.graph.node]
    assert "Col2Im" not in ops and ops.count("ConvTranspose") == 4
    assert not step.coverage_after.blockers


def test_fix_carries_an_overlapping_fold_on_the_mla() -> None:
    result = fix_model(_folded(stride=1), "mlsoc")
    assert result.coverage_after.mla_segments == 1 and not result.coverage_after.blockers
    assert "col2im-to-conv-transpose" in [step["rule"] for step in result.steps]


def test_side_by_side_blocks_are_left_to_the_transpose_rule() -> None:
    with pytest.raises(RuleNotApplicableError):
        apply_rule(_folded(stride=2), "col2im-to-conv-transpose", "mlsoc")
