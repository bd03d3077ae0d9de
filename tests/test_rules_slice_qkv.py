"""slice-qkv: q, k and v picked out of a rank-5 head split with five non-unit axes (windowed
attention) become Slices of the projection, so the split runs on the MLA instead of as a host
stage between two segments."""

from __future__ import annotations

import numpy as np
import onnx

from surgery.model import load_model
from surgery.rules import apply_rule
from tests.architectures import Builder

WINDOWS, TOKENS, HEADS, HEAD_DIM = 4, 9, 2, 4
CHANNELS = HEADS * HEAD_DIM


def _windowed_attention(split_shape: list[int], perm: list[int], pick: str = "gather"):
    """A 1×1 Conv projection on [windows·tokens, C, 1, 1] (the lifted Linear), the rank-5
    split, then q·kᵀ → Softmax → ·v. q, k and v are picked by `pick`: "gather" (TorchScript's
    unbind), "split" (Split, then Squeeze), "slice" (one Slice per index, then Squeeze: torch's
    dynamo exporter) or "reshape" (a Slice, then a Reshape to the squeezed shape)."""
    b = Builder()
    qkv = b.conv("proj", "x", CHANNELS, 3 * CHANNELS, kernel=1, act=None)
    qkv = b.node("Reshape", [qkv, b.const("split_shape", np.array(split_shape))], "split")
    qkv = b.node("Transpose", [qkv], "heads", perm=perm)
    if pick == "split":
        parts = b.nodes_out(
            "Split", [qkv, b.const("ones", np.array([1, 1, 1]))], ["q1", "k1", "v1"], axis=0
        )
        axis = b.const("axis0", np.array([0]))
        q, k, v = (b.node("Squeeze", [p, axis], t) for p, t in zip(parts, "qkv", strict=True))
    elif pick in ("slice", "reshape"):
        dropped = [split_shape[p] for p in perm[1:]] if pick == "reshape" else None
        q, k, v = (_sliced_pick(b, qkv, j, t, dropped) for j, t in enumerate("qkv"))
    else:
        q, k, v = (
            b.node("Gather", [qkv, b.const(f"i{j}", np.array(j))], t, axis=0)
            for j, t in enumerate("qkv")
        )
    s = b.node("MatMul", [q, b.node("Transpose", [k], "kT", perm=[0, 1, 3, 2])], "scores")
    b.node("MatMul", [b.node("Softmax", [s], "probs", axis=-1), v], "ctx")
    inputs = {"x": [WINDOWS * TOKENS, CHANNELS, 1, 1]}
    return load_model(b.model("windows", inputs, ["ctx"]))


def _sliced_pick(b: Builder, qkv: str, j: int, name: str, reshaped: list[int] | None) -> str:
    bounds = [b.const(f"{name}_{w}", np.array([v])) for w, v in (("s", j), ("e", j + 1), ("a", 0))]
    one = b.node("Slice", [qkv, *bounds], f"{name}1")
    if reshaped is None:
        return b.node("Squeeze", [one, b.const(f"{name}_axis", np.array([0]))], name)
    return b.node("Reshape", [one, b.const(f"{name}_shape", np.array(reshaped))], name)


SPLIT = [WINDOWS, TOKENS, 3, HEADS, HEAD_DIM]
PERM = [2, 0, 3, 1, 4]


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def test_gathers_become_slices_of_the_projection_on_the_mla() -> None:
    model = _windowed_attention(SPLIT, PERM)
    result = apply_rule(model, "slice-qkv")
    assert result.verification.passed and result.verification.mode == "exact"
    assert "Gather" not in _ops(result.model) and _ops(result.model).count("Slice") == 3
    freed = {"split", "heads", "q", "k", "v"}
    assert freed <= {b.name for b in result.coverage_before.blockers}
    assert not freed & {b.name for b in result.coverage_after.blockers}


def test_unbind_as_split_and_squeeze_is_sliced_too() -> None:
    result = apply_rule(_windowed_attention(SPLIT, PERM, pick="split"), "slice-qkv")
    assert result.verification.passed and result.verification.mode == "exact"
    assert not {"Split", "Squeeze", "Gather"} & set(_ops(result.model))


def test_unbind_as_slices_and_squeezes_is_sliced_from_the_projection() -> None:
    result = apply_rule(_windowed_attention(SPLIT, PERM, pick="slice"), "slice-qkv")
    assert result.verification.passed and result.verification.mode == "exact"
    assert "Squeeze" not in _ops(result.model)
    assert {"split", "heads"}.isdisjoint(n.name for n in result.model.graph.node)


def test_slices_whose_squeeze_became_a_reshape_are_sliced_too() -> None:
    result = apply_rule(_windowed_attention(SPLIT, PERM, pick="reshape"), "slice-qkv")
    assert result.verification.passed and result.verification.mode == "exact"
    assert {"split", "heads"}.isdisjoint(n.name for n in result.model.graph.node)


def test_a_pick_inside_the_features_is_sliced_from_a_rows_by_features_view() -> None:
    split = [WINDOWS, TOKENS, HEADS, 3, HEAD_DIM]  # the 3 inside the heads: strided picks
    result = apply_rule(_windowed_attention(split, [3, 0, 2, 1, 4]), "slice-qkv")
    assert result.verification.passed and result.verification.mode == "exact"
    assert "Gather" not in _ops(result.model)
    rows = [n for n in result.model.graph.node if n.name.startswith("qkv_rows")]
    assert len(rows) == 1 and rows[0].op_type == "Reshape"


def test_split_pieces_the_lift_reshaped_to_4d_are_sliced_and_stay_4d() -> None:
    b = Builder()
    qkv = b.conv("proj", "x", CHANNELS, 3 * CHANNELS, kernel=1, act=None)
    qkv = b.node("Reshape", [qkv, b.const("split_shape", np.array([1, *SPLIT]))], "split")
    qkv = b.node("Transpose", [qkv], "heads", perm=[3, 0, 1, 4, 2, 5])
    parts = b.nodes_out(
        "Split", [qkv, b.const("ones", np.array([1, 1, 1]))], ["q1", "k1", "v1"], axis=0
    )
    four_d = b.const("four_d", np.array([WINDOWS, HEADS, TOKENS, HEAD_DIM]))
    q, k, v = (b.node("Reshape", [p, four_d], t) for p, t in zip(parts, "qkv", strict=True))
    s = b.node("MatMul", [q, b.node("Transpose", [k], "kT", perm=[0, 1, 3, 2])], "scores")
    b.node("MatMul", [b.node("Softmax", [s], "probs", axis=-1), v], "ctx")
    model = load_model(b.model("lifted", {"x": [WINDOWS * TOKENS, CHANNELS, 1, 1]}, ["ctx"]))
    result = apply_rule(model, "slice-qkv")
    assert result.verification.passed and result.verification.mode == "exact"
    assert "Split" not in _ops(result.model)
    ranks = {len(v.type.tensor_type.shape.dim) for v in result.model.graph.value_info}
    assert ranks <= {4}
    assert {b.op_type for b in result.coverage_after.blockers} <= {"Softmax"}
