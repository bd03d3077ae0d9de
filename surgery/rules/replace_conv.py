"""Convolutions whose kernel the MLA rejects, as sums of convolutions it runs: conv-kernel-split.

RK3588's NPU runs depthwise kernels up to 8×8 only, while EdgeNeXt (9×9 in its last stage) and
other large-kernel networks use larger ones. A convolution is linear in its kernel: split the
kernel into tiles, convolve with each (padding shifted so every tile reads the input rows its
taps read in the original), and add the results. Equal up to float summation order.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from surgery.rules.base import Match, RuleContext, RuleParams
from surgery.rules.registry import register
from surgery.rules.replace_common import (
    Editor,
    GraphRule,
    Pattern,
    TensorSpec,
    constant_array,
    net_freed,
    probe_node,
)

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

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        node = ed.node_named(match.nodes[0])
        assert node is not None
        x, w, y = node.inputs[0], node.inputs[1], node.outputs[0]
        bias = node.inputs[2] if len(node.inputs) > 2 and node.inputs[2].name else None
        weight = ed.value(w)
        assert weight is not None
        attrs = dict(node.attrs)
        ed.detach(node)
        tiles = [[tuple(t) for t in axis] for axis in match.data["tiles"]]
        total = None
        pairs = _pairs(tiles)
        for k, (rows, cols) in enumerate(pairs):
            part = np.zeros((*weight.shape[:2], rows[1] - rows[0] + 1, cols[1] - cols[0] + 1))
            r_own, c_own = rows[2], cols[2]
            part[:, :, r_own - rows[0] :, c_own - cols[0] :] = weight[
                :, :, r_own : rows[1] + 1, c_own : cols[1] + 1
            ]
            inputs = [x, ed.const(f"{node.name}_tile", part.astype(weight.dtype))]
            if k == 0 and bias is not None:
                inputs.append(bias)
            tile_attrs = _tile_attrs(attrs, rows, cols)
            last = k == len(pairs) - 1
            if total is None:
                total = ed.op("Conv", f"{node.name}_tile", inputs, y.shape, y.dtype, **tile_attrs)
                continue
            conv = ed.op("Conv", f"{node.name}_tile", inputs, y.shape, y.dtype, **tile_attrs)
            if last:
                ed.node("Add", f"{node.name}_sum", [total, conv], [y])
            else:
                total = ed.op("Add", f"{node.name}_sum", [total, conv], y.shape, y.dtype)
        return True


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
