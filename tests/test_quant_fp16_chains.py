"""Two fp16-only ops in a row (rk3588: a LayerNorm whose output feeds another LayerNorm, as in
SegFormer's patch-embed norm before the block norm or CLIP's ln_pre before ln_1). The MLA runs
each norm int8 in / int8 out with fp16 inside, so the tensor between them is still quantized:
the second norm reads Q → DQ → Cast pair, and the whole chain stays in one MLA segment."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from compiler.compile import compile_model
from surgery.check import check_model
from surgery.model import load_model
from surgery.verify import make_inputs
from tests.lower_support import quantize_on, run_and_compare


def _two_norms() -> onnx.ModelProto:
    """Conv → LayerNormalization → LayerNormalization → Add(first norm, ·) → Conv."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.3, (8, 4, 1, 1)).astype(np.float32), "w1"),
        numpy_helper.from_array((1 + rng.normal(0, 0.1, 8)).astype(np.float32), "gamma"),
        numpy_helper.from_array(rng.normal(0, 0.1, 8).astype(np.float32), "beta"),
        numpy_helper.from_array(rng.normal(0, 0.3, (4, 8, 1, 1)).astype(np.float32), "w2"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c"]),
        helper.make_node("LayerNormalization", ["c", "gamma", "beta"], ["n1"], axis=1),
        helper.make_node("LayerNormalization", ["n1", "gamma", "beta"], ["n2"], axis=1),
        helper.make_node("Add", ["n1", "n2"], ["s"]),
        helper.make_node("Conv", ["s", "w2"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "two_norms",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        inits,
    )
    return load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def _first_non_cast_reader(model: onnx.ModelProto, tensor: str) -> list[str]:
    """The op types that read `tensor`, looking through Cast nodes."""
    readers = [n for n in model.graph.node if tensor in n.input]
    found: list[str] = []
    for reader in readers:
        if reader.op_type == "Cast":
            found.extend(_first_non_cast_reader(model, reader.output[0]))
        else:
            found.append(reader.op_type)
    return found


def test_a_norm_reading_a_norm_reads_integer_codes() -> None:
    qdq = quantize_on(_two_norms(), "rk3588")
    norms = [n for n in qdq.graph.node if n.op_type == "LayerNormalization"]
    assert len(norms) == 2
    for norm in norms:
        assert _first_non_cast_reader(qdq, norm.output[0]) == ["QuantizeLinear"]


def test_a_chain_of_fp16_norms_compiles_to_one_segment_bit_exact(tmp_path) -> None:
    model = _two_norms()
    qdq = quantize_on(model, "rk3588")
    result = compile_model(qdq, tmp_path, target="rk3588", model_name="two_norms")
    assert len(result.elf_files) == check_model(model, "rk3588").mla_segments == 1, result.notes
    feed = make_inputs(model, seed=7)
    comparison = run_and_compare(result, qdq, feed)
    assert comparison.mla_stages and comparison.mla_bit_exact


def _norm_with_a_host_reader() -> onnx.ModelProto:
    """Conv → LayerNormalization, read by a Conv on the MLA and by a rank-3 Reshape to a graph
    output (a host op on rk3588), as BERT's last norm feeds both the pooler and the output."""
    rng = np.random.default_rng(1)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.3, (8, 4, 1, 1)).astype(np.float32), "w1"),
        numpy_helper.from_array((1 + rng.normal(0, 0.1, 8)).astype(np.float32), "gamma"),
        numpy_helper.from_array(rng.normal(0, 0.1, 8).astype(np.float32), "beta"),
        numpy_helper.from_array(rng.normal(0, 0.3, (4, 8, 1, 1)).astype(np.float32), "w2"),
        numpy_helper.from_array(np.array([1, 8, 64], np.int64), "rows"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c"]),
        helper.make_node("LayerNormalization", ["c", "gamma", "beta"], ["n"], axis=1),
        helper.make_node("Conv", ["n", "w2"], ["y"]),
        helper.make_node("Reshape", ["n", "rows"], ["seq"]),
    ]
    graph = helper.make_graph(
        nodes,
        "norm_host_reader",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8]),
            helper.make_tensor_value_info("seq", TensorProto.FLOAT, [1, 8, 64]),
        ],
        inits,
    )
    return load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def test_a_host_reader_of_an_fp16_norm_reads_its_integer_output(tmp_path) -> None:
    """The norm hands int8 codes to every reader, a float host op included: its fp16 output goes
    through one QuantizeLinear, so compile keeps it on the MLA (.elf == check)."""
    model = _norm_with_a_host_reader()
    qdq = quantize_on(model, "rk3588")
    (norm,) = [n for n in qdq.graph.node if n.op_type == "LayerNormalization"]
    assert _first_non_cast_reader(qdq, norm.output[0]) == ["QuantizeLinear"]
    reshape = next(n for n in qdq.graph.node if n.op_type == "Reshape")
    producer = next(n for n in qdq.graph.node if reshape.input[0] in n.output)
    assert producer.op_type == "DequantizeLinear"
    result = compile_model(qdq, tmp_path, target="rk3588", model_name="norm_host_reader")
    assert len(result.elf_files) == check_model(model, "rk3588").mla_segments == 1, result.notes
    feed = make_inputs(model, seed=7)
    comparison = run_and_compare(result, qdq, feed)
    assert comparison.mla_stages and comparison.mla_bit_exact
