"""Gather on the bf16 unit (modalix runs Gather in bf16 only): the quantizer's Cast pairs make it
one step, the step equals ONNX Runtime on the QDQ model, and the compiled LUT instructions run
it on the MLA bit for bit, so the archive has the one `.elf` that `check` counts."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler.compile import compile_model
from compiler.intmath import bf16_requantize_table, lut_input_values
from compiler.runtime import IntegerExecutor
from surgery.check import check_model
from tests.lower_support import quantize_on, run_and_compare
from tests.test_reference_support import steps_apart

SCALE = np.float32(0.0137)
"""Not a power of two: bf16's 8 significant bits cannot hold every (q - z) · SCALE."""


def test_the_bf16_round_trip_moves_codes_far_from_the_zero_point() -> None:
    """Why the move goes through a table: with the same quantization on both sides, codes
    within 128 of the zero point come back unchanged, some further away do not."""
    table = bf16_requantize_table(np.int8, -100, SCALE, SCALE, -100, np.int8)
    codes = lut_input_values(np.int8)
    near = np.abs(codes + 100) <= 128
    assert np.array_equal(table[near], codes[near])
    assert np.any(table != codes)


def _qdq_gather(indices: np.ndarray, axis: int, out_scale: float, out_zero_point: int):
    """x → Q → DQ → Cast(bf16) → Cast(float) → Gather → Cast(bf16) → Cast(float) → Q → DQ."""
    inits = [
        numpy_helper.from_array(np.array(SCALE, np.float32), "x_s"),
        numpy_helper.from_array(np.array(-100, np.int8), "x_z"),
        numpy_helper.from_array(np.array(out_scale, np.float32), "y_s"),
        numpy_helper.from_array(np.array(out_zero_point, np.int8), "y_z"),
        numpy_helper.from_array(indices.astype(np.int64), "indices"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "x_s", "x_z"], ["x_q"]),
        helper.make_node("DequantizeLinear", ["x_q", "x_s", "x_z"], ["x_d"]),
        helper.make_node("Cast", ["x_d"], ["x_b"], to=TensorProto.BFLOAT16),
        helper.make_node("Cast", ["x_b"], ["x_f"], to=TensorProto.FLOAT),
        helper.make_node("Gather", ["x_f", "indices"], ["g"], "pick", axis=axis),
        helper.make_node("Cast", ["g"], ["g_b"], to=TensorProto.BFLOAT16),
        helper.make_node("Cast", ["g_b"], ["g_f"], to=TensorProto.FLOAT),
        helper.make_node("QuantizeLinear", ["g_f", "y_s", "y_z"], ["y_q"]),
        helper.make_node("DequantizeLinear", ["y_q", "y_s", "y_z"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "qdq_gather_bf16",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 6, 5, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


@pytest.mark.parametrize(
    ("indices", "axis", "out_scale", "out_zero_point"),
    [
        (np.array(2), 1, SCALE, -100),
        (np.array([0, 3, 1]), 1, 0.011, 4),
        (np.array([[1, 0], [4, 4]]), 2, SCALE, -100),
        (np.array([-1]), 3, 0.02, 0),
    ],
)
def test_a_bf16_gather_is_one_step_equal_to_onnx_runtime(
    indices, axis, out_scale, out_zero_point
) -> None:
    model = _qdq_gather(indices, axis, out_scale, out_zero_point)
    executor = IntegerExecutor(model, strict=True)
    assert executor.float_nodes == ()
    assert [s.pattern for s in executor.steps if s.name == "pick"] == ["Gather(bf16)"]
    rng = np.random.default_rng(3)
    feeds = [{"x": rng.uniform(-0.4, 3.4, (1, 6, 5, 4)).astype(np.float32)} for _ in range(3)]
    assert steps_apart(executor, model, feeds)["y"] == 0


def _conv_gather_conv(indices: np.ndarray) -> onnx.ModelProto:
    """Conv → Relu → Gather of channels → Conv: the Gather between two MLA layers."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.5, (8, 3, 3, 3)).astype(np.float32), "w1"),
        numpy_helper.from_array(
            rng.normal(0, 0.5, (4, indices.size, 1, 1)).astype(np.float32), "w2"
        ),
        numpy_helper.from_array(indices.astype(np.int64), "channels"),
    ]
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w1"], ["a"], pads=[1, 1, 1, 1]),
            helper.make_node("Relu", ["a"], ["r"]),
            helper.make_node("Gather", ["r", "channels"], ["g"], "pick", axis=1),
            helper.make_node("Conv", ["g", "w2"], ["y"]),
        ],
        "conv_gather_conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("indices", [np.array([5, 0, 2]), np.array([1, 3, 5, 7])])
def test_a_gather_mid_segment_compiles_to_one_elf_on_modalix_and_runs_bit_exact(
    indices, tmp_path
) -> None:
    model = _conv_gather_conv(indices)
    assert check_model(model, "modalix", suggest=False).mla_segments == 1
    qdq = quantize_on(model, "modalix")
    assert any(n.op_type == "Cast" for n in qdq.graph.node), "modalix quantizes Gather in bf16"
    result = compile_model(qdq, tmp_path, target="modalix", model_name="gather")
    assert len(result.elf_files) == 1, result.notes
    feed = {"x": np.random.default_rng(5).normal(0, 1, (1, 3, 8, 8)).astype(np.float32)}
    comparison = run_and_compare(result, qdq, feed)
    assert comparison.mla_stages and comparison.mla_bit_exact
    assert comparison.bit_exact
