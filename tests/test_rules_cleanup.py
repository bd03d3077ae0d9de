"""Cleanup rules: fuse-batchnorm, merge-transposes, merge-reshapes, clear-reshape-allowzero,
remove-identity (CastLike), fix-input-shapes.

Each test builds a small model with onnx.helper, checks where the rule matches (and where it
must not), applies it through the engine (so the result is shape-inferred, checked and verified
against the parent with ONNX Runtime) and looks at what changed in the graph and in coverage.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from surgery.errors import SurgeryError
from surgery.model import load_model
from surgery.rules import RuleNotApplicableError, apply_rule, find_matches
from surgery.verify import ort_session, run_model
from tests.conftest import RUN_INPUTS, shared_model

RNG = np.random.default_rng(0)


def _f32(*shape: int, scale: float = 1.0) -> np.ndarray:
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def _model(
    nodes: list[onnx.NodeProto],
    inputs: dict[str, list],
    outputs: dict[str, list | None],
    inits: dict[str, np.ndarray] | None = None,
    opset: int = 17,
    ir_version: int | None = None,
) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "test",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs.items()],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in outputs.items()],
        [numpy_helper.from_array(v, n) for n, v in (inits or {}).items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = ir_version or 8
    if ir_version is not None and ir_version < 4:
        graph.input.extend(
            helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
            for t in graph.initializer
        )
    return load_model(model)


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def _blocked(result, op: str) -> list[str]:
    return [b.name for b in result.coverage_after.blockers if b.op_type == op]


def _exact(result) -> None:
    v = result.verification
    assert v.passed and v.mode == "exact"
    assert v.worst_max_abs <= 1e-5


# --------------------------------------------------------------------------- fuse-batchnorm


def _bn_params(c: int) -> dict[str, np.ndarray]:
    return {
        "scale": (RNG.uniform(0.5, 2.0, c)).astype(np.float32),
        "beta": _f32(c),
        "mean": _f32(c),
        "var": RNG.uniform(0.1, 2.0, c).astype(np.float32),
    }


def _conv_bn(bias: bool = True) -> onnx.ModelProto:
    inits = {"w": _f32(8, 3, 3, 3), **_bn_params(8)}
    conv_in = ["x", "w"]
    if bias:
        inits["b"] = _f32(8)
        conv_in.append("b")
    nodes = [
        helper.make_node("Conv", conv_in, ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node(
            "BatchNormalization", ["c", "scale", "beta", "mean", "var"], ["bn"], name="bn"
        ),
        helper.make_node("Relu", ["bn"], ["y"], name="relu"),
    ]
    return _model(nodes, {"x": [1, 3, 8, 8]}, {"y": [1, 8, 8, 8]}, inits)


def test_fuse_batchnorm_folds_into_conv_exactly():
    model = _conv_bn()
    (match,) = find_matches(model, "fuse-batchnorm")
    assert match.nodes == ["conv", "bn"]
    result = apply_rule(model, "fuse-batchnorm")
    assert _ops(result.model) == ["Conv", "Relu"]
    _exact(result)


def test_fuse_batchnorm_adds_a_bias_when_the_conv_has_none():
    result = apply_rule(_conv_bn(bias=False), "fuse-batchnorm")
    (conv,) = [n for n in result.model.graph.node if n.op_type == "Conv"]
    assert len(conv.input) == 3
    _exact(result)


def test_fuse_batchnorm_reads_constant_nodes_and_constant_subgraphs():
    """BN parameters as Constant nodes and as ConstantOfShape outputs (Caffe2 exports)."""
    c = 4
    params = _bn_params(c)
    nodes = [
        helper.make_node("Constant", [], ["scale"], value=numpy_helper.from_array(params["scale"])),
        helper.make_node("Constant", [], ["beta"], value=numpy_helper.from_array(params["beta"])),
        helper.make_node(
            "ConstantOfShape",
            ["shape"],
            ["mean"],
            value=numpy_helper.from_array(np.array([0.25], np.float32)),
        ),
        helper.make_node("Constant", [], ["var"], value=numpy_helper.from_array(params["var"])),
        helper.make_node("Conv", ["x", "w"], ["cv"], name="conv"),
        helper.make_node(
            "BatchNormalization", ["cv", "scale", "beta", "mean", "var"], ["y"], name="bn"
        ),
    ]
    inits = {"w": _f32(c, 3, 1, 1), "shape": np.array([c], np.int64)}
    model = _model(nodes, {"x": [1, 3, 5, 5]}, {"y": [1, c, 5, 5]}, inits)
    result = apply_rule(model, "fuse-batchnorm")
    assert "BatchNormalization" not in _ops(result.model)
    _exact(result)


def test_fuse_batchnorm_into_grouped_conv_transpose():
    """ConvTranspose weights are [C_in, C_out/group, k, k]: the scale goes on axis 1 per group."""
    inits = {"w": _f32(4, 3, 2, 2), **_bn_params(6)}
    nodes = [
        helper.make_node(
            "ConvTranspose", ["x", "w"], ["c"], name="deconv", strides=[2, 2], group=2
        ),
        helper.make_node(
            "BatchNormalization", ["c", "scale", "beta", "mean", "var"], ["y"], name="bn"
        ),
    ]
    model = _model(nodes, {"x": [1, 4, 3, 3]}, {"y": [1, 6, 6, 6]}, inits)
    result = apply_rule(model, "fuse-batchnorm")
    assert _ops(result.model) == ["ConvTranspose"]
    _exact(result)


def test_fuse_batchnorm_skips_a_conv_output_read_elsewhere():
    inits = {"w": _f32(4, 3, 1, 1), **_bn_params(4)}
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
        helper.make_node(
            "BatchNormalization", ["c", "scale", "beta", "mean", "var"], ["bn"], name="bn"
        ),
        helper.make_node("Add", ["c", "bn"], ["y"], name="add"),
    ]
    model = _model(nodes, {"x": [1, 3, 4, 4]}, {"y": [1, 4, 4, 4]}, inits)
    assert find_matches(model, "fuse-batchnorm") == []


def test_fuse_batchnorm_keeps_legacy_ir3_models_valid():
    """IR 3 lists initializers as graph inputs; the new weights must be listed too."""
    inits = {"w": _f32(4, 3, 3, 3), **_bn_params(4)}
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
        helper.make_node(
            "BatchNormalization", ["c", "scale", "beta", "mean", "var"], ["y"], name="bn"
        ),
    ]
    model = _model(nodes, {"x": [1, 3, 6, 6]}, {"y": [1, 4, 4, 4]}, inits, opset=9, ir_version=3)
    result = apply_rule(model, "fuse-batchnorm")
    inputs = {i.name for i in result.model.graph.input}
    assert {t.name for t in result.model.graph.initializer} <= inputs
    _exact(result)


# --------------------------------------------------------------------------- merge-transposes


def test_merge_transposes_cancelling_pair_vanishes():
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Transpose", ["r"], ["t1"], name="to_nhwc", perm=[0, 2, 3, 1]),
        helper.make_node("Transpose", ["t1"], ["t2"], name="to_nchw", perm=[0, 3, 1, 2]),
        helper.make_node("Sigmoid", ["t2"], ["y"], name="sig"),
    ]
    model = _model(nodes, {"x": [1, 4, 5, 6]}, {"y": [1, 4, 5, 6]})
    (match,) = find_matches(model, "merge-transposes")
    assert match.nodes == ["to_nhwc", "to_nchw"]
    result = apply_rule(model, "merge-transposes")
    assert _ops(result.model) == ["Relu", "Sigmoid"]
    _exact(result)


def test_merge_transposes_composes_and_frees_a_batch_moving_blocker():
    """A chain of three Transposes becomes one whose perm is the composition."""
    nodes = [
        helper.make_node("Transpose", ["x"], ["a"], name="t1", perm=[1, 0, 2, 3]),
        helper.make_node("Transpose", ["a"], ["b"], name="t2", perm=[1, 0, 3, 2]),
        helper.make_node("Transpose", ["b"], ["y"], name="t3", perm=[0, 2, 1, 3]),
    ]
    model = _model(nodes, {"x": [2, 3, 4, 5]}, {"y": [2, 5, 3, 4]})
    matches = find_matches(model, "merge-transposes")
    assert [m.nodes for m in matches] == [["t1", "t2"], ["t2", "t3"]]
    assert set(matches[0].blockers) == {"t1", "t2"}  # both move the batch axis; the result won't
    result = apply_rule(model, "merge-transposes")
    transposes = [n for n in result.model.graph.node if n.op_type == "Transpose"]
    assert len(transposes) == 1
    assert list(transposes[0].attribute[0].ints) == [0, 3, 1, 2]
    assert result.model.graph.output[0].name == "y"
    assert not result.coverage_after.blockers
    _exact(result)


def test_merge_transposes_keeps_a_shared_first_transpose():
    nodes = [
        helper.make_node("Transpose", ["x"], ["a"], name="t1", perm=[0, 2, 3, 1]),
        helper.make_node("Transpose", ["a"], ["y"], name="t2", perm=[0, 3, 1, 2]),
        helper.make_node("Relu", ["a"], ["z"], name="other_user"),
    ]
    model = _model(nodes, {"x": [1, 2, 3, 4]}, {"y": [1, 2, 3, 4], "z": [1, 3, 4, 2]})
    result = apply_rule(model, "merge-transposes")
    assert _ops(result.model).count("Transpose") == 1
    assert [o.name for o in result.model.graph.output] == ["y", "z"]
    _exact(result)


# --------------------------------------------------------------------------- merge-reshapes


def test_merge_reshapes_collapses_cvu_only_chain_into_one_mla_reshape():
    """Flatten → Unsqueeze → Unsqueeze (CVU-only ops, rank 2/3 tensors) → one 4-D Reshape."""
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
        helper.make_node("Flatten", ["c"], ["f"], name="flatten"),
        helper.make_node("Unsqueeze", ["f", "ax2"], ["u1"], name="unsq1"),
        helper.make_node("Unsqueeze", ["u1", "ax3"], ["u2"], name="unsq2"),
        helper.make_node("Conv", ["u2", "w2"], ["y"], name="head"),
    ]
    inits = {
        "w": _f32(4, 3, 1, 1),
        "ax2": np.array([2], np.int64),
        "ax3": np.array([3], np.int64),
        "w2": _f32(5, 64, 1, 1),
    }
    model = _model(nodes, {"x": [1, 3, 4, 4]}, {"y": [1, 5, 1, 1]}, inits)
    (match,) = find_matches(model, "merge-reshapes")
    assert match.nodes == ["flatten", "unsq1", "unsq2"]
    assert set(match.blockers) == {"flatten", "unsq1", "unsq2"}
    result = apply_rule(model, "merge-reshapes")
    assert _ops(result.model) == ["Conv", "Reshape", "Conv"]
    assert result.coverage_after.mla_segments == 1 and not result.coverage_after.blockers
    _exact(result)


def test_merge_reshapes_round_trip_vanishes_and_single_reshapes_stay():
    nodes = [
        helper.make_node("Reshape", ["x", "s1"], ["a"], name="r1"),
        helper.make_node("Reshape", ["a", "s2"], ["b"], name="r2"),
        helper.make_node("Relu", ["b"], ["c"], name="relu"),
        helper.make_node("Reshape", ["c", "s1"], ["y"], name="single"),
    ]
    inits = {"s1": np.array([1, 24], np.int64), "s2": np.array([1, 2, 3, 4], np.int64)}
    model = _model(nodes, {"x": [1, 2, 3, 4]}, {"y": [1, 24]}, inits)
    (match,) = find_matches(model, "merge-reshapes")
    assert match.nodes == ["r1", "r2"]
    result = apply_rule(model, "merge-reshapes")
    assert _ops(result.model) == ["Relu", "Reshape"]
    _exact(result)


# --------------------------------------------------------------------------- fix-input-shapes


def _dynamic_cnn(dims: list) -> onnx.ModelProto:
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["y"], name="relu"),
    ]
    out = [dims[0], 4, dims[2], dims[3]]
    return _model(nodes, {"x": dims}, {"y": out}, {"w": _f32(4, 3, 3, 3)})


def _allowzero_reshape(shape: list[int]) -> onnx.ModelProto:
    """Relu → Reshape(allowzero=1) → Relu, as torch's dynamo exporter writes a `view`."""
    out = [d if d else s for d, s in zip(shape, [1, 8, 4, 4], strict=True)]
    return _model(
        [
            helper.make_node("Relu", ["x"], ["a"], name="r1"),
            helper.make_node("Reshape", ["a", "shape"], ["b"], name="view", allowzero=1),
            helper.make_node("Relu", ["b"], ["y"], name="r2"),
        ],
        {"x": [1, 8, 4, 4]},
        {"y": out},
        {"shape": np.array(shape, np.int64)},
        opset=18,
    )


def test_clear_reshape_allowzero_frees_a_dynamo_view():
    model = _allowzero_reshape([1, 4, 8, 4])
    result = apply_rule(model, "clear-reshape-allowzero")
    assert result.verification.passed and result.verification.mode == "exact"
    assert "view" in {b.name for b in result.coverage_before.blockers}
    assert "view" not in {b.name for b in result.coverage_after.blockers}
    reshape = next(n for n in result.model.graph.node if n.op_type == "Reshape")
    assert all(a.name != "allowzero" or a.i == 0 for a in reshape.attribute)


def test_clear_reshape_allowzero_leaves_a_shape_with_a_zero():
    """With a 0 in the shape, allowzero decides what the Reshape means."""
    assert find_matches(_allowzero_reshape([0, 4, 8, 4]), "clear-reshape-allowzero") == []


def test_remove_identity_drops_a_castlike_to_the_same_type():
    model = _model(
        [
            helper.make_node("Relu", ["x"], ["a"], name="r1"),
            helper.make_node("Sqrt", ["a"], ["s"], name="sqrt"),
            helper.make_node("CastLike", ["s", "a"], ["y"], name="cast_like"),
        ],
        {"x": [1, 8, 4, 4]},
        {"y": [1, 8, 4, 4]},
    )
    result = apply_rule(model, "remove-identity")
    assert result.verification.passed and result.verification.mode == "exact"
    assert "CastLike" not in {n.op_type for n in result.model.graph.node}


def _split_pass_through() -> onnx.ModelProto:
    """Relu → Split(lengths [8, 0]) → Relu on the first piece → Concat with the empty piece:
    a rotary embedding whose rotary dim is the whole head."""
    return _model(
        [
            helper.make_node("Relu", ["x"], ["a"], name="r1"),
            helper.make_node("Split", ["a", "lengths"], ["rot", "rest"], name="split", axis=1),
            helper.make_node("Relu", ["rot"], ["b"], name="r2"),
            helper.make_node("Concat", ["b", "rest"], ["y"], name="join", axis=1),
        ],
        {"x": [1, 8, 4, 4]},
        {"y": [1, 8, 4, 4]},
        {"lengths": np.array([8, 0], np.int64)},
    )


def test_drop_empty_concat_inputs_drops_an_empty_split_piece():
    result = apply_rule(_split_pass_through(), "drop-empty-concat-inputs")
    assert result.verification.passed and result.verification.mode == "exact"
    join = next(n for n in result.model.graph.node if n.op_type == "Concat")
    assert list(join.input) == ["b"]


def test_remove_identity_drops_a_split_into_one_whole_piece():
    model = apply_rule(_split_pass_through(), "drop-empty-concat-inputs").model
    result = apply_rule(model, "remove-identity")
    assert result.verification.passed and result.verification.mode == "exact"
    assert "Split" not in {n.op_type for n in result.model.graph.node}


def test_a_split_whose_other_piece_is_read_stays():
    model = _model(
        [
            helper.make_node("Split", ["x", "lengths"], ["p", "q"], name="split", axis=1),
            helper.make_node("Add", ["p", "q"], ["y"], name="sum"),
        ],
        {"x": [1, 8, 4, 4]},
        {"y": [1, 4, 4, 4]},
        {"lengths": np.array([4, 4], np.int64)},
    )
    assert not any(m.nodes == ["split"] for m in find_matches(model, "remove-identity"))


@pytest.mark.parametrize(
    ("op", "extra", "inits"),
    [
        ("Pad", ["pads"], {"pads": np.zeros(8, np.int64)}),
        (
            "Slice",
            ["starts", "ends", "axes"],
            {
                "starts": np.array([0], np.int64),
                "ends": np.array([2**62], np.int64),
                "axes": np.array([2], np.int64),
            },
        ),
    ],
    ids=["zero-pad", "whole-slice"],
)
def test_remove_identity_drops_a_pad_by_zeros_and_a_whole_slice(op, extra, inits):
    """encodec's shortcuts carry reflect Pads by zeros and Slices over the whole axis."""
    attrs = {"mode": "reflect"} if op == "Pad" else {}
    model = _model(
        [
            helper.make_node("Relu", ["x"], ["a"], name="r1"),
            helper.make_node(op, ["a", *extra], ["b"], name="noop", **attrs),
            helper.make_node("Relu", ["b"], ["y"], name="r2"),
        ],
        {"x": [1, 4, 6, 6]},
        {"y": [1, 4, 6, 6]},
        inits,
        opset=13,
    )
    result = apply_rule(model, "remove-identity")
    assert result.verification.passed and result.verification.mode == "exact"
    assert op not in {n.op_type for n in result.model.graph.node}


def test_a_reversing_slice_of_the_same_shape_stays():
    model = _model(
        [helper.make_node("Slice", ["x", "s", "e", "a", "step"], ["y"], name="flip")],
        {"x": [1, 4, 6, 6]},
        {"y": [1, 4, 6, 6]},
        {
            "s": np.array([-1], np.int64),
            "e": np.array([-(2**62)], np.int64),
            "a": np.array([3], np.int64),
            "step": np.array([-1], np.int64),
        },
    )
    assert not any(m.nodes == ["flip"] for m in find_matches(model, "remove-identity"))


def test_fix_input_shapes_sets_symbolic_batch_to_one_and_says_so():
    model = _dynamic_cnn(["N", 3, 8, 8])
    (match,) = find_matches(model, "fix-input-shapes")
    assert "set to 1" in match.reason
    assert set(match.blockers) == {"conv", "relu"}  # both blocked by the dynamic shape
    result = apply_rule(model, "fix-input-shapes")
    dims = [d.dim_value for d in result.model.graph.input[0].type.tensor_type.shape.dim]
    assert dims == [1, 3, 8, 8]
    assert not result.coverage_after.blockers and not result.coverage_after.dynamic_inputs
    _exact(result)


def test_fix_input_shapes_names_the_dims_it_cannot_guess():
    model = _dynamic_cnn(["N", 3, "H", "W"])
    (match,) = find_matches(model, "fix-input-shapes")
    assert "stay dynamic" in match.reason and "H" in match.reason
    assert match.blockers == []  # H and W are still dynamic


def test_fix_input_shapes_with_given_shapes():
    """Verified here by hand: the engine draws reference inputs from the parent's signature
    (dynamic dims = 1), which no longer fits a child fixed to other sizes (see report)."""
    model = _dynamic_cnn(["N", 3, "H", "W"])
    params = {"shapes": {"x": [2, 3, 6, 5]}}
    (match,) = find_matches(model, "fix-input-shapes", params=params)
    assert set(match.blockers) == {"conv", "relu"}
    result = apply_rule(model, "fix-input-shapes", params=params, verify=False)
    assert not result.coverage_after.blockers
    x = RNG.standard_normal((2, 3, 6, 5)).astype(np.float32)
    (ref,) = run_model(ort_session(model), {"x": x}).values()
    (got,) = run_model(ort_session(result.model), {"x": x}).values()
    np.testing.assert_array_equal(ref, got)


def test_fix_input_shapes_rejects_bad_shapes_and_static_models():
    model = _dynamic_cnn(["N", 3, 8, 8])
    with pytest.raises(SurgeryError, match="fixed at 3"):
        find_matches(model, "fix-input-shapes", params={"shapes": {"x": [1, 4, 8, 8]}})
    with pytest.raises(SurgeryError, match="nope"):
        find_matches(model, "fix-input-shapes", params={"shapes": {"nope": [1, 3, 8, 8]}})
    static = _dynamic_cnn([1, 3, 8, 8])
    assert find_matches(static, "fix-input-shapes") == []
    with pytest.raises(RuleNotApplicableError):
        apply_rule(_dynamic_cnn([1, 3, "H", "W"]), "fix-input-shapes")


# --------------------------------------------------------------------------- real models


@pytest.mark.slow
@pytest.mark.parametrize("name", ["light_resnet50", "ppocr_mobile_v2_cls"])
def test_fuse_batchnorm_on_real_models(name):
    model = load_model(shared_model(name), RUN_INPUTS.get(name))
    bns = _ops(model).count("BatchNormalization")
    result = apply_rule(model, "fuse-batchnorm")
    assert len(result.matches) == bns  # every BN in these models follows a Conv
    assert "BatchNormalization" not in _ops(result.model)
    assert result.verification.passed


@pytest.mark.slow
def test_fix_input_shapes_on_paddle_detector():
    """ppocrv4_det: batch/H/W dynamic; with shapes every dynamic-shape blocker goes."""
    model = load_model(shared_model("ppocrv4_det"))
    params = {"shapes": {"x": [1, 3, 64, 64]}}
    (match,) = find_matches(model, "fix-input-shapes", params=params)
    result = apply_rule(model, "fix-input-shapes", params=params, verify=False)
    assert not result.coverage_after.dynamic_inputs
    assert len(result.coverage_after.blockers) < len(result.coverage_before.blockers)
    assert len(match.blockers) == len(result.coverage_before.blockers) - len(
        result.coverage_after.blockers
    )
