"""Numerical verification: metrics, pass/fail, input generation, output matching, CLI."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

import surgery.cli.verify  # noqa: F401  (registers the command)
from surgery.cli.app import app
from surgery.errors import VerifyError
from surgery.verify import make_inputs, run_model, verify_models

Dims = Sequence[int | str]


def _model(
    nodes: list[onnx.NodeProto],
    inputs: list[tuple[str, int, Dims]],
    outputs: list[tuple[str, int, Dims | None]],
    initializers: dict[str, np.ndarray] | None = None,
) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, t, list(s)) for n, t, s in inputs],
        [
            helper.make_tensor_value_info(n, t, None if s is None else list(s))
            for n, t, s in outputs
        ],
        [numpy_helper.from_array(v, k) for k, v in (initializers or {}).items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def add_model(c: float = 1.0, out: str = "y", dims: Dims = (1, 8)) -> onnx.ModelProto:
    """y = x + c with c a [1]-shaped initializer."""
    return _model(
        [helper.make_node("Add", ["x", "c"], [out])],
        [("x", TensorProto.FLOAT, dims)],
        [(out, TensorProto.FLOAT, dims)],
        {"c": np.array([c], np.float32)},
    )


def two_output_model(names: tuple[str, str], swap: bool = False) -> onnx.ModelProto:
    """Outputs names[0] = x + 1 and names[1] = 2x (swapped computations when `swap`)."""
    ops = [("Add", "one"), ("Mul", "two")]
    if swap:
        ops.reverse()
    return _model(
        [
            helper.make_node(op, ["x", const], [name])
            for (op, const), name in zip(ops, names, strict=True)
        ],
        [("x", TensorProto.FLOAT, (1, 8))],
        [(n, TensorProto.FLOAT, (1, 8)) for n in names],
        {"one": np.array([1.0], np.float32), "two": np.array([2.0], np.float32)},
    )


def unary_model(op: str, dims: Dims = (1, 8)) -> onnx.ModelProto:
    return _model(
        [helper.make_node(op, ["x"], ["y"])],
        [("x", TensorProto.FLOAT, dims)],
        [("y", TensorProto.FLOAT, dims)],
    )


def embedding_model(rows: int = 10) -> onnx.ModelProto:
    """Token ids (int64 [1, 16]) gathered from a rows x 4 table."""
    table = np.arange(rows * 4, dtype=np.float32).reshape(rows, 4)
    return _model(
        [helper.make_node("Gather", ["table", "ids"], ["emb"], axis=0)],
        [("ids", TensorProto.INT64, (1, 16))],
        [("emb", TensorProto.FLOAT, (1, 16, 4))],
        {"table": table},
    )


def argmax_model(negate: bool) -> onnx.ModelProto:
    nodes = [helper.make_node("Neg", ["x"], ["t"])] if negate else []
    nodes.append(helper.make_node("ArgMax", ["t" if negate else "x"], ["idx"], axis=1))
    return _model(nodes, [("x", TensorProto.FLOAT, (2, 8))], [("idx", TensorProto.INT64, (2, 1))])


@pytest.fixture
def model_files(tmp_path: Path) -> dict[str, Path]:
    paths = {
        "base": add_model(1.0),
        "same": add_model(1.0),
        "perturbed": add_model(1.0 + 1e-2),
    }
    files = {}
    for name, model in paths.items():
        files[name] = tmp_path / f"{name}.onnx"
        onnx.save(model, files[name])
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\x8f\x02not an onnx model at all\xff\xfe" * 16)
    files["garbage"] = garbage
    return files


# --------------------------------------------------------------------------- verdicts


def test_identical_models_pass_with_cosine_one_and_infinite_sqnr():
    result = verify_models(add_model(), add_model())
    assert result.passed
    (out,) = result.outputs
    assert out.max_abs == 0.0
    assert out.cosine == pytest.approx(1.0)
    assert out.sqnr_db == math.inf
    assert result.worst["min_sqnr_db"] == math.inf


def test_perturbed_constant_fails_exact_mode():
    result = verify_models(add_model(1.0), add_model(1.01), exact=True)
    assert not result.passed
    assert "exact" in result.outputs[0].message


def test_perturbed_constant_fails_tight_atol():
    result = verify_models(add_model(1.0), add_model(1.01), atol=1e-3, rtol=0.0)
    assert not result.passed
    assert result.failed_outputs == ["y"]


def test_perturbed_constant_passes_loose_atol():
    assert verify_models(add_model(1.0), add_model(1.01), atol=2e-2, rtol=0.0).passed


def test_constant_offset_gives_known_metrics():
    c = 0.25
    out = verify_models(add_model(0.0), add_model(c)).outputs[0]
    assert out.max_abs == pytest.approx(c, abs=1e-6)
    assert out.mean_abs == pytest.approx(c, abs=1e-6)
    assert out.min_atol == pytest.approx(c, abs=1e-6)
    assert out.mismatches == out.size == 8


def test_sqnr_matches_definition():
    ref = make_inputs(add_model(0.0))["x"].astype(np.float64)
    out = verify_models(add_model(0.0), add_model(0.1)).outputs[0]
    expected = 10 * math.log10(np.sum(ref**2) / np.sum(np.full_like(ref, 0.1) ** 2))
    assert out.sqnr_db == pytest.approx(expected, abs=1e-3)


def test_shape_mismatch_is_a_failed_output_not_an_exception():
    shape = {"shape": np.array([8], np.int64)}
    reshaped = _model(
        [helper.make_node("Reshape", ["x", "shape"], ["y"])],
        [("x", TensorProto.FLOAT, (1, 8))],
        [("y", TensorProto.FLOAT, (8,))],
        shape,
    )
    result = verify_models(unary_model("Identity"), reshaped)
    assert not result.passed
    assert "shape differs" in result.outputs[0].message


def test_integer_outputs_compare_exactly_and_count_mismatches():
    same = verify_models(argmax_model(False), argmax_model(False))
    differ = verify_models(argmax_model(False), argmax_model(True), atol=1e6)
    assert same.passed and same.outputs[0].mismatches == 0
    assert not differ.passed and differ.outputs[0].mismatches > 0
    assert differ.outputs[0].cosine is None


def test_more_samples_never_report_a_smaller_worst_error():
    one = verify_models(unary_model("Identity"), unary_model("Sqrt"), samples=1)
    many = verify_models(unary_model("Identity"), unary_model("Sqrt"), samples=4)
    assert many.samples == 4
    assert many.outputs[0].max_abs >= one.outputs[0].max_abs


# --------------------------------------------------------------------------- matching


def test_outputs_match_by_name_regardless_of_order():
    a = two_output_model(("y1", "y2"))
    b = two_output_model(("y2", "y1"), swap=True)
    result = verify_models(a, b)
    assert result.passed
    assert [(o.name, o.name_b, o.matched_by) for o in result.outputs] == [
        ("y1", "y1", "name"),
        ("y2", "y2", "name"),
    ]


def test_outputs_fall_back_to_position_when_names_differ():
    result = verify_models(two_output_model(("y1", "y2")), two_output_model(("out0", "out1")))
    assert result.passed
    assert [o.matched_by for o in result.outputs] == ["position", "position"]
    assert any("by position" in note for note in result.notes)


def test_output_map_overrides_position():
    a = two_output_model(("y1", "y2"))
    b = two_output_model(("p", "q"), swap=True)
    assert not verify_models(a, b).passed
    result = verify_models(a, b, output_map={"y1": "q", "y2": "p"})
    assert result.passed
    assert {o.matched_by for o in result.outputs} == {"map"}


def test_output_map_with_unknown_name_is_a_verify_error():
    with pytest.raises(VerifyError, match="nope"):
        verify_models(add_model(), add_model(), output_map={"y": "nope"})


# --------------------------------------------------------------------------- inputs


def test_npz_inputs_are_used(tmp_path: Path):
    # Relu == Identity on the default [0, 1) inputs; only negative file values tell them apart.
    npz = tmp_path / "in.npz"
    np.savez(npz, x=-np.ones((1, 8), np.float32))
    assert verify_models(unary_model("Relu"), unary_model("Identity")).passed
    result = verify_models(unary_model("Relu"), unary_model("Identity"), inputs=npz)
    assert not result.passed
    assert result.outputs[0].max_abs == pytest.approx(1.0)


def test_npz_missing_an_input_is_a_verify_error_naming_it(tmp_path: Path):
    npz = tmp_path / "in.npz"
    np.savez(npz, other=np.zeros((1, 8), np.float32))
    with pytest.raises(VerifyError, match="'x'"):
        verify_models(add_model(), add_model(), inputs=npz)


def test_token_ids_stay_within_embedding_table():
    ids = make_inputs(embedding_model(rows=10), seed=3)["ids"]
    assert ids.dtype == np.int64
    assert ids.min() >= 0 and ids.max() < 10
    assert verify_models(embedding_model(10), embedding_model(10), samples=3).passed


def test_plain_integer_inputs_default_to_small_range():
    model = _model(
        [helper.make_node("Identity", ["n"], ["m"])],
        [("n", TensorProto.INT32, (64,))],
        [("m", TensorProto.INT32, (64,))],
    )
    n = make_inputs(model)["n"]
    assert n.dtype == np.int32 and n.min() >= 0 and n.max() < 100


def test_integer_mask_inputs_hold_zeros_and_ones():
    model = _model(
        [helper.make_node("Identity", ["attention_mask"], ["m"])],
        [("attention_mask", TensorProto.INT64, (1, 64))],
        [("m", TensorProto.INT64, (1, 64))],
    )
    mask = make_inputs(model)["attention_mask"]
    assert set(np.unique(mask).tolist()) == {0, 1}


def test_float_inputs_are_seeded_and_in_unit_range():
    first, again = make_inputs(add_model(), seed=7)["x"], make_inputs(add_model(), seed=7)["x"]
    assert first.dtype == np.float32
    assert np.array_equal(first, again)
    assert first.min() >= 0.0 and first.max() < 1.0


def test_dynamic_dims_become_one_and_are_noted():
    result = verify_models(add_model(dims=("N", 8)), add_model(dims=("N", 8)))
    assert result.inputs[0].shape == (1, 8)
    assert any("set to 1" in note for note in result.notes)


def test_a_dynamic_model_a_takes_the_static_shape_of_model_b():
    """A model against its shape-fixed version: both run at B's shape, not A's dims as 1."""
    result = verify_models(add_model(dims=("N", "W")), add_model(dims=(3, 8)))
    assert result.passed and result.inputs[0].shape == (3, 8)
    assert any("take model B's static shape: x=[3, 8]" in note for note in result.notes)


def test_input_shapes_fix_dynamic_dims():
    assert make_inputs(add_model(dims=("N", 8)), input_shapes={"x": [3, 8]})["x"].shape == (3, 8)


def test_run_model_returns_outputs_by_name():
    outputs = run_model(add_model(2.0), {"x": np.zeros((1, 8), np.float32)})
    assert list(outputs) == ["y"]
    assert np.allclose(outputs["y"], 2.0)


# --------------------------------------------------------------------------- errors


def test_garbage_file_is_a_verify_error_naming_model(model_files: dict[str, Path]):
    with pytest.raises(VerifyError, match="model B"):
        verify_models(model_files["base"], model_files["garbage"])


def test_model_ort_cannot_load_is_a_verify_error_naming_model():
    bogus = _model(
        [helper.make_node("NotAnOp", ["x"], ["y"])],
        [("x", TensorProto.FLOAT, (1, 8))],
        [("y", TensorProto.FLOAT, (1, 8))],
    )
    with pytest.raises(VerifyError, match=r"model B .*ONNX Runtime cannot load it") as info:
        verify_models(add_model(), bogus)
    assert "\n" not in info.value.message


def test_model_b_needing_an_input_a_lacks_is_a_verify_error():
    b = _model(
        [helper.make_node("Add", ["x", "z"], ["y"])],
        [("x", TensorProto.FLOAT, (1, 8)), ("z", TensorProto.FLOAT, (1, 8))],
        [("y", TensorProto.FLOAT, (1, 8))],
    )
    with pytest.raises(VerifyError, match="'z'"):
        verify_models(add_model(), b)


def test_result_to_dict_is_json_safe_with_inf_as_string():
    data = json.loads(json.dumps(verify_models(add_model(), add_model()).to_dict()))
    assert data["passed"] is True
    assert data["outputs"][0]["sqnr_db"] == "inf"
    assert data["worst"]["min_cosine"] == pytest.approx(1.0)


# --------------------------------------------------------------------------- CLI

runner = CliRunner()


def test_cli_exits_0_when_models_match(model_files: dict[str, Path]):
    result = runner.invoke(app, ["verify", str(model_files["base"]), str(model_files["same"])])
    assert result.exit_code == 0, result.output
    assert "PASS" in result.output


def test_cli_exits_1_when_outputs_differ(model_files: dict[str, Path]):
    args = ["verify", str(model_files["base"]), str(model_files["perturbed"]), "--exact"]
    result = runner.invoke(app, args)
    assert result.exit_code == 1, result.output
    assert "FAIL" in result.output


def test_cli_exits_2_on_unreadable_model(model_files: dict[str, Path]):
    result = runner.invoke(app, ["verify", str(model_files["garbage"]), str(model_files["base"])])
    assert result.exit_code == 2
    assert "model A" in result.output


def test_cli_json_output_parses(model_files: dict[str, Path]):
    args = ["verify", str(model_files["base"]), str(model_files["perturbed"])]
    result = runner.invoke(app, [*args, "--atol", "0.1", "--samples", "2", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["passed"] is True and data["samples"] == 2
    assert data["outputs"][0]["max_abs"] == pytest.approx(0.01, abs=1e-6)


def test_cli_bad_map_spec_exits_2(model_files: dict[str, Path]):
    args = ["verify", str(model_files["base"]), str(model_files["same"]), "--map", "y"]
    assert runner.invoke(app, args).exit_code == 2


def test_models_over_protobuf_limit_run_from_external_data(monkeypatch: pytest.MonkeyPatch):
    # Pretend the model is over 2 GB; a 4 KB table makes save_model write a real data file.
    monkeypatch.setattr("surgery.verify.model_nbytes", lambda model: 2**40)
    assert verify_models(embedding_model(rows=256), embedding_model(rows=256)).passed


def _unsqueeze_with_runtime_axes() -> onnx.ModelProto:
    """ORT's UnsqueezeElimination logs a warning that it cannot remove this node."""
    data = numpy_helper.from_array(np.ones(4, np.float32), "data")
    graph = helper.make_graph(
        [helper.make_node("Unsqueeze", ["data", "axes"], ["y"], name="unsqueeze")],
        "g",
        [helper.make_tensor_value_info("axes", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [data],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_sessions_without_options_stay_quiet_after_quiet_ort_logging(
    capfd: pytest.CaptureFixture[str],
):
    """onnx-graphsurgeon's fold_constants opens such sessions; ORT's default logger prints."""
    import onnxruntime as ort

    from surgery.ort_logging import quiet_ort_logging

    model = _unsqueeze_with_runtime_axes().SerializeToString()
    ort.set_default_logger_severity(2)  # ORT's default in a fresh process: warnings
    ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    assert "UnsqueezeElimination" in capfd.readouterr().err
    quiet_ort_logging()
    ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    assert "UnsqueezeElimination" not in capfd.readouterr().err


def test_onnx_runtime_reads_the_model_without_our_value_infos(monkeypatch):
    """The reference is the model as exported: our inferred value infos (data-propagated) are
    set aside while ONNX Runtime loads it — given them, it failed to run torchvision's FCOS —
    and the caller's model keeps them."""
    import surgery.verify as verify_module
    from surgery.model import load_model

    model = load_model(two_output_model(("a", "b")))
    model.graph.value_info.append(helper.make_tensor_value_info("extra", TensorProto.FLOAT, [1]))
    kept = [v.SerializeToString() for v in model.graph.value_info]
    loaded: list[onnx.ModelProto] = []
    real_open = verify_module._open_session

    def spy(data, options, label):
        loaded.append(onnx.load_from_string(data))
        return real_open(data, options, label)

    monkeypatch.setattr(verify_module, "_open_session", spy)
    verify_module.ort_session(model)
    assert loaded and len(loaded[0].graph.value_info) == 0
    assert [v.SerializeToString() for v in model.graph.value_info] == kept


def test_an_input_too_large_to_draw_is_a_typed_error_naming_it(plain_cnn):
    plain_cnn.graph.input[0].type.tensor_type.shape.dim[2].dim_value = 2**40
    with pytest.raises(VerifyError, match=r"input 'input' has shape \[1, 3, 1099511627776, 32\]"):
        make_inputs(plain_cnn)


def test_fix_of_a_model_with_an_input_too_large_to_draw_says_how_to_size_it(yolo_head):
    from surgery.rules.fix import fix_model

    yolo_head.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 2**40
    with pytest.raises(VerifyError, match="too many to draw") as raised:
        fix_model(yolo_head, "mlsoc")
    assert "--input-shape" in raised.value.hint


def _relu(quantized: bool) -> onnx.ModelProto:
    """y = Relu(x), or Relu of x quantized with a step of 0.1 (Q → DQ → Relu)."""
    if not quantized:
        return _model(
            [helper.make_node("Relu", ["x"], ["y"])],
            [("x", TensorProto.FLOAT, (1, 8))],
            [("y", TensorProto.FLOAT, (1, 8))],
        )
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
        helper.make_node("DequantizeLinear", ["q", "s", "z"], ["d"]),
        helper.make_node("Relu", ["d"], ["y"]),
    ]
    constants = {"s": np.array(0.1, np.float32), "z": np.array(0, np.int8)}
    return _model(
        nodes, [("x", TensorProto.FLOAT, (1, 8))], [("y", TensorProto.FLOAT, (1, 8))], constants
    )


def test_a_failed_float_against_quantized_comparison_says_why():
    result = verify_models(_relu(False), _relu(True))
    assert not result.passed
    assert any(n.startswith("model B is quantized and the other is not") for n in result.notes)


def test_a_failed_comparison_of_two_float_models_has_no_quantization_note():
    result = verify_models(add_model(1.0), add_model(1.5))
    assert not result.passed
    assert not any("quantized" in n for n in result.notes)
