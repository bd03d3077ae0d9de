"""stacked-branches-to-sum: SKNet's selective kernel (branches stacked on a new axis, a softmax
over that axis of a rank-5 reshape, the weighted stack summed) becomes 4-D Adds and Muls."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler.compile import compile_model
from surgery.check import check_model
from surgery.model import load_model
from surgery.rules.engine import RuleNotApplicableError, apply_rule
from surgery.verify import make_inputs
from tests.lower_support import quantize_on, run_and_compare

C, H, BRANCHES = 8, 6, 2


def _weights(rng: np.random.Generator):
    """A maker of random float initializers drawn from `rng`."""

    def weight(name: str, shape: tuple[int, ...]) -> onnx.TensorProto:
        return numpy_helper.from_array(rng.normal(0, 0.3, shape).astype(np.float32), name)

    return weight


def _ints(name: str, values: list[int]) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(values, np.int64), name)


def _selective_kernel(weighted: bool = True, opset: int = 17) -> onnx.ModelProto:
    """Conv → two 3×3 branches (dilation 1 and 2) → stack [1, 2, C, H, H] → sum → pooled
    attention → Reshape [1, 2, C, 1, 1] → Softmax(axis 1) → weighted stack summed → Conv."""
    weight = _weights(np.random.default_rng(0))
    n = helper.make_node
    nodes = [
        n("Conv", ["x", "w0"], ["a"]),
        n("Conv", ["a", "w1"], ["b1"], pads=[1, 1, 1, 1]),
        n("Conv", ["a", "w2"], ["b2"], pads=[2, 2, 2, 2], dilations=[2, 2]),
        n("Relu", ["b1"], ["p1"]),
        n("Relu", ["b2"], ["p2"]),
        n("Unsqueeze", ["p1", "one"], ["u1"]),
        n("Unsqueeze", ["p2", "one"], ["u2"]),
        n("Concat", ["u1", "u2"], ["stack"], axis=1, name="stack"),
        n("ReduceSum", ["stack", "one"], ["pooled_sum"], keepdims=0),
    ]
    if weighted:
        nodes += [
            n("GlobalAveragePool", ["pooled_sum"], ["gap"]),
            n("Conv", ["gap", "wr"], ["r"]),
            n("Relu", ["r"], ["rr"]),
            n("Conv", ["rr", "wa"], ["logits"]),
            n("Reshape", ["logits", "five_d"], ["logits5"]),
            n("Softmax", ["logits5"], ["attention"], axis=1),
            n("Mul", ["stack", "attention"], ["weighted"]),
            n("ReduceSum", ["weighted", "one"], ["selected"], keepdims=0),
            n("Conv", ["selected", "w3"], ["y"]),
        ]
    else:
        nodes.append(n("Conv", ["pooled_sum", "w3"], ["y"]))
    inits = [
        weight("w0", (C, 3, 1, 1)),
        weight("w1", (C, C, 3, 3)),
        weight("w2", (C, C, 3, 3)),
        weight("wr", (4, C, 1, 1)),
        weight("wa", (BRANCHES * C, 4, 1, 1)),
        weight("w3", (4, C, 1, 1)),
        _ints("one", [1]),
        _ints("five_d", [1, BRANCHES, C, 1, 1]),
    ]
    graph = helper.make_graph(
        nodes,
        "selective_kernel",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, H, H])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    return load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]))


def _split_attention() -> onnx.ModelProto:
    """ResNeSt: one grouped Conv makes both branches [1, 2·C, H, H] → Reshape [1, 2, C, H, H]
    → sum → pooled attention → rSoftMax (Reshape [1, 1, 2, C], Transpose, Softmax over the
    radix) → Reshape [1, 2, C, 1, 1] → weighted stack summed → Conv."""
    weight = _weights(np.random.default_rng(1))
    n = helper.make_node
    nodes = [
        n("Conv", ["x", "w1"], ["b"], group=BRANCHES, pads=[1, 1, 1, 1]),
        n("Relu", ["b"], ["branches"]),
        n("Reshape", ["branches", "stacked"], ["stack"], name="stack"),
        n("ReduceSum", ["stack", "one"], ["pooled_sum"], keepdims=0),
        n("GlobalAveragePool", ["pooled_sum"], ["gap"]),
        n("Conv", ["gap", "wr"], ["r"]),
        n("Relu", ["r"], ["rr"]),
        n("Conv", ["rr", "wa"], ["logits"]),
        n("Reshape", ["logits", "radix_view"], ["radix"]),
        n("Transpose", ["radix"], ["radix_first"], perm=[0, 2, 1, 3]),
        n("Softmax", ["radix_first"], ["soft"], axis=1),
        n("Reshape", ["soft", "five_d"], ["attention"]),
        n("Mul", ["stack", "attention"], ["weighted"]),
        n("ReduceSum", ["weighted", "one"], ["selected"], keepdims=0),
        n("Conv", ["selected", "w3"], ["y"]),
    ]
    inits = [
        weight("w1", (BRANCHES * C, 2, 3, 3)),
        weight("wr", (4, C, 1, 1)),
        weight("wa", (BRANCHES * C, 4, 1, 1)),
        weight("w3", (4, C, 1, 1)),
        _ints("one", [1]),
        _ints("stacked", [1, BRANCHES, C, H, H]),
        _ints("radix_view", [1, 1, BRANCHES, C]),
        _ints("five_d", [1, BRANCHES, C, 1, 1]),
    ]
    graph = helper.make_graph(
        nodes,
        "split_attention",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, H, H])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    return load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def test_the_rank5_stack_splits_the_block_on_mlsoc() -> None:
    assert check_model(_selective_kernel(), "mlsoc", suggest=False).mla_segments > 1


def test_a_weighted_stack_becomes_4d_sums_with_the_same_outputs() -> None:
    step = apply_rule(_selective_kernel(), "stacked-branches-to-sum", "mlsoc")
    assert step.verification.passed
    ops = _ops(step.model)
    assert not {"Unsqueeze", "Concat", "ReduceSum"} & set(ops)
    assert ops.count("Softmax") == 1 and ops.count("Slice") == BRANCHES
    assert step.coverage_after.mla_segments == 1 and not step.coverage_after.blockers


def test_a_plain_stack_sum_becomes_an_add_exactly() -> None:
    step = apply_rule(_selective_kernel(weighted=False), "stacked-branches-to-sum", "mlsoc")
    assert step.verification.passed and step.verification.worst_max_abs == 0.0
    assert _ops(step.model).count("Add") == BRANCHES - 1


def test_split_attention_becomes_channel_slices_summed() -> None:
    """The stack is a Reshape of one tensor and the weights a Reshape of a 4-D softmax: both
    become channel slices (the softmax stays as it is)."""
    model = _split_attention()
    assert check_model(model, "mlsoc", suggest=False).mla_segments > 1
    step = apply_rule(model, "stacked-branches-to-sum", "mlsoc")
    assert step.verification.passed
    ops = _ops(step.model)
    assert not {"ReduceSum"} & set(ops) and ops.count("Slice") == 2 * BRANCHES
    assert step.coverage_after.mla_segments == 1 and not step.coverage_after.blockers


def test_a_stack_read_by_anything_else_is_left_alone() -> None:
    """A reader the rule does not rewrite (here the stack is a graph output) keeps the stack."""
    model = _selective_kernel(weighted=False)
    model.graph.output.append(helper.make_tensor_value_info("stack", TensorProto.FLOAT, None))
    with pytest.raises(RuleNotApplicableError):
        apply_rule(model, "stacked-branches-to-sum", "mlsoc")


@pytest.mark.parametrize("build", [_selective_kernel, _split_attention])
def test_the_rewritten_block_compiles_to_one_elf_bit_exact(build, tmp_path: Path) -> None:
    model = apply_rule(build(), "stacked-branches-to-sum", "mlsoc").model
    qdq = quantize_on(model, "mlsoc")
    result = compile_model(qdq, tmp_path, model_name="selective_kernel")
    comparison = run_and_compare(result, qdq, make_inputs(model, seed=3))
    assert len(result.elf_files) == 1 and comparison.bit_exact
