"""ONNX Runtime's operator-oriented quantization (QOperator format) rewritten as QDQ.

`quantize_static(..., quant_format=QOperator)` and the int8 models of model zoos carry their
quantization inside integer ops: `QLinearConv`, `QLinearMatMul`, and ONNX Runtime's contrib
`QLinearAdd`, `QGemm`, `QLinearConcat`, ... with data-movement ops (MaxPool, Reshape, Split,
Resize) running on the int8 tensors themselves. No NPU runs those ops, but each one is a float
op between the quantization it names: `QLinearConv(x, xs, xz, w, ws, wz, ys, yz, B)` computes
`Q(Conv(DQ(x), DQ(w), DQ(B)), ys, yz)`. Written that way, with data movement wrapped as
`DQ → op → Q` at the tensor's own scale (exact: the op only moves values), the model is a QDQ
model like the ones `surgery quantize` writes: `check` counts its segments, `fix` rewrites
its float model, and `compile` lowers it with the scales the user chose.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from surgery.graph import (
    DEFAULT_DOMAINS,
    VALUE_MOVING_OPS,
    FreshNames,
    GraphView,
    default_opset,
    drop_unread_initializers,
    tensor_value,
)

_CONTRIB = "com.microsoft"
_PER_AXIS_OPSET = 13
"""DequantizeLinear and QuantizeLinear take per-axis scales (the `axis` attribute) from here."""


@dataclass(frozen=True)
class _Form:
    """How one QLinear op reads as a float op: its operands (input positions of value, scale
    and zero point, or a plain input position), its output quantization (scale and zero point
    positions; None: the op outputs float), and an int32 bias dequantized with the product of
    the first two operands' scales."""

    float_op: str
    operands: tuple[tuple[int, int, int] | int, ...]
    output: tuple[int, int] | None
    bias: int | None = None
    dropped_attributes: frozenset[str] = frozenset()


_ONE_INPUT = ((0, 1, 2),)
_TWO_INPUTS = ((0, 1, 2), (3, 4, 5))
_LAYOUT = frozenset({"channels_last"})
_FORMS: dict[tuple[str, str], _Form] = {
    ("", "QLinearConv"): _Form("Conv", _TWO_INPUTS, (6, 7), bias=8),
    ("", "QLinearMatMul"): _Form("MatMul", _TWO_INPUTS, (6, 7)),
    (_CONTRIB, "QLinearConv"): _Form(
        "Conv", _TWO_INPUTS, (6, 7), bias=8, dropped_attributes=_LAYOUT
    ),
    (_CONTRIB, "QLinearAdd"): _Form("Add", _TWO_INPUTS, (6, 7)),
    (_CONTRIB, "QLinearMul"): _Form("Mul", _TWO_INPUTS, (6, 7)),
    (_CONTRIB, "QGemm"): _Form("Gemm", _TWO_INPUTS, (7, 8), bias=6),
    (_CONTRIB, "QLinearSigmoid"): _Form("Sigmoid", _ONE_INPUT, (3, 4)),
    (_CONTRIB, "QLinearLeakyRelu"): _Form("LeakyRelu", _ONE_INPUT, (3, 4)),
    (_CONTRIB, "QLinearSoftmax"): _Form(
        "Softmax", _ONE_INPUT, (3, 4), dropped_attributes=frozenset({"opset"})
    ),
    (_CONTRIB, "QLinearGlobalAveragePool"): _Form(
        "GlobalAveragePool", _ONE_INPUT, (3, 4), dropped_attributes=_LAYOUT
    ),
    (_CONTRIB, "QLinearAveragePool"): _Form(
        "AveragePool", _ONE_INPUT, (3, 4), dropped_attributes=_LAYOUT
    ),
    (_CONTRIB, "QLinearReduceMean"): _Form("ReduceMean", _ONE_INPUT, (3, 4)),
    (_CONTRIB, "QLinearWhere"): _Form("Where", (0, (1, 2, 3), (4, 5, 6)), (7, 8)),
    (_CONTRIB, "QLinearConcat"): _Form("Concat", (), (0, 1)),
}
"""The QLinear ops ONNX Runtime's QOperator quantizer writes, by (domain, op type)."""

QOPERATOR_OPS = frozenset(op for _, op in _FORMS)
"""Op types of the QOperator format (what `is_qoperator` looks for)."""


def qoperator_form(domain: str, op_type: str) -> bool:
    """Whether (domain, op_type) is a QLinear op this module rewrites."""
    return (("" if domain in DEFAULT_DOMAINS else domain), op_type) in _FORMS


def is_qoperator(view: GraphView) -> bool:
    """Whether the model has an op of ONNX Runtime's QOperator format."""
    if QOPERATOR_OPS.isdisjoint(view.op_types):
        return False
    return any(
        qoperator_form(domain, op) for domain, op in zip(view.domains, view.op_types, strict=True)
    )


QOPERATOR_LEFT_REASON = (
    "an op of ONNX Runtime's QOperator quantization with no QDQ form here (channels-last "
    "layout, a per-row or run-time activation scale): the MLA does not run it; quantize the "
    "float model with `surgery quantize` instead"
)
"""Why a QLinear op that `qoperator_to_qdq` left as it was runs on the APU."""


def qdq_form(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """`model` as QDQ (itself unless it has QOperator ops) and a note on what was rewritten:
    what check, compile and the reference executor take."""
    if not any(qoperator_form(n.domain, n.op_type) for n in model.graph.node):
        return model, []
    conversion = qoperator_to_qdq(model)
    note = conversion.note()
    return conversion.model, [note] if note else []


@dataclass
class QOperatorConversion:
    """The QDQ model, how many QLinear ops became float ops, and the ones left as they were,
    each with the reason (`node name: op: reason`)."""

    model: onnx.ModelProto
    converted: int = 0
    left: list[str] = field(default_factory=list)

    def note(self) -> str | None:
        """One line for a report, or None when nothing was converted or left."""
        if not self.converted and not self.left:
            return None
        text = (
            f"rewrote {self.converted} op(s) of ONNX Runtime's QOperator quantization as QDQ "
            "(DequantizeLinear → float op → QuantizeLinear, with the model's own scales)"
        )
        if self.left:
            shown = "; ".join(self.left[:5])
            more = f"; and {len(self.left) - 5} more" if len(self.left) > 5 else ""
            text += f"; left {len(self.left)} as they are: {shown}{more}"
        return text


class _Unconvertible(Exception):
    """A QLinear op that has no exact QDQ form here (the message says why)."""


@dataclass(frozen=True)
class _Quantization:
    """Scale and zero-point tensors of a quantized run-time tensor, and its integer type."""

    scale: str
    zero_point: str
    elem_type: int


def qoperator_to_qdq(model: onnx.ModelProto) -> QOperatorConversion:
    """A copy of `model` with every QLinear op it can rewrite as DQ → float op → Q, and every
    data-movement op on a quantized tensor as DQ → op → Q at that tensor's quantization.

    Ops left as they were (a per-row activation scale, a run-time scale, channels-last
    layout) are listed with the reason; the model stays valid either way, since each Q
    writes the integer tensor the original op wrote, under its name.
    """
    from surgery.model import toposort_nodes  # model → targets → qdq reads this module

    copied = copy.deepcopy(model)
    if not GraphView(copied).is_sorted:
        toposort_nodes(copied)
    rewriter = _Rewriter(copied)
    rewriter.rewrite()
    return rewriter.result()


class _Rewriter:
    """One pass over the (topologically ordered) top-level graph."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        graph = model.graph
        self.values: dict[str, np.ndarray] = {t.name: tensor_value(t) for t in graph.initializer}
        for node in graph.node:
            if node.op_type == "Constant" and node.output:
                value = next((a.t for a in node.attribute if a.name == "value"), None)
                if value is not None:
                    self.values[node.output[0]] = tensor_value(value)
        self.elem_types: dict[str, int] = {
            v.name: v.type.tensor_type.elem_type
            for v in (*graph.input, *graph.value_info, *graph.output)
        }
        self.elem_types.update((t.name, t.data_type) for t in graph.initializer)
        self.fresh = FreshNames(graph)
        self.quantized: dict[str, _Quantization] = {}
        self.dequantized: dict[tuple[str, str, str, int | None], str] = {}
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.per_axis = False
        self.converted = 0
        self.left: list[str] = []

    def rewrite(self) -> None:
        for node in self.model.graph.node:
            self.rewrite_node(node)
        graph = self.model.graph
        del graph.node[:]
        graph.node.extend(self.nodes)
        graph.initializer.extend(self.initializers)
        drop_unread_initializers(graph)  # the scales and zero points given way to scalars

    def result(self) -> QOperatorConversion:
        model = self.model
        if self.per_axis and default_opset(model) < _PER_AXIS_OPSET:
            model = self._with_per_axis_opset(model)
        return QOperatorConversion(model, self.converted, self.left)

    def _with_per_axis_opset(self, model: onnx.ModelProto) -> onnx.ModelProto:
        """The model at opset 13, where DequantizeLinear takes per-channel weight scales."""
        from surgery.errors import SurgeryError
        from surgery.model import convert_opset

        try:
            return convert_opset(model, _PER_AXIS_OPSET)
        except Exception as exc:
            raise SurgeryError(
                f"the QOperator model has per-channel weight scales, which DequantizeLinear "
                f"takes from opset {_PER_AXIS_OPSET}, and ONNX's version converter could not "
                f"convert it from opset {default_opset(model)}: {exc}",
                hint="convert the model to opset 13 first (onnx.version_converter)",
            ) from exc

    def rewrite_node(self, node: onnx.NodeProto) -> None:
        domain = "" if node.domain in DEFAULT_DOMAINS else node.domain
        form = _FORMS.get((domain, node.op_type))
        if form is not None:
            try:
                added = self.float_form(node, form)
            except _Unconvertible as why:
                self.left.append(f"{node.name or node.output[0]}: {node.op_type}: {why}")
                self.nodes.append(node)
                return
            self.nodes.extend(added)
            self.converted += 1
            return
        if domain == "" and node.op_type == "QuantizeLinear" and len(node.input) > 1:
            self.note_quantize_linear(node)
        elif domain == "" and self.moves_quantized(node):
            self.nodes.extend(self.wrapped_movement(node))
            return
        self.nodes.append(node)

    def note_quantize_linear(self, node: onnx.NodeProto) -> None:
        """Remember the quantization of a QuantizeLinear's per-tensor output."""
        scale = self.values.get(node.input[1])
        if scale is None or scale.size != 1:
            return
        zero = node.input[2] if len(node.input) > 2 else ""
        if zero:
            elem_type = self.elem_types.get(zero, 0)
        else:
            attr = next((a.i for a in node.attribute if a.name == "output_dtype"), 0)
            elem_type = attr or onnx.TensorProto.UINT8
        self.quantized[node.output[0]] = _Quantization(node.input[1], zero, elem_type)
        self.elem_types[node.output[0]] = elem_type

    # QLinear ops

    def float_form(self, node: onnx.NodeProto, form: _Form) -> list[onnx.NodeProto]:
        ins = list(node.input)
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if attrs.get("channels_last"):
            raise _Unconvertible("channels-last layout (NHWC), which the float op has no form of")
        attrs = {k: v for k, v in attrs.items() if k not in form.dropped_attributes}
        operands = form.operands
        if node.op_type == "QLinearConcat":
            if (len(ins) - 2) % 3:
                raise _Unconvertible("inputs are not (value, scale, zero point) triplets")
            operands = tuple((k, k + 1, k + 2) for k in range(2, len(ins), 3))
        if node.op_type == "QLinearSoftmax":
            self._check_softmax_opset(attrs, node)
        added: list[onnx.NodeProto] = []
        inputs: list[str] = []
        scales: list[np.ndarray] = []
        for position, operand in enumerate(operands):
            if isinstance(operand, int):
                inputs.append(ins[operand])
                continue
            value, scale, zero = (ins[k] if k < len(ins) else "" for k in operand)
            axis = self._weight_axis(node, position, value, attrs)
            scales.append(self._constant(scale, "scale"))
            inputs.append(self.dequantize(value, scale, zero, axis, added, node))
        bias = ins[form.bias] if form.bias is not None and form.bias < len(ins) else ""
        if bias:
            inputs.append(self.dequantize_bias(bias, scales, node, attrs, added))
        if node.op_type == "QLinearReduceMean" and default_opset(self.model) >= 18:
            axes = attrs.pop("axes", None)
            if axes is not None:
                inputs.append(self.add_initializer(f"{node.output[0]}_axes", np.array(axes)))
        out = node.output[0]
        quantization = self._output_quantization(node, form, ins, operands)
        if quantization is None:
            added.append(helper.make_node(form.float_op, inputs, [out], name=node.name, **attrs))
            return added
        real = self.float_name(out)
        added.append(helper.make_node(form.float_op, inputs, [real], name=node.name, **attrs))
        added.append(self.quantize(real, out, quantization, node.name or out))
        return added

    def _check_softmax_opset(self, attrs: dict, node: onnx.NodeProto) -> None:
        """QLinearSoftmax computes the Softmax of its `opset` attribute: before 13 it
        normalises over all axes from `axis` on, from 13 over `axis` alone."""
        opset = attrs.get("opset")
        model_opset = default_opset(self.model)
        if opset is not None and (opset < 13) != (model_opset < 13):
            raise _Unconvertible(
                f"Softmax of opset {opset}, whose axis semantics differ from the model's "
                f"opset {model_opset}"
            )

    def _weight_axis(
        self, node: onnx.NodeProto, position: int, value: str, attrs: dict
    ) -> int | None:
        """The axis of the per-channel scale of operand `position`, if it can have one (the
        weight of a Conv, MatMul or Gemm: output channels)."""
        if position != 1 or node.op_type not in ("QLinearConv", "QLinearMatMul", "QGemm"):
            return None
        if node.op_type == "QLinearConv":
            return 0
        weight = self.values.get(value)
        if weight is None:
            return None
        if node.op_type == "QGemm":
            return 0 if attrs.get("transB") else 1
        return weight.ndim - 1

    def dequantize(
        self,
        value: str,
        scale: str,
        zero: str,
        axis: int | None,
        added: list[onnx.NodeProto],
        node: onnx.NodeProto,
    ) -> str:
        """The float tensor of `value` quantized as (`scale`, `zero`): a DequantizeLinear,
        shared by every reader of the same quantized tensor."""
        scale_value = self._constant(scale, "scale")
        if scale_value.size > 1:
            if axis is None:
                raise _Unconvertible(
                    f"scale {scale!r} has {scale_value.size} values: only a weight's scale "
                    "can be per channel"
                )
            self.per_axis = True
        else:
            scale, zero = self.per_tensor(scale, zero)
            axis = None
        key = (value, scale, zero, axis)
        if key not in self.dequantized:
            self.dequantized[key] = self.dequantize_node(value, scale, zero, axis, added, node)
        return self.dequantized[key]

    def dequantize_node(
        self,
        value: str,
        scale: str,
        zero: str,
        axis: int | None,
        added: list[onnx.NodeProto],
        node: onnx.NodeProto,
    ) -> str:
        """A DequantizeLinear of `value` appended to `added`; its output's name."""
        out = self.fresh(f"{value}_dequantized")
        inputs = [value, scale, *([zero] if zero else [])]
        extra = {"axis": axis} if axis is not None else {}
        label = self.fresh(f"{node.name or node.output[0]}_{value}_dequantize")
        added.append(helper.make_node("DequantizeLinear", inputs, [out], name=label, **extra))
        return out

    def dequantize_bias(
        self,
        bias: str,
        scales: Sequence[np.ndarray],
        node: onnx.NodeProto,
        attrs: dict,
        added: list[onnx.NodeProto],
    ) -> str:
        """The float bias of an int32 bias quantized at the product of the input's and the
        weight's scales (times QGemm's alpha, which scales the bias as it scales A·B)."""
        if bias not in self.values:
            raise _Unconvertible(f"bias {bias!r} is computed at run time")
        scale = (
            np.asarray(scales[0], np.float64).ravel() * np.asarray(scales[1], np.float64).ravel()
        )
        if node.op_type == "QGemm":
            scale = scale * float(attrs.get("alpha", 1.0))
        per_channel = scale.size > 1
        self.per_axis |= per_channel
        axis = self.values[bias].ndim - 1 if per_channel else None
        value = scale.astype(np.float32) if per_channel else np.float32(scale[0])
        name = self.add_initializer(f"{bias}_scale", value)
        return self.dequantize_node(bias, name, "", axis, added, node)

    def _output_quantization(
        self,
        node: onnx.NodeProto,
        form: _Form,
        ins: list[str],
        operands: tuple[tuple[int, int, int] | int, ...],
    ) -> _Quantization | None:
        """How the op's output is quantized (None: QGemm without y_scale outputs float)."""
        if form.output is None:
            return None
        scale_at, zero_at = form.output
        scale = ins[scale_at] if scale_at < len(ins) else ""
        if not scale:
            return None
        zero = ins[zero_at] if zero_at < len(ins) else ""
        if self._constant(scale, "output scale").size != 1:
            raise _Unconvertible(f"output scale {scale!r} is not one value")
        if zero:
            elem_type = self._integer_type("", zero)
        else:  # no zero point: the output has its first operand's integer type
            value, _, first_zero = (
                ins[k] if k < len(ins) else ""
                for k in next(o for o in operands if not isinstance(o, int))
            )
            elem_type = self._integer_type(value, first_zero)
        scale, zero = self.per_tensor(scale, zero)
        if not zero:
            zero = self.add_initializer(
                f"{node.output[0]}_zero_point",
                np.zeros((), onnx.helper.tensor_dtype_to_np_dtype(elem_type)),
            )
        quantization = _Quantization(scale, zero, elem_type)
        self.quantized[node.output[0]] = quantization
        self.elem_types[node.output[0]] = elem_type
        return quantization

    def _integer_type(self, value: str, zero: str) -> int:
        """The integer type of quantized tensor `value`: its zero point's, else its own."""
        if zero:
            return self.elem_types.get(zero) or _elem_type(self._constant(zero, "zero point").dtype)
        elem_type = self.elem_types.get(value, 0)
        if not elem_type and value in self.quantized:
            elem_type = self.quantized[value].elem_type
        if not elem_type:
            raise _Unconvertible(f"the integer type of {value!r} is unknown (no zero point)")
        return elem_type

    def quantize(
        self, real: str, out: str, quantization: _Quantization, label: str
    ) -> onnx.NodeProto:
        return helper.make_node(
            "QuantizeLinear",
            [real, quantization.scale, quantization.zero_point],
            [out],
            name=self.fresh(f"{label}_quantize"),
        )

    # data movement on quantized tensors

    def moves_quantized(self, node: onnx.NodeProto) -> bool:
        """Whether `node` moves the values of a quantized tensor (a Concat: of tensors of one
        quantization), so it can run on their float values between DQ and Q."""
        if not node.input or node.input[0] not in self.quantized:
            return False
        if node.op_type == "Concat":
            first = self.quantized[node.input[0]]
            return all(self._same_quantization(self.quantized.get(t), first) for t in node.input)
        return node.op_type in VALUE_MOVING_OPS and (
            node.op_type != "Pad" or self._pad_value_known(node)
        )

    def _same_quantization(self, a: _Quantization | None, b: _Quantization) -> bool:
        if a is None or a.elem_type != b.elem_type:
            return False
        if a == b:
            return True
        return np.array_equal(self.values[a.scale], self.values[b.scale]) and np.array_equal(
            self._zero_value(a), self._zero_value(b)
        )

    def _zero_value(self, q: _Quantization) -> np.ndarray:
        return self.values.get(q.zero_point, np.zeros(())) if q.zero_point else np.zeros(())

    def _pad_value_known(self, node: onnx.NodeProto) -> bool:
        mode = next((a.s for a in node.attribute if a.name == "mode"), b"constant")
        if mode != b"constant" or len(node.input) < 3 or not node.input[2]:
            return True
        return node.input[2] in self.values

    def wrapped_movement(self, node: onnx.NodeProto) -> list[onnx.NodeProto]:
        """DQ → `node` → Q at the quantization of its data input: exact, since the op only
        moves values (Resize interpolates, and rounds as the integer op would)."""
        quantization = self.quantized[node.input[0]]
        before: list[onnx.NodeProto] = []
        after: list[onnx.NodeProto] = []
        moved = copy.deepcopy(node)
        data_inputs = range(len(node.input)) if node.op_type == "Concat" else (0,)
        for k in data_inputs:
            q = self.quantized[node.input[k]]
            moved.input[k] = self.dequantize(
                node.input[k], q.scale, q.zero_point, None, before, node
            )
        if node.op_type == "Pad":
            self._dequantize_pad_value(moved, quantization)
        outputs = range(len(node.output)) if node.op_type == "Split" else (0,)
        for k in outputs:
            out = node.output[k]
            moved.output[k] = self.float_name(out)
            after.append(self.quantize(moved.output[k], out, quantization, node.name or out))
            self.quantized[out] = quantization
            self.elem_types[out] = quantization.elem_type
        return [*before, moved, *after]

    def _dequantize_pad_value(self, pad: onnx.NodeProto, q: _Quantization) -> None:
        """A constant Pad's integer value as the float it stands for (0 → -zero·scale)."""
        mode = next((a.s for a in pad.attribute if a.name == "mode"), b"constant")
        if mode != b"constant":
            return
        integer = self.values.get(pad.input[2]) if len(pad.input) > 2 and pad.input[2] else None
        integer = np.zeros(()) if integer is None else integer
        real = (float(np.ravel(integer)[0]) - float(np.ravel(self._zero_value(q))[0])) * float(
            np.ravel(self.values[q.scale])[0]
        )
        name = self.add_initializer(f"{pad.output[0]}_value", np.float32(real))
        while len(pad.input) < 3:
            pad.input.append("")
        pad.input[2] = name

    # tensors

    def per_tensor(self, scale: str, zero: str) -> tuple[str, str]:
        """Scale and zero point as the scalars a per-tensor Q/DQ takes (ONNX Runtime also
        writes 1-element vectors)."""
        value = self._constant(scale, "scale")
        if value.ndim:
            scale = self.add_initializer(f"{scale}_scalar", value.reshape(()))
        if zero:
            zero_value = self._constant(zero, "zero point")
            if zero_value.size != 1:
                raise _Unconvertible(f"zero point {zero!r} is not one value")
            if zero_value.ndim:
                zero = self.add_initializer(f"{zero}_scalar", zero_value.reshape(()))
        return scale, zero

    def _constant(self, name: str, what: str) -> np.ndarray:
        value = self.values.get(name)
        if value is None:
            raise _Unconvertible(f"{what} {name!r} is computed at run time, not a constant")
        return value

    def add_initializer(self, name: str, value: np.ndarray) -> str:
        name = self.fresh(name)
        array = np.asarray(value)
        self.initializers.append(numpy_helper.from_array(array, name))
        self.values[name] = array
        self.elem_types[name] = _elem_type(array.dtype)
        return name

    def float_name(self, quantized: str) -> str:
        """The name of the float tensor behind `quantized`: ONNX Runtime names a quantized
        tensor `<float name>_quantized`, so the float one gets its name back when free."""
        base = quantized.removesuffix("_quantized")
        return self.fresh(
            base if base != quantized and base not in self.fresh.taken else f"{quantized}_float"
        )


def _elem_type(dtype: np.dtype) -> int:
    return onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
