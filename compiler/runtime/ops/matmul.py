"""MatMul and Gemm: centred operands, exact integer products, per-column requantization.

acc = (A - z_A) @ (B - z_B) + bias          (int64, then saturated to int32)
y   = clamp(requantize(acc, alpha * s_A * s_B[n] / s_y) + z_y)

B may be per-axis quantized along its output-column axis (the last axis of MatMul's B; axis 1,
or 0 with transB, for Gemm). A MatMul followed by an Add of a constant (its bias) fuses.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from compiler.intmath import int_matmul
from compiler.runtime.ops.base import Lowered, OpContext, OutputStage, align_bias
from compiler.runtime.qparams import NotLowerable, QuantOperand


def column_params(operand: QuantOperand, column_axis: int) -> tuple[np.ndarray, np.ndarray]:
    """(scale float64, zero point int64) per output column, or scalars when per-tensor."""
    params = operand.params
    if params.per_tensor:
        return np.float64(params.scalar_scale()), np.int64(params.scalar_zero_point())
    ndim = operand.value.ndim if operand.value is not None else None
    if ndim is None or params.axis is None or params.axis % ndim != column_axis % ndim:
        raise NotLowerable(f"{operand.name} is quantized per axis {params.axis}, not per column")
    return params.scale.astype(np.float64), params.zero_point.astype(np.int64)


@dataclass(frozen=True, eq=False)
class MatMulKernel:
    """Integer (batched, broadcasting) MatMul; `trans_a`/`trans_b` serve Gemm."""

    a_zero_point: int
    b_zero_point: np.ndarray
    bias: np.ndarray | int
    stage: OutputStage
    trans_a: bool = False
    trans_b: bool = False

    def __call__(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        a = a.T if self.trans_a else a
        b = b.T if self.trans_b else b
        acc = int_matmul(
            a.astype(np.int64) - self.a_zero_point, b.astype(np.int64) - self.b_zero_point
        )
        return self.stage(acc + self.bias)


def lower_matmul(ctx: OpContext) -> Lowered:
    a, a_scale, a_zero_point = ctx.activation_input(0)
    b = ctx.quant(1)
    b_scale, b_zero_point = column_params(b, -1)
    output = ctx.output(0)
    accumulator_scale = a_scale * b_scale
    kernel = MatMulKernel(
        a_zero_point=a_zero_point,
        b_zero_point=b_zero_point,
        bias=align_bias(ctx.bias, accumulator_scale),
        stage=OutputStage.build(
            accumulator_scale / output.scalar_scale(), output, ctx.mode, ctx.activation
        ),
    )
    return Lowered(kernel, (a.name, b.name))


def lower_gemm(ctx: OpContext) -> Lowered:
    a, a_scale, a_zero_point = ctx.activation_input(0)
    b = ctx.quant(1)
    trans_a, trans_b = bool(ctx.attr("transA", 0)), bool(ctx.attr("transB", 0))
    b_scale, b_zero_point = column_params(b, 0 if trans_b else 1)
    alpha, beta = float(ctx.attr("alpha", 1.0)), float(ctx.attr("beta", 1.0))
    if alpha <= 0:
        raise NotLowerable("Gemm alpha must be positive for a non-negative multiplier")
    output = ctx.output(0)
    accumulator_scale = alpha * a_scale * b_scale
    kernel = MatMulKernel(
        a_zero_point=a_zero_point,
        b_zero_point=b_zero_point,
        bias=align_bias(ctx.input(2), accumulator_scale, factor=beta),
        stage=OutputStage.build(
            accumulator_scale / output.scalar_scale(), output, ctx.mode, ctx.activation
        ),
        trans_a=trans_a,
        trans_b=trans_b,
    )
    return Lowered(kernel, (a.name, b.name))


LOWERINGS = {"MatMul": lower_matmul, "Gemm": lower_gemm}
