"""relative-gather-to-slices: DeBERTa's relative-position picks (GatherElements along the last
axis by span ± i ∓ j) become a skew — a flat Slice read in rows of R ± 1 — after the scores
MatMul with the cut (and, for c2p, reversed) relative embeddings."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from surgery.model import load_model
from surgery.rules import apply_rule, find_matches
from surgery.rules.replace_relative_gather import affine_index
from tests.architectures import Builder

HEADS, L, HD, SPAN = 2, 6, 4, 8
ROW, COL = np.arange(L)[:, None], np.arange(L)[None, :]


def _picked(index: np.ndarray) -> onnx.ModelProto:
    """q [1, heads, L, hd] (a 1×1 Conv viewed as heads) → (heads, L, hd) → · pos [heads, hd,
    2·span] → GatherElements(axis −1, index) → back to 4-D."""
    b = Builder()
    q = b.conv("q", "x", 4, HEADS * HD, kernel=1, act=None)
    q = b.node("Reshape", [q, b.const("heads", np.array([1, HEADS, L, HD]))], "q_heads")
    q = b.node("Reshape", [q, b.const("bh", np.array([HEADS, L, HD]))], "q_bh")
    scores = b.node("MatMul", [q, b.weight("pos", HEADS, HD, 2 * SPAN)], "all")
    table = np.broadcast_to(index, (HEADS, L, L)).astype(np.int64)
    picked = b.node("GatherElements", [scores, b.const("index", table)], "picked", axis=-1)
    b.node("Reshape", [picked, b.const("out4", np.array([1, HEADS, L, L]))], "picked_4d")
    return load_model(b.model("relative", {"x": [1, 4, L, 1]}, ["picked_4d"]))


@pytest.mark.parametrize(
    "index", [SPAN + ROW - COL, SPAN - ROW + COL], ids=["c2p (reversed columns)", "p2c"]
)
def test_relative_picks_become_a_skew_of_the_cut_scores(index) -> None:
    result = apply_rule(_picked(index), "relative-gather-to-slices")
    assert result.verification.passed and result.verification.mode == "exact"
    ops = [n.op_type for n in result.model.graph.node]
    assert "GatherElements" not in ops
    (weight,) = [i for i in result.model.graph.initializer if i.name.startswith("relative_weight")]
    assert weight.dims[-1] == 2 * L - 1  # only the distances the index reaches
    assert not result.coverage_after.blockers


def test_log_bucketed_positions_are_not_a_skew() -> None:
    bucketed = np.clip(SPAN + np.sign(ROW - COL) * (np.abs(ROW - COL) ** 2 // 2), 0, 2 * SPAN - 1)
    assert affine_index(np.broadcast_to(bucketed, (HEADS, L, L))) is None
    assert find_matches(_picked(bucketed), "relative-gather-to-slices") == []


def test_an_index_that_differs_per_head_is_not_a_skew() -> None:
    table = np.stack([SPAN + ROW - COL, SPAN - ROW + COL])
    assert affine_index(table) is None
