"""From a QDQ ONNX graph to an integer program.

The QDQ convention: a float op whose inputs come from DequantizeLinear (DQ) nodes and whose
output goes to a QuantizeLinear (Q) node is an integer op with the quantization parameters of
those DQ inputs and Q outputs. `build_program` finds these patterns:

* anchor op -> Q                                  one integer step
* Conv/ConvTranspose/MatMul/Gemm/Add/Sub/Mul/Div -> Relu|Clip -> Q   activation as a clamp
* MatMul -> Add(constant) [-> Relu|Clip] -> Q     bias fused into the accumulator
* ArgMax                                          int64 indices, no Q (INDEX_OUTPUTS)
* Mul(x, Sigmoid(x) | HardSigmoid(x)) -> Q        one lookup table of x * gate(x)
* DQ -> Cast(fp16) [-> Cast(fp32)] -> LayerNormalization | RMSNormalization
     [-> Cast(fp16)] -> Cast(fp32) -> Q             one fp16 normalisation (FP16_LOWERINGS)
* DQ -> Cast(bf16) -> Cast(fp32) -> GridSample (image and grid so) -> Cast(bf16)
     -> Cast(fp32) -> Q                             one bf16 sampling (BF16_LOWERINGS)
* DQ -> Cast(bf16) -> Cast(fp32) -> Gather -> Cast(bf16) -> Cast(fp32) -> Q
                                                  one bf16 gather (a move through a table)
* DQ -> Q                                         a requantization (Rescale)

Casts between a DQ and an fp16 / bf16 op run nowhere once every reader of them is part of
such a pattern (`_elided_casts`), just as a DQ that only integer steps read.

Quantize nodes on constants are folded (weights stored as float + Q). Everything else runs as
it is written: Q nodes quantize float tensors, DQ nodes dequantize integer tensors that float
nodes or graph outputs need, and other nodes run in float (onnx.reference).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from compiler.intmath import (
    INTEGER_DTYPES,
    MultiplierRangeError,
    RequantizationMode,
    quantize_linear,
)
from compiler.runtime.errors import QdqModelError, UnsupportedQuantizedOpError
from compiler.runtime.ops import (
    BF16_LOWERINGS,
    FUSES_ACTIVATION,
    FUSES_BIAS,
    INDEX_OUTPUTS,
    LOWERINGS,
    RANKED_OPS,
    Lowered,
    OpContext,
    lowerable_domain,
)
from compiler.runtime.ops.lut import lower_gated
from compiler.runtime.ops.movement import lower_requantize
from compiler.runtime.ops.normalization import FP16_LOWERINGS
from compiler.runtime.program import DequantizeStep, FloatStep, IntegerStep, QuantizeStep, Step
from compiler.runtime.qparams import ConstOperand, NotLowerable, Operand, QuantOperand, QuantParams
from surgery.graph import node_reads, topological_order
from surgery.model import infer_shapes_through_contrib_ops

QUANTIZE = "QuantizeLinear"
DEQUANTIZE = "DequantizeLinear"
ACTIVATIONS = ("Relu", "Clip")
GATES = ("Sigmoid", "HardSigmoid")
CAST = "Cast"
Lowering = Callable[[OpContext], Lowered]
_DEFAULT_DOMAINS = ("", "ai.onnx")


class QdqGraph:
    """Read-only view of a QDQ model: constants, producers, consumers, quantization parameters."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        graph = model.graph
        self.opsets = {
            ("" if o.domain in _DEFAULT_DOMAINS else o.domain): o.version
            for o in model.opset_import
        }
        self.opset = self.opsets.get("", 1)
        self.functions = list(model.functions)
        self.constants: dict[str, np.ndarray] = {
            init.name: numpy_helper.to_array(init) for init in graph.initializer
        }
        self.input_names = [i.name for i in graph.input if i.name not in self.constants]
        self.output_names = [o.name for o in graph.output]
        self.input_types = {
            i.name: helper.tensor_dtype_to_np_dtype(i.type.tensor_type.elem_type)
            for i in graph.input
            if i.type.HasField("tensor_type") and i.type.tensor_type.elem_type
        }
        self.producer: dict[str, onnx.NodeProto] = {}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        self._ranks: dict[str, int] | None = None
        self.nodes = self._fold_constants(_topological_order(graph))
        for node in self.nodes:
            for name in node.output:
                if name:
                    self.producer[name] = node
            for name in dict.fromkeys(node_reads(node)):  # a body's outer reads count
                self.consumers.setdefault(name, []).append(node)

    def _fold_constants(self, nodes: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
        """Evaluate Constant nodes, ConstantOfShape of a constant shape (weights a trimmed
        export fills at load time) and QuantizeLinear of constants (float weights + Q)."""
        kept = []
        for node in nodes:
            if node.op_type == "Constant" and node.domain in _DEFAULT_DOMAINS:
                (value,) = ReferenceEvaluator(node).run(None, {})
                self.constants[node.output[0]] = np.asarray(value)
            elif (
                node.op_type == "ConstantOfShape"
                and node.domain in _DEFAULT_DOMAINS
                and node.input[0] in self.constants
            ):
                shape = self.constants[node.input[0]]
                (value,) = ReferenceEvaluator(node).run(None, {node.input[0]: shape})
                self.constants[node.output[0]] = np.asarray(value)
            elif node.op_type == QUANTIZE and node.input[0] in self.constants:
                try:
                    params = self.params(node)
                except NotLowerable:
                    kept.append(node)
                    continue
                x = self.constants[node.input[0]]
                scale = params.along(params.scale, x.ndim)
                zero_point = params.along(params.zero_point, x.ndim)
                self.constants[node.output[0]] = quantize_linear(x, scale, zero_point, params.dtype)
            else:
                kept.append(node)
        return kept

    def constant(self, name: str, what: str) -> np.ndarray:
        if name not in self.constants:
            raise NotLowerable(f"the {what} {name!r} is not a constant")
        return self.constants[name]

    def params(self, node: onnx.NodeProto) -> QuantParams:
        """QuantParams of a QuantizeLinear / DequantizeLinear node.

        Raises NotLowerable for what the integer program does not model (blocked quantization,
        int4 / float8 storage, non-constant scales); such nodes then run in float.
        """
        attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if attributes.get("block_size"):
            raise NotLowerable(f"{node.name or node.op_type}: blocked quantization")
        scale = np.asarray(self.constant(node.input[1], "scale"), dtype=np.float32)
        if len(node.input) > 2 and node.input[2]:
            zero_point = self.constant(node.input[2], "zero point")
            dtype = zero_point.dtype
        else:
            zero_point = np.zeros(scale.shape, dtype=np.int64)
            dtype = self._default_dtype(node, attributes)
        if np.dtype(dtype).type not in INTEGER_DTYPES:
            raise NotLowerable(f"{node.name or node.op_type}: {np.dtype(dtype)} quantization")
        per_axis = scale.size > 1
        return QuantParams(
            scale=scale.reshape(-1) if per_axis else scale.reshape(()),
            zero_point=np.asarray(zero_point, dtype=np.int64).reshape(scale.shape).reshape(-1)
            if per_axis
            else np.asarray(zero_point, dtype=np.int64).reshape(()),
            dtype=np.dtype(dtype),
            axis=int(attributes.get("axis", 1)) if per_axis else None,
        )

    def _default_dtype(self, node: onnx.NodeProto, attributes: dict) -> np.dtype:
        """Storage type when the zero point is omitted (ONNX: uint8 unless stated otherwise)."""
        if node.op_type == QUANTIZE:
            output_dtype = attributes.get("output_dtype", 0)
            return helper.tensor_dtype_to_np_dtype(output_dtype) if output_dtype else np.uint8
        source = node.input[0]
        if source in self.constants:
            return self.constants[source].dtype
        if source in self.input_types:
            return self.input_types[source]
        producer = self.producer.get(source)
        if producer is not None and producer.op_type == QUANTIZE:
            return self.params(producer).dtype
        return np.dtype(np.uint8)

    def sole_consumer(self, name: str) -> onnx.NodeProto | None:
        """The only node reading `name`, when it is not also a graph output."""
        consumers = self.consumers.get(name, [])
        if len(consumers) == 1 and name not in self.output_names:
            return consumers[0]
        return None

    def rank(self, name: str) -> int | None:
        """The rank of tensor `name` by ONNX shape inference, run once on first use (only the
        ops of `RANKED_OPS` ask), or None when it cannot tell."""
        if self._ranks is None:
            self._ranks = {name: value.ndim for name, value in self.constants.items()}
            try:
                inferred = infer_shapes_through_contrib_ops(self.model).graph
            except Exception:  # noqa: BLE001 - the rank is then unknown, and the op says so
                inferred = self.model.graph
            for info in (*inferred.input, *inferred.value_info, *inferred.output):
                tensor_type = info.type.tensor_type
                if info.type.HasField("tensor_type") and tensor_type.HasField("shape"):
                    self._ranks.setdefault(info.name, len(tensor_type.shape.dim))
        return self._ranks.get(name)

    def operand(self, name: str) -> Operand:
        """What an op input is: an integer tensor seen through DQ, a plain constant, or absent."""
        if not name:
            return None
        producer = self.producer.get(name)
        if producer is not None and producer.op_type == DEQUANTIZE:
            source = producer.input[0]
            return QuantOperand(source, self.params(producer), self.constants.get(source))
        if name in self.constants:
            return ConstOperand(name, self.constants[name])
        raise NotLowerable(
            f"input {name!r} is a float tensor, not the output of a DequantizeLinear"
        )


def _topological_order(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """Nodes in dependency order, keeping the file order among independent nodes."""
    nodes = list(graph.node)
    order = topological_order(nodes)
    if order is None:
        raise QdqModelError("the graph has a cycle")
    return [nodes[i] for i in order]


@dataclass(frozen=True, eq=False)
class Match:
    """A lowered pattern: its anchor, every node it absorbs, and the integer step.

    `reads_through` are Casts between a DequantizeLinear (or a constant) and the anchor that
    the step reads past; they may be shared, so they are elided only when nothing else reads
    them (`_elided_casts`).
    """

    anchor: onnx.NodeProto
    absorbed: tuple[onnx.NodeProto, ...]
    step: IntegerStep
    reads_through: tuple[onnx.NodeProto, ...] = ()


def _activation_bounds(graph: QdqGraph, node: onnx.NodeProto) -> tuple[float, float]:
    """Real clamp range of a Relu or a Clip with constant bounds."""
    if node.op_type == "Relu":
        return 0.0, np.inf
    if graph.opset >= 11:
        bounds = []
        for index, default in ((1, -np.inf), (2, np.inf)):
            operand = graph.operand(node.input[index]) if len(node.input) > index else None
            if operand is None:
                bounds.append(default)
            elif isinstance(operand, ConstOperand):
                bounds.append(float(np.asarray(operand.value).reshape(-1)[0]))
            elif operand.value is not None:
                bounds.append(float(operand.params.dequantize_exact(operand.value).reshape(-1)[0]))
            else:
                raise NotLowerable("Clip bounds must be constants")
        return bounds[0], bounds[1]
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    return float(attributes.get("min", -np.inf)), float(attributes.get("max", np.inf))


def _constant_operand(graph: QdqGraph, name: str) -> Operand:
    try:
        operand = graph.operand(name)
    except NotLowerable:
        return None
    if isinstance(operand, QuantOperand) and operand.value is None:
        return None
    return operand


def _gate(graph: QdqGraph, node: onnx.NodeProto) -> tuple[onnx.NodeProto, str] | None:
    """For Mul(x, gate(x)): the Sigmoid/HardSigmoid node and x."""
    if node.op_type != "Mul" or len(node.input) != 2:
        return None
    for gated, other in ((node.input[0], node.input[1]), (node.input[1], node.input[0])):
        producer = graph.producer.get(gated)
        if (
            producer is not None
            and producer.op_type in GATES
            and producer.input[0] == other
            and graph.sole_consumer(gated) is node
        ):
            return producer, other
    return None


def _cast_target(node: onnx.NodeProto | None) -> int | None:
    """The `to` type of a Cast node (None for any other node)."""
    if node is None or node.op_type != CAST or node.domain not in _DEFAULT_DOMAINS:
        return None
    return next((a.i for a in node.attribute if a.name == "to"), None)


def _casts_before(
    graph: QdqGraph, name: str, narrow: int = onnx.TensorProto.FLOAT16
) -> tuple[str, list[onnx.NodeProto]]:
    """Follow Casts to float32 / `narrow` back from `name`: (the tensor they start from, the
    Casts, nearest first)."""
    casts = []
    producer = graph.producer.get(name)
    while _cast_target(producer) in (onnx.TensorProto.FLOAT, narrow):
        casts.append(producer)
        name = producer.input[0]
        producer = graph.producer.get(name)
    return name, casts


def _casts_after(
    graph: QdqGraph, name: str, narrow: int = onnx.TensorProto.FLOAT16
) -> tuple[str, list[onnx.NodeProto]]:
    """Follow Casts to float32 / `narrow` forward from `name` while each is the sole reader:
    (the last tensor, the Casts in order)."""
    casts = []
    follower = graph.sole_consumer(name)
    while _cast_target(follower) in (onnx.TensorProto.FLOAT, narrow):
        casts.append(follower)
        name = follower.output[0]
        follower = graph.sole_consumer(name)
    return name, casts


def _cast_constant(graph: QdqGraph, name: str, casts: list[onnx.NodeProto]) -> Operand:
    """A constant read through Casts, with their roundings applied (None if not a constant)."""
    try:
        operand = graph.operand(name)
    except NotLowerable:
        return None
    if not isinstance(operand, ConstOperand):
        return operand
    value = np.asarray(operand.value)
    for cast in reversed(casts):
        value = value.astype(helper.tensor_dtype_to_np_dtype(_cast_target(cast)))
    return ConstOperand(name, value)


@dataclass(frozen=True)
class _Datapath:
    """A narrow-float unit of the MLA: the Cast type that marks its ops in the QDQ model, their
    lowerings, and whether every activation input and the output must pass through such a Cast
    (the unit rounds each of them; fp16 normalisation needs one Cast anywhere)."""

    name: str
    cast: int
    lowerings: dict[str, Lowering]
    every_operand: bool


_DATAPATHS = (
    _Datapath("fp16", onnx.TensorProto.FLOAT16, FP16_LOWERINGS, every_operand=False),
    _Datapath("bf16", onnx.TensorProto.BFLOAT16, BF16_LOWERINGS, every_operand=True),
)


def _wrapped(
    datapath: _Datapath, activation_casts: list[list[onnx.NodeProto]], after: list[onnx.NodeProto]
) -> bool:
    """Whether the Casts around a node mark it as an op of `datapath`."""

    def narrow(casts: list[onnx.NodeProto]) -> bool:
        return any(_cast_target(c) == datapath.cast for c in casts)

    if datapath.every_operand:
        return all(narrow(casts) for casts in activation_casts) and narrow(after)
    return any(narrow(casts) for casts in (*activation_casts, after))


def _match_narrow_float(
    graph: QdqGraph, node: onnx.NodeProto, mode: RequantizationMode
) -> Match | None:
    """An op wrapped in the quantizer's fp16 or bf16 activation pairs: DQ -> Casts -> node ->
    Casts -> Q (`_DATAPATHS`). None when the node is not so wrapped."""
    if node.domain not in _DEFAULT_DOMAINS or not node.output:
        return None
    for datapath in _DATAPATHS:
        lowering = datapath.lowerings.get(node.op_type)
        if lowering is not None:
            match = _match_datapath(graph, node, mode, datapath, lowering)
            if match is not None:
                return match
    return None


def _match_datapath(
    graph: QdqGraph,
    node: onnx.NodeProto,
    mode: RequantizationMode,
    datapath: _Datapath,
    lowering: Lowering,
) -> Match | None:
    """`_match_narrow_float` for one datapath. Input 0 must be an integer tensor (through its
    Casts); that is checked once the Casts say the node belongs to the datapath."""
    inputs: list[Operand] = []
    read_through: list[onnx.NodeProto] = []
    activation_casts: list[list[onnx.NodeProto]] = []
    for name in node.input:
        source, casts = _casts_before(graph, name, datapath.cast) if name else ("", [])
        operand = _cast_constant(graph, source, casts) if name else None
        if isinstance(operand, QuantOperand) and operand.value is None:
            activation_casts.append(casts)
        inputs.append(operand)
        read_through.extend(casts)
    tail, after = _casts_after(graph, node.output[0], datapath.cast)
    if not _wrapped(datapath, activation_casts, after):
        return None
    inputs[0] = graph.operand(_casts_before(graph, node.input[0], datapath.cast)[0])
    quantizer = graph.sole_consumer(tail)
    if quantizer is None or quantizer.op_type != QUANTIZE:
        raise NotLowerable(f"output {node.output[0]!r} is not quantized by a single QuantizeLinear")
    params = graph.params(quantizer)
    ctx = OpContext(
        node=node, opset=graph.opset, mode=mode, inputs=tuple(inputs), outputs=(params,)
    )
    lowered: Lowered = lowering(ctx)
    step = IntegerStep(
        node.name or node.output[0],
        f"{node.op_type}({datapath.name})",
        lowered.kernel,
        lowered.inputs,
        (quantizer.output[0],),
        (params,),
    )
    return Match(node, (*after, quantizer), step, tuple(read_through))


def match_node(graph: QdqGraph, node: onnx.NodeProto, mode: RequantizationMode) -> Match:
    """Lower one node with what it fuses, or raise NotLowerable saying why not."""
    if not lowerable_domain(node.domain, node.op_type):
        raise NotLowerable(f"{node.domain}.{node.op_type} has no integer implementation")
    wrapped = _match_narrow_float(graph, node, mode)
    if wrapped is not None:
        return wrapped
    absorbed: list[onnx.NodeProto] = []
    lowering = LOWERINGS.get(node.op_type)
    pattern = node.op_type
    gate = _gate(graph, node)
    if gate is not None:
        gate_node, gated_input = gate
        absorbed.append(gate_node)
        lowering, pattern = lower_gated, f"Mul(x, {gate_node.op_type}(x))"
        inputs: tuple[Operand, ...] = (graph.operand(gated_input),)
    elif lowering is None:
        raise NotLowerable(f"{node.op_type} has no integer implementation")
    else:
        inputs = tuple(graph.operand(name) for name in node.input)
    activation = None
    bias: Operand = None
    output_names: list[str] = []
    output_params: list[QuantParams | None] = []
    for name in node.output:
        if not name or (name not in graph.consumers and name not in graph.output_names):
            output_names.append("")
            output_params.append(None)
            continue
        if node.op_type in INDEX_OUTPUTS:
            output_names.append(name)
            output_params.append(None)
            continue
        tail = name
        follower = graph.sole_consumer(tail)
        if node.op_type in FUSES_BIAS and follower is not None and follower.op_type == "Add":
            other = [n for n in follower.input if n != tail]
            bias = _constant_operand(graph, other[0]) if len(other) == 1 else None
            if bias is not None:
                absorbed.append(follower)
                pattern += "+Add"
                tail = follower.output[0]
                follower = graph.sole_consumer(tail)
        if (
            node.op_type in FUSES_ACTIVATION
            and follower is not None
            and follower.op_type in ACTIVATIONS
        ):
            activation = _activation_bounds(graph, follower)
            absorbed.append(follower)
            pattern += f"+{follower.op_type}"
            tail = follower.output[0]
            follower = graph.sole_consumer(tail)
        if follower is None or follower.op_type != QUANTIZE:
            raise NotLowerable(f"output {name!r} is not quantized by a single QuantizeLinear")
        absorbed.append(follower)
        output_names.append(follower.output[0])
        output_params.append(graph.params(follower))
    ctx = OpContext(
        node=node,
        opset=graph.opset,
        mode=mode,
        inputs=inputs,
        outputs=tuple(output_params),
        activation=activation,
        bias=bias,
        gate=gate[0] if gate is not None else None,
        ranks=tuple(graph.rank(n) for n in node.input) if node.op_type in RANKED_OPS else (),
    )
    lowered: Lowered = lowering(ctx)
    step = IntegerStep(
        name=node.name or node.output[0],
        pattern=pattern,
        kernel=lowered.kernel,
        inputs=lowered.inputs,
        outputs=tuple(output_names),
        output_params=tuple(output_params),
    )
    return Match(node, tuple(absorbed), step)


def _is_wrapped(graph: QdqGraph, node: onnx.NodeProto) -> bool:
    """A node meant to be integer: it reads a DequantizeLinear, every used output feeds a
    QuantizeLinear, and it has no float weights (a float constant of rank >= 2), which mark a
    node the quantizer deliberately left in float.
    """
    reads_dq = any(
        graph.producer.get(name) is not None and graph.producer[name].op_type == DEQUANTIZE
        for name in node.input
    )
    float_weights = any(
        name in graph.constants
        and np.issubdtype(graph.constants[name].dtype, np.floating)
        and graph.constants[name].ndim >= 2
        for name in node.input
    )
    used = [name for name in node.output if name and name in graph.consumers]
    writes_q = bool(used) and all(
        all(c.op_type == QUANTIZE for c in graph.consumers[name]) for name in used
    )
    return reads_dq and writes_q and not float_weights


@dataclass(frozen=True)
class Program:
    """The integer program of a QDQ model and what could not be made integer."""

    steps: tuple[Step, ...]
    float_nodes: tuple[tuple[str, str], ...]
    tensor_params: dict[str, QuantParams]


def _match_all(
    graph: QdqGraph, mode: RequantizationMode
) -> tuple[dict[int, Match], set[int], dict[int, str]]:
    """Lower every op node that can be; remember why the others cannot."""
    matches: dict[int, Match] = {}
    absorbed: set[int] = set()
    reasons: dict[int, str] = {}
    for node in graph.nodes:
        if node.op_type in (QUANTIZE, DEQUANTIZE) or id(node) in absorbed:
            continue
        try:
            match = match_node(graph, node, mode)
        except (NotLowerable, MultiplierRangeError) as error:
            reasons[id(node)] = str(error)
            continue
        if any(id(n) in absorbed or id(n) in matches for n in match.absorbed):
            reasons[id(node)] = "its fused nodes already belong to another pattern"
            continue
        matches[id(node)] = match
        absorbed.update(id(n) for n in match.absorbed)
    return matches, absorbed, reasons


def _match_requantizers(
    graph: QdqGraph, mode: RequantizationMode, absorbed: set[int]
) -> dict[int, IntegerStep]:
    """QuantizeLinear nodes that read a DequantizeLinear directly: integer rescales."""
    steps: dict[int, IntegerStep] = {}
    for node in graph.nodes:
        producer = graph.producer.get(node.input[0]) if node.input else None
        if node.op_type != QUANTIZE or id(node) in absorbed or producer is None:
            continue
        if producer.op_type != DEQUANTIZE:
            continue
        try:
            source = graph.operand(node.input[0])
            target = graph.params(node)
            source.params.scalar_scale()
            target.scalar_scale()
        except NotLowerable:
            continue
        try:
            lowered = lower_requantize(source, target, mode)
        except MultiplierRangeError:
            continue  # the QuantizeLinear runs as written, in float
        name = node.name or node.output[0]
        steps[id(node)] = IntegerStep(
            name, "Requantize", lowered.kernel, lowered.inputs, (node.output[0],), (target,)
        )
    return steps


def _elided_casts(
    graph: QdqGraph, matches: dict[int, Match], integer_readers: set[int]
) -> set[int]:
    """Casts some match reads through (`Match.reads_through`) whose every reader is an integer
    step or another elided Cast, and whose output is no graph output: the Casts between a
    DequantizeLinear and an fp16 normalisation, which reads the integer tensor itself. Readers
    are visited first, so whole chains go at once."""
    candidates = {id(cast) for match in matches.values() for cast in match.reads_through}
    elided: set[int] = set()
    for node in reversed(graph.nodes):
        if id(node) not in candidates or id(node) in integer_readers:
            continue
        output = node.output[0]
        readers = graph.consumers.get(output, [])
        if output in graph.output_names or not readers:
            continue
        if all(id(r) in integer_readers or id(r) in elided for r in readers):
            elided.add(id(node))
    return elided


def _dequantize_needed(graph: QdqGraph, node: onnx.NodeProto, integer_readers: set[int]) -> bool:
    """A DequantizeLinear runs only if a float node or a graph output reads it."""
    output = node.output[0]
    readers = graph.consumers.get(output, [])
    return output in graph.output_names or any(id(r) not in integer_readers for r in readers)


def _unmatched_step(
    graph: QdqGraph, node: onnx.NodeProto, reason: str | None, strict: bool
) -> Step:
    """Quantize / dequantize boundary steps, or a float step for everything else."""
    name = node.name or node.output[0]
    if node.op_type in (QUANTIZE, DEQUANTIZE):
        try:
            params = graph.params(node)
        except NotLowerable as error:
            return FloatStep(node, graph.opsets, graph.functions, str(error))
        step_type = QuantizeStep if node.op_type == QUANTIZE else DequantizeStep
        return step_type(name, node.input[0], node.output[0], params)
    reason = reason or "not part of a quantized pattern"
    if strict and _is_wrapped(graph, node):
        raise UnsupportedQuantizedOpError(
            f"{name} ({node.op_type}) has no integer form: {reason}",
            hint="pass strict=False to run it in float",
        )
    constants = {name: graph.constants[name] for name in node.input if name in graph.constants}
    return FloatStep(node, graph.opsets, graph.functions, reason, constants)


def build_program(graph: QdqGraph, mode: RequantizationMode, *, strict: bool = False) -> Program:
    """Match every node, then emit steps in topological order (see the module docstring)."""
    matches, absorbed, reasons = _match_all(graph, mode)
    requantizers = _match_requantizers(graph, mode, absorbed)
    integer_readers = set(matches) | absorbed | set(requantizers)
    integer_readers |= _elided_casts(graph, matches, integer_readers)
    steps: list[Step] = []
    for node in graph.nodes:
        key = id(node)
        if key in matches:
            steps.append(matches[key].step)
        elif key in requantizers:
            steps.append(requantizers[key])
        elif (
            key not in absorbed
            and key not in integer_readers
            and (node.op_type != DEQUANTIZE or _dequantize_needed(graph, node, integer_readers))
        ):
            steps.append(_unmatched_step(graph, node, reasons.get(key), strict))

    float_nodes = tuple(
        (s.name, f"{s.pattern}: {s.reason}") for s in steps if isinstance(s, FloatStep)
    )
    tensor_params: dict[str, QuantParams] = {}
    for step in steps:
        if isinstance(step, IntegerStep):
            for name, params in zip(step.outputs, step.output_params, strict=True):
                if name and params is not None:
                    tensor_params[name] = params
        elif isinstance(step, QuantizeStep):
            tensor_params[step.output] = step.params
    return Program(tuple(steps), float_nodes, tensor_params)
