"""What the CLI reads and writes: inputs files are used and checked, an input model is never
overwritten, and the files written are readable by others (the mode open() gives)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import surgery.cli.rules as cli_rules
from server.cli import app
from surgery import examples
from surgery.model import save_model
from surgery.rules.fix import fix_model
from surgery.workspace import Workspace

runner = CliRunner()


@pytest.fixture
def cnn(tmp_path: Path) -> Path:
    return save_model(examples.plain_cnn(), tmp_path / "cnn.onnx")


def _fix(cnn: Path, tmp_path: Path, *extra: str):
    args = ["fix", str(cnn), "-o", str(tmp_path / "out.onnx"), "-w", str(tmp_path / "ws")]
    return runner.invoke(app, [*args, *extra])


def test_fix_verifies_with_the_inputs_file_it_is_given(cnn, tmp_path, monkeypatch) -> None:
    seen = {}

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return fix_model(*args, **kwargs)

    monkeypatch.setattr(cli_rules, "fix_model", spy)
    frame = np.random.default_rng(1).random((1, 3, 32, 32), dtype=np.float32)
    np.savez(tmp_path / "real.npz", input=frame)
    result = _fix(cnn, tmp_path, "--inputs", str(tmp_path / "real.npz"))
    assert result.exit_code == 0, result.output
    np.testing.assert_array_equal(seen["inputs"]["input"], frame)


def test_fix_takes_a_npy_for_a_one_input_model(cnn, tmp_path) -> None:
    np.save(tmp_path / "real.npy", np.zeros((1, 3, 32, 32), np.float32))
    result = _fix(cnn, tmp_path, "-i", str(tmp_path / "real.npy"))
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize(
    ("arrays", "words"),
    [
        ({"other": np.zeros((1, 3, 32, 32), np.float32)}, "lacks the model's input(s) 'input'"),
        ({"input": np.zeros((1, 3, 16, 16), np.float32)}, "has shape [1, 3, 16, 16]"),
        ({"input": np.full((1, 3, 32, 32), np.nan, np.float32)}, "NaN"),
    ],
)
def test_fix_refuses_inputs_that_do_not_fit_the_model(cnn, tmp_path, arrays, words) -> None:
    np.savez(tmp_path / "bad.npz", **arrays)
    result = _fix(cnn, tmp_path, "--inputs", str(tmp_path / "bad.npz"))
    assert result.exit_code == 2
    assert words in result.output
    assert not (tmp_path / "out.onnx").exists()


def test_fix_refuses_a_missing_inputs_file(cnn, tmp_path) -> None:
    result = _fix(cnn, tmp_path, "--inputs", str(tmp_path / "nope.npz"))
    assert result.exit_code == 2 and "inputs file not found" in result.output


@pytest.mark.parametrize("command", ["fix", "apply", "quantize"])
def test_an_output_equal_to_the_input_is_refused(cnn, tmp_path, command) -> None:
    before = cnn.read_bytes()
    args = {
        "fix": ["fix", str(cnn), "-o", str(cnn)],
        "apply": ["apply", "fold-constants", str(cnn), "-o", str(cnn)],
        "quantize": ["quantize", str(cnn), "--calib", str(tmp_path), "-o", str(cnn)],
    }[command]
    result = runner.invoke(
        app, [*args, "-w", str(tmp_path / "ws")] if command != "quantize" else args
    )
    assert result.exit_code == 2
    assert "refusing to overwrite the input model" in result.output
    assert cnn.read_bytes() == before


def test_written_models_get_the_mode_open_would_give(tmp_path) -> None:
    """Not mkstemp's 0600: other users and CI steps must be able to read them."""
    umask = os.umask(0)
    os.umask(umask)
    path = save_model(examples.plain_cnn(), tmp_path / "m.onnx")
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask


def test_fix_says_when_it_stopped_at_the_step_limit(tmp_path) -> None:
    """transformer_block needs several steps; with --max-steps 1 the note names the limit."""
    src = save_model(examples.transformer_block(), tmp_path / "block.onnx")
    result = _fix(src, tmp_path, "--max-steps", "1")
    assert result.exit_code == 1, result.output
    assert "after the step limit (1)" in result.output


def test_version_prints_the_installed_version() -> None:
    from importlib.metadata import version

    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.output.strip() == f"model-surgery {version('model-surgery')}"


def test_fix_records_its_end_to_end_verification_in_the_workspace(tmp_path) -> None:
    src = save_model(examples.yolo_head(), tmp_path / "yolo.onnx")
    result = _fix(src, tmp_path, "--json")
    assert result.exit_code == 0, result.output
    version = Workspace(tmp_path / "ws").latest("yolo")
    assert version.action == "fix" and version.verify["passed"]
    assert version.verify["mode"] == "exact"
    assert version.verify["model_b"] == "the fixed model (this version)"  # no object repr


def _other_cnn_of_the_same_name(tmp_path: Path) -> Path:
    (tmp_path / "other").mkdir()
    return save_model(examples.plain_cnn(seed=1), tmp_path / "other" / "cnn.onnx")


def test_fix_of_another_file_under_a_taken_name_is_refused_before_any_work(cnn, tmp_path) -> None:
    assert _fix(cnn, tmp_path).exit_code == 0
    (tmp_path / "out.onnx").unlink()
    result = _fix(_other_cnn_of_the_same_name(tmp_path), tmp_path)
    assert result.exit_code == 2
    assert "is another file" in result.output and "--name NAME" in result.output
    assert not (tmp_path / "out.onnx").exists()  # nothing written


def test_fix_with_a_name_keeps_another_file_as_a_model_of_its_own(cnn, tmp_path) -> None:
    assert _fix(cnn, tmp_path).exit_code == 0
    result = _fix(_other_cnn_of_the_same_name(tmp_path), tmp_path, "--name", "cnn_b")
    assert result.exit_code == 0, result.output
    assert {"cnn", "cnn_b"} <= set(Workspace(tmp_path / "ws").list_models())


def test_apply_of_another_file_under_a_taken_name_is_refused(cnn, tmp_path) -> None:
    assert _fix(cnn, tmp_path).exit_code == 0
    other = _other_cnn_of_the_same_name(tmp_path)
    args = ["apply", "remove-identity", str(other), "-w", str(tmp_path / "ws")]
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and "is another file" in result.output


def test_an_output_in_a_place_that_cannot_hold_files_is_refused_before_any_work(
    cnn, tmp_path, monkeypatch
) -> None:
    monkeypatch.setattr(cli_rules, "fix_model", lambda *a, **k: pytest.fail("fix ran"))
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    result = runner.invoke(app, ["fix", str(cnn), "-o", str(blocker / "out.onnx")])
    assert result.exit_code == 2
    assert f"{blocker / 'out.onnx'}: cannot write in {blocker}" in result.output


def test_an_output_that_is_a_folder_is_refused(cnn, tmp_path) -> None:
    result = runner.invoke(app, ["fix", str(cnn), "-o", str(tmp_path)])
    assert result.exit_code == 2 and "is a folder; give a file name" in result.output


def test_missing_output_folders_are_made(cnn, tmp_path) -> None:
    out = tmp_path / "new" / "deeper" / "out.onnx"
    result = runner.invoke(app, ["fix", str(cnn), "-o", str(out), "-w", str(tmp_path / "ws")])
    assert result.exit_code == 0, result.output
    assert out.is_file()
    assert not list(tmp_path.rglob(".surgery-write-probe-*"))  # the probe is gone
