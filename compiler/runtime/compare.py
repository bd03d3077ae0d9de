"""Compare a compiled archive's outputs with the integer reference executor, frame by frame.

The CLI (`surgery run --compare-reference`), the MCP `run_archive` tool and `surgery demo` all
ask the same question — does the compiled program compute exactly what the quantized model
specifies? — so the answer lives here once.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx

from compiler.runtime.reference import IntegerExecutor


def reference_outputs(
    manifest: dict[str, Any], qdq_model: onnx.ModelProto, feed: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """The integer reference executor's outputs on the same frames as the archive was fed."""
    executor = IntegerExecutor(qdq_model, manifest.get("requantization_mode", "sima"))
    nodes = manifest["input_nodes"]
    heads = {n["name"]: (n["shape"][0] if n["shape"] else 1) for n in nodes}
    count = max(1, feed[nodes[0]["name"]].shape[0] // heads[nodes[0]["name"]]) if nodes else 1
    results: dict[str, list[np.ndarray]] = {}
    for k in range(count):
        frame = {name: feed[name][k * h : (k + 1) * h] for name, h in heads.items()}
        for name, value in executor.run(frame).items():
            results.setdefault(name, []).append(np.asarray(value))
    return {name: np.concatenate(parts, axis=0) for name, parts in results.items()}


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
