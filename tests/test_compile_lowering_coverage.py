"""Every op a target profile places on the MLA should have an MLA lowering: where one is
missing, the compiler runs the node on a host processor and the archive holds more `.elf`
files than `surgery check` counted."""

from __future__ import annotations

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
from surgery.check import check_model
from surgery.targets import resolve_target

KNOWN_GAPS = {
    # Rewritten before lowering: the quantizer turns an n-ary Sum into Adds and folds a
    # BatchNormalization into the conv before it, or else into a per-channel Mul and Add.
    "BatchNormalization",
    "Sum",
    # Not lowered yet (each such node splits its segment; compile notes which nodes did).
    "ArgMax",
    "CumSum",
    "GridSample",
    "InstanceNormalization",
    "LRN",
    "Max",
    "Min",
    "QuickGelu",
    "RMSNormalization",
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


def _compile_and_run(model: onnx.ModelProto, tmp_path):
    """(number of .elf files, outputs bit-exact with the reference), calibrated and run on
    seeded normal samples of the model's input "x"."""
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    rng = np.random.default_rng(1)
    samples = [{"x": rng.normal(0, 1, shape).astype(np.float32)} for _ in range(4)]
    qdq = quantize_model(model, samples, target="mlsoc").model
    result = compile_model(qdq, tmp_path, model_name="op")
    archive = read_archive(result.archive)
    outputs, _ = run_archive(archive, samples[0])
    expected = reference_outputs(archive.manifest, qdq, samples[0])
    return len(result.elf_files), np.array_equal(outputs["y"], expected["y"])


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
    ("equation", "plan"),
    [
        ("bhid,bhjd->bhij", ((0, 1, 2, 3), (0, 1, 3, 2), (0, 1, 2, 3))),
        ("ik,kj->ji", ((0, 1), (0, 1), (1, 0))),
        ("bij,bjk->bik", ((0, 1, 2), (0, 1, 2), (0, 1, 2))),
        ("bij,jk->bik", None),  # a batch index missing from B
        ("ii,ij->ij", None),  # a repeated index
        ("ij,jk->ik->x", None),  # not an equation
        ("bhid,bhjd->bhj", None),  # a row index summed away
    ],
)
def test_einsum_plans(equation: str, plan) -> None:
    found = einsum_plan(equation)
    assert (found.a, found.b, found.output) == plan if plan else found is None
