"""Per-tensor statistics gathered one calibration sample at a time, in constant memory.

ONNX Runtime's calibrator stores every activation of every sample before computing histograms;
on large models and data sets that is hundreds of gigabytes. Here each observer folds a sample
into a fixed-size state and the caller drops the array: memory is O(bins) per tensor whatever
the number of samples.

The histogram grows by *exact* re-binning. Its bin edges are the multiples of the bin width
(so 0.0 is always an edge); when a sample falls outside the range, the width is multiplied by
2**n and each old bin falls entirely inside one new bin, so counts are merged, never split or
interpolated. The total count is preserved and only the resolution coarsens.

Binning is the hot loop of calibration (every element of every exposed tensor of every sample),
so it runs in chunks through reused per-thread buffers: divide, floor, shift, clip
and cast in place, then `np.bincount`. It computes exactly what the straightforward
`floor(x / width) - origin` over the whole array does (same float32 division, same floor; the
shift and clip act on small integers, exact in float32), about four times faster on large
tensors because the intermediates never leave the cache.

A tensor read only by a Softmax is observed by `SoftmaxInputObserver`, which passes on only the
values the Softmax's output can resolve (within `softmax_span` of their row's maximum): an
attention mask's −3.4e38 would otherwise set the range, and the histogram's bins, by itself.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "HistogramObserver",
    "MinMaxObserver",
    "MovingAverageMinMaxObserver",
    "Observer",
    "SoftmaxInputObserver",
    "softmax_span",
]


_CHUNK = 1 << 17
"""Elements binned per step (1.5 MB of buffers per thread). Smaller steps stay in L2 but make
more numpy calls, and each call hands the GIL over when calibration bins on several threads:
on PP-OCRv4, 32 samples, 2 threads, 2**17 took 5.2 s where 2**15 took 6.1 s."""

_INT64_MAX = int(np.iinfo(np.int64).max)

_scratch = threading.local()


def _buffers(n: int) -> tuple[np.ndarray, np.ndarray]:
    """This thread's float32 and index buffers of at least `n` elements (reused across calls, so
    the hot loop neither allocates nor page-faults)."""
    values: np.ndarray | None = getattr(_scratch, "values", None)
    if values is None or values.size < n:
        _scratch.values = np.empty(n, dtype=np.float32)
        _scratch.index = np.empty(n, dtype=np.intp)
    return _scratch.values[:n], _scratch.index[:n]


def _finite_min_max(x: np.ndarray) -> tuple[np.ndarray, float, float] | None:
    """The finite values of `x` and their min and max (NaN/inf in a calibration tensor would
    poison ranges). When min and max are finite every value is, and `x` is returned uncopied."""
    if x.size == 0:
        return None
    lo, hi = float(np.min(x)), float(np.max(x))
    if math.isfinite(lo) and math.isfinite(hi):
        return x, lo, hi
    finite = x[np.isfinite(x)]
    if finite.size == 0:
        return None
    return finite, float(finite.min()), float(finite.max())


@dataclass
class Observer:
    """Base: counts samples and elements; subclasses keep their own fixed-size state."""

    samples: int = 0
    elements: int = 0
    min: float = math.inf
    max: float = -math.inf

    def update(self, x: np.ndarray) -> None:
        x = np.asarray(x)
        size = int(x.size)
        extent = _finite_min_max(x)
        if extent is None:
            return
        finite, lo, hi = extent
        self._record(size, lo, hi)
        self._update(finite, lo, hi)

    def _record(self, size: int, lo: float, hi: float) -> None:
        """Count one sample of `size` elements whose finite values lie in [lo, hi]."""
        self.samples += 1
        self.elements += size
        self.min = min(self.min, lo)
        self.max = max(self.max, hi)

    def _update(self, x: np.ndarray, lo: float, hi: float) -> None:
        """Fold one sample's finite values (between lo and hi) into the state."""

    @property
    def empty(self) -> bool:
        return self.samples == 0

    def state_arrays(self) -> list[np.ndarray]:
        """The arrays that make up the state (their total size is the observer's memory)."""
        return []

    def state_nbytes(self) -> int:
        return sum(a.nbytes for a in self.state_arrays())


@dataclass
class MinMaxObserver(Observer):
    """Running min and max: the base class already tracks them."""


@dataclass
class MovingAverageMinMaxObserver(Observer):
    """Exponential moving average of each sample's min and max; the first sample initialises."""

    momentum: float = 0.9
    ema_min: float = math.nan
    ema_max: float = math.nan

    def _update(self, x: np.ndarray, lo: float, hi: float) -> None:
        if self.samples == 1:
            self.ema_min, self.ema_max = lo, hi
            return
        m = self.momentum
        self.ema_min = m * self.ema_min + (1.0 - m) * lo
        self.ema_max = m * self.ema_max + (1.0 - m) * hi


_MIN_BIN_WIDTH = 1e-36
"""Narrower bins would round to 0 in float32, where `_add` bins (a tensor of denormals, e.g.
an untrained model's near-zero activations); such a range quantizes as all zeros anyway
(`compiler.quantize.qparams.activation_qparams` takes scales below 1e-30 as zero and floors
the others at `MIN_ACTIVATION_RANGE`)."""


@dataclass
class HistogramObserver(Observer):
    """Fixed-bin histogram whose range grows by merging bins (see the module docstring).

    Bin i covers [(origin + i)·width, (origin + i + 1)·width): `origin` is an integer, so every
    edge is a multiple of `width` and 0 is an edge. The range always contains 0 because
    quantized ranges must (zero has to be exactly representable).
    """

    num_bins: int = 2048
    counts: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    width: float = 0.0
    origin: int = 0

    def __post_init__(self) -> None:
        if self.counts.size == 0:
            self.counts = np.zeros(self.num_bins, dtype=np.int64)

    # ---- geometry

    @property
    def lower(self) -> float:
        return self.origin * self.width

    @property
    def upper(self) -> float:
        return (self.origin + self.num_bins) * self.width

    def edges(self) -> np.ndarray:
        return (self.origin + np.arange(self.num_bins + 1, dtype=np.float64)) * self.width

    def centers(self) -> np.ndarray:
        return (self.origin + 0.5 + np.arange(self.num_bins, dtype=np.float64)) * self.width

    @property
    def total(self) -> int:
        return int(self.counts.sum())

    def state_arrays(self) -> list[np.ndarray]:
        return [self.counts]

    # ---- updates

    def _update(self, x: np.ndarray, lo: float, hi: float) -> None:
        lo, hi = min(lo, 0.0), max(hi, 0.0)
        if self.width == 0.0:
            self._initialise(lo, hi)
        elif lo < self.lower or hi >= self.upper:
            self._grow(lo, hi)
        self._add(x)

    def _initialise(self, lo: float, hi: float) -> None:
        span = hi - lo
        # (bins - 1) widths leave room for flooring the origin onto the grid.
        width = max(span / (self.num_bins - 1), _MIN_BIN_WIDTH) if span > 0 else 1e-12
        self.width = width
        self.origin = math.floor(lo / width)

    def _grow(self, lo: float, hi: float) -> None:
        """Widen bins by 2**n so [lo, hi] fits, merging old bins exactly."""
        lo, hi = min(lo, self.lower), max(hi, self.upper)
        needed = (hi - lo) / ((self.num_bins - 1) * self.width)
        shift = max(1, math.ceil(math.log2(needed))) if needed > 1 else 1
        while True:
            factor = 1 << shift
            width = self.width * factor
            origin = math.floor(lo / width)
            if (origin + self.num_bins) * width > hi:
                break
            shift += 1
        # Old bin k (absolute index origin_old + i) lies inside new absolute bin floor(k / factor).
        old_abs = self.origin + np.arange(self.num_bins, dtype=np.int64)
        if factor > _INT64_MAX:  # a jump over ~19 decades (e.g. a -3.4e38 attention mask)
            coarse = np.where(old_abs < 0, -1, 0)  # |k| < factor: floor(k / factor) is 0 or -1
        else:
            coarse = np.floor_divide(old_abs, factor)
        new_index = coarse - origin
        merged = np.zeros(self.num_bins, dtype=np.int64)
        np.add.at(merged, new_index, self.counts)
        self.counts = merged
        self.width = width
        self.origin = origin

    def _add(self, x: np.ndarray) -> None:
        """Count finite values already inside [lower, upper] (bin floor(x / width) - origin,
        clipped so float32 rounding at the two ends cannot step outside)."""
        flat = np.asarray(x, dtype=np.float32).reshape(-1)
        width, origin = np.float32(self.width), np.float32(self.origin)
        top = np.float32(self.num_bins - 1)
        values, index = _buffers(min(_CHUNK, flat.size))
        for start in range(0, flat.size, _CHUNK):
            part = flat[start : start + _CHUNK]
            v, i = values[: part.size], index[: part.size]
            np.divide(part, width, out=v)
            np.floor(v, out=v)
            np.subtract(v, origin, out=v)
            np.clip(v, 0, top, out=v)
            np.copyto(i, v, casting="unsafe")
            self.counts += np.bincount(i, minlength=self.num_bins)


_SPAN_MARGIN = 1.0
"""Nats added to the Softmax span: the input's own rounding moves a value and its row's maximum
by half an input step each (< 0.1 for 8-bit inputs over spans of ~10–30), a factor e^0.1 on a
term that the margin's factor e already covers."""


def softmax_span(row_length: int, output_bits: int) -> float:
    """How far below its row's maximum a Softmax input can be clamped without changing any output
    by as much as half an output step: ln(N) + (b + 1)·ln 2 + margin nats.

    With row maximum m, normaliser Z = Σ exp(v − m) ≥ 1 and largest probability p_max = 1/Z, a
    value v ≤ m − S has probability ≤ p_max·e^−S, and moving any such values to other points
    ≤ m − S changes Z by at most N·e^−S relative to its exp(0) term, so every output in the row
    moves by at most p_max·N·e^−S. The output's step is at least p_max·2^−b (b bits over a range
    that covers p_max: 2^b − 1 levels, or the mantissa of a float output), so
    S = ln N + (b + 1)·ln 2 keeps the change under half a step; `_SPAN_MARGIN` pays for the
    input's own rounding. For b = 8 that is 12.1 nats over N = 128 keys, and 20.9 nats for a
    float32 output (b = 24) over N = 512.
    """
    return math.log(max(row_length, 1)) + (output_bits + 1) * math.log(2.0) + _SPAN_MARGIN


@dataclass
class SoftmaxInputObserver(Observer):
    """Observer of a tensor read only by a Softmax, blind to values its output cannot see.

    Attention masks add finfo(float32).min (or −1e4, −1e9) to the scores of masked keys; a
    range that covered them would give every real score the same 8-bit code. Softmax is
    shift-invariant, and a value more than `softmax_span` below its row's maximum contributes
    under half an output step however low it is, so only the row's *significant* values
    (≥ row max − span) reach `inner`, the method's own observer (histograms are binned on the
    scores, not on a 1e38 span). `floor` is the lowest `row max − span` among rows that had
    insignificant values: the range must reach down to it, so those values, clamped there by
    QuantizeLinear, stay insignificant. Where no value is insignificant `inner` sees every
    sample unchanged and the range is exactly the method's.

    `axis` and `flatten` are the Softmax's: one axis from opset 13 on, all axes from `axis`
    flattened into the row before. `output_bits` is the resolution of the Softmax's output.
    """

    inner: Observer = field(default_factory=MinMaxObserver)
    axis: int = -1
    flatten: bool = False
    output_bits: int = 8
    floor: float = math.inf
    dropped: int = 0
    span: float = 0.0

    def update(self, x: np.ndarray) -> None:
        x = np.asarray(x)
        extent = _finite_min_max(x)
        if extent is None:
            return
        _, lo, hi = extent
        self._record(int(x.size), lo, hi)
        self.inner.update(self._significant(x))

    def _rows(self, x: np.ndarray) -> np.ndarray:
        """`x` with each Softmax row along the last axis (a view when the layout allows)."""
        axis = self.axis % x.ndim
        if self.flatten:
            return x.reshape(math.prod(x.shape[:axis]), -1)
        return np.moveaxis(x, axis, -1)

    def _significant(self, x: np.ndarray) -> np.ndarray:
        """`x` itself when every value is within the span of its row's maximum, else the values
        that are (flattened); records the floor and the count of the others."""
        if x.ndim == 0:
            return x
        rows = self._rows(x)
        length = rows.shape[-1]
        if rows.size == 0 or length <= 1:
            return x
        span = softmax_span(length, self.output_bits)
        self.span = max(self.span, span)
        cut = np.max(rows, axis=-1, keepdims=True) - np.asarray(span, dtype=rows.dtype)
        low = rows < cut  # NaN rows and -inf rows compare False: nothing of theirs is dropped
        if not low.any():
            return x
        floors = cut[..., 0][low.any(axis=-1)]
        floors = floors[np.isfinite(floors)]
        if floors.size:
            self.floor = min(self.floor, float(floors.min()))
        self.dropped += int(np.count_nonzero(low))
        return rows[~low]

    @property
    def clamped(self) -> bool:
        """Whether some value was left out as insignificant (the range then reaches `floor`)."""
        return self.dropped > 0

    def state_arrays(self) -> list[np.ndarray]:
        return self.inner.state_arrays()
