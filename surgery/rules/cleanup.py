"""Cleanup and canonicalisation rules: fold constants, remove no-op nodes, fuse BatchNorm,
merge Transpose and Reshape chains, fix dynamic input shapes.

They rarely unblock an op by themselves, but they turn exports into the plain form the other
rules pattern-match on (constants as initializers, no Identity chains, static shapes).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from pydantic import Field

from surgery.coverage import CoverageReport, NodePlacement, analyze_coverage
from surgery.graph import GraphView
from surgery.model import MAX_DIM, infer_model_shapes, read_model, set_input_shapes
from surgery.rules.base import Match, Rule, RuleContext, RuleParams
from surgery.rules.engine import RuleNotApplicableError
from surgery.rules.graph_edit import (
    bypass_node,
    fold_until_fixed_point,
    nodes_by_name,
)
from surgery.rules.registry import register
from surgery.rules.replace_common import (
    Editor,
    GraphRule,
    Pattern,
    TensorSpec,
    fmt_shape,
    freed_blockers,
    probe_node,
)
from surgery.rules.replace_pool import pad_mode_and_amounts

_NEEDS_VALUE = {"non_constant_input", "axis_unknown"}


@register
class FoldConstants(Rule):
    """Evaluate every node whose inputs are all known before run time and store the results as
    initializers: shape arithmetic (Shape→Gather→Unsqueeze→Concat→Reshape), Constant nodes,
    constant subgraphs. Ops that need a constant operand (Reshape's shape, Resize's scales,
    Pow's exponent, Slice's starts) then see a plain initializer."""

    name = "fold-constants"
    summary = "Evaluate constant subgraphs and Constant nodes into initializers."
    category = "cleanup"
    example = "surgery apply fold-constants yolov8n.onnx -o folded.onnx"

    def may_free(self, coverage: CoverageReport) -> bool:
        """Folding frees only blockers that wait for a constant operand."""
        return any(r.code in _NEEDS_VALUE for b in coverage.blockers for r in b.reasons)

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        folded = [p for p in ctx.coverage.placements if p.foldable]
        if not folded:
            return []
        view = ctx.view
        computed = {
            t for p in folded if p.op_type != "Constant" for t in view.node_outputs[p.index]
        }
        unblocked = [b.name for b in ctx.coverage.blockers if _folding_frees(b, view, computed)]
        chains = sum(1 for p in folded if p.op_type != "Constant")
        consts = len(folded) - chains
        return [
            self.match(
                [p.name for p in folded],
                f"{chains} constant-computing node(s) and {consts} Constant node(s) become initializers",
                unblocked,
            )
        ]

    def apply_all(
        self, graph: gs.Graph, matches: list[Match], params: RuleParams, ctx: RuleContext
    ) -> list[Match]:
        fold_until_fixed_point(graph, ctx.model)
        for node in list(graph.nodes):
            if node.op == "Constant" and "value" in node.attrs:
                out = node.outputs[0]
                const = gs.Constant(out.name, node.attrs["value"].values)
                for consumer in list(out.outputs):
                    for k, t in enumerate(consumer.inputs):  # gs lists reject slice assignment
                        if t is out:
                            consumer.inputs[k] = const
                node.outputs.clear()
        return matches


def _folding_frees(blocker: NodePlacement, view: GraphView, computed: set[str]) -> bool:
    """Whether folding can free `blocker`: an unknown axis (folding makes shapes known), or a
    constant operand it waits for that is computed (folding makes it an initializer whose
    value the check reads); not an operand computed from run-time data."""
    codes = {r.code for r in blocker.reasons}
    if "axis_unknown" in codes:
        return True
    return "non_constant_input" in codes and any(
        t in computed for t in view.node_inputs[blocker.index]
    )


_NO_OP = {"Identity", "Dropout"}
_SAME_SHAPE_NO_OP = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Expand", "Tile"})
"""Ops that copy their input unchanged when the output has the input's shape (a Tile by ones:
GCViT's `q.repeat(B, 1, 1, 1, 1)` with one window)."""
_NEUTRAL_OPERAND = {
    "Add": (0.0, (0, 1)),
    "Sub": (0.0, (0,)),
    "Mul": (1.0, (0, 1)),
    "Div": (1.0, (0,)),
}
"""Arithmetic that returns its other operand when a constant operand is all zeros (Add, Sub)
or all ones (Mul, Div): op → (neutral value, the input positions that may pass through)."""
_MAYBE_NO_OP = frozenset(
    {
        *_NO_OP,
        *_SAME_SHAPE_NO_OP,
        *_NEUTRAL_OPERAND,
        *("Transpose", "Cast", "CastLike", "Where", "Split", "Pad", "Slice"),
    }
)
"""The ops `_kept_input` can accept; checked first so other nodes cost one set lookup."""
_NEUTRAL_ELEMENTS = 1 << 20
"""The largest constant operand read to see whether it is neutral (a zero attention bias of a
long sequence has a million elements; reading it is a view and one comparison)."""


@register
class RemoveIdentity(Rule):
    """Remove nodes that do not change their input: Identity, inference-mode Dropout, Reshape
    (Squeeze, Unsqueeze, Expand, Tile) to the same shape, Transpose with the identity
    permutation, Cast (or CastLike) to the same type, a Split whose first piece is the whole
    input (and the rest unread), a Pad by zeros, a unit-step Slice that keeps the whole shape,
    arithmetic with a neutral constant
    (x + 0, x − 0, x · 1, x / 1) and a Where whose constant condition picks one side everywhere.

    The last two are what ONNX's own function bodies leave once their shapes fold: an
    opset-23 Attention adds an all-zero bias when no mask is given and guards its softmax with
    a Where on "row fully masked", which is constant false without a mask. A node is removed
    only when the tensor passed through already has the output's shape and type, so
    broadcasting never changes."""

    name = "remove-identity"
    suggest_for = _MAYBE_NO_OP
    summary = (
        "Remove Identity, Dropout, no-op Reshape/Expand/Tile/Transpose/Cast, x+0, x·1 and "
        "constant-condition Where nodes."
    )
    category = "cleanup"
    example = "surgery apply remove-identity model.onnx"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        view = ctx.view
        blockers = ctx.blocker_names
        found = []
        # A match lists only its own node, so with a focus only the focus nodes can be listed.
        if ctx.focus is None:
            indices: Iterable[int] = range(len(view.op_types))
        else:
            index = view.index_by_name
            indices = sorted(index[name] for name in ctx.focus if name in index)
        for idx in indices:
            op = view.op_types[idx]
            if op not in _MAYBE_NO_OP:
                continue
            kept = self._kept_input(ctx, idx, op)
            if kept is None:
                continue
            name = view.names[idx]
            found.append(
                self.match(
                    [name],
                    f"{op} {name} does not change its input",
                    [name] if name in blockers else [],
                    keep_input=kept,
                )
            )
        return found

    @staticmethod
    def _kept_input(ctx: RuleContext, idx: int, op: str) -> int | None:
        """The input the node passes through unchanged, or None when it computes something."""
        view = ctx.view
        ins, outs = view.node_inputs[idx], view.node_outputs[idx]
        if not ins or not ins[0]:
            return None
        if op in _NO_OP:
            unused_extras = len(outs) == 1 or not any(view.consumers.get(o) for o in outs[1:])
            return 0 if unused_extras else None
        if op in _NEUTRAL_OPERAND or op == "Where":
            return _passed_through(ctx, idx, op)
        x, y = view.tensor(ins[0]), view.tensor(outs[0])
        if op in _SAME_SHAPE_NO_OP:
            return 0 if x.is_static and y.is_static and x.shape == y.shape else None
        if op == "Transpose":
            perm = view.nodes[idx].attribute
            values = next((list(a.ints) for a in perm if a.name == "perm"), None)
            return 0 if values is not None and values == sorted(values) else None
        if op == "Cast":
            to = next((a.i for a in view.nodes[idx].attribute if a.name == "to"), None)
            return 0 if x.elem_type != 0 and to == x.elem_type else None
        if op == "Split":
            return 0 if _whole_first_piece(view, idx) else None
        if op in ("Pad", "Slice"):
            return 0 if _keeps_everything(ctx, idx, op) else None
        if op == "CastLike" and len(ins) == 2 and ins[1]:
            return 0 if x.elem_type != 0 and view.tensor(ins[1]).elem_type == x.elem_type else None
        return None

    def apply(self, graph: gs.Graph, match: Match, params: RuleParams, ctx: RuleContext) -> None:
        node = nodes_by_name(graph)[match.nodes[0]]
        while len(node.outputs) > 1:  # e.g. Dropout's unused mask
            node.outputs.pop()
        bypass_node(graph, node, match.data.get("keep_input", 0))


def _keeps_everything(ctx: RuleContext, idx: int, op: str) -> bool:
    """A Pad by all-zero amounts, or a Slice with unit steps whose output has its input's
    (static) shape: both copy the input (encodec's shortcut Pads and whole-axis Slices)."""
    view = ctx.view
    ins = view.node_inputs[idx]
    x, y = view.tensor(ins[0]), view.tensor(view.node_outputs[idx][0])
    if not (x.is_static and y.is_static and x.shape == y.shape):
        return False
    if op == "Pad":
        read = pad_mode_and_amounts(Pattern(ctx), idx, len(x.shape))  # type: ignore[arg-type]
        return read is not None and not any(read[1])
    if len(ins) <= 4 or not ins[4]:
        return True  # no steps: unit steps
    steps = view.constant_value(ins[4])
    return steps is not None and bool(np.all(steps == 1))


def _whole_first_piece(view: GraphView, idx: int) -> bool:
    """A Split whose first piece is its whole input and whose other pieces nobody reads (what
    is left of a rotary pass-through split once its empty piece is gone)."""
    lengths = split_lengths(view, idx)
    outs = view.node_outputs[idx]
    x = view.tensor(view.node_inputs[idx][0])
    if lengths is None or not x.is_static or len(lengths) != len(outs):
        return False
    axis = next((a.i for a in view.nodes[idx].attribute if a.name == "axis"), 0)
    whole = lengths[0] == x.shape[axis % len(x.shape)]  # type: ignore[index, arg-type]
    unread = all(not view.consumers.get(o) and o not in view.graph_outputs for o in outs[1:])
    return whole and unread


def _passed_through(ctx: RuleContext, idx: int, op: str) -> int | None:
    """For x ⊕ neutral constant, x's position; for Where with a constant, uniform condition,
    the chosen side's position — when that tensor has the output's static shape and type."""
    view = ctx.view
    ins = view.node_inputs[idx]
    if len(ins) != (3 if op == "Where" else 2) or not all(ins):
        return None
    constants = ctx.constants  # a set lookup first: most Adds and Muls have no constant side
    if op == "Where":
        if ins[0] not in constants:
            return None
        cond = view.constant_value(ins[0], _NEUTRAL_ELEMENTS)
        if cond is None or cond.size == 0 or (cond.any() and not cond.all()):
            return None
        candidates: tuple[int, ...] = (1 if cond.all() else 2,)
    else:
        neutral, candidates = _NEUTRAL_OPERAND[op]
        candidates = tuple(
            k
            for k in candidates
            if ins[1 - k] in constants
            and _all_equal(view.constant_value(ins[1 - k], _NEUTRAL_ELEMENTS), neutral)
        )
        if not candidates:
            return None
    y = view.tensor(view.node_outputs[idx][0])
    for k in candidates:
        x = view.tensor(ins[k])
        if x.is_static and y.is_static and x.shape == y.shape and x.elem_type == y.elem_type:
            return k
    return None


def _all_equal(value: np.ndarray | None, neutral: float) -> bool:
    if value is None or value.size == 0:
        return False
    if value.size == 1:  # the common case (HardSwish's +3 and /6): no array reduction
        return value.item() == neutral
    return bool((value == neutral).all())


# --------------------------------------------------------------------------- fuse-batchnorm

_CONVS = ("Conv", "ConvTranspose")


@register
class FuseBatchNorm(GraphRule):
    """Fold an inference-mode BatchNormalization into the Conv or ConvTranspose before it.

    BN(conv(x)) = conv'(x) with each output channel's weights scaled by s = scale/√(var+eps)
    and the bias becoming (b − mean)·s + B: one node instead of two, and the form the MLA
    compiler fuses anyway. Parameters may be initializers, Constant nodes or constant
    subgraphs (Caffe2 exports build weights with ConstantOfShape). The arithmetic is done in
    float64 and rounded once, so results match to float rounding. Skipped when the convolution
    output has other readers, when a BN parameter is computed at run time, or in training mode.
    """

    name = "fuse-batchnorm"
    suggest_for = frozenset({"BatchNormalization"})
    summary = "Fold BatchNormalization into the preceding Conv/ConvTranspose weights and bias."
    category = "cleanup"
    example = "surgery apply fuse-batchnorm ppocr_mobile_v2_cls.onnx -w ws"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for bn in pat.nodes("BatchNormalization"):
            conv = self._fusable_conv(pat, bn)
            if conv is None:
                continue
            found.append(
                self.match(
                    [pat.name(conv), pat.name(bn)],
                    f"{pat.name(bn)} folds into {pat.op(conv)} {pat.name(conv)}",
                    freed_blockers(ctx, [pat.name(bn)]),
                )
            )
        return found

    @staticmethod
    def _fusable_conv(pat: Pattern, bn: int) -> int | None:
        ins = pat.ins(bn)
        conv = pat.producer(ins[0], *_CONVS)
        if conv is None or not pat.private(ins[0]) or len(ins) < 5:
            return None
        attrs = pat.attrs(bn)
        if attrs.get("training_mode", 0) or not attrs.get("spatial", 1):
            return None
        if not all(pat.is_const(t) for t in ins[1:5]) or not pat.unused_extra_outputs(bn):
            return None
        conv_ins = pat.ins(conv)
        if not pat.is_const(conv_ins[1]) or (
            len(conv_ins) > 2 and conv_ins[2] and not pat.is_const(conv_ins[2])
        ):
            return None
        scale = pat.view.tensor(ins[1])
        return conv if scale.rank == 1 and pat.is_float(ins[0]) else None

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        conv, bn = ed.node_named(match.nodes[0]), ed.node_named(match.nodes[1])
        assert conv is not None and bn is not None
        values = [ed.value(t) for t in (conv.inputs[1], *bn.inputs[1:5])]
        has_bias = len(conv.inputs) > 2 and conv.inputs[2].name
        bias = ed.value(conv.inputs[2]) if has_bias else None
        if any(v is None for v in values) or (has_bias and bias is None):
            return False
        w, scale, beta, mean, var = (np.asarray(v, np.float64) for v in values)
        s = scale / np.sqrt(var + float(bn.attrs.get("epsilon", 1e-5)))
        group = int(conv.attrs.get("group", 1))
        new_w = _scale_output_channels(w, s, conv.op == "ConvTranspose", group)
        b = np.zeros_like(s) if bias is None else np.asarray(bias, np.float64)
        new_b = (b - mean) * s + beta
        dtype = np.asarray(values[0]).dtype
        w_t = ed.const(f"{conv.name}_bn_weight", new_w.astype(dtype))
        b_t = ed.const(f"{conv.name}_bn_bias", new_b.astype(dtype))
        conv.inputs[1] = w_t
        if has_bias:
            conv.inputs[2] = b_t
        else:
            conv.inputs.append(b_t)
        y = bn.outputs[0]
        ed.detach(bn)
        conv.outputs[0] = y
        return True


def _scale_output_channels(
    w: np.ndarray, s: np.ndarray, transposed: bool, group: int
) -> np.ndarray:
    """Multiply each output channel's kernel by s: axis 0 of a Conv weight [M, C/g, k…]; for a
    ConvTranspose weight [C, M/g, k…] the output channel is (group, axis 1)."""
    if not transposed:
        return w * s.reshape(-1, *([1] * (w.ndim - 1)))
    c_in, m_per_group = w.shape[0], w.shape[1]
    grouped = w.reshape(group, c_in // group, m_per_group, *w.shape[2:])
    factor = s.reshape(group, 1, m_per_group, *([1] * (w.ndim - 2)))
    return (grouped * factor).reshape(w.shape)


# --------------------------------------------------------------------------- merge-transposes


def _perm(attrs: dict, rank: int | None) -> list[int] | None:
    """The permutation a Transpose applies; None when unknown or not one of range(rank) (a
    malformed perm is the checker's to report, not a pattern to rewrite)."""
    perm = attrs.get("perm")
    if not perm:
        return list(reversed(range(rank))) if rank is not None else None
    perm = list(perm)
    return perm if sorted(perm) == list(range(rank if rank is not None else len(perm))) else None


@register
class MergeTransposes(GraphRule):
    """Compose consecutive Transposes into one; drop the result when it is the identity.

    Exports often permute to channels-last and straight back (NCHW→NHWC→NCHW around a
    layer norm or a reshape that later rules removed), leaving pairs that cancel. Transpose(p2)
    after Transpose(p1) equals one Transpose with perm p1[p2]. Data movement only: exact.
    """

    name = "merge-transposes"
    suggest_for = frozenset({"Transpose"})
    summary = "Compose consecutive Transposes into one; remove it when the result is identity."
    category = "cleanup"
    example = "surgery apply merge-transposes model.onnx"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for t2 in pat.nodes("Transpose"):
            x = pat.ins(t2)[0]
            t1 = pat.producer(x, "Transpose")
            if t1 is None:
                continue
            src = pat.ins(t1)[0]
            rank = pat.view.tensor(src).rank
            p1, p2 = _perm(pat.attrs(t1), rank), _perm(pat.attrs(t2), rank)
            if p1 is None or p2 is None:
                continue
            composed = [p1[i] for i in p2]
            identity = composed == sorted(composed)
            changed = [pat.name(t1), pat.name(t2)] if pat.private(x) else [pat.name(t2)]
            on_mla = identity or (
                probe_node(
                    ctx,
                    "Transpose",
                    [pat.spec(src)],
                    [pat.spec(pat.outs(t2)[0])],
                    {"perm": composed},
                )
                is None
            )
            what = "cancel out" if identity else f"compose to perm {composed}"
            found.append(
                self.match(
                    [pat.name(t1), pat.name(t2)],
                    f"{pat.name(t1)} and {pat.name(t2)} {what}",
                    freed_blockers(ctx, changed, on_mla),
                )
            )
        return found

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        t2 = ed.node_named(match.nodes[1])
        assert t2 is not None
        x = t2.inputs[0]
        t1 = x.inputs[0] if x.inputs else None
        if t1 is None or t1.op != "Transpose":
            return False
        src = t1.inputs[0]
        rank = len(src.shape) if src.shape is not None else None
        p1, p2 = _perm(t1.attrs, rank), _perm(t2.attrs, rank)
        if p1 is None or p2 is None:
            return False
        composed = [p1[i] for i in p2]
        t2.inputs[0] = src
        t2.attrs["perm"] = composed
        if composed == sorted(composed):
            bypass_node(ed.graph, t2)
        return True


# --------------------------------------------------------------------------- drop-empty-concat-inputs


def slice_length(size: int, start: int, end: int, step: int) -> int:
    """Elements an ONNX Slice with a positive `step` keeps on an axis of `size` (negative
    indices counted from the end, then clamped to [0, size]). Negative steps are left out:
    ONNX Runtime reads an end of INT64_MAX there as "past the front", against the spec."""
    if step <= 0:
        raise ValueError(f"slice_length takes positive steps, not {step}")
    if start < 0:
        start += size
    if end < 0:
        end += size
    start, end = min(max(start, 0), size), min(max(end, 0), size)
    return max(0, -(-(end - start) // step))


@register
class DropEmptyConcatInputs(GraphRule):
    """Remove the inputs of a Concat that a Slice or a Split leaves empty.

    Partial rotary embeddings split q and k into a rotated part and a pass-through part,
    q[..., rotary_dim:], and concatenate them back. With rotary_dim equal to the head size
    (Phi-3; every opset-23 RotaryEmbedding's function body, which Splits off a piece of
    length 0) the pass-through part is empty; shape inference cannot tell (the end is
    INT64_MAX) or gives the piece a 0 dimension, so the Slice and the Concat count as dynamic
    and leave the MLA. A Concat without its empty inputs is the same tensor: exact.
    """

    name = "drop-empty-concat-inputs"
    suggest_for = frozenset({"Concat", "Slice", "Split"})
    summary = "Concat inputs a Slice or Split leaves empty (a rotary pass-through) → removed."
    category = "cleanup"
    example = "surgery apply drop-empty-concat-inputs phi3.onnx"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for concat in pat.nodes("Concat"):
            ins = pat.ins(concat)
            empty = [t for t in ins if _empty_slice(pat, t) or _empty_split_output(pat, t)]
            if not empty or len(empty) == len(ins):
                continue
            slices = [pat.producer(t) for t in empty]
            names = [pat.name(concat), *(pat.name(s) for s in slices if s is not None)]
            found.append(
                self.match(
                    [pat.name(concat)],
                    f"Concat {pat.name(concat)}: {len(empty)} empty input(s) "
                    f"({', '.join(empty[:3])}) removed",
                    freed_blockers(ctx, names),
                    empty=empty,
                )
            )
        return found

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        concat = ed.node_named(match.nodes[0])
        assert concat is not None
        empty = set(match.data["empty"])
        kept = [t for t in concat.inputs if t.name not in empty]
        if not kept or len(kept) == len(concat.inputs):
            return False
        concat.inputs = kept
        return True


SOFTPLUS_EXACT_FROM = 16.0
"""Above this x, softplus(x) = x + log1p(exp(-x)) rounds to x in float32 (exp(-16) ≈ 1.1e-7 is
under half an ulp of 16, 9.5e-7): a threshold at or above it changes no float32 value."""


@register
class DropSoftplusThreshold(GraphRule):
    """Where(x > t, x, Softplus(x)) with a constant t ≥ 16 → Softplus(x).

    torch's F.softplus (threshold 20, beta 1) exports its large-input shortcut as a Greater
    and a Where, neither of which the MLA runs: Mamba's time-step softplus split its model in
    three. Above 16, float32 softplus already equals x, so the shortcut changes nothing and
    the single Softplus is exact. A cleanup, so it runs before rank lifts reshape x."""

    name = "drop-softplus-threshold"
    suggest_for = frozenset({"Where", "Greater"})
    summary = "torch's thresholded softplus, Where(x > 20, x, Softplus(x)) → Softplus(x)."
    category = "cleanup"
    example = "surgery apply drop-softplus-threshold mamba.onnx"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for where in pat.nodes("Where"):
            parts = _thresholded_softplus(pat, where)
            if parts is None:
                continue
            x, nodes = parts
            names = [pat.name(n) for n in nodes]
            found.append(
                self.match(
                    names,
                    f"{pat.name(where)}: where(x > t, x, softplus(x)) → softplus(x)",
                    freed_blockers(ctx, names),
                    x=x,
                    y=pat.outs(where)[0],
                )
            )
        return found

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        x, y = ed.tensor(match.data["x"]), ed.tensor(match.data["y"])
        ed.detach(*(n for n in (ed.node_named(name) for name in match.nodes) if n is not None))
        ed.node("Softplus", "softplus", [x], [y])
        return True


def _thresholded_softplus(pat: Pattern, where: int) -> tuple[str, list[int]] | None:
    """(x, [greater, softplus, where]) when `where` is Where(x > t, x, Softplus(x)) with a
    constant t ≥ SOFTPLUS_EXACT_FROM and the comparison and softplus read by it alone."""
    ins = pat.ins(where)
    if len(ins) != 3:
        return None
    cond, x, other = ins
    greater, softplus = pat.producer(cond, "Greater"), pat.producer(other, "Softplus")
    if greater is None or softplus is None or not (pat.private(cond) and pat.private(other)):
        return None
    a, t = pat.ins(greater)[:2]
    threshold = pat.scalar(t)
    if a != x or pat.ins(softplus)[0] != x or threshold is None:
        return None
    if threshold < SOFTPLUS_EXACT_FROM or not pat.is_float(x):
        return None
    return x, [greater, softplus, where]


def _empty_slice(pat: Pattern, tensor: str) -> bool:
    """Whether `tensor` is the output of a Slice (opset ≥ 10, constant operands, input of
    static shape) that keeps nothing along some axis."""
    node = pat.producer(tensor, "Slice")
    if node is None:
        return False
    ins = pat.ins(node)
    shape = pat.shape(ins[0])
    if shape is None or len(ins) < 3:
        return False
    values = [pat.value(t) if t else None for t in ins[1:5]]
    starts, ends = values[0], values[1]
    if starts is None or ends is None or (len(ins) > 3 and ins[3] and values[2] is None):
        return False
    axes = values[2] if len(values) > 2 and values[2] is not None else range(len(starts))
    steps = values[3] if len(values) > 3 and values[3] is not None else [1] * len(starts)
    for axis, start, end, step in zip(axes, starts, ends, steps, strict=False):
        size = shape[int(axis) % len(shape)]
        if int(step) > 0 and slice_length(size, int(start), int(end), int(step)) == 0:
            return True
    return False


def split_lengths(view: GraphView, idx: int) -> list[int] | None:
    """The constant piece lengths of Split node `idx` (the `split` input from opset 13, the
    attribute before), or None when they are not given or not constant."""
    ins = view.node_inputs[idx]
    if len(ins) > 1 and ins[1]:
        value = view.constant_value(ins[1])
        return None if value is None else [int(v) for v in value.reshape(-1)]
    attr = next((a for a in view.nodes[idx].attribute if a.name == "split"), None)
    return None if attr is None else [int(v) for v in attr.ints]


def _empty_split_output(pat: Pattern, tensor: str) -> bool:
    """Whether `tensor` is an output of a Split whose constant length for it is 0."""
    node = pat.producer(tensor, "Split")
    if node is None:
        return False
    lengths = split_lengths(pat.view, node)
    outs = pat.outs(node)
    return lengths is not None and len(lengths) == len(outs) and lengths[outs.index(tensor)] == 0


# --------------------------------------------------------------------------- reshape-allowzero


@register
class ClearReshapeAllowzero(GraphRule):
    """Set a Reshape's `allowzero` back to 0 when its constant shape has no zero.

    `allowzero=1` (opset 14) only changes what a 0 in the shape means — a zero-size axis
    instead of "copy this input axis" — so without a 0 it changes nothing. torch's dynamo
    exporter writes it on every `view`, and MLAs that take `allowzero=0` only (SiMa's
    compatibility list) would send each such Reshape to the host. Exact: the same Reshape.
    """

    name = "clear-reshape-allowzero"
    suggest_for = frozenset({"Reshape"})
    summary = "Reshape with allowzero=1 and a constant shape without zeros → allowzero=0."
    category = "cleanup"
    example = "surgery apply clear-reshape-allowzero model.onnx"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for node in pat.nodes("Reshape"):
            if not pat.attrs(node).get("allowzero", 0):
                continue
            x, shape_input = pat.ins(node)[:2]
            shape = pat.value(shape_input)
            if shape is None or 0 in shape:
                continue
            cleared = probe_node(
                ctx,
                "Reshape",
                [pat.spec(x), pat.spec(shape_input, with_value=True)],
                [pat.spec(pat.outs(node)[0])],
            )
            name = pat.name(node)
            found.append(
                self.match(
                    [name],
                    f"Reshape {name}: allowzero=1 is inert (shape {fmt_shape(list(shape))})",
                    freed_blockers(ctx, [name], cleared is None),
                )
            )
        return found

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        node = ed.node_named(match.nodes[0])
        if node is None:
            return False
        node.attrs.pop("allowzero", None)
        return True


# --------------------------------------------------------------------------- merge-reshapes

_RESHAPES = ("Reshape", "Flatten", "Squeeze", "Unsqueeze")


@register
class MergeReshapes(GraphRule):
    """Collapse a chain of Reshape/Flatten/Squeeze/Unsqueeze into one Reshape.

    Each of these only reinterprets the same row-major data, so a chain equals a single
    Reshape to the chain's final (static) shape — and when that shape is the input's own, the
    chain disappears. Fewer nodes, and a Reshape is what the MLA accepts where Flatten,
    Squeeze and Unsqueeze are CVU-only. Needs the final shape known (fix dynamic inputs first).
    A reshape that feeds a Tile or Expand stays as it is: it adds the axis a repeat copies,
    the pattern repeat-to-concat rewrites.
    """

    name = "merge-reshapes"
    suggest_for = frozenset(_RESHAPES)
    summary = "Collapse consecutive Reshape/Flatten/Squeeze/Unsqueeze into one Reshape."
    category = "cleanup"
    example = "surgery apply merge-reshapes model.onnx"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        pat = Pattern(ctx)
        found = []
        for last in pat.nodes(*_RESHAPES):
            out = pat.outs(last)[0]
            if pat.sole_consumer(out, *_RESHAPES) is not None:
                continue  # not the end of its chain
            chain = self._chain(pat, last)
            if any(pat.op(c) in ("Tile", "Expand") for c in pat.consumers(out)):
                # The last one adds the axis a repeat copies: repeat-to-concat reads it so.
                chain = chain[:-1]
                out = pat.outs(chain[-1])[0] if chain else out
            shape = pat.shape(out)
            if len(chain) < 2 or shape is None or 0 in shape:
                continue
            x = pat.ins(chain[0])[0]
            names = [pat.name(i) for i in chain]
            identity = pat.shape(x) == shape
            on_mla = (
                identity
                or probe_node(
                    ctx,
                    "Reshape",
                    [pat.spec(x), TensorSpec.const(np.array(shape, np.int64))],
                    [pat.spec(out)],
                )
                is None
            )
            what = "cancel out" if identity else f"become one Reshape to {fmt_shape(shape)}"
            found.append(
                self.match(
                    names,
                    f"{len(chain)} reshapes ({' → '.join(pat.op(i) for i in chain)}) {what}",
                    freed_blockers(ctx, names, on_mla),
                    shape=list(shape),
                )
            )
        return found

    @staticmethod
    def _chain(pat: Pattern, last: int) -> list[int]:
        chain = [last]
        while True:
            prev = pat.producer(pat.ins(chain[0])[0], *_RESHAPES)
            if prev is None or not pat.private(pat.outs(prev)[0]):
                return chain
            chain.insert(0, prev)

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        nodes = [ed.node_named(n) for n in match.nodes]
        first, last = nodes[0], nodes[-1]
        assert first is not None and last is not None
        x = first.inputs[0]
        shape = match.data["shape"]
        last.op = "Reshape"
        last.attrs.clear()
        last.inputs.clear()
        last.inputs.extend([x, ed.const(f"{last.name}_shape", np.array(shape, np.int64))])
        ed.detach(*(n for n in nodes[:-1] if n is not None))
        if x.shape is not None and list(x.shape) == shape:
            bypass_node(ed.graph, last)
        return True


# --------------------------------------------------------------------------- fix-input-shapes


class FixInputShapesParams(RuleParams):
    shapes: dict[str, list[Annotated[int, Field(gt=0, lt=MAX_DIM)]]] | None = Field(
        default=None,
        description='Static shape per input name, e.g. {"images": [1, 3, 640, 640]}. '
        "Without it, symbolic batch dimensions (dim 0) become 1.",
    )


@register
class FixInputShapes(GraphRule):
    """Make dynamic graph inputs static: the MLA needs static shapes everywhere.

    With `shapes`, each named input gets that shape (a dimension fixed in the model cannot be
    changed). Without parameters, only the symbolic batch dimension (dim 0) of each input is set
    to 1 — the match says so, and names the dimensions that stay dynamic; pass `shapes` for
    those (image height/width, sequence length). Shape inference then makes every downstream
    shape static. The rule only matches models with dynamic inputs, so `surgery fix` uses it
    exactly when it is needed.
    """

    name = "fix-input-shapes"
    summary = "Make dynamic inputs static (given shapes, or batch dimension 1 by default)."
    category = "cleanup"
    Params = FixInputShapesParams
    example = (
        "surgery apply fix-input-shapes nudenet_320n.onnx "
        "-p 'shapes={\"images\": [1, 3, 320, 320]}'"
    )

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        assert isinstance(params, FixInputShapesParams)
        dynamic = ctx.coverage.dynamic_inputs
        if not dynamic and not params.shapes:
            return []
        shapes, notes = (
            _given_shapes(params.shapes) if params.shapes else _batch_one_shapes(dynamic)
        )
        if (
            params.shapes
            and not dynamic
            and all(list(ctx.view.tensor(n).shape or []) == list(v) for n, v in shapes.items())
        ):
            return []  # already exactly these shapes
        if not shapes:
            left = ", ".join(f"{n} {d}" for n, d in dynamic.items())
            raise RuleNotApplicableError(
                f"fix-input-shapes: no symbolic batch dimension to set ({left})",
                hint="pass the shapes: -p 'shapes={\"NAME\": [1, 3, 640, 640]}'",
            )
        fixed = _with_input_shapes(ctx.model, shapes, ctx.view)
        after = {b.name for b in analyze_coverage(fixed, ctx.target, suggest=False).blockers}
        freed = sorted(b for b in ctx.blocker_names if b not in after)
        return [self.match([], "; ".join(notes), freed, shapes=shapes)]

    def apply_all(
        self, graph: gs.Graph, matches: list[Match], params: RuleParams, ctx: RuleContext
    ) -> list[Match]:
        shapes = matches[0].data["shapes"]
        for tensor in graph.inputs:
            if tensor.name in shapes:
                tensor.shape = [
                    new if isinstance(new, int) else old
                    for new, old in zip(shapes[tensor.name], tensor.shape or [], strict=False)
                ] or list(shapes[tensor.name])
        for tensor in graph.outputs:
            if tensor.shape is not None and not all(isinstance(d, int) for d in tensor.shape):
                tensor.shape = None  # re-inferred from the now static inputs
        return matches[:1]


def _given_shapes(given: dict[str, list[int]]) -> tuple[dict[str, list[int | str]], list[str]]:
    return (
        {n: list(s) for n, s in given.items()},
        [f"input {n!r} set to {fmt_shape(s)}" for n, s in given.items()],
    )


def _batch_one_shapes(dynamic: dict[str, list]) -> tuple[dict[str, list[int | str]], list[str]]:
    """Dim 0 → 1 where it is symbolic; other symbolic dims stay (and the note says so)."""
    shapes: dict[str, list[int | str]] = {}
    notes = []
    for name, dims in dynamic.items():
        if not dims or isinstance(dims[0], int):
            continue
        shapes[name] = [1, *(d if isinstance(d, int) else str(d or "?") for d in dims[1:])]
        label = repr(dims[0]) if dims[0] else "(unnamed)"
        note = f"input {name!r}: dynamic batch dimension {label} set to 1 (no shapes given)"
        rest = [f"{k} ({d})" for k, d in enumerate(dims) if k and not isinstance(d, int)]
        if rest:
            note += f"; dims {', '.join(rest)} stay dynamic (pass shapes to fix them)"
        notes.append(note)
    return shapes, notes


def _with_input_shapes(
    model: onnx.ModelProto, shapes: dict[str, list[int | str]], view: GraphView
) -> onnx.ModelProto:
    """A shape-inferred copy with the inputs' dims replaced (ints fixed, strings symbolic).

    Fully static requests go through `set_input_shapes`, whose errors name the problem (unknown
    input, wrong rank, a fixed dimension changed). `view` (of `model`, whose nodes the copy
    has) spares the inferencer its scans for contrib ops and control flow."""
    static = {n: s for n, s in shapes.items() if all(isinstance(d, int) for d in s)}
    copy = read_model(model)
    set_input_shapes(copy, static)  # type: ignore[arg-type]
    inputs = {i.name: i for i in copy.graph.input}
    for name, dims in shapes.items():
        if name in static:
            continue
        shape = inputs[name].type.tensor_type.shape
        for dim, value in zip(shape.dim, dims, strict=True):
            if isinstance(value, int):
                dim.Clear()
                dim.dim_value = value
    del copy.graph.value_info[:]
    infer_model_shapes(copy, "fix-input-shapes", view)
    return copy
