"""Integer steps of an MLA segment -> MLA layers, with the fusions the program still allows.

Most fusion already happened when the QDQ graph became an integer program
(`compiler.runtime.lowering`): Conv/MatMul + bias + requantization + Relu/Clip are one step with
one output stage, `x * Sigmoid(x)` is one lookup table, DequantizeLinear -> QuantizeLinear is one
rescale. What remains is layout-level:

* **views**: Reshape, Flatten, Squeeze, Unsqueeze and Identity with an identity rescale move no
  bytes in the arena's C-ordered layout; their output *is* their input reinterpreted. They emit
  no instruction and share their input's arena buffer (the memory planner sees one buffer
  whose live range covers every name). A view whose output leaves the segment still needs a
  copy to DRAM and stays a layer.

Each remaining step is one layer, named like the vendor's stats (`MLA_0/conv2d_add_relu_3`).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import numpy as np

from compiler.lower.partition import Stage
from compiler.runtime.ops.conv import ConvKernel, ConvTransposeKernel
from compiler.runtime.ops.matmul import MatMulKernel
from compiler.runtime.ops.movement import MoveKernel
from compiler.runtime.program import IntegerStep

VIEW_OPS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Dropout"})
"""Ops whose output is their input under another shape: a MOVE of a reshaped view."""

_KIND_NAMES = {
    "Conv": "conv2d",
    "ConvTranspose": "conv2d_transpose",
    "MatMul": "matmul",
    "Gemm": "dense",
    "MaxPool": "max_pool2d",
    "AveragePool": "avg_pool2d",
    "GlobalAveragePool": "global_avg_pool2d",
    "GlobalMaxPool": "global_max_pool2d",
    "Mul(x, Sigmoid(x))": "swish",
    "Mul(x, HardSigmoid(x))": "hard_swish",
    "Requantize": "requantize",
}


@dataclass(frozen=True)
class Layer:
    """One MLA layer: an integer step, its run-time tensors, and whether it is a free view."""

    index: int
    name: str
    kind: str
    step: IntegerStep
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    view_of: str | None = None

    @property
    def is_view(self) -> bool:
        return self.view_of is not None


def layer_kind(step: IntegerStep) -> str:
    """conv2d_add_relu, matmul_add, swish, max_pool2d, … from the step's pattern."""
    parts = step.pattern.split("+") if "(" not in step.pattern else [step.pattern]
    anchor, fused = parts[0], parts[1:]
    kind = _KIND_NAMES.get(anchor) or _snake(anchor)
    if _has_bias(step) and "Add" not in fused:
        kind += "_add"
    for part in fused:
        kind += "_" + _snake(part)
    return kind


def _snake(text: str) -> str:
    text = re.sub(r"[^0-9A-Za-z]+", "_", text)
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", text).strip("_").lower()


def _has_bias(step: IntegerStep) -> bool:
    kernel = step.kernel
    if isinstance(kernel, ConvKernel | ConvTransposeKernel | MatMulKernel):
        return bool(np.any(np.asarray(kernel.bias)))
    return False


def is_view_step(step: IntegerStep, constants: Collection[str]) -> bool:
    """A data movement that moves no bytes in C order: same codes, same quantization."""
    kernel = step.kernel
    return (
        step.pattern in VIEW_OPS
        and isinstance(kernel, MoveKernel)
        and kernel.rescale.is_identity
        and len(step.inputs) == 1
        and step.inputs[0] not in constants
    )


def fuse_layers(
    stage: Stage, constants: Mapping[str, np.ndarray], leaving: Collection[str]
) -> list[Layer]:
    """The layers of an MLA stage; `leaving` are tensors other stages read (segment outputs)."""
    layers: list[Layer] = []
    for step in stage.steps:
        if not isinstance(step, IntegerStep):
            raise TypeError(f"MLA stage {stage.name} holds a {step.kind} step {step.name}")
        inputs = tuple(dict.fromkeys(n for n in step.inputs if n and n not in constants))
        outputs = tuple(n for n in step.outputs if n)
        view = (
            inputs[0]
            if is_view_step(step, constants) and not (set(outputs) & set(leaving))
            else None
        )
        kind = layer_kind(step)
        index = len(layers)
        layers.append(
            Layer(index, f"{stage.name}/{kind}_{index}", kind, step, inputs, outputs, view)
        )
    return layers
