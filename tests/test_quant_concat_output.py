"""`surgery quantize` judges a concatenated output per part: a detector's one output of boxes
(hundreds of pixels) and scores (0‥1), behind a Reshape as `surgery fix` leaves it, keeps a high
whole-tensor SQNR while int8 steps sized for the boxes round every score to zero."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

from compiler.quantize.analysis import concat_output_parts
from server.cli import app
from tests.conftest import npy_calibration_folder

runner = CliRunner()


def detector_output(view: str = "Reshape") -> onnx.ModelProto:
    """Boxes (4 channels, ~±500) and sigmoid scores (3 channels) concatenated along the channels
    into one 4-D tensor, then reshaped (or transposed) into the single graph output."""
    rng = np.random.default_rng(0)
    wa = (rng.standard_normal((4, 3, 1, 1)) * 300).astype(np.float32)
    wb = (rng.standard_normal((3, 3, 1, 1)) * 0.3).astype(np.float32)
    inits = [
        numpy_helper.from_array(wa, "wa"),
        numpy_helper.from_array(wb, "wb"),
        numpy_helper.from_array(np.array([1, 7, 64], np.int64), "shape"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "wa"], ["boxes"], name="box_conv"),
        helper.make_node("Conv", ["x", "wb"], ["logits"], name="score_conv"),
        helper.make_node("Sigmoid", ["logits"], ["scores"], name="score_sigmoid"),
        helper.make_node("Concat", ["boxes", "scores"], ["head"], name="head", axis=1),
    ]
    if view == "Reshape":
        nodes.append(helper.make_node("Reshape", ["head", "shape"], ["output0"], name="flat"))
        out_shape = [1, 7, 64]
    else:
        nodes.append(helper.make_node("Transpose", ["head"], ["output0"], perm=[0, 2, 3, 1]))
        out_shape = [1, 8, 8, 7]
    graph = helper.make_graph(
        nodes,
        "detector_output",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("output0", TensorProto.FLOAT, out_shape)],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def test_parts_are_found_through_reshape_and_transpose() -> None:
    parts = concat_output_parts(detector_output("Reshape"))["output0"]
    assert list(parts) == ["boxes", "scores"]
    assert parts["boxes"].shape == (1, 7, 64)
    assert parts["boxes"][:, :4].all() and not parts["boxes"][:, 4:].any()
    assert parts["scores"][:, 4:].all() and not parts["scores"][:, :4].any()
    moved = concat_output_parts(detector_output("Transpose"))["output0"]
    assert moved["scores"].shape == (1, 8, 8, 7)
    assert moved["scores"][..., 4:].all() and not moved["scores"][..., :4].any()


def test_an_output_that_is_no_concat_has_no_parts() -> None:
    model = detector_output()
    model.graph.output[0].name = "scores"  # the Sigmoid's output: no Concat behind it
    model.graph.output[0].type.tensor_type.shape.Clear()
    model.graph.node.remove(model.graph.node[-1])
    model.graph.node.remove(model.graph.node[-1])
    assert concat_output_parts(model) == {}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("quant_concat")
    onnx.save(detector_output(), folder / "det.onnx")
    npy_calibration_folder(folder, (1, 3, 8, 8))
    return folder


def test_quantize_reports_the_collapsed_scores_part(workdir: Path) -> None:
    args = ["quantize", str(workdir / "det.onnx"), "--calib", str(workdir / "calib")]
    result = runner.invoke(app, [*args, "-o", str(workdir / "q.onnx"), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    whole = data["outputs"]["output0"]
    assert whole["sqnr_db"] > 25  # the boxes dominate the whole tensor …
    parts = whole["parts"]
    assert parts["boxes"]["sqnr_db"] > 25
    assert parts["scores"]["sqnr_db"] < 10  # … while the scores part is gone
    assert "output0 (part from scores)" in data["advice"][0]
    assert "--auto-hybrid" in data["advice"][1]
    table = runner.invoke(app, [*args, "-o", str(workdir / "q.onnx")])
    assert table.exit_code == 0, table.output
    assert "part from scores" in table.stdout


def test_auto_hybrid_brings_the_scores_part_back(workdir: Path) -> None:
    args = ["quantize", str(workdir / "det.onnx"), "--calib", str(workdir / "calib")]
    result = runner.invoke(
        app, [*args, "-o", str(workdir / "qh.onnx"), "--auto-hybrid", "0.98", "--json"]
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["outputs"]["output0"]["parts"]["scores"]["sqnr_db"] > 25
    assert data["advice"] == []
