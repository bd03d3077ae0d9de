"""Patchify convolutions as SpaceToDepth and a 1×1 Conv: patch-conv-to-space-to-depth.

A Conv whose kernel equals its stride (no padding, no dilation) reads every input pixel once,
in non-overlapping patches: ViT / DeiT / Swin patch embeddings (16×16 / 4×4), SegFormer's
sequence reduction (8×8), ConvNeXt stems. An MLA with a stride limit (rk3588: 1..7) or a kernel
limit rejects the large ones. SpaceToDepth moves each patch into the channels (a DMA move) and a
1×1 Conv with the same weights, reordered, computes the same sums: exact up to float summation
order.
"""

from __future__ import annotations

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
    probe_reshape,
)


def space_to_depth_weight(weight: np.ndarray) -> np.ndarray:
    """A [M, C, b, b] patch kernel as the [M, b·b·C, 1, 1] kernel over SpaceToDepth(b)'s output,
    whose channel (i·b + j)·C + c holds pixel (i, j) of channel c's patch (ONNX's order)."""
    m, c, b, _ = weight.shape
    return np.ascontiguousarray(weight.transpose(0, 2, 3, 1).reshape(m, b * b * c, 1, 1))


def plain_conv(pat: Pattern, node: int) -> tuple[tuple, tuple, list[int]] | None:
    """(input shape, weight shape, strides) of a 2-D Conv of a float run-time input by constant
    weights, one group, no padding or dilation: the Convs a space-to-depth move can take."""
    read = conv_by_constant_weights(pat, node)
    if read is None:
        return None
    shape, weight = read
    attrs = pat.attrs(node)
    if int(attrs.get("group", 1)) != 1 or any(attrs.get("pads", [0] * 4)):
        return None
    if any(d != 1 for d in attrs.get("dilations", [1, 1])):
        return None
    if attrs.get("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        return None
    return shape, weight, (list(attrs.get("strides", [1, 1])) + [1, 1])[:2]


@register
class PatchConvToSpaceToDepth(GraphRule):
    """Rewrite a Conv with kernel = stride (square, no padding or dilation, one group) as
    SpaceToDepth(stride) followed by a 1×1 Conv with the weights reordered (bias unchanged).

    Only Convs the target keeps off its MLA are matched, on 4-D inputs whose height and width
    the stride divides (the patches then tile the input exactly).
    """

    name = "patch-conv-to-space-to-depth"
    suggest_for = frozenset({"Conv"})
    summary = "Conv with kernel = stride (patch embedding) → SpaceToDepth + 1×1 Conv."
    category = "replace"
    example = "surgery apply patch-conv-to-space-to-depth segformer.onnx -t rk3588 -w ws"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for node in pat.blocked("Conv"):
            block = self._block(pat, node)
            if block is None:
                continue
            ins, y = pat.ins(node), pat.outs(node)[0]
            n, c, h, w = pat.shape(ins[0])
            moved = TensorSpec((n, c * block * block, h // block, w // block))
            weight = pat.shape(ins[1])
            kernel = TensorSpec.const(np.zeros((weight[0], c * block * block, 1, 1), np.float32))
            bias = [pat.spec(ins[2])] if len(ins) > 2 and ins[2] else []
            main = [
                probe_node(ctx, "SpaceToDepth", [pat.spec(ins[0])], [moved], {"blocksize": block}),
                probe_node(ctx, "Conv", [moved, kernel, *bias], [pat.spec(y)]),
            ]
            found.append(
                self.match(
                    [pat.name(node)],
                    f"Conv {pat.name(node)} ({block}×{block} patches) → SpaceToDepth({block}) "
                    "+ 1×1 Conv",
                    net_freed(ctx, [pat.name(node)], main),
                    block=block,
                )
            )
        return found

    @staticmethod
    def _block(pat: Pattern, node: int) -> int | None:
        """The patch size of a patchify Conv, or None when the node is not one."""
        plain = plain_conv(pat, node)
        if plain is None:
            return None
        shape, weight, strides = plain
        block = weight[2]
        if weight[3] != block or block < 2 or strides != [block] * 2:
            return None
        if shape[2] % block or shape[3] % block:
            return None
        return int(block)

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        node = ed.node_named(match.nodes[0])
        assert node is not None
        weight = ed.value(node.inputs[1])
        if weight is None:
            return False
        block = match.data["block"]
        x, y = node.inputs[0], node.outputs[0]
        rest = list(node.inputs[2:])
        ed.detach(node)
        moved = ed.op("SpaceToDepth", "patches", [x], None, x.dtype, blocksize=block)
        kernel = ed.const("patch_weight", space_to_depth_weight(np.asarray(weight)))
        ed.node("Conv", "patch_conv", [moved, kernel, *rest], [y], kernel_shape=[1, 1])
        return True


def strided_weight(weight: np.ndarray, stride: int, square: bool) -> np.ndarray:
    """A [M, C, kh, kw] kernel of stride s (kernel a multiple of s) as the stride-1 kernel over
    the space-to-depth input: square, SpaceToDepth(s)'s channel (i·s + j)·C + c and taps
    [kh/s, kw/s]; along the width only, channel c·s + j and taps [1, kw/s]."""
    m, c, kh, kw = weight.shape
    if square:
        split = weight.reshape(m, c, kh // stride, stride, kw // stride, stride)
        moved = split.transpose(0, 3, 5, 1, 2, 4)
        return np.ascontiguousarray(
            moved.reshape(m, stride * stride * c, kh // stride, kw // stride)
        )
    split = weight.reshape(m, c, kw // stride, stride)
    return np.ascontiguousarray(split.transpose(0, 1, 3, 2).reshape(m, c * stride, 1, kw // stride))


@register
class StridedConvToSpaceToDepth(GraphRule):
    """Rewrite a Conv whose stride the MLA rejects (rk3588: 1..7) and whose kernel is a
    multiple of the stride — audio codecs' downsampling convolutions (EnCodec, DAC, SEANet:
    kernel 2·s along the time axis), large overlapping patch stems — as a space-to-depth move
    and a stride-1 Conv over it with the weights reordered (bias unchanged).

    Square strides use SpaceToDepth(s) and a [kh/s, kw/s] kernel; a stride along the width of a
    1-D signal ([N, C, 1, W], kernel [1, kw]) uses Reshape [N, C, W/s, s], Transpose and Reshape
    [N, C·s, 1, W/s] and a [1, kw/s] kernel. The stride must divide the input (each output reads
    whole blocks); no padding, dilation or groups. Patch convolutions (kernel = stride) are
    `patch-conv-to-space-to-depth`'s."""

    name = "strided-conv-to-space-to-depth"
    suggest_for = frozenset({"Conv"})
    summary = "Conv of a large stride s, kernel a multiple of s → space-to-depth + stride-1 Conv."
    category = "replace"
    example = "surgery apply strided-conv-to-space-to-depth encodec.onnx -t rk3588"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for node in pat.blocked("Conv"):
            geometry = self._geometry(pat, node)
            if geometry is None:
                continue
            stride, square = geometry
            ins, y = pat.ins(node), pat.outs(node)[0]
            n, c, h, w = pat.shape(ins[0])
            m, _, kh, kw = pat.shape(ins[1])
            if square:
                moved = TensorSpec((n, c * stride * stride, h // stride, w // stride))
                moves = [
                    probe_node(
                        ctx, "SpaceToDepth", [pat.spec(ins[0])], [moved], {"blocksize": stride}
                    )
                ]
            else:
                blocks = TensorSpec((n, c, w // stride, stride))
                swapped = TensorSpec((n, c, stride, w // stride))
                moved = TensorSpec((n, c * stride, 1, w // stride))
                moves = [
                    probe_reshape(ctx, pat.spec(ins[0]), blocks),
                    probe_node(ctx, "Transpose", [blocks], [swapped], {"perm": [0, 1, 3, 2]}),
                    probe_reshape(ctx, swapped, moved),
                ]
            taps = (kh // stride if square else 1, kw // stride)
            kernel = TensorSpec.const(np.zeros((m, moved.shape[1], *taps), np.float32))
            bias = [pat.spec(ins[2])] if len(ins) > 2 and ins[2] else []
            main = [*moves, probe_node(ctx, "Conv", [moved, kernel, *bias], [pat.spec(y)])]
            found.append(
                self.match(
                    [pat.name(node)],
                    f"Conv {pat.name(node)} (stride {stride}, kernel {kh}×{kw}) → "
                    f"space-to-depth({stride}) + stride-1 {taps[0]}×{taps[1]} Conv",
                    net_freed(ctx, [pat.name(node)], main),
                    stride=stride,
                    square=square,
                )
            )
        return found

    @staticmethod
    def _geometry(pat: Pattern, node: int) -> tuple[int, bool] | None:
        """(stride, square) of a Conv this rule rewrites, or None."""
        plain = plain_conv(pat, node)
        if plain is None:
            return None
        shape, weight, (sh, sw) = plain
        _, _, kh, kw = weight
        if sh == sw >= 2 and (kh, kw) != (sh, sw):
            square = True
            if kh % sh or kw % sw or shape[2] % sh or shape[3] % sw:
                return None
        elif sh == 1 and sw >= 2 and shape[2] == 1 and kh == 1:
            square = False
            if kw % sw or shape[3] % sw:
                return None
        else:
            return None
        return int(sw), square

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        node = ed.node_named(match.nodes[0])
        assert node is not None
        weight = ed.value(node.inputs[1])
        if weight is None:
            return False
        stride, square = match.data["stride"], match.data["square"]
        x, y = node.inputs[0], node.outputs[0]
        n, c, _, w = x.shape
        rest = list(node.inputs[2:])
        ed.detach(node)
        kernel = strided_weight(np.asarray(weight), stride, square)
        if square:
            moved = ed.op("SpaceToDepth", "strided_blocks", [x], None, x.dtype, blocksize=stride)
        else:
            shapes = ([n, c, w // stride, stride], [n, c * stride, 1, w // stride])
            targets = [ed.const("strided_shape", np.array(s, np.int64)) for s in shapes]
            blocks = ed.op("Reshape", "strided_blocks", [x, targets[0]], shapes[0], x.dtype)
            swapped = ed.op(
                "Transpose",
                "strided_phases",
                [blocks],
                [n, c, stride, w // stride],
                x.dtype,
                perm=[0, 1, 3, 2],
            )
            moved = ed.op("Reshape", "strided_channels", [swapped, targets[1]], shapes[1], x.dtype)
        ed.node(
            "Conv",
            "strided_conv",
            [moved, ed.const("strided_weight", kernel), *rest],
            [y],
            kernel_shape=list(kernel.shape[2:]),
        )
        return True
