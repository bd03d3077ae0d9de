"""Memory planning: place every activation of an MLA segment in the on-chip arena, or in DRAM.

Input: tensors with a size and a live range [first, last] in schedule positions (a tensor
exists from the layer that writes it to the last layer that reads it, both included). Output:
a byte offset per tensor such that no two tensors whose live ranges intersect share a byte.

Four strategies (the names RKNN's `memory_plan_strategy` uses), all greedy "order, then place":

* `BestFit` (default): largest tensors first (among equal sizes, the longest-lived first);
  each goes into the smallest gap between tensors live at the same time that holds it (lowest
  offset on ties), else on top. Packing the big tensors first and wasting the least space
  around each is what keeps the peak near the bound. The lifetime tie-break matters where a
  network repeats one feature-map size: on yolov5n's head, ordering equal sizes by first use
  instead left the peak at 1.41x the bound (1.06x now).
* `GreedyBySize`: largest first (same tie-break), each at the lowest offset where it fits
  (first fit) — the TFLite arena planner's "greedy by size".
* `GreedyByLifetime`: longest-lived tensors first (they constrain the most others), first fit.
* `SlowPeakGrowth`: schedule positions in order of decreasing live bytes (the busiest step
  first); the tensors live there, largest first, each where it raises the current peak least
  (smallest fitting gap, else on top). The busiest step is packed first, contiguously, so the
  peak starts at the lower bound and grows only when a later step forces it to.

The **lower bound** is the largest number of bytes live at any one position: no placement can
do better. `verify_plan` checks a plan (no overlaps among simultaneously live tensors, every
tensor inside its space) and is what the tests and the compiler call on every plan.

With a `capacity` (the arena size), a tensor whose chosen position would cross the end of the
arena is *spilled*: it lives in DRAM instead (producers write it there, consumers read it from
there, costing DRAM bandwidth). Spilled tensors are planned with the same strategy in a DRAM
scratch space.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from compiler.lower.errors import CompileError

Strategy = Literal["BestFit", "GreedyBySize", "GreedyByLifetime", "SlowPeakGrowth"]
STRATEGIES: tuple[Strategy, ...] = ("BestFit", "GreedyBySize", "GreedyByLifetime", "SlowPeakGrowth")
DEFAULT_ALIGNMENT = 16
"""Arena offsets and sizes are multiples of 16 bytes (one HWC16 channel group of int8)."""


@dataclass(frozen=True)
class LiveTensor:
    """A buffer to place: `size` bytes, needed from position `first` to `last` inclusive."""

    name: str
    size: int
    first: int
    last: int

    def overlaps(self, other: LiveTensor) -> bool:
        return self.first <= other.last and other.first <= self.last


@dataclass(frozen=True)
class Placement:
    """Where a tensor lives: `space` is "ARENA" or "DRAM", `offset` in bytes from its start."""

    tensor: LiveTensor
    space: Literal["ARENA", "DRAM"]
    offset: int

    @property
    def end(self) -> int:
        return self.offset + self.tensor.size


@dataclass
class MemoryPlan:
    """The placement of one segment's activations and how good it is.

    `peak_bytes` is the arena actually used (highest end offset); `lower_bound_bytes` the most
    bytes simultaneously live among the arena tensors (so peak >= bound always holds);
    `demand_bytes` the same bound over every tensor, spilled or not. `dram_bytes` is the DRAM
    scratch for spilled tensors.
    """

    strategy: Strategy
    placements: dict[str, Placement]
    capacity: int | None
    alignment: int
    peak_bytes: int
    lower_bound_bytes: int
    demand_bytes: int
    dram_bytes: int
    spilled: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        """Every tensor is on chip."""
        return not self.spilled

    @property
    def efficiency(self) -> float:
        """peak / lower bound (1.0 is optimal)."""
        return self.peak_bytes / self.lower_bound_bytes if self.lower_bound_bytes else 1.0

    def to_dict(self) -> dict[str, object]:
        return {
            "strategy": self.strategy,
            "peak_bytes": self.peak_bytes,
            "lower_bound_bytes": self.lower_bound_bytes,
            "demand_bytes": self.demand_bytes,
            "capacity_bytes": self.capacity,
            "spilled_tensors": len(self.spilled),
            "spilled_bytes": sum(self.placements[n].tensor.size for n in self.spilled),
            "dram_scratch_bytes": self.dram_bytes,
        }


def align(size: int, alignment: int = DEFAULT_ALIGNMENT) -> int:
    return -(-size // alignment) * alignment


def live_bytes(tensors: Iterable[LiveTensor]) -> dict[int, int]:
    """Bytes live at every position where something is live."""
    events: dict[int, int] = {}
    for tensor in tensors:
        events[tensor.first] = events.get(tensor.first, 0) + tensor.size
        events[tensor.last + 1] = events.get(tensor.last + 1, 0) - tensor.size
    profile: dict[int, int] = {}
    running = 0
    for position in sorted(events):
        running += events[position]
        profile[position] = running
    return profile


def live_ranges(
    accesses: Sequence[tuple[Iterable[str], Iterable[str]]], sizes: Mapping[str, int]
) -> list[LiveTensor]:
    """Live range of every tensor in `sizes` from per-position (reads, writes).

    A tensor lives from the first position that touches it to the last; a tensor written and
    never read lives at its writing position only.
    """
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for position, (reads, writes) in enumerate(accesses):
        for name in (*reads, *writes):
            if name in sizes:
                first.setdefault(name, position)
                last[name] = position
    return [LiveTensor(name, sizes[name], first[name], last[name]) for name in first]


def lower_bound(tensors: Iterable[LiveTensor]) -> int:
    """max over positions of the bytes live there: no placement can use less."""
    return max(live_bytes(tensors).values(), default=0)


def plan_memory(
    tensors: Sequence[LiveTensor],
    strategy: Strategy = "BestFit",
    *,
    capacity: int | None = None,
    alignment: int = DEFAULT_ALIGNMENT,
) -> MemoryPlan:
    """Place `tensors` with `strategy`; spill to DRAM what would cross `capacity` (if given)."""
    if strategy not in STRATEGIES:
        raise CompileError(
            f"unknown memory plan strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}"
        )
    sized = [LiveTensor(t.name, align(max(t.size, 1), alignment), t.first, t.last) for t in tensors]
    names = [t.name for t in sized]
    if len(set(names)) != len(names):
        raise CompileError("memory planning got two tensors with the same name")
    order, policy = _ORDERS[strategy](sized), _POLICIES[strategy]
    arena: list[Placement] = []
    spilled: list[LiveTensor] = []
    for tensor in order:
        offset = policy(tensor, [p for p in arena if p.tensor.overlaps(tensor)])
        if capacity is not None and offset + tensor.size > capacity:
            spilled.append(tensor)
        else:
            arena.append(Placement(tensor, "ARENA", offset))
    dram: list[Placement] = []
    for tensor in _ORDERS[strategy](spilled):
        offset = policy(tensor, [p for p in dram if p.tensor.overlaps(tensor)])
        dram.append(Placement(tensor, "DRAM", offset))
    placements = {p.tensor.name: p for p in (*arena, *dram)}
    return MemoryPlan(
        strategy=strategy,
        placements={name: placements[name] for name in names},
        capacity=capacity,
        alignment=alignment,
        peak_bytes=max((p.end for p in arena), default=0),
        lower_bound_bytes=lower_bound(p.tensor for p in arena),
        demand_bytes=lower_bound(sized),
        dram_bytes=max((p.end for p in dram), default=0),
        spilled=[t.name for t in spilled],
    )


def verify_plan(plan: MemoryPlan) -> None:
    """Raise CompileError if two simultaneously live tensors share bytes of one space.

    Checked with a sweep over each space's placements sorted by offset, comparing only pairs
    whose byte ranges intersect (O(n log n + overlapping pairs)).
    """
    for space in ("ARENA", "DRAM"):
        placed = sorted(
            (p for p in plan.placements.values() if p.space == space), key=lambda p: p.offset
        )
        active: list[Placement] = []
        for placement in placed:
            if placement.offset < 0 or placement.offset % plan.alignment:
                raise CompileError(f"{placement.tensor.name} is misaligned at {placement.offset}")
            active = [a for a in active if a.end > placement.offset]
            for other in active:
                if other.tensor.overlaps(placement.tensor):
                    raise CompileError(
                        f"memory plan overlap in {space}: {other.tensor.name} "
                        f"[{other.offset}, {other.end}) and {placement.tensor.name} "
                        f"[{placement.offset}, {placement.end}) are live together"
                    )
            active.append(placement)
        arena_end = max((p.end for p in placed), default=0)
        if space == "ARENA" and plan.capacity is not None and arena_end > plan.capacity:
            raise CompileError("the arena plan exceeds the arena capacity")


# --- orders -------------------------------------------------------------------------------------


def _by_size(tensors: Sequence[LiveTensor]) -> list[LiveTensor]:
    return sorted(tensors, key=lambda t: (-t.size, -(t.last - t.first), t.first, t.name))


def _by_lifetime(tensors: Sequence[LiveTensor]) -> list[LiveTensor]:
    return sorted(tensors, key=lambda t: (-(t.last - t.first), -t.size, t.first, t.name))


def _busiest_first(tensors: Sequence[LiveTensor]) -> list[LiveTensor]:
    profile = live_bytes(tensors)
    positions = sorted({t.first for t in tensors}, key=lambda p: (-_live_at(profile, p), p))
    seen: set[str] = set()
    order: list[LiveTensor] = []
    by_first = _by_size(tensors)
    for position in positions:
        for tensor in by_first:
            if tensor.name not in seen and tensor.first <= position <= tensor.last:
                seen.add(tensor.name)
                order.append(tensor)
    return order


def _live_at(profile: dict[int, int], position: int) -> int:
    best = 0
    for key in profile:
        if key <= position:
            best = profile[key]
        else:
            break
    return best


# --- placement policies -------------------------------------------------------------------------


def _gaps(conflicts: Sequence[Placement]) -> list[tuple[int, int | None]]:
    """Free (offset, size) intervals below and between conflicting placements; size None: top."""
    gaps: list[tuple[int, int | None]] = []
    cursor = 0
    for placement in sorted(conflicts, key=lambda p: p.offset):
        if placement.offset > cursor:
            gaps.append((cursor, placement.offset - cursor))
        cursor = max(cursor, placement.end)
    gaps.append((cursor, None))
    return gaps


def _first_fit(tensor: LiveTensor, conflicts: Sequence[Placement]) -> int:
    for offset, size in _gaps(conflicts):
        if size is None or size >= tensor.size:
            return offset
    raise AssertionError("the top gap always fits")


def _best_fit(tensor: LiveTensor, conflicts: Sequence[Placement]) -> int:
    fitting = [(size, offset) for offset, size in _gaps(conflicts) if size and size >= tensor.size]
    if fitting:
        return min(fitting)[1]
    return _gaps(conflicts)[-1][0]


_ORDERS = {
    "BestFit": _by_size,
    "GreedyBySize": _by_size,
    "GreedyByLifetime": _by_lifetime,
    "SlowPeakGrowth": _busiest_first,
}
_POLICIES = {
    "BestFit": _best_fit,
    "GreedyBySize": _first_fit,
    "GreedyByLifetime": _first_fit,
    "SlowPeakGrowth": _best_fit,
}
