"""fuse-layernorm: LayerNorm spelled out by torch.onnx (opset ≤ 16) and paddle2onnx becomes one
LayerNormalization, which `transformer-to-4d` then carries onto the MLA's channel axis.

Each model is built with onnx.helper (tests/architectures.Builder writes the exporters' node
pattern); every application goes through the engine, so it is shape-inferred, checked and
verified against the original with ONNX Runtime.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from surgery.model import load_model
from surgery.rules import apply_rule, find_matches
from surgery.rules.fix import fix_model
from tests.architectures import Builder


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def _attr(model: onnx.ModelProto, op: str, name: str):
    node = next(n for n in model.graph.node if n.op_type == op)
    return onnx.helper.get_attribute_value(next(a for a in node.attribute if a.name == name))


def _initializer(model: onnx.ModelProto, node_input: int) -> np.ndarray:
    node = next(n for n in model.graph.node if n.op_type == "LayerNormalization")
    init = next(t for t in model.graph.initializer if t.name == node.input[node_input])
    return numpy_helper.to_array(init)


def _exact(result) -> None:
    assert result.verification.passed and result.verification.mode == "exact"
    assert result.verification.worst_max_abs <= 1e-5


def _torch_layer_norm(opset: int = 13) -> tuple[onnx.ModelProto, Builder]:
    b = Builder()
    b.layer_norm("ln", "x", 8, eps=1e-5)
    return load_model(b.model("ln", {"x": [1, 6, 8]}, ["ln_out"], opset=opset)), b


def test_torch_export_becomes_one_layernormalization_at_opset_17() -> None:
    model, b = _torch_layer_norm()
    result = apply_rule(model, "fuse-layernorm")
    _exact(result)
    assert _ops(result.model) == ["LayerNormalization"]
    assert max(o.version for o in result.model.opset_import if o.domain == "") == 17
    assert _attr(result.model, "LayerNormalization", "axis") == 2
    assert _attr(result.model, "LayerNormalization", "epsilon") == pytest.approx(1e-5)
    gamma = next(numpy_helper.to_array(t) for t in b.inits if t.name == "ln_g")
    np.testing.assert_array_equal(_initializer(result.model, 1), gamma)


def _bare_layer_norm(square: str, root: str) -> onnx.ModelProto:
    """No γ/β; the square as Pow 2 or x·x, the root as Sqrt or Pow 0.5."""
    b = Builder()
    mean = b.node("ReduceMean", ["x"], "mean", axes=[-1], keepdims=1)
    d = b.node("Sub", ["x", mean], "d")
    two = b.const("two", np.array(2.0, np.float32))
    sq = b.node("Pow", [d, two], "sq") if square == "pow" else b.node("Mul", [d, d], "sq")
    var = b.node("ReduceMean", [sq], "var", axes=[-1], keepdims=1)
    ve = b.node("Add", [var, b.const("eps", np.array(1e-6, np.float32))], "ve")
    half = b.const("half", np.array(0.5, np.float32))
    std = b.node("Sqrt", [ve], "std") if root == "sqrt" else b.node("Pow", [ve, half], "std")
    b.node("Div", [d, std], "y")
    return load_model(b.model("bare", {"x": [1, 5, 12]}, ["y"]))


@pytest.mark.parametrize(("square", "root"), [("mul", "sqrt"), ("pow", "pow")])
def test_variants_without_affine_get_unit_scale_and_zero_bias(square: str, root: str) -> None:
    result = apply_rule(_bare_layer_norm(square, root), "fuse-layernorm")
    _exact(result)
    assert _ops(result.model) == ["LayerNormalization"]
    np.testing.assert_array_equal(_initializer(result.model, 1), np.ones(12, np.float32))
    np.testing.assert_array_equal(_initializer(result.model, 2), np.zeros(12, np.float32))


def _channels_first_layer_norm() -> onnx.ModelProto:
    """ConvNeXt's hand-written LayerNorm over the channels of NCHW (x − u computed twice)."""
    b, c = Builder(), 6
    u = b.node("ReduceMean", ["x"], "u", axes=[1], keepdims=1)
    two = b.const("two", np.array(2.0, np.float32))
    s = b.node(
        "ReduceMean",
        [b.node("Pow", [b.node("Sub", ["x", u], "d1"), two], "sq")],
        "s",
        axes=[1],
        keepdims=1,
    )
    std = b.node(
        "Sqrt", [b.node("Add", [s, b.const("eps", np.array(1e-6, np.float32))], "se")], "std"
    )
    n = b.node("Div", [b.node("Sub", ["x", u], "d2"), std], "n")
    n = b.node("Mul", [b.weight("gamma", c, 1, 1), n], "gx")
    b.node("Add", [n, b.weight("beta", c, 1, 1)], "y")
    return load_model(b.model("cf_ln", {"x": [1, c, 4, 5]}, ["y"], opset=13))


def test_channels_first_layernorm_runs_between_transposes_to_the_last_axis() -> None:
    result = apply_rule(_channels_first_layer_norm(), "fuse-layernorm")
    _exact(result)
    assert _ops(result.model) == ["Transpose", "LayerNormalization", "Transpose"]
    assert _attr(result.model, "Transpose", "perm") == [0, 2, 3, 1]
    assert _attr(result.model, "LayerNormalization", "axis") == 3


def test_an_intermediate_read_elsewhere_keeps_the_decomposition() -> None:
    model, _ = _torch_layer_norm()
    model.graph.output.append(onnx.helper.make_empty_tensor_value_info("ln_var"))
    assert find_matches(load_model(model), "fuse-layernorm") == []


def test_a_scale_varying_along_the_tokens_stays_a_separate_mul() -> None:
    b = Builder()
    mean = b.node("ReduceMean", ["x"], "mean", axes=[-1], keepdims=1)
    d = b.node("Sub", ["x", mean], "d")
    var = b.node("ReduceMean", [b.node("Mul", [d, d], "sq")], "var", axes=[-1], keepdims=1)
    std = b.node("Sqrt", [b.node("Add", [var, b.const("eps", np.float32(1e-6))], "ve")], "std")
    b.node("Mul", [b.node("Div", [d, std], "n"), b.weight("per_token", 6, 1)], "y")
    result = apply_rule(load_model(b.model("tok", {"x": [1, 6, 8]}, ["y"])), "fuse-layernorm")
    _exact(result)
    assert _ops(result.model) == ["LayerNormalization", "Mul"]


def test_not_offered_where_the_mla_runs_no_layernormalization(tmp_path: Path) -> None:
    profile = tmp_path / "no_ln.yaml"
    profile.write_text(
        "name: no_ln\nextends: mlsoc\ntitle: mlsoc without LayerNormalization\n"
        "remove_ops: [LayerNormalization]\n"
    )
    model, _ = _torch_layer_norm()
    assert find_matches(model, "fuse-layernorm", str(profile)) == []


def test_fix_moves_an_opset13_transformer_block_onto_the_mla() -> None:
    b, c = Builder(), 16
    x = b.conv("stem", "x", 3, c, stride=2)
    x = b.node("Reshape", [x, b.const("flat", np.array([1, c, -1]))], "flat_map")
    x = b.node("Transpose", [x], "tokens", perm=[0, 2, 1])
    h = b.gelu("gelu", b.linear("fc1", b.layer_norm("ln", x, c), c, 2 * c))
    b.node("Add", [x, b.linear("fc2", h, 2 * c, c)], "y")
    model = load_model(b.model("block", {"x": [1, 3, 8, 8]}, ["y"], opset=13))
    result = fix_model(model, "mlsoc")
    assert "fuse-layernorm" in [s["rule"] for s in result.steps]
    assert result.coverage_before.mla_mac_fraction < 0.5
    assert result.single_elf and result.coverage_after.mla_mac_fraction == 1.0
    assert [b.op_type for b in result.coverage_after.blockers] == ["Reshape"]  # output, host
