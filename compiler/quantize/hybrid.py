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

**Output target** (`target_sqnr_db`). Per-layer cosines do not see how much a layer's error
grows on the way to the output: on PP-OCRv4's detector every layer keeps a single-layer cosine
above 0.98 while the output is at 11 dB, and int8 on the input alone (cosine 0.99998) caps the
output near 21 dB. With a target, layers are ranked by their *output sensitivity*
(`compiler.quantize.sensitivity`: the output's noise with only that layer — or a block of
neighbouring layers — quantized), and the most harmful are raised, round by round, until the
outputs reach it on the analysis samples — every output, and every part of an output that
concatenates (`compiler.quantize.holdout.scored_pieces`), on its own: pooled, a detector's
boxes hide its collapsed scores from any target. Each round raises as many blocks as
the measured noise shares say are needed, so a model already over the target is left alone.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, Literal

import numpy as np
import onnx

from compiler.defines import (
    NodeQuantizationConfig,
    QuantizationParams,
    QuantizationScheme,
    bfloat16_scheme,
    quantization_scheme,
)
from compiler.quantize.analysis import (
    AnalysisResult,
    ErrorMetrics,
    ErrorSums,
    LayerError,
    analyze_quantization_error,
    run_outputs,
    sqnr_db,
)
from compiler.quantize.calibrate import Progress, reference_session, with_outputs
from compiler.quantize.errors import QuantizationError
from compiler.quantize.holdout import piece_powers, scored_pieces, worst_piece
from compiler.quantize.quantizer import QuantizedModel, quantize_model
from compiler.quantize.samples import CalibrationData, SamplePasses, as_feed, input_signature
from compiler.quantize.sensitivity import OutputSensitivity, output_sensitivity
from surgery.targets import Target, resolve_target

__all__ = ["DEFAULT_COS_THRESH", "HybridResult", "RaisedLayer", "auto_hybrid", "wide_config"]

DEFAULT_COS_THRESH = 0.98
DEFAULT_SENSITIVITY_BLOCKS = 16
TARGET_MARGIN = 0.8
"""Each round aims at this fraction of the target's noise (the shares are estimates)."""
NEGLIGIBLE = 0.1
"""A block whose share of the noise is under this fraction of the target's noise is not worth
raising on its own."""
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
    cosine_before: float | None
    euclidean_before: float | None
    cosine_after: float | None = None
    euclidean_after: float | None = None
    output_sqnr_db: float | None = None
    """Target mode: the outputs' SQNR with only this layer's block quantized."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "layer": self.layer,
            "tensor": self.tensor,
            "nodes": list(self.nodes),
            "precision": self.precision,
            "round": self.round,
            "reason": self.reason,
            "cosine_before": _rounded(self.cosine_before),
            "euclidean_before": _rounded(self.euclidean_before),
            "cosine_after": _rounded(self.cosine_after),
            "euclidean_after": _rounded(self.euclidean_after),
            "output_sqnr_db": _rounded(self.output_sqnr_db),
        }


def _rounded(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else round(value, 6)


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
    target_sqnr_db: float | None = None,
    sensitivity_blocks: int | None = DEFAULT_SENSITIVITY_BLOCKS,
    sensitivity_limit: int | None = 2,
) -> HybridResult:
    """Quantize `model`, raising layers under `cos_thresh` (or over `euc_thresh`) round by round.

    `params` may be an `RknnConfig`: its `auto_hybrid_cos_thresh` / `auto_hybrid_euc_thresh`,
    target and `op_target` pins are used unless given here. The analysis runs on
    `analysis_data` (default: the calibration data), at most `limit` samples.

    With `target_sqnr_db`, layers are raised by output sensitivity (measured on
    `sensitivity_limit` samples, in `sensitivity_blocks` blocks of neighbouring layers; None: each
    layer alone) until the outputs reach the target on the analysis samples; the thresholds are
    then not used (see the module docstring).
    """
    if max_rounds < 1:
        raise QuantizationError(f"max_rounds={max_rounds}: must be at least 1")
    if metric not in ("single", "entire"):
        raise QuantizationError(f"metric={metric!r}: expected 'single' or 'entire'")
    if target_sqnr_db is not None and not target_sqnr_db > 0:
        raise QuantizationError(f"target_sqnr_db={target_sqnr_db}: must be a positive SQNR in dB")
    rknn_cos = getattr(params, "auto_hybrid_cos_thresh", None)
    rknn_euc = getattr(params, "auto_hybrid_euc_thresh", None)
    cos = cos_thresh if cos_thresh is not None else rknn_cos or DEFAULT_COS_THRESH
    euc = euc_thresh if euc_thresh is not None else rknn_euc
    if not 0.0 < cos <= 1.0:
        raise QuantizationError(f"cos_thresh={cos}: must be in (0, 1]")
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

    def quantize(p: QuantizationParams) -> QuantizedModel:
        return quantize_model(
            model,
            calibration_data,
            p,
            target=tgt,
            progress=progress,
            input_shapes=input_shapes,
            op_target=op_target,
        )

    if target_sqnr_db is not None:
        search = _TargetSearch(quantize, evaluate, limit, base, wide, precision)
        result = search.run(target_sqnr_db, sensitivity_blocks, sensitivity_limit, max_rounds)
        result.settings.update(target=tgt.name, max_rounds=max_rounds)
        return result

    def run(p: QuantizationParams) -> tuple[QuantizedModel, AnalysisResult]:
        q = quantize(p)
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
                for n in _nodes_to_raise(entry.tensor, current)
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


def _nodes_to_raise(tensor: str, quantized: QuantizedModel) -> list[str]:
    """The producer of the tensor, the owner of a scale it shares, a conv fused into it; for a
    graph input, the nodes reading it (their scheme decides how it is quantized)."""
    graph = quantized.float_model.graph
    producer = {o: n for n in graph.node for o in n.output if o}
    tensors = quantized.report.get("tensors", {})
    fused = quantized.report.get("fused", {})
    wanted: list[str] = []
    names = [tensor]
    root = tensors.get(tensor, {}).get("shared_with")
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


# --------------------------------------------------------------------------- output target


def output_errors(
    float_model: onnx.ModelProto,
    qdq_model: onnx.ModelProto,
    data: CalibrationData,
    limit: int | None,
) -> tuple[dict[str, ErrorMetrics], np.ndarray, np.ndarray, int]:
    """Per-output errors over the samples, and the signal and noise of each output piece
    (`scored_pieces` order)."""
    outputs = [o.name for o in float_model.graph.output]
    pieces = scored_pieces(float_model)
    float_sess = reference_session(with_outputs(float_model, outputs), label="the float model")
    quant_sess = reference_session(qdq_model, label="the quantized model")
    signature = input_signature(float_model)
    sums = {name: ErrorSums() for name in outputs}
    signal, noise = np.zeros(len(pieces)), np.zeros(len(pieces))
    done = 0
    for sample in islice(SamplePasses(data).new_pass(), limit):
        feed = as_feed(sample, signature, done)
        ref = run_outputs(float_sess, outputs, feed, done)
        got = run_outputs(quant_sess, outputs, feed, done)
        for name, r, g in zip(outputs, ref, got, strict=True):
            sums[name].add(r, g)
        sample_signal, sample_noise = piece_powers(pieces, outputs, ref, got)
        signal += sample_signal
        noise += sample_noise
        done += 1
    return {k: v.metrics() for k, v in sums.items()}, signal, noise, done


@dataclass
class _TargetSearch:
    """Raise the most output-sensitive blocks until the outputs reach a target SQNR."""

    quantize: Any
    data: CalibrationData
    limit: int | None
    base: QuantizationParams
    wide: NodeQuantizationConfig
    precision: str

    def run(
        self, target: float, blocks: int | None, sensitivity_limit: int | None, max_rounds: int
    ) -> HybridResult:
        current = self.quantize(self.base)
        outputs, signal, noise, samples = self._measure(current)
        initial = AnalysisResult([], outputs, samples)
        sensitivity: OutputSensitivity | None = None
        configs = dict(self.base.custom_quantization_configs)
        raised: list[RaisedLayer] = []
        done: set[str] = set()
        rounds = 0
        for round_no in range(1, max_rounds + 1):
            if worst_piece(signal, noise)[1] >= target:
                break
            if sensitivity is None:
                sensitivity = output_sensitivity(
                    current.float_model,
                    current.model,
                    self.data,
                    limit=sensitivity_limit,
                    blocks=blocks,
                )
            fresh = self._pick(sensitivity, current, done, signal, noise, target, round_no)
            if not fresh:
                break
            for item in fresh:
                configs.update(dict.fromkeys(item.nodes, self.wide))
                done.update(item.nodes)
            current = self.quantize(self.base.with_custom_quantization_configs(configs))
            outputs, signal, noise, samples = self._measure(current)
            raised += fresh
            rounds = round_no
        worst, reached = worst_piece(signal, noise)
        settings = {
            "target_sqnr_db": target,
            "output_sqnr_db": round(reached, 3) if math.isfinite(reached) else None,
            "worst_output": scored_pieces(current.float_model)[worst].label if worst >= 0 else None,
            "precision": self.precision,
            "sensitivity_blocks": blocks,
            "sensitivity": sensitivity.to_dict() if sensitivity is not None else None,
            "analysis_samples": samples,
        }
        final = AnalysisResult([], outputs, samples)
        converged = reached >= target
        remaining = [] if converged else ["outputs"]
        return HybridResult(current, final, initial, raised, rounds, converged, remaining, settings)

    def _measure(
        self, q: QuantizedModel
    ) -> tuple[dict[str, ErrorMetrics], np.ndarray, np.ndarray, int]:
        return output_errors(q.float_model, q.model, self.data, self.limit)

    def _pick(
        self,
        sensitivity: OutputSensitivity,
        current: QuantizedModel,
        done: set[str],
        signal: np.ndarray,
        noise: np.ndarray,
        target: float,
        round_no: int,
    ) -> list[RaisedLayer]:
        """Blocks, most harmful to the worst output piece first, until their share of its
        noise brings it to TARGET_MARGIN of the target's noise (at least one block; none whose
        own share is negligible next to the target's noise)."""
        piece, model_db = worst_piece(signal, noise)
        piece_label = sensitivity.pieces[piece]
        producers = {o: n for n in current.float_model.graph.node for o in n.output if o}
        candidates = []
        for unit in sorted(sensitivity.units, key=lambda u: -u.piece_noise[piece]):
            per_tensor = {t: _nodes_to_raise(t, current) for t in unit.tensors}
            per_tensor = {t: [n for n in ns if n not in done] for t, ns in per_tensor.items()}
            per_tensor = {
                t: [n for n in ns if n not in self.base.unquantized_nodes]
                for t, ns in per_tensor.items()
            }
            if any(per_tensor.values()):
                candidates.append((unit, per_tensor))
        if not candidates:
            return []
        left = sum(unit.piece_noise[piece] for unit, _ in candidates) or 1.0
        allowed = TARGET_MARGIN * signal[piece] / 10 ** (target / 10)
        wanted = max(0.0, 1.0 - allowed / noise[piece]) if noise[piece] > 0 else 0.0
        share, picked = 0.0, []
        for unit, per_tensor in candidates:
            if picked and unit.piece_noise[piece] / left * noise[piece] < NEGLIGIBLE * allowed:
                break
            picked.append((unit, per_tensor))
            share += unit.piece_noise[piece] / left
            if share >= wanted:
                break
        fresh: list[RaisedLayer] = []
        for unit, per_tensor in picked:
            unit_db = sqnr_db(sensitivity.piece_signal[piece], unit.piece_noise[piece])
            reason = (
                f"{piece_label} at {unit_db:.1f} dB with only its block of {len(unit.tensors)} "
                f"layer(s) quantized; at {model_db:.1f} dB in the model < target {target} dB"
            )
            for tensor, nodes in per_tensor.items():
                if not nodes:
                    continue
                producer = producers.get(tensor)
                label = f"[{producer.op_type if producer is not None else 'Input'}] {tensor}"
                fresh.append(
                    RaisedLayer(
                        label,
                        tensor,
                        nodes,
                        self.precision,
                        round_no,
                        reason,
                        None,
                        None,
                        output_sqnr_db=unit_db,
                    )
                )
        return fresh
