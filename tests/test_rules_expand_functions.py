"""expand-function-ops: ops ONNX defines as functions (opset-23 Attention and RotaryEmbedding,
Mish, Selu, …) that
the target runs off the MLA become their ONNX function body; and the cleanups that body needs
(Shape start/end folding, x + 0, constant-condition Where) hold on their own.

Every model is built with onnx.helper; every application goes through the engine's
verification against ONNX Runtime, and the tests compare outputs once more themselves.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from surgery.check import check_model
from surgery.model import load_model
from surgery.rules import apply_rule, find_matches
from surgery.rules.fix import fix_model

HEADS, SEQ, DIM = 2, 8, 16


def _model(nodes, inputs, outputs, inits=(), opset=23) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "m", inputs, outputs, list(inits))
    return load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]))


def _run(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feed)


def _ops(model: onnx.ModelProto) -> set[str]:
    return {n.op_type for n in model.graph.node}


def _attention_block() -> onnx.ModelProto:
    """Conv → Reshape to heads [1, H, S, D] ×3 → Attention (opset 23) → Reshape → Conv: the
    attention core of a vision transformer as torch's dynamo exporter writes it."""
    rng = np.random.default_rng(0)
    channels = HEADS * DIM
    inits = [
        numpy_helper.from_array(
            rng.normal(0, 0.2, (3 * channels, channels, 1, 1)).astype(np.float32), "w_qkv"
        ),
        numpy_helper.from_array(
            rng.normal(0, 0.2, (channels, channels, 1, 1)).astype(np.float32), "w_out"
        ),
        numpy_helper.from_array(np.array([1, HEADS, DIM, SEQ], np.int64), "heads"),
        numpy_helper.from_array(np.array([1, channels, SEQ, 1], np.int64), "merged"),
        numpy_helper.from_array(np.array([channels] * 3, np.int64), "split"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w_qkv"], ["qkv"], name="qkv"),
        helper.make_node("Split", ["qkv", "split"], ["q4", "k4", "v4"], name="split", axis=1),
    ]
    for t in ("q", "k", "v"):
        nodes += [
            helper.make_node("Reshape", [f"{t}4", "heads"], [f"{t}_hds"], name=f"{t}_heads"),
            helper.make_node("Transpose", [f"{t}_hds"], [t], name=f"{t}_t", perm=[0, 1, 3, 2]),
        ]
    nodes += [
        helper.make_node("Attention", ["q", "k", "v"], ["a"], name="attention"),
        helper.make_node("Transpose", ["a"], ["a_t"], name="a_t", perm=[0, 1, 3, 2]),
        helper.make_node("Reshape", ["a_t", "merged"], ["a4"], name="merge"),
        helper.make_node("Conv", ["a4", "w_out"], ["y"], name="out"),
    ]
    return _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, channels, SEQ, 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, channels, SEQ, 1])],
        inits,
    )


def _unary(op: str, opset: int, **attrs) -> onnx.ModelProto:
    """Conv → op → Conv on a [1, 4, 5, 6] map."""
    rng = np.random.default_rng(1)
    w = [rng.normal(0, 0.5, (4, 4, 1, 1)).astype(np.float32) for _ in range(2)]
    return _model(
        [
            helper.make_node("Conv", ["x", "w1"], ["a"], name="c1"),
            helper.make_node(op, ["a"], ["b"], name="act", **attrs),
            helper.make_node("Conv", ["b", "w2"], ["y"], name="c2"),
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 5, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 5, 6])],
        [numpy_helper.from_array(w[0], "w1"), numpy_helper.from_array(w[1], "w2")],
        opset,
    )


def _feed(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    x = model.graph.input[0]
    shape = [d.dim_value for d in x.type.tensor_type.shape.dim]
    return {x.name: np.random.default_rng(2).normal(0, 1, shape).astype(np.float32)}


def test_check_suggests_expanding_an_opset23_attention():
    report = check_model(_attention_block(), "mlsoc")
    blocker = next(b for b in report.blockers if b.op_type == "Attention")
    assert "expand-function-ops" in blocker.suggested_rules


def test_expanded_attention_computes_what_the_attention_op_computes():
    model = _attention_block()
    result = apply_rule(model, "expand-function-ops", "mlsoc")
    assert result.verification.passed
    assert "Attention" not in _ops(result.model)
    assert {"MatMul", "Softmax"} <= _ops(result.model)
    feed = _feed(model)
    np.testing.assert_allclose(_run(result.model, feed)[0], _run(model, feed)[0], atol=1e-5)


def test_fix_maps_an_opset23_attention_block_to_one_segment():
    model = _attention_block()
    assert check_model(model, "mlsoc").mla_mac_fraction < 1.0
    result = fix_model(model, "mlsoc")
    assert result.single_elf
    assert result.coverage_after.mla_mac_fraction == 1.0
    assert "expand-function-ops" in [s["rule"] for s in result.steps]
    feed = _feed(model)
    np.testing.assert_allclose(_run(result.model, feed)[0], _run(model, feed)[0], atol=1e-4)


def _packed_causal_gqa() -> onnx.ModelProto:
    """Attention on packed [1, S, heads × D] tensors, 4 query heads sharing 2 key/value heads,
    causal: the form of a decoder exported at opset 23."""
    rng = np.random.default_rng(4)
    q_heads, kv_heads, channels = 4, 2, 32

    def weight(name: str, shape: tuple[int, int]) -> onnx.TensorProto:
        return numpy_helper.from_array(rng.normal(0, 0.2, shape).astype(np.float32), name)

    nodes = [
        helper.make_node("MatMul", ["x", "wq"], ["q"], name="q"),
        helper.make_node("MatMul", ["x", "wk"], ["k"], name="k"),
        helper.make_node("MatMul", ["x", "wv"], ["v"], name="v"),
        helper.make_node(
            "Attention",
            ["q", "k", "v"],
            ["a"],
            name="attention",
            q_num_heads=q_heads,
            kv_num_heads=kv_heads,
            is_causal=1,
        ),
        helper.make_node("MatMul", ["a", "wo"], ["y"], name="out"),
    ]
    inits = [
        weight("wq", (channels, q_heads * DIM)),
        weight("wk", (channels, kv_heads * DIM)),
        weight("wv", (channels, kv_heads * DIM)),
        weight("wo", (q_heads * DIM, channels)),
    ]
    return _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, SEQ, channels])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, SEQ, channels])],
        inits,
    )


def test_fix_maps_a_packed_causal_grouped_query_attention_to_one_segment():
    model = _packed_causal_gqa()
    result = fix_model(model, "mlsoc")
    assert result.single_elf and result.coverage_after.mla_mac_fraction == 1.0
    feed = _feed(model)
    np.testing.assert_allclose(_run(result.model, feed)[0], _run(model, feed)[0], atol=1e-4)


def _rotary_block() -> onnx.ModelProto:
    """Conv → heads [1, H, S, D] → RotaryEmbedding (opset 23, full rotary dim, constant
    positions) → back → Conv."""
    rng = np.random.default_rng(5)
    channels = HEADS * DIM
    inits = [
        numpy_helper.from_array(rng.random((SEQ, DIM // 2)).astype(np.float32), "cos"),
        numpy_helper.from_array(rng.random((SEQ, DIM // 2)).astype(np.float32), "sin"),
        numpy_helper.from_array(np.arange(SEQ, dtype=np.int64).reshape(1, SEQ), "positions"),
        numpy_helper.from_array(
            rng.normal(0, 0.2, (channels, channels, 1, 1)).astype(np.float32), "w"
        ),
        numpy_helper.from_array(np.array([1, HEADS, DIM, SEQ], np.int64), "heads"),
        numpy_helper.from_array(np.array([1, channels, SEQ, 1], np.int64), "merged"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="in"),
        helper.make_node("Reshape", ["c", "heads"], ["h"], name="split_heads"),
        helper.make_node("Transpose", ["h"], ["t"], name="to_tokens", perm=[0, 1, 3, 2]),
        helper.make_node("RotaryEmbedding", ["t", "cos", "sin", "positions"], ["r"], name="rope"),
        helper.make_node("Transpose", ["r"], ["rt"], name="to_channels", perm=[0, 1, 3, 2]),
        helper.make_node("Reshape", ["rt", "merged"], ["m"], name="merge_heads"),
        helper.make_node("Conv", ["m", "w"], ["y"], name="out"),
    ]
    return _model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, channels, SEQ, 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, channels, SEQ, 1])],
        inits,
    )


def test_fix_maps_an_opset23_rotary_embedding_to_one_segment():
    """The body Splits off an empty pass-through piece and Concats it back; both go."""
    model = _rotary_block()
    assert check_model(model, "mlsoc").mla_segments == 2
    result = fix_model(model, "mlsoc")
    assert result.single_elf and "RotaryEmbedding" not in _ops(result.model)
    feed = _feed(model)
    np.testing.assert_allclose(_run(result.model, feed)[0], _run(model, feed)[0], atol=1e-5)


def test_mish_becomes_softplus_tanh_mul_on_the_mla():
    model = _unary("Mish", 22)
    result = apply_rule(model, "expand-function-ops", "mlsoc")
    assert "Mish" not in _ops(result.model)
    assert check_model(result.model, "mlsoc").single_elf
    feed = _feed(model)
    np.testing.assert_allclose(_run(result.model, feed)[0], _run(model, feed)[0], atol=1e-5)


def test_expansion_keeps_the_nodes_attributes():
    """Selu's body reads alpha and gamma through attribute references."""
    model = _unary("Selu", 22, alpha=0.5, gamma=2.5)
    result = apply_rule(model, "expand-function-ops", "mlsoc")
    assert "Selu" not in _ops(result.model)
    feed = _feed(model)
    np.testing.assert_allclose(_run(result.model, feed)[0], _run(model, feed)[0], atol=1e-5)


def test_op_the_target_runs_on_the_mla_is_not_expanded():
    """rk3588 runs Mish on its NPU: nothing to expand there."""
    assert find_matches(_unary("Mish", 22), "expand-function-ops", "rk3588") == []


def test_fold_constants_reads_shape_start_and_end():
    """onnx-graphsurgeon folds Shape(x, start=2) as the whole shape of x; the Reshape it feeds
    must still get [5, 6] (and the model stay valid and equal)."""
    model = _model(
        [
            helper.make_node("Shape", ["x"], ["hw"], name="hw", start=2),
            helper.make_node("Concat", ["minus_one", "hw"], ["shape"], name="cat", axis=0),
            helper.make_node("Reshape", ["x", "shape"], ["y"], name="flat"),
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 5, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 5, 6])],
        [numpy_helper.from_array(np.array([-1], np.int64), "minus_one")],
        opset=17,
    )
    result = apply_rule(model, "fold-constants", "mlsoc")
    assert result.verification.passed
    assert "Shape" not in _ops(result.model)
    feed = _feed(model)
    assert _run(result.model, feed)[0].shape == (4, 5, 6)


def _binary(op: str, constant: np.ndarray, x_shape=(1, 4, 5, 6)) -> onnx.ModelProto:
    rng = np.random.default_rng(3)
    out_shape = list(np.broadcast_shapes(x_shape, constant.shape))
    return _model(
        [
            helper.make_node("Relu", ["x"], ["r"], name="relu"),
            helper.make_node(op, ["r", "c"], ["y"], name="arith"),
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, out_shape)],
        [
            numpy_helper.from_array(constant.astype(np.float32), "c"),
            numpy_helper.from_array(rng.normal(size=(1,)).astype(np.float32), "unused"),
        ],
        opset=17,
    )


def test_adding_zeros_is_removed():
    result = apply_rule(_binary("Add", np.zeros((1, 1, 5, 6))), "remove-identity", "mlsoc")
    assert _ops(result.model) == {"Relu"}


def test_multiplying_by_ones_is_removed():
    result = apply_rule(_binary("Mul", np.ones((4, 1, 1))), "remove-identity", "mlsoc")
    assert _ops(result.model) == {"Relu"}


def test_adding_zeros_that_broadcast_the_input_is_kept():
    model = _binary("Add", np.zeros((2, 4, 5, 6)))
    matches = find_matches(model, "remove-identity", "mlsoc")
    assert not any(m.nodes == ["arith"] for m in matches)


def test_adding_a_nonzero_constant_is_kept():
    constant = np.zeros((1, 1, 5, 6))
    constant[0, 0, 2, 3] = 1.0
    matches = find_matches(_binary("Add", constant), "remove-identity", "mlsoc")
    assert not any(m.nodes == ["arith"] for m in matches)


def test_where_with_a_constant_false_condition_passes_its_else_side():
    model = _model(
        [
            helper.make_node("Relu", ["x"], ["r"], name="relu"),
            helper.make_node("Where", ["never", "zero", "r"], ["y"], name="guard"),
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 5, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 5, 6])],
        [
            numpy_helper.from_array(np.zeros((1, 4, 5, 1), bool), "never"),
            numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
        ],
        opset=17,
    )
    result = apply_rule(model, "remove-identity", "mlsoc")
    assert _ops(result.model) == {"Relu"}
    feed = _feed(model)
    np.testing.assert_array_equal(_run(result.model, feed)[0], _run(model, feed)[0])


def test_a_body_whose_host_op_feeds_its_mla_ops_is_not_expanded():
    """Opset 13's LogSoftmax is x - max - Log(Σ exp(x - max)): on rk3588, which lacks Log, the
    last Sub would be an MLA island between host nodes, so the op stays whole; mlsoc runs Log
    and gets the body."""
    model = _unary("LogSoftmax", 13, axis=1)
    assert find_matches(model, "expand-function-ops", "rk3588") == []
    assert find_matches(model, "expand-function-ops", "mlsoc")


def _crnn_tail() -> onnx.ModelProto:
    """A bidirectional RNN's [T, 2, 1, H] output → Transpose → Reshape [T, 1, 2H] → Linear →
    LogSoftmax (opset 13), as torch's TorchScript exporter writes a CRNN's CTC head."""
    hidden, steps, classes = 8, 20, 12
    rng = np.random.default_rng(3)
    return _model(
        [
            helper.make_node("Mul", ["x", "scale"], ["yd"], name="rnn_out"),
            helper.make_node("Transpose", ["yd"], ["yt"], name="dirs_last", perm=[0, 2, 1, 3]),
            helper.make_node("Reshape", ["yt", "seq"], ["feat"], name="to_seq"),
            helper.make_node("MatMul", ["feat", "fc_w"], ["mm"], name="fc"),
            helper.make_node("Add", ["fc_b", "mm"], ["logits"], name="fc_bias"),
            helper.make_node("LogSoftmax", ["logits"], ["y"], name="log_softmax", axis=-1),
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [steps, 2, 1, hidden])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [steps, 1, classes])],
        [
            numpy_helper.from_array(
                rng.normal(0, 0.2, (1, 2, 1, hidden)).astype(np.float32), "scale"
            ),
            numpy_helper.from_array(np.array([steps, 1, 2 * hidden], np.int64), "seq"),
            numpy_helper.from_array(
                rng.normal(0, 0.2, (2 * hidden, classes)).astype(np.float32), "fc_w"
            ),
            numpy_helper.from_array(rng.normal(0, 0.2, (classes,)).astype(np.float32), "fc_b"),
        ],
        opset=13,
    )


def test_fix_keeps_a_crnn_heads_log_softmax_whole_on_a_target_without_log():
    """Expanded, its Log went to the host with the Sub after it, which fix then had to pin to
    the host as well (3 host nodes and a place-on-host step instead of the one LogSoftmax)."""
    model = _crnn_tail()
    result = fix_model(model, "rk3588")
    rules = [s["rule"] for s in result.steps]
    assert result.single_elf and "expand-function-ops" not in rules
    assert "place-on-host" not in rules
    host = sorted(p.op_type for p in result.coverage_after.placements if p.is_blocker)
    assert "LogSoftmax" in host and "Log" not in host
    assert result.coverage_after.mla_mac_fraction == 1.0
    feed = _feed(model)
    np.testing.assert_allclose(_run(result.model, feed)[0], _run(model, feed)[0], atol=1e-5)
