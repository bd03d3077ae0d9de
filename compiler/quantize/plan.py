"""Decide what gets quantized, and how, before any data is seen.

Inputs: the prepared float model, the coverage report (only MLA nodes are quantized) and the
user's settings. Output: a `QuantPlan` listing

- the activation tensors that get a QuantizeLinear/DequantizeLinear pair (or a Cast pair for
  bf16/fp16), each with its scheme and calibration method;
- the constant inputs that are stored quantized: weights (per-channel axis or group-wise block),
  biases (int32 at scale_in × scale_w) and constant operands of elementwise ops;
- the decisions taken on the way (fusion, shared scales, precision fallbacks, unquantized nodes).

Conventions (those of ONNX Runtime's QDQ format, so its tools and our integer executor agree):

- The output of a Conv/ConvTranspose/Gemm/MatMul read only by a Relu or Clip gets no Q/DQ: the
  integer kernel fuses conv + bias + requantize + activation, so the only rounding is after the
  activation.
- Data-movement ops (Reshape, Transpose, MaxPool, Resize, …) reuse their input's scale and zero
  point, so they never requantize.
- A tensor produced by a quantized node is quantized once, with the producer's scheme; every
  reader (even one on the CVU/APU, or a graph output) sees the dequantized value, because that is
  what the MLA hands over. A tensor produced elsewhere is quantized only on the way into the
  quantized nodes that read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import onnx

from compiler.defines import (
    CalibrationMethod,
    NodeQuantizationConfig,
    QuantizationParams,
    QuantizationScheme,
    bfloat16_scheme,
    float16_scheme,
    quantization_scheme,
)
from compiler.quantize.errors import QuantizationError
from compiler.quantize.groups import ElementwiseGroup, find_groups
from surgery.coverage import CoverageReport
from surgery.graph import VALUE_MOVING_OPS, GraphView
from surgery.targets import Target

__all__ = ["ActivationSpec", "ParamSpec", "QuantPlan", "make_plan", "WEIGHTED_OPS"]

WEIGHTED_OPS = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})
FUSED_ACTIVATIONS = frozenset({"Relu", "Clip"})
SAME_SCALE_OPS = VALUE_MOVING_OPS
"""Ops whose output takes its input's scale."""

ALL_OPERAND_OPS = frozenset(
    {"Add", "Sub", "Mul", "Div", "Sum", "Max", "Min", "Mean", "Concat", "MatMul", "Einsum"}
)
"""Every input is data; constant inputs are stored quantized. Other ops quantize input 0 only
(the rest are parameters: Clip bounds, Resize scales, Pad pads, norm scales …)."""

_OPERAND_INDICES: dict[str, tuple[int, ...]] = {"Where": (1, 2), "GridSample": (0, 1)}

_FLOAT_KINDS = {"bfloat16": "bf16", "float16": "fp16"}

Role = Literal["weight", "bias", "constant"]


@dataclass
class ActivationSpec:
    """One Q/DQ (or Cast) pair on an activation tensor."""

    key: str
    tensor: str
    scheme: QuantizationScheme
    method: CalibrationMethod
    produced_by_quantized: bool
    """True: the producer's output is renamed and every reader sees the dequantized value."""
    consumers: list[tuple[int, int]] = field(default_factory=list)
    """(node index, input index) rewired to the dequantized value (producer not quantized)."""
    share_with: str | None = None
    """Key of the activation whose scale and zero point this one reuses."""
    reads_dequantized: str | None = None
    """Float (Cast) pairs only: key of the integer activation on the same tensor whose
    dequantized value this pair reads. A tensor no quantized node produces (a graph input)
    with both integer and fp16/bf16 readers gets Q → DQ, and the Cast pair after the DQ, so
    every reader starts from the same integer codes."""
    narrow: QuantizationScheme | None = None
    """Integer outputs of a node moved to fp16/bf16 (`QuantPlan.integer_interface`) only: the
    float precision the node computes in. Its output is rounded to that precision (a Cast pair)
    and then quantized, because the MLA hands over integer codes; every reader, quantized or not,
    and a graph output see the dequantized value, as for any other quantized producer."""

    @property
    def needs_observer(self) -> bool:
        return self.share_with is None and not self.scheme.is_float


@dataclass
class ParamSpec:
    """A constant input stored quantized (weights, biases, constant operands)."""

    node: int
    input_index: int
    tensor: str
    role: Role
    scheme: QuantizationScheme
    axis: int | None = None
    block_size: int | None = None
    activation_key: str | None = None
    """Bias only: the activation whose scale multiplies the weight scale."""
    weight_tensor: str | None = None
    """Bias only: the weight tensor whose scales multiply the activation scale."""


@dataclass
class QuantPlan:
    quantized: list[int]
    configs: dict[int, NodeQuantizationConfig]
    activations: dict[str, ActivationSpec]
    params: list[ParamSpec]
    fused: dict[str, str] = field(default_factory=dict)
    groups: list[ElementwiseGroup] = field(default_factory=list)
    internal: set[str] = field(default_factory=set)
    """Tensors inside an elementwise group: no Q/DQ."""
    unquantized: dict[str, str] = field(default_factory=dict)
    decisions: list[dict[str, str]] = field(default_factory=list)
    integer_interface: dict[str, QuantizationScheme] = field(default_factory=dict)
    """Node name → the integer scheme of its inputs and outputs, for nodes moved to a float
    precision because the MLA runs them only so (an fp16 LayerNorm on rk3588). The MLA keeps
    such a node's operands integer and computes in float inside it, so a tensor between two of
    them is still quantized: the reader gets Q → DQ → Cast pair, never the producer's float."""

    def observed(self) -> dict[str, ActivationSpec]:
        return {k: a for k, a in self.activations.items() if a.needs_observer}


def check_target_precisions(params: QuantizationParams, target: Target) -> None:
    """Float schemes need the target's MLA to offer them (BF16 on modalix, not on mlsoc)."""
    offered = (
        target.profile.processors["MLA"].precisions if "MLA" in target.profile.processors else []
    )
    for scheme in params.all_schemes():
        wanted = _FLOAT_KINDS.get(scheme.kind)
        if wanted and wanted not in offered:
            raise QuantizationError(
                f"{scheme.kind} scheme: the MLA of target {target.name!r} offers {', '.join(offered) or 'no precisions'}, "
                f"not {wanted}",
                hint="use integer schemes, or a target whose MLA has " + wanted,
            )


def make_plan(
    model: onnx.ModelProto,
    coverage: CoverageReport,
    params: QuantizationParams,
    *,
    view: GraphView | None = None,
    elementwise_groups: bool = False,
) -> QuantPlan:
    """The plan for `model`. x·Sigmoid(x) / x·HardSigmoid(x) are always one table (no Q/DQ on
    the gate); `elementwise_groups=True` does the same for every run of single-input elementwise
    ops (`compiler.quantize.groups`)."""
    view = view or GraphView(model)
    constants = set(view.initializers)
    unquantized_request = set(params.unquantized_nodes)
    plan = QuantPlan([], {}, {}, [])
    for placement in coverage.placements:
        idx, name = placement.index, view.names[placement.index]
        if placement.processor != "MLA":
            continue
        if name in unquantized_request:
            plan.unquantized[name] = "listed in unquantized_nodes"
            continue
        config = _node_config(params, name, placement.precisions, plan)
        if config is None:
            plan.unquantized[name] = (
                f"no MLA precision among {', '.join(placement.precisions) or 'none'} fits the schemes"
            )
            continue
        plan.quantized.append(idx)
        plan.configs[idx] = config
    quantized = set(plan.quantized)
    plan.fused = _fused_tensors(view, quantized, plan.configs, constants)
    _inherit_fused_configs(view, plan, params)
    plan.groups, plan.internal, grouped = find_groups(
        view, plan.quantized, plan.configs, constants, plan.fused, gates_only=not elementwise_groups
    )
    for idx in plan.quantized:
        _plan_node(view, idx, plan, constants, in_group=idx in grouped)
    _share_scales(view, plan)
    return plan


# --------------------------------------------------------------------------- per-node settings


def _node_config(
    params: QuantizationParams, name: str, precisions: tuple[str, ...], plan: QuantPlan
) -> NodeQuantizationConfig | None:
    """The node's settings, moved to a precision the node has on the MLA when needed."""
    config = params.for_node(name)
    act = config.activation_quantization_scheme
    assert act is not None and config.weight_quantization_scheme is not None
    offered = set(precisions)
    wanted = _FLOAT_KINDS.get(act.kind, "int8")
    if wanted in offered or not offered:
        return config
    if wanted == "int8" and "bf16" in offered:
        plan.decisions.append(
            {"node": name, "decision": "bf16", "reason": "the op runs on the MLA in bf16 only"}
        )
        plan.integer_interface[name] = act
        return NodeQuantizationConfig(
            config.calibration_method, bfloat16_scheme(), bfloat16_scheme()
        )
    if wanted == "int8" and "fp16" in offered:
        plan.decisions.append(
            {"node": name, "decision": "fp16", "reason": "the op runs on the MLA in fp16 only"}
        )
        plan.integer_interface[name] = act
        return NodeQuantizationConfig(
            config.calibration_method, float16_scheme(), config.weight_quantization_scheme
        )
    if "int8" in offered:
        plan.decisions.append(
            {"node": name, "decision": "int8", "reason": f"the op has no {wanted} on the MLA"}
        )
        return NodeQuantizationConfig(
            config.calibration_method,
            quantization_scheme(asymmetric=True, per_channel=False),
            quantization_scheme(asymmetric=False, per_channel=True),
        )
    return None


# --------------------------------------------------------------------------- fusion


def _fused_tensors(
    view: GraphView,
    quantized: set[int],
    configs: dict[int, NodeQuantizationConfig],
    constants: set[str],
) -> dict[str, str]:
    """Outputs of weighted ops read only by a quantized Relu/Clip: no Q/DQ between the two."""
    fused: dict[str, str] = {}
    outputs = set(view.graph_outputs)
    for idx in quantized:
        node = view.nodes[idx]
        if node.op_type not in WEIGHTED_OPS or not node.output:
            continue
        tensor = node.output[0]
        readers = view.consumers.get(tensor, [])
        if tensor in outputs or len(readers) != 1 or readers[0] not in quantized:
            continue
        act = view.nodes[readers[0]]
        if act.op_type not in FUSED_ACTIVATIONS or act.input[0] != tensor:
            continue
        if any(i and i not in constants for i in act.input[1:]):
            continue
        own, other = (
            configs[idx].activation_quantization_scheme,
            configs[readers[0]].activation_quantization_scheme,
        )
        if own is None or other is None or own.is_float or other.is_float:
            continue
        fused[tensor] = view.names[readers[0]]
    return fused


def _inherit_fused_configs(view: GraphView, plan: QuantPlan, params: QuantizationParams) -> None:
    """A per-node config on a conv also covers the Relu/Clip fused into it (one MLA op)."""
    for tensor, act_name in plan.fused.items():
        conv = view.producer[tensor]
        act = view.index_by_name[act_name]
        if (
            view.names[conv] in params.custom_quantization_configs
            and act_name not in params.custom_quantization_configs
        ):
            plan.configs[act] = plan.configs[conv]


# --------------------------------------------------------------------------- one node


def _is_float(view: GraphView, name: str) -> bool:
    elem = view.tensor(name).elem_type
    return elem in (0, onnx.TensorProto.FLOAT)


def _operand_indices(node: onnx.NodeProto, weighted: bool) -> tuple[int, ...]:
    if weighted:
        return (0,)
    if node.op_type in ALL_OPERAND_OPS:
        return tuple(range(len(node.input)))
    return _OPERAND_INDICES.get(node.op_type, (0,))


def _plan_node(
    view: GraphView, idx: int, plan: QuantPlan, constants: set[str], *, in_group: bool
) -> None:
    node = view.nodes[idx]
    config = plan.configs[idx]
    act = config.activation_quantization_scheme
    weight = config.weight_quantization_scheme
    method = config.calibration_method
    assert act is not None and weight is not None and method is not None
    weighted = node.op_type in WEIGHTED_OPS and len(node.input) > 1 and node.input[1] in constants
    input_key: str | None = None
    for k in _operand_indices(node, weighted):
        if k >= len(node.input) or not node.input[k] or not _is_float(view, node.input[k]):
            continue
        tensor = node.input[k]
        if tensor in constants:
            if not in_group:  # group constants are part of the table / affine map, kept float
                plan.params.append(_constant_param(idx, k, tensor, act, weight))
            continue
        if tensor in plan.fused or tensor in plan.internal:
            continue
        key = _consume(view, plan, tensor, idx, k, act, method)
        if k == 0:
            input_key = key
    if weighted:
        _plan_weight(view, idx, plan, act, weight, input_key, constants)
    for out in node.output:
        if out and out not in plan.fused and out not in plan.internal and _is_float(view, out):
            plan.activations[out] = _output_spec(view, plan, idx, out)


def _output_spec(view: GraphView, plan: QuantPlan, idx: int, tensor: str) -> ActivationSpec:
    """The Q/DQ (or Cast) pair on output `tensor` of quantized node `idx`. A node moved to a float
    precision the MLA runs it in keeps its integer interface on the output too (`narrow`)."""
    config = plan.configs[idx]
    act, method = config.activation_quantization_scheme, config.calibration_method
    assert act is not None and method is not None
    interface = plan.integer_interface.get(view.names[idx])
    if act.is_float and interface is not None:
        return ActivationSpec(tensor, tensor, interface, method, True, narrow=act)
    return ActivationSpec(tensor, tensor, act, method, produced_by_quantized=True)


def _consume(
    view: GraphView,
    plan: QuantPlan,
    tensor: str,
    idx: int,
    k: int,
    act: QuantizationScheme,
    method: CalibrationMethod,
) -> str:
    """Register (node idx, input k) as a reader of `tensor` quantized with `act`; returns the key."""
    producer = view.producer.get(tensor)
    if producer is not None and producer in plan.configs:
        primary = plan.activations.get(tensor)
        if primary is None:  # producer planned later in a non-topological order: plan it first
            primary = _output_spec(view, plan, producer, tensor)
            plan.activations[tensor] = primary
        interface = plan.integer_interface.get(
            view.names[idx], plan.integer_interface.get(view.names[producer])
        )
        if primary.scheme.is_float and act.is_float and interface is not None:
            integer = f"{tensor}::{interface.describe()}"
            plan.activations.setdefault(
                integer, ActivationSpec(integer, tensor, interface, method, False)
            )
            pair = _float_pair(plan, tensor, act, method, reads=integer)
            pair.consumers.append((idx, k))
            return pair.key
        if primary.scheme.is_float == act.is_float:
            return tensor
        key = f"{tensor}::{act.describe()}"
        spec = plan.activations.setdefault(
            key, ActivationSpec(key, tensor, act, method, produced_by_quantized=False)
        )
        spec.consumers.append((idx, k))
        return key
    spec = plan.activations.get(tensor)
    if spec is None:
        spec = ActivationSpec(tensor, tensor, act, method, produced_by_quantized=False)
        plan.activations[tensor] = spec
    elif spec.scheme.is_float != act.is_float:
        return _consume_mixed(plan, spec, idx, k, act, method)
    elif not spec.produced_by_quantized and _wider(act, spec.scheme):
        spec.scheme, spec.method = act, method
    spec.consumers.append((idx, k))
    return tensor


def _consume_mixed(
    plan: QuantPlan,
    spec: ActivationSpec,
    idx: int,
    k: int,
    act: QuantizationScheme,
    method: CalibrationMethod,
) -> str:
    """A reader whose float-ness differs from the tensor's spec so far (no quantized node
    produces the tensor): the integer spec keeps the tensor's key, the float one becomes a Cast
    pair after its DequantizeLinear (`reads_dequantized`); returns the reader's key."""
    tensor = spec.tensor
    if spec.scheme.is_float:  # the float reader came first: the integer one takes its key
        float_spec, act_spec = spec, ActivationSpec(tensor, tensor, act, method, False)
        plan.activations[tensor] = act_spec
        _float_pair(plan, tensor, float_spec.scheme, float_spec.method).consumers.extend(
            float_spec.consumers
        )
        act_spec.consumers.append((idx, k))
        return tensor
    pair = _float_pair(plan, tensor, act, method)
    pair.consumers.append((idx, k))
    return pair.key


def _float_pair(
    plan: QuantPlan,
    tensor: str,
    scheme: QuantizationScheme,
    method: CalibrationMethod,
    reads: str | None = None,
) -> ActivationSpec:
    """The Cast pair of `tensor` in `scheme`, after the DequantizeLinear of the integer spec
    keyed `reads` (default: the tensor's own key)."""
    key = f"{tensor}::{scheme.describe()}"
    return plan.activations.setdefault(
        key,
        ActivationSpec(key, tensor, scheme, method, False, reads_dequantized=reads or tensor),
    )


def _wider(a: QuantizationScheme, b: QuantizationScheme) -> bool:
    return (a.bits, a.is_float) > (b.bits, b.is_float)


def _constant_param(
    idx: int, k: int, tensor: str, act: QuantizationScheme, weight: QuantizationScheme
) -> ParamSpec:
    """Constant operands of elementwise ops: the node's float type, or symmetric integers per
    tensor. The integer executor multiplies two per-tensor operands (one multiplier per op), so
    per-axis constants would leave the op in float; per-channel multipliers after a conv are
    folded into it by `prepare` instead."""
    if act.is_float:
        return ParamSpec(idx, k, tensor, "constant", act)
    bits = weight.bits if weight.bits in (8, 16) else 8
    return ParamSpec(idx, k, tensor, "constant", quantization_scheme(False, False, bits))


# --------------------------------------------------------------------------- weights and biases


def _attr(node: onnx.NodeProto, name: str, default: int) -> int:
    return next((a.i for a in node.attribute if a.name == name), default)


def _plan_weight(
    view: GraphView,
    idx: int,
    plan: QuantPlan,
    act: QuantizationScheme,
    weight: QuantizationScheme,
    input_key: str | None,
    constants: set[str],
) -> None:
    node = view.nodes[idx]
    name = view.names[idx]
    w_name = node.input[1]
    shape = tuple(view.initializers[w_name].dims)
    axis, reduce_axis = _weight_axes(node, shape)
    scheme = weight
    block = None
    if weight.is_float:
        axis = None
    elif weight.group_size is not None:
        if reduce_axis is None or (
            node.op_type in ("Conv", "ConvTranspose") and _attr(node, "group", 1) != 1
        ):
            scheme = quantization_scheme(asymmetric=False, per_channel=True)
            plan.decisions.append(
                {
                    "node": name,
                    "decision": "int8 per-channel weights",
                    "reason": "group-wise 4-bit needs group=1 conv or a 2-D matmul weight",
                }
            )
        else:
            axis, block = reduce_axis, weight.group_size
    if not scheme.is_float and not scheme.per_channel and block is None:
        axis = None
    if scheme.per_channel and axis is None and block is None and not scheme.is_float:
        plan.decisions.append(
            {"node": name, "decision": "per-tensor weights", "reason": "no per-output-channel axis"}
        )
    plan.params.append(ParamSpec(idx, 1, w_name, "weight", scheme, axis, block))
    if node.op_type == "MatMul" or len(node.input) < 3 or not node.input[2]:
        return
    bias = node.input[2]
    if bias not in constants:
        return
    if act.is_float or scheme.is_float or input_key is None:
        if act.is_float:
            plan.params.append(ParamSpec(idx, 2, bias, "constant", act))
        return
    plan.params.append(
        ParamSpec(
            idx,
            2,
            bias,
            "bias",
            scheme,
            axis=0 if axis is not None else None,
            activation_key=input_key,
            weight_tensor=w_name,
        )
    )


def _weight_axes(node: onnx.NodeProto, shape: tuple[int, ...]) -> tuple[int | None, int | None]:
    """(output-channel axis, reduction axis) of a weight; None where there is none."""
    op = node.op_type
    if op == "Conv":
        return 0, 1
    if op == "ConvTranspose":
        group = _attr(node, "group", 1)
        if group == 1:
            return 1, 0
        return (0 if len(shape) > 1 and shape[1] == 1 else None), None
    if op == "Gemm":
        return (0, 1) if _attr(node, "transB", 0) else (1, 0)
    if len(shape) >= 2:
        return len(shape) - 1, len(shape) - 2
    return None, None


# --------------------------------------------------------------------------- shared scales


def _share_scales(view: GraphView, plan: QuantPlan) -> None:
    """Outputs of data-movement ops reuse their input's quantization parameters."""
    for idx in plan.quantized:
        node = view.nodes[idx]
        if node.op_type not in SAME_SCALE_OPS or not node.input:
            continue
        src = plan.activations.get(node.input[0])
        if src is None:
            continue
        for out in node.output:
            spec = plan.activations.get(out)
            if spec is not None and spec.scheme == src.scheme and not spec.scheme.is_float:
                spec.share_with = src.share_with or src.key
