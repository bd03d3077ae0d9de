"""Scales and zero points: from a calibrated range (activations) or the values (constants).

Storage is signed for every width: an asymmetric int8 activation is int8 with a zero point in
[-128, 127] rather than uint8 with one in [0, 255]. The two are the same affine map shifted by
128; signed storage keeps one code path for 8 and 16 bits and matches the MLA's int8 datapath.
Symmetric tensors use the restricted range [-(2^(b-1) - 1), 2^(b-1) - 1] (int8: ±127) so that
negation never overflows, with zero point 0. Biases are int32 at scale_in × scale_w, zero point 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from compiler.defines import QuantizationScheme
from compiler.quantize.ranges import Range

__all__ = [
    "ActivationQParams",
    "QuantizedTensor",
    "activation_qparams",
    "bias_safe_weight_scales",
    "quantize_bias",
    "quantize_with_scales",
    "storage_dtype",
    "weight_scales",
]

INT32_MAX = 2**31 - 1
MIN_ACTIVATION_RANGE = 2.0**-15
"""The narrowest calibrated range an activation is quantized over. At int8 its scale is
2**-15 / 255 ≈ float32's eps, the floor torch.ao.quantization's observers put on every scale.

A range of ~1e-25 (the LayerNorm of a constant row: rounding noise, normalised) would get a
scale that no 31-bit requantization multiplier reaches from its inputs' scales, and the op would
leave the MLA. Values that small quantize to 0 at the floor, within 2**-16 of their true value."""
_BIAS_HEADROOM = 0.5
"""Quantized biases stay below half the int32 range, leaving room for the accumulation."""


def storage_dtype(bits: int) -> np.dtype:
    return np.dtype({4: ml_dtypes.int4, 8: np.int8, 16: np.int16, 32: np.int32}[bits])


def _pow2(scale: float) -> float:
    return float(2.0 ** math.ceil(math.log2(scale)))


def _finite_steps(scale: np.ndarray, codes: int, power_of_two: bool) -> np.ndarray:
    """float32 `scale`, lowered where `codes` steps of it overflow float32.

    DequantizeLinear computes (q − zero_point)·scale in float32: a constant or range at
    ±finfo(float32).max (attention-mask fills) gives a scale that rounds up, so the extreme code
    would dequantize to ±inf and 0·inf = NaN downstream. One ulp lower (a power of two lower for
    power-of-two scales) keeps it finite, clipping the extreme by a relative 1e-7. A range
    spanning ±finfo.max overflows by 2×: the largest finite step is computed, not walked down
    to ulp by ulp (2²³ steps)."""
    out = np.asarray(scale, dtype=np.float32)
    with np.errstate(over="ignore"):
        overflow = ~np.isfinite(out * np.float32(codes)) & np.isfinite(out)
        if not overflow.any():
            return out
        return np.where(overflow, _largest_finite_step(codes, power_of_two), out).astype(np.float32)


def _largest_finite_step(codes: int, power_of_two: bool) -> np.float32:
    """The largest float32 scale (a power of two if asked) whose `codes` steps stay finite."""
    limit = float(np.finfo(np.float32).max) / codes
    if power_of_two:
        return np.float32(2.0 ** math.floor(math.log2(limit)))
    step = np.float32(limit)  # the nearest float32: at most a few ulps over
    with np.errstate(over="ignore"):
        while not np.isfinite(step * np.float32(codes)):
            step = np.nextafter(step, np.float32(0))
        while np.isfinite(np.nextafter(step, np.float32(np.inf)) * np.float32(codes)):
            step = np.nextafter(step, np.float32(np.inf))
    return step


@dataclass(frozen=True)
class ActivationQParams:
    scale: float
    zero_point: int
    scheme: QuantizationScheme
    range: Range

    def to_dict(self) -> dict[str, object]:
        return {
            "min": self.range.lo,
            "max": self.range.hi,
            "scale": self.scale,
            "zero_point": self.zero_point,
            "dtype": f"int{self.scheme.bits}",
        }


def activation_qparams(rng: Range, scheme: QuantizationScheme) -> ActivationQParams:
    """Per-tensor scale and zero point; 0.0 is always exactly representable."""
    lo, hi = min(rng.lo, 0.0), max(rng.hi, 0.0)
    qmin, qmax = scheme.qmin, scheme.qmax
    scale = (hi - lo) / (qmax - qmin) if scheme.asymmetric else max(-lo, hi) / qmax
    if not math.isfinite(scale) or scale <= 1e-30:
        return ActivationQParams(1.0, 0, scheme, Range(lo, hi))
    scale = max(scale, MIN_ACTIVATION_RANGE / (qmax - qmin))
    if scheme.power_of_two:
        scale = _pow2(scale)
    scale = float(_finite_steps(np.float32(scale), qmax - qmin, scheme.power_of_two))
    zero_point = 0
    if scheme.asymmetric:
        zero_point = int(np.clip(round(qmin - lo / scale), qmin, qmax))
    return ActivationQParams(scale, zero_point, scheme, Range(lo, hi))


@dataclass
class QuantizedTensor:
    values: np.ndarray
    scale: np.ndarray
    zero_point: np.ndarray | None
    axis: int | None
    block_size: int | None


def _amax(w: np.ndarray, axis: int | None, block: int | None) -> np.ndarray:
    a = np.abs(w.astype(np.float64))
    if block is not None and axis is not None:
        return _block_reduce(a, axis, block)
    if axis is None:
        return np.asarray(a.max() if a.size else 0.0)
    others = tuple(d for d in range(a.ndim) if d != axis)
    return a.max(axis=others) if others else a


def _block_reduce(a: np.ndarray, axis: int, block: int) -> np.ndarray:
    """Max over runs of `block` along `axis`; the result keeps the rank (blocked DQ's scale shape)."""
    n = a.shape[axis]
    blocks = -(-n // block)
    pad = blocks * block - n
    if pad:
        widths = [(0, 0)] * a.ndim
        widths[axis] = (0, pad)
        a = np.pad(a, widths)
    shape = (*a.shape[:axis], blocks, block, *a.shape[axis + 1 :])
    return a.reshape(shape).max(axis=axis + 1)


def _expand(scale: np.ndarray, w: np.ndarray, axis: int | None, block: int | None) -> np.ndarray:
    """`scale` broadcast to `w`'s shape."""
    if axis is None:
        return scale
    if block is not None:
        return np.repeat(scale, block, axis=axis).take(range(w.shape[axis]), axis=axis)
    shape = [1] * w.ndim
    shape[axis] = -1
    return scale.reshape(shape)


def weight_scales(
    w: np.ndarray, scheme: QuantizationScheme, axis: int | None, block: int | None
) -> np.ndarray:
    """Symmetric scales: max|w| / qmax per tensor, output channel or block (1.0 where all-zero)."""
    amax = _amax(w, axis, block)
    qmax = scheme.qmax
    scale = np.where(amax > 0, amax / qmax, 1.0)
    if scheme.power_of_two:
        scale = 2.0 ** np.ceil(np.log2(scale))
    return _finite_steps(scale.astype(np.float32), qmax, scheme.power_of_two)


def bias_safe_weight_scales(
    scale: np.ndarray, bias: np.ndarray | None, input_scale: float | None, axis: int | None
) -> np.ndarray:
    """Raise weight scales where bias / (s_in · s_w) would not fit the int32 bias headroom."""
    if bias is None or input_scale is None:
        return scale
    limit = INT32_MAX * _BIAS_HEADROOM
    b = np.abs(bias.astype(np.float64)).reshape(-1)
    if axis is None:
        needed = float(b.max()) / (input_scale * limit) if b.size else 0.0
        return np.maximum(scale, np.float32(needed)).astype(np.float32)
    if b.size != scale.size:
        return scale
    needed = b / (input_scale * limit)
    return np.maximum(scale, needed.astype(np.float32)).astype(np.float32)


def quantize_with_scales(
    w: np.ndarray,
    scale: np.ndarray,
    scheme: QuantizationScheme,
    axis: int | None,
    block: int | None,
) -> QuantizedTensor:
    full = _expand(scale.astype(np.float64), w, axis, block)
    q = np.clip(np.rint(w.astype(np.float64) / full), -scheme.qmax, scheme.qmax)
    values = (
        q.astype(np.int8).astype(ml_dtypes.int4)
        if scheme.bits == 4
        else q.astype(storage_dtype(scheme.bits))
    )
    zero_point = (
        None if scheme.bits == 4 else np.zeros(scale.shape, dtype=storage_dtype(scheme.bits))
    )
    return QuantizedTensor(values, scale.astype(np.float32), zero_point, axis, block)


def quantize_bias(
    bias: np.ndarray, input_scale: float, weight_scale: np.ndarray
) -> QuantizedTensor:
    """int32 bias at scale s_in · s_w (per output channel when the weights are per channel)."""
    scale = (np.float64(input_scale) * weight_scale.astype(np.float64)).astype(np.float32)
    if scale.ndim == 0 or scale.size == 1:
        scale = scale.reshape(())
        full = np.float64(scale)
        axis = None
    else:
        full = scale.astype(np.float64).reshape(bias.shape)
        axis = next(d for d, n in enumerate(bias.shape) if n == scale.size)
    q = np.clip(np.rint(bias.astype(np.float64) / full), -INT32_MAX, INT32_MAX).astype(np.int32)
    return QuantizedTensor(q, scale, None, axis, None)
