"""broadcast-concat-to-add: a Linear over [tokens, the CLS token expanded over them] (DPT's
readout projection) takes the CLS token's product once and broadcasts it with an Add."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler.compile import compile_model
from surgery.check import check_model
from surgery.model import load_model
from surgery.rules.engine import RuleNotApplicableError, apply_rule
from surgery.rules.fix import fix_model
from tests.lower_support import quantize_on, run_and_compare

RNG = np.random.default_rng(0)


def _const(name: str, value) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value), name)


def _model(nodes, inputs, initializers, name: str) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        name,
        inputs,
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializers,
    )
    return load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def _token_readout(
    expand_to: tuple[int, ...] = (1, 8, 16), tail_view: tuple[int, ...] | None = None
) -> onnx.ModelProto:
    """Tokens [1, 9, 16]: the last 8 concatenated with token 0 expanded to `expand_to` (and
    viewed as `tail_view`, when given) over them, then a MatMul by a constant matrix."""
    expanded = "copies" if tail_view is None else "copies_raw"
    nodes = [
        helper.make_node("Slice", ["x", "one", "nine", "axis1"], ["tokens"]),
        helper.make_node("Slice", ["x", "zero", "one", "axis1"], ["cls"]),
        helper.make_node("Expand", ["cls", "expand_to"], [expanded]),
    ]
    if tail_view is not None:
        nodes.append(helper.make_node("Reshape", ["copies_raw", "tail_view"], ["copies"]))
    nodes += [
        helper.make_node("Concat", ["tokens", "copies"], ["joined"], axis=-1),
        helper.make_node("MatMul", ["joined", "w"], ["y"]),
    ]
    inits = [
        _const("zero", [0]),
        _const("one", [1]),
        _const("nine", [9]),
        _const("axis1", [1]),
        _const("expand_to", list(expand_to)),
        _const("w", RNG.normal(0, 0.2, (16 + (tail_view or expand_to)[-1], 12)).astype(np.float32)),
    ]
    if tail_view is not None:
        inits.append(_const("tail_view", list(tail_view)))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 9, 16])
    return _model(nodes, [x], inits, "token_readout")


def _lifted_readout() -> onnx.ModelProto:
    """The readout as a transformer lift leaves it: tokens on the batch axis [8, 16, 1, 1], the
    CLS token [1, 16, 1, 1] staged as rank 3, expanded and viewed back as [8, 16, 1, 1], then a
    1×1 Conv with bias over the channel Concat (after a Conv so the MLA part is not empty)."""
    nodes = [
        helper.make_node("Conv", ["x", "w0", "b0"], ["tokens"]),
        helper.make_node("Conv", ["cls_in", "w1"], ["cls"]),
        helper.make_node("Reshape", ["cls", "rank3"], ["cls3"]),
        helper.make_node("Expand", ["cls3", "expand_to"], ["copies3"]),
        helper.make_node("Reshape", ["copies3", "rank4"], ["copies"]),
        helper.make_node("Concat", ["tokens", "copies"], ["joined"], axis=1),
        helper.make_node("Conv", ["joined", "w", "b"], ["y"]),
    ]
    inits = [
        _const("w0", RNG.normal(0, 0.3, (16, 16, 1, 1)).astype(np.float32)),
        _const("b0", RNG.normal(0, 0.1, (16,)).astype(np.float32)),
        _const("w1", RNG.normal(0, 0.3, (16, 16, 1, 1)).astype(np.float32)),
        _const("rank3", [1, 1, 16]),
        _const("expand_to", [1, 8, 16]),
        _const("rank4", [8, 16, 1, 1]),
        _const("w", RNG.normal(0, 0.2, (24, 32, 1, 1)).astype(np.float32)),
        _const("b", RNG.normal(0, 0.1, (24,)).astype(np.float32)),
    ]
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 16, 1, 1]),
        helper.make_tensor_value_info("cls_in", TensorProto.FLOAT, [1, 16, 1, 1]),
    ]
    return _model(nodes, inputs, inits, "lifted_readout")


def test_the_expanded_token_is_multiplied_once_and_added_with_broadcasting():
    step = apply_rule(_token_readout(), "broadcast-concat-to-add", "rk3588")
    assert step.verification.passed
    ops = [n.op_type for n in step.model.graph.node]
    assert "Expand" not in ops and "Concat" not in ops
    assert ops.count("MatMul") == 2 and ops.count("Add") == 1
    # the [1, 1, 16] token itself is multiplied, not a copy of it
    assert [n.input[0] for n in step.model.graph.node if n.op_type == "MatMul"].count("cls") == 1


def test_a_lifted_readout_joins_the_segment_on_mlsoc():
    model = _lifted_readout()
    assert check_model(model, "mlsoc", suggest=False).mla_segments == 2
    step = apply_rule(model, "broadcast-concat-to-add", "mlsoc")
    assert step.verification.passed
    assert step.coverage_after.mla_segments == 1 and not step.coverage_after.blockers
    reads = [n for n in step.model.graph.node if n.op_type == "Conv" and n.input[0] == "cls"]
    assert len(reads) == 1  # the CLS product reads the [1, 16, 1, 1] map before the views


def test_check_suggests_the_rule_for_the_expand():
    report = check_model(_lifted_readout(), "mlsoc")
    expand = next(b for b in report.blockers if b.op_type == "Expand")
    assert "broadcast-concat-to-add" in expand.suggested_rules


def test_a_copy_that_a_reshape_regroups_is_not_a_broadcast():
    # two copies of [c0 … c15] viewed as 8 rows of 4: rows c0-3, c4-7, …, not one row repeated
    with pytest.raises(RuleNotApplicableError):
        apply_rule(_token_readout((1, 2, 16), (1, 8, 4)), "broadcast-concat-to-add", "rk3588")


def test_a_concat_without_a_broadcast_part_is_not_matched():
    model = _token_readout()
    expand = next(n for n in model.graph.node if n.op_type == "Expand")
    expand.op_type, expand.input[1] = "Identity", ""  # both parts are real tokens now
    del expand.input[1:]
    model.graph.node[0].input[1] = "zero"
    model.graph.node[1].input[2] = "nine"
    with pytest.raises(RuleNotApplicableError):
        apply_rule(load_model(model), "broadcast-concat-to-add", "rk3588")


def test_fix_then_compile_gives_one_bit_exact_elf_on_mlsoc(tmp_path):
    result = fix_model(_lifted_readout(), "mlsoc")
    assert "broadcast-concat-to-add" in [s["rule"] for s in result.steps]
    qdq = quantize_on(result.model, "mlsoc")
    compiled = compile_model(qdq, tmp_path, target="mlsoc", model_name="readout")
    assert len(compiled.elf_files) == 1, compiled.notes
    rng = np.random.default_rng(5)
    feed = {
        "x": rng.normal(0, 1, (8, 16, 1, 1)).astype(np.float32),
        "cls_in": rng.normal(0, 1, (1, 16, 1, 1)).astype(np.float32),
    }
    comparison = run_and_compare(compiled, qdq, feed)
    assert comparison.mla_stages and comparison.bit_exact
