"""`fix` on a model that is already quantized (QDQ): it rewrites the float model the QDQ graph
quantizes, whose segments `check` counts, and says that the result must be quantized again."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

from surgery.check import check_model
from surgery.model import set_input_shapes
from surgery.qdq import (
    QUANTIZATION_METADATA_KEY,
    REWRITTEN_AS_FLOAT_NOTE,
    float_model,
    float_view,
)
from surgery.rules.engine import apply_rule
from surgery.rules.fix import fix_model
from surgery.verify import make_inputs, run_model
from tests.conftest import shared_model

TOKENS, CHANNELS = 16, 32
QDQ_OPS = {"QuantizeLinear", "DequantizeLinear"}


def _int8_weight(rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> list:
    """An int8 weight with per-tensor scale and zero point, as initializers."""
    return [
        numpy_helper.from_array(rng.integers(-127, 128, size=shape).astype(np.int8), name),
        numpy_helper.from_array(np.array(0.01, np.float32), f"{name}_scale"),
        numpy_helper.from_array(np.array(0, np.int8), f"{name}_zero"),
    ]


def _activation_pair(tensor: str) -> list[onnx.NodeProto]:
    """QuantizeLinear → DequantizeLinear of a run-time tensor (scale 0.05, zero point 0)."""
    return [
        helper.make_node("QuantizeLinear", [tensor, "act_scale", "act_zero"], [f"{tensor}_q"]),
        helper.make_node(
            "DequantizeLinear", [f"{tensor}_q", "act_scale", "act_zero"], [f"{tensor}_dq"]
        ),
    ]


@pytest.fixture(name="qdq_linear")
def qdq_linear_fixture() -> onnx.ModelProto:
    return qdq_linear_model()


def qdq_linear_model() -> onnx.ModelProto:
    """A transformer's linear layer on rank-3 tokens, quantized as ONNX Runtime writes it:
    x → Q/DQ → MatMul(DQ(int8 weight)) → Add(bias) → Relu → Q/DQ → y. Opset 13, whose
    DequantizeLinear ONNX's reference evaluator cannot run."""
    rng = np.random.default_rng(0)
    inits = [
        *_int8_weight(rng, "w", (CHANNELS, CHANNELS)),
        numpy_helper.from_array(rng.normal(size=CHANNELS).astype(np.float32), "bias"),
        numpy_helper.from_array(np.array(0.05, np.float32), "act_scale"),
        numpy_helper.from_array(np.array(0, np.int8), "act_zero"),
    ]
    nodes = [
        *_activation_pair("x"),
        helper.make_node("DequantizeLinear", ["w", "w_scale", "w_zero"], ["w_dq"], name="w_dq"),
        helper.make_node("MatMul", ["x_dq", "w_dq"], ["mm"], name="linear"),
        helper.make_node("Add", ["mm", "bias"], ["biased"], name="bias_add"),
        helper.make_node("Relu", ["biased"], ["r"], name="relu"),
        *_activation_pair("r"),
        helper.make_node("Identity", ["r_dq"], ["y"], name="out"),
    ]
    graph = helper.make_graph(
        nodes,
        "qdq_linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, TOKENS, CHANNELS])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, TOKENS, CHANNELS])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    helper.set_model_props(model, {QUANTIZATION_METADATA_KEY: '{"target": "mlsoc"}'})
    return model


def test_float_model_has_no_quantize_or_dequantize_nodes(qdq_linear):
    ops = {n.op_type for n in float_model(qdq_linear).graph.node}
    assert not ops & QDQ_OPS


def test_float_model_weight_is_the_dequantized_int8_weight(qdq_linear):
    weights = {t.name: numpy_helper.to_array(t) for t in float_model(qdq_linear).graph.initializer}
    stored = {t.name: numpy_helper.to_array(t) for t in qdq_linear.graph.initializer}
    np.testing.assert_array_equal(
        weights["w_dq"], stored["w"].astype(np.float32) * np.float32(0.01)
    )


def test_float_model_computes_what_the_float_view_computes(qdq_linear):
    feed = make_inputs(qdq_linear, seed=0)
    expected = run_model(float_view(qdq_linear), feed)["y"]
    np.testing.assert_allclose(run_model(float_model(qdq_linear), feed)["y"], expected, atol=1e-6)


def test_float_model_drops_the_quantization_record(qdq_linear):
    keys = {p.key for p in float_model(qdq_linear).metadata_props}
    assert QUANTIZATION_METADATA_KEY not in keys


@pytest.fixture
def qdq_constant_operand() -> onnx.ModelProto:
    """A GELU's `+ 1` as ONNX Runtime's quantizer writes it: the Constant 1 is quantized and
    dequantized in the graph (Constant → QuantizeLinear → DequantizeLinear → Add)."""
    nodes = [
        helper.make_node("Erf", ["x"], ["e"], name="erf"),
        helper.make_node(
            "Constant",
            [],
            ["one"],
            name="one",
            value=numpy_helper.from_array(np.array(1.0, np.float32)),
        ),
        helper.make_node("QuantizeLinear", ["one", "c_scale", "c_zero"], ["one_q"], name="one_q"),
        helper.make_node(
            "DequantizeLinear", ["one_q", "c_scale", "c_zero"], ["one_dq"], name="one_dq"
        ),
        helper.make_node("Add", ["e", "one_dq"], ["y"], name="add_one"),
    ]
    graph = helper.make_graph(
        nodes,
        "qdq_constant",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, TOKENS, CHANNELS])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, TOKENS, CHANNELS])],
        [
            numpy_helper.from_array(np.array(1 / 127, np.float32), "c_scale"),
            numpy_helper.from_array(np.array(0, np.int8), "c_zero"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def test_float_model_makes_a_quantized_constant_operand_an_initializer(qdq_constant_operand):
    model = float_model(qdq_constant_operand)
    add = next(n for n in model.graph.node if n.op_type == "Add")
    initializers = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    assert add.input[1] in initializers
    np.testing.assert_allclose(initializers[add.input[1]], 1.0, rtol=1e-6)
    assert [n.op_type for n in model.graph.node] == ["Erf", "Add"]


def test_fix_of_a_qdq_model_starts_from_the_coverage_check_reports(qdq_linear):
    before = fix_model(qdq_linear, "mlsoc").coverage_before
    checked = check_model(qdq_linear, "mlsoc")
    assert before.mla_segments == checked.mla_segments
    assert sorted(b.op_type for b in before.blockers) == sorted(b.op_type for b in checked.blockers)
    assert not {b.op_type for b in before.blockers} & QDQ_OPS


def test_fix_of_a_qdq_model_returns_a_float_model_on_one_segment(qdq_linear):
    result = fix_model(qdq_linear, "mlsoc")
    assert not {n.op_type for n in result.model.graph.node} & QDQ_OPS
    assert result.single_elf, [b.name for b in result.coverage_after.blockers]


def test_fix_of_a_qdq_model_says_it_must_be_quantized_again(qdq_linear):
    result = fix_model(qdq_linear, "mlsoc")
    assert result.notes[0] == REWRITTEN_AS_FLOAT_NOTE
    assert "surgery quantize" in REWRITTEN_AS_FLOAT_NOTE


def test_apply_on_a_qdq_model_rewrites_its_float_model_and_says_so(qdq_linear):
    result = apply_rule(qdq_linear, "transformer-to-4d", "mlsoc")
    assert not {n.op_type for n in result.model.graph.node} & QDQ_OPS
    assert result.summary()["notes"] == [REWRITTEN_AS_FLOAT_NOTE]
    assert result.coverage_after.mla_segments == 1


def test_fix_of_a_float_model_adds_no_quantization_note(qdq_linear):
    result = fix_model(float_model(qdq_linear), "mlsoc")
    assert REWRITTEN_AS_FLOAT_NOTE not in result.notes


class _RandomImages(CalibrationDataReader):
    """Calibration reader for ONNX Runtime's quantizer: two seeded images."""

    def __init__(self, name: str, shape: list[int]) -> None:
        rng = np.random.default_rng(0)
        self._feeds = iter([{name: rng.random(shape, dtype=np.float32)} for _ in range(2)])

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._feeds, None)


@pytest.mark.slow
def test_fix_takes_a_vit_quantized_by_onnx_runtime_to_one_segment(tmp_path):
    """ONNX Runtime's `quantize_static` (QDQ, per channel) on ViT-Tiny: its float model, whose
    GELU constants the quantizer wrote as Constant → Q → DQ, lifts to one segment."""
    model = onnx.load(shared_model("vit_tiny_patch16_224"))
    set_input_shapes(model, {"input": [1, 3, 224, 224]})
    onnx.save(model, tmp_path / "vit.onnx")
    reader = _RandomImages("input", [1, 3, 224, 224])
    quantize_static(
        tmp_path / "vit.onnx",
        tmp_path / "vit_qdq.onnx",
        reader,
        quant_format=QuantFormat.QDQ,
        per_channel=True,
    )
    qdq = onnx.load(tmp_path / "vit_qdq.onnx")
    result = fix_model(qdq, "mlsoc")
    assert result.coverage_before.mla_segments > 1
    assert result.single_elf, result.notes
    assert result.notes[0] == REWRITTEN_AS_FLOAT_NOTE


def test_check_of_a_qdq_model_suggests_what_matches_its_float_model(qdq_linear):
    """On the float view the weight is a DequantizeLinear and transformer-to-4d cannot match
    the MatMul; on the float model fix rewrites, it does."""
    report = check_model(qdq_linear)
    linear = next(b for b in report.blockers if b.name == "linear")
    assert "transformer-to-4d" in linear.suggested_rules
