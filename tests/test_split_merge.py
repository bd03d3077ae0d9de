"""Split and merge: closed cuts, collisions, opsets, and exact split→(edit)→merge round trips."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

from server.cli import app
from surgery import edit, examples
from surgery.coverage import PLACEMENT_METADATA_KEY
from surgery.model import load_model
from surgery.split import SplitError, merge_models, split_model
from surgery.verify import run_model, verify_models
from tests.conftest import shared_model
from tests.test_rules_structure import group_norm_then_conv

runner = CliRunner()


def _residual() -> onnx.ModelProto:
    """x → Conv(c1) → Relu(r1) → Conv(c2) → Relu(r2) → Add(r1, r2) → y: a skip connection."""
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((4, 4, 3, 3)).astype(np.float32), "w2")
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("Add", ["r1", "r2"], ["y"], name="add"),
    ]
    graph = helper.make_graph(
        nodes,
        "residual",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        [w1, w2],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return load_model(model)


def _unary(op: str, x: str, y: str, opset: int = 17, **attrs) -> onnx.ModelProto:
    """One-node model x → op → y whose node and internal names collide with its twin's."""
    graph = helper.make_graph(
        [
            helper.make_node(op, [x], ["t"], name="n", **attrs),
            helper.make_node("Neg", ["t"], [y], name="neg"),
        ],
        "g",
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info(y, TensorProto.FLOAT, [2, 3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return load_model(model)


def _round_trip(model: onnx.ModelProto, cut: list[str]) -> onnx.ModelProto:
    inits = {t.name for t in model.graph.initializer}
    inputs = [i.name for i in model.graph.input if i.name not in inits]
    outputs = [o.name for o in model.graph.output]
    head = split_model(model, inputs, cut)
    tail = split_model(model, cut, outputs)
    return merge_models(head, tail, [(t, t) for t in cut])


def _exact(a: onnx.ModelProto, b: onnx.ModelProto) -> None:
    result = verify_models(a, b, exact=True)
    assert result.passed, [o.to_dict() for o in result.outputs]
    assert all(o.max_abs == 0.0 for o in result.outputs)


def test_split_extracts_the_subgraph_with_its_weights():
    model = examples.yolo_head()
    head = split_model(model, ["images"], ["conv_26_out", "conv_31_out"])
    onnx.checker.check_model(head, full_check=True)
    assert [o.name for o in head.graph.output] == ["conv_26_out", "conv_31_out"]
    dims = [d.dim_value for d in head.graph.output[0].type.tensor_type.shape.dim]
    assert dims == [1, 8, 16, 16]
    assert head.opset_import[0].version == 17 and head.ir_version == 8
    reads = {t for n in head.graph.node for t in n.input}
    assert {t.name for t in head.graph.initializer} <= reads
    ref = run_model(model, {"images": np.ones((1, 3, 64, 64), np.float32)})
    assert ref  # the original still runs: split never modifies it


def test_split_merge_round_trip_is_exact_on_fixtures():
    _exact(examples.yolo_head(), _round_trip(examples.yolo_head(), ["conv_26_out", "conv_31_out"]))
    _exact(examples.plain_cnn(), _round_trip(examples.plain_cnn(), ["maxpool_9_out"]))
    _exact(_residual(), _round_trip(_residual(), ["r1", "r2"]))


def test_split_keeps_output_shapes_inference_alone_cannot_find_again():
    """After a torch GroupNorm (Reshape back to Shape(x)), ONNX inference does not find the
    shapes again; the checker refuses a graph output without one."""
    model = group_norm_then_conv()
    tail = split_model(model, ["c"], ["y"])
    dims = [d.dim_value for d in tail.graph.output[0].type.tensor_type.shape.dim]
    assert dims == [1, 8, 256]
    feed = {"x": np.random.default_rng(1).standard_normal((1, 3, 16, 16)).astype(np.float32)}
    c = run_model(split_model(model, ["x"], ["c"]), feed)["c"]
    np.testing.assert_array_equal(run_model(tail, {"c": c})["y"], run_model(model, feed)["y"])


def test_split_does_not_modify_its_input():
    model = examples.yolo_head()
    before = model.SerializeToString()
    split_model(model, ["images"], ["conv_26_out"])
    assert model.SerializeToString() == before


def test_open_cut_names_the_skip_connection():
    with pytest.raises(SplitError, match="not closed: the outputs also need 'r1'"):
        split_model(_residual(), ["r2"], ["y"])


def test_open_cut_names_a_missing_graph_input():
    with pytest.raises(SplitError, match="not closed.*'images'"):
        split_model(examples.yolo_head(), [], ["conv_26_out"])


@pytest.mark.parametrize(
    ("inputs", "outputs", "message"),
    [
        (["x"], ["nope"], "output 'nope' is not a tensor of the model"),
        (["w1"], ["y"], "input 'w1' is an initializer"),
        (["x", "x"], ["y"], "input 'x' is listed twice"),
        (["x"], [], "at least one output"),
        (["y"], ["r1"], "are inputs and outputs swapped"),
    ],
)
def test_split_errors(inputs, outputs, message):
    with pytest.raises(SplitError, match=message):
        split_model(_residual(), inputs, outputs)


def test_split_keeps_pins_of_kept_nodes_only():
    model = _residual()
    onnx.helper.set_model_props(
        model, {PLACEMENT_METADATA_KEY: json.dumps({"relu1": "CVU", "add": "APU", "Conv": "MLA"})}
    )
    tail = split_model(model, ["r1", "r2"], ["y"])
    props = {p.key: p.value for p in tail.metadata_props}
    assert json.loads(props[PLACEMENT_METADATA_KEY]) == {"add": "APU", "Conv": "MLA"}


def test_merge_renames_colliding_names_of_b():
    a, b = _unary("Relu", "x", "y"), _unary("Sigmoid", "u", "v")
    merged = merge_models(a, b, [("y", "u")])
    onnx.checker.check_model(merged, full_check=True)
    names = [n.name for n in merged.graph.node]
    assert names == ["n", "neg", "b_n", "b_neg"]
    assert [o.name for o in merged.graph.output] == ["v"]
    x = np.linspace(-2, 2, 6, dtype=np.float32).reshape(2, 3)
    expected = -1 / (1 + np.exp(np.maximum(x, 0)))
    np.testing.assert_allclose(run_model(merged, {"x": x})["v"], expected, rtol=1e-6)


def test_merge_with_prefix_and_kept_outputs():
    a, b = _unary("Relu", "x", "y"), _unary("Sigmoid", "u", "v")
    merged = merge_models(a, b, {"y": "u"}, prefix="post/", keep_outputs=["y"])
    assert [n.name for n in merged.graph.node] == ["n", "neg", "post/n", "post/neg"]
    assert [o.name for o in merged.graph.output] == ["y", "post/v"]


def test_merge_reconciles_opsets_to_the_max():
    a = _unary("Relu", "x", "y", opset=13)
    b = _unary("Relu", "u", "v", opset=17)
    merged = merge_models(a, b, [("y", "u")])
    assert {o.domain: o.version for o in merged.opset_import}[""] == 17
    x = np.linspace(-2, 2, 6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_allclose(run_model(merged, {"x": x})["v"], -np.maximum(-np.maximum(x, 0), 0))


def _add_const(x: str, y: str, value: float, extra_input: str | None = None) -> onnx.ModelProto:
    """y = (x + c) [* extra_input], with initializer c = value."""
    c = numpy_helper.from_array(np.full((2, 3), value, np.float32), "c")
    nodes = [helper.make_node("Add", [x, "c"], ["s" if extra_input else y], name="add")]
    inputs = [helper.make_tensor_value_info(x, TensorProto.FLOAT, [2, 3])]
    if extra_input:
        nodes.append(helper.make_node("Mul", ["s", extra_input], [y], name="mul"))
        inputs.append(helper.make_tensor_value_info(extra_input, TensorProto.FLOAT, [2, 3]))
    graph = helper.make_graph(
        nodes, "g", inputs, [helper.make_tensor_value_info(y, TensorProto.FLOAT, [2, 3])], [c]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return load_model(model)


def test_merge_shares_identical_initializers_and_inputs():
    a = _add_const("x", "y", 1.0)
    merged = merge_models(a, _add_const("u", "v", 1.0, extra_input="x"), [("y", "u")])
    assert [i.name for i in merged.graph.input] == ["x"]
    assert [t.name for t in merged.graph.initializer] == ["c"]
    x = np.full((2, 3), 2.0, np.float32)
    np.testing.assert_allclose(run_model(merged, {"x": x})["v"], (x + 2) * x)
    other = merge_models(a, _add_const("u", "v", 5.0, extra_input="x"), [("y", "u")])
    assert [t.name for t in other.graph.initializer] == ["c", "b_c"]
    np.testing.assert_allclose(run_model(other, {"x": x})["v"], (x + 6) * x)


@pytest.mark.parametrize(
    ("io_map", "message"),
    [
        ([("q", "u")], "'q' is not an output of model A"),
        ([("y", "q")], "'q' is not an input of model B"),
        ([], "the io map is empty"),
    ],
)
def test_merge_errors(io_map, message):
    with pytest.raises(SplitError, match=message):
        merge_models(_unary("Relu", "x", "y"), _unary("Relu", "u", "v"), io_map)


def test_merge_type_and_shape_mismatch():
    a = _unary("Relu", "x", "y")
    b = _unary("Relu", "u", "v")
    b.graph.input[0].type.tensor_type.elem_type = TensorProto.DOUBLE
    with pytest.raises(SplitError, match="'y' of A is float32 but 'u' of B is float64"):
        merge_models(a, b, [("y", "u")])
    wide = examples.plain_cnn()
    with pytest.raises(SplitError, match=r"shape \[1, 10, 1, 1\] but 'input' of B expects"):
        merge_models(wide, examples.plain_cnn(), [("logits", "input")])


def test_split_edit_merge_round_trip_is_exact():
    model = examples.yolo_head()
    cut = ["conv_26_out", "conv_31_out"]
    head = split_model(model, ["images"], cut)
    tail = split_model(model, cut, ["output0"])
    tail = edit.rename_tensor(tail, "sigmoid_37_out", "scores")
    tail = edit.insert_node_after(tail, "concat_34", "Identity")
    merged = merge_models(head, tail, [(t, t) for t in cut])
    _exact(model, merged)


# --------------------------------------------------------------------------- real models


@pytest.mark.slow
def test_round_trip_exact_on_yolov8n():
    model = load_model(shared_model("yolov8n"))
    cut = [
        f"/model.22/{branch}.{level}/{branch}.{level}.2/Conv_output_0"
        for branch in ("cv2", "cv3")
        for level in range(3)
    ]
    merged = _round_trip(model, cut)
    assert len(merged.graph.node) == len(model.graph.node)
    _exact(model, merged)


# --------------------------------------------------------------------------- CLI


def _invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_cli_split_and_merge_round_trip(save, tmp_path):
    src = save(examples.yolo_head(), "yolo.onnx")
    before = src.read_bytes()
    head, tail, merged = tmp_path / "head.onnx", tmp_path / "tail.onnx", tmp_path / "m.onnx"
    r = _invoke("split", src, "--outputs", "conv_26_out,conv_31_out", "-o", head, "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["outputs"] == ["conv_26_out", "conv_31_out"] and data["inputs"] == ["images"]
    r = _invoke("split", src, "--inputs", "conv_26_out", "--inputs", "conv_31_out", "-o", tail)
    assert r.exit_code == 0, r.output
    r = _invoke(
        "merge",
        head,
        tail,
        "--map",
        "conv_26_out=conv_26_out",
        "--map",
        "conv_31_out=conv_31_out",
        "-o",
        merged,
        "--json",
    )
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["outputs"] == ["output0"]
    _exact(load_model(src), load_model(merged))
    assert src.read_bytes() == before


def test_cli_merge_maps_same_names_by_default(save, tmp_path):
    model = examples.yolo_head()
    head = save(split_model(model, ["images"], ["conv_26_out", "conv_31_out"]), "h.onnx")
    tail = save(split_model(model, ["conv_26_out", "conv_31_out"], ["output0"]), "t.onnx")
    out = tmp_path / "m.onnx"
    r = _invoke("merge", head, tail, "-o", out, "--json")
    assert r.exit_code == 0, r.output
    assert len(json.loads(r.stdout)["map"]) == 2


@pytest.mark.parametrize(
    "args",
    [
        ["split", "{src}", "--inputs", "conv_26_out", "-o", "{out}"],
        ["split", "{src}", "-o", "{out}"],
        ["split", "{src}", "--outputs", "nope", "-o", "{out}"],
        ["split", "{src}", "--outputs", "conv_26_out", "-o", "{src}"],
        ["merge", "{src}", "{src}", "--map", "output0", "-o", "{out}"],
        ["merge", "{src}", "{src}", "--map", "output0=x", "-o", "{out}"],
    ],
)
def test_cli_split_merge_errors_exit_2(save, tmp_path, args):
    src = save(examples.yolo_head(), "yolo.onnx")
    before = src.read_bytes()
    out = tmp_path / "out.onnx"
    r = _invoke(*[a.format(src=src, out=out) for a in args], "--json")
    assert r.exit_code == 2, r.output
    assert json.loads(r.stdout)["error"]["message"]
    assert not out.exists()
    assert src.read_bytes() == before
