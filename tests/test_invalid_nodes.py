"""A node ONNX's shape inference finds invalid (pads of the wrong length, an axis out of range,
Split sizes that do not add up) is refused on load, naming the node, ONNX's reason and the
input shapes: ONNX Runtime refuses to load or to run it. check reported such a model with
"rank unknown" blockers, and compile failed inside its reference executor. Stale recorded shapes and custom ops are
not refused (they are read as before)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

from server.cli import app
from surgery.check import check_model
from surgery.errors import ShapeError
from surgery.verify import make_inputs

SHAPE = [1, 4, 8, 8]


def _model(node: onnx.NodeProto, initializers=(), x_shape=SHAPE, extra_outputs=()):
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in ("y", *extra_outputs)],
        initializer=list(initializers),
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _weight() -> onnx.TensorProto:
    return numpy_helper.from_array(np.ones((4, 4, 3, 3), np.float32), "w")


def _ints(values, name) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(values, np.int64), name)


INVALID = {
    "conv pads of the wrong length": (
        _model(helper.make_node("Conv", ["x", "w"], ["y"], name="n", pads=[1, 1, 1]), [_weight()]),
        "Attribute pads has incorrect size",
    ),
    "conv strides of the wrong length": (
        _model(helper.make_node("Conv", ["x", "w"], ["y"], name="n", strides=[2]), [_weight()]),
        "Attribute strides has incorrect size",
    ),
    "conv stride of zero": (
        _model(helper.make_node("Conv", ["x", "w"], ["y"], name="n", strides=[0, 1]), [_weight()]),
        "Attribute strides must only contain positive values",
    ),
    "pool kernel_shape of the wrong length": (
        _model(helper.make_node("MaxPool", ["x"], ["y"], name="n", kernel_shape=[2])),
        "Attribute kernel_shape has incorrect size",
    ),
    "softmax axis out of range": (
        _model(helper.make_node("Softmax", ["x"], ["y"], name="n", axis=7)),
        "'axis' must be in [-4 , 3]",
    ),
    "transpose perm with a repeated axis": (
        _model(helper.make_node("Transpose", ["x"], ["y"], name="n", perm=[0, 0, 1, 2])),
        "has repeated value: 0",
    ),
    "reshape target with two -1": (
        _model(helper.make_node("Reshape", ["x", "s"], ["y"], name="n"), [_ints([-1, -1], "s")]),
        "may not have multiple -1 dimensions",
    ),
    "split sizes that do not add up": (
        _model(
            helper.make_node("Split", ["x", "s"], ["y", "z"], name="n", axis=1),
            [_ints([1, 1], "s")],
            extra_outputs=["z"],
        ),
        "Mismatch between the sum of 'split' (2) and the split dimension of the input (4)",
    ),
}


@pytest.mark.parametrize("case", sorted(INVALID))
def test_an_invalid_node_is_refused_naming_it_and_the_reason(case):
    model, reason = INVALID[case]
    with pytest.raises(ShapeError) as raised:
        check_model(model)
    assert raised.value.message.startswith(f"g: node 'n' ({model.graph.node[0].op_type}): ")
    assert reason in raised.value.message
    assert "ONNX Runtime cannot run it either" in raised.value.hint
    assert raised.value.message.endswith("(at input shape x=[1, 4, 8, 8])")


@pytest.mark.parametrize("case", sorted(INVALID))
def test_onnx_runtime_refuses_to_load_each_model_check_refuses(case):
    model, _ = INVALID[case]
    with pytest.raises(Exception, match="ShapeInferenceError|TypeInferenceError"):
        ort.InferenceSession(model.SerializeToString())


def test_an_input_shape_that_breaks_a_node_is_named_in_the_refusal():
    """Concat of the input with a 4-wide constant works at width 4 only."""
    concat = helper.make_node("Concat", ["x", "c"], ["y"], name="n", axis=1)
    constant = numpy_helper.from_array(np.zeros((1, 2, 8, 4), np.float32), "c")
    model = _model(concat, [constant], x_shape=[1, 4, 8, "w"])
    assert check_model(model, input_shapes={"x": [1, 4, 8, 4]}).nodes_total == 1
    with pytest.raises(ShapeError, match=r"\(at input shape x=\[1, 4, 8, 5\]\)") as raised:
        check_model(model, input_shapes={"x": [1, 4, 8, 5]})
    assert "cannot run it at that shape" in raised.value.hint


def test_a_stale_recorded_output_shape_is_not_refused():
    model = _model(helper.make_node("Relu", ["x"], ["y"], name="n"))
    model.graph.output[0].CopyFrom(helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2]))
    assert check_model(model).nodes_total == 1


def test_a_custom_op_is_not_refused():
    node = helper.make_node("Foo", ["x"], ["y"], name="n", domain="my.ops")
    model = _model(node)
    model.opset_import.append(helper.make_opsetid("my.ops", 1))
    (placement,) = check_model(model).placements
    assert placement.processor == "APU"


def test_check_exits_2_with_onnx_runtimes_reason(tmp_path):
    path = tmp_path / "bad.onnx"
    onnx.save(INVALID["conv pads of the wrong length"][0], path)
    result = CliRunner().invoke(app, ["check", str(path)])
    assert result.exit_code == 2
    assert "node 'n' (Conv): Attribute pads has incorrect size" in result.output
    assert "Traceback" not in result.output


def test_compile_names_a_quantized_conv_whose_pads_were_damaged(plain_cnn, tmp_path):
    from compiler.compile import compile_model
    from compiler.quantize import quantize_model

    samples = [make_inputs(plain_cnn, seed=seed) for seed in range(2)]
    qdq = quantize_model(plain_cnn, samples).model
    conv = next(n for n in qdq.graph.node if n.op_type == "Conv")
    pads = next(a for a in conv.attribute if a.name == "pads")
    del pads.ints[1:]
    with pytest.raises(ShapeError, match=rf"node '{conv.name}' \(Conv\): Attribute pads"):
        compile_model(qdq, tmp_path)
    assert not list(tmp_path.iterdir())  # nothing written
