"""transpose-to-block-swaps: Reshape → Transpose → Reshape through a rank-6 tensor that is no
pixel shuffle (MobileViT's patch unfold and fold) becomes a chain of 4-D Transposes, exactly."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler.compile import compile_model
from surgery.check import check_model
from surgery.model import load_model
from surgery.rules import catalogue  # noqa: F401  (registers every rule in priority order first)
from surgery.rules.engine import RuleNotApplicableError, apply_rule
from surgery.rules.replace_shuffle import block_swaps
from tests.lower_support import quantize_on, run_and_compare

C, H, P = 8, 8, 2
N = (H // P) ** 2


def _unfold_fold() -> onnx.ModelProto:
    """Conv [1,C,H,W] → unfold to patches [1,C,P·P,N] → 1×1 Conv → fold back → Conv, as
    timm's MobileViT blocks export it (Reshape to rank 6, Transpose, Reshape)."""
    rng = np.random.default_rng(0)
    g = H // P
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.3, (C, 3, 3, 3)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.normal(0, 0.3, (C, C, 1, 1)).astype(np.float32), "w2"),
        numpy_helper.from_array(rng.normal(0, 0.3, (C, C, 1, 1)).astype(np.float32), "w3"),
        numpy_helper.from_array(np.array([1, C, g, P, g, P], np.int64), "split_grid"),
        numpy_helper.from_array(np.array([1, C, -1, N], np.int64), "patches"),
        numpy_helper.from_array(np.array([1, C, P, P, g, g], np.int64), "split_patches"),
        numpy_helper.from_array(np.array([1, C, H, H], np.int64), "image"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["a"], pads=[1, 1, 1, 1]),
        helper.make_node("Reshape", ["a", "split_grid"], ["u6"]),
        helper.make_node("Transpose", ["u6"], ["ut"], perm=[0, 1, 3, 5, 2, 4]),
        helper.make_node("Reshape", ["ut", "patches"], ["u"]),
        helper.make_node("Conv", ["u", "w2"], ["b"]),
        helper.make_node("Reshape", ["b", "split_patches"], ["f6"]),
        helper.make_node("Transpose", ["f6"], ["ft"], perm=[0, 1, 4, 2, 5, 3]),
        helper.make_node("Reshape", ["ft", "image"], ["f"]),
        helper.make_node("Conv", ["f", "w3"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "unfold_fold",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, H, H])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    return load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)]))


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


@pytest.mark.parametrize(
    ("shape", "perm"),
    [
        ((1, 8, 4, 2, 4, 2), (0, 1, 3, 5, 2, 4)),  # patch unfold
        ((1, 8, 2, 2, 4, 4), (0, 1, 4, 2, 5, 3)),  # patch fold
        ((1, 3, 4, 5, 6, 7), (0, 5, 3, 1, 4, 2)),
        ((2, 3, 1, 5, 6, 7), (0, 4, 2, 3, 1, 5)),
    ],
)
def test_the_chain_of_block_swaps_computes_the_transpose(shape, perm) -> None:
    x = np.arange(np.prod(shape)).reshape(shape)
    current = x.reshape(-1)
    steps = block_swaps(shape, perm)
    assert steps
    for shape4, step_perm in steps:
        assert len(shape4) == 4 and step_perm[0] == 0
        current = current.reshape(shape4).transpose(step_perm)
    assert np.array_equal(current.reshape(-1), x.transpose(perm).reshape(-1))


def test_a_patch_unfold_or_fold_takes_two_block_swaps() -> None:
    assert len(block_swaps((1, 64, 16, 2, 16, 2), (0, 1, 3, 5, 2, 4)) or []) == 2
    assert len(block_swaps((1, 64, 2, 2, 16, 16), (0, 1, 4, 2, 5, 3)) or []) == 2


def test_patch_unfold_and_fold_become_4d_transposes_on_the_mla() -> None:
    model = _unfold_fold()
    assert check_model(model, "mlsoc", suggest=False).mla_segments == 3
    step = apply_rule(model, "transpose-to-block-swaps", "mlsoc")
    assert step.verification.passed and step.verification.mode == "exact"
    assert len(step.matches) == 2
    assert _ops(step.model).count("Transpose") == 4
    assert step.coverage_after.mla_segments == 1 and not step.coverage_after.blockers


def test_pixel_shuffles_are_left_to_depth_to_space() -> None:
    rng = np.random.default_rng(1)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.3, (C, 3, 1, 1)).astype(np.float32), "w1"),
        numpy_helper.from_array(np.array([1, C, 4, 2, 4, 2], np.int64), "middle"),
        numpy_helper.from_array(np.array([1, 4 * C, 4, 4], np.int64), "out"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["a"]),
        helper.make_node("Reshape", ["a", "middle"], ["m"]),
        helper.make_node("Transpose", ["m"], ["t"], perm=[0, 3, 5, 1, 2, 4]),
        helper.make_node("Reshape", ["t", "out"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "space_to_depth",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, H, H])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    model = load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)]))
    with pytest.raises(RuleNotApplicableError):
        apply_rule(model, "transpose-to-block-swaps", "mlsoc")
    assert apply_rule(model, "shuffle-to-depth-to-space", "mlsoc").verification.passed


def test_a_channel_shuffle_is_left_to_the_rank4_lift() -> None:
    """[1, g, C/g, H, W] → perm (0, 2, 1, 3, 4) moves three blocks: one 4-D Transpose, which
    reshape-to-4d carries inside its region."""
    rng = np.random.default_rng(2)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.3, (C, 3, 1, 1)).astype(np.float32), "w1"),
        numpy_helper.from_array(np.array([1, 2, C // 2, H, H], np.int64), "groups"),
        numpy_helper.from_array(np.array([1, C, H, H], np.int64), "image"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["a"]),
        helper.make_node("Reshape", ["a", "groups"], ["g"]),
        helper.make_node("Transpose", ["g"], ["t"], perm=[0, 2, 1, 3, 4]),
        helper.make_node("Reshape", ["t", "image"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "channel_shuffle",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, H, H])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    model = load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)]))
    with pytest.raises(RuleNotApplicableError):
        apply_rule(model, "transpose-to-block-swaps", "mlsoc")


def test_unfold_and_fold_compile_to_one_elf_bit_exact(tmp_path) -> None:
    fixed = apply_rule(_unfold_fold(), "transpose-to-block-swaps", "mlsoc").model
    qdq = quantize_on(fixed, "mlsoc")
    result = compile_model(qdq, tmp_path, target="mlsoc", model_name="unfold_fold")
    assert len(result.elf_files) == 1, result.notes
    feed = {"x": np.random.default_rng(5).normal(0, 1, (1, 3, H, H)).astype(np.float32)}
    comparison = run_and_compare(result, qdq, feed)
    assert comparison.mla_stages and comparison.bit_exact


def test_a_4d_transpose_that_moves_the_batch_axis_becomes_block_swaps_behind_a_unit_batch() -> None:
    """[T, W, G, D] → perm (2, 1, 0, 3), as the rank lift writes Hiera's qkv head split: the
    MLA keeps the batch axis in place, two block swaps behind a unit batch do the same."""
    rng = np.random.default_rng(1)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.3, (6, 4, 1, 1)).astype(np.float32), "w1"),
        numpy_helper.from_array(np.array([4, 3, 6, 8], np.int64), "grid"),
        numpy_helper.from_array(rng.normal(0, 0.3, (6, 3, 1, 1)).astype(np.float32), "w2"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["a"], name="a"),
        helper.make_node("Reshape", ["a", "grid"], ["g"], name="g"),
        helper.make_node("Transpose", ["g"], ["t"], name="t", perm=[2, 1, 0, 3]),
        helper.make_node("Conv", ["t", "w2"], ["y"], name="y"),
    ]
    graph = helper.make_graph(
        nodes,
        "batch_move",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 12, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    model = load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)]))
    assert "t" in {b.name for b in check_model(model, "mlsoc").blockers}
    result = apply_rule(model, "transpose-to-block-swaps")
    assert result.verification.passed and result.verification.mode == "exact"
    perms = [
        list(a.ints)
        for n in result.model.graph.node
        if n.op_type == "Transpose"
        for a in n.attribute
    ]
    assert perms and all(p[0] == 0 for p in perms)
    assert "t" not in {b.name for b in result.coverage_after.blockers}
