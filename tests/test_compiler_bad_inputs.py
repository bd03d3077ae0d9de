"""Bad input to quantize / compile / run: one clear `SurgeryError` (CLI exit 2, one line), never
a traceback, and a message that names the file, node, tensor or option at fault."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

from compiler.api import Model, load_model
from compiler.compile import compile_model
from compiler.defines import QuantizationParams
from compiler.lower.errors import CompileError
from compiler.quantize import quantize_model
from server.cli import app
from surgery.errors import SurgeryError
from surgery.targets.profile import profile_dir
from tests.conftest import loop_body_adding

runner = CliRunner()
SHAPE = [1, 3, 8, 8]


def _save(path: Path, nodes, inputs, outputs, initializers=(), opsets=(("", 17),)) -> Path:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def _x() -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info("x", TensorProto.FLOAT, SHAPE)


def _y() -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info("y", TensorProto.FLOAT, SHAPE)


def _conv_model(path: Path) -> Path:
    weight = np.random.default_rng(0).random((3, 3, 3, 3)).astype(np.float32)
    conv = helper.make_node("Conv", ["x", "W"], ["y"], name="conv", pads=[1, 1, 1, 1])
    return _save(path, [conv], [_x()], [_y()], [numpy_helper.from_array(weight, "W")])


def _sequence_input_model(path: Path) -> Path:
    s = helper.make_tensor_sequence_value_info("s", TensorProto.FLOAT, None)
    index = numpy_helper.from_array(np.array(0, np.int64), "i")
    node = helper.make_node("SequenceAt", ["s", "i"], ["y"], name="sa")
    return _save(path, [node], [s], [_y()], [index])


def _error(result) -> dict:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    return json.loads(result.stdout)["error"]


@pytest.fixture(scope="module")
def calib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("calib")
    rng = np.random.default_rng(0)
    for k in range(4):
        np.save(folder / f"{k}.npy", rng.random(SHAPE).astype(np.float32))
    return folder


@pytest.fixture(scope="module")
def mychip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The mlsoc profile under another name, as a user's own profile file."""
    text = (profile_dir() / "mlsoc.yaml").read_text()
    assert "\nname: mlsoc\n" in text
    path = tmp_path_factory.mktemp("profile") / "mychip.yaml"
    path.write_text(text.replace("\nname: mlsoc\n", "\nname: mychip\n"))
    return path


# --------------------------------------------------------------------------- compile


def test_compile_of_an_op_without_schema_is_a_compile_error_naming_node_and_op(
    tmp_path: Path,
) -> None:
    model = _save(
        tmp_path / "unk.onnx", [helper.make_node("FooBar", ["x"], ["y"], name="n1")], [_x()], [_y()]
    )
    error = _error(runner.invoke(app, ["compile", str(model), "-o", str(tmp_path), "--json"]))
    assert error["code"] == "compile_error"
    assert "'n1'" in error["message"] and "FooBar" in error["message"]
    assert "no ONNX schema" in error["message"]


def test_compile_of_a_custom_domain_op_without_kernel_is_a_compile_error(tmp_path: Path) -> None:
    node = helper.make_node("Foo", ["x"], ["y"], name="n1", domain="com.example")
    model = _save(
        tmp_path / "custom.onnx", [node], [_x()], [_y()], opsets=(("", 17), ("com.example", 1))
    )
    with pytest.raises(CompileError, match=r"node 'n1': com\.example:Foo has no kernel"):
        compile_model(model, tmp_path / "out")


def test_compile_of_a_sequence_input_says_it_is_not_a_tensor(tmp_path: Path) -> None:
    model = _sequence_input_model(tmp_path / "seq.onnx")
    error = _error(runner.invoke(app, ["compile", str(model), "-o", str(tmp_path), "--json"]))
    assert error["code"] == "compile_error"
    assert "input 's'" in error["message"] and "is a sequence, not a tensor" in error["message"]


def test_compile_of_an_optional_input_says_it_is_not_a_tensor(tmp_path: Path) -> None:
    optional = helper.make_value_info(
        "o",
        helper.make_optional_type_proto(helper.make_tensor_type_proto(TensorProto.FLOAT, SHAPE)),
    )
    node = helper.make_node("OptionalGetElement", ["o"], ["y"], name="get")
    model = _save(tmp_path / "opt.onnx", [node], [optional], [_y()], opsets=(("", 18),))
    with pytest.raises(CompileError, match=r"input 'o' .*is an optional, not a tensor"):
        compile_model(model, tmp_path / "out")


def test_compile_of_a_sequence_output_says_it_is_not_a_tensor(tmp_path: Path) -> None:
    """It compiled, into an archive whose host stage ONNX Runtime then refused to load."""
    s = helper.make_tensor_sequence_value_info("s", TensorProto.FLOAT, None)
    node = helper.make_node("SplitToSequence", ["x"], ["s"], name="split", axis=1)
    model = _save(tmp_path / "seq_out.onnx", [node], [_x()], [s])
    with pytest.raises(CompileError, match=r"output 's' .*is a sequence, not a tensor"):
        compile_model(model, tmp_path / "out")


def test_compile_structural_error_names_the_file_not_the_graph(tmp_path: Path) -> None:
    nodes = [
        helper.make_node("Relu", ["b"], ["a"], name="n1"),
        helper.make_node("Relu", ["a"], ["b"], name="n2"),
        helper.make_node("Add", ["x", "b"], ["y"], name="n3"),
    ]
    model = _save(tmp_path / "cycle.onnx", nodes, [_x()], [_y()])
    error = _error(runner.invoke(app, ["compile", str(model), "-o", str(tmp_path), "--json"]))
    assert error["message"].startswith(f"{model}: the graph has a cycle")


# --------------------------------------------------------------------------- quantize


def test_quantize_of_a_sequence_input_says_it_is_not_a_tensor(tmp_path: Path, calib) -> None:
    model = _sequence_input_model(tmp_path / "seq.onnx")
    args = ["quantize", str(model), "--calib", str(calib), "-o", str(tmp_path / "q.onnx")]
    error = _error(runner.invoke(app, [*args, "--json"]))
    assert "input 's' is a sequence, not a tensor" in error["message"]


def test_quantize_model_of_a_sequence_input_fails_before_reading_samples(tmp_path: Path) -> None:
    model = onnx.load(_sequence_input_model(tmp_path / "seq.onnx"))
    read: list[int] = []

    def samples():
        read.append(1)
        yield np.zeros(SHAPE, np.float32)

    with pytest.raises(SurgeryError, match="input 's' is a sequence, not a tensor"):
        quantize_model(model, samples())
    assert not read


@pytest.mark.parametrize("value", ["200", "-1"])
def test_quantize_percentile_out_of_range_is_a_clean_error(
    tmp_path: Path, calib, value: str
) -> None:
    model = _conv_model(tmp_path / "m.onnx")
    args = ["quantize", str(model), "--calib", str(calib), "-o", str(tmp_path / "q.onnx")]
    flags = ["--method", "percentile", "--percentile", value, "--json"]
    error = _error(runner.invoke(app, [*args, *flags]))
    assert error["message"] == f"--percentile {value}: must be in (0, 100]"


@pytest.mark.parametrize("value", ["0", "-5"])
def test_quantize_too_few_bins_is_a_clean_error(tmp_path: Path, calib, value: str) -> None:
    model = _conv_model(tmp_path / "m.onnx")
    args = ["quantize", str(model), "--calib", str(calib), "-o", str(tmp_path / "q.onnx")]
    error = _error(runner.invoke(app, [*args, "--bins", value, "--json"]))
    assert error["message"].startswith(f"--bins {value}: needs an integer ≥ 128")


def test_quantize_accepts_a_profile_file_of_a_target_that_is_not_built_in(
    tmp_path: Path, calib, mychip: Path
) -> None:
    model = _conv_model(tmp_path / "m.onnx")
    out = tmp_path / "q.onnx"
    args = ["quantize", str(model), "--calib", str(calib), "-t", str(mychip), "-o", str(out)]
    result = runner.invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["target"] == "mychip" and out.is_file()


@pytest.fixture(scope="module")
def mychip_archive(tmp_path_factory: pytest.TempPathFactory, mychip: Path):
    """A conv model quantized (API) and compiled for the profile file's target."""
    folder = tmp_path_factory.mktemp("mychip")
    net = load_model(_conv_model(folder / "m.onnx"), target=str(mychip))
    samples = [np.random.default_rng(k).random(SHAPE).astype(np.float32) for k in range(3)]
    return net.quantize(samples).compile(folder / "out")


def test_a_model_quantized_for_a_profile_file_compiles_for_that_profile(mychip_archive) -> None:
    assert mychip_archive.target == "mychip" and len(mychip_archive.elf_files) == 1
    assert not any("quantized for" in note for note in mychip_archive.notes)


def test_run_of_an_archive_for_a_profile_file_takes_that_profile(
    mychip_archive, mychip: Path
) -> None:
    run = runner.invoke(app, ["run", str(mychip_archive.archive), "-t", str(mychip), "--json"])
    assert run.exit_code == 0, run.output
    error = _error(runner.invoke(app, ["run", str(mychip_archive.archive), "--json"]))
    assert "'mychip'" in error["message"] and "--target" in (error["hint"] or "")


def test_compile_without_target_of_a_model_quantized_for_a_profile_file_asks_for_it(
    tmp_path: Path, calib, mychip: Path
) -> None:
    model = _conv_model(tmp_path / "m.onnx")
    out = tmp_path / "q.onnx"
    args = ["quantize", str(model), "--calib", str(calib), "-t", str(mychip), "-o", str(out)]
    assert runner.invoke(app, args).exit_code == 0
    error = _error(runner.invoke(app, ["compile", str(out), "-o", str(tmp_path), "--json"]))
    assert "'mychip'" in error["message"] and "--target" in (error["hint"] or "")


def test_quantize_names_the_calibration_files_it_cannot_read(tmp_path: Path) -> None:
    model = _conv_model(tmp_path / "m.onnx")
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "a.jpg").write_text("not a jpeg")
    (junk / "b.png").write_bytes(bytes(range(256)))
    args = ["quantize", str(model), "--calib", str(junk), "-o", str(tmp_path / "q.onnx")]
    error = _error(runner.invoke(app, [*args, "--json"]))
    assert "2 of 2 samples cannot be used" in error["message"]
    assert f"{junk / 'a.jpg'}: cannot decode the image" in error["message"]
    assert f"{junk / 'b.png'}: cannot decode the image" in error["message"]


def test_quantize_of_an_invalid_float_model_blames_the_model_not_the_quantizer(
    tmp_path: Path, calib
) -> None:
    model = _save(
        tmp_path / "unk.onnx", [helper.make_node("FooBar", ["x"], ["y"], name="n1")], [_x()], [_y()]
    )
    args = ["quantize", str(model), "--calib", str(calib), "-o", str(tmp_path / "q.onnx")]
    error = _error(runner.invoke(app, [*args, "--json"]))
    assert "quantizer bug" not in error["message"]
    assert error["message"].startswith("the input model is not valid ONNX")
    assert "FooBar" in error["message"]


def test_onnx_runtime_refusing_the_quantized_model_says_so_once(tmp_path: Path) -> None:
    node = helper.make_node("Transpose", ["x"], ["y"], name="tr", perm=[0, 1, 2, 7])
    graph = helper.make_graph([node], "g", [_x()], [_y()])
    bad = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model = Model(bad, "mlsoc", "m", QuantizationParams())
    with pytest.raises(SurgeryError) as info:
        model.execute(np.zeros(SHAPE, np.float32))
    assert info.value.message.startswith("ONNX Runtime cannot load the quantized model: ")
    assert info.value.message.count("ONNX Runtime") == 1


def _loop_reading_an_outer_tensor(tmp_path: Path) -> Path:
    """conv → Relu → `seq`, then a Loop whose body adds `seq` to its state: `seq` is read only
    inside the body, as a Keras LSTM's Loop reads its sequence."""
    body = loop_body_adding("seq", SHAPE)
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c1"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["seq"], name="relu"),
        helper.make_node("Loop", ["M", "", "x"], ["y"], name="loop", body=body),
    ]
    rng = np.random.default_rng(0)
    initializers = [
        numpy_helper.from_array(np.array(2, np.int64), "M"),
        numpy_helper.from_array(rng.standard_normal((3, 3, 3, 3)).astype(np.float32), "w"),
    ]
    return _save(tmp_path / "loop_outer.onnx", nodes, [_x()], [_y()], initializers)


def test_quantize_keeps_a_loop_after_the_outer_tensor_its_body_reads(tmp_path: Path, calib):
    out = tmp_path / "q.onnx"
    args = ["quantize", str(_loop_reading_an_outer_tensor(tmp_path)), "--calib", str(calib)]
    result = runner.invoke(app, [*args, "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    onnx.checker.check_model(onnx.load(out), full_check=True)


def test_quantize_keeps_an_initializer_only_a_loop_body_reads(tmp_path: Path, calib) -> None:
    body = loop_body_adding("one", SHAPE)
    loop = helper.make_node("Loop", ["M", "", "x"], ["y"], name="loop", body=body)
    initializers = [
        numpy_helper.from_array(np.array(3, np.int64), "M"),
        numpy_helper.from_array(np.ones(1, np.float32), "one"),
    ]
    model = _save(tmp_path / "loop.onnx", [loop], [_x()], [_y()], initializers)
    out = tmp_path / "q.onnx"
    args = ["quantize", str(model), "--calib", str(calib), "-o", str(out), "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "one" in {t.name for t in onnx.load(out).graph.initializer}
    assert json.loads(result.stdout)["outputs"]["y"]["cosine"] > 0.999
