"""compile_model compiles for the target the model was quantized for unless told otherwise, and
says so when told a different one (the quantizer chose each node's precision for its target)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler.compile import compile_model
from compiler.quantize import quantize_model
from surgery.check import check_model
from surgery.model import load_model
from surgery.qdq import quantized_for
from surgery.verify import make_inputs


@pytest.fixture(scope="module")
def rk3588_qdq() -> onnx.ModelProto:
    weight = np.random.default_rng(0).normal(0, 0.3, (4, 4, 3, 3)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])],
        "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        [numpy_helper.from_array(weight, "w")],
    )
    model = load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]))
    samples = [make_inputs(model, seed=s) for s in range(2)]
    return quantize_model(model, samples, target="rk3588").model


def test_quantization_record_names_the_target(rk3588_qdq) -> None:
    assert quantized_for(rk3588_qdq) == "rk3588"


def test_compile_defaults_to_the_target_the_model_was_quantized_for(rk3588_qdq, tmp_path) -> None:
    result = compile_model(rk3588_qdq, tmp_path, model_name="conv")
    assert result.target == "rk3588"
    assert not result.notes


def test_compiling_for_another_target_is_noted(rk3588_qdq, tmp_path) -> None:
    result = compile_model(rk3588_qdq, tmp_path, model_name="conv", target="mlsoc")
    assert result.target == "mlsoc"
    assert any("quantized for rk3588" in note for note in result.notes)


def test_model_without_a_record_compiles_for_mlsoc(rk3588_qdq, tmp_path) -> None:
    bare = onnx.ModelProto()
    bare.CopyFrom(rk3588_qdq)
    del bare.metadata_props[:]
    assert quantized_for(bare) is None
    assert compile_model(bare, tmp_path, model_name="conv").target == "mlsoc"


def test_check_counts_a_quantized_model_on_the_target_it_was_quantized_for(rk3588_qdq) -> None:
    assert check_model(rk3588_qdq).target == "rk3588"
    assert check_model(rk3588_qdq, "mlsoc").target == "mlsoc"
