"""Compare a compiled archive's outputs with the integer reference executor, frame by frame.

The CLI (`surgery run --compare-reference`), the MCP `run_archive` tool and `surgery demo` all
ask the same question — does the compiled program compute exactly what the quantized model
specifies? — so the answer lives here once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx

from compiler.runtime.reference import IntegerExecutor
from surgery.qoperator import qdq_form


def reference_outputs(
    manifest: dict[str, Any], qdq_model: onnx.ModelProto, feed: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """The integer reference executor's outputs on the same frames as the archive was fed."""
    return _reference_run(manifest, qdq_model, feed, keep_intermediates=False)[0]


def _reference_run(
    manifest: dict[str, Any],
    qdq_model: onnx.ModelProto,
    feed: dict[str, np.ndarray],
    *,
    keep_intermediates: bool,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Outputs and (optionally) every intermediate tensor, frames stacked on axis 0. A
    QOperator model is read as the QDQ model compile lowered (`qdq_form`)."""
    executor = IntegerExecutor(
        qdq_form(qdq_model)[0],
        manifest.get("requantization_mode", "sima"),
        keep_intermediates=keep_intermediates,
    )
    nodes = manifest["input_nodes"]
    heads = {n["name"]: (n["shape"][0] if n["shape"] else 1) for n in nodes}
    count = max(1, feed[nodes[0]["name"]].shape[0] // heads[nodes[0]["name"]]) if nodes else 1
    results: dict[str, list[np.ndarray]] = {}
    tensors: dict[str, list[np.ndarray]] = {}
    for k in range(count):
        frame = {name: feed[name][k * h : (k + 1) * h] for name, h in heads.items()}
        for name, value in executor.run(frame).items():
            results.setdefault(name, []).append(np.asarray(value))
        for name, value in executor.intermediates.items():
            tensors.setdefault(name, []).append(np.asarray(value))
    return _stacked(results), _stacked(tensors)


def _stacked(parts: dict[str, list[np.ndarray]]) -> dict[str, np.ndarray]:
    return {
        name: np.concatenate(values, axis=0) if values[0].ndim else values[-1]
        for name, values in parts.items()
    }


@dataclass
class ReferenceComparison:
    """An archive run against the integer reference: every output, and every MLA stage's
    outputs, which is where a difference would be the compiler's or the emulator's. Host
    stages run float ops in ONNX Runtime while the reference runs them in onnx.reference, so
    outputs behind such a stage (an LSTM, a GridSample) may differ in the last bits
    even when every MLA stage is exact."""

    outputs: dict[str, dict[str, Any]]
    mla_stages: list[dict[str, Any]] = field(default_factory=list)

    @property
    def bit_exact(self) -> bool:
        return all(o["bit_exact"] for o in self.outputs.values())

    @property
    def mla_bit_exact(self) -> bool:
        return all(stage["bit_exact"] for stage in self.mla_stages)

    def explanation(self) -> str | None:
        """Why the outputs differ when every MLA stage is exact (None otherwise)."""
        if self.bit_exact or not self.mla_bit_exact:
            return None
        stages = (
            f"all {len(self.mla_stages)} MLA stage(s) match" if self.mla_stages else "no MLA stage"
        )
        return (
            f"{stages} the reference bit for bit; the outputs differ after host float stages "
            "(ONNX Runtime there; the reference executor falls back to onnx.reference for ops "
            "ONNX Runtime has no kernel for)"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "bit_exact": self.bit_exact,
            "mla_bit_exact": self.mla_bit_exact,
            "mla_stages": self.mla_stages,
            "explanation": self.explanation(),
        }


@dataclass(frozen=True)
class ReferenceRun:
    """The reference executor on one feed: its outputs and every tensor it computed, frames
    stacked on axis 0 (what `compare_with_reference` compares a run with)."""

    outputs: dict[str, np.ndarray]
    tensors: dict[str, np.ndarray]


def reference_run(
    manifest: dict[str, Any], qdq_model: onnx.ModelProto, feed: dict[str, np.ndarray]
) -> ReferenceRun:
    """Run the reference once, to compare several compiles of the same model with it."""
    return ReferenceRun(*_reference_run(manifest, qdq_model, feed, keep_intermediates=True))


def compare_with_reference(
    manifest: dict[str, Any],
    qdq_model: onnx.ModelProto,
    feed: dict[str, np.ndarray],
    outputs: dict[str, np.ndarray],
    tensors: dict[str, np.ndarray],
    *,
    reference: ReferenceRun | None = None,
) -> ReferenceComparison:
    """Compare a run (`run_archive(..., keep_tensors=True)`: its outputs and tensors) with the
    reference executor on the same feed (`reference`, when already run on it)."""
    reference = reference or reference_run(manifest, qdq_model, feed)
    references, intermediates = reference.outputs, reference.tensors
    compared = {name: compare_output(value, references[name]) for name, value in outputs.items()}
    stages = []
    for plugin in manifest["plugins"]:
        if plugin["processor"] != "MLA":
            continue
        rows = [
            {
                "name": node["name"],
                **compare_output(tensors[node["name"]], intermediates[node["name"]]),
            }
            for node in plugin["output_nodes"]
            if node["name"] in tensors and node["name"] in intermediates
        ]
        stages.append(
            {
                "name": plugin["name"],
                "bit_exact": all(r["bit_exact"] for r in rows),
                "outputs": rows,
            }
        )
    return ReferenceComparison(compared, stages)


def compare_output(value: np.ndarray, reference: np.ndarray) -> dict[str, Any]:
    """`max_abs_diff_vs_reference` and `bit_exact` for one output."""
    same_shape = reference.shape == value.shape
    if same_shape and value.size:
        diff: float | None = float(
            np.max(np.abs(value.astype(np.float64) - reference.astype(np.float64)))
        )
    else:
        diff = 0.0 if same_shape else None
    return {
        "max_abs_diff_vs_reference": diff,
        "bit_exact": bool(same_shape and np.array_equal(value, reference)),
    }


def random_inputs(
    manifest: dict[str, Any], frames: int = 1, seed: int = 0
) -> dict[str, np.ndarray]:
    """Seeded inputs in [0, 1) (integers in the node's `value_range`, else [0, 100)) of the
    archive's declared input shapes, `frames` stacked on axis 0: what `surgery run` and the
    MCP `run_archive` feed by default."""
    rng = np.random.default_rng(seed)
    feed = {}
    for node in manifest["input_nodes"]:
        shape = list(node["shape"]) or [1]
        shape[0] *= frames
        dtype = np.dtype(node["dtype"])
        if dtype.kind == "f":
            feed[node["name"]] = rng.random(shape, dtype=np.float64).astype(dtype)
        else:
            low, high = node.get("value_range", (0, 100))
            feed[node["name"]] = rng.integers(low, high, shape).astype(dtype)
    return feed
