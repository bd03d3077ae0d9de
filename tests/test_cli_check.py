"""The `surgery check / inspect / targets / demo` commands: output, JSON and exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

import onnx
import pytest
from typer.testing import CliRunner

from server.cli import app
from surgery import examples
from surgery.model import save_model

runner = CliRunner()


def _run(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def test_check_single_segment_exits_zero(plain_cnn, save):
    result = _run("check", save(plain_cnn))
    assert result.exit_code == 0, result.output
    assert "single .elf" in result.output


def test_check_two_segments_exits_one(cnn_with_topk, save):
    result = _run("check", save(cnn_with_topk))
    assert result.exit_code == 1
    assert "2 MLA segments" in result.output


def test_check_json_is_machine_readable(cnn_with_topk, save):
    result = _run("check", save(cnn_with_topk), "--json")
    data = json.loads(result.stdout)
    assert data["mla_segments"] == 2 and data["single_elf"] is False
    assert data["blockers"][0]["op_type"] == "TopK"


def test_check_input_shape_option_fixes_dynamic_inputs(plain_cnn, save):
    plain_cnn.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "batch"
    path = save(plain_cnn)
    assert _run("check", path).exit_code == 1
    assert _run("check", path, "--input-shape", "input=1,3,32,32").exit_code == 0


def test_check_missing_file_exits_two_without_traceback(tmp_path):
    result = _run("check", tmp_path / "nope.onnx")
    assert result.exit_code == 2
    assert "no such file" in result.output
    assert "Traceback" not in result.output


def test_check_unknown_target_exits_two(plain_cnn, save):
    result = _run("check", save(plain_cnn), "--target", "tpu9000")
    assert result.exit_code == 2 and "unknown target" in result.output


def test_check_json_error_is_json(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"junk" * 50)
    result = _run("check", bad, "--json")
    assert result.exit_code == 2
    assert json.loads(result.stdout)["error"]["code"] == "not_onnx"


def test_inspect_summary_and_node_query(yolo_head, save):
    path = save(yolo_head)
    summary = json.loads(_run("inspect", path, "--json").stdout)
    assert summary["nodes"] == len(yolo_head.graph.node)
    node = json.loads(_run("inspect", path, "--node", "split_36", "--json").stdout)
    assert node["op_type"] == "Split"
    found = json.loads(_run("inspect", path, "--op", "Sigmoid", "--json").stdout)
    assert found["count"] == 5


def test_targets_lists_and_explains():
    assert "rk3588" in _run("targets").output
    explained = json.loads(_run("targets", "mlsoc", "--op", "Resize", "--json").stdout)
    assert explained["on_mla"] is True


def test_demo_runs_the_whole_pipeline_on_the_shipped_example(tmp_path):
    result = _run("demo", "--out", tmp_path, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["check"]["mla_segments"] == 1
    assert data["fix"]["single_elf"] is True
    assert data["quantize"]["held_out_sqnr_db"] > 25
    assert len(data["compile"]["elf_files"]) == data["fix"]["mla_segments_after"]
    assert data["run"]["bit_exact"] is True
    assert (tmp_path / "yolo_head.onnx").exists()


def test_the_demos_archive_runs_against_its_saved_model_without_naming_it(tmp_path):
    """What a user tries after the demo: the archive records the int8 model the demo saved."""
    assert _run("demo", "--out", tmp_path, "--json").exit_code == 0
    archive = tmp_path / "yolo_head_mpk.tar.gz"
    result = _run("run", archive, "--compare-reference", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["reference"]["bit_exact"] is True


@pytest.mark.slow
def test_console_script_reports_errors_without_traceback(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x08\x07junk")
    proc = subprocess.run(
        [sys.executable, "-m", "surgery", "check", str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "bad.onnx" in proc.stderr


def test_a_model_with_dynamic_input_dims_is_no_single_elf_yet(tmp_path) -> None:
    """One segment of the few nodes whose shapes are known is not a compilable model."""
    model = examples.plain_cnn()
    dims = model.graph.input[0].type.tensor_type.shape.dim
    dims[2].dim_param, dims[3].dim_param = "h", "w"
    path = save_model(model, tmp_path / "dynamic.onnx")
    result = runner.invoke(app, ["check", str(path), "--json"])
    data = json.loads(result.stdout)
    assert data["dynamic_inputs"] == {"input": [1, 3, "h", "w"]}
    assert not data["single_elf"] and result.exit_code == 1


def test_a_rule_that_frees_part_of_a_group_says_how_many(save) -> None:
    """A group's fix must not read as a fix for all of it."""
    from surgery.cli.check import _rules_text

    group = {"count": 47, "suggested_rule_nodes": {"classifier-to-conv": 6, "fold-constants": 47}}
    assert _rules_text(group) == "classifier-to-conv (6 of 47), fold-constants"


def test_counts_on_the_terminal_are_singular_for_one(save) -> None:
    """One blocker is "1 node, 1 reason", not "1 nodes, 1 reasons"."""
    model = examples.plain_cnn()
    y = model.graph.output[0].name
    model.graph.node.append(onnx.helper.make_node("Flatten", [y], ["flat"], name="flat"))
    model.graph.output[0].CopyFrom(onnx.helper.make_empty_tensor_value_info("flat"))
    result = runner.invoke(app, ["check", str(save(model))])
    assert "Blockers (1 node, 1 reason):" in result.output


@pytest.mark.parametrize(
    ("example", "said"),
    [
        ("plain_cnn", "nothing to rewrite: the model is one MLA segment already"),
        ("cnn_with_topk", "no rule frees its blockers: 2 MLA segments stay"),
    ],
)
def test_the_demos_fix_says_why_it_made_no_step(example, said, tmp_path):
    result = _run("demo", "--example", example, "--out", tmp_path)
    assert result.exit_code == 0, result.output
    assert said in result.output
    assert f"next: surgery run {tmp_path / example}_mpk.tar.gz --compare-reference" in result.output
