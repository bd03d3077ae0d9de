"""Attention masks do not set the range of a Softmax's input.

Transformer exports add finfo(float32).min (or −1e4) to the scores of masked keys before the
Softmax. Calibrated as is, the int8 step of the sum was ~1e36 and every real score shared one
code (the attention flattened; DistilBERT's output at 8 dB). Values far below their row's maximum
are invisible in the Softmax's output, so the range stops `softmax_span` below the row maxima,
wherever the mask comes from and through permuting ops before the Softmax — but only when the
Softmax is the quantized value's only reader.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler.compile import compile_model
from compiler.defines import (
    HistogramMSEMethod,
    MinMaxMethod,
    QuantizationParams,
    quantization_scheme,
)
from compiler.quantize import quantize_model
from compiler.quantize.calibrate import reference_session
from compiler.quantize.errors import QuantizationError
from compiler.quantize.observers import SoftmaxInputObserver, softmax_span
from compiler.quantize.qparams import activation_qparams, weight_scales
from compiler.quantize.ranges import Range, make_observer, select_range
from surgery.model import load_model
from surgery.rules.fix import fix_model

ASYM8 = quantization_scheme(asymmetric=True, per_channel=False, bits=8)
SYM8 = quantization_scheme(asymmetric=False, per_channel=False, bits=8)
HEADS, KEYS, DEPTH = 2, 8, 4
NEG = float(np.finfo(np.float32).min)


# --------------------------------------------------------------------------- models


def _attention(mask: str, *, relayout: bool = False, extra_reader: bool = False) -> onnx.ModelProto:
    """Scores q·k masked by an additive bias input ("add"), by a constant causal bias (what a
    decoder's mask folds to: "causal") or in torch's masked_fill form as `surgery fix` writes a
    Where(pad, finfo.min, scores): scores·keep + (1 − keep)·finfo.min ("fill"); optionally
    Transpose → Reshape before the Softmax, optionally also a graph output."""
    scores = helper.make_node("MatMul", ["q", "k"], ["scores"], name="qk")
    inputs = [
        helper.make_tensor_value_info("q", TensorProto.FLOAT, [1, HEADS, KEYS, DEPTH]),
        helper.make_tensor_value_info("k", TensorProto.FLOAT, [1, HEADS, DEPTH, KEYS]),
    ]
    inits = []
    if mask == "add":
        inputs.append(helper.make_tensor_value_info("bias", TensorProto.FLOAT, [1, 1, 1, KEYS]))
        nodes = [scores, helper.make_node("Add", ["scores", "bias"], ["masked"], name="mask")]
    elif mask == "causal":
        future = np.triu(np.ones((KEYS, KEYS), bool), 1).reshape(1, 1, KEYS, KEYS)
        inits.append(numpy_helper.from_array(np.where(future, NEG, 0).astype(np.float32), "causal"))
        nodes = [scores, helper.make_node("Add", ["scores", "causal"], ["masked"], name="mask")]
    else:
        inputs.append(helper.make_tensor_value_info("keep", TensorProto.FLOAT, [1, 1, 1, KEYS]))
        inits.append(numpy_helper.from_array(np.array(1.0, np.float32), "one"))
        inits.append(numpy_helper.from_array(np.array(NEG, np.float32), "fill"))
        nodes = [
            scores,
            helper.make_node("Sub", ["one", "keep"], ["pad"], name="pad"),
            helper.make_node("Mul", ["pad", "fill"], ["fill_bias"], name="mask_fill"),
            helper.make_node("Mul", ["scores", "keep"], ["kept"], name="keep_scores"),
            helper.make_node("Add", ["kept", "fill_bias"], ["masked"], name="mask"),
        ]
    probs_in = "masked"
    if relayout:
        shape = numpy_helper.from_array(np.array([HEADS * KEYS, KEYS], np.int64), "rows")
        inits.append(shape)
        nodes += [
            helper.make_node("Transpose", ["masked"], ["heads_last"], perm=[0, 2, 1, 3]),
            helper.make_node("Reshape", ["heads_last", "rows"], ["flat"], name="flatten_rows"),
        ]
        probs_in = "flat"
    nodes.append(helper.make_node("Softmax", [probs_in], ["probs"], name="softmax", axis=-1))
    out_shape = [HEADS * KEYS, KEYS] if relayout else [1, HEADS, KEYS, KEYS]
    outputs = [helper.make_tensor_value_info("probs", TensorProto.FLOAT, out_shape)]
    if extra_reader:
        outputs.append(
            helper.make_tensor_value_info("masked", TensorProto.FLOAT, [1, HEADS, KEYS, KEYS])
        )
    graph = helper.make_graph(nodes, "attention", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return fix_model(load_model(model), "mlsoc").model  # the Softmax in the MLA's layout


def _samples(mask: str, count: int, seed: int) -> list[dict[str, np.ndarray]]:
    """Scores of a few units; each sample masks a tail of 1 to 5 of the 8 keys."""
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(count):
        valid = int(rng.integers(3, KEYS))
        keep = np.arange(KEYS).reshape(1, 1, 1, KEYS) < valid
        sample = {
            "q": rng.normal(0, 1.5, (1, HEADS, KEYS, DEPTH)).astype(np.float32),
            "k": rng.normal(0, 1.5, (1, HEADS, DEPTH, KEYS)).astype(np.float32),
        }
        if mask == "add":
            sample["bias"] = np.where(keep, 0.0, NEG).astype(np.float32)
        elif mask == "fill":
            sample["keep"] = keep.astype(np.float32)
        samples.append(sample)
    return samples


def _quantize(model: onnx.ModelProto, mask: str, params: QuantizationParams | None = None):
    return quantize_model(model, _samples(mask, 6, seed=0), params, target="mlsoc")


def _probs_sqnr(quantized, mask: str) -> float:
    float_session = reference_session(quantized.float_model)
    qdq_session = reference_session(quantized.model)
    signal = noise = 0.0
    for feed in _samples(mask, 4, seed=1):
        ref = float_session.run(["probs"], feed)[0].astype(np.float64)
        got = qdq_session.run(["probs"], feed)[0].astype(np.float64)
        signal += float(np.square(ref).sum())
        noise += float(np.square(ref - got).sum())
    return 10 * math.log10(signal / noise)


# --------------------------------------------------------------------------- the span


def test_values_beyond_the_span_move_no_output_by_half_a_step() -> None:
    rng = np.random.default_rng(0)
    keys, bits = 64, 8
    span = softmax_span(keys, bits)
    rows = rng.normal(0, 8, (2000, keys))
    rows[:, 0] = rows.max(axis=1) + rng.uniform(0, 2, 2000)  # a peak above the rest
    floor = rows.max(axis=1, keepdims=True) - span
    below = rows < floor
    moved = np.where(below, floor - rng.uniform(0, 100, rows.shape), rows)  # anywhere below

    def softmax(x: np.ndarray) -> np.ndarray:
        e = np.exp(x - x.max(axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True)

    assert below.any()
    step = softmax(rows).max(axis=1, keepdims=True) / (2**bits - 1)
    assert (np.abs(softmax(moved) - softmax(rows)) < step / 2).all()


def test_span_widens_with_the_row_length_and_the_output_resolution() -> None:
    assert softmax_span(128, 8) == pytest.approx(math.log(128) + 9 * math.log(2) + 1)
    assert softmax_span(512, 8) > softmax_span(128, 8)
    assert softmax_span(128, 16) > softmax_span(128, 8)


# --------------------------------------------------------------------------- the observer


def _masked_scores(seed: int, masked: bool) -> np.ndarray:
    rng = np.random.default_rng(seed)
    scores = rng.normal(0, 1, (4, KEYS, KEYS)).astype(np.float32)
    if masked:
        scores[..., 5:] = NEG
    return scores


@pytest.mark.parametrize("method", [MinMaxMethod(), HistogramMSEMethod()])
def test_without_masked_values_the_range_is_the_methods_own(method) -> None:
    plain = make_observer(method)
    aware = SoftmaxInputObserver(inner=make_observer(method), axis=-1, output_bits=8)
    for seed in range(3):
        plain.update(_masked_scores(seed, masked=False))
        aware.update(_masked_scores(seed, masked=False))
    assert not aware.clamped
    assert select_range(method, aware, ASYM8) == select_range(method, plain, ASYM8)


def test_masked_values_stay_out_of_the_histogram() -> None:
    observer = SoftmaxInputObserver(inner=make_observer(HistogramMSEMethod()), output_bits=8)
    for seed in range(3):
        observer.update(_masked_scores(seed, masked=True))
    assert observer.min == NEG  # still reported as observed
    assert observer.inner.min > -20.0
    assert observer.inner.width < 0.05


def test_range_reaches_the_lowest_row_maximum_minus_the_span() -> None:
    scores = _masked_scores(0, masked=True)
    observer = SoftmaxInputObserver(inner=make_observer(HistogramMSEMethod()), output_bits=8)
    observer.update(scores)
    lowest_peak = float(scores.max(axis=-1).min())
    r = select_range(HistogramMSEMethod(), observer, ASYM8)
    assert r.lo == pytest.approx(lowest_peak - softmax_span(KEYS, 8), rel=1e-6)
    assert r.hi <= float(scores.max())


def test_rows_that_lost_nothing_do_not_lower_the_floor() -> None:
    scores = _masked_scores(0, masked=False)
    scores[0, 0, :] = -30.0  # an unmasked row far below the others, nothing insignificant in it
    scores[1, :, 5:] = NEG
    observer = SoftmaxInputObserver(inner=make_observer(MinMaxMethod()), output_bits=8)
    observer.update(scores)
    assert observer.floor == pytest.approx(
        float(scores[1].max(axis=-1).min()) - softmax_span(KEYS, 8), rel=1e-6
    )


def test_minus_infinity_masks_clamp_to_a_finite_floor() -> None:
    scores = _masked_scores(0, masked=False)
    scores[..., 6:] = -np.inf
    observer = SoftmaxInputObserver(inner=make_observer(MinMaxMethod()), output_bits=8)
    observer.update(scores)
    r = select_range(MinMaxMethod(), observer, ASYM8)
    finite = scores[..., :6]
    assert r.lo == pytest.approx(float(finite.max(axis=-1).min()) - softmax_span(KEYS, 8), rel=1e-6)
    assert r.lo < float(finite.min())  # −inf lands where it stays insignificant


# --------------------------------------------------------------------------- the graph


def test_additive_mask_leaves_the_scores_a_score_sized_step() -> None:
    quantized = _quantize(_attention("add"), "add")
    entry = quantized.report["tensors"]["masked"]
    assert entry["observed_min"] == NEG
    assert entry["min"] == pytest.approx(entry["softmax_floor"])
    assert entry["scale"] < 0.2
    assert _probs_sqnr(quantized, "add") > 25.0


def test_masked_fill_form_is_clamped_like_an_additive_mask() -> None:
    quantized = _quantize(_attention("fill"), "fill")
    assert quantized.report["tensors"]["masked"]["scale"] < 0.2
    assert _probs_sqnr(quantized, "fill") > 25.0


def test_mask_operand_of_a_clamped_sum_stops_below_the_sums_range() -> None:
    quantized = _quantize(_attention("fill"), "fill")
    tensors = quantized.report["tensors"]
    fill_bias, masked, kept = tensors["fill_bias"], tensors["masked"], tensors["kept"]
    assert fill_bias["observed_min"] == NEG
    assert fill_bias["min"] == pytest.approx(
        masked["min"] - kept["max"] - (masked["max"] - masked["min"])
    )


def test_finfo_min_factor_of_a_saturating_mul_is_stored_at_a_usable_scale() -> None:
    quantized = _quantize(_attention("fill"), "fill")
    assert quantized.report["weights"]["fill"]["scale_max"] < 1e3


def test_constant_causal_mask_is_stored_at_a_usable_scale() -> None:
    """A decoder's causal mask folds to a constant Add operand holding finfo.min: stored as is,
    its step was ~1e36 and the integer Add needed a ~1e32 requantization multiplier, so the
    compiler sent every masked Add to the CVU and split the model."""
    quantized = _quantize(_attention("causal"), "causal")
    assert quantized.report["weights"]["causal"]["scale_max"] < 1e3
    assert _probs_sqnr(quantized, "causal") > 25.0


def test_constant_causal_mask_compiles_to_one_elf(tmp_path) -> None:
    quantized = _quantize(_attention("causal"), "causal")
    result = compile_model(quantized.model, tmp_path, model_name="causal")
    assert len(result.elf_files) == 1 and result.notes == []


def test_constant_with_infinities_is_refused_by_name() -> None:
    """scores − (+inf where masked): no saturation bound applies to a Sub operand, and inf has
    no integer scale, so a QuantizationError names the constant (it used to surface as a NaN
    scale, then a ValueError deep in compile)."""
    model = _attention("causal")
    for init in model.graph.initializer:
        if init.name == "causal":
            values = numpy_helper.to_array(init)
            init.CopyFrom(
                numpy_helper.from_array(
                    np.where(values < 0, np.inf, 0.0).astype(np.float32), "causal"
                )
            )
    next(n for n in model.graph.node if n.op_type == "Add").op_type = "Sub"
    with pytest.raises(QuantizationError, match="'causal'.*inf or NaN"):
        _quantize(model, "causal")


def test_clamp_follows_a_transpose_and_reshape_to_the_softmax() -> None:
    quantized = _quantize(_attention("add", relayout=True), "add")
    tensors = quantized.report["tensors"]
    assert {tensors[t].get("shared_with") for t in ("heads_last", "flatten_rows_out")} == {"masked"}
    assert tensors["masked"]["scale"] < 0.2
    assert _probs_sqnr(quantized, "add") > 25.0


def test_scores_with_another_reader_keep_their_full_range() -> None:
    quantized = _quantize(_attention("add", extra_reader=True), "add")
    entry = quantized.report["tensors"]["masked"]
    assert "softmax_floor" not in entry
    assert entry["min"] < -1e37


def test_float_softmax_gets_the_wider_span_of_a_float32_output() -> None:
    params = QuantizationParams().with_unquantized_nodes("softmax_channel")
    quantized = _quantize(_attention("add"), "add", params)
    entry = quantized.report["tensors"]["masked"]
    assert entry["softmax_span"] == pytest.approx(softmax_span(KEYS, 24))


# --------------------------------------------------------------------------- finite Q/DQ


def test_finfo_min_constant_dequantizes_to_a_finite_value() -> None:
    scale = weight_scales(np.array(NEG, np.float32), SYM8, None, None)
    assert np.isfinite(np.float32(-127) * scale).all()
    assert float(np.float32(-127) * scale) == pytest.approx(NEG, rel=1e-6)


def test_finfo_min_range_dequantizes_its_lowest_code_to_a_finite_value() -> None:
    qp = activation_qparams(Range(NEG, 0.0), ASYM8)
    lowest = np.float32(ASYM8.qmin - qp.zero_point) * np.float32(qp.scale)
    assert np.isfinite(lowest)
    assert qp.zero_point == ASYM8.qmax


@pytest.mark.parametrize("scheme", [ASYM8, SYM8, dataclasses.replace(SYM8, power_of_two=True)])
def test_a_range_across_the_whole_float32_line_gets_the_largest_finite_step(scheme) -> None:
    big = float(np.finfo(np.float32).max)
    qp = activation_qparams(Range(-big, big), scheme)
    codes = np.float32(scheme.qmax - scheme.qmin)
    larger = (
        np.float32(qp.scale) * 2
        if scheme.power_of_two
        else np.nextafter(np.float32(qp.scale), np.float32(np.inf))
    )
    with np.errstate(over="ignore"):
        assert np.isfinite(np.float32(qp.scale) * codes)
        assert not np.isfinite(np.float32(larger) * codes)


def _biased_attention() -> onnx.ModelProto:
    """T5's form: scores + (position bias + (1 − keep)·finfo.min), the mask added to a learnt
    position bias before it reaches the scores (the sum of the two is shared by every layer)."""
    rng = np.random.default_rng(3)
    bias = rng.normal(0, 0.5, (1, HEADS, KEYS, KEYS)).astype(np.float32)
    inits = [
        numpy_helper.from_array(bias, "position_bias"),
        numpy_helper.from_array(np.array(1.0, np.float32), "one"),
        numpy_helper.from_array(np.array(NEG, np.float32), "fill"),
    ]
    nodes = [
        helper.make_node("MatMul", ["q", "k"], ["scores"], name="qk"),
        helper.make_node("Sub", ["one", "keep"], ["pad"], name="pad"),
        helper.make_node("Mul", ["pad", "fill"], ["fill_bias"], name="mask_fill"),
        helper.make_node("Add", ["position_bias", "fill_bias"], ["bias_sum"], name="bias_sum"),
        helper.make_node("Add", ["scores", "bias_sum"], ["masked"], name="mask"),
        helper.make_node("Softmax", ["masked"], ["probs"], name="softmax", axis=-1),
    ]
    inputs = [
        helper.make_tensor_value_info("q", TensorProto.FLOAT, [1, HEADS, KEYS, DEPTH]),
        helper.make_tensor_value_info("k", TensorProto.FLOAT, [1, HEADS, DEPTH, KEYS]),
        helper.make_tensor_value_info("keep", TensorProto.FLOAT, [1, 1, 1, KEYS]),
    ]
    outputs = [helper.make_tensor_value_info("probs", TensorProto.FLOAT, [1, HEADS, KEYS, KEYS])]
    graph = helper.make_graph(nodes, "biased", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return fix_model(load_model(model), "mlsoc").model


def test_mask_operand_of_a_floored_bias_sum_stops_below_it() -> None:
    """The floor goes on through an Add whose own sum was floored: the mask term of position
    bias + mask kept −3.4e38 in its range, and the integer Add of the two needed a ~1e31
    requantization multiplier (T5 compiled to two .elf files around a CVU Add)."""
    quantized = _quantize(_biased_attention(), "fill")
    tensors = quantized.report["tensors"]
    fill_bias, bias_sum, bias = tensors["fill_bias"], tensors["bias_sum"], "position_bias"
    assert bias_sum["min"] > -1e3
    hi_bias = float(
        numpy_helper.to_array(
            next(i for i in quantized.float_model.graph.initializer if i.name == bias)
        ).max()
    )
    assert fill_bias["min"] == pytest.approx(
        bias_sum["min"] - hi_bias - (bias_sum["max"] - bias_sum["min"]), rel=1e-4
    )


def test_mask_added_to_a_position_bias_compiles_to_one_elf(tmp_path) -> None:
    quantized = _quantize(_biased_attention(), "fill")
    result = compile_model(quantized.model, tmp_path, model_name="biased")
    assert len(result.elf_files) == 1 and result.notes == []
