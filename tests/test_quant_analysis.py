"""Per-layer error analysis: entire vs single error, identity cases, JSON layout."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler.api import load_model
from compiler.quantize import QuantizationError, quantize_model
from compiler.quantize.analysis import analyze_quantization_error, find_quantized_tensors


def conv_net() -> onnx.ModelProto:
    """x → conv1 → relu → conv2 → relu → conv3 (graph output)."""
    rng = np.random.default_rng(0)
    inits, nodes, prev = [], [], "x"
    for k, cin in enumerate((3, 8, 8), start=1):
        w = (rng.standard_normal((8, cin, 3, 3)) * 0.3).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"w{k}"))
        out = f"c{k}" if k == 3 else f"c{k}_raw"
        nodes.append(
            helper.make_node("Conv", [prev, f"w{k}"], [out], name=f"conv{k}", pads=[1] * 4)
        )
        if k < 3:
            nodes.append(helper.make_node("Relu", [out], [f"r{k}"], name=f"relu{k}"))
            prev = f"r{k}"
    graph = helper.make_graph(
        nodes,
        "convnet",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("c3", TensorProto.FLOAT, [1, 8, 8, 8])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


@pytest.fixture(scope="module")
def quantized(samples):
    return quantize_model(conv_net(), samples)


def test_layers_are_matched_to_float_tensors(quantized) -> None:
    pairs, unmatched = find_quantized_tensors(quantized.model, conv_net())
    assert {p.tensor for p in pairs} == {"x", "r1", "r2", "c3"}
    assert not unmatched
    assert {p.tensor: p.op_type for p in pairs}["r1"] == "Relu"


def test_entire_accumulates_single_isolates(quantized, samples) -> None:
    result = analyze_quantization_error(conv_net(), quantized.model, samples)
    by = {e.tensor: e for e in result.layers}
    # the input's pair sees only the input: both errors are the same
    assert by["x"].entire.cosine == pytest.approx(by["x"].single.cosine, abs=1e-9)
    # deeper layers carry upstream error in "entire" only
    assert by["c3"].entire.sqnr_db < by["c3"].single.sqnr_db - 1.0
    assert by["r2"].entire.euclidean > by["r2"].single.euclidean
    assert all(0.9 < e.single.cosine <= 1.0 for e in result.layers)
    singles = [e.single.cosine for e in result.layers]
    assert singles == sorted(singles)  # worst first
    assert result.outputs["c3"].cosine == pytest.approx(by["c3"].entire.cosine)
    json.dumps(result.to_dict(), allow_nan=False)
    assert result.to_dict()["layers"][0]["layer"].startswith("[")


def test_identical_models_have_cosine_one(samples) -> None:
    """A QDQ model whose Q/DQ pairs are exact (the float model with an added pair at 16 bits on
    an integer-valued input) scores cosine 1 everywhere; so does the float model vs itself."""
    model = conv_net()
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])
    qdq = onnx.ModelProto()
    qdq.CopyFrom(model)
    qdq.graph.initializer.extend(
        [
            numpy_helper.from_array(np.array(1.0, np.float32), "s"),
            numpy_helper.from_array(np.array(0, np.int8), "z"),
        ]
    )
    qdq.graph.node.insert(0, helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]))
    qdq.graph.node.insert(1, helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"]))
    qdq.graph.node[2].input[0] = "xd"
    assert x.name == "x"
    ints = [np.round(s * 10).clip(-120, 120).astype(np.float32) for s in samples]
    result = analyze_quantization_error(model, qdq, ints)
    (layer,) = result.layers
    assert layer.entire.cosine == 1.0 and layer.single.cosine == 1.0
    assert result.to_dict()["layers"][0]["entire"]["sqnr_db"] is None  # exact: infinite SQNR
    assert result.outputs["c3"].cosine == pytest.approx(1.0, abs=1e-12)


def test_model_method_and_errors(quantized, samples) -> None:
    from compiler.api import Model

    model = Model(quantized.model, "mlsoc", "convnet", quantized.params, quantized.report)
    result = model.analyze_quantization_error(samples, load_model(conv_net()), limit=2)
    assert result.samples == 2
    with pytest.raises(QuantizationError, match="no quantized activations"):
        analyze_quantization_error(conv_net(), conv_net(), samples)
