"""GridSample on the MLA's bf16 sampling unit: the float32 sampling against ONNX Runtime, the
GRID_SAMPLE_BF16 instruction against the reference kernel, and the QDQ pattern (bf16 Cast pairs,
as the quantizer writes them for modalix) against ONNX Runtime running the QDQ model."""

from __future__ import annotations

import itertools

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler.intmath import bf16_round, grid_sample_float32
from compiler.isa import GridSampleBf16, SampleMode, SamplePadding, Space, float32_bits
from compiler.runtime import IntegerExecutor
from compiler.runtime.emulator_ops import EmulatorError
from compiler.runtime.ops.base import OpContext
from compiler.runtime.ops.grid_sample import GridSampleKernel, lower_grid_sample
from compiler.runtime.qparams import NotLowerable, QuantOperand
from tests.test_emulator_support import Codegen, qparams, random_codes, run_single
from tests.test_reference_support import ort_run, steps_apart

SAMPLINGS = list(
    itertools.product(["nearest", "bilinear"], ["zeros", "border", "reflection"], [0, 1])
)


def _float_model(shape: tuple, grid_shape: tuple, opset: int = 16, **attributes) -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("GridSample", ["x", "grid"], ["y"], **attributes)],
        "grid_sample",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape)),
            helper.make_tensor_value_info("grid", TensorProto.FLOAT, list(grid_shape)),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 9
    return model


@pytest.mark.parametrize(("mode", "padding", "align_corners"), SAMPLINGS)
@pytest.mark.parametrize("size", [(5, 7), (1, 4), (6, 1)])
def test_the_float32_sampling_is_onnx_runtimes(mode, padding, align_corners, size) -> None:
    """Same operations in the same order: equal to ONNX Runtime's kernel up to an ulp or two
    (grid points well outside the image exercise every padding rule)."""
    rng = np.random.default_rng(0)
    x = bf16_round(rng.normal(0, 2, (2, 3, *size)))
    grid = bf16_round(rng.uniform(-2.5, 2.5, (2, 4, 6, 2)))
    attributes = {"mode": mode, "padding_mode": padding, "align_corners": align_corners}
    theirs = ort_run(_float_model(x.shape, grid.shape, **attributes), {"x": x, "grid": grid})["y"]
    ours = grid_sample_float32(x, grid, mode, padding, bool(align_corners))
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=4e-7 * np.abs(x).max())


def _kernel(mode: str, padding: str, align_corners: int, dtype: str = "int8") -> GridSampleKernel:
    ctx = OpContext(
        node=helper.make_node(
            "GridSample",
            ["x", "grid"],
            ["y"],
            mode=mode,
            padding_mode=padding,
            align_corners=align_corners,
        ),
        opset=16,
        mode="sima",
        inputs=(
            QuantOperand("x", qparams(0.05, 3, dtype), None),
            QuantOperand("grid", qparams(1.3 / 127, 0), None),
        ),
        outputs=(qparams(0.04, -2),),
    )
    kernel = lower_grid_sample(ctx).kernel
    assert isinstance(kernel, GridSampleKernel)
    return kernel


def _program(kernel: GridSampleKernel, x: np.ndarray, grid: np.ndarray) -> Codegen:
    """The GRID_SAMPLE_BF16 codegen writes: an HWC DRAM image, an arena grid."""
    build = Codegen()
    n, c = x.shape[:2]
    build.emit(
        GridSampleBf16(
            mode=SampleMode.NEAREST if kernel.mode == "nearest" else SampleMode.BILINEAR,
            padding=SamplePadding[kernel.padding.upper()],
            input=build.input("x", x.shape, x.dtype, Space.DRAM, "HWC"),
            grid=build.input("grid", grid.shape, grid.dtype, Space.ARENA),
            output=build.output("y", (n, c, *grid.shape[1:3]), "int8", Space.ARENA),
            align_corners=int(kernel.align_corners),
            input_zero_point=kernel.input_zero_point,
            input_scale=float32_bits(kernel.input_scale),
            grid_zero_point=kernel.grid_zero_point,
            grid_scale=float32_bits(kernel.grid_scale),
            output_scale=float32_bits(kernel.output_scale),
            output_zero_point=kernel.zero_point,
            low=kernel.low,
            high=kernel.high,
        )
    )
    return build


@pytest.mark.parametrize(("mode", "padding", "align_corners"), SAMPLINGS)
@pytest.mark.parametrize("dtype", ["int8", "uint8", "int16"])
def test_the_instruction_matches_the_reference_kernel(mode, padding, align_corners, dtype) -> None:
    rng = np.random.default_rng(len(dtype) + align_corners)
    shape = tuple(int(v) for v in rng.integers(1, 7, 4))
    kernel = _kernel(mode, padding, align_corners, dtype)
    x = random_codes(rng, shape, dtype)
    grid = random_codes(rng, (shape[0], 3, 5, 2), "int8")
    run_single(_program(kernel, x, grid), {"x": x, "grid": grid}, kernel(x, grid).astype(np.int8))


def test_the_emulator_rejects_a_grid_of_another_batch() -> None:
    rng = np.random.default_rng(4)
    kernel = _kernel("bilinear", "zeros", 0)
    x, grid = random_codes(rng, (2, 3, 4, 4), "int8"), random_codes(rng, (1, 3, 5, 2), "int8")
    with pytest.raises(EmulatorError, match="GRID_SAMPLE_BF16"):
        _program(kernel, x, grid).run({"x": x, "grid": grid})


@pytest.mark.parametrize("mode", ["bicubic", "cubic"])
def test_cubic_sampling_stays_on_the_host(mode: str) -> None:
    with pytest.raises(NotLowerable, match="nearest or bilinear"):
        _kernel(mode, "zeros", 0)


def _qdq_grid_sample(casts: bool, **attributes) -> onnx.ModelProto:
    """x, grid → Q → DQ [→ Cast(bf16) → Cast(float)] → GridSample [→ Cast(bf16) → Cast(float)]
    → Q → DQ → y: the quantizer's bf16 pattern (modalix), or plain QDQ."""
    scales = {"x": (0.05, 3), "grid": (1.3 / 127, 0), "y": (0.04, -2)}
    inits = []
    for name, (scale, zero_point) in scales.items():
        inits.append(numpy_helper.from_array(np.array(scale, np.float32), f"{name}_s"))
        inits.append(numpy_helper.from_array(np.array(zero_point, np.int8), f"{name}_z"))
    nodes = []
    read = {}
    for name in ("x", "grid"):
        nodes += [
            helper.make_node("QuantizeLinear", [name, f"{name}_s", f"{name}_z"], [f"{name}_q"]),
            helper.make_node(
                "DequantizeLinear", [f"{name}_q", f"{name}_s", f"{name}_z"], [f"{name}_d"]
            ),
        ]
        read[name] = f"{name}_d"
        if casts:
            nodes += [
                helper.make_node("Cast", [f"{name}_d"], [f"{name}_b"], to=TensorProto.BFLOAT16),
                helper.make_node("Cast", [f"{name}_b"], [f"{name}_f"], to=TensorProto.FLOAT),
            ]
            read[name] = f"{name}_f"
    nodes.append(
        helper.make_node("GridSample", [read["x"], read["grid"]], ["s"], "sample", **attributes)
    )
    sampled = "s"
    if casts:
        nodes += [
            helper.make_node("Cast", ["s"], ["s_b"], to=TensorProto.BFLOAT16),
            helper.make_node("Cast", ["s_b"], ["s_f"], to=TensorProto.FLOAT),
        ]
        sampled = "s_f"
    nodes += [
        helper.make_node("QuantizeLinear", [sampled, "y_s", "y_z"], ["y_q"]),
        helper.make_node("DequantizeLinear", ["y_q", "y_s", "y_z"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "qdq_grid_sample",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 6, 7]),
            helper.make_tensor_value_info("grid", TensorProto.FLOAT, [2, 5, 4, 2]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)])
    model.ir_version = 9
    return model


@pytest.mark.parametrize(("mode", "padding", "align_corners"), SAMPLINGS)
def test_the_bf16_pattern_is_one_step_within_one_step_of_onnx_runtime(
    mode, padding, align_corners
) -> None:
    """The Cast pairs become part of the step (they run nowhere), and the integer program is
    ONNX Runtime's QDQ simulation up to float32 rounding of the sampled value."""
    model = _qdq_grid_sample(True, mode=mode, padding_mode=padding, align_corners=align_corners)
    executor = IntegerExecutor(model, strict=True)
    assert executor.float_nodes == ()
    assert [s.pattern for s in executor.steps if s.name == "sample"] == ["GridSample(bf16)"]
    rng = np.random.default_rng(7)
    feeds = [
        {
            "x": rng.normal(0, 2, (2, 3, 6, 7)).astype(np.float32),
            "grid": rng.uniform(-1.25, 1.25, (2, 5, 4, 2)).astype(np.float32),
        }
        for _ in range(3)
    ]
    assert steps_apart(executor, model, feeds)["y"] <= 1


def test_plain_qdq_grid_sample_runs_on_the_same_unit() -> None:
    """Without Casts (no integer form) the node still is one step on the bf16 unit: within one
    step of the float op except where the bf16 roundings move the value past a rounding tie."""
    model = _qdq_grid_sample(False)
    executor = IntegerExecutor(model, strict=True)
    assert [s.pattern for s in executor.steps if s.name == "sample"] == ["GridSample"]
    rng = np.random.default_rng(8)
    feeds = [
        {
            "x": rng.normal(0, 2, (2, 3, 6, 7)).astype(np.float32),
            "grid": rng.uniform(-1, 1, (2, 5, 4, 2)).astype(np.float32),
        }
    ]
    assert steps_apart(executor, model, feeds)["y"] <= 2
