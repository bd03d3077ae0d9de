"""A host stage's output whose shape depends on values (an If's branches) runs as computed.

Optimum's merged decoder returns `present.*` of past + new tokens on the cache branch and of
the new tokens alone on the other; the archive can declare only one shape, and run_archive
reshaped the other branch's output into it (a ValueError: "cannot reshape array of size 1536
into shape (1,4,16,16)").
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from compiler.archive import read_archive
from compiler.compile import compile_model
from compiler.runtime.pipeline import run_archive
from surgery.model import load_model


def _cache_if() -> onnx.ModelProto:
    """present = Concat(past, new) along the sequence axis if use_cache else new."""
    out = helper.make_tensor_value_info("present", TensorProto.FLOAT, None)
    with_past = helper.make_graph(
        [helper.make_node("Concat", ["past", "new"], ["present"], axis=2)], "cache", [], [out]
    )
    without = helper.make_graph(
        [helper.make_node("Identity", ["new"], ["present"])], "no_cache", [], [out]
    )
    node = helper.make_node(
        "If", ["use_cache"], ["present"], then_branch=with_past, else_branch=without
    )
    graph = helper.make_graph(
        [node],
        "merged",
        [
            helper.make_tensor_value_info("use_cache", TensorProto.BOOL, [1]),
            helper.make_tensor_value_info("past", TensorProto.FLOAT, [1, 4, 8, 16]),
            helper.make_tensor_value_info("new", TensorProto.FLOAT, [1, 4, 16, 16]),
        ],
        [helper.make_tensor_value_info("present", TensorProto.FLOAT, [1, 4, 16, 16])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_each_branch_returns_its_own_shape(tmp_path) -> None:
    result = compile_model(load_model(_cache_if()), tmp_path, model_name="merged")
    archive = read_archive(result.archive)
    rng = np.random.default_rng(0)
    past = rng.normal(size=(1, 4, 8, 16)).astype(np.float32)
    new = rng.normal(size=(1, 4, 16, 16)).astype(np.float32)
    for use_cache, expected in ((False, new), (True, np.concatenate([past, new], axis=2))):
        feed = {"use_cache": np.array([use_cache]), "past": past, "new": new}
        outputs, _ = run_archive(archive, feed, keep_tensors=True)
        np.testing.assert_array_equal(outputs["present"], expected)
