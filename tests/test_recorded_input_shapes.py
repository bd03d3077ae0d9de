"""A dynamic-size export that records the size it was exported at (metadata `imgsz`/`batch`,
as Ultralytics writes with dynamic=True): check and fix name the --input-shape to give."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

from server.cli import app
from surgery.errors import SurgeryError
from surgery.model import recorded_input_shapes
from surgery.rules.fix import fix_model

runner = CliRunner()


def dynamic_detector(meta: dict[str, str]) -> onnx.ModelProto:
    """images [batch, 3, height, width] → stride-2 conv → ×2 upsample → concat with the input:
    fed as 1×3×1×1 the upsampled map is 2×2 and the Concat cannot run."""
    w = numpy_helper.from_array(np.ones((3, 3, 1, 1), np.float32), "w")
    scales = numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")
    nodes = [
        helper.make_node("Conv", ["images", "w"], ["down"], strides=[2, 2]),
        helper.make_node("Resize", ["down", "", "scales"], ["up"], mode="nearest"),
        helper.make_node("Concat", ["images", "up"], ["out"], axis=1),
    ]
    graph = helper.make_graph(
        nodes,
        "dyn",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, ["batch", 3, "h", "w"])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)],
        [w, scales],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    helper.set_model_props(model, meta)
    return model


def test_the_recorded_size_fills_the_dynamic_dims() -> None:
    model = dynamic_detector({"imgsz": "[64, 96]", "batch": "1"})
    dims = {"images": ["batch", 3, "h", "w"]}
    assert recorded_input_shapes(model, dims) == {"images": [1, 3, 64, 96]}
    assert recorded_input_shapes(model, {"images": [2, 3, None, None]}) == {
        "images": [2, 3, 64, 96]
    }
    square = dynamic_detector({"imgsz": "640"})
    assert recorded_input_shapes(square, dims) == {"images": [1, 3, 640, 640]}
    assert recorded_input_shapes(dynamic_detector({}), dims) == {}
    assert recorded_input_shapes(model, {"tokens": ["batch", "seq"]}) == {}
    assert recorded_input_shapes(model, {"images": ["batch", "c", "h", "w"]}) == {}


def test_fix_names_the_recorded_size() -> None:
    with pytest.raises(SurgeryError) as err:
        fix_model(dynamic_detector({"imgsz": "[64, 64]", "batch": "1"}), "mlsoc")
    assert "--input-shape images=1,3,64,64 (the size its metadata records)" in err.value.hint


def test_fix_without_a_recorded_size_keeps_the_generic_hint() -> None:
    with pytest.raises(SurgeryError) as err:
        fix_model(dynamic_detector({}), "mlsoc")
    assert "--input-shape NAME=DIMS" in err.value.hint


def test_check_prints_the_recorded_size(tmp_path: Path) -> None:
    path = tmp_path / "dyn.onnx"
    onnx.save(dynamic_detector({"imgsz": "[64, 64]", "batch": "1"}), path)
    result = runner.invoke(app, ["check", str(path)])
    assert "the size its metadata records: -s images=1,3,64,64" in result.stdout
