"""Padding folded into the window ops: pad-into-conv, maxpool-ceil-to-pad,
avgpool-count-include-pad. Each keeps every output element identical (the pooling variants
only change how the edge windows are described)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from surgery.rules.base import Match, RuleContext, RuleParams
from surgery.rules.registry import register
from surgery.rules.replace_common import (
    Editor,
    GraphRule,
    Pattern,
    TensorSpec,
    model_opset,
    net_freed,
    probe_node,
)


def read_pad(
    attrs: Mapping[str, Any],
    inputs: Sequence[str],
    value: Callable[[str], np.ndarray | None],
    opset: int,
    rank: int,
) -> tuple[str, list[int]] | None:
    """A Pad node's mode and full [begin…, end…] list over its `rank` axes, from its attributes
    (opset < 11) or its constant inputs (`value` reads a constant by name; the `axes` input of
    opset 18 spread over all axes); None when they are not constant. The one reader of Pad
    amounts (rules read them through `pad_mode_and_amounts`, the rank lifts directly)."""
    mode = str(attrs.get("mode", "constant"))
    if opset < 11:
        pads = [int(p) for p in attrs.get("pads", [])]
    else:
        raw = value(inputs[1]) if len(inputs) > 1 and inputs[1] else None
        if raw is None:
            return None
        pads = [int(p) for p in raw.reshape(-1)]
        if len(inputs) > 3 and inputs[3]:
            axes = value(inputs[3])
            if axes is None:
                return None
            n = axes.size
            full = [0] * (2 * rank)
            for k, a in enumerate(int(a) % rank for a in axes.reshape(-1)):
                full[a], full[a + rank] = pads[k], pads[k + n]
            pads = full
    return (mode, pads) if len(pads) == 2 * rank else None


def pad_mode_and_amounts(pat: Pattern, node: int, rank: int) -> tuple[str, list[int]] | None:
    """`read_pad` of a node of the pattern's model."""
    return read_pad(pat.attrs(node), pat.ins(node), pat.value, model_opset(pat.ctx), rank)


def _pad_amounts(pat: Pattern, node: int, rank: int) -> list[int] | None:
    """The Pad node's full [begin…, end…] list, when it pads with the constant 0; else None."""
    read = pad_mode_and_amounts(pat, node, rank)
    if read is None or read[0] != "constant":
        return None
    ins = pat.ins(node)
    if model_opset(pat.ctx) < 11:
        value = float(pat.attrs(node).get("value", 0.0))
    elif len(ins) > 2 and ins[2]:
        scalar = pat.scalar(ins[2])
        if scalar is None:
            return None
        value = scalar
    else:
        value = 0.0
    return read[1] if value == 0.0 else None


def _spatial(pads: Sequence[int], rank: int) -> list[int]:
    """Pad's [begin…, end…] over all axes → a Conv/pool `pads` over the spatial axes."""
    return [*pads[2:rank], *pads[rank + 2 : 2 * rank]]


@register
class PadIntoConv(GraphRule):
    """Fold a zero-valued constant Pad into the Convs that read it, as their `pads` attribute.

    A Conv with explicit padding zero-pads the same way, so Pad + Conv = Conv with the pads
    added: one op fewer and no padded copy of the feature map in memory. Only spatial padding,
    non-negative amounts, value 0, and only when every reader of the padded tensor is a Conv
    (with explicit, not auto, padding).
    """

    name = "pad-into-conv"
    suggest_for = frozenset({"Pad", "Conv"})  # a match frees only its Pad and Convs
    summary = "Pad(constant 0) followed by Conv → the Conv's own pads."
    category = "replace"
    example = "surgery apply pad-into-conv model.onnx"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for pad in pat.nodes("Pad"):
            x, padded = pat.ins(pad)[0], pat.outs(pad)[0]
            rank = pat.view.tensor(x).rank
            convs = pat.consumers(padded)
            if rank is None or rank < 3 or not convs or padded in pat.outputs:
                continue
            pads = _pad_amounts(pat, pad, rank)
            if (
                pads is None
                or any(p < 0 for p in pads)
                or any(pads[a] or pads[a + rank] for a in (0, 1))
            ):
                continue
            plans = [self._conv_pads(pat, c, padded, _spatial(pads, rank)) for c in convs]
            if any(p is None for p in plans):
                continue
            probes = [
                probe_node(
                    ctx,
                    "Conv",
                    [pat.spec(x), *(pat.spec(t) for t in pat.ins(c)[1:])],
                    [pat.spec(pat.outs(c)[0])],
                    {**pat.attrs(c), "pads": new},
                )
                for c, new in zip(convs, plans, strict=True)
            ]
            names = [pat.name(pad), *(pat.name(c) for c in convs)]
            found.append(
                self.match(
                    names,
                    f"Pad {pat.name(pad)} folds into {len(convs)} Conv(s)",
                    net_freed(ctx, names, probes),
                    pads={pat.name(c): p for c, p in zip(convs, plans, strict=True)},
                )
            )
        return found

    @staticmethod
    def _conv_pads(pat: Pattern, conv: int, padded: str, extra: list[int]) -> list[int] | None:
        if pat.op(conv) != "Conv" or pat.ins(conv)[0] != padded or padded in pat.ins(conv)[1:]:
            return None
        attrs = pat.attrs(conv)
        if attrs.get("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
            return None
        old = list(attrs.get("pads", [0] * len(extra)))
        return [a + b for a, b in zip(old, extra, strict=True)] if len(old) == len(extra) else None

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        pad = ed.node_named(match.nodes[0])
        assert pad is not None
        x = pad.inputs[0]
        for name, pads in match.data["pads"].items():
            conv = ed.node_named(name)
            if conv is None:
                return False
            conv.inputs[0] = x
            conv.attrs["pads"] = list(pads)
            conv.attrs.pop("auto_pad", None)
        ed.detach(pad)
        return True


def _window_attrs(attrs: dict, n: int) -> tuple[list[int], list[int], list[int], list[int]]:
    kernel = list(attrs["kernel_shape"])
    strides = list(attrs.get("strides", [1] * n))
    dilations = list(attrs.get("dilations", [1] * n))
    pads = list(attrs.get("pads", [0] * (2 * n)))
    return kernel, strides, dilations, pads


@register
class MaxPoolCeilToPad(GraphRule):
    """Rewrite MaxPool with ceil_mode=1 as ceil_mode=0 with extra end padding.

    Ceil mode adds a last, partial window on each spatial axis. Padding the end by just enough
    for floor mode to produce the same output size gives the same windows; MaxPool ignores
    padded positions (they are never the maximum — not zeros), so every output is identical.
    Applied only when the shapes are static and every window still starts inside the input.
    Only nodes the target keeps off its MLA are matched.
    """

    name = "maxpool-ceil-to-pad"
    suggest_for = frozenset({"MaxPool"})
    summary = "MaxPool ceil_mode=1 → ceil_mode=0 with explicit end padding (identical results)."
    category = "replace"
    example = "surgery apply maxpool-ceil-to-pad model.onnx --target rk3588"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for node in pat.blocked("MaxPool"):
            attrs = pat.attrs(node)
            x, y = pat.ins(node)[0], pat.outs(node)[0]
            xs, ys = pat.shape(x), pat.shape(y)
            if not attrs.get("ceil_mode", 0) or xs is None or ys is None:
                continue
            if attrs.get("auto_pad", "NOTSET") != "NOTSET" or not pat.unused_extra_outputs(node):
                continue
            pads = self._floor_pads(attrs, xs[2:], ys[2:])
            if pads is None:
                continue
            new = {**attrs, "ceil_mode": 0, "pads": pads}
            probe = probe_node(ctx, "MaxPool", [pat.spec(x)], [pat.spec(y)], new)
            found.append(
                self.match(
                    [pat.name(node)],
                    f"MaxPool {pat.name(node)}: ceil_mode → pads {pads}",
                    net_freed(ctx, [pat.name(node)], [probe]),
                    pads=pads,
                )
            )
        return found

    @staticmethod
    def _floor_pads(attrs: dict, ins: Sequence[int], outs: Sequence[int]) -> list[int] | None:
        n = len(ins)
        kernel, strides, dilations, pads = _window_attrs(attrs, n)
        new = list(pads)
        for i in range(n):
            span = (kernel[i] - 1) * dilations[i] + 1
            if (outs[i] - 1) * strides[i] - pads[i] >= ins[i]:
                return None  # the last window would start in the padding
            extra = max(0, (outs[i] - 1) * strides[i] + span - (ins[i] + pads[i] + pads[i + n]))
            new[i + n] += extra
            if (ins[i] + new[i] + new[i + n] - span) // strides[i] + 1 != outs[i]:
                return None
        return new

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        node = ed.node_named(match.nodes[0])
        assert node is not None
        node.attrs["ceil_mode"] = 0
        node.attrs["pads"] = list(match.data["pads"])
        return True


@register
class MaxPoolToChain(GraphRule):
    """Split a stride-1 "same" MaxPool whose kernel the MLA rejects into a chain of smaller
    ones (SPP's 9×9 and 13×13 pools on an MLA that pools at most 7×7).

    With stride 1 and (k − 1)/2 padding each side, MaxPool(a) then MaxPool(b) takes the max
    over a window of a + b − 1 clipped to the input, exactly what MaxPool(a + b − 1) takes
    (padding never wins a max). The chain uses the largest odd kernel the target accepts and
    one smaller remainder, per axis; every output is identical.
    """

    name = "maxpool-to-chain"
    suggest_for = frozenset({"MaxPool"})
    summary = "Stride-1 MaxPool with a kernel the MLA rejects → a chain of smaller MaxPools."
    category = "replace"
    example = "surgery apply maxpool-to-chain yolox_s.onnx --target rk3588"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for node in pat.blocked("MaxPool"):
            kernel = self._same_kernel(pat, node)
            x = pat.ins(node)[0]
            if kernel is None or pat.shape(x) is None:
                continue
            chain = self._chain(ctx, pat.spec(x), kernel)
            if chain is None:
                continue
            probes = [
                probe_node(ctx, "MaxPool", [pat.spec(x)], [pat.spec(x)], _same(k)) for k in chain
            ]
            found.append(
                self.match(
                    [pat.name(node)],
                    f"MaxPool {pat.name(node)} {kernel} → {' → '.join(map(str, chain))}",
                    net_freed(ctx, [pat.name(node)], probes),
                    chain=chain,
                )
            )
        return found

    @staticmethod
    def _same_kernel(pat: Pattern, node: int) -> list[int] | None:
        """The kernel of a 2-D, stride-1, undilated MaxPool padded (k − 1)/2 on every side
        (odd k), whose Indices output is unused; else None."""
        attrs = pat.attrs(node)
        if attrs.get("auto_pad", "NOTSET") != "NOTSET" or not pat.unused_extra_outputs(node):
            return None
        kernel = list(attrs.get("kernel_shape", []))
        if len(kernel) != 2 or any(k % 2 == 0 for k in kernel):
            return None
        _, strides, dilations, pads = _window_attrs(attrs, 2)
        if any(v != 1 for v in (*strides, *dilations)):
            return None
        return kernel if pads == [(k - 1) // 2 for k in kernel] * 2 else None

    @staticmethod
    def _chain(ctx: RuleContext, spec: TensorSpec, kernel: list[int]) -> list[list[int]] | None:
        """Kernels whose composition is `kernel`: as many of the largest accepted odd size as
        fit, then the odd remainder, per axis (1 where an axis is done); None if none fits."""
        largest = next(
            (
                m
                for m in range(max(kernel) - 2, 2, -2)
                if probe_node(ctx, "MaxPool", [spec], [spec], _same([m, m])) is None
            ),
            None,
        )
        if largest is None:
            return None
        per_axis = []
        for k in kernel:
            parts, left = [], k - 1  # a chain of kernels k_i covers 1 + Σ (k_i − 1)
            while left > 0:
                step = min(largest - 1, left)
                parts.append(step + 1)
                left -= step
            per_axis.append(parts)
        return _chain_steps(per_axis)

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        node = ed.node_named(match.nodes[0])
        assert node is not None
        x, y = node.inputs[0], node.outputs[0]
        chain = match.data["chain"]
        ed.detach(node)
        current = x
        for k, kernel in enumerate(chain):
            last = k == len(chain) - 1
            out = y if last else ed.var(f"{node.name}_part{k}", x.dtype, x.shape)
            ed.node("MaxPool", f"{node.name}_part{k}", [current], [out], **_same(kernel))
            current = out
        return True


@register
class AvgPoolToChain(GraphRule):
    """Split an AveragePool whose windows tile the input (kernel = strides, no padding, every
    axis divisible) and whose kernel the MLA rejects into a chain of AveragePools whose
    kernels multiply to it.

    The mean of k1·k2 consecutive elements is the mean over k2 consecutive means of k1: each
    pool of the chain again tiles its input. NextViT's E-MHSA reduces its keys by a 1-D average
    pool of kernel 16 over the tokens, past rk3588's kernel limit of 7; 4 then 4 is the same
    mean. Equal up to float rounding of the sums.
    """

    name = "avgpool-to-chain"
    suggest_for = frozenset({"AveragePool"})
    summary = (
        "Tiling AveragePool with a kernel the MLA rejects → a chain whose kernels multiply to it."
    )
    category = "replace"
    example = "surgery apply avgpool-to-chain nextvit_small.onnx --target rk3588"
    op = "AveragePool"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for node in pat.blocked(self.op):
            if not pat.unused_extra_outputs(node):
                continue  # MaxPool's Indices
            x = pat.ins(node)[0]
            shape, kernel = pat.shape(x), self._tiling_kernel(pat, node)
            if shape is None or kernel is None or len(shape) != 4:
                continue
            if any(size % k for size, k in zip(shape[2:], kernel, strict=True)):
                continue
            chain = self._chain(ctx, pat.spec(x), kernel)
            if chain is None:
                continue
            probes, current = [], tuple(shape)
            for step in chain:
                smaller = (*current[:2], current[2] // step[0], current[3] // step[1])
                attrs = {"kernel_shape": list(step), "strides": list(step)}
                probes.append(
                    probe_node(ctx, self.op, [TensorSpec(current)], [TensorSpec(smaller)], attrs)
                )
                current = smaller
            found.append(
                self.match(
                    [pat.name(node)],
                    f"{self.op} {pat.name(node)} {kernel} → {' → '.join(map(str, chain))}",
                    net_freed(ctx, [pat.name(node)], probes),
                    chain=chain,
                )
            )
        return found

    @staticmethod
    def _tiling_kernel(pat: Pattern, node: int) -> list[int] | None:
        """The kernel of a 2-D pool with strides equal to it, no padding, no dilation,
        floor mode; else None."""
        attrs = pat.attrs(node)
        if attrs.get("auto_pad", "NOTSET") != "NOTSET" or attrs.get("ceil_mode", 0):
            return None
        kernel = list(attrs.get("kernel_shape", []))
        if len(kernel) != 2:
            return None
        _, strides, dilations, pads = _window_attrs(attrs, 2)
        if strides != kernel or any(d != 1 for d in dilations) or any(pads):
            return None
        return kernel

    def _chain(
        self, ctx: RuleContext, spec: TensorSpec, kernel: list[int]
    ) -> list[list[int]] | None:
        """Per step (kh, kw): each axis's kernel as a product of the largest factors the target
        accepts on that axis (1 where an axis is done); None if some factor is never accepted."""

        def accepted(axis: int, k: int) -> bool:
            window = [k, 1] if axis == 0 else [1, k]
            attrs = {"kernel_shape": window, "strides": window}
            return probe_node(ctx, self.op, [spec], [spec], attrs) is None

        per_axis = []
        for axis, k in enumerate(kernel):
            parts = []
            while k > 1:
                factor = next(
                    (d for d in range(k, 1, -1) if k % d == 0 and accepted(axis, d)), None
                )
                if factor is None:
                    return None
                parts.append(factor)
                k //= factor
            per_axis.append(parts)
        if max(len(parts) for parts in per_axis) < 2:
            return None  # the kernel itself is accepted: not this rule's case
        return _chain_steps(per_axis)

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        node = ed.node_named(match.nodes[0])
        assert node is not None
        x, y = node.inputs[0], node.outputs[0]
        ed.detach(node)
        chain = match.data["chain"]
        current = x
        for k, step in enumerate(chain):
            attrs = {"kernel_shape": list(step), "strides": list(step)}
            base = f"{self.op.lower()}_step"
            if k == len(chain) - 1:
                ed.node(self.op, base, [current], [y], **attrs)
            else:
                current = ed.op(self.op, base, [current], None, x.dtype, **attrs)
        return True


@register
class TilingMaxPoolToChain(AvgPoolToChain):
    """Split a MaxPool whose windows tile the input (kernel = strides, no padding, every axis
    divisible) and whose kernel the MLA rejects into a chain of MaxPools whose kernels multiply
    to it.

    The max of k1·k2 consecutive elements is the max over k2 consecutive maxes of k1. A CRNN
    collapses its feature map's height with one MaxPool of kernel [8, 1] (rk3588's limit is 7);
    4 then 2 is the same max. Exact. Stride-1 "same" MaxPools are maxpool-to-chain's.
    """

    name = "tiling-maxpool-to-chain"
    suggest_for = frozenset({"MaxPool"})
    summary = "Tiling MaxPool with a kernel the MLA rejects → a chain whose kernels multiply to it."
    example = "surgery apply tiling-maxpool-to-chain crnn.onnx --target rk3588"
    op = "MaxPool"


def _chain_steps(per_axis: list[list[int]]) -> list[list[int]]:
    """Per-axis kernel chains as steps of one 2-D kernel each (1 where an axis is done)."""
    length = max(len(parts) for parts in per_axis)
    padded = [parts + [1] * (length - len(parts)) for parts in per_axis]
    return [list(pair) for pair in zip(*padded, strict=True)]


def _same(kernel: Sequence[int]) -> dict:
    """MaxPool attributes of a stride-1 window `kernel` with "same" padding."""
    return {"kernel_shape": list(kernel), "pads": [(k - 1) // 2 for k in kernel] * 2}


def valid_counts(size: int, out: int, kernel: int, stride: int, pad_begin: int) -> np.ndarray:
    """How many real (non-padding) inputs each output window on one axis covers."""
    starts = np.arange(out) * stride - pad_begin
    return np.clip(starts + kernel, 0, size) - np.clip(starts, 0, size)


@register
class AvgPoolCountIncludePad(GraphRule):
    """Rewrite AveragePool(count_include_pad=0) with padding as AveragePool(count_include_pad=1)
    followed by a Mul with a constant correction map.

    The MLA averages over the whole window, padding included. Excluding padding divides an edge
    window's sum by its count of real inputs instead of the kernel size, so
    avg_excl = avg_incl · (kernel size / real count); the ratio depends only on the output
    position, so it is one constant [1, 1, H_out, W_out] map (1 in the interior). Same sums,
    a different rounding of the divisor: exact to float rounding. Only ceil_mode=0 and no
    dilation (then every window lies inside the padded input, so the include-pad divisor is the
    kernel size).
    Only nodes the target keeps off its MLA are matched.
    """

    name = "avgpool-count-include-pad"
    suggest_for = frozenset({"AveragePool"})
    summary = "AveragePool excluding padding → including padding × a constant correction map."
    category = "replace"
    example = "surgery apply avgpool-count-include-pad model.onnx"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for node in pat.blocked("AveragePool"):
            attrs = pat.attrs(node)
            x, y = pat.ins(node)[0], pat.outs(node)[0]
            xs, ys = pat.shape(x), pat.shape(y)
            if xs is None or ys is None or attrs.get("count_include_pad", 0):
                continue
            n = len(xs) - 2
            kernel, strides, dilations, pads = _window_attrs(attrs, n)
            if attrs.get("ceil_mode", 0) or any(d != 1 for d in dilations) or not any(pads):
                continue
            if attrs.get("auto_pad", "NOTSET") != "NOTSET":
                continue
            correction = self.correction(xs[2:], ys[2:], kernel, strides, pads)
            new = {**attrs, "count_include_pad": 1}
            factor = TensorSpec((1, 1, *ys[2:]), constant=True)
            probes = [
                probe_node(ctx, "AveragePool", [pat.spec(x)], [pat.spec(y)], new),
                probe_node(ctx, "Mul", [pat.spec(y), factor], [pat.spec(y)]),
            ]
            found.append(
                self.match(
                    [pat.name(node)],
                    f"AveragePool {pat.name(node)}: count_include_pad=1 × correction "
                    f"(edge factors up to {correction.max():.3g})",
                    net_freed(ctx, [pat.name(node)], probes),
                )
            )
        return found

    @staticmethod
    def correction(
        ins: Sequence[int],
        outs: Sequence[int],
        kernel: Sequence[int],
        strides: Sequence[int],
        pads: Sequence[int],
    ) -> np.ndarray:
        """kernel size / real count per output position, shaped [1, 1, *outs] (float64)."""
        counts = np.ones((1, 1), np.float64)
        for i, size in enumerate(ins):
            axis = valid_counts(size, outs[i], kernel[i], strides[i], pads[i])
            counts = np.multiply.outer(counts, axis.astype(np.float64))
        return float(np.prod(kernel)) / counts.reshape(1, 1, *outs)

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        node = ed.node_named(match.nodes[0])
        assert node is not None
        x, y = node.inputs[0], node.outputs[0]
        n = len(x.shape) - 2
        kernel, strides, _, pads = _window_attrs(node.attrs, n)
        correction = self.correction(x.shape[2:], y.shape[2:], kernel, strides, pads)
        pooled = ed.var(f"{node.name}_incl", x.dtype, y.shape)
        node.attrs["count_include_pad"] = 1
        node.outputs[0] = pooled
        factor = ed.const(f"{node.name}_correction", correction.astype(x.dtype or np.float32))
        ed.node("Mul", f"{node.name}_exclude_pad", [pooled, factor], [y])
        return True


@register
class WholeMapPoolToGlobal(GraphRule):
    """Rewrite an AveragePool / MaxPool whose one window covers the whole map (kernel at least
    the map, no padding, a 1×1 result) as GlobalAveragePool / GlobalMaxPool.

    Hugging Face's EfficientNet pools with `nn.AvgPool2d(hidden_dim, ceil_mode=True)`: a kernel
    of 1280–2560 over a 7×7 map, past every MLA's kernel limit, that averages the 49 values as
    a global pool does (ONNX Runtime divides a ceil-mode overhang by the values inside).
    Only nodes the target keeps off its MLA are matched.
    """

    name = "whole-map-pool-to-global"
    suggest_for = frozenset({"AveragePool", "MaxPool"})
    summary = "Pool whose one window covers the whole map → GlobalAveragePool / GlobalMaxPool."
    category = "replace"
    example = "surgery apply whole-map-pool-to-global efficientnet.onnx"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for node in pat.blocked("AveragePool", "MaxPool"):
            x, y = pat.ins(node)[0], pat.outs(node)[0]
            xs, ys = pat.shape(x), pat.shape(y)
            attrs = pat.attrs(node)
            if xs is None or ys is None or len(xs) < 3 or any(d != 1 for d in ys[2:]):
                continue
            if not pat.unused_extra_outputs(node) or attrs.get("auto_pad", "NOTSET") != "NOTSET":
                continue
            kernel, _, dilations, pads = _window_attrs(attrs, len(xs) - 2)
            if any(pads) or any(d != 1 for d in dilations):
                continue
            if any(k < size for k, size in zip(kernel, xs[2:], strict=True)):
                continue
            op = "Global" + pat.op(node)
            probe = probe_node(ctx, op, [pat.spec(x)], [pat.spec(y)])
            found.append(
                self.match(
                    [pat.name(node)],
                    f"{pat.op(node)} {pat.name(node)} kernel {list(kernel)} over "
                    f"{list(xs[2:])} → {op}",
                    net_freed(ctx, [pat.name(node)], [probe]),
                    op=op,
                )
            )
        return found

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        return ed.replace_op(match.nodes[0], match.data["op"], "global_pool")
