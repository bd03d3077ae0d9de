"""negative-step-slice-to-concat: a Slice with a negative step (torch.flip, x[::-1], the
time-reversed sequence of a BiLSTM written as two forward LSTMs), which the MLA does not take,
as a Concat of the single-element Slices it picks."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from surgery.check import check_model
from surgery.model import load_model
from surgery.rules.engine import RuleNotApplicableError, apply_rule
from surgery.rules.fix import fix_model
from tests.architectures import crnn_bilstm

RULE = "negative-step-slice-to-concat"
INT64_MIN = -(2**63)


def _conv_slice_conv(start: int, end: int, axis: int, step: int, size: int = 6) -> onnx.ModelProto:
    """Conv [1, 4, size, size] → Slice(start, end, axis, step) → Conv."""
    rng = np.random.default_rng(0)
    channels = len(range(4)[slice(start, end, step)]) if axis == 1 else 4
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.5, (4, 4, 1, 1)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.normal(0, 0.5, (3, channels, 1, 1)).astype(np.float32), "w2"),
        *(
            numpy_helper.from_array(np.array([v], np.int64), name)
            for name, v in (("starts", start), ("ends", end), ("axes", axis), ("steps", step))
        ),
    ]
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w1"], ["a"]),
            helper.make_node("Slice", ["a", "starts", "ends", "axes", "steps"], ["s"], "flip"),
            helper.make_node("Conv", ["s", "w2"], ["y"]),
        ],
        "conv_slice_conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, size, size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    return load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]))


@pytest.mark.parametrize(
    ("start", "end", "axis", "step"),
    [(-1, INT64_MIN, 3, -1), (4, 0, 2, -2), (-1, INT64_MIN, 1, -1)],
    ids=["flip-width", "every-other-row-backwards", "flip-channels-on-a-view"],
)
def test_a_negative_step_slice_becomes_a_concat_of_picks(start, end, axis, step) -> None:
    model = _conv_slice_conv(start, end, axis, step)
    assert check_model(model, "mlsoc", suggest=False).mla_segments == 2
    result = apply_rule(model, RULE, "mlsoc")
    assert result.verification.passed and result.verification.mode == "exact"
    assert result.coverage_after.mla_segments == 1 and not result.coverage_after.blockers


def test_a_reversal_longer_than_max_picks_is_left_alone() -> None:
    with pytest.raises(RuleNotApplicableError):
        apply_rule(_conv_slice_conv(-1, INT64_MIN, 3, -1, size=65), RULE, "mlsoc")


def test_a_bilstm_of_two_forward_lstms_on_a_reversed_sequence_runs_on_one_segment() -> None:
    """CRNN as PaddleOCR exports it: fix unrolls both LSTMs (the unrolling alone splits the
    segment around the still rank-3 reversals, a detour fix takes) and writes the reversals
    as Concats, which leaves only the rank-3 output and its ArgMax on the host."""
    fixed = fix_model(load_model(crnn_bilstm()), "mlsoc")
    rules = [step["rule"] for step in fixed.steps]
    assert "recurrent-to-cells" in rules and RULE in rules
    report = check_model(fixed.model, "mlsoc", suggest=False)
    assert report.mla_segments == 1 and report.mla_mac_fraction == 1.0
    assert {b.op_type for b in report.blockers} <= {"Reshape", "ArgMax"}
