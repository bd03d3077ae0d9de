"""The rewrite engine: verification, rollback, node selection, and the fix loop."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import onnx_graphsurgeon as gs
import pytest
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

from server.cli import app
from surgery.model import load_model, outputs_as_inferred
from surgery.rules import (
    Rule,
    RuleFailedError,
    RuleNotApplicableError,
    all_rules,
    apply_rule,
    find_matches,
    get_rule,
)
from surgery.rules.base import Match, RuleContext, RuleParams
from surgery.rules.fix import fix_model
from surgery.rules.graph_edit import export_graph, import_graph, nodes_by_name
from surgery.rules.registry import UnknownRuleError
from surgery.workspace import Workspace


def _identity_cnn() -> onnx.ModelProto:
    w = numpy_helper.from_array(
        np.random.default_rng(0).standard_normal((4, 3, 3, 3)).astype(np.float32), "w"
    )
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Identity", ["c"], ["i"], name="ident"),
        helper.make_node("Relu", ["i"], ["y"], name="relu"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        [w],
    )
    return load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


class _ScaleRelu(Rule):
    """Test-only rule that breaks the numbers: multiplies Relu's input by 2."""

    name = "test-scale-relu"
    summary = "breaks numerics on purpose"
    category = "replace"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        return [
            self.match([n], "scale")
            for i, n in enumerate(ctx.view.names)
            if ctx.view.op_types[i] == "Relu"
        ]

    def apply(self, graph, match, params, ctx) -> None:
        relu = nodes_by_name(graph)[match.nodes[0]]
        doubled = gs.Variable("doubled", dtype=np.float32)
        graph.nodes.append(
            gs.Node(
                "Mul",
                inputs=[relu.inputs[0], gs.Constant("two", np.array(2, np.float32))],
                outputs=[doubled],
            )
        )
        relu.inputs[0] = doubled


def test_apply_removes_identity_and_verifies_exactly():
    model = _identity_cnn()
    result = apply_rule(model, "remove-identity")
    assert result.nodes_removed == ["ident"]
    assert result.verification.passed and result.verification.worst_max_abs == 0.0
    assert [o.name for o in result.model.graph.output] == ["y"]


@pytest.mark.parametrize(("op", "operand"), [("Tile", [1, 1, 1, 1]), ("Expand", [1, 4, 1, 1])])
def test_a_tile_or_expand_to_its_own_shape_is_removed(op: str, operand: list[int]):
    """GCViT's `q.repeat(B, 1, 1, 1, 1)` with one window copies nothing."""
    graph = helper.make_graph(
        [
            helper.make_node(op, ["x", "operand"], ["copy"], name="copy"),
            helper.make_node("Relu", ["copy"], ["y"]),
        ],
        "no_op_copy",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 3, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 3, 3])],
        [numpy_helper.from_array(np.array(operand, np.int64), "operand")],
    )
    model = load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    result = apply_rule(model, "remove-identity")
    assert result.nodes_removed == ["copy"]
    assert result.verification.passed and result.verification.worst_max_abs == 0.0


def test_apply_never_modifies_the_input_model():
    model = _identity_cnn()
    before = model.SerializeToString()
    apply_rule(model, "remove-identity")
    assert model.SerializeToString() == before


def test_rule_that_changes_outputs_is_rolled_back():
    with pytest.raises(RuleFailedError, match="rolled back"):
        apply_rule(_identity_cnn(), _ScaleRelu())


def test_rule_with_no_match_is_reported():
    with pytest.raises(RuleNotApplicableError, match="does not apply"):
        apply_rule(_identity_cnn(), "fold-constants")


def test_nodes_filter_restricts_matches_and_rejects_unknown_names():
    with pytest.raises(RuleNotApplicableError, match="no node named nope"):
        apply_rule(_identity_cnn(), "remove-identity", nodes=["nope"])
    with pytest.raises(RuleNotApplicableError):
        apply_rule(_identity_cnn(), "remove-identity", nodes=["relu"])


def test_unknown_rule_name_suggests_similar():
    with pytest.raises(UnknownRuleError) as err:
        get_rule("remove-identities")
    assert "remove-identity" in err.value.hint


def test_find_matches_reports_nodes_without_editing():
    matches = find_matches(_identity_cnn(), "remove-identity")
    assert [m.nodes for m in matches] == [["ident"]]


def test_bad_rule_params_are_a_clear_error():
    from surgery.rules.engine import RuleParamsError

    with pytest.raises(RuleParamsError, match="remove-identity"):
        apply_rule(_identity_cnn(), "remove-identity", params={"bogus": 1})


def test_fix_on_single_segment_model_stops_without_changes(plain_cnn):
    result = fix_model(load_model(plain_cnn))
    assert result.single_elf and result.steps == []


def _noop_cast_between_convs() -> onnx.ModelProto:
    w = numpy_helper.from_array(np.ones((3, 3, 1, 1), np.float32), "w")
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["a"], name="conv_a"),
        helper.make_node("Cast", ["a"], ["b"], name="cast", to=TensorProto.FLOAT),
        helper.make_node("Conv", ["b", "w"], ["y"], name="conv_b"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 4, 4])],
        [w],
    )
    return load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def test_fix_removes_a_no_op_cast_that_splits_the_mla_region():
    result = fix_model(_noop_cast_between_convs())
    assert result.coverage_before.mla_segments == 2
    assert [s["rule"] for s in result.steps] == ["remove-identity"]
    assert all(s["verify"]["passed"] for s in result.steps)
    assert result.to_dict()["single_elf"] is True


def test_fix_rejects_unknown_skip_names():
    with pytest.raises(UnknownRuleError):
        fix_model(_identity_cnn(), skip=["no-such-rule"])


def test_fix_skip_is_honoured():
    result = fix_model(_noop_cast_between_convs(), skip=["remove-identity"])
    assert result.steps == [] and not result.single_elf


runner = CliRunner()


def test_cli_rules_lists_and_explains():
    listing = json.loads(runner.invoke(app, ["rules", "--json"]).stdout)
    assert {"fold-constants", "remove-identity"} <= {r["name"] for r in listing["rules"]}
    one = json.loads(runner.invoke(app, ["rules", "remove-identity", "--json"]).stdout)
    assert one["exactness"] == "exact"


def test_cli_rule_explanation_prints_bracketed_shapes_as_written():
    """Rule texts index tensors in brackets; rich markup must not eat them as style tags."""
    out = runner.invoke(app, ["rules", "col2im-to-transpose"]).stdout
    assert "out[n, c, i·kh + a," in out.replace("\n", " ")
    assert "[N, C, kh, kw, H/kh, W/kw]" in out.replace("\n", " ")


def test_rule_docs_print_as_paragraphs_the_terminal_wraps():
    from surgery.cli.rules import reflow

    doc = "First line of a\nparagraph.\n\nSecond one\n- an item\n- another\n  indented"
    assert reflow(doc) == (
        "First line of a paragraph.\n\nSecond one\n- an item\n- another\n  indented"
    )


def test_cli_apply_writes_output_and_a_workspace_version(tmp_path, save):
    src = save(_identity_cnn(), "net.onnx")
    out = tmp_path / "out.onnx"
    res = runner.invoke(
        app,
        [
            "apply",
            "remove-identity",
            str(src),
            "-o",
            str(out),
            "-w",
            str(tmp_path / "ws"),
            "--json",
        ],
    )
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout)
    assert data["verify"]["passed"] and out.exists()
    history = Workspace(tmp_path / "ws").history("net")
    assert [h.action for h in history] == ["import", "rule:remove-identity"]


def test_cli_apply_names_swapped_arguments(tmp_path, save, monkeypatch):
    src = save(_identity_cnn(), "net.onnx")
    monkeypatch.chdir(tmp_path)
    res = runner.invoke(app, ["apply", str(src), "remove-identity"])
    assert res.exit_code == 2
    assert "the rule comes first: surgery apply remove-identity" in res.output
    assert not (tmp_path / ".surgery").exists()


def test_cli_fix_exit_code_follows_single_elf(tmp_path, save, cnn_with_topk):
    src = save(cnn_with_topk, "topk.onnx")
    res = runner.invoke(
        app, ["fix", str(src), "-o", str(tmp_path / "f.onnx"), "-w", str(tmp_path / "ws"), "--json"]
    )
    data = json.loads(res.stdout)
    assert res.exit_code == (0 if data["single_elf"] else 1)
    assert data["mla_segments_before"] == 2


def test_rule_priority_does_not_depend_on_which_rule_module_was_imported_first() -> None:
    """`surgery fix` tries rules in catalogue order; a caller importing a late rule module
    before the catalogue must not move that module's rules to the front."""
    script = (
        "import surgery.rules.rank4_heads, surgery.rules.replace_slicing\n"
        "from surgery.rules import all_rules\n"
        "print(' '.join(c.name for c in all_rules()))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, check=True)
    assert out.stdout.decode().split() == [cls.name for cls in all_rules()]
    assert [cls.name for cls in all_rules()][0] == "fold-constants"


def test_export_sorts_a_dependency_chain_longer_than_the_recursion_limit():
    """An unrolled recurrence is a chain of thousands of nodes; exporting must not recurse."""
    length = sys.getrecursionlimit() + 500
    names = [f"t{i}" for i in range(length + 1)]
    nodes = [helper.make_node("Relu", [names[i]], [names[i + 1]]) for i in range(length)]
    graph = helper.make_graph(
        list(reversed(nodes)),
        "chain",
        [helper.make_tensor_value_info("t0", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info(names[-1], TensorProto.FLOAT, [1, 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    exported = export_graph(import_graph(model), model)
    assert [node.output[0] for node in exported.graph.node] == names[1:]


def _reshape_by_its_own_shape(declared: list) -> onnx.ModelProto:
    """x [1, 2, 3, 4] reshaped to [x.shape[0], -1] by a Shape → Gather → Unsqueeze → Concat
    chain, with the graph output declared as `declared`."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node(
            "Constant", [], ["zero"], value=numpy_helper.from_array(np.array(0, np.int64))
        ),
        helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
        helper.make_node("Unsqueeze", ["n", "axes"], ["n1"]),
        helper.make_node("Concat", ["n1", "rest"], ["shape"], axis=0),
        helper.make_node("Reshape", ["x", "shape"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "reshape_by_shape",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 3, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, declared)],
        [
            numpy_helper.from_array(np.array([0], np.int64), "axes"),
            numpy_helper.from_array(np.array([-1], np.int64), "rest"),
        ],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_wrongly_declared_output_shape_takes_the_inferred_one_after_a_rewrite():
    """Exporters can declare an output shape ONNX Runtime ignores ([1, seqlen] for [1, 24]);
    once folding lets inference reach it, the rewrite must not fail the full checker."""
    step = apply_rule(_reshape_by_its_own_shape([1, "seqlen", 5]), "fold-constants")
    assert step.verification.passed
    (out,) = step.model.graph.output
    assert [d.dim_value for d in out.type.tensor_type.shape.dim] == [1, 24]


def test_outputs_as_inferred_keeps_a_declared_shape_inference_agrees_with():
    model, renamed = outputs_as_inferred(_reshape_by_its_own_shape([1, "features"]))
    (out,) = model.graph.output
    assert renamed == []
    assert [d.dim_param or d.dim_value for d in out.type.tensor_type.shape.dim] == [1, "features"]


def test_outputs_as_inferred_names_the_output_it_corrects():
    _, renamed = outputs_as_inferred(_reshape_by_its_own_shape([1, "seqlen", 5]))
    assert renamed == ["y"]


def test_cli_rule_texts_keep_colons_that_read_as_emoji_codes():
    """x[..., a:b:k] is a slice: rich would print ':b:' as an emoji."""
    out = runner.invoke(app, ["rules"]).stdout
    assert "x[..., a:b:k]" in out
