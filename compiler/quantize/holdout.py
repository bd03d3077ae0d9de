"""How far a quantized model's outputs are from the float model's on held-out samples, per
output and per part of an output that concatenates (a detector's boxes and scores): what the
CLI's `quantize` and the MCP `quantize_model` tool report and advise on."""

from __future__ import annotations

import math
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
