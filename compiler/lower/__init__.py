"""Lowering of a QDQ model to MLA programs and a pipeline of CVU / APU stages.

One module per stage, named for what it does (after Arm's Vela): `partition` (MLA segments and
host stages), `layout` (tensor formats in DRAM and in the arena), `fusion` (integer steps into
MLA layers), `schedule` (layer order: WidthFirst / DepthFirst), `memory` (arena planning with
four strategies and the lower bound), `batch` (largest batch that fits), `tessellate` (tile
formats and the CVU reorder kernels), `codegen` (ISA instructions and the ELF) and `pipeline`
(all of the above for one model, in order).
"""
