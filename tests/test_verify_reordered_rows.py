"""verify says when a failed output holds the same rows in another order: a TopK whose
near-equal scores a rewrite moved by a rounding error orders (or selects) them differently."""

from __future__ import annotations

import itertools

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from surgery.verify import _max_matching, compare_arrays, reordered_rows, verify_models


def topk_detections(nudge: float) -> onnx.ModelProto:
    """Rows (box, score) of x, the k best by score; `nudge` adds a tiny multiple of column 0
    to the score before TopK, as a rewrite's rounding change would."""
    inits = [
        numpy_helper.from_array(np.array([4], np.int64), "k"),
        numpy_helper.from_array(np.array([[0.0, 0.0, 0.0, 1.0]], np.float32).T, "pick"),
        numpy_helper.from_array(np.array([[nudge, 0.0, 0.0, 0.0]], np.float32).T, "nudge"),
        numpy_helper.from_array(np.array([1, 6], np.int64), "flat"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "pick"], ["score"]),
        helper.make_node("MatMul", ["x", "nudge"], ["tiny"]),
        helper.make_node("Add", ["score", "tiny"], ["ranked"]),
        helper.make_node("Reshape", ["ranked", "flat"], ["ranked_flat"]),
        helper.make_node("TopK", ["ranked_flat", "k"], ["top", "index"], axis=1),
        helper.make_node("Gather", ["x", "index"], ["picked"], axis=1),
        helper.make_node("Squeeze", ["picked"], ["det"]),
    ]
    graph = helper.make_graph(
        nodes,
        "topk",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 6, 4])],
        [helper.make_tensor_value_info("det", TensorProto.FLOAT, [4, 4])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.graph.node[-1].input.append("axis0")
    model.graph.initializer.append(numpy_helper.from_array(np.array([0], np.int64), "axis0"))
    return model


def test_topk_ties_broken_differently_are_reported_as_moved_rows() -> None:
    x = np.array(
        [
            [[0.1, 0.1, 0.2, 0.9], [0.3, 0.3, 0.4, 0.9], [0.5, 0.1, 0.1, 0.5], [0.2, 0.2, 0.6, 0.4]]
            + [[0.7, 0.7, 0.8, 0.1], [0.6, 0.6, 0.9, 0.7]]
        ],
        np.float32,
    )
    result = verify_models(topk_detections(0.0), topk_detections(1e-6), inputs={"x": x})
    (out,) = result.outputs
    assert not out.passed  # still a failure: the order is part of the output …
    assert out.rows_moved == 2  # … but the two tied rows only swapped places
    assert "2 of the 2 differing rows are rows of B in another place" in out.message


def test_different_rows_are_not_moved_rows() -> None:
    rng = np.random.default_rng(0)
    a = rng.random((1, 50, 6))
    b = a.copy()
    b[0, 7] += 1.0
    out = compare_arrays(a, b)
    assert not out.passed and out.rows_moved is None
    perm = np.arange(50)
    perm[[3, 4, 5]] = [5, 3, 4]
    moved = a[:, perm].copy()
    moved[0, 20] += 1.0  # one row truly different, three in another order
    assert reordered_rows(a, moved, 1e-4, 1e-3) == (4, 3)
    assert compare_arrays(a, moved, exact=True).rows_moved == 3


def test_max_matching_matches_brute_force() -> None:
    rng = np.random.default_rng(1)
    for _ in range(200):
        n = int(rng.integers(1, 6))
        close = rng.random((n, n)) < 0.4
        best = max(
            sum(bool(close[i, p[i]]) for i in range(n)) for p in itertools.permutations(range(n))
        )
        assert _max_matching(close) == best
