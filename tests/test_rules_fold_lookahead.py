"""fold-constants folds shape arithmetic until inference knows every shape, and `surgery fix`
keeps a cleanup that makes coverage worse by itself when fixing on from it ends better (also
two such cleanups in a row)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from surgery.check import check_model
from surgery.coverage import analyze_coverage
from surgery.graph import GraphView
from surgery.model import load_model
from surgery.rules.engine import apply_rule
from surgery.rules.fix import fix_model


def _constant(name: str, value: np.ndarray) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(value))


def _flatten_like_paddle(x: str, out: str, tail: list[int]) -> list[onnx.NodeProto]:
    """Reshape(x, Concat(Shape(x)[0:2], tail)) with Constant-node operands, as paddle2onnx
    writes flatten: ONNX's data propagation leaves the result's rank unknown."""
    return [
        helper.make_node("Shape", [x], [f"{out}_shape"]),
        helper.make_node("Slice", [f"{out}_shape", "zero", "two", "zero"], [f"{out}_lead"]),
        _constant(f"{out}_tail", np.array(tail, np.int64)),
        helper.make_node("Concat", [f"{out}_lead", f"{out}_tail"], [f"{out}_target"], axis=0),
        helper.make_node("Reshape", [x, f"{out}_target"], [out]),
    ]


def _tokens_model() -> onnx.ModelProto:
    """Conv → flatten to tokens [1, 8, 16] → Transpose → MatMul → Transpose → back to
    [1, 8, 16, 1] → Conv, every reshape target computed from Shape."""
    rng = np.random.default_rng(0)
    weights = [
        numpy_helper.from_array(rng.normal(0, 0.5, (8, 3, 1, 1)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.normal(0, 0.5, (8, 8)).astype(np.float32), "wm"),
        numpy_helper.from_array(rng.normal(0, 0.5, (4, 8, 1, 1)).astype(np.float32), "w2"),
    ]
    nodes = [
        _constant("zero", np.array([0], np.int64)),
        _constant("two", np.array([2], np.int64)),
        helper.make_node("Conv", ["x", "w1"], ["a"]),
        *_flatten_like_paddle("a", "tokens", [-1]),
        helper.make_node("Transpose", ["tokens"], ["t"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["t", "wm"], ["m"]),
        helper.make_node("Transpose", ["m"], ["mt"], perm=[0, 2, 1]),
        *_flatten_like_paddle("mt", "map", [-1, 1]),
        helper.make_node("Conv", ["map", "w2"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "tokens",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        weights,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 12)])


def test_shape_inference_alone_leaves_the_token_ranks_unknown() -> None:
    view = GraphView(load_model(_tokens_model()))
    assert view.tensor("tokens").shape is None
    assert view.tensor("map").shape is None


def test_fold_constants_folds_shape_arithmetic_that_needs_reinference() -> None:
    folded = apply_rule(load_model(_tokens_model()), "fold-constants", "mlsoc").model
    view = GraphView(folded)
    assert "Shape" not in view.op_types
    assert view.tensor("map").shape == (1, 8, 16, 1)
    assert view.tensor("y").shape == (1, 4, 16, 1)


def test_fix_keeps_a_fold_that_pays_off_in_later_steps() -> None:
    result = fix_model(load_model(_tokens_model()), "mlsoc")
    fold = next(s for s in result.steps if s["rule"] == "fold-constants")
    assert "look_ahead" in fold
    assert result.coverage_after.mla_segments == 1
    assert not result.coverage_after.blockers


def test_fix_without_look_ahead_stops_at_the_unknown_ranks() -> None:
    result = fix_model(load_model(_tokens_model()), "mlsoc", look_ahead=False)
    assert "fold-constants" not in [s["rule"] for s in result.steps]
    assert result.coverage_after.blockers


def _lite_mla_pad_model() -> onnx.ModelProto:
    """Conv → F.pad(v, (0, 1), value=1) as torch exports it (the pads computed by
    ConstantOfShape → Concat → Reshape → reversing Slice → Transpose → Reshape → Cast, as in
    EfficientViT's LiteMLA) → Conv → Reshape to a constant shape → Conv. Until folded, the
    Pad's output shape is unknown, and so is everything up to the Reshape."""
    rng = np.random.default_rng(0)
    weights = [
        numpy_helper.from_array(rng.normal(0, 0.5, (4, 3, 1, 1)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.normal(0, 0.5, (4, 4, 1, 1)).astype(np.float32), "w2"),
        numpy_helper.from_array(rng.normal(0, 0.5, (4, 4, 1, 1)).astype(np.float32), "w3"),
        numpy_helper.from_array(np.array([1, 4, 4, 5], np.int64), "back"),
    ]
    i64 = np.int64
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["v"]),
        _constant("six", np.array([6], i64)),
        helper.make_node(
            "ConstantOfShape", ["six"], ["zeros"], value=numpy_helper.from_array(np.array([0], i64))
        ),
        _constant("last", np.array([0, 1], i64)),
        helper.make_node("Concat", ["last", "zeros"], ["p1"], axis=0),
        _constant("pairs", np.array([-1, 2], i64)),
        helper.make_node("Reshape", ["p1", "pairs"], ["p2"]),
        _constant("start", np.array([-1], i64)),
        _constant("end", np.array([-(2**63) + 1], i64)),
        _constant("axis", np.array([0], i64)),
        _constant("step", np.array([-1], i64)),
        helper.make_node("Slice", ["p2", "start", "end", "axis", "step"], ["p3"]),
        helper.make_node("Transpose", ["p3"], ["p4"], perm=[1, 0]),
        _constant("flat", np.array([-1], i64)),
        helper.make_node("Reshape", ["p4", "flat"], ["p5"]),
        helper.make_node("Cast", ["p5"], ["pads"], to=TensorProto.INT64),
        _constant("one", np.array(1.0, np.float32)),
        helper.make_node("Pad", ["v", "pads", "one"], ["padded"], mode="constant"),
        helper.make_node("Conv", ["padded", "w2"], ["c"]),
        helper.make_node("Reshape", ["c", "back"], ["r"]),
        helper.make_node("Conv", ["r", "w3"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "lite_mla_pad",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        weights,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def test_fix_folds_computed_pads_and_joins_a_pad_with_ones() -> None:
    """Folding leaves a Pad with value 1, which the MLA rejects; pad-to-concat makes it data
    movement, so the fold pays off and the model is one segment."""
    model = load_model(_lite_mla_pad_model())
    result = fix_model(model, "mlsoc")
    rules = [s["rule"] for s in result.steps]
    assert "fold-constants" in rules and "pad-to-concat" in rules
    assert result.coverage_before.mla_segments == 2
    assert result.coverage_after.mla_segments == 1 and not result.coverage_after.blockers


def test_without_pad_to_concat_the_pad_with_ones_splits_the_model() -> None:
    result = fix_model(load_model(_lite_mla_pad_model()), "mlsoc", skip=["pad-to-concat"])
    assert result.coverage_after.mla_segments == 2


def _deep_shape_chain(levels: int = 12) -> onnx.ModelProto:
    """Conv, then `levels` reshapes each computed from the Shape of the one before (a Swin-T's
    window padding chains its shapes through all twelve blocks like this): every level needs one
    fold and one re-inference before the next can fold."""
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.normal(0, 0.5, (8, 3, 1, 1)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.normal(0, 0.5, (4, 8, 1, 1)).astype(np.float32), "w2")
    nodes = [
        _constant("zero", np.array([0], np.int64)),
        _constant("two", np.array([2], np.int64)),
        helper.make_node("Conv", ["x", "w1"], ["level0"]),
    ]
    for k in range(1, levels + 1):
        tail = [-1] if k % 2 else [-1, 1]
        nodes += _flatten_like_paddle(f"level{k - 1}", f"level{k}", tail)
    nodes.append(helper.make_node("Conv", [f"level{levels}", "w2"], ["y"]))
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [w1, w2],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 12)])


def test_fold_constants_follows_a_shape_chain_deeper_than_eight_levels() -> None:
    folded = apply_rule(load_model(_deep_shape_chain(12)), "fold-constants", "mlsoc").model
    view = GraphView(folded)
    assert "Shape" not in view.op_types
    assert view.tensor("y").shape == (1, 4, 16, 1)


def _unknown_until_folded() -> onnx.ModelProto:
    """Conv → a reshape whose target is shape arithmetic (rank unknown until folded) → Conv →
    Cos (a host op on mlsoc) → Conv. Unfolded, only the first Conv has known shapes: one MLA
    "segment" of one node; folded, the three Convs run on the MLA around the host Cos."""
    rng = np.random.default_rng(0)
    weights = [
        numpy_helper.from_array(rng.normal(0, 0.5, (8, 3, 1, 1)).astype(np.float32), f"w{k}")
        if k == 1
        else numpy_helper.from_array(rng.normal(0, 0.5, (8, 8, 1, 1)).astype(np.float32), f"w{k}")
        for k in (1, 2, 3)
    ]
    nodes = [
        _constant("zero", np.array([0], np.int64)),
        _constant("two", np.array([2], np.int64)),
        helper.make_node("Conv", ["x", "w1"], ["a"]),
        *_flatten_like_paddle("a", "map", [-1, 1]),
        helper.make_node("Conv", ["map", "w2"], ["b"]),
        helper.make_node("Cos", ["b"], ["c"]),
        helper.make_node("Conv", ["c", "w3"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "unknown",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        weights,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 12)])


def test_fix_keeps_a_fold_that_makes_the_shapes_known_even_with_more_segments() -> None:
    model = load_model(_unknown_until_folded())
    before = analyze_coverage(model, "mlsoc", suggest=False)
    assert before.mla_segments == 1 and before.macs_unknown_nodes == 2
    result = fix_model(model, "mlsoc")
    assert "fold-constants" in [s["rule"] for s in result.steps]
    after = result.coverage_after
    assert after.macs_unknown_nodes == 0
    assert after.mla_segments == 2  # the Cos between the Convs is a host op on mlsoc


def test_check_counts_the_segments_of_the_folded_model() -> None:
    """The quantizer folds before compiling, so check does too where shapes wait for it."""
    report = check_model(load_model(_unknown_until_folded()), "mlsoc", suggest=False)
    assert report.mla_segments == 2 and report.macs_unknown_nodes == 0


def _resize_to_computed_size() -> onnx.ModelProto:
    """Conv → Resize whose sizes are Concat(Shape(x)[0:2], [8, 8]) (torchvision's LR-ASPP and
    DeepLabV3 write F.interpolate(size=...) so) → Conv. Check places the Resize on the MLA as if
    the sizes were known; the model is one segment with no blockers before any rewrite."""
    rng = np.random.default_rng(0)
    weights = [
        numpy_helper.from_array(rng.normal(0, 0.5, (8, 3, 1, 1)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.normal(0, 0.5, (4, 8, 1, 1)).astype(np.float32), "w2"),
        numpy_helper.from_array(np.array([8, 8], np.int64), "hw"),
    ]
    nodes = [
        _constant("zero", np.array([0], np.int64)),
        _constant("two", np.array([2], np.int64)),
        helper.make_node("Conv", ["x", "w1"], ["a"]),
        helper.make_node("Shape", ["a"], ["a_shape"]),
        helper.make_node("Slice", ["a_shape", "zero", "two", "zero"], ["a_lead"]),
        helper.make_node("Concat", ["a_lead", "hw"], ["sizes"], axis=0),
        helper.make_node("Resize", ["a", "", "", "sizes"], ["up"], mode="nearest"),
        helper.make_node("Conv", ["up", "w2"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "resize",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        weights,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def test_fix_folds_the_constants_of_a_model_that_is_already_one_segment() -> None:
    model = load_model(_resize_to_computed_size())
    before = check_model(model, "mlsoc", suggest=False)
    assert before.single_elf and not before.blockers
    result = fix_model(model, "mlsoc")
    assert [s["rule"] for s in result.steps] == ["fold-constants"]
    assert "Shape" not in GraphView(result.model).op_types
    assert result.coverage_after.single_elf


def _masked_attention_model() -> onnx.ModelProto:
    """The tokens model with attention in the middle as torch's sdpa exports it: a −inf mask
    from a run-time input added to the scores, and the Where(IsNaN(p), 0, p) guard after the
    Softmax. Folding the shapes (worse by itself) comes first; then dropping the guard, which
    adds the mask's host pre-stage (worse by itself too), and only then the lift."""
    rng = np.random.default_rng(0)

    def weight(name: str, *shape: int) -> onnx.TensorProto:
        return numpy_helper.from_array(rng.normal(0, 0.5, shape).astype(np.float32), name)

    weights = [
        weight("w1", 8, 3, 1, 1),
        *(weight(f"w{p}", 8, 8) for p in "qkv"),
        weight("w2", 4, 8, 1, 1),
        numpy_helper.from_array(np.array(0, np.float32), "f0"),
        numpy_helper.from_array(np.array(-np.inf, np.float32), "ninf"),
        numpy_helper.from_array(np.array([1], np.int64), "ax1"),
    ]
    nodes = [
        _constant("zero", np.array([0], np.int64)),
        _constant("two", np.array([2], np.int64)),
        helper.make_node("Conv", ["x", "w1"], ["a"]),
        *_flatten_like_paddle("a", "tokens", [-1]),
        helper.make_node("Transpose", ["tokens"], ["t"], perm=[0, 2, 1]),
        *(helper.make_node("MatMul", ["t", f"w{p}"], [p]) for p in "qkv"),
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "kt"], ["scores"]),
        helper.make_node("Equal", ["keep", "f0"], ["masked"]),
        helper.make_node("Where", ["masked", "ninf", "f0"], ["bias"]),
        helper.make_node("Unsqueeze", ["bias", "ax1"], ["bias3"]),
        helper.make_node("Add", ["scores", "bias3"], ["biased"]),
        helper.make_node("Softmax", ["biased"], ["p"], axis=-1),
        helper.make_node("IsNaN", ["p"], ["nan"]),
        helper.make_node("Where", ["nan", "f0", "p"], ["guarded"]),
        helper.make_node("MatMul", ["guarded", "v"], ["o"]),
        helper.make_node("Transpose", ["o"], ["ot"], perm=[0, 2, 1]),
        *_flatten_like_paddle("ot", "map", [-1, 1]),
        helper.make_node("Conv", ["map", "w2"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "attention",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4, 4]),
            helper.make_tensor_value_info("keep", TensorProto.FLOAT, [1, 16]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        weights,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def test_a_look_ahead_branch_looks_ahead_again() -> None:
    result = fix_model(load_model(_masked_attention_model()), "mlsoc")
    assert result.coverage_after.mla_segments == 1
    applied = [step["rule"] for step in result.steps]
    assert applied[:2] == ["fold-constants", "drop-softmax-nan-guard"]


def _shared_weight_through_identities(uses: int = 3) -> onnx.ModelProto:
    """One weight read by `uses` MatMuls, each through an Identity of it (how torch exports a
    parameter shared across layers, as ALBERT's are)."""
    weight = numpy_helper.from_array(
        np.random.default_rng(0).normal(0, 0.1, (16, 16)).astype(np.float32), "shared"
    )
    nodes = [
        helper.make_node(
            "Constant", [], ["zero"], value=numpy_helper.from_array(np.zeros(1, np.float32))
        )
    ]
    current = "x"
    for k in range(uses):
        nodes += [
            helper.make_node("Identity", ["shared"], [f"w{k}"]),
            helper.make_node("MatMul", [current, f"w{k}"], [f"h{k}"]),
        ]
        current = f"h{k}"
    nodes.append(helper.make_node("Add", [current, "zero"], ["y"]))
    graph = helper.make_graph(
        nodes,
        "shared",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 4, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [weight],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_fold_constants_keeps_one_copy_of_a_weight_shared_through_identities() -> None:
    step = apply_rule(load_model(_shared_weight_through_identities()), "fold-constants")
    weights = [t for t in step.model.graph.initializer if list(t.dims) == [16, 16]]
    assert len(weights) == 1
    assert [n.input[1] for n in step.model.graph.node if n.op_type == "MatMul"] == [
        weights[0].name
    ] * 3


def _tokens_through_a_shared_linear(uses: int = 3) -> onnx.ModelProto:
    """Tokens [1, 8, 512] through `uses` MatMuls by one shared [512, 512] weight (1 MB),
    each with a Relu after it: ALBERT's shared layers in miniature."""
    weight = numpy_helper.from_array(
        np.random.default_rng(1).normal(0, 0.05, (512, 512)).astype(np.float32), "shared"
    )
    nodes, current = [], "x"
    for k in range(uses):
        nodes += [
            helper.make_node("MatMul", [current, "shared"], [f"m{k}"]),
            helper.make_node("Relu", [f"m{k}"], [f"h{k}"]),
        ]
        current = f"h{k}"
    graph = helper.make_graph(
        nodes,
        "shared_linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 512])],
        [helper.make_tensor_value_info(current, TensorProto.FLOAT, None)],
        [weight],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_weight_shared_by_several_layers_stays_one_weight_through_fix() -> None:
    result = fix_model(load_model(_tokens_through_a_shared_linear()), "mlsoc")
    assert result.coverage_after.mla_segments == 1
    big = [t for t in result.model.graph.initializer if np.prod(t.dims) == 512 * 512]
    assert len(big) == 1
