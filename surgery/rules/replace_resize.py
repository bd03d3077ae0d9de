"""Resizes in a form the MLA accepts: resize-to-supported (nearest resizes the MLA rejects, and
any resize of a single pixel, in an exactly equivalent form), upsample-to-resize (the
pre-opset-10 Upsample op)."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import product

import numpy as np
import onnx_graphsurgeon as gs

from surgery.rules.base import Match, RuleContext, RuleParams
from surgery.rules.registry import register
from surgery.rules.replace_common import (
    Editor,
    GraphRule,
    OpsetGraphRule,
    Pattern,
    TensorSpec,
    conversion_note,
    freed_blockers,
    model_opset,
    opset_upgrade_error,
    probe_node,
    with_axis,
)
from surgery.targets import Reason

CANONICAL = {
    "mode": "nearest",
    "coordinate_transformation_mode": "asymmetric",
    "nearest_mode": "floor",
}
"""Nearest resize attributes under which an integer scale k replicates each pixel k times."""
MAX_STEPS = 4


def original_coordinates(size: int, out: int, scale: float, ctm: str) -> np.ndarray | None:
    """The input coordinate each output position of an ONNX Resize maps to, in float32 as
    ONNX Runtime computes it (None for coordinate modes the rules do not model)."""
    f32 = np.float32
    o = np.arange(out, dtype=f32)
    s = f32(scale)
    if ctm == "half_pixel":
        return (o + f32(0.5)) / s - f32(0.5)
    if ctm == "pytorch_half_pixel":
        return (o + f32(0.5)) / s - f32(0.5) if out > 1 else np.zeros(out, f32)
    if ctm == "asymmetric":
        return o / s
    if ctm == "align_corners":
        return o * f32(size - 1) / f32(out - 1) if out > 1 else np.zeros(out, f32)
    if ctm == "tf_half_pixel_for_nn":
        return (o + f32(0.5)) / s
    return None


def nearest_indices(
    size: int, out: int, scale: float, ctm: str, nearest_mode: str
) -> np.ndarray | None:
    """The input index each output position reads in an ONNX nearest Resize (None for
    coordinate modes this rule does not model).

    Computed in float32 as ONNX Runtime does (scale = float(out) / float(in) when the node gives
    sizes), so a coordinate that lands within rounding of an integer rounds the way the
    verifier's runtime rounds it (7 → 39, half_pixel, floor: output 19 reads input 2 in float32
    but 3 in float64)."""
    f32 = np.float32
    x = original_coordinates(size, out, scale, ctm)
    if x is None:
        return None
    rounding = {
        "round_prefer_floor": lambda v: np.where(
            v == np.floor(v) + f32(0.5), np.floor(v), np.round(v)
        ),
        "round_prefer_ceil": lambda v: np.floor(v + f32(0.5)),
        "floor": np.floor,
        "ceil": np.ceil,
    }.get(nearest_mode)
    if rounding is None:
        return None
    return np.clip(rounding(x), 0, size - 1).astype(np.int64)


def _linear_coordinates(size: int, out: int, scale: float, ctm: str) -> np.ndarray | None:
    """The source coordinate of each output of a linear Resize, clamped to [0, size − 1]."""
    if ctm == "tf_half_pixel_for_nn":
        return None
    x = original_coordinates(size, out, scale, ctm)
    if x is None:
        return None
    return np.clip(x, np.float32(0), np.float32(size - 1))


def linear_weights(size: int, out: int, scale: float, ctm: str) -> np.ndarray | None:
    """The [size, out] matrix of an ONNX linear Resize along one axis: column o holds the two
    interpolation weights of output o. The coordinate is clamped to [0, size − 1] first, as
    ONNX Runtime does (the reference pads with the edge value: the same numbers)."""
    x = _linear_coordinates(size, out, scale, ctm)
    if x is None:
        return None
    f32 = np.float32
    low = np.floor(x).astype(np.int64)
    high = np.minimum(low + 1, size - 1)
    upper = (x - low.astype(f32)).astype(f32)
    matrix = np.zeros((size, out), f32)
    columns = np.arange(out)
    np.add.at(matrix, (low, columns), f32(1) - upper)
    np.add.at(matrix, (high, columns), upper)
    return matrix


def _axis_kind(
    size: int, out: int, scale: float, ctm: str, mode: str
) -> tuple[str, int, int] | None:
    """("up", k, 0) for pixel replication by k, ("down", k, offset) for taking every k-th
    pixel from `offset`, ("same", 1, 0) for an untouched axis; None otherwise."""
    idx = nearest_indices(size, out, scale, ctm, mode)
    if idx is None:
        return None
    if out == size and np.array_equal(idx, np.arange(size)):
        return "same", 1, 0
    if out % size == 0 and np.array_equal(idx, np.arange(out) // (out // size)):
        return "up", out // size, 0
    if out > 1 and size % out == 0:
        k = size // out
        if np.array_equal(idx, np.arange(out) * k + idx[0]):
            return "down", k, int(idx[0])
    return None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


MAX_PIECES = 64
"""Most Concat inputs one axis of a gathered Resize may need: each is one move, so a map
that breaks into more pieces costs more than the host round trip it saves."""
MAX_PRE_FACTOR = 8
"""Largest integer upsampling tried before gathering (the MLA's own Resize, when accepted)."""

Piece = tuple[int, int, int]
"""(start, count, step) of one Slice along an axis: positions start, start+step, …"""


def gather_pieces(idx: np.ndarray, k: int, strided: bool) -> list[Piece] | None:
    """The fewest Slices whose concatenation reads, at output position o, an element that a
    k-fold pixel replication of the axis puts at index idx[o] (any of the positions
    idx[o]·k … idx[o]·k + k − 1); None past MAX_PIECES.

    A piece is a run of positions with a constant step ≥ 1 (step 1 only unless `strided`); a
    single position is a piece too (repeated rows read the same one-row Slice). Dynamic
    programming over the output: cost[o] is the fewest pieces covering the first o positions.
    """
    out = len(idx)
    inf = out + 1
    cost = [0] + [inf] * out
    back: list[tuple[int, Piece] | None] = [None] * (out + 1)

    def relax(end: int, start: int, piece: Piece) -> None:
        if cost[start] + 1 < cost[end]:
            cost[end] = cost[start] + 1
            back[end] = (start, piece)

    for o in range(out):
        if cost[o] >= inf:
            continue
        for p0 in range(int(idx[o]) * k, int(idx[o]) * k + k):
            relax(o + 1, o, (p0, 1, 1))
            if o + 1 == out:
                continue
            for p1 in range(int(idx[o + 1]) * k, int(idx[o + 1]) * k + k):
                step = p1 - p0
                if step < 1 or (step > 1 and not strided):
                    continue
                n = 2
                while o + n < out and (p0 + step * n) // k == idx[o + n]:
                    n += 1
                for m in range(2, n + 1):
                    relax(o + m, o, (p0, m, step))
    if cost[out] > MAX_PIECES:
        return None
    pieces: list[Piece] = []
    end = out
    while end:
        start, piece = back[end]  # type: ignore[misc]
        pieces.append(piece)
        end = start
    return pieces[::-1]


def _pieces_cost(pieces: list[Piece], size: int) -> int:
    """Nodes and Concat inputs one axis costs: none when the only piece is the whole axis."""
    if pieces == [(0, size, 1)]:
        return 0
    slices = len({p for p in pieces if p != (0, size, 1)})
    return slices + (len(pieces) if len(pieces) > 1 else 0)


class _Planner:
    """Searches for an exact replacement of one nearest Resize that the target's MLA accepts."""

    def __init__(self, ctx: RuleContext, shape: Sequence[int]) -> None:
        self.ctx = ctx
        self.shape = tuple(shape)

    def resize_ok(self, shape: tuple, fh: int, fw: int) -> Reason | None:
        out = (*shape[:2], shape[2] * fh, shape[3] * fw)
        scales = TensorSpec.const(np.array([1, 1, fh, fw], np.float32))
        roi = TensorSpec.const(np.zeros(0, np.float32))
        return probe_node(
            self.ctx, "Resize", [TensorSpec(shape), roi, scales], [TensorSpec(out)], CANONICAL
        )

    def steps(self, kh: int, kw: int) -> list[list[int]] | None:
        """The shortest chain of accepted integer upsamplings whose product is (kh, kw)."""
        frontier: list[tuple[int, int, tuple, list[list[int]]]] = [(kh, kw, self.shape, [])]
        for _ in range(MAX_STEPS):
            nxt = []
            for rh, rw, shape, chain in frontier:
                for fh, fw in product(_divisors(rh), _divisors(rw)):
                    if (fh, fw) == (1, 1) or self.resize_ok(shape, fh, fw) is not None:
                        continue
                    out = (*shape[:2], shape[2] * fh, shape[3] * fw)
                    done = [*chain, [fh, fw]]
                    if (rh // fh, rw // fw) == (1, 1):
                        return done
                    nxt.append((rh // fh, rw // fw, out, done))
            frontier = nxt[:64]
        return None

    def depth_to_space_ok(self, k: int) -> bool:
        n, c, h, w = self.shape
        stacked = TensorSpec((n, c * k * k, h, w))
        concat = probe_node(
            self.ctx, "Concat", [TensorSpec(self.shape)] * (k * k), [stacked], {"axis": 1}
        )
        d2s = probe_node(
            self.ctx,
            "DepthToSpace",
            [stacked],
            [TensorSpec((n, c, h * k, w * k))],
            {"blocksize": k, "mode": "DCR"},
        )
        return concat is None and d2s is None

    def conv_transpose_ok(self, kh: int, kw: int, depthwise: bool) -> bool:
        n, c, h, w = self.shape
        weight = TensorSpec((c, 1 if depthwise else c, kh, kw), constant=True)
        return (
            probe_node(
                self.ctx,
                "ConvTranspose",
                [TensorSpec(self.shape), weight],
                [TensorSpec((n, c, h * kh, w * kw))],
                {"strides": [kh, kw], "kernel_shape": [kh, kw], "group": c if depthwise else 1},
            )
            is None
        )

    def slice_ok(self, out: tuple, starts: list[int], steps: list[int]) -> bool:
        ends = [starts[i] + (out[2 + i] - 1) * steps[i] + 1 for i in range(2)]
        specs = [TensorSpec.const(np.array(v, np.int64)) for v in (starts, ends, [2, 3], steps)]
        return (
            probe_node(self.ctx, "Slice", [TensorSpec(self.shape), *specs], [TensorSpec(out)])
            is None
        )

    def gather(self, indices: list[np.ndarray]) -> dict | None:
        """Any nearest index map as data movement: an optional integer Resize the MLA
        accepts, then per axis (H, W) a Concat of Slices of it (or one Slice, or nothing).
        The factor pair is the one whose slices and Concats cost fewest nodes and inputs."""
        n, c, h, w = self.shape
        sizes = (h, w)
        strided = self.slice_ok_1d((n, c, h, w), 2, 0, 2, 2)
        options: list[list[tuple[int, list[Piece], int]]] = []
        for a, idx in enumerate(indices):
            ratio = -(-len(idx) // sizes[a])
            axis_options = []
            for k in range(1, min(ratio, MAX_PRE_FACTOR) + 1):
                pieces = gather_pieces(idx, k, strided)
                if pieces is not None:
                    axis_options.append((k, pieces, _pieces_cost(pieces, sizes[a] * k)))
            if not axis_options:
                return None
            options.append(axis_options)
        ranked = sorted(
            product(*options),
            key=lambda o: (sum(c for *_, c in o) + (o[0][0] * o[1][0] > 1), o[0][0] * o[1][0]),
        )
        for (kh, ph, ch), (kw, pw, cw) in ranked:
            if ch == cw == 0 and (kh, kw) == (1, 1):
                return None  # an identity resize: nothing to move
            if (kh, kw) != (1, 1) and self.resize_ok(self.shape, kh, kw) is not None:
                continue
            if not self._gather_ok(kh, kw, ph, pw, len(indices[0]), len(indices[1])):
                continue
            text = [f"×{kh}×{kw} Resize" if kh != kw else f"×{kh} Resize"] * ((kh, kw) != (1, 1))
            for axis, pieces, cost in ((2, ph, ch), (3, pw, cw)):
                if cost:
                    text.append(f"{len(pieces)} Slice piece(s) on axis {axis}")
            return {
                "kind": "gather",
                "pre": [kh, kw],
                "axes": [[list(p) for p in ph], [list(p) for p in pw]],
                "describe": " + ".join(text) + " (nearest index map as data movement)",
            }
        return None

    def _gather_ok(
        self, kh: int, kw: int, ph: list[Piece], pw: list[Piece], out_h: int, out_w: int
    ) -> bool:
        """Every Slice and Concat of a gather plan runs on the MLA."""
        n, c, h, w = self.shape
        shape = (n, c, h * kh, w * kw)
        for axis, pieces, out in ((2, ph, out_h), (3, pw, out_w)):
            size = shape[axis]
            if pieces == [(0, size, 1)]:
                continue
            parts = []
            for start, count, step in pieces:
                if (start, count, step) != (0, size, 1) and not self.slice_ok_1d(
                    shape, axis, start, count, step
                ):
                    return False
                parts.append(TensorSpec(with_axis(shape, axis, count)))
            result = with_axis(shape, axis, out)
            if len(parts) > 1 and (
                probe_node(self.ctx, "Concat", parts, [TensorSpec(result)], {"axis": axis})
                is not None
            ):
                return False
            shape = result
        return True

    def slice_ok_1d(self, shape: tuple, axis: int, start: int, count: int, step: int) -> bool:
        end = start + (count - 1) * step + 1
        specs = [TensorSpec.const(np.array([v], np.int64)) for v in (start, end, axis, step)]
        out = TensorSpec(with_axis(shape, axis, count))
        return probe_node(self.ctx, "Slice", [TensorSpec(shape), *specs], [out]) is None


@register
class ResizeToSupported(GraphRule):
    """Rewrite a nearest-neighbour Resize whose scale the target rejects into an exactly
    equivalent form its MLA accepts.

    The rule first works out, from the coordinate transformation and rounding modes, which
    input pixel each output reads. When that is pixel replication by integers (kh, kw), it tries
    in order: a chain of accepted integer Resizes (×4 as ×2 then ×2; ×6 as ×2 then ×3), then
    Concat of k² copies + DepthToSpace(k, DCR) (each k×k block is one pixel), then a
    ConvTranspose with stride k and an all-ones k×k kernel (depthwise, then dense with an
    identity channel map). When it is taking every k-th pixel (nearest downscaling), it becomes
    a strided Slice. Any other index map (a fractional factor: GhostNetV2's gate interpolated
    from 3×3 to 7×7 reads rows 0,0,0,1,1,2,2) is gathered: an integer Resize the MLA accepts,
    then per axis a Concat of Slices of it (runs of consecutive rows; a repeated row is one
    Slice read again), the factor chosen for the fewest Slices and Concat inputs (at most 64
    per axis). Indices are computed in float32 as ONNX Runtime does. Every form copies pixels
    unchanged, so results are identical. Linear and cubic resizes are rewritten only from a
    single pixel (every output is that pixel, as in the image-pooling branch of DeepLabV3's
    ASPP); otherwise a chain of bilinear resizes is not one bilinear resize. Only nodes the
    target keeps off its MLA are matched.
    """

    name = "resize-to-supported"
    suggest_for = frozenset({"Resize"})
    summary = (
        "Nearest Resize (or any Resize of one pixel) the MLA rejects → Resize chain, "
        "DepthToSpace, ConvTranspose, Slice, or Slices + Concat of its index map."
    )
    category = "replace"
    example = "surgery apply resize-to-supported model.onnx --target rk3588"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        if model_opset(ctx) < 11:
            return []
        pat = Pattern(ctx)
        found = []
        for node in pat.blocked("Resize"):
            plan = self._plan(ctx, pat, node)
            if plan is not None:
                found.append(
                    self.match(
                        [pat.name(node)],
                        f"Resize {pat.name(node)} → {plan['describe']}",
                        [pat.name(node)],
                        **plan,
                    )
                )
        return found

    @staticmethod
    def _plan(ctx: RuleContext, pat: Pattern, node: int) -> dict | None:
        attrs = pat.attrs(node)
        x, y = pat.ins(node)[0], pat.outs(node)[0]
        xs, ys = pat.shape(x), pat.shape(y)
        if xs is None or ys is None or len(xs) != 4 or xs[:2] != ys[:2]:
            return None
        if attrs.get("mode", "nearest") != "nearest":
            if not _from_one_pixel(xs, ys):
                return None
            kinds = [("up", ys[a], 0) if xs[a] != ys[a] else ("same", 1, 0) for a in (2, 3)]
            return _upsample_plan(_Planner(ctx, xs), kinds[0][1], kinds[1][1])
        ctm = attrs.get("coordinate_transformation_mode", "half_pixel")
        rounding = attrs.get("nearest_mode", "round_prefer_floor")
        scales = _declared_scales(pat, node, xs, ys)
        kinds = [_axis_kind(xs[a], ys[a], scales[a], ctm, rounding) for a in (2, 3)]
        planner = _Planner(ctx, xs)
        plan = None
        if all(k is not None and k[0] in ("up", "same") for k in kinds):
            plan = _upsample_plan(planner, kinds[0][1], kinds[1][1])  # type: ignore[index]
        elif all(k is not None and k[0] in ("down", "same") for k in kinds):
            starts = [k[2] for k in kinds]  # type: ignore[index]
            steps = [k[1] for k in kinds]  # type: ignore[index]
            if planner.slice_ok(tuple(ys), starts, steps):
                ends = [starts[i] + (ys[2 + i] - 1) * steps[i] + 1 for i in range(2)]
                plan = {
                    "kind": "slice",
                    "starts": starts,
                    "ends": ends,
                    "steps": steps,
                    "describe": f"strided Slice (steps {steps})",
                }
        if plan is None:
            indices = [nearest_indices(xs[a], ys[a], scales[a], ctm, rounding) for a in (2, 3)]
            if all(i is not None for i in indices):
                plan = planner.gather(indices)  # type: ignore[arg-type]
        return plan

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        node = ed.node_named(match.nodes[0])
        assert node is not None
        x, y = node.inputs[0], node.outputs[0]
        ed.detach(node)
        d = match.data
        builders = {
            "steps": lambda: _build_steps(ed, x, y, d["steps"]),
            "depth_to_space": lambda: _build_depth_to_space(ed, x, y, d["k"]),
            "conv_transpose": lambda: _build_conv_transpose(ed, x, y, d["k"], d["depthwise"]),
            "slice": lambda: _build_slice(ed, x, y, d["starts"], d["ends"], d["steps"]),
            "gather": lambda: _build_gather(ed, x, y, d["pre"], d["axes"]),
        }
        builders[d["kind"]]()
        return True


def _from_one_pixel(xs: Sequence[int], ys: Sequence[int]) -> bool:
    """Every resized axis has one input pixel: any mode then copies it to every output (the
    linear or cubic weights all fall on that pixel), the image-pooling branch of DeepLabV3's
    ASPP upsampling its 1×1 map to the feature map's size."""
    return all(xs[a] == 1 or xs[a] == ys[a] for a in (2, 3)) and any(xs[a] != ys[a] for a in (2, 3))


def _declared_scales(pat: Pattern, node: int, xs: Sequence[int], ys: Sequence[int]) -> list[float]:
    """The scales the Resize computes coordinates with: its `scales` input when given (they
    may differ from out/in when the output size was rounded), else out/in."""
    ins = pat.ins(node)
    if len(ins) > 2 and ins[2]:
        value = pat.value(ins[2])
        if value is not None and value.size == len(xs):
            return [float(v) for v in value.reshape(-1)]
    return [float(np.float32(o) / np.float32(i)) for i, o in zip(xs, ys, strict=True)]


def _upsample_plan(planner: _Planner, kh: int, kw: int) -> dict | None:
    if (kh, kw) == (1, 1):
        return None  # an identity resize blocked for another reason: nothing to replace
    steps = planner.steps(kh, kw)
    if steps is not None:
        text = " then ".join(f"×{fh}×{fw}" if fh != fw else f"×{fh}" for fh, fw in steps)
        return {"kind": "steps", "steps": steps, "describe": f"nearest {text} (asymmetric, floor)"}
    if kh == kw and planner.depth_to_space_ok(kh):
        return {
            "kind": "depth_to_space",
            "k": kh,
            "describe": f"Concat of {kh * kh} copies + DepthToSpace({kh})",
        }
    for depthwise in (True, False):
        if planner.conv_transpose_ok(kh, kw, depthwise):
            how = "depthwise" if depthwise else "dense"
            return {
                "kind": "conv_transpose",
                "k": [kh, kw],
                "depthwise": depthwise,
                "describe": f"{how} ConvTranspose stride {kh}×{kw} with a ones kernel",
            }
    return None


def _roi(ed: Editor) -> gs.Tensor:
    if ed.graph.opset >= 13:
        return gs.Variable.empty()
    return ed.const("resize_roi", np.zeros(0, np.float32))


def _build_steps(ed: Editor, x: gs.Tensor, y: gs.Tensor, steps: list[list[int]]) -> None:
    current = x
    shape = list(x.shape)
    for k, (fh, fw) in enumerate(steps):
        shape = [shape[0], shape[1], shape[2] * fh, shape[3] * fw]
        scales = ed.const("resize_scales", np.array([1, 1, fh, fw], np.float32))
        last = k == len(steps) - 1
        out = y if last else ed.var("resize_step", x.dtype, shape)
        ed.node("Resize", "resize_step", [current, _roi(ed), scales], [out], **CANONICAL)
        current = out


def _build_depth_to_space(ed: Editor, x: gs.Tensor, y: gs.Tensor, k: int) -> None:
    n, c, h, w = x.shape
    stacked = ed.op("Concat", "replicate", [x] * (k * k), [n, c * k * k, h, w], x.dtype, axis=1)
    ed.node("DepthToSpace", "replicate_d2s", [stacked], [y], blocksize=k, mode="DCR")


def _build_conv_transpose(
    ed: Editor, x: gs.Tensor, y: gs.Tensor, k: list[int], depthwise: bool
) -> None:
    c = x.shape[1]
    dtype = x.dtype or np.float32
    if depthwise:
        weight = np.ones((c, 1, *k), dtype)
    else:
        weight = np.zeros((c, c, *k), dtype)
        weight[np.arange(c), np.arange(c)] = 1
    w = ed.const("replicate_weight", weight)
    ed.node(
        "ConvTranspose",
        "replicate",
        [x, w],
        [y],
        strides=list(k),
        kernel_shape=list(k),
        group=c if depthwise else 1,
    )


def _build_slice(
    ed: Editor, x: gs.Tensor, y: gs.Tensor, starts: list[int], ends: list[int], steps: list[int]
) -> None:
    consts = [
        ed.const(f"resize_slice_{what}", np.array(v, np.int64))
        for what, v in (("starts", starts), ("ends", ends), ("axes", [2, 3]), ("steps", steps))
    ]
    ed.node("Slice", "resize_slice", [x, *consts], [y])


def _build_gather(
    ed: Editor, x: gs.Tensor, y: gs.Tensor, pre: list[int], axes: list[list[list[int]]]
) -> None:
    shape = list(x.shape)
    stages: list[tuple] = []
    if pre != [1, 1]:
        shape = [shape[0], shape[1], shape[2] * pre[0], shape[3] * pre[1]]
        stages.append(("resize", list(shape)))
    for axis, pieces in zip((2, 3), axes, strict=True):
        if [tuple(p) for p in pieces] == [(0, shape[axis], 1)]:
            continue
        shape = list(with_axis(shape, axis, sum(p[1] for p in pieces)))
        stages.append(("axis", list(shape), axis, pieces))
    current = x
    for k, stage in enumerate(stages):
        out = y if k == len(stages) - 1 else ed.var("resize_gather", x.dtype, stage[1])
        if stage[0] == "resize":
            scales = ed.const("resize_scales", np.array([1, 1, *pre], np.float32))
            ed.node("Resize", "resize_step", [current, _roi(ed), scales], [out], **CANONICAL)
        else:
            _build_axis_gather(ed, current, out, stage[2], stage[3])
        current = out


def _build_axis_gather(
    ed: Editor, x: gs.Tensor, y: gs.Tensor, axis: int, pieces: list[list[int]]
) -> None:
    """y = Concat of the Slices `pieces` of x along `axis` (one Slice when there is one piece);
    a piece read several times (a repeated row) is one Slice."""
    size = x.shape[axis]
    sliced: dict[tuple[int, int, int], gs.Tensor] = {}
    parts = []
    for start, count, step in pieces:
        key = (start, count, step)
        if key == (0, size, 1):
            parts.append(x)
            continue
        if key not in sliced:
            out = (
                y
                if len(pieces) == 1
                else ed.var("resize_rows", x.dtype, with_axis(x.shape, axis, count))
            )
            end = start + (count - 1) * step + 1
            consts = [
                ed.const(f"resize_slice_{what}", np.array([v], np.int64))
                for what, v in (("starts", start), ("ends", end), ("axes", axis), ("steps", step))
            ]
            ed.node("Slice", "resize_rows", [x, *consts], [out])
            sliced[key] = out
        parts.append(sliced[key])
    if len(pieces) > 1:
        ed.node("Concat", "resize_concat", parts, [y], axis=axis)


RESIZE_ATTRIBUTES_OPSET = 11
"""The first opset whose Resize states its coordinate mode (Upsample's is asymmetric)."""


MAX_MATRIX = 1 << 20
"""Most entries one interpolation matrix of linear-resize-to-matmul may hold (a 1024 → 1024
axis): beyond that the constant, not the host round trip, is the cost."""


@register
class LinearResizeToMatMul(GraphRule):
    """Rewrite a linear Resize the MLA rejects as MatMuls by constant interpolation matrices.

    A linear resize is linear in its input and separable: along W it is X · A_w with
    A_w [W, W_out] holding each output column's two interpolation weights, along H it is
    A_h · X with A_h [H_out, H]. The weights follow the node's coordinate transformation in
    float32 as ONNX Runtime computes them. Every MLA runs MatMul by a constant; few run a
    fractional linear resize (rk3588: integer scales only; DepthAnything's head resizes by 1.75,
    DeepLabV3 by 16). The same weighted sums: equal up to float rounding. Axes the Resize does
    not change are left out. Only Resizes the target keeps off its MLA are matched.
    """

    name = "linear-resize-to-matmul"
    suggest_for = frozenset({"Resize"})
    summary = (
        "Linear Resize the MLA rejects (fractional scale) → MatMuls by interpolation matrices."
    )
    category = "replace"
    example = "surgery apply linear-resize-to-matmul depth_anything.onnx --target rk3588"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        if model_opset(ctx) < 11:
            return []
        pat = Pattern(ctx)
        found = []
        for node in pat.blocked("Resize"):
            plan = _matmul_plan(pat, node)
            if plan is None:
                continue
            x, y = pat.ins(node)[0], pat.outs(node)[0]
            xs, ys = pat.shape(x), pat.shape(y)
            assert xs is not None and ys is not None
            elem = pat.elem_type(x)
            probes: list[Reason | None] = []
            current = tuple(xs)
            if plan["w"] is not None:
                after = (*current[:3], ys[3])
                matrix = TensorSpec((xs[3], ys[3]), elem, constant=True)
                probes.append(
                    probe_node(
                        ctx,
                        "MatMul",
                        [TensorSpec(current, elem), matrix],
                        [TensorSpec(after, elem)],
                    )
                )
                current = after
            if plan["h"] is not None:
                matrix = TensorSpec((ys[2], xs[2]), elem, constant=True)
                probes.append(
                    probe_node(ctx, "MatMul", [matrix, TensorSpec(current, elem)], [pat.spec(y)])
                )
            names = [pat.name(node)]
            found.append(
                self.match(
                    names,
                    f"Resize {pat.name(node)} {xs[2]}×{xs[3]} → {ys[2]}×{ys[3]} (linear) → "
                    f"MatMul by {'A_h, ' if plan['h'] is not None else ''}"
                    f"{'A_w' if plan['w'] is not None else ''}".rstrip(", "),
                    freed_blockers(ctx, names, all(p is None for p in probes)),
                    ctm=plan["ctm"],
                    scales=plan["scales"],
                    axes=[a for a in ("h", "w") if plan[a] is not None],
                )
            )
        return found

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        node = ed.node_named(match.nodes[0])
        assert node is not None
        x, y = node.inputs[0], node.outputs[0]
        xs, ys = list(x.shape), list(y.shape)
        ed.detach(node)
        d = match.data
        current = x
        if "w" in d["axes"]:
            a_w = linear_weights(xs[3], ys[3], d["scales"][1], d["ctm"])
            assert a_w is not None
            last = "h" not in d["axes"]
            out = y if last else ed.var("resize_w_out", x.dtype, [*xs[:3], ys[3]])
            ed.node("MatMul", "resize_w", [current, ed.const("resize_w", a_w)], [out])
            current = out
        if "h" in d["axes"]:
            a_h = linear_weights(xs[2], ys[2], d["scales"][0], d["ctm"])
            assert a_h is not None
            ed.node(
                "MatMul",
                "resize_h",
                [ed.const("resize_h", np.ascontiguousarray(a_h.T)), current],
                [y],
            )
        return True


def _matmul_plan(pat: Pattern, node: int) -> dict | None:
    """The coordinate mode, the H/W scales and which axes need a matrix (None for an axis the
    Resize leaves alone), when the node is a plain 4-D linear Resize of H and W."""
    attrs = pat.attrs(node)
    x, y = pat.ins(node)[0], pat.outs(node)[0]
    xs, ys = pat.shape(x), pat.shape(y)
    if attrs.get("mode", "nearest") != "linear" or attrs.get("antialias", 0):
        return None
    if xs is None or ys is None or len(xs) != 4 or xs[:2] != ys[:2] or not pat.is_float(x):
        return None
    ctm = attrs.get("coordinate_transformation_mode", "half_pixel")
    scales = _declared_scales(pat, node, xs, ys)
    if scales[:2] != [1.0, 1.0]:
        return None
    plan: dict = {"ctm": ctm, "scales": scales[2:]}
    for axis, key in ((2, "h"), (3, "w")):
        coordinates = _linear_coordinates(xs[axis], ys[axis], scales[axis], ctm)
        if coordinates is None or xs[axis] * ys[axis] > MAX_MATRIX:
            return None
        # every output reads its own input index: the identity matrix, nothing to multiply
        identity = xs[axis] == ys[axis] and np.array_equal(coordinates, np.arange(ys[axis]))
        plan[key] = None if identity else key
    if plan["h"] is None and plan["w"] is None:
        return None
    return plan


@register
class UpsampleToResize(OpsetGraphRule):
    """Rewrite the Upsample op of old exports (opset 7–9: torch ≤ 1.2, Keras/TF converters,
    darknet ports) as the Resize that computes the same thing.

    Upsample is deprecated since opset 10 and no target runs it on the MLA, so an old FPN or
    YOLOv3 neck leaves the accelerator at every upsampling. The model is converted to opset 11
    with ONNX's version converter, which turns each Upsample into a Resize; the conversion
    states Upsample's asymmetric coordinates (and floor rounding for nearest), which the
    converter itself leaves at Resize's half_pixel default. Identical results, nearest or
    linear. Only Upsamples with constant scales (for the placement probe).
    """

    name = "upsample-to-resize"
    suggest_for = frozenset({"Upsample"})
    summary = "Upsample (opset ≤ 9) → Resize with the same asymmetric coordinates (opset 11)."
    category = "replace"
    example = "surgery apply upsample-to-resize yolov3_opset9.onnx -w ws"

    def find(self, ctx: RuleContext, params: RuleParams) -> list[Match]:
        if opset_upgrade_error(ctx, RESIZE_ATTRIBUTES_OPSET) is not None:
            return []
        pat = Pattern(ctx)
        opset = max(model_opset(ctx), RESIZE_ATTRIBUTES_OPSET)
        found = []
        for node in pat.blocked("Upsample"):
            ins, attrs = pat.ins(node), pat.attrs(node)
            scales = pat.value(ins[1]) if len(ins) > 1 and ins[1] else attrs.get("scales")
            shape, out = pat.shape(ins[0]), pat.shape(pat.outs(node)[0])
            if scales is None or shape is None or out is None:
                continue
            mode = attrs.get("mode", "nearest")
            mode = mode.decode() if isinstance(mode, bytes) else str(mode)
            resize_attrs = {"mode": mode, "coordinate_transformation_mode": "asymmetric"}
            if mode == "nearest":
                resize_attrs["nearest_mode"] = "floor"
            roi = TensorSpec.const(np.zeros(0, np.float32))
            factors = TensorSpec.const(np.asarray(scales, np.float32).reshape(-1))
            probe = probe_node(
                ctx,
                "Resize",
                [TensorSpec(shape), roi, factors],
                [TensorSpec(out)],
                resize_attrs,
                opset=opset,
            )
            name = pat.name(node)
            found.append(
                self.match(
                    [name],
                    f"Upsample {name} ({mode}) → Resize" + conversion_note(ctx, opset),
                    freed_blockers(ctx, [name], probe is None),
                    opset=opset,
                )
            )
        return found

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        """The conversion has replaced the Upsample; one left behind (an Upsample-10 the
        converter kept) is rewritten here."""
        node = ed.node_named(match.nodes[0])
        assert node is not None
        if node.op == "Resize":
            return True
        if node.op != "Upsample" or len(node.inputs) < 2:
            return False
        mode = str(node.attrs.get("mode", "nearest"))
        node.op = "Resize"
        node.inputs = [node.inputs[0], ed.const("roi", np.zeros(0, np.float32)), node.inputs[1]]
        node.attrs = {"mode": mode, "coordinate_transformation_mode": "asymmetric"}
        if mode == "nearest":
            node.attrs["nearest_mode"] = "floor"
        return True
