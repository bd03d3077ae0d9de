"""Convolutions whose kernel or padding the MLA rejects, as sums of convolutions it runs:
conv-kernel-split.

RK3588's NPU runs depthwise kernels up to 8×8 only, while EdgeNeXt (9×9 in its last stage) and
other large-kernel networks use larger ones. A convolution is linear in its kernel: split the
kernel into tiles, convolve with each (padding shifted so every tile reads the input rows its
taps read in the original), and add the results. Equal up to float summation order.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx_graphsurgeon as gs

from surgery.rules.base import Match, RuleContext, RuleParams
from surgery.rules.registry import register
from surgery.rules.replace_common import (
    Editor,
    GraphRule,
    Pattern,
    TensorSpec,
    add_slice,
    add_zero_pad,
    constant_array,
    net_freed,
    probe_node,
    probe_slice,
    probe_zero_pad,
)
from surgery.targets import Reason

Tile = tuple[int, int, int, int, int]
"""A tile of taps on one spatial axis: (first tap, last tap, first tap it owns, pad before,
pad after)."""


@register
class ConvKernelSplit(GraphRule):
    """Rewrite a 2-D Conv whose kernel the MLA rejects as the sum of two (or four) Convs with
    kernels about half as large.

    Along an axis with K taps, pads (p₀, p₁) and dilation d, a tile of taps [r₀, r₁] is a
    Conv on the same input with pads (p₀ − d·r₀, p₁ − d·(K−1−r₁)): same output size, and
    each output reads exactly the input rows its taps read in the original. Pads cannot be
    negative, so every tile contains the taps [K−1−p₁, p₀] — the centre tap of a "same"
    convolution. The axis is split into [0, K−1−p₁] and [p₀, K−1], the taps both hold given
    to the first (the second has zeros there): a 9-tap "same" axis becomes 5 + 5 taps. Axes
    are split only as far as the target needs (probed with its own op table: W, then H, then
    both); the bias stays with the first tile. The partial results are summed with Adds, so
    the output equals the original up to float summation order.

    When no such split runs — the pads themselves are past the MLA's limit, or a tile would
    still be too large (wav2vec 2.0's 128-tap positional convolution padded by 64 on rk3588) —
    the input is zero-padded once by a Pad and the kernel cut into up to 8 tiles per axis,
    each convolving its own crop (Slice) of the padded input without padding (`CroppedPlan`).
    Only Convs the target keeps off its MLA are matched.
    """

    name = "conv-kernel-split"
    suggest_for = frozenset({"Conv"})
    summary = "Conv with a kernel the MLA rejects (e.g. depthwise 9×9 on rk3588) → sum of Convs over kernel tiles."
    category = "replace"
    example = "surgery apply conv-kernel-split edgenext.onnx --target rk3588"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for node in pat.blocked("Conv"):
            ins = pat.ins(node)
            x, y = ins[0], pat.outs(node)[0]
            xs, ys = pat.shape(x), pat.shape(y)
            weight = constant_array(ctx, ins[1]) if len(ins) > 1 else None
            if xs is None or ys is None or len(xs) != 4 or weight is None or weight.ndim != 4:
                continue
            attrs = pat.attrs(node)
            if attrs.get("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
                continue
            kernel = tuple(weight.shape[2:])
            pads = list(attrs.get("pads", [0, 0, 0, 0]))
            dilations = list(attrs.get("dilations", [1, 1]))
            plan = None
            for split in ((False, True), (True, False), (True, True)):
                tiles = [
                    _axis_tiles(kernel[a], pads[a], pads[a + 2], dilations[a])
                    if split[a]
                    else [(0, kernel[a] - 1, 0, pads[a], pads[a + 2])]
                    for a in (0, 1)
                ]
                if any(t is None or (split[a] and len(t) < 2) for a, t in enumerate(tiles)):
                    continue
                probes = self._probes(ctx, pat, node, tiles, weight)  # type: ignore[arg-type]
                if all(p is None for p in probes):
                    plan = tiles
                    break
            if plan is None:
                cropped = _cropped_plan(ctx, pat, node, weight)
                if cropped is not None:
                    found.append(self._cropped_match(pat, node, kernel, cropped))
                continue
            names = [pat.name(node)]
            sizes = " + ".join(f"{r[1] - r[0] + 1}×{c[1] - c[0] + 1}" for r, c in _pairs(plan))
            found.append(
                self.match(
                    names,
                    f"Conv {pat.name(node)} kernel {kernel[0]}×{kernel[1]} → {sizes} tiles summed",
                    net_freed(ctx, names, self._probes(ctx, pat, node, plan, weight)),
                    tiles=[[list(t) for t in axis] for axis in plan],
                )
            )
        return found

    @staticmethod
    def _probes(ctx: RuleContext, pat: Pattern, node: int, tiles, weight: np.ndarray) -> list:
        ins, attrs = pat.ins(node), pat.attrs(node)
        x, y = ins[0], pat.outs(node)[0]
        probes = []
        for k, (rows, cols) in enumerate(_pairs(tiles)):
            kernel = (rows[1] - rows[0] + 1, cols[1] - cols[0] + 1)
            w = TensorSpec((*weight.shape[:2], *kernel), constant=True)
            inputs = [pat.spec(x), w]
            if k == 0 and len(ins) > 2 and ins[2]:
                inputs.append(pat.spec(ins[2]))
            probes.append(
                probe_node(ctx, "Conv", inputs, [pat.spec(y)], _tile_attrs(attrs, rows, cols))
            )
        probes.append(probe_node(ctx, "Add", [pat.spec(y), pat.spec(y)], [pat.spec(y)]))
        return probes

    def _cropped_match(self, pat: Pattern, node: int, kernel: tuple, plan: CroppedPlan) -> Match:
        names = [pat.name(node)]
        tiles = " + ".join(f"{r1 - r0 + 1}×{c1 - c0 + 1}" for (r0, r1), (c0, c1) in plan.tiles())
        padding = "zero Pad, then " if any(plan.pads) else ""
        return self.match(
            names,
            f"Conv {pat.name(node)} kernel {kernel[0]}×{kernel[1]} → {padding}cropped "
            f"{tiles} tiles summed",
            net_freed(pat.ctx, names, plan.probes),
            cropped=plan.to_data(),
        )

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        conv = _take_conv(ed, match)
        if "cropped" in match.data:
            _sum_tile_convs(ed, conv, _cropped_tile_convs(ed, conv, match))
            return True
        weight = conv.weight
        tiles = [[tuple(t) for t in axis] for axis in match.data["tiles"]]
        convs = []
        for rows, cols in _pairs(tiles):
            part = np.zeros((*weight.shape[:2], rows[1] - rows[0] + 1, cols[1] - cols[0] + 1))
            r_own, c_own = rows[2], cols[2]
            part[:, :, r_own - rows[0] :, c_own - cols[0] :] = weight[
                :, :, r_own : rows[1] + 1, c_own : cols[1] + 1
            ]
            tile = ed.const(f"{conv.name}_tile", part.astype(weight.dtype))
            convs.append(([conv.x, tile], _tile_attrs(conv.attrs, rows, cols)))
        _sum_tile_convs(ed, conv, convs)
        return True


@dataclass
class _TakenConv:
    """A matched Conv's parts, the node itself detached (its output rewired by the edit)."""

    name: str
    x: gs.Tensor
    y: gs.Tensor
    bias: gs.Tensor | None
    weight: np.ndarray
    attrs: dict


def _take_conv(ed: Editor, match: Match) -> _TakenConv:
    node = ed.node_named(match.nodes[0])
    assert node is not None
    weight = ed.value(node.inputs[1])
    assert weight is not None
    bias = node.inputs[2] if len(node.inputs) > 2 and node.inputs[2].name else None
    taken = _TakenConv(
        node.name, node.inputs[0], node.outputs[0], bias, np.asarray(weight), dict(node.attrs)
    )
    ed.detach(node)
    return taken


def _sum_tile_convs(ed: Editor, conv: _TakenConv, tiles: list[tuple[list, dict]]) -> None:
    """One Conv per (inputs, attributes) — the bias with the first — summed by Adds into the
    original output."""
    y, total = conv.y, None
    for k, (inputs, attrs) in enumerate(tiles):
        inputs = [*inputs, conv.bias] if k == 0 and conv.bias is not None else inputs
        out = ed.op("Conv", f"{conv.name}_tile", inputs, y.shape, y.dtype, **attrs)
        if total is None:
            total = out
        elif k == len(tiles) - 1:
            ed.node("Add", f"{conv.name}_sum", [total, out], [y])
        else:
            total = ed.op("Add", f"{conv.name}_sum", [total, out], y.shape, y.dtype)


def _axis_tiles(taps: int, before: int, after: int, dilation: int) -> list[Tile] | None:
    """Two tiles [0, K−1−p₁] and [p₀, K−1] of an axis with `taps` taps (the second owning the
    taps after the first's last), or None when the pads do not allow it (each tile must keep
    non-negative pads, so both hold the taps [K−1−p₁, p₀]) or one tile would be all of it."""
    if taps < 2 or before % dilation or after % dilation:
        return None
    first_end = taps - 1 - after // dilation
    second_start = before // dilation
    if first_end < 0 or second_start > taps - 1 or second_start > first_end + 1:
        return None
    if first_end >= taps - 1 or second_start <= 0:
        return None
    return [
        (0, first_end, 0, before, after - dilation * (taps - 1 - first_end)),
        (second_start, taps - 1, first_end + 1, before - dilation * second_start, after),
    ]


def _pairs(tiles: Sequence[Sequence[Tile]]) -> list[tuple[Tile, Tile]]:
    return list(itertools.product(tiles[0], tiles[1]))


def _tile_attrs(attrs: dict, rows: Tile, cols: Tile) -> dict:
    """The Conv attributes of one tile: its kernel and the pads that keep outputs aligned."""
    new = {k: v for k, v in attrs.items() if k not in ("pads", "kernel_shape", "auto_pad")}
    new["kernel_shape"] = [rows[1] - rows[0] + 1, cols[1] - cols[0] + 1]
    new["pads"] = [rows[3], cols[3], rows[4], cols[4]]
    return new


MAX_TILES_PER_AXIS = 8
"""Most tiles one spatial axis is cut into by the cropped plan (each one more Slice, Conv and
Add): wav2vec 2.0's positional convolution (128 taps, rk3588 runs 31) needs five."""


@dataclass
class CroppedPlan:
    """A Conv as a zero Pad of its input by its own pads, then per tile of taps a crop (Slice)
    of the padded input convolved with that tile without padding, the tiles summed.

    Tile [r₀, r₁] of an axis with K taps and dilation d reads padded rows o·s + d·r for
    r ∈ [r₀, r₁]: the padded input cropped to [d·r₀, P − d·(K−1−r₁)) gives exactly the
    original's output size. No tile needs padding of its own, so the plan works where the
    pad-shifting split cannot (pads past the MLA's limit, tiles that do not reach the centre).
    """

    pads: list[int]
    padded: list[int]
    row_tiles: list[tuple[int, int]]
    col_tiles: list[tuple[int, int]]
    probes: list = field(default_factory=list)

    def tiles(self) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        return list(itertools.product(self.row_tiles, self.col_tiles))

    def to_data(self) -> dict:
        return {
            "pads": self.pads,
            "padded": self.padded,
            "row_tiles": [list(t) for t in self.row_tiles],
            "col_tiles": [list(t) for t in self.col_tiles],
        }

    @classmethod
    def from_data(cls, data: dict) -> CroppedPlan:
        return cls(
            data["pads"],
            data["padded"],
            [tuple(t) for t in data["row_tiles"]],  # type: ignore[misc]
            [tuple(t) for t in data["col_tiles"]],  # type: ignore[misc]
        )


def even_tiles(taps: int, count: int) -> list[tuple[int, int]]:
    """`taps` taps cut into `count` runs whose sizes differ by at most one."""
    bounds = [round(k * taps / count) for k in range(count + 1)]
    return [(bounds[k], bounds[k + 1] - 1) for k in range(count)]


def _crop(tile: tuple[int, int], taps: int, dilation: int, padded: int) -> tuple[int, int]:
    """The rows [start, end) of the padded input that tile's outputs read."""
    return tile[0] * dilation, padded - (taps - 1 - tile[1]) * dilation


def _cropped_plan(
    ctx: RuleContext, pat: Pattern, node: int, weight: np.ndarray
) -> CroppedPlan | None:
    """The fewest tiles (at most MAX_TILES_PER_AXIS per axis) whose every op the MLA runs."""
    attrs = pat.attrs(node)
    xs = pat.shape(pat.ins(node)[0])
    if xs is None or attrs.get("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        return None
    kernel = weight.shape[2:]
    top, left, bottom, right = list(attrs.get("pads", [0, 0, 0, 0]))
    pads = [0, 0, top, left, 0, 0, bottom, right]
    padded = [xs[0], xs[1], xs[2] + top + bottom, xs[3] + left + right]
    counts = sorted(
        itertools.product(
            range(1, min(kernel[0], MAX_TILES_PER_AXIS) + 1),
            range(1, min(kernel[1], MAX_TILES_PER_AXIS) + 1),
        ),
        key=lambda c: (c[0] * c[1], c),
    )
    for rows, cols in counts[1:]:
        plan = CroppedPlan(pads, padded, even_tiles(kernel[0], rows), even_tiles(kernel[1], cols))
        probes = []
        for probe in _cropped_probes(ctx, pat, node, plan, weight):
            if probe is not None:
                break  # this tiling has an op off the MLA: try the next one
            probes.append(probe)
        else:
            plan.probes = probes
            return plan
    return None


def _cropped_probes(
    ctx: RuleContext, pat: Pattern, node: int, plan: CroppedPlan, weight: np.ndarray
) -> Iterator[Reason | None]:
    """The placement of each op of the plan, the Add first: one generator, so the search
    stops probing a tiling at its first op off the MLA."""
    ins, attrs = pat.ins(node), pat.attrs(node)
    x, y = pat.spec(ins[0]), pat.spec(pat.outs(node)[0])
    dilations = list(attrs.get("dilations", [1, 1]))
    source = TensorSpec(tuple(plan.padded), x.elem_type)
    yield probe_node(ctx, "Add", [y, y], [y])
    if any(plan.pads):
        yield probe_zero_pad(ctx, x, plan.padded, plan.pads)
    for k, (rows, cols) in enumerate(plan.tiles()):
        (h0, h1), (w0, w1) = (
            _crop(rows, weight.shape[2], dilations[0], plan.padded[2]),
            _crop(cols, weight.shape[3], dilations[1], plan.padded[3]),
        )
        cropped = TensorSpec((*plan.padded[:2], h1 - h0, w1 - w0), x.elem_type)
        if cropped.shape != source.shape:
            yield probe_slice(ctx, source, cropped, [h0, w0], [h1, w1], [2, 3])
        kernel = (rows[1] - rows[0] + 1, cols[1] - cols[0] + 1)
        inputs = [cropped, TensorSpec((*weight.shape[:2], *kernel), constant=True)]
        if k == 0 and len(ins) > 2 and ins[2]:
            inputs.append(pat.spec(ins[2]))
        tile_attrs = _tile_attrs(attrs, _unpadded(rows), _unpadded(cols))
        yield probe_node(ctx, "Conv", inputs, [y], tile_attrs)


def _cropped_tile_convs(ed: Editor, conv: _TakenConv, match: Match) -> list[tuple[list, dict]]:
    """The zero Pad and the crops; per tile, the Conv's inputs and attributes."""
    plan = CroppedPlan.from_data(match.data["cropped"])
    dilations = list(conv.attrs.get("dilations", [1, 1]))
    source = conv.x
    if any(plan.pads):
        source = add_zero_pad(ed, conv.x, plan.pads, plan.padded, f"{conv.name}_pad")
    convs = []
    for rows, cols in plan.tiles():
        (h0, h1), (w0, w1) = (
            _crop(rows, conv.weight.shape[2], dilations[0], plan.padded[2]),
            _crop(cols, conv.weight.shape[3], dilations[1], plan.padded[3]),
        )
        cropped = source
        if (h0, h1, w0, w1) != (0, plan.padded[2], 0, plan.padded[3]):
            shape = [*plan.padded[:2], h1 - h0, w1 - w0]
            cropped = ed.var(f"{conv.name}_crop", conv.x.dtype, shape)
            add_slice(ed, source, cropped, [h0, w0], [h1, w1], [2, 3])
        part = conv.weight[:, :, rows[0] : rows[1] + 1, cols[0] : cols[1] + 1]
        tile = ed.const(f"{conv.name}_tile", np.ascontiguousarray(part))
        convs.append(([cropped, tile], _tile_attrs(conv.attrs, _unpadded(rows), _unpadded(cols))))
    return convs


def _unpadded(taps: tuple[int, int]) -> Tile:
    """A cropped tile as a `Tile` that owns all its taps and needs no padding."""
    return (taps[0], taps[1], taps[0], 0, 0)
