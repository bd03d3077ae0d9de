"""From observer state to a quantization range [lo, hi] (always containing 0).

Three histogram criteria, all vectorised and O(bins) or O(bins·candidates) per tensor:

- **MSE**: minimise the expected squared error of quantize-dequantize — clipping error of the
  values outside [lo, hi] plus uniform rounding noise Δ²/12 for the values inside, where Δ is
  the step for the scheme's bits (and symmetry). Values are taken at bin centres. Asymmetric
  ranges are found by a coarse 2-D grid over (lo, hi) bin edges, refined at full resolution.
- **Entropy**: TensorRT's KL-divergence threshold on the |x| histogram — the candidate
  distribution keeps `i` bins (outliers folded into the last one) and is compared with its
  quantization into 2**(bits-1) − 1 levels (2**bits − 1 when the data is one-signed and the
  scheme is asymmetric). With 2048 bins the threshold can sit well inside the data range, so outliers
  are clipped; with 128 bins and 128 levels (ONNX Runtime's default) it cannot.
- **Percentile**: the (100 − p)-th and p-th percentiles (|x|'s p-th for symmetric schemes),
  interpolated inside bins.

A Softmax input observed by `SoftmaxInputObserver` gets the method's range over the values its
Softmax can resolve, reaching down to the observer's floor when it left values out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from compiler.defines import (
    CalibrationMethod,
    HistogramEntropyMethod,
    HistogramMSEMethod,
    HistogramPercentileMethod,
    MinMaxMethod,
    MovingAverageMinMaxMethod,
    QuantizationScheme,
)
from compiler.quantize.observers import (
    HistogramObserver,
    MinMaxObserver,
    MovingAverageMinMaxObserver,
    Observer,
    SoftmaxInputObserver,
)

__all__ = [
    "Range",
    "entropy_range",
    "make_observer",
    "mse_range",
    "percentile_range",
    "select_range",
    "softmax_input_range",
]

_COARSE_CANDIDATES = 192
"""Per-axis candidates of the coarse search before refining at full bin resolution."""


@dataclass(frozen=True)
class Range:
    lo: float
    hi: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "lo", min(float(self.lo), 0.0))
        object.__setattr__(self, "hi", max(float(self.hi), 0.0))


def make_observer(method: CalibrationMethod) -> Observer:
    """The observer that collects what `method` needs (histograms only for histogram methods)."""
    if isinstance(method, MovingAverageMinMaxMethod):
        return MovingAverageMinMaxObserver(momentum=method.momentum)
    if isinstance(method, MinMaxMethod):
        return MinMaxObserver()
    bins = getattr(method, "num_bins", None)
    if bins is None:
        raise ValueError(f"calibration method {method!r} is not supported by the quantizer")
    return HistogramObserver(num_bins=bins)


def select_range(
    method: CalibrationMethod, observer: Observer, scheme: QuantizationScheme
) -> Range:
    """The range `method` picks from `observer` for tensors quantized with `scheme`."""
    if observer.empty:
        return Range(0.0, 0.0)
    if isinstance(observer, SoftmaxInputObserver):
        return softmax_input_range(method, observer, scheme)
    if isinstance(observer, MovingAverageMinMaxObserver):
        return Range(observer.ema_min, observer.ema_max)
    if not isinstance(observer, HistogramObserver):
        return Range(observer.min, observer.max)
    bits = scheme.bits if scheme.kind == "int" else 16
    symmetric = not scheme.asymmetric
    if isinstance(method, HistogramMSEMethod):
        return mse_range(observer, bits, symmetric)
    if isinstance(method, HistogramEntropyMethod):
        return entropy_range(observer, bits, symmetric)
    if isinstance(method, HistogramPercentileMethod):
        return percentile_range(observer, method.percentile, symmetric)
    return Range(observer.min, observer.max)


def softmax_input_range(
    method: CalibrationMethod, observer: SoftmaxInputObserver, scheme: QuantizationScheme
) -> Range:
    """The method's range over the values the Softmax can resolve, reaching down to the floor
    when values below it were left out: QuantizeLinear clamps them there, and at or below each
    row's `max − span` they stay invisible in the output (`softmax_span`). Unchanged when no
    value was left out."""
    chosen = select_range(method, observer.inner, scheme)
    if not observer.clamped:
        return chosen
    return Range(min(chosen.lo, observer.floor), chosen.hi)


# --------------------------------------------------------------------------- MSE


class _ClipErrors:
    """Σ count·(centre − a)² over bins whose centre lies below a (and the mirror for above b).

    Prefix sums of count, count·centre and count·centre² make each candidate O(log bins).
    """

    def __init__(self, hist: HistogramObserver) -> None:
        c = hist.counts.astype(np.float64)
        # Centres relative to the grid origin keep the sums well conditioned.
        m = hist.centers()
        self.centers = m
        self.n = float(c.sum())
        zero = np.zeros(1)
        self.c0 = np.concatenate([zero, np.cumsum(c)])
        self.c1 = np.concatenate([zero, np.cumsum(c * m)])
        self.c2 = np.concatenate([zero, np.cumsum(c * m * m)])

    def below(self, a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(clipping error, count) of the values below each candidate `a`."""
        k = np.searchsorted(self.centers, a, side="left")
        s0, s1, s2 = self.c0[k], self.c1[k], self.c2[k]
        return np.maximum(s2 - 2 * a * s1 + a * a * s0, 0.0), s0

    def above(self, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        k = np.searchsorted(self.centers, b, side="right")
        s0 = self.c0[-1] - self.c0[k]
        s1 = self.c1[-1] - self.c1[k]
        s2 = self.c2[-1] - self.c2[k]
        return np.maximum(s2 - 2 * b * s1 + b * b * s0, 0.0), s0


def _quant_noise(n_in: np.ndarray, step: np.ndarray) -> np.ndarray:
    return n_in * step * step / 12.0


def mse_range(hist: HistogramObserver, bits: int, symmetric: bool) -> Range:
    """Range minimising expected quantization MSE for `bits` (see the module docstring)."""
    errors = _ClipErrors(hist)
    edges = hist.edges()
    lo_seen, hi_seen = min(hist.min, 0.0), max(hist.max, 0.0)
    if symmetric:
        top = max(-lo_seen, hi_seen)
        if top <= 0:
            return Range(0.0, 0.0)
        t = np.unique(np.concatenate([np.abs(edges[(np.abs(edges) <= top) & (edges != 0)]), [top]]))
        low, n_low = errors.below(-t)
        high, n_high = errors.above(t)
        step = t / (2 ** (bits - 1) - 1)
        total = low + high + _quant_noise(errors.n - n_low - n_high, step)
        best = float(t[int(np.argmin(total))])
        return Range(max(-best, lo_seen), min(best, hi_seen))
    a_all = np.unique(np.concatenate([edges[(edges <= 0) & (edges >= lo_seen)], [lo_seen, 0.0]]))
    b_all = np.unique(np.concatenate([edges[(edges >= 0) & (edges <= hi_seen)], [hi_seen, 0.0]]))
    levels = 2**bits - 1

    def evaluate(a: np.ndarray, b: np.ndarray) -> tuple[float, float, float]:
        la, na = errors.below(a)
        hb, nb = errors.above(b)
        step = (b[None, :] - a[:, None]) / levels
        total = la[:, None] + hb[None, :] + _quant_noise(errors.n - na[:, None] - nb[None, :], step)
        i, j = np.unravel_index(int(np.argmin(total)), total.shape)
        return float(a[i]), float(b[j]), float(total[i, j])

    a_stride = max(1, math.ceil(len(a_all) / _COARSE_CANDIDATES))
    b_stride = max(1, math.ceil(len(b_all) / _COARSE_CANDIDATES))
    a_coarse = np.unique(np.concatenate([a_all[::a_stride], a_all[:1], a_all[-1:]]))
    b_coarse = np.unique(np.concatenate([b_all[::b_stride], b_all[:1], b_all[-1:]]))
    a_best, b_best, _ = evaluate(a_coarse, b_coarse)
    ia = int(np.searchsorted(a_all, a_best))
    ib = int(np.searchsorted(b_all, b_best))
    a_fine = a_all[max(0, ia - a_stride) : ia + a_stride + 1]
    b_fine = b_all[max(0, ib - b_stride) : ib + b_stride + 1]
    a_best, b_best, _ = evaluate(a_fine, b_fine)
    return Range(a_best, b_best)


# --------------------------------------------------------------------------- entropy


def _abs_histogram(hist: HistogramObserver) -> tuple[np.ndarray, bool]:
    """Histogram of |x| on the same bin width (exact: 0 is an edge), and whether x has both signs."""
    zero = -hist.origin  # index of the first bin at or above 0
    pos = hist.counts[max(zero, 0) :]
    neg = hist.counts[: max(zero, 0)][::-1]
    length = max(len(pos), len(neg))
    out = np.zeros(length, dtype=np.float64)
    out[: len(pos)] += pos
    out[: len(neg)] += neg
    two_signed = bool(neg.sum() > 0 and pos.sum() > 0)
    last = int(np.flatnonzero(out)[-1]) + 1 if out.any() else 1
    return out[:last], two_signed


def _kl_for(abs_hist: np.ndarray, i: int, levels: int) -> float:
    """KL(P‖Q) for threshold bin i: P folds the tail into bin i−1, Q is P's `levels`-level
    quantization spread back over the non-empty bins (TensorRT's recipe)."""
    sliced = abs_hist[:i]
    p = sliced.copy()
    p[-1] += abs_hist[i:].sum()
    chunk = np.minimum((np.arange(i) * levels) // i, levels - 1)
    nonzero = sliced != 0
    q_sum = np.bincount(chunk, weights=sliced, minlength=levels)
    q_cnt = np.bincount(chunk, weights=nonzero.astype(np.float64), minlength=levels)
    q = np.where(nonzero, q_sum[chunk] / np.maximum(q_cnt[chunk], 1.0), 0.0)
    p_total, q_total = p.sum(), q.sum()
    if p_total <= 0 or q_total <= 0:
        return math.inf
    ps, qs = _smooth(p / p_total), _smooth(q / q_total)
    if ps is None or qs is None:
        return math.inf
    return float(np.sum(ps * np.log(ps / qs)))


def _smooth(p: np.ndarray, eps: float = 1e-4) -> np.ndarray | None:
    """Move eps of mass onto empty bins (ONNX Runtime's smoothing), so a tail that lands in an
    empty bin costs a finite divergence instead of ruling the candidate out."""
    zeros = p == 0
    n_zero = int(zeros.sum())
    n_nonzero = p.size - n_zero
    if n_nonzero == 0:
        return None
    out = p + eps * zeros - (eps * n_zero / n_nonzero) * (~zeros)
    return np.where(out > 0, out, eps * 1e-3)


_MIN_COUNT_PER_BIN = 16
"""Sparse histograms are coarsened until bins hold this many values on average (KL on a
histogram with a few values per bin picks noise, not a threshold)."""


def entropy_range(hist: HistogramObserver, bits: int, symmetric: bool) -> Range:
    """TensorRT-style KL threshold on |x| (see the module docstring).

    The bin at 0 takes its neighbour's count, as in NVIDIA's recipe: ReLU outputs put half
    their mass exactly at 0, which would otherwise dominate the divergence.
    """
    abs_hist, two_signed = _abs_histogram(hist)
    levels = 2 ** (bits - 1) - 1 if (symmetric or two_signed) else 2**bits - 1
    width = hist.width
    factor = max(1, math.ceil(len(abs_hist) * _MIN_COUNT_PER_BIN / max(abs_hist.sum(), 1.0)))
    if factor > 1:
        padded = np.pad(abs_hist, (0, (-len(abs_hist)) % factor))
        abs_hist = padded.reshape(-1, factor).sum(axis=1)
        width *= factor
    n = len(abs_hist)
    if n <= levels:
        threshold = n * width
    else:
        abs_hist = abs_hist.copy()
        abs_hist[0] = abs_hist[1]
        stride = max(1, (n - levels) // 128)
        coarse = list(range(levels, n + 1, stride))
        if coarse[-1] != n:
            coarse.append(n)
        kls = [_kl_for(abs_hist, i, levels) for i in coarse]
        best = coarse[int(np.argmin(kls))]
        fine = range(max(levels, best - stride), min(n, best + stride) + 1)
        kls = [_kl_for(abs_hist, i, levels) for i in fine]
        threshold = fine[int(np.argmin(kls))] * width
    if symmetric:
        return Range(-threshold, threshold)
    return Range(max(hist.min, -threshold), min(hist.max, threshold))


# --------------------------------------------------------------------------- percentile


def _quantile(counts: np.ndarray, edges: np.ndarray, q: float) -> float:
    """Value below which a fraction q of the mass lies, linear inside the bin."""
    cdf = np.cumsum(counts, dtype=np.float64)
    total = cdf[-1]
    if total <= 0:
        return 0.0
    target = q * total
    k = int(np.searchsorted(cdf, target, side="left"))
    k = min(k, len(counts) - 1)
    before = cdf[k - 1] if k > 0 else 0.0
    inside = counts[k]
    frac = (target - before) / inside if inside > 0 else 0.0
    return float(edges[k] + frac * (edges[k + 1] - edges[k]))


def percentile_range(hist: HistogramObserver, percentile: float, symmetric: bool) -> Range:
    """(100 − p)-th to p-th percentile; |x|'s p-th percentile for symmetric schemes."""
    q = percentile / 100.0
    if symmetric:
        abs_hist, _ = _abs_histogram(hist)
        edges = np.arange(len(abs_hist) + 1, dtype=np.float64) * hist.width
        t = min(_quantile(abs_hist, edges, q), max(-hist.min, hist.max))
        return Range(-t, t)
    edges = hist.edges()
    lo = _quantile(hist.counts, edges, 1.0 - q)
    hi = _quantile(hist.counts, edges, q)
    return Range(max(lo, hist.min), min(hi, hist.max))
