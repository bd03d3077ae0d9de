"""Output sensitivity and auto-hybrid to an output SQNR target, on a synthetic outlier model."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler.api import load_model
from compiler.quantize import RknnConfig, quantize_model
from compiler.quantize.analysis import analyze_quantization_error, find_quantized_tensors
from compiler.quantize.calibrate import reference_session
from compiler.quantize.hybrid import auto_hybrid, output_errors
from compiler.quantize.sensitivity import MASK_INPUT, output_sensitivity, switched_model
from tests.test_quant_hybrid import collapsing_head


def outlier_model() -> onnx.ModelProto:
    """conv_a → mid → conv_b → out. One channel of `mid` is ~1000× the others, and conv_b
    ignores it: int8 steps sized for the outlier channel erase what the output is made of,
    while `mid` as a whole keeps a cosine near 1."""
    rng = np.random.default_rng(0)
    wa = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    wa[0] *= 1000.0
    wb = rng.standard_normal((2, 4, 1, 1)).astype(np.float32)
    wb[:, 0] = 0.0
    wc = rng.standard_normal((3, 3, 1, 1)).astype(np.float32)
    nodes = [
        helper.make_node("Conv", ["x", "wc"], ["pre"], name="conv_pre"),
        helper.make_node("Conv", ["pre", "wa"], ["mid"], name="conv_a", pads=[1] * 4),
        helper.make_node("Conv", ["mid", "wb"], ["out"], name="conv_b"),
    ]
    inits = [numpy_helper.from_array(w, n) for w, n in ((wa, "wa"), (wb, "wb"), (wc, "wc"))]
    graph = helper.make_graph(
        nodes,
        "outlier",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 2, 8, 8])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


@pytest.fixture(scope="module")
def quantized(samples):
    return quantize_model(outlier_model(), samples)


def concatenated_head() -> onnx.ModelProto:
    """`collapsing_head` with its Concat as the one output: boxes (~±500) ‖ scores (~±0.5)."""
    model = collapsing_head()
    del model.graph.node[3:]
    del model.graph.output[:]
    model.graph.output.append(
        helper.make_tensor_value_info("head", TensorProto.FLOAT, [1, 8, 8, 8])
    )
    return model


def plain_conv() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], name="conv", pads=[1] * 4)],
        "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        [w],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def _db(model, quantized, samples) -> float:
    """The SQNR of the worst output piece."""
    _, signal, noise, _ = output_errors(model, quantized, samples, None)
    return float(np.min(10 * np.log10(signal / noise)))


def test_switches_off_give_float_and_on_give_the_qdq_model(quantized, samples) -> None:
    pairs, _ = find_quantized_tensors(quantized.model, quantized.float_model)
    session = reference_session(switched_model(quantized.model, quantized.float_model, pairs))
    feed = {"x": samples[0]}
    float_out = reference_session(quantized.float_model).run(None, feed)[0]
    qdq_out = reference_session(quantized.model).run(None, feed)[0]
    off = session.run(None, {**feed, MASK_INPUT: np.zeros(len(pairs), np.float32)})[0]
    on = session.run(None, {**feed, MASK_INPUT: np.ones(len(pairs), np.float32)})[0]
    np.testing.assert_allclose(off, float_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(on, qdq_out, rtol=1e-5, atol=1e-5)
    assert np.abs(qdq_out - float_out).max() > 1e-3


def test_sensitivity_finds_the_layer_the_outlier_ruins(quantized, samples) -> None:
    result = output_sensitivity(quantized.float_model, quantized.model, samples, limit=3)
    assert result.units[0].tensors == ("mid",)
    assert result.units[0].sqnr_db < 20 < result.units[-1].sqnr_db
    layer = analyze_quantization_error(quantized.float_model, quantized.model, samples)
    assert layer.layer("mid").single.cosine > 0.999  # the per-layer cosine does not see it


def test_sensitivity_blocks_group_neighbours(quantized, samples) -> None:
    result = output_sensitivity(quantized.float_model, quantized.model, samples, blocks=2)
    assert sorted(len(u.tensors) for u in result.units) == [2, 2]
    assert abs(sum(u.noise for u in result.units) / result.total_noise - 1) < 0.5


def test_target_raises_the_ruined_layer_and_the_output_improves(samples) -> None:
    model = outlier_model()
    before = _db(model, quantize_model(model, samples).model, samples)
    result = auto_hybrid(model, samples, target_sqnr_db=30.0, sensitivity_blocks=None)
    after = _db(model, result.quantized.model, samples)
    assert before < 20 and after >= 30 and result.converged
    assert [r.tensor for r in result.raised] == ["mid"]
    assert result.raised[0].nodes == ["conv_a"]
    assert "only its block of 1 layer(s)" in result.raised[0].reason
    custom = result.quantized.params.custom_quantization_configs
    assert set(custom) == {"conv_a"} and custom["conv_a"].weight_quantization_scheme.bits == 16
    assert json.dumps(result.to_dict(), allow_nan=False)


def test_target_already_met_raises_nothing(samples) -> None:
    result = auto_hybrid(plain_conv(), samples, target_sqnr_db=20.0)
    assert result.raised == [] and result.rounds == 0 and result.converged
    assert not result.quantized.params.custom_quantization_configs


def test_target_is_reached_by_each_output_not_by_their_pool(samples) -> None:
    """Pooled, the boxes' > 40 dB met a 20 dB target while int8 rounded every score to 0."""
    model = collapsing_head()
    assert _db(model, quantize_model(model, samples).model, samples) < 1
    result = auto_hybrid(model, samples, target_sqnr_db=20.0)
    assert "head" in {n for r in result.raised for n in r.nodes}
    assert result.converged and _db(model, result.quantized.model, samples) >= 20
    assert result.settings["output_sqnr_db"] >= 20


def test_target_is_reached_by_each_part_of_a_concatenated_output(samples) -> None:
    model = concatenated_head()
    result = auto_hybrid(model, samples, target_sqnr_db=20.0)
    assert [r.nodes for r in result.raised] == [["head"]]
    assert result.raised[0].reason.startswith("head (part from scores_raw) at 0.0 dB")
    assert result.converged and _db(model, result.quantized.model, samples) >= 20


def test_loaded_net_runs_auto_hybrid_with_an_rknn_config(samples) -> None:
    net = load_model(collapsing_head())
    rknn = RknnConfig(target_platform="rk3588", auto_hybrid_cos_thresh=0.98)
    plain = net.quantize(samples, rknn)
    hybrid = net.quantize(samples, rknn, auto_hybrid=True)
    assert "auto_hybrid" not in plain.report
    raised = {r["tensor"] for r in hybrid.report["auto_hybrid"]["raised"]}
    assert raised == {"head", "scores"}
    assert (
        hybrid.params.custom_quantization_configs["head"].activation_quantization_scheme.bits == 16
    )
