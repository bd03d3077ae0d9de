"""Small models of architecture families the shared models do not cover (no tests here), each
written the way its exporter emits it (torch.onnx opset 11–17, paddle2onnx, ultralytics): an
OCR recogniser with an LSTM, an anchor-free detection head, a MobileNetV3 / EfficientNet block,
a UNet, an SSD head, an MLP classifier with erf-GELU, a per-channel PReLU classifier, a two-input
model with the less common data-movement ops; ViT/DeiT and DETR encoders with LayerNorm spelled
out (opset < 17), ConvNeXt with channels-first and channels-last LayerNorm, EfficientNet SE with
SiLU, a ShuffleNetV2 channel shuffle, YOLOv7 / YOLOX / YOLOv8-seg / YOLOv8-pose heads, an FCOS
head, a PaddleOCR SVTR recogniser and DBNet head, ResNet and DenseNet at opset 11 with unfused
BatchNorm, a GoogLeNet-style block with LRN and ArgMax, a BERT encoder with an attention mask, a
Swin block with shifted windows, YOLO11's C2PSA attention and a YOLOv10 NMS-free head.

A second round adds transformers beyond ViT/BERT (SegFormer efficient self-attention, MobileViT
unfold/fold, CLIP with QuickGELU, a T5 encoder with RMS norm and relative position bias, a
Whisper encoder with Conv1d stems, LeViT with rank-2 BatchNorm and attention biases, PARSeq-style
positional attention, DistilBERT's masked_fill), detection heads (CenterNet's max-pool NMS,
EfficientDet BiFPN weighted fusion, a GFL/DFL head, YOLOv9 ADown, unfused YOLOv6 RepVGG blocks,
RetinaFace, YOLOv5's Focus slices and Detect decode), classifiers (RegNet grouped convs, GhostNet,
SqueezeNet, Inception-v3 asymmetric convs, the TF-port EfficientNet with Pad-then-Conv) and OCR
(a CRNN whose BiLSTM is two LSTMs with step −1 Slices, an EAST head); and export styles: a
dynamic batch read through Shape/Gather/Concat, GroupNorm as InstanceNormalization between
Reshapes, Einsum attention, an FPN Resize to a Shape-derived size, an opset-9 SSD with Upsample
and attribute Clip/Slice, a multi-axis Focus Slice, an RMSNorm/SwiGLU block and BERT with
torch's sdpa export (−inf mask, NaN guard after the Softmax). Built with onnx.helper and seeded
weights, small enough to run the whole pipeline in a second or two.
"""

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

    def nodes_out(
        self, op: str, inputs: Sequence[str], outputs: Sequence[str], **attrs
    ) -> list[str]:
        """A node with several outputs (Split), named after its first."""
        node = helper.make_node(op, list(inputs), list(outputs), name=outputs[0], **attrs)
        self.nodes.append(node)
        return list(outputs)

    def slice(self, name: str, x: str, start: int, end: int, axis: int) -> str:
        """x[start:end] on one axis, with the constant inputs of opset ≥ 10."""
        bounds = (("from", start), ("to", end), ("on", axis))
        names = [self.const(f"{name}_{label}", np.array([v])) for label, v in bounds]
        return self.node("Slice", [x, *names], name)

    def linear(self, name: str, x: str, cin: int, cout: int) -> str:
        """nn.Linear on a rank ≥ 3 input as torch exports it: MatMul, then Add of the bias."""
        y = self.node("MatMul", [x, self.weight(f"{name}_w", cin, cout)], f"{name}_mm")
        return self.node("Add", [y, self.weight(f"{name}_b", cout)], f"{name}_out")

    def gelu(self, name: str, x: str) -> str:
        """nn.GELU(): x·(1 + erf(x/√2))·0.5."""
        root2 = self.const(f"{name}_sqrt2", np.array(np.sqrt(2.0), np.float32))
        erf = self.node("Erf", [self.node("Div", [x, root2], f"{name}_div")], f"{name}_erf")
        one = self.const(f"{name}_one", np.array(1.0, np.float32))
        gate = self.node("Mul", [x, self.node("Add", [erf, one], f"{name}_erf1")], f"{name}_xe")
        half = self.const(f"{name}_half", np.array(0.5, np.float32))
        return self.node("Mul", [gate, half], f"{name}_out")

    def layer_norm(self, name: str, x: str, c: int, eps: float = 1e-6) -> str:
        """nn.LayerNorm(c) as torch.onnx (opset ≤ 16) and paddle2onnx write it: ReduceMean, Sub,
        Pow 2, ReduceMean, Add ε, Sqrt, Div, Mul γ, Add β."""
        mean = self.node("ReduceMean", [x], f"{name}_mean", axes=[-1], keepdims=1)
        d = self.node("Sub", [x, mean], f"{name}_sub")
        two = self.const(f"{name}_two", np.array(2.0, np.float32))
        var = self.node(
            "ReduceMean",
            [self.node("Pow", [d, two], f"{name}_pow")],
            f"{name}_var",
            axes=[-1],
            keepdims=1,
        )
        eps_ = self.const(f"{name}_eps", np.array(eps, np.float32))
        std = self.node("Sqrt", [self.node("Add", [var, eps_], f"{name}_vareps")], f"{name}_std")
        gamma = self.const(f"{name}_g", (1 + self.rng.normal(0, 0.1, c)).astype(np.float32))
        scaled = self.node(
            "Mul", [self.node("Div", [d, std], f"{name}_norm"), gamma], f"{name}_g_mul"
        )
        return self.node("Add", [scaled, self.weight(f"{name}_b", c)], f"{name}_out")

    def batch_norm(self, name: str, x: str, c: int) -> str:
        """An inference BatchNormalization with seeded statistics (left unfused by the export)."""
        scale = self.const(f"{name}_scale", (1 + self.rng.normal(0, 0.1, c)).astype(np.float32))
        var = self.const(f"{name}_var", self.rng.uniform(0.5, 1.5, c).astype(np.float32))
        stats = [scale, self.weight(f"{name}_shift", c), self.weight(f"{name}_mean", c), var]
        return self.node("BatchNormalization", [x, *stats], f"{name}_bn", epsilon=1e-5)

    def model(
        self,
        name: str,
        inputs: dict[str, list[int]],
        outputs: Sequence[str],
        opset: int = 13,
        types: dict[str, int] | None = None,
    ) -> onnx.ModelProto:
        """The model; `types` gives the element type of inputs and outputs that are not float."""
        types = types or {}

        def info(n: str, shape: list[int] | None) -> onnx.ValueInfoProto:
            return helper.make_tensor_value_info(n, types.get(n, TensorProto.FLOAT), shape)

        graph = helper.make_graph(
            self.nodes,
            name,
            [info(n, s) for n, s in inputs.items()],
            [info(n, None) for n in outputs],
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


def _attention(b: Builder, name: str, x: str, tokens: int, c: int, heads: int) -> str:
    """timm Attention: qkv Linear, Reshape(1, L, 3, heads, hd), Transpose(2,0,3,1,4), Gather of
    q/k/v, q·kᵀ·scale, Softmax, ·v, Transpose back, Reshape(1, L, C), proj Linear."""
    hd = c // heads
    qkv = b.linear(f"{name}_qkv", x, c, 3 * c)
    split = b.const(f"{name}_qkv_shape", np.array([1, tokens, 3, heads, hd]))
    qkv = b.node(
        "Transpose",
        [b.node("Reshape", [qkv, split], f"{name}_qkv5")],
        f"{name}_qkvT",
        perm=[2, 0, 3, 1, 4],
    )
    q, k, v = (
        b.node("Gather", [qkv, b.const(f"{name}_i{j}", np.array(j))], f"{name}_{t}", axis=0)
        for j, t in enumerate("qkv")
    )
    scores = b.node(
        "MatMul", [q, b.node("Transpose", [k], f"{name}_kT", perm=[0, 1, 3, 2])], f"{name}_scores"
    )
    scale = b.const(f"{name}_scale", np.array(hd**-0.5, np.float32))
    probs = b.node(
        "Softmax", [b.node("Mul", [scores, scale], f"{name}_scaled")], f"{name}_p", axis=-1
    )
    ctx = b.node(
        "Transpose",
        [b.node("MatMul", [probs, v], f"{name}_ctx")],
        f"{name}_ctxT",
        perm=[0, 2, 1, 3],
    )
    merge = b.const(f"{name}_merge", np.array([1, tokens, c]))
    return b.linear(f"{name}_proj", b.node("Reshape", [ctx, merge], f"{name}_merged"), c, c)


def vit_opset13() -> onnx.ModelProto:
    """timm ViT/DeiT exported at opset 13: patch Conv, flatten(2).transpose(1,2), the class
    token expanded through the Equal/Where/Expand shape arithmetic, Concat, position Add,
    pre-norm blocks with LayerNorm spelled out, Gather of token 0, Gemm head."""
    b, c = Builder(), 32
    patch = [b.weight("patch_w", c, 3, 8, 8), b.weight("patch_b", c)]
    x = b.node("Conv", ["x", *patch], "patch", kernel_shape=[8, 8], strides=[8, 8])
    x = b.node("Reshape", [x, b.const("flat_shape", np.array([1, c, -1]))], "flat")
    x = b.node("Transpose", [x], "tokens", perm=[0, 2, 1])
    shape = b.const("cls_shape", np.array([1, -1, -1]))
    keep = b.node("Equal", [shape, b.const("minus_one", np.array(-1))], "cls_keep")
    one = helper.make_tensor("one", TensorProto.INT64, [1], [1])
    ones = b.node("ConstantOfShape", [b.const("rank", np.array([3]))], "cls_ones", value=one)
    full = b.node("Where", [keep, ones, shape], "cls_full")
    cls = b.node("Expand", [b.weight("cls_token", 1, 1, c), full], "cls_expand")
    x = b.node("Concat", [cls, x], "with_cls", axis=1)
    x = b.node("Add", [x, b.weight("pos_embed", 1, 17, c)], "pos")
    for k in range(2):
        h = _attention(b, f"b{k}_attn", b.layer_norm(f"b{k}_ln1", x, c), 17, c, heads=2)
        x = b.node("Add", [x, h], f"b{k}_res1")
        h = b.linear(f"b{k}_fc1", b.layer_norm(f"b{k}_ln2", x, c), c, 2 * c)
        x = b.node(
            "Add", [x, b.linear(f"b{k}_fc2", b.gelu(f"b{k}_gelu", h), 2 * c, c)], f"b{k}_res2"
        )
    x = b.node(
        "Gather", [b.layer_norm("norm", x, c), b.const("token0", np.array(0))], "cls_out", axis=1
    )
    b.node("Gemm", [x, b.weight("head_w", 10, c), b.weight("head_b", 10)], "logits", transB=1)
    return b.model("vit_opset13", {"x": [1, 3, 32, 32]}, ["logits"], opset=13)


def detr_encoder() -> onnx.ModelProto:
    """DETR: backbone, 1×1 input_proj, flatten(2).permute(2,0,1) to sequence-first (HW, N, C),
    a post-norm encoder layer as nn.MultiheadAttention exports it (q = k = src + pos, v = src,
    heads split by Reshape(HW, heads, hd) + Transpose, Gemm out-projection on (HW·N, C))."""
    b, c, heads, hw = Builder(), 32, 4, 64
    hd = c // heads
    x = b.conv("bb2", b.conv("bb1", "x", 3, 16, stride=2), 16, 32, stride=2)
    x = b.conv("proj", x, 32, c, kernel=1, act=None)
    x = b.node("Reshape", [x, b.const("flat_shape", np.array([1, c, -1]))], "flat")
    src = b.node("Transpose", [x], "src", perm=[2, 0, 1])
    qk = b.node("Add", [src, b.weight("pos", hw, 1, c)], "qk_in")

    def heads_of(t: str, name: str) -> str:
        y = b.linear(name, t, c, c)
        y = b.node(
            "Reshape", [y, b.const(f"{name}_shape", np.array([hw, heads, hd]))], f"{name}_split"
        )
        return b.node("Transpose", [y], f"{name}_heads", perm=[1, 0, 2])

    scale = b.const("scaling", np.array(hd**-0.5, np.float32))
    q = b.node("Mul", [heads_of(qk, "q"), scale], "q_scaled")
    k = b.node("Transpose", [heads_of(qk, "k")], "kT", perm=[0, 2, 1])
    probs = b.node("Softmax", [b.node("MatMul", [q, k], "scores")], "probs", axis=-1)
    o = b.node(
        "Transpose", [b.node("MatMul", [probs, heads_of(src, "v")], "ctx")], "ctxT", perm=[1, 0, 2]
    )
    o = b.node("Reshape", [o, b.const("merge", np.array([hw, c]))], "merged")
    o = b.node("Gemm", [o, b.weight("out_w", c, c), b.weight("out_b", c)], "out_proj", transB=1)
    o = b.node("Reshape", [o, b.const("unmerge", np.array([hw, 1, c]))], "attn_out")
    x = b.layer_norm("norm1", b.node("Add", [src, o], "res1"), c, eps=1e-5)
    h = b.linear("ffn2", b.node("Relu", [b.linear("ffn1", x, c, 64)], "ffn_act"), 64, c)
    x = b.layer_norm("norm2", b.node("Add", [x, h], "res2"), c, eps=1e-5)
    b.node("Transpose", [x], "memory", perm=[1, 2, 0])
    return b.model("detr_encoder", {"x": [1, 3, 32, 32]}, ["memory"], opset=13)


def convnext() -> onnx.ModelProto:
    """ConvNeXt (official repo, opset 17): the channels-first LayerNorm after the stem written
    by hand (x.mean(1), (x−u).pow(2).mean(1), (x−u)/sqrt(s+ε), γ[:,None,None]·x + β), then a
    block: depthwise 7×7, Transpose to NHWC, LayerNormalization, Linear, erf-GELU, Linear,
    γ scale, Transpose back, residual; mean over H,W, LayerNormalization, Gemm head."""
    b, c = Builder(), 16
    stem = [b.weight("stem_w", c, 3, 4, 4), b.weight("stem_b", c)]
    x = b.node("Conv", ["x", *stem], "stem", kernel_shape=[4, 4], strides=[4, 4])
    u = b.node("ReduceMean", [x], "stem_ln_u", axes=[1], keepdims=1)
    two = b.const("stem_ln_two", np.array(2.0, np.float32))
    sq = b.node("Pow", [b.node("Sub", [x, u], "stem_ln_d1"), two], "stem_ln_sq")
    var = b.node("ReduceMean", [sq], "stem_ln_s", axes=[1], keepdims=1)
    eps = b.const("stem_ln_eps", np.array(1e-6, np.float32))
    std = b.node("Sqrt", [b.node("Add", [var, eps], "stem_ln_se")], "stem_ln_std")
    x = b.node("Div", [b.node("Sub", [x, u], "stem_ln_d2"), std], "stem_ln_n")
    gamma = b.const("stem_ln_g", (1 + b.rng.normal(0, 0.1, (c, 1, 1))).astype(np.float32))
    x = b.node(
        "Add", [b.node("Mul", [gamma, x], "stem_ln_gx"), b.weight("stem_ln_b", c, 1, 1)], "stem_ln"
    )
    h = b.node(
        "Transpose", [b.conv("dw", x, c, c, kernel=7, act=None, group=c)], "nhwc", perm=[0, 2, 3, 1]
    )
    ln = [b.const("ln_g", np.ones(c, np.float32)), b.weight("ln_b", c)]
    h = b.node("LayerNormalization", [h, *ln], "ln", axis=-1, epsilon=1e-6)
    h = b.linear("pw2", b.gelu("gelu", b.linear("pw1", h, c, 4 * c)), 4 * c, c)
    h = b.node("Mul", [h, b.const("gamma", np.full(c, 0.5, np.float32))], "gamma_mul")
    x = b.node("Add", [x, b.node("Transpose", [h], "nchw", perm=[0, 3, 1, 2])], "res")
    x = b.node("ReduceMean", [x], "gap", axes=[-2, -1], keepdims=0)
    head_ln = [b.const("head_ln_g", np.ones(c, np.float32)), b.weight("head_ln_b", c)]
    x = b.node("LayerNormalization", [x, *head_ln], "head_ln", axis=-1, epsilon=1e-6)
    b.node("Gemm", [x, b.weight("fc_w", 10, c), b.weight("fc_b", 10)], "logits", transB=1)
    return b.model("convnext", {"x": [1, 3, 32, 32]}, ["logits"], opset=17)


def efficientnet_se() -> onnx.ModelProto:
    """EfficientNet / YOLOv5: SiLU as x·Sigmoid(x), an MBConv block whose squeeze-excite pools
    with ReduceMean(keepdims=1), residual Add, GAP → Flatten → Gemm."""
    b = Builder()
    x = b.conv("stem", "x", 3, 16, stride=2, act="silu")
    h = b.conv(
        "dw", b.conv("expand", x, 16, 32, kernel=1, act="silu"), 32, 32, act="silu", group=32
    )
    s = b.node("ReduceMean", [h], "se_mean", axes=[2, 3], keepdims=1)
    s = b.conv(
        "se_expand", b.conv("se_reduce", s, 32, 8, kernel=1, act="silu"), 8, 32, kernel=1, act=None
    )
    h = b.node("Mul", [h, b.node("Sigmoid", [s], "se_gate")], "se_out")
    x = b.node("Add", [x, b.conv("project", h, 32, 16, kernel=1, act=None)], "res")
    x = b.conv("head", x, 16, 32, kernel=1, act="silu")
    x = b.node("Flatten", [b.node("GlobalAveragePool", [x], "gap")], "flat")
    b.node("Gemm", [x, b.weight("fc_w", 10, 32), b.weight("fc_b", 10)], "logits", transB=1)
    return b.model("efficientnet_se", {"x": [1, 3, 32, 32]}, ["logits"])


def shufflenet_v2() -> onnx.ModelProto:
    """ShuffleNetV2 units: Split in halves, a branch of pointwise/depthwise convs, Concat, and
    the channel shuffle Reshape(1, 2, C/2, H, W) → Transpose(0,2,1,3,4) → Reshape(1, C, H, W)."""
    b, c = Builder(), 16
    x = b.node(
        "MaxPool",
        [b.conv("stem", "x", 3, c, stride=2)],
        "pool",
        kernel_shape=[3, 3],
        strides=[2, 2],
        pads=[1, 1, 1, 1],
    )
    for k in range(2):
        halves = b.const(f"halves{k}", np.array([c // 2, c // 2]))
        a, br = b.nodes_out("Split", [x, halves], [f"split{k}_a", f"split{k}_b"], axis=1)
        br = b.conv(
            f"u{k}_dw",
            b.conv(f"u{k}_pw1", br, c // 2, c // 2, kernel=1),
            c // 2,
            c // 2,
            act=None,
            group=c // 2,
        )
        x = b.node(
            "Concat", [a, b.conv(f"u{k}_pw2", br, c // 2, c // 2, kernel=1)], f"cat{k}", axis=1
        )
        groups = b.const(f"shuffle{k}_groups", np.array([1, 2, c // 2, 8, 8]))
        x = b.node(
            "Transpose",
            [b.node("Reshape", [x, groups], f"shuffle{k}_5d")],
            f"shuffle{k}_t",
            perm=[0, 2, 1, 3, 4],
        )
        x = b.node("Reshape", [x, b.const(f"shuffle{k}_4d", np.array([1, c, 8, 8]))], f"shuffle{k}")
    x = b.node("ReduceMean", [x], "gap", axes=[2, 3], keepdims=0)
    b.node("Gemm", [x, b.weight("fc_w", 10, c), b.weight("fc_b", 10)], "logits", transB=1)
    return b.model("shufflenet_v2", {"x": [1, 3, 32, 32]}, ["logits"])


def yolov7_head() -> onnx.ModelProto:
    """YOLOv7 export (opset 12): per scale Conv → Reshape(1,3,85,h,w) → Transpose(0,1,3,4,2) →
    Sigmoid; xy = (2·y[...,0:2] − 0.5 + grid)·stride and wh = (2·y[...,2:4])²·anchor_grid on
    last-axis Slices; Concat, Reshape(1,−1,85), Concat over scales."""
    b, no = Builder(), 85
    x = b.conv("stem", "images", 3, 16, stride=2, act="silu")
    flat = []
    for k, (stride, hw) in enumerate(((4, 16), (8, 8))):
        x = b.conv(f"down{k}", x, 16, 16, stride=2, act="silu")
        p = b.conv(f"det{k}", x, 16, 3 * no, kernel=1, act=None)
        p = b.node(
            "Reshape", [p, b.const(f"anchors5d{k}", np.array([1, 3, no, hw, hw]))], f"p5_{k}"
        )
        y = b.node("Sigmoid", [b.node("Transpose", [p], f"pt{k}", perm=[0, 1, 3, 4, 2])], f"sig{k}")
        gy, gx = np.meshgrid(np.arange(hw), np.arange(hw), indexing="ij")
        grid = np.broadcast_to(np.stack([gx, gy], -1) - 0.5, (1, 3, hw, hw, 2))
        anchors = np.broadcast_to(b.rng.uniform(5, 50, (1, 3, 1, 1, 2)), (1, 3, hw, hw, 2))
        two = b.const(f"two{k}", np.array(2.0, np.float32))
        xy = b.node("Mul", [b.slice(f"xy{k}", y, 0, 2, 4), two], f"xy2_{k}")
        xy = b.node("Add", [xy, b.const(f"grid{k}", grid.astype(np.float32))], f"xyg{k}")
        xy = b.node("Mul", [xy, b.const(f"stride{k}", np.array(stride, np.float32))], f"xys{k}")
        wh = b.node("Mul", [b.slice(f"wh{k}", y, 2, 4, 4), two], f"wh2_{k}")
        wh = b.node("Pow", [wh, two], f"whp{k}")
        wh = b.node("Mul", [wh, b.const(f"anchor{k}", anchors.astype(np.float32))], f"wha{k}")
        cat = b.node("Concat", [xy, wh, b.slice(f"rest{k}", y, 4, no, 4)], f"cat{k}", axis=-1)
        flat.append(
            b.node("Reshape", [cat, b.const(f"rows{k}", np.array([1, -1, no]))], f"flat{k}")
        )
    b.node("Concat", flat, "output", axis=1)
    return b.model("yolov7_head", {"images": [1, 3, 64, 64]}, ["output"], opset=12)


def yolox_decode() -> onnx.ModelProto:
    """YOLOX with decode_in_inference (opset 11): per level Concat(reg, sigmoid(obj),
    sigmoid(cls)) → Reshape(1, 85, −1); Concat, Transpose to (1, N, 85); xy = (xy + grid)·stride
    and wh = exp(wh)·stride on last-axis Slices, Concat back."""
    b, no = Builder(), 13
    x = b.conv("stem", "images", 3, 16, stride=2, act="silu")
    flat, grids, strides = [], [], []
    for k in range(2):
        x = b.conv(f"down{k}", x, 16, 16, stride=2, act="silu")
        hw = 16 // 2**k
        reg = b.conv(f"reg{k}", b.conv(f"regc{k}", x, 16, 16, act="silu"), 16, 4, 1, act=None)
        obj = b.node("Sigmoid", [b.conv(f"obj{k}", x, 16, 1, 1, act=None)], f"objs{k}")
        cls = b.conv(f"cls{k}", b.conv(f"clsc{k}", x, 16, 16, act="silu"), 16, no - 5, 1, act=None)
        cat = b.node("Concat", [reg, obj, b.node("Sigmoid", [cls], f"clss{k}")], f"cat{k}", axis=1)
        flat.append(
            b.node("Reshape", [cat, b.const(f"rows{k}", np.array([1, no, -1]))], f"flat{k}")
        )
        gy, gx = np.meshgrid(np.arange(hw), np.arange(hw), indexing="ij")
        grids.append(np.stack([gx, gy], -1).reshape(-1, 2))
        strides.append(np.full((hw * hw, 1), 4.0 * 2**k))
    y = b.node("Transpose", [b.node("Concat", flat, "joined", axis=2)], "outputs", perm=[0, 2, 1])
    grid = b.const("grid", np.concatenate(grids)[None].astype(np.float32))
    stride = b.const("stride", np.concatenate(strides)[None].astype(np.float32))
    xy = b.node("Mul", [b.node("Add", [b.slice("xy", y, 0, 2, 2), grid], "xy_g"), stride], "xy_s")
    wh = b.node("Mul", [b.node("Exp", [b.slice("wh", y, 2, 4, 2)], "wh_e"), stride], "wh_s")
    b.node("Concat", [xy, wh, b.slice("rest", y, 4, no, 2)], "detections", axis=2)
    return b.model("yolox_decode", {"images": [1, 3, 64, 64]}, ["detections"], opset=11)


def _yolov8_head(b: Builder, nc: int, extra: int, extra_name: str) -> tuple[str, list[str], tuple]:
    """ultralytics Detect over two levels: Concat(cv2 box, cv3 cls) → Reshape(1, 64+nc, −1),
    Concat, Split, DFL (Reshape(1,4,16,N) → Transpose → Softmax → Conv 1×1 with arange weights),
    dist2bbox with anchor points, ·strides, Sigmoid scores; plus `extra` channels per level
    (mask coefficients or keypoints) flattened to (1, extra, HW). Returns the detections, the
    flattened extras and (anchors, strides, N)."""
    x = b.conv("stem", "images", 3, 16, stride=2, act="silu")
    levels, extras, anchors, strides = [], [], [], []
    for k in range(2):
        x = b.conv(f"down{k}", x, 16, 16, stride=2, act="silu")
        hw = 16 // 2**k
        box = b.conv(f"cv2_{k}", x, 16, 64, kernel=1, act=None)
        cat = b.node(
            "Concat", [box, b.conv(f"cv3_{k}", x, 16, nc, kernel=1, act=None)], f"lv{k}", axis=1
        )
        rows = b.const(f"lv{k}_rows", np.array([1, 64 + nc, -1]))
        levels.append(b.node("Reshape", [cat, rows], f"lv{k}_flat"))
        e = b.conv(f"cv4_{k}", x, 16, extra, kernel=1, act=None)
        rows = b.const(f"{extra_name}{k}_rows", np.array([1, extra, -1]))
        extras.append(b.node("Reshape", [e, rows], f"{extra_name}{k}_flat"))
        sy, sx = np.meshgrid(np.arange(hw) + 0.5, np.arange(hw) + 0.5, indexing="ij")
        anchors.append(np.stack([sx.ravel(), sy.ravel()]))
        strides.append(np.full(hw * hw, 4.0 * 2**k))
    n = sum(a.shape[1] for a in anchors)
    anchor_points = np.concatenate(anchors, 1)[None].astype(np.float32)
    stride_row = np.concatenate(strides)[None, None].astype(np.float32)
    x = b.node("Concat", levels, "cat_levels", axis=2)
    box, cls = b.nodes_out(
        "Split", [x, b.const("box_cls", np.array([64, nc]))], ["box", "cls"], axis=1
    )
    d = b.node("Reshape", [box, b.const("dfl_shape", np.array([1, 4, 16, n]))], "dfl_r")
    d = b.node("Softmax", [b.node("Transpose", [d], "dfl_t", perm=[0, 2, 1, 3])], "dfl_sm", axis=1)
    proj = b.const("dfl_w", np.arange(16, dtype=np.float32).reshape(1, 16, 1, 1))
    d = b.node(
        "Reshape",
        [b.node("Conv", [d, proj], "dfl_conv"), b.const("dfl_rows", np.array([1, 4, n]))],
        "dfl_dist",
    )
    lt, rb = b.nodes_out("Split", [d, b.const("lt_rb", np.array([2, 2]))], ["lt", "rb"], axis=1)
    points = b.const("anchor_points", anchor_points)
    x1y1, x2y2 = b.node("Sub", [points, lt], "x1y1"), b.node("Add", [points, rb], "x2y2")
    half = b.const("two", np.array(2.0, np.float32))
    c_xy = b.node("Div", [b.node("Add", [x1y1, x2y2], "xy_sum"), half], "c_xy")
    boxes = b.node("Concat", [c_xy, b.node("Sub", [x2y2, x1y1], "wh")], "dbox_raw", axis=1)
    boxes = b.node("Mul", [boxes, b.const("strides", stride_row)], "dbox")
    detections = b.node("Concat", [boxes, b.node("Sigmoid", [cls], "scores")], "det", axis=1)
    return detections, extras, (anchor_points, stride_row, n)


def yolov8_seg() -> onnx.ModelProto:
    """ultralytics Segment export: the Detect head plus 32 mask coefficients per anchor
    (Concat on axis 2, then on the channels) and the proto branch (Conv, ConvTranspose 2×,
    Conv, Conv) as a second output."""
    b = Builder()
    det, coefficients, _ = _yolov8_head(b, nc=4, extra=32, extra_name="mc")
    mc = b.node("Concat", coefficients, "mask_coef", axis=2)
    b.node("Concat", [det, mc], "output0", axis=1)
    p = b.conv("proto1", "stem_silu", 16, 16, act="silu")
    up = [b.weight("proto_up_w", 16, 16, 2, 2), b.weight("proto_up_b", 16)]
    p = b.node("ConvTranspose", [p, *up], "proto_up", kernel_shape=[2, 2], strides=[2, 2])
    b.conv("proto3", b.conv("proto2", p, 16, 16, act="silu"), 16, 32, kernel=1, act="silu")
    return b.model("yolov8_seg", {"images": [1, 3, 64, 64]}, ["output0", "proto3_silu"], opset=17)


def yolov8_pose() -> onnx.ModelProto:
    """ultralytics Pose export: keypoints viewed as (1, 17, 3, N); xy = (2·k[:, :, :2] +
    anchors − 0.5)·strides, visibility Sigmoid, Concat on axis 2, view (1, 51, N), Concat with
    the boxes and scores."""
    b, nk = Builder(), 17
    det, keypoints, (anchor_points, stride_row, n) = _yolov8_head(b, 1, nk * 3, "kpt")
    k = b.node("Concat", keypoints, "kpt_cat", axis=-1)
    k = b.node("Reshape", [k, b.const("kpt_view", np.array([1, nk, 3, n]))], "kpt_4d")
    xy = b.node(
        "Mul", [b.slice("kxy", k, 0, 2, 2), b.const("k2", np.array(2.0, np.float32))], "kxy2"
    )
    xy = b.node("Add", [xy, b.const("kanchors", anchor_points - 0.5)], "kxya")
    xy = b.node("Mul", [xy, b.const("kstrides", stride_row)], "kxys")
    vis = b.node("Sigmoid", [b.slice("kvis", k, 2, 3, 2)], "kvis_sig")
    k = b.node("Concat", [xy, vis], "kpts_4d", axis=2)
    k = b.node("Reshape", [k, b.const("kpt_rows", np.array([1, nk * 3, n]))], "kpts")
    b.node("Concat", [det, k], "output0", axis=1)
    return b.model("yolov8_pose", {"images": [1, 3, 64, 64]}, ["output0"], opset=17)


def fcos_head() -> onnx.ModelProto:
    """FCOS / RetinaNet: one tower shared by two levels (the same weights twice), class Sigmoid,
    exp(scale·reg) boxes, centerness Sigmoid; each map to NHWC and Reshape(1, −1, K), Concat
    over levels; scores = sqrt(cls·centerness)."""
    b, nc = Builder(), 6
    p3 = b.conv("p3", b.conv("stem", "x", 3, 16, stride=2), 16, 16, stride=2)
    levels = [p3, b.conv("p4", p3, 16, 16, stride=2)]
    shared = {
        name: [b.weight(f"{name}_w", cout, 16, 3, 3), b.weight(f"{name}_b", cout)]
        for name, cout in (("tower", 16), ("cls", nc), ("reg", 4), ("ctr", 1))
    }

    def conv(name: str, x: str, k: int) -> str:
        return b.node("Conv", [x, *shared[name]], f"{name}{k}", kernel_shape=[3, 3], pads=[1] * 4)

    def rows(y: str, width: int, name: str) -> str:
        y = b.node("Transpose", [y], f"{name}_nhwc", perm=[0, 2, 3, 1])
        return b.node(
            "Reshape", [y, b.const(f"{name}_rows", np.array([1, -1, width]))], f"{name}_flat"
        )

    cls, reg, ctr = [], [], []
    for k, f in enumerate(levels):
        t = b.node("Relu", [conv("tower", f, k)], f"tower{k}_relu")
        cls.append(rows(b.node("Sigmoid", [conv("cls", t, k)], f"cls{k}_sig"), nc, f"cls{k}"))
        scale = b.const(f"scale{k}", np.array(0.5 + k, np.float32))
        r = b.node("Exp", [b.node("Mul", [conv("reg", t, k), scale], f"reg{k}_s")], f"reg{k}_exp")
        reg.append(rows(r, 4, f"reg{k}"))
        ctr.append(rows(b.node("Sigmoid", [conv("ctr", t, k)], f"ctr{k}_sig"), 1, f"ctr{k}"))
    score = b.node(
        "Mul",
        [b.node("Concat", cls, "cls_all", axis=1), b.node("Concat", ctr, "ctr_all", axis=1)],
        "cls_ctr",
    )
    b.node("Sqrt", [score], "scores")
    b.node("Concat", reg, "boxes", axis=1)
    return b.model("fcos_head", {"x": [1, 3, 32, 32]}, ["scores", "boxes"])


def svtr_recognizer() -> onnx.ModelProto:
    """PaddleOCR SVTR (paddle2onnx, opset 11): Conv-BN stem with HardSwish spelled out as
    x·HardSigmoid(x), Reshape with 0 (copy a dim) + Transpose to (N, H·W, C), a global mixing
    block with LayerNorm spelled out and multi-head attention, back to a map, MaxPool over the
    height, Squeeze, Transpose to (N, W, C), CTC Linear and Softmax over the classes."""
    b, c, heads = Builder(), 32, 2
    hd = c // heads
    w1 = b.weight("c1_w", 16, 3, 3, 3)
    x = b.node("Conv", ["x", w1], "c1", kernel_shape=[3, 3], strides=[2, 2], pads=[1] * 4)
    x = b.batch_norm("c1", x, 16)
    x = b.node("Mul", [x, b.node("HardSigmoid", [x], "c1_gate", alpha=1 / 6, beta=0.5)], "c1_hs")
    w2 = b.weight("c2_w", c, 16, 3, 3)
    x = b.node("Conv", [x, w2], "c2", kernel_shape=[3, 3], strides=[2, 2], pads=[1] * 4)
    x = b.node("Relu", [b.batch_norm("c2", x, c)], "c2_relu")
    x = b.node("Reshape", [x, b.const("seq_shape", np.array([0, 0, -1]))], "seq_flat")
    x = b.node("Transpose", [x], "seq", perm=[0, 2, 1])
    h = b.layer_norm("mix_ln1", x, c, eps=1e-5)
    qkv = b.linear("mix_qkv", h, c, 3 * c)
    qkv = b.node("Reshape", [qkv, b.const("qkv_shape", np.array([0, -1, 3, heads, hd]))], "qkv5")
    qkv = b.node("Transpose", [qkv], "qkvT", perm=[2, 0, 3, 1, 4])
    q, k, v = (
        b.node("Gather", [qkv, b.const(f"pick{j}", np.array(j))], f"attn_{t}", axis=0)
        for j, t in enumerate("qkv")
    )
    q = b.node("Mul", [q, b.const("scale", np.array(hd**-0.5, np.float32))], "q_scaled")
    s = b.node("MatMul", [q, b.node("Transpose", [k], "kT", perm=[0, 1, 3, 2])], "scores")
    p = b.node("Softmax", [s], "attn_probs", axis=-1)
    o = b.node("Transpose", [b.node("MatMul", [p, v], "ctx")], "ctxT", perm=[0, 2, 1, 3])
    o = b.node("Reshape", [o, b.const("merge", np.array([0, -1, c]))], "merged")
    x = b.node("Add", [x, b.linear("mix_proj", o, c, c)], "mix_res")
    h = b.linear("mlp1", b.layer_norm("mix_ln2", x, c, eps=1e-5), c, 2 * c)
    x = b.node("Add", [x, b.linear("mlp2", b.gelu("mlp_gelu", h), 2 * c, c)], "mlp_res")
    x = b.node("Transpose", [x], "back", perm=[0, 2, 1])
    x = b.node("Reshape", [x, b.const("map_shape", np.array([0, c, 8, 32]))], "map")
    x = b.node("MaxPool", [x], "hpool", kernel_shape=[8, 1], strides=[8, 1])
    x = b.node(
        "Transpose", [b.node("Squeeze", [x], "squeeze", axes=[2])], "seq_out", perm=[0, 2, 1]
    )
    b.node("Softmax", [b.linear("ctc", x, c, 40)], "probs", axis=2)
    return b.model("svtr_recognizer", {"x": [1, 3, 32, 128]}, ["probs"], opset=11)


def dbnet_head() -> onnx.ModelProto:
    """DBNet head (PaddleOCR, paddle2onnx opset 11): per branch Conv-BN-ReLU and two
    ConvTranspose 2× stages, Sigmoid probability and threshold maps, the differentiable
    binarisation 1/(1 + exp(−k(P − T))), and the three maps concatenated."""
    b = Builder()
    x = b.conv("bb2", b.conv("bb1", "x", 3, 16, stride=2), 16, 16, stride=2)

    def branch(name: str) -> str:
        w = b.weight(f"{name}_w", 4, 16, 3, 3)
        y = b.node("Conv", [x, w], f"{name}_conv", kernel_shape=[3, 3], pads=[1] * 4)
        y = b.node("Relu", [b.batch_norm(f"{name}_conv", y, 4)], f"{name}_relu")
        for k, cout in ((1, 4), (2, 1)):
            up = [b.weight(f"{name}_up{k}_w", 4, cout, 2, 2), b.weight(f"{name}_up{k}_b", cout)]
            y = b.node(
                "ConvTranspose", [y, *up], f"{name}_up{k}", kernel_shape=[2, 2], strides=[2, 2]
            )
            if k == 1:
                y = b.node("Relu", [b.batch_norm(f"{name}_up{k}", y, 4)], f"{name}_up{k}_relu")
        return b.node("Sigmoid", [y], f"{name}_map")

    prob, thresh = branch("binarize"), branch("thresh")
    kd = b.node(
        "Mul",
        [b.node("Sub", [prob, thresh], "diff"), b.const("minus_k", np.array(-50.0, np.float32))],
        "kd",
    )
    den = b.node(
        "Add", [b.const("one", np.array(1.0, np.float32)), b.node("Exp", [kd], "exp")], "den"
    )
    binary = b.node("Div", [b.const("numerator", np.array(1.0, np.float32)), den], "binary")
    b.node("Concat", [prob, thresh, binary], "maps", axis=1)
    return b.model("dbnet_head", {"x": [1, 3, 32, 32]}, ["maps"], opset=11)


def resnet_opset11() -> onnx.ModelProto:
    """torchvision ResNet exported at opset 11 without BatchNorm folding (training=TRAINING
    exports, or paddle2onnx): Conv-BN-Relu stem, MaxPool with padding, basic blocks with
    residual Add, GAP → Flatten → Gemm(transB)."""
    b = Builder()
    w = b.weight("stem_w", 16, 3, 7, 7)
    x = b.node("Conv", ["x", w], "stem", kernel_shape=[7, 7], strides=[2, 2], pads=[3] * 4)
    x = b.node("Relu", [b.batch_norm("stem", x, 16)], "stem_relu")
    x = b.node("MaxPool", [x], "pool", kernel_shape=[3, 3], strides=[2, 2], pads=[1] * 4)
    for k in range(2):
        h = x
        for j in (1, 2):
            w = b.weight(f"b{k}_{j}_w", 16, 16, 3, 3)
            h = b.node("Conv", [h, w], f"b{k}_{j}", kernel_shape=[3, 3], pads=[1] * 4)
            h = b.batch_norm(f"b{k}_{j}", h, 16)
            if j == 1:
                h = b.node("Relu", [h], f"b{k}_{j}_relu")
        x = b.node("Relu", [b.node("Add", [h, x], f"b{k}_add")], f"b{k}_out")
    x = b.node("Flatten", [b.node("GlobalAveragePool", [x], "gap")], "flat", axis=1)
    b.node("Gemm", [x, b.weight("fc_w", 10, 16), b.weight("fc_b", 10)], "logits", transB=1)
    return b.model("resnet_opset11", {"x": [1, 3, 32, 32]}, ["logits"], opset=11)


def densenet() -> onnx.ModelProto:
    """DenseNet (opset 11): pre-activation BN-Relu-Conv layers on a growing Concat (the BN
    reads a Concat, so it cannot fold into a conv), a BN-Relu-Conv-AveragePool transition,
    final BN-Relu, GAP → Flatten → Gemm → Softmax."""
    b, growth, c = Builder(), 8, 16
    w = b.weight("stem_w", c, 3, 3, 3)
    x = b.node("Conv", ["x", w], "stem", kernel_shape=[3, 3], strides=[2, 2], pads=[1] * 4)
    for k in range(3):
        h = b.node("Relu", [b.batch_norm(f"l{k}_n1", x, c)], f"l{k}_r1")
        w = b.weight(f"l{k}_c1_w", 2 * growth, c, 1, 1)
        h = b.node("Conv", [h, w], f"l{k}_c1", kernel_shape=[1, 1])
        h = b.node("Relu", [b.batch_norm(f"l{k}_n2", h, 2 * growth)], f"l{k}_r2")
        w = b.weight(f"l{k}_c2_w", growth, 2 * growth, 3, 3)
        h = b.node("Conv", [h, w], f"l{k}_c2", kernel_shape=[3, 3], pads=[1] * 4)
        x, c = b.node("Concat", [x, h], f"l{k}_cat", axis=1), c + growth
    x = b.node("Relu", [b.batch_norm("t_n", x, c)], "t_r")
    x = b.node("Conv", [x, b.weight("t_w", 16, c, 1, 1)], "t_c", kernel_shape=[1, 1])
    x = b.node("AveragePool", [x], "t_pool", kernel_shape=[2, 2], strides=[2, 2])
    x = b.node("Relu", [b.batch_norm("final", x, 16)], "final_r")
    x = b.node("Flatten", [b.node("GlobalAveragePool", [x], "gap")], "flat")
    x = b.node("Gemm", [x, b.weight("fc_w", 10, 16), b.weight("fc_b", 10)], "logits", transB=1)
    b.node("Softmax", [x], "probs", axis=1)
    return b.model("densenet", {"x": [1, 3, 32, 32]}, ["probs"], opset=11)


def googlenet() -> onnx.ModelProto:
    """GoogLeNet / AlexNet-ish: MaxPool with ceil_mode=1 (odd sizes, so the ceiling matters),
    LRN, an inception block with a 3×3 MaxPool branch, Concat, Gemm logits and an int64 ArgMax
    label as a second output."""
    b = Builder()
    x = b.conv("stem", "x", 3, 16, kernel=7, stride=2)
    x = b.node("MaxPool", [x], "pool1", kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1)
    x = b.node("LRN", [x], "lrn", size=5, alpha=1e-4, beta=0.75, bias=1.0)
    b1 = b.conv("i_1x1", x, 16, 8, kernel=1)
    b2 = b.conv("i_3x3", b.conv("i_3x3r", x, 16, 8, kernel=1), 8, 8)
    p = b.node("MaxPool", [x], "i_pool", kernel_shape=[3, 3], pads=[1] * 4, ceil_mode=1)
    x = b.node("Concat", [b1, b2, b.conv("i_pp", p, 16, 8, kernel=1)], "inception", axis=1)
    x = b.node("MaxPool", [x], "pool2", kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1)
    x = b.node("Flatten", [b.node("GlobalAveragePool", [x], "gap")], "flat")
    x = b.node("Gemm", [x, b.weight("fc_w", 10, 24), b.weight("fc_b", 10)], "logits", transB=1)
    b.node("ArgMax", [x], "label", axis=1, keepdims=0)
    types = {"label": TensorProto.INT64}
    return b.model("googlenet", {"x": [1, 3, 33, 33]}, ["logits", "label"], types=types)


def bert_encoder() -> onnx.ModelProto:
    """transformers BERT (opset 14): word / token-type / position Gather embeddings, LayerNorm
    spelled out, the extended attention mask (Unsqueeze, Unsqueeze, Cast, 1 − m, ·−10000)
    added to the scaled scores, one encoder layer, the pooler (Gather token 0, Gemm, Tanh)."""
    b, c, heads, length = Builder(), 32, 2, 16
    hd = c // heads
    words = b.node("Gather", [b.weight("word_emb", 50, c), "input_ids"], "words", axis=0)
    types = b.node("Gather", [b.weight("type_emb", 2, c), "token_type_ids"], "types", axis=0)
    positions = b.const("position_ids", np.arange(length)[None])
    pos = b.node("Gather", [b.weight("pos_emb", 64, c), positions], "positions", axis=0)
    x = b.node("Add", [b.node("Add", [words, types], "emb_wt"), pos], "emb")
    x = b.layer_norm("emb_ln", x, c, eps=1e-12)
    m = b.node("Unsqueeze", ["attention_mask", b.const("ax1", np.array([1]))], "mask1")
    m = b.node("Unsqueeze", [m, b.const("ax2", np.array([2]))], "mask2")
    m = b.node("Cast", [m], "mask_f", to=TensorProto.FLOAT)
    m = b.node("Sub", [b.const("one", np.array(1.0, np.float32)), m], "inv_mask")
    m = b.node("Mul", [m, b.const("neg", np.array(-10000.0, np.float32))], "ext_mask")

    def heads_of(name: str, perm: list[int]) -> str:
        shape = b.const(f"{name}_shape", np.array([1, length, heads, hd]))
        y = b.node("Reshape", [b.linear(name, x, c, c), shape], f"{name}_split")
        return b.node("Transpose", [y], f"{name}_heads", perm=perm)

    q, k, v = heads_of("q", [0, 2, 1, 3]), heads_of("k", [0, 2, 3, 1]), heads_of("v", [0, 2, 1, 3])
    root = b.const("sqrt_d", np.array(np.sqrt(hd), np.float32))
    s = b.node("Div", [b.node("MatMul", [q, k], "qk"), root], "scores")
    p = b.node("Softmax", [b.node("Add", [s, m], "masked")], "probs", axis=-1)
    o = b.node("Transpose", [b.node("MatMul", [p, v], "ctx")], "ctxT", perm=[0, 2, 1, 3])
    o = b.node("Reshape", [o, b.const("merge", np.array([1, length, c]))], "merged")
    x = b.layer_norm(
        "attn_ln", b.node("Add", [b.linear("attn_out", o, c, c), x], "attn_res"), c, eps=1e-12
    )
    h = b.linear("out", b.gelu("gelu", b.linear("inter", x, c, 2 * c)), 2 * c, c)
    x = b.layer_norm("out_ln", b.node("Add", [h, x], "out_res"), c, eps=1e-12)
    cls = b.node("Gather", [x, b.const("first", np.array(0))], "cls_token", axis=1)
    pool = [b.weight("pool_w", c, c), b.weight("pool_b", c)]
    b.node("Tanh", [b.node("Gemm", [cls, *pool], "pooler_dense", transB=1)], "pooler")
    ids = ("input_ids", "attention_mask", "token_type_ids")
    return b.model(
        "bert_encoder",
        dict.fromkeys(ids, [1, length]),
        [x, "pooler"],
        opset=14,
        types=dict.fromkeys(ids, TensorProto.INT64),
    )


def _roll(b: Builder, name: str, x: str, shift: int, size: int) -> str:
    """torch.roll over H and W of NHWC as exported: two Slices and a Concat per axis."""
    for axis in (1, 2):
        tail = b.slice(f"{name}{axis}_tail", x, shift, size, axis)
        head = b.slice(f"{name}{axis}_head", x, 0, shift, axis)
        x = b.node("Concat", [tail, head], f"{name}{axis}", axis=axis)
    return x


def _patch_rows(b: Builder, c: int) -> str:
    """The 4×4 patch embedding of a [1, 3, H, W] image "x", flattened to [1, c, H·W/16]."""
    patch = [b.weight("pe_w", c, 3, 4, 4), b.weight("pe_b", c)]
    x = b.node("Conv", ["x", *patch], "pe", kernel_shape=[4, 4], strides=[4, 4])
    return b.node("Reshape", [x, b.const("pe_rows", np.array([1, c, -1]))], "pe_flat")


def _mlp_and_head(b: Builder, x: str, c: int) -> str:
    """A pre-norm MLP block with its residual, then final LayerNorm, mean over the tokens and
    a 10-class Gemm head ("logits")."""
    h = b.gelu("gelu", b.linear("fc1", b.layer_norm("n2", x, c), c, 2 * c))
    x = b.node("Add", [x, b.linear("fc2", h, 2 * c, c)], "res2")
    x = b.node("Transpose", [b.layer_norm("final_ln", x, c)], "channels", perm=[0, 2, 1])
    x = b.node("ReduceMean", [x], "pool", axes=[2], keepdims=0)
    return b.node(
        "Gemm", [x, b.weight("head_w", 10, c), b.weight("head_b", 10)], "logits", transB=1
    )


def swin() -> onnx.ModelProto:
    """Swin (torch opset 13): patch embedding, LayerNorm spelled out, view(1, H, W, C), cyclic
    shift (Slice + Concat), window partition by a rank-6 Reshape/Transpose, window attention
    over four windows (a rank-5 qkv split with five non-unit axes) with relative position bias
    and shift mask, window reverse, un-shift, residual, MLP, patch merging by strided Slices,
    mean over tokens, Gemm head."""
    b, c, side, win, heads = Builder(), 16, 8, 4, 2
    hd, n, windows = c // heads, win * win, (side // win) ** 2
    x = _patch_rows(b, c)
    x = b.layer_norm("pe_ln", b.node("Transpose", [x], "tokens", perm=[0, 2, 1]), c)
    h = b.layer_norm("n1", x, c)
    h = b.node("Reshape", [h, b.const("hw_shape", np.array([1, side, side, c]))], "hw")
    h = _roll(b, "shift", h, 2, side)
    split = np.array([1, side // win, win, side // win, win, c])
    h = b.node("Reshape", [h, b.const("partition_shape", split)], "partition")
    h = b.node("Transpose", [h], "partition_t", perm=[0, 1, 3, 2, 4, 5])
    h = b.node("Reshape", [h, b.const("windows_shape", np.array([-1, n, c]))], "windows")
    qkv = b.linear("qkv", h, c, 3 * c)
    qkv = b.node("Reshape", [qkv, b.const("qkv5", np.array([windows, n, 3, heads, hd]))], "qkv_r")
    qkv = b.node("Transpose", [qkv], "qkv_t", perm=[2, 0, 3, 1, 4])
    q, k, v = (
        b.node("Gather", [qkv, b.const(f"pick{j}", np.array(j))], t, axis=0)
        for j, t in enumerate("qkv")
    )
    q = b.node("Mul", [q, b.const("scale", np.array(hd**-0.5, np.float32))], "q_scaled")
    s = b.node("MatMul", [q, b.node("Transpose", [k], "kT", perm=[0, 1, 3, 2])], "attn")
    s = b.node("Add", [s, b.weight("rel_bias", 1, heads, n, n)], "attn_bias")
    s = b.node("Reshape", [s, b.const("per_window", np.array([1, windows, heads, n, n]))], "attn5")
    mask = np.where(b.rng.random((1, windows, 1, n, n)) < 0.3, -100.0, 0.0).astype(np.float32)
    s = b.node("Add", [s, b.const("shift_mask", mask)], "attn_mask")
    s = b.node("Reshape", [s, b.const("all_windows", np.array([-1, heads, n, n]))], "attn4")
    p = b.node("Softmax", [s], "probs", axis=-1)
    o = b.node("Transpose", [b.node("MatMul", [p, v], "ctx")], "ctxT", perm=[0, 2, 1, 3])
    o = b.node("Reshape", [o, b.const("merge", np.array([windows, n, c]))], "merged")
    o = b.linear("proj", o, c, c)
    grid = np.array([1, side // win, side // win, win, win, c])
    o = b.node("Reshape", [o, b.const("reverse_shape", grid)], "reverse")
    o = b.node("Transpose", [o], "reverse_t", perm=[0, 1, 3, 2, 4, 5])
    o = b.node("Reshape", [o, b.const("map_shape", np.array([1, side, side, c]))], "map")
    o = _roll(b, "unshift", o, side - 2, side)
    o = b.node("Reshape", [o, b.const("seq_shape", np.array([1, side * side, c]))], "seq")
    x = b.node("Add", [x, o], "res1")
    h = b.gelu("gelu", b.linear("fc1", b.layer_norm("n2", x, c), c, 2 * c))
    x = b.node("Add", [x, b.linear("fc2", h, 2 * c, c)], "res2")
    x = b.node("Reshape", [x, b.const("merge_hw", np.array([1, side, side, c]))], "merge_map")
    quads = []
    for k, (i, j) in enumerate(((0, 0), (1, 0), (0, 1), (1, 1))):
        bounds = [np.array(v) for v in ([i, j], [side, side], [1, 2], [2, 2])]
        names = [b.const(f"quad{k}_{m}", v) for m, v in enumerate(bounds)]
        quads.append(b.node("Slice", [x, *names], f"quad{k}"))
    x = b.node("Concat", quads, "quads", axis=-1)
    x = b.node("Reshape", [x, b.const("merged_rows", np.array([1, -1, 4 * c]))], "merged_seq")
    x = b.node(
        "MatMul",
        [b.layer_norm("merge_ln", x, 4 * c), b.weight("reduction", 4 * c, 2 * c)],
        "reduced",
    )
    x = b.node("Transpose", [b.layer_norm("final_ln", x, 2 * c)], "channels", perm=[0, 2, 1])
    x = b.node("ReduceMean", [x], "pool", axes=[2], keepdims=0)
    b.node("Gemm", [x, b.weight("head_w", 10, 2 * c), b.weight("head_b", 10)], "logits", transB=1)
    return b.model("swin", {"x": [1, 3, 32, 32]}, ["logits"], opset=13)


def twins_locally_grouped_attention() -> onnx.ModelProto:
    """timm Twins-SVT's locally grouped self-attention: tokens viewed (1, H, W, C), windows
    partitioned by Reshape (1, H/ws, ws, W/ws, ws, C) → Transpose(2, 3), and only then the qkv
    Linear — on a rank-6 tensor with five non-unit axes — viewed (1, windows, ws², 3, heads,
    hd), permuted (3, 0, 1, 4, 2, 5) and unbound by Split + Squeeze; attention per window;
    windows merged back, output projection, residual, MLP."""
    b, c, side, ws, heads = Builder(), 16, 8, 4, 2
    hd, groups, tokens = c // heads, (side // ws) ** 2, ws * ws
    x = _patch_rows(b, c)
    x = b.layer_norm("pe_ln", b.node("Transpose", [x], "tokens", perm=[0, 2, 1]), c)
    h = b.layer_norm("n1", x, c)
    h = b.node("Reshape", [h, b.const("hw_shape", np.array([1, side, side, c]))], "hw")
    grid = np.array([1, side // ws, ws, side // ws, ws, c])
    h = b.node("Reshape", [h, b.const("partition_shape", grid)], "partition")
    h = b.node("Transpose", [h], "partition_t", perm=[0, 1, 3, 2, 4, 5])
    qkv = b.linear("qkv", h, c, 3 * c)
    split = np.array([1, groups, tokens, 3, heads, hd])
    qkv = b.node("Reshape", [qkv, b.const("qkv6", split)], "qkv_r")
    qkv = b.node("Transpose", [qkv], "qkv_t", perm=[3, 0, 1, 4, 2, 5])
    parts = b.nodes_out("Split", [qkv, b.const("ones", np.array([1, 1, 1]))], ["q1", "k1", "v1"])
    axis = b.const("axis0", np.array([0]))
    q, k, v = (b.node("Squeeze", [p, axis], t) for p, t in zip(parts, "qkv", strict=True))
    q = b.node("Mul", [q, b.const("scale", np.array(hd**-0.5, np.float32))], "q_scaled")
    s = b.node("MatMul", [q, b.node("Transpose", [k], "kT", perm=[0, 1, 2, 4, 3])], "attn")
    p = b.node("Softmax", [s], "probs", axis=-1)
    o = b.node("Transpose", [b.node("MatMul", [p, v], "ctx")], "ctxT", perm=[0, 1, 3, 2, 4])
    windows = np.array([1, side // ws, side // ws, ws, ws, c])
    o = b.node("Reshape", [o, b.const("windows_shape", windows)], "windows")
    o = b.node("Transpose", [o], "reverse_t", perm=[0, 1, 3, 2, 4, 5])
    o = b.node("Reshape", [o, b.const("seq_shape", np.array([1, side * side, c]))], "seq")
    x = b.node("Add", [x, b.linear("proj", o, c, c)], "res1")
    _mlp_and_head(b, x, c)
    return b.model("twins_locally_grouped_attention", {"x": [1, 3, 32, 32]}, ["logits"], opset=13)


def hiera_mask_unit_attention() -> onnx.ModelProto:
    """timm Hiera's mask-unit attention with query pooling: the qkv Linear viewed (1, tokens,
    windows, 3, heads, hd) — five non-unit axes — permuted (3, 0, 4, 2, 1, 5) and unbound by
    Split + Squeeze; q viewed (1, heads, windows, stride, tokens/stride, hd) and max-pooled over
    the stride (ReduceMax of a rank-6 tensor); attention per window; x.transpose(1, 3) back to
    tokens, projection, MLP, mean over tokens, Gemm head."""
    b, c, heads, windows, stride = Builder(), 16, 2, 4, 4
    hd, tokens = c // heads, 64 // windows
    x = _patch_rows(b, c)
    x = b.layer_norm("n1", b.node("Transpose", [x], "tokens", perm=[0, 2, 1]), c)
    qkv = b.linear("qkv", x, c, 3 * c)
    split = np.array([1, tokens, windows, 3, heads, hd])
    qkv = b.node("Reshape", [qkv, b.const("qkv6", split)], "qkv_r")
    qkv = b.node("Transpose", [qkv], "qkv_t", perm=[3, 0, 4, 2, 1, 5])
    parts = b.nodes_out("Split", [qkv, b.const("ones", np.array([1, 1, 1]))], ["q1", "k1", "v1"])
    axis = b.const("axis0", np.array([0]))
    q, k, v = (b.node("Squeeze", [p, axis], t) for p, t in zip(parts, "qkv", strict=True))
    pooled = np.array([1, heads, windows, stride, tokens // stride, hd])
    q = b.node("Reshape", [q, b.const("q_pool_view", pooled)], "q_view")
    q = b.node("ReduceMax", [q], "q_pooled", axes=[3], keepdims=0)
    q = b.node("Mul", [q, b.const("scale", np.array(hd**-0.5, np.float32))], "q_scaled")
    s = b.node("MatMul", [q, b.node("Transpose", [k], "kT", perm=[0, 1, 2, 4, 3])], "attn")
    p = b.node("Softmax", [s], "probs", axis=-1)
    o = b.node("Transpose", [b.node("MatMul", [p, v], "ctx")], "ctxT", perm=[0, 3, 2, 1, 4])
    o = b.node("Reshape", [o, b.const("merge", np.array([1, -1, c]))], "merged")
    x = b.linear("proj", o, c, c)
    _mlp_and_head(b, x, c)
    return b.model("hiera_mask_unit_attention", {"x": [1, 3, 32, 32]}, ["logits"], opset=13)


def yolo11_psa() -> onnx.ModelProto:
    """ultralytics YOLO11 C2PSA attention on a feature map: qkv 1×1 Conv, view
    (B, heads, 2·key_dim + head_dim, N), Split on axis 2, (qᵀ·k)·scale, Softmax(−1),
    v·attnᵀ viewed back to (B, C, H, W), plus a depthwise positional Conv on v, projection
    Conv, residual, then an FFN of two 1×1 Convs."""
    b = Builder()
    c, heads, side = 32, 2, 8
    head_dim, key_dim, n = c // heads, c // heads // 2, side * side
    x = b.conv("stem", "images", 3, c, stride=2, act="silu")
    qkv = b.conv("qkv", x, c, c + 2 * key_dim * heads, kernel=1, act=None)
    view = b.const("qkv_view", np.array([1, heads, 2 * key_dim + head_dim, n]))
    qkv = b.node("Reshape", [qkv, view], "qkv_heads")
    sizes = b.const("qkv_sizes", np.array([key_dim, key_dim, head_dim]))
    q, k, v = b.nodes_out("Split", [qkv, sizes], ["q", "k", "v"], axis=2)
    scores = b.node("MatMul", [b.node("Transpose", [q], "qT", perm=[0, 1, 3, 2]), k], "qk")
    scale = b.const("attn_scale", np.array(key_dim**-0.5, np.float32))
    attn = b.node("Softmax", [b.node("Mul", [scores, scale], "qk_scaled")], "attn", axis=-1)
    mixed = b.node("MatMul", [v, b.node("Transpose", [attn], "attnT", perm=[0, 1, 3, 2])], "av")
    shape = b.const("map_shape", np.array([1, c, side, side]))
    mixed = b.node("Reshape", [mixed, shape], "av_map")
    pe = b.conv("pe", b.node("Reshape", [v, shape], "v_map"), c, c, group=c, act=None)
    attended = b.conv("proj", b.node("Add", [mixed, pe], "av_pe"), c, c, kernel=1, act=None)
    x = b.node("Add", [x, attended], "psa_res")
    ffn = b.conv(
        "ffn2", b.conv("ffn1", x, c, 2 * c, kernel=1, act="silu"), 2 * c, c, kernel=1, act=None
    )
    b.node("Add", [x, ffn], "psa_out")
    return b.model("yolo11_psa", {"images": [1, 3, 16, 16]}, ["psa_out"], opset=17)


def mobilevitv2_hf() -> onnx.ModelProto:
    """HF transformers MobileViTV2 (dynamo export, opset 18): F.unfold of 2×2 patches as two
    Gathers by the index table [[0, 2, …], [1, 3, …]] (axis 2, then axis 4), viewed as
    (1, C, P, N); separable linear attention over the N patches (Softmax of a 1-channel score
    over N, context = Σ k·score broadcast onto Relu(v)); F.fold back as Col2Im with
    strides = block shape."""
    b, c, side, ph = Builder(), 16, 8, 2
    n, pa = (side // ph) ** 2, ph * ph
    x = b.conv("stem", "x", 3, c, stride=2, act="silu")
    y = b.conv("proj_in", x, c, c, kernel=1, act=None)
    table = b.const("patch_index", np.arange(side).reshape(side // ph, ph).T.copy())
    y = b.node("Gather", [y, table], "unfold_h", axis=2)
    y = b.node("Gather", [y, table], "unfold_w", axis=4)
    patches = b.node("Reshape", [y, b.const("patch_view", np.array([1, c, pa, n]))], "patches")
    score = b.conv("score", patches, c, 1, kernel=1, act=None)
    score = b.node("Softmax", [score], "score_softmax", axis=-1)
    key = b.conv("key", patches, c, c, kernel=1, act=None)
    context = b.node("Mul", [key, score], "key_scored")
    context = b.node(
        "ReduceSum", [context, b.const("over_n", np.array([-1]))], "context", keepdims=1
    )
    value = b.node("Relu", [b.conv("value", patches, c, c, kernel=1, act=None)], "value_relu")
    mixed = b.conv(
        "attn_out", b.node("Mul", [value, context], "attended"), c, c, kernel=1, act=None
    )
    cols = b.node("Reshape", [mixed, b.const("cols", np.array([1, c * pa, n]))], "columns")
    image, block = b.const("image", np.array([side, side])), b.const("block", np.array([ph, ph]))
    folded = b.node("Col2Im", [cols, image, block], "fold", strides=[ph, ph])
    b.conv("fuse", b.node("Add", [x, folded], "residual"), c, c, act="silu")
    return b.model("mobilevitv2_hf", {"x": [1, 3, 16, 16]}, ["fuse_silu"], opset=18)


def maxvit_window_attention() -> onnx.ModelProto:
    """torchvision MaxViT's relative attention over windows: q, k, v viewed as
    (1, windows, heads, tokens, d), scores by Einsum "bwhid,bwhjd->bwhij" plus a relative
    position bias, Softmax, Einsum "bwhij,bwhjd->bwhid", back to the map, residual."""
    b, c, side = Builder(), 16, 8
    windows, heads, tokens, d = 4, 2, 16, 8
    x = b.conv("stem", "images", 3, c, stride=2, act="silu")
    view = b.const("heads_view", np.array([1, windows, heads, tokens, d]))
    q, k, v = (
        b.node("Reshape", [b.conv(p, x, c, c, kernel=1, act=None), view], f"{p}_heads")
        for p in ("q", "k", "v")
    )
    scores = b.node("Einsum", [q, k], "scores", equation="bwhid,bwhjd->bwhij")
    bias = b.weight("relative_bias", 1, 1, heads, tokens, tokens)
    attn = b.node("Softmax", [b.node("Add", [scores, bias], "biased")], "attn", axis=-1)
    mixed = b.node("Einsum", [attn, v], "mixed", equation="bwhij,bwhjd->bwhid")
    mixed = b.node(
        "Reshape", [mixed, b.const("map_view", np.array([1, c, side, side]))], "mixed_map"
    )
    out = b.conv("proj", mixed, c, c, kernel=1, act=None)
    b.node("Add", [x, out], "attn_out")
    return b.model("maxvit_window_attention", {"images": [1, 3, 16, 16]}, ["attn_out"], opset=17)


def yolo_world() -> onnx.ModelProto:
    """ultralytics YOLO-World (set_classes, then export): MaxSigmoidAttnBlock — guide = text
    embeddings [1, K, heads, hc] (constant), embed = image features viewed (1, heads, hc, h·w)
    → Transpose → MatMul by the constant guide → ReduceMax over classes → view (1, heads, h, w)
    → /√hc → Sigmoid, unsqueezed to (1, heads, 1, h, w) gating proj_conv's map viewed as
    (1, heads, hc, h, w), viewed back to (1, C, h, w); then the contrastive head
    einsum("bchw,bkc->bkhw") exported as MatMul(text [1, K, C], features (1, C, h·w)) →
    view (1, K, h, w) → · exp(logit_scale) + bias. The attention sits inside the neck (convs
    follow it), so the host cannot take it as a trailing stage."""
    b = Builder()
    c, heads, classes, side = 16, 2, 3, 8
    hc = c // heads
    x = b.conv("stem", "images", 3, c, stride=2, act="silu")
    embed = b.node("Reshape", [x, b.const("embed_view", np.array([1, heads, hc, -1]))], "embed")
    embed = b.node("Transpose", [embed], "embed_t", perm=[0, 1, 3, 2])
    guide = b.weight("guide", 1, heads, hc, classes)
    scores = b.node("ReduceMax", [b.node("MatMul", [embed, guide], "aw")], "aw_max", axes=[-1])
    scores = b.node(
        "Reshape", [scores, b.const("aw_view", np.array([1, heads, side, side]))], "aw_map"
    )
    scale = b.const("aw_scale", np.array(hc**0.5, np.float32))
    gate = b.node("Sigmoid", [b.node("Div", [scores, scale], "aw_scaled")], "aw_gate")
    gate = b.node("Unsqueeze", [gate, b.const("gate_axis", np.array([2]))], "aw_gate5")
    proj = b.conv("proj", x, c, c, act=None)
    proj = b.node(
        "Reshape", [proj, b.const("proj_view", np.array([1, heads, hc, side, side]))], "proj5"
    )
    gated = b.node("Mul", [proj, gate], "gated5")
    x = b.node("Reshape", [gated, b.const("gated_view", np.array([1, c, side, side]))], "gated")
    x = b.conv("neck", x, c, c, act="silu")
    text = b.weight("text", 1, classes, c)
    flat = b.node("Reshape", [x, b.const("flat_view", np.array([1, c, -1]))], "features")
    logits = b.node("MatMul", [text, flat], "contrast")
    logits = b.node(
        "Reshape",
        [logits, b.const("logit_view", np.array([1, classes, side, side]))],
        "contrast_map",
    )
    logit_scale = b.const("logit_scale", np.array(np.exp(-0.5), np.float32))
    logits = b.node("Mul", [logits, logit_scale], "contrast_scaled")
    b.node("Add", [logits, b.const("contrast_bias", np.array(-1.0, np.float32))], "class_logits")
    return b.model("yolo_world", {"images": [1, 3, 16, 16]}, ["class_logits"], opset=17)


def yolov10_head() -> onnx.ModelProto:
    """YOLOv10's NMS-free one-to-one head: boxes and class scores flattened to (1, N, 4+nc),
    max score per anchor (ReduceMax), TopK over anchors, GatherElements of the kept rows and a
    second TopK over the flattened class scores — the post-processing stays on the host, the
    network before it on the MLA."""
    b, nc, k = Builder(), 4, 8
    x = b.conv("stem", "images", 3, 16, stride=2, act="silu")
    x = b.conv("down", x, 16, 16, stride=2, act="silu")
    boxes = b.conv("box", x, 16, 4, kernel=1, act=None)
    scores = b.node("Sigmoid", [b.conv("cls", x, 16, nc, kernel=1, act=None)], "cls_sig")
    cat = b.node("Concat", [boxes, scores], "box_cls", axis=1)
    rows = b.node("Reshape", [cat, b.const("rows", np.array([1, 4 + nc, -1]))], "flat")
    rows = b.node("Transpose", [rows], "per_anchor", perm=[0, 2, 1])
    cls = b.slice("cls_part", rows, 4, 4 + nc, 2)
    best = b.node("ReduceMax", [cls], "best", axes=[-1], keepdims=0)
    top = b.const("top_k", np.array([k]))
    _, index = b.nodes_out("TopK", [best, top], ["top_scores", "top_index"], axis=-1)
    index = b.node("Unsqueeze", [index, b.const("last", np.array([-1]))], "top_index3")
    index = b.node("Tile", [index, b.const("tile", np.array([1, 1, 4 + nc]))], "top_rows")
    b.node("GatherElements", [rows, index], "detections", axis=1)
    return b.model("yolov10_head", {"images": [1, 3, 32, 32]}, ["detections"], opset=13)


def _split_heads(
    b: Builder,
    name: str,
    x: str,
    shape: tuple[int, int, int, int],
    perm: tuple[int, ...] = (0, 2, 1, 3),
) -> str:
    """view(batch, tokens, heads, hd) then the transpose to heads-first (or keys-transposed)."""
    batch, tokens, heads, hd = shape
    y = b.node(
        "Reshape", [x, b.const(f"{name}_hs", np.array([batch, tokens, heads, hd]))], f"{name}_split"
    )
    return b.node("Transpose", [y], f"{name}_heads", perm=list(perm))


def segformer() -> onnx.ModelProto:
    """SegFormer MiT stage: overlapping patch embed Conv 7x7/4, LayerNorm; efficient self-attention
    with spatial-reduction Conv (sr_ratio 2) + LayerNorm on the keys/values, kv Linear split by a
    rank-5 Reshape/Transpose; Mix-FFN with a depthwise 3x3 between Linear layers; then the
    all-MLP decoder: Linear on tokens, back to a map, bilinear Resize, 1x1 fuse conv."""
    b, c, side, heads = Builder(), 32, 8, 1
    n, hd = side * side, c // heads
    w = [b.weight("pe_w", c, 3, 7, 7), b.weight("pe_b", c)]
    x = b.node("Conv", ["x", *w], "pe", kernel_shape=[7, 7], strides=[4, 4], pads=[3] * 4)
    x = b.node("Reshape", [x, b.const("pe_flat", np.array([1, c, -1]))], "pe_rows")
    x = b.layer_norm("pe_ln", b.node("Transpose", [x], "pe_tokens", perm=[0, 2, 1]), c)
    h = b.layer_norm("ln1", x, c)
    q = _split_heads(b, "q", b.linear("q", h, c, c), (1, n, heads, hd))
    m = b.node("Transpose", [h], "sr_t", perm=[0, 2, 1])
    m = b.node("Reshape", [m, b.const("sr_map", np.array([1, c, side, side]))], "sr_in")
    w = [b.weight("sr_w", c, c, 2, 2), b.weight("sr_b", c)]
    m = b.node("Conv", [m, *w], "sr", kernel_shape=[2, 2], strides=[2, 2])
    m = b.node("Reshape", [m, b.const("sr_flat", np.array([1, c, -1]))], "sr_rows")
    m = b.layer_norm("sr_ln", b.node("Transpose", [m], "sr_tokens", perm=[0, 2, 1]), c, eps=1e-5)
    kv = b.linear("kv", m, c, 2 * c)
    kv = b.node("Reshape", [kv, b.const("kv5", np.array([1, -1, 2, heads, hd]))], "kv_r")
    kv = b.node("Transpose", [kv], "kv_t", perm=[2, 0, 3, 1, 4])
    k = b.node("Gather", [kv, b.const("k_i", np.array(0))], "k", axis=0)
    v = b.node("Gather", [kv, b.const("v_i", np.array(1))], "v", axis=0)
    s = b.node("MatMul", [q, b.node("Transpose", [k], "kT", perm=[0, 1, 3, 2])], "qk")
    s = b.node("Mul", [s, b.const("scale", np.array(hd**-0.5, np.float32))], "qk_s")
    p = b.node("Softmax", [s], "attn", axis=-1)
    o = b.node("Transpose", [b.node("MatMul", [p, v], "av")], "av_t", perm=[0, 2, 1, 3])
    o = b.linear(
        "proj", b.node("Reshape", [o, b.const("merge", np.array([1, n, c]))], "av_m"), c, c
    )
    x = b.node("Add", [x, o], "res1")
    h = b.linear("fc1", b.layer_norm("ln2", x, c), c, 2 * c)
    h = b.node("Transpose", [h], "ffn_t", perm=[0, 2, 1])
    h = b.node("Reshape", [h, b.const("ffn_map", np.array([1, 2 * c, side, side]))], "ffn_in")
    h = b.conv("dw", h, 2 * c, 2 * c, act=None, group=2 * c)
    h = b.node(
        "Transpose",
        [b.node("Reshape", [h, b.const("dw_flat", np.array([1, 2 * c, -1]))], "dw_rows")],
        "dw_tok",
        perm=[0, 2, 1],
    )
    x = b.node("Add", [x, b.linear("fc2", b.gelu("gelu", h), 2 * c, c)], "res2")
    x = b.layer_norm("norm", x, c)
    x = b.node("Reshape", [x, b.const("out_map", np.array([1, side, side, c]))], "nhwc")
    x = b.node("Transpose", [x], "stage_out", perm=[0, 3, 1, 2])
    d = b.node(
        "Transpose",
        [b.node("Reshape", [x, b.const("dec_flat", np.array([1, c, -1]))], "dec_rows")],
        "dec_tok",
        perm=[0, 2, 1],
    )
    d = b.linear("dec", d, c, 16)
    d = b.node("Transpose", [d], "dec_t", perm=[0, 2, 1])
    d = b.node("Reshape", [d, b.const("dec_map", np.array([1, 16, side, side]))], "dec_in")
    d = b.node(
        "Resize",
        [d, "", b.const("up", np.array([1, 1, 2, 2], np.float32))],
        "dec_up",
        mode="linear",
        coordinate_transformation_mode="align_corners",
    )
    b.conv("cls", d, 16, 5, kernel=1, act=None)
    return b.model("segformer", {"x": [1, 3, 32, 32]}, ["cls_conv"], opset=13)


def mobilevit() -> onnx.ModelProto:
    """MobileViT block (ml-cvnets/timm): local 3x3 + 1x1 conv, unfold to patches
    Reshape(C·nh, ph, nw, pw) → Transpose(1,2) → Reshape(1, C, N, P) → Transpose(1,3) →
    Reshape(P, N, C), a transformer over P sequences, fold back, 1x1 proj, Concat with input,
    3x3 fuse conv."""
    b, cin, c, side, ph = Builder(), 16, 24, 8, 2
    nh = side // ph
    n, pa = nh * nh, ph * ph
    x = b.conv("stem", "x", 3, cin, stride=2, act="silu")
    y = b.conv("local", x, cin, cin, act="silu")
    y = b.conv("proj_in", y, cin, c, kernel=1, act=None)
    y = b.node("Reshape", [y, b.const("u1", np.array([c * nh, ph, nh, ph]))], "unfold1")
    y = b.node("Transpose", [y], "unfold_t1", perm=[0, 2, 1, 3])
    y = b.node("Reshape", [y, b.const("u2", np.array([1, c, n, pa]))], "unfold2")
    y = b.node("Transpose", [y], "unfold_t2", perm=[0, 3, 2, 1])
    t = b.node("Reshape", [y, b.const("u3", np.array([pa, n, c]))], "patches")
    heads, hd = 2, c // 2
    h = b.layer_norm("ln1", t, c, eps=1e-5)
    qkv = b.linear("qkv", h, c, 3 * c)
    qkv = b.node("Reshape", [qkv, b.const("qkv5", np.array([pa, n, 3, heads, hd]))], "qkv_r")
    qkv = b.node("Transpose", [qkv], "qkv_t", perm=[2, 0, 3, 1, 4])
    q, k, v = (
        b.node("Gather", [qkv, b.const(f"i{j}", np.array(j))], f"{t_}", axis=0)
        for j, t_ in enumerate("qkv")
    )
    q = b.node("Mul", [q, b.const("scale", np.array(hd**-0.5, np.float32))], "q_s")
    p = b.node(
        "Softmax",
        [b.node("MatMul", [q, b.node("Transpose", [k], "kT", perm=[0, 1, 3, 2])], "qk")],
        "attn",
        axis=-1,
    )
    o = b.node("Transpose", [b.node("MatMul", [p, v], "av")], "av_t", perm=[0, 2, 1, 3])
    o = b.linear(
        "proj", b.node("Reshape", [o, b.const("merge", np.array([pa, n, c]))], "av_m"), c, c
    )
    t = b.node("Add", [t, o], "res1")
    h = b.linear("fc1", b.layer_norm("ln2", t, c, eps=1e-5), c, 2 * c)
    s = b.node("Sigmoid", [h], "fc1_sig")
    t = b.node("Add", [t, b.linear("fc2", b.node("Mul", [h, s], "fc1_silu"), 2 * c, c)], "res2")
    t = b.layer_norm("ln_out", t, c, eps=1e-5)
    y = b.node("Reshape", [t, b.const("f1", np.array([1, pa, n, c]))], "fold1")
    y = b.node("Transpose", [y], "fold_t1", perm=[0, 3, 2, 1])
    y = b.node("Reshape", [y, b.const("f2", np.array([c * nh, nh, ph, ph]))], "fold2")
    y = b.node("Transpose", [y], "fold_t2", perm=[0, 2, 1, 3])
    y = b.node("Reshape", [y, b.const("f3", np.array([1, c, side, side]))], "folded")
    y = b.conv("proj_out", y, c, cin, kernel=1, act="silu")
    y = b.node("Concat", [x, y], "cat", axis=1)
    b.conv("fuse", y, 2 * cin, cin, act="silu")
    return b.model("mobilevit", {"x": [1, 3, 16, 16]}, ["fuse_silu"], opset=13)


def clip_vit() -> onnx.ModelProto:
    """OpenAI CLIP visual (opset 14): patch Conv without bias, class embedding Concat, ln_pre,
    a residual block whose MLP uses QuickGELU x·Sigmoid(1.702·x), ln_post on token 0, and the
    projection MatMul without bias, then L2 normalisation (ReduceL2 / Div)."""
    b, c, heads = Builder(), 32, 2
    hd, n = c // heads, 17
    x = b.node(
        "Conv", ["x", b.weight("conv1", c, 3, 8, 8)], "patch", kernel_shape=[8, 8], strides=[8, 8]
    )
    x = b.node("Reshape", [x, b.const("flat_shape", np.array([1, c, -1]))], "flat")
    x = b.node("Transpose", [x], "tokens", perm=[0, 2, 1])
    x = b.node("Concat", [b.weight("class_emb", 1, 1, c), x], "with_cls", axis=1)
    x = b.node("Add", [x, b.weight("pos", n, c)], "pos_add")
    x = b.layer_norm("ln_pre", x, c, eps=1e-5)
    h = b.layer_norm("ln_1", x, c, eps=1e-5)
    q, k, v = (_split_heads(b, t, b.linear(t, h, c, c), (1, n, heads, hd)) for t in "qkv")
    q = b.node("Mul", [q, b.const("scale", np.array(hd**-0.5, np.float32))], "q_s")
    p = b.node(
        "Softmax",
        [b.node("MatMul", [q, b.node("Transpose", [k], "kT", perm=[0, 1, 3, 2])], "qk")],
        "attn",
        axis=-1,
    )
    o = b.node("Transpose", [b.node("MatMul", [p, v], "av")], "av_t", perm=[0, 2, 1, 3])
    o = b.linear("out", b.node("Reshape", [o, b.const("merge", np.array([1, n, c]))], "av_m"), c, c)
    x = b.node("Add", [x, o], "res1")
    h = b.linear("c_fc", b.layer_norm("ln_2", x, c, eps=1e-5), c, 4 * c)
    g = b.node(
        "Sigmoid",
        [b.node("Mul", [h, b.const("qg", np.array(1.702, np.float32))], "qg_mul")],
        "qg_sig",
    )
    x = b.node(
        "Add", [x, b.linear("c_proj", b.node("Mul", [h, g], "quick_gelu"), 4 * c, c)], "res2"
    )
    cls = b.node("Gather", [x, b.const("first", np.array(0))], "cls", axis=1)
    cls = b.layer_norm("ln_post", cls, c, eps=1e-5)
    e = b.node("MatMul", [cls, b.weight("proj", c, 16)], "embed")
    norm = b.node("ReduceL2", [e], "embed_norm", axes=[-1], keepdims=1)
    b.node("Div", [e, norm], "image_embeds")
    return b.model("clip_vit", {"x": [1, 3, 32, 32]}, ["image_embeds"], opset=14)


def t5_encoder() -> onnx.ModelProto:
    """HF T5 encoder (opset 13): token Gather, T5LayerNorm (Pow 2, ReduceMean, Add ε, Sqrt,
    Div 1/·, Mul x, Mul γ — no mean subtraction), attention without scaling and with the
    relative-position bias (Gather of a bucket table by constant bucket ids, Transpose,
    Unsqueeze) added to the scores, gated-GELU FFN with the tanh approximation."""
    b, c, heads, length = Builder(), 32, 2, 12
    hd = c // heads

    def rms(name: str, x: str) -> str:
        var = b.node(
            "ReduceMean",
            [b.node("Pow", [x, b.const(f"{name}_two", np.array(2.0, np.float32))], f"{name}_pow")],
            f"{name}_var",
            axes=[-1],
            keepdims=1,
        )
        std = b.node(
            "Sqrt",
            [
                b.node(
                    "Add", [var, b.const(f"{name}_eps", np.array(1e-6, np.float32))], f"{name}_ve"
                )
            ],
            f"{name}_std",
        )
        inv = b.node(
            "Div", [b.const(f"{name}_one", np.array(1.0, np.float32)), std], f"{name}_rsqrt"
        )
        y = b.node("Mul", [x, inv], f"{name}_n")
        return b.node(
            "Mul",
            [b.const(f"{name}_g", (1 + b.rng.normal(0, 0.1, c)).astype(np.float32)), y],
            f"{name}_out",
        )

    x = b.node("Gather", [b.weight("shared", 40, c), "input_ids"], "embeds", axis=0)
    h = rms("ln0", x)
    q, k, v = (
        _split_heads(
            b, t, b.node("MatMul", [h, b.weight(f"{t}_w", c, c)], f"{t}_mm"), (1, length, heads, hd)
        )
        for t in "qkv"
    )
    s = b.node("MatMul", [q, b.node("Transpose", [k], "kT", perm=[0, 1, 3, 2])], "scores")
    rel = np.abs(np.arange(length)[None] - np.arange(length)[:, None]).clip(0, 7)
    bias = b.node(
        "Gather",
        [b.weight("rel_emb", 8, heads), b.const("buckets", rel.astype(np.int64))],
        "rel_vals",
        axis=0,
    )
    bias = b.node("Transpose", [bias], "rel_t", perm=[2, 0, 1])
    bias = b.node("Unsqueeze", [bias, b.const("ax0", np.array([0]))], "pos_bias")
    p = b.node("Softmax", [b.node("Add", [s, bias], "scores_b")], "attn", axis=-1)
    o = b.node("Transpose", [b.node("MatMul", [p, v], "av")], "av_t", perm=[0, 2, 1, 3])
    o = b.node("Reshape", [o, b.const("merge", np.array([1, -1, c]))], "av_m")
    x = b.node("Add", [x, b.node("MatMul", [o, b.weight("o_w", c, c)], "o_mm")], "res1")
    h = rms("ln1", x)
    g = b.node("MatMul", [h, b.weight("wi0", c, 2 * c)], "wi0_mm")
    cube = b.node("Pow", [g, b.const("three", np.array(3.0, np.float32))], "g_cube")
    inner = b.node(
        "Add",
        [g, b.node("Mul", [cube, b.const("k044", np.array(0.044715, np.float32))], "g_c")],
        "g_in",
    )
    inner = b.node(
        "Mul", [inner, b.const("s2pi", np.array(np.sqrt(2 / np.pi), np.float32))], "g_in2"
    )
    t = b.node(
        "Add",
        [b.node("Tanh", [inner], "g_tanh"), b.const("one_t", np.array(1.0, np.float32))],
        "g_t1",
    )
    g = b.node(
        "Mul",
        [b.node("Mul", [b.const("halfg", np.array(0.5, np.float32)), g], "g_half"), t],
        "gelu_new",
    )
    lin = b.node("MatMul", [h, b.weight("wi1", c, 2 * c)], "wi1_mm")
    f = b.node("MatMul", [b.node("Mul", [g, lin], "gated"), b.weight("wo", 2 * c, c)], "wo_mm")
    x = b.node("Add", [x, f], "res2")
    rms("final", x)
    return b.model(
        "t5_encoder",
        {"input_ids": [1, length]},
        ["final_out"],
        opset=13,
        types={"input_ids": TensorProto.INT64},
    )


def whisper_encoder() -> onnx.ModelProto:
    """HF Whisper encoder: log-mel (1, 16, 32) through Conv1d k3 + erf-GELU, Conv1d k3/2 +
    GELU on rank 3, permute to (1, T, C), + sinusoidal positions, pre-LN attention with q
    scaled by hd^-0.5 and heads folded to (heads, T, hd) for bmm, fc1/GELU/fc2, final LN."""
    b, mel, c, heads = Builder(), 16, 32, 2
    hd, t = c // heads, 16
    x = b.node(
        "Conv",
        ["input_features", b.weight("c1_w", c, mel, 3), b.weight("c1_b", c)],
        "conv1",
        kernel_shape=[3],
        pads=[1, 1],
    )
    x = b.gelu("g1", x)
    x = b.node(
        "Conv",
        [x, b.weight("c2_w", c, c, 3), b.weight("c2_b", c)],
        "conv2",
        kernel_shape=[3],
        pads=[1, 1],
        strides=[2],
    )
    x = b.gelu("g2", x)
    x = b.node("Transpose", [x], "perm", perm=[0, 2, 1])
    x = b.node("Add", [x, b.weight("pos", t, c)], "pos_add")
    h = b.layer_norm("ln1", x, c, eps=1e-5)

    def heads_of(name: str, bias: bool) -> str:
        y = (
            b.linear(name, h, c, c)
            if bias
            else b.node("MatMul", [h, b.weight(f"{name}_w", c, c)], f"{name}_mm")
        )
        if name == "q":
            y = b.node("Mul", [y, b.const("scaling", np.array(hd**-0.5, np.float32))], "q_s")
        y = _split_heads(b, name, y, (1, -1, heads, hd))
        return b.node(
            "Reshape", [y, b.const(f"{name}_bh", np.array([heads, -1, hd]))], f"{name}_3d"
        )

    q, k, v = heads_of("q", True), heads_of("k", False), heads_of("v", True)
    p = b.node(
        "Softmax",
        [b.node("MatMul", [q, b.node("Transpose", [k], "kT", perm=[0, 2, 1])], "qk")],
        "attn",
        axis=-1,
    )
    o = b.node(
        "Reshape",
        [b.node("MatMul", [p, v], "av"), b.const("o4", np.array([1, heads, t, hd]))],
        "av4",
    )
    o = b.node("Transpose", [o], "av_t", perm=[0, 2, 1, 3])
    o = b.linear("out", b.node("Reshape", [o, b.const("merge", np.array([1, t, c]))], "av_m"), c, c)
    x = b.node("Add", [x, o], "res1")
    h2 = b.gelu("g3", b.linear("fc1", b.layer_norm("ln2", x, c, eps=1e-5), c, 2 * c))
    x = b.node("Add", [x, b.linear("fc2", h2, 2 * c, c)], "res2")
    b.layer_norm("ln_post", x, c, eps=1e-5)
    return b.model("whisper_encoder", {"input_features": [1, mel, 32]}, ["ln_post_out"], opset=14)


def centernet() -> onnx.ModelProto:
    """CenterNet: backbone, ConvTranspose up, heads (heatmap Sigmoid, wh, reg) and the
    heatmap NMS heat·Cast(Equal(MaxPool3x3(heat), heat)) in the graph."""
    b = Builder()
    x = b.conv("c1", "x", 3, 16, stride=2)
    x = b.conv("c2", x, 16, 32, stride=2)
    x = b.node(
        "ConvTranspose",
        [x, b.weight("up_w", 32, 16, 4, 4), b.weight("up_b", 16)],
        "up",
        kernel_shape=[4, 4],
        strides=[2, 2],
        pads=[1, 1, 1, 1],
    )
    x = b.node("Relu", [x], "up_relu")
    heat = b.node(
        "Sigmoid", [b.conv("hm2", b.conv("hm1", x, 16, 16), 16, 4, kernel=1, act=None)], "heat"
    )
    wh = b.conv("wh2", b.conv("wh1", x, 16, 16), 16, 2, kernel=1, act=None)
    reg = b.conv("reg2", b.conv("reg1", x, 16, 16), 16, 2, kernel=1, act=None)
    hmax = b.node("MaxPool", [heat], "hmax", kernel_shape=[3, 3], pads=[1] * 4, strides=[1, 1])
    keep = b.node("Cast", [b.node("Equal", [hmax, heat], "is_peak")], "keep", to=TensorProto.FLOAT)
    b.node("Mul", [heat, keep], "peaks")
    return b.model("centernet", {"x": [1, 3, 32, 32]}, ["peaks", wh, reg], opset=11)


def efficientdet_bifpn() -> onnx.ModelProto:
    """EfficientDet BiFPN node: fast normalised fusion w = Relu(w)/(Σw + ε) on an initializer,
    Gather of each weight, weighted sum of a feature and a nearest-upsampled coarser one, Swish,
    depthwise-separable conv with BN folded; class and box heads Transposed/Reshaped."""
    b = Builder()
    p3 = b.conv(
        "p3", b.conv("stem", "x", 3, 16, stride=2, act="silu"), 16, 16, stride=2, act="silu"
    )
    p4 = b.conv("p4", p3, 16, 16, stride=2, act="silu")
    w = b.node("Relu", [b.const("fuse_w", np.array([1.0, 0.7], np.float32))], "w_relu")
    w = b.node(
        "Div",
        [
            w,
            b.node(
                "Add",
                [
                    b.node("ReduceSum", [w], "w_sum", keepdims=1),
                    b.const("eps", np.array(1e-4, np.float32)),
                ],
                "w_den",
            ),
        ],
        "w_norm",
    )
    w0 = b.node("Gather", [w, b.const("i0", np.array(0))], "w0", axis=0)
    w1 = b.node("Gather", [w, b.const("i1", np.array(1))], "w1", axis=0)
    up = b.node(
        "Resize",
        [p4, "", b.const("up", np.array([1, 1, 2, 2], np.float32))],
        "p4_up",
        mode="nearest",
    )
    f = b.node("Add", [b.node("Mul", [w0, p3], "wp3"), b.node("Mul", [w1, up], "wp4")], "fused")
    f = b.node("Mul", [f, b.node("Sigmoid", [f], "f_sig")], "f_swish")
    f = b.conv(
        "sep_pw", b.conv("sep_dw", f, 16, 16, act=None, group=16), 16, 16, kernel=1, act=None
    )
    outs = []
    for kind, width in (("cls", 3), ("box", 4)):
        y = b.conv(f"{kind}_head", f, 16, 9 * width, act=None)
        y = b.node("Transpose", [y], f"{kind}_nhwc", perm=[0, 2, 3, 1])
        outs.append(
            b.node(
                "Reshape", [y, b.const(f"{kind}_shape", np.array([1, -1, width]))], f"{kind}_out"
            )
        )
    b.node("Sigmoid", [outs[0]], "scores")
    return b.model("efficientdet_bifpn", {"x": [1, 3, 32, 32]}, ["scores", outs[1]], opset=13)


def gfl_head() -> onnx.ModelProto:
    """NanoDet / PicoDet GFL head: per stride cls Sigmoid and reg 4·(R+1) maps, flattened to
    (1, HW, ·), the distribution Reshape(1, HW, 4, R+1) → Softmax(-1) → MatMul with the
    projection arange(R+1) (DFL integral), Concat over strides."""
    b, reg_max = Builder(), 7
    x = b.conv("stem", "x", 3, 16, stride=2, act="relu")
    scores, dists = [], []
    for k in range(2):
        x = b.conv(f"s{k}", x, 16, 16, stride=2)
        hw = (32 // 2 ** (k + 2)) ** 2
        for kind, width in (("cls", 3), ("reg", 4 * (reg_max + 1))):
            y = b.conv(f"{kind}{k}", x, 16, width, kernel=1, act=None)
            y = b.node(
                "Reshape",
                [y, b.const(f"{kind}{k}_rows", np.array([1, width, -1]))],
                f"{kind}{k}_flat",
            )
            y = b.node("Transpose", [y], f"{kind}{k}_t", perm=[0, 2, 1])
            if kind == "cls":
                scores.append(b.node("Sigmoid", [y], f"cls{k}_sig"))
            else:
                y = b.node(
                    "Reshape",
                    [y, b.const(f"reg{k}_d", np.array([1, hw, 4, reg_max + 1]))],
                    f"reg{k}_dist",
                )
                y = b.node("Softmax", [y], f"reg{k}_p", axis=-1)
                dists.append(
                    b.node(
                        "MatMul",
                        [y, b.const(f"proj{k}", np.arange(reg_max + 1, dtype=np.float32))],
                        f"reg{k}_ltrb",
                    )
                )
    b.node("Concat", scores, "scores", axis=1)
    b.node("Concat", dists, "distances", axis=1)
    return b.model("gfl_head", {"x": [1, 3, 32, 32]}, ["scores", "distances"], opset=11)


def yolov9_adown() -> onnx.ModelProto:
    """YOLOv9 ADown: AveragePool 2x2/1, Split in channel halves, 3x3/2 conv on one, MaxPool
    3x3/2 + 1x1 conv on the other, Concat; then RepNCSPELAN-style Split/Concat of convs."""
    b = Builder()
    x = b.conv("stem", "x", 3, 16, stride=2, act="silu")
    x = b.node("AveragePool", [x], "ad_avg", kernel_shape=[2, 2], strides=[1, 1])
    a, c = b.nodes_out("Split", [x, b.const("halves", np.array([8, 8]))], ["ad_a", "ad_b"], axis=1)
    a = b.conv("ad_cv1", a, 8, 8, stride=2, act="silu")
    c = b.node("MaxPool", [c], "ad_max", kernel_shape=[3, 3], strides=[2, 2], pads=[1] * 4)
    c = b.conv("ad_cv2", c, 8, 8, kernel=1, act="silu")
    x = b.node("Concat", [a, c], "adown", axis=1)
    y = b.conv("elan_cv1", x, 16, 16, kernel=1, act="silu")
    p, q = b.nodes_out(
        "Split", [y, b.const("elan_halves", np.array([8, 8]))], ["elan_a", "elan_b"], axis=1
    )
    r = b.conv("elan_cv2", q, 8, 8, act="silu")
    s = b.conv("elan_cv3", r, 8, 8, act="silu")
    y = b.node("Concat", [p, q, r, s], "elan_cat", axis=1)
    b.conv("elan_cv4", y, 32, 16, kernel=1, act="silu")
    return b.model("yolov9_adown", {"x": [1, 3, 32, 32]}, ["elan_cv4_silu"], opset=13)


def yolov6_repvgg() -> onnx.ModelProto:
    """YOLOv6 / RepVGG training-time blocks exported unfused (opset 12): 3x3 Conv+BN,
    1x1 Conv+BN and an identity BN summed, Relu."""
    b, c = Builder(), 16
    x = b.conv("stem", "x", 3, c, stride=2)
    for k in range(2):
        w3 = b.weight(f"r{k}_w3", c, c, 3, 3)
        d = b.batch_norm(
            f"r{k}_bn3", b.node("Conv", [x, w3], f"r{k}_c3", kernel_shape=[3, 3], pads=[1] * 4), c
        )
        w1 = b.weight(f"r{k}_w1", c, c, 1, 1)
        o = b.batch_norm(f"r{k}_bn1", b.node("Conv", [x, w1], f"r{k}_c1", kernel_shape=[1, 1]), c)
        i = b.batch_norm(f"r{k}_id", x, c)
        x = b.node(
            "Relu",
            [b.node("Add", [b.node("Add", [d, o], f"r{k}_add1"), i], f"r{k}_add2")],
            f"r{k}_out",
        )
    b.conv("head", x, c, 8, kernel=1, act=None)
    return b.model("yolov6_repvgg", {"x": [1, 3, 32, 32]}, ["head_conv"], opset=12)


def retinaface() -> onnx.ModelProto:
    """RetinaFace: FPN (1x1 laterals, nearest Resize with sizes, Add, 3x3 merge), SSH-less heads
    per stride: ClassHead Transpose + Reshape(1, -1, 2), BboxHead (·, 4), LandmarkHead (·, 10),
    Concat over strides, Softmax(-1) on classes."""
    b = Builder()
    c3 = b.conv("b1", b.conv("b0", "x", 3, 16, stride=2), 16, 16, stride=2)
    c4 = b.conv("b2", c3, 16, 32, stride=2)
    l3 = b.conv("lat3", c3, 16, 16, kernel=1)
    l4 = b.conv("lat4", c4, 32, 16, kernel=1)
    empty = b.const("no_scales", np.array([], np.float32))
    up = b.node(
        "Resize",
        [
            l4,
            b.const("no_roi", np.array([], np.float32)),
            empty,
            b.const("sizes", np.array([1, 16, 8, 8])),
        ],
        "up4",
        mode="nearest",
    )
    l3 = b.conv("merge3", b.node("Add", [l3, up], "sum3"), 16, 16)
    outs = {"cls": [], "box": [], "ldm": []}
    for k, f in enumerate((l3, l4)):
        for kind, width in (("cls", 2), ("box", 4), ("ldm", 10)):
            y = b.conv(f"{kind}{k}", f, 16, 2 * width, kernel=1, act=None)
            y = b.node("Transpose", [y], f"{kind}{k}_t", perm=[0, 2, 3, 1])
            outs[kind].append(
                b.node(
                    "Reshape",
                    [y, b.const(f"{kind}{k}_s", np.array([1, -1, width]))],
                    f"{kind}{k}_r",
                )
            )
    b.node("Softmax", [b.node("Concat", outs["cls"], "cls_cat", axis=1)], "conf", axis=-1)
    b.node("Concat", outs["box"], "loc", axis=1)
    b.node("Concat", outs["ldm"], "landms", axis=1)
    return b.model("retinaface", {"x": [1, 3, 32, 32]}, ["loc", "conf", "landms"], opset=11)


def yolov5_focus() -> onnx.ModelProto:
    """YOLOv5 v5.0 Focus: x[..., ::2, ::2] etc. as two step-2 Slices each (H then W), Concat of
    the four, conv; then a Detect layer Reshape(1, 3, 85, H, W) → Transpose(0,1,3,4,2) →
    Sigmoid → grid/anchor decode → Reshape(1, -1, 85)."""
    b, no = Builder(), 9
    parts = []
    for k, (i, j) in enumerate(((0, 0), (1, 0), (0, 1), (1, 1))):
        y = "images"
        for axis, start in ((2, i), (3, j)):
            names = [
                b.const(f"f{k}_{axis}_{m}", np.array([v]))
                for m, v in enumerate((start, 2**62, axis, 2))
            ]
            y = b.node("Slice", [y, *names], f"focus{k}_{axis}")
        parts.append(y)
    x = b.conv("focus", b.node("Concat", parts, "focus_cat", axis=1), 12, 16, act="silu")
    x = b.conv("down", x, 16, 16, stride=2, act="silu")
    y = b.conv("detect", x, 16, 3 * no, kernel=1, act=None)
    y = b.node("Reshape", [y, b.const("d5", np.array([1, 3, no, 8, 8]))], "d_r")
    y = b.node("Sigmoid", [b.node("Transpose", [y], "d_t", perm=[0, 1, 3, 4, 2])], "d_sig")
    xy = b.slice("xy", y, 0, 2, 4)
    wh = b.slice("wh", y, 2, 4, 4)
    rest = b.slice("rest", y, 4, no, 4)
    grid = (
        np.stack(np.meshgrid(np.arange(8), np.arange(8)), -1)
        .reshape(1, 1, 8, 8, 2)
        .astype(np.float32)
        - 0.5
    )
    xy = b.node(
        "Mul",
        [
            b.node(
                "Add",
                [
                    b.node("Mul", [xy, b.const("two", np.array(2.0, np.float32))], "xy2"),
                    b.const("grid", grid),
                ],
                "xyg",
            ),
            b.const("stride", np.array(4.0, np.float32)),
        ],
        "xy_out",
    )
    wh2 = b.node("Mul", [wh, b.const("two_b", np.array(2.0, np.float32))], "wh2")
    anchors = b.rng.uniform(4, 16, (1, 3, 1, 1, 2)).astype(np.float32)
    wh = b.node("Mul", [b.node("Mul", [wh2, wh2], "wh_sq"), b.const("anchors", anchors)], "wh_out")
    y = b.node("Concat", [xy, wh, rest], "decoded", axis=4)
    b.node("Reshape", [y, b.const("rows", np.array([1, -1, no]))], "output")
    return b.model("yolov5_focus", {"images": [1, 3, 32, 32]}, ["output"], opset=12)


def regnet() -> onnx.ModelProto:
    """RegNetY / ResNeXt: grouped 3x3 convs (group width 8), SE with ReduceMean, residual."""
    b, c = Builder(), 32
    x = b.conv("stem", "x", 3, c, stride=2)
    for k in range(2):
        h = b.conv(f"b{k}_a", x, c, c, kernel=1)
        h = b.conv(f"b{k}_b", h, c, c, stride=1, group=4)
        s = b.node("ReduceMean", [h], f"b{k}_se_m", axes=[2, 3], keepdims=1)
        s = b.conv(f"b{k}_se_e", b.conv(f"b{k}_se_r", s, c, 8, kernel=1), 8, c, kernel=1, act=None)
        h = b.node("Mul", [h, b.node("Sigmoid", [s], f"b{k}_se_g")], f"b{k}_se")
        h = b.conv(f"b{k}_c", h, c, c, kernel=1, act=None)
        x = b.node("Relu", [b.node("Add", [x, h], f"b{k}_add")], f"b{k}_out")
    x = b.node("Flatten", [b.node("GlobalAveragePool", [x], "gap")], "flat")
    b.node("Gemm", [x, b.weight("fc_w", 10, c), b.weight("fc_b", 10)], "logits", transB=1)
    return b.model("regnet", {"x": [1, 3, 32, 32]}, ["logits"], opset=13)


def ghostnet() -> onnx.ModelProto:
    """GhostNet module: primary 1x1 conv, cheap depthwise 3x3, Concat, Slice [:, :oup]; SE with
    hard_sigmoid spelled out (Add 3, Clip 0..6, Div 6); GAP, 1x1 conv head, Flatten, Gemm."""
    b = Builder()
    x = b.conv("stem", "x", 3, 16, stride=2)
    for k in range(2):
        p = b.conv(f"g{k}_p", x, 16, 8, kernel=1)
        cheap = b.conv(f"g{k}_c", p, 8, 8, group=8)
        y = b.node("Concat", [p, cheap], f"g{k}_cat", axis=1)
        y = b.slice(f"g{k}_out", y, 0, 14 if k == 0 else 16, 1)
        if k == 0:
            y = b.conv("g0_fix", y, 14, 16, kernel=1, act=None)
        s = b.node("ReduceMean", [y], f"se{k}_m", axes=[2, 3], keepdims=1)
        s = b.conv(f"se{k}_e", b.conv(f"se{k}_r", s, 16, 4, kernel=1), 4, 16, kernel=1, act=None)
        s = b.node("Add", [s, b.const(f"se{k}_3", np.array(3.0, np.float32))], f"se{k}_a3")
        s = b.node(
            "Clip",
            [
                s,
                b.const(f"se{k}_lo", np.array(0.0, np.float32)),
                b.const(f"se{k}_hi", np.array(6.0, np.float32)),
            ],
            f"se{k}_clip",
        )
        s = b.node("Div", [s, b.const(f"se{k}_6", np.array(6.0, np.float32))], f"se{k}_hs")
        x = b.node("Add", [x, b.node("Mul", [y, s], f"se{k}_mul")], f"g{k}_res")
    x = b.node("GlobalAveragePool", [x], "gap")
    x = b.node("Flatten", [b.conv("head", x, 16, 32, kernel=1)], "flat")
    b.node("Gemm", [x, b.weight("fc_w", 10, 32), b.weight("fc_b", 10)], "logits", transB=1)
    return b.model("ghostnet", {"x": [1, 3, 32, 32]}, ["logits"], opset=13)


def squeezenet() -> onnx.ModelProto:
    """SqueezeNet 1.1: MaxPool ceil_mode, Fire modules (squeeze 1x1, expand 1x1 ‖ 3x3 Concat),
    final 1x1 conv + Relu, GAP, Flatten, Softmax."""
    b = Builder()
    x = b.conv("stem", "x", 3, 16, stride=2)
    x = b.node("MaxPool", [x], "pool", kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1)
    for k in range(2):
        s = b.conv(f"f{k}_sq", x, 16, 4, kernel=1)
        x = b.node(
            "Concat",
            [b.conv(f"f{k}_e1", s, 4, 8, kernel=1), b.conv(f"f{k}_e3", s, 4, 8)],
            f"f{k}",
            axis=1,
        )
    x = b.node("GlobalAveragePool", [b.conv("cls", x, 16, 10, kernel=1)], "gap")
    b.node("Softmax", [b.node("Flatten", [x], "flat")], "probs", axis=1)
    return b.model("squeezenet", {"x": [1, 3, 33, 33]}, ["probs"], opset=11)


def inception_v3() -> onnx.ModelProto:
    """Inception-v3 block C: asymmetric 1x7 / 7x1 convs (pads (0,3)/(3,0)), an AveragePool 3x3/1
    with count_include_pad=0 branch, Concat."""
    b, c = Builder(), 16
    x = b.conv("stem", "x", 3, c, stride=2)

    def asym(name: str, y: str, cin: int, cout: int, kh: int, kw: int) -> str:
        w = [b.weight(f"{name}_w", cout, cin, kh, kw), b.weight(f"{name}_b", cout)]
        y = b.node(
            "Conv",
            [y, *w],
            f"{name}_conv",
            kernel_shape=[kh, kw],
            pads=[kh // 2, kw // 2, kh // 2, kw // 2],
        )
        return b.node("Relu", [y], f"{name}_relu")

    b1 = b.conv("b1", x, c, 8, kernel=1)
    b7 = asym("b7_3", asym("b7_2", b.conv("b7_1", x, c, 8, kernel=1), 8, 8, 1, 7), 8, 8, 7, 1)
    bp = b.node(
        "AveragePool", [x], "bp_pool", kernel_shape=[3, 3], pads=[1] * 4, count_include_pad=0
    )
    bp = b.conv("bp", bp, c, 8, kernel=1)
    x = b.node("Concat", [b1, b7, bp], "mixed", axis=1)
    x = b.node("Flatten", [b.node("GlobalAveragePool", [x], "gap")], "flat")
    b.node("Gemm", [x, b.weight("fc_w", 10, 24), b.weight("fc_b", 10)], "logits", transB=1)
    return b.model("inception_v3", {"x": [1, 3, 32, 32]}, ["logits"], opset=11)


def efficientnet_tf() -> onnx.ModelProto:
    """EfficientNet-B0 TF port (opset 11): 'same' padding as an explicit asymmetric Pad
    (0 before, 1 after) then an unpadded stride-2 Conv, Swish, depthwise with Pad, SE."""
    b = Builder()

    def same(name: str, y: str, cin: int, cout: int, k: int, stride: int, group: int = 1) -> str:
        total = max(k - stride, 0)
        pads = np.array(
            [0, 0, total // 2, total // 2, 0, 0, total - total // 2, total - total // 2]
        )
        y = b.node("Pad", [y, b.const(f"{name}_pads", pads)], f"{name}_pad", mode="constant")
        w = [b.weight(f"{name}_w", cout, cin // group, k, k), b.weight(f"{name}_b", cout)]
        y = b.node(
            "Conv",
            [y, *w],
            f"{name}_conv",
            kernel_shape=[k, k],
            strides=[stride, stride],
            group=group,
        )
        return b.node("Mul", [y, b.node("Sigmoid", [y], f"{name}_sig")], f"{name}_swish")

    x = same("stem", "x", 3, 16, 3, 2)
    h = same("dw", x, 16, 16, 3, 2, group=16)
    s = b.node("ReduceMean", [h], "se_m", axes=[2, 3], keepdims=1)
    s = b.conv("se_e", b.conv("se_r", s, 16, 4, kernel=1, act="silu"), 4, 16, kernel=1, act=None)
    h = b.node("Mul", [h, b.node("Sigmoid", [s], "se_g")], "se")
    h = b.conv("proj", h, 16, 24, kernel=1, act=None)
    x = b.node("Flatten", [b.node("GlobalAveragePool", [h], "gap")], "flat")
    b.node("Gemm", [x, b.weight("fc_w", 10, 24), b.weight("fc_b", 10)], "logits", transB=1)
    return b.model("efficientnet_tf", {"x": [1, 3, 32, 32]}, ["logits"], opset=11)


def crnn_bilstm() -> onnx.ModelProto:
    """CRNN (PaddleOCR / old torch port): BiLSTM written as a forward LSTM and a backward one on
    the time-reversed sequence (Slice step −1), reversed back, Concat; Linear, Softmax and the
    greedy CTC decode ArgMax(−1)."""
    b, hidden = Builder(), 16
    x = b.conv("c1", "x", 3, 16, stride=2)
    x = b.conv("c2", x, 16, 32, stride=2)
    x = b.node("MaxPool", [x], "pool", kernel_shape=[8, 1], strides=[8, 1])
    x = b.node("Squeeze", [x, b.const("h_ax", np.array([2]))], "seq")
    x = b.node("Transpose", [x], "tm", perm=[2, 0, 1])

    def rev(name: str, y: str) -> str:
        names = [b.const(f"{name}_{m}", np.array([v])) for m, v in enumerate((-1, -(2**63), 0, -1))]
        return b.node("Slice", [y, *names], name)

    outs = []
    for d, seq in (("fw", x), ("bw", rev("rev_in", x))):
        w = [
            b.weight(f"{d}_w", 1, 4 * hidden, 32),
            b.weight(f"{d}_r", 1, 4 * hidden, hidden),
            b.weight(f"{d}_b", 1, 8 * hidden),
        ]
        y = b.node(
            "Squeeze",
            [
                b.node("LSTM", [seq, *w], f"{d}_lstm", hidden_size=hidden),
                b.const(f"{d}_ax", np.array([1])),
            ],
            f"{d}_out",
        )
        outs.append(y if d == "fw" else rev("rev_out", y))
    x = b.node("Concat", outs, "bi", axis=-1)
    x = b.linear("fc", x, 2 * hidden, 11)
    x = b.node("Softmax", [x], "probs", axis=-1)
    b.node("ArgMax", [x], "labels", axis=-1, keepdims=0)
    return b.model(
        "crnn_bilstm",
        {"x": [1, 3, 32, 64]},
        ["probs", "labels"],
        opset=13,
        types={"labels": TensorProto.INT64},
    )


def east() -> onnx.ModelProto:
    """EAST: U-shaped merge (Resize up, Concat, 1x1 + 3x3), score Sigmoid, geometry
    Sigmoid·scale, angle (Sigmoid − 0.5)·π/2, Concat of geometry and angle."""
    b = Builder()
    f1 = b.conv("f1", "x", 3, 16, stride=2)
    f2 = b.conv("f2", f1, 16, 32, stride=2)
    up = b.node(
        "Resize",
        [f2, "", b.const("up_scales", np.array([1, 1, 2, 2], np.float32))],
        "up",
        mode="linear",
    )
    h = b.conv(
        "m2", b.conv("m1", b.node("Concat", [up, f1], "cat", axis=1), 48, 16, kernel=1), 16, 16
    )
    score = b.node("Sigmoid", [b.conv("score", h, 16, 1, kernel=1, act=None)], "score_map")
    geo = b.node(
        "Mul",
        [
            b.node("Sigmoid", [b.conv("geo", h, 16, 4, kernel=1, act=None)], "geo_sig"),
            b.const("scope", np.array(512.0, np.float32)),
        ],
        "geo_map",
    )
    ang = b.node(
        "Sub",
        [
            b.node("Sigmoid", [b.conv("ang", h, 16, 1, kernel=1, act=None)], "ang_sig"),
            b.const("half", np.array(0.5, np.float32)),
        ],
        "ang_c",
    )
    ang = b.node("Mul", [ang, b.const("quarter_pi", np.array(np.pi / 2, np.float32))], "angle")
    b.node("Concat", [geo, ang], "geometry", axis=1)
    return b.model("east", {"x": [1, 3, 32, 32]}, [score, "geometry"], opset=13)


def parseq_decoder() -> onnx.ModelProto:
    """ABINet / PARSeq-style positional attention: a constant positional query (1, T, C) over
    visual tokens (flatten(2).transpose), cross-attention (q from the queries, k/v Linear of the
    memory), LayerNorm, classifier Linear and greedy ArgMax."""
    b, c, t, heads = Builder(), 32, 8, 2
    hd = c // heads
    x = b.conv("c2", b.conv("c1", "x", 3, 16, stride=2), 16, c, stride=2)
    x = b.node("Reshape", [x, b.const("flat", np.array([1, c, -1]))], "mem_rows")
    mem = b.layer_norm("mem_ln", b.node("Transpose", [x], "memory", perm=[0, 2, 1]), c, eps=1e-5)
    q = _split_heads(
        b, "q", b.linear("q", b.weight("pos_queries", 1, t, c), c, c), (1, t, heads, hd)
    )
    k = _split_heads(b, "k", b.linear("k", mem, c, c), (1, 64, heads, hd), perm=(0, 2, 3, 1))
    v = _split_heads(b, "v", b.linear("v", mem, c, c), (1, 64, heads, hd))
    s = b.node(
        "Mul",
        [b.node("MatMul", [q, k], "qk"), b.const("scale", np.array(hd**-0.5, np.float32))],
        "qk_s",
    )
    o = b.node(
        "Transpose",
        [b.node("MatMul", [b.node("Softmax", [s], "attn", axis=-1), v], "av")],
        "av_t",
        perm=[0, 2, 1, 3],
    )
    o = b.linear("out", b.node("Reshape", [o, b.const("merge", np.array([1, t, c]))], "av_m"), c, c)
    o = b.layer_norm("dec_ln", o, c, eps=1e-5)
    logits = b.linear("head", o, c, 20)
    b.node("ArgMax", [logits], "labels", axis=-1, keepdims=0)
    return b.model(
        "parseq_decoder",
        {"x": [1, 3, 16, 64]},
        [logits, "labels"],
        opset=14,
        types={"labels": TensorProto.INT64},
    )


def levit() -> onnx.ModelProto:
    """LeViT (timm, opset 14): Linear+BatchNorm1d applied on flatten(0,1) (Reshape to (N·L, C),
    BatchNormalization rank 2, Reshape back), Hardswish op, attention with a learned bias
    gathered by constant indices (attention_biases[:, idxs]) added to scaled scores."""
    b, c, heads, n = Builder(), 32, 2, 16
    kd, hd = 8, 16
    x = b.node("HardSwish", [b.conv("stem", "x", 3, c, stride=2, act=None)], "stem_hs")
    x = b.conv("stem2", x, c, c, stride=2, act=None)
    x = b.node(
        "Transpose",
        [b.node("Reshape", [x, b.const("flat", np.array([1, c, -1]))], "rows")],
        "tok",
        perm=[0, 2, 1],
    )

    def lin_bn(name: str, y: str, cin: int, cout: int) -> str:
        y = b.node("MatMul", [y, b.weight(f"{name}_w", cin, cout)], f"{name}_mm")
        y = b.node("Reshape", [y, b.const(f"{name}_2d", np.array([n, cout]))], f"{name}_flat")
        y = b.batch_norm(f"{name}_bn", y, cout)
        return b.node("Reshape", [y, b.const(f"{name}_3d", np.array([1, n, cout]))], f"{name}_out")

    qkv = lin_bn("qkv", x, c, heads * (2 * kd + hd))
    qkv = b.node("Reshape", [qkv, b.const("qkv4", np.array([1, n, heads, 2 * kd + hd]))], "qkv_h")
    q, k, v = b.nodes_out(
        "Split", [qkv, b.const("sizes", np.array([kd, kd, hd]))], ["q", "k", "v"], axis=3
    )
    q = b.node("Transpose", [q], "q_t", perm=[0, 2, 1, 3])
    k = b.node("Transpose", [k], "k_t", perm=[0, 2, 3, 1])
    v = b.node("Transpose", [v], "v_t", perm=[0, 2, 1, 3])
    s = b.node(
        "Mul",
        [b.node("MatMul", [q, k], "qk"), b.const("scale", np.array(kd**-0.5, np.float32))],
        "qk_s",
    )
    idx = np.abs(np.arange(n)[:, None] - np.arange(n)[None]).astype(np.int64)
    bias = b.node(
        "Gather", [b.weight("attn_biases", heads, n), b.const("bias_idxs", idx)], "bias", axis=1
    )
    s = b.node("Add", [s, bias], "qk_b")
    o = b.node("MatMul", [b.node("Softmax", [s], "attn", axis=-1), v], "av")
    o = b.node(
        "Reshape",
        [
            b.node("Transpose", [o], "av_t", perm=[0, 2, 1, 3]),
            b.const("merge", np.array([1, n, heads * hd])),
        ],
        "av_m",
    )
    o = lin_bn("proj", b.node("HardSwish", [o], "proj_hs"), heads * hd, c)
    x = b.node("Add", [x, o], "res")
    x = b.node("ReduceMean", [x], "pool", axes=[1], keepdims=0)
    x = b.batch_norm("head_bn", x, c)
    b.node("Gemm", [x, b.weight("head_w", 10, c), b.weight("head_b", 10)], "logits", transB=1)
    return b.model("levit", {"x": [1, 3, 16, 16]}, ["logits"], opset=14)


def mvitv2_relative_position() -> onnx.ModelProto:
    """timm MViTv2's decomposed relative positions (as SAM and ViTDet): q viewed (1, heads,
    qh, qw, c), Einsum "byhwc,hkc->byhwk" and "byhwc,wkc->byhwk" with the per-row and
    per-column tables, both added to the scores viewed (1, heads, qh, qw, kh, kw) — five
    non-unit axes — and written back over the scores by ScatterND (attn[:, :, 0:, 0:] = …,
    no class token); Softmax, ·v, heads merged, projection."""
    b, c, heads, side = Builder(), 16, 2, 4
    hd, n = c // heads, side * side
    x = b.node(
        "Reshape",
        [b.conv("stem", "x", 3, c, act=None), b.const("rows", np.array([1, c, n]))],
        "rows_v",
    )
    x = b.layer_norm("n1", b.node("Transpose", [x], "tokens", perm=[0, 2, 1]), c)
    q, k, v = (_split_heads(b, p, b.linear(p, x, c, c), (1, -1, heads, hd)) for p in "qkv")
    scale = b.const("scale", np.array(hd**-0.5, np.float32))
    kt = b.node("Transpose", [k], "kT", perm=[0, 1, 3, 2])
    attn = b.node("MatMul", [b.node("Mul", [q, scale], "q_s"), kt], "attn")
    r_q = b.node("Reshape", [q, b.const("q_grid", np.array([1, heads, side, side, hd]))], "r_q")
    rel_h = b.node(
        "Einsum",
        [r_q, b.weight("rel_h_table", side, side, hd)],
        "rel_h",
        equation="byhwc,hkc->byhwk",
    )
    rel_w = b.node(
        "Einsum",
        [r_q, b.weight("rel_w_table", side, side, hd)],
        "rel_w",
        equation="byhwc,wkc->byhwk",
    )
    grid = b.node(
        "Reshape",
        [attn, b.const("attn_grid", np.array([1, heads, side, side, side, side]))],
        "attn6",
    )
    last, before_last = b.const("ax_last", np.array([-1])), b.const("ax_before", np.array([-2]))
    grid = b.node("Add", [grid, b.node("Unsqueeze", [rel_h, last], "rel_h6")], "attn_h")
    grid = b.node("Add", [grid, b.node("Unsqueeze", [rel_w, before_last], "rel_w6")], "attn_hw")
    biased = b.node("Reshape", [grid, b.const("attn_flat", np.array([1, heads, n, n]))], "attn_rel")
    every = np.stack(np.meshgrid(*(np.arange(d) for d in (1, heads, n, n)), indexing="ij"), axis=-1)
    attn = b.node("ScatterND", [attn, b.const("every", every.astype(np.int64)), biased], "attn_set")
    o = b.node("MatMul", [b.node("Softmax", [attn], "probs", axis=-1), v], "ctx")
    o = b.node("Transpose", [o], "ctx_t", perm=[0, 2, 1, 3])
    o = b.linear(
        "proj", b.node("Reshape", [o, b.const("merge", np.array([1, -1, c]))], "merged"), c, c
    )
    return b.model("mvitv2_relative_position", {"x": [1, 3, side, side]}, [o], opset=13)


def deberta_disentangled_attention() -> onnx.ModelProto:
    """HF DeBERTa-v2/v3 (TorchScript, opset 14): q and k in (heads, L, hd), scaled, scored
    against the projected relative-position embeddings (constants after folding: [heads, hd,
    2·span]) by a batched MatMul, and the distance of each (query, key) pair picked by
    GatherElements along the last axis — index span + i − j for content-to-position, span −
    i + j for position-to-content (then transposed) — added to q·kᵀ; Softmax, ·v, output
    projection, post-LN."""
    b, c, heads, length, span = Builder(), 32, 2, 8, 16
    hd = c // heads
    x = b.node("Gather", [b.weight("word_emb", 40, c), "input_ids"], "words", axis=0)
    x = b.layer_norm("emb_ln", x, c, eps=1e-7)

    def heads_of(name: str) -> str:
        y = _split_heads(b, name, b.linear(name, x, c, c), (1, -1, heads, hd))
        return b.node(
            "Reshape", [y, b.const(f"{name}_3d", np.array([heads, length, hd]))], f"{name}_bh"
        )

    q, k, v = heads_of("q"), heads_of("k"), heads_of("v")
    scale = b.const("scale", np.array(1 / np.sqrt(3 * hd), np.float32))
    kt = b.node("Transpose", [b.node("Mul", [k, scale], "k_s")], "kT", perm=[0, 2, 1])
    scores = b.node("MatMul", [q, kt], "scores")
    i, j = np.arange(length)[:, None], np.arange(length)[None, :]
    for name, reader, index in (("c2p", q, span + i - j), ("p2c", k, span - i + j)):
        rel = b.weight(f"{name}_pos", heads, hd, 2 * span)
        table = np.broadcast_to(index, (heads, length, length)).astype(np.int64)
        picked = b.node(
            "GatherElements",
            [b.node("MatMul", [reader, rel], f"{name}_all"), b.const(f"{name}_index", table)],
            f"{name}_att",
            axis=-1,
        )
        if name == "p2c":
            picked = b.node("Transpose", [picked], "p2c_t", perm=[0, 2, 1])
        scores = b.node("Add", [scores, b.node("Mul", [picked, scale], f"{name}_s")], f"{name}_sum")
    attn = b.node("Softmax", [scores], "attn", axis=-1)
    o = b.node("MatMul", [attn, v], "ctx")
    o = b.node("Reshape", [o, b.const("ctx4", np.array([1, heads, length, hd]))], "ctx_4d")
    o = b.node("Transpose", [o], "ctx_t", perm=[0, 2, 1, 3])
    o = b.linear(
        "out", b.node("Reshape", [o, b.const("merge", np.array([1, -1, c]))], "merged"), c, c
    )
    b.layer_norm("sa_ln", b.node("Add", [o, x], "res1"), c, eps=1e-7)
    return b.model(
        "deberta_disentangled_attention",
        {"input_ids": [1, length]},
        ["sa_ln_out"],
        opset=14,
        types={"input_ids": TensorProto.INT64},
    )


def distilbert() -> onnx.ModelProto:
    """HF DistilBERT (opset 14): word + position Gather embeddings, LayerNorm spelled out, the
    mask applied by masked_fill: Equal(mask, 0) → Reshape(1,1,1,L) → Expand → Where(mask,
    finfo.min, scores), q divided by √hd before the MatMul, post-LN FFN with erf-GELU."""
    b, c, heads, length = Builder(), 32, 2, 12
    hd = c // heads
    x = b.node("Gather", [b.weight("word_emb", 40, c), "input_ids"], "words", axis=0)
    x = b.node("Add", [x, b.weight("pos_emb", 1, length, c)], "emb")
    x = b.layer_norm("emb_ln", x, c, eps=1e-12)
    q = _split_heads(b, "q", b.linear("q", x, c, c), (1, -1, heads, hd))
    q = b.node("Div", [q, b.const("sqrt_d", np.array(np.sqrt(hd), np.float32))], "q_s")
    k = _split_heads(b, "k", b.linear("k", x, c, c), (1, -1, heads, hd))
    v = _split_heads(b, "v", b.linear("v", x, c, c), (1, -1, heads, hd))
    s = b.node("MatMul", [q, b.node("Transpose", [k], "kT", perm=[0, 1, 3, 2])], "scores")
    m = b.node("Equal", ["attention_mask", b.const("zero", np.array(0, np.int64))], "mask0")
    m = b.node("Reshape", [m, b.const("mask_shape", np.array([1, 1, 1, length]))], "mask4")
    m = b.node("Expand", [m, b.const("mask_full", np.array([1, heads, length, length]))], "mask_x")
    s = b.node(
        "Where", [m, b.const("neg", np.array(np.finfo(np.float32).min, np.float32)), s], "masked"
    )
    o = b.node(
        "Transpose",
        [b.node("MatMul", [b.node("Softmax", [s], "attn", axis=-1), v], "av")],
        "av_t",
        perm=[0, 2, 1, 3],
    )
    o = b.linear(
        "out", b.node("Reshape", [o, b.const("merge", np.array([1, -1, c]))], "av_m"), c, c
    )
    x = b.layer_norm("sa_ln", b.node("Add", [o, x], "res1"), c, eps=1e-12)
    h = b.linear("lin2", b.gelu("gelu", b.linear("lin1", x, c, 2 * c)), 2 * c, c)
    b.layer_norm("out_ln", b.node("Add", [h, x], "res2"), c, eps=1e-12)
    return b.model(
        "distilbert",
        {"input_ids": [1, length], "attention_mask": [1, length]},
        ["out_ln_out"],
        opset=14,
        types={"input_ids": TensorProto.INT64, "attention_mask": TensorProto.INT64},
    )


def _shape_dim(b: Builder, name: str, x: str, index: int) -> str:
    """x.shape[index] as torch exports it for a dynamic dim: Shape → Gather → Unsqueeze."""
    s = b.node("Shape", [x], f"{name}_shape")
    g = b.node("Gather", [s, b.const(f"{name}_idx", np.array(index))], f"{name}_dim", axis=0)
    return b.node("Unsqueeze", [g, b.const(f"{name}_ax", np.array([0]))], f"{name}_u")


def dynamic_vit() -> onnx.ModelProto:
    """torch.onnx with dynamic_axes={'x': {0: 'batch'}}: every view reads its batch size from
    Shape → Gather → Unsqueeze → Concat."""
    b, c, heads = Builder(), 32, 2
    hd = c // heads
    x = b.node(
        "Conv",
        ["x", b.weight("pw", c, 3, 8, 8), b.weight("pb", c)],
        "patch",
        kernel_shape=[8, 8],
        strides=[8, 8],
    )
    bs = _shape_dim(b, "b0", x, 0)
    shp = b.node("Concat", [bs, b.const("c_m1", np.array([c, -1]))], "flat_shape", axis=0)
    x = b.node("Transpose", [b.node("Reshape", [x, shp], "flat")], "tok", perm=[0, 2, 1])
    h = b.layer_norm("ln", x, c)
    qkv = b.linear("qkv", h, c, 3 * c)
    bs1 = _shape_dim(b, "b1", h, 0)
    n1 = _shape_dim(b, "n1", h, 1)
    shp = b.node(
        "Concat", [bs1, n1, b.const("qkv_rest", np.array([3, heads, hd]))], "qkv_shape", axis=0
    )
    qkv = b.node("Transpose", [b.node("Reshape", [qkv, shp], "qkv5")], "qkvT", perm=[2, 0, 3, 1, 4])
    q, k, v = (
        b.node("Gather", [qkv, b.const(f"i{j}", np.array(j))], t, axis=0)
        for j, t in enumerate("qkv")
    )
    s = b.node(
        "Mul",
        [
            b.node("MatMul", [q, b.node("Transpose", [k], "kT", perm=[0, 1, 3, 2])], "qk"),
            b.const("scale", np.array(hd**-0.5, np.float32)),
        ],
        "qk_s",
    )
    o = b.node(
        "Transpose",
        [b.node("MatMul", [b.node("Softmax", [s], "attn", axis=-1), v], "av")],
        "avT",
        perm=[0, 2, 1, 3],
    )
    shp = b.node("Concat", [bs1, n1, b.const("c_only", np.array([c]))], "merge_shape", axis=0)
    o = b.linear("proj", b.node("Reshape", [o, shp], "merged"), c, c)
    x = b.node("Add", [x, o], "res")
    x = b.node("ReduceMean", [x], "pool", axes=[1], keepdims=0)
    b.node("Gemm", [x, b.weight("hw", 10, c), b.weight("hb", 10)], "logits", transB=1)
    m = b.model("dynamic_vit", {"x": [1, 3, 32, 32]}, ["logits"], opset=13)
    m.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "batch"
    return m


def groupnorm_head() -> onnx.ModelProto:
    """FCOS / mmdet GroupNorm at opset < 18: Reshape(1, G, -1) → InstanceNormalization (ones,
    zeros) → Reshape(shape of x) → Mul γ(C,1,1) → Add β → Relu."""
    b, c, g = Builder(), 16, 4
    x = b.conv("stem", "x", 3, c, stride=2, act=None)
    for k in range(2):
        y = b.node("Reshape", [x, b.const(f"gn{k}_grp", np.array([1, g, -1]))], f"gn{k}_r")
        y = b.node(
            "InstanceNormalization",
            [
                y,
                b.const(f"gn{k}_one", np.ones(g, np.float32)),
                b.const(f"gn{k}_zero", np.zeros(g, np.float32)),
            ],
            f"gn{k}_in",
            epsilon=1e-5,
        )
        y = b.node("Reshape", [y, b.node("Shape", [x], f"gn{k}_shape")], f"gn{k}_back")
        y = b.node(
            "Mul",
            [y, b.const(f"gn{k}_g", (1 + b.rng.normal(0, 0.1, (c, 1, 1))).astype(np.float32))],
            f"gn{k}_mul",
        )
        y = b.node("Add", [y, b.weight(f"gn{k}_b", c, 1, 1)], f"gn{k}_add")
        x = b.conv(f"c{k}", b.node("Relu", [y], f"gn{k}_relu"), c, c, act=None)
    b.node("Sigmoid", [b.conv("cls", x, c, 3, act=None)], "scores")
    return b.model("groupnorm_head", {"x": [1, 3, 32, 32]}, ["scores"], opset=13)


def einsum_attention() -> onnx.ModelProto:
    """Attention written with torch.einsum (exported as Einsum at opset 12+)."""
    b, c, heads, n = Builder(), 32, 2, 16
    hd = c // heads
    x = b.node(
        "Conv",
        ["x", b.weight("pw", c, 3, 8, 8), b.weight("pb", c)],
        "patch",
        kernel_shape=[8, 8],
        strides=[8, 8],
    )
    x = b.node(
        "Transpose",
        [b.node("Reshape", [x, b.const("fs", np.array([1, c, -1]))], "flat")],
        "tok",
        perm=[0, 2, 1],
    )

    def heads_of(t: str) -> str:
        y = b.node(
            "Reshape",
            [b.linear(t, x, c, c), b.const(f"{t}_s", np.array([1, n, heads, hd]))],
            f"{t}_h",
        )
        return y

    q, k, v = heads_of("q"), heads_of("k"), heads_of("v")
    s = b.node("Einsum", [q, k], "qk", equation="bqhd,bkhd->bhqk")
    p = b.node(
        "Softmax",
        [b.node("Mul", [s, b.const("scale", np.array(hd**-0.5, np.float32))], "qk_s")],
        "attn",
        axis=-1,
    )
    o = b.node("Einsum", [p, v], "av", equation="bhqk,bkhd->bqhd")
    o = b.linear("proj", b.node("Reshape", [o, b.const("m", np.array([1, n, c]))], "merged"), c, c)
    b.node("Add", [x, o], "y")
    return b.model("einsum_attention", {"x": [1, 3, 32, 32]}, ["y"], opset=13)


def fpn_size_resize() -> onnx.ModelProto:
    """torchvision / mmdet FPN: F.interpolate(top, size=lateral.shape[-2:]) exported as
    Shape → Slice [2:4] → Concat(N, C from the top) → Resize(sizes), then Add."""
    b = Builder()
    c3 = b.conv("c3", b.conv("c2", "x", 3, 16, stride=2), 16, 16, stride=2)
    c4 = b.conv("c4", c3, 16, 16, stride=2)
    l3 = b.conv("l3", c3, 16, 16, kernel=1, act=None)
    l4 = b.conv("l4", c4, 16, 16, kernel=1, act=None)
    hw = b.slice("hw", b.node("Shape", [l3], "l3_shape"), 2, 4, 0)
    nc = b.slice("nc", b.node("Shape", [l4], "l4_shape"), 0, 2, 0)
    sizes = b.node("Concat", [nc, hw], "sizes", axis=0)
    up = b.node(
        "Resize",
        [
            l4,
            b.const("roi", np.array([], np.float32)),
            b.const("sc", np.array([], np.float32)),
            sizes,
        ],
        "up",
        mode="nearest",
        coordinate_transformation_mode="asymmetric",
        nearest_mode="floor",
    )
    p3 = b.conv("p3", b.node("Add", [l3, up], "sum"), 16, 16, act=None)
    return b.model("fpn_size_resize", {"x": [1, 3, 32, 32]}, [p3], opset=11)


def opset9_ssd() -> onnx.ModelProto:
    """An old (opset 9) MobileNet-SSD style export: Clip with min/max attributes (ReLU6),
    Upsample with scales input, Slice with attributes, Flatten + Concat."""
    b = Builder()
    x = b.node("Clip", [b.conv("c1", "x", 3, 16, stride=2, act=None)], "relu6", min=0.0, max=6.0)
    x = b.conv("c2", x, 16, 16, stride=2)
    up = b.node(
        "Upsample", [x, b.const("scales", np.array([1, 1, 2, 2], np.float32))], "up", mode="nearest"
    )
    x = b.node("Concat", [up, b.conv("lat", "x", 3, 16, stride=2)], "cat", axis=1)
    x = b.node("Slice", [x], "first", starts=[0], ends=[24], axes=[1])
    loc = b.node("Transpose", [b.conv("loc", x, 24, 8, act=None)], "loc_t", perm=[0, 2, 3, 1])
    b.node("Flatten", [loc], "loc_flat", axis=1)
    return b.model("opset9_ssd", {"x": [1, 3, 32, 32]}, ["loc_flat"], opset=9)


def focus_multi_axis() -> onnx.ModelProto:
    """YOLOv5 Focus after onnx-simplifier: one Slice per quarter over axes (2, 3), step 2."""
    b = Builder()
    parts = []
    for k, (i, j) in enumerate(((0, 0), (1, 0), (0, 1), (1, 1))):
        names = [
            b.const(f"f{k}_{m}", np.array(v))
            for m, v in enumerate(([i, j], [2**62, 2**62], [2, 3], [2, 2]))
        ]
        parts.append(b.node("Slice", ["images", *names], f"focus{k}"))
    x = b.conv("focus", b.node("Concat", parts, "cat", axis=1), 12, 16, act="silu")
    b.conv("out", x, 16, 8, kernel=1, act=None)
    return b.model("focus_multi_axis", {"images": [1, 3, 32, 32]}, ["out_conv"], opset=13)


def rmsnorm_llama_like() -> onnx.ModelProto:
    """An encoder with RMSNorm spelled as Pow/ReduceMean/Add/Sqrt/Reciprocal/Mul (rsqrt → Reciprocal
    at newer torch), SwiGLU FFN (SiLU(x·W1)·(x·W3))·W2."""
    b, c = Builder(), 32
    x = b.node(
        "Conv",
        ["x", b.weight("pw", c, 3, 8, 8), b.weight("pb", c)],
        "patch",
        kernel_shape=[8, 8],
        strides=[8, 8],
    )
    x = b.node(
        "Transpose",
        [b.node("Reshape", [x, b.const("fs", np.array([1, c, -1]))], "flat")],
        "tok",
        perm=[0, 2, 1],
    )
    var = b.node(
        "ReduceMean",
        [b.node("Pow", [x, b.const("two", np.array(2.0, np.float32))], "sq")],
        "var",
        axes=[-1],
        keepdims=1,
    )
    r = b.node(
        "Reciprocal",
        [
            b.node(
                "Sqrt",
                [b.node("Add", [var, b.const("eps", np.array(1e-6, np.float32))], "ve")],
                "std",
            )
        ],
        "rstd",
    )
    h = b.node("Mul", [b.node("Mul", [x, r], "n"), b.weight("g", c)], "normed")
    g = b.node("MatMul", [h, b.weight("w1", c, 2 * c)], "up1")
    g = b.node("Mul", [g, b.node("Sigmoid", [g], "up1_sig")], "silu")
    u = b.node("MatMul", [h, b.weight("w3", c, 2 * c)], "up3")
    y = b.node("MatMul", [b.node("Mul", [g, u], "glu"), b.weight("w2", 2 * c, c)], "down")
    b.node("Add", [x, y], "y")
    return b.model("rmsnorm_llama_like", {"x": [1, 3, 32, 32]}, ["y"], opset=17)


def sdpa_bert() -> onnx.ModelProto:
    """HF BERT with sdpa attention as torch.onnx exports `scaled_dot_product_attention`
    (opset 17): the bool padding mask → Where(mask, 0, −inf) shared by both layers, added to
    the scaled scores, and the Softmax guarded by Where(IsNaN(p), 0, p) before the MatMul."""
    b, c, heads, length = Builder(), 32, 2, 12
    hd = c // heads
    x = b.node("Gather", [b.weight("word_emb", 40, c), "input_ids"], "words", axis=0)
    x = b.node("Add", [x, b.weight("pos_emb", 1, length, c)], "emb")

    def layer_norm(name: str, y: str) -> str:
        g, beta = b.weight(f"{name}_g", c), b.weight(f"{name}_b", c)
        return b.node("LayerNormalization", [y, g, beta], name, axis=-1, epsilon=1e-12)

    x = layer_norm("emb_ln", x)
    m = b.node("Cast", ["attention_mask"], "mask_b", to=TensorProto.BOOL)
    m = b.node("Reshape", [m, b.const("mask_shape", np.array([1, 1, 1, length]))], "mask4")
    m = b.node("Expand", [m, b.const("mask_full", np.array([1, 1, length, length]))], "mask_x")
    bias = b.node(
        "Where",
        [m, b.const("open", np.array(0.0, np.float32)), b.const("shut", np.float32(-np.inf))],
        "mask_bias",
    )
    scale = b.const("scale", np.array(1 / np.sqrt(hd), np.float32))
    for layer in range(2):
        n = f"l{layer}"
        q = _split_heads(b, f"{n}q", b.linear(f"{n}q", x, c, c), (1, -1, heads, hd))
        k = _split_heads(b, f"{n}k", b.linear(f"{n}k", x, c, c), (1, -1, heads, hd), (0, 2, 3, 1))
        v = _split_heads(b, f"{n}v", b.linear(f"{n}v", x, c, c), (1, -1, heads, hd))
        s = b.node("MatMul", [b.node("Mul", [q, scale], f"{n}qs"), k], f"{n}scores")
        p = b.node("Softmax", [b.node("Add", [s, bias], f"{n}masked")], f"{n}attn", axis=-1)
        nan = b.node("IsNaN", [p], f"{n}attn_nan")
        p = b.node("Where", [nan, b.const(f"{n}zero", np.array(0.0, np.float32)), p], f"{n}p")
        o = b.node("Transpose", [b.node("MatMul", [p, v], f"{n}av")], f"{n}av_t", perm=[0, 2, 1, 3])
        o = b.node("Reshape", [o, b.const(f"{n}merge", np.array([1, -1, c]))], f"{n}av_m")
        x = layer_norm(f"{n}sa_ln", b.node("Add", [b.linear(f"{n}o", o, c, c), x], f"{n}res1"))
        h = b.linear(f"{n}lin2", b.gelu(f"{n}gelu", b.linear(f"{n}lin1", x, c, 2 * c)), 2 * c, c)
        x = layer_norm(f"{n}out_ln", b.node("Add", [h, x], f"{n}res2"))
    return b.model(
        "sdpa_bert",
        {"input_ids": [1, length], "attention_mask": [1, length]},
        [x],
        opset=17,
        types={"input_ids": TensorProto.INT64, "attention_mask": TensorProto.INT64},
    )


ARCHITECTURES: dict[str, Callable[[], onnx.ModelProto]] = {
    "crnn": crnn,
    "anchor_free_head": anchor_free_head,
    "mobile_block": mobile_block,
    "unet": unet,
    "ssd_head": ssd_head,
    "mlp_classifier": mlp_classifier,
    "prelu_classifier": prelu_classifier,
    "two_inputs": two_inputs,
    "vit_opset13": vit_opset13,
    "detr_encoder": detr_encoder,
    "convnext": convnext,
    "efficientnet_se": efficientnet_se,
    "shufflenet_v2": shufflenet_v2,
    "yolov7_head": yolov7_head,
    "yolox_decode": yolox_decode,
    "yolov8_seg": yolov8_seg,
    "yolov8_pose": yolov8_pose,
    "fcos_head": fcos_head,
    "svtr_recognizer": svtr_recognizer,
    "dbnet_head": dbnet_head,
    "resnet_opset11": resnet_opset11,
    "densenet": densenet,
    "googlenet": googlenet,
    "bert_encoder": bert_encoder,
    "swin": swin,
    "twins_locally_grouped_attention": twins_locally_grouped_attention,
    "hiera_mask_unit_attention": hiera_mask_unit_attention,
    "yolo11_psa": yolo11_psa,
    "yolov10_head": yolov10_head,
    "yolo_world": yolo_world,
    "maxvit_window_attention": maxvit_window_attention,
    "mobilevitv2_hf": mobilevitv2_hf,
    "segformer": segformer,
    "mobilevit": mobilevit,
    "clip_vit": clip_vit,
    "t5_encoder": t5_encoder,
    "whisper_encoder": whisper_encoder,
    "centernet": centernet,
    "efficientdet_bifpn": efficientdet_bifpn,
    "gfl_head": gfl_head,
    "yolov9_adown": yolov9_adown,
    "yolov6_repvgg": yolov6_repvgg,
    "retinaface": retinaface,
    "yolov5_focus": yolov5_focus,
    "regnet": regnet,
    "ghostnet": ghostnet,
    "squeezenet": squeezenet,
    "inception_v3": inception_v3,
    "efficientnet_tf": efficientnet_tf,
    "crnn_bilstm": crnn_bilstm,
    "east": east,
    "parseq_decoder": parseq_decoder,
    "levit": levit,
    "distilbert": distilbert,
    "deberta_disentangled_attention": deberta_disentangled_attention,
    "mvitv2_relative_position": mvitv2_relative_position,
    "dynamic_vit": dynamic_vit,
    "groupnorm_head": groupnorm_head,
    "einsum_attention": einsum_attention,
    "fpn_size_resize": fpn_size_resize,
    "opset9_ssd": opset9_ssd,
    "focus_multi_axis": focus_multi_axis,
    "rmsnorm_llama_like": rmsnorm_llama_like,
    "sdpa_bert": sdpa_bert,
}
