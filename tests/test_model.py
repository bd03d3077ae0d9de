"""Loading, validation, shape fixing, saving and summaries (surgery.model / surgery.summary)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from surgery import model as model_mod
from surgery.errors import (
    InvalidGraphError,
    ModelFormatError,
    ModelNotFoundError,
    ShapeError,
    UnknownDomainError,
)
from surgery.graph import GraphView
from surgery.model import (
    check_model_fully,
    load_model,
    parse_input_shapes,
    read_model,
    save_model,
)
from surgery.summary import summarize
from tests.conftest import loop_body_adding, shared_model


def _relu_model(shape=(1, 3, 8, 8)) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="relu")], "g", [x], [y])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_load_from_proto_infers_intermediate_shapes(plain_cnn):
    loaded = load_model(plain_cnn)
    view = GraphView(loaded)
    first_conv_out = loaded.graph.node[0].output[0]
    assert view.tensor(first_conv_out).shape == (1, 8, 16, 16)


def test_load_does_not_modify_the_callers_proto(plain_cnn):
    before = plain_cnn.SerializeToString()
    load_model(plain_cnn, infer_shapes=True)
    assert plain_cnn.SerializeToString() == before


def test_load_from_path_leaves_file_untouched(plain_cnn, save):
    path = save(plain_cnn)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    load_model(path, {"input": [1, 3, 32, 32]})
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest


def test_input_shapes_fix_dynamic_dims():
    model = _relu_model(("batch", 3, "h", "w"))
    loaded = load_model(model, {"x": [2, 3, 16, 16]})
    assert GraphView(loaded).tensor("y").shape == (2, 3, 16, 16)


@pytest.mark.parametrize("as_file", [True, False])
def test_a_negative_declared_dim_reads_as_dynamic_from_a_file_or_a_proto(as_file, save):
    """Exporters write -1 for "dynamic": a ModelProto handed over reads as its file does."""
    model = _relu_model((-1, 3, 8, 8))
    loaded = load_model(save(model) if as_file else model)
    assert GraphView(loaded).tensor("x").shape == (None, 3, 8, 8)
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_value == -1  # caller's copy


def test_an_input_shape_given_twice_differently_is_refused():
    with pytest.raises(ShapeError, match="'x' is given twice, as 1,3,8,8 and 1,3,9,9"):
        parse_input_shapes(["x=1,3,8,8", "x=1,3,9,9"])
    assert parse_input_shapes(["x=1,3,8,8", "x=1x3x8x8"]) == {"x": [1, 3, 8, 8]}


def test_input_shape_for_unknown_input_names_the_real_inputs():
    with pytest.raises(ShapeError, match="model's inputs are: x"):
        load_model(_relu_model(), {"images": [1, 3, 8, 8]})


def test_input_shape_with_wrong_rank_is_rejected():
    with pytest.raises(ShapeError, match="rank 4"):
        load_model(_relu_model(), {"x": [1, 3, 8]})


def test_parse_input_shapes_accepts_commas_and_x():
    assert parse_input_shapes(["images=1,3,640,640", "mask=1x128"]) == {
        "images": [1, 3, 640, 640],
        "mask": [1, 128],
    }


@pytest.mark.parametrize("spec", ["images", "images=", "=1,2", "images=1,a", "images=0,3"])
def test_parse_input_shapes_rejects_malformed_specs(spec):
    with pytest.raises(ShapeError):
        parse_input_shapes([spec])


def test_missing_file_is_a_typed_error(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no such file"):
        load_model(tmp_path / "absent.onnx")


def test_garbage_bytes_are_not_onnx(tmp_path):
    path = tmp_path / "garbage.onnx"
    path.write_bytes(b"\xff\x00not a protobuf at all\x13\x37" * 10)
    with pytest.raises(ModelFormatError, match="garbage.onnx"):
        load_model(path)


def test_truncated_model_is_rejected(plain_cnn, tmp_path):
    data = plain_cnn.SerializeToString()
    path = tmp_path / "truncated.onnx"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFormatError):
        load_model(path)


def test_cycle_is_reported_with_node_names():
    nodes = [
        helper.make_node("Add", ["x", "b"], ["a"], name="first"),
        helper.make_node("Relu", ["a"], ["b"], name="second"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("b", TensorProto.FLOAT, [1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(InvalidGraphError, match="cycle.*first"):
        load_model(model)


def test_missing_initializer_names_node_and_tensor():
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "conv.weight"], ["y"], name="conv0")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(InvalidGraphError, match="conv0.*conv.weight.*missing initializer"):
        load_model(model)


def test_undeclared_custom_domain_is_rejected():
    model = _relu_model()
    model.graph.node[0].domain = "com.example"
    with pytest.raises(UnknownDomainError, match="com.example"):
        load_model(model)


def test_external_data_round_trip(plain_cnn, tmp_path):
    path = save_model(plain_cnn, tmp_path / "ext.onnx", external_data=True)
    assert (tmp_path / "ext.onnx.data").exists()
    loaded = read_model(path)
    original = {t.name: numpy_helper.to_array(t) for t in plain_cnn.graph.initializer}
    for t in loaded.graph.initializer:
        np.testing.assert_array_equal(numpy_helper.to_array(t), original[t.name])


def _external_model(plain_cnn, folder) -> Path:
    """plain_cnn saved with its weights in `ext.onnx.data`, the data moved to `elsewhere/`."""
    path = save_model(plain_cnn, folder / "ext.onnx", external_data=True)
    (folder / "elsewhere").mkdir()
    data = folder / "ext.onnx.data"
    data.rename(folder / "elsewhere" / data.name)
    return path


def test_a_missing_external_data_file_is_a_clear_error(plain_cnn, tmp_path):
    path = _external_model(plain_cnn, tmp_path)
    with pytest.raises(ModelFormatError, match="external data cannot be loaded") as refused:
        read_model(path)
    assert "ext.onnx.data" in refused.value.message and refused.value.hint


def test_external_data_behind_a_symbolic_link_is_a_clear_error(plain_cnn, tmp_path):
    path = _external_model(plain_cnn, tmp_path)
    (tmp_path / "ext.onnx.data").symlink_to(tmp_path / "elsewhere" / "ext.onnx.data")
    with pytest.raises(ModelFormatError, match="symbolic link"):
        read_model(path)


def test_models_near_the_protobuf_limit_are_saved_with_external_data(
    plain_cnn, tmp_path, monkeypatch
):
    monkeypatch.setattr(model_mod, "PROTOBUF_LIMIT", 64 * 2**20 + 1000)
    save_model(plain_cnn, tmp_path / "big.onnx")
    assert (tmp_path / "big.onnx.data").exists()
    assert len(read_model(tmp_path / "big.onnx").graph.initializer) == len(
        plain_cnn.graph.initializer
    )


def test_failed_save_leaves_no_file(plain_cnn, tmp_path, monkeypatch):
    def boom(*_a, **_k):
        raise OSError("disk full")

    monkeypatch.setattr(onnx.ModelProto, "SerializeToString", boom)
    with pytest.raises(OSError):
        save_model(plain_cnn, tmp_path / "out.onnx")
    assert list(tmp_path.iterdir()) == []


def test_summary_counts_ops_params_and_dynamic_dims():
    model = _relu_model(("batch", 3, 8, 8))
    model.graph.initializer.append(numpy_helper.from_array(np.zeros((4, 4), np.float32), "unused"))
    s = summarize(load_model(model))
    assert s.nodes == 1
    assert s.op_histogram == {"Relu": 1}
    assert s.parameters == 16 and s.parameter_bytes == 64
    assert s.dynamic_dims == {"x": ["batch", 3, 8, 8]}


def test_summary_counts_subgraph_nodes(tmp_path):
    then_g = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["t"])],
        "then",
        [],
        [helper.make_tensor_value_info("t", TensorProto.FLOAT, [1])],
    )
    else_g = helper.make_graph(
        [helper.make_node("Neg", ["x"], ["e"])],
        "else",
        [],
        [helper.make_tensor_value_info("e", TensorProto.FLOAT, [1])],
    )
    node = helper.make_node(
        "If", ["cond"], ["y"], then_branch=then_g, else_branch=else_g, name="if"
    )
    graph = helper.make_graph(
        [node],
        "g",
        [
            helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    s = summarize(load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])))
    assert s.nodes == 1 and s.nodes_including_subgraphs == 3
    assert s.subgraph_ops == ["Neg", "Relu"]


@pytest.mark.slow
def test_legacy_ir_with_initializers_as_inputs_loads():
    loaded = load_model(shared_model("light_resnet50"))
    s = summarize(loaded)
    assert s.legacy_initializer_inputs > 0
    assert [i["name"] for i in s.inputs] == ["gpu_0/data_0"]


def _matmul_by_weight(rows: int) -> onnx.ModelProto:
    """x [1, 64] @ w [rows, 32] (a 64-row weight is consistent; others are not)."""
    weight = np.ones((rows, 32), np.float32)  # 8 KB+: a weight the light check moves out
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "matmul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32])],
        [numpy_helper.from_array(weight, "w")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_the_full_check_of_a_model_over_the_protobuf_limit_passes_a_valid_one(monkeypatch):
    monkeypatch.setattr(model_mod, "PROTOBUF_LIMIT", 2**26 + 1000)
    monkeypatch.setattr(onnx.ModelProto, "SerializeToString", _refuse_the_whole_model)
    check_model_fully(_matmul_by_weight(64))


def test_the_full_check_of_a_model_over_the_protobuf_limit_still_sees_weight_shapes(
    monkeypatch,
):
    monkeypatch.setattr(model_mod, "PROTOBUF_LIMIT", 2**26 + 1000)
    with pytest.raises(onnx.shape_inference.InferenceError):
        check_model_fully(_matmul_by_weight(48))


def _refuse_the_whole_model(self: onnx.ModelProto) -> bytes:
    """SerializeToString that fails, as protobuf does above 2 GB, while the weight is in."""
    if any(t.name == "w" for t in self.graph.initializer):
        raise ValueError("Failed to serialize proto")
    return onnx.ModelProto.SerializePartialToString(self)


def _large_weight_model() -> onnx.ModelProto:
    """A Conv whose weight is an initializer and a MatMul whose weight is a Constant node,
    both over the size the inferencer is shown."""
    rng = np.random.default_rng(0)
    conv_w = rng.normal(size=(16, 8, 3, 3)).astype(np.float32)  # 4.6 KB
    fc_w = rng.normal(size=(16, 100)).astype(np.float32)  # 6.4 KB
    nodes = [
        helper.make_node("Conv", ["x", "conv_w"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("GlobalAveragePool", ["c"], ["p"]),
        helper.make_node("Flatten", ["p"], ["f"]),
        helper.make_node("Constant", [], ["fc_w"], value=numpy_helper.from_array(fc_w, "fc_w")),
        helper.make_node("MatMul", ["f", "fc_w"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "large_weights",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(conv_w, "conv_w")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _inferencer_input_sizes(monkeypatch) -> list[int]:
    """The serialized size of every model onnx's shape inferencer is given from now on."""
    seen: list[int] = []
    infer = onnx.shape_inference.infer_shapes

    def spy(model, *args, **kwargs):
        seen.append(model.ByteSize())
        return infer(model, *args, **kwargs)

    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", spy)
    return seen


def test_the_inferencer_sees_no_large_weight_and_the_model_keeps_every_one(monkeypatch):
    original = _large_weight_model()
    seen = _inferencer_input_sizes(monkeypatch)
    loaded = load_model(original)
    assert seen and max(seen) < 2048  # neither weight's bytes were serialised for it
    assert [d.dim_value for d in loaded.graph.output[0].type.tensor_type.shape.dim] == [1, 100]
    weights = {t.name: t for t in loaded.graph.initializer}
    assert weights["conv_w"].raw_data == original.graph.initializer[0].raw_data
    constant = next(n for n in loaded.graph.node if n.op_type == "Constant")
    assert constant.attribute[0].t.raw_data == original.graph.node[3].attribute[0].t.raw_data


def _constant_node_weights_model() -> onnx.ModelProto:
    """`_large_weight_model` as Paddle and Caffe2 export it: every weight a Constant node, and
    a small shape Constant that the inferencer must read (the Reshape's target)."""
    rng = np.random.default_rng(1)
    conv_w = rng.normal(size=(16, 8, 3, 3)).astype(np.float32)  # 4.6 KB
    fc_w = rng.normal(size=(16, 100)).astype(np.float32)  # 6.4 KB
    nodes = [
        helper.make_node("Constant", [], ["conv_w"], value=numpy_helper.from_array(conv_w)),
        helper.make_node("Conv", ["x", "conv_w"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("GlobalAveragePool", ["c"], ["p"]),
        helper.make_node(
            "Constant", [], ["flat"], value=numpy_helper.from_array(np.array([1, 16], np.int64))
        ),
        helper.make_node("Reshape", ["p", "flat"], ["f"]),
        helper.make_node("Constant", [], ["fc_w"], value=numpy_helper.from_array(fc_w)),
        helper.make_node("MatMul", ["f", "fc_w"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "constant_weights",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_the_inferencer_sees_no_constant_node_weight_and_the_model_keeps_every_one(monkeypatch):
    original = _constant_node_weights_model()
    before = original.SerializeToString()
    seen = _inferencer_input_sizes(monkeypatch)
    loaded = load_model(original)
    assert seen and max(seen) < 2048  # neither weight's bytes were serialised for it
    assert GraphView(loaded).tensor("f").shape == (1, 16)  # the shape Constant was read
    assert [d.dim_value for d in loaded.graph.output[0].type.tensor_type.shape.dim] == [1, 100]
    kept = [n.attribute[0].t.raw_data for n in loaded.graph.node if n.op_type == "Constant"]
    assert kept == [
        n.attribute[0].t.raw_data for n in original.graph.node if n.op_type == "Constant"
    ]
    assert original.SerializeToString() == before


def test_the_inferencer_sees_no_quantized_weight_and_the_model_keeps_it(monkeypatch):
    weight = np.random.default_rng(2).integers(-128, 128, size=(64, 100), dtype=np.int8)
    nodes = [
        helper.make_node("DequantizeLinear", ["w_q", "w_scale"], ["w"]),
        helper.make_node("MatMul", ["x", "w"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "int8_weight",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [
            numpy_helper.from_array(weight, "w_q"),  # 6.4 KB
            numpy_helper.from_array(np.array(0.02, np.float32), "w_scale"),
        ],
    )
    original = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    seen = _inferencer_input_sizes(monkeypatch)
    loaded = load_model(original)
    assert seen and max(seen) < 2048  # the int8 weight's bytes were not serialised for it
    assert [d.dim_value for d in loaded.graph.output[0].type.tensor_type.shape.dim] == [1, 100]
    assert numpy_helper.to_array(loaded.graph.initializer[0]).tobytes() == weight.tobytes()


def test_read_model_copies_a_model_proto_unless_it_is_handed_over():
    model = _relu_model()
    copied = read_model(model)
    assert copied is not model and copied == model
    assert read_model(model, owned=True) is model


def _traced_head_reshape(width: int | str = "w") -> onnx.ModelProto:
    """x [1, 4, W] → Transpose → Reshape to a constant [8, 2, 2] → Relu: a head reshape whose
    sequence length (W = 8) an export traced as a constant, as torch's TorchScript exporter
    writes nn.MultiheadAttention; the model runs at W = 8 only."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, width])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    nodes = [
        helper.make_node("Transpose", ["x"], ["t"], name="seq_first", perm=[2, 0, 1]),
        helper.make_node("Reshape", ["t", "heads"], ["h"], name="to_heads"),
        helper.make_node("Relu", ["h"], ["y"], name="act"),
    ]
    heads = numpy_helper.from_array(np.array([8, 2, 2], np.int64), "heads")
    graph = helper.make_graph(nodes, "g", [x], [y], [heads])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_an_input_shape_a_traced_reshape_cannot_take_is_refused():
    """Shape inference takes a Reshape's target shape as its output's without counting: the
    model loaded, and check counted segments, at a width ONNX Runtime refuses to run."""
    assert load_model(_traced_head_reshape(), input_shapes={"x": [1, 4, 8]})
    with pytest.raises(ShapeError, match=r"cannot run at input shape x=\[1, 4, 10\].*to_heads"):
        load_model(_traced_head_reshape(), input_shapes={"x": [1, 4, 10]})


def test_check_refuses_a_static_model_whose_reshape_cannot_take_its_input():
    from surgery.check import check_model

    assert check_model(_traced_head_reshape(8), "mlsoc").nodes_total == 3
    with pytest.raises(ShapeError, match=r"gets \[10, 1, 4\] \(40 values\) and makes \[8, 2, 2\]"):
        check_model(load_model(_traced_head_reshape(10)), "mlsoc")


def test_toposort_puts_a_loop_after_the_tensor_its_body_reads():
    body = loop_body_adding("s", [2])
    nodes = [
        helper.make_node("Loop", ["M", "", "x"], ["y"], name="loop", body=body),
        helper.make_node("Relu", ["x"], ["s"], name="relu"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        [numpy_helper.from_array(np.array(2, np.int64), "M")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model_mod.toposort_nodes(model)
    assert [n.name for n in model.graph.node] == ["relu", "loop"]
