"""A convolution's or pool's window attributes must have one value per spatial axis (two for
`pads`): ONNX Runtime refuses such a node, onnx's lenient inference only leaves its output
unshaped. check names the node and the attribute (CLI exit 2) instead of reporting an
unknown rank, and compile does so instead of failing in its reference executor."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

from server.cli import app
from surgery.check import check_model
from surgery.errors import InvalidGraphError
from surgery.verify import make_inputs


def _windowed(op: str, x_shape: list[int], w_shape: list[int] | None, **attrs) -> onnx.ModelProto:
    inputs, initializers = ["x"], []
    if w_shape is not None:
        initializers.append(numpy_helper.from_array(np.ones(w_shape, np.float32), "w"))
        inputs.append("w")
    node = helper.make_node(op, inputs, ["y"], name="window", **attrs)
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=initializers,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


MALFORMED = [
    ("Conv", [1, 3, 8, 8], [4, 3, 3, 3], {"pads": [1, 1, 1]}, "pads", 4),
    ("Conv", [1, 3, 8, 8], [4, 3, 3, 3], {"pads": [1, 1, 1, 1, 1, 1]}, "pads", 4),
    ("Conv", [1, 3, 8, 8], [4, 3, 3, 3], {"strides": [2]}, "strides", 2),
    ("Conv", [1, 3, 8, 8], [4, 3, 3, 3], {"dilations": [1, 1, 1]}, "dilations", 2),
    ("ConvTranspose", [1, 3, 8, 8], [3, 4, 3, 3], {"output_padding": [1]}, "output_padding", 2),
    ("MaxPool", [1, 3, 8, 8], None, {"kernel_shape": [2]}, "kernel_shape", 2),
    ("LpPool", [1, 3, 8, 8], None, {"kernel_shape": [2, 2], "strides": [2, 2, 2]}, "strides", 2),
]


@pytest.mark.parametrize(("op", "x_shape", "w_shape", "attrs", "attribute", "wanted"), MALFORMED)
def test_a_window_attribute_of_the_wrong_length_is_named(
    op, x_shape, w_shape, attrs, attribute, wanted
):
    model = _windowed(op, x_shape, w_shape, **attrs)
    with pytest.raises(InvalidGraphError) as raised:
        check_model(model)
    message = str(raised.value)
    assert f"node 'window' ({op}): attribute '{attribute}'" in message
    assert f"its input is rank 4, so it takes {wanted}" in message


@pytest.mark.parametrize(("op", "x_shape", "w_shape", "attrs", "attribute", "wanted"), MALFORMED)
def test_onnx_runtime_refuses_each_model_check_refuses(
    op, x_shape, w_shape, attrs, attribute, wanted
):
    model = _windowed(op, x_shape, w_shape, **attrs)
    with pytest.raises(Exception, match=f"Attribute {attribute} has incorrect size"):
        ort.InferenceSession(model.SerializeToString())


def test_an_empty_pads_list_is_named():
    model = _windowed("Conv", [1, 3, 8, 8], [4, 3, 3, 3])
    model.graph.node[0].attribute.append(
        helper.make_attribute("pads", [], attr_type=onnx.AttributeProto.INTS)
    )
    with pytest.raises(InvalidGraphError, match="'pads' has 0 value"):
        check_model(model)


@pytest.mark.parametrize(
    ("x_shape", "w_shape", "attrs"),
    [
        ([1, 3, 8], [4, 3, 3], {"pads": [1, 1], "strides": [2]}),
        ([1, 3, 8, 8, 8], [4, 3, 3, 3, 3], {"pads": [1] * 6, "dilations": [1, 1, 1]}),
    ],
)
def test_one_and_three_dimensional_convolutions_are_placed(x_shape, w_shape, attrs):
    report = check_model(_windowed("Conv", x_shape, w_shape, **attrs))
    assert report.nodes_total == 1


def test_with_an_unknown_input_rank_the_weight_gives_the_spatial_rank():
    model = _windowed("Conv", [1, 3, 8, 8], [4, 3, 3, 3], pads=[1, 1])
    model.graph.input[0].type.tensor_type.ClearField("shape")
    with pytest.raises(InvalidGraphError, match="its weight is rank 4, so it takes 4"):
        check_model(model)


def test_check_exits_2_naming_the_attribute(tmp_path):
    path = tmp_path / "bad.onnx"
    onnx.save(_windowed("Conv", [1, 3, 8, 8], [4, 3, 3, 3], pads=[1, 1, 1]), path)
    result = CliRunner().invoke(app, ["check", str(path)])
    assert result.exit_code == 2
    assert "attribute 'pads' has 3 value(s)" in result.output
    assert "Traceback" not in result.output


def test_compile_names_a_quantized_conv_whose_pads_were_damaged(plain_cnn, tmp_path):
    from compiler.compile import compile_model
    from compiler.quantize import quantize_model

    samples = [make_inputs(plain_cnn, seed=seed) for seed in range(2)]
    qdq = quantize_model(plain_cnn, samples).model
    conv = next(n for n in qdq.graph.node if n.op_type == "Conv")
    pads = next(a for a in conv.attribute if a.name == "pads")
    del pads.ints[1:]
    with pytest.raises(InvalidGraphError, match=rf"node '{conv.name}' \(Conv\): attribute 'pads'"):
        compile_model(qdq, tmp_path)
    assert not list(tmp_path.iterdir())  # nothing written
