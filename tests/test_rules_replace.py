"""Operator replacement rules.

For each rule: where it matches (and where it must not), that the rewrite verifies through the
engine (exact rules to float rounding, approximate ones under their declared bound, with the
measured error asserted), and that the blocker it claims is gone from coverage. Rules whose
blocker does not exist on mlsoc are checked against a target that lacks the op (a profile that
`extends: mlsoc` and removes it) or against rk3588, so every claim comes from a target table.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from surgery.coverage import analyze_coverage
from surgery.model import load_model
from surgery.rules import Reference, apply_rule, find_matches, get_rule
from surgery.rules.fix import fix_model
from surgery.rules.replace_einsum import plan_product
from tests.conftest import shared_model

RNG = np.random.default_rng(1)


def _f32(*shape: int, scale: float = 1.0) -> np.ndarray:
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def _model(
    nodes: list[onnx.NodeProto],
    inputs: dict[str, list],
    outputs: dict[str, list | None],
    inits: dict[str, np.ndarray] | None = None,
    opset: int = 17,
) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "test",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs.items()],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs.items()],
        [numpy_helper.from_array(np.asarray(v), n) for n, v in (inits or {}).items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return load_model(model)


def _unary(op: str, shape: list[int], opset: int = 17, **attrs) -> onnx.ModelProto:
    node = helper.make_node(op, ["x"], ["y"], name="node", **attrs)
    return _model([node], {"x": shape}, {"y": None}, opset=opset)


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def _wide(model: onnx.ModelProto, low: float = -4.0, high: float = 4.0) -> Reference:
    """Reference on inputs spanning negative and positive values (the default is [0, 1))."""
    rng = np.random.default_rng(7)
    feed = {}
    for vi in model.graph.input:
        shape = [d.dim_value for d in vi.type.tensor_type.shape.dim]
        feed[vi.name] = rng.uniform(low, high, shape).astype(np.float32)
    return Reference.of(model, feed)


def _exact(result) -> None:
    """Verified by the engine in exact mode: max_abs ≤ 1e-5·max(1, max|ref|)."""
    v = result.verification
    assert v.passed and v.mode == "exact"
    assert v.worst_max_abs <= 1e-4


def _blockers(result) -> set[str]:
    return {b.name for b in result.coverage_after.blockers}


@pytest.fixture
def target_without(tmp_path: Path):
    """A target profile: mlsoc minus some ops (they fall to the APU and become blockers)."""

    def make(*ops: str) -> str:
        path = tmp_path / f"no_{'_'.join(o.lower() for o in ops)}.yaml"
        path.write_text(
            f"name: {path.stem}\nextends: mlsoc\ntitle: mlsoc without {', '.join(ops)}\n"
            f"remove_ops: [{', '.join(ops)}]\n"
        )
        return str(path)

    return make


# --------------------------------------------------------------------------- gemm / matmul


def _classifier(**gemm_attrs) -> onnx.ModelProto:
    """Conv → GlobalAveragePool → Flatten → Gemm → output: the usual CNN tail."""
    trans_b = gemm_attrs.get("transB", 0)
    b = _f32(10, 8) if trans_b else _f32(8, 10)
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("GlobalAveragePool", ["c"], ["g"], name="gap"),
        helper.make_node("Flatten", ["g"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "b", "bias"], ["y"], name="fc", **gemm_attrs),
    ]
    inits = {"w": _f32(8, 3, 3, 3), "b": b, "bias": _f32(10)}
    return _model(nodes, {"x": [1, 3, 8, 8]}, {"y": [1, 10]}, inits)


def test_gemm_to_conv_absorbs_flatten_and_folds_alpha_beta_transb():
    model = _classifier(transB=1, alpha=0.5, beta=2.0)
    (match,) = find_matches(model, "gemm-to-conv")
    assert match.nodes == ["fc", "flatten"]
    assert set(match.blockers) == {"fc", "flatten"}
    result = apply_rule(model, "gemm-to-conv")
    assert _ops(result.model) == ["Conv", "GlobalAveragePool", "Conv", "Reshape"]
    assert _blockers(result) == {"linear_back"}  # only the rank-2 output reshape, at the edge
    assert result.coverage_after.mla_segments == 1
    _exact(result)


def test_gemm_to_conv_over_a_flattened_map_uses_a_full_kernel():
    """Flatten of [1, 4, 3, 3] then Gemm = Conv with a 3×3 kernel; a Reshape consumer reads the
    4-D result directly, so no reshape back is added."""
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Flatten", ["r"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "b"], ["g"], name="fc"),
        helper.make_node("Reshape", ["g", "shape"], ["y"], name="to4d"),
    ]
    inits = {"b": _f32(36, 6), "shape": np.array([1, 6, 1, 1], np.int64)}
    model = _model(nodes, {"x": [1, 4, 3, 3]}, {"y": [1, 6, 1, 1]}, inits)
    result = apply_rule(model, "gemm-to-conv")
    conv = next(n for n in result.model.graph.node if n.op_type == "Conv")
    kernel = next(a for a in conv.attribute if a.name == "kernel_shape")
    assert list(kernel.ints) == [3, 3]
    assert _ops(result.model) == ["Relu", "Conv", "Reshape"]
    assert not result.coverage_after.blockers
    _exact(result)


def test_gemm_to_conv_on_a_plain_rank2_input_claims_no_blocker():
    """[N, K] from a graph input needs a Reshape in and out (both rank-2, both blocked): the
    rewrite is valid but frees nothing, so `surgery fix` will not pick it."""
    nodes = [helper.make_node("Gemm", ["x", "b"], ["y"], name="fc")]
    model = _model(nodes, {"x": [2, 5]}, {"y": [2, 3]}, {"b": _f32(5, 3)})
    (match,) = find_matches(model, "gemm-to-conv")
    assert match.blockers == []
    _exact(apply_rule(model, "gemm-to-conv"))


def test_gemm_to_conv_skips_transa_and_computed_weights():
    nodes = [
        helper.make_node("Gemm", ["x", "b"], ["y"], name="ta", transA=1),
        helper.make_node("Gemm", ["x2", "w"], ["z"], name="dyn"),
    ]
    model = _model(
        nodes,
        {"x": [5, 2], "x2": [2, 5], "w": [5, 3]},
        {"y": [2, 3], "z": [2, 3]},
        {"b": _f32(5, 3)},
    )
    assert find_matches(model, "gemm-to-conv") == []


def test_matmul_to_conv_fuses_the_bias_add():
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
        helper.make_node("Flatten", ["c"], ["f"], name="flatten"),
        helper.make_node("MatMul", ["f", "b"], ["m"], name="mm"),
        helper.make_node("Add", ["m", "bias"], ["y"], name="bias_add"),
    ]
    inits = {"w": _f32(4, 3, 1, 1), "b": _f32(4 * 2 * 2, 7), "bias": _f32(7)}
    model = _model(nodes, {"x": [1, 3, 2, 2]}, {"y": [1, 7]}, inits)
    (match,) = find_matches(model, "matmul-to-conv")
    assert set(match.nodes) == {"mm", "bias_add", "flatten"}
    result = apply_rule(model, "matmul-to-conv")
    assert _ops(result.model) == ["Conv", "Conv", "Reshape"]
    assert len(result.coverage_before.blockers) == 3 and len(result.coverage_after.blockers) == 1
    _exact(result)


def test_matmul_to_conv_channels_last_absorbs_the_transposes(target_without):
    """NCHW → NHWC → MatMul → NCHW is one 1×1 Conv; on a target without MatMul it is a blocker."""
    nodes = [
        helper.make_node("Transpose", ["x"], ["t"], name="to_nhwc", perm=[0, 2, 3, 1]),
        helper.make_node("MatMul", ["t", "b"], ["m"], name="mm"),
        helper.make_node("Transpose", ["m"], ["y"], name="to_nchw", perm=[0, 3, 1, 2]),
    ]
    model = _model(nodes, {"x": [1, 6, 3, 4]}, {"y": [1, 5, 3, 4]}, {"b": _f32(6, 5)})
    target = target_without("MatMul")
    (match,) = find_matches(model, "matmul-to-conv", target)
    assert "mm" in match.blockers
    result = apply_rule(model, "matmul-to-conv", target)
    assert _ops(result.model) == ["Conv"]
    assert not result.coverage_after.blockers
    _exact(result)


def test_matmul_to_conv_leaves_rank3_tokens_to_the_rank_rules():
    nodes = [helper.make_node("MatMul", ["x", "b"], ["y"], name="mm")]
    model = _model(nodes, {"x": [1, 5, 8]}, {"y": [1, 5, 4]}, {"b": _f32(8, 4)})
    assert find_matches(model, "matmul-to-conv") == []


# --------------------------------------------------------------------------- split / gather


def test_split_to_slices_on_the_batch_axis():
    nodes = [
        helper.make_node("Split", ["x", "sizes"], ["a", "b", "unused"], name="split", axis=0),
        helper.make_node("Add", ["a", "b"], ["y"], name="add"),
    ]
    model = _model(
        nodes, {"x": [5, 3, 4, 4]}, {"y": [2, 3, 4, 4]}, {"sizes": np.array([2, 2, 1], np.int64)}
    )
    (match,) = find_matches(model, "split-to-slices")
    assert match.blockers == ["split"]  # the MLA cannot split the batch axis; it can slice it
    result = apply_rule(model, "split-to-slices")
    assert _ops(result.model) == ["Slice", "Slice", "Add"]  # no Slice for the unused output
    assert "split" not in _blockers(result)
    _exact(result)


def test_split_to_slices_handles_num_outputs(target_without):
    node = helper.make_node("Split", ["x"], ["a", "b"], name="split", axis=1, num_outputs=2)
    model = _model([node], {"x": [1, 4, 2, 2]}, {"a": None, "b": None}, opset=18)
    assert find_matches(model, "split-to-slices") == []  # a channel Split runs on the MLA
    result = apply_rule(model, "split-to-slices", target_without("Split"))
    assert _ops(result.model) == ["Slice", "Slice"]
    assert [o.name for o in result.model.graph.output] == ["a", "b"]
    assert not result.coverage_after.blockers
    _exact(result)


def _gather(indices: np.ndarray, axis: int = 1) -> onnx.ModelProto:
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Gather", ["r", "idx"], ["y"], name="gather", axis=axis),
    ]
    return _model(nodes, {"x": [1, 8, 4, 4]}, {"y": None}, {"idx": indices})


def test_gather_to_slice_contiguous_indices():
    model = _gather(np.array([2, 3, 4], np.int64))
    (match,) = find_matches(model, "gather-to-slice")
    assert match.blockers == ["gather"]  # Gather is bf16-only on the mlsoc MLA
    result = apply_rule(model, "gather-to-slice")
    assert _ops(result.model) == ["Relu", "Slice"]
    assert not result.coverage_after.blockers
    _exact(result)


def test_gather_to_slice_scalar_and_negative_index_keep_rank_semantics():
    model = _gather(np.array(-1, np.int64))
    (match,) = find_matches(model, "gather-to-slice")
    assert match.data["start"] == 7
    assert match.blockers == []  # the Reshape to rank 3 stays blocked: no net gain
    result = apply_rule(model, "gather-to-slice")
    assert _ops(result.model) == ["Relu", "Slice", "Reshape"]
    dims = [d.dim_value for d in result.model.graph.output[0].type.tensor_type.shape.dim]
    assert dims == [1, 4, 4]
    _exact(result)


def test_a_scalar_pick_of_a_unit_axis_is_one_reshape_absorbing_its_reader():
    """Funnel Transformer's x[:, 0] of a [1, 1, 64, 16] map then viewed as [64, 16, 1, 1] by
    a lift: one 4-D Reshape, which frees both the Gather and the rank-3 Reshape after it."""
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Gather", ["r", "idx"], ["picked"], name="gather", axis=1),
        helper.make_node("Reshape", ["picked", "to4d"], ["v"], name="to4d"),
        helper.make_node("Relu", ["v"], ["y"], name="after"),
    ]
    inits = {"idx": np.array(0, np.int64), "to4d": np.array([64, 16, 1, 1], np.int64)}
    model = _model(nodes, {"x": [1, 1, 64, 16]}, {"y": None}, inits)
    (match,) = find_matches(model, "gather-to-slice")
    assert sorted(match.blockers) == ["gather", "to4d"]
    result = apply_rule(model, "gather-to-slice")
    assert _ops(result.model) == ["Relu", "Reshape", "Relu"]
    assert result.coverage_after.mla_segments == 1 and not result.coverage_after.blockers
    _exact(result)


def test_gather_to_slice_skips_non_contiguous_and_computed_indices():
    assert find_matches(_gather(np.array([0, 2], np.int64)), "gather-to-slice") == []
    assert find_matches(_gather(np.array([[0, 1]], np.int64)), "gather-to-slice") == []


def _gather_nd(indices: np.ndarray, batch_dims: int = 0) -> onnx.ModelProto:
    """Relu on [6, 2, 4, 4] → GatherND: Falcon's fused multi-query projection picks k and v so."""
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("GatherND", ["r", "idx"], ["y"], name="pick", batch_dims=batch_dims),
    ]
    return _model(nodes, {"x": [6, 2, 4, 4]}, {"y": None}, {"idx": indices})


def test_gather_nd_of_one_leading_position_becomes_a_slice_and_reshape():
    model = _gather_nd(np.array([[-2]], np.int64))
    (match,) = find_matches(model, "gather-to-slice")
    assert (match.data["axis"], match.data["start"], match.data["end"]) == (0, 4, 5)
    result = apply_rule(model, "gather-to-slice")
    assert _ops(result.model) == ["Relu", "Slice", "Reshape"]
    dims = [d.dim_value for d in result.model.graph.output[0].type.tensor_type.shape.dim]
    assert dims == [1, 2, 4, 4]
    _exact(result)


def test_gather_nd_that_is_no_slice_is_left_alone():
    assert find_matches(_gather_nd(np.array([[0], [2]], np.int64)), "gather-to-slice") == []
    assert find_matches(_gather_nd(np.array([[1, 0]], np.int64)), "gather-to-slice") == []


# --------------------------------------------------------------------------- einsum


@pytest.mark.parametrize(
    ("equation", "expected"),
    [
        ("bhlk,bhtk->bhlt", (None, [0, 1, 3, 2], None)),  # q·kᵀ
        ("bhlt,bhtv->bhlv", (None, None, None)),  # p·v
        ("bik,bkj->bji", (None, None, [0, 2, 1])),
        ("kbi,bkj->bij", ([1, 2, 0], None, None)),
    ],
)
def test_einsum_products_plan_as_transposes_around_a_matmul(equation, expected):
    plan = plan_product(equation)
    assert plan is not None
    assert (plan.lhs_perm, plan.rhs_perm, plan.out_perm) == expected


@pytest.mark.parametrize(
    "equation",
    [
        "bij,bjk,bkl->bil",
        "bij,bjk->bk",
        "...ij,...jk->...ik",
        "bij,bjk->bik,",
        "iij,jk->ik",
        "bij,jk->bik",
    ],
)
def test_einsums_that_are_not_one_batched_product_are_not_planned(equation):
    """Three operands, a letter summed inside one operand, an ellipsis, a repeated letter, a
    batch letter missing from one operand."""
    assert plan_product(equation) is None


def test_einsum_to_matmul_on_a_target_without_einsum():
    """rk3588 has no Einsum: CvT's attention q·kᵀ becomes a MatMul on a transposed k."""
    model = _model(
        [helper.make_node("Einsum", ["q", "k"], ["y"], name="scores", equation="bhlk,bhtk->bhlt")],
        {"q": [1, 2, 6, 4], "k": [1, 2, 5, 4]},
        {"y": [1, 2, 6, 5]},
        opset=17,
    )
    (match,) = find_matches(model, "einsum-to-matmul", "rk3588")
    assert match.blockers == ["scores"]
    result = apply_rule(model, "einsum-to-matmul", "rk3588", reference=_wide(model))
    assert _ops(result.model) == ["Transpose", "MatMul"]
    assert not result.coverage_after.blockers
    _exact(result)


# --------------------------------------------------------------------------- reductions


def _reducemean(keepdims: int, opset: int = 17, axes: list[int] | None = None):
    axes = axes or [2, 3]
    if opset >= 18:
        node = helper.make_node("ReduceMean", ["x", "axes"], ["y"], name="mean", keepdims=keepdims)
        return _model(
            [node], {"x": [1, 4, 5, 6]}, {"y": None}, {"axes": np.array(axes, np.int64)}, opset
        )
    node = helper.make_node("ReduceMean", ["x"], ["y"], name="mean", axes=axes, keepdims=keepdims)
    return _model([node], {"x": [1, 4, 5, 6]}, {"y": None}, opset=opset)


def test_reducemean_to_gap_frees_the_blocker_where_reducemean_is_missing(target_without):
    target = target_without("ReduceMean")
    model = _reducemean(keepdims=1)
    (match,) = find_matches(model, "reducemean-to-gap", target)
    assert match.blockers == ["mean"]
    result = apply_rule(model, "reducemean-to-gap", target)
    assert _ops(result.model) == ["GlobalAveragePool"]
    assert not result.coverage_after.blockers
    _exact(result)


def test_reducemean_to_gap_keepdims0_and_axes_input():
    result = apply_rule(_reducemean(keepdims=0, opset=18, axes=[-1, -2]), "reducemean-to-gap")
    assert _ops(result.model) == ["GlobalAveragePool", "Reshape"]
    _exact(result)
    assert find_matches(_reducemean(keepdims=1, axes=[1, 2]), "reducemean-to-gap") == []


def test_reducemin_to_reducemax_runs_on_the_mla():
    model = _unary("ReduceMin", [1, 4, 5, 6], axes=[2, 3], keepdims=1)
    (match,) = find_matches(model, "reducemin-to-reducemax")
    assert match.blockers == ["node"]  # ReduceMin is CVU-only on mlsoc
    result = apply_rule(model, "reducemin-to-reducemax", reference=_wide(model))
    assert _ops(result.model) == ["Mul", "ReduceMax", "Mul"]  # Mul by −1: Neg is not on the MLA
    assert not result.coverage_after.blockers
    assert result.verification.worst_max_abs == 0.0


def test_softmax_to_channel_moves_the_axis():
    model = _unary("Softmax", [1, 4, 5, 6], axis=-1)
    (match,) = find_matches(model, "softmax-to-channel")
    assert match.blockers == ["node"]
    result = apply_rule(model, "softmax-to-channel", reference=_wide(model))
    assert _ops(result.model) == ["Transpose", "Softmax", "Transpose"]
    assert not result.coverage_after.blockers
    _exact(result)


def test_softmax_to_channel_not_before_opset_13_nor_on_channel_axis():
    assert (
        find_matches(_unary("Softmax", [1, 4, 5, 6], opset=11, axis=3), "softmax-to-channel") == []
    )
    assert find_matches(_unary("Softmax", [1, 4, 5, 6], axis=1), "softmax-to-channel") == []


# --------------------------------------------------------------------------- arithmetic


def test_sub_div_to_add_mul(target_without):
    nodes = [
        helper.make_node("Sub", ["x", "mean"], ["s"], name="sub"),
        helper.make_node("Div", ["s", "std"], ["d"], name="div"),
        helper.make_node("Div", ["d", "zero_in"], ["z"], name="div_by_zero"),
        helper.make_node("Div", ["one", "z"], ["y"], name="const_over_x"),
    ]
    inits = {
        "mean": np.array([0.485, 0.456, 0.406], np.float32).reshape(1, 3, 1, 1),
        "std": np.array([0.229, 0.224, 0.225], np.float32).reshape(1, 3, 1, 1),
        "zero_in": np.array([1.0, 0.0, 2.0], np.float32).reshape(1, 3, 1, 1),
        "one": np.array(1.0, np.float32),
    }
    model = _model(nodes, {"x": [1, 3, 4, 4]}, {"y": None}, inits)
    target = target_without("Sub", "Div")
    matches = find_matches(model, "sub-div-to-add-mul", target)
    assert [m.nodes for m in matches] == [["sub"], ["div"]]
    assert [m.blockers for m in matches] == [["sub"], ["div"]]
    result = apply_rule(model, "sub-div-to-add-mul", target)
    assert _ops(result.model) == ["Add", "Mul", "Div", "Div"]
    assert {"sub", "div"}.isdisjoint(_blockers(result))
    _exact(result)


@pytest.mark.parametrize(
    ("exponent", "ops", "blocked"),
    [
        (2.0, ["Mul"], False),
        (0.5, ["Sqrt"], False),
        (1.0, [], True),
        (4.0, ["Mul", "Mul"], True),
        (-1.0, ["Reciprocal"], True),
    ],
)
def test_pow2_to_mul(exponent, ops, blocked):
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Pow", ["r", "e"], ["p"], name="pow"),
        helper.make_node("Sigmoid", ["p"], ["y"], name="sig"),
    ]
    model = _model(nodes, {"x": [1, 2, 3, 3]}, {"y": None}, {"e": np.array(exponent, np.float32)})
    (match,) = find_matches(model, "pow2-to-mul")
    assert match.blockers == (["pow"] if blocked else [])  # mlsoc's Pow takes 0.5, -0.5, 2, 3
    result = apply_rule(model, "pow2-to-mul", reference=_wide(model, 0.5, 3.0))
    assert _ops(result.model) == ["Relu", *ops, "Sigmoid"]
    assert not result.coverage_after.blockers
    _exact(result)


def test_pow2_to_mul_skips_other_exponents():
    nodes = [helper.make_node("Pow", ["x", "e"], ["y"], name="pow")]
    model = _model(nodes, {"x": [1, 2, 3, 3]}, {"y": None}, {"e": np.array(5.0, np.float32)})
    assert find_matches(model, "pow2-to-mul") == []


# --------------------------------------------------------------------------- activations


def _paddle_hardswish(opset: int = 11) -> onnx.ModelProto:
    """Paddle's hardswish: x·Clip(x + 3, 0, 6)/6, plus its hardsigmoid Clip(x + 3, 0, 6)/6."""
    nodes = [
        helper.make_node("Add", ["x", "three"], ["a"], name="add3"),
        helper.make_node("Clip", ["a", "zero", "six"], ["c"], name="relu6"),
        helper.make_node("Mul", ["x", "c"], ["m"], name="mul"),
        helper.make_node("Div", ["m", "six"], ["hs"], name="div6"),
        helper.make_node("Add", ["hs", "three"], ["b"], name="add3b"),
        helper.make_node("Clip", ["b", "zero", "six"], ["c2"], name="relu6b"),
        helper.make_node("Div", ["c2", "six"], ["y"], name="div6b"),
    ]
    inits = {
        "three": np.array(3.0, np.float32),
        "zero": np.array(0.0, np.float32),
        "six": np.array(6.0, np.float32),
    }
    return _model(nodes, {"x": [1, 4, 5, 5]}, {"y": None}, inits, opset)


def test_normalise_activations_paddle_hardswish_and_hardsigmoid():
    model = _paddle_hardswish()
    matches = find_matches(model, "normalise-activations")
    assert [m.nodes for m in matches] == [
        ["add3", "relu6", "mul", "div6"],
        ["add3b", "relu6b", "div6b"],
    ]
    assert "opset 11 to 14" in matches[0].reason
    result = apply_rule(model, "normalise-activations", reference=_wide(model, -6, 6))
    assert _ops(result.model) == ["HardSwish", "HardSigmoid"]
    assert result.model.opset_import[0].version == 14
    _exact(result)


def test_normalise_activations_hardsigmoid_forms():
    nodes = [
        helper.make_node("HardSigmoid", ["x"], ["h"], name="hsig", alpha=1 / 6, beta=0.5),
        helper.make_node("Mul", ["h", "x"], ["s"], name="mul"),
        helper.make_node("HardSigmoid", ["s"], ["h2"], name="paddle_se"),  # alpha 0.2: no match
        helper.make_node("Mul", ["s", "h2"], ["y"], name="gate"),
    ]
    model = _model(nodes, {"x": [1, 4, 5, 5]}, {"y": None})
    (match,) = find_matches(model, "normalise-activations")
    assert match.nodes == ["hsig", "mul"]
    result = apply_rule(model, "normalise-activations", reference=_wide(model, -6, 6))
    assert _ops(result.model) == ["HardSwish", "HardSigmoid", "Mul"]
    _exact(result)


def test_normalise_activations_swish_only_where_the_target_runs_it(target_without):
    nodes = [
        helper.make_node("Sigmoid", ["x"], ["s"], name="sig"),
        helper.make_node("Mul", ["x", "s"], ["y"], name="mul"),
    ]
    model = _model(nodes, {"x": [1, 4, 5, 5]}, {"y": None})
    result = apply_rule(model, "normalise-activations", reference=_wide(model))
    assert _ops(result.model) == ["Swish"]
    _exact(result)
    assert find_matches(model, "normalise-activations", target_without("Swish")) == []


def test_normalise_activations_min_max_relu6_becomes_clip():
    nodes = [
        helper.make_node("Max", ["x", "zero"], ["a"], name="max0"),
        helper.make_node("Min", ["a", "six"], ["b"], name="min6"),
        helper.make_node("Max", ["b", "zero"], ["y"], name="relu"),
    ]
    inits = {"zero": np.array(0.0, np.float32), "six": np.array(6.0, np.float32)}
    model = _model(nodes, {"x": [1, 4, 5, 5]}, {"y": None}, inits)
    matches = find_matches(model, "normalise-activations")
    assert [m.nodes for m in matches] == [["min6", "relu"], ["max0"]]
    assert {b for m in matches for b in m.blockers} == {"max0", "min6", "relu"}  # CVU-only
    result = apply_rule(model, "normalise-activations", reference=_wide(model, -8, 8))
    assert sorted(_ops(result.model)) == ["Clip", "Relu"]
    assert not result.coverage_after.blockers
    _exact(result)


def test_clip_bounds_written_by_a_rule_are_scalars():
    """Clip's min and max must be scalars: a rule's 0-d constant stays 0-d (the compiler's
    Clip lowering read a [1]-shaped bound as an error)."""
    nodes = [helper.make_node("Max", ["x", "floor"], ["y"], name="floor_max")]
    inits = {"floor": np.array(-1.5, np.float32)}
    model = _model(nodes, {"x": [1, 4, 5, 5]}, {"y": None}, inits)
    result = apply_rule(model, "normalise-activations", reference=_wide(model, -8, 8))
    (clip,) = result.model.graph.node
    bounds = {t.name: list(t.dims) for t in result.model.graph.initializer}
    assert clip.op_type == "Clip" and bounds[clip.input[1]] == []


# --------------------------------------------------------------------------- GELU


def _erf_gelu(variant: str) -> onnx.ModelProto:
    """The erf GELU in the association orders exporters produce."""
    head = [
        helper.make_node("Div", ["x", "sqrt2"], ["d"], name="div"),
        helper.make_node("Erf", ["d"], ["e"], name="erf"),
        helper.make_node("Add", ["e", "one"], ["a"], name="add"),
    ]
    if variant == "torch":  # (x·(1+erf))·0.5
        tail = [
            helper.make_node("Mul", ["x", "a"], ["m"], name="mul"),
            helper.make_node("Mul", ["m", "half"], ["y"], name="mul_half"),
        ]
    elif variant == "half_first":  # (x·0.5)·(1+erf)
        tail = [
            helper.make_node("Mul", ["x", "half"], ["h"], name="mul_half"),
            helper.make_node("Mul", ["h", "a"], ["y"], name="mul"),
        ]
    else:  # x·((1+erf)·0.5), with x·(1/√2) instead of x/√2
        head[0] = helper.make_node("Mul", ["x", "inv_sqrt2"], ["d"], name="div")
        tail = [
            helper.make_node("Mul", ["a", "half"], ["h"], name="mul_half"),
            helper.make_node("Mul", ["x", "h"], ["y"], name="mul"),
        ]
    inits = {
        "sqrt2": np.array(1.4142135, np.float32),
        "inv_sqrt2": np.array(0.70710677, np.float32),
        "one": np.array(1.0, np.float32),
        "half": np.array(0.5, np.float32),
    }
    return _model(head + tail, {"x": [1, 4, 6, 6]}, {"y": None}, inits)


@pytest.mark.parametrize("variant", ["torch", "half_first", "scaled"])
def test_erf_gelu_to_gelu_variants(variant):
    model = _erf_gelu(variant)
    (match,) = find_matches(model, "erf-gelu-to-gelu")
    assert len(match.nodes) == 5
    result = apply_rule(model, "erf-gelu-to-gelu", reference=_wide(model))
    assert _ops(result.model) == ["Gelu"]
    assert result.model.opset_import[0].version == 20
    _exact(result)


def test_erf_gelu_to_gelu_ignores_other_erf_uses():
    nodes = [
        helper.make_node("Erf", ["x"], ["e"], name="erf"),
        helper.make_node("Add", ["e", "one"], ["y"], name="add"),
    ]
    model = _model(nodes, {"x": [1, 2, 2, 2]}, {"y": None}, {"one": np.array(1.0, np.float32)})
    assert find_matches(model, "erf-gelu-to-gelu") == []


def test_gelu_to_tanh_is_within_its_bound():
    model = _erf_gelu("torch")
    rule = get_rule("gelu-to-tanh")
    (match,) = find_matches(model, rule)
    assert match.data["plan"] == "tanh formula"  # mlsoc's MLA runs Gelu(approximate=none) only
    result = apply_rule(model, rule, reference=_wide(model))
    assert "Tanh" in _ops(result.model) and "Erf" not in _ops(result.model)
    measured = result.verification.worst_max_rel
    assert result.verification.mode == "approximate"
    assert 1e-6 < measured <= rule.error_bound
    assert measured < 2e-4  # ≤ 4.8e-4 absolute against outputs up to 4


def test_gelu_to_tanh_from_a_gelu_op():
    model = _unary("Gelu", [1, 4, 6, 6], opset=20)
    result = apply_rule(model, "gelu-to-tanh", reference=_wide(model))
    assert result.verification.passed and result.verification.worst_max_rel > 0


def test_gelu_to_quickgelu_measured_error(target_without):
    model = _erf_gelu("half_first")
    rule = get_rule("gelu-to-quickgelu")
    result = apply_rule(model, rule, reference=_wide(model))
    assert _ops(result.model) == ["Swish"]
    assert result.model.opset_import[0].version == 24
    measured = result.verification.worst_max_rel
    assert 1e-3 < measured <= rule.error_bound  # pointwise max 0.0203, here over max|ref| ≈ 4
    plain = apply_rule(model, rule, target_without("Swish"), reference=_wide(model))
    assert _ops(plain.model) == ["Mul", "Sigmoid", "Mul"]
    assert plain.verification.worst_max_rel == pytest.approx(measured, rel=1e-3)


# --------------------------------------------------------------------------- padding and pools


def test_pad_into_conv():
    nodes = [
        helper.make_node("Pad", ["x", "pads"], ["p"], name="pad"),
        helper.make_node("Conv", ["p", "w"], ["y"], name="conv", pads=[0, 1, 0, 1]),
    ]
    inits = {"pads": np.array([0, 0, 1, 2, 0, 0, 1, 0], np.int64), "w": _f32(4, 3, 3, 3)}
    model = _model(nodes, {"x": [1, 3, 6, 6]}, {"y": None}, inits)
    (match,) = find_matches(model, "pad-into-conv")
    assert match.data["pads"] == {"conv": [1, 3, 1, 1]}
    result = apply_rule(model, "pad-into-conv", reference=_wide(model))
    assert _ops(result.model) == ["Conv"]
    _exact(result)


def test_pad_into_conv_skips_nonzero_and_channel_padding():
    for pads, value in (([0, 0, 1, 1, 0, 0, 1, 1], 1.0), ([0, 1, 0, 0, 0, 0, 0, 0], 0.0)):
        nodes = [
            helper.make_node("Pad", ["x", "pads", "v"], ["p"], name="pad"),
            helper.make_node("Conv", ["p", "w"], ["y"], name="conv"),
        ]
        c = 3 + pads[1]
        inits = {
            "pads": np.array(pads, np.int64),
            "v": np.array(value, np.float32),
            "w": _f32(2, c, 3, 3),
        }
        model = _model(nodes, {"x": [1, 3, 6, 6]}, {"y": None}, inits)
        assert find_matches(model, "pad-into-conv") == []


def test_maxpool_ceil_to_pad_is_identical_on_negative_inputs():
    """All-negative inputs: had the padding been zeros, the edge maxima would be 0."""
    model = _unary("MaxPool", [1, 2, 8, 8], kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1)
    (match,) = find_matches(model, "maxpool-ceil-to-pad", "rk3588")
    assert match.blockers == ["node"]  # the RKNPU takes ceil_mode=0 only
    assert match.data["pads"] == [0, 0, 1, 1]
    result = apply_rule(model, "maxpool-ceil-to-pad", "rk3588", reference=_wide(model, -2, -1))
    assert not result.coverage_after.blockers
    assert result.verification.worst_max_abs == 0.0


def test_avgpool_count_include_pad_correction_map():
    model = _unary(
        "AveragePool", [1, 2, 7, 7], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]
    )
    (match,) = find_matches(model, "avgpool-count-include-pad")
    assert match.blockers == ["node"]  # count_include_pad=0 with padding: rejected on mlsoc
    result = apply_rule(model, "avgpool-count-include-pad", reference=_wide(model))
    assert _ops(result.model) == ["AveragePool", "Mul"]
    assert not result.coverage_after.blockers
    _exact(result)
    assert (
        find_matches(
            _unary("AveragePool", [1, 2, 6, 6], kernel_shape=[2, 2]), "avgpool-count-include-pad"
        )
        == []
    )


# --------------------------------------------------------------------------- resize


def _resize(scale_h: float, scale_w: float, shape=(1, 3, 4, 5), **attrs) -> onnx.ModelProto:
    attrs = {"mode": "nearest", **attrs}
    node = helper.make_node("Resize", ["x", "", "scales"], ["y"], name="resize", **attrs)
    scales = np.array([1, 1, scale_h, scale_w], np.float32)
    return _model([node], {"x": list(shape)}, {"y": None}, {"scales": scales})


def test_resize_to_supported_nearest_x3_as_depth_to_space():
    model = _resize(3, 3, coordinate_transformation_mode="asymmetric", nearest_mode="floor")
    (match,) = find_matches(model, "resize-to-supported")
    assert match.data["kind"] == "depth_to_space" and match.blockers == ["resize"]
    result = apply_rule(model, "resize-to-supported", reference=_wide(model))
    assert _ops(result.model) == ["Concat", "DepthToSpace"]
    assert not result.coverage_after.blockers
    assert result.verification.worst_max_abs == 0.0


def test_resize_to_supported_half_pixel_x3_is_replication_too():
    model = _resize(3, 3)  # half_pixel + round_prefer_floor: integer scales replicate
    result = apply_rule(model, "resize-to-supported", reference=_wide(model))
    assert result.verification.worst_max_abs == 0.0


def test_resize_to_supported_x16_as_a_chain_on_rk3588():
    asymmetric = {"coordinate_transformation_mode": "asymmetric"}
    model = _resize(16, 16, shape=(1, 2, 3, 3), nearest_mode="floor", **asymmetric)
    (match,) = find_matches(model, "resize-to-supported", "rk3588")
    assert match.data["kind"] == "steps" and len(match.data["steps"]) == 2
    result = apply_rule(model, "resize-to-supported", "rk3588", reference=_wide(model))
    assert _ops(result.model) == ["Resize", "Resize"]
    assert not result.coverage_after.blockers
    assert result.verification.worst_max_abs == 0.0


def test_resize_to_supported_gathers_a_rounding_x16_on_rk3588():
    """Rounding to nearest shifts every block by half a pixel: not a replication, so ×8 then
    Slices + Concat per axis."""
    rounding = _resize(16, 16, shape=(1, 2, 3, 3), coordinate_transformation_mode="asymmetric")
    (match,) = find_matches(rounding, "resize-to-supported", "rk3588")
    assert match.data["kind"] == "gather" and match.data["pre"] == [8, 8]
    result = apply_rule(rounding, "resize-to-supported", "rk3588", reference=_wide(rounding))
    assert not result.coverage_after.blockers
    assert result.verification.worst_max_abs == 0.0


def test_resize_to_supported_downscale_as_strided_slice():
    model = _resize(1 / 3, 1 / 3, shape=(1, 2, 9, 9), coordinate_transformation_mode="asymmetric")
    (match,) = find_matches(model, "resize-to-supported")
    assert match.data["kind"] == "slice" and match.data["steps"] == [3, 3]
    result = apply_rule(model, "resize-to-supported", reference=_wide(model))
    assert _ops(result.model) == ["Slice"]
    assert result.verification.worst_max_abs == 0.0


def test_resize_to_supported_leaves_supported_and_linear_resizes():
    assert find_matches(_resize(2, 2), "resize-to-supported") == []  # already on the MLA
    assert find_matches(_resize(3, 3, mode="linear"), "resize-to-supported", "rk3588") == []


# --------------------------------------------------------------------------- real models


@pytest.mark.slow
def test_erf_gelu_to_gelu_on_vit_tiny():
    model = load_model(shared_model("vit_tiny_patch16_224"))
    result = apply_rule(model, "erf-gelu-to-gelu")
    assert len(result.matches) == 12  # one GELU per block
    assert _ops(result.model).count("Gelu") == 12 and "Erf" not in _ops(result.model)
    assert result.verification.passed


@pytest.mark.slow
def test_softmax_to_channel_on_vit_tiny_halves_the_segments():
    model = load_model(shared_model("vit_tiny_patch16_224"))
    result = apply_rule(model, "softmax-to-channel")
    assert len(result.matches) == 12
    assert result.coverage_after.mla_segments < result.coverage_before.mla_segments
    _exact(result)


@pytest.mark.slow
def test_gemm_to_conv_on_mobilenet_v2():
    model = load_model(shared_model("mobilenet_v2"))
    result = apply_rule(model, "gemm-to-conv")
    assert len(result.coverage_after.blockers) == 1  # the reshape back to [1, 1000]
    assert result.coverage_after.mla_segments == 1
    _exact(result)


@pytest.mark.slow
def test_normalise_activations_on_paddle_detector():
    model = load_model(shared_model("ppocrv4_det"), {"x": [1, 3, 64, 64]})
    result = apply_rule(model, "normalise-activations")
    assert _ops(result.model).count("HardSwish") == 24
    assert result.verification.passed


# --------------------------------------------------------------------------- with check and fix


def test_blockers_suggest_and_fix_picks_the_replacements():
    """The blockers a match claims are what `surgery check` suggests and `surgery fix` uses."""
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("ReduceMin", ["c"], ["m"], name="rmin", axes=[1], keepdims=1),
        helper.make_node("Softmax", ["m"], ["s"], name="softmax", axis=3),
        helper.make_node("Conv", ["s", "w2"], ["y"], name="conv2"),
    ]
    inits = {"w": _f32(4, 3, 3, 3), "w2": _f32(2, 1, 1, 1)}
    model = _model(nodes, {"x": [1, 3, 6, 6]}, {"y": [1, 2, 6, 6]}, inits)
    coverage = analyze_coverage(model, "mlsoc")
    suggested = {b.name: b.suggested_rules for b in coverage.blockers}
    assert "reducemin-to-reducemax" in suggested["rmin"]
    assert "softmax-to-channel" in suggested["softmax"]
    assert coverage.mla_segments == 2
    result = fix_model(model, "mlsoc")
    assert {"reducemin-to-reducemax", "softmax-to-channel"} <= {s["rule"] for s in result.steps}
    assert result.single_elf and not result.coverage_after.blockers
