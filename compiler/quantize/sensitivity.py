"""Output sensitivity: how much each quantized layer, quantized alone, degrades the model output.

The per-layer errors of `compiler.quantize.analysis` say how well a layer's own tensor is
represented; they do not say how much that error matters downstream. On an ill-conditioned model
the two differ by orders of magnitude: PP-OCRv4's detector loses 20 dB at its output from
int8-quantizing nothing but its input, whose own SQNR is ~45 dB. Mixed precision aimed at an
output SQNR has to rank layers by their effect on the output.

Here a *unit* is one activation Q/DQ (or Cast) pair of the QDQ model together with the quantized
constants (weights, biases, constant operands) of the node that produces it — or of the conv
fused into that producer. One copy of the QDQ model gets a 0/1 switch per unit: every switched
value becomes `float + m·(quantized − float)`, the float weights coming from the float model.
With one unit switched on at a time, ONNX Runtime returns the outputs with only that unit
quantized; their noise against the float outputs, summed over the samples, is the unit's output
sensitivity — counted per output piece as well (`compiler.quantize.holdout.scored_pieces`: each
output, each part of an output that concatenates), so a unit that ruins a detector's scores is
not ranked by the boxes' noise it hardly adds to. All switches off compute the float model and all on the QDQ model (tested); the
run with all on is reported too, so the caller can see how far the units' noise adds up — only
roughly on a saturating model (PP-OCRv4: the 16 blocks' noise sums to 1.3 dB more than the
total), which is why `compiler.quantize.hybrid` re-measures after every round.

Cost: (units + 1) runs per sample, or (blocks + 1) with `blocks` runs of neighbouring units, so
it is worth few samples (`limit`); memory is one sample's outputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from compiler.quantize.analysis import (
    QuantizedTensor,
    find_quantized_tensors,
    run_outputs,
    sqnr_db,
)
from compiler.quantize.calibrate import Progress, reference_session, with_outputs
from compiler.quantize.errors import QuantizationError
from compiler.quantize.holdout import piece_powers, scored_pieces, worst_piece
from compiler.quantize.plan import FUSED_ACTIVATIONS
from compiler.quantize.samples import CalibrationData, SamplePasses, as_feed, input_signature
from surgery.graph import FreshNames

__all__ = ["OutputSensitivity", "UnitSensitivity", "output_sensitivity"]

MASK_INPUT = "__unit_switches"


@dataclass(frozen=True)
class UnitSensitivity:
    """The model outputs' error with only these units quantized."""

    tensors: tuple[str, ...]
    """The float tensors of the units' activation pairs (one, or a block of neighbours)."""
    noise: float
    """Σ (float output − output)² over the samples and outputs."""
    sqnr_db: float
    """That of the output piece (`ScoredPiece`) these units harm most."""
    piece_noise: tuple[float, ...] = ()
    """`noise` per piece, in `OutputSensitivity.pieces` order."""


@dataclass
class OutputSensitivity:
    """Units (or blocks) most harmful first; `signal` is Σ float output², `total_noise` the
    noise with every unit quantized (the QDQ model)."""

    units: list[UnitSensitivity]
    signal: float
    total_noise: float
    samples: int
    skipped: list[str] = field(default_factory=list)
    pieces: tuple[str, ...] = ()
    """The labels of the output pieces noise is also counted in (`scored_pieces`)."""
    piece_signal: tuple[float, ...] = ()

    @property
    def total_sqnr_db(self) -> float:
        return sqnr_db(self.signal, self.total_noise)

    def to_dict(self) -> dict[str, Any]:
        return {
            "samples": self.samples,
            "total_sqnr_db": _finite(self.total_sqnr_db),
            "sum_of_units_sqnr_db": _finite(sqnr_db(self.signal, sum(u.noise for u in self.units))),
            "units": [
                {"tensors": list(u.tensors), "sqnr_db": _finite(u.sqnr_db)} for u in self.units
            ],
        }


def _finite(value: float) -> float | None:
    return round(value, 4) if math.isfinite(value) else None


def output_sensitivity(
    float_model: onnx.ModelProto,
    qdq_model: onnx.ModelProto,
    data: CalibrationData,
    *,
    limit: int | None = 2,
    blocks: int | None = None,
    progress: Progress | None = None,
) -> OutputSensitivity:
    """Output noise of each unit of `qdq_model` quantized alone (see the module docstring).

    `blocks=N` measures N runs of neighbouring units (in graph order) instead of every unit:
    N + 1 runs per sample instead of units + 1, for models whose units are many and slow."""
    pairs, unmatched = find_quantized_tensors(qdq_model, float_model)
    if not pairs:
        raise QuantizationError(
            "no quantized activations of the QDQ model match a tensor of the float model",
            hint="pass the float model the QDQ model was quantized from",
        )
    switched = switched_model(qdq_model, float_model, pairs)
    groups = _blocks(len(pairs), blocks)
    outputs = [o.name for o in float_model.graph.output]
    pieces = scored_pieces(float_model)
    float_sess = reference_session(with_outputs(float_model, outputs), label="the float model")
    switch_sess = reference_session(switched, label="the quantized model")
    signature = input_signature(float_model)
    noise = np.zeros((len(groups) + 1, len(pieces)))
    signal = np.zeros(len(pieces))
    done = 0
    for sample in islice(SamplePasses(data).new_pass(), limit):
        feed = as_feed(sample, signature, done)
        ref = run_outputs(float_sess, outputs, feed, done)
        for k, group in enumerate([*groups, range(len(pairs))]):
            masks = np.zeros(len(pairs), np.float32)
            masks[list(group)] = 1.0
            got = run_outputs(switch_sess, outputs, {**feed, MASK_INPUT: masks}, done)
            sample_signal, noise_k = piece_powers(pieces, outputs, ref, got)
            noise[k] += noise_k
        signal += sample_signal
        done += 1
        if progress is not None:
            progress(done, limit)
    if done == 0:
        raise QuantizationError("the sensitivity data yielded no samples")
    pooled = float(signal.sum())
    units = [
        UnitSensitivity(
            tuple(dict.fromkeys(pairs[i].tensor for i in group)),
            float(noise[k].sum()),
            worst_piece(signal, noise[k])[1],
            tuple(float(n) for n in noise[k]),
        )
        for k, group in enumerate(groups)
    ]
    units.sort(key=lambda u: (u.sqnr_db, -u.noise))
    return OutputSensitivity(
        units,
        pooled,
        float(noise[-1].sum()),
        done,
        unmatched,
        tuple(p.label for p in pieces),
        tuple(float(v) for v in signal),
    )


def _blocks(n: int, blocks: int | None) -> list[range]:
    """Every unit alone, or `blocks` runs of neighbours of (nearly) equal length."""
    if blocks is None or blocks >= n:
        return [range(k, k + 1) for k in range(n)]
    if blocks < 1:
        raise QuantizationError(f"blocks={blocks}: must be at least 1")
    cuts = np.linspace(0, n, blocks + 1).round().astype(int)
    return [range(int(a), int(b)) for a, b in zip(cuts[:-1], cuts[1:], strict=True) if b > a]


def switched_model(
    qdq_model: onnx.ModelProto, float_model: onnx.ModelProto, pairs: list[QuantizedTensor]
) -> onnx.ModelProto:
    """The QDQ model with a switch per unit (graph input `MASK_INPUT`, one float per pair):
    all switches 0 computes the float model, all 1 the QDQ model."""
    model = onnx.ModelProto()
    model.CopyFrom(qdq_model)
    g = model.graph
    fresh = FreshNames(g)

    g.input.append(helper.make_tensor_value_info(MASK_INPUT, onnx.TensorProto.FLOAT, [len(pairs)]))
    by_name = {n.name: n for n in g.node}
    extra: list[onnx.NodeProto] = []
    switches: list[str] = []
    for k, pair in enumerate(pairs):
        index = fresh(f"__switch_{k}_index")
        g.initializer.append(numpy_helper.from_array(np.array(k, np.int64), index))
        switch = fresh(f"__switch_{k}")
        extra.append(helper.make_node("Gather", [MASK_INPUT, index], [switch], name=switch))
        switches.append(switch)
        second = by_name[pair.nodes[1].name]
        quantized = fresh(f"{pair.dequantized}__quantized")
        second.output[0] = quantized
        extra += _blend(pair.source, quantized, switch, pair.dequantized, fresh)
    owners = _constant_owners(g, float_model, pairs)
    float_inits = {t.name: t for t in float_model.graph.initializer}
    float_nodes = {n.name: n for n in float_model.graph.node if n.name}
    dq_outputs = _constant_dequantizers(g)
    for node in g.node:
        unit = owners.get(node.name)
        reference = float_nodes.get(node.name)
        if unit is None or reference is None:
            continue
        for i, name in enumerate(node.input):
            if name not in dq_outputs or i >= len(reference.input):
                continue
            original = float_inits.get(reference.input[i])
            if original is None:
                continue
            float_name = fresh(f"{original.name}__float")
            g.initializer.append(
                numpy_helper.from_array(numpy_helper.to_array(original), float_name)
            )
            out = fresh(f"{name}__switched")
            extra += _blend(float_name, name, switches[unit], out, fresh)
            node.input[i] = out
    g.node.extend(extra)
    return model


def _blend(
    original: str, quantized: str, switch: str, out: str, fresh: Any
) -> list[onnx.NodeProto]:
    """out = original + switch·(quantized − original)."""
    diff, scaled = fresh(f"{out}__diff"), fresh(f"{out}__scaled")
    return [
        helper.make_node("Sub", [quantized, original], [diff], name=diff),
        helper.make_node("Mul", [diff, switch], [scaled], name=scaled),
        helper.make_node("Add", [original, scaled], [out], name=fresh(f"{out}__blend")),
    ]


def _constant_dequantizers(g: onnx.GraphProto) -> set[str]:
    """Outputs of DequantizeLinear nodes reading an initializer (quantized constants)."""
    inits = {t.name for t in g.initializer}
    return {
        n.output[0]
        for n in g.node
        if n.op_type == "DequantizeLinear" and n.input and n.input[0] in inits
    }


def _constant_owners(
    g: onnx.GraphProto, float_model: onnx.ModelProto, pairs: list[QuantizedTensor]
) -> dict[str, int]:
    """Node name → unit whose switch also covers the node's quantized constants: the unit of
    the node's output, or of the Relu/Clip it is fused into."""
    unit_of = {p.tensor: k for k, p in reversed(list(enumerate(pairs)))}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in float_model.graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    owners: dict[str, int] = {}
    for node in float_model.graph.node:
        if not node.name or not node.output:
            continue
        tensor: str | None = node.output[0]
        for _ in range(len(float_model.graph.node)):
            if tensor is None or tensor in unit_of:
                break
            after = readers.get(tensor, [])
            tensor = (
                after[0].output[0]
                if len(after) == 1 and after[0].op_type in FUSED_ACTIVATIONS
                else None
            )
        if tensor is not None and tensor in unit_of:
            owners[node.name] = unit_of[tensor]
    return owners
