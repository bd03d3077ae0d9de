"""Quantization parameters of integer tensors and the operands an integer op reads."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from compiler.intmath import dtype_range


class NotLowerable(Exception):
    """A node (or pattern) has no integer implementation; the message says why.

    Raised while building the integer program; the node then runs in float (a float island).
    """


@dataclass(frozen=True, eq=False)
class QuantParams:
    """Scale, zero point and storage type of an integer tensor (ONNX QuantizeLinear semantics).

    `scale` is float32 and `zero_point` int64, both of shape () for per-tensor quantization or
    (C,) for per-axis quantization along `axis`. real = (q - zero_point) * scale.
    """

    scale: np.ndarray
    zero_point: np.ndarray
    dtype: np.dtype
    axis: int | None = None

    @property
    def per_tensor(self) -> bool:
        return self.scale.size == 1 and (self.axis is None or self.scale.ndim == 0)

    @property
    def bounds(self) -> tuple[int, int]:
        """(min, max) integer code of the storage type."""
        return dtype_range(self.dtype)

    @property
    def bits(self) -> int:
        return np.dtype(self.dtype).itemsize * 8

    def scalar_scale(self) -> float:
        """The per-tensor scale as a float64 (of the float32 value); per-axis is not lowerable."""
        if not self.per_tensor:
            raise NotLowerable("a per-axis quantized activation (only weights may be per-axis)")
        return float(self.scale.reshape(-1)[0])

    def scalar_zero_point(self) -> int:
        if not self.per_tensor:
            raise NotLowerable("a per-axis quantized activation (only weights may be per-axis)")
        return int(self.zero_point.reshape(-1)[0])

    def along(self, values: np.ndarray, ndim: int) -> np.ndarray:
        """Reshape a per-axis vector (scale, zero point) to broadcast against a rank-`ndim` tensor."""
        if self.per_tensor:
            return values.reshape(())
        axis = self.axis if self.axis is not None else 1
        axis = axis % ndim
        shape = [1] * ndim
        shape[axis] = values.size
        return values.reshape(shape)

    def same_as(self, other: QuantParams) -> bool:
        """Equal storage type, scales and zero points: data can move without arithmetic."""
        return (
            np.dtype(self.dtype) == np.dtype(other.dtype)
            and self.scale.shape == other.scale.shape
            and bool(np.all(self.scale == other.scale))
            and bool(np.all(self.zero_point == other.zero_point))
        )

    def dequantize_exact(self, q: np.ndarray) -> np.ndarray:
        """Real values of integer codes in float64 (compile-time use: constants, tables)."""
        q = np.asarray(q, dtype=np.int64)
        zero_point = self.along(self.zero_point, q.ndim) if q.ndim else self.zero_point
        scale = self.along(self.scale, q.ndim) if q.ndim else self.scale
        return (q - zero_point).astype(np.float64) * scale.astype(np.float64)

    def __repr__(self) -> str:
        scale = self.scale.tolist()
        zero_point = self.zero_point.tolist()
        axis = "" if self.per_tensor else f", axis={self.axis}"
        return f"QuantParams({np.dtype(self.dtype).name}, scale={scale}, zero_point={zero_point}{axis})"


@dataclass(frozen=True, eq=False)
class QuantOperand:
    """An op input that is an integer tensor seen through a DequantizeLinear.

    `name` is the integer tensor (the DequantizeLinear's input); `params` are the
    DequantizeLinear's parameters; `value` holds the integers when they are constant (weights,
    biases, quantized constants).
    """

    name: str
    params: QuantParams
    value: np.ndarray | None = None

    @property
    def is_constant(self) -> bool:
        return self.value is not None


@dataclass(frozen=True, eq=False)
class ConstOperand:
    """An op input that is a plain constant: shapes, axes, pads, float parameters."""

    name: str
    value: np.ndarray


Operand = QuantOperand | ConstOperand | None
