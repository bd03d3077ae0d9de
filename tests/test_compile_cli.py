"""`surgery compile`, `surgery archive`, `surgery run`: output, JSON keys and exit codes."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from typer.testing import CliRunner

from server.cli import app
from tests.lower_support import input_frames, load_example, reference_outputs

runner = CliRunner()


def _run(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli")
    model_path = folder / "topk.onnx"
    onnx.save(load_example("cnn_with_topk"), model_path)
    result = _run("compile", model_path, "-o", folder / "out", "--batch-size", 2, "--json")
    assert result.exit_code == 0, result.output
    return model_path, json.loads(result.stdout)


def test_compile_json_reports_elves_segments_and_batch(compiled) -> None:
    _, data = compiled
    assert data["archive"].endswith("topk_mpk.tar.gz")
    assert len(data["elf_files"]) == 2 == data["mla_segments"]
    assert data["actual_batch_size"] == 2
    for segment in data["segments"]:
        assert segment["peak_bytes"] >= segment["lower_bound_bytes"] > 0
        assert segment["cycles"] > 0


def test_compile_terminal_output(tmp_path) -> None:
    model_path = tmp_path / "cnn.onnx"
    onnx.save(load_example("plain_cnn"), model_path)
    result = _run(
        "compile",
        model_path,
        "-o",
        tmp_path,
        "--memory-plan",
        "GreedyByLifetime",
        "--compute-order",
        "DepthFirst",
        "--tessellate-default",
        "--custom-string",
        "hi",
    )
    assert result.exit_code == 0, result.output
    assert "1 .elf file(s) for 1 MLA segment(s)" in result.output
    assert "lower bound" in result.output and "tessellate" not in result.output


def test_archive_json_and_stats(compiled) -> None:
    _, data = compiled
    result = _run("archive", data["archive"], "--stats", "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["elf_files"] == data["elf_files"]
    assert summary["actual_batch_size"] == 2
    assert any(entry["name"].startswith("MLA_1/") for entry in summary["mla_stats"].values())
    assert _run("archive", data["archive"], "--stats").exit_code == 0


def test_run_compares_with_the_reference(compiled, tmp_path) -> None:
    model_path, data = compiled
    model = onnx.load(model_path)
    feeds = input_frames(model, 3)
    np.savez(tmp_path / "in.npz", **feeds)
    result = _run(
        "run",
        data["archive"],
        "--inputs",
        tmp_path / "in.npz",
        "--save-outputs",
        tmp_path / "out.npz",
        "--compare-reference",
        "--model",
        model_path,
        "--json",
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    (output,) = report["outputs"]
    assert output["name"] == "output" and output["shape"] == [3, 4, 16, 16]
    assert output["bit_exact"] is True and output["max_abs_diff_vs_reference"] == 0.0
    saved = np.load(tmp_path / "out.npz")
    np.testing.assert_array_equal(saved["output"], reference_outputs(model, feeds, 3)["output"])
    assert {s["processor"] for s in report["stats"]["stages"]} == {"MLA", "EV74", "A65"}


def test_run_with_random_inputs_on_the_terminal(compiled) -> None:
    _, data = compiled
    result = _run("run", data["archive"], "--frames", 2)
    assert result.exit_code == 0, result.output
    assert "modelled latency per frame" in result.output
    assert "cycles (2 frames)" in result.output  # a total, beside per-frame times


def test_errors_exit_two(tmp_path, compiled) -> None:
    model_path, data = compiled
    assert _run("compile", tmp_path / "missing.onnx", "-o", tmp_path).exit_code == 2
    bad = _run("compile", model_path, "-o", tmp_path, "--memory-plan", "Optimal", "--json")
    assert bad.exit_code == 2
    assert json.loads(bad.stdout)["error"]["code"] == "compile_error"
    assert _run("archive", tmp_path / "missing_mpk.tar.gz").exit_code == 2
    no_model = _run("run", data["archive"], "--compare-reference", "--model", tmp_path / "x.onnx")
    assert no_model.exit_code == 2


def test_run_refuses_a_reference_that_is_not_the_compiled_model(tmp_path, compiled) -> None:
    """A bit-exact comparison against another model would be a false diagnosis."""
    _, data = compiled
    other = tmp_path / "other.onnx"
    onnx.save(load_example("plain_cnn"), other)
    result = _run("run", data["archive"], "--compare-reference", "--model", other)
    assert result.exit_code == 2
    assert "is not the model this archive was compiled from" in result.output


def test_compile_into_a_file_is_a_clear_error(tmp_path, compiled) -> None:
    model_path, _ = compiled
    result = _run("compile", model_path, "-o", model_path)
    assert result.exit_code == 2 and "is a file" in result.output


def test_run_saves_outputs_into_a_new_folder(tmp_path, compiled) -> None:
    _, data = compiled
    result = _run("run", data["archive"], "--save-outputs", tmp_path / "new" / "out.npz")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "new" / "out.npz").is_file()


def test_run_notes_an_input_it_casts_to_the_pipelines_dtype(compiled, tmp_path) -> None:
    model_path, data = compiled
    feeds = {
        k: (v * 255).astype(np.uint8) for k, v in input_frames(onnx.load(model_path), 1).items()
    }
    np.savez(tmp_path / "pixels.npz", **feeds)
    result = _run("run", data["archive"], "--inputs", tmp_path / "pixels.npz", "--json")
    assert result.exit_code == 0, result.output
    (name,) = feeds
    assert json.loads(result.stdout)["notes"] == [f"input {name!r} cast from uint8 to float32"]
    terminal = _run("run", data["archive"], "--inputs", tmp_path / "pixels.npz")
    assert f"note: input {name!r} cast from uint8 to float32" in terminal.output


def test_run_of_inputs_in_the_pipelines_dtype_has_no_notes(compiled) -> None:
    _, data = compiled
    result = _run("run", data["archive"], "--json")
    assert json.loads(result.stdout)["notes"] == []


def test_an_empty_inputs_file_is_a_clear_error(tmp_path, compiled) -> None:
    _, data = compiled
    empty = tmp_path / "empty.npz"
    empty.write_bytes(b"")
    result = _run("run", data["archive"], "--inputs", empty)
    assert result.exit_code == 2
    assert "not a readable .npz" in result.output


@pytest.mark.parametrize("file_name", ["topk_mpk.tar.gz", "topk.tar.gz", "topk.tgz"])
def test_an_archive_file_name_as_output_is_refused_before_compiling(
    tmp_path, compiled, file_name
) -> None:
    model_path, _ = compiled
    target = tmp_path / file_name
    result = _run("compile", model_path, "-o", target, "--json")
    assert result.exit_code == 2
    message = json.loads(result.stdout)["error"]["message"]
    assert str(target) in message and "directory" in message and "--output" in message
    assert not target.exists() and list(tmp_path.iterdir()) == []


def test_an_output_path_that_cannot_be_written_is_one_line_naming_it(compiled, tmp_path) -> None:
    _, data = compiled
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    result = _run("run", data["archive"], "--save-outputs", blocker / "out.npz")
    assert result.exit_code == 2
    assert f"error: {blocker}: " in result.output
    assert "Error:" not in result.output  # no exception class names


def test_running_a_model_instead_of_its_archive_says_compile_it_first(compiled) -> None:
    model_path, _ = compiled
    result = _run("run", model_path)
    assert result.exit_code == 2
    assert "an ONNX model, not a compiled archive" in result.output
    assert f"surgery compile {model_path}" in result.output
