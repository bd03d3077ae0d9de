"""QuickGelu (ONNX Runtime's contrib op, domain com.microsoft): x·sigmoid(alpha·x) as a lookup
table (`LookupKernel`, the LUT instruction), like Swish and Gelu."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler.intmath import quantize_linear
from compiler.isa import Lut, Space
from compiler.lower.partition import partition_model
from compiler.runtime import IntegerExecutor
from compiler.runtime.lowering import QdqGraph, match_node
from compiler.runtime.ops.base import OpContext
from compiler.runtime.ops.lut import LookupKernel, lower_unary
from compiler.runtime.qparams import NotLowerable, QuantOperand
from tests.test_emulator_support import Codegen, qparams, random_codes, run_single
from tests.test_reference_support import ort_run, steps_apart

MICROSOFT = "com.microsoft"


def _node(domain: str = MICROSOFT, **attributes) -> onnx.NodeProto:
    return helper.make_node("QuickGelu", ["x"], ["y"], domain=domain, **attributes)


def _kernel(
    input_scale: float, zero_point: int, dtype: str, output: tuple[float, int, str], **attributes
) -> LookupKernel:
    ctx = OpContext(
        node=_node(**attributes),
        opset=17,
        mode="sima",
        inputs=(QuantOperand("x", qparams(input_scale, zero_point, dtype), None),),
        outputs=(qparams(*output),),
    )
    kernel = lower_unary(ctx).kernel
    assert isinstance(kernel, LookupKernel)
    return kernel


def _float_quick_gelu(x: np.ndarray, **attributes) -> np.ndarray:
    """ONNX Runtime's own QuickGelu kernel on float32 `x`."""
    graph = helper.make_graph(
        [_node(**attributes)],
        "quick_gelu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(x.shape))],
    )
    model = helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MICROSOFT, 1)],
    )
    model.ir_version = 9
    return ort_run(model, {"x": x})["y"]


@pytest.mark.parametrize("attributes", [{}, {"alpha": 1.0}, {"alpha": 2.5}])
@pytest.mark.parametrize(("dtype", "zero_point"), [("int8", 3), ("uint8", 120), ("int16", 0)])
def test_every_table_entry_is_onnx_runtimes_quick_gelu_rounded(
    attributes: dict, dtype: str, zero_point: int
) -> None:
    """Each entry is the float op on the dequantized code, quantized: at most one step from
    ONNX Runtime's float32 QuickGelu (ours is float64), and the default alpha is 1.702."""
    scale = 8.0 / np.iinfo(dtype).max
    output = (0.03, -100, "int8")
    kernel = _kernel(scale, zero_point, dtype, output, **attributes)
    info = np.iinfo(dtype)
    codes = np.arange(info.min, int(info.max) + 1).astype(dtype)
    real = ((codes.astype(np.int64) - zero_point) * np.float32(scale)).astype(np.float32)
    expected = quantize_linear(
        _float_quick_gelu(real, **attributes),
        np.float32(output[0]),
        np.int64(output[1]),
        np.dtype(output[2]),
    )
    differences = np.abs(kernel(codes).astype(np.int64) - expected)
    assert differences.max() <= 1
    assert np.count_nonzero(differences) <= codes.size // 100


@pytest.mark.parametrize(
    ("dtype", "out_dtype"), [("int8", "int8"), ("uint8", "uint8"), ("int16", "int16")]
)
def test_the_lut_instruction_runs_the_table_bit_exact(dtype: str, out_dtype: str) -> None:
    rng = np.random.default_rng(3)
    zero_point = 128 if dtype == "uint8" else 0
    out_zero_point = 30 if out_dtype == "uint8" else -5
    kernel = _kernel(0.04, zero_point, dtype, (0.02, out_zero_point, out_dtype))
    x = random_codes(rng, (1, 5, 6, 7), dtype)
    build = Codegen()
    build.emit(
        Lut(
            input=build.input("x", x.shape, dtype, Space.DRAM, "HWC"),
            table=build.const(kernel.table, out_dtype),
            output=build.output("y", x.shape, out_dtype, Space.ARENA),
        )
    )
    run_single(build, {"x": x}, kernel(x))


def _qdq_quick_gelu(domain: str = MICROSOFT, *, conv_after: bool = False) -> onnx.ModelProto:
    """x → Q → DQ → QuickGelu → Q → DQ → y, as a quantizer writes it around an MLA op; with
    `conv_after`, a 1×1 Conv (int8 weights behind a DQ) reads the result."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.integers(-9, 9, (4, 4, 1, 1)).astype(np.int8), "w"),
        numpy_helper.from_array(np.array(0.05, np.float32), "w_scale"),
    ]
    for name, (scale, zero_point) in {"x": (0.03, 4), "p": (0.02, -90), "c": (0.1, 0)}.items():
        inits.append(numpy_helper.from_array(np.array(scale, np.float32), f"{name}_scale"))
        inits.append(numpy_helper.from_array(np.array(zero_point, np.int8), f"{name}_zp"))
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zp"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "x_scale", "x_zp"], ["xd"]),
        helper.make_node("QuickGelu", ["xd"], ["p"], "gelu", domain=domain, alpha=1.702),
        helper.make_node("QuantizeLinear", ["p", "p_scale", "p_zp"], ["pq"]),
        helper.make_node(
            "DequantizeLinear", ["pq", "p_scale", "p_zp"], ["pd" if conv_after else "y"]
        ),
    ]
    if conv_after:
        nodes += [
            helper.make_node("DequantizeLinear", ["w", "w_scale"], ["wd"]),
            helper.make_node("Conv", ["pd", "wd"], ["c"], "conv"),
            helper.make_node("QuantizeLinear", ["c", "c_scale", "c_zp"], ["cq"]),
            helper.make_node("DequantizeLinear", ["cq", "c_scale", "c_zp"], ["y"]),
        ]
    graph = helper.make_graph(
        nodes,
        "qdq_quick_gelu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4, 6, 6])],
        [i for i in inits if conv_after or not i.name.startswith(("w", "c_"))],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(domain, 1)]
    )
    model.ir_version = 9
    return model


def test_a_quantized_quick_gelu_is_one_integer_step_within_one_step_of_onnx_runtime() -> None:
    model = _qdq_quick_gelu()
    executor = IntegerExecutor(model, strict=True)
    assert executor.float_nodes == ()
    rng = np.random.default_rng(5)
    feeds = [{"x": (2 * rng.standard_normal((2, 4, 6, 6))).astype(np.float32)} for _ in range(3)]
    assert steps_apart(executor, model, feeds)["y"] <= 1


def test_a_quick_gelu_of_another_domain_stays_in_float() -> None:
    """Only ONNX Runtime's contrib op is known to be x·sigmoid(alpha·x); a custom op of the same
    name elsewhere may compute anything."""
    graph = QdqGraph(_qdq_quick_gelu("my.custom.ops"))
    node = next(n for n in graph.nodes if n.op_type == "QuickGelu")
    with pytest.raises(NotLowerable, match="my.custom.ops.QuickGelu has no integer"):
        match_node(graph, node, "sima")


def test_the_partition_carries_shapes_through_quick_gelu() -> None:
    """onnx's shape inference does not know the contrib op; the compiler's partition gives its
    output the input's type, so the Conv after it has a 4-D input on the MLA."""
    partition = partition_model(_qdq_quick_gelu(conv_after=True), "mlsoc")
    shapes = {
        v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
        for v in partition.model.graph.value_info
    }
    assert shapes["p"] == [2, 4, 6, 6]
    conv = next(p for p in partition.coverage.placements if p.name == "conv")
    assert conv.processor == "MLA", conv.reasons
