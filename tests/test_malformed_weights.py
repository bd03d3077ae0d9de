"""A weight whose data does not fit its dims or type is named as the model's problem (where an
analysis tripped over it), and a rule that fails on a model warns in one line."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from surgery.check import check_model
from surgery.errors import InvalidGraphError, MalformedTensorError
from surgery.graph import tensor_data_problem
from surgery.rules.base import RuleContext
from surgery.rules.cleanup import RemoveIdentity
from surgery.rules.suggest import rule_matches
from surgery.verify import make_inputs


def _strided_conv(weight: onnx.TensorProto) -> onnx.ModelProto:
    """A Conv with stride 32 (beyond the MLA's 31): a blocker, whose weight the rules read."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 32, 32])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    conv = helper.make_node("Conv", ["x", "w"], ["y"], name="conv", strides=[32, 32])
    graph = helper.make_graph([conv], "g", [x], [y], initializer=[weight])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _weight() -> onnx.TensorProto:
    return numpy_helper.from_array(np.ones((4, 3, 3, 3), np.float32), "w")


def test_check_reports_the_blocker_of_a_model_with_whole_weights():
    assert check_model(_strided_conv(_weight())).blocker_names == {"conv"}


def test_check_names_a_truncated_weight_that_the_analysis_reads():
    weight = _weight()
    weight.raw_data = weight.raw_data[:216]
    with pytest.raises(InvalidGraphError, match=r"initializer 'w': raw_data size \(216 bytes\)"):
        check_model(_strided_conv(weight))


def test_more_values_than_the_dims_hold_is_a_problem():
    weight = helper.make_tensor("w", TensorProto.FLOAT, [3], [1.0, 2.0, 3.0])
    weight.dims[0] = 2
    assert "does not fit dims [2]" in tensor_data_problem(weight)


def test_an_element_type_onnx_does_not_define_is_a_problem():
    weight = _weight()
    weight.data_type = 99
    assert tensor_data_problem(weight) == "element type 99 is not an ONNX type"


@pytest.mark.parametrize(
    "tensor",
    [
        numpy_helper.from_array(np.ones((2, 3), np.float32), "raw"),
        helper.make_tensor("ints", TensorProto.INT64, [3], [1, 2, 3]),
        helper.make_tensor("bf16", TensorProto.BFLOAT16, [2], [1.0, 2.0]),
        helper.make_tensor("int4", TensorProto.INT4, [3], [1, -2, 3]),
        helper.make_tensor("scalar", TensorProto.FLOAT, [], [0.5]),
    ],
    ids=lambda t: t.name,
)
def test_well_formed_tensors_have_no_problem(tensor):
    assert tensor_data_problem(tensor) is None


class _FailingRule(RemoveIdentity):
    def find(self, ctx, params):
        raise RuntimeError("boom")


def test_a_failing_rule_warns_in_one_line_and_keeps_its_traceback_for_debugging(caplog):
    ctx = RuleContext.build(_strided_conv(_weight()), "mlsoc")
    with caplog.at_level(logging.DEBUG, logger="surgery.rules.suggest"):
        assert rule_matches(ctx, [_FailingRule()]) == []
    warning, debug = caplog.records
    assert warning.levelno == logging.WARNING and warning.exc_info is None
    assert (
        "remove-identity" in warning.getMessage() and "RuntimeError: boom" in warning.getMessage()
    )
    assert debug.levelno == logging.DEBUG and debug.exc_info is not None


def _truncated_conv_weight(model: onnx.ModelProto) -> str:
    """Cut the first 4-D initializer's data in half; its name."""
    weight = next(t for t in model.graph.initializer if len(t.dims) == 4 and t.raw_data)
    weight.raw_data = weight.raw_data[: len(weight.raw_data) // 2]
    return weight.name


def test_quantize_names_a_weight_whose_data_does_not_fit(plain_cnn):
    from compiler.quantize import quantize_model

    samples = [make_inputs(plain_cnn, seed=seed) for seed in range(2)]
    name = _truncated_conv_weight(plain_cnn)
    with pytest.raises(MalformedTensorError, match=rf"initializer '{name}': raw_data size"):
        quantize_model(plain_cnn, samples)


def test_compile_names_a_weight_whose_data_does_not_fit(plain_cnn, tmp_path):
    from compiler.compile import compile_model
    from compiler.quantize import quantize_model

    samples = [make_inputs(plain_cnn, seed=seed) for seed in range(2)]
    qdq = quantize_model(plain_cnn, samples).model
    name = _truncated_conv_weight(qdq)
    with pytest.raises(MalformedTensorError, match=rf"initializer '{name}'"):
        compile_model(qdq, tmp_path)
    assert not list(tmp_path.iterdir())  # nothing written


def test_inspect_names_an_element_type_onnx_does_not_define(plain_cnn, tmp_path):
    from typer.testing import CliRunner

    from server.cli import app

    plain_cnn.graph.initializer[0].data_type = 99
    onnx.save(plain_cnn, tmp_path / "m.onnx")
    args = ["inspect", str(tmp_path / "m.onnx"), "--node", "conv_3", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "element type 99" in result.output


def test_a_session_that_cannot_load_logs_nothing_of_its_own(tmp_path):
    """ORT's load failure (here its optimiser reading a bias whose data holds more values than
    its dims) is raised as a VerifyError; ORT logged it to stderr as well, in colour."""
    import subprocess
    import sys

    model = _strided_conv(_weight())
    bias = numpy_helper.from_array(np.ones(4, np.float32), "b")
    bias.dims[0] = 2
    model.graph.initializer.append(bias)
    model.graph.node[0].input.append("b")
    model.graph.node.append(helper.make_node("Relu", ["y"], ["z"], name="relu"))
    model.graph.output[0].name = "z"
    onnx.save(model, tmp_path / "m.onnx")
    code = (
        "import sys\n"
        "import onnx\n"
        "from surgery.errors import VerifyError\n"
        "from surgery.verify import ort_session\n"
        "try:\n"
        "    ort_session(onnx.load(sys.argv[1]))\n"
        "except VerifyError as error:\n"
        "    print('refused:', error.message[:60])\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "m.onnx")], capture_output=True, text=True
    )
    assert "refused: model: ONNX Runtime cannot load it" in run.stdout
    assert run.stderr == ""
