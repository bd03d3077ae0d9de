"""expand-ort-fused-ops: ONNX Runtime's fused contrib ops (what a session saves as its optimised
model) become the standard ops they fuse, so the MLA runs them.

Models are built with onnx.helper, or saved by an ONNX Runtime session at ORT_ENABLE_EXTENDED;
every application goes through the engine's verification against ONNX Runtime (which runs the
fused ops), and each test compares the outputs once more itself.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from surgery.check import check_model
from surgery.model import load_model
from surgery.rules import apply_rule, find_matches
from surgery.rules.fix import fix_model

RULE = "expand-ort-fused-ops"
CONTRIB = "com.microsoft"


def _model(nodes, inputs, outputs, inits=(), opset=17) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "m", inputs, outputs, list(inits))
    opsets = [helper.make_opsetid("", opset), helper.make_opsetid(CONTRIB, 1)]
    return load_model(helper.make_model(graph, opset_imports=opsets))


def _run(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), options)
    return session.run(None, feed)


def _contrib_ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node if n.domain == CONTRIB]


def _value(name: str, shape, seed: int = 0, scale: float = 0.3) -> onnx.TensorProto:
    rng = np.random.default_rng(seed)
    return numpy_helper.from_array((rng.normal(size=shape) * scale).astype(np.float32), name)


def _expanded_matches(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> onnx.ModelProto:
    """Apply the rule (verified by the engine) and compare the outputs with ONNX Runtime's."""
    result = apply_rule(model, RULE, "mlsoc")
    assert result.verification.passed
    assert not _contrib_ops(result.model)
    for got, expected in zip(_run(result.model, feed), _run(model, feed), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    return result.model


def _image_input(shape=(1, 4, 8, 8)) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))


def _feed(shape=(1, 4, 8, 8), seed: int = 1) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(seed).normal(size=shape).astype(np.float32)}


ACTIVATIONS = {
    "Relu": [],
    "Clip": [0.0, 6.0],
    "LeakyRelu": [0.2],
    "HardSigmoid": [0.3, 0.4],
    "Sigmoid": [],
    "Tanh": [],
}


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_fused_conv_becomes_conv_and_its_activation(activation) -> None:
    params = ACTIVATIONS[activation]
    attrs = {"activation_params": params} if params else {}
    node = helper.make_node(
        "FusedConv",
        ["x", "w", "b"],
        ["y"],
        name="fused",
        domain=CONTRIB,
        activation=activation,
        pads=[1, 1, 1, 1],
        **attrs,
    )
    model = _model(
        [node],
        [_image_input()],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 6, 8, 8])],
        [_value("w", (6, 4, 3, 3)), _value("b", (6,), 1)],
    )
    expanded = _expanded_matches(model, _feed())
    ops = [n.op_type for n in expanded.graph.node]
    assert ops == ["Conv", activation]
    assert check_model(expanded).mla_segments == 1


def test_fused_conv_adds_its_residual_input_before_the_activation() -> None:
    node = helper.make_node(
        "FusedConv",
        ["x", "w", "", "x"],
        ["y"],
        name="fused",
        domain=CONTRIB,
        activation="Relu",
        pads=[1, 1, 1, 1],
    )
    model = _model(
        [node],
        [_image_input()],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        [_value("w", (4, 4, 3, 3))],
    )
    expanded = _expanded_matches(model, _feed())
    assert [n.op_type for n in expanded.graph.node] == ["Conv", "Add", "Relu"]


def test_fused_gemm_keeps_alpha_beta_and_its_activation() -> None:
    node = helper.make_node(
        "FusedGemm",
        ["x", "w", "c"],
        ["y"],
        name="fused",
        domain=CONTRIB,
        alpha=0.5,
        beta=2.0,
        transB=1,
        activation="LeakyRelu",
        activation_alpha=0.1,
    )
    model = _model(
        [node],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 5])],
        [_value("w", (5, 8)), _value("c", (5,), 1)],
    )
    _expanded_matches(model, _feed((3, 8)))


@pytest.mark.parametrize(("trans_a", "trans_b"), [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_fused_matmul_transposes_and_scales(trans_a, trans_b) -> None:
    a_shape = (2, 6, 5) if trans_a else (2, 5, 6)
    b_shape = (7, 6) if trans_b else (6, 7)
    node = helper.make_node(
        "FusedMatMul",
        ["x", "w"],
        ["y"],
        name="fused",
        domain=CONTRIB,
        alpha=0.25,
        transA=trans_a,
        transB=trans_b,
    )
    model = _model(
        [node],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(a_shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5, 7])],
        [_value("w", b_shape)],
    )
    _expanded_matches(model, _feed(a_shape))


def test_fused_matmul_with_batch_transposes_is_left() -> None:
    node = helper.make_node(
        "FusedMatMul", ["x", "w"], ["y"], name="fused", domain=CONTRIB, transBatchA=1
    )
    model = _model(
        [node],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5, 2, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [_value("w", (6, 7))],
    )
    assert find_matches(model, RULE, "mlsoc") == []


@pytest.mark.parametrize(
    ("op", "inputs", "inits"),
    [
        ("Gelu", ["x"], []),
        ("BiasGelu", ["x", "bias"], ["bias"]),
        ("FastGelu", ["x", "bias"], ["bias"]),
        ("FastGelu", ["x"], []),
    ],
)
def test_gelu_forms_become_standard_ops(op, inputs, inits) -> None:
    node = helper.make_node(op, inputs, ["y"], name="fused", domain=CONTRIB)
    model = _model(
        [node],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 16])],
        [_value(name, (16,), 2) for name in inits],
    )
    _expanded_matches(model, _feed((1, 8, 16)))


def _skip_norm_model(op: str, opset: int, outputs: list[str]) -> onnx.ModelProto:
    simplified = op == "SkipSimplifiedLayerNormalization"
    inputs = ["x", "skip", "gamma", *([] if simplified else ["beta"]), "bias"]
    node = helper.make_node(op, inputs, outputs, name="fused", domain=CONTRIB, epsilon=1e-5)
    graph_outputs = [
        helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, 8, 16])
        for name in outputs
        if name
    ]
    return _model(
        [node],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 16])],
        graph_outputs,
        [
            _value("skip", (1, 8, 16), 3, 1.0),
            _value("gamma", (16,), 4),
            _value("beta", (16,), 5),
            _value("bias", (16,), 6),
        ],
        opset=opset,
    )


@pytest.mark.parametrize("opset", [16, 17, 18])
@pytest.mark.parametrize("op", ["SkipLayerNormalization", "SkipSimplifiedLayerNormalization"])
def test_skip_norms_become_add_and_the_norm_with_their_sum_output(op, opset) -> None:
    model = _skip_norm_model(op, opset, ["y", "", "", "sum"])
    expanded = _expanded_matches(model, _feed((1, 8, 16)))
    has_layer_norm = "LayerNormalization" in {n.op_type for n in expanded.graph.node}
    assert has_layer_norm == (op == "SkipLayerNormalization" and opset >= 17)


def test_a_skip_norm_whose_mean_is_read_is_left() -> None:
    model = _skip_norm_model("SkipLayerNormalization", 17, ["y", "mean"])
    assert find_matches(model, RULE, "mlsoc") == []


def test_simplified_layer_norm_of_the_onnx_domain_becomes_rms_norm() -> None:
    """ONNX Runtime registers SimplifiedLayerNormalization in ONNX's own domain."""
    node = helper.make_node(
        "SimplifiedLayerNormalization", ["x", "gamma"], ["y"], name="fused", epsilon=1e-6
    )
    model = _model(
        [node],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 16])],
        [_value("gamma", (16,), 4)],
    )
    expanded = _expanded_matches(model, _feed((1, 8, 16)))
    assert "SimplifiedLayerNormalization" not in {n.op_type for n in expanded.graph.node}


def _ort_saved(model: onnx.ModelProto, tmp_path) -> onnx.ModelProto:
    """`model` as an ONNX Runtime session saves it optimised (its fusions as contrib ops)."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return load_model(tmp_path / "optimized.onnx")


def test_an_ort_optimised_cnn_goes_from_no_segment_to_one(plain_cnn, tmp_path) -> None:
    optimised = _ort_saved(plain_cnn, tmp_path)
    assert "FusedConv" in _contrib_ops(optimised)
    assert check_model(optimised).mla_segments == 0
    result = fix_model(optimised)
    assert [s["rule"] for s in result.steps][0] == RULE
    assert result.coverage_after.mla_segments == 1
    assert not _contrib_ops(result.model)


def test_an_ort_optimised_transformer_block_reaches_one_segment(
    transformer_block, tmp_path
) -> None:
    optimised = _ort_saved(transformer_block, tmp_path)
    fused = set(_contrib_ops(optimised))
    assert fused & {"SkipLayerNormalization", "FusedMatMul", "Gelu", "BiasGelu"}
    result = fix_model(optimised)
    assert RULE in [s["rule"] for s in result.steps]
    assert result.coverage_after.mla_segments == 1


BATCH, SEQ, HIDDEN, HEADS, VOCAB = 2, 6, 16, 2, 30


def _attention_model(mask: str | None) -> onnx.ModelProto:
    """Attention (ORT's BERT fusion) on x [B, S, H], with no mask, a raw [B, S] mask or 1-D
    end positions."""
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [BATCH, SEQ, HIDDEN])]
    attention_inputs = ["x", "w", "b"]
    if mask == "raw":
        inputs.append(helper.make_tensor_value_info("mask", TensorProto.INT32, [BATCH, SEQ]))
        attention_inputs.append("mask")
    elif mask == "ends":
        inputs.append(helper.make_tensor_value_info("mask", TensorProto.INT32, [BATCH]))
        attention_inputs.append("mask")
    node = helper.make_node(
        "Attention", attention_inputs, ["y"], name="attention", domain=CONTRIB, num_heads=HEADS
    )
    return _model(
        [node],
        inputs,
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [BATCH, SEQ, HIDDEN])],
        [_value("w", (HIDDEN, 3 * HIDDEN)), _value("b", (3 * HIDDEN,), 1)],
    )


@pytest.mark.parametrize("mask", [None, "raw", "ends"])
def test_attention_becomes_matmuls_and_softmax(mask) -> None:
    model = _attention_model(mask)
    feed = _feed((BATCH, SEQ, HIDDEN))
    if mask == "raw":
        feed["mask"] = np.array([[1] * SEQ, [1] * 4 + [0] * 2], np.int32)
    elif mask == "ends":
        feed["mask"] = np.array([SEQ, 3], np.int32)
    expanded = _expanded_matches(model, feed)
    assert {"MatMul", "Softmax"} <= {n.op_type for n in expanded.graph.node}


def test_attention_with_past_state_is_left() -> None:
    model = _attention_model(None)
    model.graph.input.append(helper.make_tensor_value_info("past", TensorProto.FLOAT, None))
    model.graph.node[0].input.extend(["", "past"])
    assert find_matches(model, RULE, "mlsoc") == []


def test_embed_layer_norm_and_its_mask_index_feed_attention() -> None:
    """EmbedLayerNormalization's mask_index (ones per row) is Attention's 1-D mask."""
    embed = helper.make_node(
        "EmbedLayerNormalization",
        ["ids", "segments", "word", "position", "segment", "gamma", "beta", "mask"],
        ["embedded", "mask_index"],
        name="embed",
        domain=CONTRIB,
        epsilon=1e-5,
    )
    attention = helper.make_node(
        "Attention",
        ["embedded", "w", "b", "mask_index"],
        ["y"],
        name="attention",
        domain=CONTRIB,
        num_heads=HEADS,
    )
    int_input = lambda name: helper.make_tensor_value_info(name, TensorProto.INT32, [BATCH, SEQ])  # noqa: E731
    model = _model(
        [embed, attention],
        [int_input("ids"), int_input("segments"), int_input("mask")],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [BATCH, SEQ, HIDDEN])],
        [
            _value("word", (VOCAB, HIDDEN), 2),
            _value("position", (SEQ, HIDDEN), 3),
            _value("segment", (2, HIDDEN), 4),
            _value("gamma", (HIDDEN,), 5),
            _value("beta", (HIDDEN,), 6),
            _value("w", (HIDDEN, 3 * HIDDEN)),
            _value("b", (3 * HIDDEN,), 1),
        ],
    )
    rng = np.random.default_rng(7)
    feed = {
        "ids": rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32),
        "segments": rng.integers(0, 2, (BATCH, SEQ)).astype(np.int32),
        "mask": np.array([[1] * SEQ, [1] * 4 + [0] * 2], np.int32),
    }
    expanded = _expanded_matches(model, feed)
    assert {"Gather", "LayerNormalization", "Softmax"} <= {n.op_type for n in expanded.graph.node}


def _fused_bert_layer() -> onnx.ModelProto:
    """EmbedLayerNormalization → Attention → SkipLayerNormalization → FastGelu FFN →
    SkipLayerNormalization: one BERT layer as ONNX Runtime's transformer optimizer fuses it."""
    nodes = [
        helper.make_node(
            "EmbedLayerNormalization",
            ["ids", "segments", "word", "position", "segment", "gamma", "beta", "mask"],
            ["e", "mask_index"],
            name="embed",
            domain=CONTRIB,
            epsilon=1e-5,
        ),
        helper.make_node(
            "Attention",
            ["e", "w", "b", "mask_index"],
            ["a"],
            name="attention",
            domain=CONTRIB,
            num_heads=HEADS,
        ),
        helper.make_node("MatMul", ["a", "wo"], ["ao"], name="proj"),
        helper.make_node(
            "SkipLayerNormalization",
            ["ao", "e", "g1", "b1", "bo"],
            ["n1"],
            name="norm1",
            domain=CONTRIB,
            epsilon=1e-5,
        ),
        helper.make_node("MatMul", ["n1", "w1"], ["h"], name="ffn1"),
        helper.make_node("FastGelu", ["h", "bh"], ["hg"], name="gelu", domain=CONTRIB),
        helper.make_node("MatMul", ["hg", "w2"], ["f"], name="ffn2"),
        helper.make_node(
            "SkipLayerNormalization",
            ["f", "n1", "g2", "b2", "bf"],
            ["y"],
            name="norm2",
            domain=CONTRIB,
            epsilon=1e-5,
        ),
    ]
    shapes = {
        "word": (VOCAB, HIDDEN),
        "position": (SEQ, HIDDEN),
        "segment": (2, HIDDEN),
        "w": (HIDDEN, 3 * HIDDEN),
        "b": (3 * HIDDEN,),
        "wo": (HIDDEN, HIDDEN),
        "w1": (HIDDEN, 4 * HIDDEN),
        "bh": (4 * HIDDEN,),
        "w2": (4 * HIDDEN, HIDDEN),
    }
    for name in ("gamma", "beta", "g1", "b1", "bo", "g2", "b2", "bf"):
        shapes[name] = (HIDDEN,)
    inits = [_value(name, shape, seed) for seed, (name, shape) in enumerate(shapes.items())]
    ints = [
        helper.make_tensor_value_info(name, TensorProto.INT32, [BATCH, SEQ])
        for name in ("ids", "segments", "mask")
    ]
    return _model(
        nodes,
        ints,
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [BATCH, SEQ, HIDDEN])],
        inits,
    )


def test_a_bert_layer_of_ort_transformer_fusions_reaches_one_segment() -> None:
    model = _fused_bert_layer()
    assert check_model(model).mla_segments == 0
    result = fix_model(model)
    assert result.steps[0]["rule"] == RULE
    assert result.coverage_after.mla_segments == 1
    assert not _contrib_ops(result.model)


def test_ort_nchwc_layout_ops_are_blockers_that_say_how_to_save_the_model() -> None:
    """ORT_ENABLE_ALL (the default level) saves CPU-specific NCHWc ops with reordered weights:
    no standard form to expand, so check says to save the model at ORT_ENABLE_EXTENDED."""
    nchwc = "com.microsoft.nchwc"
    nodes = [
        helper.make_node("ReorderInput", ["x"], ["xb"], name="reorder_in", domain=nchwc),
        helper.make_node(
            "Conv", ["xb", "w"], ["cb"], name="conv", domain=nchwc, kernel_shape=[1, 1]
        ),
        helper.make_node(
            "ReorderOutput", ["cb"], ["y"], name="reorder_out", domain=nchwc, channels=8
        ),
    ]
    graph = helper.make_graph(
        nodes,
        "nchwc",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 4, 4])],
        [_value("w", (8, 8, 1, 1))],
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(nchwc, 1)]
    report = check_model(load_model(helper.make_model(graph, opset_imports=opsets)))
    assert report.mla_segments == 0
    assert {b.reasons[0].code for b in report.blockers} == {"ort_layout"}
    assert "ORT_ENABLE_EXTENDED" in report.blockers[0].reasons[0].message
