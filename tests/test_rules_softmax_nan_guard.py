"""drop-softmax-nan-guard: torch.onnx writes Where(IsNaN(p), 0, p) after the Softmax of
scaled_dot_product_attention (HF sdpa attention, the dynamo exporter). The IsNaN and Where run
on the host between two MLA ops and cut every attention block in two segments.

Each model is a 4-D stand-in for attention (Conv scores, a Softmax over channels, a Conv after
it) built with onnx.helper; every application goes through the engine's verification, and the
−inf case is also run on a mask with fully masked rows, where the guard does its work.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from surgery.check import check_model
from surgery.model import load_model
from surgery.rules import apply_rule, find_matches

C, H, W = 4, 3, 5


def _guarded(
    fill: float | None,
    mask_shape: tuple[int, ...] = (1, C, H, W),
    reshape_after: bool = False,
    p_also_output: bool = False,
) -> onnx.ModelProto:
    """Conv → [+ Where(mask, 0, fill)] → Softmax(axis=1) → [Reshape] → Where(IsNaN(p), 0, p)
    → Conv."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.5, (C, C, 1, 1)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.normal(0, 0.5, (C, C, 1, 1)).astype(np.float32), "w2"),
        numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
    ]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["scores"], name="scores")]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, C, H, W])]
    logits = "scores"
    if fill is not None:
        inits.append(numpy_helper.from_array(np.array(fill, np.float32), "fill"))
        inputs.append(helper.make_tensor_value_info("mask", TensorProto.BOOL, list(mask_shape)))
        nodes += [
            helper.make_node("Where", ["mask", "zero", "fill"], ["bias"], name="mask_bias"),
            helper.make_node("Add", ["scores", "bias"], ["logits"], name="masked"),
        ]
        logits = "logits"
    nodes.append(helper.make_node("Softmax", [logits], ["p"], name="attn", axis=1))
    p = "p"
    if reshape_after:
        inits.append(numpy_helper.from_array(np.array([1, C, H * W, 1]), "flat"))
        nodes.append(helper.make_node("Reshape", ["p", "flat"], ["p_flat"], name="p_flat"))
        p = "p_flat"
    nodes += [
        helper.make_node("IsNaN", [p], ["nan"], name="attn_nan"),
        helper.make_node("Where", ["nan", "zero", p], ["probs"], name="attn_guard"),
        helper.make_node("Conv", ["probs", "w2"], ["y"], name="out"),
    ]
    out_shape = [1, C, H * W, 1] if reshape_after else [1, C, H, W]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)]
    if p_also_output:
        outputs.append(helper.make_tensor_value_info("p", TensorProto.FLOAT, [1, C, H, W]))
    graph = helper.make_graph(nodes, "guarded", inputs, outputs, inits)
    return load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def _exact(result) -> None:
    assert result.verification.passed and result.verification.mode == "exact"
    assert result.verification.worst_max_abs <= 1e-6


def _run(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(["y"], feed)[0]


def _feed_with_shut_rows(mask_shape: tuple[int, ...]) -> dict[str, np.ndarray]:
    """A random mask whose first row of positions has every key (channel) shut."""
    rng = np.random.default_rng(1)
    mask = rng.random(mask_shape) > 0.4
    mask[..., 0, :] = False
    return {"x": rng.normal(0, 1, (1, C, H, W)).astype(np.float32), "mask": mask}


def test_a_guard_after_a_finite_mask_is_dropped() -> None:
    """finfo.min fill (HF's masks, the dynamo exporter): the Softmax input is finite."""
    model = _guarded(float(np.finfo(np.float32).min))
    result = apply_rule(model, "drop-softmax-nan-guard")
    _exact(result)
    assert _ops(result.model) == ["Conv", "Where", "Add", "Softmax", "Conv"]


def test_a_guard_without_a_mask_is_dropped() -> None:
    result = apply_rule(_guarded(None), "drop-softmax-nan-guard")
    _exact(result)
    assert _ops(result.model) == ["Conv", "Softmax", "Conv"]


def test_a_guard_behind_a_reshape_is_dropped() -> None:
    """After transformer-to-4d the Softmax reaches the guard through a Reshape."""
    result = apply_rule(_guarded(None, reshape_after=True), "drop-softmax-nan-guard")
    _exact(result)
    assert "IsNaN" not in _ops(result.model)


def test_dropping_the_guard_joins_the_two_segments() -> None:
    model = _guarded(float(np.finfo(np.float32).min))
    assert check_model(model, "mlsoc", suggest=False).mla_segments == 2
    result = apply_rule(model, "drop-softmax-nan-guard")
    assert check_model(result.model, "mlsoc", suggest=False).mla_segments == 1


def test_neg_inf_mask_is_clamped_and_rows_without_a_key_are_zeroed() -> None:
    """torch's bool mask → Where(mask, 0, −inf): rows with every key shut are NaN before the
    guard and 0 after it; the rewrite gives the same 0 and leaves every other row as it was."""
    model = _guarded(-np.inf)
    result = apply_rule(model, "drop-softmax-nan-guard")
    _exact(result)
    ops = _ops(result.model)
    assert "IsNaN" not in ops and {"IsInf", "Max", "ReduceMax", "Mul"} <= set(ops)
    feed = _feed_with_shut_rows((1, C, H, W))
    np.testing.assert_array_equal(_run(result.model, feed), _run(model, feed))
    assert check_model(result.model, "mlsoc", suggest=False).mla_segments == 1


def test_a_mask_broadcast_along_the_softmax_axis_needs_no_reduction() -> None:
    """One mask value for every key of a row: the row is shut where that value is −inf."""
    model = _guarded(-np.inf, mask_shape=(1, 1, H, W))
    result = apply_rule(model, "drop-softmax-nan-guard")
    _exact(result)
    assert "ReduceMax" not in _ops(result.model)
    feed = _feed_with_shut_rows((1, 1, H, W))
    np.testing.assert_array_equal(_run(result.model, feed), _run(model, feed))


def test_a_softmax_also_read_unguarded_keeps_its_guard() -> None:
    model = _guarded(-np.inf, p_also_output=True)
    assert find_matches(model, "drop-softmax-nan-guard") == []


def test_a_guard_filling_other_than_zero_is_left_alone() -> None:
    model = _guarded(None)
    zero = next(t for t in model.graph.initializer if t.name == "zero")
    zero.CopyFrom(numpy_helper.from_array(np.array(0.5, np.float32), "zero"))
    assert find_matches(load_model(model), "drop-softmax-nan-guard") == []


def test_a_constant_neg_inf_mask_is_clamped() -> None:
    """A decoder's causal mask folds to an initializer holding −inf (Whisper's decoder after
    fold-constants): the mask is a constant, not a tensor computed from one, and the guard
    was kept — the IsNaN and Where left the decoder in three MLA segments."""
    model = _guarded(-np.inf)
    mask = np.triu(np.ones((H, W), bool), 1)[None, None].repeat(C, axis=1)
    graph = model.graph
    where = next(n for n in graph.node if n.name == "mask_bias")
    graph.node.remove(where)
    graph.input.remove(next(i for i in graph.input if i.name == "mask"))
    bias = np.where(mask, -np.inf, 0.0).astype(np.float32)
    graph.initializer.append(numpy_helper.from_array(bias, "bias"))
    model = load_model(model)
    assert check_model(model, "mlsoc", suggest=False).mla_segments == 2
    result = apply_rule(model, "drop-softmax-nan-guard")
    _exact(result)
    assert "IsNaN" not in _ops(result.model)
    x = {"x": np.random.default_rng(2).normal(0, 1, (1, C, H, W)).astype(np.float32)}
    np.testing.assert_array_equal(_run(result.model, x), _run(model, x))
    assert check_model(result.model, "mlsoc", suggest=False).mla_segments == 1
