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
    net_freed,
    probe_node,
)


def space_to_depth_weight(weight: np.ndarray) -> np.ndarray:
    """A [M, C, b, b] patch kernel as the [M, b·b·C, 1, 1] kernel over SpaceToDepth(b)'s output,
    whose channel (i·b + j)·C + c holds pixel (i, j) of channel c's patch (ONNX's order)."""
    m, c, b, _ = weight.shape
    return np.ascontiguousarray(weight.transpose(0, 2, 3, 1).reshape(m, b * b * c, 1, 1))


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
        ins = pat.ins(node)
        shape = pat.shape(ins[0])
        weight = pat.shape(ins[1])
        if shape is None or weight is None or len(shape) != 4 or len(weight) != 4:
            return None
        if not pat.is_float(ins[0]) or pat.is_const(ins[0]) or not pat.is_const(ins[1]):
            return None
        if len(ins) > 2 and ins[2] and not pat.is_const(ins[2]):
            return None
        attrs = pat.attrs(node)
        block = weight[2]
        if weight[3] != block or block < 2 or list(attrs.get("strides", [1, 1])) != [block] * 2:
            return None
        if int(attrs.get("group", 1)) != 1 or any(attrs.get("pads", [0] * 4)):
            return None
        if any(d != 1 for d in attrs.get("dilations", [1, 1])):
            return None
        if attrs.get("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
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
