"""Rule suggestions skip rules by `Rule.may_free`, rules that keep ranks when every blocker has
an off-rank tensor (`Rule.keeps_ranks`), and anchors far from every blocker by
`RuleContext.near_focus`: no skip may drop or add a suggestion.

Each rule's `suggest_for` (or `may_free` override) claims that its matches list blockers only
when the model has a blocker it names. These tests run every rule on the example and real
models, unfiltered and without a focus, and check the claim and that `check`'s suggestions are
unchanged by both.
"""

from __future__ import annotations

import dataclasses

import onnx
import pytest
from onnx import TensorProto, helper

from surgery import examples
from surgery.check import check_model
from surgery.coverage import analyze_coverage
from surgery.fold import folded_copy, shapes_wait_for_folding
from surgery.model import open_model
from surgery.rules.base import RuleContext
from surgery.rules.registry import all_rules
from surgery.rules.suggest import rule_matches
from surgery.targets import resolve_target
from tests.conftest import RUN_INPUTS, SHARED_MODELS

EXAMPLES = examples.EXAMPLES
REAL = sorted(p.stem for p in SHARED_MODELS.glob("*.onnx"))


def _model(name: str) -> tuple[onnx.ModelProto | str, dict | None]:
    if name in EXAMPLES:
        return EXAMPLES[name](), None
    return str(SHARED_MODELS / f"{name}.onnx"), RUN_INPUTS.get(name)


def _unfiltered_suggestions(source, target: str, shapes, report) -> dict[str, list[str]]:
    """Blocker → rules, asking every rule without a focus (what `check` suggested before the
    pre-check); `report` is check's own, whose blockers the context must see too (on the
    folded model where check folds)."""
    model, view = open_model(source, shapes)
    if shapes_wait_for_folding(analyze_coverage(model, target, view=view, suggest=False)):
        folded = folded_copy(model, view.names)  # the model check analyses then
        if folded is not None:
            model, view = open_model(folded)
    ctx = RuleContext.build(model, target, view)
    assert [b.name for b in ctx.coverage.blockers] == [b.name for b in report.blockers]
    found: dict[str, list[str]] = {}
    for rule, matches in rule_matches(ctx, [cls() for cls in all_rules()]):
        listed = {b for m in matches for b in m.blockers}
        if listed:
            assert rule.may_free(ctx.coverage), (
                f"{rule.name} lists blockers {sorted(listed)[:3]} but may_free() said no"
            )
        for b in listed:
            found.setdefault(b, []).append(rule.name)
    return {b: sorted(set(rules)) for b, rules in found.items()}


@pytest.mark.parametrize("target", ["mlsoc", "rk3588"])
@pytest.mark.parametrize("name", [*EXAMPLES, *REAL])
def test_pre_check_never_drops_a_suggestion(name, target):
    source, shapes = _model(name)
    report = check_model(source, target, input_shapes=shapes)
    expected = _unfiltered_suggestions(source, target, shapes, report)
    got = {b.name: sorted(b.suggested_rules) for b in report.blockers if b.suggested_rules}
    names = {b.name for b in report.blockers}
    assert got == {b: rules for b, rules in expected.items() if b in names}


def test_near_focus_is_every_node_within_reach_of_a_focus_blocker() -> None:
    names = [f"relu{k}" for k in range(6)]
    nodes = [
        helper.make_node("Relu", [f"t{k}"], [f"t{k + 1}"], name=name)
        for k, name in enumerate(names)
    ]
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("t0", TensorProto.FLOAT, [1, 2, 2, 2])],
        [helper.make_tensor_value_info("t6", TensorProto.FLOAT, [1, 2, 2, 2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    ctx = RuleContext.build(model, "mlsoc")
    assert ctx.near_focus(1) is None  # no focus: every anchor is wanted
    focused = dataclasses.replace(ctx, focus=frozenset({"relu2"}))
    assert focused.near_focus(0) == {2}
    assert focused.near_focus(1) == {1, 2, 3}
    assert focused.near_focus(10) == set(range(6))


def test_a_rule_that_refuses_without_parameters_is_no_warning(caplog):
    """fix-input-shapes cannot fix a dynamic height by itself and says so; check's suggestion
    pass skips it quietly (a warning with a traceback is for a rule's bug)."""
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "dynamic_height",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, "height", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with caplog.at_level("WARNING", logger="surgery.rules.suggest"):
        report = check_model(model, "mlsoc")
    assert report.blockers and not caplog.records


def test_profiles_with_one_mla_rank_for_every_op_say_so():
    assert resolve_target("mlsoc").uniform_mla_ranks == {4}
    assert resolve_target("modalix").uniform_mla_ranks == {4}
    assert resolve_target("rk3588").uniform_mla_ranks is None  # its Gemm and Flatten skip it


def _rank_keeping_rules_asked(model: onnx.ModelProto, monkeypatch) -> list[str]:
    """Names of the `keeps_ranks` rules whose `find` check's suggestion pass calls."""
    asked: list[str] = []
    for cls in all_rules():
        if cls.keeps_ranks:
            original = cls.find

            def spy(self, ctx, params, _original=original):
                asked.append(self.name)
                return _original(self, ctx, params)

            monkeypatch.setattr(cls, "find", spy)
    check_model(model, "mlsoc")
    return asked


def test_rank_keeping_rules_are_not_asked_when_every_blocker_has_an_off_rank_tensor(
    monkeypatch,
):
    """The YOLO head's blockers carry rank-5 tensors: Split as Slices would be rank 5 too."""
    assert "Split" in {b.op_type for b in check_model(examples.yolo_head(), "mlsoc").blockers}
    assert _rank_keeping_rules_asked(examples.yolo_head(), monkeypatch) == []


def test_rank_keeping_rules_are_asked_for_a_4d_blocker(monkeypatch):
    """A 4-D Neg is blocked by its op alone: neg-to-mul frees it, and check says so."""
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
            helper.make_node("Neg", ["c"], ["n"], name="neg"),
            helper.make_node("Conv", ["n", "w"], ["y"], name="conv2"),
        ],
        "neg_4d",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [helper.make_tensor("w", TensorProto.FLOAT, [2, 2, 1, 1], [1.0, 0.0, 0.0, 1.0])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert "neg-to-mul" in _rank_keeping_rules_asked(model, monkeypatch)
    neg = next(b for b in check_model(model, "mlsoc").blockers if b.name == "neg")
    assert "neg-to-mul" in neg.suggested_rules
