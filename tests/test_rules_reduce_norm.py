"""reducel2-to-sum and channel-reduce-to-conv: ConvNeXt V2's Global Response Norm (an L2 norm
over H, W and a mean of those norms over the channels) on the MLA, where it reduces only
spatial axes and has no ReduceL2."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler.compile import compile_model
from surgery.check import check_model
from surgery.model import load_model
from surgery.rules.engine import RuleNotApplicableError, apply_rule
from surgery.rules.fix import fix_model
from tests.lower_support import quantize_on, run_and_compare

C = 8


def _reduce(op: str, axes: list[int], keepdims: int, opset: int) -> onnx.NodeProto:
    """A Reduce node with its axes as an attribute or (ReduceSum ≥ 13, all ≥ 18) an input."""
    as_input = opset >= 18 or (op == "ReduceSum" and opset >= 13)
    if as_input:
        return helper.make_node(op, ["r_in", "axes"], ["r"], "reduce", keepdims=keepdims)
    return helper.make_node(op, ["r_in"], ["r"], "reduce", axes=axes, keepdims=keepdims)


def _conv_reduce_conv(
    op: str, axes: list[int], keepdims: int = 1, opset: int = 17
) -> onnx.ModelProto:
    """Conv [1, C, 6, 5] → Reduce → Mul back onto the map → Conv: the reduction sits inside
    the MLA body, as a GRN's does."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.5, (C, 3, 3, 3)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.normal(0, 0.5, (C, C, 1, 1)).astype(np.float32), "w2"),
        numpy_helper.from_array(np.array(axes, np.int64), "axes"),
    ]
    reduced_shape = [1, C, 6, 5]
    for a in axes:
        reduced_shape[a] = 1
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["r_in"], pads=[1, 1, 1, 1]),
        _reduce(op, axes, keepdims, opset),
    ]
    scale = "r"
    if not keepdims:
        inits.append(numpy_helper.from_array(np.array(reduced_shape, np.int64), "kept"))
        nodes.append(helper.make_node("Reshape", ["r", "kept"], ["r_kept"]))
        scale = "r_kept"
    nodes += [
        helper.make_node("Mul", ["r_in", scale], ["m"]),
        helper.make_node("Conv", ["m", "w2"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "conv_reduce_conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 6, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    return load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]))


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize(
    ("op", "ops"),
    [("ReduceL2", ["Mul", "ReduceSum", "Sqrt"]), ("ReduceSumSquare", ["Mul", "ReduceSum"])],
)
def test_a_spatial_l2_norm_becomes_sum_of_squares_on_the_mla(op, ops, opset) -> None:
    model = _conv_reduce_conv(op, [2, 3], opset=opset)
    assert check_model(model, "mlsoc", suggest=False).mla_segments == 2
    step = apply_rule(model, "reducel2-to-sum", "mlsoc")
    assert step.verification.passed
    assert _ops(step.model)[1 : 1 + len(ops)] == ops
    assert step.coverage_after.mla_segments == 1 and not step.coverage_after.blockers


@pytest.mark.parametrize("opset", [11, 18])
@pytest.mark.parametrize("op", ["ReduceMean", "ReduceSum"])
def test_a_channel_reduction_becomes_a_one_by_one_conv(op, opset) -> None:
    model = _conv_reduce_conv(op, [1], 1, opset)
    assert check_model(model, "mlsoc", suggest=False).mla_segments == 2
    step = apply_rule(model, "channel-reduce-to-conv", "mlsoc")
    assert step.verification.passed
    assert op not in _ops(step.model)
    assert step.coverage_after.mla_segments == 1


def test_without_keepdims_the_conv_is_reshaped_to_the_reduced_shape() -> None:
    step = apply_rule(_conv_reduce_conv("ReduceSum", [1], 0, 13), "channel-reduce-to-conv")
    assert step.verification.passed
    assert _ops(step.model)[:3] == ["Conv", "Conv", "Reshape"]


def test_the_channel_conv_averages_with_weights_one_over_c() -> None:
    step = apply_rule(_conv_reduce_conv("ReduceMean", [1]), "channel-reduce-to-conv", "mlsoc")
    (weight,) = [
        numpy_helper.to_array(i) for i in step.model.graph.initializer if i.dims[:2] == [1, C]
    ]
    assert weight.shape == (1, C, 1, 1) and np.all(weight == np.float32(1 / C))


def test_a_reduction_over_channels_and_space_is_not_a_channel_conv() -> None:
    with pytest.raises(RuleNotApplicableError):
        apply_rule(_conv_reduce_conv("ReduceMean", [1, 2]), "channel-reduce-to-conv", "mlsoc")


def _grn() -> onnx.ModelProto:
    """timm's GlobalResponseNorm, channels first, between two Convs: g = ‖x‖₂ over H, W;
    n = g / (mean_C(g) + ε); y = γ·(x·n) + β + x."""
    rng = np.random.default_rng(1)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.5, (C, 3, 3, 3)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.normal(0, 0.5, (C, C, 1, 1)).astype(np.float32), "w2"),
        numpy_helper.from_array(rng.normal(0, 0.5, (1, C, 1, 1)).astype(np.float32), "gamma"),
        numpy_helper.from_array(rng.normal(0, 0.5, (1, C, 1, 1)).astype(np.float32), "beta"),
        numpy_helper.from_array(np.array(1e-6, np.float32), "eps"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["a"], pads=[1, 1, 1, 1]),
        helper.make_node("ReduceL2", ["a"], ["g"], axes=[2, 3], keepdims=1),
        helper.make_node("ReduceMean", ["g"], ["gm"], axes=[1], keepdims=1),
        helper.make_node("Add", ["gm", "eps"], ["den"]),
        helper.make_node("Div", ["g", "den"], ["n"]),
        helper.make_node("Mul", ["a", "n"], ["an"]),
        helper.make_node("Mul", ["gamma", "an"], ["gan"]),
        helper.make_node("Add", ["beta", "gan"], ["shifted"]),
        helper.make_node("Add", ["a", "shifted"], ["grn"]),
        helper.make_node("Conv", ["grn", "w2"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "grn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    return load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def test_fix_takes_a_global_response_norm_to_one_segment() -> None:
    model = _grn()
    assert check_model(model, "mlsoc", suggest=False).mla_segments > 1
    result = fix_model(model, "mlsoc")
    assert result.coverage_after.mla_segments == 1
    applied = {step["rule"] for step in result.steps}
    assert {"reducel2-to-sum", "channel-reduce-to-conv"} <= applied


def test_a_fixed_global_response_norm_compiles_to_one_elf_bit_exact(tmp_path) -> None:
    fixed = fix_model(_grn(), "mlsoc").model
    qdq = quantize_on(fixed, "mlsoc")
    result = compile_model(qdq, tmp_path, target="mlsoc", model_name="grn")
    assert len(result.elf_files) == 1, result.notes
    feed = {"x": np.random.default_rng(5).normal(0, 1, (1, 3, 8, 8)).astype(np.float32)}
    comparison = run_and_compare(result, qdq, feed)
    assert comparison.mla_stages and comparison.bit_exact


def _channels_last_norm(op: str = "ReduceL2", keepdims: int = 1) -> onnx.ModelProto:
    """Hugging Face's ConvNeXt V2 GRN after the lift to 4-D: the map is channels-last
    [1, H, W, C] and the norm runs over axes [1, 2]."""
    rng = np.random.default_rng(2)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.5, (C, 3, 3, 3)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.normal(0, 0.5, (C, C, 1, 1)).astype(np.float32), "w2"),
        numpy_helper.from_array(np.array([1, 1, 1, C], np.int64), "kept"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["a"], pads=[1, 1, 1, 1]),
        helper.make_node("Transpose", ["a"], ["a_last"], perm=[0, 2, 3, 1]),
        helper.make_node(op, ["a_last"], ["g"], axes=[1, 2], keepdims=keepdims),
    ]
    scale = "g"
    if not keepdims:
        nodes.append(helper.make_node("Reshape", ["g", "kept"], ["g_kept"]))
        scale = "g_kept"
    nodes += [
        helper.make_node("Mul", ["a_last", scale], ["m"]),
        helper.make_node("Transpose", ["m"], ["m_first"], perm=[0, 3, 1, 2]),
        helper.make_node("Conv", ["m_first", "w2"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "channels_last_norm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 6, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    return load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


@pytest.mark.parametrize("op", ["ReduceL2", "ReduceSumSquare"])
def test_a_channels_last_norm_is_summed_over_h_and_w_of_its_transpose(op) -> None:
    model = _channels_last_norm(op)
    assert check_model(model, "mlsoc", suggest=False).mla_segments == 2
    step = apply_rule(model, "reducel2-to-sum", "mlsoc")
    assert step.verification.passed
    ops = _ops(step.model)
    assert op not in ops and ("Sqrt" in ops) == (op == "ReduceL2")
    assert ops.count("Transpose") == 4
    assert step.coverage_after.mla_segments == 1 and not step.coverage_after.blockers


def test_a_channels_last_norm_without_keepdims_is_reshaped_to_its_shape() -> None:
    """keepdims=0: the sum over H, W of [1, C, 1, 1] is reshaped to [1, C] (which the model
    then reshapes back to 4-D; fix merges the two Reshapes)."""
    model = _channels_last_norm(keepdims=0)
    step = apply_rule(model, "reducel2-to-sum", "mlsoc")
    assert step.verification.passed
    assert "ReduceL2" not in _ops(step.model)
    assert fix_model(model, "mlsoc").coverage_after.mla_segments == 1


def test_a_fixed_channels_last_norm_compiles_to_one_elf_bit_exact(tmp_path) -> None:
    result = fix_model(_channels_last_norm(), "mlsoc")
    assert result.coverage_after.mla_segments == 1
    qdq = quantize_on(result.model, "mlsoc")
    compiled = compile_model(qdq, tmp_path, target="mlsoc", model_name="grn_last")
    assert len(compiled.elf_files) == 1, compiled.notes
    feed = {"x": np.random.default_rng(6).normal(0, 1, (1, 3, 6, 5)).astype(np.float32)}
    comparison = run_and_compare(compiled, qdq, feed)
    assert comparison.mla_stages and comparison.bit_exact
