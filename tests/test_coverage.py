"""Coverage: node → processor with reasons, foldable shape chains, and MLA segmentation."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from surgery import examples
from surgery.check import check_model
from surgery.coverage import PLACEMENT_METADATA_KEY, analyze_coverage
from surgery.errors import NodeNotFoundError, TargetError
from surgery.model import load_model


def _coverage(model, target="mlsoc", **kw):
    return analyze_coverage(load_model(model), target, **kw)


def _model(nodes, inputs, outputs, inits=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _vi(name, shape, dtype=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, dtype, shape)


def test_plain_cnn_is_one_segment_entirely_on_the_mla(plain_cnn):
    report = _coverage(plain_cnn)
    assert report.mla_segments == 1 and report.single_elf
    assert {p.processor for p in report.placements} == {"MLA"}
    assert report.mla_mac_fraction == 1.0


def test_unsupported_op_in_the_middle_makes_two_segments(cnn_with_topk):
    report = _coverage(cnn_with_topk)
    assert report.mla_segments == 2
    topk = next(p for p in report.placements if p.op_type == "TopK")
    assert topk.processor == "APU"
    assert topk.reasons[0].code == "op_not_supported"
    assert [b.name for b in report.blockers] == [topk.name]


def test_yolo_head_rank3_nodes_are_blocked_with_rank_reason(yolo_head):
    report = _coverage(yolo_head)
    blocked = {p.op_type: p for p in report.blockers}
    assert set(blocked) == {"Reshape", "Concat", "Split", "Sigmoid"}
    assert all(b.processor == "CVU" for b in report.blockers)
    reshape = blocked["Reshape"]
    assert reshape.reasons[0].code == "rank"
    assert "is rank 3; the MLA needs 4-D tensors" in reshape.reasons[0].message


def test_trailing_host_stages_do_not_add_segments(yolo_head):
    assert _coverage(yolo_head).mla_segments == 1


def test_rank5_reshape_is_blocked(yolov5_head):
    report = _coverage(yolov5_head)
    reshapes = [p for p in report.placements if p.op_type == "Reshape"]
    assert reshapes[0].processor != "MLA" and "rank 5" in reshapes[0].reasons[0].message


def test_transformer_softmax_on_last_axis_is_blocked_by_axis_rule(transformer_block):
    report = _coverage(transformer_block)
    softmax = next(p for p in report.placements if p.op_type == "Softmax")
    assert softmax.processor != "MLA"
    assert softmax.reasons[0].code == "axis" and "channel" in softmax.reasons[0].message


def test_transformer_matmul_on_rank3_goes_to_apu(transformer_block):
    report = _coverage(transformer_block)
    first_matmul = next(p for p in report.placements if p.op_type == "MatMul")
    assert first_matmul.processor == "APU"  # no CVU fallback for MatMul
    assert first_matmul.reasons[0].code == "rank"


def test_shape_chain_is_foldable_not_a_blocker():
    shape_of = [
        helper.make_node("Shape", ["x"], ["s"], name="shape"),
        helper.make_node("Gather", ["s", "idx"], ["c"], name="gather", axis=0),
        helper.make_node("Unsqueeze", ["c", "zero"], ["cu"], name="unsq"),
        helper.make_node("Concat", ["one", "cu", "minus1", "one"], ["shp"], name="cat", axis=0),
        helper.make_node("Reshape", ["x", "shp"], ["y"], name="reshape"),
    ]
    inits = [
        numpy_helper.from_array(np.array(1, np.int64), "idx"),
        numpy_helper.from_array(np.array([0], np.int64), "zero"),
        numpy_helper.from_array(np.array([1], np.int64), "one"),
        numpy_helper.from_array(np.array([-1], np.int64), "minus1"),
    ]
    model = _model(shape_of, [_vi("x", [1, 4, 4, 4])], [_vi("y", None)], inits)
    report = _coverage(model)
    by_name = {p.name: p for p in report.placements}
    assert all(by_name[n].foldable for n in ("shape", "gather", "unsq", "cat"))
    assert by_name["reshape"].processor == "MLA"
    assert [b.name for b in report.blockers] == []


def test_dynamic_shape_blocks_with_a_hint():
    model = _model(
        [helper.make_node("Relu", ["x"], ["y"], name="relu")],
        [_vi("x", ["n", 3, 8, 8])],
        [_vi("y", None)],
    )
    report = _coverage(model)
    assert report.dynamic_inputs == {"x": ["n", 3, 8, 8]}
    assert report.placements[0].reasons[0].code == "dynamic_shape"
    assert "--input-shape" in report.placements[0].reasons[0].message


def _conv_matmul(batch: int | str) -> onnx.ModelProto:
    """Conv (4×4 kernel over 8 channels) then MatMul by a (16, 5) weight, batch `batch`."""
    w = numpy_helper.from_array(np.ones((8, 3, 4, 4), np.float32), "w")
    m = numpy_helper.from_array(np.ones((16, 5), np.float32), "m")
    return _model(
        [
            helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
            helper.make_node("MatMul", ["c", "m"], ["y"], name="matmul"),
        ],
        [_vi("x", [batch, 3, 19, 19])],
        [_vi("y", None)],
        [w, m],
    )


def test_matrix_ops_with_dynamic_shapes_are_counted_as_unknown_macs():
    static = _coverage(_conv_matmul(1))
    assert static.macs_unknown_nodes == 0
    assert static.total_macs == 8 * 16 * 16 * (3 * 4 * 4) + 8 * 16 * 5 * 16
    dynamic = _coverage(_conv_matmul("n"))
    assert dynamic.macs_unknown_nodes == 2
    assert dynamic.total_macs == 0
    assert dynamic.to_dict()["macs_unknown_nodes"] == 2


def test_matmul_takes_its_depth_from_the_weight_when_the_input_leaves_it_open():
    """Inference can leave a reshaped activation's last dim symbolic (bert's attention output)
    while the weight fixes it."""
    weight = numpy_helper.from_array(np.ones((6, 3), np.float32), "w")
    model = _model(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="matmul")],
        [_vi("x", [1, 4, "k"])],
        [_vi("y", [1, 4, 3])],
        [weight],
    )
    report = _coverage(model)
    assert report.macs_unknown_nodes == 0 and report.total_macs == 1 * 4 * 3 * 6


@pytest.mark.parametrize(
    ("shapes", "attrs"),
    [
        (([1, 2, 5, 8], [1, 2, 7, 8], [1, 2, 7, 6]), {}),
        (([1, 5, 16], [1, 7, 16], [1, 7, 12]), {"q_num_heads": 2, "kv_num_heads": 2}),
    ],
    ids=["heads-4d", "packed-3d"],
)
def test_attention_counts_both_products(shapes, attrs):
    """Q·Kᵀ (5 × 7 × 8 per head) and P·V (5 × 7 × 6 per head), two heads."""
    q, k, v = shapes
    model = _model(
        [helper.make_node("Attention", ["q", "k", "v"], ["y"], name="attention", **attrs)],
        [_vi("q", q), _vi("k", k), _vi("v", v)],
        [_vi("y", None)],
    )
    model.opset_import[0].version = 23
    report = _coverage(model)
    assert report.macs_unknown_nodes == 0
    assert report.total_macs == 2 * 5 * 7 * (8 + 6)


def test_int64_data_is_not_placed_on_the_mla():
    model = _model(
        [helper.make_node("Add", ["a", "b"], ["y"], name="add")],
        [_vi("a", [1, 2, 2, 2], TensorProto.INT64), _vi("b", [1, 2, 2, 2], TensorProto.INT64)],
        [_vi("y", None, TensorProto.INT64)],
    )
    p = _coverage(model).placements[0]
    assert p.processor == "APU" and p.reasons[0].code == "dtype"


def test_bf16_only_op_runs_on_modalix_but_not_on_mlsoc():
    table = numpy_helper.from_array(np.zeros((10, 4, 4, 4), np.float32), "table")
    idx = numpy_helper.from_array(np.array([1, 2], np.int64), "idx")
    model = _model(
        [helper.make_node("Gather", ["x", "idx"], ["y"], name="gather", axis=1)],
        [_vi("x", [1, 8, 4, 4])],
        [_vi("y", None)],
        [table, idx],
    )
    assert _coverage(model, "mlsoc").placements[0].reasons[0].code == "precision"
    assert _coverage(model, "modalix").placements[0].processor == "MLA"


def test_pow_exponent_must_be_a_supported_constant():
    model = _model(
        [helper.make_node("Pow", ["x", "e"], ["y"], name="pow")],
        [_vi("x", [1, 2, 2, 2])],
        [_vi("y", None)],
        [numpy_helper.from_array(np.array(2.5, np.float32), "e")],
    )
    p = _coverage(model).placements[0]
    assert p.processor == "CVU" and "2.5" in p.reasons[0].message


def test_resize_by_three_nearest_is_not_power_of_two():
    model = _model(
        [helper.make_node("Resize", ["x", "", "scales"], ["y"], name="resize", mode="nearest")],
        [_vi("x", [1, 2, 4, 4])],
        [_vi("y", None)],
        [numpy_helper.from_array(np.array([1, 1, 3, 3], np.float32), "scales")],
    )
    report = _coverage(model)
    assert report.placements[0].processor == "CVU"
    assert "3" in report.placements[0].reasons[0].message


def test_rk3588_limits_conv_stride():
    w = numpy_helper.from_array(np.zeros((4, 2, 3, 3), np.float32), "w")
    node = helper.make_node("Conv", ["x", "w"], ["y"], name="conv", strides=[8, 8])
    model = _model([node], [_vi("x", [1, 2, 64, 64])], [_vi("y", None)], [w])
    assert _coverage(model, "mlsoc").placements[0].processor == "MLA"
    rk = _coverage(model, "rk3588").placements[0]
    assert rk.processor == "APU" and "strides" in rk.reasons[0].message


def test_unknown_op_is_named_as_unknown(plain_cnn):
    model = _model(
        [helper.make_node("FancyOp", ["x"], ["y"], name="fancy")],
        [_vi("x", [1, 2, 2, 2])],
        [_vi("y", [1, 2, 2, 2])],
    )
    p = analyze_coverage(model, "mlsoc").placements[0]
    assert p.processor == "APU" and p.reasons[0].code == "unknown_op"


def _dynamically_quantized_conv() -> onnx.ModelProto:
    """ONNX Runtime's quantize_dynamic form of a Conv: the activation quantized at run time."""
    w = numpy_helper.from_array(np.ones((4, 2, 3, 3), np.uint8), "w_q")
    w_zp = numpy_helper.from_array(np.array(0, np.uint8), "w_zp")
    w_scale = numpy_helper.from_array(np.array(0.01, np.float32), "w_scale")
    nodes = [
        helper.make_node("DynamicQuantizeLinear", ["x"], ["x_q", "x_scale", "x_zp"], name="dql"),
        helper.make_node("ConvInteger", ["x_q", "w_q", "x_zp", "w_zp"], ["acc"], name="conv"),
        helper.make_node("Cast", ["acc"], ["acc_f"], to=TensorProto.FLOAT, name="cast"),
        helper.make_node("Mul", ["x_scale", "w_scale"], ["scale"], name="scale"),
        helper.make_node("Mul", ["acc_f", "scale"], ["y"], name="rescale"),
    ]
    return _model(nodes, [_vi("x", [1, 2, 8, 8])], [_vi("y", [1, 4, 6, 6])], [w, w_zp, w_scale])


def test_dynamic_quantization_ops_are_named_with_what_to_do_instead():
    report = _coverage(_dynamically_quantized_conv())
    by_name = {p.name: p for p in report.placements}
    for name in ("dql", "conv"):
        reason = by_name[name].reasons[0]
        assert by_name[name].processor == "APU" and reason.code == "dynamic_quantization"
        assert "surgery quantize" in reason.message
    assert by_name["rescale"].reasons[0].code != "dynamic_quantization"


def test_op_target_pins_a_node_to_the_host(plain_cnn):
    pool = next(n.name for n in plain_cnn.graph.node if n.op_type == "MaxPool")
    report = _coverage(plain_cnn, op_target={pool: "cvu"})
    assert report.by_name(pool).processor == "CVU"
    assert report.by_name(pool).reasons[0].code == "pinned"
    assert report.mla_segments == 2


def test_check_refuses_a_pin_to_no_processor(plain_cnn):
    pool = next(n.name for n in plain_cnn.graph.node if n.op_type == "MaxPool")
    with pytest.raises(TargetError, match="'GPU' is not a processor"):
        check_model(plain_cnn, "mlsoc", op_target={pool: "GPU"})


def test_check_refuses_a_pin_that_names_nothing_in_the_model(plain_cnn):
    pool = next(n.name for n in plain_cnn.graph.node if n.op_type == "MaxPool")
    with pytest.raises(NodeNotFoundError, match="names no node or op type") as info:
        check_model(plain_cnn, "mlsoc", op_target={pool + "e": "APU"})
    assert pool in info.value.hint


def test_placement_pinned_in_model_metadata_is_honoured(plain_cnn):
    pool = next(n.name for n in plain_cnn.graph.node if n.op_type == "MaxPool")
    helper.set_model_props(plain_cnn, {PLACEMENT_METADATA_KEY: f'{{"{pool}": "APU"}}'})
    assert _coverage(plain_cnn).by_name(pool).processor == "APU"


def test_segments_do_not_create_cycles_through_host_nodes():
    # a → TopK (host) → c ; a → c directly too: merging a and c into one segment would need the
    # host node's output inside the segment while it depends on the segment: two segments.
    w = numpy_helper.from_array(np.ones((4, 4, 1, 1), np.float32), "w")
    k = numpy_helper.from_array(np.array([4], np.int64), "k")
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["a"], name="a"),
        helper.make_node("TopK", ["a", "k"], ["t", "ti"], name="host", axis=1),
        helper.make_node("Add", ["a", "t"], ["c"], name="c"),
    ]
    model = _model(nodes, [_vi("x", [1, 4, 4, 4])], [_vi("c", None)], [w, k])
    report = _coverage(model)
    assert report.mla_segments == 2
    assert report.segments[0].outputs == ["a"] and report.segments[1].inputs == ["a", "t"]


def test_parallel_branches_join_into_one_segment():
    w = numpy_helper.from_array(np.ones((4, 4, 1, 1), np.float32), "w")
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["a"], name="a"),
        helper.make_node("Relu", ["a"], ["b1"], name="b1"),
        helper.make_node("Sigmoid", ["a"], ["b2"], name="b2"),
        helper.make_node("Add", ["b1", "b2"], ["y"], name="join"),
    ]
    report = _coverage(_model(nodes, [_vi("x", [1, 4, 4, 4])], [_vi("y", None)], [w]))
    assert report.mla_segments == 1 and len(report.segments[0].nodes) == 4


def test_report_json_has_the_documented_keys(yolo_head):
    data = _coverage(yolo_head).to_dict()
    for key in (
        "target",
        "nodes_total",
        "processors",
        "mla_segments",
        "single_elf",
        "mla_mac_fraction",
        "macs_unknown_nodes",
        "segments",
        "blockers",
    ):
        assert key in data
    assert sum(data["processors"].values()) == data["nodes_total"]
    assert {"node", "op_type", "processor", "reasons", "suggested_rules"} <= set(
        data["blockers"][0]
    )


@pytest.mark.parametrize("target", ["mlsoc", "modalix", "rk3588"])
def test_every_target_analyses_every_example(target):
    from surgery.examples import EXAMPLES

    for build in EXAMPLES.values():
        report = _coverage(build(), target)
        assert report.nodes_total == len(build().graph.node)


def test_model_is_not_modified_by_analysis(yolo_head):
    loaded = load_model(yolo_head)
    before = loaded.SerializeToString()
    analyze_coverage(loaded, "mlsoc")
    assert loaded.SerializeToString() == before
    assert isinstance(loaded, onnx.ModelProto)


def test_check_on_a_qdq_model_counts_the_float_models_segments(plain_cnn, tmp_path):
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    from surgery.check import check_model
    from surgery.model import save_model

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.samples = iter(
                [{"input": np.random.default_rng(0).random((1, 3, 32, 32), np.float32)}]
            )

        def get_next(self):
            return next(self.samples, None)

    src = save_model(plain_cnn, tmp_path / "f.onnx")
    quantize_static(str(src), str(tmp_path / "q.onnx"), Reader(), quant_format=QuantFormat.QDQ)
    report = check_model(tmp_path / "q.onnx", "mlsoc")
    assert report.mla_segments == 1
    assert not any(
        p.op_type in ("QuantizeLinear", "DequantizeLinear") and not p.foldable
        for p in report.placements
    )


def _pad_model(opset: int, **attrs) -> onnx.ModelProto:
    inputs = ["x", "pads"] if opset >= 11 else ["x"]
    pads = numpy_helper.from_array(np.array([0, 0, 1, 1, 0, 0, 1, 1], np.int64), "pads")
    graph = helper.make_graph(
        [helper.make_node("Pad", inputs, ["y"], **attrs)],
        "pad",
        [_vi("x", [1, 2, 4, 4])],
        [_vi("y", [1, 2, 6, 6])],
        [pads] if opset >= 11 else [],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def test_pad_value_attribute_of_old_opsets_is_checked() -> None:
    model = _pad_model(6, pads=[0, 0, 1, 1, 0, 0, 1, 1], value=2.0)
    (pad,) = _coverage(model).placements
    assert pad.processor != "MLA"
    assert "pad value 2" in pad.reasons[0].message


def test_zero_pad_of_old_opsets_runs_on_the_mla() -> None:
    (pad,) = _coverage(_pad_model(6, pads=[0, 0, 1, 1, 0, 0, 1, 1])).placements
    assert pad.processor == "MLA"


def _quick_gelu(domain: str) -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("QuickGelu", ["x"], ["y"], domain=domain, alpha=1.702)],
        "quick_gelu",
        [_vi("x", [1, 4, 8, 8])],
        [_vi("y", [1, 4, 8, 8])],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(domain, 1)]
    return helper.make_model(graph, opset_imports=opsets)


def test_contrib_quick_gelu_is_placed_by_the_profile() -> None:
    (node,) = _coverage(_quick_gelu("com.microsoft")).placements
    assert node.processor == "MLA"


def test_quick_gelu_of_another_domain_is_a_custom_op() -> None:
    (node,) = _coverage(_quick_gelu("example.custom")).placements
    assert node.processor == "APU"
    assert node.reasons[0].code == "custom_op"


def test_a_rule_that_keeps_the_model_whole_is_suggested_before_one_that_cuts_it():
    report = check_model(examples.yolo_head(), "mlsoc")
    both = [b for b in report.blockers if len(b.suggested_rules) > 1]
    assert both and all(b.suggested_rules == ["reshape-to-4d", "cut-postprocess"] for b in both)


def test_a_blocker_group_lists_the_rule_that_frees_most_of_its_nodes_first():
    groups = check_model(examples.yolov5_head(), "mlsoc").blocker_groups()
    counts = [list(g["suggested_rule_nodes"].values()) for g in groups]
    assert all(c == sorted(c, reverse=True) for c in counts)
    assert groups[0]["suggested_rule_nodes"] == {"cut-postprocess": 3, "reshape-to-4d": 2}
