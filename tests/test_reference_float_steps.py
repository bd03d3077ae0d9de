"""Float steps of the reference executor run on ONNX Runtime, configured as the archive's host
stages are, so the two agree bit for bit (and the MLA stages after a float island see the same
codes); onnx.reference runs what ONNX Runtime has no kernel for."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from compiler.runtime import IntegerExecutor
from compiler.runtime.host_session import host_session


def _float_model(nodes, inputs, initializers, elem=TensorProto.FLOAT) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "float_island",
        [helper.make_tensor_value_info(name, elem, shape) for name, shape in inputs.items()],
        [helper.make_tensor_value_info("y", elem, None)],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


def _host_run(model: onnx.ModelProto, feed: dict) -> np.ndarray:
    return host_session(model.SerializeToString()).run(None, feed)[0]


def test_a_float_conv_gives_the_host_stages_bits() -> None:
    rng = np.random.default_rng(0)
    weight = rng.normal(0, 0.3, (16, 8, 3, 3)).astype(np.float32)
    model = _float_model(
        [helper.make_node("Conv", ["x", "w"], ["y"], pads=[2, 2, 2, 2], dilations=[2, 2])],
        {"x": [1, 8, 20, 20]},
        [numpy_helper.from_array(weight, "w")],
    )
    feed = {"x": rng.normal(0, 1, (1, 8, 20, 20)).astype(np.float32)}
    ours = IntegerExecutor(model).run(feed)["y"]
    assert np.array_equal(ours, _host_run(model, feed))


def test_a_float_attention_island_gives_the_host_stages_bits() -> None:
    """MatMul, scale, Softmax, Sigmoid gate: each op rounds as ONNX Runtime does, where
    onnx.reference's numpy kernels differ in the last bit (an RT-DETR decoder's float ops put
    its MLA stages one code off)."""
    rng = np.random.default_rng(3)
    model = _float_model(
        [
            helper.make_node("MatMul", ["q", "k"], ["scores"]),
            helper.make_node("Mul", ["scores", "scale"], ["scaled"]),
            helper.make_node("Softmax", ["scaled"], ["p"], axis=-1),
            helper.make_node("Sigmoid", ["p"], ["gate"]),
            helper.make_node("Mul", ["p", "gate"], ["y"]),
        ],
        {"q": [2, 30, 16], "k": [2, 16, 30]},
        [numpy_helper.from_array(np.array(0.25, np.float32), "scale")],
    )
    feed = {
        "q": rng.normal(0, 2, (2, 30, 16)).astype(np.float32),
        "k": rng.normal(0, 2, (2, 16, 30)).astype(np.float32),
    }
    ours = IntegerExecutor(model).run(feed)["y"]
    assert np.array_equal(ours, _host_run(model, feed))


def test_a_resize_by_sizes_with_an_empty_scales_constant_runs_on_onnx_runtime() -> None:
    """torchvision's F.interpolate(size=...) export: roi and scales are empty constants, which
    ONNX Runtime accepts only as initializers."""
    empty = np.zeros(0, np.float32)
    model = _float_model(
        [helper.make_node("Resize", ["x", "roi", "scales", "sizes"], ["y"], mode="linear")],
        {"x": [1, 3, 5, 7]},
        [
            numpy_helper.from_array(empty, "roi"),
            numpy_helper.from_array(empty, "scales"),
            numpy_helper.from_array(np.array([1, 3, 12, 9], np.int64), "sizes"),
        ],
    )
    feed = {"x": np.random.default_rng(1).normal(0, 1, (1, 3, 5, 7)).astype(np.float32)}
    ours = IntegerExecutor(model).run(feed)["y"]
    assert ours.shape == (1, 3, 12, 9)
    assert np.array_equal(ours, _host_run(model, feed))


def test_a_float64_conv_without_an_onnx_runtime_kernel_falls_back_to_onnx_reference() -> None:
    rng = np.random.default_rng(2)
    weight = rng.normal(0, 0.3, (2, 3, 1, 1))
    model = _float_model(
        [helper.make_node("Conv", ["x", "w"], ["y"])],
        {"x": [1, 3, 4, 4]},
        [numpy_helper.from_array(weight, "w")],
        elem=TensorProto.DOUBLE,
    )
    x = rng.normal(0, 1, (1, 3, 4, 4))
    ours = IntegerExecutor(model).run({"x": x})["y"]
    np.testing.assert_allclose(ours, np.einsum("mc,nchw->nmhw", weight[:, :, 0, 0], x))
