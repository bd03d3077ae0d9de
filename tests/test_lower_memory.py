"""Memory planning: no two live tensors overlap, the peak never beats the lower bound, spills."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from compiler.lower.errors import CompileError
from compiler.lower.memory import (
    STRATEGIES,
    LiveTensor,
    MemoryPlan,
    Placement,
    live_bytes,
    live_ranges,
    lower_bound,
    plan_memory,
    verify_plan,
)
from compiler.lower.pipeline import segment_live_tensors
from tests.lower_support import load_example


def _random_tensors(rng: np.random.Generator, count: int, horizon: int) -> list[LiveTensor]:
    tensors = []
    for k in range(count):
        first = int(rng.integers(0, horizon))
        last = first + int(rng.integers(0, 8))
        size = int(rng.choice([16, 48, 100, 256, 1000, 4096, 7000]))
        tensors.append(LiveTensor(f"t{k}", size, first, last))
    return tensors


def _overlaps(plan: MemoryPlan) -> list[tuple[str, str]]:
    """Brute force: every pair of simultaneously live tensors sharing bytes of one space."""
    placed = list(plan.placements.values())
    bad = []
    for i, a in enumerate(placed):
        for b in placed[i + 1 :]:
            shared = a.space == b.space and a.offset < b.end and b.offset < a.end
            if shared and a.tensor.overlaps(b.tensor):
                bad.append((a.tensor.name, b.tensor.name))
    return bad


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("seed", range(6))
def test_random_plans_never_overlap_and_respect_the_bound(strategy: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    tensors = _random_tensors(rng, 60, 40)
    plan = plan_memory(tensors, strategy)
    verify_plan(plan)
    assert not _overlaps(plan)
    assert set(plan.placements) == {t.name for t in tensors}
    assert plan.peak_bytes >= plan.lower_bound_bytes == plan.demand_bytes
    assert not plan.spilled


def test_lower_bound_is_the_most_bytes_live_at_one_position() -> None:
    rng = np.random.default_rng(11)
    tensors = _random_tensors(rng, 40, 30)
    brute = max(
        sum(t.size for t in tensors if t.first <= position <= t.last) for position in range(0, 40)
    )
    aligned = [LiveTensor(t.name, -(-t.size // 16) * 16, t.first, t.last) for t in tensors]
    assert lower_bound(tensors) == brute
    assert plan_memory(tensors).demand_bytes == lower_bound(aligned)


def test_a_chain_is_packed_to_its_lower_bound_by_every_strategy() -> None:
    sizes = [4096, 1024, 8192, 512, 2048, 2048, 64]
    tensors = [LiveTensor(f"t{k}", s, k, k + 1) for k, s in enumerate(sizes)]
    for strategy in STRATEGIES:
        plan = plan_memory(tensors, strategy)
        assert plan.peak_bytes == lower_bound(tensors), strategy


def test_strategies_differ_and_best_fit_is_close_to_the_bound() -> None:
    peaks = {}
    ratios = []
    for seed in range(10):
        tensors = _random_tensors(np.random.default_rng(100 + seed), 80, 50)
        for strategy in STRATEGIES:
            plan = plan_memory(tensors, strategy)
            peaks.setdefault(strategy, []).append(plan.peak_bytes)
            if strategy == "BestFit":
                ratios.append(plan.efficiency)
    assert len({tuple(v) for v in peaks.values()}) > 1
    assert float(np.mean(ratios)) < 1.25


def test_equal_sizes_go_longest_lived_first_and_reach_the_bound() -> None:
    """Two 32-byte tensors: placing the short one (first used at the same step) first strands
    16 bytes the long one cannot use; longest-lived first packs to the bound."""
    tensors = [
        LiveTensor("t0", 16, 0, 4),
        LiveTensor("t1", 32, 4, 7),
        LiveTensor("t2", 32, 0, 0),
        LiveTensor("t3", 32, 0, 2),
        LiveTensor("t4", 16, 1, 4),
    ]
    for strategy in ("BestFit", "GreedyBySize"):
        plan = plan_memory(tensors, strategy)
        verify_plan(plan)
        assert plan.peak_bytes == lower_bound(tensors) == 80


def test_capacity_spills_to_dram_without_overlap() -> None:
    tensors = _random_tensors(np.random.default_rng(5), 50, 20)
    unbounded = plan_memory(tensors)
    capacity = unbounded.peak_bytes // 2
    plan = plan_memory(tensors, capacity=capacity)
    verify_plan(plan)
    assert not _overlaps(plan)
    assert plan.spilled and not plan.fits
    assert plan.peak_bytes <= capacity
    assert {plan.placements[n].space for n in plan.spilled} == {"DRAM"}
    assert plan.dram_bytes >= max(plan.placements[n].end for n in plan.spilled)
    assert plan.demand_bytes == unbounded.demand_bytes


def test_a_tensor_larger_than_the_arena_is_spilled() -> None:
    plan = plan_memory(
        [LiveTensor("big", 1 << 20, 0, 3), LiveTensor("small", 64, 1, 2)], capacity=4096
    )
    assert plan.spilled == ["big"]
    assert plan.placements["small"].space == "ARENA"


def test_verify_plan_reports_an_overlap() -> None:
    a, b = LiveTensor("a", 64, 0, 2), LiveTensor("b", 64, 1, 3)
    plan = plan_memory([a, b])
    plan.placements["b"] = Placement(b, "ARENA", 32)
    with pytest.raises(CompileError, match="overlap"):
        verify_plan(plan)


def test_unknown_strategy_is_a_clear_error() -> None:
    with pytest.raises(CompileError, match="BestFit"):
        plan_memory([], "Optimal")  # type: ignore[arg-type]


def test_live_ranges_and_profile() -> None:
    accesses = [((), ("a",)), (("a",), ("b",)), (("b",), ("c", "dead")), (("a", "c"), ())]
    ranges = {
        t.name: (t.first, t.last)
        for t in live_ranges(accesses, {"a": 1, "b": 1, "c": 1, "dead": 1})
    }
    assert ranges == {"a": (0, 3), "b": (1, 2), "c": (2, 3), "dead": (2, 2)}
    profile = live_bytes([LiveTensor("x", 10, 0, 1), LiveTensor("y", 5, 1, 2)])
    assert profile[0] == 10 and profile[1] == 15 and profile[2] == 5


@pytest.mark.parametrize(
    "name", ["plain_cnn", "yolo_head", "yolov5_head", "transformer_block", "cnn_with_topk"]
)
@pytest.mark.parametrize("order", ["WidthFirst", "DepthFirst"])
def test_best_fit_is_within_five_percent_of_the_bound_on_the_fixtures(
    name: str, order: str
) -> None:
    segments = segment_live_tensors(load_example(name), "mlsoc", order)
    assert segments
    for tensors in segments.values():
        for strategy in STRATEGIES:
            plan = plan_memory(tensors, strategy)
            verify_plan(plan)
            assert plan.peak_bytes >= plan.lower_bound_bytes
        best = plan_memory(tensors, "BestFit")
        assert best.peak_bytes <= 1.05 * best.lower_bound_bytes


def test_segment_live_tensors_takes_a_model_proto() -> None:
    model = load_example("plain_cnn")
    assert isinstance(model, onnx.ModelProto)
    (tensors,) = segment_live_tensors(model, "mlsoc").values()
    assert all(t.size > 0 and t.first <= t.last for t in tensors)
