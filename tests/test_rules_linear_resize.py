"""linear-resize-to-matmul: a linear Resize by a scale the MLA rejects (rk3588 resizes by
integers only; DepthAnything's head resizes by 1.75) becomes MatMuls by constant
interpolation matrices, equal to ONNX Runtime's resize up to float rounding."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler.compile import compile_model
from surgery.check import check_model
from surgery.model import load_model
from surgery.rules.engine import RuleNotApplicableError, apply_rule
from surgery.rules.replace_resize import linear_weights
from surgery.verify import make_inputs
from tests.lower_support import quantize_on, run_and_compare

MODES = ["half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric"]


def _resize_model(shape: list[int], out: list[int], ctm: str, between_convs: bool = False):
    """A linear Resize to `out` by sizes (optionally between two 1×1 Convs)."""
    sizes = numpy_helper.from_array(np.array(out, np.int64), "sizes")
    resize = helper.make_node(
        "Resize",
        ["r_in", "", "", "sizes"],
        ["r_out"],
        mode="linear",
        coordinate_transformation_mode=ctm,
        name="resize",
    )
    nodes, inits = [resize], [sizes]
    x, y = "r_in", "r_out"
    if between_convs:
        rng = np.random.default_rng(0)
        c = shape[1]
        inits += [
            numpy_helper.from_array(rng.normal(0, 0.5, (c, 3, 1, 1)).astype(np.float32), "w1"),
            numpy_helper.from_array(rng.normal(0, 0.5, (4, c, 1, 1)).astype(np.float32), "w2"),
        ]
        nodes = [helper.make_node("Conv", ["x", "w1"], ["r_in"]), resize]
        nodes.append(helper.make_node("Conv", ["r_out", "w2"], ["y"]))
        x, y = "x", "y"
        shape = [shape[0], 3, *shape[2:]]
    graph = helper.make_graph(
        nodes,
        "linear_resize",
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info(y, TensorProto.FLOAT, None)],
        inits,
    )
    return load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


@pytest.mark.parametrize("ctm", MODES)
@pytest.mark.parametrize(("size", "out"), [(8, 14), (16, 28), (20, 7), (5, 5), (3, 48)])
def test_interpolation_matrix_matches_onnx_runtime(ctm: str, size: int, out: int) -> None:
    model = _resize_model([1, 1, 1, size], [1, 1, 1, out], ctm)
    x = np.random.default_rng(size * out).normal(0, 1, (1, 1, 1, size)).astype(np.float32)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    expected = session.run(None, {"r_in": x})[0]
    matrix = linear_weights(size, out, out / size, ctm)
    assert matrix is not None
    np.testing.assert_allclose(x @ matrix, expected, rtol=0, atol=1e-5)


def test_every_column_sums_to_one() -> None:
    """Interpolation weights of each output are a convex pair."""
    matrix = linear_weights(16, 28, 28 / 16, "half_pixel")
    assert matrix is not None
    np.testing.assert_allclose(matrix.sum(axis=0), 1.0, atol=1e-6)
    assert (matrix >= 0).all() and (np.count_nonzero(matrix, axis=0) <= 2).all()


def test_a_fractional_linear_resize_splits_the_model_on_rk3588() -> None:
    model = _resize_model([1, 8, 8, 8], [1, 8, 14, 14], "half_pixel", between_convs=True)
    assert check_model(model, "rk3588", suggest=False).mla_segments == 2


def test_the_resize_becomes_two_matmuls_with_the_same_outputs() -> None:
    model = _resize_model([1, 8, 8, 8], [1, 8, 14, 14], "half_pixel", between_convs=True)
    step = apply_rule(model, "linear-resize-to-matmul", "rk3588")
    assert step.verification.passed and step.verification.worst_max_abs < 1e-5
    assert [n.op_type for n in step.model.graph.node] == ["Conv", "MatMul", "MatMul", "Conv"]
    assert step.coverage_after.mla_segments == 1 and not step.coverage_after.blockers


def test_an_axis_the_resize_keeps_gets_no_matrix() -> None:
    model = _resize_model([1, 8, 8, 8], [1, 8, 8, 14], "half_pixel", between_convs=True)
    step = apply_rule(model, "linear-resize-to-matmul", "rk3588")
    assert [n.op_type for n in step.model.graph.node] == ["Conv", "MatMul", "Conv"]


def test_nearest_resizes_are_left_to_resize_to_supported() -> None:
    model = _resize_model([1, 8, 8, 8], [1, 8, 14, 14], "half_pixel", between_convs=True)
    resize = next(n for n in model.graph.node if n.op_type == "Resize")
    next(a for a in resize.attribute if a.name == "mode").s = b"nearest"
    with pytest.raises(RuleNotApplicableError):
        apply_rule(model, "linear-resize-to-matmul", "rk3588")


def test_the_matmuls_compile_to_one_elf_bit_exact(tmp_path: Path) -> None:
    model = _resize_model([1, 8, 8, 8], [1, 8, 14, 14], "half_pixel", between_convs=True)
    fixed = apply_rule(model, "linear-resize-to-matmul", "rk3588").model
    qdq = quantize_on(fixed, "rk3588")
    result = compile_model(qdq, tmp_path, target="rk3588", model_name="linear_resize")
    comparison = run_and_compare(result, qdq, make_inputs(fixed, seed=1))
    assert len(result.elf_files) == 1 and comparison.bit_exact
