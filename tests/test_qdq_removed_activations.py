"""`float_model` puts back the Relu and Clip that ONNX Runtime's quantizer removed.

`quantize_static` (asymmetric QDQ, its default) drops a Relu or Clip after a quantized op and
lets the next QuantizeLinear's [0, max] range clamp instead. Without its Q -> DQ pair the float
model would lose the activation: a PP-OCR classifier's float model overflowed to NaN.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

from surgery.check import check_model
from surgery.qdq import float_model, float_view
from surgery.rules.fix import fix_model
from surgery.session import record_fix
from surgery.verify import run_model
from surgery.workspace import Workspace

SHAPE = [1, 4, 8, 8]


def _conv_model(activation: str | None) -> onnx.ModelProto:
    """Conv → `activation` (Relu, or Clip to [0, 6]) → Conv, with weights that make the first
    Conv's output reach far below 0 and above 6."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(4 * rng.normal(size=(4, 4, 3, 3)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.normal(size=(4, 4, 1, 1)).astype(np.float32), "w2"),
        numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
        numpy_helper.from_array(np.array(6.0, np.float32), "six"),
    ]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"], name="conv1", pads=[1, 1, 1, 1])]
    source = "a"
    if activation == "Relu":
        nodes.append(helper.make_node("Relu", ["a"], ["r"], name="act"))
        source = "r"
    elif activation == "Clip":
        nodes.append(helper.make_node("Clip", ["a", "zero", "six"], ["r"], name="act"))
        source = "r"
    nodes.append(helper.make_node("Conv", [source, "w2"], ["y"], name="conv2"))
    graph = helper.make_graph(
        nodes,
        "conv_act_conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, SHAPE)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, SHAPE)],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


class _Images(CalibrationDataReader):
    def __init__(self, samples: int = 4) -> None:
        rng = np.random.default_rng(1)
        self._feeds = iter([{"x": rng.random(SHAPE, dtype=np.float32)} for _ in range(samples)])

    def get_next(self):
        return next(self._feeds, None)


def _ort_qdq(model: onnx.ModelProto, tmp_path, symmetric: bool = False) -> onnx.ModelProto:
    onnx.save(model, tmp_path / "float.onnx")
    quantize_static(
        tmp_path / "float.onnx",
        tmp_path / "qdq.onnx",
        _Images(),
        quant_format=QuantFormat.QDQ,
        extra_options={"ActivationSymmetric": symmetric},
    )
    return onnx.load(tmp_path / "qdq.onnx")


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


@pytest.mark.parametrize("activation", ["Relu", "Clip"])
def test_an_activation_the_quantizer_removed_comes_back_as_a_clip(activation, tmp_path):
    qdq = _ort_qdq(_conv_model(activation), tmp_path)
    assert activation not in _ops(qdq)  # the premise: ONNX Runtime removed it
    restored = float_model(qdq)
    assert _ops(restored) == ["Conv", "Clip", "Conv"]
    low, high = (
        numpy_helper.to_array(i) for i in restored.graph.initializer if "clamp_m" in i.name
    )
    assert float(low) == 0.0
    assert 0 < float(high) <= (6.0 if activation == "Clip" else np.inf)


@pytest.mark.parametrize("activation", ["Relu", "Clip"])
def test_the_restored_float_model_computes_what_the_float_model_did(activation, tmp_path):
    """Within the quantization error of the QDQ model, not the unclamped Conv's values, on an
    input like the calibration samples (above their range, the QDQ model clamps a Relu's
    output at its calibrated maximum, and so does the restored Clip)."""
    original = _conv_model(activation)
    restored = float_model(_ort_qdq(original, tmp_path))
    x = {"x": np.random.default_rng(2).random(SHAPE, dtype=np.float32)}
    want = run_model(original, x)["y"]
    got = run_model(restored, x)["y"]
    unclamped = run_model(_conv_model(None), x)["y"]
    error = np.abs(got - want).max()
    assert error < 0.2 * np.abs(want).max()
    assert error < 0.2 * np.abs(unclamped - want).max()


def test_a_signed_range_gets_no_clip(tmp_path):
    """Without an activation the Conv's range straddles 0: nothing was removed."""
    restored = float_model(_ort_qdq(_conv_model(None), tmp_path))
    assert _ops(restored) == ["Conv", "Conv"]


def test_symmetric_quantization_keeps_the_relu_and_adds_no_clip(tmp_path):
    """ONNX Runtime removes no activation with symmetric activations."""
    restored = float_model(_ort_qdq(_conv_model("Relu"), tmp_path, symmetric=True))
    assert _ops(restored) == ["Conv", "Relu", "Conv"]


def test_a_range_from_zero_after_a_relu_adds_no_clip():
    """A Q -> DQ pair of a Relu's output starts at 0 because the Relu's output does."""
    scale = numpy_helper.from_array(np.array(0.05, np.float32), "s")
    zero = numpy_helper.from_array(np.array(0, np.uint8), "z")
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node("QuantizeLinear", ["r", "s", "z"], ["rq"]),
        helper.make_node("DequantizeLinear", ["rq", "s", "z"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "relu_qdq",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, SHAPE)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, SHAPE)],
        [scale, zero],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert _ops(float_model(model)) == ["Relu"]


def test_fix_of_an_ort_quantized_model_verifies_against_its_float_model(tmp_path):
    """The end-to-end check compares the result with the float model the steps rewrote; the
    QDQ input differs from it by its quantization, which is not a rewrite's error."""
    qdq = _ort_qdq(_conv_model("Clip"), tmp_path)
    ws = Workspace(tmp_path / "ws")
    parent = ws.import_model(tmp_path / "qdq.onnx", name="m")
    _, check = record_fix(ws, parent, fix_model(qdq, "mlsoc"))
    assert check["passed"], check
    assert "float model" in check["reference"]


def test_two_ranges_from_zero_on_one_tensor_get_clips_of_their_own_names():
    """Names stay unique when one tensor is quantized twice."""
    inits = [
        numpy_helper.from_array(np.array(0.05, np.float32), "s"),
        numpy_helper.from_array(np.array(0.1, np.float32), "s2"),
        numpy_helper.from_array(np.array(0, np.uint8), "z"),
    ]
    nodes = [helper.make_node("Neg", ["x"], ["a"])]
    for k, scale in enumerate(("s", "s2")):
        nodes += [
            helper.make_node("QuantizeLinear", ["a", scale, "z"], [f"q{k}"]),
            helper.make_node("DequantizeLinear", [f"q{k}", scale, "z"], [f"y{k}"]),
        ]
    outputs = [helper.make_tensor_value_info(f"y{k}", TensorProto.FLOAT, SHAPE) for k in (0, 1)]
    graph = helper.make_graph(
        nodes,
        "twice",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, SHAPE)],
        outputs,
        inits,
    )
    restored = float_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    onnx.checker.check_model(restored, full_check=True)
    assert _ops(restored) == ["Neg", "Clip", "Clip"]
    x = {"x": -np.linspace(-2, 30, 256, dtype=np.float32).reshape(SHAPE)}
    outs = run_model(restored, x)
    assert outs["y0"].min() == 0 and outs["y0"].max() == pytest.approx(255 * 0.05)
    assert outs["y1"].max() == pytest.approx(255 * 0.1)


def test_float_model_leaves_the_quantized_model_as_it_was(tmp_path):
    """The Clips are put into a copy, which is then rewritten in place: never the caller's."""
    qdq = _ort_qdq(_conv_model("Relu"), tmp_path)
    before = qdq.SerializeToString()
    assert _ops(float_model(qdq)) == ["Conv", "Clip", "Conv"]
    assert qdq.SerializeToString() == before


def test_float_view_in_place_rewrites_the_given_model_as_the_copy_would(tmp_path):
    qdq = _ort_qdq(_conv_model("Relu"), tmp_path)
    before = qdq.SerializeToString()
    copied = float_view(qdq)
    assert qdq.SerializeToString() == before
    assert float_view(qdq, in_place=True) is qdq
    assert qdq.SerializeToString() == copied.SerializeToString()


def test_check_of_a_quantized_model_leaves_it_as_it_was_with_and_without_suggestions(tmp_path):
    """Without suggestions, check rewrites its own copy into the float view in place."""
    qdq = _ort_qdq(_conv_model("Relu"), tmp_path)
    before = qdq.SerializeToString()
    placed = check_model(qdq, "mlsoc", suggest=False)
    suggested = check_model(qdq, "mlsoc")
    assert qdq.SerializeToString() == before
    assert [(p.name, p.processor) for p in placed.placements] == [
        (p.name, p.processor) for p in suggested.placements
    ]
