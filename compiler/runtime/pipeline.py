"""Run a compiled archive: the pipeline of `_mpk.json`, stage by stage, on real inputs.

* CVU (EV74) built-in kernels — quantize, dequantize, tessellate, detessellate — in numpy,
  with the arithmetic of `compiler.intmath` (ONNX QuantizeLinear / DequantizeLinear);
* CVU ONNX stages (float elementwise work, integer ops off the MLA) with the reference
  integer executor, which is the spec for integer ops and `onnx.reference` for float ones;
* MLA stages in the bit-exact emulator (`compiler.runtime.emulator`), from the ELF bytes;
* APU (A65) ONNX stages with ONNX Runtime.

Inputs are given as the ONNX model takes them (NCHW float); N frames may be stacked along
axis 0. The runner plays the application's part at the edges: it hands the pipeline its inputs
in the declared layout (HWC when the MLA reads them directly) and turns declared-layout
outputs (HWC16) back into NCHW. Host stages run frame by frame; an MLA stage runs once per
batch of `actual_batch_size` frames (the last batch is filled up with copies of its last frame).

ONNX stages are loaded (an `IntegerExecutor`, an ONNX Runtime session) once per process for
each distinct stage file, as a runtime loads a model once and runs it on every frame.

Statistics per stage: MLA stages report the static cycles of the program and the DRAM-stall-
aware estimate (`compiler.costmodel`); built-in CVU kernels an estimate from `CvuModel`;
ONNX stages their measured wall time.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from compiler import native
from compiler.archive import Archive, read_archive
from compiler.costmodel import MlaHardware
from compiler.intmath import dequantize_linear, quantize_linear_fast
from compiler.lower.errors import ArchiveError
from compiler.lower.tessellate import detessellate, physical_shape, tessellate, tile_count
from compiler.runtime.cache import LruCache
from compiler.runtime.emulator import Emulator
from compiler.runtime.errors import ExecutionError
from compiler.runtime.host_session import host_session
from compiler.runtime.reference import IntegerExecutor
from surgery.errors import first_line
from surgery.targets import Target, available_targets, resolve_target

Buffers = dict[tuple[str, str], np.ndarray]


@dataclass(frozen=True)
class CvuModel:
    """Throughput of the EV74 kernels (estimates; docs/archive-format.md, "Statistics").

    Quantize / dequantize stream `lanes` elements per cycle; a reorder moves
    `reorder_bytes_per_cycle` bytes per cycle plus `tile_setup_cycles` per tile; every kernel
    launch costs `launch_cycles`.
    """

    clock_mhz: float = 1000.0
    lanes: int = 32
    reorder_bytes_per_cycle: int = 16
    tile_setup_cycles: int = 64
    launch_cycles: int = 500

    def quantize_cycles(self, elements: int) -> int:
        return self.launch_cycles + -(-elements // self.lanes)

    def reorder_cycles(self, nbytes: int, tiles: int) -> int:
        return (
            self.launch_cycles
            + -(-nbytes // self.reorder_bytes_per_cycle)
            + tiles * self.tile_setup_cycles
        )


@dataclass
class StageStats:
    """One plugin: how often it ran and what it cost."""

    name: str
    processor: str
    kernel: str
    invocations: int = 0
    frames: int = 0
    static_cycles: int = 0
    stall_aware_cycles: int = 0
    wall_seconds: float = 0.0
    run_seconds: float = 0.0
    clock_mhz: float = 1000.0
    measured: bool = False

    @property
    def latency_us_per_frame(self) -> float:
        """Modelled (MLA, built-in CVU) or measured (ONNX stages) time per frame."""
        if not self.frames:
            return 0.0
        if self.measured:
            return self.run_seconds * 1e6 / self.frames
        return self.stall_aware_cycles / self.clock_mhz / self.frames

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "processor": self.processor,
            "kernel": self.kernel,
            "invocations": self.invocations,
            "frames": self.frames,
            "static_cycles": self.static_cycles,
            "stall_aware_cycles": self.stall_aware_cycles,
            "latency_us_per_frame": round(self.latency_us_per_frame, 3),
            "estimate": "measured run time" if self.measured else "cost model",
            "wall_seconds": round(self.wall_seconds, 6),
        }


@dataclass
class PipelineStats:
    """Per-stage statistics of one `run_archive` call (and, on request, every tensor)."""

    stages: list[StageStats]
    frames: int
    batch: int
    wall_seconds: float
    tensors: dict[str, np.ndarray] = field(default_factory=dict, repr=False)

    @property
    def mla_static_cycles(self) -> int:
        return sum(s.static_cycles for s in self.stages if s.processor == "MLA")

    @property
    def latency_us_per_frame(self) -> float:
        """The modelled device time per frame: MLA programs and built-in CVU kernels. ONNX
        host stages are left out: their time is measured on this machine, not on the device."""
        return sum(s.latency_us_per_frame for s in self.stages if not s.measured)

    @property
    def host_measured_us_per_frame(self) -> float:
        """The ONNX host stages' run time per frame on this machine (not a device estimate)."""
        return sum(s.latency_us_per_frame for s in self.stages if s.measured)

    def to_dict(self) -> dict[str, Any]:
        return {
            "frames": self.frames,
            "actual_batch_size": self.batch,
            "wall_seconds": round(self.wall_seconds, 6),
            "latency_us_per_frame": round(self.latency_us_per_frame, 3),
            "host_measured_us_per_frame": round(self.host_measured_us_per_frame, 3),
            "mla_static_cycles": self.mla_static_cycles,
            "emulator_kernels": native.describe(),
            "stages": [s.to_dict() for s in self.stages],
        }


def _archive_target(document: Mapping[str, Any]) -> Target:
    """The built-in target an archive names; one compiled for a profile file needs that file."""
    name = document.get("target")
    if isinstance(name, str) and name not in available_targets():
        raise ArchiveError(
            f"the archive was compiled for target {name!r}, a profile read from a file (the "
            f"built-in targets are {', '.join(available_targets())})",
            hint="pass the same profile: surgery run --target PATH.yaml "
            "(run_archive(hardware=MlaHardware.from_profile(...)))",
        )
    return resolve_target(name)


def run_archive(
    archive: str | Path | Archive,
    inputs: Mapping[str, np.ndarray],
    *,
    keep_tensors: bool = False,
    hardware: MlaHardware | None = None,
    cvu: CvuModel | None = None,
) -> tuple[dict[str, np.ndarray], PipelineStats]:
    """Run every stage of the archive's pipeline on `inputs`; outputs in NCHW, plus stats."""
    started = time.perf_counter()
    if not isinstance(archive, Archive):
        archive = read_archive(archive)
    document = archive.manifest
    if hardware is None:
        hardware = MlaHardware.from_profile(_archive_target(document).profile.hardware)
    cvu = cvu or CvuModel()
    batch = archive.actual_batch_size
    frames = _frames_of(document["input_nodes"], inputs)
    stats: list[StageStats] = []
    for plugin in archive.plugins:
        runner = _RUNNERS.get((plugin["processor"], plugin["config_params"]["kernel"]))
        if runner is None:
            raise ArchiveError(
                f"plugin {plugin['name']!r}: no runner for {plugin['processor']} "
                f"kernel {plugin['config_params']['kernel']!r}"
            )
        stage = StageStats(plugin["name"], plugin["processor"], plugin["config_params"]["kernel"])
        stage.clock_mhz = hardware.clock_mhz if plugin["processor"] == "MLA" else cvu.clock_mhz
        clock = time.perf_counter()
        runner(archive, plugin, frames, stage, batch=batch, hardware=hardware, cvu=cvu)
        stage.wall_seconds = time.perf_counter() - clock
        stats.append(stage)
    outputs = {}
    for node in document["output_nodes"]:
        key = (node["name"], node["layout"])
        parts = [_logical(frame[key], node) for frame in frames]
        outputs[node["name"]] = _stack_frames(parts)
    tensors: dict[str, np.ndarray] = {}
    if keep_tensors:
        shapes = _declared_shapes(archive)
        for name, layout in sorted({key for frame in frames for key in frame}):
            node = shapes.get(name)
            if node is None:
                continue
            parts = [
                _logical(frame[(name, layout)], {**node, "layout": layout}) for frame in frames
            ]
            tensors.setdefault(name, _stack_frames(parts))
    pipeline = PipelineStats(stats, len(frames), batch, time.perf_counter() - started, tensors)
    return outputs, pipeline


def _stack_frames(parts: list[np.ndarray]) -> np.ndarray:
    """Per-frame values of one tensor, frames stacked on axis 0. A 0-d tensor (a scalar a host
    stage computes, e.g. Swin-T's window-shift arithmetic) has no frame axis: the last frame's."""
    if len(parts) == 1 or np.ndim(parts[0]) == 0:
        return parts[-1]
    return np.concatenate(parts, axis=0)


# --- inputs and layouts -------------------------------------------------------------------------------


def run_notes(
    nodes: Sequence[Mapping[str, Any]],
    inputs: Mapping[str, np.ndarray],
    outputs: Mapping[str, np.ndarray],
) -> list[str]:
    """What a reader of a run's outputs should know: each input given in another dtype than
    the pipeline's (`run_archive` casts it, as `surgery verify` does and notes: integer pixels
    given to a float input run unscaled), and each output that holds one value only (bit-exact
    then says little: on inputs unlike the calibration data a detector's map is all zero)."""
    notes = []
    for node in nodes:
        given = inputs.get(node["name"])
        if given is None:
            continue
        have, want = np.asarray(given).dtype, np.dtype(node["dtype"])
        if have != want:
            notes.append(f"input {node['name']!r} cast from {have} to {want}")
    for name, value in outputs.items():
        if value.size > 1 and (value == value.flat[0]).all():
            notes.append(
                f"output {name!r} holds one value only ({value.flat[0]:g} everywhere): "
                "run it on inputs like the calibration data"
            )
    return notes


def _frames_of(
    nodes: Sequence[Mapping[str, Any]], inputs: Mapping[str, np.ndarray]
) -> list[Buffers]:
    """Split every input into frames, in the layout the pipeline declares for it."""
    missing = [n["name"] for n in nodes if n["name"] not in inputs]
    if missing:
        raise ExecutionError(
            f"missing input(s) {', '.join(map(repr, missing))}; "
            f"the pipeline needs {[n['name'] for n in nodes]}"
        )
    counts = set()
    split: dict[str, list[np.ndarray]] = {}
    for node in nodes:
        shape = tuple(node["shape"])
        array = np.asarray(inputs[node["name"]], dtype=node["dtype"])
        head = shape[0] if shape else 1
        if array.shape == shape:
            count = 1
        elif (
            shape
            and array.ndim == len(shape)
            and array.shape[1:] == shape[1:]
            and (array.shape[0] % head == 0)
        ):
            count = array.shape[0] // head
        else:
            raise ExecutionError(
                f"input {node['name']!r} has shape {array.shape}; expected {list(shape)} "
                "(or N frames stacked on axis 0)"
            )
        counts.add(count)
        split[node["name"]] = (
            [array[k * head : (k + 1) * head] for k in range(count)] if shape else [array]
        )
    if len(counts) > 1:
        raise ExecutionError(f"inputs hold different numbers of frames: {sorted(counts)}")
    count = counts.pop() if counts else 1
    frames: list[Buffers] = [{} for _ in range(count)]
    for node in nodes:
        for frame, array in zip(frames, split[node["name"]], strict=True):
            frame[(node["name"], node["layout"])] = tessellate(array, node["layout"])
    return frames


def _logical(buffer: np.ndarray, node: Mapping[str, Any]) -> np.ndarray:
    """The tensor of `buffer` in its logical shape. A host stage's NCHW output that holds
    another number of values than declared keeps the shape its stage computed: an output of
    an If (Optimum's merged decoder: `present.*` grows by the past length only on the cache
    branch) or of any op whose shape depends on values has no one shape to declare."""
    shape = tuple(int(s) for s in node["shape"])
    if node["layout"] == "NCHW" and np.asarray(buffer).size != int(np.prod(shape, dtype=np.int64)):
        return np.asarray(buffer)
    return detessellate(buffer, node["layout"], shape)


def _declared_shapes(archive: Archive) -> dict[str, dict[str, Any]]:
    shapes: dict[str, dict[str, Any]] = {}
    for plugin in archive.plugins:
        for node in (*plugin["input_nodes"], *plugin["output_nodes"]):
            shapes.setdefault(node["name"], dict(node))
    for node in (*archive.manifest["input_nodes"], *archive.manifest["output_nodes"]):
        shapes.setdefault(node["name"], dict(node))
    return shapes


# --- stage runners ------------------------------------------------------------------------------------


def _run_quantize(archive, plugin, frames: list[Buffers], stage: StageStats, *, cvu, **_) -> None:
    quantize = plugin["config_params"]["kernel"] == "quantize"
    layouts = {n["name"]: n["layout"] for n in plugin["input_nodes"]}
    out_layouts = {n["name"]: n["layout"] for n in plugin["output_nodes"]}
    cycles = 0
    for frame in frames:
        for entry in plugin["config_params"]["params"]["tensors"]:
            source = frame[(entry["input"], layouts[entry["input"]])]
            scale = np.asarray(entry["scale"], dtype=np.float32)
            zero_point = np.asarray(entry["zero_point"], dtype=np.int64)
            if scale.size > 1:
                axis = (entry["axis"] if entry["axis"] is not None else 1) % source.ndim
                shape = [1] * source.ndim
                shape[axis] = scale.size
                scale, zero_point = scale.reshape(shape), zero_point.reshape(shape)
            else:
                scale, zero_point = scale.reshape(()), zero_point.reshape(())
            if quantize:
                result = quantize_linear_fast(source, scale, zero_point, np.dtype(entry["dtype"]))
            else:
                result = dequantize_linear(source, scale, zero_point)
            frame[(entry["output"], out_layouts[entry["output"]])] = result
            cycles += cvu.quantize_cycles(int(source.size))
    _account(stage, len(frames), len(frames), cycles)


def _run_reorder(archive, plugin, frames: list[Buffers], stage: StageStats, *, cvu, **_) -> None:
    forward = plugin["config_params"]["kernel"] == "tessellate"
    nodes = {n["name"]: n for n in plugin["input_nodes"]}
    cycles = 0
    for frame in frames:
        for entry in plugin["config_params"]["params"]["tensors"]:
            name, layout = entry["tensor"], entry["layout"]
            shape = nodes[name]["shape"]
            if forward:
                frame[(name, layout)] = tessellate(frame[(name, "NCHW")], layout)
            else:
                frame[(name, "NCHW")] = detessellate(frame[(name, layout)], layout, shape)
            nbytes = (
                math.prod(physical_shape(shape, layout)) * np.dtype(nodes[name]["dtype"]).itemsize
            )
            cycles += cvu.reorder_cycles(nbytes, tile_count(shape, entry["tile_shape"], layout))
    _account(stage, len(frames), len(frames), cycles)


def _account(stage: StageStats, invocations: int, frames: int, cycles: int) -> None:
    stage.invocations += invocations
    stage.frames += frames
    stage.static_cycles += cycles
    stage.stall_aware_cycles += cycles


LOADED_STAGES = 32
"""ONNX stages whose loaded form (`IntegerExecutor`, ONNX Runtime session) `run_archive` keeps,
by content, between calls (least recently used first out)."""

_LOADED: LruCache[Any] = LruCache()


def _loaded(kind: str, data: bytes, load: Callable[[bytes], Any]) -> Any:
    """load(data), once per process for these exact bytes: a runtime loads a model's stages once
    and runs them on every frame, and building an executor or a session costs more than running
    a small stage. Both are reusable and thread-safe for runs (neither keeps per-run state)."""
    return _LOADED.get((kind, data), lambda: load(data), LOADED_STAGES)


def _integer_executor(data: bytes) -> IntegerExecutor:
    return IntegerExecutor(onnx.load_from_string(data))


def _onnxruntime_session(data: bytes) -> Any:
    return host_session(data)


def _run_reference(archive, plugin, frames: list[Buffers], stage: StageStats, **_) -> None:
    executor = _loaded("reference", archive.executable(plugin), _integer_executor)
    names = [n["name"] for n in plugin["input_nodes"]]
    for frame in frames:
        feed = {name: frame[(name, "NCHW")] for name in names}
        if executor.runs == 0:  # untimed: the first run makes its float steps' sessions
            executor.run(feed)
        clock = time.perf_counter()
        results = executor.run(feed)
        stage.run_seconds += time.perf_counter() - clock
        for node in plugin["output_nodes"]:
            frame[(node["name"], "NCHW")] = np.asarray(results[node["name"]])
    stage.invocations += len(frames)
    stage.frames += len(frames)
    stage.measured = True


def _run_onnxruntime(archive, plugin, frames: list[Buffers], stage: StageStats, **_) -> None:
    try:
        session = _loaded("onnxruntime", archive.executable(plugin), _onnxruntime_session)
    except Exception as error:  # noqa: BLE001 - ORT raises one class per status code
        raise ExecutionError(
            f"stage {plugin['name']!r} ({plugin['processor']}): ONNX Runtime cannot load its "
            f"model: {first_line(error)}"
        ) from None
    names = [n["name"] for n in plugin["input_nodes"]]
    outputs = [n["name"] for n in plugin["output_nodes"]]
    for k, frame in enumerate(frames):
        feed = {name: frame[(name, "NCHW")] for name in names}
        if k == 0:  # untimed: ORT's first run allocates and initialises (tens of ms)
            with contextlib.suppress(Exception):
                session.run(outputs, feed)
        clock = time.perf_counter()
        try:
            results = session.run(outputs, feed)
        except Exception as error:  # noqa: BLE001 - ORT raises one class per status code
            raise ExecutionError(
                f"stage {plugin['name']!r} ({plugin['processor']}, ONNX Runtime) rejected "
                f"its inputs: {first_line(error)}"
            ) from None
        stage.run_seconds += time.perf_counter() - clock
        for name, value in zip(outputs, results, strict=True):
            frame[(name, "NCHW")] = np.asarray(value)
    stage.invocations += len(frames)
    stage.frames += len(frames)
    stage.measured = True


def _run_mla(
    archive, plugin, frames: list[Buffers], stage: StageStats, *, batch: int, hardware, **_
) -> None:
    emulator = Emulator(archive.executable(plugin), hardware)
    metadata = emulator.program.metadata
    program_batch = metadata.batch_size
    inputs = {n["name"]: n for n in plugin["input_nodes"]}
    outputs = {n["name"]: n for n in plugin["output_nodes"]}
    for start in range(0, len(frames), program_batch):
        chunk = frames[start : start + program_batch]
        padded = chunk + [chunk[-1]] * (program_batch - len(chunk))
        feed = {}
        for info in metadata.inputs:
            node = inputs[info.name]
            parts = [_logical(frame[(info.name, node["layout"])], node) for frame in padded]
            feed[info.name] = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
        results = emulator.run(feed)
        for info in metadata.outputs:
            node = outputs[info.name]
            head = node["shape"][0] if node["shape"] else 1
            value = results[info.name]
            for k, frame in enumerate(chunk):
                part = value[k * head : (k + 1) * head] if node["shape"] else value
                frame[(info.name, node["layout"])] = tessellate(part, node["layout"])
        run = emulator.stats
        stage.invocations += 1
        stage.frames += len(chunk)
        stage.static_cycles += run.static_cycles if run else 0
        stage.stall_aware_cycles += run.stall_aware_cycles if run else 0


_RUNNERS = {
    ("EV74", "quantize"): _run_quantize,
    ("EV74", "dequantize"): _run_quantize,
    ("EV74", "tessellate"): _run_reorder,
    ("EV74", "detessellate"): _run_reorder,
    ("EV74", "onnx"): _run_reference,
    ("A65", "onnx"): _run_onnxruntime,
    ("MLA", "mla"): _run_mla,
}
