"""A 4-D Transpose that moves a batch axis of size 1 is lifted like any other relabel: the MLA
keeps axis 0 in place, but with a unit batch the same data is a Transpose of the other three
axes between two Reshapes. torch's nn.MultiheadAttention (sequence-first inside, as torchvision's
ViT exports it) writes one per attention block: [1,H,L,d] → perm (2,0,1,3) → [L,1,H,d]."""

from __future__ import annotations

import numpy as np
import onnx

from surgery.check import check_model
from surgery.model import load_model
from surgery.rules import apply_rule, find_matches
from tests.architectures import Builder

TOKENS, CHANNELS, HEADS = 16, 8, 2
HEAD_DIM = CHANNELS // HEADS
LIFT_RULES = ("reshape-to-4d", "classifier-to-conv", "transformer-to-4d")


def _shape(b: Builder, name: str, dims: list[int]) -> str:
    return b.const(name, np.array(dims, np.int64))


def _sequence_first_attention() -> onnx.ModelProto:
    """Conv stem → tokens [1,L,C] → nn.MultiheadAttention(batch_first=True) as torch exports
    it: to [L,1,C], in_proj, the rank-5 q/k/v unbind, heads [1,H,L,d], attention, back through
    Transpose(2,0,1,3) → [L,1,H,d] → [L,C] → out_proj → [1,L,C], residual Add."""
    b = Builder()
    x = b.conv("stem", "x", 3, CHANNELS, stride=2)
    x = b.node("Reshape", [x, _shape(b, "flat", [1, CHANNELS, TOKENS])], "flat_map")
    tokens = b.node("Transpose", [x], "tokens", perm=[0, 2, 1])
    seq = b.node("Transpose", [tokens], "seq_first", perm=[1, 0, 2])
    qkv = b.linear("in_proj", seq, CHANNELS, 3 * CHANNELS)
    qkv = b.node("Reshape", [qkv, _shape(b, "unflat_shape", [TOKENS, 1, 3, CHANNELS])], "unflat")
    qkv = b.node("Unsqueeze", [qkv, _shape(b, "front", [0])], "unsq")
    qkv = b.node("Transpose", [qkv], "qkv_first", perm=[3, 1, 2, 0, 4])
    qkv = b.node("Squeeze", [qkv, _shape(b, "unit", [-2])], "qkv")
    heads = []
    for j, part in enumerate("qkv"):
        t = b.node("Gather", [qkv, b.const(f"pick_{part}", np.array(j))], f"{part}_seq", axis=0)
        t = b.node("Reshape", [t, _shape(b, f"{part}_split", [TOKENS, HEADS, HEAD_DIM])], part)
        t = b.node("Transpose", [t], f"{part}_heads", perm=[1, 0, 2])
        heads.append(
            b.node(
                "Reshape", [t, _shape(b, f"{part}_4d", [1, HEADS, TOKENS, HEAD_DIM])], f"{part}_b"
            )
        )
    q, k, v = heads
    k = b.node("Transpose", [k], "k_t", perm=[0, 1, 3, 2])
    scale = b.const("scale", np.array(HEAD_DIM**-0.5, np.float32))
    scores = b.node("MatMul", [b.node("Mul", [q, scale], "q_scaled"), k], "scores")
    probs = b.node("Softmax", [scores], "probs", axis=-1)
    ctx = b.node("MatMul", [probs, v], "ctx")
    ctx = b.node("Transpose", [ctx], "ctx_seq", perm=[2, 0, 1, 3])
    ctx = b.node("Reshape", [ctx, _shape(b, "rows", [TOKENS, CHANNELS])], "ctx_rows")
    w, bias = b.weight("out_w", CHANNELS, CHANNELS), b.weight("out_b", CHANNELS)
    out = b.node("Gemm", [ctx, w, bias], "out_proj", transB=1)
    out = b.node("Reshape", [out, _shape(b, "seq", [TOKENS, 1, CHANNELS])], "out_seq")
    out = b.node("Transpose", [out], "out_batch", perm=[1, 0, 2])
    b.node("Add", [tokens, out], "y")
    return load_model(b.model("mha", {"x": [1, 3, 8, 8]}, ["y"]))


def _moves_batch(model: onnx.ModelProto) -> list[str]:
    return [
        n.name
        for n in model.graph.node
        if n.op_type == "Transpose"
        for a in n.attribute
        if a.name == "perm" and list(a.ints)[0] != 0
    ]


def test_attention_transpose_of_the_unit_batch_is_a_blocker_before() -> None:
    report = check_model(_sequence_first_attention(), "mlsoc", suggest=False)
    reasons = {b.name: b.reasons[0].message for b in report.blockers}
    assert "moves axis 0" in reasons["ctx_seq"]


def test_sequence_first_attention_lifts_to_one_segment() -> None:
    result = apply_rule(_sequence_first_attention(), "transformer-to-4d")
    assert result.verification.passed and result.verification.mode == "exact"
    assert "ctx_seq" in {n for m in result.matches for n in m.nodes}
    assert not _moves_batch(result.model)
    after = check_model(result.model, "mlsoc", suggest=False)
    assert after.mla_segments == 1
    assert [b.op_type for b in after.blockers] == ["Reshape"]  # the rank-3 output, on the host


def _lone_transpose(batch: int) -> onnx.ModelProto:
    """Conv → [N,4,3,5] → Transpose(2,0,1,3) → Conv: one 4-D Transpose between two MLA convs."""
    b = Builder()
    x = b.conv("c1", "x", 3, 4)
    x = b.node("Transpose", [x], "swap", perm=[2, 0, 1, 3])
    b.conv("c2", x, batch, 4)
    return load_model(b.model("swap", {"x": [batch, 3, 3, 5]}, ["c2_relu"]))


def test_a_lone_unit_batch_transpose_no_longer_splits_the_model() -> None:
    model = _lone_transpose(batch=1)
    assert check_model(model, "mlsoc", suggest=False).mla_segments == 2
    result = apply_rule(model, "reshape-to-4d")
    assert result.verification.passed and result.verification.mode == "exact"
    assert not _moves_batch(result.model)
    assert check_model(result.model, "mlsoc", suggest=False).mla_segments == 1


def test_a_transpose_of_a_real_batch_axis_is_left_to_the_host() -> None:
    model = _lone_transpose(batch=2)
    assert "swap" in {b.name for b in check_model(model, "mlsoc", suggest=False).blockers}
    assert all(find_matches(model, rule, "mlsoc") == [] for rule in LIFT_RULES)
