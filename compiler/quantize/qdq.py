"""Write the QDQ model: the prepared float graph plus the Q/DQ (or Cast) pairs the plan asks for.

The result is standard ONNX that ONNX Runtime executes as the float-simulated reference:

- activations: QuantizeLinear → DequantizeLinear, per tensor, int8/int16 with a zero point
  (bf16/fp16 activations: Cast → Cast);
- weights: stored quantized (int8/int16, or int4 with a blocked DequantizeLinear) with zero
  point 0 and a DequantizeLinear, per channel along the output-channel axis when asked;
- biases: int32 at scale_in × scale_w with a DequantizeLinear.

The builder is a pure function of (prepared model, plan, activation parameters), so bias
correction can change float biases and rebuild without recalibrating.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np
import onnx
from onnx import helper, numpy_helper

from compiler.defines import QuantizationScheme
from compiler.quantize.errors import QuantizationError
from compiler.quantize.plan import ActivationSpec, ParamSpec, QuantPlan
from compiler.quantize.prepare import remove_unused_initializers
from compiler.quantize.qparams import (
    ActivationQParams,
    bias_safe_weight_scales,
    quantize_bias,
    quantize_with_scales,
    storage_dtype,
    weight_scales,
)
from surgery.graph import FreshNames
from surgery.model import toposort_nodes

__all__ = ["BuildResult", "build_qdq"]

_CAST_TYPES = {"bfloat16": onnx.TensorProto.BFLOAT16, "float16": onnx.TensorProto.FLOAT16}
_NP_FLOATS = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16)}


@dataclass
class BuildResult:
    model: onnx.ModelProto
    weights: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Per quantized constant: role, node, scheme, axis, block size, scale summary."""
    raw_outputs: dict[str, str] = field(default_factory=dict)
    """Node name → name of its float (pre-quantization) output in the QDQ model."""
    notes: list[dict[str, str]] = field(default_factory=list)


class _Builder:
    def __init__(
        self, model: onnx.ModelProto, plan: QuantPlan, qparams: Mapping[str, ActivationQParams]
    ) -> None:
        self.model = onnx.ModelProto()
        self.model.CopyFrom(model)
        self.g = self.model.graph
        self.plan = plan
        self.qparams = qparams
        self.inits = {t.name: t for t in self.g.initializer}
        self.fresh = FreshNames(self.g)
        self.producer = {o: n for n in self.g.node for o in n.output if o}
        self.new_nodes: list[onnx.NodeProto] = []
        self.result = BuildResult(self.model)
        self._param_cache: dict[tuple, str] = {}
        self._float_io = [(list(n.input), list(n.output)) for n in model.graph.node]
        """Each node's tensor names in the float model (rewiring renames them in `g`)."""
        self._qparam_names: dict[str, tuple[str, str]] = {}
        self.dequantized: dict[str, str] = {}
        """Key of a spec on an unquantized producer's tensor → its dequantized tensor."""

    def add_init(self, base: str, value: np.ndarray) -> str:
        name = self.fresh(base)
        tensor = numpy_helper.from_array(np.asarray(value), name)
        self.g.initializer.append(tensor)
        self.inits[name] = tensor
        return name

    def add_node(
        self, op: str, inputs: list[str], outputs: list[str], base: str, **attrs: Any
    ) -> None:
        self.new_nodes.append(helper.make_node(op, inputs, outputs, name=self.fresh(base), **attrs))

    # ---- activations

    def activation(self, spec: ActivationSpec) -> None:
        if spec.produced_by_quantized:
            producer = self.producer[spec.tensor]
            raw = self.fresh(f"{spec.tensor}_prequant")
            for k, out in enumerate(producer.output):
                if out == spec.tensor:
                    producer.output[k] = raw
            src, dst = raw, spec.tensor
            if spec.narrow is not None:
                src = self.cast_pair(src, f"{spec.key}_{spec.narrow.kind}", spec.narrow)
        else:
            src = self.dequantized.get(spec.reads_dequantized or "", spec.tensor)
            dst = self.fresh(f"{spec.key.replace('::', '_')}_dequantized")
            self.dequantized[spec.key] = dst
            for idx, k in spec.consumers:
                self.g.node[idx].input[k] = dst
        base = spec.key.replace("::", "_")
        if spec.scheme.is_float:
            self.cast_pair(src, base, spec.scheme, dst)
            return
        scale_name, zp_name = self.qparam_names(spec)
        quantized = self.fresh(f"{base}_quantized")
        self.add_node(
            "QuantizeLinear", [src, scale_name, zp_name], [quantized], f"{base}_QuantizeLinear"
        )
        self.add_node(
            "DequantizeLinear", [quantized, scale_name, zp_name], [dst], f"{base}_DequantizeLinear"
        )

    def cast_pair(
        self, src: str, base: str, scheme: QuantizationScheme, dst: str | None = None
    ) -> str:
        """Round `src` to the float `scheme` and back to float32 (into `dst`, or a fresh name)."""
        base = base.replace("::", "_")
        cast = self.fresh(f"{base}_{scheme.kind}")
        dst = dst or self.fresh(f"{base}_{scheme.kind}_float")
        self.add_node("Cast", [src], [cast], f"{base}_Cast", to=_CAST_TYPES[scheme.kind])
        self.add_node("Cast", [cast], [dst], f"{base}_CastBack", to=onnx.TensorProto.FLOAT)
        return dst

    def qparam_names(self, spec: ActivationSpec) -> tuple[str, str]:
        root = spec.share_with or spec.key
        if root not in self._qparam_names:
            qp = self.qparams[root]
            base = root.replace("::", "_")
            scale = self.add_init(f"{base}_scale", np.array(qp.scale, dtype=np.float32))
            zp = self.add_init(
                f"{base}_zero_point", np.array(qp.zero_point, dtype=storage_dtype(qp.scheme.bits))
            )
            self._qparam_names[root] = (scale, zp)
        return self._qparam_names[root]

    # ---- constants

    def param(
        self, spec: ParamSpec, weight_scales_by_tensor: dict[tuple[str, int], np.ndarray]
    ) -> None:
        node = self.g.node[spec.node]
        value = numpy_helper.to_array(self.inits[spec.tensor])
        if spec.role == "bias":
            out = self.bias(spec, node, value, weight_scales_by_tensor)
        elif spec.scheme.is_float:
            out = self.float_constant(spec, value)
        else:
            out = self.int_constant(spec, node, value, weight_scales_by_tensor)
        if out is not None:
            node.input[spec.input_index] = out

    def float_constant(self, spec: ParamSpec, value: np.ndarray) -> str:
        key = ("float", spec.tensor, spec.scheme.kind)
        if key in self._param_cache:
            return self._param_cache[key]
        stored = self.add_init(
            f"{spec.tensor}_{spec.scheme.kind}", value.astype(_NP_FLOATS[spec.scheme.kind])
        )
        out = self.fresh(f"{spec.tensor}_dequantized")
        self.add_node("Cast", [stored], [out], f"{spec.tensor}_Cast", to=onnx.TensorProto.FLOAT)
        self._record(spec, spec.scheme, None, None, None)
        self._param_cache[key] = out
        return out

    def int_constant(
        self,
        spec: ParamSpec,
        node: onnx.NodeProto,
        value: np.ndarray,
        scales_out: dict[tuple[str, int], np.ndarray],
    ) -> str:
        bounds = self._saturating_bounds(spec, node) if spec.role == "constant" else None
        if bounds is not None and np.issubdtype(value.dtype, np.floating):
            largest = float(np.finfo(value.dtype).max)  # stored clipped, still finite
            bounds = (max(bounds[0], -largest), min(bounds[1], largest))
        if (
            bounds is not None
            and value.size
            and (float(value.min()) < bounds[0] or float(value.max()) > bounds[1])
        ):
            value = np.clip(value, *bounds).astype(value.dtype)
        else:
            bounds = None
        if np.issubdtype(value.dtype, np.floating) and not np.isfinite(value).all():
            raise QuantizationError(
                f"constant {spec.tensor!r} of node {node.name!r} ({node.op_type}) holds "
                "inf or NaN values, which no integer scale represents",
                hint="replace them with finite values in the float model (an attention mask "
                "can use finfo(float32).min), or keep the node float with a custom "
                "quantization config",
            )
        key = ("int", spec.tensor, spec.scheme, spec.axis, spec.block_size, bounds)
        if key in self._param_cache:
            return self._param_cache[key]
        scale = weight_scales(value, spec.scheme, spec.axis, spec.block_size)
        if spec.role == "weight":
            scale = self._bias_safe(spec, node, scale)
            scales_out[(spec.tensor, spec.node)] = scale
        q = quantize_with_scales(value, scale, spec.scheme, spec.axis, spec.block_size)
        base = spec.tensor
        stored = self.add_init(f"{base}_quantized", q.values)
        scale_name = self.add_init(f"{base}_scale", q.scale)
        inputs = [stored, scale_name]
        if q.zero_point is not None:
            inputs.append(self.add_init(f"{base}_zero_point", q.zero_point))
        attrs: dict[str, Any] = {}
        if q.axis is not None:
            attrs["axis"] = q.axis
        if q.block_size is not None:
            attrs["block_size"] = q.block_size
        out = self.fresh(f"{base}_dequantized")
        self.add_node("DequantizeLinear", inputs, [out], f"{base}_DequantizeLinear", **attrs)
        self._record(spec, spec.scheme, q.axis, q.block_size, q.scale)
        self._param_cache[key] = out
        return out

    def _saturating_bounds(
        self, spec: ParamSpec, node: onnx.NodeProto
    ) -> tuple[float, float] | None:
        """For the constant operand c of a quantized Mul(a, c) or Add(a, c): the values beyond
        which the result is past its range by more than a whole range width, so the result's
        QuantizeLinear saturates however far c goes; c is stored clipped to them.

        An attention mask stores finfo(float32).min: as mask·finfo.min (a Mul factor: every
        nonzero dequantized a, |a| ≥ its step s_a, puts a·c beyond twice the product's reach
        once |c| > 2·reach / s_a) or, once a causal mask folds to a constant, as the Add
        operand itself (a + c is below lo − width for every a ≤ hi_a once c < lo − hi_a −
        width). Stored as is, c would get a scale of ~1e36 and the integer op a ~1e35
        requantization multiplier that no fixed point holds; clipped, the stored constant and
        the saturated results are unchanged in effect.

        Max(a, c) / Min(a, c) read c only where it passes a: below a's range (above, for Min)
        every value of c gives a itself, beyond the result's range it saturates. JAX's softmax
        guard Max(−inf, ReduceMax(x)) is such a Max: its −inf is stored as a's lower end."""
        inputs, outputs = self._float_io[spec.node]
        if (
            node.op_type not in ("Mul", "Add", "Max", "Min")
            or len(inputs) != 2
            or spec.axis is not None
        ):
            return None
        a_spec = self.plan.activations.get(inputs[1 - spec.input_index])
        out_spec = self.plan.activations.get(outputs[0])
        if a_spec is None or out_spec is None:
            return None
        a_qp = self.qparams.get(a_spec.share_with or a_spec.key)
        out_qp = self.qparams.get(out_spec.share_with or out_spec.key)
        if a_qp is None or out_qp is None:
            return None
        out = out_qp.range
        width = out.hi - out.lo
        if node.op_type == "Add":
            return out.lo - a_qp.range.hi - width, out.hi - a_qp.range.lo + width
        if node.op_type == "Max":  # a whole width below: a's lowest code rounds below a.lo
            return min(a_qp.range.lo, out.lo) - width, out.hi + width
        if node.op_type == "Min":
            return out.lo - width, max(a_qp.range.hi, out.hi) + width
        reach = max(-out.lo, out.hi)
        if a_qp.scale <= 0 or reach <= 0:
            return None
        limit = 2.0 * reach / a_qp.scale
        return -limit, limit

    def _bias_safe(self, spec: ParamSpec, node: onnx.NodeProto, scale: np.ndarray) -> np.ndarray:
        bias_spec = next(
            (p for p in self.plan.params if p.node == spec.node and p.role == "bias"), None
        )
        if bias_spec is None or bias_spec.activation_key is None:
            return scale
        input_qp = self._activation_qparams(bias_spec.activation_key)
        bias = numpy_helper.to_array(self.inits[bias_spec.tensor])
        return bias_safe_weight_scales(scale, bias, input_qp.scale, spec.axis)

    def _activation_qparams(self, key: str) -> ActivationQParams:
        spec = self.plan.activations[key]
        return self.qparams[spec.share_with or key]

    def bias(
        self,
        spec: ParamSpec,
        node: onnx.NodeProto,
        value: np.ndarray,
        scales: dict[tuple[str, int], np.ndarray],
    ) -> str | None:
        assert spec.activation_key is not None and spec.weight_tensor is not None
        w_scale = scales.get((spec.weight_tensor, spec.node))
        if w_scale is None:
            return None
        if w_scale.size > 1 and w_scale.size != value.size:
            self.result.notes.append(
                {
                    "node": node.name,
                    "note": "bias shape does not match the weight channels; kept float",
                }
            )
            return None
        input_qp = self._activation_qparams(spec.activation_key)
        q = quantize_bias(value, input_qp.scale, w_scale)
        base = spec.tensor
        stored = self.add_init(f"{base}_quantized", q.values)
        scale_name = self.add_init(f"{base}_scale", q.scale)
        out = self.fresh(f"{base}_dequantized")
        attrs = {"axis": q.axis} if q.axis is not None else {}
        self.add_node(
            "DequantizeLinear", [stored, scale_name], [out], f"{base}_DequantizeLinear", **attrs
        )
        self._record(spec, None, q.axis, None, q.scale, dtype="int32")
        return out

    def _record(
        self,
        spec: ParamSpec,
        scheme: QuantizationScheme | None,
        axis: int | None,
        block: int | None,
        scale: np.ndarray | None,
        dtype: str | None = None,
    ) -> None:
        entry: dict[str, Any] = {
            "node": self.g.node[spec.node].name,
            "role": spec.role,
            "dtype": dtype
            or (
                scheme.kind if scheme and scheme.is_float else f"int{scheme.bits if scheme else 32}"
            ),
            "axis": axis,
        }
        if block is not None:
            entry["block_size"] = block
        if scale is not None and scale.size:
            entry["scale_min"] = float(scale.min())
            entry["scale_max"] = float(scale.max())
        self.result.weights[spec.tensor] = entry

    # ---- assembly

    def build(self) -> BuildResult:
        # Pairs on unquantized producers first (those reading another pair's dequantized
        # value after it), then the producers' own pairs, which rename their outputs.
        activations = self.plan.activations.values()
        for spec in sorted(activations, key=lambda a: a.reads_dequantized is not None):
            if not spec.produced_by_quantized:
                self.activation(spec)
        for spec in activations:
            if spec.produced_by_quantized:
                self.activation(spec)
        scales: dict[tuple[str, int], np.ndarray] = {}
        ordered = sorted(
            self.plan.params, key=lambda p: {"weight": 0, "constant": 1, "bias": 2}[p.role]
        )
        for spec in ordered:
            self.param(spec, scales)
        for idx in self.plan.quantized:
            node = self.g.node[idx]
            if node.output:
                self.result.raw_outputs[node.name] = node.output[0]
        self.g.node.extend(self.new_nodes)
        remove_unused_initializers(self.model)
        toposort_nodes(self.model)
        return self.result


def build_qdq(
    model: onnx.ModelProto, plan: QuantPlan, qparams: Mapping[str, ActivationQParams]
) -> BuildResult:
    """The QDQ model for `plan` with activation parameters `qparams` (keyed like plan.activations)."""
    return _Builder(model, plan, qparams).build()
