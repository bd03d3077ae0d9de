"""Shared fixtures: example models built with onnx.helper and the real models in ../shared."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from surgery import examples
from surgery.model import save_model

REPO = Path(__file__).resolve().parents[1]
SHARED_MODELS = REPO.parent / "shared" / "models"
SHARED_IMAGES = REPO.parent / "shared" / "data" / "images"

# Concrete shapes for real models whose declared inputs are dynamic (from shared/models/INDEX.tsv).
RUN_INPUTS: dict[str, dict[str, list[int]]] = {
    "nudenet_320n": {"images": [1, 3, 320, 320]},
    "ppocrv4_det": {"x": [1, 3, 640, 640]},
    "ppocr_mobile_v2_cls": {"x": [1, 3, 48, 192]},
    "silero_vad": {"input": [1, 512], "state": [2, 1, 128]},
}


def npy_calibration_folder(folder: Path, shape: tuple[int, ...], count: int = 6) -> Path:
    """`folder`/calib with `count` seeded standard-normal samples of `shape` as .npy files."""
    calib = folder / "calib"
    calib.mkdir()
    rng = np.random.default_rng(0)
    for k in range(count):
        np.save(calib / f"s{k}.npy", rng.standard_normal(shape).astype(np.float32))
    return calib


def loop_body_adding(tensor: str, shape: list[int]) -> onnx.GraphProto:
    """A Loop body whose state `v` becomes `v + tensor`, `tensor` being read from the outer
    graph (not a Loop input), as a Keras LSTM's Loop reads its sequence."""
    helper, float_type = onnx.helper, onnx.TensorProto.FLOAT
    return helper.make_graph(
        [
            helper.make_node("Identity", ["c"], ["co"]),
            helper.make_node("Add", ["v", tensor], ["vo"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("it", onnx.TensorProto.INT64, []),
            helper.make_tensor_value_info("c", onnx.TensorProto.BOOL, []),
            helper.make_tensor_value_info("v", float_type, shape),
        ],
        [
            helper.make_tensor_value_info("co", onnx.TensorProto.BOOL, []),
            helper.make_tensor_value_info("vo", float_type, shape),
        ],
    )


def shared_model(name: str) -> Path:
    """Path of a real model in ../shared/models, skipping the test cleanly when absent."""
    path = SHARED_MODELS / f"{name}.onnx"
    if not path.exists():
        pytest.skip(f"{path} not available (the shared models folder is absent)")
    return path


@pytest.fixture
def plain_cnn() -> onnx.ModelProto:
    return examples.plain_cnn()


@pytest.fixture
def yolo_head() -> onnx.ModelProto:
    return examples.yolo_head()


@pytest.fixture
def yolov5_head() -> onnx.ModelProto:
    return examples.yolov5_head()


@pytest.fixture
def transformer_block() -> onnx.ModelProto:
    return examples.transformer_block()


@pytest.fixture
def cnn_with_topk() -> onnx.ModelProto:
    return examples.cnn_with_topk()


@pytest.fixture
def save(tmp_path):
    """Save a ModelProto under tmp_path and return its path."""

    def _save(model: onnx.ModelProto, name: str = "model.onnx") -> Path:
        return save_model(model, tmp_path / name)

    return _save


@pytest.fixture(scope="module")
def samples() -> list[np.ndarray]:
    """Six seeded standard-normal (1, 3, 8, 8) inputs: calibration data for the small
    quantizer test nets (hybrid, analysis, sensitivity)."""
    rng = np.random.default_rng(1)
    return [rng.standard_normal((1, 3, 8, 8)).astype(np.float32) for _ in range(6)]
