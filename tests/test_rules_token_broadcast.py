"""expand-into-broadcast and reduce-to-spatial: reductions over the tokens of a patch and the
broadcast of their result back over those tokens (MobileViTv2's separable attention, EdgeNeXt's
L2-normalised cross-covariance attention) on an MLA that has no Expand and reduces long axes
only together with every spatial axis."""

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

C, P, N = 8, 4, 256
"""Channels, pixels per patch, patches: [1, C, P, N] is MobileViT's unfolded feature map."""


def _model(nodes, inits, shape=(1, 3, P, N), opset: int = 14) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "tokens",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    return load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]))


def _weights(rng, *shapes_and_names):
    return [
        numpy_helper.from_array(rng.normal(0, 0.3, shape).astype(np.float32), name)
        for shape, name in shapes_and_names
    ]


def _ints(name: str, values) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(values, np.int64), name)


def _expand_into(op: str, expanded_first: bool = False) -> onnx.ModelProto:
    """Conv → ReduceMax over the tokens → Expand back to [1, C, P, N] → `op` with the map."""
    rng = np.random.default_rng(0)
    inits = _weights(rng, ((C, 3, 1, 1), "w1"), ((C, C, 1, 1), "w2"))
    inits.append(_ints("full", [1, C, P, N]))
    pair = ["e", "a"] if expanded_first else ["a", "e"]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["a"]),
        helper.make_node("ReduceMax", ["a"], ["m"], axes=[3], keepdims=1),
        helper.make_node("Expand", ["m", "full"], ["e"]),
        helper.make_node(op, pair, ["b"]),
        helper.make_node("Conv", ["b", "w2"], ["y"]),
    ]
    return _model(nodes, inits)


@pytest.mark.parametrize(("op", "expanded_first"), [("Mul", False), ("Div", False), ("Sub", True)])
def test_an_expand_a_broadcasting_op_makes_redundant_is_removed(op, expanded_first) -> None:
    model = _expand_into(op, expanded_first)
    assert check_model(model, "mlsoc", suggest=False).mla_segments == 2
    step = apply_rule(model, "expand-into-broadcast", "mlsoc")
    assert step.verification.passed and step.verification.mode == "exact"
    assert step.verification.worst_max_abs == 0
    assert "Expand" not in [n.op_type for n in step.model.graph.node]
    assert step.coverage_after.mla_segments == 1 and not step.coverage_after.blockers


def test_an_expand_that_sets_the_output_shape_stays() -> None:
    rng = np.random.default_rng(0)
    inits = _weights(rng, ((C, 3, 1, 1), "w1"), ((C, C, 1, 1), "w2"), ((1, C, 1, 1), "bias"))
    inits.append(_ints("full", [1, C, P, N]))
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["a"]),
        helper.make_node("ReduceMax", ["a"], ["m"], axes=[3], keepdims=1),
        helper.make_node("Expand", ["m", "full"], ["e"]),
        helper.make_node("Add", ["e", "bias"], ["b"]),  # [1,C,P,1] + [1,C,1,1] is not [1,C,P,N]
        helper.make_node("Conv", ["b", "w2"], ["y"]),
    ]
    with pytest.raises(RuleNotApplicableError):
        apply_rule(_model(nodes, inits), "expand-into-broadcast", "mlsoc")


def _reduce_tokens(op: str, axes: list[int], opset: int, keepdims: int = 1) -> onnx.ModelProto:
    """Conv → `op` over `axes` of [1, C, P, N] → Mul back onto the map → Conv."""
    rng = np.random.default_rng(1)
    inits = _weights(rng, ((C, 3, 1, 1), "w1"), ((C, C, 1, 1), "w2"))
    inits.append(_ints("axes", axes))
    as_input = opset >= 18 or (op == "ReduceSum" and opset >= 13)
    reduce = (
        helper.make_node(op, ["a", "axes"], ["r"], keepdims=keepdims)
        if as_input
        else helper.make_node(op, ["a"], ["r"], axes=axes, keepdims=keepdims)
    )
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"]), reduce]
    scale = "r"
    if not keepdims:
        kept = [1, C, P, N]
        for a in axes:
            kept[a] = 1
        inits.append(_ints("kept", kept))
        nodes.append(helper.make_node("Reshape", ["r", "kept"], ["rk"]))
        scale = "rk"
    nodes += [
        helper.make_node("Mul", ["a", scale], ["b"]),
        helper.make_node("Conv", ["b", "w2"], ["y"]),
    ]
    return _model(nodes, inits, opset=opset)


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMean"])
@pytest.mark.parametrize("axes", [[3], [1, 2, 3]])
def test_a_reduction_over_the_trailing_axes_becomes_a_spatial_one(op, axes, opset) -> None:
    model = _reduce_tokens(op, axes, opset)
    assert check_model(model, "mlsoc", suggest=False).mla_segments == 2
    step = apply_rule(model, "reduce-to-spatial", "mlsoc")
    assert step.verification.passed
    assert step.coverage_after.mla_segments == 1 and not step.coverage_after.blockers


def test_without_keepdims_the_spatial_reduction_is_reshaped_back() -> None:
    step = apply_rule(_reduce_tokens("ReduceSum", [3], 13, keepdims=0), "reduce-to-spatial")
    assert step.verification.passed
    ops = [n.op_type for n in step.model.graph.node]
    assert ops[1:4] == ["Reshape", "ReduceSum", "Reshape"]


def test_a_reduction_over_the_height_alone_is_not_rewritten() -> None:
    model = _reduce_tokens("ReduceSum", [2], 13)
    with pytest.raises(RuleNotApplicableError):
        apply_rule(model, "reduce-to-spatial", "mlsoc")


def _separable_attention() -> onnx.ModelProto:
    """MobileViTv2's LinearSelfAttention on unfolded patches [1, C, P, N], as timm exports it:
    a 1×1 qkv Conv split into a 1-channel query, keys and values; softmax of the query over
    the tokens; the context vector Σ_tokens k·softmax(q), expanded back over the tokens and
    multiplied into relu(v); a 1×1 output Conv."""
    rng = np.random.default_rng(2)
    inits = _weights(
        rng, ((C, 3, 1, 1), "w_in"), ((1 + 2 * C, C, 1, 1), "w_qkv"), ((C, C, 1, 1), "w_out")
    )
    inits += [_ints("split", [1, C, C]), _ints("tokens", [-1]), _ints("full", [1, C, P, N])]
    nodes = [
        helper.make_node("Conv", ["x", "w_in"], ["a"]),
        helper.make_node("Conv", ["a", "w_qkv"], ["qkv"]),
        helper.make_node("Split", ["qkv", "split"], ["q", "k", "v"], axis=1),
        helper.make_node("Softmax", ["q"], ["sq"], axis=-1),
        helper.make_node("Mul", ["k", "sq"], ["ks"]),
        helper.make_node("ReduceSum", ["ks", "tokens"], ["context"], keepdims=1),
        helper.make_node("Relu", ["v"], ["rv"]),
        helper.make_node("Expand", ["context", "full"], ["ce"]),
        helper.make_node("Mul", ["rv", "ce"], ["att"]),
        helper.make_node("Conv", ["att", "w_out"], ["y"]),
    ]
    return _model(nodes, inits)


@pytest.mark.parametrize("target", ["mlsoc", "rk3588"])
def test_fix_takes_separable_attention_to_one_segment(target) -> None:
    model = _separable_attention()
    assert check_model(model, target, suggest=False).mla_segments > 1
    result = fix_model(model, target)
    assert result.coverage_after.mla_segments == 1 and not result.coverage_after.blockers
    assert "expand-into-broadcast" in {step["rule"] for step in result.steps}


def test_fixed_separable_attention_compiles_to_one_elf_bit_exact(tmp_path) -> None:
    fixed = fix_model(_separable_attention(), "mlsoc").model
    qdq = quantize_on(fixed, "mlsoc")
    result = compile_model(qdq, tmp_path, target="mlsoc", model_name="separable_attention")
    assert len(result.elf_files) == 1, result.notes
    feed = {"x": np.random.default_rng(5).normal(0, 1, (1, 3, P, N)).astype(np.float32)}
    comparison = run_and_compare(result, qdq, feed)
    assert comparison.mla_stages and comparison.bit_exact


def _l2_normalised_tokens() -> onnx.ModelProto:
    """EdgeNeXt's XCA normalisation, torch's F.normalize(q, dim=-1) over the tokens:
    q / Expand(Clip(ReduceL2(q), eps)), then a 1×1 Conv. The norm runs over N ≥ 128 tokens,
    which the MLA sums only as a reduction over every spatial axis."""
    rng = np.random.default_rng(3)
    inits = _weights(rng, ((C, 3, 1, 1), "w1"), ((C, C, 1, 1), "w2"))
    inits += [
        _ints("full", [1, C, P, N]),
        numpy_helper.from_array(np.array(1e-12, np.float32), "eps"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["q"]),
        helper.make_node("ReduceL2", ["q"], ["norm"], axes=[-1], keepdims=1),
        helper.make_node("Clip", ["norm", "eps"], ["clipped"]),
        helper.make_node("Expand", ["clipped", "full"], ["en"]),
        helper.make_node("Div", ["q", "en"], ["qn"]),
        helper.make_node("Conv", ["qn", "w2"], ["y"]),
    ]
    return _model(nodes, inits)


def test_fix_takes_l2_normalised_tokens_to_one_segment() -> None:
    model = _l2_normalised_tokens()
    assert check_model(model, "mlsoc", suggest=False).mla_segments > 1
    result = fix_model(model, "mlsoc")
    assert result.coverage_after.mla_segments == 1 and not result.coverage_after.blockers
    applied = {step["rule"] for step in result.steps}
    assert {"expand-into-broadcast", "reducel2-to-sum"} <= applied
    ops = [n.op_type for n in result.model.graph.node]
    assert ops[1:5] == ["Mul", "Reshape", "ReduceSum", "Sqrt"]  # the sum over H·W of [1,C·P,1,N]


def _l2_normalised_rank3_tokens() -> onnx.ModelProto:
    """SwiftFormer's efficient additive attention as timm exports it: the map flattened to
    tokens [1, H·W, C], a Linear, F.normalize over the features (ReduceL2, Clip, Expand, Div)
    on rank-3 tensors the host runs until they are lifted to 4-D, a Linear, and back."""
    rng = np.random.default_rng(4)
    inits = _weights(
        rng, ((C, 3, 1, 1), "w1"), ((C, C), "wq"), ((C, C), "wo"), ((C, C, 1, 1), "w2")
    )
    inits += [
        _ints("tokens", [1, C, P * N]),
        _ints("full", [1, P * N, C]),
        _ints("map", [1, C, P, N]),
        numpy_helper.from_array(np.array(1e-12, np.float32), "eps"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["a"]),
        helper.make_node("Reshape", ["a", "tokens"], ["t"]),
        helper.make_node("Transpose", ["t"], ["tt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["tt", "wq"], ["q"]),
        helper.make_node("ReduceL2", ["q"], ["norm"], axes=[-1], keepdims=1),
        helper.make_node("Clip", ["norm", "eps"], ["clipped"]),
        helper.make_node("Expand", ["clipped", "full"], ["en"]),
        helper.make_node("Div", ["q", "en"], ["qn"]),
        helper.make_node("MatMul", ["qn", "wo"], ["o"]),
        helper.make_node("Transpose", ["o"], ["ot"], perm=[0, 2, 1]),
        helper.make_node("Reshape", ["ot", "map"], ["m"]),
        helper.make_node("Conv", ["m", "w2"], ["y"]),
    ]
    return _model(nodes, inits)


def test_expand_before_host_consumers_is_removed_so_the_tokens_can_be_lifted() -> None:
    model = _l2_normalised_rank3_tokens()
    assert check_model(model, "mlsoc", suggest=False).mla_segments > 1
    result = fix_model(model, "mlsoc")
    assert result.coverage_after.mla_segments == 1 and not result.coverage_after.blockers
    applied = [step["rule"] for step in result.steps]
    assert applied.index("expand-into-broadcast") < applied.index("transformer-to-4d")
