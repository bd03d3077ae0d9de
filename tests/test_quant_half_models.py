"""Half-precision exports (a GPU export with half=True, a bfloat16 checkpoint) quantize,
compile and run like float32 ones: the quantizer computes them in float32 (exact for their
weights), so the QDQ model and the archive take float32 tensors."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler.compile import compile_model
from compiler.quantize.prepare import float32_from_half, prepare_model
from surgery.check import check_model
from surgery.model import load_model
from surgery.rules.fix import fix_model
from tests.lower_support import quantize_on, run_and_compare

SHAPE = [1, 3, 16, 16]


def _half_cnn(elem_type: int = TensorProto.FLOAT16) -> onnx.ModelProto:
    """Conv → Relu → Conv → Cast to the half type → Sigmoid, weights and I/O in `elem_type`."""
    rng = np.random.default_rng(0)
    dtype = np.float16 if elem_type == TensorProto.FLOAT16 else np.float32

    def weight(name: str, *shape: int) -> onnx.TensorProto:
        values = rng.normal(0, 0.3, shape).astype(dtype)
        tensor = numpy_helper.from_array(values, name)
        if elem_type == TensorProto.BFLOAT16:
            tensor = helper.make_tensor(name, elem_type, shape, values.reshape(-1).tolist())
        return tensor

    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["a"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["a"], ["r"], name="relu"),
        helper.make_node("Conv", ["r", "w2"], ["c"], name="conv2"),
        helper.make_node("Cast", ["c"], ["h"], name="cast", to=elem_type),
        helper.make_node("Sigmoid", ["h"], ["y"], name="sigmoid"),
    ]
    graph = helper.make_graph(
        nodes,
        "half_cnn",
        [helper.make_tensor_value_info("x", elem_type, SHAPE)],
        [helper.make_tensor_value_info("y", elem_type, None)],
        [weight("w1", 8, 3, 3, 3), weight("b1", 8), weight("w2", 4, 8, 1, 1)],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("elem_type", [TensorProto.FLOAT16, TensorProto.BFLOAT16])
def test_half_model_becomes_float32_with_the_same_weights(elem_type) -> None:
    model = _half_cnn(elem_type)
    before = {t.name: numpy_helper.to_array(t).astype(np.float32) for t in model.graph.initializer}
    assert float32_from_half(model.graph)
    after = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    assert all(after[name].dtype == np.float32 for name in after)
    assert all(np.array_equal(before[name], after[name]) for name in before)
    assert model.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT
    assert next(a.i for a in model.graph.node[3].attribute if a.name == "to") == TensorProto.FLOAT


def test_float32_model_is_left_as_it_is() -> None:
    model = _half_cnn(TensorProto.FLOAT)
    original = model.SerializeToString()
    assert not float32_from_half(model.graph)
    assert model.SerializeToString() == original


def test_prepared_half_model_computes_the_float32_model() -> None:
    prepared = prepare_model(_half_cnn()).model
    assert prepared.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT
    assert not any(
        t.data_type in (TensorProto.FLOAT16, TensorProto.BFLOAT16)
        for t in prepared.graph.initializer
    )


def test_float16_model_fixes_quantizes_compiles_and_runs_bit_exact(tmp_path) -> None:
    model = fix_model(load_model(_half_cnn()), "mlsoc").model  # drops the no-op Cast
    assert check_model(model, "mlsoc", suggest=False).mla_segments == 1
    assert model.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT16
    qdq = quantize_on(model, "mlsoc")
    assert qdq.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT
    result = compile_model(qdq, tmp_path, target="mlsoc", model_name="half_cnn")
    assert len(result.elf_files) == 1, result.notes
    feed = {"x": np.random.default_rng(3).random(SHAPE, dtype=np.float32)}
    comparison = run_and_compare(result, qdq, feed)
    assert comparison.mla_stages and comparison.bit_exact
