"""Cross-layer equalization (Nagel et al., "Data-Free Quantization", 2019).

For Conv1 → [Relu | LeakyRelu | PRelu | Clip(0, ∞) | nothing] → Conv2, output channel c of Conv1
is divided by s_c and input channel c of Conv2 multiplied by s_c. The activations in between
are positively homogeneous (f(x/s) = f(x)/s for s > 0), so the float model computes exactly the
same function. With s_c = sqrt(r1_c / r2_c) (r = per-channel max |w|) both layers end with
range sqrt(r1_c · r2_c) on channel c, which is what per-tensor and depthwise weights need.

Clip(0, 6) (ReLU6) is *not* homogeneous: scaling moves the clip point per channel, which one
Clip node cannot express. Those pairs are skipped and reported rather than silently changing
the model (the DFQ paper replaces ReLU6 by ReLU, which changes the float function).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import numpy_helper

from surgery.graph import GraphView

__all__ = ["EqualizationReport", "equalize", "find_pairs"]

_HOMOGENEOUS = frozenset({"Relu", "LeakyRelu", "PRelu"})


@dataclass(frozen=True)
class Pair:
    first: int
    activation: int | None
    second: int


@dataclass
class EqualizationReport:
    pairs: list[dict[str, object]] = field(default_factory=list)
    skipped: list[dict[str, str]] = field(default_factory=list)
    iterations: int = 0

    def to_dict(self) -> dict[str, object]:
        return {"pairs": self.pairs, "skipped": self.skipped, "iterations": self.iterations}


def _single_reader(view: GraphView, tensor: str) -> int | None:
    readers = view.consumers.get(tensor, [])
    if len(readers) != 1 or tensor in view.graph_outputs:
        return None
    return readers[0]


def _clip_is_relu(view: GraphView, node: onnx.NodeProto) -> bool:
    """Clip(0, +inf) (bounds from attributes before opset 11, from constant inputs after)."""
    bounds: dict[str, float | None] = {
        a.name: a.f for a in node.attribute if a.name in ("min", "max")
    }
    for k, key in ((1, "min"), (2, "max")):
        if len(node.input) > k and node.input[k]:
            value = view.constant_value(node.input[k])
            if value is None:
                return False
            bounds[key] = float(value)
    hi = bounds.get("max")
    return bounds.get("min") == 0.0 and (hi is None or math.isinf(hi))


def _weight_ok(view: GraphView, node: onnx.NodeProto) -> bool:
    if (
        len(node.input) < 2
        or node.input[1] not in view.initializers
        or len(view.consumers.get(node.input[1], [])) != 1
    ):
        return False
    return not (
        len(node.input) > 2
        and node.input[2]
        and (
            node.input[2] not in view.initializers
            or len(view.consumers.get(node.input[2], [])) != 1
        )
    )


def find_pairs(
    model: onnx.ModelProto, allowed: set[str]
) -> tuple[list[Pair], list[dict[str, str]]]:
    """Conv pairs that can be equalized without changing the float model, and those skipped."""
    view = GraphView(model)
    pairs: list[Pair] = []
    skipped: list[dict[str, str]] = []
    for idx, node in enumerate(view.nodes):
        if node.op_type != "Conv" or view.names[idx] not in allowed or not _weight_ok(view, node):
            continue
        nxt = _single_reader(view, node.output[0])
        if nxt is None:
            continue
        act: int | None = None
        mid = view.nodes[nxt]
        if mid.op_type in _HOMOGENEOUS or mid.op_type == "Clip":
            if mid.op_type == "Clip" and not _clip_is_relu(view, mid):
                follower = _single_reader(view, mid.output[0])
                if follower is not None and view.nodes[follower].op_type == "Conv":
                    skipped.append(
                        {
                            "first": view.names[idx],
                            "second": view.names[follower],
                            "reason": f"{mid.op_type} {view.names[nxt]!r} has an upper bound; per-channel scaling would move it",
                        }
                    )
                continue
            act = nxt
            following = _single_reader(view, mid.output[0])
            if following is None:
                continue
            nxt = following
        second = view.nodes[nxt]
        if second.op_type != "Conv" or second.input[0] != (
            view.nodes[act].output[0] if act is not None else node.output[0]
        ):
            continue
        if view.names[nxt] not in allowed or not _weight_ok(view, second):
            continue
        pairs.append(Pair(idx, act, nxt))
    return pairs, skipped


def _group(node: onnx.NodeProto) -> int:
    return next((a.i for a in node.attribute if a.name == "group"), 1)


def _input_channel_view(w2: np.ndarray, group: int) -> np.ndarray:
    """W2 as (groups, out per group, in per group, …) so input channel c = (c // ipg, c % ipg)."""
    cout, ipg = w2.shape[0], w2.shape[1]
    return w2.reshape(group, cout // group, ipg, *w2.shape[2:])


def _equalize_pair(inits: dict[str, onnx.TensorProto], view: GraphView, pair: Pair) -> float:
    """Equalize one pair in place; returns max |log s| (0 when nothing changed)."""
    conv1, conv2 = view.nodes[pair.first], view.nodes[pair.second]
    w1 = numpy_helper.to_array(inits[conv1.input[1]]).astype(np.float64)
    w2 = numpy_helper.to_array(inits[conv2.input[1]]).astype(np.float64)
    channels = w1.shape[0]
    g2 = _group(conv2)
    if w2.shape[1] * g2 != channels or w2.shape[0] % g2:
        return 0.0
    r1 = np.abs(w1).reshape(channels, -1).max(axis=1)
    grouped = _input_channel_view(w2, g2)
    axes = (1, *range(3, grouped.ndim))
    r2 = np.abs(grouped).max(axis=axes).reshape(channels)
    s = np.ones(channels)
    ok = (r1 > 0) & (r2 > 0)
    s[ok] = np.sqrt(r1[ok] / r2[ok])
    w1 = w1 / s.reshape(-1, *([1] * (w1.ndim - 1)))
    ipg = w2.shape[1]
    grouped = grouped * s.reshape(g2, 1, ipg, *([1] * (w2.ndim - 2)))
    dtype = onnx.helper.tensor_dtype_to_np_dtype(inits[conv1.input[1]].data_type)
    inits[conv1.input[1]].CopyFrom(numpy_helper.from_array(w1.astype(dtype), conv1.input[1]))
    inits[conv2.input[1]].CopyFrom(
        numpy_helper.from_array(grouped.reshape(w2.shape).astype(dtype), conv2.input[1])
    )
    if len(conv1.input) > 2 and conv1.input[2]:
        b1 = numpy_helper.to_array(inits[conv1.input[2]]).astype(np.float64) / s
        inits[conv1.input[2]].CopyFrom(numpy_helper.from_array(b1.astype(dtype), conv1.input[2]))
    return float(np.abs(np.log(s)).max())


def equalize(
    model: onnx.ModelProto, allowed: set[str], *, max_iterations: int = 20, tolerance: float = 1e-3
) -> EqualizationReport:
    """Equalize all eligible pairs in place, repeating until the scales settle (chains)."""
    pairs, skipped = find_pairs(model, allowed)
    report = EqualizationReport(skipped=skipped)
    if not pairs:
        return report
    view = GraphView(model)
    inits = {t.name: t for t in model.graph.initializer}
    first_pass: list[float] = []
    for iteration in range(max_iterations):
        changes = [_equalize_pair(inits, view, p) for p in pairs]
        if iteration == 0:
            first_pass = changes
        report.iterations = iteration + 1
        if max(changes) < tolerance:
            break
    for pair, change in zip(pairs, first_pass, strict=True):
        report.pairs.append(
            {
                "first": view.names[pair.first],
                "activation": view.names[pair.activation] if pair.activation is not None else None,
                "second": view.names[pair.second],
                "max_log_scale": round(change, 6),
            }
        )
    return report
