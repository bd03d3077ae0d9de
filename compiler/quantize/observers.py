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
        self.samples += 1
        self.elements += size
        self.min = min(self.min, lo)
        self.max = max(self.max, hi)
        self._update(finite, lo, hi)

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
        width = span / (self.num_bins - 1) if span > 0 else 1e-12
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
