"""Tessellation: how a tensor crossing the MLA boundary is laid out in DRAM, and who reorders it.

The MLA exchanges 4-D tensors with the rest of the pipeline through DRAM. Its own format is
**HWC16**: NHWC with the channel pitch rounded up to 16 (a channel group per DMA beat). The
ONNX tensors the host stages see are NCHW. Someone must reorder between the two:

* `tessellate_parameters=None` (the default): the CVU (EV74) does it. Before an MLA stage a
  `tessellate` kernel turns each NCHW input into HWC16, tile by tile (`tile_shape`); after it a
  `detessellate` kernel turns each HWC16 output back into NCHW. Two extra host stages per
  boundary tensor, and the MLA reads and writes its native format.
* `TensorTessellateParameters(tile_shape, enable_mla=True, dram_layout=HWC | HWC16)` for a
  pipeline input or output: the MLA's DMA reads (or writes) that layout directly, so there is no
  CVU reorder stage; the pipeline input is then expected in HWC (what cameras deliver) and the
  output is delivered in HWC16. `enable_mla=False` keeps the CVU stage but makes it produce
  `dram_layout` with `tile_shape` tiles.

The numpy kernels here are the reference of what the EV74 kernels compute.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import numpy as np

from compiler.isa import HWC16_CHANNEL_ALIGN
from compiler.lower.errors import CompileError

DEFAULT_TILE_SHAPE = (1, 16, 16, 16)
"""N, H, W, C of one tile the CVU moves at a time (one 4 KiB int8 tile)."""


class TensorDRAMLayout(str, Enum):
    """DRAM layout of an MLA input or output: HWC (dense NHWC) or HWC16 (channel pitch 16)."""

    HWC = "HWC"
    HWC16 = "HWC16"


@dataclass(frozen=True)
class TensorTessellateParameters:
    """Tessellation of one tensor (a pipeline input or output), in the vendor API's shape.

    `tile_shape` is (N, H, W, C) or (H, W, C) of a tile; `enable_mla=True` lets the MLA read or
    write the tensor in `dram_layout` directly (no CVU reorder stage).
    """

    tile_shape: tuple[int, ...] = DEFAULT_TILE_SHAPE
    enable_mla: bool = True
    dram_layout: TensorDRAMLayout = TensorDRAMLayout.HWC

    def __post_init__(self) -> None:
        shape = tuple(int(v) for v in self.tile_shape)
        if len(shape) == 3:
            shape = (1, *shape)
        if len(shape) != 4 or min(shape) < 1:
            raise CompileError(
                f"tile_shape must be 3 or 4 positive integers (N, H, W, C), not {self.tile_shape}"
            )
        object.__setattr__(self, "tile_shape", shape)
        try:
            layout = TensorDRAMLayout(
                self.dram_layout.value
                if isinstance(self.dram_layout, TensorDRAMLayout)
                else str(self.dram_layout).upper()
            )
        except ValueError:
            raise CompileError(
                f"dram_layout must be HWC or HWC16, not {self.dram_layout!r}"
            ) from None
        object.__setattr__(self, "dram_layout", layout)
        object.__setattr__(self, "enable_mla", bool(self.enable_mla))

    def to_dict(self) -> dict[str, Any]:
        return {
            "tile_shape": list(self.tile_shape),
            "enable_mla": self.enable_mla,
            "dram_layout": self.dram_layout.value,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TensorTessellateParameters:
        return cls(
            tuple(data.get("tile_shape", DEFAULT_TILE_SHAPE)),
            bool(data.get("enable_mla", True)),
            TensorDRAMLayout(str(data.get("dram_layout", "HWC")).upper()),
        )


TessellateParameters = Mapping[str, TensorTessellateParameters]


DEFAULT = "default"
"""`tessellate_parameters="default"`: MLA-side tessellation wherever the pipeline allows it."""


def coerce_parameters(parameters: Any) -> dict[str, TensorTessellateParameters] | str:
    """Accept None, "default", {name: TensorTessellateParameters} or {name: dict} (JSON)."""
    if parameters is None:
        return {}
    if isinstance(parameters, str):
        if parameters != DEFAULT:
            raise CompileError(
                f"tessellate_parameters must be a mapping or {DEFAULT!r}, not {parameters!r}"
            )
        return DEFAULT
    if not isinstance(parameters, Mapping):
        raise CompileError("tessellate_parameters must map tensor names to parameters")
    result: dict[str, TensorTessellateParameters] = {}
    for name, value in parameters.items():
        if isinstance(value, TensorTessellateParameters):
            result[str(name)] = value
        elif isinstance(value, Mapping):
            result[str(name)] = TensorTessellateParameters.from_dict(value)
        else:
            raise CompileError(
                f"tessellate_parameters[{name!r}] must be TensorTessellateParameters, "
                f"not {type(value).__name__}"
            )
    return result


def default_parameters(
    inputs: Sequence[tuple[str, Sequence[int]]], outputs: Sequence[tuple[str, Sequence[int]]]
) -> dict[str, TensorTessellateParameters]:
    """MLA-side tessellation for the given 4-D pipeline inputs (HWC) and outputs (HWC16)."""
    params: dict[str, TensorTessellateParameters] = {}
    for name, shape in inputs:
        if len(shape) == 4:
            params[name] = TensorTessellateParameters(dram_layout=TensorDRAMLayout.HWC)
    for name, shape in outputs:
        if len(shape) == 4:
            params[name] = TensorTessellateParameters(dram_layout=TensorDRAMLayout.HWC16)
    return params


# --- the CVU kernels ----------------------------------------------------------------------------


def channel_pitch(channels: int, layout: str) -> int:
    if layout == "HWC16":
        return -(-channels // HWC16_CHANNEL_ALIGN) * HWC16_CHANNEL_ALIGN
    return channels


def physical_shape(shape: Sequence[int], layout: str) -> tuple[int, ...]:
    """Shape of the array holding a logical (NCHW) tensor in `layout` (N, H, W, pitch)."""
    shape = tuple(int(s) for s in shape)
    if layout == "NCHW" or len(shape) != 4:
        return shape
    n, c, h, w = shape
    return (n, h, w, channel_pitch(c, layout))


def tessellate(array: np.ndarray, layout: str) -> np.ndarray:
    """NCHW -> HWC or HWC16 (padding channels hold 0; nothing reads them)."""
    array = np.asarray(array)
    if layout == "NCHW" or array.ndim != 4:
        return array
    n, c, h, w = array.shape
    out = np.zeros((n, h, w, channel_pitch(c, layout)), dtype=array.dtype)
    out[..., :c] = array.transpose(0, 2, 3, 1)
    return out


def detessellate(buffer: np.ndarray, layout: str, shape: Sequence[int]) -> np.ndarray:
    """HWC or HWC16 -> NCHW of logical `shape` (the padding channels are dropped)."""
    buffer = np.asarray(buffer)
    shape = tuple(int(s) for s in shape)
    if layout == "NCHW" or len(shape) != 4:
        return buffer.reshape(shape) if buffer.shape != shape else buffer
    n, c, h, w = shape
    if buffer.ndim != 4 or buffer.shape[:3] != (n, h, w):
        raise CompileError(f"a {layout} buffer of shape {buffer.shape} does not hold {shape}")
    return np.ascontiguousarray(buffer[..., :c].transpose(0, 3, 1, 2))


def tile_count(shape: Sequence[int], tile_shape: Sequence[int], layout: str) -> int:
    """Tiles the CVU moves for one tensor (the per-tile set-up cost of the reorder)."""
    physical = physical_shape(shape, layout if layout != "NCHW" else "HWC")
    if len(physical) != 4:
        return 1
    return math.prod(-(-p // t) for p, t in zip(physical, tile_shape, strict=True))
