"""fuse-rmsnorm: RMSNorm spelled out by torch.onnx (T5LayerNorm, LlamaRMSNorm, Gemma's RMSNorm)
becomes one RMSNormalization (opset 23), which `transformer-to-4d` then carries onto the MLA's
channel axis.

Each model is built with onnx.helper; every application goes through the engine, so it is
shape-inferred, checked and verified against the original with ONNX Runtime.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, numpy_helper

from surgery.check import check_model
from surgery.model import load_model
from surgery.rules import apply_rule, find_matches
from surgery.rules.fix import fix_model
from tests.architectures import Builder


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def _attr(model: onnx.ModelProto, op: str, name: str):
    node = next(n for n in model.graph.node if n.op_type == op)
    return onnx.helper.get_attribute_value(next(a for a in node.attribute if a.name == name))


def _scale(model: onnx.ModelProto) -> np.ndarray:
    node = next(n for n in model.graph.node if n.op_type == "RMSNormalization")
    return numpy_helper.to_array(
        next(t for t in model.graph.initializer if t.name == node.input[1])
    )


def _exact(result) -> None:
    assert result.verification.passed and result.verification.mode == "exact"
    assert result.verification.worst_max_abs <= 1e-5


def _rms(
    b: Builder,
    x: str,
    c: int,
    square: str = "pow",
    inverse: str = "div_one",
    weight: str | None = "before",
    axes: tuple[int, ...] = (-1,),
    opset: int = 13,
) -> str:
    """One RMSNorm over `axes` of x, the way an exporter spells it.

    square: Pow(x, 2) or Mul(x, x); inverse: Sqrt then Div(1, ·) (T5 at older torch), Sqrt then
    Reciprocal (LLaMA's rsqrt at newer torch), Pow(·, −0.5), or Div(x, Sqrt) (x / rms);
    weight: γ on the left of the Mul (T5), on the right (LLaMA) or none.
    """
    two = b.const(f"{x}_two", np.array(2.0, np.float32))
    sq = b.node("Pow", [x, two], f"{x}_sq") if square == "pow" else b.node("Mul", [x, x], f"{x}_sq")
    if opset >= 18:  # axes as an input (the dynamo exporter's opset)
        axes_in = b.const(f"{x}_axes", np.array(axes, np.int64))
        var = b.node("ReduceMean", [sq, axes_in], f"{x}_var", keepdims=1)
    else:
        var = b.node("ReduceMean", [sq], f"{x}_var", axes=list(axes), keepdims=1)
    ve = b.node("Add", [var, b.const(f"{x}_eps", np.array(1e-6, np.float32))], f"{x}_ve")
    if inverse == "pow_neg_half":
        inv = b.node("Pow", [ve, b.const(f"{x}_mhalf", np.array(-0.5, np.float32))], f"{x}_inv")
        n = b.node("Mul", [x, inv], f"{x}_n")
    else:
        std = b.node("Sqrt", [ve], f"{x}_std")
        if inverse == "div_x":
            n = b.node("Div", [x, std], f"{x}_n")
        else:
            if inverse == "reciprocal":
                inv = b.node("Reciprocal", [std], f"{x}_inv")
            else:
                inv = b.node(
                    "Div", [b.const(f"{x}_one", np.array(1.0, np.float32)), std], f"{x}_inv"
                )
            n = b.node("Mul", [inv, x], f"{x}_n")
    if weight is None:
        return n
    gamma = b.const(f"{x}_g", (1 + b.rng.normal(0, 0.1, c)).astype(np.float32))
    ins = [gamma, n] if weight == "before" else [n, gamma]
    return b.node("Mul", ins, f"{x}_out")


def test_t5_layer_norm_becomes_one_rmsnormalization_at_opset_23() -> None:
    b = Builder()
    y = _rms(b, "x", 8)
    model = load_model(b.model("t5_ln", {"x": [1, 6, 8]}, [y]))
    result = apply_rule(model, "fuse-rmsnorm")
    _exact(result)
    assert _ops(result.model) == ["RMSNormalization"]
    assert max(o.version for o in result.model.opset_import if o.domain == "") == 23
    assert _attr(result.model, "RMSNormalization", "axis") == 2
    assert _attr(result.model, "RMSNormalization", "epsilon") == pytest.approx(1e-6)
    gamma = next(numpy_helper.to_array(t) for t in b.inits if t.name == "x_g")
    np.testing.assert_array_equal(_scale(result.model), gamma)


@pytest.mark.parametrize(
    ("square", "inverse", "weight"),
    [
        ("mul", "reciprocal", "after"),
        ("pow", "pow_neg_half", "before"),
        ("mul", "div_x", "after"),
        ("pow", "reciprocal", None),
    ],
)
def test_spellings_of_the_root_square_and_weight(
    square: str, inverse: str, weight: str | None
) -> None:
    b = Builder()
    y = _rms(b, "x", 12, square, inverse, weight)
    result = apply_rule(
        load_model(b.model("rms", {"x": [1, 5, 12]}, [y], opset=17)), "fuse-rmsnorm"
    )
    _exact(result)
    assert _ops(result.model) == ["RMSNormalization"]
    if weight is None:
        np.testing.assert_array_equal(_scale(result.model), np.ones(12, np.float32))


def _fp16_llama(readers_of_cast: int = 1) -> onnx.ModelProto:
    """LlamaRMSNorm on an fp16 model: Cast to float32, the norm, Cast back, γ (fp16) · it.
    With readers_of_cast=2 the float32 copy of x is also read by a later node."""
    b = Builder()
    xf = b.node("Cast", ["x"], "xf", to=TensorProto.FLOAT)
    n = _rms(b, xf, 8, "pow", "reciprocal", None, opset=18)
    h = b.node("Cast", [n], "n16", to=TensorProto.FLOAT16)
    gamma = b.const("g16", (1 + b.rng.normal(0, 0.1, 8)).astype(np.float16))
    y = b.node("Mul", [gamma, h], "y")
    outputs = [y]
    if readers_of_cast == 2:
        outputs.append(b.node("Relu", [xf], "side"))
    model = b.model("llama16", {"x": [1, 6, 8]}, outputs, opset=18)
    model.graph.input[0].type.tensor_type.elem_type = TensorProto.FLOAT16
    model.graph.output[0].type.tensor_type.elem_type = TensorProto.FLOAT16
    return load_model(model)


def test_hf_fp16_cast_pair_is_part_of_the_op() -> None:
    result = apply_rule(_fp16_llama(), "fuse-rmsnorm")
    _exact(result)
    assert _ops(result.model) == ["RMSNormalization"]
    node = result.model.graph.node[0]
    assert node.input[0] == "x"
    assert _scale(result.model).dtype == np.float16


def test_a_cast_read_elsewhere_stays_and_so_do_the_cast_back_and_weight() -> None:
    """The float32 copy stays as the input; RMSNormalization's output has its input's type,
    so the Cast back to fp16 and the fp16 γ stay after it."""
    result = apply_rule(_fp16_llama(readers_of_cast=2), "fuse-rmsnorm")
    _exact(result)
    assert sorted(_ops(result.model)) == ["Cast", "Cast", "Mul", "RMSNormalization", "Relu"]
    node = next(n for n in result.model.graph.node if n.op_type == "RMSNormalization")
    assert node.input[0] == "xf"
    np.testing.assert_array_equal(_scale(result.model), np.ones(8, np.float32))


def test_gemma_weight_in_float32_then_cast_back_keeps_the_last_cast() -> None:
    """Gemma: output = norm(x.float()) · (1 + w); output.type_as(x) — the Cast is after γ."""
    b = Builder()
    xf = b.node("Cast", ["x"], "xf", to=TensorProto.FLOAT)
    n = _rms(b, xf, 8, "pow", "div_one", "after", opset=18)
    b.node("Cast", [n], "y", to=TensorProto.FLOAT16)
    model = b.model("gemma16", {"x": [1, 6, 8]}, ["y"], opset=18)
    model.graph.input[0].type.tensor_type.elem_type = TensorProto.FLOAT16
    model.graph.output[0].type.tensor_type.elem_type = TensorProto.FLOAT16
    result = apply_rule(load_model(model), "fuse-rmsnorm")
    _exact(result)
    assert _ops(result.model) == ["Cast", "RMSNormalization", "Cast"]
    assert _scale(result.model).dtype == np.float32


def test_channels_first_rmsnorm_runs_between_transposes_to_the_last_axis() -> None:
    b = Builder()
    n = _rms(b, "x", 6, weight=None, axes=(1,))
    y = b.node("Mul", [n, b.weight("g", 6, 1, 1)], "y")
    result = apply_rule(load_model(b.model("cf", {"x": [1, 6, 4, 5]}, [y])), "fuse-rmsnorm")
    _exact(result)
    assert _ops(result.model) == ["Transpose", "RMSNormalization", "Transpose"]
    assert _attr(result.model, "Transpose", "perm") == [0, 2, 3, 1]
    assert _attr(result.model, "RMSNormalization", "axis") == 3


def test_an_intermediate_read_elsewhere_keeps_the_decomposition() -> None:
    b = Builder()
    y = _rms(b, "x", 8)
    model = b.model("t5_ln", {"x": [1, 6, 8]}, [y, "x_var"])
    assert find_matches(load_model(model), "fuse-rmsnorm") == []


def test_a_layernorm_is_not_taken_for_an_rmsnorm() -> None:
    b = Builder()
    b.layer_norm("ln", "x", 8, eps=1e-5)
    model = load_model(b.model("ln", {"x": [1, 6, 8]}, ["ln_out"]))
    assert find_matches(model, "fuse-rmsnorm") == []


def test_a_scale_varying_along_the_tokens_stays_a_separate_mul() -> None:
    b = Builder()
    n = _rms(b, "x", 8, weight=None)
    y = b.node("Mul", [n, b.weight("per_token", 6, 1)], "y")
    result = apply_rule(load_model(b.model("tok", {"x": [1, 6, 8]}, [y])), "fuse-rmsnorm")
    _exact(result)
    assert _ops(result.model) == ["RMSNormalization", "Mul"]


def test_not_offered_where_the_mla_runs_no_rmsnormalization(tmp_path: Path) -> None:
    profile = tmp_path / "no_rms.yaml"
    profile.write_text(
        "name: no_rms\nextends: mlsoc\ntitle: mlsoc without RMSNormalization\n"
        "remove_ops: [RMSNormalization]\n"
    )
    b = Builder()
    y = _rms(b, "x", 8)
    model = load_model(b.model("t5_ln", {"x": [1, 6, 8]}, [y]))
    assert find_matches(model, "fuse-rmsnorm", str(profile)) == []


def test_fix_moves_a_t5_block_onto_the_mla_in_one_segment() -> None:
    """Token embedding on the host, then RMSNorm → attention-free FFN with a residual: the
    spelled-out RMSNorm's broadcast Mul by 1/rms cannot be lifted, the fused op can."""
    b, c = Builder(), 16
    x = b.node("Gather", [b.weight("emb", 40, c), "ids"], "tok", axis=0)
    h = _rms(b, x, c)
    h = b.node("Relu", [b.node("MatMul", [h, b.weight("wi", c, 2 * c)], "wi_mm")], "act")
    x = b.node("Add", [x, b.node("MatMul", [h, b.weight("wo", 2 * c, c)], "wo_mm")], "res")
    h = _rms(b, x, c, "mul", "reciprocal", "after")
    y = b.node("MatMul", [h, b.weight("head", c, c)], "y")
    model = b.model("t5_block", {"ids": [1, 10]}, [y], types={"ids": TensorProto.INT64})
    result = fix_model(load_model(model), "mlsoc")
    steps = [s["rule"] for s in result.steps]
    assert "fuse-rmsnorm" in steps and "transformer-to-4d" in steps
    assert result.single_elf and result.coverage_after.mla_mac_fraction == 1.0
    report = check_model(result.model, "mlsoc", suggest=False)
    assert report.mla_segments == 1
    assert "RMSNormalization" in _ops(result.model)
