"""neg-to-mul and repeat-to-concat: the rotary embedding's Neg and grouped-query attention's
repeat_kv (Llama, Qwen2, Mistral), which split every attention layer off an int8 MLA, become
a Mul by −1 and Concats of copies it runs, exactly; so does Keras' UpSampling2D as tf2onnx
writes it (repeats read through a Transpose)."""

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
from surgery.rules.fix import fix_model
from surgery.rules.replace_pad import Repeat, plan_repeat
from surgery.verify import make_inputs
from tests.lower_support import quantize_on, run_and_compare

HEADS, KV_HEADS, LENGTH, DIM = 4, 2, 8, 16


def _model(nodes, inits, x_shape, opset: int = 17) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "attention_part",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    return load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]))


def _rotary() -> onnx.ModelProto:
    """Conv → q·cos + rotate_half(q)·sin → Conv: rotate_half = Concat(−q[…, d/2:], q[…, :d/2])."""
    rng = np.random.default_rng(0)
    half = DIM // 2
    const = {
        "w1": rng.normal(0, 0.5, (HEADS, HEADS, 1, 1)),
        "w2": rng.normal(0, 0.5, (HEADS, HEADS, 1, 1)),
        "cos": rng.uniform(-1, 1, (1, 1, LENGTH, DIM)),
        "sin": rng.uniform(-1, 1, (1, 1, LENGTH, DIM)),
    }
    inits = [numpy_helper.from_array(v.astype(np.float32), k) for k, v in const.items()]
    inits += [
        numpy_helper.from_array(np.array(v, np.int64), k)
        for k, v in {"h": [half], "end": [DIM], "zero": [0], "axis": [3]}.items()
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["q"]),
        helper.make_node("Slice", ["q", "zero", "h", "axis"], ["q1"]),
        helper.make_node("Slice", ["q", "h", "end", "axis"], ["q2"]),
        helper.make_node("Neg", ["q2"], ["neg"], name="rotate_half_neg"),
        helper.make_node("Concat", ["neg", "q1"], ["rot"], axis=3),
        helper.make_node("Mul", ["q", "cos"], ["qc"]),
        helper.make_node("Mul", ["rot", "sin"], ["rs"]),
        helper.make_node("Add", ["qc", "rs"], ["e"]),
        helper.make_node("Conv", ["e", "w2"], ["y"]),
    ]
    return _model(nodes, inits, [1, HEADS, LENGTH, DIM])


def _repeat_kv(
    unsqueeze_axis: int, merged_shape: list[int], copy_op: str = "Expand"
) -> onnx.ModelProto:
    """Conv (kv heads) → Unsqueeze → Expand (or Tile) → Reshape(merged_shape) → Conv (query
    heads)."""
    rng = np.random.default_rng(1)
    copies = HEADS // KV_HEADS
    source = [1, KV_HEADS, LENGTH, DIM]
    expanded = source[:unsqueeze_axis] + [copies] + source[unsqueeze_axis:]
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.5, (KV_HEADS, 3, 1, 1)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.normal(0, 0.5, (HEADS, HEADS, 1, 1)).astype(np.float32), "w2"),
        numpy_helper.from_array(np.array([unsqueeze_axis], np.int64), "axes"),
        numpy_helper.from_array(
            np.array(expanded if copy_op == "Expand" else _repeats(unsqueeze_axis), np.int64),
            "expanded",
        ),
        numpy_helper.from_array(np.array(merged_shape, np.int64), "merged"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["kv"]),
        helper.make_node("Unsqueeze", ["kv", "axes"], ["u"]),
        helper.make_node(copy_op, ["u", "expanded"], ["e"], name="repeat_kv_copy"),
        helper.make_node("Reshape", ["e", "merged"], ["r"]),
        helper.make_node("Conv", ["r", "w2"], ["y"]),
    ]
    return _model(nodes, inits, [1, 3, LENGTH, DIM])


def _repeats(axis: int) -> list[int]:
    """Tile's repeats for a copy along the unit axis the Unsqueeze inserted at `axis`."""
    return [HEADS // KV_HEADS if a == axis else 1 for a in range(5)]


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


# --------------------------------------------------------------------------- neg-to-mul


def test_rotary_neg_splits_the_block_on_mlsoc() -> None:
    report = check_model(_rotary(), "mlsoc")
    assert report.mla_segments == 2
    neg = next(b for b in report.blockers if b.name == "rotate_half_neg")
    assert "neg-to-mul" in neg.suggested_rules


def test_neg_becomes_a_mul_by_minus_one_with_identical_outputs() -> None:
    step = apply_rule(_rotary(), "neg-to-mul", "mlsoc")
    assert step.verification.passed and step.verification.worst_max_abs == 0.0
    assert "Neg" not in _ops(step.model)
    mul = next(n for n in step.model.graph.node if n.name == "rotate_half_neg")
    minus_one = next(i for i in step.model.graph.initializer if i.name == mul.input[1])
    assert numpy_helper.to_array(minus_one).tolist() == -1.0
    assert step.coverage_after.mla_segments == 1


def test_a_neg_of_integers_is_left_alone() -> None:
    """Index arithmetic is not the MLA's business: only float data is rewritten."""
    graph = helper.make_graph(
        [helper.make_node("Neg", ["i"], ["j"])],
        "integer_neg",
        [helper.make_tensor_value_info("i", TensorProto.INT32, [4])],
        [helper.make_tensor_value_info("j", TensorProto.INT32, [4])],
    )
    model = load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    with pytest.raises(RuleNotApplicableError):
        apply_rule(model, "neg-to-mul", "mlsoc")


def test_fixed_rotary_compiles_to_one_elf_bit_exact(tmp_path: Path) -> None:
    model = fix_model(_rotary(), "mlsoc").model
    qdq = quantize_on(model, "mlsoc")
    result = compile_model(qdq, tmp_path, model_name="rotary")
    comparison = run_and_compare(result, qdq, make_inputs(model, seed=4))
    assert len(result.elf_files) == 1 and comparison.bit_exact


# --------------------------------------------------------------------------- repeat-to-concat


def test_plan_repeat_stages_repeat_kv_as_before_copies_after() -> None:
    """[1, kv, L, d] → [1, kv, 1, L, d] → [1, kv, n, L, d] → [1, kv·n, L, d]: memory order
    [kv, n, L·d]."""
    assert plan_repeat([1, 2, 8, 16], [1, 2, 1, 8, 16], [1, 2, 3, 8, 16], [1, 6, 8, 16]) == Repeat(
        2, 128, 3
    )


def test_plan_repeat_reads_a_fold_into_the_axis_after_as_a_plain_concat() -> None:
    assert plan_repeat([1, 2, 8, 16], [1, 1, 2, 8, 16], [1, 3, 2, 8, 16], [1, 6, 8, 16]) == Repeat(
        1, 256, 3, tile_axis=1
    )


def test_plan_repeat_takes_any_reshape_of_the_copies() -> None:
    """GCViT: a global query [1, 7, 7, 64] tiled over 64 windows, reshaped to [64, 49, 2, 32]."""
    assert plan_repeat([1, 7, 7, 64], [1, 1, 7, 7, 64], [1, 64, 7, 7, 64], [64, 49, 2, 32]) == (
        Repeat(1, 3136, 64)
    )


def test_plan_repeat_refuses_an_expand_of_two_axes() -> None:
    assert plan_repeat([1, 2, 1, 16], [1, 2, 1, 1, 16], [1, 2, 3, 3, 16], [1, 2, 9, 16]) is None


def test_repeat_kv_splits_the_model_on_mlsoc() -> None:
    model = _repeat_kv(2, [1, HEADS, LENGTH, DIM])
    assert check_model(model, "mlsoc", suggest=False).mla_segments == 2


def test_interleaved_repeat_becomes_reshape_concat_reshape_with_identical_outputs() -> None:
    step = apply_rule(_repeat_kv(2, [1, HEADS, LENGTH, DIM]), "repeat-to-concat", "mlsoc")
    assert step.verification.passed and step.verification.worst_max_abs == 0.0
    assert _ops(step.model) == ["Conv", "Reshape", "Concat", "Reshape", "Conv"]
    assert step.coverage_after.mla_segments == 1 and not step.coverage_after.blockers


def test_a_tile_of_the_new_axis_is_rewritten_like_an_expand() -> None:
    model = _repeat_kv(2, [1, HEADS, LENGTH, DIM], copy_op="Tile")
    step = apply_rule(model, "repeat-to-concat", "mlsoc")
    assert step.verification.passed and step.verification.worst_max_abs == 0.0
    assert _ops(step.model) == ["Conv", "Reshape", "Concat", "Reshape", "Conv"]


def test_copies_reshaped_across_axes_become_reshape_concat_reshape() -> None:
    """[1, kv, n, L, d] → [1, 4, 16, 8] regroups L and d too: any Reshape relabels memory."""
    step = apply_rule(_repeat_kv(2, [1, HEADS, 2 * DIM, LENGTH // 2]), "repeat-to-concat", "mlsoc")
    assert step.verification.passed and step.verification.worst_max_abs == 0.0
    assert _ops(step.model)[1:4] == ["Reshape", "Concat", "Reshape"]


def test_tiled_repeat_becomes_a_concat_with_identical_outputs() -> None:
    step = apply_rule(_repeat_kv(1, [1, HEADS, LENGTH, DIM]), "repeat-to-concat", "mlsoc")
    assert step.verification.passed and step.verification.worst_max_abs == 0.0
    assert _ops(step.model) == ["Conv", "Concat", "Conv"]
    assert step.coverage_after.mla_segments == 1


def test_fixed_repeat_kv_compiles_to_one_elf_bit_exact(tmp_path: Path) -> None:
    model = fix_model(_repeat_kv(2, [1, HEADS, LENGTH, DIM]), "mlsoc").model
    qdq = quantize_on(model, "mlsoc")
    result = compile_model(qdq, tmp_path, model_name="repeat_kv")
    comparison = run_and_compare(result, qdq, make_inputs(model, seed=2))
    assert len(result.elf_files) == 1 and comparison.bit_exact


def _keras_upsample() -> onnx.ModelProto:
    """Keras 3's UpSampling2D(2) as tf2onnx writes it on an NCHW map: repeat the rows
    (Unsqueeze → Tile → Transpose to channels-last → Reshape), then the columns
    (Unsqueeze → Tile → Reshape), then back to NCHW; a Conv on each side."""
    rng = np.random.default_rng(2)
    c, side = 4, 4
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.5, (c, 3, 1, 1)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.normal(0, 0.5, (c, c, 1, 1)).astype(np.float32), "w2"),
        numpy_helper.from_array(np.array([3], np.int64), "axis3"),
        numpy_helper.from_array(np.array([1, 1, 1, 2, 1], np.int64), "twice"),
        numpy_helper.from_array(np.array([1, 2 * side, side, c], np.int64), "rows"),
        numpy_helper.from_array(np.array([1, 2 * side, 2 * side, c], np.int64), "cols"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["a"]),
        helper.make_node("Unsqueeze", ["a", "axis3"], ["a5"]),
        helper.make_node("Tile", ["a5", "twice"], ["a5t"]),
        helper.make_node("Transpose", ["a5t"], ["nhwc5"], perm=[0, 2, 3, 4, 1]),
        helper.make_node("Reshape", ["nhwc5", "rows"], ["tall"]),
        helper.make_node("Unsqueeze", ["tall", "axis3"], ["t5"]),
        helper.make_node("Tile", ["t5", "twice"], ["t5t"]),
        helper.make_node("Reshape", ["t5t", "cols"], ["up"]),
        helper.make_node("Transpose", ["up"], ["up_nchw"], perm=[0, 3, 1, 2]),
        helper.make_node("Conv", ["up_nchw", "w2"], ["y"]),
    ]
    return _model(nodes, inits, [1, 3, side, side])


def test_a_repeat_read_through_a_transpose_is_rewritten() -> None:
    model = _keras_upsample()
    assert check_model(model, "mlsoc", suggest=False).mla_segments == 2
    step = apply_rule(model, "repeat-to-concat", "mlsoc")
    assert step.verification.passed and step.verification.worst_max_abs == 0.0
    assert "Tile" not in _ops(step.model)


def test_fix_takes_the_keras_upsample_to_one_segment() -> None:
    result = fix_model(_keras_upsample(), "mlsoc")
    assert result.coverage_after.mla_segments == 1 and not result.coverage_after.blockers
    assert "repeat-to-concat" in [step["rule"] for step in result.steps]


def test_a_repeat_whose_axis_a_reshape_adds_is_rewritten() -> None:
    """The Unsqueeze folded into the Reshape before it ([1, kv, L·d] → [1, kv, 1, L, d])."""
    model = _repeat_kv(2, [1, HEADS, LENGTH, DIM])
    for node in model.graph.node:
        if node.op_type == "Unsqueeze":
            node.op_type, node.input[1] = "Reshape", "as_unit_axis"
    model.graph.initializer.append(
        numpy_helper.from_array(np.array([1, KV_HEADS, 1, LENGTH, DIM], np.int64), "as_unit_axis")
    )
    step = apply_rule(load_model(model), "repeat-to-concat", "mlsoc")
    assert step.verification.passed and step.verification.worst_max_abs == 0.0
    assert _ops(step.model) == ["Conv", "Reshape", "Concat", "Reshape", "Conv"]
