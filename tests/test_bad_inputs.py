"""Bad input is a clear, typed error that names the problem — never a hang, a traceback from
deep inside a library, a wrong success, or a file replaced that was not the user's to lose."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from typer.testing import CliRunner

from server.cli import app
from surgery import examples
from surgery.check import check_model
from surgery.errors import (
    InvalidGraphError,
    ModelFormatError,
    ModelNotFoundError,
    ShapeError,
    SurgeryError,
    TargetError,
    VerifyError,
)
from surgery.model import load_model, save_model
from surgery.rules import apply_rule
from surgery.rules.engine import RuleParamsError
from surgery.rules.fix import fix_model
from surgery.targets import load_target
from surgery.verify import load_inputs, verify_models

PROFILES = Path(__file__).resolve().parents[1] / "compiler" / "targets" / "profiles"


def _one_node(node: onnx.NodeProto, opset: int = 17) -> onnx.ModelProto:
    graph = helper.make_graph(
        [node],
        "one",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def test_a_fifo_as_the_model_is_refused_without_reading_it(tmp_path) -> None:
    fifo = tmp_path / "model.onnx"
    os.mkfifo(fifo)
    with pytest.raises(ModelNotFoundError, match="not a regular file"):
        check_model(fifo)


def test_a_fifo_as_the_output_is_refused_and_kept(tmp_path) -> None:
    fifo = tmp_path / "out.onnx"
    os.mkfifo(fifo)
    with pytest.raises(SurgeryError, match="not a regular file"):
        save_model(examples.plain_cnn(), fifo)
    assert fifo.is_fifo()


def test_an_output_below_a_file_names_that_file(tmp_path) -> None:
    (tmp_path / "model.onnx").write_bytes(b"x")
    with pytest.raises(SurgeryError, match="model.onnx is a file, not a folder"):
        save_model(examples.plain_cnn(), tmp_path / "model.onnx" / "out.onnx")


def test_a_node_with_too_many_inputs_is_invalid() -> None:
    with pytest.raises(
        InvalidGraphError, match=r"'relu' \(Relu\) has 2 input\(s\); Relu-14 takes 1"
    ):
        check_model(_one_node(helper.make_node("Relu", ["x", "x"], ["y"], name="relu")))


def test_an_attribute_of_the_wrong_type_is_named() -> None:
    node = helper.make_node("Transpose", ["x"], ["y"], name="tr", perm=1.5)
    with pytest.raises(InvalidGraphError, match="attribute 'perm' is FLOAT; Transpose takes INTS"):
        check_model(_one_node(node))


def test_an_attribute_given_twice_is_named_where_compile_reads_attributes(tmp_path) -> None:
    from compiler.compile import compile_model

    node = helper.make_node("Transpose", ["x"], ["y"], name="tr", perm=[0, 1, 3, 2])
    node.attribute.append(helper.make_attribute("perm", [0, 2, 3, 1]))
    with pytest.raises(InvalidGraphError, match="attribute 'perm' is given twice"):
        compile_model(_one_node(node), tmp_path)


def test_a_graph_without_outputs_is_invalid() -> None:
    model = _one_node(helper.make_node("Relu", ["x"], ["y"]))
    del model.graph.output[:]
    with pytest.raises(InvalidGraphError, match="no outputs"):
        check_model(model)


def test_an_opset_below_one_is_invalid() -> None:
    """Opset 0 has no schemas: node counts went unchecked and rules failed on a one-input Gather."""
    with pytest.raises(InvalidGraphError, match="opset 0 is not an ONNX opset"):
        check_model(_one_node(helper.make_node("Relu", ["x"], ["y"]), opset=0))


def test_an_opset_newer_than_onnx_knows_is_invalid() -> None:
    with pytest.raises(InvalidGraphError, match="opset 99 is newer"):
        check_model(_one_node(helper.make_node("Relu", ["x"], ["y"]), opset=99))


@pytest.mark.parametrize("dims", [[1, 3, -8, 32], [1, 3, 2**64, 32], [1, 3, 0, 32]])
def test_impossible_input_dims_are_refused(dims) -> None:
    model = examples.plain_cnn()
    model.graph.input[0].type.tensor_type.shape.dim[2].dim_param = "h"
    with pytest.raises(ShapeError, match="positive integers below 2\\*\\*63"):
        check_model(model, input_shapes={"input": dims})


def test_fix_input_shapes_refuses_a_negative_dim() -> None:
    model = examples.plain_cnn()
    model.graph.input[0].type.tensor_type.shape.dim[2].dim_param = "h"
    shapes = {"shapes": {"input": [1, 3, -8, 32]}}
    with pytest.raises(RuleParamsError, match="greater than 0"):
        apply_rule(load_model(model), "fix-input-shapes", params=shapes)


@pytest.mark.parametrize(("atol", "rtol"), [(float("nan"), 1e-3), (1e-4, float("nan"))])
def test_verify_refuses_a_nan_tolerance(atol, rtol) -> None:
    """NaN compares false with everything, so every difference would have passed."""
    with pytest.raises(VerifyError, match="finite and non-negative"):
        verify_models(examples.plain_cnn(), examples.plain_cnn(seed=1), atol=atol, rtol=rtol)


def test_verify_refuses_a_negative_seed() -> None:
    with pytest.raises(VerifyError, match="seed must be 0 or more"):
        verify_models(examples.plain_cnn(), examples.plain_cnn(), seed=-1)


def test_an_inputs_file_of_object_arrays_is_refused(tmp_path) -> None:
    np.savez(tmp_path / "obj.npz", input=np.array([1, "a", None], dtype=object))
    with pytest.raises(VerifyError, match="Object arrays cannot be loaded"):
        load_inputs(tmp_path / "obj.npz")


@pytest.mark.parametrize("source", [None, 5, b"onnx"])
def test_check_of_something_that_is_no_path_or_model_says_so(source) -> None:
    with pytest.raises(ModelFormatError, match="expected an .onnx path or an onnx.ModelProto"):
        check_model(source)


def test_a_target_that_is_no_name_or_path_says_so() -> None:
    with pytest.raises(TargetError, match="profile name or path, got int"):
        check_model(examples.plain_cnn(), target=5)


def test_fix_takes_a_path_as_check_does(tmp_path) -> None:
    path = save_model(examples.plain_cnn(), tmp_path / "cnn.onnx")
    assert fix_model(path).single_elf


def _profile(tmp_path: Path, old: str, new: str) -> Path:
    text = (PROFILES / "mlsoc.yaml").read_text(encoding="utf-8")
    assert old in text
    path = tmp_path / "custom.yaml"
    path.write_text(text.replace(old, new, 1), encoding="utf-8")
    return path


def test_a_profile_check_parameter_of_the_wrong_kind_names_the_constraint(tmp_path) -> None:
    path = _profile(tmp_path, "{check: rank, ranks: [4]}", "{check: rank, ranks: four}")
    with pytest.raises(TargetError, match=r"constraint \{check: rank, ranks: four\}"):
        check_model(examples.plain_cnn(), target=str(path))


@pytest.mark.parametrize("value", ["four", "0", "-5"])
def test_profile_hardware_constants_must_be_positive_numbers(tmp_path, value) -> None:
    path = _profile(tmp_path, "quads: 4", f"quads: {value}")
    with pytest.raises(TargetError, match="hardware.quads"):
        load_target(str(path))


def test_a_profile_that_is_not_utf8_says_so(tmp_path) -> None:
    path = tmp_path / "binary.yaml"
    path.write_bytes(b"\xff\xfe\x00name")
    with pytest.raises(TargetError, match="not UTF-8 text"):
        load_target(str(path))


def test_fix_that_cannot_write_its_output_stores_no_version(tmp_path) -> None:
    src = save_model(examples.yolo_head(), tmp_path / "yolo.onnx")
    (tmp_path / "blocker").write_bytes(b"a file where a folder should be")
    result = CliRunner().invoke(
        app,
        ["fix", str(src), "-o", str(tmp_path / "blocker" / "out.onnx"), "-w", str(tmp_path / "ws")],
    )
    assert result.exit_code == 2, result.output
    assert not (tmp_path / "ws" / "models" / "yolo").exists()


@pytest.mark.parametrize("kind", ["initializer", "graph input"])
def test_two_tensors_of_one_name_are_invalid(kind) -> None:
    model = examples.plain_cnn()
    g = model.graph
    if kind == "initializer":
        g.initializer.append(g.initializer[0])
    else:
        g.input.append(g.input[0])
    with pytest.raises(InvalidGraphError, match=f"two {kind}s are named"):
        check_model(model)
