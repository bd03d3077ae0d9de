"""MatMul and Gemm: centred operands, exact integer products, per-column requantization.

acc = (A - z_A) @ (B - z_B) + bias          (int64, then saturated to int32)
y   = clamp(requantize(acc, alpha * s_A * s_B[n] / s_y) + z_y)

B may be per-axis quantized along its output-column axis (the last axis of MatMul's B; axis 1,
or 0 with transB, for Gemm). A MatMul followed by an Add of a constant (its bias) fuses.
An Einsum that is a batched matrix product (e.g. "bhid,bhjd->bhij") is the same MatMul on
permuted operands, its product permuted to the equation's output order.

CumSum along an axis of length L is the product of the centred codes (that axis moved last)
with a constant L x L matrix of zeros and ones (`prefix_matrix`: T[j, i] = 1 where input j
enters output i), requantized by s_in / s_out: exact prefix sums, one rounding.
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


@dataclass(frozen=True)
class EinsumPlan:
    """An Einsum as a batched matrix product: A and B permuted to (batch…, M, K) and
    (batch…, K, N); the product (batch…, M, N) permuted by `output` to the equation's order."""

    a: tuple[int, ...]
    b: tuple[int, ...]
    output: tuple[int, ...]


def einsum_plan(equation: str) -> EinsumPlan | None:
    """The plan of a two-operand Einsum in which every index is a batch index (in both operands
    and the output) or one of exactly one row (A and output), one column (B and output) and one
    contracted (A and B) index; None for any other equation."""
    eq = equation.replace(" ", "")
    if "..." in eq or eq.count("->") != 1:
        return None
    lhs, out = eq.split("->")
    operands = lhs.split(",")
    if len(operands) != 2 or any(len(set(t)) != len(t) for t in (*operands, out)):
        return None
    ta, tb = operands
    batch = [i for i in out if i in ta and i in tb]
    rows = [i for i in ta if i in out and i not in tb]
    columns = [i for i in tb if i in out and i not in ta]
    contracted = [i for i in ta if i in tb and i not in out]
    if not (len(rows) == len(columns) == len(contracted) == 1):
        return None
    if len(batch) + 2 != len(ta) or len(batch) + 2 != len(tb) or len(batch) + 2 != len(out):
        return None
    product = [*batch, *rows, *columns]
    return EinsumPlan(
        a=tuple(ta.index(i) for i in (*batch, *rows, *contracted)),
        b=tuple(tb.index(i) for i in (*batch, *contracted, *columns)),
        output=tuple(product.index(i) for i in out),
    )


@dataclass(frozen=True, eq=False)
class EinsumKernel:
    """Einsum (attention's QK^T and PV written as equations) as a permuted MatMul."""

    matmul: MatMulKernel
    plan: EinsumPlan

    def __call__(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        product = self.matmul(np.transpose(a, self.plan.a), np.transpose(b, self.plan.b))
        return np.transpose(product, self.plan.output)


def lower_einsum(ctx: OpContext) -> Lowered:
    plan = einsum_plan(str(ctx.attr("equation", "")))
    if plan is None:
        raise NotLowerable(f"Einsum {ctx.attr('equation')!r} is not a batched matrix product")
    if not ctx.quant(1).params.per_tensor:
        raise NotLowerable("Einsum operands must be quantized per tensor")
    lowered = lower_matmul(ctx)
    return Lowered(EinsumKernel(lowered.kernel, plan), lowered.inputs)


def prefix_matrix(length: int, *, exclusive: bool, reverse: bool) -> np.ndarray:
    """T (int8, L x L) with x @ T = CumSum(x) along the last axis: T[j, i] = 1 where input j
    enters output i (j <= i; j < i when exclusive; mirrored when reverse)."""
    j, i = np.indices((length, length))
    enters = (j >= i if reverse else j <= i) & (j != i if exclusive else True)
    return enters.astype(np.int8)


@dataclass(frozen=True, eq=False)
class CumSumKernel:
    """Integer CumSum: centred codes times `prefix_matrix` along `axis`, then the stage."""

    axis: int
    exclusive: bool
    reverse: bool
    input_zero_point: int
    stage: OutputStage

    def __call__(self, x: np.ndarray) -> np.ndarray:
        axis = self.axis % x.ndim
        centred = np.moveaxis(x.astype(np.int64) - self.input_zero_point, axis, -1)
        matrix = prefix_matrix(x.shape[axis], exclusive=self.exclusive, reverse=self.reverse)
        return np.moveaxis(self.stage(int_matmul(centred, matrix)), -1, axis)


def lower_cumsum(ctx: OpContext) -> Lowered:
    x, x_scale, x_zero_point = ctx.activation_input(0)
    axis = ctx.ints(1)
    if axis is None or len(axis) != 1:
        raise NotLowerable("the CumSum axis must be a constant scalar")
    output = ctx.output(0)
    kernel = CumSumKernel(
        axis=axis[0],
        exclusive=bool(ctx.attr("exclusive", 0)),
        reverse=bool(ctx.attr("reverse", 0)),
        input_zero_point=x_zero_point,
        stage=OutputStage.build(x_scale / output.scalar_scale(), output, ctx.mode),
    )
    return Lowered(kernel, (x.name,))


LOWERINGS = {
    "MatMul": lower_matmul,
    "Gemm": lower_gemm,
    "Einsum": lower_einsum,
    "CumSum": lower_cumsum,
}
