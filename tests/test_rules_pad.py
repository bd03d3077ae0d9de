"""pad-to-slices and expand-to-concat: a reflect/edge Pad and an Expand, which the MLA
rejects, become Slices and Concats it runs as data movement, exactly."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler.compile import compile_model
from compiler.quantize import quantize_model
from surgery.check import check_model
from surgery.model import load_model
from surgery.rules.engine import RuleNotApplicableError, apply_rule
from surgery.verify import make_inputs
from tests.lower_support import run_and_compare


def _conv_pad_conv(mode: str, pads: list[int], value: float | None = None) -> onnx.ModelProto:
    """Conv [1, 4, 6, 5] → Pad(mode, pads) → Conv, so the Pad sits between two MLA regions."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.5, (4, 4, 1, 1)).astype(np.float32), "w1"),
        numpy_helper.from_array(
            rng.normal(0, 0.5, (4, 4 + pads[1] + pads[5], 1, 1)).astype(np.float32), "w2"
        ),
        numpy_helper.from_array(np.array(pads, np.int64), "pads"),
    ]
    pad_inputs = ["a", "pads"]
    if value is not None:
        inits.append(numpy_helper.from_array(np.array(value, np.float32), "value"))
        pad_inputs.append("value")
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w1"], ["a"]),
            helper.make_node("Pad", pad_inputs, ["p"], mode=mode),
            helper.make_node("Conv", ["p", "w2"], ["y"]),
        ],
        "conv_pad_conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 6, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    return load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]))


def _conv_expand_conv(shape: list[int]) -> onnx.ModelProto:
    """Conv [1, 4, 4, 4] → 1 channel → Expand(shape) → Conv."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.5, (1, 4, 1, 1)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.normal(0, 0.5, (4, 4, 1, 1)).astype(np.float32), "w2"),
        numpy_helper.from_array(np.array(shape, np.int64), "shape"),
    ]
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w1"], ["a"]),
            helper.make_node("Expand", ["a", "shape"], ["e"]),
            helper.make_node("Conv", ["e", "w2"], ["y"]),
        ],
        "conv_expand_conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    return load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]))


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


ASYMMETRIC_PADS = {
    "H": [0, 0, 2, 0, 0, 0, 1, 0],
    "W": [0, 0, 0, 3, 0, 0, 0, 1],
    "HW": [0, 0, 1, 2, 0, 0, 3, 0],
}


@pytest.mark.parametrize("mode", ["reflect", "edge"])
@pytest.mark.parametrize("axes", sorted(ASYMMETRIC_PADS))
def test_pad_becomes_slices_and_concats_with_identical_outputs(mode: str, axes: str) -> None:
    model = _conv_pad_conv(mode, ASYMMETRIC_PADS[axes])
    assert check_model(model, "mlsoc", suggest=False).mla_segments == 2
    step = apply_rule(model, "pad-to-slices", "mlsoc")
    assert step.verification.passed and step.verification.mode == "exact"
    assert "Pad" not in _ops(step.model)
    assert step.coverage_after.mla_segments == 1 and not step.coverage_after.blockers


def test_a_pad_the_mla_runs_is_left_alone() -> None:
    with pytest.raises(RuleNotApplicableError):
        apply_rule(_conv_pad_conv("constant", ASYMMETRIC_PADS["HW"], 0.0), "pad-to-slices")


@pytest.mark.parametrize(
    ("mode", "pads"),
    [("reflect", [0, 1, 0, 0, 0, 2, 0, 0]), ("edge", [1, 0, 0, 0, 1, 0, 0, 0])],
    ids=["channels", "batch"],
)
def test_a_pad_of_the_batch_or_channel_axis_is_padded_on_a_view(mode, pads) -> None:
    """The MLA concatenates along neither: the axis becomes H of [1, outer, n, inner]."""
    model = _conv_pad_conv(mode, pads)
    step = apply_rule(model, "pad-to-slices", "mlsoc")
    assert step.verification.passed and step.verification.mode == "exact"
    assert "Pad" not in _ops(step.model) and _ops(step.model).count("Reshape") == 2
    assert step.coverage_after.mla_segments == 1 and not step.coverage_after.blockers


def test_a_reflect_pad_as_wide_as_the_axis_is_not_matched() -> None:
    """ONNX reflects at most size − 1 positions; W is 5 here."""
    with pytest.raises(RuleNotApplicableError):
        apply_rule(_conv_pad_conv("reflect", [0, 0, 0, 5, 0, 0, 0, 0]), "pad-to-slices")


def test_reflect_pad_compiles_to_one_elf_bit_exact(tmp_path) -> None:
    model = apply_rule(_conv_pad_conv("reflect", ASYMMETRIC_PADS["HW"]), "pad-to-slices").model
    qdq = quantize_model(model, [make_inputs(model, seed=s) for s in range(2)]).model
    result = compile_model(qdq, tmp_path, model_name="pad")
    feed = make_inputs(model, seed=5)
    comparison = run_and_compare(result, qdq, feed)
    assert len(result.elf_files) == 1 and comparison.bit_exact


def test_expand_becomes_a_concat_of_copies_with_identical_outputs() -> None:
    model = _conv_expand_conv([1, 4, 4, 4])
    assert check_model(model, "mlsoc", suggest=False).mla_segments == 2
    step = apply_rule(model, "expand-to-concat", "mlsoc")
    assert step.verification.passed and step.verification.mode == "exact"
    assert _ops(step.model) == ["Conv", "Concat", "Conv"]
    assert step.coverage_after.mla_segments == 1 and not step.coverage_after.blockers


def test_an_expand_that_adds_axes_is_not_matched() -> None:
    """[1, 1, 4, 4] → [1, 1, 1, 4, 4] changes the rank: not a copy along existing axes."""
    with pytest.raises(RuleNotApplicableError):
        apply_rule(_conv_expand_conv([1, 1, 1, 4, 4]), "expand-to-concat")


# --------------------------------------------------------------------------- pad-to-concat


def test_a_pad_with_ones_becomes_a_concat_with_identical_outputs() -> None:
    """LiteMLA's F.pad(v, (0, 1), value=1): one column of ones after the last axis."""
    model = _conv_pad_conv("constant", [0, 0, 0, 0, 0, 0, 0, 1], 1.0)
    assert check_model(model, "mlsoc", suggest=False).mla_segments == 2
    step = apply_rule(model, "pad-to-concat", "mlsoc")
    assert step.verification.passed and step.verification.worst_max_abs == 0.0
    assert _ops(step.model) == ["Conv", "Concat", "Conv"]
    assert step.coverage_after.mla_segments == 1 and not step.coverage_after.blockers


def test_a_zero_pad_of_the_channel_axis_becomes_a_concat() -> None:
    model = _conv_pad_conv("constant", [0, 2, 0, 0, 0, 1, 1, 0], 0.0)
    model.graph.initializer[1].CopyFrom(  # w2 reads the 7 padded channels
        numpy_helper.from_array(np.ones((4, 7, 1, 1), np.float32), "w2")
    )
    step = apply_rule(load_model(model), "pad-to-concat", "mlsoc")
    assert step.verification.passed and step.verification.worst_max_abs == 0.0
    assert _ops(step.model) == ["Conv", "Concat", "Concat", "Conv"]
    assert step.coverage_after.mla_segments == 1 and not step.coverage_after.blockers


def test_a_zero_pad_of_the_batch_axis_is_concatenated_on_a_view() -> None:
    """Funnel Transformer's decoder pads its tokens, which a lift has put on the batch axis:
    the MLA concatenates along H of the view [1, 1, n, C·H·W] instead."""
    model = _conv_pad_conv("constant", [0, 0, 0, 0, 2, 0, 0, 0], 0.0)
    assert check_model(model, "mlsoc", suggest=False).mla_segments == 2
    step = apply_rule(model, "pad-to-concat", "mlsoc")
    assert step.verification.passed and step.verification.worst_max_abs == 0.0
    assert _ops(step.model) == ["Conv", "Reshape", "Concat", "Reshape", "Conv"]
    assert step.coverage_after.mla_segments == 1 and not step.coverage_after.blockers


def test_pad_to_concat_leaves_cropping_and_supported_pads() -> None:
    with pytest.raises(RuleNotApplicableError):  # zeros on H/W: the MLA pads these itself
        apply_rule(_conv_pad_conv("constant", ASYMMETRIC_PADS["HW"], 0.0), "pad-to-concat")
    with pytest.raises(RuleNotApplicableError):  # a negative pad crops: not a Concat
        apply_rule(_conv_pad_conv("constant", [0, 0, 0, -1, 0, 0, 0, 1], 1.0), "pad-to-concat")


def test_pad_with_ones_compiles_to_one_elf_bit_exact(tmp_path) -> None:
    model = _conv_pad_conv("constant", [0, 0, 1, 0, 0, 0, 0, 1], 1.0)
    model = apply_rule(model, "pad-to-concat").model
    qdq = quantize_model(model, [make_inputs(model, seed=s) for s in range(2)]).model
    result = compile_model(qdq, tmp_path, model_name="pad_ones")
    comparison = run_and_compare(result, qdq, make_inputs(model, seed=5))
    assert len(result.elf_files) == 1 and comparison.bit_exact


def _conv_wide_pad_conv(pad: int, opset: int = 13) -> onnx.ModelProto:
    """Conv → dilated 3×3 Conv padded by `pad` (DeepLabV3's ASPP) → Conv."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.5, (4, 3, 1, 1)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.normal(0, 0.3, (4, 4, 3, 3)).astype(np.float32), "w2"),
        numpy_helper.from_array(rng.normal(0, 0.5, (4, 4, 1, 1)).astype(np.float32), "w3"),
    ]
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w1"], ["a"]),
            helper.make_node(
                "Conv", ["a", "w2"], ["d"], "aspp", pads=[pad] * 4, dilations=[pad, pad]
            ),
            helper.make_node("Conv", ["d", "w3"], ["y"]),
        ],
        "conv_wide_pad_conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 20, 20])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    return load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]))


@pytest.mark.parametrize("opset", [10, 13])
def test_padding_past_the_limit_becomes_a_pad_before_the_conv_exactly(opset: int) -> None:
    model = _conv_wide_pad_conv(18, opset)
    assert check_model(model, "rk3588", suggest=False).mla_segments == 2
    step = apply_rule(model, "conv-pads-to-pad", "rk3588")
    assert step.verification.passed and step.verification.worst_max_abs == 0.0
    assert _ops(step.model) == ["Conv", "Pad", "Conv", "Conv"]
    assert step.coverage_after.mla_segments == 1 and not step.coverage_after.blockers


def test_padding_within_the_limit_is_left_alone() -> None:
    with pytest.raises(RuleNotApplicableError):
        apply_rule(_conv_wide_pad_conv(12), "conv-pads-to-pad", "rk3588")


def test_a_conv_padded_by_a_pad_compiles_to_one_elf_bit_exact_on_rk3588(tmp_path) -> None:
    model = apply_rule(_conv_wide_pad_conv(18), "conv-pads-to-pad", "rk3588").model
    qdq = quantize_model(
        model, [make_inputs(model, seed=s) for s in range(2)], target="rk3588"
    ).model
    result = compile_model(qdq, tmp_path, target="rk3588", model_name="aspp")
    comparison = run_and_compare(result, qdq, make_inputs(model, seed=5))
    assert len(result.elf_files) == 1 and comparison.bit_exact
