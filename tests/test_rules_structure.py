"""cut-postprocess (body + post, proven exact) and place-on-host (tiny islands pinned home)."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from typer.testing import CliRunner

from server.cli import app
from surgery import edit, examples
from surgery.check import check_model
from surgery.coverage import PLACEMENT_METADATA_KEY, analyze_coverage
from surgery.examples import _Builder, _io
from surgery.model import load_model
from surgery.rules import RuleFailedError, apply_rule, find_matches, get_rule, graph_edit
from surgery.rules.fix import fix_model
from surgery.rules.structure import (
    CutError,
    cut_postprocess,
    place_on_host,
    prove_cut,
    small_islands,
)
from surgery.verify import verify_models
from tests.conftest import RUN_INPUTS, shared_model

runner = CliRunner()


def _dfl_head(size: int = 32) -> onnx.ModelProto:
    """A YOLOv8-style anchor-free head with a DFL softmax-conv: the DFL is a tiny MLA island."""
    b = _Builder(3)
    x = b.conv("images", 3, 16, stride=2, act="SiLU")
    x = b.conv(x, 16, 32, act="SiLU")
    x = b.conv(x, 32, 32, act="SiLU")
    box = b.conv(x, 32, 64, k=1, act=None)
    cls = b.conv(x, 32, 2, k=1, act=None)
    n = (size // 2) ** 2
    (r,) = b.op("Reshape", [box, b.const(np.array([1, 64, n], np.int64), "shape")])
    (r,) = b.op("Reshape", [r, b.const(np.array([1, 4, 16, n], np.int64), "shape")])
    (t,) = b.op("Transpose", [r], perm=[0, 2, 1, 3])
    (s,) = b.op("Softmax", [t], axis=1)
    proj = np.arange(16, dtype=np.float32).reshape(1, 16, 1, 1)
    (d,) = b.op("Conv", [s, b.const(proj, "dfl")], kernel_shape=[1, 1])
    (d,) = b.op("Reshape", [d, b.const(np.array([1, 4, n], np.int64), "shape")])
    (d,) = b.op("Mul", [d, b.const(np.array(8.0, np.float32), "stride")])
    (c,) = b.op("Reshape", [cls, b.const(np.array([1, 2, n], np.int64), "shape")])
    (c,) = b.op("Sigmoid", [c])
    (out,) = b.op("Concat", [d, c], axis=1)
    b.name_output(out, "output0")
    model = b.model([_io("images", [1, 3, size, size])], [_io("output0", [1, 6, n])], "dfl_head")
    return load_model(model)


def _tiny_island() -> onnx.ModelProto:
    """Conv stack → TopK (APU) → a 1×1 conv with well under 1% of the MACs: a tiny island."""
    b = _Builder(4)
    x = b.conv("input", 3, 16)
    x = b.conv(x, 16, 16)
    values, _ = b.op("TopK", [x, b.const(np.array([8], np.int64), "k")], n_out=2, axis=1)
    b.name_output(b.conv(values, 8, 1, k=1, act=None), "output")
    model = b.model([_io("input", [1, 3, 32, 32])], [_io("output", [1, 1, 32, 32])], "island")
    return load_model(model)


def _four_d(model: onnx.ModelProto) -> bool:
    return all(len(o.type.tensor_type.shape.dim) == 4 for o in model.graph.output)


# --------------------------------------------------------------------------- cut-postprocess


def test_cut_postprocess_on_yolo_head_is_proven_exact():
    model = load_model(examples.yolo_head())
    before = model.SerializeToString()
    body, post, report = cut_postprocess(model)
    assert [o.name for o in body.graph.output] == ["conv_26_out", "conv_31_out"]
    assert _four_d(body)
    assert [i.name for i in post.graph.input] == ["conv_26_out", "conv_31_out"]
    assert [o.name for o in post.graph.output] == ["output0"]
    assert report.body_segments == 1 and report.body_blockers == 0
    assert report.proof.passed and report.proof.bitwise
    assert report.plan.tail_ops == {"Reshape": 2, "Concat": 2, "Split": 1, "Sigmoid": 1}
    for part in (body, post):
        onnx.checker.check_model(part, full_check=True)
    assert model.SerializeToString() == before


def test_cut_postprocess_walks_over_the_dfl_island():
    model = _dfl_head()
    assert analyze_coverage(model).mla_segments == 2
    body, post, report = cut_postprocess(model)
    assert report.plan.islands == ["MLA_1"]
    assert {"Softmax", "Conv", "Transpose"} <= set(report.plan.tail_ops)
    assert _four_d(body) and report.body_segments == 1
    assert report.proof.passed and report.proof.bitwise


def test_cut_postprocess_on_the_yolov5_anchor_head():
    body, _, report = cut_postprocess(examples.yolov5_head())
    assert [o.name for o in body.graph.output] == ["conv_11_out"]
    assert report.proof.passed and report.body_segments == 1


def test_cut_postprocess_passes_through_outputs_that_are_maps():
    """A seg head's proto map is a 4-D graph output: it stays a body output and post echoes it."""
    model = edit.add_output(examples.yolo_head(), "conv_31_out")
    body, post, report = cut_postprocess(model)
    assert [o.name for o in body.graph.output] == ["conv_26_out", "conv_31_out"]
    assert [o.name for o in post.graph.output] == ["output0", "conv_31_out"]
    assert report.proof.passed and report.proof.bitwise


def test_proof_catches_a_wrong_post_model():
    model = load_model(examples.yolo_head())
    body, post, _ = cut_postprocess(model)
    for node in post.graph.node:
        if node.op_type == "Sigmoid":
            node.op_type = "Relu"
    proof = prove_cut(model, body, post)
    assert not proof.passed and not proof.bitwise


@pytest.mark.parametrize(
    ("builder", "message"),
    [
        (examples.plain_cnn, "there is no tail"),
        (examples.cnn_with_topk, "there is no tail"),
        (examples.transformer_block, "that is the network itself"),
    ],
)
def test_cut_postprocess_refuses_models_without_a_decode_tail(builder, message):
    with pytest.raises(CutError, match=message):
        cut_postprocess(builder())


def test_cut_postprocess_rule_returns_body_and_proof(tmp_path):
    post_path = tmp_path / "post.onnx"
    model = load_model(examples.yolo_head())
    result = apply_rule(model, "cut-postprocess", params={"post": str(post_path)})
    assert [o.name for o in result.model.graph.output] == ["conv_26_out", "conv_31_out"]
    assert result.coverage_after.mla_segments == 1 and not result.coverage_after.blockers
    match = result.summary()["matches"][0]
    assert match["proof"]["passed"] and match["proof"]["bitwise_identical"]
    assert match["post_model"] == str(post_path) and match["body_single_segment"]
    post = load_model(post_path)
    assert result.matches[0].split_off.graph.output[0].name == "output0"
    proof = prove_cut(model, result.model, post)
    assert proof.passed and proof.bitwise


def test_cut_postprocess_is_never_automatic():
    rule = get_rule("cut-postprocess")
    assert rule.auto is False and rule.changes_outputs and rule.category == "structure"
    matches = find_matches(load_model(examples.yolo_head()), "cut-postprocess")
    assert len(matches) == 1 and len(matches[0].blockers) == 6
    result = fix_model(load_model(examples.yolo_head()), max_steps=3)
    assert "cut-postprocess" not in {s["rule"] for s in result.steps}
    assert [o.name for o in result.model.graph.output] == ["output0"]


# --------------------------------------------------------------------------- place-on-host


def test_small_islands_by_mac_share():
    assert [s.name for s in small_islands(analyze_coverage(_tiny_island()))] == ["MLA_1"]
    topk = analyze_coverage(load_model(examples.cnn_with_topk()))
    assert small_islands(topk) == []  # its second segment holds 40% of the MACs
    assert [s.name for s in small_islands(topk, max_fraction=0.5)] == ["MLA_1"]
    assert small_islands(analyze_coverage(load_model(examples.plain_cnn()))) == []


def test_no_islands_without_a_main_body_on_the_mla():
    """With the big convs on the host, the largest MLA segment is tiny too: pinning the other
    would report one .elf with almost nothing on the MLA."""
    pins = {"conv_3": "APU", "conv_7": "APU"}
    coverage = analyze_coverage(_tiny_island(), op_target=pins)
    assert coverage.mla_segments == 3  # the two Relus and the small conv
    assert small_islands(coverage) == []


def test_place_on_host_pins_islands_and_removes_segments():
    model = _tiny_island()
    onnx.helper.set_model_props(model, {PLACEMENT_METADATA_KEY: json.dumps({"relu_4": "MLA"})})
    pinned, moves = place_on_host(model)
    assert [m.segment for m in moves] == ["MLA_1"] and moves[0].fraction < 0.01
    pins = json.loads({p.key: p.value for p in pinned.metadata_props}[PLACEMENT_METADATA_KEY])
    assert pins == {"relu_4": "MLA", "conv_13": "APU"}  # Conv has no CVU placement on mlsoc
    assert analyze_coverage(model).mla_segments == 2
    assert analyze_coverage(pinned).mla_segments == 1
    assert pinned.graph.node == model.graph.node
    assert verify_models(model, pinned, exact=True).passed


def test_place_on_host_does_nothing_without_islands():
    model = load_model(examples.plain_cnn())
    pinned, moves = place_on_host(model)
    assert moves == [] and not pinned.metadata_props


def test_place_on_host_matches_report_their_segment():
    matches = find_matches(_tiny_island(), "place-on-host")
    assert len(matches) == 1
    info = matches[0].to_dict()
    assert info["segment"] == "MLA_1" and info["pins"] == {"conv_13": "APU"}
    assert "one .elf fewer" in info["reason"]
    topk = load_model(examples.cnn_with_topk())
    assert find_matches(topk, "place-on-host", params={"max_fraction": 0.5})


@pytest.mark.xfail(
    not hasattr(graph_edit, "GRAPH_METADATA_ATTR"),
    reason="needs export_graph to write rule metadata (framework change, see issue #3 report)",
    raises=RuleFailedError,
    strict=True,
)
def test_place_on_host_rule_pins_through_the_engine():
    result = apply_rule(_tiny_island(), "place-on-host")
    assert result.coverage_before.mla_segments == 2
    assert result.coverage_after.mla_segments == 1
    assert result.verification.passed
    props = {p.key: p.value for p in result.model.metadata_props}
    assert json.loads(props[PLACEMENT_METADATA_KEY]) == {"conv_13": "APU"}


# --------------------------------------------------------------------------- real models


@pytest.mark.slow
@pytest.mark.parametrize("name", ["yolov8n", "nudenet_320n", "yolov5n_anchor"])
def test_cut_postprocess_on_real_detectors(name):
    model = load_model(shared_model(name), RUN_INPUTS.get(name))
    body, post, report = cut_postprocess(model)
    assert _four_d(body) and report.body_segments == 1 and report.body_blockers == 0
    assert report.proof.passed, report.proof.to_dict()
    assert [o.name for o in post.graph.output] == [o.name for o in model.graph.output]
    if name != "yolov5n_anchor":  # anchor-free heads carry the DFL island
        assert report.segments_before == 2 and report.plan.islands == ["MLA_1"]


@pytest.mark.slow
def test_place_on_host_on_yolov8n_leaves_one_segment():
    model = load_model(shared_model("yolov8n"))
    pinned, moves = place_on_host(model)
    assert [m.segment for m in moves] == ["MLA_1"]
    assert analyze_coverage(model).mla_segments == 2
    assert analyze_coverage(pinned).mla_segments == 1


# --------------------------------------------------------------------------- CLI


def _invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_cli_cut_postprocess_writes_body_and_post(save, tmp_path):
    src = save(examples.yolo_head(), "yolo.onnx")
    before = src.read_bytes()
    body, post = tmp_path / "body.onnx", tmp_path / "post.onnx"
    r = _invoke("cut-postprocess", src, "-o", body, "--post", post, "--json")
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["proof"]["passed"] and data["body_single_segment"]
    assert data["body"] == str(body) and data["post"] == str(post)
    assert prove_cut(load_model(src), load_model(body), load_model(post)).bitwise
    assert src.read_bytes() == before


@pytest.mark.parametrize(
    ("model", "out", "post", "message"),
    [
        ("cnn", "body.onnx", "post.onnx", "no post-processing tail"),
        ("yolo", "same.onnx", "same.onnx", "name the same file"),
        ("yolo", "{src}", "post.onnx", "refusing to overwrite"),
    ],
)
def test_cli_cut_postprocess_errors_exit_2(save, tmp_path, model, out, post, message):
    src = save(examples.plain_cnn() if model == "cnn" else examples.yolo_head(), "m.onnx")
    before = src.read_bytes()
    paths = [tmp_path / p.format(src=src.name) for p in (out, post)]
    r = _invoke("cut-postprocess", src, "-o", paths[0], "--post", paths[1], "--json")
    assert r.exit_code == 2, r.output
    assert message in json.loads(r.stdout)["error"]["message"]
    assert src.read_bytes() == before


def test_fix_says_a_model_quantized_with_integer_ops_needs_its_float_model() -> None:
    graph = onnx.helper.make_graph(
        [
            onnx.helper.make_node(
                "DynamicQuantizeLinear", ["x"], ["q", "scale", "zero_point"], name="dq"
            ),
            onnx.helper.make_node("ConvInteger", ["q", "w", "zero_point"], ["y"], name="conv"),
        ],
        "dynamic",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 2, 4, 4])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.INT32, [1, 2, 4, 4])],
        [onnx.numpy_helper.from_array(np.ones((2, 2, 1, 1), np.uint8), "w")],
    )
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 13)])
    result = fix_model(load_model(model))
    assert any("already quantized" in note and "ConvInteger" in note for note in result.notes)


def group_norm_then_conv() -> onnx.ModelProto:
    """conv → GroupNorm as torch exports it (Reshape to rank 3, InstanceNormalization, Reshape
    back to Shape(conv)) → conv → rank-3 output. ONNX inference does not read the Shape-computed
    Reshape-13 target: unfolded, everything after the norm has unknown shapes."""
    rng = np.random.default_rng(0)
    inits = [
        onnx.numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype(np.float32), "w1"),
        onnx.numpy_helper.from_array(rng.standard_normal((8, 8, 1, 1)).astype(np.float32), "w2"),
        onnx.numpy_helper.from_array(np.array([1, 2, -1], np.int64), "grouped"),
        onnx.numpy_helper.from_array(np.array([1, 8, -1], np.int64), "flat"),
        onnx.numpy_helper.from_array(np.ones(2, np.float32), "scale"),
        onnx.numpy_helper.from_array(np.zeros(2, np.float32), "bias"),
    ]
    make = onnx.helper.make_node
    nodes = [
        make("Conv", ["x", "w1"], ["c"], name="conv1", pads=[1, 1, 1, 1]),
        make("Reshape", ["c", "grouped"], ["g"], name="to_groups"),
        make("InstanceNormalization", ["g", "scale", "bias"], ["n"], name="norm"),
        make("Shape", ["c"], ["c_shape"], name="shape"),
        make("Reshape", ["n", "c_shape"], ["back"], name="back"),
        make("Conv", ["back", "w2"], ["d"], name="conv2"),
        make("Reshape", ["d", "flat"], ["y"], name="flatten"),
    ]
    graph = onnx.helper.make_graph(
        nodes,
        "group_norm_then_conv",
        [_io("x", [1, 3, 16, 16])],
        [_io("y", [1, 8, 256])],
        inits,
    )
    return onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 13)])


def test_cut_postprocess_plans_on_the_model_as_check_counts_it():
    """Unfolded, conv2's MACs are unknown and the tail reached back to conv1 (segments 1)."""
    model = group_norm_then_conv()
    _, _, report = cut_postprocess(model, "mlsoc")
    assert report.segments_before == check_model(model, "mlsoc").mla_segments == 2
    assert report.plan.tail == ["flatten"] and report.proof.passed


def test_applied_cut_postprocess_cuts_where_the_api_cuts():
    """`surgery apply cut-postprocess` planned on the unfolded model and cut at conv1."""
    model = load_model(group_norm_then_conv())
    body, _, _ = cut_postprocess(model, "mlsoc")
    applied = apply_rule(model, "cut-postprocess", "mlsoc")
    assert [o.name for o in applied.model.graph.output] == [o.name for o in body.graph.output]
    assert [n.op_type for n in applied.model.graph.node] == [n.op_type for n in body.graph.node]
    assert applied.matches[0].data["report"].plan.tail == ["flatten"]


def test_applied_rule_reports_segments_as_check_counts_them():
    model = load_model(group_norm_then_conv())
    result = apply_rule(model, "cut-postprocess", "mlsoc").as_compiled("mlsoc")
    assert result.summary()["mla_segments_before"] == check_model(model, "mlsoc").mla_segments
    assert result.summary()["mla_segments_after"] == check_model(result.model).mla_segments == 2
