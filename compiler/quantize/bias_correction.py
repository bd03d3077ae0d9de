"""Empirical bias correction: fold the mean quantization error of each layer into its bias.

Rounding weights shifts each output channel's mean (E[W_q x] ≠ E[W x]), and the shift adds up
layer after layer. Running the float and the QDQ model side by side on the calibration samples
gives, per quantized Conv/ConvTranspose/Gemm, the mean of (float output − quantized output) per
output channel, taken before the fused activation. Adding it to the float bias and re-quantizing
removes the shift. Sums are streamed, so memory is O(channels) whatever the number of samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from compiler.quantize.calibrate import Progress, float_session
from compiler.quantize.errors import CalibrationDataError
from compiler.quantize.plan import QuantPlan
from compiler.quantize.qdq import BuildResult
from compiler.quantize.samples import SamplePasses, as_feed, input_signature

__all__ = ["correct_biases"]


@dataclass
class _Target:
    node: str
    float_output: str
    qdq_output: str
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


def _targets(float_model: onnx.ModelProto, built: BuildResult, plan: QuantPlan) -> list[_Target]:
    targets: list[_Target] = []
    for spec in plan.params:
        if spec.role != "bias":
            continue
        node = float_model.graph.node[spec.node]
        raw = built.raw_outputs.get(node.name)
        if raw is None or not node.output:
            continue
        axis = -1 if node.op_type == "Gemm" else 1
        targets.append(_Target(node.name, node.output[0], raw, spec.tensor, axis))
    return targets


def correct_biases(
    float_model: onnx.ModelProto,
    built: BuildResult,
    plan: QuantPlan,
    data: SamplePasses,
    *,
    progress: Progress | None = None,
) -> dict[str, dict[str, float]]:
    """Update the float biases of `float_model` in place; returns per-node correction sizes."""
    targets = _targets(float_model, built, plan)
    if not targets:
        return {}
    float_sess = float_session(float_model, [t.float_output for t in targets])
    qdq_sess = float_session(built.model, [t.qdq_output for t in targets])
    signature = input_signature(float_model)
    done = 0
    for sample in data.new_pass():
        feed = as_feed(sample, signature, done)
        ref = float_sess.run([t.float_output for t in targets], feed)
        test = qdq_sess.run([t.qdq_output for t in targets], feed)
        for target, f, q in zip(targets, ref, test, strict=True):
            target.add(np.asarray(f) - np.asarray(q))
        del ref, test, feed
        done += 1
        if progress is not None:
            progress(done, data.total)
    if done == 0:
        raise CalibrationDataError("the calibration data yielded no samples on the bias-correction pass")
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
        report[target.node] = {"max_abs_shift": float(np.abs(shift).max()), "mean_abs_shift": float(np.abs(shift).mean())}
    return report
