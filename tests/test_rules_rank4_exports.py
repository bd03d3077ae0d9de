"""The rank-4 lift on two exporter patterns whose 4-D layout decides whether they reach the MLA:
ShuffleNet's channel shuffle (a rank-5 Reshape/Transpose/Reshape) must not need a Transpose of
the batch axis, and a mean over the tokens (ViT/BERT mean pooling, Swin's final pool) must be a
reduction over the spatial axes, the only ones the MLA reduces."""

from __future__ import annotations

import numpy as np
import onnx

from surgery.model import load_model
from surgery.rules import apply_rule
from tests.architectures import Builder


def _channel_shuffle(c: int = 8) -> onnx.ModelProto:
    b = Builder()
    x = b.conv("c1", "x", 3, c)
    x = b.node("Reshape", [x, b.const("groups", np.array([1, 2, c // 2, 6, 6]))], "grouped")
    x = b.node("Transpose", [x], "swapped", perm=[0, 2, 1, 3, 4])
    x = b.node("Reshape", [x, b.const("back", np.array([1, c, 6, 6]))], "shuffled")
    b.conv("c2", x, c, 4)
    return load_model(b.model("shuffle", {"x": [1, 3, 6, 6]}, ["c2_relu"]))


def test_channel_shuffle_lifts_without_moving_the_batch_axis() -> None:
    result = apply_rule(_channel_shuffle(), "reshape-to-4d")
    assert result.verification.passed and result.verification.mode == "exact"
    assert result.coverage_after.single_elf and not result.coverage_after.blockers
    perms = [
        list(onnx.helper.get_attribute_value(a))
        for n in result.model.graph.node
        if n.op_type == "Transpose"
        for a in n.attribute
    ]
    assert perms and all(p[0] == 0 for p in perms)


def _token_mean_pool(c: int = 8) -> onnx.ModelProto:
    b = Builder()
    x = b.conv("stem", "x", 3, c, stride=2)
    x = b.node("Reshape", [x, b.const("flat", np.array([1, c, -1]))], "flat_map")
    x = b.node("Transpose", [x], "tokens", perm=[0, 2, 1])
    x = b.linear("fc", x, c, c)
    x = b.node("ReduceMean", [x], "pool", axes=[1], keepdims=0)
    b.node("Gemm", [x, b.weight("head_w", 5, c), b.weight("head_b", 5)], "logits", transB=1)
    return load_model(b.model("mean_pool", {"x": [1, 3, 8, 8]}, ["logits"]))


def test_mean_over_the_tokens_becomes_a_spatial_reduction_on_the_mla() -> None:
    result = apply_rule(_token_mean_pool(), "transformer-to-4d")
    assert result.verification.passed and result.verification.mode == "exact"
    pool = next(n for n in result.model.graph.node if n.op_type == "ReduceMean")
    axes = next(onnx.helper.get_attribute_value(a) for a in pool.attribute if a.name == "axes")
    assert min(axes) >= 2
    assert result.coverage_after.single_elf
    assert [b.op_type for b in result.coverage_after.blockers] == ["Reshape"]  # output, host
