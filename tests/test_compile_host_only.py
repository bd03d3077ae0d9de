"""Models of which no node runs on the MLA: `surgery check` counts 0 `.elf` files, the
quantizer leaves them float, and compile builds a host-only archive (or says why it cannot)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler.archive import read_archive
from compiler.compile import compile_model
from compiler.lower.errors import CompileError
from compiler.runtime.pipeline import run_archive
from surgery.check import check_model
from tests.conftest import loop_body_adding
from tests.lower_support import input_frames, quantize_on, run_and_compare


def _top3() -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("TopK", ["x", "k"], ["values", "indices"], axis=1)],
        "top3",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 10])],
        [
            helper.make_tensor_value_info("values", TensorProto.FLOAT, [1, 3]),
            helper.make_tensor_value_info("indices", TensorProto.INT64, [1, 3]),
        ],
        [numpy_helper.from_array(np.array([3], np.int64), "k")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def _branch(name: str, node: onnx.NodeProto) -> onnx.GraphProto:
    return helper.make_graph(
        [node], name, [], [helper.make_tensor_value_info(node.output[0], TensorProto.FLOAT, None)]
    )


def _if_positive(
    then_node: onnx.NodeProto, else_node: onnx.NodeProto, *constants: onnx.TensorProto
) -> onnx.ModelProto:
    """y = then_node(x) if sum(x) > 0 else else_node(x), x of shape [1, 4]; the branches read x
    (and `constants`) from the outer graph, and y's shape is left to the branches."""
    nodes = [
        helper.make_node("ReduceSum", ["x"], ["total"], keepdims=0),
        helper.make_node("Greater", ["total", "zero"], ["positive"]),
        helper.make_node(
            "If",
            ["positive"],
            ["y"],
            then_branch=_branch("then", then_node),
            else_branch=_branch("else", else_node),
        ),
    ]
    graph = helper.make_graph(
        nodes,
        "if_positive",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.array(0.0, np.float32), "zero"), *constants],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def _if_that_fails_on_zeros() -> onnx.ModelProto:
    """y = x if sum(x) > 0 else reshape(x, [3, -1]), which 4 values cannot take: shape
    inference cannot tell y's shape, and the zero-input run takes the failing branch."""
    return _if_positive(
        helper.make_node("Identity", ["x"], ["kept"]),
        helper.make_node("Reshape", ["x", "three_rows"], ["folded"]),
        numpy_helper.from_array(np.array([3, -1], np.int64), "three_rows"),
    )


def test_a_float_model_without_mla_work_compiles_to_host_stages_only(tmp_path) -> None:
    model = _top3()
    assert check_model(model).mla_segments == 0
    result = compile_model(model, tmp_path, model_name="top3")
    assert result.elf_files == [] and result.mla_segments == 0
    assert {s["processor"] for s in result.stages} == {"APU"}
    assert any("0 MLA segments" in note for note in result.notes)
    x = np.array([[5, 1, 9, 3, 7, 0, 2, 8, 6, 4]], np.float32)
    outputs, _ = run_archive(read_archive(result.archive), {"x": x})
    assert outputs["values"].tolist() == [[9, 8, 7]]
    assert outputs["indices"].tolist() == [[2, 7, 4]]


def test_an_unmeasurable_shape_is_a_compile_error_naming_the_tensor(tmp_path) -> None:
    with pytest.raises(CompileError, match=r"cannot tell the shape of .*y.*zero inputs"):
        compile_model(_if_that_fails_on_zeros(), tmp_path, model_name="branchy")
    assert not list(tmp_path.iterdir())  # nothing half-written


def _sign_flip() -> onnx.ModelProto:
    """y = -x if sum(x) > 0 else x."""
    return _if_positive(
        helper.make_node("Neg", ["x"], ["flipped"]), helper.make_node("Identity", ["x"], ["kept"])
    )


def test_branches_that_read_the_outer_graph_compile_and_run(tmp_path) -> None:
    result = compile_model(_sign_flip(), tmp_path, model_name="sign_flip")
    archive = read_archive(result.archive)
    for x, expected in (([1, 2, 3, 4], [-1, -2, -3, -4]), ([-1, -2, 0, 1], [-1, -2, 0, 1])):
        outputs, _ = run_archive(archive, {"x": np.array([x], np.float32)})
        assert outputs["y"].tolist() == [expected]


def _sign_flip_of_relu() -> onnx.ModelProto:
    """y = -relu(x) if sum(x) > 0 else relu(x): only the branches read relu(x), which a node
    of the same host stage makes (not a stage input)."""
    model = _if_positive(
        helper.make_node("Neg", ["r"], ["flipped"]), helper.make_node("Identity", ["r"], ["kept"])
    )
    nodes = [helper.make_node("Relu", ["x"], ["r"]), *model.graph.node]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return model


@pytest.mark.parametrize("target", ["mlsoc", "rk3588"])
def test_a_host_stage_keeps_the_producers_of_what_its_branches_read(tmp_path, target) -> None:
    result = compile_model(_sign_flip_of_relu(), tmp_path, target=target, model_name="relu_flip")
    archive = read_archive(result.archive)
    for x, expected in (([1, -2, 3, 4], [-1, 0, -3, -4]), ([-1, -2, 0, 1], [0, 0, 0, 1])):
        outputs, _ = run_archive(archive, {"x": np.array([x], np.float32)})
        assert outputs["y"].tolist() == [expected]


def _loop_between_convs() -> onnx.ModelProto:
    """conv1 → relu → `seq`; a Loop whose body adds `seq` (read from the outer graph, not an
    input) to its state `x`; then add(loop, seq) → conv2. The Loop depends on conv1's side
    only through its body, as a Keras LSTM's Loop reads its sequence."""
    shape = [1, 3, 8, 8]

    def info(name: str, dims: list[int]) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, dims)

    body = loop_body_adding("seq", shape)
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["seq"], name="relu"),
        helper.make_node("Loop", ["M", "", "x"], ["l"], name="loop", body=body),
        helper.make_node("Add", ["l", "seq"], ["a"], name="add"),
        helper.make_node("Conv", ["a", "w"], ["y"], name="conv2", pads=[1, 1, 1, 1]),
    ]
    rng = np.random.default_rng(0)
    initializers = [
        numpy_helper.from_array(np.array(2, np.int64), "M"),
        numpy_helper.from_array(rng.standard_normal((3, 3, 3, 3)).astype(np.float32), "w"),
    ]
    graph = helper.make_graph(
        nodes, "loop_between_convs", [info("x", shape)], [info("y", shape)], initializers
    )
    graph.value_info.append(info("l", shape))  # onnx infers no shape for a Loop's state
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_check_splits_the_mla_work_around_a_loop_that_reads_it_from_its_body() -> None:
    """One segment {conv1, relu, add, conv2} would both feed the Loop and wait for it."""
    report = check_model(_loop_between_convs(), "mlsoc")
    assert [s.nodes for s in report.segments] == [["conv1", "relu"], ["add", "conv2"]]


def test_check_of_the_quantized_loop_model_counts_the_same_segments() -> None:
    """The float view removes the Q/DQ pair of `seq`: the Loop body must read the float name."""
    qdq = quantize_on(_loop_between_convs(), "mlsoc")
    assert check_model(qdq, "mlsoc").mla_segments == 2


def test_a_loop_reading_mla_tensors_from_its_body_compiles_and_runs_bit_exact(tmp_path) -> None:
    qdq = quantize_on(_loop_between_convs(), "mlsoc")
    result = compile_model(qdq, tmp_path, model_name="loop")
    assert len(result.segments) == 2
    comparison = run_and_compare(result, qdq, {"x": input_frames(qdq, 1)["x"]})
    assert len(comparison.mla_stages) == 2 and comparison.bit_exact
