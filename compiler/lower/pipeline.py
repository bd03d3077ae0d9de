"""The whole lowering of one QDQ model, in order: the stages of the compiler wired together.

    partition   QDQ model -> integer program -> MLA segments + CVU / APU stages
    layout      DRAM format of every MLA boundary tensor; CVU reorder stages where needed
    per MLA segment:
      fusion    integer steps -> layers (views cost nothing)
      schedule  layer order (WidthFirst / DepthFirst) + the DMA loads and stores
      memory    live ranges -> arena offsets (strategy), spills to DRAM, lower bound
    batch       largest batch <= the requested one whose plans all fit
    codegen     instructions + .rodata at the planned addresses -> ELF
    host stages quantize / dequantize / (de)tessellate kernels, ONNX subgraphs

The result, `CompiledModel`, is what `compiler.archive` writes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import onnx

from compiler.costmodel import MlaHardware, Schedule, stall_aware_schedule, static_schedule
from compiler.elf import elf_bytes
from compiler.isa import (
    Instruction,
    MlaProgram,
    ProgramMetadata,
    Space,
    TensorInfo,
    layout_nbytes,
)
from compiler.lower.batch import BatchChoice, largest_fitting_batch
from compiler.lower.codegen import (
    Constants,
    Storage,
    emit_copy,
    emit_layer,
    writes_c_order_only,
)
from compiler.lower.errors import CompileError
from compiler.lower.fusion import Layer, fuse_layers
from compiler.lower.layout import LayoutPlan, plan_layouts
from compiler.lower.memory import (
    STRATEGIES,
    LiveTensor,
    MemoryPlan,
    Strategy,
    live_ranges,
    plan_memory,
    verify_plan,
)
from compiler.lower.partition import (
    Partition,
    Stage,
    TensorType,
    partition_model,
    stage_graph,
    tensor_types,
)
from compiler.lower.schedule import (
    COMPUTE_ORDERS,
    ComputeOrder,
    Item,
    build_timeline,
    schedule_layers,
)
from compiler.lower.tessellate import (
    TensorDRAMLayout,
    TensorTessellateParameters,
    coerce_parameters,
)
from compiler.runtime.program import DequantizeStep, QuantizeStep
from surgery.targets import Target, resolve_target
from surgery.verify import input_specs

DRAM_ALIGNMENT = 64
PROCESSOR_NAMES = {"MLA": "MLA", "CVU": "EV74", "APU": "A65"}
"""Our processor classes -> the names `_mpk.json` uses (the vendor's plugin processors)."""


@dataclass(frozen=True)
class CompileOptions:
    """Every knob of `compile_model`, validated once."""

    target: str | Target = "mlsoc"
    batch_size: int = 1
    compress: bool = True
    tessellate_parameters: Mapping[str, TensorTessellateParameters] | str | None = None
    memory_plan_strategy: Strategy = "BestFit"
    compute_order: ComputeOrder = "WidthFirst"
    single_core_mode: bool = False
    custom_string: str = ""
    arena_bytes: int | None = None
    """Override of the arena size (what-if studies and tests); default: the target's SRAM."""

    def __post_init__(self) -> None:
        if self.memory_plan_strategy not in STRATEGIES:
            raise CompileError(
                f"memory_plan_strategy must be one of {', '.join(STRATEGIES)}, "
                f"not {self.memory_plan_strategy!r}"
            )
        if self.compute_order not in COMPUTE_ORDERS:
            raise CompileError(
                f"compute_order must be one of {', '.join(COMPUTE_ORDERS)}, "
                f"not {self.compute_order!r}"
            )
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise CompileError(f"batch_size must be a positive integer, not {self.batch_size!r}")
        if self.arena_bytes is not None and self.arena_bytes < 0:
            raise CompileError("arena_bytes must be non-negative")
        object.__setattr__(
            self, "tessellate_parameters", coerce_parameters(self.tessellate_parameters)
        )
        object.__setattr__(self, "custom_string", self.custom_string or "")


@dataclass(frozen=True)
class TensorSpec:
    """A pipeline buffer: logical per-frame shape, element type and DRAM layout."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    layout: str = "NCHW"
    value_range: tuple[int, int] | None = None
    """[low, high) of the values an integer input may take (ids into a Gather table of `high`
    rows); None when any value of the dtype is valid."""

    @property
    def size(self) -> int:
        """Bytes of one frame in its layout (HWC16 counts the channel padding)."""
        if np.dtype(self.dtype).kind in "iu":
            return layout_nbytes(self.shape, self.dtype, self.layout)
        itemsize = np.dtype(self.dtype).itemsize
        if self.layout == "HWC16" and len(self.shape) == 4:
            n, c, h, w = self.shape
            return n * h * w * (-(-c // 16) * 16) * itemsize
        return math.prod(self.shape) * itemsize

    def to_dict(self) -> dict[str, Any]:
        node = {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "layout": self.layout,
            "size": self.size,
        }
        if self.value_range is not None:
            node["value_range"] = list(self.value_range)
        return node


@dataclass
class CompiledSegment:
    """One MLA segment: its program (and ELF), memory plan and static schedule."""

    stage: Stage
    program: MlaProgram
    elf: bytes
    plan: MemoryPlan
    static: Schedule
    stall_aware: Schedule
    layers: list[Layer]

    @property
    def name(self) -> str:
        return self.stage.name

    def summary(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "coverage_segment": (self.stage.segment or self.name).split(".")[0],
            "layers": sum(1 for layer in self.layers if not layer.is_view),
            "instructions": len(self.program.instructions),
            "peak_bytes": self.plan.peak_bytes,
            "lower_bound_bytes": self.plan.lower_bound_bytes,
            "arena_capacity_bytes": self.plan.capacity,
            "spilled_tensors": len(self.plan.spilled),
            "dram_scratch_bytes": self.plan.dram_bytes,
            "rodata_bytes": len(self.program.rodata),
            "cycles": self.static.total_cycles,
            "stall_aware_cycles": self.stall_aware.total_cycles,
            "macs": self.static.total_macs,
        }


@dataclass
class PipelineStage:
    """One plugin of the pipeline (`_mpk.json`): an MLA program or a host kernel."""

    name: str
    processor: str
    kernel: str
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    params: dict[str, Any] = field(default_factory=dict)
    segment: CompiledSegment | None = None
    graph: onnx.ModelProto | None = None


@dataclass
class CompiledModel:
    """Everything the archive holds, before it is written."""

    name: str
    target: str
    stages: list[PipelineStage]
    segments: list[CompiledSegment]
    batch: BatchChoice
    quads: int
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    partition: Partition
    layouts: LayoutPlan
    options: CompileOptions
    hardware: MlaHardware
    notes: list[str] = field(default_factory=list)


@dataclass
class SegmentPrep:
    """An MLA segment up to memory planning; `plan(batch)` scales it to a batch."""

    stage: Stage
    layers: list[Layer]
    items: list[Item]
    roots: dict[str, str]
    working: list[str]
    direct_outputs: set[str]
    live: list[LiveTensor]

    def plan(self, batch: int, strategy: Strategy, capacity: int | None) -> MemoryPlan:
        scaled = [replace(t, size=t.size * batch) for t in self.live]
        plan = plan_memory(scaled, strategy, capacity=capacity)
        verify_plan(plan)
        return plan


def compile_pipeline(
    qdq_model: onnx.ModelProto, name: str, options: CompileOptions
) -> CompiledModel:
    """Lower a QDQ model to MLA programs and host stages (module docstring)."""
    target = resolve_target(options.target)
    hardware = MlaHardware.from_profile(target.profile.hardware)
    quads = 1 if options.single_core_mode else hardware.quads
    hardware = hardware.with_quads(quads)
    capacity = options.arena_bytes if options.arena_bytes is not None else hardware.arena_bytes
    if capacity > hardware.arena_bytes:
        raise CompileError(
            f"arena_bytes={capacity} exceeds the {hardware.arena_bytes} bytes of SRAM that "
            f"{quads} quad(s) of {target.name} have"
        )
    partition = partition_model(qdq_model, target)
    types = tensor_types(partition)
    shapes = {n: t.shape for n, t in types.items()}
    layouts = plan_layouts(partition, shapes, options.tessellate_parameters or {})
    if options.tessellate_parameters == "default":
        options = replace(options, tessellate_parameters=_chosen(layouts))
    preps = [
        prepare_segment(stage, partition, types, options.compute_order)
        for stage in partition.mla_stages
    ]
    strategy = options.memory_plan_strategy
    cache: dict[tuple[int, int], MemoryPlan] = {}

    def planner(index: int):
        def plan(batch: int) -> MemoryPlan:
            key = (index, batch)
            if key not in cache:
                cache[key] = preps[index].plan(batch, strategy, capacity)
            return cache[key]

        return plan

    planners = [planner(i) for i in range(len(preps))]
    batch = (
        largest_fitting_batch(planners, options.batch_size)
        if preps
        else BatchChoice(options.batch_size, options.batch_size, "no MLA segment")
    )
    segments = [
        generate_segment(
            prep,
            planners[i](batch.actual),
            batch.actual,
            partition,
            layouts,
            types,
            hardware,
            quads,
            name,
            options,
        )
        for i, prep in enumerate(preps)
    ]
    stages = _assemble(partition, layouts, segments, types, batch, quads)
    notes = list(partition.notes)
    if batch.actual != batch.desired:
        notes.append(f"batch {batch.desired} requested, {batch.actual} compiled: {batch.reason}")
    for segment in segments:
        if segment.plan.spilled:
            notes.append(
                f"{segment.name}: {len(segment.plan.spilled)} tensors spill to DRAM "
                f"({segment.plan.dram_bytes} bytes of scratch)"
            )
    index_ranges = _index_ranges(partition.model)
    return CompiledModel(
        name=name,
        target=target.name,
        stages=stages,
        segments=segments,
        batch=batch,
        quads=quads,
        inputs=[
            TensorSpec(
                n,
                shapes[n],
                types[n].dtype.name,
                layouts.pipeline_inputs.get(n, "NCHW"),
                index_ranges.get(n),
            )
            for n in partition.input_names
        ],
        outputs=[
            TensorSpec(n, shapes[n], types[n].dtype.name, layouts.pipeline_outputs.get(n, "NCHW"))
            for n in partition.output_names
        ],
        partition=partition,
        layouts=layouts,
        options=options,
        hardware=hardware,
        notes=notes,
    )


# --- one MLA segment ------------------------------------------------------------------------------


def prepare_segment(
    stage: Stage, partition: Partition, types: Mapping[str, TensorType], order: ComputeOrder
) -> SegmentPrep:
    """Fuse, schedule and lay out the timeline of one MLA stage; live ranges per frame."""
    leaving = set(stage.outputs)
    layers = fuse_layers(stage, partition.constants, leaving)
    roots: dict[str, str] = {}

    def root(name: str) -> str:
        while name in roots:
            name = roots[name]
        return name

    for layer in layers:
        if layer.view_of is not None:
            roots[layer.outputs[0]] = root(layer.view_of)
    read_inside = {n for layer in layers for n in layer.inputs}
    read_inside |= {n for layer in layers if writes_c_order_only(layer) for n in layer.outputs}
    resident_outputs = [n for n in stage.outputs if n in read_inside]
    direct_outputs = leaving - set(resident_outputs)
    schedule = schedule_layers(layers, order)
    items = build_timeline(layers, schedule, stage.inputs, resident_outputs)
    accesses: list[tuple[tuple[str, ...], tuple[str, ...]]] = []
    for item in items:
        if item.kind == "load":
            accesses.append(((), (root(item.tensor),)))
        elif item.kind == "store":
            accesses.append(((root(item.tensor),), ()))
        else:
            layer = layers[item.layer]
            reads = tuple(root(n) for n in layer.inputs)
            writes = tuple(root(n) for n in layer.outputs if n not in direct_outputs)
            accesses.append((reads, () if layer.is_view else writes))
    working = sorted(
        {root(n) for layer in layers for n in (*layer.inputs, *layer.outputs)} - direct_outputs
    )
    sizes = {n: math.prod(types[n].shape) * types[n].dtype.itemsize for n in working}
    live = live_ranges(accesses, sizes)
    return SegmentPrep(stage, layers, items, roots, working, direct_outputs, live)


def generate_segment(
    prep: SegmentPrep,
    plan: MemoryPlan,
    batch: int,
    partition: Partition,
    layouts: LayoutPlan,
    types: Mapping[str, TensorType],
    hardware: MlaHardware,
    quads: int,
    model_name: str,
    options: CompileOptions,
) -> CompiledSegment:
    """Addresses from the plan, instructions from the layers, then the program and its ELF.

    DRAM holds the segment's inputs and outputs in their boundary layouts (64-byte aligned, in
    that order) and then the scratch space of spilled tensors.
    """
    stage = prep.stage
    boundary: dict[str, Storage] = {}
    offset = 0
    for name in (*stage.inputs, *stage.outputs):
        fmt = layouts.inputs[name] if name in layouts.inputs else layouts.outputs[name]
        info = types[name]
        storage = Storage(name, Space.DRAM, info.dtype, offset, info.shape, batch, fmt.layout)
        boundary[name] = storage
        nbytes = layout_nbytes(storage.stacked().shape, info.dtype, fmt.layout)
        offset += -(-max(nbytes, 1) // DRAM_ALIGNMENT) * DRAM_ALIGNMENT
    scratch = offset
    storages: dict[str, Storage] = {}
    for name in prep.working:
        placement = plan.placements[name]
        space = Space.ARENA if placement.space == "ARENA" else Space.DRAM
        base = 0 if space == Space.ARENA else scratch
        info = types[name]
        storages[name] = Storage(
            name, space, info.dtype, base + placement.offset, info.shape, batch, "NCHW"
        )
    for member, root in prep.roots.items():
        while root in prep.roots:
            root = prep.roots[root]
        info = types[member]
        storages[member] = replace(storages[root], name=member, shape=info.shape, dtype=info.dtype)
    for name in prep.direct_outputs:
        storages[name] = boundary[name]
    constants = Constants()
    names: list[str] = []
    instructions: list[Instruction] = []
    loads = stores = 0
    for item in prep.items:
        if item.kind == "layer":
            layer = prep.layers[item.layer]
            if layer.is_view:
                continue
            index = len(names)
            names.append(layer.name)
            instructions.extend(
                emit_layer(layer, index, storages, partition.constants, constants, batch)
            )
            continue
        tensor = item.tensor
        index = len(names)
        if item.kind == "load":
            names.append(f"{stage.name}/dma_load_{loads}")
            loads += 1
            instructions.append(
                emit_copy(boundary[tensor].stacked(), storages[tensor].stacked(), index)
            )
        else:
            names.append(f"{stage.name}/dma_store_{stores}")
            stores += 1
            instructions.append(
                emit_copy(storages[tensor].stacked(), boundary[tensor].stacked(), index)
            )
    tensors = []
    for role, group in (("input", stage.inputs), ("output", stage.outputs)):
        for name in group:
            params = partition.tensor_params.get(name)
            tensors.append(
                TensorInfo(
                    name=name,
                    role=role,
                    tensor=boundary[name].stacked(),
                    layout=boundary[name].layout,
                    scale=tuple(float(s) for s in np.ravel(params.scale)) if params else (1.0,),
                    zero_point=tuple(int(z) for z in np.ravel(params.zero_point))
                    if params
                    else (0,),
                )
            )
    metadata = ProgramMetadata(
        name=f"{model_name}_{stage.name}",
        tensors=tuple(tensors),
        arena_size=plan.peak_bytes,
        dram_size=scratch + plan.dram_bytes,
        batch_size=batch,
        quads=quads,
        custom_string=options.custom_string,
        requantization_mode=partition.mode,
        layers=tuple(names),
        extra={
            "segment": stage.name,
            "coverage_segment": (stage.segment or stage.name).split(".")[0],
            "compute_order": options.compute_order,
            "memory_plan": plan.to_dict(),
        },
    )
    program = MlaProgram(tuple(instructions), constants.to_bytes(), metadata)
    return CompiledSegment(
        stage=stage,
        program=program,
        elf=elf_bytes(program, compress=options.compress),
        plan=plan,
        static=static_schedule(program.instructions, hardware),
        stall_aware=stall_aware_schedule(program.instructions, hardware),
        layers=prep.layers,
    )


# --- host stages and the plugin list ----------------------------------------------------------------


def _assemble(
    partition: Partition,
    layouts: LayoutPlan,
    segments: list[CompiledSegment],
    types: Mapping[str, TensorType],
    batch: BatchChoice,
    quads: int,
) -> list[PipelineStage]:
    by_stage = {segment.stage.name: segment for segment in segments}

    def spec(name: str, layout: str = "NCHW") -> TensorSpec:
        return TensorSpec(name, types[name].shape, types[name].dtype.name, layout)

    direct_out = {n: f.layout for n, f in layouts.outputs.items() if not f.reorder}
    stages: list[PipelineStage] = []
    for stage in partition.stages:
        if stage.processor == "MLA":
            segment = by_stage[stage.name]
            before = [layouts.inputs[n] for n in stage.inputs if layouts.inputs[n].reorder]
            if before:
                stages.append(_reorder_stage("tessellate", before, spec))
            stages.append(
                PipelineStage(
                    name=stage.name,
                    processor="MLA",
                    kernel="mla",
                    inputs=[spec(n, layouts.inputs[n].layout) for n in stage.inputs],
                    outputs=[spec(n, layouts.outputs[n].layout) for n in stage.outputs],
                    params={
                        "coverage_segment": (stage.segment or stage.name).split(".")[0],
                        "memory_plan": segment.plan.to_dict(),
                        "static_cycles": segment.static.total_cycles,
                        "stall_aware_cycles": segment.stall_aware.total_cycles,
                        "layers": len(segment.program.metadata.layers),
                    },
                    segment=segment,
                )
            )
            after = [layouts.outputs[n] for n in stage.outputs if layouts.outputs[n].reorder]
            if after:
                stages.append(_reorder_stage("detessellate", after, spec))
        elif stage.kernel in ("quantize", "dequantize"):
            tensors = []
            inputs = []
            outputs = []
            for step in stage.steps:
                if not isinstance(step, QuantizeStep | DequantizeStep):
                    raise CompileError(f"{stage.name} mixes a {step.kind} step into {stage.kernel}")
                layout = (
                    layouts.pipeline_inputs.get(step.input, "NCHW")
                    if isinstance(step, QuantizeStep)
                    else direct_out.get(step.input, "NCHW")
                )
                params = step.params
                tensors.append(
                    {
                        "input": step.input,
                        "output": step.output,
                        "scale": [float(s) for s in np.ravel(params.scale)],
                        "zero_point": [int(z) for z in np.ravel(params.zero_point)],
                        "axis": params.axis,
                        "dtype": np.dtype(params.dtype).name,
                    }
                )
                inputs.append(spec(step.input, layout))
                outputs.append(spec(step.output, layout))
            stages.append(
                PipelineStage(
                    stage.name, "CVU", stage.kernel, inputs, outputs, {"tensors": tensors}
                )
            )
        else:
            stages.append(
                PipelineStage(
                    name=stage.name,
                    processor=stage.processor,
                    kernel="onnx",
                    inputs=[spec(n) for n in stage.inputs],
                    outputs=[spec(n) for n in stage.outputs],
                    params={"nodes": len(stage.steps)},
                    graph=stage_graph(partition, stage, types),
                )
            )
    for sequence, plugin in enumerate(stages):
        if plugin.processor != "MLA":
            plugin.name = f"{plugin.kernel}_{sequence}"
        plugin.params = {
            "desired_batch_size": batch.desired,
            "actual_batch_size": batch.actual,
            "number_of_quads_to_user": quads if plugin.processor == "MLA" else 0,
            "kernel": plugin.kernel,
            "params": plugin.params,
        }
    return stages


def _index_ranges(model: onnx.ModelProto) -> dict[str, tuple[int, int]]:
    """Integer inputs that index a Gather table: their valid [low, high) (the rule `surgery
    verify` draws random inputs by), so `surgery run` without inputs feeds valid token ids."""
    return {
        spec.name: (int(spec.low), int(spec.high))
        for spec in input_specs(model)
        if spec.dtype.kind in "iu" and spec.range_source
    }


def _chosen(layouts: LayoutPlan) -> dict[str, TensorTessellateParameters]:
    """The parameters "default" resolved to, keyed by pipeline input / output name."""
    chosen = {}
    for name, layout in (*layouts.pipeline_inputs.items(), *layouts.pipeline_outputs.items()):
        if layout != "NCHW":
            chosen[name] = TensorTessellateParameters(dram_layout=TensorDRAMLayout(layout))
    return chosen


def _reorder_stage(kernel: str, formats, spec) -> PipelineStage:
    tensors = [
        {"tensor": f.tensor, "layout": f.layout, "tile_shape": list(f.tile_shape)} for f in formats
    ]
    if kernel == "tessellate":
        inputs = [spec(f.tensor) for f in formats]
        outputs = [spec(f.tensor, f.layout) for f in formats]
    else:
        inputs = [spec(f.tensor, f.layout) for f in formats]
        outputs = [spec(f.tensor) for f in formats]
    return PipelineStage(kernel, "CVU", kernel, inputs, outputs, {"tensors": tensors})


def segment_live_tensors(
    qdq_model: onnx.ModelProto, target: str | Target = "mlsoc", order: ComputeOrder = "WidthFirst"
) -> dict[str, list[LiveTensor]]:
    """Per MLA segment, the tensors the memory planner places (batch 1): for benchmarks."""
    partition = partition_model(qdq_model, target)
    types = tensor_types(partition)
    return {
        stage.name: prepare_segment(stage, partition, types, order).live
        for stage in partition.mla_stages
    }
