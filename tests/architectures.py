"""Small models of architecture families the shared models do not cover (no tests here): an
OCR recogniser with an LSTM, an anchor-free detection head, a MobileNetV3 / EfficientNet block,
a UNet, an SSD head, an MLP classifier with erf-GELU, a per-channel PReLU classifier and a
two-input model with the less common data-movement ops. Built with onnx.helper and seeded
weights, small enough to run the whole pipeline in a second or two."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


class Builder:
    """The nodes and seeded weights of one model, named after the layer that owns them."""

    def __init__(self, seed: int = 0) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.rng = np.random.default_rng(seed)

    def const(self, name: str, value: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def weight(self, name: str, *shape: int) -> str:
        return self.const(name, self.rng.normal(0, 0.2, shape).astype(np.float32))

    def node(self, op: str, inputs: Sequence[str], output: str, **attrs) -> str:
        self.nodes.append(helper.make_node(op, list(inputs), [output], name=output, **attrs))
        return output

    def conv(
        self,
        name: str,
        x: str,
        cin: int,
        cout: int,
        kernel: int = 3,
        stride: int = 1,
        act: str | None = "relu",
        group: int = 1,
    ) -> str:
        w = self.weight(f"{name}_w", cout, cin // group, kernel, kernel)
        b = self.weight(f"{name}_b", cout)
        y = self.node(
            "Conv",
            [x, w, b],
            f"{name}_conv",
            kernel_shape=[kernel, kernel],
            strides=[stride, stride],
            pads=[kernel // 2] * 4,
            group=group,
        )
        if act == "relu":
            return self.node("Relu", [y], f"{name}_relu")
        if act == "silu":
            gate = self.node("Sigmoid", [y], f"{name}_gate")
            return self.node("Mul", [y, gate], f"{name}_silu")
        return y

    def model(
        self,
        name: str,
        inputs: dict[str, list[int]],
        outputs: Sequence[str],
        opset: int = 13,
    ) -> onnx.ModelProto:
        graph = helper.make_graph(
            self.nodes,
            name,
            [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs.items()],
            [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs],
            self.inits,
        )
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def crnn() -> onnx.ModelProto:
    """OCR recogniser: conv backbone → (T, N, C) sequence → LSTM → MatMul → Softmax."""
    b, hidden = Builder(), 24
    x = b.conv("c1", "x", 3, 16, stride=2)
    x = b.conv("c2", x, 16, 32, stride=2)
    x = b.conv("c3", x, 32, 32, stride=2)
    x = b.node("MaxPool", [x], "pool", kernel_shape=[4, 1], strides=[4, 1])
    x = b.node("Squeeze", [x, b.const("height", np.array([2]))], "sequence")
    x = b.node("Transpose", [x], "time_major", perm=[2, 0, 1])
    lstm_inputs = [
        x,
        b.weight("lstm_w", 1, 4 * hidden, 32),
        b.weight("lstm_r", 1, 4 * hidden, hidden),
        b.weight("lstm_b", 1, 8 * hidden),
    ]
    x = b.node("LSTM", lstm_inputs, "lstm", hidden_size=hidden)
    x = b.node("Squeeze", [x, b.const("direction", np.array([1]))], "lstm_out")
    x = b.node("MatMul", [x, b.weight("classes", hidden, 37)], "logits")
    b.node("Softmax", [x], "probs", axis=-1)
    return b.model("crnn", {"x": [1, 3, 32, 128]}, ["probs"], opset=17)


def anchor_free_head() -> onnx.ModelProto:
    """YOLOX-style: per scale Concat(box, sigmoid(obj), sigmoid(cls)) → (N, 85, HW), scales
    concatenated and transposed to (N, anchors, 85)."""
    b = Builder()
    x = b.conv("stem", "images", 3, 16, stride=2, act="silu")
    flat = []
    for k in range(2):
        x = b.conv(f"down{k}", x, 16, 16, stride=2, act="silu")
        box = b.conv(f"box{k}", x, 16, 4, kernel=1, act=None)
        obj = b.node("Sigmoid", [b.conv(f"obj{k}", x, 16, 1, kernel=1, act=None)], f"objs{k}")
        cls = b.node("Sigmoid", [b.conv(f"cls{k}", x, 16, 80, kernel=1, act=None)], f"clss{k}")
        cat = b.node("Concat", [box, obj, cls], f"cat{k}", axis=1)
        shape = b.const(f"shape{k}", np.array([1, 85, -1]))
        flat.append(b.node("Reshape", [cat, shape], f"flat{k}"))
    joined = b.node("Concat", flat, "joined", axis=2)
    b.node("Transpose", [joined], "output", perm=[0, 2, 1])
    return b.model("anchor_free_head", {"images": [1, 3, 64, 64]}, ["output"])


def mobile_block() -> onnx.ModelProto:
    """MobileNetV3 / EfficientNet: HardSwish op, depthwise conv, squeeze-excite (GAP, two 1×1
    convs, HardSigmoid gate, broadcast Mul), bilinear Resize back up and a residual Add."""
    b = Builder()
    x = b.node("HardSwish", [b.conv("stem", "x", 3, 16, stride=2, act=None)], "hswish")
    dw = b.conv("dw", x, 16, 16, stride=2, act=None, group=16)
    squeezed = b.node("GlobalAveragePool", [dw], "squeeze")
    gate = b.conv("se_reduce", squeezed, 16, 4, kernel=1)
    gate = b.conv("se_expand", gate, 4, 16, kernel=1, act=None)
    gate = b.node("HardSigmoid", [gate], "gate", alpha=1 / 6, beta=0.5)
    excited = b.node("Mul", [dw, gate], "excited")
    scales = b.const("scales", np.array([1, 1, 2, 2], np.float32))
    up = b.node("Resize", [excited, "", scales], "up", mode="linear")
    b.node("Add", [up, x], "y")
    return b.model("mobile_block", {"x": [1, 3, 32, 32]}, ["y"], opset=14)


def unet() -> onnx.ModelProto:
    """Two-level UNet: MaxPool down, ConvTranspose and nearest Resize up, skip Concats, a
    per-pixel Softmax over classes."""
    b = Builder()
    e1 = b.conv("enc1", "x", 3, 8)
    e2 = b.conv(
        "enc2", b.node("MaxPool", [e1], "pool1", kernel_shape=[2, 2], strides=[2, 2]), 8, 16
    )
    bottom = b.conv(
        "bottom", b.node("MaxPool", [e2], "pool2", kernel_shape=[2, 2], strides=[2, 2]), 16, 16
    )
    up2 = b.node(
        "ConvTranspose",
        [bottom, b.weight("up_w", 16, 16, 2, 2), b.weight("up_b", 16)],
        "up2",
        kernel_shape=[2, 2],
        strides=[2, 2],
    )
    d2 = b.conv("dec2", b.node("Concat", [up2, e2], "skip2", axis=1), 32, 8)
    scales = b.const("scales", np.array([1, 1, 2, 2], np.float32))
    up1 = b.node("Resize", [d2, "", scales], "up1", mode="nearest")
    logits = b.conv("head", b.node("Concat", [up1, e1], "skip1", axis=1), 16, 5, 1, act=None)
    b.node("Softmax", [logits], "probs", axis=1)
    return b.model("unet", {"x": [1, 3, 32, 32]}, ["probs"])


def ssd_head() -> onnx.ModelProto:
    """SSD: per scale NHWC-transposed box and class maps reshaped to (N, -1, 4|6), concatenated
    over scales, class scores through a Softmax on the last axis."""
    b = Builder()
    features = [b.conv("s16", "x", 3, 16, stride=2)]
    features.append(b.conv("s8", features[0], 16, 16, stride=2))
    boxes, scores = [], []
    for k, f in enumerate(features):
        for kind, width, out in (("loc", 4, boxes), ("conf", 6, scores)):
            maps = b.conv(f"{kind}{k}", f, 16, 3 * width, act=None)
            nhwc = b.node("Transpose", [maps], f"{kind}{k}_nhwc", perm=[0, 2, 3, 1])
            shape = b.const(f"{kind}{k}_shape", np.array([1, -1, width]))
            out.append(b.node("Reshape", [nhwc, shape], f"{kind}{k}_flat"))
    b.node("Concat", boxes, "boxes", axis=1)
    b.node("Softmax", [b.node("Concat", scores, "logits", axis=1)], "scores", axis=-1)
    return b.model("ssd_head", {"x": [1, 3, 32, 32]}, ["boxes", "scores"])


def mlp_classifier() -> onnx.ModelProto:
    """GAP → Flatten → MatMul + Add with the erf form of GELU written out → MatMul + Add →
    Softmax (a Gemm spelled out, as transformer heads export)."""
    b = Builder()
    x = b.node("GlobalAveragePool", [b.conv("c1", "x", 3, 8, stride=2)], "gap")
    x = b.node("Flatten", [x], "flat")
    h = b.node(
        "Add", [b.node("MatMul", [x, b.weight("w1", 8, 32)], "mm1"), b.weight("b1", 32)], "h"
    )
    scaled = b.node("Div", [h, b.const("sqrt2", np.array(np.sqrt(2.0), np.float32))], "scaled")
    erf = b.node("Add", [b.node("Erf", [scaled], "erf"), b.const("one", np.float32(1))], "erf1")
    g = b.node("Mul", [b.node("Mul", [h, erf], "gelu2"), b.const("half", np.float32(0.5))], "g")
    y = b.node("Add", [b.node("MatMul", [g, b.weight("w2", 32, 5)], "mm2"), b.weight("b2", 5)], "y")
    b.node("Softmax", [y], "probs", axis=1)
    return b.model("mlp_classifier", {"x": [1, 3, 16, 16]}, ["probs"])


def prelu_classifier() -> onnx.ModelProto:
    """nn.PReLU(C): a slope per channel, exported as (C, 1, 1); then GAP → Flatten → Gemm."""
    b = Builder()
    x = b.conv("c1", "x", 3, 8, stride=2, act=None)
    slopes = b.const("slope", np.linspace(0.05, 0.4, 8, dtype=np.float32).reshape(8, 1, 1))
    x = b.conv("c2", b.node("PRelu", [x, slopes], "prelu"), 8, 8, stride=2)
    x = b.node("Flatten", [b.node("GlobalAveragePool", [x], "gap")], "flat")
    b.node("Gemm", [x, b.weight("fc_w", 10, 8), b.weight("fc_b", 10)], "logits", transB=1)
    return b.model("prelu_classifier", {"x": [1, 3, 32, 32]}, ["logits"])


def two_inputs() -> onnx.ModelProto:
    """Two inputs summed, reflect Pad, a strided Slice, Gather of one channel, Expand, and two
    outputs (one an intermediate map)."""
    b = Builder()
    x = b.node("Add", [b.conv("a", "x1", 3, 8), b.conv("b", "x2", 3, 8)], "sum")
    x = b.node(
        "Pad", [x, b.const("pads", np.array([0, 0, 0, 0, 0, 0, 1, 1]))], "pad", mode="reflect"
    )
    ends = [
        b.const(n, np.array([v])) for n, v in (("start", 0), ("end", 16), ("axis", 2), ("step", 2))
    ]
    maps = b.conv("c", b.node("Slice", [x, *ends], "strided"), 8, 8)
    picked = b.node("Gather", [maps, b.const("channel", np.array([2]))], "picked", axis=1)
    wide = b.node("Expand", [picked, b.const("shape", np.array([1, 4, 8, 17]))], "wide")
    b.node("Mul", [wide, wide], "squared")
    return b.model("two_inputs", {"x1": [1, 3, 16, 16], "x2": [1, 3, 16, 16]}, [maps, "squared"])


ARCHITECTURES: dict[str, Callable[[], onnx.ModelProto]] = {
    "crnn": crnn,
    "anchor_free_head": anchor_free_head,
    "mobile_block": mobile_block,
    "unet": unet,
    "ssd_head": ssd_head,
    "mlp_classifier": mlp_classifier,
    "prelu_classifier": prelu_classifier,
    "two_inputs": two_inputs,
}
