"""Auto hybrid: a concatenated head whose small-range half collapses in int8 is raised."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler.quantize import RknnConfig, quantize_model
from compiler.quantize.analysis import analyze_quantization_error
from compiler.quantize.hybrid import auto_hybrid


def collapsing_head() -> onnx.ModelProto:
    """Boxes (range ~±500) and scores (range ~±0.5) concatenated, then sliced apart: int8 steps
    sized for the boxes round every score to zero."""
    rng = np.random.default_rng(0)
    wa = (rng.standard_normal((4, 3, 3, 3)) * 60).astype(np.float32)
    wb = (rng.standard_normal((4, 3, 3, 3)) * 0.05).astype(np.float32)
    ints = {"s0": 0, "s4": 4, "s8": 8, "ax": 1}
    inits = [numpy_helper.from_array(wa, "wa"), numpy_helper.from_array(wb, "wb")]
    inits += [numpy_helper.from_array(np.array([v], np.int64), k) for k, v in ints.items()]
    nodes = [
        helper.make_node("Conv", ["x", "wa"], ["boxes_raw"], name="box_conv", pads=[1] * 4),
        helper.make_node("Conv", ["x", "wb"], ["scores_raw"], name="score_conv", pads=[1] * 4),
        helper.make_node("Concat", ["boxes_raw", "scores_raw"], ["head"], name="head", axis=1),
        helper.make_node("Slice", ["head", "s0", "s4", "ax"], ["boxes"], name="box_slice"),
        helper.make_node("Slice", ["head", "s4", "s8", "ax"], ["scores"], name="score_slice"),
    ]
    out = [
        helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 4, 8, 8])
        for n in ("boxes", "scores")
    ]
    graph = helper.make_graph(
        nodes,
        "head",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        out,
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def test_int8_collapses_the_small_half(samples) -> None:
    q = quantize_model(collapsing_head(), samples)
    result = analyze_quantization_error(collapsing_head(), q.model, samples)
    assert {e.tensor for e in result.layers[:2]} == {"head", "scores"}
    assert result.layer("scores").single.cosine < 0.5
    head = result.layer("head")
    assert head.single.cosine > 0.999  # the whole tensor hides the collapse …
    assert head.single_parts["scores_raw"].cosine < 0.5  # … its scores part shows it
    assert head.single_parts["boxes_raw"].cosine > 0.999
    assert head.worst_cosine() == head.single_parts["scores_raw"].cosine


def test_auto_hybrid_fixes_it_and_says_why(samples) -> None:
    result = auto_hybrid(collapsing_head(), samples)
    assert result.converged and result.rounds == 1
    by_tensor = {r.tensor: r for r in result.raised}
    assert set(by_tensor) == {"head", "scores"}
    assert {n for r in result.raised for n in r.nodes} == {"score_slice", "head"}
    assert "the part from scores_raw" in by_tensor["head"].reason
    for raised in result.raised:
        assert raised.precision == "int16" and raised.round == 1
        assert raised.cosine_before < 0.5 and raised.cosine_after > 0.99
    assert result.analysis.outputs["scores"].cosine > 0.99
    assert result.initial.outputs["scores"].cosine < 0.5
    custom = result.quantized.params.custom_quantization_configs
    assert custom["head"].activation_quantization_scheme.bits == 16
    assert "box_conv" not in custom
    record = json.dumps(result.to_dict(), allow_nan=False)
    assert "score_slice" in record


def test_bf16_on_modalix_and_rknn_threshold(samples) -> None:
    result = auto_hybrid(collapsing_head(), samples, target="modalix")
    assert result.raised[0].precision == "bf16"
    assert result.analysis.outputs["scores"].cosine > 0.999
    relaxed = auto_hybrid(
        collapsing_head(),
        samples,
        RknnConfig(target_platform="rk3588", auto_hybrid_cos_thresh=0.0001),
    )
    assert relaxed.settings["cos_thresh"] == 0.0001
    assert {r.tensor for r in relaxed.raised} == {"head", "scores"}  # 0 is under any threshold


def test_unreachable_threshold_stops_and_reports(samples) -> None:
    result = auto_hybrid(collapsing_head(), samples, cos_thresh=1.0, max_rounds=3)
    assert not result.converged and result.remaining
    assert result.rounds == 1  # round 2 had nothing left to raise
    assert {n for r in result.raised for n in r.nodes} >= {"box_conv", "score_conv", "head"}


def test_bad_settings() -> None:
    with pytest.raises(ValueError, match="max_rounds"):
        auto_hybrid(collapsing_head(), [], max_rounds=0)
    with pytest.raises(ValueError, match="metric"):
        auto_hybrid(collapsing_head(), [], metric="worst")  # type: ignore[arg-type]
