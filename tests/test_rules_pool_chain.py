"""maxpool-to-chain: a stride-1 "same" MaxPool larger than the MLA pools (rk3588: 7×7) becomes
a chain of smaller MaxPools with identical outputs (SPP's 9×9 and 13×13 windows)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from surgery.check import check_model
from surgery.model import load_model
from surgery.rules.engine import RuleNotApplicableError, apply_rule


def _spp(kernel: list[int], strides: list[int] | None = None) -> onnx.ModelProto:
    """Conv → MaxPool(kernel, "same" padding) → Conv."""
    rng = np.random.default_rng(0)
    weights = [
        numpy_helper.from_array(rng.normal(0, 0.3, (8, 8, 1, 1)).astype(np.float32), name)
        for name in ("w1", "w2")
    ]
    pool = helper.make_node(
        "MaxPool",
        ["a"],
        ["p"],
        kernel_shape=kernel,
        pads=[(k - 1) // 2 for k in kernel] * 2,
        strides=strides or [1, 1],
    )
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w1"], ["a"]),
            pool,
            helper.make_node("Conv", ["p", "w2"], ["y"]),
        ],
        "spp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        weights,
    )
    return load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]))


def _kernels(model: onnx.ModelProto, op: str = "MaxPool") -> list[list[int]]:
    return [
        list(helper.get_attribute_value(a))
        for n in model.graph.node
        if n.op_type == op
        for a in n.attribute
        if a.name == "kernel_shape"
    ]


@pytest.mark.parametrize(
    ("kernel", "chain"),
    [([13, 13], [[7, 7], [7, 7]]), ([9, 9], [[7, 7], [3, 3]]), ([13, 5], [[7, 5], [7, 1]])],
)
def test_large_maxpool_becomes_a_chain_the_mla_runs(kernel, chain) -> None:
    model = _spp(kernel)
    assert check_model(model, "rk3588").mla_segments == 2
    step = apply_rule(model, "maxpool-to-chain", "rk3588")
    assert step.verification.passed
    assert _kernels(step.model) == chain
    assert step.coverage_after.mla_segments == 1
    assert not step.coverage_after.blockers


def test_strided_maxpool_is_not_split() -> None:
    with pytest.raises(RuleNotApplicableError):
        apply_rule(_spp([9, 9], strides=[2, 2]), "maxpool-to-chain", "rk3588")


def test_maxpool_the_mla_runs_is_left_alone() -> None:
    with pytest.raises(RuleNotApplicableError):
        apply_rule(_spp([5, 5]), "maxpool-to-chain", "rk3588")


def _token_pool(kernel: list[int], op: str = "AveragePool") -> onnx.ModelProto:
    """Conv → AveragePool(kernel, strides = kernel) over a [1, 8, 1, 64] token row → Conv, as
    NextViT's E-MHSA reduces its keys (AvgPool1d of kernel 16, lifted to 4-D)."""
    rng = np.random.default_rng(1)
    weights = [
        numpy_helper.from_array(rng.normal(0, 0.3, (8, 8, 1, 1)).astype(np.float32), name)
        for name in ("w1", "w2")
    ]
    pool = helper.make_node(op, ["a"], ["p"], name="p", kernel_shape=kernel, strides=kernel)
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w1"], ["a"]),
            pool,
            helper.make_node("Conv", ["p", "w2"], ["y"]),
        ],
        "token_pool",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 1, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        weights,
    )
    return load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]))


def test_a_tiling_average_pool_past_the_limit_becomes_a_chain_of_accepted_kernels() -> None:
    model = _token_pool([1, 16])
    assert "p" in {b.name for b in check_model(model, "rk3588").blockers}
    result = apply_rule(model, "avgpool-to-chain", "rk3588")
    assert result.verification.passed
    assert _kernels(result.model, "AveragePool") == [[1, 4], [1, 4]]
    assert result.coverage_after.mla_segments == 1 and not result.coverage_after.blockers


def test_a_prime_kernel_past_the_limit_has_no_chain() -> None:
    model = _token_pool([1, 11])
    model.graph.input[0].type.tensor_type.shape.dim[3].dim_value = 66
    with pytest.raises(RuleNotApplicableError):
        apply_rule(load_model(model), "avgpool-to-chain", "rk3588")


def test_a_tiling_max_pool_past_the_limit_becomes_a_chain_of_accepted_kernels() -> None:
    """A CRNN collapses its map's height with MaxPool [8, 1]; here along the tokens."""
    model = _token_pool([1, 8], "MaxPool")
    assert "p" in {b.name for b in check_model(model, "rk3588").blockers}
    result = apply_rule(model, "tiling-maxpool-to-chain", "rk3588")
    assert result.verification.passed and result.verification.mode == "exact"
    assert _kernels(result.model) == [[1, 4], [1, 2]]
    assert result.coverage_after.mla_segments == 1 and not result.coverage_after.blockers
