"""recurrent-to-cells: LSTM, GRU and RNN nodes of a static length unrolled into per-step
MatMuls and gates, the same function as ONNX Runtime's recurrent kernels to float rounding."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from surgery.check import check_model
from surgery.model import load_model
from surgery.rules.engine import RuleNotApplicableError, apply_rule
from surgery.rules.fix import fix_model

RULE = "recurrent-to-cells"
STEPS, FEATURES, HIDDEN = 8, 16, 12
GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}


def _recognizer(
    kind: str = "LSTM",
    direction: str = "bidirectional",
    *,
    batch: int = 1,
    initial: bool = False,
    outputs: tuple[str, ...] = ("Y",),
    opset: int = 14,
    **attrs,
) -> onnx.ModelProto:
    """A CRNN-style model: Conv over the image height → [T, B, C] sequence → `kind` → a
    classifier MatMul on Y (and, as graph outputs, the last states asked for)."""
    rng = np.random.default_rng(0)
    gates, dirs = GATES[kind], 2 if direction == "bidirectional" else 1

    def weight(name: str, *shape: int) -> onnx.TensorProto:
        return numpy_helper.from_array(rng.normal(0, 0.3, shape).astype(np.float32), name)

    inits = [
        weight("conv_w", FEATURES, 3, 8, 1),
        weight("W", dirs, gates * HIDDEN, FEATURES),
        weight("R", dirs, gates * HIDDEN, HIDDEN),
        weight("B", dirs, 2 * gates * HIDDEN),
        weight("classes", dirs * HIDDEN, 5),
        numpy_helper.from_array(np.array([batch, FEATURES, STEPS], np.int64), "rows"),
        numpy_helper.from_array(np.array([STEPS, batch, dirs * HIDDEN], np.int64), "merged"),
    ]
    graph_inputs = [helper.make_tensor_value_info("image", TensorProto.FLOAT, [batch, 3, 8, STEPS])]
    recurrent_inputs = ["sequence", "W", "R", "B", ""]
    if initial:
        for state in ("h0", "c0")[: 2 if kind == "LSTM" else 1]:
            info = helper.make_tensor_value_info(state, TensorProto.FLOAT, [dirs, batch, HIDDEN])
            graph_inputs.append(info)
            recurrent_inputs.append(state)
    nodes = [
        helper.make_node("Conv", ["image", "conv_w"], ["features"]),
        helper.make_node("Relu", ["features"], ["active"]),
        helper.make_node("Reshape", ["active", "rows"], ["by_channel"]),
        helper.make_node("Transpose", ["by_channel"], ["sequence"], perm=[2, 0, 1]),
        helper.make_node(
            kind,
            recurrent_inputs,
            ["Y", "Y_h", "Y_c"][: 3 if kind == "LSTM" else 2],
            hidden_size=HIDDEN,
            direction=direction,
            **attrs,
        ),
    ]
    graph_outputs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs]
    if "Y" in outputs:
        nodes += [
            helper.make_node("Transpose", ["Y"], ["time_batch"], perm=[0, 2, 1, 3]),
            helper.make_node("Reshape", ["time_batch", "merged"], ["states"]),
            helper.make_node("MatMul", ["states", "classes"], ["logits"]),
        ]
        graph_outputs[outputs.index("Y")] = helper.make_tensor_value_info(
            "logits", TensorProto.FLOAT, None
        )
    graph = helper.make_graph(nodes, "recognizer", graph_inputs, graph_outputs, inits)
    return load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]))


def _unrolled(model: onnx.ModelProto, target: str = "mlsoc") -> onnx.ModelProto:
    step = apply_rule(model, RULE, target)
    assert step.verification.passed, step.verification
    assert not {"LSTM", "GRU", "RNN"} & {n.op_type for n in step.model.graph.node}
    return step.model


def test_bidirectional_lstm_becomes_cells_that_match_onnx_runtime() -> None:
    model = _unrolled(_recognizer("LSTM"))
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("Sigmoid") == 2 * STEPS and ops.count("Tanh") == 2 * 2 * STEPS


@pytest.mark.parametrize("linear_before_reset", [0, 1])
def test_gru_with_either_reset_form_and_an_initial_state_matches(linear_before_reset) -> None:
    _unrolled(
        _recognizer(
            "GRU",
            initial=True,
            outputs=("Y", "Y_h"),
            linear_before_reset=linear_before_reset,
        )
    )


def test_reverse_rnn_over_a_batch_of_two_matches() -> None:
    _unrolled(_recognizer("RNN", "reverse", batch=2))


def test_last_states_alone_are_written_when_y_is_unused() -> None:
    model = _unrolled(_recognizer("LSTM", "reverse", initial=True, outputs=("Y_h", "Y_c")))
    assert [o.name for o in model.graph.output] == ["Y_h", "Y_c"]


def test_opset_18_splits_name_their_number_of_outputs() -> None:
    model = _unrolled(_recognizer("GRU", opset=18, linear_before_reset=1))
    splits = [n for n in model.graph.node if n.op_type == "Split"]
    assert splits and all(any(a.name == "num_outputs" for a in n.attribute) for n in splits)


def test_check_suggests_the_rule_and_fix_puts_the_recognizer_on_one_segment() -> None:
    model = _recognizer("LSTM")
    report = check_model(model, "mlsoc")
    lstm = next(b for b in report.blockers if b.op_type == "LSTM")
    assert RULE in lstm.suggested_rules and report.mla_segments == 2
    for target in ("mlsoc", "rk3588"):
        fixed = fix_model(model, target)
        assert RULE in [s["rule"] for s in fixed.steps]
        assert check_model(fixed.model, target, suggest=False).mla_segments == 1


def test_batch_first_layout_is_left_alone() -> None:
    """layout 1 LSTMs exist in ONNX but ONNX Runtime runs none, so no rewrite is verifiable."""
    model = _recognizer("RNN")
    next(n for n in model.graph.node if n.op_type == "RNN").attribute.append(
        helper.make_attribute("layout", 1)
    )
    with pytest.raises(RuleNotApplicableError):
        apply_rule(model, RULE, "mlsoc")


def test_shorter_sequence_lengths_are_left_alone() -> None:
    model = _recognizer("GRU")
    model.graph.initializer.append(numpy_helper.from_array(np.array([STEPS - 2], np.int32), "lens"))
    node = next(n for n in model.graph.node if n.op_type == "GRU")
    node.input[4] = "lens"
    with pytest.raises(RuleNotApplicableError):
        apply_rule(model, RULE, "mlsoc")


def test_full_sequence_lengths_are_dropped() -> None:
    model = _recognizer("GRU")
    model.graph.initializer.append(numpy_helper.from_array(np.array([STEPS], np.int32), "lens"))
    next(n for n in model.graph.node if n.op_type == "GRU").input[4] = "lens"
    _unrolled(model)


def test_recurrences_longer_than_max_cells_are_left_alone() -> None:
    model = _recognizer("LSTM")  # 8 steps × 2 directions = 16 cells
    with pytest.raises(RuleNotApplicableError):
        apply_rule(model, RULE, "mlsoc", params={"max_cells": 15})
    assert apply_rule(model, RULE, "mlsoc", params={"max_cells": 16}).verification.passed
