"""ArgMax over int8 codes: the integer lowering (`ArgMaxKernel`), the REDUCE ARGMAX /
ARGMAX_LAST instruction and the float op (ONNX's reference ArgMax of the dequantized input)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from compiler.isa import Reduce, ReduceOp, Requant, Space
from compiler.quantize import quantize_model
from compiler.runtime import IntegerExecutor
from compiler.runtime.emulator_ops import EmulatorError
from compiler.runtime.ops.base import OpContext
from compiler.runtime.ops.reduce import ArgMaxKernel, lower_argmax
from compiler.runtime.qparams import NotLowerable, QuantOperand
from tests.test_emulator_support import Codegen, qparams, random_codes, run_single
from tests.test_reference_support import float_model, random_feeds

SEEDS = st.integers(0, 2**32 - 1)


def _lowered(scale: float = 0.05, **attributes) -> ArgMaxKernel:
    ctx = OpContext(
        node=helper.make_node("ArgMax", ["x"], ["y"], **attributes),
        opset=13,
        mode="sima",
        inputs=(QuantOperand("x", qparams(scale, 3), None),),
        outputs=(None,),
    )
    return lower_argmax(ctx).kernel


def _onnx_argmax(x: np.ndarray, **attributes) -> np.ndarray:
    node = helper.make_node("ArgMax", ["x"], ["y"], **attributes)
    (result,) = ReferenceEvaluator(node).run(None, {"x": x})
    return result


def _reduce(build: Codegen, kernel: ArgMaxKernel, x: np.ndarray, out_dtype: str) -> Reduce:
    """The REDUCE that codegen writes for `kernel`; the output may drop the reduced axis."""
    axis = kernel.axis % x.ndim
    shape = list(x.shape)
    shape[axis] = 1
    if not kernel.keepdims:
        del shape[axis]
    return Reduce(
        op=ReduceOp.ARGMAX_LAST if kernel.select_last else ReduceOp.ARGMAX,
        input=build.input("x", x.shape, x.dtype, Space.DRAM, "HWC" if x.ndim == 4 else "NCHW"),
        output=build.output("y", shape, out_dtype, Space.ARENA),
        axes=1 << axis,
    )


@settings(max_examples=40, deadline=None)
@given(
    shape=st.lists(st.integers(1, 6), min_size=1, max_size=4),
    data=st.data(),
    keepdims=st.booleans(),
    select_last=st.booleans(),
    dtype=st.sampled_from(["int8", "uint8", "int16"]),
    seed=SEEDS,
)
def test_emulator_and_reference_match_onnx(
    shape: list, data: st.DataObject, keepdims: bool, select_last: bool, dtype: str, seed: int
) -> None:
    """Codes drawn from a few values, so ties (where select_last_index matters) are common."""
    rng = np.random.default_rng(seed)
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    attributes = {"axis": axis, "keepdims": int(keepdims), "select_last_index": int(select_last)}
    kernel = _lowered(**attributes)
    x = random_codes(rng, shape, dtype) // 64
    expected = kernel(x)
    assert expected.dtype == np.int64
    np.testing.assert_array_equal(expected, _onnx_argmax(x.astype(np.float32) * 0.05, **attributes))
    build = Codegen()
    build.emit(_reduce(build, kernel, x, "int64"))
    run_single(build, {"x": x}, expected)


def test_indices_may_be_written_as_int32() -> None:
    """The mlsoc hardware writes int32 indices; the instruction allows both widths."""
    rng = np.random.default_rng(2)
    kernel = _lowered(axis=1)
    x = random_codes(rng, (2, 5, 3, 4), "int8")
    build = Codegen()
    build.emit(_reduce(build, kernel, x, "int32"))
    run_single(build, {"x": x}, kernel(x).astype(np.int32))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"axes": 0b0110}, "one axis"),
        ({"requant": Requant(1 << 30, 0, 0, -128, 127, "sima")}, "no output stage"),
        ({"output_dtype": "int8"}, "int32 or int64"),
    ],
)
def test_the_emulator_rejects_malformed_argmax(change: dict, message: str) -> None:
    rng = np.random.default_rng(3)
    x = random_codes(rng, (1, 4, 3, 3), "int8")
    build = Codegen()
    instruction = _reduce(build, _lowered(axis=1), x, change.pop("output_dtype", "int64"))
    build.emit(replace(instruction, **change))
    with pytest.raises(EmulatorError, match=message):
        build.run({"x": x})


def test_a_non_positive_scale_is_not_lowerable() -> None:
    """Codes order the reals only when the scale is positive."""
    with pytest.raises(NotLowerable, match="positive"):
        _lowered(scale=-0.05, axis=1)


def test_the_quantized_model_keeps_argmax_integer_and_agrees_with_float() -> None:
    """Our quantizer leaves the int64 output unquantized; the executor lowers the op (no float
    island) and its indices equal ArgMax of the dequantized input."""
    rng = np.random.default_rng(9)
    node = helper.make_node("ArgMax", ["x"], ["y"], axis=1, select_last_index=1)
    model = float_model([node], {"x": (1, 6, 5, 5)}, ["y"], opset=13)
    model.graph.output[0].type.tensor_type.elem_type = TensorProto.INT64
    feeds = random_feeds(model, rng, 6)
    qdq = quantize_model(model, feeds[:4], target="rk3588").model
    executor = IntegerExecutor(qdq, strict=True, keep_intermediates=True)
    assert executor.float_nodes == ()
    (quantized,) = [n.output[0] for n in qdq.graph.node if n.op_type == "QuantizeLinear"]
    for feed in feeds[4:]:
        indices = executor.run(feed)["y"]
        params = executor.tensor_params[quantized]
        reals = (executor.intermediates[quantized].astype(np.float32) - params.zero_point) * (
            params.scale
        )
        np.testing.assert_array_equal(indices, _onnx_argmax(reals, axis=1, select_last_index=1))
