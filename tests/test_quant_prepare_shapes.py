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
