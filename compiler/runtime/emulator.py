"""The bit-exact MLA emulator: decoded instructions against a flat memory image.

`Emulator(program)` decodes the program's `.text` (the encoded bytes, not the objects the
compiler built, so an encoding bug shows), lays out three byte arrays (DRAM, the on-chip arena,
the read-only CONST image of `.rodata`) at the sizes the metadata plans, writes the inputs at
their planned addresses, and executes every instruction by reading its operands through their
descriptors, computing with `compiler.intmath` and writing the result back. A wrong memory plan
(overlapping live tensors, a tensor outside the arena) or a wrong descriptor gives wrong numbers
or an `EmulatorError` naming the instruction, never a silent pass.

Uninitialised DRAM and arena bytes hold a poison pattern, so reading a tensor nothing wrote
gives garbage rather than plausible zeros. Like a runtime, which allocates a model's memory once
and runs many frames in it, an emulator keeps its image between runs (and hands it to the next
emulator of the same ELF when it is dropped), re-poisoning all of it at the start of each run.

Small instructions run as steps planned once per image (`compiler.runtime.emulator_plans`):
their checks, CONST-derived tables and views of their operands' places are made on the
image's first run, so later runs only compute; larger ones run their executors in
`compiler.runtime.emulator_ops`.

An instruction's independent blocks can run on a few threads, as the hardware's quads share it
(`compiler.runtime.parallel`; `parallel.WORKERS`, one thread by default); each thread writes its
own part of the result, so the numbers do not depend on the thread count.

Cycle counts come from `compiler.costmodel`: a static per-instruction estimate and a
DRAM-stall-aware overlapped schedule.

An ELF (path or bytes) is decoded once per process: its program, instructions, cycle schedules
and the values derived from its read-only CONST tensors are kept, by content, for every later
`Emulator` of the same bytes (the pipeline builds one per run). All of them are immutable, so
sharing them changes no result. While instructions execute, numpy's OpenBLAS runs on one thread
(`BLAS_THREADS`), which keeps the many mid-sized matrix products from stalling on busy hosts.
"""

from __future__ import annotations

import ctypes
import functools
import threading
import weakref
from collections.abc import Callable, Hashable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from compiler.costmodel import (
    InstructionCost,
    MlaHardware,
    Schedule,
    instruction_cost,
    stall_aware_schedule,
    static_schedule,
)
from compiler.intmath import dtype_range
from compiler.isa import Instruction, IsaError, MlaProgram, Space, Tensor, decode
from compiler.runtime import emulator_plans
from compiler.runtime.cache import LruCache
from compiler.runtime.emulator_ops import EmulatorError
from compiler.runtime.emulator_plans import Plan, plan_program
from compiler.runtime.parallel import for_each, worker_count

POISON = 0xA5
"""Byte value of memory no instruction has written yet."""

__all__ = ["POISON", "Emulator", "EmulatorError", "Memory", "RunStats"]

_dtype_range = functools.cache(dtype_range)
"""`compiler.intmath.dtype_range`, remembered (numpy's iinfo is slow for a per-write call)."""


T = TypeVar("T")


class Memory:
    """The flat memory image: one byte array per space, read and written through descriptors.

    `constants` (shared by every run of one program) keeps what `read_cached` derives from CONST
    tensors, which no instruction can change.
    """

    def __init__(
        self,
        dram_size: int,
        arena_size: int,
        rodata: bytes,
        poison: int | None = POISON,
        constants: dict[tuple[Tensor, Hashable], Any] | None = None,
    ) -> None:
        self.poison = poison
        fill = 0 if poison is None else poison
        self.spaces: dict[Space, bytearray | bytes] = {
            Space.DRAM: bytearray([fill]) * dram_size,
            Space.ARENA: bytearray([fill]) * arena_size,
            Space.CONST: bytes(rodata),
        }
        self.bytes_read = dict.fromkeys(self.spaces, 0)
        self.bytes_written = dict.fromkeys(self.spaces, 0)
        self.constants: dict[tuple[Tensor, Hashable], Any] = {} if constants is None else constants
        self._views: dict[Tensor, np.ndarray] = {}
        self.plan: Plan | None = None

    def reset(self) -> None:
        """Back to the state of a new image: DRAM and arena all poison again (so a run on a
        reused image reads garbage wherever nothing wrote, as on a fresh one), counters zero.
        Refilling mapped memory costs a fraction of mapping and page-faulting a new image;
        the views made so far stay valid (the buffers are the same)."""
        fill = 0 if self.poison is None else self.poison
        for space in (Space.DRAM, Space.ARENA):
            np.frombuffer(self.spaces[space], dtype=np.uint8).fill(fill)
        self.bytes_read = dict.fromkeys(self.spaces, 0)
        self.bytes_written = dict.fromkeys(self.spaces, 0)

    def _view(self, tensor: Tensor) -> np.ndarray:
        """The tensor's elements as a numpy view of its space (made once per descriptor)."""
        view = self._views.get(tensor)
        if view is not None:
            return view
        buffer = self.spaces[tensor.space]
        low, high = tensor.span()
        if tensor.size and (low < 0 or high > len(buffer)):
            raise EmulatorError(
                f"{tensor.space.name} bytes [{low}, {high}) of a {tensor.shape} "
                f"{tensor.dtype.numpy.name} tensor fall outside the {len(buffer)}-byte space"
            )
        if tensor.size == 0:
            view = np.zeros(tensor.shape, dtype=tensor.dtype.numpy)
        else:
            view = np.ndarray(
                tensor.shape,
                dtype=tensor.dtype.numpy,
                buffer=memoryview(buffer)[low:high],
                offset=tensor.offset - low,
                strides=tensor.strides,
            )
        self._views[tensor] = view
        return view

    def count(self, reads: Mapping[Space, int], writes: Mapping[Space, int]) -> None:
        """Add bytes read and written per space (a planned step's, counted per run)."""
        for space, nbytes in reads.items():
            self.bytes_read[space] += nbytes
        for space, nbytes in writes.items():
            self.bytes_written[space] += nbytes

    def read(self, tensor: Tensor) -> np.ndarray:
        """A copy of the tensor's elements, shape `tensor.shape`, dtype `tensor.dtype`."""
        self.bytes_read[tensor.space] += tensor.nbytes
        return self._view(tensor).copy()

    def view(self, tensor: Tensor) -> np.ndarray:
        """The tensor's elements in place, read-only (counted as a read): for instructions
        that compute their whole result before they write it, so an output that overlaps the
        input cannot change what they read."""
        self.bytes_read[tensor.space] += tensor.nbytes
        view = self._view(tensor).view()
        view.flags.writeable = False
        return view

    def read_cached(self, tensor: Tensor, key: Hashable, derive: Callable[[np.ndarray], T]) -> T:
        """derive(elements), counted as one read. For a CONST tensor it is computed once per
        program (the `constants` cache, under `key`), so `derive` must return something its
        callers never modify."""
        if tensor.space != Space.CONST:
            return derive(self.read(tensor))
        self.bytes_read[tensor.space] += tensor.nbytes
        return self.constant(tensor, key, lambda: derive(self._view(tensor).copy()))

    def constant(self, tensor: Tensor, key: Hashable, build: Callable[[], T]) -> T:
        """build(), kept once per program under (tensor, key): for values made from CONST
        tables an instruction has already read (not counted again), which no run can change."""
        entry = (tensor, key)
        if entry not in self.constants:
            self.constants[entry] = build()
        return self.constants[entry]

    def place(self, tensor: Tensor, *, writable: bool = False) -> np.ndarray:
        """The tensor's elements in place, not counted, for a step planned once per image
        (`emulator_plans`), which counts its traffic per run instead. A writable place is
        checked as `target` checks it; a read-only one cannot be written by mistake."""
        if writable:
            self._writable(tensor)
            return self._view(tensor)
        view = self._view(tensor).view()
        view.flags.writeable = False
        return view

    def _writable(self, tensor: Tensor) -> None:
        if tensor.space == Space.CONST:
            raise EmulatorError("CONST (.rodata) is read-only")
        if any(s == 0 and n > 1 for n, s in zip(tensor.shape, tensor.strides, strict=True)):
            raise EmulatorError(
                f"a destination with a zero stride {tensor.strides} overlaps itself"
            )

    def target(self, tensor: Tensor) -> np.ndarray:
        """The tensor's elements in place, writable (counted as a write), for an instruction
        that computes its result straight into them instead of into a copy that `write` then
        stores. It must store only values of the tensor's dtype (`write`'s range check is
        skipped) and not overwrite what it has still to read."""
        self._writable(tensor)
        self.bytes_written[tensor.space] += tensor.nbytes
        return self._view(tensor)

    def write(self, tensor: Tensor, values: np.ndarray) -> None:
        """Store integer values; values outside the dtype's range are an error, never a wrap."""
        self._writable(tensor)
        values = np.asarray(values)
        if values.shape != tensor.shape:
            raise EmulatorError(f"writing {values.shape} values into a {tensor.shape} tensor")
        low, high = _dtype_range(tensor.dtype.numpy)
        checked = values.size and not _within(values.dtype, low, high)
        if checked and (values.min() < low or values.max() > high):
            raise EmulatorError(
                f"values in [{values.min()}, {values.max()}] do not fit {tensor.dtype.numpy.name}"
            )
        self.bytes_written[tensor.space] += tensor.nbytes
        _store(self._view(tensor), values)


PARALLEL_STORE_BYTES = 1 << 18
"""Writes of at least this many bytes are shared between the threads (`_store`)."""


def _store(target: np.ndarray, values: np.ndarray) -> None:
    """target[...] = values; a large one split between the threads (`parallel.for_each`) in
    runs along target's outermost axis. Values that may share memory with the target are
    copied by numpy alone, which buffers an overlapping copy (the runs could not)."""
    if target.nbytes < PARALLEL_STORE_BYTES:
        target[...] = values
        return
    workers = worker_count()
    if workers < 2 or np.may_share_memory(target, values):
        target[...] = values
        return
    axis = max(range(target.ndim), key=lambda a: (target.shape[a] > 1, abs(target.strides[a])))
    step = -(-target.shape[axis] // workers)
    lead = (slice(None),) * axis

    def copy(start: int) -> None:
        run = (*lead, slice(start, start + step))
        target[run] = values[run]

    for_each(range(0, target.shape[axis], step), copy)


@functools.cache
def _within(dtype: np.dtype, low: int, high: int) -> bool:
    """Whether every value of an integer dtype lies in [low, high] (then no check is needed);
    remembered (numpy's dtype tests cost a microsecond a call)."""
    if not np.issubdtype(dtype, np.integer):
        return False
    dtype_low, dtype_high = _dtype_range(dtype)
    return low <= dtype_low and dtype_high <= high


@dataclass(frozen=True)
class RunStats:
    """What the last run did: per-instruction cycles (static and stall-aware) and the bytes the
    instructions read and wrote per space (the host's input and output copies excluded)."""

    static: Schedule
    stall_aware: Schedule
    bytes_read: dict[str, int]
    bytes_written: dict[str, int]

    @property
    def static_cycles(self) -> int:
        return self.static.total_cycles

    @property
    def stall_aware_cycles(self) -> int:
        return self.stall_aware.total_cycles


class _OpenBlasThreads:
    """numpy's OpenBLAS thread count, through its C API (found among the loaded libraries)."""

    def __init__(self) -> None:
        self._get: Callable[[], int] | None = None
        self._set: Callable[[int], None] | None = None
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return
        paths = {line.split()[-1] for line in maps.splitlines() if "openblas" in line}
        for path in sorted(paths):
            try:
                library = ctypes.CDLL(path)
            except OSError:
                continue
            for prefix, suffix in (("", ""), ("scipy_", "64_"), ("", "64_"), ("scipy_", "")):
                getter = getattr(library, f"{prefix}openblas_get_num_threads{suffix}", None)
                setter = getattr(library, f"{prefix}openblas_set_num_threads{suffix}", None)
                if getter is not None and setter is not None:
                    self._get, self._set = getter, setter
                    return

    def get(self) -> int | None:
        return None if self._get is None else int(self._get())

    def set(self, threads: int) -> None:
        if self._set is not None:
            self._set(threads)


BLAS_THREADS: int | None = 1
"""BLAS threads while an emulator runs (None: leave BLAS alone). Its matrix products are many
and mid-sized (one per CONV block of rows), and a multi-threaded OpenBLAS waits at every one for
all its workers: when other processes hold the cores, a descheduled worker stalls each product,
which made whole runs 5-7x slower in wall time on a shared 2-core host (a quiet host gains some
20% from a second thread in one measurement, nothing consistent in a later one). With
`parallel.WORKERS` above one, the blocks' products run on those threads instead, each with a
single-threaded BLAS."""

_blas = functools.cache(_OpenBlasThreads)
_blas_lock = threading.Lock()
_blas_users = 0
_blas_saved: int | None = None


@contextmanager
def single_threaded_blas() -> Iterator[None]:
    """Hold numpy's OpenBLAS to `BLAS_THREADS` threads inside the block (best effort: without
    an OpenBLAS that exposes its thread count, nothing changes). Nested and concurrent blocks
    share one limit; the last to leave restores the previous count."""
    global _blas_users, _blas_saved
    if BLAS_THREADS is None:
        yield
        return
    with _blas_lock:
        if _blas_users == 0:
            _blas_saved = _blas().get()
            _blas().set(BLAS_THREADS)
        _blas_users += 1
    try:
        yield
    finally:
        with _blas_lock:
            _blas_users -= 1
            if _blas_users == 0 and _blas_saved is not None:
                _blas().set(_blas_saved)


DECODED_PROGRAMS = 32
"""ELF files whose decoded program `Emulator` keeps (least recently used first out). A staged
model has one per MLA segment (ppocrv4_det has 25), and every run of a pipeline rebuilds its
emulators from the same archive bytes."""


IDLE_IMAGES = 2
"""Memory images kept per decoded program for later emulators of it (see `_Decoded.image`)."""


@dataclass
class _Decoded:
    """A program and what every run of it shares: its instructions, per-hardware costs and
    schedules, and `Memory.constants` (each computed once and never modified), and the memory
    images no emulator is using (`image`, `release`)."""

    program: MlaProgram
    instructions: tuple[Instruction, ...] | None = None
    costs: dict[MlaHardware, tuple[InstructionCost, ...]] = field(default_factory=dict)
    schedules: dict[tuple[str, MlaHardware], Schedule] = field(default_factory=dict)
    constants: dict[tuple[Tensor, Hashable], Any] = field(default_factory=dict)
    idle_images: list[Memory] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def image(self, poison: int | None) -> Memory:
        """A memory image of this program, poisoned throughout: an idle one (`release`d by an
        emulator that is gone) if there is one with this poison, else a new one."""
        with self.lock:
            for index, memory in enumerate(self.idle_images):
                if memory.poison == poison:
                    del self.idle_images[index]
                    memory.reset()
                    return memory
        metadata = self.program.metadata
        return Memory(
            metadata.dram_size, metadata.arena_size, self.program.rodata, poison, self.constants
        )

    def release(self, memory: Memory) -> None:
        """Keep an image no emulator uses any more for the next one (at most `IDLE_IMAGES`)."""
        with self.lock:
            if len(self.idle_images) < IDLE_IMAGES:
                self.idle_images.append(memory)

    def decode(self) -> tuple[Instruction, ...]:
        """The instructions decoded from the encoded `.text` bytes."""
        if self.instructions is None:
            try:
                self.instructions = tuple(decode(self.program.text))
            except IsaError as error:
                raise EmulatorError(f"cannot decode the program: {error}") from error
        return self.instructions


_DECODED: LruCache[_Decoded] = LruCache()


def _decoded_elf(source: str | Path | bytes | bytearray) -> _Decoded:
    """The decoded ELF, from `_DECODED` when these exact bytes were seen before."""
    from compiler.elf import read_elf

    data = bytes(source) if isinstance(source, bytes | bytearray) else Path(source).read_bytes()
    return _DECODED.get(data, lambda: _Decoded(read_elf(data)), DECODED_PROGRAMS)


class Emulator:
    """Run an MLA program (an `MlaProgram`, or an ELF path / bytes) on integer inputs.

    `run(inputs)` takes and returns integer arrays in each I/O tensor's logical shape (NCHW),
    keyed by the names in the program's tensor table; it places them at the planned addresses
    (in their DRAM layout) and reads the outputs back from theirs.
    """

    def __init__(
        self,
        program: MlaProgram | str | Path | bytes,
        hardware: MlaHardware | None = None,
        *,
        poison: int | None = POISON,
    ) -> None:
        if isinstance(program, MlaProgram):
            self._decoded = _Decoded(program)
        else:
            self._decoded = _decoded_elf(program)
        program = self.program = self._decoded.program
        self.poison = poison
        metadata = program.metadata
        base = hardware or MlaHardware()
        try:
            self.hardware = base.with_quads(metadata.quads)
        except ValueError as error:
            raise EmulatorError(str(error)) from error
        if metadata.arena_size > self.hardware.arena_bytes:
            raise EmulatorError(
                f"the program plans {metadata.arena_size} arena bytes; {metadata.quads} quads "
                f"have {self.hardware.arena_bytes}"
            )
        self.instructions: tuple[Instruction, ...] = self._decoded.decode()
        costs = self._decoded.costs
        if self.hardware not in costs:
            costs[self.hardware] = tuple(
                instruction_cost(i, self.hardware) for i in self.instructions
            )
        self.costs = costs[self.hardware]
        self.memory: Memory | None = None
        self.stats: RunStats | None = None

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.program.metadata.inputs]

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.program.metadata.outputs]

    def _schedule(self, kind: str, build: Callable[..., Schedule]) -> Schedule:
        schedules = self._decoded.schedules
        if (kind, self.hardware) not in schedules:
            schedules[kind, self.hardware] = build(self.instructions, self.hardware)
        return schedules[kind, self.hardware]

    def static_schedule(self) -> Schedule:
        """Instructions back to back (what `_mla_stats.yaml` reports); computed once."""
        return self._schedule("static", static_schedule)

    def stall_aware_schedule(self) -> Schedule:
        """DMA/compute overlap with DRAM contention (compiler.costmodel); computed once."""
        return self._schedule("stall_aware", stall_aware_schedule)

    def _describe(self, index: int) -> str:
        instruction = self.instructions[index]
        layer = self.program.layer_name(instruction)
        return f"instruction {index} ({instruction.mnemonic}{f', {layer}' if layer else ''})"

    def _image(self) -> Memory:
        """The memory image for a run, poisoned throughout: this emulator's own from its last
        run, else one from the program's idle images or a new one, which becomes its own and
        goes back to the program when the emulator is dropped. A runtime allocates a model's
        memory once and runs many frames in it; the pipeline builds an emulator per run."""
        if self.memory is not None:
            self.memory.reset()
            return self.memory
        memory = self._decoded.image(self.poison)
        self.memory = memory
        weakref.finalize(self, self._decoded.release, memory)
        return memory

    def _plan(self, memory: Memory) -> Plan:
        """The program's steps on this image (`emulator_plans`), made on its first run (the
        views and buffers they hold stay valid: an image keeps its buffers)."""
        plan = memory.plan
        if plan is None or plan.planned != emulator_plans.plan_settings():
            plan = memory.plan = plan_program(self.instructions, memory)
        return plan

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Execute the program once; returns every output tensor as integers (logical shape)."""
        metadata = self.program.metadata
        memory = self._image()
        for info in metadata.inputs:
            if info.name not in inputs:
                raise EmulatorError(
                    f"missing input {info.name!r}; the program needs {self.input_names}"
                )
            values = np.asarray(inputs[info.name])
            if not np.issubdtype(values.dtype, np.integer):
                raise EmulatorError(
                    f"input {info.name!r} must hold integer codes, not {values.dtype}"
                )
            if values.shape != info.tensor.shape:
                raise EmulatorError(
                    f"input {info.name!r} has shape {values.shape}; expected {info.tensor.shape}"
                )
            try:
                memory.write(info.tensor, values)
            except EmulatorError as error:
                raise EmulatorError(f"input {info.name!r}: {error}") from error
        plan = self._plan(memory)
        memory.bytes_read = dict.fromkeys(memory.spaces, 0)
        memory.bytes_written = dict.fromkeys(memory.spaces, 0)
        with single_threaded_blas():
            for index, step in enumerate(plan.steps):
                try:
                    step()
                except EmulatorError as error:
                    raise EmulatorError(f"{self._describe(index)}: {error}") from error
        memory.count(plan.reads, plan.writes)
        self.stats = RunStats(
            static=self.static_schedule(),
            stall_aware=self.stall_aware_schedule(),
            bytes_read={s.name: n for s, n in memory.bytes_read.items()},
            bytes_written={s.name: n for s, n in memory.bytes_written.items()},
        )
        results = {info.name: memory.read(info.tensor) for info in metadata.outputs}
        return results
