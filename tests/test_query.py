"""Focused queries: one node, a neighbourhood, nodes by op type or name pattern."""

from __future__ import annotations

import pytest

from surgery.errors import NodeNotFoundError
from surgery.model import load_model
from surgery.query import find_nodes, inspect_node, neighbourhood


@pytest.fixture
def yolo(yolo_head):
    return load_model(yolo_head)


def test_inspect_node_shows_shapes_attributes_and_neighbours(yolo):
    reshape = next(n.name for n in yolo.graph.node if n.op_type == "Reshape")
    info = inspect_node(yolo, reshape)
    assert info["op_type"] == "Reshape"
    assert info["inputs"][1]["value"] == [1, 8, -1]
    assert info["outputs"][0]["shape"] == [1, 8, 256] or info["outputs"][0]["shape"] == [1, 8, 64]
    assert info["consumers"] == ["concat_34"]


def test_inspect_node_accepts_an_output_tensor_name(yolo):
    node = yolo.graph.node[0]
    assert inspect_node(yolo, node.output[0])["name"] == node.name


def test_unknown_node_suggests_similar_names(yolo):
    with pytest.raises(NodeNotFoundError) as err:
        inspect_node(yolo, "sigmoid")
    assert "sigmoid_" in err.value.hint


def test_neighbourhood_respects_hop_count(yolo):
    one = neighbourhood(yolo, "split_36", hops=1)
    two = neighbourhood(yolo, "split_36", hops=2)
    assert {n["name"] for n in one["nodes"]} == {"split_36", "concat_34", "sigmoid_37", "concat_38"}
    assert len(two["nodes"]) > len(one["nodes"])


def test_find_nodes_by_op_type_and_pattern(yolo):
    assert find_nodes(yolo, op_type="Reshape")["count"] == 2
    assert find_nodes(yolo, pattern="concat_*")["count"] == 3
    assert find_nodes(yolo, pattern="/^sig/")["count"] == 5
    limited = find_nodes(yolo, op_type="Conv", limit=2)
    assert limited["truncated"] and len(limited["nodes"]) == 2
