"""Kernel taps that only ever read the zero padding: conv-drop-padding-taps.

A dilated Conv whose dilation reaches past the feature map reads zeros through every tap but a
few: DeepLabV3's ASPP branches (3×3, dilation 12/24/36, padding = dilation) on the 20×20 map of
a 320×320 input read the image through the centre tap only, at every output position. Those
taps multiply zeros, so dropping them changes nothing, and the Conv shrinks to the live taps
with the padding reduced by what they no longer reach — a 1×1 Conv without padding for the
24 and 36 branches. An MLA with a padding or dilation limit (rk3588: pads ≤ 15) rejects the
original and runs the result.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from surgery.rules.base import Match, RuleContext, RuleParams
from surgery.rules.registry import register
from surgery.rules.replace_common import (
    Editor,
    GraphRule,
    Pattern,
    TensorSpec,
    conv_by_constant_weights,
    net_freed,
    probe_node,
)


@dataclass
class Trim:
    """The live taps [first, last] of each spatial axis and the Conv attributes after the trim."""

    first: list[int]
    last: list[int]
    kernel: list[int]
    pads: list[int]
    dilations: list[int]


def live_taps(size: int, out: int, kernel: int, stride: int, dilation: int, pad: int) -> list[int]:
    """Taps of one spatial axis that read inside the input for at least one output position.

    Output o reads input o·stride − pad + t·dilation through tap t; the positions a tap reads
    form one interval, which moves right with t, so the live taps are one run.
    """
    live = []
    for t in range(kernel):
        lo = t * dilation - pad
        hi = (out - 1) * stride + lo
        if hi >= 0 and lo < size:
            live.append(t)
    return live


def plan_trim(shape: list[int], out: list[int], kernel: list[int], attrs: dict) -> Trim | None:
    """The trim of a 2-D Conv (None when every tap is live, none is, or the reduced padding
    would be negative)."""
    strides = list(attrs.get("strides", [1, 1]))
    dilations = list(attrs.get("dilations", [1, 1]))
    pads = list(attrs.get("pads", [0, 0, 0, 0]))
    first, last, new_kernel, new_pads, new_dilations = [], [], [], [0] * 4, []
    for a in range(2):
        live = live_taps(shape[a], out[a], kernel[a], strides[a], dilations[a], pads[a])
        if not live:
            return None
        t0, t1 = live[0], live[-1]
        begin = pads[a] - t0 * dilations[a]
        end = pads[a + 2] - (kernel[a] - 1 - t1) * dilations[a]
        if begin < 0 or end < 0:
            return None
        first.append(t0)
        last.append(t1)
        new_kernel.append(t1 - t0 + 1)
        new_pads[a], new_pads[a + 2] = begin, end
        new_dilations.append(dilations[a] if t1 > t0 else 1)
    if new_kernel == list(kernel):
        return None
    return Trim(first, last, new_kernel, new_pads, new_dilations)


@register
class ConvDropPaddingTaps(GraphRule):
    """Drop the kernel taps of a 2-D Conv that read only zero padding at every output position,
    keeping the live ones with the padding reduced to match (same output size and values).

    Only Convs the target keeps off its MLA are matched, when the trimmed Conv runs there: a
    dilated ASPP branch whose dilation reaches past the feature map becomes a 1×1 Conv. Exact:
    the dropped taps only ever multiply zeros.
    """

    name = "conv-drop-padding-taps"
    suggest_for = frozenset({"Conv"})
    summary = "Conv taps that only read zero padding (dilated ASPP on a small map) are dropped."
    category = "replace"
    example = "surgery apply conv-drop-padding-taps deeplabv3.onnx -t rk3588 -w ws"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for node in pat.blocked("Conv"):
            trim = self._trim(pat, node)
            if trim is None:
                continue
            ins, y = pat.ins(node), pat.outs(node)[0]
            weight = pat.shape(ins[1])
            kernel = TensorSpec.const(np.zeros((*weight[:2], *trim.kernel), np.float32))
            bias = [pat.spec(ins[2])] if len(ins) > 2 and ins[2] else []
            attrs = {**pat.attrs(node), **self._attrs(trim)}
            probe = probe_node(ctx, "Conv", [pat.spec(ins[0]), kernel, *bias], [pat.spec(y)], attrs)
            size = "×".join(map(str, weight[2:]))
            found.append(
                self.match(
                    [pat.name(node)],
                    f"Conv {pat.name(node)}: only the {'×'.join(map(str, trim.kernel))} taps of "
                    f"its {size} kernel read the input → pads {trim.pads}",
                    net_freed(ctx, [pat.name(node)], [probe]),
                    trim=asdict(trim),
                )
            )
        return found

    @staticmethod
    def _trim(pat: Pattern, node: int) -> Trim | None:
        read = conv_by_constant_weights(pat, node)
        out = pat.shape(pat.outs(node)[0])
        if read is None or out is None:
            return None
        shape, weight = read
        attrs = pat.attrs(node)
        if attrs.get("auto_pad", "NOTSET") != "NOTSET":
            return None
        if len(out) != 4 or len(attrs.get("pads", [0] * 4)) != 4:
            return None  # a declared output or pads that do not fit a 2-D Conv: malformed
        return plan_trim(list(shape[2:]), list(out[2:]), list(weight[2:]), attrs)

    @staticmethod
    def _attrs(trim: Trim) -> dict:
        return {"kernel_shape": trim.kernel, "pads": trim.pads, "dilations": trim.dilations}

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        node = ed.node_named(match.nodes[0])
        assert node is not None
        weight = ed.value(node.inputs[1])
        if weight is None:
            return False
        trim = Trim(**match.data["trim"])
        (h0, w0), (h1, w1) = trim.first, trim.last
        kept = np.ascontiguousarray(np.asarray(weight)[:, :, h0 : h1 + 1, w0 : w1 + 1])
        node.inputs[1] = ed.const("live_taps", kept)
        node.attrs.update(self._attrs(trim))
        return True
