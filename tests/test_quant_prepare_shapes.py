"""Shapes computed from static tensors fold before quantization: torchvision's
F.interpolate(size=x.shape[-2:]) gives a Resize whose sizes come from Shape → Slice → Concat,
which must be a constant for the Resize to run on the MLA (LR-ASPP had 2 .elf for check's 1)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from compiler.compile import compile_model
from compiler.quantize.prepare import prepare_model
from surgery.check import check_model
from tests.lower_support import quantize_on, run_and_compare


def _resize_to_shape_of() -> onnx.ModelProto:
    """Conv (stride 2) → Resize(sizes = N, C of it ‖ H, W of the input) → Add → Conv."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.5, (4, 4, 3, 3)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.normal(0, 0.5, (4, 4, 1, 1)).astype(np.float32), "w2"),
        numpy_helper.from_array(np.array([2], np.int64), "two"),
        numpy_helper.from_array(np.array([4], np.int64), "four"),
        numpy_helper.from_array(np.array([0], np.int64), "zero"),
    ]
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w1"], ["low"], strides=[2, 2], pads=[1, 1, 1, 1]),
            helper.make_node("Shape", ["low"], ["low_shape"]),
            helper.make_node("Slice", ["low_shape", "zero", "two", "zero"], ["nc"]),
            helper.make_node("Shape", ["x"], ["x_shape"]),
            helper.make_node("Slice", ["x_shape", "two", "four", "zero"], ["hw"]),
            helper.make_node("Concat", ["nc", "hw"], ["sizes"], axis=0),
            helper.make_node("Resize", ["low", "", "", "sizes"], ["up"], mode="nearest"),
            helper.make_node("Add", ["up", "x"], ["sum"]),
            helper.make_node("Conv", ["sum", "w2"], ["y"]),
        ],
        "resize_to_shape_of",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def test_shape_computations_of_static_tensors_fold_away() -> None:
    prepared = prepare_model(_resize_to_shape_of()).model
    ops = [n.op_type for n in prepared.graph.node]
    assert "Shape" not in ops and "Concat" not in ops
    (sizes,) = [i for i in prepared.graph.initializer if i.name == "sizes"]
    assert numpy_helper.to_array(sizes).tolist() == [1, 4, 8, 8]


def test_a_resize_to_a_computed_size_compiles_to_checks_one_elf_bit_exact(tmp_path) -> None:
    model = _resize_to_shape_of()
    assert check_model(model, "mlsoc", suggest=False).mla_segments == 1
    qdq = quantize_on(model, "mlsoc")
    result = compile_model(qdq, tmp_path, target="mlsoc", model_name="resize")
    assert len(result.elf_files) == 1, result.notes
    feed = {"x": np.random.default_rng(4).normal(0, 1, (1, 4, 8, 8)).astype(np.float32)}
    comparison = run_and_compare(result, qdq, feed)
    assert comparison.mla_stages and comparison.bit_exact


def _reshape_chain() -> onnx.ModelProto:
    """Conv → Reshape to [C·H, W] (C·H = Mul of two Gathers of Shape, which ONNX's data
    propagation leaves unknown) → Reshape to [1, C·H, W, 1] read from the Shape of that."""
    rng = np.random.default_rng(1)
    consts = {
        "w1": rng.normal(0, 0.5, (4, 3, 1, 1)).astype(np.float32),
        "w2": rng.normal(0, 0.5, (2, 24, 1, 1)).astype(np.float32),
        "one": np.array(1, np.int64),
        "two": np.array(2, np.int64),
        "axis0": np.array([0], np.int64),
        "minus_one": np.array([-1], np.int64),
        "ones": np.array([1], np.int64),
        "start0": np.array([0], np.int64),
        "end2": np.array([2], np.int64),
    }
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w1"], ["a"]),
            helper.make_node("Shape", ["a"], ["sa"]),
            helper.make_node("Gather", ["sa", "one"], ["c"]),
            helper.make_node("Gather", ["sa", "two"], ["h"]),
            helper.make_node("Mul", ["c", "h"], ["ch"]),
            helper.make_node("Unsqueeze", ["ch", "axis0"], ["ch1"]),
            helper.make_node("Concat", ["ch1", "minus_one"], ["t1"], axis=0),
            helper.make_node("Reshape", ["a", "t1"], ["r"]),
            helper.make_node("Shape", ["r"], ["sr"]),
            helper.make_node("Slice", ["sr", "start0", "end2"], ["sr2"]),
            helper.make_node("Concat", ["ones", "sr2", "ones"], ["t2"], axis=0),
            helper.make_node("Reshape", ["r", "t2"], ["r4"]),
            helper.make_node("Conv", ["r4", "w2"], ["y"]),
        ],
        "reshape_chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(v, k) for k, v in consts.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def test_shapes_that_become_static_after_a_fold_fold_in_the_next_round() -> None:
    prepared = prepare_model(_reshape_chain()).model
    assert [n.op_type for n in prepared.graph.node] == ["Conv", "Reshape", "Reshape", "Conv"]


def _shared_weight_through_identities(uses: int = 3) -> onnx.ModelProto:
    """x through `uses` MatMuls by one weight, each read through an Identity of it."""
    weight = np.random.default_rng(0).normal(0, 0.1, (16, 16)).astype(np.float32)
    nodes, current = [], "x"
    for k in range(uses):
        nodes += [
            helper.make_node("Identity", ["shared"], [f"w{k}"]),
            helper.make_node("MatMul", [current, f"w{k}"], [f"h{k}"]),
        ]
        current = f"h{k}"
    graph = helper.make_graph(
        nodes,
        "shared",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 4, 16])],
        [helper.make_tensor_value_info(current, TensorProto.FLOAT, None)],
        [numpy_helper.from_array(weight, "shared")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_prepare_keeps_one_copy_of_a_weight_shared_through_identities() -> None:
    """torch exports a weight shared across layers (ALBERT's) through one Identity per use;
    folding those Identities one by one copied the weight per use (785 MB → 3.2 GB)."""
    prepared = prepare_model(_shared_weight_through_identities(3))
    weights = [t for t in prepared.model.graph.initializer if list(t.dims) == [16, 16]]
    assert len(weights) == 1
    assert "Identity" not in [n.op_type for n in prepared.model.graph.node]
