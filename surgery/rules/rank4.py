"""The reshape-to-4d family: carry rank-1/2/3/5 activations as 4-D so heads stay on the MLA.

The MLA takes 4-D tensors only, so detection heads ([N,C,L] after flattening the grid),
classifier heads ([N,C] after Flatten) and transformers ([B,L,C] tokens) fall to the host and
split the model into several MLA segments. These rules rewrite such regions so every tensor
inside is 4-D and every op is one the MLA runs, without changing a single output value.

How (see `rank4_layout`, `rank4_lift`, `rank4_ops`, `rank4_regions`):

- Each tensor in a region gets a **layout**: which original axes sit on which of the four 4-D
  axes (merged or alone, possibly permuted). Converting between layouts is at most
  Reshape → Transpose → Reshape on 4-D tensors, with the batch axis kept in place.
- Ops are rewritten **per op, by pattern**: elementwise ops get their constant operands
  re-laid-out; Concat/Split/Slice/Softmax/Reduce get their axes remapped; LayerNorm and Softmax
  are moved to axis 1 by choosing a layout where the normalised axis is the channel axis;
  MatMul/Gemm by a constant matrix (x·W, or W·x mixing the channels of a [N,C,L] map) become
  1×1 Convs; Gather with a constant index becomes a Slice; Transpose and unit-axis reshapes
  become nothing (only the layout changes). Two run-time operands that broadcast (a per-head
  gate [1,h,1,H,W] times [1,h,c,H,W]) get a layout in which the broadcast stays 4-D.
- At the region's edges the original tensors are rebuilt under their own names, so the outputs
  keep their names, shapes and values. A reshape back to the output's rank at the end of the
  graph stays on the host: a trailing host stage adds no `.elf`.

Why three rules over one engine: they differ in the layout a rank-3 tensor gets by default,
which decides how few conversions the region needs. Detection heads are channel-first
([N,C,L] → [N,C,1,L]: Concat/Split on channels, Softmax over channels, Slice on anchors stay as
they are). Transformers are token-major ([B,L,C] → [B·L,C,1,1]): ONNX LayerNormalization with
axis=1 normalises axes 1..3 together, so the features must be the *only* non-unit axis there —
[B,C,1,L] would normalise over all tokens at once. With tokens in the batch axis, the 1×1 Conv,
LayerNorm(axis=1) and Softmax(axis=1) compute exactly the per-token ops; attention reshapes
tokens back out of the batch axis with 4-D Reshapes where it needs batched MatMuls.
Rank-5 anchor heads ([1,3,85,H,W]) use the same engine: with at most four non-unit axes a
rank-5 tensor is carried as [3,85,H,W] (anchors on axis 0, the 85 outputs on the channels), so
the channel-last Transpose costs nothing until the final Reshape, and Split/Pow/Mul/Add with the
grid and anchor constants run channel-first on the MLA. Tensors with more non-unit axes (a Swin
window partition [1,nH,h,nW,w,C]) are carried with the axes a Transpose keeps together merged,
so the partition is a 4-D Transpose of slots.

Regions are found from op patterns and the target's own constraints, never from node names; a
region is only proposed when it removes more blockers than the reshapes its edges add. A node
the lift turns out unable to carry (no 4-D layout separates the axis it works on) is left out
and the rest of its region lifted; fix keeps the result only if coverage improves.
"""

from __future__ import annotations

from typing import ClassVar

import onnx_graphsurgeon as gs

from surgery.rules.base import Match, Rule, RuleContext, RuleParams
from surgery.rules.graph_edit import nodes_by_name
from surgery.rules.rank4_lift import Lifter, LiftError, Policy, ncl_policy, rows_policy
from surgery.rules.rank4_ops import SUPPORT
from surgery.rules.rank4_regions import regions
from surgery.rules.registry import register

MAX_LEFT_OUT = 24
"""Nodes a lift leaves out of one region before giving the region up (each costs a retry)."""


class _LiftRule(Rule):
    """Shared find/apply: claim the regions of one kind and lift each with the rule's policy."""

    category = "rank"
    exactness = "exact"
    kind: ClassVar[str]
    policy: ClassVar[Policy]

    suggest_for = frozenset(SUPPORT)
    """Regions are grown from blockers whose op the lift supports (`rank4_ops.SUPPORT`) and
    list only such blockers, so without one there is nothing to find."""

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        return [
            self.match(list(r.nodes), r.reason, list(r.blockers))
            for r in regions(ctx)
            if r.kind == self.kind
        ]

    def apply(self, graph: gs.Graph, match: Match, params: RuleParams, ctx: RuleContext) -> None:
        """Lift the region; a node the lift cannot carry (a tensor with five non-unit axes in
        Hiera's mask-unit attention) is left out of it and the rest lifted without it."""
        by_name = nodes_by_name(graph)
        region = [by_name[n] for n in match.nodes]
        policy = type(self).policy
        for _ in range(MAX_LEFT_OUT):
            try:
                Lifter(graph, ctx.view, region, policy, ctx.opset).run()
                return
            except LiftError as error:
                kept = [n for n in region if n.name != error.node]
                if error.node is None or len(kept) == len(region) or not kept:
                    raise
                region = kept
        raise LiftError(f"more than {MAX_LEFT_OUT} nodes of the region cannot be lifted")

    def apply_all(
        self, graph: gs.Graph, matches: list[Match], params: RuleParams, ctx: RuleContext
    ) -> list[Match]:
        """Lift each region; a region the lift cannot express is skipped, the others kept."""
        applied = []
        for match in matches:
            try:
                self.apply(graph, match, params, ctx)
            except LiftError:
                continue
            applied.append(match)
        return applied  # IR < 4 initializer inputs are listed by graph_edit.export_graph


@register
class ReshapeTo4D(_LiftRule):
    """Carry rank-2/3/5 detection-head tensors as 4-D ([N,C,L] → [N,C,1,L]).

    Finds connected regions of nodes blocked because their tensors are not 4-D (the flattened
    grid of a YOLO head: Reshape [1,C,H,W]→[1,C,H·W], Concat over anchors, Split/Slice of box
    and class channels, Sigmoid, the DFL Reshape/Softmax, dist2bbox Sub/Add/Mul with anchor
    constants; rank-5 anchor heads; 1-D conv stacks) and rewrites them as 4-D ops with the same
    values: reshapes get a unit height, axis attributes move with their axis, constants are
    re-laid-out to broadcast the same way. Graph outputs keep their names and shapes through a
    final reshape that stays a trailing host stage.
    """

    name = "reshape-to-4d"
    summary = "Carry rank-2/3/5 head tensors as 4-D ([N,C,L] → [N,C,1,L]) so they run on the MLA."
    example = "surgery apply reshape-to-4d yolov8n.onnx -o yolov8n_4d.onnx"
    kind = "ncl"
    policy = staticmethod(ncl_policy)


@register
class ClassifierToConv(_LiftRule):
    """Turn a Flatten/Reshape → Gemm (or MatMul + Add) classifier head into a 1×1 Conv on 4-D.

    The pooled features [N,C,1,1] are not flattened: the Gemm becomes a 1×1 Conv with the same
    weights (alpha, beta and transB folded in), a following Softmax runs over the channel axis,
    and only the graph output is reshaped back to [N,K] (a trailing host stage).
    """

    name = "classifier-to-conv"
    summary = "Flatten → Gemm/MatMul classifier heads become a 1×1 Conv on [N,C,1,1]."
    example = "surgery apply classifier-to-conv mobilenet_v2.onnx -o mobilenet_v2_conv.onnx"
    kind = "classifier"
    policy = staticmethod(ncl_policy)


@register
class TransformerTo4D(_LiftRule):
    """Carry transformer tokens as 4-D: [B,L,C] → [B·L,C,1,1], one row per token.

    Linear layers (MatMul/Gemm by a constant matrix) become 1×1 Convs; Layer/RMSNormalization and
    Softmax run on axis 1, which then holds exactly the normalised axis; elementwise ops (Erf-GELU,
    residual adds, bias) take re-laid-out constants; the attention reshapes/transposes (including
    the rank-5 qkv split) become 4-D Reshape/Transpose/Split; the attention Softmax over keys is
    reshaped to [B·H·L, L, 1, 1]; Gather of the class token becomes a Slice.
    """

    name = "transformer-to-4d"
    summary = "Carry transformer tokens as 4-D ([B,L,C] → [B·L,C,1,1]); linear layers as 1×1 Conv."
    example = "surgery apply transformer-to-4d vit_tiny_patch16_224.onnx -o vit_4d.onnx"
    kind = "transformer"
    policy = staticmethod(rows_policy)
