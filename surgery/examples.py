"""Small, deterministic example models built with onnx.helper.

They ship with the package so `surgery demo` works on a fresh machine with no downloads, and the
tests use the same builders. Each mirrors a pattern found in real exports: a plain CNN, a
YOLO-style detection head (rank-3/5 reshapes, Split, Concat, Sigmoid), a transformer block
(rank-3 MatMul/LayerNorm/Softmax/erf-GELU), and a CNN with TopK in the middle.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17


class _Builder:
    """Accumulates nodes and initializers with unique names and seeded weights."""

    def __init__(self, seed: int = 0) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.rng = np.random.default_rng(seed)
        self.count = 0

    def name(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}_{self.count}"

    def const(self, value: np.ndarray, prefix: str = "c") -> str:
        name = self.name(prefix)
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def op(self, op_type: str, inputs: list[str], n_out: int = 1, **attrs) -> list[str]:
        name = self.name(op_type.lower())
        outs = [f"{name}_out{k}" if n_out > 1 else f"{name}_out" for k in range(n_out)]
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=name, **attrs))
        return outs

    def conv(
        self, x: str, c_in: int, c_out: int, k: int = 3, stride: int = 1, act: str | None = "Relu"
    ) -> str:
        w = self.const(
            (self.rng.standard_normal((c_out, c_in, k, k)) * (1.0 / np.sqrt(c_in * k * k))).astype(
                np.float32
            ),
            "w",
        )
        b = self.const((self.rng.standard_normal(c_out) * 0.1).astype(np.float32), "b")
        pad = k // 2
        (y,) = self.op(
            "Conv", [x, w, b], kernel_shape=[k, k], strides=[stride, stride], pads=[pad] * 4
        )
        if act == "Relu":
            (y,) = self.op("Relu", [y])
        elif act == "SiLU":
            (s,) = self.op("Sigmoid", [y])
            (y,) = self.op("Mul", [y, s])
        return y

    def name_output(self, tensor: str, name: str) -> str:
        """Give a produced tensor its graph-output name."""
        for node in self.nodes:
            for k, out in enumerate(node.output):
                if out == tensor:
                    node.output[k] = name
        return name

    def model(self, inputs, outputs, name: str) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, name, inputs, outputs, self.inits)
        model = helper.make_model(
            graph,
            opset_imports=[helper.make_opsetid("", OPSET)],
            producer_name="model-surgery examples",
        )
        model.ir_version = 8
        return model


def _io(name: str, shape: list[int], dtype: int = TensorProto.FLOAT) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, shape)


def plain_cnn(seed: int = 0) -> onnx.ModelProto:
    """Conv-ReLU stack with pooling and a 1x1 conv head: one MLA segment on every target."""
    b = _Builder(seed)
    x = b.conv("input", 3, 8, stride=2)
    x = b.conv(x, 8, 16, stride=2)
    (x,) = b.op("MaxPool", [x], kernel_shape=[2, 2], strides=[2, 2])
    x = b.conv(x, 16, 16)
    (x,) = b.op("GlobalAveragePool", [x])
    b.name_output(b.conv(x, 16, 10, k=1, act=None), "logits")
    return b.model([_io("input", [1, 3, 32, 32])], [_io("logits", [1, 10, 1, 1])], "plain_cnn")


def yolo_head(seed: int = 0, size: int = 64, classes: int = 4) -> onnx.ModelProto:
    """A YOLOv8-style detector: SiLU backbone, two levels, rank-3 reshape/concat/split/sigmoid head."""
    b = _Builder(seed)
    x = b.conv("images", 3, 8, stride=2, act="SiLU")
    p3 = b.conv(x, 8, 16, stride=2, act="SiLU")
    p4 = b.conv(p3, 16, 16, stride=2, act="SiLU")
    (up,) = b.op(
        "Resize", [p4, "", b.const(np.array([1, 1, 2, 2], np.float32), "scales")], mode="nearest"
    )
    (p3,) = b.op("Concat", [p3, up], axis=1)
    p3 = b.conv(p3, 32, 16, act="SiLU")
    no = 4 + classes
    flat = []
    for level in (p3, p4):
        h = b.conv(level, 16, no, k=1, act=None)
        (r,) = b.op("Reshape", [h, b.const(np.array([1, no, -1], np.int64), "shape")])
        flat.append(r)
    (cat,) = b.op("Concat", flat, axis=2)
    box, cls = b.op(
        "Split", [cat, b.const(np.array([4, classes], np.int64), "split")], n_out=2, axis=1
    )
    (score,) = b.op("Sigmoid", [cls])
    (out,) = b.op("Concat", [box, score], axis=1)
    b.name_output(out, "output0")
    anchors = (size // 4) ** 2 + (size // 8) ** 2
    return b.model(
        [_io("images", [1, 3, size, size])], [_io("output0", [1, no, anchors])], "yolo_head"
    )


def yolov5_head(seed: int = 0, size: int = 64, classes: int = 3) -> onnx.ModelProto:
    """A YOLOv5-style anchor head: per level Reshape to [1,3,no,H,W] (rank 5) and a Transpose."""
    b = _Builder(seed)
    x = b.conv("images", 3, 8, stride=2)
    x = b.conv(x, 8, 16, stride=2)
    no = 5 + classes
    h = b.conv(x, 16, 3 * no, k=1, act=None)
    hw = size // 4
    (r,) = b.op("Reshape", [h, b.const(np.array([1, 3, no, hw, hw], np.int64), "shape")])
    (t,) = b.op("Transpose", [r], perm=[0, 1, 3, 4, 2])
    (s,) = b.op("Sigmoid", [t])
    (out,) = b.op("Reshape", [s, b.const(np.array([1, -1, no], np.int64), "shape")])
    b.name_output(out, "output0")
    return b.model(
        [_io("images", [1, 3, size, size])], [_io("output0", [1, 3 * hw * hw, no])], "yolov5_head"
    )


def transformer_block(
    seed: int = 0, tokens: int = 16, dim: int = 32, heads: int = 2
) -> onnx.ModelProto:
    """One pre-norm encoder block on [1, L, C]: LayerNorm, attention, erf-GELU MLP (rank 3)."""
    b = _Builder(seed)
    rng = b.rng

    def weight(i: int, o: int) -> str:
        return b.const((rng.standard_normal((i, o)) / np.sqrt(i)).astype(np.float32), "w")

    def bias(o: int) -> str:
        return b.const((rng.standard_normal(o) * 0.02).astype(np.float32), "b")

    ones, zeros = (
        b.const(np.ones(dim, np.float32), "ln_g"),
        b.const(np.zeros(dim, np.float32), "ln_b"),
    )
    (ln,) = b.op("LayerNormalization", ["tokens", ones, zeros], axis=-1, epsilon=1e-5)
    hd = dim // heads
    qkv = []
    for _ in range(3):
        (p,) = b.op("MatMul", [ln, weight(dim, dim)])
        (p,) = b.op("Add", [p, bias(dim)])
        (p,) = b.op("Reshape", [p, b.const(np.array([1, tokens, heads, hd], np.int64), "shape")])
        (p,) = b.op("Transpose", [p], perm=[0, 2, 1, 3])
        qkv.append(p)
    q, k, v = qkv
    (kt,) = b.op("Transpose", [k], perm=[0, 1, 3, 2])
    (att,) = b.op("MatMul", [q, kt])
    (att,) = b.op("Mul", [att, b.const(np.array(1 / np.sqrt(hd), np.float32), "scale")])
    (att,) = b.op("Softmax", [att], axis=-1)
    (ctx,) = b.op("MatMul", [att, v])
    (ctx,) = b.op("Transpose", [ctx], perm=[0, 2, 1, 3])
    (ctx,) = b.op("Reshape", [ctx, b.const(np.array([1, tokens, dim], np.int64), "shape")])
    (proj,) = b.op("MatMul", [ctx, weight(dim, dim)])
    (res,) = b.op("Add", ["tokens", proj])
    (ln2,) = b.op("LayerNormalization", [res, ones, zeros], axis=-1, epsilon=1e-5)
    (h,) = b.op("MatMul", [ln2, weight(dim, 2 * dim)])
    # erf-GELU as exported by PyTorch: x * 0.5 * (1 + erf(x / sqrt(2)))
    (d,) = b.op("Div", [h, b.const(np.array(np.sqrt(2), np.float32), "sqrt2")])
    (e,) = b.op("Erf", [d])
    (a,) = b.op("Add", [e, b.const(np.array(1, np.float32), "one")])
    (m,) = b.op("Mul", [h, a])
    (g,) = b.op("Mul", [m, b.const(np.array(0.5, np.float32), "half")])
    (o,) = b.op("MatMul", [g, weight(2 * dim, dim)])
    (y,) = b.op("Add", [res, o])
    b.name_output(y, "hidden")
    return b.model(
        [_io("tokens", [1, tokens, dim])], [_io("hidden", [1, tokens, dim])], "transformer_block"
    )


def cnn_with_topk(seed: int = 0) -> onnx.ModelProto:
    """Conv → TopK over channels (unsupported) → Conv: two MLA segments around the APU node."""
    b = _Builder(seed)
    x = b.conv("input", 3, 16)
    values, _ = b.op("TopK", [x, b.const(np.array([8], np.int64), "k")], n_out=2, axis=1)
    b.name_output(b.conv(values, 8, 4, act=None), "output")
    return b.model([_io("input", [1, 3, 16, 16])], [_io("output", [1, 4, 16, 16])], "cnn_with_topk")


EXAMPLES = {
    "plain_cnn": plain_cnn,
    "yolo_head": yolo_head,
    "yolov5_head": yolov5_head,
    "transformer_block": transformer_block,
    "cnn_with_topk": cnn_with_topk,
}
