"""Float host stages run through onnx.reference with our replacement kernels (FLOAT_OP_OVERRIDES)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from compiler.runtime.program import FloatStep


def _gather_elements(axis: int) -> FloatStep:
    node = helper.make_node("GatherElements", ["data", "index"], ["out"], axis=axis)
    return FloatStep(node, {"": 17}, [], "test")


def test_gather_elements_takes_rows_along_an_axis_longer_than_64() -> None:
    rng = np.random.default_rng(0)
    data = rng.random((1, 8400, 6)).astype(np.float32)
    index = rng.integers(0, 8400, (1, 100, 6))
    values = {"data": data, "index": index}
    _gather_elements(1).run(values)
    np.testing.assert_array_equal(values["out"], np.take_along_axis(data, index, axis=1))


def test_gather_elements_counts_negative_indices_from_the_end() -> None:
    data = np.arange(12, dtype=np.float32).reshape(3, 4)
    values = {"data": data, "index": np.array([[-1, 0, 1, -3]])}
    _gather_elements(0).run(values)
    np.testing.assert_array_equal(values["out"], [[8, 1, 6, 3]])


def _grid_sample(mode: str, opset: int) -> FloatStep:
    node = helper.make_node("GridSample", ["x", "grid"], ["out"], mode=mode, align_corners=0)
    return FloatStep(node, {"": opset}, [], "test")


def test_grid_sample_of_opset_16_takes_its_bilinear_mode_name() -> None:
    """RT-DETR's deformable attention, exported at opset 16: onnx.reference knows only the
    opset 20 names and raised RuntimeError on 'bilinear'."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1, 2, 5, 6)).astype(np.float32)
    grid = rng.uniform(-1.2, 1.2, (1, 3, 4, 2)).astype(np.float32)
    old, new = {"x": x, "grid": grid}, {"x": x, "grid": grid}
    _grid_sample("bilinear", 16).run(old)
    _grid_sample("linear", 20).run(new)
    np.testing.assert_array_equal(old["out"], new["out"])
    assert old["out"].shape == (1, 2, 3, 4)


def _sample(mode: str, padding: str, align_corners: int, x, grid) -> tuple[np.ndarray, ...]:
    """(this kernel, ONNX Runtime, onnx.reference's own loop) on one opset 16 GridSample."""
    node = helper.make_node(
        "GridSample",
        ["x", "grid"],
        ["out"],
        mode=mode,
        padding_mode=padding,
        align_corners=align_corners,
    )
    values = {"x": x, "grid": grid}
    FloatStep(node, {"": 16}, [], "test").run(values)
    graph = helper.make_graph(
        [node],
        "g",
        [
            helper.make_tensor_value_info(k, TensorProto.FLOAT, v.shape)
            for k, v in values.items()
            if k != "out"
        ],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)])
    runtime = ort.InferenceSession(model.SerializeToString()).run(None, {"x": x, "grid": grid})[0]
    renamed = onnx.ModelProto()
    renamed.CopyFrom(model)
    renamed.opset_import[0].version = 20
    for attr in renamed.graph.node[0].attribute:
        if attr.name == "mode" and attr.s == b"bilinear":
            attr.s = b"linear"
    loop = ReferenceEvaluator(renamed).run(None, {"x": x, "grid": grid})[0]
    return values["out"], runtime, loop


@pytest.mark.parametrize("mode", ["bilinear", "nearest"])
@pytest.mark.parametrize("padding", ["zeros", "border"])
@pytest.mark.parametrize("align_corners", [0, 1])
def test_grid_sample_on_whole_arrays_matches_onnx_runtime(mode, padding, align_corners) -> None:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(2, 3, 7, 9)).astype(np.float32)
    grid = rng.uniform(-1.3, 1.3, (2, 5, 6, 2)).astype(np.float32)
    ours, runtime, loop = _sample(mode, padding, align_corners, x, grid)
    np.testing.assert_allclose(ours, loop, atol=1e-6)
    if mode == "nearest" or (padding, align_corners) == ("zeros", 0):
        np.testing.assert_array_equal(ours, runtime)  # RT-DETR's deformable attention
    else:
        np.testing.assert_allclose(ours, runtime, atol=1e-6)
