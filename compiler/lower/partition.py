"""Partition a QDQ model's integer program into MLA segments and CVU / APU stages.

Placement is decided once, by `surgery.coverage` (the same table and segmentation as
`surgery check`), never re-derived here. Coverage on the QDQ graph itself would be wrong: every
QuantizeLinear / DequantizeLinear between two MLA ops is a CVU node, so each op would become its
own segment. We therefore run coverage on the model's *float view*: the QDQ graph with every
activation QuantizeLinear -> DequantizeLinear pair removed (the consumers read the float tensor
again) and the weight DequantizeLinear nodes kept (coverage folds them as constants). The float
view has the node names, topology and shapes of the float model the quantizer started from, and
keeps the placement pins the quantizer wrote into the metadata, so its segments are exactly what
`surgery check` reports for that float model.

Every step of the integer program (`compiler.runtime.lowering.build_program`) is then assigned:

* an integer step whose anchor node coverage puts on the MLA -> that node's segment;
* a requantization (DequantizeLinear -> QuantizeLinear, no anchor in the float view) -> the
  segment of the step producing its input, else of a step reading its output, else the CVU;
* QuantizeLinear / DequantizeLinear steps -> CVU `quantize` / `dequantize` kernels;
* float steps and integer steps off the MLA -> a CVU or APU `onnx` stage, per coverage;
* steps that read only constants -> evaluated now (constant folding), they vanish.

Units (one per MLA segment, one per other step) are ordered topologically, preferring to stay
on the same processor; neighbouring non-MLA units with the same kernel merge into one stage.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import onnx
from onnx import helper, numpy_helper

from compiler.intmath import REQUANTIZATION_MODES, RequantizationMode
from compiler.lower.errors import CompileError
from compiler.runtime.errors import UnknownOpError
from compiler.runtime.lowering import QdqGraph, build_program
from compiler.runtime.program import (
    DequantizeStep,
    IntegerStep,
    QuantizeStep,
    Step,
)
from compiler.runtime.qparams import QuantParams
from surgery.check import check_model
from surgery.coverage import CoverageReport
from surgery.edit import node_reads
from surgery.errors import first_line
from surgery.model import infer_shapes_through_contrib_ops
from surgery.qdq import quantization_record
from surgery.targets import Target, resolve_target

Processor = Literal["MLA", "CVU", "APU"]


@dataclass(frozen=True)
class Stage:
    """A run of steps on one processor: one MLA segment, or one host kernel invocation.

    `inputs` are the run-time tensors the stage reads from other stages (or the pipeline
    inputs); `outputs` the ones it hands on. `segment` names the coverage segment of an MLA stage.
    """

    name: str
    processor: Processor
    kernel: str
    steps: tuple[Step, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    segment: str | None = None


@dataclass
class Partition:
    """The integer program of a QDQ model cut into stages, with what the cut was based on."""

    model: onnx.ModelProto
    graph: QdqGraph
    mode: RequantizationMode
    coverage: CoverageReport
    stages: list[Stage]
    tensor_params: dict[str, QuantParams]
    constants: dict[str, np.ndarray]
    input_names: list[str]
    output_names: list[str]
    folded: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def mla_stages(self) -> list[Stage]:
        return [s for s in self.stages if s.processor == "MLA"]


def requantization_mode_of(model: onnx.ModelProto) -> RequantizationMode:
    """The mode the quantizer recorded in the model metadata ("sima" when absent)."""
    mode = quantization_record(model).get("requantization_mode", "sima")
    return mode if mode in REQUANTIZATION_MODES else "sima"


def with_unique_names(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy whose nodes all have distinct, non-empty names (steps are keyed by node name)."""
    named = copy.deepcopy(model)
    seen: set[str] = set()
    for index, node in enumerate(named.graph.node):
        name = node.name or f"{node.op_type}_{index}"
        while name in seen:
            name = f"{name}_{index}"
        node.name = name
        seen.add(name)
    return named


def _infer_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """Surgery's shape inference, which carries shapes through the contrib ops the MLA runs
    (without them coverage would see unknown ranks and move those ops, and everything after
    them, off the MLA); the model as is when inference fails."""
    try:
        return infer_shapes_through_contrib_ops(model)
    except Exception:  # noqa: BLE001 - shapes are a convenience here; execution fills gaps
        return model


_TYPE_KINDS = {
    "sequence_type": "a sequence",
    "map_type": "a map",
    "optional_type": "an optional",
    "sparse_tensor_type": "a sparse tensor",
}


def check_tensor_io(model: onnx.ModelProto, label: str | None = None) -> None:
    """Every graph input and output must be a (dense) tensor: the pipeline's buffers are
    tensors, and a sequence, map or optional has no shape, dtype or DRAM layout."""
    where = f" of {label}" if label else ""
    constants = {t.name for t in model.graph.initializer}
    for role, infos in (("input", model.graph.input), ("output", model.graph.output)):
        for info in infos:
            if info.name in constants:
                continue
            kind = _TYPE_KINDS.get(info.type.WhichOneof("value") or "")
            if kind is not None:
                takes = "takes" if role == "input" else "hands out"
                raise CompileError(
                    f"{role} {info.name!r}{where} is {kind}, not a tensor; the pipeline "
                    f"{takes} tensors",
                    hint="cut the part that builds or reads it off the model (surgery split) "
                    "and run that part on the host",
                )


def partition_model(
    qdq_model: onnx.ModelProto,
    target: str | Target = "mlsoc",
    *,
    requantization_mode: RequantizationMode | None = None,
) -> Partition:
    """Lower the QDQ model to an integer program and cut it into stages (module docstring)."""
    check_tensor_io(qdq_model)
    model = _infer_shapes(with_unique_names(qdq_model))
    mode = requantization_mode or requantization_mode_of(model)
    graph = QdqGraph(model)
    try:
        program = build_program(graph, mode)
    except UnknownOpError as error:  # a compile of the model fails on it: say so in its terms
        raise CompileError(error.message, hint=error.hint) from None
    # check's own analysis (float view, shapes folded as check folds them), so the segments
    # compiled are the ones `surgery check` reports.
    coverage = check_model(model, target, suggest=False)
    constants = dict(graph.constants)
    steps, folded = _fold_constant_steps(program.steps, constants, set(graph.output_names))
    notes: list[str] = []
    assignment = _assign(steps, coverage, resolve_target(target), notes)
    _note_float_islands(steps, assignment, coverage, notes)
    units = _order_units(steps, assignment, constants)
    stages = _make_stages(units, steps, assignment, constants, graph.output_names)
    _check_stage_order(stages, graph.input_names)
    return Partition(
        model=model,
        graph=graph,
        mode=mode,
        coverage=coverage,
        stages=stages,
        tensor_params=dict(program.tensor_params),
        constants=constants,
        input_names=list(graph.input_names),
        output_names=list(graph.output_names),
        folded=folded,
        notes=notes,
    )


def _check_stage_order(stages: list[Stage], input_names: list[str]) -> None:
    """Every stage reads only pipeline inputs and what earlier stages wrote: an archive that
    breaks this would fail at run time with a missing tensor, so compiling it is refused."""
    available = set(input_names)
    for stage in stages:
        missing = [t for t in stage.inputs if t not in available]
        if missing:
            raise CompileError(
                f"stage {stage.name} reads {missing[0]!r} before any stage writes it "
                "(a partition bug: the stages are out of dependency order)",
                hint="report it with the model; `surgery check` lists the segments it expects",
            )
        available.update(stage.outputs)


def _fold_constant_steps(
    steps: tuple[Step, ...], constants: dict[str, np.ndarray], outputs: set[str]
) -> tuple[list[Step], list[str]]:
    """Run steps whose inputs are all constants now; their outputs join the constants.

    Steps producing a pipeline output stay, so every output has a stage that writes it.
    """
    kept: list[Step] = []
    folded: list[str] = []
    for step in steps:
        inputs = _step_inputs(step)
        constant = inputs and all(name in constants for name in inputs)
        if constant and not set(_step_outputs(step)) & outputs:
            values = {name: constants[name] for name in inputs}
            step.run(values)
            for name in _step_outputs(step):
                constants[name] = np.asarray(values[name])
            folded.append(step.name)
        else:
            kept.append(step)
    return kept, folded


def _step_inputs(step: Step) -> tuple[str, ...]:
    if isinstance(step, QuantizeStep | DequantizeStep):
        return (step.input,)
    return tuple(name for name in step.inputs if name)


def _step_outputs(step: Step) -> tuple[str, ...]:
    if isinstance(step, QuantizeStep | DequantizeStep):
        return (step.output,)
    return tuple(name for name in step.outputs if name)


@dataclass(frozen=True)
class _Unit:
    """Where one step goes: (processor, kernel, segment name or None)."""

    processor: Processor
    kernel: str
    segment: str | None = None


def _assign(
    steps: list[Step], coverage: CoverageReport, target: Target, notes: list[str]
) -> list[_Unit]:
    placement = {p.name: p for p in coverage.placements}
    segment_of = {node: seg.name for seg in coverage.segments for node in seg.nodes}
    producer: dict[str, int] = {}
    for index, step in enumerate(steps):
        for name in _step_outputs(step):
            producer[name] = index
    readers: dict[str, list[int]] = {}
    for index, step in enumerate(steps):
        for name in _step_inputs(step):
            readers.setdefault(name, []).append(index)
    units: list[_Unit | None] = [None] * len(steps)
    deferred: list[int] = []
    for index, step in enumerate(steps):
        if isinstance(step, QuantizeStep):
            units[index] = _Unit("CVU", "quantize")
        elif isinstance(step, DequantizeStep):
            units[index] = _Unit("CVU", "dequantize")
        elif isinstance(step, IntegerStep):
            if step.name in segment_of:
                units[index] = _Unit("MLA", "mla", segment_of[step.name])
            elif step.pattern == "Requantize":
                deferred.append(index)
            else:
                units[index] = _Unit("CVU", "onnx")
        else:
            where = placement.get(step.name)
            processor = where.processor if where is not None else "APU"
            if processor == "MLA":
                notes.append(
                    f"{step.name} ({step.pattern}) is on the MLA by the target's op table but the "
                    f"QDQ model gives it no MLA form, integer or fp16 ({step.reason}); it runs on the "
                    f"{_host_for(step.pattern, target)}"
                )
                processor = _host_for(step.pattern, target)
            units[index] = _Unit(processor, "onnx")
    for index in deferred:
        step = steps[index]
        source = producer.get(step.inputs[0])
        unit = units[source] if source is not None else None
        if unit is None or unit.processor != "MLA":
            candidates = [units[r] for name in step.outputs for r in readers.get(name, [])]
            unit = next((u for u in candidates if u is not None and u.processor == "MLA"), None)
        units[index] = unit or _Unit("CVU", "onnx")
    return _split_segments(steps, [u for u in units if u is not None], producer, notes)


def _note_float_islands(
    steps: list[Step], assignment: list[_Unit], coverage: CoverageReport, notes: list[str]
) -> None:
    """Say once, in check's terms, when ops the QDQ model leaves in float (no Q/DQ of their
    own, e.g. BatchNormalization from ONNX Runtime's quantizer without pre-processing) split
    the MLA part into more programs than `surgery check` counts on the float model."""
    placement = {p.name: p.processor for p in coverage.placements}
    moved = [
        step.name
        for step, unit in zip(steps, assignment, strict=True)
        if unit.processor != "MLA"
        and placement.get(step.name) == "MLA"
        and not isinstance(step, QuantizeStep | DequantizeStep)
    ]
    programs = len({u.segment for u in assignment if u.segment is not None})
    if moved and programs > coverage.mla_segments:
        notes.insert(
            0,
            f"{len(moved)} op(s) the target runs on the MLA stay float in this QDQ model (no "
            f"Q/DQ of their own: {', '.join(moved[:4])}{' …' if len(moved) > 4 else ''}); they "
            f"run on the host and split the MLA part into {programs} programs, where `surgery "
            f"check` counts {coverage.mla_segments} for the float model; quantize the float "
            "model again (`surgery fix MODEL` gives it, then `surgery quantize`) to get those",
        )


def _host_for(op_type: str, target: Target) -> Processor:
    return "CVU" if target.supports(op_type, "CVU") else "APU"


def _split_segments(
    steps: list[Step], units: list[_Unit], producer: Mapping[str, int], notes: list[str]
) -> list[_Unit]:
    """Cut a segment where a path leaves it and comes back (only after a step moved off it).

    For segment S, every step gets a level: steps of S inherit the highest level of their S
    producers and of host steps on a path from S, and a host step reached from level k of S
    carries k + 1. Each level of S is convex (a path that leaves S raises the level), so each
    becomes its own segment. Without moved steps every segment has one level.
    """
    for segment in dict.fromkeys(u.segment for u in units if u.segment is not None):
        level: dict[int, int] = {}
        for index, step in enumerate(steps):
            inside = units[index].segment == segment
            value = 0 if inside else -1
            for name in _step_inputs(step):
                source = producer.get(name)
                if source is None or level.get(source, -1) < 0:
                    continue
                carried = level[source]
                if units[source].segment == segment and not inside:
                    carried += 1
                value = max(value, carried)
            level[index] = value
        levels = sorted({level[i] for i, u in enumerate(units) if u.segment == segment})
        if len(levels) > 1:
            notes.append(f"{segment} is split into {len(levels)} MLA programs around host steps")
            rank = {value: k for k, value in enumerate(levels)}
            for index, unit in enumerate(units):
                if unit.segment == segment and rank[level[index]]:
                    units[index] = _Unit("MLA", "mla", f"{segment}.{rank[level[index]]}")
    return units


def _order_units(
    steps: list[Step], assignment: list[_Unit], constants: Mapping[str, np.ndarray]
) -> list[list[int]]:
    """Group steps into units and sort the units topologically, staying on one processor."""
    keys: list[str] = []
    members: dict[str, list[int]] = {}
    for index, unit in enumerate(assignment):
        key = unit.segment if unit.segment is not None else f"step{index}"
        if key not in members:
            members[key] = []
            keys.append(key)
        members[key].append(index)
    unit_of = {i: key for key, indices in members.items() for i in indices}
    producer = {name: unit_of[i] for i, s in enumerate(steps) for name in _step_outputs(s)}
    needs: dict[str, set[str]] = {key: set() for key in keys}
    for index, step in enumerate(steps):
        for name in _step_inputs(step):
            source = producer.get(name)
            if source is not None and source != unit_of[index] and name not in constants:
                needs[unit_of[index]].add(source)
    dependents: dict[str, list[str]] = {key: [] for key in keys}
    for key, sources in needs.items():
        for source in sources:
            dependents[source].append(key)
    first = {key: min(indices) for key, indices in members.items()}
    waiting = {key: len(sources) for key, sources in needs.items()}
    ready = [key for key in keys if waiting[key] == 0]
    order: list[list[int]] = []
    last: tuple[str, str] | None = None
    while ready:
        same = [k for k in ready if _kind(assignment, members[k]) == last]
        key = min(same or ready, key=lambda k: first[k])
        ready.remove(key)
        order.append(members[key])
        last = _kind(assignment, members[key])
        for dependent in dependents[key]:
            waiting[dependent] -= 1
            if waiting[dependent] == 0:
                ready.append(dependent)
    if len(order) != len(keys):
        raise CompileError(
            "the MLA segments and host stages depend on each other in a cycle",
            hint="this is a partitioner bug: coverage segments are convex by construction",
        )
    return order


def _kind(assignment: list[_Unit], indices: list[int]) -> tuple[str, str]:
    unit = assignment[indices[0]]
    return unit.processor, unit.kernel


def _make_stages(
    units: list[list[int]],
    steps: list[Step],
    assignment: list[_Unit],
    constants: Mapping[str, np.ndarray],
    graph_outputs: list[str],
) -> list[Stage]:
    groups: list[list[int]] = []
    for indices in units:
        unit = assignment[indices[0]]
        previous = assignment[groups[-1][0]] if groups else None
        if (
            previous is not None
            and unit.processor != "MLA"
            and (previous.processor, previous.kernel) == (unit.processor, unit.kernel)
        ):
            groups[-1].extend(indices)
        else:
            groups.append(list(indices))
    read_by: dict[str, set[int]] = {}
    for group_index, indices in enumerate(groups):
        for i in indices:
            for name in _step_inputs(steps[i]):
                read_by.setdefault(name, set()).add(group_index)
    outputs_wanted = set(graph_outputs)
    stages: list[Stage] = []
    for group_index, indices in enumerate(groups):
        unit = assignment[indices[0]]
        members = tuple(steps[i] for i in sorted(indices))
        produced = [name for step in members for name in _step_outputs(step)]
        produced_set = set(produced)
        inputs = tuple(
            dict.fromkeys(
                name
                for step in members
                for name in _step_inputs(step)
                if name not in produced_set and name not in constants
            )
        )
        outputs = tuple(
            name
            for name in dict.fromkeys(produced)
            if name in outputs_wanted or (read_by.get(name, set()) - {group_index})
        )
        if unit.processor == "MLA":
            name = f"MLA_{sum(1 for stage in stages if stage.processor == 'MLA')}"
        else:
            name = f"{unit.kernel}_{group_index}"
        stages.append(
            Stage(name, unit.processor, unit.kernel, members, inputs, outputs, unit.segment)
        )
    return stages


@dataclass(frozen=True)
class TensorType:
    """Per-frame shape and element type of a tensor of the QDQ model."""

    shape: tuple[int, ...]
    dtype: np.dtype


def tensor_types(partition: Partition) -> dict[str, TensorType]:
    """Shapes and types of every tensor: shape inference first, one execution for the rest.

    Shape inference usually knows every tensor of a static-shaped model; when it does not, the
    integer program runs once on zero inputs and the tensors it produced give the answer.
    """
    graph = partition.model.graph
    found: dict[str, TensorType] = {}
    for info in (*graph.input, *graph.value_info, *graph.output):
        tensor_type = info.type.tensor_type
        if not info.type.HasField("tensor_type") or not tensor_type.elem_type:
            continue
        dims = tensor_type.shape.dim
        if not tensor_type.HasField("shape") or any(not d.HasField("dim_value") for d in dims):
            continue
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tensor_type.elem_type))
        found[info.name] = TensorType(tuple(int(d.dim_value) for d in dims), dtype)
    for name, value in partition.constants.items():
        found.setdefault(name, TensorType(tuple(np.shape(value)), np.asarray(value).dtype))
    needed = {n for stage in partition.stages for n in (*stage.inputs, *stage.outputs)}
    needed |= {
        n
        for stage in partition.mla_stages
        for step in stage.steps
        for n in (*_step_inputs(step), *_step_outputs(step))
    }
    for name, params in partition.tensor_params.items():
        if name in found:
            found[name] = TensorType(found[name].shape, np.dtype(params.dtype))
    if needed - set(found):
        found.update(_executed_types(partition, sorted(needed - set(found))))
    missing = sorted(needed - set(found))
    if missing:
        raise CompileError(f"cannot tell the shape of {', '.join(missing[:5])}")
    return found


def _executed_types(partition: Partition, unknown: list[str]) -> dict[str, TensorType]:
    """Types of the `unknown` tensors (shape inference left them open, e.g. behind an If), from
    one run of the reference executor on zero inputs."""
    from compiler.runtime.reference import IntegerExecutor

    executor = IntegerExecutor(partition.model, partition.mode, keep_intermediates=True)
    inputs = {}
    for info in partition.model.graph.input:
        if info.name not in partition.input_names:
            continue
        tensor_type = info.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else 1 for d in tensor_type.shape.dim]
        dtype = helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)
        inputs[info.name] = np.zeros(dims, dtype=dtype)
    try:
        executor.run(inputs)
    except Exception as error:  # noqa: BLE001 - any op may reject placeholder zeros
        reason = first_line(error, 200)
        raise CompileError(
            f"cannot tell the shape of {', '.join(unknown[:5])}: shape inference leaves "
            f"{'it' if len(unknown) == 1 else 'them'} unknown, and running the model on zero "
            f"inputs to measure {'it' if len(unknown) == 1 else 'them'} failed ({reason})",
            hint="quantize at static input shapes (surgery quantize --input-shape NAME=DIMS) or cut "
            "the part that computes them off the model (surgery split)",
        ) from None
    return {
        name: TensorType(tuple(np.shape(value)), np.asarray(value).dtype)
        for name, value in executor.intermediates.items()
    }


def stage_graph(
    partition: Partition, stage: Stage, types: Mapping[str, TensorType]
) -> onnx.ModelProto:
    """A host stage as a standalone ONNX model: the nodes between its inputs and outputs.

    Walks back from the stage's outputs through the (named) QDQ graph, stopping at the stage's
    inputs and at constants, so the subgraph holds the stage's own nodes, the DequantizeLinear /
    QuantizeLinear around integer steps, and the constants they read. A control-flow node's
    bodies read tensors of this graph by name: their producers are walked to as well.
    """
    model = partition.model
    producer = {out: node for node in model.graph.node for out in node.output if out}
    stop = set(stage.inputs)
    chosen: set[int] = set()
    constants: set[str] = set()
    stack = list(stage.outputs)
    seen: set[str] = set()
    while stack:
        name = stack.pop()
        if name in seen or name in stop:
            continue
        seen.add(name)
        if name in partition.constants:
            constants.add(name)
            continue
        node = producer.get(name)
        if node is None:
            raise CompileError(f"stage {stage.name} needs {name!r}, which nothing produces")
        if id(node) not in chosen:
            chosen.add(id(node))
            stack.extend(node_reads(node))  # with what If/Loop/Scan bodies read outside
    nodes = [copy.deepcopy(n) for n in model.graph.node if id(n) in chosen]

    def value_info(name: str) -> onnx.ValueInfoProto:
        info = types[name]
        elem = helper.np_dtype_to_tensor_dtype(info.dtype)
        return helper.make_tensor_value_info(name, elem, list(info.shape))

    graph = helper.make_graph(
        nodes,
        f"{stage.name}",
        [value_info(n) for n in stage.inputs],
        [value_info(n) for n in stage.outputs],
        [numpy_helper.from_array(np.asarray(partition.constants[n]), n) for n in sorted(constants)],
    )
    sub = helper.make_model(graph, opset_imports=list(model.opset_import))
    sub.ir_version = model.ir_version
    sub.functions.extend(model.functions)
    return sub
