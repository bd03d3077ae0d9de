"""Einsum lowered to MATMUL (two operands) or REDUCE SUM / MOVE (one operand).

Three levels: the integer reference agrees with ONNX Runtime's float Einsum between the same
QuantizeLinear / DequantizeLinear nodes to within one output step; the emitted
instructions reproduce the reference kernel bit for bit in the emulator, for every kind of
index grouping; and on mlsoc whole Conv → Einsum → Conv models compile to exactly the segments
`surgery check` counts, bit-exact with the reference.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler.isa import MatMul, Move, Reduce, Space
from compiler.lower.codegen import Constants, Storage, emit_layer
from compiler.lower.fusion import Layer
from compiler.runtime.program import IntegerStep
from compiler.runtime.reference import IntegerExecutor
from surgery.check import check_model
from tests.test_compile_lowering_coverage import _compile_and_run
from tests.test_emulator_support import Codegen

LETTER_SIZES = {"b": 2, "h": 3, "i": 4, "j": 5, "d": 6, "n": 4, "c": 5, "k": 3, "w": 4, "q": 3}
"""Index sizes of the QDQ test models (distinct sizes catch a transposed axis)."""


def _sizes(term: str) -> list[int]:
    return [LETTER_SIZES.get(i, 2) for i in term]


def _quantize_weight(weight: np.ndarray, axis: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 codes and scales (per tensor, or per slice along `axis`)."""
    if axis is None:
        scale = np.float32(np.abs(weight).max() / 127)
        return np.round(weight / scale).astype(np.int8), np.asarray(scale, np.float32)
    others = tuple(a for a in range(weight.ndim) if a != axis)
    scale = (np.abs(weight).max(axis=others) / 127).astype(np.float32)
    shape = [1] * weight.ndim
    shape[axis] = -1
    return np.round(weight / scale.reshape(shape)).astype(np.int8), scale


def _qdq_einsum(
    equation: str,
    *,
    constant: int | None = None,
    weight_axis: int | None = None,
    seed: int = 0,
) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """A QDQ model of one Einsum: run-time operands are uint8 (zero point 128) graph inputs
    through Q / DQ, operand `constant` (if any) an int8 weight, the output int8 with a nonzero
    zero point sized from a float run. Returns the model and one float sample."""
    rng = np.random.default_rng(seed)
    lhs, out = equation.split("->")
    terms = lhs.split(",")
    nodes, inits, graph_inputs, feeds, operands = [], [], [], {}, []
    act_scale = numpy_helper.from_array(np.asarray(8 / 255, np.float32), "sx")
    act_zero = numpy_helper.from_array(np.asarray(128, np.uint8), "zx")
    inits += [act_scale, act_zero]
    for index, term in enumerate(terms):
        name = f"x{index}"
        value = rng.normal(0, 1, _sizes(term)).astype(np.float32)
        operands.append(value)
        if index == constant:
            codes, scale = _quantize_weight(value, weight_axis)
            operands[-1] = codes.astype(np.float32) * (
                scale if scale.ndim == 0 else _along(scale, weight_axis, codes.ndim)
            )
            inits += [
                numpy_helper.from_array(codes, f"{name}_q"),
                numpy_helper.from_array(scale, f"{name}_s"),
                numpy_helper.from_array(np.zeros(scale.shape, np.int8), f"{name}_z"),
            ]
            attrs = {"axis": weight_axis} if weight_axis is not None else {}
            nodes.append(
                helper.make_node(
                    "DequantizeLinear", [f"{name}_q", f"{name}_s", f"{name}_z"], [name], **attrs
                )
            )
            continue
        feeds[name] = value
        graph_inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, value.shape))
        nodes += [
            helper.make_node("QuantizeLinear", [name, "sx", "zx"], [f"{name}_q"]),
            helper.make_node("DequantizeLinear", [f"{name}_q", "sx", "zx"], [f"{name}_d"]),
        ]
    names = [f"x{i}" if i == constant else f"x{i}_d" for i in range(len(terms))]
    expected = np.einsum(equation, *operands)
    y_scale = np.float32(max(np.abs(expected).max(), 1e-3) / 120)
    inits += [
        numpy_helper.from_array(np.asarray(y_scale, np.float32), "sy"),
        numpy_helper.from_array(np.asarray(3, np.int8), "zy"),
    ]
    nodes += [
        helper.make_node("Einsum", names, ["e"], equation=equation),
        helper.make_node("QuantizeLinear", ["e", "sy", "zy"], ["e_q"]),
        helper.make_node("DequantizeLinear", ["e_q", "sy", "zy"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "einsum",
        graph_inputs,
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model, feeds


def _along(scale: np.ndarray, axis: int, ndim: int) -> np.ndarray:
    shape = [1] * ndim
    shape[axis] = -1
    return scale.reshape(shape)


EQUATIONS = [
    # (equation, constant operand, per-axis weight axis)
    ("bhid,bhjd->bhij", None, None),  # attention QK^T
    ("bqhd,bkhd->bhqk", None, None),  # batch indices in other positions
    ("bhqk,bkhd->bqhd", None, None),  # attention PV
    ("bnhd,hdc->bnc", 1, None),  # linear projection, two contracted indices merged
    ("bnhd,hdc->bnc", 1, 2),  # … with per-column weights
    ("bnhd,dhc->bnc", 1, None),  # … with the weight's h, d swapped: stored permuted
    ("nchw,kc->nkhw", 1, None),  # 1x1 conv as an einsum: three row indices
    ("kc,nchw->nkhw", 0, 0),  # constant first (swapped), per-axis along its column
    ("bchw,bchw->bhw", None, None),  # per-pixel dot product: no row, no column
    ("bchw,bchq->bwq", None, None),  # two run-time contracted indices, adjacent in both
    ("bi,bj->bij", None, None),  # outer product: no contracted index
    ("bij,bjk->bki", None, None),
    ("ij->ji", None, None),  # transposition: MOVE
    ("bij->bj", None, None),  # sum: REDUCE
    ("bij->jb", None, None),  # sum and transposition
]


@pytest.mark.parametrize(("equation", "constant", "axis"), EQUATIONS)
def test_integer_einsum_agrees_with_onnxruntime(equation, constant, axis) -> None:
    """The integer Einsum is the float one to within one output step (an exact tie may round
    the other way; on these models they agree exactly)."""
    model, feeds = _qdq_einsum(equation, constant=constant, weight_axis=axis)
    executor = IntegerExecutor(model)
    assert not executor.float_nodes, executor.float_nodes
    ours = executor.run(feeds)["y"]
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (theirs,) = session.run(["y"], feeds)
    step = float(numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "sy")))
    assert ours.shape == theirs.shape
    assert np.abs(ours - theirs).max() <= step * (1 + 1e-6)


def _einsum_step(executor: IntegerExecutor) -> IntegerStep:
    (step,) = [s for s in executor.steps if isinstance(s, IntegerStep)]
    return step


@pytest.mark.parametrize(("equation", "constant", "axis"), EQUATIONS)
def test_emitted_einsum_is_bit_exact_with_the_reference(equation, constant, axis) -> None:
    """emit_layer's MATMUL / REDUCE / MOVE on the emulator equals the reference kernel."""
    model, feeds = _qdq_einsum(equation, constant=constant, weight_axis=axis, seed=3)
    executor = IntegerExecutor(model)
    step = _einsum_step(executor)
    rng = np.random.default_rng(5)
    values = dict(executor._graph.constants)
    build = Codegen("einsum")
    storages: dict[str, Storage] = {}
    codes: dict[str, np.ndarray] = {}
    for name in step.inputs:
        if name in values:
            continue
        shape = feeds[name.removesuffix("_q")].shape
        codes[name] = rng.integers(0, 256, shape).astype(np.uint8)
        tensor = build.input(name, shape, "uint8")
        storages[name] = Storage(name, Space.DRAM, np.dtype(np.uint8), tensor.offset, shape, 1)
    expected = step.kernel(*(codes.get(n, values.get(n)) for n in step.inputs))
    (output,) = step.outputs
    tensor = build.output(output, expected.shape, expected.dtype)
    storages[output] = Storage(output, Space.DRAM, expected.dtype, tensor.offset, expected.shape, 1)
    constants = Constants()
    constants.pool = build.pool
    run_time = tuple(n for n in step.inputs if n in storages)
    layer = Layer(0, step.name, "einsum", step, run_time, step.outputs)
    build.layers.append(layer.name)
    instructions = emit_layer(layer, 0, storages, values, constants, 1)
    terms = equation.split("->")[0].split(",")
    summed = len(terms) == 1 and len(terms[0]) > len(equation.split("->")[1])
    kind = MatMul if len(terms) == 2 else Reduce if summed else Move
    assert [type(i) for i in instructions] == [kind]
    build.emit(*instructions)
    (result,) = build.run(codes).values()
    assert result.dtype == expected.dtype
    np.testing.assert_array_equal(result, expected)


def _conv_einsum_conv(
    equation: str, shapes: tuple[tuple[int, ...], ...], weight: np.ndarray | None
) -> onnx.ModelProto:
    """x → Conv → Reshape (and a second Conv → Reshape unless `weight` is B) → Einsum →
    Reshape → Conv: float model, quantized by the pipeline."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.5, (8, 4, 1, 1)).astype(np.float32), name)
        for name in ("w1", "w2")
    ]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"])]
    inits.append(numpy_helper.from_array(np.asarray(shapes[0], np.int64), "s1"))
    nodes.append(helper.make_node("Reshape", ["c1", "s1"], ["a"]))
    if weight is None:
        nodes.append(helper.make_node("Conv", ["x", "w2"], ["c2"]))
        inits.append(numpy_helper.from_array(np.asarray(shapes[1], np.int64), "s2"))
        nodes.append(helper.make_node("Reshape", ["c2", "s2"], ["b"]))
    else:
        inits.append(numpy_helper.from_array(weight.astype(np.float32), "b"))
    out_shape = shapes[-1]
    channels = out_shape[1]
    inits += [
        numpy_helper.from_array(np.asarray(out_shape, np.int64), "so"),
        numpy_helper.from_array(rng.normal(0, 0.5, (4, channels, 1, 1)).astype(np.float32), "w3"),
    ]
    nodes += [
        helper.make_node("Einsum", ["a", "b"], ["e"], equation=equation),
        helper.make_node("Reshape", ["e", "so"], ["r"]),
        helper.make_node("Conv", ["r", "w3"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "conv_einsum_conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


_WEIGHTS = np.random.default_rng(7)

MLSOC_MODELS = [
    # conv outputs (1, 8, 4, 4) viewed as the operands; the last shape views the result.
    # mlsoc's MLA takes 4-D tensors only, so every run-time operand and result is 4-D.
    ("bqhd,bkhd->bhqk", ((1, 8, 4, 4), (1, 8, 4, 4), (1, 4, 8, 8)), None),
    # linear projection: contracted h·d merged, two columns (c broadcast, e the MATMUL's N)
    ("bnhd,hdce->bnce", ((1, 8, 4, 4), (1, 8, 4, 4)), _WEIGHTS.normal(0, 0.3, (4, 4, 2, 8))),
    # a 1x1 convolution written as an einsum: rows n, h, w
    ("nchw,kc->nkhw", ((1, 8, 4, 4), (1, 6, 4, 4)), _WEIGHTS.normal(0, 0.3, (6, 8))),
    # two run-time operands, contracted c·h merged in both, two rows and two columns
    ("chij,chkl->ijkl", ((2, 4, 4, 4), (2, 4, 4, 4), (1, 16, 4, 4)), None),
    # batch, row and column indices interleaved
    ("bchw,bcvw->bhvw", ((1, 8, 4, 4), (1, 8, 4, 4), (1, 4, 4, 4)), None),
]


@pytest.mark.parametrize(("equation", "shapes", "weight"), MLSOC_MODELS)
def test_einsum_compiles_into_checks_segments_bit_exact(
    equation: str, shapes, weight, tmp_path
) -> None:
    model = _conv_einsum_conv(equation, shapes, weight)
    segments = check_model(model, target="mlsoc").mla_segments
    assert segments == 1
    assert _compile_and_run(model, tmp_path) == (segments, True)


def test_an_einsum_whose_contraction_no_view_merges_splits_the_segment(tmp_path) -> None:
    """c and h are contracted in opposite orders: merging them into one depth axis would need
    a copy, so check keeps the Einsum off the MLA (the two Conv branches before it and the Conv
    after it are three segments) and compile writes the .elf files check counts."""
    model = _conv_einsum_conv(
        "chij,hckl->ijkl", ((2, 4, 4, 4), (4, 2, 4, 4), (1, 16, 4, 4)), weight=None
    )
    report = check_model(model, target="mlsoc")
    einsum = next(p for p in report.placements if p.op_type == "Einsum")
    assert einsum.processor != "MLA" and "one run of axes" in einsum.reasons[-1].message
    assert report.mla_segments == 3
    assert _compile_and_run(model, tmp_path) == (3, True)
