"""reshape-to-flatten: `x.view(x.size(0), -1)` before a Linear on a target whose MLA runs
Flatten and a 2-D Gemm but no Reshape to rank 2 (rk3588)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler.compile import compile_model
from surgery.check import check_model
from surgery.model import load_model
from surgery.rules.engine import RuleNotApplicableError, apply_rule
from surgery.rules.fix import fix_model
from surgery.rules.replace_flatten import flatten_axis
from tests.lower_support import quantize_on, run_and_compare


def _conv_view_linear(view: list[int]) -> onnx.ModelProto:
    """Conv [1, 8, 4, 4] → Reshape to `view` → Gemm by a constant [10, 128] (transB)."""
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w"], ["a"], pads=[1, 1, 1, 1]),
            helper.make_node("Reshape", ["a", "view"], ["flat"]),
            helper.make_node("Gemm", ["flat", "fc", "bias"], ["y"], transB=1),
        ],
        "conv_view_linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [
            numpy_helper.from_array(rng.normal(0, 0.5, (8, 3, 3, 3)).astype(np.float32), "w"),
            numpy_helper.from_array(np.array(view, np.int64), "view"),
            numpy_helper.from_array(
                rng.normal(0, 0.1, (10, 128 // view[0])).astype(np.float32), "fc"
            ),
            numpy_helper.from_array(rng.normal(0, 0.1, (10,)).astype(np.float32), "bias"),
        ],
    )
    return load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


@pytest.mark.parametrize(
    ("shape", "out_shape", "axis"),
    [
        ((32, 1, 2, 512), (32, 1024), 1),
        ((2, 3, 4), (6, 4), 2),
        ((2, 3), (1, 6), 0),
        ((2, 3, 4), (4, 6), None),
        ((2, 3, 4), (2, 3, 4), None),
    ],
)
def test_flatten_axis_is_the_split_of_leading_and_trailing_axes(shape, out_shape, axis):
    assert flatten_axis(shape, out_shape) == axis


def test_a_flattening_reshape_before_a_gemm_joins_its_segment_on_rk3588():
    model = _conv_view_linear([1, -1])
    assert check_model(model, "rk3588", suggest=False).mla_segments == 2
    step = apply_rule(model, "reshape-to-flatten", "rk3588")
    assert step.verification.passed
    assert all(o.max_abs == 0 for o in step.verification.outputs)
    (flatten,) = [n for n in step.model.graph.node if n.op_type == "Flatten"]
    assert flatten.attribute[0].i == 1
    assert step.coverage_after.mla_segments == 1 and not step.coverage_after.blockers


def test_a_reshape_that_reorders_rows_and_columns_is_not_a_flatten():
    with pytest.raises(RuleNotApplicableError):
        apply_rule(_conv_view_linear([16, 8]), "reshape-to-flatten", "rk3588")


def test_fix_then_compile_gives_one_bit_exact_elf_on_rk3588(tmp_path):
    result = fix_model(_conv_view_linear([1, -1]), "rk3588")
    assert "reshape-to-flatten" in [s["rule"] for s in result.steps]
    qdq = quantize_on(result.model, "rk3588")
    compiled = compile_model(qdq, tmp_path, target="rk3588", model_name="view_linear")
    assert len(compiled.elf_files) == 1, compiled.notes
    feed = {"x": np.random.default_rng(3).normal(0, 1, (1, 3, 4, 4)).astype(np.float32)}
    comparison = run_and_compare(compiled, qdq, feed)
    assert comparison.mla_stages and comparison.bit_exact
