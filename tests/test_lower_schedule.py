"""Layer order (WidthFirst / DepthFirst), the DMA timeline, fusion of views, batching choice."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from compiler.lower.batch import largest_fitting_batch
from compiler.lower.errors import CompileError
from compiler.lower.fusion import fuse_layers, layer_kind
from compiler.lower.memory import LiveTensor, plan_memory
from compiler.lower.partition import partition_model
from compiler.lower.schedule import build_timeline, schedule_layers
from tests.lower_support import load_example


@dataclass(frozen=True)
class Node:
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


# x -> a -> {b1 -> b2, c1 -> c2} -> d
BRANCHES = [
    Node(("x",), ("a",)),
    Node(("a",), ("b1",)),
    Node(("a",), ("c1",)),
    Node(("b1",), ("b2",)),
    Node(("c1",), ("c2",)),
    Node(("b2", "c2"), ("d",)),
]


def _is_topological(layers, order) -> bool:
    seen: set[str] = {"x"}
    for index in order:
        if not set(layers[index].inputs) <= seen:
            return False
        seen |= set(layers[index].outputs)
    return True


def test_width_first_advances_every_branch_depth_first_finishes_one() -> None:
    width = schedule_layers(BRANCHES, "WidthFirst")
    depth = schedule_layers(BRANCHES, "DepthFirst")
    assert width == [0, 1, 2, 3, 4, 5]
    assert depth == [0, 1, 3, 2, 4, 5]
    assert _is_topological(BRANCHES, width) and _is_topological(BRANCHES, depth)


def test_unknown_order_and_cycles_are_errors() -> None:
    with pytest.raises(CompileError, match="WidthFirst"):
        schedule_layers(BRANCHES, "Random")  # type: ignore[arg-type]
    with pytest.raises(CompileError, match="cycle"):
        schedule_layers([Node(("b",), ("a",)), Node(("a",), ("b",))])


def test_timeline_loads_before_first_use_and_stores_read_outputs() -> None:
    items = build_timeline(BRANCHES, [0, 1, 2, 3, 4, 5], ["x"], ["a"])
    kinds = [(i.kind, i.layer if i.kind == "layer" else i.tensor) for i in items]
    assert kinds[:3] == [("load", "x"), ("layer", 0), ("store", "a")]
    assert [k for k in kinds if k[0] == "layer"] == [("layer", i) for i in range(6)]


def test_depth_first_never_needs_more_memory_on_branches() -> None:
    sizes = {"x": 100, "a": 100, "b1": 400, "c1": 400, "b2": 50, "c2": 50, "d": 10}

    def peak(order):
        position = {layer: k for k, layer in enumerate(order)}
        tensors = []
        for name, size in sizes.items():
            writers = [position[i] for i, n in enumerate(BRANCHES) if name in n.outputs]
            readers = [position[i] for i, n in enumerate(BRANCHES) if name in n.inputs]
            first = min(writers or [0])
            tensors.append(LiveTensor(name, size, first, max(readers or [first])))
        return plan_memory(tensors).peak_bytes

    assert peak(schedule_layers(BRANCHES, "DepthFirst")) < peak(
        schedule_layers(BRANCHES, "WidthFirst")
    )


def test_fusion_names_layers_like_the_vendor_and_marks_views() -> None:
    partition = partition_model(load_example("yolov5_head"), "mlsoc")
    (stage,) = partition.mla_stages
    layers = fuse_layers(stage, partition.constants, set(stage.outputs))
    kinds = [layer.kind for layer in layers]
    assert kinds[0] == "conv2d_add_relu" and layers[0].name == "MLA_0/conv2d_add_relu_0"
    assert all(layer.name.startswith("MLA_0/") for layer in layers)
    swish = partition_model(load_example("yolo_head"), "mlsoc").mla_stages[0].steps[1]
    assert layer_kind(swish) == "swish"


def test_largest_fitting_batch_bisects() -> None:
    class Fake:
        def __init__(self, fits: bool) -> None:
            self.fits = fits

    choice = largest_fitting_batch([lambda b: Fake(b <= 12)], 16)
    assert (choice.desired, choice.actual) == (16, 12)
    assert largest_fitting_batch([lambda b: Fake(True)], 5).actual == 5
    assert largest_fitting_batch([lambda b: Fake(False)], 5).actual == 1
    with pytest.raises(CompileError):
        largest_fitting_batch([lambda b: Fake(True)], 0)
