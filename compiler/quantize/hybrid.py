"""Automatic mixed precision (RKNN's `auto_hybrid`): raise the layers int8 cannot represent.

Quantize, analyse layer by layer (`compiler.quantize.analysis`), and give every layer whose
error is over the thresholds a wider precision through per-node custom configs — int16
activations and weights, or BF16 on a target whose MLA offers it (modalix) — then quantize and
analyse again, until no layer is flagged or `max_rounds` is reached. It wraps `quantize_model`
rather than changing it: every round is an ordinary quantization with
`QuantizationParams.with_custom_quantization_configs`, so the record of the final model says
exactly which nodes are wide, and a user can replay the result without this module.

A Concat output is judged by its worst input's slice as well as by the whole tensor (boxes in
pixels and scores in 0‥1 in one tensor: the whole tensor's cosine stays near 1 while the scores
are gone). Layers are judged by their *single* error by default: the entire error of a layer downstream of
a bad one is bad too, and raising it would change nothing. When a flagged tensor reuses another
tensor's scale (a Slice of a Concat: the detection head whose boxes and scores share one
concatenated tensor, where int8 steps sized for box coordinates erase the scores), the node that
owns the scale is raised with it; likewise the conv whose output is fused into a flagged
Relu/Clip.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import onnx

from compiler.defines import (
    NodeQuantizationConfig,
    QuantizationParams,
    QuantizationScheme,
    bfloat16_scheme,
    quantization_scheme,
)
from compiler.quantize.analysis import AnalysisResult, LayerError, analyze_quantization_error
from compiler.quantize.calibrate import Progress
from compiler.quantize.quantizer import QuantizedModel, quantize_model
from compiler.quantize.samples import CalibrationData
from surgery.targets import Target, resolve_target

__all__ = ["DEFAULT_COS_THRESH", "HybridResult", "RaisedLayer", "auto_hybrid", "wide_config"]

DEFAULT_COS_THRESH = 0.98
Metric = Literal["single", "entire"]


@dataclass
class RaisedLayer:
    """One flagged layer: what was raised, why, and what it measured before and after."""

    layer: str
    tensor: str
    nodes: list[str]
    precision: str
    round: int
    reason: str
    cosine_before: float
    euclidean_before: float
    cosine_after: float | None = None
    euclidean_after: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "layer": self.layer,
            "tensor": self.tensor,
            "nodes": list(self.nodes),
            "precision": self.precision,
            "round": self.round,
            "reason": self.reason,
            "cosine_before": round(self.cosine_before, 6),
            "euclidean_before": round(self.euclidean_before, 6),
            "cosine_after": None if self.cosine_after is None else round(self.cosine_after, 6),
            "euclidean_after": None
            if self.euclidean_after is None
            else round(self.euclidean_after, 6),
        }


@dataclass
class HybridResult:
    quantized: QuantizedModel
    """The final quantization (its params carry the custom configs)."""
    analysis: AnalysisResult
    """The analysis of the final model."""
    initial: AnalysisResult
    """The analysis of the all-default model, for before/after comparisons."""
    raised: list[RaisedLayer] = field(default_factory=list)
    rounds: int = 0
    converged: bool = True
    """False when layers were still under the threshold after `max_rounds`."""
    remaining: list[str] = field(default_factory=list)
    """Layers still flagged at the end (already raised, or with nothing to raise)."""
    settings: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "settings": dict(self.settings),
            "rounds": self.rounds,
            "converged": self.converged,
            "raised": [r.to_dict() for r in self.raised],
            "remaining": list(self.remaining),
            "outputs_before": {k: v.to_dict() for k, v in self.initial.outputs.items()},
            "outputs_after": {k: v.to_dict() for k, v in self.analysis.outputs.items()},
        }


def wide_config(target: Target, base: QuantizationParams) -> tuple[NodeQuantizationConfig, str]:
    """BF16 where the target's MLA has it, else int16 activations and int16 weights."""
    mla = target.profile.processors.get("MLA")
    if mla is not None and "bf16" in mla.precisions:
        scheme: QuantizationScheme = bfloat16_scheme()
        return NodeQuantizationConfig(base.calibration_method, scheme, scheme), "bf16"
    act = quantization_scheme(asymmetric=True, per_channel=False, bits=16)
    weight = quantization_scheme(asymmetric=False, per_channel=True, bits=16)
    return NodeQuantizationConfig(base.calibration_method, act, weight), "int16"


def auto_hybrid(
    model: onnx.ModelProto,
    calibration_data: CalibrationData,
    params: QuantizationParams | Any = None,
    *,
    target: str | Target | None = None,
    cos_thresh: float | None = None,
    euc_thresh: float | None = None,
    metric: Metric = "single",
    analysis_data: CalibrationData | None = None,
    limit: int | None = 8,
    max_rounds: int = 4,
    progress: Progress | None = None,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    op_target: Mapping[str, str] | None = None,
) -> HybridResult:
    """Quantize `model`, raising layers under `cos_thresh` (or over `euc_thresh`) round by round.

    `params` may be an `RknnConfig`: its `auto_hybrid_cos_thresh` / `auto_hybrid_euc_thresh`,
    target and `op_target` pins are used unless given here. The analysis runs on
    `analysis_data` (default: the calibration data), at most `limit` samples.
    """
    if max_rounds < 1:
        raise ValueError(f"max_rounds={max_rounds}: must be at least 1")
    if metric not in ("single", "entire"):
        raise ValueError(f"metric={metric!r}: expected 'single' or 'entire'")
    rknn_cos = getattr(params, "auto_hybrid_cos_thresh", None)
    rknn_euc = getattr(params, "auto_hybrid_euc_thresh", None)
    cos = cos_thresh if cos_thresh is not None else rknn_cos or DEFAULT_COS_THRESH
    euc = euc_thresh if euc_thresh is not None else rknn_euc
    if not 0.0 < cos <= 1.0:
        raise ValueError(f"cos_thresh={cos}: must be in (0, 1]")
    if target is None:
        target = getattr(params, "target", None) or "mlsoc"
    if op_target is None and hasattr(params, "placement_pins"):
        op_target = params.placement_pins() or None
    if params is not None and not isinstance(params, QuantizationParams):
        params = params.to_quantization_params()
    base = params or QuantizationParams()
    tgt = resolve_target(target)
    wide, precision = wide_config(tgt, base)
    evaluate = analysis_data if analysis_data is not None else calibration_data

    def run(p: QuantizationParams) -> tuple[QuantizedModel, AnalysisResult]:
        q = quantize_model(
            model,
            calibration_data,
            p,
            target=tgt,
            progress=progress,
            input_shapes=input_shapes,
            op_target=op_target,
        )
        return q, analyze_quantization_error(q.float_model, q.model, evaluate, limit=limit)

    current, analysis = run(base)
    initial = analysis
    configs = dict(base.custom_quantization_configs)
    raised: list[RaisedLayer] = []
    raised_nodes: set[str] = set()
    rounds, converged, remaining = 0, True, []
    for round_no in range(1, max_rounds + 1):
        flagged = [e for e in analysis.layers if _flagged(e, metric, cos, euc)]
        fresh: list[RaisedLayer] = []
        for entry in flagged:
            nodes = [
                n
                for n in _nodes_to_raise(entry, current)
                if n not in raised_nodes and n not in base.unquantized_nodes
            ]
            if not nodes:
                continue
            fresh.append(
                RaisedLayer(
                    entry.label,
                    entry.tensor,
                    nodes,
                    precision,
                    round_no,
                    _reason(entry, metric, cos, euc),
                    entry.worst_cosine(metric),
                    entry.worst_euclidean(metric),
                )
            )
            raised_nodes.update(nodes)
        if not fresh:
            remaining = [e.label for e in flagged]
            converged = not flagged
            break
        for item in fresh:
            for node in item.nodes:
                configs[node] = wide
        current, analysis = run(base.with_custom_quantization_configs(configs))
        rounds = round_no
        for item in fresh:
            after = _find(analysis, item.tensor)
            if after is not None:
                item.cosine_after = after.worst_cosine(metric)
                item.euclidean_after = after.worst_euclidean(metric)
        raised += fresh
    else:
        remaining = [e.label for e in analysis.layers if _flagged(e, metric, cos, euc)]
        converged = not remaining
    settings = {
        "cos_thresh": cos,
        "euc_thresh": euc,
        "metric": metric,
        "precision": precision,
        "target": tgt.name,
        "max_rounds": max_rounds,
        "analysis_samples": analysis.samples,
    }
    return HybridResult(current, analysis, initial, raised, rounds, converged, remaining, settings)


def _flagged(entry: LayerError, metric: Metric, cos: float, euc: float | None) -> bool:
    return entry.worst_cosine(metric) < cos or (
        euc is not None and entry.worst_euclidean(metric) > euc
    )


def _reason(entry: LayerError, metric: str, cos: float, euc: float | None) -> str:
    whole: Any = getattr(entry, metric)
    parts: dict[str, Any] = getattr(entry, f"{metric}_parts")
    where = ""
    if parts and entry.worst_cosine(metric) < whole.cosine:
        worst = min(parts, key=lambda k: parts[k].cosine)
        where = f" (the part from {worst}; whole tensor {whole.cosine:.4f})"
    c, e = entry.worst_cosine(metric), entry.worst_euclidean(metric)
    if c < cos:
        return f"{metric} cosine {c:.4f} < {cos}{where}"
    return f"{metric} euclidean {e:.4g} > {euc}"


def _find(analysis: AnalysisResult, tensor: str) -> LayerError | None:
    try:
        return analysis.layer(tensor)
    except KeyError:
        return None


def _nodes_to_raise(entry: LayerError, quantized: QuantizedModel) -> list[str]:
    """The producer of the tensor, the owner of a scale it shares, a conv fused into it; for a
    graph input, the nodes reading it (their scheme decides how it is quantized)."""
    graph = quantized.float_model.graph
    producer = {o: n for n in graph.node for o in n.output if o}
    tensors = quantized.report.get("tensors", {})
    fused = quantized.report.get("fused", {})
    wanted: list[str] = []
    names = [entry.tensor]
    root = tensors.get(entry.tensor, {}).get("shared_with")
    if root is not None:
        names.append(tensors.get(root, {}).get("tensor", root))
    for name in names:
        node = producer.get(name)
        if node is None:
            wanted += [n.name for n in graph.node if name in n.input]
            continue
        wanted.append(node.name)
        if node.input and node.input[0] in fused:
            conv = producer.get(node.input[0])
            if conv is not None:
                wanted.append(conv.name)
    return list(dict.fromkeys(w for w in wanted if w))
