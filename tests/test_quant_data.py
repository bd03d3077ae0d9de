"""Calibration data from disk: image folders, .npy/.npz folders, dataset.txt; lazy and re-iterable."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler.defines import default_quantization
from compiler.quantize import CalibrationDataError, load_calibration_data, quantize_model
from tests.test_quant_nets import conv_net

Image = pytest.importorskip("PIL.Image")


def write_images(folder: Path, n: int = 3, size: tuple[int, int] = (20, 12)) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    paths = []
    for i in range(n):
        pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
        path = folder / f"img{i}.png"
        Image.fromarray(pixels).save(path)
        paths.append(path)
    return paths


def two_input_model() -> onnx.ModelProto:
    node = helper.make_node("Add", ["a", "b"], ["y"])
    graph = helper.make_graph(
        [node],
        "two",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 4]) for n in ("a", "b")],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_image_folder_resizes_normalises_and_is_lazy(tmp_path: Path) -> None:
    paths = write_images(tmp_path / "imgs")
    ds = load_calibration_data(tmp_path / "imgs", conv_net())
    assert len(ds) == 3
    first = next(iter(ds))
    assert first["x"].shape == (1, 3, 16, 16) and first["x"].dtype == np.float32
    assert first["x"].min() >= 0.0 and first["x"].max() <= 1.0
    assert len(list(ds)) == 3 and len(list(ds)) == 3  # re-iterable
    paths[1].write_bytes(b"not an image")  # decoded only when reached
    it = iter(ds)
    next(it)
    with pytest.raises(CalibrationDataError, match="img1.png"):
        next(it)


def test_image_mean_std_bgr_and_layouts(tmp_path: Path) -> None:
    folder = tmp_path / "imgs"
    folder.mkdir()
    Image.fromarray(np.full((16, 16, 3), [10, 20, 30], dtype=np.uint8)).save(folder / "a.png")
    rgb = next(iter(load_calibration_data(folder, conv_net(), mean=[10, 10, 10], std=[2, 2, 2])))[
        "x"
    ]
    np.testing.assert_allclose(rgb[0, :, 0, 0], [0.0, 5.0, 10.0])
    bgr = next(
        iter(load_calibration_data(folder, conv_net(), mean=[10, 10, 10], std=[2, 2, 2], bgr=True))
    )["x"]
    np.testing.assert_allclose(bgr[0, :, 0, 0], [10.0, 5.0, 0.0])
    nhwc = conv_net()
    dims = nhwc.graph.input[0].type.tensor_type.shape.dim
    for d, v in zip(dims, (1, 16, 16, 3), strict=True):
        d.dim_value = v
    sample = next(iter(load_calibration_data(folder, nhwc, layout="NHWC", letterbox=True)))["x"]
    assert sample.shape == (1, 16, 16, 3)


def test_npy_and_npz_folders(tmp_path: Path) -> None:
    npy = tmp_path / "npy"
    npy.mkdir()
    for i in range(2):
        np.save(npy / f"{i}.npy", np.full((1, 3, 16, 16), i, np.float32))
    ds = load_calibration_data(npy, conv_net())
    assert [float(s["x"].mean()) for s in ds] == [0.0, 1.0]
    npz = tmp_path / "npz"
    npz.mkdir()
    np.savez(npz / "s0.npz", a=np.ones((1, 4), np.float32), b=np.zeros((1, 4), np.float32))
    sample = next(iter(load_calibration_data(npz, two_input_model())))
    assert set(sample) == {"a", "b"}
    with pytest.raises(CalibrationDataError, match="inputs"):
        load_calibration_data(npy, two_input_model())


def test_dataset_txt(tmp_path: Path) -> None:
    np.save(tmp_path / "a0.npy", np.ones((1, 4), np.float32))
    np.save(tmp_path / "b0.npy", np.zeros((1, 4), np.float32))
    (tmp_path / "dataset.txt").write_text("# a b\na0.npy b0.npy\n\n")
    ds = load_calibration_data(tmp_path / "dataset.txt", two_input_model())
    sample = next(iter(ds))
    assert sample["a"].sum() == 4 and sample["b"].sum() == 0
    (tmp_path / "bad.txt").write_text("a0.npy\n")
    with pytest.raises(CalibrationDataError, match="bad.txt:1"):
        load_calibration_data(tmp_path / "bad.txt", two_input_model())
    (tmp_path / "missing.txt").write_text("a0.npy nope.npy\n")
    with pytest.raises(CalibrationDataError, match="nope.npy"):
        load_calibration_data(tmp_path / "missing.txt", two_input_model())


def test_clear_errors(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(CalibrationDataError, match="no images"):
        load_calibration_data(tmp_path / "empty", conv_net())
    with pytest.raises(CalibrationDataError, match="no such file"):
        load_calibration_data(tmp_path / "absent", conv_net())
    bad = tmp_path / "shape"
    bad.mkdir()
    np.save(bad / "0.npy", np.zeros((1, 3, 8, 8), np.float32))
    with pytest.raises(CalibrationDataError, match="shape"):
        list(load_calibration_data(bad, conv_net()))
    assert issubclass(CalibrationDataError, ValueError)


def test_limit_and_quantize_from_a_folder(tmp_path: Path) -> None:
    write_images(tmp_path / "imgs", n=5)
    ds = load_calibration_data(tmp_path / "imgs", conv_net(), limit=2)
    assert len(ds) == 2
    result = quantize_model(conv_net(), ds, default_quantization.with_bias_correction())
    assert result.report["calibration"]["samples"] == 2


def _sqrt_then_conv() -> onnx.ModelProto:
    w = numpy_helper.from_array(np.ones((2, 3, 1, 1), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Sqrt", ["x"], ["root"]), helper.make_node("Conv", ["root", "w"], ["y"])],
        "sqrt_conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 4, 4])],
        [w],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def test_a_sample_on_which_the_float_model_computes_nan_is_named(tmp_path: Path) -> None:
    folder = tmp_path / "negative"
    folder.mkdir()
    for k in range(2):
        np.save(folder / f"{k}.npy", np.full((1, 3, 4, 4), 1.0 - 2 * k, np.float32))
    data = load_calibration_data(folder, _sqrt_then_conv())
    with pytest.raises(CalibrationDataError, match=r"sample 1: tensor '(root|y)' holds NaN"):
        quantize_model(_sqrt_then_conv(), data, default_quantization)


def test_a_dynamic_image_input_gets_an_input_shape_to_paste(tmp_path: Path) -> None:
    """The hint keeps the dims the model fixes (one channel, height 64) and is a CLI flag."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 1, 64, "w"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "ocr", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    write_images(tmp_path / "imgs")
    with pytest.raises(CalibrationDataError) as raised:
        load_calibration_data(tmp_path / "imgs", model)
    assert raised.value.hint.startswith("fix it with --input-shape x=1,1,64,640 ")
