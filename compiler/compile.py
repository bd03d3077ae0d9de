"""`compile_model`: a QDQ model -> `<name>_mpk.tar.gz` (what `Model.compile` calls).

The lowering itself is `compiler.lower.pipeline`; this module resolves the inputs (a path or a
ModelProto), names the model, writes the archive and reports what was produced in numbers:
.elf files, per-segment peak arena vs its lower bound, cycles, the batch actually compiled.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx

from compiler.archive import ARCHIVE_SUFFIX, model_checksum, write_archive
from compiler.costmodel import MlaHardware
from compiler.lower.errors import CompileError
from compiler.lower.memory import Strategy
from compiler.lower.partition import check_tensor_io
from compiler.lower.pipeline import CompiledModel, CompileOptions, compile_pipeline
from compiler.lower.schedule import ComputeOrder
from compiler.lower.tessellate import TensorTessellateParameters
from surgery.check import DEFAULT_TARGET, check_model
from surgery.model import open_model, read_model, validate_graph
from surgery.qdq import quantized_for
from surgery.qdq_check import raise_malformed_qdq
from surgery.qoperator import qdq_form
from surgery.schema_check import raise_malformed
from surgery.targets import Target, available_targets, resolve_target


@dataclass
class CompileResult:
    """What a compile produced (all numbers computed from the programs, none assumed)."""

    archive: Path
    name: str
    target: str
    elf_files: list[str]
    mla_segments: int
    segments: list[dict[str, Any]]
    stages: list[dict[str, Any]]
    desired_batch_size: int
    actual_batch_size: int
    quads: int
    compile_seconds: float
    notes: list[str] = field(default_factory=list)
    default_mla: bool = False
    """The target's profile gives no MLA geometry (rk3588 lists its NPU's cores and TOPS): the
    program is laid out and timed for the default virtual MLA (docs/mla-isa.md)."""
    compiled: CompiledModel | None = field(default=None, repr=False)

    @property
    def total_cycles(self) -> int:
        return sum(s["cycles"] for s in self.segments)

    def to_dict(self) -> dict[str, Any]:
        return {
            "archive": str(self.archive),
            "name": self.name,
            "target": self.target,
            "elf_files": self.elf_files,
            "elf_count": len(self.elf_files),
            "mla_segments": self.mla_segments,
            "segments": self.segments,
            "stages": self.stages,
            "desired_batch_size": self.desired_batch_size,
            "actual_batch_size": self.actual_batch_size,
            "number_of_quads_to_user": self.quads,
            "default_mla": self.default_mla,
            "total_cycles": self.total_cycles,
            "compile_seconds": round(self.compile_seconds, 3),
            "notes": self.notes,
        }


_ARCHIVE_FILE_ENDINGS = (".tar.gz", ".tgz", ".tar")  # ARCHIVE_SUFFIX ends in .tar.gz
"""Output names that mean an archive file, not the directory compile writes the archive into
(`-o out.tar.gz` once made a directory of that name)."""


def compile_model(
    qdq_model: onnx.ModelProto | str | os.PathLike,
    output_path: str | os.PathLike,
    *,
    target: str | Target | None = None,
    batch_size: int = 1,
    compress: bool = True,
    tessellate_parameters: Mapping[str, TensorTessellateParameters] | None = None,
    memory_plan_strategy: Strategy = "BestFit",
    compute_order: ComputeOrder = "WidthFirst",
    single_core_mode: bool = False,
    custom_string: str | None = None,
    model_name: str | None = None,
    arena_bytes: int | None = None,
    source_path: str | os.PathLike | None = None,
) -> CompileResult:
    """Compile a quantized (QDQ) model into `<output_path>/<name>_mpk.tar.gz`.

    `batch_size` is the batch wanted; the largest batch up to it whose activations fit the
    arena is compiled (`actual_batch_size`). `tessellate_parameters` maps pipeline inputs /
    outputs to `TensorTessellateParameters` (None: CVU tessellate / detessellate stages).
    `single_core_mode` uses one quad (a quarter of the arena and MAC arrays).
    `custom_string` is stored in the archive and every ELF. `model_name` defaults to the file
    name (without `.onnx`) or the graph name; `arena_bytes` overrides the arena size. `target`
    defaults to the one the model was quantized for (its quantization record), else mlsoc.
    `source_path`: where a ModelProto given is saved (`Model.save`), recorded in the archive
    for `run --compare-reference` as a path is (the archive's checksum tells if it changed).
    """
    started = time.perf_counter()
    if isinstance(qdq_model, onnx.ModelProto):
        model = qdq_model
        data = model.SerializeToString(deterministic=True)
        model_path = (
            str(Path(source_path).resolve()) if source_path else model.graph.name or "model"
        )
        default_name = model.graph.name or "model"
    else:
        path = Path(qdq_model)
        model = read_model(path)
        # Structural errors name the file, not the graph (check would say "g: ...").
        validate_graph(model, str(path))
        data = path.read_bytes()
        model_path = str(path.resolve())  # run --compare-reference finds it from any folder
        default_name = path.name.removesuffix(".onnx")
    raise_malformed(model)  # lowering reads every attribute and decodes every weight
    model, converted = qdq_form(model)  # a QOperator model compiles with its own scales
    check_tensor_io(model, model_path)
    profile, notes = _resolve_target(model, target)
    notes = [*converted, *notes]
    notes += _check_quantized(model, model_path, profile)
    # Shapes for the Q/DQ check; a ModelProto's structure is validated here too.
    raise_malformed_qdq(open_model(model)[1], model_path)
    name = _safe_name(model_name or default_name)
    options = CompileOptions(
        target=profile,
        batch_size=batch_size,
        compress=compress,
        tessellate_parameters=tessellate_parameters,
        memory_plan_strategy=memory_plan_strategy,
        compute_order=compute_order,
        single_core_mode=single_core_mode,
        custom_string=custom_string or "",
        arena_bytes=arena_bytes,
    )
    output_dir = Path(output_path)
    if output_dir.exists() and not output_dir.is_dir():
        raise CompileError(
            f"{output_dir} is a file; the output is the directory to write the archive into"
        )
    if output_dir.name.endswith(_ARCHIVE_FILE_ENDINGS):  # before compiling: fail fast
        raise CompileError(
            f"{output_dir}: the output is the directory to write the archive into, not its "
            f"file name; the archive is named {name}{ARCHIVE_SUFFIX} "
            f"(e.g. --output {output_dir.parent}; --name sets the name)"
        )
    compiled = compile_pipeline(model, name, options)
    archive = write_archive(
        compiled, output_dir, model_path=model_path, checksum=model_checksum(data)
    )
    elf_files = [
        f"{name}_stage{k}_mla.elf" for k, s in enumerate(compiled.stages) if s.processor == "MLA"
    ]
    return CompileResult(
        archive=archive,
        name=name,
        target=compiled.target,
        elf_files=elf_files,
        mla_segments=compiled.partition.coverage.mla_segments,
        segments=[segment.summary() for segment in compiled.segments],
        stages=[
            {"name": s.name, "processor": s.processor, "kernel": s.kernel} for s in compiled.stages
        ],
        desired_batch_size=compiled.batch.desired,
        actual_batch_size=compiled.batch.actual,
        quads=compiled.quads,
        compile_seconds=time.perf_counter() - started,
        notes=[*notes, *compiled.notes],
        default_mla=not MlaHardware.constants_in(profile.profile.hardware),
        compiled=compiled,
    )


def _resolve_target(
    model: onnx.ModelProto, target: str | Target | None
) -> tuple[Target, list[str]]:
    """The target to compile for and a note when it is not the one the model was quantized
    for: the quantizer chose each node's precision (int8, fp16 norms, bf16) for that target.
    Targets compare by profile name (`-t mychip.yaml` is the `mychip` the record names)."""
    recorded = quantized_for(model)
    if target is None:
        if recorded is not None and recorded not in available_targets():
            raise CompileError(
                f"the model was quantized for target {recorded!r}, a profile read from a file "
                f"(the built-in targets are {', '.join(available_targets())})",
                hint="pass the same profile: --target PATH.yaml (compile_model(target=...))",
            )
        return resolve_target(recorded or DEFAULT_TARGET), []
    profile = resolve_target(target)
    if recorded is not None and recorded != profile.name:
        return profile, [
            f"the model was quantized for {recorded}, compiled for {profile.name}: nodes whose "
            f"precision {profile.name} does not run on its MLA run on the host"
        ]
    return profile, []


def _check_quantized(model: onnx.ModelProto, label: str, target: Target) -> list[str]:
    """A float model with work for the MLA, or one with dynamic inputs, cannot be compiled; say
    so before lowering. A float model of which no node runs on the MLA (the quantizer leaves
    such a model float) compiles to host stages only, as `surgery check` counts 0 `.elf`s;
    the returned note says so."""
    notes = []
    if not any(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in model.graph.node):
        segments = check_model(model, target, suggest=False).mla_segments
        if segments:
            raise CompileError(
                f"{label} is not a quantized (QDQ) model: it has no QuantizeLinear/"
                f"DequantizeLinear, and {segments} MLA segment(s) need quantized data",
                hint="quantize it first: surgery quantize MODEL --calib DATA (or load_model(...).quantize(...))",
            )
        notes.append(
            f"no node of {label} runs on the MLA of {target.name} (surgery check: 0 MLA "
            "segments); the archive runs every stage on the host"
        )
    constants = {i.name for i in model.graph.initializer}
    for graph_input in model.graph.input:
        if graph_input.name in constants or not graph_input.type.HasField("tensor_type"):
            continue
        dims = graph_input.type.tensor_type.shape.dim
        if any(not d.HasField("dim_value") or d.dim_value < 1 for d in dims):
            raise CompileError(
                f"input {graph_input.name!r} of {label} has a dynamic shape; the MLA needs "
                "static shapes",
                hint="quantize the float model again at one input size (surgery quantize --input-shape NAME=DIMS)",
            )
    return notes


def _safe_name(name: str) -> str:
    cleaned = re.sub(r"[^0-9A-Za-z_.-]+", "_", name).strip("._") or "model"
    return cleaned
