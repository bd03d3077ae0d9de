"""`check` counts the segments of the model the compiler sees: where ONNX's data propagation
gives up on shape arithmetic that folds (opset-12 Unsqueeze with axes as an attribute, on a
product of two gathered dims), check folds it, as the quantizer does, before placing."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from compiler.compile import compile_model
from surgery.check import check_model
from surgery.rules.fix import describe_step, fix_model
from tests.lower_support import quantize_on

C, H, W = 4, 3, 5


def _index(name: str, value: int) -> onnx.NodeProto:
    return helper.make_node(
        "Constant", [], [name], value=numpy_helper.from_array(np.array(value, np.int64))
    )


def _view_by_computed_shape() -> onnx.ModelProto:
    """Conv → TopK (the host) → Reshape to [b, c·h, w, 1] from Shape arithmetic → Conv."""
    rng = np.random.default_rng(0)
    gathered = [
        helper.make_node("Gather", ["s", f"i{k}"], [dim], axis=0)
        for k, dim in enumerate(["b", "c", "h", "w"])
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["a"], pads=[1, 1, 1, 1]),
        helper.make_node("TopK", ["a", "k"], ["v", "i"], axis=1),
        helper.make_node("Shape", ["v"], ["s"]),
        *(_index(f"i{k}", k) for k in range(4)),
        *gathered,
        helper.make_node("Mul", ["c", "h"], ["ch"]),
        *(helper.make_node("Unsqueeze", [d], [f"{d}_1d"], axes=[0]) for d in ("b", "ch", "w")),
        helper.make_node("Concat", ["b_1d", "ch_1d", "w_1d", "one"], ["shape"], axis=0),
        helper.make_node("Reshape", ["v", "shape"], ["r"]),
        helper.make_node("Conv", ["r", "w2"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "view_by_computed_shape",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, H, W])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [
            numpy_helper.from_array(rng.normal(size=(C, 3, 3, 3)).astype(np.float32), "w1"),
            numpy_helper.from_array(np.array([C], np.int64), "k"),
            numpy_helper.from_array(np.array([1], np.int64), "one"),
            numpy_helper.from_array(rng.normal(size=(2, C * H, 1, 1)).astype(np.float32), "w2"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 12)])


def test_check_places_the_nodes_after_shape_arithmetic_that_only_folding_resolves():
    report = check_model(_view_by_computed_shape(), "mlsoc")
    processors = {p.name: p.processor for p in report.placements}
    assert processors["Reshape_16"] == "MLA" and processors["Conv_17"] == "MLA"
    assert report.mla_segments == 2


def test_check_reports_the_folded_nodes_as_foldable_and_keeps_every_node():
    model = _view_by_computed_shape()
    report = check_model(model, "mlsoc")
    assert report.nodes_total == len(model.graph.node)
    folded = {p.name for p in report.placements if p.foldable}
    assert {"Shape_2", "Mul_11", "Concat_15"} <= folded
    assert [p.index for p in report.placements] == list(range(len(model.graph.node)))


def test_the_compile_writes_as_many_elf_files_as_check_counts(tmp_path):
    model = _view_by_computed_shape()
    qdq = quantize_on(model, "mlsoc")
    result = compile_model(qdq, tmp_path, target="mlsoc", model_name="computed_view")
    assert len(result.elf_files) == check_model(model, "mlsoc").mla_segments == 2


def test_fix_reports_the_segments_check_counts_before_and_after():
    model = _view_by_computed_shape()
    result = fix_model(model, "mlsoc")
    assert result.coverage_before.mla_segments == check_model(model, "mlsoc").mla_segments == 2
    assert result.coverage_after.mla_segments == check_model(result.model, "mlsoc").mla_segments


def test_a_fold_step_reports_the_segments_check_counts_not_those_of_the_unfolded_model():
    model = _view_by_computed_shape()
    step = fix_model(model, "mlsoc").steps[0]
    assert step["rule"] == "fold-constants"
    assert (
        step["segments_before"]
        == step["segments_after"]
        == check_model(model, "mlsoc").mla_segments
    )
    assert step["macs_unknown_nodes_before"] == step["macs_unknown_nodes_after"] == 0
    assert "segments 2→2, blockers" in describe_step(step)


def test_a_step_line_names_unknown_shapes_only_while_there_are_some():
    step = {
        "step": 3,
        "rule": "remove-identity",
        "matches": 2,
        "segments_before": 2,
        "segments_after": 1,
        "blockers_before": 4,
        "blockers_after": 2,
        "macs_unknown_nodes_before": 0,
        "macs_unknown_nodes_after": 0,
    }
    assert describe_step(step) == "step 3: remove-identity ×2 — segments 2→1, blockers 4→2"
    assert describe_step(step, ascii_only=True) == (
        "step 3: remove-identity x2, segments 2->1, blockers 4->2"
    )
