"""QDQ models as other quantizers leave them: ONNX Runtime's quantizer without pre-processing
keeps BatchNormalization unfolded between Q/DQ, and a hard-swish's / 6 with a float constant.
Both compile on the MLA (one .elf, bit-exact with the integer reference, within a step of ONNX
Runtime on the QDQ model); an op with no MLA form at all (a Conv with float weights) runs on
the host, which splits the MLA part, and compile says so against check's count."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler.archive import read_archive
from compiler.compile import compile_model
from compiler.runtime.compare import compare_with_reference
from compiler.runtime.pipeline import run_archive
from surgery.check import check_model

SCALE = 0.02


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


def _quantized_chain(
    middle: list[onnx.NodeProto], inits: list[onnx.TensorProto]
) -> onnx.ModelProto:
    """x → Q → DQ → Conv(int8 w) → Q → DQ → `middle` (reads c0d, writes m) → Q → DQ → y."""
    rng = np.random.default_rng(1)
    inits = [
        numpy_helper.from_array(np.array(SCALE, np.float32), "s"),
        numpy_helper.from_array(np.array(3, np.int8), "z"),
        numpy_helper.from_array(np.full(4, 0.01, np.float32), "ws"),
        numpy_helper.from_array(rng.integers(-60, 60, (4, 4, 3, 3)).astype(np.int8), "w"),
        *inits,
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"], name="q_in"),
        helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"], name="dq_in"),
        helper.make_node("DequantizeLinear", ["w", "ws"], ["wd"], name="dq_w", axis=0),
        helper.make_node("Conv", ["xd", "wd"], ["c0"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("QuantizeLinear", ["c0", "s", "z"], ["c0q"], name="q0"),
        helper.make_node("DequantizeLinear", ["c0q", "s", "z"], ["c0d"], name="dq0"),
        *middle,
        helper.make_node("QuantizeLinear", ["m", "s", "z"], ["mq"], name="q1"),
        helper.make_node("DequantizeLinear", ["mq", "s", "z"], ["y"], name="dq1"),
    ]
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _batch_norm() -> onnx.ModelProto:
    rng = np.random.default_rng(2)
    stats = {
        "gamma": rng.uniform(-1.5, 1.5, 4),
        "beta": rng.normal(0, 0.3, 4),
        "mean": rng.normal(0, 0.2, 4),
        "var": rng.uniform(0.5, 2.0, 4),
    }
    inits = [numpy_helper.from_array(v.astype(np.float32), k) for k, v in stats.items()]
    node = helper.make_node("BatchNormalization", ["c0d", *stats], ["m"], name="bn", epsilon=1e-3)
    return _quantized_chain([node], inits)


def _hard_swish_tail() -> onnx.ModelProto:
    """x · 0.5 / 6 with both constants left in float."""
    inits = [
        numpy_helper.from_array(np.array(0.5, np.float32), "half"),
        numpy_helper.from_array(np.array(6.0, np.float32), "six"),
    ]
    nodes = [
        helper.make_node("Mul", ["c0d", "half"], ["h"], name="mul_half"),
        helper.make_node("QuantizeLinear", ["h", "s", "z"], ["hq"], name="qh"),
        helper.make_node("DequantizeLinear", ["hq", "s", "z"], ["hd"], name="dqh"),
        helper.make_node("Div", ["hd", "six"], ["m"], name="div_six"),
    ]
    return _quantized_chain(nodes, inits)


def _sum_relu() -> onnx.ModelProto:
    """A two-input Sum (Caffe2's residual add) and its Relu, left in float."""
    nodes = [
        helper.make_node("Sum", ["c0d", "xd"], ["total"], name="sum"),
        helper.make_node("Relu", ["total"], ["m"], name="relu"),
    ]
    return _quantized_chain(nodes, [])


def _weight_filled_at_load() -> onnx.ModelProto:
    """A Conv weight made by ConstantOfShape → QuantizeLinear → DequantizeLinear, as trimmed
    exports fill their weights: a constant for the compiler too."""
    fill = helper.make_tensor("fill", TensorProto.FLOAT, [1], [0.05])
    inits = [
        numpy_helper.from_array(np.array([4, 4, 1, 1], np.int64), "w2_shape"),
        numpy_helper.from_array(np.array(0.001, np.float32), "w2_scale"),
        numpy_helper.from_array(np.array(0, np.int8), "w2_zero"),
    ]
    nodes = [
        helper.make_node("ConstantOfShape", ["w2_shape"], ["w2"], name="fill", value=fill),
        helper.make_node("QuantizeLinear", ["w2", "w2_scale", "w2_zero"], ["w2q"], name="q_w2"),
        helper.make_node("DequantizeLinear", ["w2q", "w2_scale", "w2_zero"], ["w2d"], name="dq_w2"),
        helper.make_node("Conv", ["c0d", "w2d"], ["m"], name="conv_filled"),
    ]
    return _quantized_chain(nodes, inits)


@pytest.mark.parametrize(
    "build",
    [_batch_norm, _hard_swish_tail, _sum_relu, _weight_filled_at_load],
    ids=["batch_norm", "div_mul", "sum_relu", "constant_of_shape_weight"],
)
def test_ops_other_quantizers_leave_in_float_compile_on_the_mla(build, tmp_path) -> None:
    model = build()
    result = compile_model(model, tmp_path, model_name="chain")
    assert len(result.elf_files) == 1 == check_model(model).mla_segments
    assert not any("no MLA form" in note for note in result.notes)
    archive = read_archive(result.archive)
    feed = {"x": np.random.default_rng(5).normal(size=(1, 4, 8, 8)).astype(np.float32)}
    outputs, stats = run_archive(archive, feed, keep_tensors=True)
    comparison = compare_with_reference(archive.manifest, model, feed, outputs, stats.tensors)
    assert comparison.mla_bit_exact and comparison.bit_exact
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    (expected,) = ort.InferenceSession(model.SerializeToString(), options).run(None, feed)
    assert np.max(np.abs(outputs["y"] - expected)) <= SCALE * 1.001  # one output step
