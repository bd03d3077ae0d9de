"""Tensor layouts: in the arena, at each MLA segment's DRAM boundary, and at the pipeline's edges.

Inside the arena every activation is stored NCHW in C order, one frame after the other (frame
`b` of a batch starts `b * nbytes` after frame 0). C order keeps Reshape / Flatten / Squeeze a
free reinterpretation of the same bytes (see `fusion`) and makes any Transpose, Slice or
DepthToSpace a strided view for the MOVE instruction; the MAC array is fed through the
descriptors' strides, so no compute instruction needs another layout.

A 4-D tensor crossing an MLA boundary lives in DRAM as HWC16 (the MLA's tessellated format)
unless tessellation parameters say otherwise (see `tessellate`):

* default: HWC16 at the boundary, with a CVU `tessellate` (NCHW -> HWC16) before the MLA stage
  and a CVU `detessellate` (HWC16 -> NCHW) after it;
* `enable_mla=True` on a pipeline input: the MLA reads `dram_layout` (HWC) from DRAM, the
  pipeline input is declared in that layout and its CVU quantize works on it elementwise;
* `enable_mla=True` on a pipeline output: the MLA writes `dram_layout` (HWC16), the CVU
  dequantize works on it elementwise and the pipeline output is declared in that layout.

Tensors of other ranks cross in C order with no reorder.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from compiler.isa import Layout
from compiler.lower.errors import CompileError
from compiler.lower.partition import Partition
from compiler.lower.tessellate import (
    DEFAULT,
    DEFAULT_TILE_SHAPE,
    TensorTessellateParameters,
    default_parameters,
)
from compiler.runtime.program import DequantizeStep, QuantizeStep

ARENA_LAYOUT: Layout = "NCHW"
MLA_NATIVE_LAYOUT: Layout = "HWC16"


@dataclass(frozen=True)
class BoundaryFormat:
    """How one MLA input or output sits in DRAM, and whether a CVU stage reorders it."""

    tensor: str
    layout: Layout
    reorder: bool
    tile_shape: tuple[int, ...] = DEFAULT_TILE_SHAPE


@dataclass
class LayoutPlan:
    """DRAM formats of every MLA boundary tensor and the layouts of the pipeline's edges."""

    inputs: dict[str, BoundaryFormat] = field(default_factory=dict)
    outputs: dict[str, BoundaryFormat] = field(default_factory=dict)
    pipeline_inputs: dict[str, Layout] = field(default_factory=dict)
    pipeline_outputs: dict[str, Layout] = field(default_factory=dict)

    @property
    def reorder_stages(self) -> int:
        return sum(f.reorder for f in (*self.inputs.values(), *self.outputs.values()))


def plan_layouts(
    partition: Partition,
    shapes: Mapping[str, Sequence[int]],
    parameters: Mapping[str, TensorTessellateParameters] | str,
) -> LayoutPlan:
    """Choose the DRAM format of every MLA boundary tensor (module docstring).

    `parameters="default"` asks for MLA-side tessellation (HWC in, HWC16 out) on every 4-D
    pipeline input and output the MLA can read or write directly.
    """
    if parameters == DEFAULT:
        parameters = default_direct_parameters(partition, shapes)
    stages = partition.stages
    producer = {name: stage for stage in stages for step in stage.steps for name in _outs(step)}
    producing_step = {
        name: step for stage in stages for step in stage.steps for name in _outs(step)
    }
    readers: dict[str, list] = {}
    for stage in stages:
        for name in stage.inputs:
            readers.setdefault(name, []).append(stage)
    mla_inputs = {n for s in partition.mla_stages for n in s.inputs}
    mla_outputs = {n for s in partition.mla_stages for n in s.outputs}
    _check_names(parameters, partition, mla_inputs | mla_outputs)
    plan = LayoutPlan(
        pipeline_inputs={name: "NCHW" for name in partition.input_names},
        pipeline_outputs={name: "NCHW" for name in partition.output_names},
    )
    for tensor in sorted(mla_inputs, key=_order(partition)):
        if len(shapes.get(tensor, ())) != 4:
            plan.inputs[tensor] = BoundaryFormat(tensor, "NCHW", False)
            continue
        step = producing_step.get(tensor)
        source = step.input if isinstance(step, QuantizeStep) else None
        params = parameters.get(tensor) or (parameters.get(source) if source else None)
        if params is None or not params.enable_mla:
            layout = params.dram_layout.value if params else MLA_NATIVE_LAYOUT
            tile = params.tile_shape if params else DEFAULT_TILE_SHAPE
            plan.inputs[tensor] = BoundaryFormat(tensor, layout, True, tile)
            continue
        direct = (
            source in partition.input_names
            and all(r.processor == "MLA" for r in readers.get(tensor, []))
            and [r.name for r in readers.get(source, [])] == [producer[tensor].name]
        )
        if not direct:
            raise CompileError(
                f"the MLA can read {tensor!r} directly only if it is the quantized pipeline "
                "input read by MLA stages alone",
                hint="drop enable_mla for it, or give the parameters for a pipeline input",
            )
        layout = params.dram_layout.value
        plan.inputs[tensor] = BoundaryFormat(tensor, layout, False, params.tile_shape)
        plan.pipeline_inputs[source] = layout
    for tensor in sorted(mla_outputs, key=_order(partition)):
        if len(shapes.get(tensor, ())) != 4:
            plan.outputs[tensor] = BoundaryFormat(tensor, "NCHW", False)
            continue
        consumers = readers.get(tensor, [])
        dequantized = [
            step.output
            for stage in consumers
            for step in stage.steps
            if isinstance(step, DequantizeStep) and step.input == tensor
        ]
        params = parameters.get(tensor) or next(
            (parameters[name] for name in dequantized if name in parameters), None
        )
        if params is None or not params.enable_mla:
            layout = params.dram_layout.value if params else MLA_NATIVE_LAYOUT
            tile = params.tile_shape if params else DEFAULT_TILE_SHAPE
            plan.outputs[tensor] = BoundaryFormat(tensor, layout, True, tile)
            continue
        direct = (
            tensor not in partition.output_names
            and dequantized
            and all(
                name in partition.output_names and not readers.get(name) for name in dequantized
            )
            and all(
                stage.kernel == "dequantize" and set(stage.inputs) <= set(mla_outputs)
                for stage in consumers
            )
        )
        if not direct:
            raise CompileError(
                f"the MLA can write {tensor!r} directly only if it is dequantized straight into "
                "pipeline outputs",
                hint="drop enable_mla for it, or give the parameters for a pipeline output",
            )
        layout = params.dram_layout.value
        plan.outputs[tensor] = BoundaryFormat(tensor, layout, False, params.tile_shape)
        for name in dequantized:
            plan.pipeline_outputs[name] = layout
    return plan


def default_direct_parameters(
    partition: Partition, shapes: Mapping[str, Sequence[int]]
) -> dict[str, TensorTessellateParameters]:
    """HWC / HWC16 MLA-side tessellation for every pipeline edge where it is possible."""
    candidates = default_parameters(
        [(n, shapes.get(n, ())) for n in partition.input_names],
        [(n, shapes.get(n, ())) for n in partition.output_names],
    )
    chosen: dict[str, TensorTessellateParameters] = {}
    for name, params in candidates.items():
        try:
            plan_layouts(partition, shapes, {**chosen, name: params})
        except CompileError:
            continue
        chosen[name] = params
    return chosen


def _outs(step) -> tuple[str, ...]:
    if isinstance(step, QuantizeStep | DequantizeStep):
        return (step.output,)
    return tuple(name for name in step.outputs if name)


def _order(partition: Partition):
    position: dict[str, int] = {}
    for stage in partition.stages:
        for step in stage.steps:
            for name in _outs(step):
                position.setdefault(name, len(position))
    return lambda name: (position.get(name, -1), name)


def _check_names(
    parameters: Mapping[str, TensorTessellateParameters],
    partition: Partition,
    boundary: set[str],
) -> None:
    known = set(partition.input_names) | set(partition.output_names) | boundary
    unknown = sorted(set(parameters) - known)
    if unknown:
        raise CompileError(
            f"tessellate_parameters name tensors that are not pipeline inputs, outputs or MLA "
            f"boundaries: {', '.join(map(repr, unknown))}",
            hint=f"known tensors: {', '.join(sorted(known)[:12])}",
        )
