"""transpose-before-expand: timm's relative position logits (HaloNet, BoTNet) expand the
height and width logits over a new axis and permute them into place before adding them; the
Transpose moves to the small tensor, and the Expands then fold into the Add's broadcast."""

from __future__ import annotations

import numpy as np
import onnx

from surgery.model import load_model
from surgery.rules import apply_rule, find_matches
from surgery.rules.fix import fix_model
from tests.architectures import Builder

BLOCKS, Q, K = 4, 6, 6
"""Windows × heads, query side, key side: the logits are [BLOCKS, Q, Q, K, K] (five axes)."""


def _rel_logits(b: Builder) -> str:
    """Height logits [B, Q, 1, Q, K] expanded over the query width, width logits likewise,
    each permuted into [B, Q, Q, K, K] and added (timm's rel_logits_1d, as exported)."""
    x = b.conv("proj", "x", 4, 4, kernel=1, act=None)
    shape = b.const("logit_view", np.array([BLOCKS, Q, 1, Q, K]))
    full = b.const("full", np.array([BLOCKS, Q, Q, Q, K]))
    parts = []
    for name, perm in (("h", [0, 1, 3, 2, 4]), ("w", [0, 3, 1, 4, 2])):
        logits = b.node(
            "Reshape",
            [b.node("Mul", [x, b.weight(f"{name}_w", 1)], f"{name}_s"), shape],
            f"{name}_v",
        )
        wide = b.node("Expand", [logits, full], f"{name}_expand")
        parts.append(b.node("Transpose", [wide], f"{name}_placed", perm=perm))
    total = b.node("Add", parts, "logits")
    return b.node(
        "Reshape", [total, b.const("flat", np.array([1, BLOCKS, Q * Q, K * K]))], "flat_logits"
    )


def _model() -> onnx.ModelProto:
    b = Builder()
    out = _rel_logits(b)
    return load_model(b.model("relpos", {"x": [1, 4, BLOCKS * Q, Q * K // 4]}, [out]))


def test_the_transpose_moves_before_the_expand() -> None:
    result = apply_rule(_model(), "transpose-before-expand")
    assert result.verification.passed and result.verification.mode == "exact"
    order = [n.op_type for n in result.model.graph.node]
    for name in ("h", "w"):
        expand = next(n for n in result.model.graph.node if n.output[0] == f"{name}_placed")
        assert expand.op_type == "Expand"
    assert order.count("Transpose") == 2


def test_fix_then_folds_the_expands_into_the_add_and_runs_it_on_the_mla() -> None:
    result = fix_model(_model(), "mlsoc")
    rules = [step["rule"] for step in result.steps]
    assert "transpose-before-expand" in rules and "expand-into-broadcast" in rules
    assert result.coverage_after.mla_segments == 1
    assert "Expand" not in {n.op_type for n in result.model.graph.node}


def test_an_expand_read_by_another_node_is_left_in_place() -> None:
    b = Builder()
    x = b.conv("proj", "x", 4, 4, kernel=1, act=None)
    v = b.node("Reshape", [x, b.const("view", np.array([BLOCKS, Q, 1, Q, K]))], "v")
    wide = b.node("Expand", [v, b.const("full", np.array([BLOCKS, Q, Q, Q, K]))], "wide")
    moved = b.node("Transpose", [wide], "moved", perm=[0, 1, 3, 2, 4])
    b.node("Add", [moved, wide], "both")
    model = load_model(b.model("shared", {"x": [1, 4, BLOCKS * Q, Q * K // 4]}, ["both"]))
    assert find_matches(model, "transpose-before-expand") == []
