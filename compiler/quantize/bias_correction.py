"""Empirical bias correction: fold each layer's mean quantization error into its bias.

Rounding weights (and clipping the input) shifts each output channel's mean: E[W_q·Q(x)] is not
E[W·x]. For every quantized Conv/ConvTranspose/Gemm with an integer bias, the layer is run twice
on the *float* model's own input x, once in float and once quantized (Q/DQ on x, dequantized
weights and bias), on every calibration sample. The per-channel mean of the difference is added
to the float bias, which is then re-quantized.

Feeding the float input isolates the layer's own error. Comparing against the fully quantized
model instead would fold the upstream layers' errors in as well and, since those layers are
corrected too, count them twice (that over-correction ruins deep networks).

The side model holding the float graph plus one quantized clone per layer runs in ONNX Runtime;
sums are streamed, so memory is O(channels) whatever the number of samples.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from compiler.quantize.calibrate import Progress, float_session
from compiler.quantize.errors import CalibrationDataError
from compiler.quantize.plan import QuantPlan
from compiler.quantize.qdq import BuildResult
from compiler.quantize.qparams import ActivationQParams, storage_dtype
from compiler.quantize.samples import SamplePasses, as_feed, input_signature

__all__ = ["correct_biases"]


@dataclass
class _Target:
    node: str
    float_output: str
    single_output: str
    bias: str
    channel_axis: int
    total: np.ndarray | None = None
    count: int = 0

    def add(self, diff: np.ndarray) -> None:
        axis = self.channel_axis % diff.ndim
        moved = np.moveaxis(diff.astype(np.float64), axis, 0).reshape(diff.shape[axis], -1)
        sums = moved.sum(axis=1)
        self.total = sums if self.total is None else self.total + sums
        self.count += moved.shape[1]


class _SideModel:
    """The float model plus, per target layer, a quantized clone fed with Q/DQ(float input)."""

    def __init__(self, float_model: onnx.ModelProto, built: BuildResult) -> None:
        self.model = onnx.ModelProto()
        self.model.CopyFrom(float_model)
        self.g = self.model.graph
        self.built_nodes = {n.name: n for n in built.model.graph.node}
        self.built_producer = {o: n for n in built.model.graph.node for o in n.output if o}
        self.built_inits = {t.name: t for t in built.model.graph.initializer}
        self.names = {t.name for t in self.g.initializer} | {
            o for n in self.g.node for o in n.output
        }
        self.names |= {i.name for i in self.g.input}
        self.copied: set[str] = set()

    def _copy_dequantized(self, name: str) -> bool:
        """Bring the DequantizeLinear producing `name` (and its initializers) over from the QDQ model."""
        if name in self.copied:
            return True
        node = self.built_producer.get(name)
        if node is None or node.op_type != "DequantizeLinear" or name in self.names:
            return False
        for i in node.input:
            if i not in self.built_inits or i in self.names:
                return False
        for i in node.input:
            if i not in self.copied:
                self.g.initializer.append(self.built_inits[i])
                self.copied.add(i)
        self.g.node.append(node)
        self.copied.add(name)
        return True

    def add_clone(self, float_node: onnx.NodeProto, qp: ActivationQParams) -> str | None:
        built = self.built_nodes.get(float_node.name)
        if built is None or len(built.input) < 3:
            return None
        if not (self._copy_dequantized(built.input[1]) and self._copy_dequantized(built.input[2])):
            return None
        base = f"{float_node.name}__bias_correction"
        scale, zp, q, dq, out = (
            f"{base}_{s}" for s in ("scale", "zero_point", "quantized", "input", "output")
        )
        if any(n in self.names for n in (scale, zp, q, dq, out)):
            return None
        self.g.initializer.append(
            numpy_helper.from_array(np.array(qp.scale, dtype=np.float32), scale)
        )
        self.g.initializer.append(
            numpy_helper.from_array(
                np.array(qp.zero_point, dtype=storage_dtype(qp.scheme.bits)), zp
            )
        )
        x = float_node.input[0]
        self.g.node.append(
            helper.make_node("QuantizeLinear", [x, scale, zp], [q], name=f"{base}_Q")
        )
        self.g.node.append(
            helper.make_node("DequantizeLinear", [q, scale, zp], [dq], name=f"{base}_DQ")
        )
        clone = helper.make_node(
            float_node.op_type, [dq, built.input[1], built.input[2]], [out], name=f"{base}_clone"
        )
        clone.attribute.extend(float_node.attribute)
        self.g.node.append(clone)
        return out


def correct_biases(
    float_model: onnx.ModelProto,
    built: BuildResult,
    plan: QuantPlan,
    qparams: Mapping[str, ActivationQParams],
    data: SamplePasses,
    *,
    progress: Progress | None = None,
) -> dict[str, dict[str, float]]:
    """Update the float biases of `float_model` in place; returns per-node correction sizes."""
    side = _SideModel(float_model, built)
    targets: list[_Target] = []
    for spec in plan.params:
        if spec.role != "bias" or spec.activation_key is None:
            continue
        act = plan.activations[spec.activation_key]
        qp = qparams.get(act.share_with or act.key)
        node = float_model.graph.node[spec.node]
        if qp is None or not node.output:
            continue
        single = side.add_clone(node, qp)
        if single is not None:
            axis = -1 if node.op_type == "Gemm" else 1
            targets.append(_Target(node.name, node.output[0], single, spec.tensor, axis))
    if not targets:
        return {}
    names = [t.float_output for t in targets] + [t.single_output for t in targets]
    session = float_session(side.model, names)
    signature = input_signature(float_model)
    done = 0
    for sample in data.new_pass():
        feed = as_feed(sample, signature, done)
        values = session.run(names, feed)
        for k, target in enumerate(targets):
            target.add(np.asarray(values[k]) - np.asarray(values[k + len(targets)]))
        del values, feed
        done += 1
        if progress is not None:
            progress(done, data.total)
    if done == 0:
        raise CalibrationDataError(
            "the calibration data yielded no samples on the bias-correction pass"
        )
    return _apply(float_model, targets)


def _apply(float_model: onnx.ModelProto, targets: list[_Target]) -> dict[str, dict[str, float]]:
    inits = {t.name: t for t in float_model.graph.initializer}
    report: dict[str, dict[str, float]] = {}
    for target in targets:
        if target.total is None or target.count == 0:
            continue
        shift = target.total / target.count
        bias = numpy_helper.to_array(inits[target.bias])
        if shift.size != bias.size:
            continue
        corrected = (bias.astype(np.float64) + shift.reshape(bias.shape)).astype(bias.dtype)
        inits[target.bias].CopyFrom(numpy_helper.from_array(corrected, target.bias))
        report[target.node] = {
            "max_abs_shift": float(np.abs(shift).max()),
            "mean_abs_shift": float(np.abs(shift).mean()),
        }
    return report
