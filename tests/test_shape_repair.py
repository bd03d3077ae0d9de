"""check's shape repair: where shapes wait for folding, the computed constants are evaluated
and only the nodes after them inferred again, and the model is analysed as the fold would
leave it. test_check_fold_shortcut holds check's report (which takes this path) equal to the
fold's on these models and the shared ones; here, what the repair itself does and refuses."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import surgery.shape_repair
from surgery.check import check_model
from surgery.coverage import constant_tensors
from surgery.fold import waits_for_folding
from surgery.model import open_model
from surgery.shape_repair import repair_shapes
from surgery.targets import resolve_target

CH = 8


def _const(name: str, values, dtype=np.int64) -> onnx.NodeProto:
    return helper.make_node(
        "Constant", [], [name], value=numpy_helper.from_array(np.array(values, dtype), name)
    )


def paddle_flatten(opset: int = 11) -> onnx.ModelProto:
    """Conv → GlobalAveragePool → Paddle's flatten (Shape → Cast int32 → Slice → Cast →
    Concat with a Cast int32 constant → Reshape-5) → MatMul → Softmax: a Reshape before
    opset 14 never reads a propagated target, so every shape after it is unknown."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("GlobalAveragePool", ["c"], ["p"]),
        helper.make_node("Shape", ["p"], ["s"]),
        helper.make_node("Cast", ["s"], ["s32"], to=TensorProto.INT32),
        _const("start", [0]),
        _const("end", [1]),
        helper.make_node("Slice", ["s32", "start", "end"], ["batch32"]),
        helper.make_node("Cast", ["batch32"], ["batch"], to=TensorProto.INT64),
        _const("width32", [CH], np.int32),
        helper.make_node("Cast", ["width32"], ["width"], to=TensorProto.INT64),
        helper.make_node("Concat", ["batch", "width"], ["target"], axis=0),
        helper.make_node("Reshape", ["p", "target"], ["flat"]),
        helper.make_node("MatMul", ["flat", "fc"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["y"], axis=1),
    ]
    graph = helper.make_graph(
        nodes,
        "paddle_flatten",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [
            numpy_helper.from_array(rng.normal(size=(CH, 3, 3, 3)).astype(np.float32), "w"),
            numpy_helper.from_array(rng.normal(size=(CH, 2)).astype(np.float32), "fc"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def two_rounds() -> onnx.ModelProto:
    """A second Reshape whose target is computed from the shape after the first: its shape
    is only known after the first one's is (two repair rounds, as two fold rounds)."""
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"]),
        helper.make_node("Shape", ["c"], ["s"]),
        _const("i0", 0),
        _const("i1", 1),
        helper.make_node("Gather", ["s", "i0"], ["b"], axis=0),
        helper.make_node("Gather", ["s", "i1"], ["ch"], axis=0),
        _const("minus1", [-1]),
        helper.make_node("Unsqueeze", ["b"], ["b1"], axes=[0]),
        helper.make_node("Unsqueeze", ["ch"], ["ch1"], axes=[0]),
        helper.make_node("Concat", ["b1", "ch1", "minus1"], ["t1"], axis=0),
        helper.make_node("Reshape", ["c", "t1"], ["r1"]),  # [1, 4, 36]
        helper.make_node("Shape", ["r1"], ["s2"]),
        helper.make_node("Gather", ["s2", "i1"], ["d"], axis=0),
        helper.make_node("Unsqueeze", ["d"], ["d1"], axes=[0]),
        _const("one", [1]),
        helper.make_node("Concat", ["b1", "d1", "minus1", "one"], ["t2"], axis=0),
        helper.make_node("Reshape", ["r1", "t2"], ["r2"]),  # [1, 4, 36, 1]
        helper.make_node("Relu", ["r2"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "two_rounds",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.ones((4, 3, 1, 1), np.float32), "w")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 12)])


def computed_constant_operand() -> onnx.ModelProto:
    """An Add whose operand is ConstantOfShape of a computed shape: inference leaves that
    constant's shape unknown, folding gives it its value's."""
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"]),
        helper.make_node("Shape", ["c"], ["s"]),
        helper.make_node("Cast", ["s"], ["s32"], to=TensorProto.INT32),
        helper.make_node("Cast", ["s32"], ["s64"], to=TensorProto.INT64),
        helper.make_node(
            "ConstantOfShape",
            ["s64"],
            ["bias"],
            value=numpy_helper.from_array(np.array([0.5], np.float32)),
        ),
        helper.make_node("Add", ["c", "bias"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "computed_constant_operand",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.ones((4, 3, 1, 1), np.float32), "w")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])


def resize_to_computed_size() -> onnx.ModelProto:
    """An FPN-style upsample at opset 11: Resize to the spatial size of another map, taken
    with Shape → Slice and joined to constant N, C (`F.interpolate(size=y.shape[-2:])`); the
    Resize-11 output, and the Add and Conv after it, have unknown shapes until folded."""
    rng = np.random.default_rng(1)
    nodes = [
        helper.make_node("Conv", ["x", "w_down"], ["small"], strides=[2, 2]),
        helper.make_node("Shape", ["x"], ["s"]),
        _const("hw_start", [2]),
        _const("hw_end", [4]),
        helper.make_node("Slice", ["s", "hw_start", "hw_end"], ["hw"]),
        _const("nc", [1, 3]),
        helper.make_node("Concat", ["nc", "hw"], ["size"], axis=0),
        _const("roi", [], np.float32),
        _const("scales", [], np.float32),
        helper.make_node("Resize", ["small", "roi", "scales", "size"], ["up"], mode="nearest"),
        helper.make_node("Add", ["up", "x"], ["sum"]),
        helper.make_node("Conv", ["sum", "w_out"], ["y"], pads=[1, 1, 1, 1]),
    ]
    graph = helper.make_graph(
        nodes,
        "resize_to_computed_size",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [
            numpy_helper.from_array(rng.normal(size=(3, 3, 1, 1)).astype(np.float32), "w_down"),
            numpy_helper.from_array(rng.normal(size=(4, 3, 3, 3)).astype(np.float32), "w_out"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])


def run_time_weight_before_flatten() -> onnx.ModelProto:
    """`paddle_flatten` whose Conv weight is a graph input: a blocker that waits for a constant
    operand folding cannot give (fold-constants must not claim it, on either path)."""
    model = paddle_flatten()
    model.graph.input.append(helper.make_tensor_value_info("wx", TensorProto.FLOAT, [CH, 3, 3, 3]))
    model.graph.node[0].input[1] = "wx"
    return model


def custom_op_after_flatten() -> onnx.ModelProto:
    """The flatten of `paddle_flatten`, then a custom op: the repair leaves it to the fold."""
    model = paddle_flatten()
    model.graph.node[-1].CopyFrom(helper.make_node("Opaque", ["logits"], ["y"], domain="custom"))
    model.opset_import.append(helper.make_opsetid("custom", 1))
    return model


def unsorted_flatten() -> onnx.ModelProto:
    """`paddle_flatten` with its nodes stored in reverse order: the repair leaves it to the
    fold (the view it leaves forgets readers, which only a stored topological order keeps
    consistent)."""
    model = paddle_flatten()
    nodes = list(reversed(model.graph.node))
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model


REPAIRED = {
    "paddle_flatten": paddle_flatten,
    "two_rounds": two_rounds,
    "computed_constant_operand": computed_constant_operand,
    "resize_to_computed_size": resize_to_computed_size,
    "run_time_weight_before_flatten": run_time_weight_before_flatten,
}


def _repair(model: onnx.ModelProto):
    loaded, view = open_model(model)
    constants = constant_tensors(view)
    assert waits_for_folding(loaded, view, resolve_target("mlsoc"), constants, None)
    return loaded, view, repair_shapes(loaded, view, constants)


def test_every_shape_is_static_after_the_repair():
    for build in REPAIRED.values():
        _, view, constants = _repair(build())
        assert constants is not None, build.__name__
        _, foldable = constants
        for idx, outs in enumerate(view.node_outputs):
            if not foldable[idx]:
                assert all(view.tensor(t).is_static for t in outs), (build.__name__, idx)


def test_the_repaired_shapes_are_the_ones_onnx_runtime_computes():
    import onnxruntime as ort

    model = two_rounds()
    _, view, constants = _repair(model)
    assert constants is not None
    outs = ["r1", "r2", "y"]
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.extend(helper.make_empty_tensor_value_info(t) for t in outs[:2])
    session = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.zeros((1, 3, 6, 6), np.float32)
    got = dict(
        zip([o.name for o in session.get_outputs()], session.run(None, {"x": x}), strict=True)
    )
    for t in outs:
        assert view.tensor(t).shape == got[t].shape, t


def test_the_view_reads_the_computed_reshape_target_as_folding_would():
    _, view, constants = _repair(paddle_flatten())
    assert constants is not None
    assert "target" in view.computed
    np.testing.assert_array_equal(view.constant_value("target"), [1, CH])


def test_a_computed_constant_operand_gets_the_type_of_its_value():
    _, view, constants = _repair(computed_constant_operand())
    assert constants is not None
    bias = view.tensor("bias")
    assert bias.shape == (1, 4, 4, 4) and bias.elem_type == TensorProto.FLOAT


def test_a_custom_op_leaves_the_repair_to_the_fold():
    _, _, constants = _repair(custom_op_after_flatten())
    assert constants is None


def test_a_graph_stored_out_of_order_leaves_the_repair_to_the_fold():
    _, _, constants = _repair(unsorted_flatten())
    assert constants is None


def test_check_places_the_nodes_after_a_repaired_reshape_by_their_known_ranks():
    report = check_model(paddle_flatten(), "mlsoc")
    codes = {r.code for p in report.placements for r in p.reasons}
    assert "rank_unknown" not in codes
    placed = {p.name: p for p in report.placements}
    assert placed["Reshape_11"].reasons[0].code == "rank"  # rank 2, known: the CVU runs it
    assert "'flat' is rank 2" in placed["MatMul_12"].reasons[0].message


def test_check_on_a_model_proto_leaves_the_callers_model_unchanged():
    model = paddle_flatten()
    before = model.SerializeToString()
    check_model(model, "mlsoc")
    assert model.SerializeToString() == before


def test_the_repaired_analysis_is_freed_without_the_garbage_collector():
    """No reference cycle holds the view (and with it every node and type of the model): the
    check pauses the collector, so a cycle would cost a collection over all of it."""
    import gc

    from surgery.graph import GraphView

    check_model(paddle_flatten(), "mlsoc")  # warm: imports, schemas
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        check_model(paddle_flatten(), "mlsoc")
        gc.collect()
        nodes = len(paddle_flatten().graph.node)  # the evaluator's own small models may cycle
        leaked = [
            o
            for o in gc.garbage
            if isinstance(o, GraphView)
            or (isinstance(o, onnx.ModelProto) and len(o.graph.node) == nodes)
        ]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if was:
            gc.enable()
    assert leaked == []


def test_a_computed_constant_known_to_be_large_is_not_evaluated_for_its_value():
    """`constant_value` of a computed constant whose static type is over the size asked for
    is None without evaluating it (a weight made by ConstantOfShape, light_resnet50's way)."""
    nodes = [
        _const("shape", [1, 8, 64, 64]),
        helper.make_node(
            "ConstantOfShape",
            ["shape"],
            ["big"],
            value=numpy_helper.from_array(np.array([1.0], np.float32)),
        ),
        _const("small_shape", [1, 8, 1, 1]),
        helper.make_node(
            "ConstantOfShape",
            ["small_shape"],
            ["small"],
            value=numpy_helper.from_array(np.array([2.0], np.float32)),
        ),
        helper.make_node("Add", ["x", "big"], ["a"]),
        helper.make_node("Mul", ["a", "small"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "computed_weights",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 64, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    _, view = open_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    asked: list[str] = []

    def evaluate(name: str) -> np.ndarray:
        asked.append(name)
        return np.full((1, 8, 1, 1), 2.0, np.float32)

    view.read_computed_constants(["big", "small"], evaluate)
    assert view.constant_value("big") is None
    np.testing.assert_array_equal(view.constant_value("small"), np.full((1, 8, 1, 1), 2.0))
    view.constant_value("small")
    assert asked == ["small"]


def test_fold_constants_does_not_claim_an_operand_computed_from_run_time_data():
    """At opset 14 the flatten resolves without folding (plain path); the Conv whose weight is
    a graph input waits for a constant folding cannot make, so no fold-constants for it."""
    model = run_time_weight_before_flatten()
    model.opset_import[0].version = 14
    report = check_model(model, "mlsoc")
    conv = next(p for p in report.placements if p.op_type == "Conv")
    assert any(r.code == "non_constant_input" for r in conv.reasons)
    assert "fold-constants" not in conv.suggested_rules


def _flatten_then_regroup() -> onnx.ModelProto:
    """`paddle_flatten` whose logits are reshaped again to a target cast from a constant:
    the nodes after the flatten read two computed constants, both targets."""
    model = paddle_flatten()
    graph = model.graph
    graph.node[-1].input[0] = "grouped"
    graph.node.insert(len(graph.node) - 1, _const("groups32", [1, 2, 1], np.int32))
    graph.node.insert(
        len(graph.node) - 1,
        helper.make_node("Cast", ["groups32"], ["groups"], to=TensorProto.INT64),
    )
    graph.node.insert(
        len(graph.node) - 1, helper.make_node("Reshape", ["logits", "groups"], ["grouped"])
    )
    return model


def test_the_constants_the_tail_reads_are_evaluated_in_one_run(monkeypatch):
    calls = []
    evaluate = surgery.shape_repair.evaluate_constants

    def counting(view, names, *args, **kwargs):
        calls.append(list(names))
        return evaluate(view, names, *args, **kwargs)

    monkeypatch.setattr(surgery.shape_repair, "evaluate_constants", counting)
    loaded, view, repaired = _repair(_flatten_then_regroup())
    assert repaired is not None
    assert calls == [["target", "groups"]]
    assert view.tensor("y").shape == (1, 2, 1)
