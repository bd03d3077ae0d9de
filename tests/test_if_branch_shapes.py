"""Shape inference keeps the bodies of control-flow ops as they were.

onnx's data propagation keys propagated values by tensor name across subgraphs: when the two
branches of an If reuse names, as Optimum's merged decoder does (decoder_model_merged.onnx:
both branches are exports of one module), one branch's shapes are written into the other's
value_info. ONNX Runtime then refused the compiler's host stage, inferred that way, and every
merged decoder failed to run ("Graph attribute inferencing failed … Incompatible dimensions").
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from compiler.archive import read_archive
from compiler.compile import compile_model
from compiler.runtime.pipeline import run_archive
from surgery.model import infer_shapes_through_contrib_ops, load_model


def _branch(src: str, name: str) -> onnx.GraphProto:
    nodes = [
        helper.make_node("Shape", [src], ["s"]),
        helper.make_node("ConstantOfShape", ["s"], ["c"]),  # the same names in both branches
        helper.make_node("Add", ["c", src], ["e"]),
        helper.make_node("ReduceSum", ["e"], ["out"], keepdims=0),
    ]
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, [])
    return helper.make_graph(nodes, name, [], [out])


def _merged() -> onnx.ModelProto:
    node = helper.make_node(
        "If", ["cond"], ["out"], then_branch=_branch("x", "then"), else_branch=_branch("y", "else")
    )
    graph = helper.make_graph(
        [node],
        "merged",
        [
            helper.make_tensor_value_info("cond", TensorProto.BOOL, [1]),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 16]),
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 64]),
        ],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_branch_shapes_do_not_leak_into_the_other_branch() -> None:
    inferred = infer_shapes_through_contrib_ops(_merged())
    branches = {a.name: a.g for a in inferred.graph.node[0].attribute}
    ranks = {v.name: len(v.type.tensor_type.shape.dim) for v in branches["else_branch"].value_info}
    assert ranks.get("c", 3) == 3  # ConstantOfShape(Shape(y)), y of rank 3


def test_a_merged_decoder_compiles_to_a_host_stage_that_runs(tmp_path) -> None:
    model = load_model(_merged())
    result = compile_model(model, tmp_path, model_name="merged")
    feed = {
        "cond": np.array([False]),
        "x": np.ones((1, 4, 8, 16), np.float32),
        "y": np.ones((1, 16, 64), np.float32),
    }
    outputs, _ = run_archive(read_archive(result.archive), feed)
    assert float(np.asarray(outputs["out"])) == 16 * 64  # c is 0: the sum of y
    feed["cond"] = np.array([True])
    outputs, _ = run_archive(read_archive(result.archive), feed)
    assert float(np.asarray(outputs["out"])) == 4 * 8 * 16
