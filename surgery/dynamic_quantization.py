"""ONNX Runtime's dynamic quantization (`quantize_dynamic`) undone: the float model it quantizes.

`quantize_dynamic` keeps the weights in int8 and quantizes activations at run time:
`DynamicQuantizeLinear(x)` feeds `MatMulInteger` / `ConvInteger` with the int8 weight, whose
int32 result is cast to float and scaled by the activation's and the weight's scales; LSTMs
become `com.microsoft.DynamicQuantizeLSTM`, and ORT's optimiser fuses a MatMul's pattern into
`com.microsoft.DynamicQuantizeMatMul`; an embedding is a Gather of an int8 table followed by
a DequantizeLinear. No NPU runs these. Each becomes the float op on the
float activation with the dequantized weight, `(w - zero_point) * scale`, so the model can be
rewritten and quantized statically; it then differs from the dynamic model by that model's
activation rounding only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from surgery.edit import prune_dead
from surgery.graph import remove_at
from surgery.model import DEFAULT_DOMAINS, toposort_nodes

_FLOAT = onnx.TensorProto.FLOAT
_CONTRIB = "com.microsoft"


@dataclass
class _Graph:
    """The graph's nodes with their producers, readers and initializers. Each undo marks the
    nodes it replaces as removed and adds their float replacement; what only fed them (the
    activation's DynamicQuantizeLinear, the scales' product, a bias's quantization) is dead
    afterwards and goes with `prune_dead`."""

    graph: onnx.GraphProto
    initializers: dict[str, onnx.TensorProto] = field(init=False)
    producer: dict[str, int] = field(init=False)
    readers: dict[str, list[int]] = field(init=False)
    removed: set[int] = field(default_factory=set)
    added: list[onnx.NodeProto] = field(default_factory=list)

    def __post_init__(self) -> None:
        # Decoded on demand (`weight`): most models have no dynamic quantization to undo, and
        # this runs on every quantized model's float view.
        self.initializers = {t.name: t for t in self.graph.initializer}
        self.producer, self.readers = {}, {}
        for k, node in enumerate(self.graph.node):
            for name in node.output:
                self.producer[name] = k
            for name in node.input:
                self.readers.setdefault(name, []).append(k)
        self.outputs = {o.name for o in self.graph.output}

    def node(self, k: int) -> onnx.NodeProto:
        return self.graph.node[k]

    def produced_by(self, tensor: str, op_type: str) -> int | None:
        """The index of the default-domain `op_type` node that makes `tensor`, if one does."""
        k = self.producer.get(tensor)
        if k is None or k in self.removed:
            return None
        node = self.node(k)
        return k if node.op_type == op_type and node.domain in DEFAULT_DOMAINS else None

    def only_reader(self, tensor: str) -> int | None:
        """The one node that reads `tensor`, if it is not also a graph output."""
        readers = [k for k in self.readers.get(tensor, []) if k not in self.removed]
        return readers[0] if len(readers) == 1 and tensor not in self.outputs else None

    def weight(self, name: str) -> np.ndarray | None:
        tensor = self.initializers.get(name) if name else None
        return None if tensor is None else numpy_helper.to_array(tensor)

    def add_dequantized(
        self,
        name: str,
        scale: np.ndarray,
        zero: np.ndarray | None,
        channels: tuple[int, ...],
        axes: tuple[int, ...] | None = None,
    ) -> str:
        """A float initializer `(w - zero) * scale` for weight `name`, the scale and zero point
        one for all or one per channel (`channels`: the shape they broadcast as), its axes
        permuted by `axes` if given; its name."""
        weight = numpy_helper.to_array(self.initializers[name])
        zero = np.zeros((), weight.dtype) if zero is None else zero
        value = (weight.astype(np.float32) - _channels(zero, channels)) * _channels(scale, channels)
        if axes is not None:
            value = value.transpose(axes)
        new = f"{name}_dequantized"
        self.graph.initializer.append(numpy_helper.from_array(value.astype(np.float32), new))
        return new


def _channels(value: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    value = np.asarray(value, np.float32)
    return value if value.ndim == 0 else value.reshape(shape)


def undo_dynamic_quantization(model: onnx.ModelProto) -> int:
    """Rewrite `model` in place as the float model its dynamic quantization quantizes; the
    number of float ops added. Patterns other than the ones ORT writes stay as they are."""
    undos = [
        (k, undo)
        for k, node in enumerate(model.graph.node)
        if (
            undo := _UNDOS.get(
                ("" if node.domain in DEFAULT_DOMAINS else node.domain, node.op_type)
            )
        )
    ]
    if not undos:
        return 0
    g = _Graph(model.graph)
    for k, undo in undos:
        undo(g, k)
    if not g.added:
        return 0
    remove_at(model.graph.node, sorted(g.removed))
    model.graph.node.extend(g.added)
    toposort_nodes(model)
    prune_dead(model)
    return len(g.added)


def _undo_integer_op(g: _Graph, k: int) -> None:
    """DynamicQuantizeLinear → MatMulInteger/ConvInteger → Cast(float) → Mul(scales) →
    MatMul/Conv of the float input and the dequantized weight."""
    node = g.node(k)
    ins = [*node.input, "", "", "", ""][:4]
    quantize = g.produced_by(ins[0], "DynamicQuantizeLinear")
    if quantize is None or g.weight(ins[1]) is None:
        return
    dql = g.node(quantize)
    if ins[2] not in ("", dql.output[2]):
        return
    replaced = [k]
    cast = g.only_reader(node.output[0])
    bias = None
    if cast is not None and g.node(cast).op_type == "Add":  # older ORT adds a quantized bias
        add = g.node(cast)
        bias = _float_bias(g, add.input[1 if add.input[0] == node.output[0] else 0])
        if bias is None:
            return
        replaced.append(cast)
        cast = g.only_reader(add.output[0])
    if cast is None or g.node(cast).op_type != "Cast":
        return
    if next((a.i for a in g.node(cast).attribute if a.name == "to"), None) != _FLOAT:
        return
    scaled = g.only_reader(g.node(cast).output[0])
    if scaled is None or g.node(scaled).op_type != "Mul":
        return
    scale_tensor = next(t for t in g.node(scaled).input if t != g.node(cast).output[0])
    scales = g.produced_by(scale_tensor, "Mul")
    if scales is None:
        return
    factors = list(g.node(scales).input)
    if dql.output[1] not in factors or len(factors) != 2:
        return
    w_scale = g.weight(factors[1 - factors.index(dql.output[1])])
    if w_scale is None:
        return
    conv = node.op_type == "ConvInteger"
    rank = g.weight(ins[1]).ndim
    channels = (-1,) + (1,) * (rank - 1) if conv else (-1,)
    name = g.add_dequantized(ins[1], w_scale, g.weight(ins[3]), channels)
    out, label = g.node(scaled).output[0], node.name or g.node(scaled).name
    if conv:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        inputs = [dql.input[0], name, *([bias] if bias else [])]
        g.added.append(helper.make_node("Conv", inputs, [out], name=label, **attrs))
    elif bias:
        g.added.append(helper.make_node("MatMul", [dql.input[0], name], [f"{out}_mm"], name=label))
        g.added.append(helper.make_node("Add", [f"{out}_mm", bias], [out], name=f"{label}_bias"))
    else:
        g.added.append(helper.make_node("MatMul", [dql.input[0], name], [out], name=label))
    g.removed.update((*replaced, cast, scaled))


def _float_bias(g: _Graph, tensor: str) -> str | None:
    """The float bias initializer behind an integer bias quantized at run time
    (Reshape(Cast(Floor(Div(bias, scale)))))."""
    for op in ("Reshape", "Cast", "Floor", "Div"):
        k = g.produced_by(tensor, op)
        if k is None:
            return None
        tensor = g.node(k).input[0]
    bias = g.weight(tensor)
    return tensor if bias is not None and bias.dtype.kind == "f" and bias.ndim == 1 else None


def _undo_dynamic_matmul(g: _Graph, k: int) -> None:
    """DynamicQuantizeMatMul(A, B, b_scale, b_zero_point, bias) → MatMul(A, B') (+ bias)."""
    node = g.node(k)
    ins = [*node.input, "", "", ""][:5]
    scale = g.weight(ins[2])
    if g.weight(ins[1]) is None or scale is None:
        return
    name = g.add_dequantized(ins[1], scale, g.weight(ins[3]), (-1,))
    out = node.output[0]
    product = f"{out}_matmul" if ins[4] else out
    g.added.append(helper.make_node("MatMul", [ins[0], name], [product], name=node.name))
    if ins[4]:
        g.added.append(helper.make_node("Add", [product, ins[4]], [out], name=f"{node.name}_bias"))
    g.removed.add(k)


def _undo_gathered_table(g: _Graph, k: int) -> None:
    """Gather of an int8 table (an embedding) → DequantizeLinear → Gather of the dequantized
    table, as `quantize_dynamic` quantizes embeddings."""
    node = g.node(k)
    ins = [*node.input, ""][:3]
    gather = g.produced_by(ins[0], "Gather")
    if gather is None or g.only_reader(ins[0]) != k:
        return
    source = g.node(gather)
    scale, zero = g.weight(ins[1]), g.weight(ins[2])
    if g.weight(source.input[0]) is None or scale is None or scale.ndim or np.ndim(zero):
        return  # per-axis tables would need the axis: not what ORT writes
    if ins[2] and zero is None:
        return
    name = g.add_dequantized(source.input[0], scale, zero, ())
    attrs = {a.name: helper.get_attribute_value(a) for a in source.attribute}
    g.added.append(
        helper.make_node(
            "Gather", [name, source.input[1]], [node.output[0]], name=source.name, **attrs
        )
    )
    g.removed.update((k, gather))


def _undo_dynamic_lstm(g: _Graph, k: int) -> None:
    """DynamicQuantizeLSTM → LSTM with dequantized W and R (stored [dirs, in, 4·hidden], as
    the contrib op takes them; ONNX's LSTM takes [dirs, 4·hidden, in])."""
    node = g.node(k)
    ins = [*node.input, *[""] * 12][:12]
    weights = []
    for value, scale, zero in ((ins[1], ins[8], ins[9]), (ins[2], ins[10], ins[11])):
        w, s = g.weight(value), g.weight(scale)
        if w is None or s is None:
            return
        channels = (-1, 1, 1) if np.ndim(s) == 1 else (w.shape[0], 1, -1)
        weights.append(g.add_dequantized(value, s, g.weight(zero), channels, axes=(0, 2, 1)))
    inputs = [ins[0], *weights, *ins[3:8]]
    while inputs and not inputs[-1]:
        inputs.pop()
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    g.added.append(helper.make_node("LSTM", inputs, list(node.output), name=node.name, **attrs))
    g.removed.add(k)


_UNDOS = {
    ("", "MatMulInteger"): _undo_integer_op,
    ("", "ConvInteger"): _undo_integer_op,
    ("", "DequantizeLinear"): _undo_gathered_table,
    (_CONTRIB, "DynamicQuantizeMatMul"): _undo_dynamic_matmul,
    (_CONTRIB, "DynamicQuantizeLSTM"): _undo_dynamic_lstm,
}
"""The undo for each op (domain, op type) a dynamic quantization pattern starts from."""
