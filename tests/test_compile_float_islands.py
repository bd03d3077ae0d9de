"""A QDQ model that leaves an MLA op in float (no Q/DQ of its own, as ONNX Runtime's quantizer
leaves an unfolded BatchNormalization): compile runs it on the host, which splits the MLA part,
and says so against check's count for the float model."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from compiler.compile import compile_model
from surgery.check import check_model


def _qdq_with_float_conv() -> onnx.ModelProto:
    """Q → DQ → Conv(int8 w) → Q → DQ → Conv(float w: no DQ) → Q → DQ → Conv(int8 w) → Q → DQ."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(np.array(0.02, np.float32), "s"),
        numpy_helper.from_array(np.array(0, np.int8), "z"),
        numpy_helper.from_array(np.array(0.01, np.float32), "ws"),
        numpy_helper.from_array(rng.normal(0, 0.3, (4, 4, 3, 3)).astype(np.float32), "w_float"),
    ]
    for name in ("w1", "w3"):
        inits.append(
            numpy_helper.from_array(rng.integers(-50, 50, (4, 4, 3, 3)).astype(np.int8), name)
        )
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"], name="q_in")]
    nodes.append(helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"], name="dq_in"))
    source = "xd"
    for k, weight in enumerate(("w1", "w_float", "w3")):
        if weight != "w_float":
            nodes.append(
                helper.make_node(
                    "DequantizeLinear", [weight, "ws"], [f"{weight}_d"], name=f"dq_{weight}"
                )
            )
            weight = f"{weight}_d"
        nodes += [
            helper.make_node(
                "Conv", [source, weight], [f"c{k}"], name=f"conv{k}", pads=[1, 1, 1, 1]
            ),
            helper.make_node("QuantizeLinear", [f"c{k}", "s", "z"], [f"c{k}q"], name=f"q{k}"),
            helper.make_node("DequantizeLinear", [f"c{k}q", "s", "z"], [f"c{k}d"], name=f"dq{k}"),
        ]
        source = f"c{k}d"
    nodes.append(helper.make_node("Identity", [source], ["y"], name="out"))
    graph = helper.make_graph(
        nodes,
        "float_island",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_float_op_in_a_qdq_model_splits_the_compile_and_is_explained(tmp_path) -> None:
    model = _qdq_with_float_conv()
    assert check_model(model).mla_segments == 1
    result = compile_model(model, tmp_path, model_name="island")
    assert len(result.elf_files) == 2
    note = next(n for n in result.notes if "stay float in this QDQ model" in n)
    assert "conv1" in note and "2 programs" in note and "counts 1" in note
