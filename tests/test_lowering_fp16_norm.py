"""LayerNormalization and RMSNormalization on the MLA's fp16 normalisation unit (NORM_FP16).

rk3588 runs both norms in fp16 only, so the quantizer wraps them in Cast pairs to float16; the
integer program lowers DQ -> Casts -> norm -> Casts -> Q to one fp16 step
(`compiler.intmath.fp16_normalisation`) that the reference kernel and the emulator share. These
tests pin the arithmetic (tree order, overflow scaling, epsilon floor), check the emulator
against the reference bit for bit over shapes, axes and epsilons, compare with ONNX Runtime, and
compile transformer blocks for rk3588 to exactly the segments `surgery check` counts.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler.archive import read_archive
from compiler.compile import compile_model
from compiler.costmodel import MlaHardware, instruction_cost
from compiler.intmath import (
    FP16_SUM_LIMIT,
    FP16_TINY,
    fp16_epsilon,
    fp16_input_exponent,
    fp16_normalisation,
    fp16_pairwise_sum,
)
from compiler.isa import NormFp16, NormOp, Space, float16_bits, float32_bits
from compiler.quantize import quantize_model
from compiler.runtime import IntegerExecutor
from compiler.runtime.compare import reference_outputs
from compiler.runtime.ops.base import OpContext
from compiler.runtime.ops.normalization import Fp16NormKernel, lower_fp16_normalization
from compiler.runtime.pipeline import run_archive
from compiler.runtime.qparams import ConstOperand, QuantOperand
from surgery.check import check_model
from tests.test_emulator_support import Codegen, qparams, random_codes, run_single
from tests.test_reference_support import ort_run

NORMS = {"LayerNormalization": 17, "RMSNormalization": 23}
"""Each norm with the first opset that defines it."""


# --- the fp16 arithmetic ---------------------------------------------------------------------------


def _documented_tree_sum(values: list[float]) -> np.float16:
    """The tree of docs/integer-semantics.md, one fp16 scalar addition at a time."""
    level = [np.float16(v) for v in values]
    while len(level) > 1:
        if len(level) % 2:
            level.append(np.float16(0.0))
        level = [np.float16(level[i] + level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]


@pytest.mark.parametrize("count", [1, 2, 3, 5, 8, 13, 192])
def test_the_tree_sum_adds_in_the_documented_order(count: int) -> None:
    rng = np.random.default_rng(count)
    values = rng.normal(0, 40, (3, count)).astype(np.float16)
    got = fp16_pairwise_sum(values)
    for row, total in zip(values, got, strict=True):
        assert total.view(np.uint16) == _documented_tree_sum(list(row)).view(np.uint16)


@pytest.mark.parametrize("count", [1, 7, 192, 4096, 65536])
@pytest.mark.parametrize("largest", [1e-3, 1.0, 300.0, 1e5])
def test_the_input_exponent_bounds_every_sum(count: int, largest: float) -> None:
    """4 N A'**2 and N A' stay within the limit, and e is the smallest such exponent."""
    exponent = fp16_input_exponent(largest, count)

    def fits(e: int) -> bool:
        scaled = largest * 2.0**-e
        return 4 * count * scaled**2 <= FP16_SUM_LIMIT and count * scaled <= FP16_SUM_LIMIT

    assert fits(exponent) and not fits(exponent - 1)


def _float_layer_norm(real: np.ndarray, gamma, beta, epsilon: float, centre: bool) -> np.ndarray:
    """The op in float64 over the last axis."""
    mean = real.mean(axis=-1, keepdims=True) if centre else 0.0
    variance = ((real - mean) ** 2).mean(axis=-1, keepdims=True)
    y = (real - mean) / np.sqrt(variance + epsilon) * gamma
    return y + beta if beta is not None else y


def _normalise(q: np.ndarray, scale: float, zero_point: int, gamma, beta, epsilon, centre):
    """fp16_normalisation over the last axis of int8 codes, with the kernel's scaling."""
    exponent = fp16_input_exponent(max(zero_point + 128, 127 - zero_point) * scale, q.shape[-1])
    return fp16_normalisation(
        q,
        -1,
        input_zero_point=zero_point,
        input_scale=np.float32(np.float32(scale) * 2.0**-exponent),
        gamma=gamma,
        beta=beta,
        epsilon=fp16_epsilon(epsilon, exponent),
        centre=centre,
        output_scale=np.float32(0.02),
        output_zero_point=0,
        low=-128,
        high=127,
        dtype=np.int8,
    )


@pytest.mark.parametrize("centre", [True, False])
@pytest.mark.parametrize("count", [4, 192, 4096])
@pytest.mark.parametrize("scale", [1e-3, 0.05, 40.0])
def test_extreme_codes_stay_finite_and_within_one_step(centre: bool, count: int, scale) -> None:
    """Rows of -128 and 127 (the largest squares the scaling must keep below fp16's limit) at
    tiny and huge input scales normalise to within one step of the float64 op."""
    rng = np.random.default_rng(count)
    q = np.where(rng.random((4, count)) < 0.5, -128, 127).astype(np.int8)
    q[0, : count // 4] = 0
    gamma = rng.uniform(0.2, 0.9, count).astype(np.float16)
    beta = rng.uniform(-0.5, 0.5, count).astype(np.float16) if centre else None
    got = _normalise(q, scale, 0, gamma, beta, 1e-5, centre)
    real = q.astype(np.float64) * np.float64(np.float32(scale))
    expected = _float_layer_norm(real, gamma.astype(np.float64), beta, 1e-5, centre) / 0.02
    assert np.max(np.abs(got - np.clip(np.rint(expected), -128, 127))) <= 1


def test_a_constant_row_gives_beta_not_nan() -> None:
    """Zero variance: epsilon (at least 2**-24) keeps 1 / sqrt finite and d = 0."""
    q = np.full((2, 16), 37, np.int8)
    beta = np.linspace(-1, 1, 16).astype(np.float16)
    got = _normalise(q, 0.1, 3, np.ones(16, np.float16), beta, 0.0, True)
    expected = np.rint(beta.astype(np.float32) / np.float32(0.02)).astype(np.int8)
    np.testing.assert_array_equal(got, np.broadcast_to(expected, got.shape))
    assert fp16_epsilon(0.0, 0) == FP16_TINY


def test_an_epsilon_past_fp16_range_is_inf_and_normalises_to_beta(recwarn) -> None:
    """Codes far below sqrt(epsilon): the scaled epsilon overflows fp16 without a warning, and
    (x - mean) / sqrt(inf) = 0 leaves beta, what the true value rounds to."""
    exponent = fp16_input_exponent(128 * 1e-24, 16)
    assert fp16_epsilon(1e-5, exponent) == np.float16(np.inf)
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]
    q = np.arange(32, dtype=np.int8).reshape(2, 16)
    beta = np.linspace(-1, 1, 16).astype(np.float16)
    got = _normalise(q, 1e-24, 0, np.ones(16, np.float16), beta, 1e-5, True)
    expected = np.rint(beta.astype(np.float32) / np.float32(0.02)).astype(np.int8)
    np.testing.assert_array_equal(got, np.broadcast_to(expected, got.shape))


# --- NORM_FP16 in the emulator against the reference kernel ---------------------------------------


def _kernel(
    op_type: str,
    gamma: np.ndarray,
    beta: np.ndarray | None,
    *,
    axis: int,
    epsilon: float,
    dtype: str = "int8",
) -> Fp16NormKernel:
    zero_point = -6 if dtype == "int8" else 131
    inputs = [
        QuantOperand("x", qparams(0.04, zero_point, dtype), None),
        ConstOperand("g", gamma.astype(np.float32)),
    ]
    if beta is not None:
        inputs.append(ConstOperand("b", beta.astype(np.float32)))
    ctx = OpContext(
        node=helper.make_node(
            op_type, ["x", "g", "b"][: len(inputs)], ["y"], axis=axis, epsilon=epsilon
        ),
        opset=NORMS[op_type],
        mode="sima",
        inputs=tuple(inputs),
        outputs=(qparams(0.03, 5 if dtype == "int8" else 120, dtype),),
    )
    kernel = lower_fp16_normalization(ctx).kernel
    assert isinstance(kernel, Fp16NormKernel)
    return kernel


def _instruction(build: Codegen, kernel: Fp16NormKernel, x: np.ndarray, dtype: str) -> NormFp16:
    """The NORM_FP16 that codegen writes for `kernel` on input `x`."""
    axis = kernel.axis % x.ndim
    normalised = x.shape[axis:]
    scale, epsilon = kernel.scaled(math.prod(normalised))

    def table(values: np.ndarray | None):
        if values is None:
            return None
        return build.const(np.broadcast_to(values, normalised), "float16")

    return NormFp16(
        op=NormOp.LAYER if kernel.centre else NormOp.RMS,
        input=build.input("x", x.shape, dtype, Space.DRAM),
        output=build.output("y", x.shape, dtype, Space.ARENA),
        gamma=table(kernel.gamma),
        beta=table(kernel.beta),
        input_zero_point=kernel.input_zero_point,
        input_scale=float32_bits(scale),
        axis=axis,
        epsilon=float16_bits(epsilon),
        output_scale=float32_bits(kernel.output_scale),
        output_zero_point=kernel.zero_point,
        low=kernel.low,
        high=kernel.high,
    )


@pytest.mark.parametrize(
    ("op_type", "shape", "axis", "parameter_shape", "epsilon", "dtype"),
    [
        ("LayerNormalization", (2, 5, 7), -1, (7,), 1e-5, "int8"),
        ("LayerNormalization", (6, 16, 1, 1), 1, (16, 1, 1), 1e-6, "int8"),
        ("LayerNormalization", (1, 3, 4, 5), 1, (1, 4, 5), 1e-2, "uint8"),
        ("LayerNormalization", (3, 11), 0, (1,), 0.0, "int8"),
        ("RMSNormalization", (2, 5, 7), -1, (7,), 1e-5, "int8"),
        ("RMSNormalization", (1, 4, 6, 6), 2, (6, 6), 1e-3, "uint8"),
        ("RMSNormalization", (4, 300), 1, (300,), 1e-6, "int8"),
    ],
)
def test_the_emulator_matches_the_reference_kernel(
    op_type: str, shape: tuple, axis: int, parameter_shape: tuple, epsilon: float, dtype: str
) -> None:
    rng = np.random.default_rng(len(shape) * 31 + axis)
    gamma = rng.uniform(-2.0, 2.0, parameter_shape)
    beta = rng.uniform(-1.0, 1.0, parameter_shape) if op_type == "LayerNormalization" else None
    kernel = _kernel(op_type, gamma, beta, axis=axis, epsilon=epsilon, dtype=dtype)
    x = random_codes(rng, shape, dtype)
    expected = kernel(x)
    build = Codegen()
    build.emit(_instruction(build, kernel, x, dtype))
    run_single(build, {"x": x}, expected)


def test_the_cost_model_counts_the_fp16_passes() -> None:
    build = Codegen()
    kernel = _kernel("LayerNormalization", np.ones(64), np.zeros(64), axis=-1, epsilon=1e-5)
    layer = _instruction(build, kernel, np.zeros((8, 64), np.int8), "int8")
    rms = NormFp16(**{**layer.__dict__, "op": NormOp.RMS, "beta": None})
    hardware = MlaHardware()
    assert instruction_cost(layer, hardware).compute > instruction_cost(rms, hardware).compute > 0


# --- QDQ models against ONNX Runtime --------------------------------------------------------------


def _cast(source: str, target: str, to: int) -> onnx.NodeProto:
    return helper.make_node("Cast", [source], [target], name=f"cast_{target}", to=to)


def _fp16_wrapped(op_type: str, shape: tuple, axis: int, epsilon: float) -> onnx.ModelProto:
    """x -> Q -> DQ -> Cast16 -> Cast32 -> norm -> Cast16 -> Cast32 -> Q -> DQ -> y, written the
    way the quantizer writes an fp16 op; scales and zero points fit inputs of std 1."""
    rng = np.random.default_rng(axis + len(shape))
    normalised = shape[axis:]
    inits = {
        "s_in": np.array(0.025, np.float32),
        "z_in": np.array(-3, np.int8),
        "s_out": np.array(0.022, np.float32),
        "z_out": np.array(4, np.int8),
        "g": rng.uniform(0.5, 1.5, normalised).astype(np.float32),
        "b": rng.uniform(-0.3, 0.3, normalised).astype(np.float32),
    }
    parameters = ["g", "b"] if op_type == "LayerNormalization" else ["g"]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s_in", "z_in"], ["xq"], name="q_in"),
        helper.make_node("DequantizeLinear", ["xq", "s_in", "z_in"], ["xd"], name="dq_in"),
        _cast("xd", "x16", TensorProto.FLOAT16),
        _cast("x16", "x32", TensorProto.FLOAT),
        helper.make_node(
            op_type, ["x32", *parameters], ["n"], name="norm", axis=axis, epsilon=epsilon
        ),
        _cast("n", "n16", TensorProto.FLOAT16),
        _cast("n16", "n32", TensorProto.FLOAT),
        helper.make_node("QuantizeLinear", ["n32", "s_out", "z_out"], ["yq"], name="q_out"),
        helper.make_node("DequantizeLinear", ["yq", "s_out", "z_out"], ["y"], name="dq_out"),
    ]
    graph = helper.make_graph(
        nodes,
        "fp16_norm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape))],
        [numpy_helper.from_array(value, name) for name, value in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", NORMS[op_type])])
    model.ir_version = 10
    return model


def _float_norm(model: onnx.ModelProto, feed: dict[str, np.ndarray]) -> np.ndarray:
    """ONNX Runtime's float op on the dequantized input: the norm node alone, in float32."""
    norm = next(n for n in model.graph.node if n.name == "norm")
    constants = [i for i in model.graph.initializer if i.name in norm.input]
    shape = list(feed["x"].shape)
    graph = helper.make_graph(
        [helper.make_node(norm.op_type, ["x", *norm.input[1:]], ["y"], **_attributes(norm))],
        "float_norm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
        constants,
    )
    float_model = helper.make_model(graph, opset_imports=list(model.opset_import))
    float_model.ir_version = model.ir_version
    session = ort.InferenceSession(float_model.SerializeToString())
    return session.run(None, feed)[0]


def _attributes(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


@pytest.mark.parametrize("op_type", list(NORMS))
@pytest.mark.parametrize(
    ("shape", "axis", "epsilon"),
    [((2, 16, 1, 1), 1, 1e-6), ((1, 3, 4, 24), -1, 1e-5), ((197, 192, 1, 1), 1, 1e-6)],
)
def test_fp16_wrapped_norms_agree_with_onnx_runtime(op_type, shape, axis, epsilon) -> None:
    """Within two output steps of ONNX Runtime on the QDQ model (its Casts round to fp16 too)
    and of the float op on the dequantized input; no node runs in float."""
    model = _fp16_wrapped(op_type, shape, axis, epsilon)
    executor = IntegerExecutor(model)
    assert executor.float_nodes == ()
    [step] = [s for s in executor.steps if s.kind == "integer"]
    assert step.pattern == f"{op_type}(fp16)"
    rng = np.random.default_rng(7)
    for _ in range(3):
        feed = {"x": rng.normal(0, 1, shape).astype(np.float32)}
        ours = executor.run(feed)["y"]
        qdq = ort_run(model, feed)["y"]
        dequantized = (np.clip(np.rint(feed["x"] / 0.025) - 3, -128, 127) + 3) * np.float32(0.025)
        reference = _float_norm(model, {"x": dequantized.astype(np.float32)})
        assert np.max(np.abs(ours - qdq)) <= 2 * 0.022 + 1e-6
        representable = np.clip(reference, (-128 - 4) * 0.022, (127 - 4) * 0.022)
        assert np.max(np.abs(ours - representable)) <= 2 * 0.022


def test_casts_that_a_float_node_reads_still_run() -> None:
    """Only Casts whose every reader is an fp16 step are elided."""
    model = _fp16_wrapped("LayerNormalization", (2, 16), 1, 1e-5)
    model.graph.output.append(helper.make_tensor_value_info("x32", TensorProto.FLOAT, [2, 16]))
    executor = IntegerExecutor(model)
    assert {name for name, _ in executor.float_nodes} == {"cast_x16", "cast_x32"}
    feed = {"x": np.random.default_rng(0).normal(0, 1, (2, 16)).astype(np.float32)}
    outputs = executor.run(feed)
    np.testing.assert_array_equal(outputs["x32"], ort_run(model, feed)["x32"])


def test_rms_normalization_between_dq_and_q_runs_on_the_fp16_unit() -> None:
    """No integer form: a plain DQ -> RMSNormalization -> Q is the same fp16 step."""
    model = _fp16_wrapped("RMSNormalization", (3, 32), 1, 1e-5)
    nodes = [n for n in model.graph.node if n.op_type != "Cast"]
    nodes[2].input[0], nodes[3].input[0] = "xd", "n"
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    executor = IntegerExecutor(model)
    assert executor.float_nodes == ()
    rng = np.random.default_rng(3)
    for _ in range(3):
        feed = {"x": rng.normal(0, 1, (3, 32)).astype(np.float32)}
        assert np.max(np.abs(executor.run(feed)["y"] - ort_run(model, feed)["y"])) <= 2 * 0.022


# --- a transformer block compiled for rk3588 ------------------------------------------------------


def _transformer_block(norm: str, tokens: int = 8, channels: int = 16) -> onnx.ModelProto:
    """Patch embedding, then pre-norm attention and MLP with residuals, in the rank-4 form the
    rk3588 rules give a ViT: tokens on axis 0, channels on axis 1, norms over axis 1."""
    rng = np.random.default_rng(0)
    t, c = tokens, channels

    def weight(name: str, shape: tuple) -> onnx.TensorProto:
        return numpy_helper.from_array(rng.normal(0, 0.3, shape).astype(np.float32), name)

    inits = [weight(name, (c, c, 1, 1)) for name in ("we", "wq", "wk", "wv", "wo")]
    inits += [weight("w1", (2 * c, c, 1, 1)), weight("w2", (c, 2 * c, 1, 1))]
    for k in (1, 2):
        gamma = rng.uniform(0.5, 1.5, (c, 1, 1)).astype(np.float32)
        inits.append(numpy_helper.from_array(gamma, f"g{k}"))
        inits.append(
            numpy_helper.from_array(rng.normal(0, 0.2, (c, 1, 1)).astype(np.float32), f"b{k}")
        )
    inits.append(numpy_helper.from_array(np.array([1, 1, t, c], np.int64), "rows"))
    inits.append(numpy_helper.from_array(np.array([t, c, 1, 1], np.int64), "tokens"))

    def normalise(x: str, k: int, y: str) -> onnx.NodeProto:
        parameters = [f"g{k}", f"b{k}"] if norm == "LayerNormalization" else [f"g{k}"]
        return helper.make_node(norm, [x, *parameters], [y], axis=1, epsilon=1e-5)

    nodes = [
        helper.make_node("Conv", ["x", "we"], ["e"]),
        normalise("e", 1, "n1"),
        *(helper.make_node("Conv", ["n1", f"w{p}"], [p]) for p in "qkv"),
        *(helper.make_node("Reshape", [p, "rows"], [f"{p}2"]) for p in "qkv"),
        helper.make_node("Transpose", ["k2"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q2", "kt"], ["scores"]),
        helper.make_node("Softmax", ["scores"], ["p"], axis=3),
        helper.make_node("MatMul", ["p", "v2"], ["a2"]),
        helper.make_node("Reshape", ["a2", "tokens"], ["a"]),
        helper.make_node("Conv", ["a", "wo"], ["o"]),
        helper.make_node("Add", ["e", "o"], ["r"]),
        normalise("r", 2, "n2"),
        helper.make_node("Conv", ["n2", "w1"], ["h"]),
        helper.make_node("Relu", ["h"], ["hr"]),
        helper.make_node("Conv", ["hr", "w2"], ["m"]),
        helper.make_node("Add", ["r", "m"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "transformer_block",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [t, c, 1, 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [t, c, 1, 1])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", NORMS[norm])])


@pytest.mark.parametrize("norm", list(NORMS))
def test_a_transformer_block_compiles_to_checks_segments_bit_exact(norm: str, tmp_path) -> None:
    """check counts one segment with every node on the MLA; the compile writes one .elf, runs
    nothing on a host processor, notes nothing, and the emulator equals the reference; the
    outputs are within a few steps of ONNX Runtime's QDQ simulation and close to the float
    model."""
    model = _transformer_block(norm)
    report = check_model(model, target="rk3588")
    assert {p.processor for p in report.placements} == {"MLA"}
    rng = np.random.default_rng(1)
    samples = [{"x": rng.normal(0, 1, (8, 16, 1, 1)).astype(np.float32)} for _ in range(6)]
    qdq = quantize_model(model, samples[:4], target="rk3588").model
    result = compile_model(qdq, tmp_path, target="rk3588", model_name="block")
    assert len(result.elf_files) == result.mla_segments == report.mla_segments == 1
    assert [s["kernel"] for s in result.stages if s["kernel"] in ("mla", "onnx")] == ["mla"]
    assert result.notes == []
    archive = read_archive(result.archive)
    float_session = ort.InferenceSession(model.SerializeToString())
    step = IntegerExecutor(qdq).output_params["y"].scalar_scale()
    for feed in samples[4:]:
        outputs, _ = run_archive(archive, feed)
        np.testing.assert_array_equal(
            outputs["y"], reference_outputs(archive.manifest, qdq, feed)["y"]
        )
        assert np.max(np.abs(outputs["y"] - ort_run(qdq, feed)["y"])) <= 4 * step + 1e-6
        expected = float_session.run(None, feed)[0]
        cosine = (
            np.sum(outputs["y"] * expected)
            / np.linalg.norm(outputs["y"])
            / np.linalg.norm(expected)
        )
        assert cosine > 0.98


@pytest.mark.parametrize("target", ["mlsoc", "modalix", "rk3588"])
@pytest.mark.parametrize("norm", ["RMSNormalization", "LayerNormalization"])
def test_a_norm_without_bias_stays_in_its_segment(norm: str, target: str, tmp_path) -> None:
    """Conv -> RMSNormalization (or a LayerNormalization without B, as torch exports
    `bias=False`: PoolFormerV2, CAFormer) -> Conv: int8-wrapped on mlsoc / modalix,
    fp16-wrapped on rk3588; one .elf either way, bit-exact."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.5, (4, 4, 1, 1)).astype(np.float32), name)
        for name in ("w1", "w2")
    ]
    inits.append(numpy_helper.from_array(rng.uniform(0.5, 1.5, (4, 1, 1)).astype(np.float32), "g"))
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w1"], ["a"]),
            helper.make_node(norm, ["a", "g"], ["p"], axis=1),
            helper.make_node("Conv", ["p", "w2"], ["y"]),
        ],
        "conv_norm_conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", NORMS[norm])])
    assert check_model(model, target=target).mla_segments == 1
    samples = [{"x": rng.normal(0, 1, (1, 4, 8, 8)).astype(np.float32)} for _ in range(4)]
    qdq = quantize_model(model, samples, target=target).model
    result = compile_model(qdq, tmp_path, target=target, model_name="op")
    assert (len(result.elf_files), result.notes) == (1, [])
    archive = read_archive(result.archive)
    outputs, _ = run_archive(archive, samples[0])
    expected = reference_outputs(archive.manifest, qdq, samples[0])
    np.testing.assert_array_equal(outputs["y"], expected["y"])


def test_a_batch_of_two_runs_every_frame_bit_exact(tmp_path) -> None:
    """Conv -> LayerNormalization (last axis) -> Conv on rk3588: one NORM_FP16 over both frames."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.normal(0, 0.5, (4, 4, 1, 1)).astype(np.float32), name)
        for name in ("w1", "w2")
    ]
    inits.append(numpy_helper.from_array(rng.uniform(0.5, 1.5, (8,)).astype(np.float32), "g"))
    inits.append(numpy_helper.from_array(rng.normal(0, 0.2, (8,)).astype(np.float32), "b"))
    graph = helper.make_graph(
        [
            helper.make_node("Conv", ["x", "w1"], ["a"]),
            helper.make_node("LayerNormalization", ["a", "g", "b"], ["p"], axis=-1),
            helper.make_node("Conv", ["p", "w2"], ["y"]),
        ],
        "conv_layernorm_conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    samples = [{"x": rng.normal(0, 1, (1, 4, 8, 8)).astype(np.float32)} for _ in range(4)]
    qdq = quantize_model(model, samples, target="rk3588").model
    result = compile_model(qdq, tmp_path, target="rk3588", batch_size=2, model_name="op")
    assert (result.actual_batch_size, len(result.elf_files), result.notes) == (2, 1, [])
    archive = read_archive(result.archive)
    outputs, _ = run_archive(archive, {"x": np.concatenate([s["x"] for s in samples[:2]])})
    expected = [reference_outputs(archive.manifest, qdq, s)["y"] for s in samples[:2]]
    np.testing.assert_array_equal(outputs["y"], np.concatenate(expected))
