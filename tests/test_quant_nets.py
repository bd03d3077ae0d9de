"""Small float networks for the quantizer tests (built with onnx.helper), and their sanity checks."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

SHAPE = (1, 3, 16, 16)


def _model(nodes, inits, inputs, outputs, opset: int = 17) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "net", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    onnx.checker.check_model(model)
    return model


def conv_net(
    seed: int = 0, *, constant_weights: bool = False, channels: int = 8
) -> onnx.ModelProto:
    """conv → relu → depthwise conv → relu → 1x1 conv → residual add → maxpool → GAP.

    Depthwise kernels get very different magnitudes per channel (what per-channel weights and
    equalization are for). With `constant_weights` every weight lives in a Constant node, as in
    Paddle exports.
    """
    rng = np.random.default_rng(seed)
    c = channels
    inits: list[TensorProto] = []
    nodes: list[onnx.NodeProto] = []

    def weight(name: str, value: np.ndarray) -> None:
        value = value.astype(np.float32)
        if constant_weights:
            nodes.append(
                helper.make_node(
                    "Constant",
                    [],
                    [name],
                    name=f"const_{name}",
                    value=numpy_helper.from_array(value, name),
                )
            )
        else:
            inits.append(numpy_helper.from_array(value, name))

    weight("w1", rng.normal(0, 0.3, (c, 3, 3, 3)))
    weight("b1", rng.normal(0, 0.1, c))
    weight("w2", rng.normal(0, 0.3, (c, 1, 3, 3)) * rng.uniform(0.05, 3, (c, 1, 1, 1)))
    weight("b2", rng.normal(0, 0.1, c))
    weight("w3", rng.normal(0, 0.3, (c, c, 1, 1)))
    weight("b3", rng.normal(0, 0.1, c))
    nodes += [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node(
            "Conv", ["r1", "w2", "b2"], ["c2"], name="conv2", pads=[1, 1, 1, 1], group=c
        ),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("Conv", ["r2", "w3", "b3"], ["c3"], name="conv3"),
        helper.make_node("Add", ["c3", "r1"], ["a3"], name="add"),
        helper.make_node(
            "MaxPool", ["a3"], ["p"], name="pool", kernel_shape=[2, 2], strides=[2, 2]
        ),
        helper.make_node("GlobalAveragePool", ["p"], ["y"], name="gap"),
    ]
    return _model(
        nodes,
        inits,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(SHAPE))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, c, 1, 1])],
    )


def two_conv_net(
    seed: int = 0, *, activation: str | None = "Relu", depthwise: bool = False
) -> onnx.ModelProto:
    """conv1 → [activation] → conv2 with badly balanced channels (for equalization)."""
    rng = np.random.default_rng(seed)
    c = 6
    w1 = rng.normal(0, 1, (c, 3, 3, 3)) * np.array([0.01, 0.1, 1, 5, 20, 0.5]).reshape(c, 1, 1, 1)
    w2 = rng.normal(0, 1, (c, 1, 3, 3)) if depthwise else rng.normal(0, 1, (4, c, 1, 1))
    inits = [
        numpy_helper.from_array(w1.astype(np.float32), "w1"),
        numpy_helper.from_array(rng.normal(0, 0.1, c).astype(np.float32), "b1"),
        numpy_helper.from_array(w2.astype(np.float32), "w2"),
        numpy_helper.from_array(rng.normal(0, 0.1, w2.shape[0]).astype(np.float32), "b2"),
    ]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1])]
    mid = "c1"
    if activation is not None:
        nodes.append(helper.make_node(activation, ["c1"], ["a1"], name="act"))
        mid = "a1"
    attrs = {"group": c, "pads": [1, 1, 1, 1]} if depthwise else {}
    nodes.append(helper.make_node("Conv", [mid, "w2", "b2"], ["y"], name="conv2", **attrs))
    out_c = w2.shape[0]
    return _model(
        nodes,
        inits,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(SHAPE))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, out_c, 16, 16])],
    )


def random_samples(
    n: int, seed: int = 1, shape: tuple[int, ...] = SHAPE
) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"x": rng.random(shape, dtype=np.float32)} for _ in range(n)]


def run(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> np.ndarray:
    options = ort.SessionOptions()
    options.add_session_config_entry("session.disable_quant_qdq", "1")  # float-simulated Q/DQ
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    return session.run(None, feed)[0]


def sqnr_db(ref: np.ndarray, test: np.ndarray) -> float:
    ref = ref.astype(np.float64)
    noise = ((ref - test.astype(np.float64)) ** 2).sum()
    return float(10 * np.log10((ref**2).sum() / max(noise, 1e-30)))


def test_nets_run_in_onnxruntime() -> None:
    feed = random_samples(1)[0]
    assert run(conv_net(), feed).shape == (1, 8, 1, 1)
    assert np.allclose(run(conv_net(constant_weights=True), feed), run(conv_net(), feed))
    assert run(two_conv_net(depthwise=True), feed).shape == (1, 6, 16, 16)
