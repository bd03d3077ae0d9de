"""resize-to-supported on nearest Resizes by a fractional factor (GhostNetV2's DFC gate:
F.interpolate(gate, size=...) from a pooled 3×3 to 7×7): the index map ONNX defines becomes an
accepted integer Resize and Slices + Concat along each axis, exactly."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler.compile import compile_model
from compiler.quantize import quantize_model
from surgery.check import check_model
from surgery.model import load_model
from surgery.rules import find_matches
from surgery.rules.engine import apply_rule
from surgery.rules.replace_resize import gather_pieces, nearest_indices
from surgery.verify import make_inputs
from tests.lower_support import run_and_compare


def _conv_resize_conv(
    hw: tuple[int, int],
    out: tuple[int, int],
    ctm: str = "asymmetric",
    nearest_mode: str = "floor",
) -> onnx.ModelProto:
    """Conv [1, 4, h, w] → nearest Resize to `out` (given as sizes, as torch exports
    F.interpolate(size=...)) → Conv, so the Resize sits between two MLA regions."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.5, (4, 4, 1, 1)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.normal(0, 0.5, (4, 4, 1, 1)).astype(np.float32), "w2"),
        numpy_helper.from_array(np.array([1, 4, *out], np.int64), "sizes"),
    ]
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w1"], ["a"]),
            helper.make_node(
                "Resize",
                ["a", "", "", "sizes"],
                ["r"],
                mode="nearest",
                coordinate_transformation_mode=ctm,
                nearest_mode=nearest_mode,
            ),
            helper.make_node("Conv", ["r", "w2"], ["y"]),
        ],
        "conv_resize_conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, *hw])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    return load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]))


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


def test_ghostnet_gate_3_to_7_joins_the_segments_bit_identically() -> None:
    model = _conv_resize_conv((3, 3), (7, 7))
    assert check_model(model, "mlsoc", suggest=False).mla_segments == 2
    step = apply_rule(model, "resize-to-supported", "mlsoc")
    assert step.verification.passed and step.verification.worst_max_abs == 0.0
    assert step.coverage_after.mla_segments == 1 and not step.coverage_after.blockers
    # ×2 then, per axis, row 0 once more in front: [0,0,0,1,1,2,2] = [0] + [0,0,1,1,2,2]
    assert _ops(step.model) == ["Conv", "Resize", "Slice", "Concat", "Slice", "Concat", "Conv"]


@pytest.mark.parametrize(
    ("hw", "out", "ctm", "nearest_mode"),
    [
        ((3, 5), (7, 12), "half_pixel", "round_prefer_floor"),
        ((20, 20), (45, 45), "pytorch_half_pixel", "round_prefer_ceil"),
        ((4, 4), (9, 9), "align_corners", "round_prefer_floor"),
        ((5, 5), (12, 12), "tf_half_pixel_for_nn", "ceil"),
        ((7, 7), (5, 3), "asymmetric", "floor"),
    ],
)
@pytest.mark.parametrize("target", ["mlsoc", "rk3588"])
def test_every_coordinate_mode_is_gathered_exactly(hw, out, ctm, nearest_mode, target) -> None:
    model = _conv_resize_conv(hw, out, ctm, nearest_mode)
    step = apply_rule(model, "resize-to-supported", target)
    assert step.verification.passed and step.verification.worst_max_abs == 0.0
    assert step.coverage_after.mla_segments == 1 and not step.coverage_after.blockers


def test_indices_round_in_float32_as_onnx_runtime_does() -> None:
    """7 → 39 half_pixel floor: output 19 sits on an integer coordinate that float64 rounds
    one way and ONNX Runtime's float32 the other; the rewrite must follow the runtime."""
    scale = float(np.float32(39) / np.float32(7))
    exact64 = np.floor((np.arange(39) + 0.5) / (39 / 7) - 0.5).clip(0, 6)
    assert not np.array_equal(nearest_indices(7, 39, scale, "half_pixel", "floor"), exact64)
    step = apply_rule(_conv_resize_conv((3, 7), (3, 39), "half_pixel"), "resize-to-supported")
    assert step.verification.passed and step.verification.worst_max_abs == 0.0


def test_pieces_are_runs_of_the_replicated_axis() -> None:
    idx = np.array([0, 0, 0, 1, 1, 2, 2])
    assert gather_pieces(idx, 2, strided=False) == [(0, 1, 1), (0, 6, 1)]
    assert gather_pieces(idx, 1, strided=False) == [
        (0, 1, 1),
        (0, 1, 1),
        (0, 2, 1),
        (1, 2, 1),
        (2, 1, 1),
    ]
    assert gather_pieces(np.array([0, 2, 4]), 1, strided=True) == [(0, 3, 2)]


def test_a_supported_resize_is_left_alone() -> None:
    assert find_matches(_conv_resize_conv((3, 3), (6, 6)), "resize-to-supported") == []


def test_gathered_resize_compiles_to_one_elf_bit_exact(tmp_path) -> None:
    model = apply_rule(_conv_resize_conv((3, 3), (7, 7)), "resize-to-supported").model
    qdq = quantize_model(model, [make_inputs(model, seed=s) for s in range(2)]).model
    result = compile_model(qdq, tmp_path, model_name="resize")
    comparison = run_and_compare(result, qdq, make_inputs(model, seed=5))
    assert len(result.elf_files) == 1 and comparison.bit_exact
