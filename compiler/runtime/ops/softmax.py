"""Softmax in integers: max-subtract, exp table, integer sum, one reciprocal per row.

  d  = q - max(q)                        in [-(2**bits - 1), 0]
  e  = EXP[d]                            EXP[d] = round_half_up(exp(d * s_in) * 2**16), so e <= 2**16
  S  = sum(e)                            int64 (>= 2**16: the maximum contributes exp(0))
  R  = round_half_up(2**47 / S)          one integer division per row, R <= 2**31
  p  = (e * R) >> 17, rounded half up    the probability in Q30 (<= 2**30)
  y  = clamp(requantize(p, 2**-30 / s_out) + z_out)

The exp table (2**bits entries) is a program constant computed in float64. The result is
deterministic and within a few output steps of float softmax; it is not bit-equal to it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from compiler.intmath import divide_round_half_up, round_half_up, rounding_right_shift
from compiler.runtime.ops.base import Lowered, OpContext, OutputStage
from compiler.runtime.qparams import NotLowerable

EXP_BITS = 16
RECIPROCAL_BITS = 47
PROBABILITY_BITS = 30


def exp_table(input_scale: float, bits: int) -> np.ndarray:
    """EXP[i] = round_half_up(exp(-(span - i) * s_in) * 2**16) for i in [0, span], span = 2**bits - 1."""
    span = (1 << bits) - 1
    differences = np.arange(-span, 1, dtype=np.float64)
    return round_half_up(np.exp(differences * input_scale) * (1 << EXP_BITS))


@dataclass(frozen=True, eq=False)
class SoftmaxKernel:
    """Integer Softmax over `axis` (opset >= 13) or the flattened axes from `axis` (older)."""

    axis: int
    flatten: bool
    table: np.ndarray
    stage: OutputStage

    def _softmax_last_axis(self, q: np.ndarray) -> np.ndarray:
        span = self.table.size - 1
        difference = q - q.max(axis=-1, keepdims=True)
        e = self.table[difference + span]
        total = e.sum(axis=-1, keepdims=True)
        reciprocal = divide_round_half_up(1 << RECIPROCAL_BITS, total)
        probability = rounding_right_shift(e * reciprocal, RECIPROCAL_BITS - PROBABILITY_BITS)
        return self.stage(probability)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        q = x.astype(np.int64)
        axis = self.axis % x.ndim
        if self.flatten:
            rows = q.reshape(math.prod(x.shape[:axis]), -1)
            return self._softmax_last_axis(rows).reshape(x.shape)
        moved = np.moveaxis(q, axis, -1)
        return np.moveaxis(self._softmax_last_axis(moved), -1, axis)


def lower_softmax(ctx: OpContext) -> Lowered:
    x, x_scale, _ = ctx.activation_input(0)
    if x.params.bits > 16:
        raise NotLowerable("Softmax needs 8- or 16-bit inputs")
    output = ctx.output(0)
    real = 2.0**-PROBABILITY_BITS / output.scalar_scale()
    kernel = SoftmaxKernel(
        axis=int(ctx.attr("axis", -1 if ctx.opset >= 13 else 1)),
        flatten=ctx.opset < 13,
        table=exp_table(x_scale, x.params.bits),
        stage=OutputStage.build(real, output, ctx.mode),
    )
    return Lowered(kernel, (x.name,))


LOWERINGS = {"Softmax": lower_softmax}
