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
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Item:
    """One position of a segment's timeline: a DMA in, a layer, or a DMA out.

    `load` brings a segment input from its DRAM buffer into its working copy just before the
    first layer that reads it; `store` copies a segment output that layers of the segment also
    read from its working copy to its DRAM buffer right after it is written. Outputs nothing
    in the segment reads are written straight to DRAM by their layer and need no item.
    """

    kind: Literal["load", "layer", "store"]
    layer: int | None = None
    tensor: str | None = None


def build_timeline(
    layers: Sequence[Schedulable],
    order: Sequence[int],
    segment_inputs: Sequence[str],
    resident_outputs: Sequence[str],
) -> list[Item]:
    """Layers in `order` with the loads and stores they need (see `Item`)."""
    pending = set(segment_inputs)
    stored = set(resident_outputs)
    items: list[Item] = []
    for index in order:
        layer = layers[index]
        for name in layer.inputs:
            if name in pending:
                pending.discard(name)
                items.append(Item("load", tensor=name))
        items.append(Item("layer", layer=index))
        for name in layer.outputs:
            if name in stored:
                items.append(Item("store", tensor=name))
    return items
