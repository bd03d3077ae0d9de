"""shuffle-to-depth-to-space: Reshape → Transpose → Reshape pixel shuffles (torch's PixelShuffle,
the DCR spelling, a space-to-depth block) become one DepthToSpace / SpaceToDepth, exactly."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler.compile import compile_model
from compiler.quantize import quantize_model
from surgery.model import load_model
from surgery.rules.engine import RuleNotApplicableError, apply_rule
from surgery.verify import make_inputs
from tests.lower_support import run_and_compare


def _shuffle(
    middle: list[int], perm: list[int], out: list[int], opset: int = 13
) -> onnx.ModelProto:
    """Conv [1, 8, 4, 4] → Reshape(middle) → Transpose(perm) → Reshape(out) → Conv."""
    rng = np.random.default_rng(0)
    channels = out[1]
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.3, (8, 8, 1, 1)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.normal(0, 0.3, (4, channels, 1, 1)).astype(np.float32), "w2"),
        numpy_helper.from_array(np.array(middle, np.int64), "middle"),
        numpy_helper.from_array(np.array(out, np.int64), "out"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["a"]),
        helper.make_node("Reshape", ["a", "middle"], ["m"]),
        helper.make_node("Transpose", ["m"], ["t"], perm=perm),
        helper.make_node("Reshape", ["t", "out"], ["s"]),
        helper.make_node("Conv", ["s", "w2"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "shuffle",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    return load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]))


PIXEL_SHUFFLE = ([1, 2, 2, 2, 4, 4], [0, 1, 4, 2, 5, 3], [1, 2, 8, 8])
DCR = ([1, 2, 2, 2, 4, 4], [0, 3, 4, 1, 5, 2], [1, 2, 8, 8])
SPACE_TO_DEPTH = ([1, 8, 2, 2, 2, 2], [0, 3, 5, 1, 2, 4], [1, 32, 2, 2])


def _ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


@pytest.mark.parametrize(
    ("spelling", "op", "mode"),
    [
        (PIXEL_SHUFFLE, "DepthToSpace", "CRD"),
        (DCR, "DepthToSpace", "DCR"),
        (SPACE_TO_DEPTH, "SpaceToDepth", None),
    ],
)
def test_shuffle_becomes_one_op_with_identical_outputs(spelling, op, mode) -> None:
    step = apply_rule(_shuffle(*spelling), "shuffle-to-depth-to-space", "mlsoc")
    assert step.verification.passed and step.verification.mode == "exact"
    assert _ops(step.model) == ["Conv", op, "Conv"]
    node = step.model.graph.node[1]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["blocksize"] == 2
    assert attrs.get("mode", b"DCR").decode() == (mode or "DCR")
    assert step.coverage_after.mla_segments == 1 and not step.coverage_after.blockers


def test_pixel_shuffle_in_an_old_opset_is_converted_for_crd() -> None:
    step = apply_rule(_shuffle(*PIXEL_SHUFFLE, opset=9), "shuffle-to-depth-to-space", "mlsoc")
    assert step.verification.passed
    assert max(o.version for o in step.model.opset_import if o.domain in ("", "ai.onnx")) >= 11


def test_other_transposes_are_not_shuffles() -> None:
    with pytest.raises(RuleNotApplicableError):
        apply_rule(
            _shuffle([1, 2, 2, 2, 4, 4], [0, 1, 2, 3, 5, 4], [1, 8, 4, 4]),
            "shuffle-to-depth-to-space",
            "mlsoc",
        )


def test_pixel_shuffle_compiles_to_one_elf_bit_exact(tmp_path) -> None:
    model = apply_rule(_shuffle(*PIXEL_SHUFFLE), "shuffle-to-depth-to-space", "mlsoc").model
    qdq = quantize_model(model, [make_inputs(model, seed=s) for s in range(2)]).model
    result = compile_model(qdq, tmp_path, model_name="shuffle")
    feed = make_inputs(model, seed=5)
    comparison = run_and_compare(result, qdq, feed)
    assert len(result.elf_files) == 1 and comparison.bit_exact
