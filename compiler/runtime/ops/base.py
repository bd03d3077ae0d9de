"""What every integer op lowering shares: the op context, the output stage, rescaling, biases.

A *lowering* turns one float op (with the quantization parameters of its DequantizeLinear inputs
and QuantizeLinear outputs) into a *kernel*: a callable on integer numpy arrays whose constants
(centred weights, integer biases, multipliers and shifts, tables) are fixed at build time, which
is exactly the information a compiler would emit for the MLA.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import helper

from compiler.intmath import (
    RequantizationMode,
    quantize_constant,
    quantize_multiplier,
    requantize_clamp,
    round_half_even,
)
from compiler.runtime.qparams import ConstOperand, NotLowerable, Operand, QuantOperand, QuantParams

Kernel = Callable[..., np.ndarray | tuple[np.ndarray, ...]]


@dataclass(frozen=True)
class Lowered:
    """A kernel and the integer tensors it reads at run time (in argument order)."""

    kernel: Kernel
    inputs: tuple[str, ...]


@dataclass(frozen=True, eq=False)
class OpContext:
    """Everything a lowering may look at for one float op of the QDQ graph.

    `inputs` are aligned with `node.input` (None for an omitted optional input), `outputs` are
    the QuantizeLinear parameters of each output. `activation` is the real clamp range
    (low, high) of a fused Relu/Clip; `bias` the constant of a fused bias Add (MatMul); `gate`
    the Sigmoid/HardSigmoid node of a fused x * gate(x).
    """

    node: onnx.NodeProto
    opset: int
    mode: RequantizationMode
    inputs: tuple[Operand, ...]
    outputs: tuple[QuantParams | None, ...]
    activation: tuple[float, float] | None = None
    bias: Operand = None
    gate: onnx.NodeProto | None = None
    ranks: tuple[int | None, ...] = ()
    """Input ranks, for the ops that need them to build a kernel (`RANKED_OPS`)."""
    _attributes: dict[str, Any] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        for attribute in self.node.attribute:
            value = helper.get_attribute_value(attribute)
            if isinstance(value, bytes):
                value = value.decode()
            self._attributes[attribute.name] = value

    @property
    def op_type(self) -> str:
        return self.node.op_type

    def attr(self, name: str, default: Any = None) -> Any:
        return self._attributes.get(name, default)

    def input(self, index: int) -> Operand:
        return self.inputs[index] if index < len(self.inputs) else None

    def quant(self, index: int, *, constant: bool = False) -> QuantOperand:
        """Input `index` as an integer tensor; `constant=True` also requires its value."""
        operand = self.input(index)
        if not isinstance(operand, QuantOperand):
            raise NotLowerable(f"input {index} of {self.op_type} is not a dequantized tensor")
        if constant and operand.value is None:
            raise NotLowerable(f"input {index} of {self.op_type} must be a constant")
        return operand

    def activation_input(self, index: int = 0) -> tuple[QuantOperand, float, int]:
        """A per-tensor quantized input with its scale and zero point."""
        operand = self.quant(index)
        return operand, operand.params.scalar_scale(), operand.params.scalar_zero_point()

    def constant(self, index: int) -> np.ndarray | None:
        """A plain (or quantized, then dequantized) constant input, None when omitted."""
        operand = self.input(index)
        if operand is None:
            return None
        if isinstance(operand, ConstOperand):
            return operand.value
        if operand.value is None:
            raise NotLowerable(f"input {index} of {self.op_type} must be a constant")
        return operand.params.dequantize_exact(operand.value)

    def ints(self, index: int, attribute: str | None = None) -> list[int] | None:
        """An integer-list parameter that moved from an attribute to an input across opsets."""
        value = self.constant(index)
        if value is not None:
            return [int(v) for v in np.asarray(value).reshape(-1)]
        if attribute is not None and attribute in self._attributes:
            return [int(v) for v in np.atleast_1d(self._attributes[attribute])]
        return None

    def output(self, index: int = 0) -> QuantParams:
        params = self.outputs[index] if index < len(self.outputs) else None
        if params is None:
            raise NotLowerable(f"output {index} of {self.op_type} is not quantized")
        params.scalar_scale()
        return params


@dataclass(frozen=True, eq=False)
class OutputStage:
    """acc (int64) -> int32 saturation -> x (M, n) -> + z_out -> activation clamp -> saturate.

    `multiplier` and `shift` broadcast against the accumulator (per output channel, per
    position or scalar). `low`/`high` are the type range intersected with the fused activation.
    """

    multiplier: np.ndarray
    shift: np.ndarray
    zero_point: int
    low: int
    high: int
    dtype: np.dtype
    mode: RequantizationMode

    @classmethod
    def build(
        cls,
        real_multiplier: np.ndarray | float,
        output: QuantParams,
        mode: RequantizationMode,
        activation: tuple[float, float] | None = None,
    ) -> OutputStage:
        multiplier, shift = quantize_multiplier(real_multiplier)
        low, high = clamp_bounds(output, activation)
        return cls(multiplier, shift, output.scalar_zero_point(), low, high, output.dtype, mode)

    def __call__(self, acc: np.ndarray) -> np.ndarray:
        return requantize_clamp(
            acc, self.multiplier, self.shift, self.mode, self.zero_point, self.low, self.high
        ).astype(self.dtype)


def clamp_bounds(output: QuantParams, activation: tuple[float, float] | None) -> tuple[int, int]:
    """Integer clamp range: the type range, narrowed by a fused Relu/Clip.

    Quantization is monotonic, so clamping the integer result at quantize(a), quantize(b)
    (round half to even, like QuantizeLinear) equals quantizing the clamped real value.
    """
    low, high = output.bounds
    if activation is None:
        return low, high
    scale, zero_point = output.scalar_scale(), output.scalar_zero_point()
    real_low, real_high = activation
    if np.isfinite(real_low):
        low = max(low, int(quantize_constant(real_low, scale, zero_point, np.int64)))
    if np.isfinite(real_high):
        high = min(high, int(quantize_constant(real_high, scale, zero_point, np.int64)))
    return low, max(low, high)


@dataclass(frozen=True, eq=False)
class Rescale:
    """Move integer data between two quantizations: identity when they are equal.

    Otherwise q_out = saturate(requantize(q_in - z_in, s_in / s_out) + z_out). Used by every data
    movement op, Concat inputs and DequantizeLinear -> QuantizeLinear pairs.
    """

    input_zero_point: int
    stage: OutputStage | None

    @classmethod
    def build(cls, source: QuantParams, target: QuantParams, mode: RequantizationMode) -> Rescale:
        zero_point = source.scalar_zero_point()
        if source.same_as(target):
            return cls(zero_point, None)
        real = source.scalar_scale() / target.scalar_scale()
        return cls(zero_point, OutputStage.build(real, target, mode))

    @property
    def is_identity(self) -> bool:
        return self.stage is None

    def __call__(self, q: np.ndarray) -> np.ndarray:
        if self.stage is None:
            return q
        return self.stage(q.astype(np.int64) - self.input_zero_point)


def align_bias(
    bias: Operand, accumulator_scale: np.ndarray, *, factor: float = 1.0
) -> np.ndarray | int:
    """The bias as integers at the accumulator's scale (s_in * s_w, per output channel).

    A quantized bias whose encoding already is the accumulator's (zero point 0 and scale equal
    to s_in * s_w within 1e-6 relative, as QDQ producers write it) is used verbatim. Any other
    bias (float constant, other scale, a `factor` such as Gemm's beta) is re-encoded at build
    time: round_half_even(factor * real_bias / accumulator_scale), in float64.
    """
    if bias is None:
        return 0
    if isinstance(bias, QuantOperand):
        if bias.value is None:
            raise NotLowerable("the bias must be a constant")
        params = bias.params
        bias_scale = params.along(params.scale, bias.value.ndim).astype(np.float64)
        exact = (
            factor == 1.0
            and not np.any(params.zero_point)
            and np.allclose(bias_scale, accumulator_scale, rtol=1e-6, atol=0.0)
        )
        if exact:
            return np.broadcast_to(
                bias.value.astype(np.int64),
                np.broadcast_shapes(bias.value.shape, np.shape(accumulator_scale)),
            ).copy()
        real = params.dequantize_exact(bias.value)
    else:
        real = np.asarray(bias.value, dtype=np.float64)
    return round_half_even(factor * real / accumulator_scale)
