"""Arithmetic instructions vs the reference kernels, bit for bit, through encode -> ELF -> emulate.

Each test builds a reference kernel of `compiler.runtime.ops` with random constants, emits the
instruction that carries the same constants (the hand codegen of test_emulator_support), places
operands in DRAM (HWC / HWC16 layouts) or the arena, and compares the emulator's integers with
the kernel's.
"""

from __future__ import annotations

import math

import numpy as np
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from compiler.intmath import (
    build_lut,
    dtype_range,
    quantize_multiplier,
    round_half_even,
    round_half_up,
)
from compiler.isa import (
    Conv,
    ConvTranspose,
    Eltwise,
    EltwiseOp,
    LayerNorm,
    Lut,
    MatMul,
    Pool,
    PoolOp,
    Reduce,
    ReduceOp,
    Resize,
    ResizeMode,
    Softmax,
    Space,
)
from compiler.runtime.ops.base import OutputStage, Rescale
from compiler.runtime.ops.conv import ConvKernel, ConvTransposeKernel
from compiler.runtime.ops.elementwise import (
    LEFT_SHIFT_8BIT,
    LEFT_SHIFT_16BIT,
    QUOTIENT_BITS,
    AddKernel,
    DivKernel,
    ExtremumKernel,
    MulKernel,
)
from compiler.runtime.ops.geometry import resolve_pads
from compiler.runtime.ops.lut import LookupKernel
from compiler.runtime.ops.matmul import MatMulKernel
from compiler.runtime.ops.normalization import (
    NORMALISED_BITS,
    OUTPUT_FRACTION_BITS,
    LayerNormKernel,
)
from compiler.runtime.ops.pool import (
    AveragePoolKernel,
    AverageStage,
    GlobalAveragePoolKernel,
    GlobalMaxPoolKernel,
    MaxPoolKernel,
)
from compiler.runtime.ops.reduce import ReduceExtremumKernel, ReduceSumKernel, Reduction
from compiler.runtime.ops.resize import (
    ResizeKernel,
    input_coordinates,
    linear_taps,
    nearest_indices,
)
from compiler.runtime.ops.softmax import SoftmaxKernel, exp_table
from tests.test_emulator_support import Codegen, qparams, random_codes, run_single

SEEDS = st.integers(0, 2**32 - 1)
MODES = st.sampled_from(["sima", "tflite"])
ACTIVATION_DTYPES = st.sampled_from(["int8", "uint8"])
PLACEMENTS_IN = st.sampled_from([(Space.DRAM, "HWC"), (Space.ARENA, "NCHW"), (Space.DRAM, "NCHW")])
PLACEMENTS_OUT = st.sampled_from(
    [(Space.DRAM, "HWC16"), (Space.ARENA, "NCHW"), (Space.DRAM, "HWC")]
)


def _zero_point(rng: np.random.Generator, dtype: str) -> int:
    low, high = dtype_range(dtype)
    return int(rng.integers(low // 2, high // 2 + 1))


def _activation(rng: np.random.Generator) -> tuple[float, float] | None:
    return [None, (0.0, np.inf), (-0.5, 0.75)][int(rng.integers(0, 3))]


@st.composite
def conv_cases(draw: st.DrawFn) -> dict:
    kind = draw(st.sampled_from(["dense", "grouped", "depthwise"]))
    group_channels = 1 if kind == "depthwise" else draw(st.integers(1, 4))
    group = 1 if kind == "dense" else draw(st.integers(2, 3))
    group_out = 1 if kind == "depthwise" else draw(st.integers(1, 3))
    kernel = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    case = {
        "batch": draw(st.integers(1, 2)),
        "channels": group_channels * group,
        "out_channels": group_out * group,
        "group": group,
        "kernel": kernel,
        "spatial": (draw(st.integers(1, 7)), draw(st.integers(1, 7))),
        "strides": (draw(st.integers(1, 3)), draw(st.integers(1, 3))),
        "dilations": (draw(st.integers(1, 2)), draw(st.integers(1, 2))),
        "pads": tuple(draw(st.integers(0, 2)) for _ in range(4)),
    }
    for axis in range(2):
        extent = (kernel[axis] - 1) * case["dilations"][axis] + 1
        padded = case["spatial"][axis] + case["pads"][axis] + case["pads"][axis + 2]
        assume(padded >= extent)
    return case


@settings(max_examples=40, deadline=None)
@given(
    case=conv_cases(),
    dtype=ACTIVATION_DTYPES,
    mode=MODES,
    placement_in=PLACEMENTS_IN,
    placement_out=PLACEMENTS_OUT,
    seed=SEEDS,
)
def test_conv_matches_reference(
    case: dict, dtype: str, mode: str, placement_in: tuple, placement_out: tuple, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    m, cg = case["out_channels"], case["channels"] // case["group"]
    weight = rng.integers(-127, 128, size=(m, cg, *case["kernel"])).astype(np.int64)
    bias = rng.integers(-5000, 5000, size=m).astype(np.int64)
    x_zero_point = _zero_point(rng, dtype)
    output = qparams(float(rng.uniform(0.02, 0.3)), _zero_point(rng, dtype), dtype)
    real = (0.01 * rng.uniform(0.001, 0.02, size=m)).reshape(-1, 1, 1) / 0.05
    kernel = ConvKernel(
        weight=weight,
        bias=bias,
        input_zero_point=x_zero_point,
        strides=case["strides"],
        dilations=case["dilations"],
        pads=list(case["pads"]),
        auto_pad="NOTSET",
        group=case["group"],
        stage=OutputStage.build(real, output, mode, _activation(rng)),
    )
    x = random_codes(rng, (case["batch"], case["channels"], *case["spatial"]), dtype)
    expected = kernel(x)

    build = Codegen()
    source = build.input("x", x.shape, dtype, *placement_in)
    target = build.output("y", expected.shape, dtype, *placement_out)
    build.emit(
        Conv(
            input=source,
            weight=build.const(weight, "int8"),
            bias=build.const(bias, "int32"),
            output=target,
            requant=build.stage(kernel.stage, table_shape=(m,)),
            input_zero_point=x_zero_point,
            strides=case["strides"],
            dilations=case["dilations"],
            pads=case["pads"],
            group=case["group"],
        )
    )
    run_single(build, {"x": x}, expected)


@settings(max_examples=25, deadline=None)
@given(
    depthwise=st.booleans(),
    channels=st.integers(1, 3),
    group_out=st.integers(1, 3),
    spatial=st.tuples(st.integers(1, 4), st.integers(1, 4)),
    kernel_shape=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    strides=st.tuples(st.integers(1, 3), st.integers(1, 3)),
    dilations=st.tuples(st.integers(1, 2), st.integers(1, 2)),
    pads=st.tuples(*[st.integers(0, 1)] * 4),
    output_padding=st.tuples(st.integers(0, 1), st.integers(0, 1)),
    mode=MODES,
    seed=SEEDS,
)
def test_conv_transpose_matches_reference(
    depthwise: bool,
    channels: int,
    group_out: int,
    spatial: tuple,
    kernel_shape: tuple,
    strides: tuple,
    dilations: tuple,
    pads: tuple,
    output_padding: tuple,
    mode: str,
    seed: int,
) -> None:
    assume(all(p < s for p, s in zip(output_padding, strides, strict=True)))
    rng = np.random.default_rng(seed)
    group = channels if depthwise else 1
    group_out = 1 if depthwise else group_out
    weight = rng.integers(-127, 128, size=(channels, group_out, *kernel_shape)).astype(np.int64)
    out_channels = group_out * group
    bias = rng.integers(-3000, 3000, size=out_channels).astype(np.int64)
    output = qparams(0.1, 3)
    kernel = ConvTransposeKernel(
        weight=weight,
        bias=bias,
        input_zero_point=-4,
        strides=strides,
        dilations=dilations,
        pads=list(pads),
        auto_pad="NOTSET",
        output_padding=output_padding,
        output_shape=None,
        group=group,
        stage=OutputStage.build(
            rng.uniform(0.001, 0.01, size=(out_channels, 1, 1)), output, mode, None
        ),
    )
    x = random_codes(rng, (1, channels, *spatial), "int8")
    full, begin, end = kernel._geometry(spatial)
    assume(all(f - b - e > 0 for f, b, e in zip(full, begin, end, strict=True)))
    expected = kernel(x)

    build = Codegen()
    build.emit(
        ConvTranspose(
            input=build.input("x", x.shape, "int8", Space.ARENA),
            weight=build.const(weight, "int8"),
            bias=build.const(bias, "int32"),
            output=build.output("y", expected.shape, "int8"),
            requant=build.stage(kernel.stage, table_shape=(out_channels,)),
            input_zero_point=-4,
            strides=strides,
            dilations=dilations,
            crop=(*begin, *end),
            output_padding=output_padding,
            group=group,
        )
    )
    run_single(build, {"x": x}, expected)


@settings(max_examples=30, deadline=None)
@given(
    batch=st.lists(st.integers(1, 3), max_size=2),
    rows=st.integers(1, 5),
    depth=st.integers(1, 40),
    columns=st.integers(1, 6),
    constant_b=st.booleans(),
    transposed=st.booleans(),
    with_bias=st.booleans(),
    dtype=ACTIVATION_DTYPES,
    mode=MODES,
    seed=SEEDS,
)
def test_matmul_matches_reference(
    batch: list,
    rows: int,
    depth: int,
    columns: int,
    constant_b: bool,
    transposed: bool,
    with_bias: bool,
    dtype: str,
    mode: str,
    seed: int,
) -> None:
    """Activation @ activation (per-tensor zero points) or activation @ constant (per column)."""
    rng = np.random.default_rng(seed)
    a = random_codes(rng, (*batch, rows, depth), dtype)
    a_zero_point = _zero_point(rng, dtype)
    output = qparams(0.2, _zero_point(rng, dtype), dtype)
    if constant_b:
        b = random_codes(rng, (depth, columns), "uint8")
        b_zero_point = rng.integers(100, 156, size=columns).astype(np.int64)
        real = rng.uniform(1e-4, 1e-3, size=columns)
    else:
        b = random_codes(rng, (*batch, depth, columns), dtype)
        b_zero_point = np.int64(_zero_point(rng, dtype))
        real = np.float64(rng.uniform(1e-4, 1e-3))
    bias = rng.integers(-2000, 2000, size=columns).astype(np.int64) if with_bias else 0
    kernel = MatMulKernel(
        a_zero_point=a_zero_point,
        b_zero_point=b_zero_point,
        bias=bias,
        stage=OutputStage.build(real, output, mode, _activation(rng)),
    )
    expected = kernel(a, b)

    build = Codegen()
    a_tensor = build.input("a", a.shape, dtype, Space.ARENA)
    inputs = {"a": a}
    if constant_b:
        centred = b.astype(np.int64) - b_zero_point
        stored = centred.T.copy() if transposed else centred
        b_tensor = build.const(stored, "int16")
        b_tensor = b_tensor.transpose((1, 0)) if transposed else b_tensor
        b_operand_zero_point = 0
    else:
        swap = (*range(len(batch)), len(batch) + 1, len(batch))
        stored = np.swapaxes(b, -1, -2).copy() if transposed else b
        b_tensor = build.input("b", stored.shape, dtype, Space.DRAM)
        b_tensor = b_tensor.transpose(swap) if transposed else b_tensor
        inputs["b"] = stored
        b_operand_zero_point = int(b_zero_point)
    build.emit(
        MatMul(
            a=a_tensor,
            b=b_tensor,
            bias=build.const(bias, "int32") if with_bias else None,
            output=build.output("y", expected.shape, dtype),
            requant=build.stage(kernel.stage),
            a_zero_point=a_zero_point,
            b_zero_point=b_operand_zero_point,
        )
    )
    run_single(build, inputs, expected)


@st.composite
def broadcast_pairs(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...]]:
    full = draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    other = [d if draw(st.booleans()) else 1 for d in full]
    other = other[draw(st.integers(0, len(other) - 1)) :]
    pair = (tuple(full), tuple(other))
    return pair if draw(st.booleans()) else pair[::-1]


@settings(max_examples=50, deadline=None)
@given(
    shapes=broadcast_pairs(),
    op=st.sampled_from(list(EltwiseOp)),
    dtypes=st.sampled_from([("int8", "int8"), ("uint8", "int8"), ("int16", "int8")]),
    mode=MODES,
    seed=SEEDS,
)
def test_eltwise_matches_reference(
    shapes: tuple, op: EltwiseOp, dtypes: tuple, mode: str, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    a_dtype, b_dtype = dtypes
    a = random_codes(rng, shapes[0], a_dtype)
    b = random_codes(rng, shapes[1], b_dtype)
    za, zb = _zero_point(rng, a_dtype), _zero_point(rng, b_dtype)
    sa, sb = float(rng.uniform(0.01, 0.1)), float(rng.uniform(0.01, 0.1))
    out_dtype = "int16" if "int16" in dtypes else "int8"
    output = qparams(float(rng.uniform(0.01, 0.2)), _zero_point(rng, out_dtype), out_dtype)
    activation = _activation(rng)
    left_shift, a_pair, b_pair = 0, (0, 0), (0, 0)
    if op in (EltwiseOp.ADD, EltwiseOp.SUB, EltwiseOp.MAX, EltwiseOp.MIN):
        left_shift = LEFT_SHIFT_16BIT if "int16" in dtypes else LEFT_SHIFT_8BIT
        twice = 2.0 * max(sa, sb)
        a_pair, b_pair = quantize_multiplier(sa / twice), quantize_multiplier(sb / twice)
        stage = OutputStage.build(
            twice / (2.0**left_shift * output.scalar_scale()), output, mode, activation
        )
        kernel = AddKernel(za, zb, left_shift, a_pair, b_pair, op == EltwiseOp.SUB, mode, stage)
        if op in (EltwiseOp.MAX, EltwiseOp.MIN):
            kernel = ExtremumKernel(op == EltwiseOp.MAX, (kernel,))
    elif op == EltwiseOp.MUL:
        stage = OutputStage.build(sa * sb / output.scalar_scale(), output, mode, activation)
        kernel = MulKernel(za, zb, stage)
    else:
        left_shift = QUOTIENT_BITS
        real = sa / (sb * output.scalar_scale() * 2.0**QUOTIENT_BITS)
        stage = OutputStage.build(real, output, mode, activation)
        kernel = DivKernel(za, zb, stage)
    expected = kernel(a, b)

    build = Codegen()
    build.emit(
        Eltwise(
            op=op,
            a=build.input("a", a.shape, a_dtype, Space.ARENA),
            b=build.input("b", b.shape, b_dtype, Space.DRAM),
            output=build.output("y", expected.shape, out_dtype, Space.ARENA),
            requant=build.stage(stage),
            a_zero_point=za,
            b_zero_point=zb,
            left_shift=left_shift,
            a_multiplier=int(a_pair[0]),
            a_shift=int(a_pair[1]),
            b_multiplier=int(b_pair[0]),
            b_shift=int(b_pair[1]),
        )
    )
    run_single(build, {"a": a, "b": b}, expected)


@settings(max_examples=20, deadline=None)
@given(
    dtypes=st.sampled_from([("int8", "int8"), ("uint8", "uint8"), ("int16", "int16")]),
    function=st.sampled_from(["sigmoid", "tanh", "exp", "silu"]),
    shape=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    seed=SEEDS,
)
def test_lut_matches_reference(dtypes: tuple, function: str, shape: list, seed: int) -> None:
    rng = np.random.default_rng(seed)
    functions = {
        "sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)),
        "tanh": np.tanh,
        "exp": np.exp,
        "silu": lambda x: x / (1.0 + np.exp(-x)),
    }
    in_dtype, out_dtype = dtypes
    wide = in_dtype == "int16"
    table = build_lut(
        functions[function],
        0.001 if wide else 0.05,
        _zero_point(rng, in_dtype),
        in_dtype,
        0.0005 if wide else 0.02,
        _zero_point(rng, out_dtype),
        out_dtype,
    )
    kernel = LookupKernel(table, np.dtype(in_dtype))
    x = random_codes(rng, shape, in_dtype)
    expected = kernel(x).astype(out_dtype)

    build = Codegen()
    build.emit(
        Lut(
            input=build.input("x", x.shape, in_dtype, Space.DRAM),
            table=build.const(table, out_dtype),
            output=build.output("y", x.shape, out_dtype, Space.ARENA),
        )
    )
    run_single(build, {"x": x}, expected)


@st.composite
def pool_cases(draw: st.DrawFn) -> dict:
    kernel = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    return {
        "kernel": kernel,
        "strides": (draw(st.integers(1, 3)), draw(st.integers(1, 3))),
        "pads": [draw(st.integers(0, k - 1)) for k in kernel * 2],
        "spatial": (draw(st.integers(3, 8)), draw(st.integers(3, 8))),
    }


@settings(max_examples=30, deadline=None)
@given(
    case=pool_cases(),
    ceil_mode=st.booleans(),
    rescaled=st.booleans(),
    dtype=ACTIVATION_DTYPES,
    placement_in=PLACEMENTS_IN,
    seed=SEEDS,
)
def test_max_pool_matches_reference(
    case: dict, ceil_mode: bool, rescaled: bool, dtype: str, placement_in: tuple, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    source = qparams(0.05, _zero_point(rng, dtype), dtype)
    target = qparams(0.07, _zero_point(rng, "int8"), "int8") if rescaled else source
    kernel = MaxPoolKernel(
        kernel=case["kernel"],
        strides=case["strides"],
        dilations=(1, 1),
        pads=case["pads"],
        auto_pad="NOTSET",
        ceil_mode=ceil_mode,
        pad_value=dtype_range(dtype)[0],
        rescale=Rescale.build(source, target, "sima"),
    )
    x = random_codes(rng, (1, 3, *case["spatial"]), dtype)
    expected = kernel(x)
    begin, end = resolve_pads(
        case["spatial"],
        case["kernel"],
        case["strides"],
        (1, 1),
        case["pads"],
        "NOTSET",
        ceil_mode=ceil_mode,
    )

    build = Codegen()
    input_zero_point, requant = build.rescale(kernel.rescale)
    build.emit(
        Pool(
            op=PoolOp.MAX,
            input=build.input("x", x.shape, dtype, *placement_in),
            output=build.output("y", expected.shape, expected.dtype, Space.ARENA),
            requant=requant,
            kernel=case["kernel"],
            strides=case["strides"],
            pads=(*begin, *end),
            pad_value=kernel.pad_value,
            input_zero_point=input_zero_point,
        )
    )
    run_single(build, {"x": x}, expected)


@settings(max_examples=30, deadline=None)
@given(
    case=pool_cases(),
    count_include_pad=st.booleans(),
    dtype=ACTIVATION_DTYPES,
    mode=MODES,
    seed=SEEDS,
)
def test_average_pool_matches_reference(
    case: dict, count_include_pad: bool, dtype: str, mode: str, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    x_zero_point = _zero_point(rng, dtype)
    out_zero_point = _zero_point(rng, dtype)
    low, high = dtype_range(dtype)
    stage = AverageStage(0.05, 0.04, out_zero_point, low, high, np.dtype(dtype), mode)
    kernel = AveragePoolKernel(
        kernel=case["kernel"],
        strides=case["strides"],
        dilations=(1, 1),
        pads=case["pads"],
        auto_pad="NOTSET",
        count_include_pad=count_include_pad,
        input_zero_point=x_zero_point,
        stage=stage,
    )
    x = random_codes(rng, (2, 2, *case["spatial"]), dtype)
    expected = kernel(x)

    build = Codegen()
    volume = math.prod(case["kernel"])
    tables = {}
    if count_include_pad:
        multiplier, shift = quantize_multiplier(0.05 / (0.04 * volume))
    else:
        multiplier, shift = 0, 0
        counts = np.arange(1, volume + 1)
        multipliers, shifts = quantize_multiplier(0.05 / (0.04 * counts))
        tables = {
            "count_multipliers": build.const(np.concatenate([[0], multipliers]), "int32"),
            "count_shifts": build.const(np.concatenate([[0], shifts]), "int32"),
        }
    build.emit(
        Pool(
            op=PoolOp.AVG,
            input=build.input("x", x.shape, dtype, Space.DRAM, "HWC"),
            output=build.output("y", expected.shape, dtype, Space.DRAM, "HWC16"),
            requant=build.requant(multiplier, shift, out_zero_point, low, high, mode),
            kernel=case["kernel"],
            strides=case["strides"],
            pads=tuple(case["pads"]),
            input_zero_point=x_zero_point,
            **tables,
        )
    )
    run_single(build, {"x": x}, expected)


@settings(max_examples=15, deadline=None)
@given(
    spatial=st.tuples(st.integers(1, 9), st.integers(1, 9)),
    as_reduce=st.booleans(),
    mode=MODES,
    seed=SEEDS,
)
def test_global_pools_match_reference(
    spatial: tuple, as_reduce: bool, mode: str, seed: int
) -> None:
    """GlobalAveragePool / GlobalMaxPool as a full-size POOL window or as a REDUCE."""
    rng = np.random.default_rng(seed)
    x = random_codes(rng, (2, 5, *spatial), "int8")
    average = GlobalAveragePoolKernel(
        3, AverageStage(0.05, 0.03, -2, -128, 127, np.dtype("int8"), mode)
    )
    maximum = GlobalMaxPoolKernel(Rescale.build(qparams(0.05, 3), qparams(0.05, 3), mode))
    expected_average, expected_max = average(x), maximum(x)

    build = Codegen()
    source = build.input("x", x.shape, "int8", Space.ARENA)
    out_average = build.output("avg", expected_average.shape, "int8")
    out_max = build.output("max", expected_max.shape, "int8")
    multiplier, shift = quantize_multiplier(0.05 / (0.03 * math.prod(spatial)))
    requant = build.requant(multiplier, shift, -2, -128, 127, mode)
    if as_reduce:
        build.emit(
            Reduce(
                op=ReduceOp.SUM,
                input=source,
                output=out_average,
                requant=requant,
                axes=0b1100,
                input_zero_point=3,
            ),
            Reduce(op=ReduceOp.MAX, input=source, output=out_max, axes=0b1100),
        )
    else:
        build.emit(
            Pool(
                op=PoolOp.AVG,
                input=source,
                output=out_average,
                requant=requant,
                kernel=spatial,
                input_zero_point=3,
            ),
            Pool(op=PoolOp.MAX, input=source, output=out_max, kernel=spatial, pad_value=-128),
        )
    results = build.run({"x": x})
    np.testing.assert_array_equal(results["avg"], expected_average)
    np.testing.assert_array_equal(results["max"], expected_max)


@settings(max_examples=30, deadline=None)
@given(
    shape=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    op=st.sampled_from(["ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin"]),
    keepdims=st.booleans(),
    data=st.data(),
    mode=MODES,
    seed=SEEDS,
)
def test_reduce_matches_reference(
    shape: list, op: str, keepdims: bool, data: st.DataObject, mode: str, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    axes = data.draw(st.sets(st.integers(0, len(shape) - 1), min_size=1))
    reduction = Reduction(tuple(sorted(axes)), keepdims, False)
    x = random_codes(rng, shape, "int8")
    build = Codegen()
    source = build.input("x", x.shape, "int8", Space.DRAM)
    mask = sum(1 << a for a in axes)
    if op in ("ReduceMean", "ReduceSum"):
        stage = AverageStage(0.05, 0.2, 4, -128, 127, np.dtype("int8"), mode)
        kernel = ReduceSumKernel(reduction, -3, op == "ReduceMean", stage)
        expected = kernel(x)
        count = math.prod(shape[a] for a in axes) if op == "ReduceMean" else 1
        multiplier, shift = quantize_multiplier(0.05 / (0.2 * count))
        requant = build.requant(multiplier, shift, 4, -128, 127, mode)
        instruction_op, input_zero_point = ReduceOp.SUM, -3
    else:
        rescale = Rescale.build(qparams(0.05, -3), qparams(0.08, 5), mode)
        kernel = ReduceExtremumKernel(reduction, op == "ReduceMax", rescale)
        expected = kernel(x)
        input_zero_point, requant = build.rescale(rescale)
        instruction_op = ReduceOp.MAX if op == "ReduceMax" else ReduceOp.MIN
    build.emit(
        Reduce(
            op=instruction_op,
            input=source,
            output=build.output("y", expected.shape, "int8", Space.ARENA),
            requant=requant,
            axes=mask,
            input_zero_point=input_zero_point,
        )
    )
    run_single(build, {"x": x}, expected)


@settings(max_examples=40, deadline=None)
@given(
    mode=st.sampled_from(["nearest", "linear"]),
    coordinate_mode=st.sampled_from(
        ["half_pixel", "asymmetric", "align_corners", "pytorch_half_pixel"]
    ),
    nearest_mode=st.sampled_from(["round_prefer_floor", "floor", "ceil"]),
    spatial=st.tuples(st.integers(1, 6), st.integers(1, 6)),
    scales=st.tuples(
        st.sampled_from([1.0, 0.5, 2.0, 3.0, 1.5]), st.sampled_from([1.0, 0.5, 2.0, 4.0, 0.75])
    ),
    rescaled=st.booleans(),
    seed=SEEDS,
)
def test_resize_matches_reference(
    mode: str,
    coordinate_mode: str,
    nearest_mode: str,
    spatial: tuple,
    scales: tuple,
    rescaled: bool,
    seed: int,
) -> None:
    rng = np.random.default_rng(seed)
    source = qparams(0.05, 7)
    target = qparams(0.06, -3) if rescaled or mode == "linear" else source
    linear_stages = {
        count: OutputStage.build(0.05 / (0.06 * 2.0 ** (10 * count)), target, "sima")
        for count in range(3)
    }
    kernel = ResizeKernel(
        mode=mode,
        coordinate_mode=coordinate_mode,
        nearest_mode=nearest_mode,
        scales=(1.0, 1.0, *scales),
        sizes=None,
        axes=None,
        input_zero_point=7,
        rescale=Rescale.build(source, target, "sima"),
        linear_stages=linear_stages,
    )
    x = random_codes(rng, (1, 2, *spatial), "int8")
    resized = kernel._geometry(x.shape)
    assume(all(out > 0 for _, _, out, _ in resized))
    expected = kernel(x)

    build = Codegen()
    tables = {}
    for slot, (axis, in_size, out_size, scale) in enumerate(resized):
        coordinates = input_coordinates(out_size, in_size, scale, coordinate_mode)
        if mode == "nearest":
            rows = nearest_indices(coordinates, in_size, nearest_mode)[None, :]
        else:
            rows = np.stack(linear_taps(coordinates, in_size))
        tables[f"axis{slot}"] = axis
        tables[f"table{slot}"] = build.const(rows, "int32")
    if mode == "linear":
        requant = build.stage(linear_stages[len(resized)])
        input_zero_point = 7
    else:
        input_zero_point, requant = build.rescale(kernel.rescale)
    build.emit(
        Resize(
            mode=ResizeMode.NEAREST if mode == "nearest" else ResizeMode.LINEAR,
            input=build.input("x", x.shape, "int8", Space.DRAM, "HWC"),
            output=build.output("y", expected.shape, "int8", Space.ARENA),
            requant=requant,
            input_zero_point=input_zero_point,
            **tables,
        )
    )
    run_single(build, {"x": x}, expected)


@settings(max_examples=25, deadline=None)
@given(
    shape=st.lists(st.integers(1, 6), min_size=1, max_size=4),
    dtype=st.sampled_from(["int8", "uint8", "int16"]),
    data=st.data(),
    mode=MODES,
    seed=SEEDS,
)
def test_softmax_matches_reference(
    shape: list, dtype: str, data: st.DataObject, mode: str, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    axis = data.draw(st.integers(-len(shape), len(shape) - 1))
    bits = np.dtype(dtype).itemsize * 8
    input_scale = 0.05 if bits == 8 else 0.0005
    output = qparams(1.0 / 256, -128, "int8")
    kernel = SoftmaxKernel(
        axis=axis,
        flatten=False,
        table=exp_table(input_scale, bits),
        stage=OutputStage.build(2.0**-30 / output.scalar_scale(), output, mode),
    )
    x = random_codes(rng, shape, dtype)
    expected = kernel(x)

    build = Codegen()
    build.emit(
        Softmax(
            input=build.input("x", x.shape, dtype, Space.ARENA),
            table=build.const(kernel.table, "int32"),
            output=build.output("y", x.shape, "int8", Space.DRAM),
            requant=build.stage(kernel.stage),
            axis=axis,
        )
    )
    run_single(build, {"x": x}, expected)


@settings(max_examples=25, deadline=None)
@given(
    shape=st.lists(st.integers(1, 6), min_size=2, max_size=4),
    data=st.data(),
    mode=MODES,
    seed=SEEDS,
)
def test_layernorm_matches_reference(
    shape: list, data: st.DataObject, mode: str, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    axis = data.draw(st.integers(1, len(shape) - 1))
    normalised = tuple(shape[axis:])
    gamma = rng.uniform(-2.0, 2.0, size=normalised)
    gamma[rng.random(normalised) < 0.1] = 0.0
    beta = rng.uniform(-1.0, 1.0, size=normalised)
    input_scale, out_scale, out_zero_point, epsilon = 0.04, 0.03, 5, 1e-5
    multiplier, shift = quantize_multiplier(
        np.abs(gamma) * 2.0 ** (OUTPUT_FRACTION_BITS - NORMALISED_BITS) / out_scale
    )
    kernel = LayerNormKernel(
        axis=axis,
        epsilon=epsilon,
        input_scale=input_scale,
        input_zero_point=-6,
        sign=np.sign(gamma).astype(np.int64),
        multiplier=multiplier,
        shift=shift,
        offset=round_half_even(beta * 2.0**OUTPUT_FRACTION_BITS / out_scale),
        zero_point=out_zero_point,
        low=-128,
        high=127,
        dtype=np.dtype("int8"),
        mode=mode,
    )
    x = random_codes(rng, shape, "int8")
    expected = kernel(x)

    count = math.prod(normalised)
    epsilon_term = max(1, int(round_half_up(epsilon * count**2 / input_scale**2)))
    unit_multiplier, unit_shift = quantize_multiplier(2.0**-OUTPUT_FRACTION_BITS)
    build = Codegen()
    build.emit(
        LayerNorm(
            input=build.input("x", x.shape, "int8", Space.DRAM),
            output=build.output("y", x.shape, "int8", Space.ARENA),
            signs=build.const(kernel.sign, "int8"),
            multipliers=build.const(multiplier, "int32"),
            shifts=build.const(shift, "int32"),
            offsets=build.const(kernel.offset, "int32"),
            requant=build.requant(unit_multiplier, unit_shift, out_zero_point, -128, 127, mode),
            input_zero_point=-6,
            axis=axis,
            epsilon_term=epsilon_term,
        )
    )
    run_single(build, {"x": x}, expected)
