"""Every op a target profile places on the MLA should have an MLA lowering: where one is
missing, the compiler runs the node on a host processor and the archive holds more `.elf`
files than `surgery check` counted."""

from __future__ import annotations

import re

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler.archive import read_archive
from compiler.compile import compile_model
from compiler.quantize import quantize_model
from compiler.runtime.compare import reference_outputs
from compiler.runtime.ops import LOWERINGS
from compiler.runtime.ops.matmul import einsum_plan
from compiler.runtime.pipeline import run_archive
from compiler.runtime.qparams import NotLowerable
from surgery.check import check_model
from surgery.targets import resolve_target

KNOWN_GAPS = {
    # Rewritten before lowering: the quantizer turns an n-ary Sum into Adds and folds a
    # BatchNormalization into the conv before it, or else into a per-channel Mul and Add.
    "BatchNormalization",
    "Sum",
}


@pytest.mark.parametrize("target", ["mlsoc", "modalix", "rk3588"])
def test_mla_ops_without_a_lowering_are_the_known_gaps(target: str) -> None:
    profile = resolve_target(target)
    missing = {op for op in profile.ops if profile.supports(op, "MLA") and op not in LOWERINGS}
    assert missing <= KNOWN_GAPS, f"new MLA ops without a lowering: {sorted(missing - KNOWN_GAPS)}"


def _conv_op_conv(op: str, operand: np.ndarray) -> onnx.ModelProto:
    """Conv → op(·, constant operand) → Conv."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.5, (4, 4, 1, 1)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.normal(0, 0.5, (4, 4, 1, 1)).astype(np.float32), "w2"),
        numpy_helper.from_array(operand.astype(np.float32), "c"),
    ]
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w1"], ["a"]),
            helper.make_node(op, ["a", "c"], ["p"]),
            helper.make_node("Conv", ["p", "w2"], ["y"]),
        ],
        "conv_op_conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def _compile_and_run(model: onnx.ModelProto, tmp_path, target: str = "mlsoc"):
    """(number of .elf files, outputs bit-exact with the reference), calibrated and run on
    seeded normal samples of the model's input "x"."""
    result, exact = _compile_and_compare(model, tmp_path, target)
    return len(result.elf_files), exact


def _compile_and_compare(model: onnx.ModelProto, tmp_path, target: str = "mlsoc"):
    """(the CompileResult, whether output "y" is bit-exact with the reference) for `target`."""
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    rng = np.random.default_rng(1)
    samples = [{"x": rng.normal(0, 1, shape).astype(np.float32)} for _ in range(4)]
    qdq = quantize_model(model, samples, target=target).model
    result = compile_model(qdq, tmp_path, target=target, model_name="op")
    archive = read_archive(result.archive)
    outputs, _ = run_archive(archive, samples[0])
    expected = reference_outputs(archive.manifest, qdq, samples[0])
    exact = outputs["y"].dtype == expected["y"].dtype and np.array_equal(
        outputs["y"], expected["y"]
    )
    return result, exact


def _runs_on_the_mla(model: onnx.ModelProto, tmp_path, target: str) -> None:
    """check puts every node on the MLA in one segment, compile writes one .elf and runs no
    node on a host processor (no `onnx` stage), and the output is bit-exact with the reference
    executor."""
    report = check_model(model, target=target)
    assert {p.processor for p in report.placements} == {"MLA"}, report.placements
    assert report.mla_segments == 1
    result, exact = _compile_and_compare(model, tmp_path, target)
    assert [s["kernel"] for s in result.stages if s["kernel"] in ("mla", "onnx")] == ["mla"]
    assert len(result.elf_files) == 1
    assert exact


@pytest.mark.parametrize("exponent", [2.0, 3.0])
def test_pow_by_a_constant_stays_in_its_segment_and_runs_bit_exact(exponent, tmp_path) -> None:
    """A YOLOv5 decode squares its sigmoid outputs so."""
    model = _conv_op_conv("Pow", np.array(exponent))
    assert check_model(model).mla_segments == 1
    assert _compile_and_run(model, tmp_path) == (1, True)


def test_prelu_with_one_slope_stays_in_its_segment_and_runs_bit_exact(tmp_path) -> None:
    """PyTorch's default nn.PReLU() has one slope (stored here once per channel)."""
    model = _conv_op_conv("PRelu", np.full((4, 1, 1), 0.25))
    assert check_model(model).mla_segments == 1
    assert _compile_and_run(model, tmp_path) == (1, True)


def test_prelu_with_a_slope_per_channel_uses_one_table_per_channel(tmp_path) -> None:
    """Per-channel nn.PReLU(C), exported with a (C, 1, 1) slope."""
    model = _conv_op_conv("PRelu", np.array([0.1, -0.2, 0.3, 0.9]).reshape(4, 1, 1))
    assert check_model(model).mla_segments == 1
    assert _compile_and_run(model, tmp_path) == (1, True)


def test_inference_dropout_is_a_move_inside_its_segment(tmp_path) -> None:
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.5, (4, 4, 1, 1)).astype(np.float32), name)
        for name in ("w1", "w2")
    ]
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w1"], ["a"]),
            helper.make_node("Dropout", ["a"], ["p"], ratio=0.3),
            helper.make_node("Conv", ["p", "w2"], ["y"]),
        ],
        "conv_dropout_conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    assert check_model(model).mla_segments == 1
    assert _compile_and_run(model, tmp_path) == (1, True)


def test_a_batchnorm_after_a_residual_add_stays_in_its_segment(tmp_path) -> None:
    """Pre-activation ResNet / DenseNet: BatchNormalization with no conv before it."""
    rng = np.random.default_rng(0)
    stats = [
        numpy_helper.from_array(value.astype(np.float32), name)
        for name, value in (
            ("gamma", rng.uniform(0.5, 2, 4)),
            ("beta", rng.normal(0, 1, 4)),
            ("mean", rng.normal(0, 1, 4)),
            ("var", rng.uniform(0.5, 2, 4)),
        )
    ]
    weights = [
        numpy_helper.from_array(rng.normal(0, 0.5, (4, 4, 1, 1)).astype(np.float32), name)
        for name in ("w1", "w2")
    ]
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w1"], ["a"]),
            helper.make_node("Add", ["a", "x"], ["residual"]),
            helper.make_node(
                "BatchNormalization", ["residual", "gamma", "beta", "mean", "var"], ["bn"]
            ),
            helper.make_node("Relu", ["bn"], ["p"]),
            helper.make_node("Conv", ["p", "w2"], ["y"]),
        ],
        "preactivation",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        [*stats, *weights],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    assert check_model(model).mla_segments == 1
    assert _compile_and_run(model, tmp_path) == (1, True)


@pytest.mark.parametrize("equation", ["bhid,bhjd->bhij", "bhij,bhjd->bhdi"])
def test_einsum_as_a_batched_matmul_stays_in_its_segment(equation: str, tmp_path) -> None:
    """Attention written with einsum: two convs make (batch, heads, tokens, dims) operands."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.5, (2, 2, 1, 1)).astype(np.float32), name)
        for name in ("wq", "wk", "wo")
    ]
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "wq"], ["q"]),
            helper.make_node("Conv", ["x", "wk"], ["k"]),
            helper.make_node("Einsum", ["q", "k"], ["att"], equation=equation),
            helper.make_node("Conv", ["att", "wo"], ["y"]),
        ],
        "einsum_attention",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    assert check_model(model).mla_segments == 1
    assert _compile_and_run(model, tmp_path) == (1, True)


@pytest.mark.parametrize(
    ("equation", "views"),
    [
        # (A perm, A groups), (B perm, B groups), (output perm, output groups)
        ("bhid,bhjd->bhij", ((0, 1, 2, 3), (1, 1, 1, 1), (0, 1, 3, 2), (1, 1, 1, 1))),
        ("ik,kj->ji", ((0, 1), (1, 1), (0, 1), (1, 1))),
        ("bij,jk->bik", ((0, 1, 2), (1, 1, 1), (0, 1), (0, 1, 1))),  # B broadcasts over b
        ("bnhd,hdc->bnc", ((0, 1, 2, 3), (1, 1, 2), (0, 1, 2), (0, 2, 1))),  # K = h·d
    ],
)
def test_einsum_plans(equation: str, views) -> None:
    plan = einsum_plan(equation)
    a_perm, a_groups, b_perm, b_groups = views
    assert (plan.a.perm, plan.a.groups, plan.b.perm, plan.b.groups) == (
        a_perm,
        a_groups,
        b_perm,
        b_groups,
    )


@pytest.mark.parametrize(
    ("equation", "reason"),
    [
        ("ii,ij->ij", "repeats an index"),
        ("ij,jk->ik->x", "not an equation"),
        ("bhid,bhjd->bhj", "sums 'i' within one operand"),
        ("...ij,...jk->...ik", "ellipsis"),
        ("hdn,hdc->nc", None),  # adjacent contracted indices in the same order: accepted
        ("dhn,hdc->nc", "not adjacent and in A's order in the run-time B"),
        ("hnd,hdc->nc", "not adjacent in A"),
    ],
)
def test_einsum_plan_refusals(equation: str, reason: str | None) -> None:
    if reason is None:
        assert einsum_plan(equation) is not None
        return
    with pytest.raises(NotLowerable, match=re.escape(reason)):
        einsum_plan(equation)


def _two_convs_op_conv(op: str, constant: np.ndarray | None) -> onnx.ModelProto:
    """Conv, Conv → op(a, b[, constant]) → Conv: operands at three different scales."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.5, (4, 4, 1, 1)).astype(np.float32), name)
        for name in ("w1", "w2", "w3")
    ]
    operands = ["a", "b"]
    if constant is not None:
        inits.append(numpy_helper.from_array(constant.astype(np.float32), "c"))
        operands.append("c")
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w1"], ["a"]),
            helper.make_node("Conv", ["x", "w2"], ["b"]),
            helper.make_node(op, operands, ["p"]),
            helper.make_node("Conv", ["p", "w3"], ["y"]),
        ],
        "two_convs_op_conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def _conv_around(
    op: str, constants: dict[str, np.ndarray], *, weight_std: float = 0.5, **attributes
) -> onnx.ModelProto:
    """Conv → op(a, *constants) → Conv on (1, 4, 8, 8)."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.normal(0, weight_std, (4, 4, 1, 1)).astype(np.float32), name)
        for name in ("w1", "w2")
    ]
    inits += [numpy_helper.from_array(value, name) for name, value in constants.items()]
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w1"], ["a"]),
            helper.make_node(op, ["a", *constants], ["p"], **attributes),
            helper.make_node("Conv", ["p", "w2"], ["y"]),
        ],
        f"conv_{op.lower()}_conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def _conv_instance_norm_conv() -> onnx.ModelProto:
    gamma = np.array([1.5, -0.5, 0.8, 0.0], np.float32)
    beta = np.array([0.1, -0.3, 0.0, 0.4], np.float32)
    return _conv_around("InstanceNormalization", {"gamma": gamma, "beta": beta})


def _conv_lrn_conv(**attributes) -> onnx.ModelProto:
    """Large activations (weights of std 2) so that the squares matter against the bias."""
    return _conv_around("LRN", {}, weight_std=2.0, **attributes)


def _conv_cumsum_conv(axis: int, **attributes) -> onnx.ModelProto:
    return _conv_around("CumSum", {"axis": np.array(axis, np.int64)}, **attributes)


def _conv_argmax(**attributes) -> onnx.ModelProto:
    """Conv → ArgMax: a segmentation head's class map (int64 indices) as the graph output."""
    rng = np.random.default_rng(0)
    weight = rng.normal(0, 0.5, (4, 4, 1, 1)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w"], ["a"]),
            helper.make_node("ArgMax", ["a"], ["y"], **attributes),
        ],
        "conv_argmax",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.INT64, None)],
        [numpy_helper.from_array(weight, "w")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


@pytest.mark.parametrize("op", ["Max", "Min"])
def test_max_min_with_a_constant_stay_in_their_segment(op: str, tmp_path) -> None:
    """Conv → Max(a, 0.1) → Conv (a ReLU with a floor, written as Max) on rk3588."""
    _runs_on_the_mla(_conv_op_conv(op, np.array(0.1)), tmp_path, "rk3588")


@pytest.mark.parametrize("op", ["Max", "Min"])
@pytest.mark.parametrize("constant", [None, np.full((4, 1, 1), -0.2)])
def test_max_min_of_several_tensors_stay_in_their_segment(op: str, constant, tmp_path) -> None:
    """Two or three operands with their own scales, folded pairwise in one layer."""
    _runs_on_the_mla(_two_convs_op_conv(op, constant), tmp_path, "rk3588")


@pytest.mark.parametrize("target", ["mlsoc", "modalix", "rk3588"])
def test_instance_normalization_stays_in_its_segment(target: str, tmp_path) -> None:
    _runs_on_the_mla(_conv_instance_norm_conv(), tmp_path, target)


@pytest.mark.parametrize(
    ("target", "attributes"),
    [
        ("mlsoc", {"axis": 1}),
        ("mlsoc", {"axis": 1, "select_last_index": 1}),
        ("modalix", {"axis": 1}),
        ("rk3588", {"axis": 2}),
        ("rk3588", {"axis": -1, "select_last_index": 1}),
    ],
)
def test_argmax_runs_on_the_mla_and_writes_int64_indices(target: str, attributes, tmp_path):
    """keepdims=0 gives a rank-3 map, which both targets keep off the MLA (check agrees)."""
    _runs_on_the_mla(_conv_argmax(**attributes), tmp_path, target)


@pytest.mark.parametrize("target", ["mlsoc", "modalix"])
@pytest.mark.parametrize(
    "attributes",
    [
        {"size": 3, "alpha": 1e-2, "beta": 0.75, "bias": 1.0},
        {"size": 5, "alpha": 1e-4, "beta": 0.75, "bias": 2.0},  # AlexNet
    ],
)
def test_lrn_stays_in_its_segment(target: str, attributes: dict, tmp_path) -> None:
    """AlexNet / GoogLeNet normalise their early feature maps across channels (int8)."""
    _runs_on_the_mla(_conv_lrn_conv(**attributes), tmp_path, target)


def _conv_quick_gelu_conv() -> onnx.ModelProto:
    """Conv → QuickGelu (ONNX Runtime's contrib op, as its transformer optimizer fuses CLIP's
    x·sigmoid(1.702x)) → Conv, the QuickGelu output typed as such exports carry it."""
    model = _conv_around("QuickGelu", {}, domain="com.microsoft", alpha=1.702)
    model.graph.value_info.append(
        helper.make_tensor_value_info("p", TensorProto.FLOAT, [1, 4, 8, 8])
    )
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model


@pytest.mark.parametrize("target", ["mlsoc", "modalix"])
def test_quick_gelu_stays_in_its_segment(target: str, tmp_path) -> None:
    _runs_on_the_mla(_conv_quick_gelu_conv(), tmp_path, target)


def _conv_untyped_quick_gelu_conv() -> onnx.ModelProto:
    """Conv → QuickGelu → Conv with no value_info for the QuickGelu output: onnx's shape
    inference has no schema for the contrib op, so only surgery's inference can type it."""
    model = _conv_around("QuickGelu", {}, domain="com.microsoft", alpha=1.702)
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model


def test_untyped_quick_gelu_output_takes_its_input_type_in_check() -> None:
    report = check_model(_conv_untyped_quick_gelu_conv())
    reasons = [r.code for p in report.placements for r in p.reasons]
    assert report.mla_segments == 1 and "rank_unknown" not in reasons, report.placements


def test_untyped_quick_gelu_compiles_to_one_elf_bit_exact(tmp_path) -> None:
    assert _compile_and_run(_conv_untyped_quick_gelu_conv(), tmp_path) == (1, True)


def _conv_grid_sample_conv(**attributes) -> onnx.ModelProto:
    """A flow-field warp: Conv → GridSample(a, tanh(Conv(x)) as an (N, H, W, 2) grid) → Conv."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.5, shape).astype(np.float32), name)
        for name, shape in (("w1", (4, 4, 1, 1)), ("wg", (2, 4, 1, 1)), ("w2", (4, 4, 1, 1)))
    ]
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w1"], ["a"]),
            helper.make_node("Conv", ["x", "wg"], ["flow"]),
            helper.make_node("Transpose", ["flow"], ["flow_hwc"], perm=[0, 2, 3, 1]),
            helper.make_node("Tanh", ["flow_hwc"], ["grid"]),
            helper.make_node("GridSample", ["a", "grid"], ["p"], **attributes),
            helper.make_node("Conv", ["p", "w2"], ["y"]),
        ],
        "conv_grid_sample_conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)])


@pytest.mark.parametrize(
    "attributes",
    [
        {},
        {"padding_mode": "border", "align_corners": 1},
        {"padding_mode": "reflection"},
        {"mode": "bilinear", "padding_mode": "zeros", "align_corners": 1},
    ],
)
def test_grid_sample_runs_on_the_bf16_unit_inside_its_segment(attributes, tmp_path) -> None:
    """Modalix runs GridSample on the MLA in bf16 only: the quantizer's bf16 Cast pairs around
    it become one GRID_SAMPLE_BF16."""
    _runs_on_the_mla(_conv_grid_sample_conv(**attributes), tmp_path, "modalix")


@pytest.mark.parametrize("target", ["mlsoc", "modalix"])
@pytest.mark.parametrize(
    ("axis", "attributes"), [(3, {}), (1, {"exclusive": 1}), (-2, {"exclusive": 1})]
)
def test_cumsum_is_a_matmul_inside_its_segment(target: str, axis: int, attributes, tmp_path):
    _runs_on_the_mla(_conv_cumsum_conv(axis, **attributes), tmp_path, target)


@pytest.mark.parametrize(
    ("model", "target"),
    [
        (_two_convs_op_conv("Max", np.full((4, 1, 1), -0.2)), "rk3588"),
        (_conv_instance_norm_conv(), "mlsoc"),
        (_conv_argmax(axis=1, select_last_index=1), "mlsoc"),
        (_conv_lrn_conv(size=3), "mlsoc"),
        (_conv_cumsum_conv(2), "mlsoc"),
        (_conv_grid_sample_conv(padding_mode="border"), "modalix"),
    ],
    ids=["max", "instance_norm", "argmax", "lrn", "cumsum", "grid_sample"],
)
def test_a_batch_of_two_runs_every_frame_bit_exact(model, target: str, tmp_path) -> None:
    """Batched emission (one instruction over both frames where axis 0 allows it)."""
    rng = np.random.default_rng(1)
    samples = [{"x": rng.normal(0, 1, (1, 4, 8, 8)).astype(np.float32)} for _ in range(4)]
    qdq = quantize_model(model, samples, target=target).model
    result = compile_model(qdq, tmp_path, target=target, batch_size=2, model_name="op")
    assert (result.actual_batch_size, len(result.elf_files)) == (2, 1)
    archive = read_archive(result.archive)
    outputs, _ = run_archive(archive, {"x": np.concatenate([s["x"] for s in samples[:2]])})
    expected = [reference_outputs(archive.manifest, qdq, s)["y"] for s in samples[:2]]
    np.testing.assert_array_equal(outputs["y"], np.concatenate(expected))
