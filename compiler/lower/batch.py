"""Batching: compile for the largest batch, up to the one asked for, whose plan fits the arena.

A batch of B frames runs every layer on all B frames before the next layer (weights are
fetched once per batch), so every activation is B times larger. The compiler asks for
`batch_size=N` and gets the largest B <= N for which every segment's memory plan keeps all
activations on chip; the archive records both (`desired_batch_size`, `actual_batch_size`), as
the vendor's compiler does (16 asked, 12 compiled). If even one frame does not fit, the batch is
1 and the plan spills to DRAM.

The peak of a plan grows with B (every size scales), so the largest fitting B is found by
bisection and confirmed by planning it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from compiler.lower.errors import CompileError
from compiler.lower.memory import MemoryPlan

Planner = Callable[[int], MemoryPlan]


@dataclass(frozen=True)
class BatchChoice:
    desired: int
    actual: int
    reason: str


def largest_fitting_batch(planners: Sequence[Planner], desired: int) -> BatchChoice:
    """The largest batch in [1, desired] whose plans (one per segment) all fit."""
    if desired < 1:
        raise CompileError(f"batch_size must be at least 1, not {desired}")

    def fits(batch: int) -> bool:
        return all(planner(batch).fits for planner in planners)

    if fits(desired):
        return BatchChoice(desired, desired, "every activation of the batch fits the arena")
    if not fits(1):
        return BatchChoice(
            desired, 1, "one frame does not fit the arena; activations spill to DRAM"
        )
    low, high = 1, desired
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return BatchChoice(
        desired, low, f"a batch of {low + 1} would need more arena than the target has"
    )
