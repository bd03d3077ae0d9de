"""A graph input read by both an fp16 op and an int8 op (rk3588: LayerNorm in fp16, the
residual Add in int8) is quantized once; the fp16 reader's Cast pair follows its DequantizeLinear,
so every reader starts from the same integer codes and the MLA runs all of them."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from compiler.compile import compile_model
from surgery.check import check_model
from surgery.model import load_model
from surgery.verify import make_inputs
from tests.lower_support import quantize_on, run_and_compare


def _norm_and_residual() -> onnx.ModelProto:
    """x → LayerNormalization → Add(x, ·) → Conv: x has an fp16 and an int8 reader."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(np.ones(8, np.float32), "gamma"),
        numpy_helper.from_array(np.zeros(8, np.float32), "beta"),
        numpy_helper.from_array(rng.normal(0, 0.3, (4, 4, 1, 1)).astype(np.float32), "w"),
    ]
    nodes = [
        helper.make_node("LayerNormalization", ["x", "gamma", "beta"], ["ln"], axis=-1),
        helper.make_node("Add", ["x", "ln"], ["s"]),
        helper.make_node("Conv", ["s", "w"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "norm_and_residual",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        inits,
    )
    return load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def _producer_op(model: onnx.ModelProto, tensor: str) -> str:
    return next(n.op_type for n in model.graph.node if tensor in n.output)


def test_input_with_an_fp16_and_an_int8_reader_is_quantized_once() -> None:
    qdq = quantize_on(_norm_and_residual(), "rk3588")
    readers = {n.op_type: n for n in qdq.graph.node if n.op_type in ("Add", "LayerNormalization")}
    add_input = readers["Add"].input[0]
    assert _producer_op(qdq, add_input) == "DequantizeLinear"
    cast_back = next(
        n for n in qdq.graph.node if readers["LayerNormalization"].input[0] in n.output
    )
    cast = next(n for n in qdq.graph.node if cast_back.input[0] in n.output)
    assert (cast_back.op_type, cast.op_type) == ("Cast", "Cast")
    assert cast.input[0] == add_input


def test_input_with_mixed_readers_compiles_to_checks_segments_on_the_mla(tmp_path) -> None:
    model = _norm_and_residual()
    qdq = quantize_on(model, "rk3588")
    result = compile_model(qdq, tmp_path, model_name="mixed")
    assert len(result.elf_files) == check_model(model, "rk3588").mla_segments == 1
    assert not result.notes, result.notes
    feed = make_inputs(model, seed=7)
    comparison = run_and_compare(result, qdq, feed)
    assert comparison.mla_stages and comparison.bit_exact
