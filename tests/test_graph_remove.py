"""Removing elements from a repeated protobuf field in place (`remove_at`, `remove_where`):
the others stay, in order, on both the in-place path and the rebuild for scattered removals."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import surgery.graph
from surgery.graph import remove_at, remove_where


def _relu_chain(n: int) -> onnx.GraphProto:
    graph = onnx.GraphProto()
    graph.node.extend(helper.make_node("Relu", [f"t{k}"], [f"t{k + 1}"]) for k in range(n))
    return graph


def _outputs(graph: onnx.GraphProto) -> list[str]:
    return [node.output[0] for node in graph.node]


@pytest.mark.parametrize("in_place", [True, False])
def test_remove_at_keeps_the_others_in_order(monkeypatch, in_place: bool):
    if not in_place:
        monkeypatch.setattr(surgery.graph, "REMOVE_IN_PLACE_MOVES", 0)
    graph = _relu_chain(10)
    remove_at(graph.node, [0, 3, 4, 5, 9])
    assert _outputs(graph) == ["t2", "t3", "t7", "t8", "t9"]


def test_remove_at_nothing_leaves_the_field_as_it_is():
    graph = _relu_chain(3)
    remove_at(graph.node, [])
    assert _outputs(graph) == ["t1", "t2", "t3"]


def test_remove_where_returns_how_many_went_and_keeps_the_weights():
    graph = onnx.GraphProto()
    values = {f"w{k}": np.full((4, 4), k, np.float32) for k in range(5)}
    graph.initializer.extend(numpy_helper.from_array(v, name) for name, v in values.items())
    removed = remove_where(graph.initializer, lambda t: t.name in ("w1", "w3"))
    assert removed == 2
    assert [t.name for t in graph.initializer] == ["w0", "w2", "w4"]
    for t in graph.initializer:
        np.testing.assert_array_equal(numpy_helper.to_array(t), values[t.name])
