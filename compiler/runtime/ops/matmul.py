"""MatMul and Gemm: centred operands, exact integer products, per-column requantization.

acc = (A - z_A) @ (B - z_B) + bias          (int64, then saturated to int32)
y   = clamp(requantize(acc, alpha * s_A * s_B[n] / s_y) + z_y)

B may be per-axis quantized along its output-column axis (the last axis of MatMul's B; axis 1,
or 0 with transB, for Gemm). A MatMul followed by an Add of a constant (its bias) fuses.
A two-operand Einsum (batch, row, column and contracted indices, any number of each) is the
same MatMul on views of its operands (`EinsumPlan`): extra rows and columns broadcast as batch
axes, contracted indices merge into one depth axis; a one-operand Einsum is ReduceSum on the
permuted input.

CumSum along an axis of length L is the product of the centred codes (that axis moved last)
with a constant L x L matrix of zeros and ones (`prefix_matrix`: T[j, i] = 1 where input j
enters output i), requantized by s_in / s_out: exact prefix sums, one rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from compiler.intmath import int_matmul
from compiler.isa import MAX_RANK
from compiler.runtime.ops.base import Lowered, OpContext, OutputStage, align_bias
from compiler.runtime.ops.pool import average_stage
from compiler.runtime.ops.reduce import ReduceSumKernel, Reduction
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


def _matmul_kernel(
    ctx: OpContext,
    a_scale: float,
    a_zero_point: int,
    b_scale: np.ndarray,
    b_zero_point: np.ndarray,
) -> MatMulKernel:
    """The MatMul of centred operands with the fused bias and one output stage: the single
    definition that MatMul and Einsum share."""
    output = ctx.output(0)
    accumulator_scale = a_scale * b_scale
    return MatMulKernel(
        a_zero_point=a_zero_point,
        b_zero_point=b_zero_point,
        bias=align_bias(ctx.bias, accumulator_scale),
        stage=OutputStage.build(
            accumulator_scale / output.scalar_scale(), output, ctx.mode, ctx.activation
        ),
    )


def lower_matmul(ctx: OpContext) -> Lowered:
    a, a_scale, a_zero_point = ctx.activation_input(0)
    b = ctx.quant(1)
    b_scale, b_zero_point = column_params(b, -1)
    kernel = _matmul_kernel(ctx, a_scale, a_zero_point, b_scale, b_zero_point)
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
class AxisView:
    """How an Einsum operand is seen by MATMUL: its axes permuted by `perm`, then consecutive
    permuted axes grouped into the view's axes (`groups[i]` axes merged into axis i, in C order;
    0 inserts a size-1 axis). The reference reshapes; the code generator builds the same view
    from strides, which is why a group of several axes must be adjacent in the operand."""

    perm: tuple[int, ...]
    groups: tuple[int, ...]

    def shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The view's shape for an operand of `shape`."""
        permuted = [shape[p] for p in self.perm]
        sizes, start = [], 0
        for count in self.groups:
            sizes.append(math.prod(permuted[start : start + count]))
            start += count
        return tuple(sizes)

    def __call__(self, array: np.ndarray) -> np.ndarray:
        return np.transpose(array, self.perm).reshape(self.shape(array.shape))


@dataclass(frozen=True)
class EinsumPlan:
    """A two-operand Einsum as one batched, broadcasting MatMul.

    Indices in both operands and the output are batch indices, in A and the output rows, in B
    and the output columns, in A and B only contracted. The views are A (batch…, rows…, 1…,
    M, K), B (batch…, 1…, columns…, K, N) and the product (batch…, rows…, columns…, M, N): every
    row but the last (M) and every column but the last (N) is a broadcast batch axis, so they
    need no merging; the contracted indices merge into K. An absent M, N or K is a size-1 axis.
    `output` views the equation's output as the product (its groups are 0 or 1).
    """

    a: AxisView
    b: AxisView
    output: AxisView

    def product_to_output(self, product: np.ndarray) -> np.ndarray:
        """The product (batch…, rows…, columns…, M, N) in the equation's output order."""
        kept = [
            size for size, count in zip(product.shape, self.output.groups, strict=True) if count
        ]
        return np.transpose(product.reshape(kept), np.argsort(self.output.perm))


def _parse_einsum(equation: str) -> tuple[list[str], str]:
    """Operand terms and output term; the implicit output is the indices seen once, sorted."""
    eq = equation.replace(" ", "")
    if "." in eq:
        raise NotLowerable(f"Einsum {equation!r}: an ellipsis broadcasts unnamed axes")
    if eq.count("->") > 1:
        raise NotLowerable(f"Einsum {equation!r} is not an equation")
    lhs, arrow, out = eq.partition("->")
    terms = lhs.split(",")
    if not arrow:
        letters = "".join(terms)
        out = "".join(sorted(i for i in set(letters) if letters.count(i) == 1))
    for term in (*terms, out):
        if len(set(term)) != len(term) or not all(i.isalpha() for i in term):
            raise NotLowerable(f"Einsum {equation!r} repeats an index within one term")
    if not set(out) <= set("".join(terms)):
        raise NotLowerable(f"Einsum {equation!r} has an output index no operand has")
    return terms, out


def _adjacent(term: str, indices: list[str]) -> bool:
    """Whether `indices` occupy consecutive positions of `term`, in this order."""
    start = term.index(indices[0])
    return term[start : start + len(indices)] == "".join(indices)


def einsum_plan(
    equation: str, *, constant_b: bool = False, column: str | None = None
) -> EinsumPlan:
    """The MatMul plan of a two-operand Einsum, or NotLowerable saying why there is none.

    Several contracted indices must merge into one depth axis: run-time operands are C-ordered,
    so they have to be adjacent and in the same order in A and in a run-time B (a constant B is
    permuted at build time). `column` names the column index that must be N (B's per-axis
    quantized axis), otherwise N is the output's last column.
    """
    terms, out = _parse_einsum(equation)
    if len(terms) != 2:
        raise NotLowerable(f"Einsum {equation!r} has {len(terms)} operands, not two")
    ta, tb = terms
    for term, other in ((ta, tb), (tb, ta)):
        summed = [i for i in term if i not in other and i not in out]
        if summed:
            raise NotLowerable(
                f"Einsum {equation!r} sums {''.join(summed)!r} within one operand "
                "(a reduction before the product, not a contraction)"
            )
    batch = [i for i in out if i in ta and i in tb]
    rows = [i for i in out if i in ta and i not in tb]
    columns = [i for i in out if i in tb and i not in ta]
    contracted = [i for i in ta if i in tb and i not in out]
    if column is not None:
        if column not in columns:
            raise NotLowerable(
                f"Einsum {equation!r}: B is quantized per axis {column!r}, not per output column"
            )
        columns = [i for i in columns if i != column] + [column]
    if len(contracted) > 1:
        if not _adjacent(ta, contracted):
            raise NotLowerable(
                f"Einsum {equation!r}: the contracted indices {''.join(contracted)!r} are not "
                "adjacent in A, so no strided view merges them into one depth axis"
            )
        if not constant_b and not _adjacent(tb, contracted):
            raise NotLowerable(
                f"Einsum {equation!r}: the contracted indices {''.join(contracted)!r} are not "
                "adjacent and in A's order in the run-time B, so no strided view merges them "
                "into one depth axis"
            )
    extra_rows, m = rows[:-1], rows[-1:]
    extra_columns, n = columns[:-1], columns[-1:]
    product = [*batch, *extra_rows, *extra_columns, *m, *n]
    if len(batch) + len(extra_rows) + len(extra_columns) + 2 > MAX_RANK:
        raise NotLowerable(f"Einsum {equation!r} needs a product of more than {MAX_RANK} axes")
    broadcast_columns = [0] * len(extra_columns)  # size-1 axes of A facing B's extra columns
    a_order = [*batch, *rows, *contracted]
    b_order = [*batch, *extra_columns, *contracted, *n]
    return EinsumPlan(
        a=AxisView(
            tuple(ta.index(i) for i in a_order),
            (*[1] * (len(batch) + len(extra_rows)), *broadcast_columns, len(m), len(contracted)),
        ),
        b=AxisView(
            tuple(tb.index(i) for i in b_order),
            (*[1] * len(batch), *[0] * len(extra_rows), *[1] * len(extra_columns))
            + (len(contracted), len(n)),
        ),
        output=AxisView(
            tuple(out.index(i) for i in product),
            (*[1] * (len(batch) + len(extra_rows) + len(extra_columns)), len(m), len(n)),
        ),
    )


@dataclass(frozen=True, eq=False)
class EinsumKernel:
    """A two-operand Einsum: `MatMulKernel` (the one MatMul arithmetic) on the plan's views
    of both operands, its product permuted to the equation's output order."""

    matmul: MatMulKernel
    plan: EinsumPlan

    def __call__(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        product = self.matmul(self.plan.a(a), self.plan.b(b))
        return self.plan.product_to_output(product)


@dataclass(frozen=True, eq=False)
class EinsumSumKernel:
    """A one-operand Einsum: the input permuted by `perm` (kept indices in output order, then
    the summed ones), the trailing `summed` axes added by `ReduceSumKernel` (REDUCE SUM; a
    pure transposition is its rescale alone, a MOVE)."""

    perm: tuple[int, ...]
    summed: int
    reduce: ReduceSumKernel

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.reduce(np.transpose(x, self.perm))


def _lower_einsum_sum(ctx: OpContext, term: str, out: str) -> Lowered:
    x, x_scale, x_zero_point = ctx.activation_input(0)
    summed = [i for i in term if i not in out]
    perm = tuple(term.index(i) for i in (*out, *summed))
    axes = tuple(range(len(out), len(term)))
    kernel = EinsumSumKernel(
        perm,
        len(summed),
        ReduceSumKernel(
            Reduction(axes, keepdims=False, noop_with_empty_axes=True),
            x_zero_point,
            False,
            average_stage(ctx, x_scale),
        ),
    )
    return Lowered(kernel, (x.name,))


def lower_einsum(ctx: OpContext) -> Lowered:
    """Einsum as a MatMul (two operands) or a REDUCE SUM / MOVE (one operand).

    A constant first operand with a run-time second one swaps them (Einsum is symmetric in
    its operands), so that the constant is B: MATMUL's weight, which may be per-column."""
    equation = str(ctx.attr("equation", ""))
    terms, out = _parse_einsum(equation)
    if len(terms) == 1 and len(ctx.inputs) == 1:
        return _lower_einsum_sum(ctx, terms[0], out)
    if len(terms) != 2 or len(ctx.inputs) != 2:
        raise NotLowerable(f"Einsum {equation!r} has {len(terms)} operands, not one or two")
    first, second = ctx.quant(0), ctx.quant(1)
    if first.value is not None and second.value is None:
        terms.reverse()
        ctx = replace(ctx, inputs=(second, first))
    ta, tb = terms
    b = ctx.quant(1)
    column = None
    if not b.params.per_tensor and b.value is not None and b.params.axis is not None:
        column = tb[b.params.axis % len(tb)]
    plan = einsum_plan(f"{ta},{tb}->{out}", constant_b=b.value is not None, column=column)
    a, a_scale, a_zero_point = ctx.activation_input(0)
    b_scale, b_zero_point = column_params(b, tb.index(column) if column else -1)
    kernel = _matmul_kernel(ctx, a_scale, a_zero_point, b_scale, b_zero_point)
    return Lowered(EinsumKernel(kernel, plan), (a.name, b.name))


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
