"""drop-empty-concat-inputs: a Concat input that a Slice leaves empty (Phi-3's rotary
pass-through q[..., rotary_dim:] with rotary_dim = head size) is removed, exactly."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from surgery.check import check_model
from surgery.model import load_model
from surgery.rules.cleanup import slice_length
from surgery.rules.engine import RuleNotApplicableError, apply_rule

INT64_MAX = np.iinfo(np.int64).max


def _ort_slice_length(size: int, start: int, end: int, step: int) -> int:
    graph = helper.make_graph(
        [helper.make_node("Slice", ["x", "starts", "ends", "axes", "steps"], ["y"])],
        "slice",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [
            numpy_helper.from_array(np.array([v], np.int64), name)
            for name, v in (("starts", start), ("ends", end), ("axes", 0), ("steps", step))
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return len(session.run(None, {"x": np.zeros(size, np.float32)})[0])


@pytest.mark.parametrize("size", [1, 5, 8])
@pytest.mark.parametrize("start", [-10, -1, 0, 2, 32, INT64_MAX])
@pytest.mark.parametrize("end", [-INT64_MAX, -9, -1, 0, 3, INT64_MAX])
@pytest.mark.parametrize("step", [1, 2, 3])
def test_slice_length_matches_onnx_runtime(size, start, end, step) -> None:
    assert slice_length(size, start, end, step) == _ort_slice_length(size, start, end, step)


def test_slice_length_refuses_negative_steps() -> None:
    with pytest.raises(ValueError, match="positive steps"):
        slice_length(5, 2, 0, -1)


def _partial_rotary(rotary: int, head: int = 16) -> onnx.ModelProto:
    """Conv → q [1, 4, 8, head] → Concat(q[..., :rotary]·2, q[..., rotary:]) → Conv."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.5, (4, 3, 1, 1)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.normal(0, 0.5, (4, 4, 1, 1)).astype(np.float32), "w2"),
        numpy_helper.from_array(np.array([0], np.int64), "zero"),
        numpy_helper.from_array(np.array([rotary], np.int64), "rotary"),
        numpy_helper.from_array(np.array([INT64_MAX], np.int64), "end"),
        numpy_helper.from_array(np.array([3], np.int64), "axis"),
        numpy_helper.from_array(np.array(2.0, np.float32), "two"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["q"]),
        helper.make_node("Slice", ["q", "zero", "rotary", "axis"], ["rotated"]),
        helper.make_node("Slice", ["q", "rotary", "end", "axis"], ["passed"], name="pass"),
        helper.make_node("Mul", ["rotated", "two"], ["scaled"]),
        helper.make_node("Concat", ["scaled", "passed"], ["joined"], axis=3, name="join"),
        helper.make_node("Conv", ["joined", "w2"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "partial_rotary",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, head])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    return load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def test_an_empty_pass_through_keeps_the_concat_off_the_mla() -> None:
    assert check_model(_partial_rotary(16), "mlsoc", suggest=False).mla_segments == 2


def test_the_empty_input_is_removed_with_identical_outputs() -> None:
    step = apply_rule(_partial_rotary(16), "drop-empty-concat-inputs", "mlsoc")
    assert step.verification.passed and step.verification.worst_max_abs == 0.0
    join = next(n for n in step.model.graph.node if n.name == "join")
    assert list(join.input) == ["scaled"]
    assert step.coverage_after.mla_segments == 1


def test_a_pass_through_with_elements_is_kept() -> None:
    with pytest.raises(RuleNotApplicableError):
        apply_rule(_partial_rotary(8), "drop-empty-concat-inputs", "mlsoc")
