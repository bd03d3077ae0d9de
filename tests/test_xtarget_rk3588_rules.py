"""Rewrites that make stricter targets reach one MLA segment where mlsoc already does (rk3588:
Slice steps of 1 only; Gemm on the MLA at any rank).

- strided-slice-to-space-to-depth: Swin's patch merging (four step-2 Slices of a channels-last
  map) and LeViT's query subsampling (a step-2 Slice per axis, 7 → 4 rows) become one
  SpaceToDepth and channel Slices, exactly;
- transformer-to-4d lifts a rank-2 Gemm the target already runs on the MLA together with the
  Reshapes around it (DETR's out-projection on (HW·N, C)); left out, the lift rebuilt its rank-2
  operands on the host and split the model."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler.compile import compile_model
from surgery.check import check_model
from surgery.model import load_model
from surgery.rules import apply_rule, find_matches
from surgery.rules.fix import fix_model
from tests.lower_support import quantize_on, run_and_compare

RULE = "strided-slice-to-space-to-depth"


def _model(nodes, inits, inputs, outputs, opset: int = 13) -> onnx.ModelProto:
    for node in nodes:
        node.name = node.name or node.output[0]
    graph = helper.make_graph(nodes, "m", inputs, outputs, inits)
    return load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]))


def _patch_merging(channels_last: bool, side: int = 8, c: int = 4) -> onnx.ModelProto:
    """Conv → (Transpose to NHWC) → four x[..., i::2, j::2] Slices → Concat → Conv, so the
    slices sit between two MLA convolutions."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.3, (c, 3, 1, 1)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.normal(0, 0.3, (5, 4 * c, 1, 1)).astype(np.float32), "w2"),
    ]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c"])]
    src, axes, cat = "c", [2, 3], 1
    if channels_last:
        nodes.append(helper.make_node("Transpose", ["c"], ["nhwc"], perm=[0, 2, 3, 1]))
        src, axes, cat = "nhwc", [1, 2], 3
    quads = []
    for k, (i, j) in enumerate(((0, 0), (1, 0), (0, 1), (1, 1))):
        names = [f"q{k}_{m}" for m in range(4)]
        for name, value in zip(names, ([i, j], [side, side], axes, [2, 2]), strict=True):
            inits.append(numpy_helper.from_array(np.array(value, np.int64), name))
        nodes.append(helper.make_node("Slice", [src, *names], [f"quad{k}"], name=f"quad{k}"))
        quads.append(f"quad{k}")
    nodes.append(helper.make_node("Concat", quads, ["quads"], axis=cat))
    merged = "quads"
    if channels_last:
        nodes.append(helper.make_node("Transpose", ["quads"], ["nchw"], perm=[0, 3, 1, 2]))
        merged = "nchw"
    nodes.append(helper.make_node("Conv", [merged, "w2"], ["y"]))
    return _model(
        nodes,
        inits,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, side, side])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 5, side // 2, side // 2])],
    )


@pytest.mark.parametrize("channels_last", [False, True])
def test_patch_merging_slices_become_one_space_to_depth_exactly(channels_last: bool) -> None:
    model = _patch_merging(channels_last)
    assert check_model(model, "rk3588", suggest=False).mla_segments == 2
    (match,) = find_matches(model, RULE, "rk3588")
    assert sorted(match.nodes) == ["quad0", "quad1", "quad2", "quad3"]
    result = apply_rule(model, RULE, "rk3588")
    assert result.verification is not None and result.verification.passed
    assert result.verification.worst_max_abs == 0.0
    ops = [n.op_type for n in result.model.graph.node]
    assert ops.count("SpaceToDepth") == 1 and ops.count("Slice") == 4
    assert check_model(result.model, "rk3588", suggest=False).mla_segments == 1


def _chained_patch_merging(side: int = 8, c: int = 4) -> onnx.ModelProto:
    """HF Swin's patch merging as torch exports x[:, i::2, j::2, :]: a Slice of the rows, then
    a Slice of the columns of it (two row Slices, each read by two column Slices)."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.3, (c, 3, 1, 1)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.normal(0, 0.3, (5, 4 * c, 1, 1)).astype(np.float32), "w2"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c"]),
        helper.make_node("Transpose", ["c"], ["nhwc"], perm=[0, 2, 3, 1]),
    ]

    def stepped(name: str, src: str, start: int, axis: int) -> None:
        values = ([start], [2**63 - 1], [axis], [2])
        names = [f"{name}_{m}" for m in range(4)]
        for arg, value in zip(names, values, strict=True):
            inits.append(numpy_helper.from_array(np.array(value, np.int64), arg))
        nodes.append(helper.make_node("Slice", [src, *names], [name], name=name))

    for i in (0, 1):
        stepped(f"rows{i}", "nhwc", i, 1)
    quads = []
    for i, j in ((0, 0), (1, 0), (0, 1), (1, 1)):
        stepped(f"quad{i}{j}", f"rows{i}", j, 2)
        quads.append(f"quad{i}{j}")
    nodes += [
        helper.make_node("Concat", quads, ["quads"], axis=3),
        helper.make_node("Transpose", ["quads"], ["nchw"], perm=[0, 3, 1, 2]),
        helper.make_node("Conv", ["nchw", "w2"], ["y"]),
    ]
    return _model(
        nodes,
        inits,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, side, side])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 5, side // 2, side // 2])],
    )


def test_a_slice_of_a_row_slice_is_one_two_axis_sampling() -> None:
    model = _chained_patch_merging()
    assert check_model(model, "rk3588", suggest=False).mla_segments == 2
    (match,) = find_matches(model, RULE, "rk3588")
    assert sorted(match.nodes) == ["quad00", "quad01", "quad10", "quad11", "rows0", "rows1"]
    assert sorted(match.blockers) == sorted(match.nodes)
    result = apply_rule(model, RULE, "rk3588")
    assert result.verification is not None and result.verification.worst_max_abs == 0.0
    ops = [n.op_type for n in result.model.graph.node]
    assert ops.count("SpaceToDepth") == 1 and ops.count("Slice") == 4
    assert check_model(result.model, "rk3588", suggest=False).mla_segments == 1


def test_mlsoc_keeps_its_strided_slices() -> None:
    """The MLA of mlsoc slices with any step: nothing to rewrite there."""
    assert find_matches(_patch_merging(False), RULE, "mlsoc") == []


def test_slices_that_are_not_whole_tile_samplings_are_left_alone() -> None:
    """A slice that stops short of the end is not one block of every tile."""
    short = _patch_merging(False)
    for init in short.graph.initializer:
        if init.name == "q0_1":
            init.CopyFrom(numpy_helper.from_array(np.array([6, 8], np.int64), "q0_1"))
    matches = find_matches(short, RULE, "rk3588")
    assert [sorted(m.nodes) for m in matches] == [["quad1", "quad2", "quad3"]]


def _query_subsampling(side: int, c: int = 4) -> onnx.ModelProto:
    """Conv → channels-last map → x[:, ::2] → [:, :, ::2] (two Slices, as LeViT subsamples its
    attention queries) → back to NCHW → Conv."""
    rng = np.random.default_rng(1)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.3, (c, 3, 1, 1)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.normal(0, 0.3, (5, c, 1, 1)).astype(np.float32), "w2"),
    ]
    for axis in (1, 2):
        for what, value in (("s", 0), ("e", 2**63 - 1), ("a", axis), ("p", 2)):
            inits.append(numpy_helper.from_array(np.array([value], np.int64), f"{what}{axis}"))
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c"]),
        helper.make_node("Transpose", ["c"], ["nhwc"], perm=[0, 2, 3, 1]),
        helper.make_node("Slice", ["nhwc", "s1", "e1", "a1", "p1"], ["rows"], name="rows"),
        helper.make_node("Slice", ["rows", "s2", "e2", "a2", "p2"], ["grid"], name="grid"),
        helper.make_node("Transpose", ["grid"], ["nchw"], perm=[0, 3, 1, 2]),
        helper.make_node("Conv", ["nchw", "w2"], ["y"]),
    ]
    out = -(-side // 2)
    return _model(
        nodes,
        inits,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, side, side])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 5, out, out])],
    )


@pytest.mark.parametrize("side", [8, 7])
def test_two_chained_step_slices_become_one_space_to_depth(side: int) -> None:
    """One step-2 Slice per axis is the same sampling as one Slice over both; a side the step
    does not divide (7 → 4 rows) is zero-padded to 8 and the block cropped back to 4."""
    model = _query_subsampling(side)
    assert check_model(model, "rk3588", suggest=False).mla_segments == 2
    (match,) = find_matches(model, RULE, "rk3588")
    assert sorted(match.nodes) == sorted(match.blockers) == ["grid", "rows"]
    result = apply_rule(model, RULE, "rk3588")
    assert result.verification is not None and result.verification.passed
    assert result.verification.worst_max_abs == 0.0
    ops = [n.op_type for n in result.model.graph.node]
    assert ops.count("SpaceToDepth") == 1 and ops.count("Pad") == (side % 2)
    assert check_model(result.model, "rk3588", suggest=False).mla_segments == 1


def _rank2_gemm_between_reshapes(tokens: int = 16, c: int = 8) -> onnx.ModelProto:
    """Tokens [L, 1, C] → LayerNorm → Reshape (L, C) → Gemm → Reshape (L, 1, C) → Add → LayerNorm
    → Transpose back to [1, C, L]: DETR's post-norm attention output projection."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(np.ones(c, np.float32), "g"),
        numpy_helper.from_array(np.zeros(c, np.float32), "b"),
        numpy_helper.from_array(rng.normal(0, 0.3, (c, c)).astype(np.float32), "w"),
        numpy_helper.from_array(rng.normal(0, 0.1, c).astype(np.float32), "wb"),
        numpy_helper.from_array(np.array([tokens, c], np.int64), "flat"),
        numpy_helper.from_array(np.array([tokens, 1, c], np.int64), "seq"),
        numpy_helper.from_array(np.array([1, c, tokens], np.int64), "rows"),
    ]
    nodes = [
        helper.make_node("Reshape", ["x", "rows"], ["xr"]),
        helper.make_node("Transpose", ["xr"], ["src"], perm=[2, 0, 1]),
        helper.make_node("LayerNormalization", ["src", "g", "b"], ["n1"], axis=-1),
        helper.make_node("Reshape", ["n1", "flat"], ["merged"]),
        helper.make_node("Gemm", ["merged", "w", "wb"], ["proj"], transB=1),
        helper.make_node("Reshape", ["proj", "seq"], ["unmerged"]),
        helper.make_node("Add", ["src", "unmerged"], ["res"]),
        helper.make_node("LayerNormalization", ["res", "g", "b"], ["n2"], axis=-1),
        helper.make_node("Transpose", ["n2"], ["t"], perm=[1, 2, 0]),
        helper.make_node("Reshape", ["t", "side"], ["y"]),
    ]
    inits.append(numpy_helper.from_array(np.array([1, c, 4, 4], np.int64), "side"))
    return _model(
        nodes,
        inits,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, c, 4, 4])],
        opset=17,
    )


def test_transformer_lift_takes_a_rank2_gemm_the_target_runs_along() -> None:
    model = _rank2_gemm_between_reshapes()
    matches = find_matches(model, "transformer-to-4d", "rk3588")
    assert len(matches) == 1 and "proj" in matches[0].nodes
    fixed = fix_model(model, "rk3588")
    assert check_model(fixed.model, "rk3588", suggest=False).mla_segments == 1
    assert "transformer-to-4d" in [step["rule"] for step in fixed.steps]


def test_padded_query_subsampling_compiles_to_one_elf_bit_exact(tmp_path) -> None:
    fixed = apply_rule(_query_subsampling(7), RULE, "rk3588").model
    qdq = quantize_on(fixed, "rk3588")
    result = compile_model(qdq, tmp_path, target="rk3588", model_name="query_subsampling")
    assert len(result.elf_files) == 1, result.notes
    feed = {"x": np.random.default_rng(5).normal(0, 1, (1, 3, 7, 7)).astype(np.float32)}
    comparison = run_and_compare(result, qdq, feed)
    assert comparison.mla_stages and comparison.bit_exact


def _interleaved_rotary(c: int = 8, tokens: int = 6, end: int | None = None) -> onnx.ModelProto:
    """A 1×1 Conv viewed as [1, heads, tokens, hd] then split into its even and odd features
    (x[..., ::2], x[..., 1::2]) and recombined as EVA-02's rotary embedding does."""
    rng = np.random.default_rng(3)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.5, (c, c, 1, 1)).astype(np.float32), "w"),
        numpy_helper.from_array(np.array([1, 2, tokens, c // 2], np.int64), "heads"),
        *(
            numpy_helper.from_array(np.array(v, np.int64), name)
            for name, v in (
                ("s0", [0]),
                ("s1", [1]),
                ("end", [end or c]),
                ("ax", [3]),
                ("two", [2]),
            )
        ),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["a"]),
        helper.make_node("Reshape", ["a", "heads"], ["h"]),
        helper.make_node("Slice", ["h", "s0", "end", "ax", "two"], ["even"], name="even"),
        helper.make_node("Slice", ["h", "s1", "end", "ax", "two"], ["odd"], name="odd"),
        helper.make_node("Sub", ["even", "odd"], ["y"]),
    ]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, c, tokens, 1])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    return _model(nodes, inits, inputs, outputs)


def test_a_strided_slice_of_the_features_becomes_a_step_1_slice_of_a_view() -> None:
    model = _interleaved_rotary()
    assert {"even", "odd"} <= {b.name for b in check_model(model, "rk3588").blockers}
    result = apply_rule(model, "strided-slice-to-reshape", "rk3588")
    assert result.verification.passed and result.verification.mode == "exact"
    steps = [n for n in result.model.graph.node if n.op_type == "Slice" and len(n.input) > 4]
    assert not steps and not result.coverage_after.blockers


def test_a_strided_slice_of_part_of_an_axis_slices_its_window_first() -> None:
    model = _interleaved_rotary(c=12, end=3)  # hd = 6: [0:3:2] takes 0, 2; [1:3:2] takes 1
    assert {"even", "odd"} <= {b.name for b in check_model(model, "rk3588").blockers}
    result = apply_rule(model, "strided-slice-to-reshape", "rk3588")
    assert result.verification.passed and result.verification.mode == "exact"
    assert not result.coverage_after.blockers
    windows = [m.data["window"] for m in find_matches(model, "strided-slice-to-reshape", "rk3588")]
    assert sorted(windows) == [[0, 4], [1, 3]]
