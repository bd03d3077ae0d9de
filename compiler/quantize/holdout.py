"""How far a quantized model's outputs are from the float model's on held-out samples, per
output and per part of an output that concatenates (a detector's boxes and scores): what the
CLI's `quantize` and the MCP `quantize_model` tool report and advise on; and the pieces
(`ScoredPiece`) an output SQNR target must reach one by one."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from compiler.quantize.analysis import concat_output_parts, sqnr_db


def output_errors(
    float_out: dict[str, np.ndarray],
    quant_out: dict[str, np.ndarray],
    parts: dict[str, dict[str, np.ndarray]] | None = None,
) -> dict:
    """Per output over all held-out samples (stacked on a leading axis): SQNR (dB) and cosine
    from summed products; an output that is a Concat's data (`concat_output_parts`) also gets
    them per part under "parts", where a collapsed score slice shows."""
    result: dict[str, dict[str, Any]] = {}
    for name, ref in float_out.items():
        result[name] = _errors(ref, quant_out[name])
        masks = (parts or {}).get(name, {})
        if masks and all(m.shape == ref.shape[1:] for m in masks.values()):
            result[name]["parts"] = {
                part: _errors(ref[:, mask], quant_out[name][:, mask])
                for part, mask in masks.items()
            }
    return result


def _errors(ref: np.ndarray, quant: np.ndarray) -> dict[str, float | None]:
    r = ref.astype(np.float64).ravel()
    q = quant.astype(np.float64).ravel()
    noise = float(np.square(r - q).sum())
    signal = float(np.square(r).sum())
    norm = math.sqrt(signal * float(np.square(q).sum()))
    sqnr = None if noise == 0 else sqnr_db(signal, noise)
    cosine = (1.0 if noise == 0 else 0.0) if norm == 0 else float(r @ q) / norm
    return {"sqnr_db": sqnr, "cosine": cosine}


def part_label(output: str, part: str) -> str:
    return f"{output} (part from {part})"


def part_sqnrs(errors: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """SQNR of every part of a concatenated output (`output_errors`' "parts"), by label."""
    return {
        part_label(name, part): perr["sqnr_db"]
        for name, err in errors.items()
        for part, perr in err.get("parts", {}).items()
    }


def holdout_errors(net: Any, model: Any, held: Any) -> dict[str, dict[str, Any]]:
    """`output_errors` of quantized `model` against float `net` over the samples of `held`,
    with the parts of outputs that concatenate (`concat_output_parts`)."""
    floats: dict[str, list[np.ndarray]] = {}
    quants: dict[str, list[np.ndarray]] = {}
    for sample in held:
        for store, outs in ((floats, net.execute(sample)), (quants, model.execute(sample))):
            for k, v in outs.items():
                store.setdefault(k, []).append(v)
    return stacked_errors(floats, quants, net.model)


def stacked_errors(
    floats: dict[str, list[np.ndarray]],
    quants: dict[str, list[np.ndarray]],
    float_model: onnx.ModelProto,
) -> dict[str, dict[str, Any]]:
    """`output_errors` of per-sample outputs (name → one array per held-out sample) of
    `float_model` and its quantized model, with the parts of outputs that concatenate."""
    return output_errors(
        {k: np.stack(v) for k, v in floats.items()},
        {k: np.stack(v) for k, v in quants.items()},
        concat_output_parts(float_model),
    )


@dataclass(frozen=True)
class ScoredPiece:
    """An output, or a part of an output that concatenates, judged on its own: pooled with
    the rest, a detector's scores (0‥1) vanish next to its boxes (hundreds of pixels), and a
    target SQNR met by the pool says nothing of them."""

    label: str
    output: str
    mask: np.ndarray | None = None
    """The part's elements in one sample's output; None: the whole output."""


def scored_pieces(model: onnx.ModelProto) -> list[ScoredPiece]:
    """Every output of `model`, an output that concatenates as its parts."""
    parts = concat_output_parts(model)
    pieces: list[ScoredPiece] = []
    for output in model.graph.output:
        masks = parts.get(output.name, {})
        pieces += [
            ScoredPiece(part_label(output.name, p), output.name, m) for p, m in masks.items()
        ]
        if not masks:
            pieces.append(ScoredPiece(output.name, output.name))
    return pieces


def piece_powers(
    pieces: Sequence[ScoredPiece],
    outputs: Sequence[str],
    ref: Sequence[np.ndarray],
    got: Sequence[np.ndarray],
) -> tuple[np.ndarray, np.ndarray]:
    """Σ ref² and Σ (ref − got)² of each piece over one sample's `outputs` (a part whose
    mask does not fit the sample's output, a dynamic one, counts the whole output)."""
    by_name = dict(zip(outputs, zip(ref, got, strict=True), strict=True))
    signal, noise = np.zeros(len(pieces)), np.zeros(len(pieces))
    for k, piece in enumerate(pieces):
        r, g = (np.asarray(a, np.float64) for a in by_name[piece.output])
        if piece.mask is not None and piece.mask.shape == r.shape:
            r, g = r[piece.mask], g[piece.mask]
        signal[k] = float(np.square(r).sum())
        noise[k] = float(np.square(r - g).sum())
    return signal, noise


def worst_piece(signal: np.ndarray, noise: np.ndarray) -> tuple[int, float]:
    """The index and SQNR (dB) of the piece furthest from its float values; a piece that is
    zero in the float model has no SQNR to reach and is left out (-1, inf if none is left)."""
    worst, worst_db = -1, math.inf
    for k, (s, n) in enumerate(zip(signal, noise, strict=True)):
        db = sqnr_db(float(s), float(n)) if s > 0 else math.inf
        if db < worst_db:
            worst, worst_db = k, db
    return worst, worst_db
