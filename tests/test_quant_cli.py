"""`surgery quantize` / `surgery analyze`: exit codes and JSON on a folder of .npy samples."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
from typer.testing import CliRunner

from server.cli import app
from tests.conftest import npy_calibration_folder
from tests.test_quant_hybrid import collapsing_head

runner = CliRunner()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("quant_cli")
    onnx.save(collapsing_head(), folder / "head.onnx")
    npy_calibration_folder(folder, (1, 3, 8, 8))
    return folder


def _json(result) -> dict:
    assert result.stdout.lstrip().startswith("{"), result.output
    return json.loads(result.stdout)


def test_quantize_json(workdir: Path) -> None:
    out = workdir / "q.onnx"
    args = ["quantize", str(workdir / "head.onnx"), "--calib", str(workdir / "calib")]
    result = runner.invoke(app, [*args, "-o", str(out), "--method", "minmax", "--json"])
    assert result.exit_code == 0, result.output
    data = _json(result)
    assert data["output"] == str(out) and out.is_file()
    assert data["method"] == "minmax" and data["samples"] == 4 and data["holdout"] == 2
    assert data["outputs"]["scores"]["cosine"] < 0.5
    assert data["outputs"]["boxes"]["sqnr_db"] > 25


def test_quantize_auto_hybrid_and_table(workdir: Path) -> None:
    out = workdir / "qh.onnx"
    args = ["quantize", str(workdir / "head.onnx"), "--calib", str(workdir / "calib")]
    result = runner.invoke(app, [*args, "-o", str(out), "--auto-hybrid", "0.98", "--json"])
    assert result.exit_code == 0, result.output
    data = _json(result)
    assert data["outputs"]["scores"]["cosine"] > 0.99
    assert {r["tensor"] for r in data["auto_hybrid"]["raised"]} == {"head", "scores"}
    table = runner.invoke(app, [*args, "-o", str(out), "--holdout", "1", "--bits", "16"])
    assert table.exit_code == 0, table.output
    assert "scores" in table.stdout and "held-out" in table.stdout


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--method", "best"], "--method"),
        (["--bits", "4"], "--bits"),
        (["--holdout", "6"], "--holdout"),
        (["--unquantized", "nope"], "nope"),
    ],
)
def test_quantize_errors_exit_2(workdir: Path, extra: list[str], message: str) -> None:
    args = ["quantize", str(workdir / "head.onnx"), "--calib", str(workdir / "calib")]
    result = runner.invoke(app, [*args, "-o", str(workdir / "bad.onnx"), *extra, "--json"])
    assert result.exit_code == 2
    assert message in _json(result)["error"]["message"]


def test_quantize_missing_calib_exit_2(workdir: Path) -> None:
    result = runner.invoke(
        app, ["quantize", str(workdir / "head.onnx"), "--calib", str(workdir / "none")]
    )
    assert result.exit_code == 2


def test_analyze(workdir: Path) -> None:
    out = workdir / "qa.onnx"
    model = str(workdir / "head.onnx")
    calib = str(workdir / "calib")
    assert runner.invoke(app, ["quantize", model, "--calib", calib, "-o", str(out)]).exit_code == 0
    result = runner.invoke(
        app, ["analyze", model, str(out), "--data", calib, "--top", "2", "--json"]
    )
    assert result.exit_code == 0, result.output
    data = _json(result)
    assert len(data["layers"]) == 2 and data["total_layers"] == 6
    assert {e["layer"] for e in data["layers"]} == {"[Slice] scores", "[Concat] head"}
    head = next(e for e in data["layers"] if e["tensor"] == "head")
    assert head["single_parts"]["scores_raw"]["cosine"] < 0.5
    table = runner.invoke(app, ["analyze", model, str(out), "--data", calib])
    assert table.exit_code == 0 and "scores" in table.stdout
    head_row = next(line for line in table.stdout.splitlines() if "[Concat] head" in line)
    assert head_row.count(" *") == 2  # ranked by its worst part's cosine, marked so
    bad = runner.invoke(app, ["analyze", model, model, "--data", calib, "--json"])
    assert bad.exit_code == 2


def test_quantize_auto_hybrid_on_the_entire_error(workdir: Path) -> None:
    out = workdir / "qe.onnx"
    args = ["quantize", str(workdir / "head.onnx"), "--calib", str(workdir / "calib")]
    flags = ["--auto-hybrid", "0.98", "--hybrid-metric", "entire", "--json"]
    result = runner.invoke(app, [*args, "-o", str(out), *flags])
    assert result.exit_code == 0, result.output
    hybrid = _json(result)["auto_hybrid"]
    assert hybrid["settings"]["metric"] == "entire"
    assert all(r["reason"].startswith("entire cosine") for r in hybrid["raised"])


def test_quantize_to_a_target_sqnr(workdir: Path) -> None:
    out = workdir / "qt.onnx"
    args = ["quantize", str(workdir / "head.onnx"), "--calib", str(workdir / "calib")]
    result = runner.invoke(app, [*args, "-o", str(out), "--target-sqnr", "25", "--json"])
    assert result.exit_code == 0, result.output
    hybrid = _json(result)["auto_hybrid"]
    assert hybrid["settings"]["target_sqnr_db"] == 25 and hybrid["converged"]
    assert hybrid["raised"] and all(r["output_sqnr_db"] is not None for r in hybrid["raised"])


def test_no_held_out_samples_says_the_sqnr_was_not_measured(workdir: Path) -> None:
    args = ["quantize", str(workdir / "head.onnx"), "--calib", str(workdir / "calib")]
    result = runner.invoke(app, [*args, "-o", str(workdir / "q0.onnx"), "--holdout", "0"])
    assert result.exit_code == 0, result.output
    assert "no held-out samples (--holdout 0)" in result.stdout
    assert "final outputs vs float" not in result.stdout  # no empty table


def test_a_target_sqnr_reached_is_said_on_the_terminal(workdir: Path) -> None:
    args = ["quantize", str(workdir / "head.onnx"), "--calib", str(workdir / "calib")]
    result = runner.invoke(app, [*args, "-o", str(workdir / "qr.onnx"), "--target-sqnr", "25"])
    assert result.exit_code == 0, result.output
    assert "target 25 dB reached" in result.stdout


def test_a_target_sqnr_out_of_reach_exits_1_and_still_writes_the_model(workdir: Path) -> None:
    out = workdir / "qu.onnx"
    args = ["quantize", str(workdir / "head.onnx"), "--calib", str(workdir / "calib")]
    terminal = runner.invoke(app, [*args, "-o", str(out), "--target-sqnr", "400"])
    assert terminal.exit_code == 1, terminal.output
    assert "target 400 dB not reached" in terminal.stdout and out.is_file()
    result = runner.invoke(app, [*args, "-o", str(out), "--target-sqnr", "400", "--json"])
    assert result.exit_code == 1 and _json(result)["auto_hybrid"]["converged"] is False


def test_bad_hybrid_metric(workdir: Path) -> None:
    args = ["quantize", str(workdir / "head.onnx"), "--calib", str(workdir / "calib")]
    result = runner.invoke(app, [*args, "--auto-hybrid", "0.98", "--hybrid-metric", "worst"])
    assert result.exit_code != 0 and "hybrid-metric" in result.output


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--target-sqnr", "-5"], "target_sqnr_db=-5.0: must be a positive SQNR in dB"),
        (["--auto-hybrid", "1.5"], "cos_thresh=1.5: must be in (0, 1]"),
    ],
)
def test_bad_hybrid_settings_fail_cleanly_without_writing(
    workdir: Path, flags: list[str], message: str
) -> None:
    out = workdir / "never.onnx"
    args = ["quantize", str(workdir / "head.onnx"), "--calib", str(workdir / "calib")]
    result = runner.invoke(app, [*args, "-o", str(out), *flags])
    assert result.exit_code == 2
    assert message in result.output and "Traceback" not in result.output
    assert not out.exists()


def test_a_low_output_sqnr_comes_with_what_to_try(workdir: Path) -> None:
    out = workdir / "qa.onnx"
    args = ["quantize", str(workdir / "head.onnx"), "--calib", str(workdir / "calib")]
    result = runner.invoke(app, [*args, "-o", str(out), "--method", "minmax", "--json"])
    advice = _json(result)["advice"]
    assert "'scores'" in advice[0] and "dB" in advice[0]
    assert any("--target-sqnr 30" in line for line in advice)
    assert any(f"surgery analyze {workdir / 'head.onnx'} {out}" in line for line in advice)
    terminal = runner.invoke(app, [*args, "-o", str(out), "--method", "minmax"])
    assert "try: --target-sqnr 30" in terminal.stdout


def test_no_advice_when_every_output_is_precise(workdir: Path) -> None:
    out = workdir / "qb.onnx"
    args = ["quantize", str(workdir / "head.onnx"), "--calib", str(workdir / "calib")]
    result = runner.invoke(app, [*args, "-o", str(out), "--bits", "16", "--json"])
    data = _json(result)
    assert min(e["sqnr_db"] or 99 for e in data["outputs"].values()) >= 20
    assert data["advice"] == []


def test_the_advised_analyze_command_repeats_the_data_options(workdir: Path) -> None:
    out = workdir / "qc.onnx"
    args = ["quantize", str(workdir / "head.onnx"), "--calib", str(workdir / "calib")]
    flags = ["--mean", "0.5", "--std", "2", "--method", "minmax", "--json"]
    advice = _json(runner.invoke(app, [*args, "-o", str(out), *flags]))["advice"]
    command = next(line for line in advice if "surgery analyze" in line).strip("`").split("`")[0]
    assert command.endswith("--mean 0.5 --std 2")
    analyzed = runner.invoke(app, command.split()[1:] + ["--json"])
    assert analyzed.exit_code == 0, analyzed.output


def test_quantize_logs_progress_lines_when_stderr_is_no_terminal(workdir: Path) -> None:
    """A CI log gets plain progress lines (the bar only draws on a terminal)."""
    args = ["quantize", str(workdir / "head.onnx"), "--calib", str(workdir / "calib")]
    result = runner.invoke(app, [*args, "-o", str(workdir / "qp.onnx")])
    assert result.exit_code == 0, result.output
    assert "calibrating: " in result.stderr and "samples" in result.stderr
