"""What to try when a quantized model's outputs come out imprecise: one text for the CLI's
`quantize` and the MCP `quantize_model` tool, which name the same remedies their own way."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

LOW_OUTPUT_SQNR_DB = 20.0
"""Held-out output SQNR under which quantize says how to get more precision: at 20 dB the
noise is a tenth of the signal's amplitude, where int8 detectors start to lose boxes."""


def low_sqnr_advice(
    output_sqnr_db: Mapping[str, float | None],
    *,
    raised: bool,
    raise_layers: str,
    analyze: str,
    part_sqnr_db: Mapping[str, float | None] | None = None,
    raise_parts: str = "",
) -> list[str]:
    """What to try when an output's held-out SQNR (None: exact), or a part's of an output that
    concatenates (`part_sqnr_db`), is under `LOW_OUTPUT_SQNR_DB`; nothing otherwise. `raised`:
    layers were already raised to int16/bf16 (hybrid or 16 bits), so the advice is about
    raising more and about the data. `raise_layers` names the switch that raises layers to an
    output target (`--target-sqnr 30`), `raise_parts` the one that judges each part
    (`--auto-hybrid 0.98`), `analyze` the per-layer analysis of this model."""
    wholes = [(sqnr, name) for name, sqnr in output_sqnr_db.items() if sqnr is not None]
    parts = [(sqnr, name) for name, sqnr in (part_sqnr_db or {}).items() if sqnr is not None]
    if not wholes + parts or min(wholes + parts)[0] >= LOW_OUTPUT_SQNR_DB:
        return []
    worst, name = min(wholes + parts)
    advice = [
        f"output {name!r} is at {worst:.1f} dB on the held-out samples (under "
        f"{LOW_OUTPUT_SQNR_DB:.0f} dB): quantization loses much of its signal"
    ]
    only_a_part = not wholes or min(wholes)[0] >= LOW_OUTPUT_SQNR_DB
    if only_a_part and raise_parts:
        # an output target judges whole outputs: the boxes' signal hides the scores' noise
        advice.append(
            f"{raise_parts} raises the layers under that cosine to int16 (bf16 on modalix), "
            f"judging each part of a concatenated tensor; {raise_layers} judges whole outputs"
        )
    elif raised:
        advice.append(f"raise more layers: a higher output target ({raise_layers})")
    else:
        advice.append(
            f"{raise_layers} raises the layers that hurt the outputs most to int16 "
            "(bf16 on modalix), only as many as it takes"
        )
    advice.append(f"{analyze} ranks the layers by their error")
    advice.append(
        "calibrate and hold out samples like the deployment's: on unrelated images a detector's "
        "scores sit near zero and a classifier is unsure, which SQNR punishes"
    )
    return advice


def hybrid_outcome(hybrid: Mapping[str, Any]) -> str | None:
    """One line on whether auto-hybrid (a `HybridResult.to_dict()`) reached its goal: a target
    SQNR missed was silent (27 dB for a 30 dB target, with exit 0). None without one."""
    if not hybrid:
        return None
    settings = hybrid["settings"]
    count = f"{len(hybrid['raised'])} layer(s) raised to {settings.get('precision', 'int16')}"
    if "target_sqnr_db" in settings:
        reached = settings.get("output_sqnr_db")
        got = f"{reached:.2f} dB" if reached is not None else "no finite SQNR"
        worst = settings.get("worst_output")
        where = f" (worst: {worst})" if worst else ""
        target = f"target {settings['target_sqnr_db']:g} dB"
        if hybrid["converged"]:
            return f"{target} reached: {got}{where} on the calibration samples; {count}"
        return (
            f"{target} not reached: {got}{where} on the calibration samples with {count}; "
            "raising more does not get further (analyze shows where the error comes from)"
        )
    if hybrid["converged"]:
        return f"every layer above the auto-hybrid threshold with {count}"
    left = [str(name) for name in hybrid["remaining"]]
    shown = ", ".join(left[:8]) + (" …" if len(left) > 8 else "")
    return f"{len(left)} layer(s) still under the auto-hybrid threshold after {count}: {shown}"
