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

from surgery.graph import detached_copy
from surgery.model import toposort_nodes

_FLOAT = onnx.TensorProto.FLOAT
_CONTRIB = "com.microsoft"


@dataclass
class _Graph:
    """The graph's nodes with their producers, readers and initializers, edited in place."""

    graph: onnx.GraphProto
    initializers: dict[str, np.ndarray] = field(init=False)
    producer: dict[str, int] = field(init=False)
    readers: dict[str, list[int]] = field(init=False)
    removed: set[int] = field(default_factory=set)
    added: list[onnx.NodeProto] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.initializers = {t.name: numpy_helper.to_array(t) for t in self.graph.initializer}
        self.producer, self.readers = {}, {}
        for k, node in enumerate(self.graph.node):
            for name in node.output:
                self.producer[name] = k
            for name in node.input:
                self.readers.setdefault(name, []).append(k)
        self.outputs = {o.name for o in self.graph.output}

    def node(self, k: int) -> onnx.NodeProto:
        return self.graph.node[k]

    def produced_by(self, tensor: str, op_type: str, domain: str = "") -> int | None:
        k = self.producer.get(tensor)
        if k is None or k in self.removed:
            return None
        node = self.node(k)
        return k if node.op_type == op_type and node.domain in (domain, *_default(domain)) else None

    def only_reader(self, tensor: str) -> int | None:
        """The one node that reads `tensor`, if it is not also a graph output."""
        readers = [k for k in self.readers.get(tensor, []) if k not in self.removed]
        return readers[0] if len(readers) == 1 and tensor not in self.outputs else None

    def weight(self, name: str) -> np.ndarray | None:
        return self.initializers.get(name) if name else None

    def add_initializer(self, name: str, value: np.ndarray) -> str:
        self.graph.initializer.append(numpy_helper.from_array(value.astype(np.float32), name))
        self.initializers[name] = value
        return name

    def drop_unread(self, k: int) -> None:
        """Remove node `k` when nothing left reads any of its outputs, then the nodes that
        only fed it (a bias's quantization, the scales' product)."""
        node = self.node(k)
        if k in self.removed or any(
            o in self.outputs or o in self.read_by_added for o in node.output
        ):
            return
        if all(r in self.removed for o in node.output for r in self.readers.get(o, [])):
            self.removed.add(k)
            for t in node.input:
                if t in self.producer:
                    self.drop_unread(self.producer[t])

    @property
    def read_by_added(self) -> set[str]:
        return {t for n in self.added for t in n.input}


def _default(domain: str) -> tuple[str, ...]:
    return ("ai.onnx",) if domain == "" else ()


def undo_dynamic_quantization(model: onnx.ModelProto) -> int:
    """Rewrite `model` in place as the float model its dynamic quantization quantizes; the
    number of quantized ops undone. Patterns other than the ones ORT writes stay as they are."""
    g = _Graph(model.graph)
    for k, node in enumerate(model.graph.node):
        if node.op_type in ("MatMulInteger", "ConvInteger") and node.domain in ("", "ai.onnx"):
            _undo_integer_op(g, k)
        elif node.domain == _CONTRIB and node.op_type == "DynamicQuantizeMatMul":
            _undo_dynamic_matmul(g, k)
        elif node.domain == _CONTRIB and node.op_type == "DynamicQuantizeLSTM":
            _undo_dynamic_lstm(g, k)
        elif node.op_type == "DequantizeLinear" and node.domain in ("", "ai.onnx"):
            _undo_gathered_table(g, k)
    if not g.added:
        return 0
    kept = [detached_copy(n) for k, n in enumerate(model.graph.node) if k not in g.removed]
    del model.graph.node[:]
    model.graph.node.extend(kept + g.added)
    toposort_nodes(model)
    read = {t for n in model.graph.node for t in n.input} | g.outputs
    inits = [detached_copy(t) for t in model.graph.initializer if t.name in read]
    del model.graph.initializer[:]
    model.graph.initializer.extend(inits)
    return len(g.added)


def _undo_integer_op(g: _Graph, k: int) -> None:
    """DynamicQuantizeLinear → MatMulInteger/ConvInteger → Cast(float) → Mul(scales) →
    MatMul/Conv of the float input and the dequantized weight."""
    node = g.node(k)
    ins = [*node.input, "", "", "", ""][:4]
    quantize = g.produced_by(ins[0], "DynamicQuantizeLinear")
    weight = g.weight(ins[1])
    if quantize is None or weight is None:
        return
    dql = g.node(quantize)
    if ins[2] not in ("", dql.output[2]):
        return
    cast = g.only_reader(node.output[0])
    bias, bias_chain = None, []
    if cast is not None and g.node(cast).op_type == "Add":  # older ORT adds a quantized bias
        add = g.node(cast)
        bias, bias_chain = _float_bias(g, add.input[1 if add.input[0] == node.output[0] else 0])
        if bias is None:
            return
        bias_chain.insert(0, cast)
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
    zero = g.weight(ins[3])
    zero = np.zeros((), weight.dtype) if zero is None else zero
    conv = node.op_type == "ConvInteger"
    per_channel = (-1,) + (1,) * (weight.ndim - 1) if conv else (-1,)
    dequantized = (weight.astype(np.float32) - _channels(zero, per_channel)) * _channels(
        w_scale, per_channel
    )
    name = g.add_initializer(f"{ins[1]}_dequantized", dequantized)
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
    g.removed.update((k, cast, scaled))
    for j in (*bias_chain, scales, quantize):
        g.drop_unread(j)


def _float_bias(g: _Graph, tensor: str) -> tuple[str | None, list[int]]:
    """The float bias initializer behind an integer bias quantized at run time
    (Reshape(Cast(Floor(Div(bias, scale))))), and those nodes, readers first."""
    chain: list[int] = []
    for op in ("Reshape", "Cast", "Floor", "Div"):
        k = g.produced_by(tensor, op)
        if k is None:
            return None, []
        chain.append(k)
        tensor = g.node(k).input[0]
    bias = g.weight(tensor)
    if bias is None or bias.dtype.kind != "f" or bias.ndim != 1:
        return None, []
    return tensor, chain


def _channels(value: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """A scale or zero point per output channel (or one for all) shaped to broadcast."""
    value = np.asarray(value, np.float32)
    return value if value.ndim == 0 else value.reshape(shape)


def _undo_dynamic_matmul(g: _Graph, k: int) -> None:
    """DynamicQuantizeMatMul(A, B, b_scale, b_zero_point, bias) → MatMul(A, B') (+ bias)."""
    node = g.node(k)
    ins = [*node.input, "", "", ""][:5]
    weight, scale = g.weight(ins[1]), g.weight(ins[2])
    if weight is None or scale is None:
        return
    zero = g.weight(ins[3])
    zero = np.zeros((), weight.dtype) if zero is None else zero
    dequantized = (weight.astype(np.float32) - _channels(zero, (-1,))) * _channels(scale, (-1,))
    name = g.add_initializer(f"{ins[1]}_dequantized", dequantized)
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
    table, scale = g.weight(g.node(gather).input[0]), g.weight(ins[1])
    zero = g.weight(ins[2]) if ins[2] else np.zeros((), np.int8)
    if table is None or scale is None or zero is None or scale.ndim or np.ndim(zero):
        return  # per-axis tables would need the axis: not what ORT writes
    source = g.node(gather)
    name = g.add_initializer(
        f"{source.input[0]}_dequantized", (table.astype(np.float32) - zero) * scale
    )
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
        w, s, z = g.weight(value), g.weight(scale), g.weight(zero)
        if w is None or s is None:
            return
        z = np.zeros((), w.dtype) if z is None else z
        shape = (-1, 1, 1) if np.ndim(s) == 1 else (w.shape[0], 1, -1)
        dequantized = (w.astype(np.float32) - _channels(z, shape)) * _channels(s, shape)
        weights.append(g.add_initializer(f"{value}_dequantized", dequantized.transpose(0, 2, 1)))
    inputs = [ins[0], *weights, *ins[3:8]]
    while inputs and not inputs[-1]:
        inputs.pop()
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    g.added.append(helper.make_node("LSTM", inputs, list(node.output), name=node.name, **attrs))
    g.removed.add(k)
