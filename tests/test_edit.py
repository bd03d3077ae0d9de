"""Low-level edits: each op's happy path and a clear error, apply_edits, and `surgery edit`."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

from server.cli import app
from surgery import edit
from surgery.edit import EditError
from surgery.errors import NodeNotFoundError
from surgery.model import load_model
from surgery.verify import run_model

runner = CliRunner()


def _chain() -> onnx.ModelProto:
    """x → Relu(relu) → Add(add, +b) → Mul(mul, x) → y: small enough to reason about."""
    b = numpy_helper.from_array(np.full((1, 4), 0.5, np.float32), "b")
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Add", ["r", "b"], ["a"], name="add"),
        helper.make_node("Mul", ["a", "x"], ["y"], name="mul"),
    ]
    graph = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        [b],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return load_model(model)


X = np.array([[-1.0, 0.0, 1.0, 2.0]], np.float32)


def _run(model: onnx.ModelProto, x: np.ndarray = X) -> dict[str, np.ndarray]:
    return run_model(model, {"x": x})


def _valid(model: onnx.ModelProto) -> onnx.ModelProto:
    onnx.checker.check_model(model, full_check=True)
    return model


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def test_edits_never_modify_their_input():
    model = _chain()
    before = model.SerializeToString()
    edit.remove_node(model, "relu")
    edit.insert_node_after(model, "relu", "Neg")
    edit.rename_tensor(model, "a", "a2")
    assert model.SerializeToString() == before


def test_remove_node_reconnects_consumers():
    out = _valid(edit.remove_node(_chain(), "relu"))
    assert _ops(out) == ["Add", "Mul"]
    np.testing.assert_allclose(_run(out)["y"], (X + 0.5) * X)


def test_remove_node_keeps_the_graph_output_name():
    out = _valid(edit.remove_node(_chain(), "add"))  # Add(r, const) has one data input
    assert _ops(out) == ["Relu", "Mul"]
    assert [o.name for o in out.graph.output] == ["y"]
    np.testing.assert_allclose(_run(out)["y"], np.maximum(X, 0) * X)


def test_remove_node_refuses_two_data_inputs():
    with pytest.raises(EditError, match=r"'mul' \(Mul\) has 2 data inputs.*'a', 'x'"):
        edit.remove_node(_chain(), "mul")


def test_unknown_node_is_named_with_suggestions():
    with pytest.raises(NodeNotFoundError, match="no node named 'rellu'") as info:
        edit.remove_node(_chain(), "rellu")
    assert "relu" in (info.value.hint or "")


def test_bypass_node_uses_the_chosen_input():
    out = _valid(edit.bypass_node(_chain(), "add", input=1))  # consumers read the bias
    np.testing.assert_allclose(_run(out)["y"], 0.5 * X)
    out = _valid(edit.bypass_node(_chain(), "mul", input=0))  # y = a
    np.testing.assert_allclose(_run(out)["y"], np.maximum(X, 0) + 0.5)
    assert [o.name for o in out.graph.output] == ["y"]


def test_bypass_node_rejects_a_missing_input():
    with pytest.raises(EditError, match="'relu' \\(Relu\\) has no input 3"):
        edit.bypass_node(_chain(), "relu", input=3)


def test_bypass_of_a_graph_input_straight_to_an_output_is_refused():
    with pytest.raises(EditError, match="graph output 'y' straight from 'x'"):
        edit.bypass_node(_chain(), "mul", input=1)


def test_replace_op_changes_the_op():
    out = _valid(edit.replace_op(_chain(), "relu", "Sigmoid"))
    assert _ops(out)[0] == "Sigmoid"
    np.testing.assert_allclose(_run(out)["y"], (1 / (1 + np.exp(-X)) + 0.5) * X, rtol=1e-6)


def test_replace_op_with_attributes_coerced_by_schema():
    out = _valid(edit.replace_op(_chain(), "relu", "LeakyRelu", {"alpha": 1}))
    attr = out.graph.node[0].attribute[0]
    assert attr.type == onnx.AttributeProto.FLOAT and attr.f == 1.0


def test_replace_op_unknown_op_suggests_close_names():
    with pytest.raises(EditError, match="'Relux' is not an ONNX op at opset 17") as info:
        edit.replace_op(_chain(), "relu", "Relux")
    assert "Relu" in (info.value.hint or "")


def test_set_attributes_sets_and_removes():
    leaky = edit.replace_op(_chain(), "relu", "LeakyRelu", {"alpha": 0.1})
    out = _valid(edit.set_attributes(leaky, "relu", {"alpha": 0.5}))
    np.testing.assert_allclose(_run(out)["y"], (np.where(X > 0, X, 0.5 * X) + 0.5) * X)
    default = _valid(edit.set_attributes(leaky, "relu", remove=["alpha"]))
    assert not default.graph.node[0].attribute


def test_set_attributes_rejects_unknown_attribute():
    with pytest.raises(EditError, match="Relu has no attribute 'alpha'"):
        edit.set_attributes(_chain(), "relu", {"alpha": 1.0})
    with pytest.raises(EditError, match="no attribute\\(s\\) 'axis' to remove"):
        edit.set_attributes(_chain(), "relu", remove=["axis"])


def test_insert_node_before_only_changes_that_input():
    out = _valid(
        edit.insert_node_before(
            _chain(), "mul", "Mul", inputs=[np.array(2, np.float32)], input_index=1
        )
    )
    assert _ops(out) == ["Relu", "Add", "Mul", "Mul"]
    np.testing.assert_allclose(_run(out)["y"], (np.maximum(X, 0) + 0.5) * 2 * X)


def test_insert_node_before_needs_an_existing_input():
    with pytest.raises(EditError, match="Relu node has no input 2"):
        edit.insert_node_before(_chain(), "relu", "Neg", input_index=2)


def test_insert_node_after_takes_over_the_output_name():
    const = edit.ConstantInput(value=3, dtype="float32")
    out = _valid(edit.insert_node_after(_chain(), "mul", "Mul", inputs=[const], name="triple"))
    assert [o.name for o in out.graph.output] == ["y"]
    assert out.graph.node[-1].name == "triple"
    np.testing.assert_allclose(_run(out)["y"], 3 * (np.maximum(X, 0) + 0.5) * X)


def test_insert_node_after_rejects_unknown_extra_input():
    with pytest.raises(EditError, match="no tensor named 'nope'"):
        edit.insert_node_after(_chain(), "relu", "Add", inputs=["nope"])


def test_rename_tensor_everywhere():
    out = _valid(edit.rename_tensor(_chain(), "y", "scores"))
    assert [o.name for o in out.graph.output] == ["scores"]
    out = _valid(edit.rename_tensor(out, "b", "bias"))
    assert [t.name for t in out.graph.initializer] == ["bias"]


def test_rename_tensor_refuses_taken_names():
    with pytest.raises(EditError, match="'x' is already used"):
        edit.rename_tensor(_chain(), "a", "x")


def test_set_input_shape_reinfers_shapes():
    out = _valid(edit.set_input_shape(_chain(), "x", ["batch", 4]))
    dims = out.graph.input[0].type.tensor_type.shape.dim
    assert dims[0].dim_param == "batch" and dims[1].dim_value == 4
    y = _run(out, np.ones((3, 4), np.float32))["y"]
    assert y.shape == (3, 4)


def test_set_input_shape_names_the_inputs():
    with pytest.raises(EditError, match="no graph input named 'b'"):
        edit.set_input_shape(_chain(), "b", [1, 4])


def test_set_input_shape_that_breaks_the_graph_fails_the_checker():
    with pytest.raises(EditError, match="set_input_shape 'x'"):
        edit.set_input_shape(_chain(), "x", [1, 5])  # Add with a [1,4] bias


def test_add_and_remove_output():
    out = _valid(edit.add_output(_chain(), "r"))
    assert [o.name for o in out.graph.output] == ["y", "r"]
    np.testing.assert_allclose(_run(out)["r"], np.maximum(X, 0))
    back = _valid(edit.remove_output(out, "r"))
    assert [o.name for o in back.graph.output] == ["y"] and len(back.graph.node) == 3


def test_remove_output_prunes_dead_nodes():
    two = edit.add_output(_chain(), "r")
    out = _valid(edit.remove_output(two, "y"))
    assert _ops(out) == ["Relu"] and not out.graph.initializer


def test_output_errors():
    with pytest.raises(EditError, match="'y' is already a graph output"):
        edit.add_output(_chain(), "y")
    with pytest.raises(EditError, match="no tensor named 'q'"):
        edit.add_output(_chain(), "q")
    with pytest.raises(EditError, match="only output"):
        edit.remove_output(_chain(), "y")


def test_replace_initializer_from_array_and_npy(tmp_path):
    out = _valid(edit.replace_initializer(_chain(), "b", np.ones((1, 4), np.float32)))
    np.testing.assert_allclose(_run(out)["y"], (np.maximum(X, 0) + 1) * X)
    path = tmp_path / "b.npy"
    np.save(path, np.full((1, 4), 2.0, np.float32))
    out = _valid(edit.replace_initializer(_chain(), "b", path))
    np.testing.assert_allclose(_run(out)["y"], (np.maximum(X, 0) + 2) * X)


def test_replace_initializer_checks_dtype_and_shape():
    with pytest.raises(EditError, match="is float32 and the new value is float64"):
        edit.replace_initializer(_chain(), "b", np.ones((1, 4), np.float64))
    with pytest.raises(EditError, match=r"shape \[1, 4\] and the new value \[4\]"):
        edit.replace_initializer(_chain(), "b", np.ones(4, np.float32))
    out = edit.replace_initializer(_chain(), "b", np.ones(4, np.float32), allow_shape_change=True)
    assert list(out.graph.initializer[0].dims) == [4]
    with pytest.raises(EditError, match="no initializer or Constant named 'r'") as info:
        edit.replace_initializer(_chain(), "r", np.ones(1, np.float32))
    assert "computed at run time" in (info.value.hint or "")


def test_replace_initializer_bad_npy(tmp_path):
    with pytest.raises(EditError, match="no such .npy file"):
        edit.replace_initializer(_chain(), "b", tmp_path / "missing.npy")


def test_unnamed_nodes_keep_their_display_names_across_edits():
    model = _chain()
    for node in model.graph.node:
        node.name = ""
    out = edit.apply_edits(
        model,
        [
            {"op": "insert_node_before", "node": "Relu_0", "op_type": "Neg"},
            {"op": "remove_node", "node": "Add_1"},
        ],
    )
    assert _ops(_valid(out)) == ["Neg", "Relu", "Mul"]


def test_apply_edits_runs_a_list():
    ops = [
        {"op": "replace_op", "node": "relu", "op_type": "LeakyRelu", "attributes": {"alpha": 0.5}},
        {"op": "set_attributes", "node": "relu", "attributes": {"alpha": 0.25}},
        {
            "op": "insert_node_after",
            "node": "mul",
            "op_type": "Mul",
            "inputs": [{"value": [2, 2, 2, 2], "dtype": "float32"}],
        },
        {"op": "replace_initializer", "name": "b", "value": [[1, 1, 1, 1]]},
        {"op": "rename_tensor", "tensor": "y", "new_name": "out"},
        {"op": "add_output", "tensor": "r"},
        {"op": "remove_output", "output": "r"},
        {"op": "set_input_shape", "input": "x", "shape": [1, 4]},
        {"op": "bypass_node", "node": "add", "input": 0},
        {"op": "remove_node", "node": "relu"},
    ]
    out = _valid(edit.apply_edits(_chain(), ops))
    assert [o.name for o in out.graph.output] == ["out"]
    np.testing.assert_allclose(run_model(out, {"x": X})["out"], 2 * X * X)


@pytest.mark.parametrize(
    ("ops", "message"),
    [
        ([{"op": "frobnicate"}], "edit #1: unknown or missing op 'frobnicate'"),
        ([{"node": "relu"}], "edit #1: unknown or missing op None"),
        ([{"op": "remove_node"}], r"edit #1 \(remove_node\): node: Field required"),
        (
            [{"op": "remove_node", "node": "relu", "extra": 1}],
            r"edit #1 \(remove_node\): extra: Extra inputs are not permitted",
        ),
        (
            [
                {"op": "rename_tensor", "tensor": "a", "new_name": "a2"},
                {"op": "remove_node", "node": "zzz"},
            ],
            r"edit #2 \(remove_node\): no node named 'zzz'",
        ),
        ([], "the edit list is empty"),
        ({"op": "remove_node"}, "edits must be a list"),
        (
            [{"op": "replace_initializer", "name": "b"}],
            "give exactly one of npy or value",
        ),
        (
            [
                {
                    "op": "insert_node_before",
                    "node": "relu",
                    "op_type": "Mul",
                    "inputs": [{"value": 1, "dtype": "complex999"}],
                }
            ],
            "unknown dtype 'complex999'",
        ),
    ],
)
def test_apply_edits_errors_name_the_edit(ops, message):
    with pytest.raises(EditError, match=message):
        edit.apply_edits(_chain(), ops)


def test_apply_edits_keeps_the_error_code():
    with pytest.raises(EditError) as info:
        edit.apply_edits(_chain(), [{"op": "remove_node", "node": "zzz"}])
    assert info.value.code == "node_not_found"


# --------------------------------------------------------------------------- CLI


def _invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_cli_edit_writes_the_result(save, tmp_path):
    src = save(_chain(), "chain.onnx")
    before = src.read_bytes()
    ops = tmp_path / "ops.json"
    ops.write_text(json.dumps([{"op": "remove_node", "node": "relu"}]))
    out = tmp_path / "out.onnx"
    result = _invoke("edit", src, "--ops", ops, "-o", out, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["edits"] == 1 and data["nodes_before"] == 3 and data["nodes"] == 2
    assert _ops(load_model(out)) == ["Add", "Mul"]
    assert src.read_bytes() == before


def test_cli_edit_inline_ops(save, tmp_path):
    src = save(_chain(), "chain.onnx")
    out = tmp_path / "out.onnx"
    ops = '[{"op": "rename_tensor", "tensor": "y", "new_name": "z"}]'
    result = _invoke("edit", src, "--ops", ops, "-o", out)
    assert result.exit_code == 0, result.output
    assert [o.name for o in load_model(out).graph.output] == ["z"]


@pytest.mark.parametrize(
    ("ops", "message"),
    [
        ('[{"op": "remove_node", "node": "mul"}]', "2 data inputs"),
        ("[{bad json", "not valid JSON"),
        ('{"op": "remove_node"}', "expected a JSON list"),
        ("missing.json", "no such file"),
    ],
)
def test_cli_edit_errors_exit_2(save, tmp_path, ops, message):
    src = save(_chain(), "chain.onnx")
    out = tmp_path / "out.onnx"
    result = _invoke("edit", src, "--ops", ops, "-o", out, "--json")
    assert result.exit_code == 2
    assert message in json.loads(result.stdout)["error"]["message"]
    assert not out.exists()


def test_cli_edit_refuses_to_overwrite_its_input(save):
    src = save(_chain(), "chain.onnx")
    before = src.read_bytes()
    result = _invoke("edit", src, "--ops", '[{"op": "remove_node", "node": "relu"}]', "-o", src)
    assert result.exit_code == 2
    assert "refusing to overwrite" in result.output
    assert src.read_bytes() == before
