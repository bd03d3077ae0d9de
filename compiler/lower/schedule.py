"""Layer order inside an MLA segment: `WidthFirst` (default) or `DepthFirst`.

Both are topological orders of the segment's layers (Kahn's algorithm); they differ in which
ready layer runs next, and so in which tensors are live together — the memory planner sees the
difference, the numbers do not (every order computes the same values).

* `WidthFirst` takes ready layers first-in first-out: every branch advances one layer at a time
  (breadth first). Branches that fan out (a detection head's levels, an Inception block) keep
  all their tensors live at once.
* `DepthFirst` takes the most recently readied layer first (a stack): it follows one branch to
  its end before starting the next, so a finished branch's tensors die before the next
  branch's are born, which usually lowers the peak.

Ties keep the program order of the integer program, so both orders are deterministic.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol

from compiler.lower.errors import CompileError

ComputeOrder = Literal["WidthFirst", "DepthFirst"]
COMPUTE_ORDERS: tuple[ComputeOrder, ...] = ("WidthFirst", "DepthFirst")


class Schedulable(Protocol):
    """Anything with named input and output tensors (a fused layer)."""

    @property
    def inputs(self) -> tuple[str, ...]: ...

    @property
    def outputs(self) -> tuple[str, ...]: ...


def schedule_layers(layers: Sequence[Schedulable], order: ComputeOrder = "WidthFirst") -> list[int]:
    """Indices of `layers` in execution order (see the module docstring)."""
    if order not in COMPUTE_ORDERS:
        raise CompileError(
            f"unknown compute order {order!r}; choose one of {', '.join(COMPUTE_ORDERS)}"
        )
    producer = {name: i for i, layer in enumerate(layers) for name in layer.outputs if name}
    waiting = [
        len({producer[n] for n in layer.inputs if n in producer and producer[n] != i})
        for i, layer in enumerate(layers)
    ]
    consumers: list[list[int]] = [[] for _ in layers]
    for i, layer in enumerate(layers):
        for j in sorted({producer[n] for n in layer.inputs if n in producer and producer[n] != i}):
            consumers[j].append(i)
    ready = [i for i, count in enumerate(waiting) if count == 0]
    if order == "DepthFirst":
        ready.reverse()
    result: list[int] = []
    while ready:
        current = ready.pop(0) if order == "WidthFirst" else ready.pop()
        result.append(current)
        released = []
        for consumer in consumers[current]:
            waiting[consumer] -= 1
            if waiting[consumer] == 0:
                released.append(consumer)
        if order == "WidthFirst":
            ready.extend(sorted(released))
        else:
            ready.extend(sorted(released, reverse=True))
    if len(result) != len(layers):
        raise CompileError("the layers of an MLA segment form a cycle")
    return result
