"""Bring a float model into the form the quantizer works on, without changing what it computes.

- A float16 or bfloat16 model (a GPU export with `half=True`) is computed in float32: its
  weights, Cast targets and tensor types become float32. Weights convert exactly; activations
  are rounded less than in the half-precision model, which is what quantization starts from
  anyway (ONNX Runtime's QDQ kernels and the integer reference take float32 scales). The QDQ
  model, and so the compiled archive, then take and give float32 tensors.
- Every node gets a stable name (its `surgery` label), so `unquantized_nodes` and per-node
  configs written against the user's model keep pointing at the same nodes.
- The opset is raised when the QDQ form needs it (13 for per-channel axes, 21 for int16 and
  int4 Q/DQ), with ONNX's version converter. Where the converter spelled a Softmax before opset
  13 as Flatten → Softmax → Reshape although every axis after the softmax axis has size 1, the
  single Softmax comes back: the float model's segments (what `surgery check` counted) must
  not gain a host Flatten in the middle of an MLA region.
- Initializers listed as graph inputs (IR-3 files such as light_resnet50) stop being inputs:
  `surgery check` already counts them as weights, and a weight the caller may override can be
  neither quantized nor compiled into an MLA program.
- Weights become initializers wherever they live: `Constant` nodes (Paddle exports keep every
  weight in one) and constant subgraphs (evaluated once with ONNX Runtime). ONNX Runtime's
  quantizer treats such weights as activations; that is how it reaches 2.3 dB on PP-OCRv4.
- An n-ary Sum (older exports write residual adds so) becomes a chain of two-input Adds, the
  form the MLA lowers: target profiles place Sum on the MLA as an n-ary add, so without this
  a compile would split the segment `surgery check` counts at every Sum.
- A BatchNormalization with no conv before it (after an Add or a Concat, or on the input)
  becomes Mul and Add by per-channel constants, which the MLA runs as ELTWISE.
- BatchNormalization after a Conv/ConvTranspose is folded into its weights and bias, as the MLA
  does, and so are per-channel Mul/Add/Sub/Div by constants (Paddle exports BN as such a chain).
  Quantizing the unfolded chain would round the conv output once per op and quantize a
  per-channel multiplier with one per-tensor scale.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import numpy_helper

from compiler.quantize.errors import QuantizationError
from surgery.edit import node_reads
from surgery.fold import constants_to_initializers, fold_shapes_and_constants
from surgery.graph import (
    FreshNames,
    GraphView,
    default_opset,
    node_label,
    remove_at,
    remove_where,
)
from surgery.model import (
    convert_opset,
    infer_model_shapes,
    load_model,
    raise_ir_version,
    toposort_nodes,
)
from surgery.schema_check import raise_malformed_weights

__all__ = ["PreparedModel", "model_opset", "prepare_model", "remove_unused_initializers"]


_CONV_OPS = ("Conv", "ConvTranspose")


@dataclass
class PreparedModel:
    model: onnx.ModelProto
    names: frozenset[str]
    """Node names of the user's model after labelling (what users may refer to)."""
    original_opset: int
    opset: int
    folded_constants: int = 0
    folded_affine: list[str] = field(default_factory=list)
    """BatchNormalization and per-channel Mul/Add/Sub/Div nodes folded into convs."""
    added_biases: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, object]:
        return {
            "original_opset": self.original_opset,
            "opset": self.opset,
            "folded_constants": self.folded_constants,
            "folded_affine": self.folded_affine,
            "added_biases": self.added_biases,
        }


model_opset = default_opset


def prepare_model(
    model: onnx.ModelProto | str,
    *,
    opset: int = 13,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    add_biases: bool = False,
) -> PreparedModel:
    """A float-equivalent copy ready for quantization (see the module docstring)."""
    proto = load_model(model, input_shapes)
    raise_malformed_weights(proto)  # every weight is decoded below
    float32_from_half(proto.graph)  # value infos included: the inferred shapes still hold
    names = _label_nodes(proto)
    original = model_opset(proto)
    if original < opset:
        proto = _convert_opset(proto, opset)
        if original < _SOFTMAX_LAST_AXIS_OPSET <= opset:
            _unflatten_softmax(proto)
        _label_nodes(proto)
    _initializers_not_inputs(proto)
    prepared = PreparedModel(proto, frozenset(names), original, max(original, opset))
    prepared.folded_constants = constants_to_initializers(proto)
    prepared.folded_constants += fold_shapes_and_constants(proto)
    prepared.folded_affine = _fold_affine(proto)
    prepared.folded_affine += _batchnorms_as_affine(proto)
    _sums_as_adds(proto)
    if add_biases:
        prepared.added_biases = _add_zero_biases(proto)
    remove_unused_initializers(proto)
    toposort_nodes(proto)
    infer_model_shapes(proto)
    return prepared


_HALF_TYPES = (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
_TYPE_ATTRIBUTES = {"Cast": "to", "EyeLike": "dtype", "RandomNormalLike": "dtype"}
"""Ops whose attribute names the element type of their result (the Random*/Multinomial ops
of a generator are not models we compile)."""


def float32_from_half(graph: onnx.GraphProto) -> bool:
    """Make every float16/bfloat16 tensor of `graph` (and its subgraphs) float32, in place:
    initializers, Constant and ConstantOfShape values, Cast/EyeLike targets, and the declared
    types of inputs, outputs and value infos. True if anything changed."""
    changed = False
    for k, tensor in enumerate(graph.initializer):
        if tensor.data_type in _HALF_TYPES:
            graph.initializer[k].CopyFrom(_float32_tensor(tensor))
            changed = True
    for info in (*graph.input, *graph.output, *graph.value_info):
        tensor_type = info.type.tensor_type
        if tensor_type.elem_type in _HALF_TYPES:
            tensor_type.elem_type = onnx.TensorProto.FLOAT
            changed = True
    for node in graph.node:
        typed = _TYPE_ATTRIBUTES.get(node.op_type)
        for attr in node.attribute:
            if attr.name == typed and attr.i in _HALF_TYPES:
                attr.i = onnx.TensorProto.FLOAT
                changed = True
            elif attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type in _HALF_TYPES:
                attr.t.CopyFrom(_float32_tensor(attr.t))
                changed = True
            elif attr.type == onnx.AttributeProto.GRAPH:
                changed |= float32_from_half(attr.g)
            elif attr.type == onnx.AttributeProto.GRAPHS:
                for sub in attr.graphs:
                    changed |= float32_from_half(sub)
    return changed


def _float32_tensor(tensor: onnx.TensorProto) -> onnx.TensorProto:
    values = numpy_helper.to_array(tensor).astype(np.float32)
    return numpy_helper.from_array(values, tensor.name)


def _label_nodes(model: onnx.ModelProto) -> list[str]:
    """Name unnamed nodes `<OpType>_<index>` (surgery's labels) and make names unique."""
    seen: set[str] = set()
    names: list[str] = []
    for idx, node in enumerate(model.graph.node):
        label = node_label(node, idx)
        if label in seen:
            label = f"{label}#{idx}"
        seen.add(label)
        node.name = label
        names.append(label)
    return names


def _initializers_not_inputs(model: onnx.ModelProto) -> None:
    """Drop graph inputs that name an initializer (allowed from IR version 4 on)."""
    weights = {t.name for t in model.graph.initializer}
    if remove_where(model.graph.input, lambda i: i.name in weights):
        model.ir_version = max(model.ir_version, 4)


def _convert_opset(model: onnx.ModelProto, opset: int) -> onnx.ModelProto:
    try:
        converted = convert_opset(model, opset)
    except Exception as exc:  # the converter raises bare RuntimeError/IndexError on gaps
        raise QuantizationError(
            f"the model uses opset {model_opset(model)}; the QDQ form needs opset {opset} and ONNX's "
            f"version converter failed: {str(exc).splitlines()[0][:200]}",
            hint="convert the model to a newer opset when exporting it",
        ) from None
    raise_ir_version(converted)
    infer_model_shapes(converted)
    return converted


_SOFTMAX_OPS = ("Softmax", "LogSoftmax", "Hardmax")
_SOFTMAX_LAST_AXIS_OPSET = 13
"""Before opset 13 these ops normalised over all axes from `axis` on, flattened to 2-D."""


def _unflatten_softmax(model: onnx.ModelProto) -> int:
    """Undo the converter's Flatten(axis=k) → Softmax(-1) → Reshape(Shape(x)) where x has size 1
    on every axis after k: then the old semantics are exactly Softmax(axis=k) on x itself.

    The converter keeps a single node only when k is the last axis, so a 4-D Softmax on the
    channels of [N, C, 1, 1] (a lifted classifier or token row) would come back as a host
    Flatten, a rank-2 Softmax and a Reshape, splitting the MLA segment around it.
    """
    g = model.graph
    view = GraphView(model)
    outputs = {o.name for o in g.output}
    drop: set[int] = set()
    for idx, node in enumerate(g.node):
        if node.op_type not in _SOFTMAX_OPS or idx in drop:
            continue
        flat = view.producer.get(node.input[0])
        users = view.consumers.get(node.output[0], [])
        if flat is None or len(users) != 1 or node.output[0] in outputs:
            continue
        reshape, flatten = g.node[users[0]], g.node[flat]
        if flatten.op_type != "Flatten" or reshape.op_type != "Reshape":
            continue
        if len(view.consumers.get(flatten.output[0], [])) != 1 or flatten.input[0] in outputs:
            continue
        source = flatten.input[0]
        shape = view.tensor(source).shape if view.tensor(source).is_static else None
        axis = next((a.i for a in flatten.attribute if a.name == "axis"), 1)
        if not shape or not _reshapes_back(view, reshape.input[1], source, shape):
            continue
        axis %= len(shape)
        if any(d != 1 for d in shape[axis + 1 :]):
            continue
        node.input[0] = source
        node.output[0] = reshape.output[0]
        del node.attribute[:]
        node.attribute.append(onnx.helper.make_attribute("axis", axis))
        drop.update((flat, users[0]))
    if drop:
        remove_at(g.node, sorted(drop))
        _drop_dead_shapes(model)
    return len(drop) // 2


def _reshapes_back(view: GraphView, shape_tensor: str, source: str, shape: Sequence[int]) -> bool:
    """The Reshape target is Shape(source) or a constant equal to source's shape."""
    producer = view.producer.get(shape_tensor)
    if producer is not None and view.op_types[producer] == "Shape":
        node = view.nodes[producer]
        return node.input[0] == source and not node.attribute
    value = view.constant_value(shape_tensor)
    return value is not None and [int(d) for d in value.reshape(-1)] == list(shape)


def _drop_dead_shapes(model: onnx.ModelProto) -> None:
    """Remove Shape nodes nobody reads any more (the converter's Reshape targets)."""
    g = model.graph
    used = {i for n in g.node for i in node_reads(n)} | {o.name for o in g.output}
    remove_where(g.node, lambda n: n.op_type == "Shape" and n.output[0] not in used)


# --------------------------------------------------------------------------- constants


def remove_unused_initializers(model: onnx.ModelProto) -> None:
    """Drop initializers nothing reads; an If / Loop / Scan body reading one from the outer
    scope counts (dropping it left the body reading a tensor that no longer exists)."""
    g = model.graph
    used = {i for n in g.node for i in node_reads(n)} | {o.name for o in g.output}
    declared_inputs = {i.name for i in g.input}
    remove_where(g.initializer, lambda t: t.name not in used and t.name not in declared_inputs)


# --------------------------------------------------------------------------- per-channel affine folding


def _conv_channels(conv: onnx.NodeProto, weight: onnx.TensorProto) -> int:
    group = next((a.i for a in conv.attribute if a.name == "group"), 1)
    return weight.dims[0] if conv.op_type == "Conv" else weight.dims[1] * group


def _per_channel(value: np.ndarray, channels: int) -> np.ndarray | None:
    """`value` as a (channels,) vector when it broadcasts per channel over NCHW, else None."""
    if value.size == 1:
        return np.full(channels, float(value.reshape(())), dtype=np.float64)
    if value.ndim >= 3 and value.size == channels and value.shape[-3] == channels:
        return value.reshape(channels).astype(np.float64)
    return None


def _affine_of(
    view: GraphView, idx: int, src: str, inits: dict[str, onnx.TensorProto], channels: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """(scale, shift) with node(src) == src·scale + shift per channel, or None."""
    node = view.nodes[idx]
    op = node.op_type
    if op == "BatchNormalization":
        if (
            node.input[0] != src
            or len([o for o in node.output if o]) != 1
            or not all(n in inits for n in node.input[1:5])
        ):
            return None
        if any(a.name == "training_mode" and a.i for a in node.attribute):
            return None
        gamma, beta, mean, var = (
            numpy_helper.to_array(inits[n]).astype(np.float64).reshape(-1) for n in node.input[1:5]
        )
        if gamma.size != channels:
            return None
        eps = next((a.f for a in node.attribute if a.name == "epsilon"), 1e-5)
        scale = gamma / np.sqrt(var + eps)
        return scale, beta - mean * scale
    if op not in ("Add", "Sub", "Mul", "Div") or len(node.input) != 2 or src not in node.input:
        return None
    k = list(node.input).index(src)
    const = node.input[1 - k]
    if const not in inits or node.input[0] == node.input[1]:
        return None
    c = _per_channel(numpy_helper.to_array(inits[const]), channels)
    if c is None:
        return None
    ones, zeros = np.ones(channels), np.zeros(channels)
    if op == "Add":
        return ones, c
    if op == "Mul":
        return c, zeros
    if op == "Sub":
        return (ones, -c) if k == 0 else (-ones, c)
    if k == 0 and np.all(c != 0):
        return 1.0 / c, zeros
    return None


def _scale_weight(conv: onnx.NodeProto, weight: np.ndarray, scale: np.ndarray) -> np.ndarray:
    if conv.op_type == "Conv":
        return weight * scale.reshape(-1, *([1] * (weight.ndim - 1)))
    group = next((a.i for a in conv.attribute if a.name == "group"), 1)
    cin, cout_g = weight.shape[0], weight.shape[1]
    grouped = weight.reshape(group, cin // group, cout_g, *weight.shape[2:])
    return (grouped * scale.reshape(group, 1, cout_g, *([1] * (weight.ndim - 2)))).reshape(
        weight.shape
    )


def _fold_affine(model: onnx.ModelProto) -> list[str]:
    """Fold per-channel Mul/Add/Sub/Div by constants and BatchNormalization into the preceding
    Conv/ConvTranspose, repeatedly (Paddle exports BN as Mul + Add chains)."""
    folded: list[str] = []
    while True:
        done = _fold_affine_pass(model)
        if not done:
            return folded
        folded.extend(done)


def _fold_affine_pass(model: onnx.ModelProto) -> list[str]:
    view = GraphView(model)
    inits = {t.name: t for t in model.graph.initializer}
    graph_outputs = set(view.graph_outputs)
    removed: set[int] = set()
    touched: set[int] = set()
    folded: list[str] = []
    for p, conv in enumerate(view.nodes):
        if (
            conv.op_type not in _CONV_OPS
            or len(conv.input) < 2
            or conv.input[1] not in inits
            or p in touched
        ):
            continue
        src = conv.output[0]
        readers = view.consumers.get(src, [])
        if len(readers) != 1 or src in graph_outputs or _shared(view, conv.input[1]):
            continue
        has_bias = len(conv.input) > 2 and bool(conv.input[2])
        if has_bias and (conv.input[2] not in inits or _shared(view, conv.input[2])):
            continue
        channels = _conv_channels(conv, inits[conv.input[1]])
        affine = _affine_of(view, readers[0], src, inits, channels)
        if affine is None:
            continue
        scale, shift = affine
        w_tensor = inits[conv.input[1]]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(w_tensor.data_type)
        weight = numpy_helper.to_array(w_tensor).astype(np.float64)
        _replace_initializer(inits, conv.input[1], _scale_weight(conv, weight, scale).astype(dtype))
        bias = (
            numpy_helper.to_array(inits[conv.input[2]]).astype(np.float64).reshape(-1)
            if has_bias
            else np.zeros(channels)
        )
        new_bias = (bias * scale + shift).astype(dtype)
        if has_bias:
            _replace_initializer(inits, conv.input[2], new_bias)
        else:
            _set_bias(model, inits, conv, new_bias)
        conv.output[0] = view.nodes[readers[0]].output[0]
        removed.add(readers[0])
        touched.add(p)
        folded.append(view.names[readers[0]])
    _remove_nodes(model, removed)
    return folded


def _batchnorms_as_affine(model: onnx.ModelProto) -> list[str]:
    """BatchNormalization(x) → x · scale + shift with per-channel constants, for the ones the
    conv folding left (constant statistics, inference mode, known input rank); the Add keeps
    the node's name and output."""
    view = GraphView(model)
    inits = {t.name: t for t in model.graph.initializer}
    fresh = FreshNames(model.graph)
    rewritten: list[str] = []
    nodes: list[onnx.NodeProto] = []
    for idx, node in enumerate(view.nodes):
        affine = None
        if node.op_type == "BatchNormalization" and len(node.input) > 1:
            rank = view.tensor(node.input[0]).rank
            gamma = inits.get(node.input[1])
            if gamma is not None and rank is not None and rank >= 2:
                affine = _affine_of(view, idx, node.input[0], inits, int(np.prod(gamma.dims)))
        if affine is None:
            nodes.append(node)
            continue
        dtype = onnx.helper.tensor_dtype_to_np_dtype(gamma.data_type)
        shape = (-1,) + (1,) * (rank - 2)
        scale = fresh(f"{node.name}.scale")
        model.graph.initializer.append(
            numpy_helper.from_array(affine[0].astype(dtype).reshape(shape), scale)
        )
        rewritten.append(view.names[idx])
        # A zero shift (beta = mean = 0, as initialised) adds nothing; an Add of it would also
        # give the zero constant a scale unrelated to the activation it is added to.
        if not np.any(affine[1]):
            nodes.append(
                onnx.helper.make_node(
                    "Mul", [node.input[0], scale], [node.output[0]], name=node.name
                )
            )
            continue
        shift = fresh(f"{node.name}.shift")
        model.graph.initializer.append(
            numpy_helper.from_array(affine[1].astype(dtype).reshape(shape), shift)
        )
        scaled = fresh(f"{node.name}_scaled")
        nodes.append(
            onnx.helper.make_node(
                "Mul", [node.input[0], scale], [scaled], name=fresh(f"{node.name}_mul")
            )
        )
        nodes.append(
            onnx.helper.make_node("Add", [scaled, shift], [node.output[0]], name=node.name)
        )
    if rewritten:
        del model.graph.node[:]
        model.graph.node.extend(nodes)
    return rewritten


def _set_bias(
    model: onnx.ModelProto,
    inits: dict[str, onnx.TensorProto],
    node: onnx.NodeProto,
    value: np.ndarray,
) -> str:
    name = f"{node.name}.bias"
    tensor = numpy_helper.from_array(value, name)
    model.graph.initializer.append(tensor)
    inits[name] = tensor
    while len(node.input) < 2:
        node.input.append("")
    if len(node.input) > 2:
        node.input[2] = name
    else:
        node.input.append(name)
    return name


def _remove_nodes(model: onnx.ModelProto, removed: set[int]) -> None:
    remove_at(model.graph.node, sorted(removed))


def _shared(view: GraphView, name: str) -> bool:
    return len(view.consumers.get(name, [])) > 1


def _replace_initializer(inits: dict[str, onnx.TensorProto], name: str, value: np.ndarray) -> None:
    inits[name].CopyFrom(numpy_helper.from_array(value, name))


# --------------------------------------------------------------------------- biases


def _sums_as_adds(model: onnx.ModelProto) -> None:
    """Sum(x0, x1, …, xn) → Add(…Add(Add(x0, x1), x2)…, xn), left to right as Sum adds; the
    last Add keeps the node's name and output."""
    graph = model.graph
    if not any(n.op_type == "Sum" and len(n.input) > 1 for n in graph.node):
        return
    fresh = FreshNames(graph)
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        inputs = list(node.input)
        if node.op_type != "Sum" or node.domain not in ("", "ai.onnx") or len(inputs) < 2:
            nodes.append(node)
            continue
        partial = inputs[0]
        for k, operand in enumerate(inputs[1:], start=1):
            last = k == len(inputs) - 1
            output = node.output[0] if last else fresh(f"{node.name}_partial{k}")
            name = node.name if last else fresh(f"{node.name}_add{k}")
            nodes.append(onnx.helper.make_node("Add", [partial, operand], [output], name=name))
            partial = output
    del graph.node[:]
    graph.node.extend(nodes)


def _add_zero_biases(model: onnx.ModelProto) -> list[str]:
    """Give bias-less convs and Gemms a zero bias, so bias correction has somewhere to go."""
    inits = {t.name: t for t in model.graph.initializer}
    added: list[str] = []
    for node in model.graph.node:
        if node.op_type not in (*_CONV_OPS, "Gemm") or (len(node.input) > 2 and node.input[2]):
            continue
        w = inits.get(node.input[1]) if len(node.input) > 1 else None
        if w is None or len(w.dims) < 2:
            continue
        if node.op_type == "Gemm":
            trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
            channels = w.dims[0] if trans_b else w.dims[1]
        else:
            channels = _conv_channels(node, w)
        dtype = onnx.helper.tensor_dtype_to_np_dtype(w.data_type)
        _set_bias(model, inits, node, np.zeros(channels, dtype=dtype))
        added.append(node.name)
    return added
