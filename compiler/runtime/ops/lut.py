"""Elementwise nonlinear functions as lookup tables over every input code.

table[q - min] = saturate(round_half_even(f((q - z_in) * s_in) / s_out) + z_out), f in float64:
256 entries for 8-bit inputs, 65536 for 16-bit. The table is a constant of the program (the
compiler computes it, the MLA only indexes it), so it is exact by construction: the only error
against float is the output rounding. A Mul of x by Sigmoid(x) or HardSigmoid(x) with no
QuantizeLinear in between (SiLU / Swish / HardSwish written out) is one table of x * gate(x).
Pow with a constant scalar exponent and PRelu with one slope are tables too.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from compiler.intmath import apply_lut, build_lut
from compiler.runtime.ops.base import Lowered, OpContext
from compiler.runtime.qparams import NotLowerable

RealFunction = Callable[[np.ndarray], np.ndarray]

_erf = np.vectorize(math.erf, otypes=[np.float64])


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, x)


def _elu(x: np.ndarray, alpha: float) -> np.ndarray:
    return np.where(x > 0, x, alpha * np.expm1(np.minimum(x, 0.0)))


def _hard_sigmoid(x: np.ndarray, alpha: float, beta: float) -> np.ndarray:
    return np.clip(alpha * x + beta, 0.0, 1.0)


def _clip(ctx: OpContext) -> RealFunction:
    low = ctx.constant(1) if ctx.opset >= 11 else ctx.attr("min")
    high = ctx.constant(2) if ctx.opset >= 11 else ctx.attr("max")
    low = -np.inf if low is None else float(np.asarray(low))
    high = np.inf if high is None else float(np.asarray(high))
    return lambda x: np.clip(x, low, high)


def _leaky_relu(ctx: OpContext) -> RealFunction:
    alpha = float(ctx.attr("alpha", 0.01))
    return lambda x: np.where(x >= 0, x, alpha * x)


def _elu_op(ctx: OpContext) -> RealFunction:
    alpha = float(ctx.attr("alpha", 1.0))
    return lambda x: _elu(x, alpha)


def _selu(ctx: OpContext) -> RealFunction:
    alpha = float(ctx.attr("alpha", 1.6732632423543772))
    gamma = float(ctx.attr("gamma", 1.0507009873554805))
    return lambda x: gamma * _elu(x, alpha)


def _celu(ctx: OpContext) -> RealFunction:
    alpha = float(ctx.attr("alpha", 1.0))
    return lambda x: (
        np.maximum(x, 0.0) + np.minimum(0.0, alpha * np.expm1(np.minimum(x, 0) / alpha))
    )


def _thresholded_relu(ctx: OpContext) -> RealFunction:
    alpha = float(ctx.attr("alpha", 1.0))
    return lambda x: np.where(x > alpha, x, 0.0)


def _hard_sigmoid_op(ctx: OpContext) -> RealFunction:
    alpha, beta = float(ctx.attr("alpha", 0.2)), float(ctx.attr("beta", 0.5))
    return lambda x: _hard_sigmoid(x, alpha, beta)


def _hard_swish(_: OpContext) -> RealFunction:
    return lambda x: x * _hard_sigmoid(x, 1.0 / 6.0, 0.5)


def _gelu(ctx: OpContext) -> RealFunction:
    if ctx.attr("approximate", "none") == "tanh":
        inner = math.sqrt(2.0 / math.pi)
        return lambda x: 0.5 * x * (1.0 + np.tanh(inner * (x + 0.044715 * x**3)))
    return lambda x: 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def _swish(ctx: OpContext) -> RealFunction:
    alpha = float(ctx.attr("alpha", 1.0))
    return lambda x: x * _sigmoid(alpha * x)


def _quick_gelu(ctx: OpContext) -> RealFunction:
    """ONNX Runtime's contrib QuickGelu (com.microsoft): x·sigmoid(alpha·x), alpha 1.702 by
    default, the CLIP / ViT activation its transformer optimizer fuses. Swish with another
    default alpha, so the same table."""
    alpha = float(ctx.attr("alpha", 1.702))
    return lambda x: x * _sigmoid(alpha * x)


def _pow(ctx: OpContext) -> RealFunction:
    """x ** e for a constant scalar exponent (target profiles place Pow on the MLA only so)."""
    exponent = ctx.constant(1)
    if exponent is None or np.size(exponent) != 1:
        raise NotLowerable("Pow needs a constant scalar exponent")
    power = float(np.asarray(exponent).reshape(-1)[0])
    return lambda x: np.power(x, power)


def _prelu_slopes(ctx: OpContext) -> tuple[np.ndarray, int]:
    """PRelu's slopes (one, or one per position along one axis) and how many axes follow that
    axis in the slope's shape (ONNX broadcasts the slope against x from the right)."""
    slope = ctx.constant(1)
    if slope is None or np.size(slope) == 0:
        raise NotLowerable("PRelu needs a constant slope")
    values = np.asarray(slope, dtype=np.float64)
    flat = values.reshape(-1)
    if np.all(flat == flat[0]):
        return flat[:1], 0
    varying = [k for k, n in enumerate(values.shape) if n != 1]
    if len(varying) != 1:
        raise NotLowerable(f"PRelu slope of shape {values.shape} varies along several axes")
    return flat, values.ndim - 1 - varying[0]


def lower_prelu(ctx: OpContext) -> Lowered:
    """PRelu as one lookup table (one slope, PyTorch's default nn.PReLU()), or, for 8-bit
    inputs, one 256-entry table per channel (the LUT instruction's per-channel form)."""
    slopes, trailing = _prelu_slopes(ctx)
    if slopes.size == 1:
        alpha = float(slopes[0])
        return lookup_lowering(ctx, lambda x: np.where(x >= 0, x, alpha * x))
    tables = [
        _table(ctx, lambda v, a=float(a): np.where(v >= 0, v, a * v), max_bits=8) for a in slopes
    ]
    x = ctx.activation_input(0)[0]
    kernel = LookupKernel(np.stack(tables), np.dtype(x.params.dtype), trailing)
    return Lowered(kernel, (x.name,))


def _fixed(function: RealFunction) -> Callable[[OpContext], RealFunction]:
    return lambda _: function


FUNCTIONS: dict[str, Callable[[OpContext], RealFunction]] = {
    "Relu": _fixed(lambda x: np.maximum(x, 0.0)),
    "Clip": _clip,
    "Sigmoid": _fixed(_sigmoid),
    "Tanh": _fixed(np.tanh),
    "Exp": _fixed(np.exp),
    "Log": _fixed(np.log),
    "Sqrt": _fixed(np.sqrt),
    "Reciprocal": _fixed(lambda x: 1.0 / x),
    "Erf": _fixed(_erf),
    "Neg": _fixed(np.negative),
    "Abs": _fixed(np.abs),
    "Softsign": _fixed(lambda x: x / (1.0 + np.abs(x))),
    "Softplus": _fixed(_softplus),
    "Mish": _fixed(lambda x: x * np.tanh(_softplus(x))),
    "HardSigmoid": _hard_sigmoid_op,
    "HardSwish": _hard_swish,
    "LeakyRelu": _leaky_relu,
    "Elu": _elu_op,
    "Selu": _selu,
    "Celu": _celu,
    "ThresholdedRelu": _thresholded_relu,
    "Gelu": _gelu,
    "Swish": _swish,
    "QuickGelu": _quick_gelu,
    "Pow": _pow,
}
"""Unary op (ONNX, or a contrib op of `CONTRIB_OPS`) -> builder of its float64 function
(attributes bound)."""


def real_function(ctx: OpContext) -> RealFunction:
    """The float64 function of a unary elementwise op, with its attributes bound."""
    if ctx.op_type not in FUNCTIONS:
        raise NotLowerable(f"no lookup-table function for {ctx.op_type}")
    return FUNCTIONS[ctx.op_type](ctx)


@dataclass(frozen=True, eq=False)
class LookupKernel:
    """y = table[x - min(input dtype)]: every elementwise nonlinearity on the MLA. A 2-D table
    holds one table per position along the axis of x that has `trailing` axes after it."""

    table: np.ndarray
    input_dtype: np.dtype
    trailing: int = 0

    def axis(self, ndim: int) -> int:
        """The axis of a rank-`ndim` input the per-channel tables run along."""
        return ndim - 1 - self.trailing

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return apply_lut(self.table, x, self.input_dtype, self.axis(np.ndim(x)))


def _table(ctx: OpContext, function: RealFunction, max_bits: int = 16) -> np.ndarray:
    """`function` tabulated between the quantization of input 0 and of output 0."""
    x, x_scale, x_zero_point = ctx.activation_input(0)
    if x.params.bits > max_bits:
        raise NotLowerable(f"these lookup tables need inputs of at most {max_bits} bits")
    output = ctx.output(0)
    return build_lut(
        function,
        x_scale,
        x_zero_point,
        x.params.dtype,
        output.scalar_scale(),
        output.scalar_zero_point(),
        output.dtype,
    )


def lookup_lowering(ctx: OpContext, function: RealFunction) -> Lowered:
    """Tabulate `function` between the quantization of input 0 and of output 0."""
    x = ctx.activation_input(0)[0]
    table = _table(ctx, function)
    return Lowered(LookupKernel(table, np.dtype(x.params.dtype)), (x.name,))


def lower_unary(ctx: OpContext) -> Lowered:
    return lookup_lowering(ctx, real_function(ctx))


def lower_gated(ctx: OpContext) -> Lowered:
    """x * gate(x) for a Mul whose other input is Sigmoid(x) or HardSigmoid(x) of the same x."""
    if ctx.gate is None:
        raise NotLowerable("not a gated multiplication")
    gate_ctx = OpContext(ctx.gate, ctx.opset, ctx.mode, ctx.inputs[:1], ctx.outputs)
    gate = real_function(gate_ctx)
    return lookup_lowering(ctx, lambda x: x * gate(x))


LOWERINGS = {**{op_type: lower_unary for op_type in FUNCTIONS}, "PRelu": lower_prelu}
