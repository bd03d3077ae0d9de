"""Bracketed user text survives the CLI's rich output: names, shapes and messages such as
"out[0]" or "[batch, 3, 32, 32]" are printed as text, never eaten as console markup."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from typer.testing import CliRunner

from server.cli import app
from surgery import examples
from surgery.model import save_model

runner = CliRunner()

BRACKETED = "out[logits]"


def _run(*args: object):
    return runner.invoke(app, [str(a) for a in args])


def _rename_output(model: onnx.ModelProto, new: str) -> onnx.ModelProto:
    old = model.graph.output[0].name
    for node in model.graph.node:
        node.output[:] = [new if o == old else o for o in node.output]
    model.graph.output[0].name = new
    return model


def _dynamic_batch(model: onnx.ModelProto) -> onnx.ModelProto:
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "batch"
    return model


@pytest.fixture
def bracketed(tmp_path: Path) -> Path:
    """plain_cnn whose output tensor is named out[logits]."""
    return save_model(_rename_output(examples.plain_cnn(), BRACKETED), tmp_path / "a.onnx")


def test_verify_prints_a_bracketed_output_name_in_table_and_fail_line(bracketed, tmp_path):
    other = _rename_output(examples.plain_cnn(seed=1), BRACKETED)
    result = _run("verify", bracketed, save_model(other, tmp_path / "b.onnx"))
    assert result.exit_code == 1, result.output
    lines = result.output.splitlines()
    assert any("FAIL" in line and BRACKETED in line for line in lines[:-1]), result.output
    assert lines[-1].startswith(f"FAIL: {BRACKETED};"), result.output


@pytest.fixture
def lab_profile(tmp_path: Path) -> Path:
    """A user's target profile whose name and title carry brackets."""
    path = tmp_path / "lab.yaml"
    path.write_text('name: "lab[v2]"\nextends: mlsoc\ntitle: "Lab board [rev b]"\n')
    return path


def test_fix_prints_a_bracketed_target_in_remaining_blockers_and_output_path(
    lab_profile, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    save_model(examples.cnn_with_topk(), tmp_path / "topk.onnx")
    result = _run("fix", "topk.onnx", "-t", lab_profile, "-o", "topk[v2].onnx", "-w", "ws")
    assert result.exit_code == 1, result.output
    assert "× TopK: TopK is not supported on the MLA of lab[v2]" in result.output
    assert "wrote topk[v2].onnx" in result.output


def test_targets_prints_a_bracketed_profile_name_and_title(lab_profile):
    result = _run("targets", lab_profile)
    assert result.exit_code == 0, result.output
    assert result.output.startswith("lab[v2]: Lab board [rev b]\n")
    explained = _run("targets", lab_profile, "--op", "TopK")
    assert "TopK on lab[v2]: TopK is not in the lab[v2] op table" in explained.output


def test_check_prints_dynamic_input_dims_as_batch_3_32_32_in_brackets(tmp_path):
    model = save_model(_dynamic_batch(examples.plain_cnn()), tmp_path / "dyn.onnx")
    result = _run("check", model)
    assert result.exit_code == 1, result.output
    assert "dynamic inputs: input=[batch, 3, 32, 32]" in result.output


def test_error_message_keeps_the_bracketed_argument_it_quotes(bracketed):
    result = _run("verify", bracketed, bracketed, "--map", "out[logits]")
    assert result.exit_code == 2
    assert "error: --map 'out[logits]': expected A_OUT=B_OUT" in result.output


def test_split_summary_prints_bracketed_tensor_names(bracketed, tmp_path):
    result = _run("split", bracketed, "-o", tmp_path / "part.onnx", "--outputs", BRACKETED)
    assert result.exit_code == 0, result.output
    assert f"(input → {BRACKETED})" in result.output
