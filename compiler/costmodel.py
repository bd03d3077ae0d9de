"""Cycle estimates for MLA instructions: max(compute, memory) per instruction, Vela-style.

The hardware constants come from the target profile's `hardware:` block (quads, MACs per quad,
clock, SRAM per quad, DRAM bytes per cycle); the micro-architectural constants the profile does
not state (MAC array shape, vector lanes, arena bandwidth, DMA set-up, dispatch) are defaults of
`MlaHardware` and documented in docs/mla-isa.md, section "Cost model".

Two estimates:

* `static_schedule`: instructions run one after another, each taking
  `dispatch + max(compute, memory)` cycles. This is what `_mla_stats.yaml` reports (start and end
  cycle per layer) and it assumes no memory stalls beyond each instruction's own traffic.
* `stall_aware_schedule`: DMA instructions (LOAD, STORE) run on their own engine, concurrently
  with compute; an instruction waits for every earlier instruction whose bytes it reads or writes
  (read-after-write, write-after-read, write-after-write on overlapping byte ranges), and all DRAM
  traffic (DRAM and CONST operands) shares one DRAM channel, so concurrent transfers queue.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from compiler.isa import (
    Conv,
    ConvTranspose,
    Eltwise,
    EltwiseOp,
    GridSampleBf16,
    Instruction,
    LayerNorm,
    Load,
    Lrn,
    Lut,
    MatMul,
    Move,
    NormFp16,
    NormOp,
    Pool,
    Reduce,
    Resize,
    ResizeMode,
    SampleMode,
    Softmax,
    Space,
    Store,
    Tensor,
)


@dataclass(frozen=True)
class MlaHardware:
    """The virtual MLA's throughput constants (defaults: the `mlsoc` profile).

    A quad has a MAC array of `macs_per_quad` = array_width (output channels) x array_depth
    (input channels) 8-bit MACs per cycle, `vector_lanes_per_quad` elements per cycle for
    elementwise / pooling / table work, and an SRAM slice of `sram_bytes_per_quad` read or
    written at `arena_bytes_per_cycle_per_quad`. All quads share one DRAM channel of
    `dram_bytes_per_cycle`. Work is split evenly over the quads a program uses.
    """

    quads: int = 4
    macs_per_quad: int = 1024
    clock_mhz: float = 1000.0
    sram_bytes_per_quad: int = 4 * 1024 * 1024
    dram_bytes_per_cycle: int = 32
    vector_lanes_per_quad: int = 64
    arena_bytes_per_cycle_per_quad: int = 128
    dispatch_cycles: int = 16
    dma_setup_cycles: int = 64

    @classmethod
    def from_profile(cls, hardware: Mapping[str, Any] | None) -> MlaHardware:
        """From a target profile's `hardware:` mapping; unknown keys are ignored."""
        return cls(**cls.constants_in(hardware))

    @classmethod
    def constants_in(cls, hardware: Mapping[str, Any] | None) -> dict[str, Any]:
        """The entries of a profile's `hardware:` mapping that are this machine's constants
        (rk3588 lists its NPU's cores and TOPS: none are)."""
        return {k: v for k, v in (hardware or {}).items() if k in cls.__dataclass_fields__}

    def with_quads(self, quads: int) -> MlaHardware:
        if not 1 <= quads <= self.quads:
            raise ValueError(f"the MLA has {self.quads} quads; a program cannot use {quads}")
        return replace(self, quads=quads)

    @property
    def array_width(self) -> int:
        """Output channels computed in parallel by one quad's MAC array."""
        return 1 << (int(math.log2(self.macs_per_quad)) + 1) // 2

    @property
    def array_depth(self) -> int:
        """Input channels (reduction depth) consumed per cycle by one quad's MAC array."""
        return self.macs_per_quad // self.array_width

    @property
    def arena_bytes(self) -> int:
        """On-chip SRAM available to a program using `quads` quads."""
        return self.sram_bytes_per_quad * self.quads

    @property
    def arena_bytes_per_cycle(self) -> int:
        return self.arena_bytes_per_cycle_per_quad * self.quads

    def seconds(self, cycles: int) -> float:
        return cycles / (self.clock_mhz * 1e6)


@dataclass(frozen=True)
class InstructionCost:
    """Cycles of one instruction: dispatch + max(compute, memory)."""

    compute: int
    memory: int
    macs: int
    dram_bytes: int
    arena_bytes: int
    dispatch: int

    @property
    def cycles(self) -> int:
        return self.dispatch + max(self.compute, self.memory)

    @property
    def bound(self) -> str:
        return "compute" if self.compute >= self.memory else "memory"


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


_VECTOR_PASSES = {
    EltwiseOp.ADD: 3,
    EltwiseOp.SUB: 3,
    EltwiseOp.MUL: 1,
    EltwiseOp.DIV: 4,
    EltwiseOp.MAX: 3,
    EltwiseOp.MIN: 3,
}
"""Vector-unit passes per output element: Add/Sub/Max/Min requantize three times (both
operands, then the result), Div divides."""

SOFTMAX_PASSES = 4
"""max, table + sum, reciprocal-multiply, requantize."""

LAYERNORM_PASSES = 6
"""two moment sums, centring, rsqrt-multiply, two requantizations."""

NORM_FP16_PASSES = {NormOp.LAYER: 9, NormOp.RMS: 6}
"""fp16 vector passes per element, each one rounding: LAYER dequantizes, sums (the tree has
N - 1 adds per N elements), centres, squares, sums, multiplies by r and gamma, adds beta and
quantizes; RMS skips the mean, the centring and beta. The per-row add, sqrt and divide are a
few lanes' work per row and not counted."""

GRID_SAMPLE_POINT_PASSES = 12
"""GRID_SAMPLE_BF16 work per sampling point (shared by every channel): dequantize x and y to
bf16, denormalise each (three float32 operations), the border test and clamp or reflection,
floor and the four weights."""

GRID_SAMPLE_ELEMENT_PASSES = {SampleMode.NEAREST: 2, SampleMode.BILINEAR: 9}
"""GRID_SAMPLE_BF16 work per output element: a gather and the bf16 round + quantize (nearest);
four gathers with dequantize, six multiply / adds and the round + quantize (bilinear)."""

LRN_EXTRA_PASSES = 3
"""LRN: `size` window adds, plus squaring, the table lookup and the multiply-requantize."""


def _traffic(instruction: Instruction) -> tuple[int, int]:
    """(DRAM bytes, ARENA bytes) moved by an instruction; CONST lives in DRAM."""
    dram = arena = 0
    for tensor in instruction.operands().values():
        if tensor.space == Space.ARENA:
            arena += tensor.nbytes
        else:
            dram += tensor.nbytes
    return dram, arena


def _compute_cycles(instruction: Instruction, hw: MlaHardware) -> tuple[int, int]:
    """(compute cycles, MACs) on `hw.quads` quads."""
    lanes = hw.vector_lanes_per_quad * hw.quads
    width, depth = hw.array_width, hw.array_depth
    if isinstance(instruction, Conv):
        n, m, ho, wo = instruction.output.shape
        _, cg, kh, kw = instruction.weight.shape
        group = instruction.group
        taps = n * ho * wo * kh * kw
        macs = taps * m * cg
        if cg == 1 and m == group:
            blocks = taps * _ceil(m, width)
        else:
            blocks = taps * group * _ceil(m // group, width) * _ceil(cg, depth)
        return _ceil(blocks, hw.quads), macs
    if isinstance(instruction, ConvTranspose):
        n, c, h, w = instruction.input.shape
        _, mg, kh, kw = instruction.weight.shape
        group = instruction.group
        taps = n * h * w * kh * kw
        macs = taps * c * mg
        blocks = taps * group * _ceil(mg, width) * _ceil(c // group, depth)
        return _ceil(blocks, hw.quads), macs
    if isinstance(instruction, MatMul):
        out = instruction.output.shape
        rows, columns = (out[-2], out[-1]) if len(out) >= 2 else (1, out[-1] if out else 1)
        batch = math.prod(out[:-2]) if len(out) > 2 else 1
        k = instruction.a.shape[-1]
        macs = batch * rows * columns * k
        blocks = batch * rows * _ceil(columns, width) * _ceil(k, depth)
        return _ceil(blocks, hw.quads), macs
    if isinstance(instruction, Eltwise):
        passes = _VECTOR_PASSES[instruction.op]
        return _ceil(instruction.output.size * passes, lanes), 0
    if isinstance(instruction, Lut):
        return _ceil(instruction.output.size, lanes), 0
    if isinstance(instruction, Pool):
        taps = instruction.kernel[0] * instruction.kernel[1]
        return _ceil(instruction.output.size * taps, lanes), 0
    if isinstance(instruction, Reduce):
        return _ceil(instruction.input.size, lanes), 0
    if isinstance(instruction, Resize):
        axes = sum(1 for a in (instruction.axis0, instruction.axis1) if a >= 0)
        per_element = 2 * axes + 1 if instruction.mode == ResizeMode.LINEAR else 1
        return _ceil(instruction.output.size * per_element, lanes), 0
    if isinstance(instruction, Softmax):
        return _ceil(instruction.input.size * SOFTMAX_PASSES, lanes), 0
    if isinstance(instruction, LayerNorm):
        return _ceil(instruction.input.size * LAYERNORM_PASSES, lanes), 0
    if isinstance(instruction, NormFp16):
        return _ceil(instruction.input.size * NORM_FP16_PASSES[instruction.op], lanes), 0
    if isinstance(instruction, GridSampleBf16):
        points = math.prod(instruction.grid.shape[:3])
        work = points * GRID_SAMPLE_POINT_PASSES
        work += instruction.output.size * GRID_SAMPLE_ELEMENT_PASSES[instruction.mode]
        return _ceil(work, lanes), 0
    if isinstance(instruction, Lrn):
        passes = instruction.size + LRN_EXTRA_PASSES
        return _ceil(instruction.input.size * passes, lanes), 0
    if isinstance(instruction, Move) and instruction.requant is not None:
        return _ceil(instruction.dst.size, lanes), 0
    return 0, 0


def instruction_cost(instruction: Instruction, hw: MlaHardware) -> InstructionCost:
    """Compute, memory and total cycles of one instruction on `hw`."""
    compute, macs = _compute_cycles(instruction, hw)
    dram, arena = _traffic(instruction)
    memory = max(_ceil(dram, hw.dram_bytes_per_cycle), _ceil(arena, hw.arena_bytes_per_cycle))
    if isinstance(instruction, Load | Store):
        memory += hw.dma_setup_cycles
    return InstructionCost(compute, memory, macs, dram, arena, hw.dispatch_cycles)


@dataclass(frozen=True)
class ScheduledInstruction:
    index: int
    mnemonic: str
    layer: int
    start: int
    end: int
    cost: InstructionCost

    @property
    def stall(self) -> int:
        """Cycles beyond the instruction's own cost (waiting for DRAM or for other engines)."""
        return max(0, self.end - self.start - self.cost.cycles)


@dataclass(frozen=True)
class Schedule:
    entries: tuple[ScheduledInstruction, ...]
    hardware: MlaHardware
    stalls_modelled: bool
    notes: tuple[str, ...] = field(default=())

    @property
    def total_cycles(self) -> int:
        return max((e.end for e in self.entries), default=0)

    @property
    def total_macs(self) -> int:
        return sum(e.cost.macs for e in self.entries)

    @property
    def seconds(self) -> float:
        return self.hardware.seconds(self.total_cycles)

    def by_layer(self) -> dict[int, tuple[int, int]]:
        """layer index -> (first start cycle, last end cycle)."""
        spans: dict[int, tuple[int, int]] = {}
        for entry in self.entries:
            start, end = spans.get(entry.layer, (entry.start, entry.end))
            spans[entry.layer] = (min(start, entry.start), max(end, entry.end))
        return spans

    def layer_rows(self, names: Sequence[str]) -> list[dict[str, Any]]:
        """One row per layer, in layer order, for `_mla_stats.yaml`.

        Each row: name (from `names`, the program's `layers`), start_cycle, end_cycle,
        cycles (the layer's own instruction cycles), macs and instructions (count).
        """
        rows: dict[int, dict[str, Any]] = {}
        for entry in self.entries:
            row = rows.setdefault(
                entry.layer,
                {
                    "name": names[entry.layer] if entry.layer < len(names) else "",
                    "start_cycle": entry.start,
                    "end_cycle": entry.end,
                    "cycles": 0,
                    "macs": 0,
                    "instructions": 0,
                },
            )
            row["start_cycle"] = min(row["start_cycle"], entry.start)
            row["end_cycle"] = max(row["end_cycle"], entry.end)
            row["cycles"] += entry.cost.cycles
            row["macs"] += entry.cost.macs
            row["instructions"] += 1
        return [rows[index] for index in sorted(rows)]


def static_schedule(instructions: Sequence[Instruction], hw: MlaHardware) -> Schedule:
    """Serial schedule: each instruction starts when the previous one ends."""
    entries = []
    clock = 0
    for index, instruction in enumerate(instructions):
        cost = instruction_cost(instruction, hw)
        entries.append(
            ScheduledInstruction(
                index, instruction.mnemonic, instruction.layer, clock, clock + cost.cycles, cost
            )
        )
        clock += cost.cycles
    return Schedule(tuple(entries), hw, stalls_modelled=False)


def _intervals(tensors: Mapping[str, Tensor]) -> list[tuple[Space, int, int]]:
    return [(t.space, *t.span()) for t in tensors.values() if t.size]


def _overlap(a: list[tuple[Space, int, int]], b: list[tuple[Space, int, int]]) -> bool:
    return any(sa == sb and lo < hi_b and lo_b < hi for sa, lo, hi in a for sb, lo_b, hi_b in b)


def stall_aware_schedule(instructions: Sequence[Instruction], hw: MlaHardware) -> Schedule:
    """DMA/compute overlap with byte-range dependencies and one shared DRAM channel.

    Each instruction starts when its engine (DMA for LOAD/STORE, the compute pipeline for the
    rest) is free and every earlier instruction it depends on has finished. Its DRAM traffic
    occupies the DRAM channel for dram_bytes / dram_bytes_per_cycle cycles, starting when the
    channel is free; it ends at the later of its compute/arena time and its DRAM transfer.
    """
    engines = {"dma": 0, "compute": 0}
    dram_free = 0
    in_flight: list[tuple[list, list, int]] = []
    entries = []
    for index, instruction in enumerate(instructions):
        cost = instruction_cost(instruction, hw)
        engine = "dma" if isinstance(instruction, Load | Store) else "compute"
        reads = _intervals(instruction.inputs())
        writes = _intervals(instruction.outputs())
        ready = engines[engine]
        for prior_reads, prior_writes, prior_end in in_flight:
            if prior_end > ready and (
                _overlap(reads, prior_writes)
                or _overlap(writes, prior_writes)
                or _overlap(writes, prior_reads)
            ):
                ready = prior_end
        start = ready
        dram_cycles = _ceil(cost.dram_bytes, hw.dram_bytes_per_cycle)
        arena_cycles = _ceil(cost.arena_bytes, hw.arena_bytes_per_cycle)
        setup = hw.dma_setup_cycles if engine == "dma" else 0
        local_end = start + cost.dispatch + max(cost.compute, arena_cycles + setup)
        end = local_end
        if dram_cycles:
            dram_start = max(start + cost.dispatch + setup, dram_free)
            dram_free = dram_start + dram_cycles
            end = max(end, dram_free)
        engines[engine] = end
        in_flight.append((reads, writes, end))
        horizon = min(engines.values())
        in_flight = [record for record in in_flight if record[2] > horizon]
        entries.append(
            ScheduledInstruction(index, instruction.mnemonic, instruction.layer, start, end, cost)
        )
    return Schedule(tuple(entries), hw, stalls_modelled=True)
