"""Whole programs: a QDQ model's integer steps, hand-lowered, run bit-exactly; bad plans show.

The test codegen here maps the reference executor's own step kernels (what the compiler
receives) to instructions, so the emulator is checked against `IntegerExecutor.run_integer`,
the specification, on a model quantized by ONNX Runtime. It also shows that a wrong memory plan
gives wrong numbers, and exercises the cost model.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from onnx import helper

from compiler.costmodel import MlaHardware, instruction_cost, stall_aware_schedule
from compiler.intmath import quantize_multiplier
from compiler.isa import (
    Conv,
    Eltwise,
    EltwiseOp,
    Instruction,
    Load,
    Lut,
    MatMul,
    Pool,
    PoolOp,
    Requant,
    Space,
    Store,
    Tensor,
)
from compiler.runtime import IntegerExecutor
from compiler.runtime.emulator import POISON, Emulator, EmulatorError
from compiler.runtime.ops.conv import ConvKernel
from compiler.runtime.ops.elementwise import AddKernel
from compiler.runtime.ops.geometry import resolve_pads
from compiler.runtime.ops.lut import LookupKernel
from compiler.runtime.ops.pool import GlobalAveragePoolKernel, MaxPoolKernel
from compiler.runtime.program import DequantizeStep, IntegerStep, QuantizeStep
from tests.test_emulator_support import Codegen, random_codes
from tests.test_reference_support import float_model, ort_quantize, random_feeds


@pytest.fixture(scope="module")
def small_cnn() -> IntegerExecutor:
    """conv-relu -> maxpool -> conv -> add(residual) -> sigmoid -> global average pool."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "w2", "b2"], ["c2"]),
        helper.make_node("Add", ["c2", "p1"], ["a1"]),
        helper.make_node("Sigmoid", ["a1"], ["s1"]),
        helper.make_node("GlobalAveragePool", ["s1"], ["y"]),
    ]
    initializers = {
        "w1": (0.3 * rng.standard_normal((8, 3, 3, 3))).astype(np.float32),
        "b1": (0.1 * rng.standard_normal(8)).astype(np.float32),
        "w2": (0.3 * rng.standard_normal((8, 8, 1, 1))).astype(np.float32),
        "b2": (0.1 * rng.standard_normal(8)).astype(np.float32),
    }
    model = float_model(nodes, {"x": (1, 3, 8, 8)}, ["y"], initializers)
    qdq = ort_quantize(model, random_feeds(model, rng, 8))
    return IntegerExecutor(qdq, strict=True)


def _lower_step(
    build: Codegen, step: IntegerStep, operands: list[Tensor], out: Tensor
) -> Instruction:
    """The test's mini code generator: one reference step kernel -> one instruction."""
    kernel = step.kernel
    if isinstance(kernel, ConvKernel):
        begin, end = resolve_pads(
            operands[0].shape[2:],
            kernel.weight.shape[2:],
            kernel.strides,
            kernel.dilations,
            kernel.pads,
            kernel.auto_pad,
        )
        channels = kernel.weight.shape[0]
        return Conv(
            input=operands[0],
            weight=build.const(kernel.weight, "int8"),
            bias=build.const(kernel.bias, "int32"),
            output=out,
            requant=build.stage(kernel.stage, table_shape=(channels,)),
            input_zero_point=kernel.input_zero_point,
            strides=kernel.strides,
            dilations=kernel.dilations,
            pads=(*begin, *end),
            group=kernel.group,
        )
    if isinstance(kernel, MaxPoolKernel):
        begin, end = resolve_pads(
            operands[0].shape[2:],
            kernel.kernel,
            kernel.strides,
            kernel.dilations,
            kernel.pads,
            kernel.auto_pad,
            ceil_mode=kernel.ceil_mode,
        )
        input_zero_point, requant = build.rescale(kernel.rescale)
        return Pool(
            op=PoolOp.MAX,
            input=operands[0],
            output=out,
            requant=requant,
            kernel=kernel.kernel,
            strides=kernel.strides,
            pads=(*begin, *end),
            pad_value=kernel.pad_value,
            input_zero_point=input_zero_point,
        )
    if isinstance(kernel, AddKernel):
        return Eltwise(
            op=EltwiseOp.SUB if kernel.subtract else EltwiseOp.ADD,
            a=operands[0],
            b=operands[1],
            output=out,
            requant=build.stage(kernel.stage),
            a_zero_point=kernel.a_zero_point,
            b_zero_point=kernel.b_zero_point,
            left_shift=kernel.left_shift,
            a_multiplier=int(kernel.a_multiplier[0]),
            a_shift=int(kernel.a_multiplier[1]),
            b_multiplier=int(kernel.b_multiplier[0]),
            b_shift=int(kernel.b_multiplier[1]),
        )
    if isinstance(kernel, LookupKernel):
        return Lut(input=operands[0], table=build.const(kernel.table, out.dtype.numpy), output=out)
    if isinstance(kernel, GlobalAveragePoolKernel):
        stage = kernel.stage
        count = math.prod(operands[0].shape[2:])
        multiplier, shift = quantize_multiplier(stage.input_scale / (stage.output_scale * count))
        return Pool(
            op=PoolOp.AVG,
            input=operands[0],
            output=out,
            requant=build.requant(
                multiplier, shift, stage.zero_point, stage.low, stage.high, stage.mode
            ),
            kernel=tuple(operands[0].shape[2:]),
            input_zero_point=kernel.input_zero_point,
        )
    raise NotImplementedError(type(kernel).__name__)


def _lower(executor: IntegerExecutor, x: np.ndarray, *, clobber: bool = False) -> Codegen:
    """Lower the whole program: input LOADed from DRAM (HWC), each step into its own arena
    buffer, the result STOREd to DRAM (HWC16). `clobber` deliberately places the second
    convolution's output on top of the max-pool output, which the Add still needs."""
    values = {name: x for name in executor.input_names}
    executor.keep_intermediates = True
    executor.run_integer(values)
    shapes = {name: value.shape for name, value in executor.intermediates.items()}
    build = Codegen("small_cnn")
    tensors: dict[str, Tensor] = {}
    for step in executor.steps:
        if isinstance(step, QuantizeStep):
            params = step.params
            source = build.input(step.input, shapes[step.output], params.dtype, Space.DRAM, "HWC")
            tensors[step.output] = build.alloc(source.shape, params.dtype)
            build.emit(Load(src=source, dst=tensors[step.output]))
        elif isinstance(step, IntegerStep):
            (name,) = step.outputs
            dtype = step.output_params[0].dtype
            if clobber and step.pattern.startswith("Conv") and len(build.layers) == 2:
                tensors[name] = Tensor.contiguous(
                    Space.ARENA, dtype, tensors[step.inputs[0]].offset, shapes[name]
                )
            else:
                tensors[name] = build.alloc(shapes[name], dtype)
            build.layers.append(step.name)
            operands = [tensors[i] for i in step.inputs]
            instruction = _lower_step(build, step, operands, tensors[name])
            build.emit(dataclasses.replace(instruction, layer=len(build.layers) - 1))
        elif isinstance(step, DequantizeStep):
            target = build.output(
                step.output, shapes[step.input], step.params.dtype, Space.DRAM, "HWC16"
            )
            build.emit(Store(src=tensors[step.input], dst=target, layer=len(build.layers) - 1))
    return build


def test_small_cnn_is_bit_exact_against_the_integer_executor(small_cnn: IntegerExecutor) -> None:
    rng = np.random.default_rng(1)
    for _ in range(3):
        x = random_codes(rng, (1, 3, 8, 8), "int8")
        expected = small_cnn.run_integer({"x": x})["y"]
        build = _lower(small_cnn, x)
        results = build.run({"x": x}, compress=True)
        np.testing.assert_array_equal(results["y"], expected)
    patterns = [step.pattern for step in small_cnn.steps if isinstance(step, IntegerStep)]
    assert patterns[0].startswith("Conv") and len(patterns) == 6


def test_a_wrong_memory_plan_gives_wrong_numbers(small_cnn: IntegerExecutor) -> None:
    x = random_codes(np.random.default_rng(2), (1, 3, 8, 8), "int8")
    expected = small_cnn.run_integer({"x": x})["y"]
    results = _lower(small_cnn, x, clobber=True).run({"x": x})
    assert not np.array_equal(results["y"], expected)


def test_reading_memory_nothing_wrote_shows_poison() -> None:
    build = Codegen()
    never_written = build.alloc((2, 4), "uint8")
    out = build.output("y", (2, 4), "uint8")
    build.emit(Store(src=never_written, dst=out))
    assert (build.run({})["y"] == POISON).all()


def test_errors_name_the_instruction_and_layer() -> None:
    build = Codegen()
    x = build.input("x", (1, 2, 4, 4), "int8", Space.ARENA)
    y = build.output("y", (1, 2, 4, 4), "int8", Space.ARENA)
    build.layers = ["relu_7"]
    build.emit(Lut(input=x, table=build.const(np.zeros(16), "int8"), output=y, layer=0))
    with pytest.raises(EmulatorError, match=r"instruction 0 \(LUT, relu_7\): .*256 entries"):
        build.run({"x": np.zeros((1, 2, 4, 4), np.int8)})
    outside = Codegen()
    source = outside.input("x", (4,), "int8", Space.ARENA)
    beyond = Tensor.contiguous(Space.ARENA, "int8", 10_000, (4,))
    outside.output("y", (4,), "int8")
    outside.emit(Load(src=beyond, dst=source))
    with pytest.raises(EmulatorError, match="LOAD reads DRAM or CONST"):
        outside.run({"x": np.zeros(4, np.int8)})
    wide = Codegen()
    a = wide.input("a", (4,), "int8", Space.DRAM)
    target = wide.output("y", (4,), "int8", Space.DRAM)
    wide.emit(Store(src=Tensor.contiguous(Space.ARENA, "int8", 4096, (4,)), dst=target))
    with pytest.raises(EmulatorError, match="outside the 16-byte space"):
        wide.run({"a": np.zeros(4, np.int8)})
    del a
    with pytest.raises(EmulatorError, match="missing input"):
        build.run({})


def test_clamp_bounds_wider_than_the_output_type_are_an_error_not_a_wrap() -> None:
    build = Codegen()
    a = build.input("a", (4,), "int8", Space.ARENA)
    y = build.output("y", (4,), "int8", Space.ARENA)
    build.emit(
        Eltwise(
            op=EltwiseOp.MUL, a=a, b=a, output=y, requant=Requant(2**30, -5, 0, -(2**20), 2**20)
        )
    )
    with pytest.raises(EmulatorError, match="do not fit int8"):
        build.run({"a": np.full(4, 100, np.int8)})


def test_cost_model_counts_cycles_vela_style() -> None:
    hw = MlaHardware()
    assert (hw.array_width, hw.array_depth, hw.arena_bytes) == (32, 32, 16 * 2**20)
    x = Tensor.contiguous(Space.ARENA, "int8", 0, (1, 64, 16, 16))
    y = Tensor.contiguous(Space.ARENA, "int8", 0, (1, 64, 16, 16))
    requant = Requant(2**30, 0, 0, -128, 127)
    dense = Conv(
        input=x,
        weight=Tensor.contiguous(Space.CONST, "int8", 0, (64, 64, 3, 3)),
        output=y,
        requant=requant,
        pads=(1, 1, 1, 1),
    )
    depthwise = Conv(
        input=x,
        weight=Tensor.contiguous(Space.CONST, "int8", 0, (64, 1, 3, 3)),
        output=y,
        requant=requant,
        pads=(1, 1, 1, 1),
        group=64,
    )
    dense_cost = instruction_cost(dense, hw)
    assert dense_cost.macs == 16 * 16 * 9 * 64 * 64
    assert dense_cost.compute == 16 * 16 * 9 * 2 * 2 // 4
    assert dense_cost.cycles == hw.dispatch_cycles + max(dense_cost.compute, dense_cost.memory)
    depthwise_cost = instruction_cost(depthwise, hw)
    assert depthwise_cost.macs == dense_cost.macs // 64
    assert depthwise_cost.compute == 16 * 16 * 9 * 2 // 4
    one_quad = instruction_cost(dense, hw.with_quads(1))
    assert one_quad.compute == 4 * dense_cost.compute
    matmul = MatMul(
        a=Tensor.contiguous(Space.DRAM, "int8", 0, (128, 256)),
        b=Tensor.contiguous(Space.CONST, "int8", 0, (256, 10)),
        output=Tensor.contiguous(Space.ARENA, "int8", 0, (128, 10)),
        requant=requant,
    )
    cost = instruction_cost(matmul, hw)
    assert cost.bound == "memory" and cost.dram_bytes == 128 * 256 + 256 * 10


def test_stall_aware_schedule_overlaps_dma_and_queues_dram() -> None:
    hw = MlaHardware()
    requant = Requant(2**30, 0, 0, -128, 127)
    a = Tensor.contiguous(Space.ARENA, "int8", 0, (1, 64, 32, 32))
    b = Tensor.contiguous(Space.ARENA, "int8", 65536, (1, 64, 32, 32))
    weight = Tensor.contiguous(Space.CONST, "int8", 0, (64, 64, 3, 3))
    prefetch = Load(
        src=Tensor.contiguous(Space.DRAM, "int8", 0, (1, 64, 32, 32)),
        dst=Tensor.contiguous(Space.ARENA, "int8", 2 * 65536, (1, 64, 32, 32)),
    )
    conv = Conv(input=a, weight=weight, output=b, requant=requant, pads=(1, 1, 1, 1))
    independent = stall_aware_schedule([conv, prefetch], hw)
    static_total = sum(instruction_cost(i, hw).cycles for i in (conv, prefetch))
    assert independent.total_cycles < static_total
    assert independent.entries[1].start == 0
    dependent = Load(src=prefetch.src, dst=a)
    serial = stall_aware_schedule([dependent, conv], hw)
    assert serial.entries[1].start == serial.entries[0].end
    streaming = Conv(
        input=a,
        weight=Tensor.contiguous(Space.CONST, "int8", 0, (64, 64, 15, 15)),
        output=b,
        requant=requant,
        pads=(7, 7, 7, 7),
    )
    contended = stall_aware_schedule([prefetch, streaming], hw)
    assert contended.entries[1].stall > 0 or contended.entries[1].end > contended.entries[0].end


def test_run_reports_both_cycle_estimates(small_cnn: IntegerExecutor) -> None:
    x = random_codes(np.random.default_rng(3), (1, 3, 8, 8), "int8")
    emulator = Emulator(_lower(small_cnn, x).program())
    emulator.run({"x": x})
    stats = emulator.stats
    assert stats is not None
    assert stats.static_cycles == sum(c.cycles for c in emulator.costs)
    assert stats.stall_aware_cycles > 0
    assert stats.bytes_read["CONST"] > 0 and stats.bytes_written["DRAM"] == 8
    spans = stats.static.by_layer()
    assert len(spans) == 6 and all(start < end for start, end in spans.values())


def test_layer_rows_feed_the_stats_file(small_cnn: IntegerExecutor) -> None:
    x = random_codes(np.random.default_rng(4), (1, 3, 8, 8), "int8")
    build = _lower(small_cnn, x)
    emulator = Emulator(build.program())
    rows = emulator.static_schedule().layer_rows(build.layers)
    assert [row["name"] for row in rows] == build.layers
    assert rows[0]["start_cycle"] == 0
    assert rows[-1]["end_cycle"] == emulator.static_schedule().total_cycles
    assert all(a["end_cycle"] <= b["start_cycle"] for a, b in zip(rows, rows[1:], strict=False))
    assert rows[0]["macs"] == 8 * 8 * 8 * 3 * 9


def test_moving_codes_between_types_needs_a_rescale() -> None:
    build = Codegen()
    x = build.input("x", (1, 1, 2, 2), "uint8", Space.ARENA)
    y = build.output("y", (1, 1, 1, 1), "int8", Space.ARENA)
    build.emit(Pool(op=PoolOp.MAX, input=x, output=y, kernel=(2, 2)))
    with pytest.raises(EmulatorError, match="keeps the dtype: UINT8 -> INT8"):
        build.run({"x": np.zeros((1, 1, 2, 2), np.uint8)})
