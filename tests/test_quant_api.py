"""compiler.api: load_model → LoadedNet.quantize → Model.execute / save / load."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from compiler.api import LoadedNet, Model, load_model
from compiler.defines import HistogramPercentileMethod, default_quantization
from compiler.quantize import RknnConfig
from surgery.errors import ModelNotFoundError, TargetError
from tests.test_quant_nets import conv_net, random_samples, sqnr_db


@pytest.fixture(scope="module")
def net() -> LoadedNet:
    return load_model(conv_net(), target="mlsoc")


@pytest.fixture(scope="module")
def quantized(net: LoadedNet) -> Model:
    return net.quantize(random_samples(8), default_quantization, model_name="tiny")


def test_load_model_and_execute_float(net: LoadedNet, tmp_path: Path) -> None:
    feed = random_samples(1)[0]
    out = net.execute(feed)
    assert list(out) == ["y"] and out["y"].shape == (1, 8, 1, 1)
    np.testing.assert_array_equal(net.execute(feed["x"])["y"], out["y"])  # a bare array works too
    with pytest.raises(TargetError):
        load_model(conv_net(), target="nope")
    with pytest.raises(ValueError, match="layout"):
        load_model(conv_net(), layout="CHW")  # type: ignore[arg-type]


def test_quantize_and_execute(net: LoadedNet, quantized: Model) -> None:
    assert quantized.target == "mlsoc" and quantized.name == "tiny"
    feed = random_samples(1, seed=4)[0]
    assert sqnr_db(net.execute(feed)["y"], quantized.execute(feed)["y"]) > 25.0
    assert any(n.op_type == "QuantizeLinear" for n in quantized.qdq_model.graph.node)


def test_save_load_round_trip_is_byte_exact(quantized: Model, tmp_path: Path) -> None:
    first = quantized.save("tiny", tmp_path / "a")
    loaded = Model.load("tiny", tmp_path / "a")
    loaded.save("tiny", tmp_path / "b")
    for name in ("tiny.onnx", "tiny.quant.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert first == tmp_path / "a" / "tiny.onnx"
    assert loaded.params == quantized.params and loaded.target == quantized.target
    assert loaded.report == quantized.report
    feed = random_samples(1, seed=2)[0]
    np.testing.assert_array_equal(loaded.execute(feed)["y"], quantized.execute(feed)["y"])


def test_load_errors(quantized: Model, tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError):
        Model.load("missing", tmp_path)
    quantized.save("tiny", tmp_path)
    (tmp_path / "tiny.onnx").write_bytes((tmp_path / "tiny.onnx").read_bytes() + b"\x00")
    with pytest.raises(ValueError, match="checksum"):
        Model.load("tiny", tmp_path)


def test_quantize_from_a_folder_with_vendor_settings(net: LoadedNet, tmp_path: Path) -> None:
    folder = tmp_path / "npy"
    folder.mkdir()
    for i, sample in enumerate(random_samples(4)):
        np.save(folder / f"{i}.npy", sample["x"])
    config = default_quantization.with_calibration(HistogramPercentileMethod(99.9, 2048))
    model = net.quantize(str(folder), config)
    assert model.report["calibration"]["samples"] == 4
    assert model.params.calibration_method == HistogramPercentileMethod(99.9, 2048)


def test_rknn_config_is_a_second_front_door(net: LoadedNet) -> None:
    model = net.quantize(
        random_samples(4), RknnConfig(target_platform="rk3588", quantized_algorithm="mmse")
    )
    assert model.target == "rk3588"
    assert model.report["calibration"]["method"]["method"] == "histogram_mse"
    assert model.report["requantization_mode"] == "tflite"


def test_compile_after_save_records_the_saved_file_for_compare_reference(
    net: LoadedNet, tmp_path: Path
) -> None:
    from compiler.archive import check_compiled_from, read_archive

    model = net.quantize(random_samples(8), default_quantization, model_name="tiny")
    saved = model.save("tiny", tmp_path)
    manifest = read_archive(model.compile(tmp_path / "out").archive).manifest
    assert manifest["model_path"] == str(saved.resolve())
    check_compiled_from(manifest, saved)  # the saved bytes are the ones compiled


def test_compile_of_a_model_never_saved_records_its_graph_name(
    net: LoadedNet, tmp_path: Path
) -> None:
    from compiler.archive import read_archive

    model = net.quantize(random_samples(8), default_quantization, model_name="tiny")
    manifest = read_archive(model.compile(tmp_path).archive).manifest
    assert manifest["model_path"] == (model.qdq_model.graph.name or "model")
