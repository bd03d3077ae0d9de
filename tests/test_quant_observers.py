"""Observers and range selection: known answers, constant memory, outliers."""

from __future__ import annotations

import numpy as np
import pytest

from compiler.defines import (
    HistogramEntropyMethod,
    HistogramMSEMethod,
    HistogramPercentileMethod,
    MinMaxMethod,
    MovingAverageMinMaxMethod,
    quantization_scheme,
)
from compiler.quantize.observers import (
    HistogramObserver,
    MinMaxObserver,
    MovingAverageMinMaxObserver,
)
from compiler.quantize.qparams import activation_qparams
from compiler.quantize.ranges import Range, make_observer, mse_range, select_range

ASYM8 = quantization_scheme(asymmetric=True, per_channel=False, bits=8)
SYM8 = quantization_scheme(asymmetric=False, per_channel=False, bits=8)


def laplace_with_outlier(
    samples: int = 8, size: int = 250_000, outlier: float = 100.0
) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    batches = [rng.laplace(0.0, 1.0, size).astype(np.float32) for _ in range(samples)]
    batches[samples // 2][0] = outlier
    return batches


def observe(method, batches):
    obs = make_observer(method)
    for b in batches:
        obs.update(b)
    return obs


def test_min_max_keeps_the_outlier() -> None:
    batches = laplace_with_outlier()
    r = select_range(MinMaxMethod(), observe(MinMaxMethod(), batches), ASYM8)
    assert r.hi == pytest.approx(100.0)
    assert r.lo == pytest.approx(min(float(b.min()) for b in batches))


@pytest.mark.parametrize(
    "method", [HistogramEntropyMethod(), HistogramPercentileMethod(99.99), HistogramMSEMethod()]
)
def test_histogram_methods_clip_a_far_outlier(method) -> None:
    batches = laplace_with_outlier()
    for scheme in (ASYM8, SYM8):
        r = select_range(method, observe(method, batches), scheme)
        assert r.hi < 50.0, (method, scheme, r)
        assert r.hi > 5.0  # but keep the body of the distribution


def test_mse_picks_a_clipped_range_that_beats_min_max() -> None:
    batches = laplace_with_outlier()
    data = np.concatenate(batches).astype(np.float64)
    hist = observe(HistogramMSEMethod(), batches)
    chosen = mse_range(hist, 8, symmetric=False)

    def empirical_mse(r: Range) -> float:
        qp = activation_qparams(r, ASYM8)
        q = np.clip(np.rint(data / qp.scale) + qp.zero_point, -128, 127)
        return float(np.mean((data - (q - qp.zero_point) * qp.scale) ** 2))

    full = Range(float(data.min()), float(data.max()))
    assert chosen.hi < 0.3 * full.hi
    assert empirical_mse(chosen) < 0.7 * empirical_mse(full)


def test_mse_range_widens_with_more_bits() -> None:
    hist = observe(HistogramMSEMethod(), laplace_with_outlier())
    assert mse_range(hist, 16, symmetric=True).hi > mse_range(hist, 8, symmetric=True).hi


def test_moving_average_is_a_true_exponential_average() -> None:
    obs = MovingAverageMinMaxObserver(momentum=0.9)
    for lo, hi in [(-1.0, 2.0), (-3.0, 4.0), (-2.0, 10.0)]:
        obs.update(np.array([lo, 0.5, hi], dtype=np.float32))
    # m1 = x1; m2 = 0.9 m1 + 0.1 x2; m3 = 0.9 m2 + 0.1 x3
    assert obs.ema_min == pytest.approx(0.9 * (0.9 * -1.0 + 0.1 * -3.0) + 0.1 * -2.0)
    assert obs.ema_max == pytest.approx(0.9 * (0.9 * 2.0 + 0.1 * 4.0) + 0.1 * 10.0)
    assert obs.ema_max == pytest.approx(2.98)  # a plain mean would give 5.33
    r = select_range(MovingAverageMinMaxMethod(0.9), obs, ASYM8)
    assert (r.lo, r.hi) == (pytest.approx(obs.ema_min), pytest.approx(obs.ema_max))


def test_histogram_rebinning_keeps_the_count_and_covers_the_new_range() -> None:
    h = HistogramObserver(num_bins=128)
    h.update(np.linspace(0.0, 1.0, 1000, dtype=np.float32))
    assert h.lower == 0.0 and h.upper >= 1.0
    before = h.counts.copy()
    h.update(np.array([-10.0, 30.0], dtype=np.float32))
    assert h.total == 1002
    assert h.lower <= -10.0 and h.upper > 30.0
    assert h.counts.size == 128
    # exact merge: the 1000 values now sit in the bins that cover [0, 1], nothing got lost
    edges = h.edges()
    inside = h.counts[(edges[:-1] >= 0.0) & (edges[1:] <= 1.0 + h.width)].sum()
    assert inside >= 1000 and before.sum() == 1000
    assert 0.0 in set(np.round(edges, 12))  # zero stays a bin edge


def test_histogram_rebinning_matches_a_direct_histogram() -> None:
    rng = np.random.default_rng(3)
    data = [rng.normal(0, s, 5000).astype(np.float32) for s in (0.1, 1.0, 10.0, 100.0)]
    h = HistogramObserver(num_bins=256)
    for d in data:
        h.update(d)
    direct, _ = np.histogram(np.concatenate(data), bins=h.edges())
    # values from the first (narrow) samples are merged exactly; later samples binned directly
    assert h.total == sum(d.size for d in data)
    assert np.abs(h.counts - direct).sum() <= 2  # float rounding at bin edges only


def test_histogram_grows_from_a_narrow_range_to_float32_extremes() -> None:
    """An exported attention mask adds (1 - mask) * float32.min: after a narrow first sample
    the bins widen by more than 2**63 at once, which must merge, not overflow."""
    h = HistogramObserver(num_bins=256)
    h.update(np.linspace(-1e-3, 1e-3, 1000, dtype=np.float32))
    lowest = float(np.finfo(np.float32).min)
    h.update(np.array([lowest, 0.5], dtype=np.float32))
    assert h.total == 1002
    assert h.lower <= lowest and h.upper > 0.5
    zero_bin = int(np.searchsorted(h.edges(), 0.0, side="right")) - 1
    assert h.counts[zero_bin - 1 : zero_bin + 1].sum() == 1001  # the narrow sample and 0.5
    assert h.counts[0] == 1


def test_a_tensor_of_denormals_is_binned_and_quantizes_as_zero() -> None:
    """An untrained model's near-zero activations (~1e-45): a range narrower than float32
    resolves must not give zero-width bins (the division made every index negative)."""
    h = HistogramObserver(num_bins=256)
    h.update(np.array([0.0, 3e-45, -1e-45, 5.6e-45], dtype=np.float32))
    h.update(np.array([2e-45], dtype=np.float32))
    assert h.total == 5
    assert activation_qparams(mse_range(h, 8, symmetric=False), ASYM8).scale == 1.0


@pytest.mark.parametrize(
    "method",
    [MinMaxMethod(), MovingAverageMinMaxMethod(), HistogramMSEMethod(), HistogramEntropyMethod()],
)
def test_observer_memory_does_not_grow_with_samples(method) -> None:
    rng = np.random.default_rng(0)
    obs = make_observer(method)
    obs.update(rng.normal(size=1000).astype(np.float32))
    first = [a.shape for a in obs.state_arrays()], obs.state_nbytes()
    for scale in np.linspace(1, 50, 200):
        obs.update((rng.normal(size=1000) * scale).astype(np.float32))
    assert ([a.shape for a in obs.state_arrays()], obs.state_nbytes()) == first
    assert obs.samples == 201


def test_histogram_state_is_o_bins() -> None:
    h = HistogramObserver(num_bins=2048)
    h.update(np.zeros(10, dtype=np.float32))
    h.update(np.random.default_rng(0).normal(size=100_000).astype(np.float32))
    assert h.state_nbytes() == 2048 * 8


def test_ranges_always_contain_zero_and_ignore_non_finite() -> None:
    obs = MinMaxObserver()
    obs.update(np.array([2.0, 3.0, np.nan, np.inf], dtype=np.float32))
    r = select_range(MinMaxMethod(), obs, ASYM8)
    assert (r.lo, r.hi) == (0.0, 3.0)
    qp = activation_qparams(r, ASYM8)
    assert qp.zero_point == -128 and qp.scale == pytest.approx(3.0 / 255, rel=1e-6)


def test_symmetric_activation_qparams() -> None:
    qp = activation_qparams(Range(-2.0, 1.0), SYM8)
    assert qp.zero_point == 0 and qp.scale == pytest.approx(2.0 / 127, rel=1e-6)
    empty = activation_qparams(Range(0.0, 0.0), ASYM8)
    assert empty.scale == 1.0 and empty.zero_point == 0


def _reference_counts(obs: HistogramObserver, x: np.ndarray) -> np.ndarray:
    """The unchunked formula the chunked binning must reproduce bit for bit."""
    flat = x.astype(np.float32).reshape(-1)
    index = np.floor(flat / np.float32(obs.width)).astype(np.int64) - obs.origin
    return np.bincount(np.clip(index, 0, obs.num_bins - 1), minlength=obs.num_bins)


def test_chunked_binning_matches_the_whole_array_formula() -> None:
    rng = np.random.default_rng(3)
    first = (rng.standard_normal(1000) * 4).astype(np.float32)
    obs = HistogramObserver()
    obs.update(first)
    edges = obs.edges().astype(np.float32)  # values exactly on bin edges, and both range ends
    x = np.concatenate([rng.uniform(obs.lower, obs.upper, 200_003).astype(np.float32), edges])
    x = x[(x >= obs.lower) & (x < obs.upper)]
    before = obs.counts.copy()
    obs.update(x)
    np.testing.assert_array_equal(obs.counts - before, _reference_counts(obs, x))
    assert x.size > 4 * (1 << 15)  # several chunks


def test_non_finite_values_are_dropped_before_binning() -> None:
    obs = HistogramObserver()
    x = np.array([1.0, np.nan, -2.0, np.inf, 0.5], np.float32)
    obs.update(x)
    assert obs.total == 3 and obs.elements == 5 and (obs.min, obs.max) == (-2.0, 1.0)
