"""The lifting engine: rewrite a region of nodes so every tensor inside it is carried as 4-D.

`Lifter` walks the region in topological order. Every tensor produced inside gets a 4-D
stand-in plus the `Layout` that relates it to the original; each op has a handler that reads its
inputs' 4-D forms (converting them when the op needs a particular layout), emits the 4-D op and
records the layout of its outputs. Pure data-movement ops (Transpose, Identity, reshapes that only
add or drop unit axes) emit nothing: they change the layout, not the data. Where a tensor leaves
the region (a graph output or a consumer outside), the original tensor is rebuilt from its 4-D
form under its own name, so the rest of the graph and the model's outputs are unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx_graphsurgeon as gs

from surgery.graph import FreshNames, GraphView
from surgery.rules import rank4_layout as L
from surgery.rules.graph_edit import constant
from surgery.rules.rank4_layout import Layout, Shape

Policy = Callable[[Shape], Layout]
"""The layout a rule gives a tensor whose form an op does not dictate (e.g. a Reshape output)."""

Handler = Callable[["Lifter", gs.Node], None]
HANDLERS: dict[str, Handler] = {}


def handles(*ops: str) -> Callable[[Handler], Handler]:
    def register(fn: Handler) -> Handler:
        for op in ops:
            HANDLERS[op] = fn
        return fn

    return register


@dataclass(frozen=True)
class Lifted:
    """The 4-D stand-in of an original tensor."""

    var: gs.Tensor
    layout: Layout
    shape: Shape
    """Static shape of the original tensor."""


def ncl_policy(shape: Shape) -> Layout:
    """[N,C,L] → [N,C,1,L], [N,C] → [N,C,1,1]: channels stay on axis 1 (detection heads)."""
    rank = len(shape)
    if 1 <= rank <= 4:
        return L.ncl(rank)
    return _spread_or_fail(shape)


def rows_policy(shape: Shape) -> Layout:
    """[B,L,C] → [B·L,C,1,1]: one row per token, features on the channel axis (transformers)."""
    rank = len(shape)
    if rank == 4:
        return L.identity()
    if 1 <= rank <= 3:
        return L.rows(rank)
    return _spread_or_fail(shape)


def _spread_or_fail(shape: Shape) -> Layout:
    layout = L.spread(shape)
    if layout is None or not shape:
        raise ValueError(f"a tensor of shape {list(shape)} cannot be carried as 4-D")
    return layout


def static_dims(shape: Sequence[object] | None) -> Shape:
    """A shape as ints (callers have checked it is static)."""
    if shape is None or not all(isinstance(d, int) for d in shape):
        raise ValueError(f"shape {shape} is not static")
    return tuple(d for d in shape if isinstance(d, int))


def relayout_constant(value: np.ndarray, layout: Layout, shape: Sequence[int]) -> np.ndarray:
    """A constant operand re-laid-out so it broadcasts against the 4-D form exactly as before.

    `shape` is the (original) shape the constant broadcasts against. Scalars stay scalars; other
    constants get leading unit axes up to that rank, and are expanded to it only when a merged
    slot would mix broadcast and non-broadcast axes.
    """
    if value.size == 1:
        return value if value.ndim <= 4 else value.reshape(())
    rank = len(shape)
    v = value.reshape((1,) * (rank - value.ndim) + tuple(value.shape))
    if not layout.broadcasts(v.shape, shape):
        v = np.broadcast_to(v, tuple(shape))
    return np.ascontiguousarray(v.transpose(layout.order).reshape(layout.shape4(v.shape)))


def constant_of(tensor: gs.Tensor) -> np.ndarray | None:
    """The value of an initializer or of a Constant node's output; None for run-time tensors."""
    if isinstance(tensor, gs.Constant):
        return np.asarray(tensor.values)
    if not tensor.name or len(tensor.inputs) != 1 or tensor.inputs[0].op != "Constant":
        return None
    attrs = tensor.inputs[0].attrs
    if isinstance(attrs.get("value"), gs.Constant):
        return np.asarray(attrs["value"].values)
    for key, dtype in (
        ("value_float", np.float32),
        ("value_floats", np.float32),
        ("value_int", np.int64),
        ("value_ints", np.int64),
    ):
        if key in attrs:
            return np.asarray(attrs[key], dtype=dtype)
    return None


class LiftError(ValueError):
    """A region could not be lifted; the graph is unchanged. `node` names the region node
    being rewritten (or whose result was being handed back) when it failed, if known."""

    def __init__(self, message: str, node: str | None = None) -> None:
        super().__init__(message)
        self.node = node


class Lifter:
    """Rewrites one region; `run()` leaves the graph with the region replaced by 4-D ops."""

    def __init__(
        self,
        graph: gs.Graph,
        view: GraphView,
        region: Sequence[gs.Node],
        policy: Policy,
        opset: int,
    ) -> None:
        self.graph = graph
        self.view = view
        self.region = list(region)
        self.policy = policy
        self.opset = opset
        self.lifted: dict[str, Lifted] = {}
        self.created: list[gs.Node] = []
        self._cache: dict[tuple[str, Layout, Layout], Lifted] = {}
        """Conversions by (4-D tensor, the layout it is read in, target layout): a Transpose
        relabels the same 4-D tensor with another layout, so the tensor alone is no key."""
        self._shapes: dict[str, Shape] = {}
        self._fresh_vars: set[str] = set()
        self._bound: dict[str, gs.Tensor] = {}
        self._names = FreshNames(taken=[*graph.tensors(), *(n.name for n in graph.nodes)])
        # The rewritten ops keep the names of the nodes they replace (readable history).
        tensors = set(graph.tensors())
        self._names.taken -= {n.name for n in self.region if n.name not in tensors}

    # ------------------------------------------------------------------ reading the original
    def shape(self, tensor: gs.Tensor) -> Shape:
        """Static shape of an original tensor (find() only admits static shapes)."""
        if tensor.name in self._shapes:
            return self._shapes[tensor.name]
        info = self.view.tensor(tensor.name)
        if not info.is_static:
            raise ValueError(f"tensor {tensor.name!r} has no static shape")
        return static_dims(info.shape)

    def const(self, tensor: gs.Tensor) -> np.ndarray | None:
        return constant_of(tensor)

    def value(self, tensor: gs.Tensor) -> Lifted:
        """The 4-D form of a data tensor; tensors from outside the region enter here."""
        known = self.lifted.get(tensor.name)
        if known is not None:
            return known
        shape = self.shape(tensor)
        if len(shape) == 4:
            entry = Lifted(tensor, L.identity(), shape)
        else:
            layout = self.layout_for(tensor, shape)
            var = self._chain(tensor, L.steps_between(shape, None, layout), f"{tensor.name}_to4d")
            entry = Lifted(var, layout, shape)
        self.lifted[tensor.name] = entry
        return entry

    def layout_for(self, tensor: gs.Tensor, shape: Shape) -> Layout:
        """The rule's layout for a new tensor; for a Transpose's >4-D input, its slot runs.

        The slot runs are also preferred when the Transpose's result is only reshaped (so it
        is needed in plain order) and the rule's layout puts an axis on the batch slot that the
        Transpose moves away from the front (ShuffleNet's channel shuffle [1,g,C/g,H,W], perm
        (0,2,1,3,4), Reshape back to [1,C,H,W]): the plain order would then need a 4-D Transpose
        of the batch axis, which the MLA does not run.
        """
        users = tensor.outputs
        perm = None
        if len(users) == 1 and users[0].op == "Transpose" and "perm" in users[0].attrs:
            perm = list(users[0].attrs["perm"])
        try:
            layout = self.policy(shape)
        except ValueError:
            runs = L.transpose_runs(shape, perm) if perm is not None else None
            if runs is not None:
                return runs
            raise
        if (
            perm is not None
            and len(shape) > L.SLOTS
            and _only_reshaped(users[0])
            and L.moves_batch_slot(layout, shape, perm)
        ):
            runs = L.transpose_runs(shape, perm)
            if runs is not None and not L.moves_batch_slot(runs, shape, perm):
                return runs
        return layout

    def separated(self, x: Lifted) -> Lifted:
        """`x` with every non-unit axis alone in its slot (what axis-indexed ops can address)."""
        target = L.spread(x.shape)
        if target is None:
            raise ValueError(f"shape {list(x.shape)} has more than four non-unit axes")
        return self.convert(x, target)

    def plain(self, x: Lifted) -> Lifted:
        """`x` in a layout that is a plain reshape of the original (what Reshape needs)."""
        if x.layout.is_plain(x.shape):
            return x
        target = L.plain_slots(x.layout, x.shape) or L.spread(x.shape)
        if target is None:
            raise ValueError(f"no plain 4-D layout for shape {list(x.shape)}")
        return self.convert(x, target)

    # ------------------------------------------------------------------ recording results
    def set(self, tensor: gs.Tensor, var: gs.Tensor, layout: Layout) -> None:
        self.lifted[tensor.name] = Lifted(var, layout, self.shape(tensor))

    def convert(self, x: Lifted, layout: Layout) -> Lifted:
        """`x` in another layout (conversions are shared between consumers)."""
        if x.layout == layout:
            return x
        key = (x.var.name, x.layout, layout)
        if key not in self._cache:
            steps = L.steps_between(x.shape, x.layout, layout)
            var = self._chain(x.var, steps, f"{x.var.name}_relayout")
            self._cache[key] = Lifted(var, layout, x.shape)
        return self._cache[key]

    def choose(
        self,
        inputs: Sequence[Lifted],
        shape: Shape,
        ok: Callable[[Layout], bool] = lambda _: True,
        extra: Sequence[Layout] = (),
    ) -> Layout:
        """The layout for an op whose inputs must agree: the one needing fewest new conversions.

        Candidates are the inputs' own layouts, then the rule's default and the spread layout
        (when the shape has one), then `extra`; `ok` filters out layouts the op cannot use.
        """
        try:
            default: Layout | None = self.policy(shape)
        except ValueError:
            default = None  # more than four non-unit axes: only `extra` can carry the result
        candidates = [x.layout for x in inputs] + ([default] if default is not None else [])
        spread = L.spread(shape)
        if spread is not None:
            candidates.append(spread)
        candidates.extend(extra)
        usable = [c for c in dict.fromkeys(candidates) if ok(c)]
        if not usable:
            raise ValueError(f"no 4-D layout fits an op on shape {list(shape)}")

        def cost(layout: Layout) -> tuple[int, int]:
            new = sum(
                1
                for x in inputs
                if x.layout != layout and (x.var.name, x.layout, layout) not in self._cache
            )
            return (new, layout != default)

        return min(usable, key=cost)

    # ------------------------------------------------------------------ emitting
    def emit(
        self,
        op: str,
        inputs: Sequence[gs.Tensor],
        shapes: Sequence[Shape],
        name: str,
        dtype: Any = np.float32,
        **attrs: Any,
    ) -> list[gs.Variable]:
        outputs = [self._var(f"{name}_out", shape, dtype) for shape in shapes]
        node = gs.Node(op, self._names(name), attrs, list(inputs), outputs)
        self.created.append(node)
        return outputs

    def constant(self, base: str, value: np.ndarray) -> gs.Constant:
        return constant(self._names(base), value)

    def _var(self, base: str, shape: Shape, dtype: Any) -> gs.Variable:
        var = gs.Variable(self._names(base), dtype=dtype, shape=list(shape))
        self._shapes[var.name] = tuple(shape)
        self._fresh_vars.add(var.name)
        return var

    def _chain(
        self,
        src: gs.Tensor,
        steps: Iterable[L.Step],
        base: str,
        last: gs.Tensor | None = None,
    ) -> gs.Tensor:
        steps = list(steps)
        current = src
        for k, (kind, arg) in enumerate(steps):
            final = k == len(steps) - 1
            if kind == "Reshape":
                shape = arg
                attrs: dict[str, Any] = {}
                inputs = [current, self.constant(f"{base}_shape", np.array(arg, np.int64))]
            else:
                shape = tuple(self._shape_of(current)[p] for p in arg)
                attrs = {"perm": list(arg)}
                inputs = [current]
            out = last if final and last is not None else self._var(base, shape, _dtype(src))
            node = gs.Node(kind, self._names(base), attrs, inputs, [out])
            self.created.append(node)
            current = out
        return current

    def _shape_of(self, tensor: gs.Tensor) -> Shape:
        return self._shapes.get(tensor.name) or self.shape(tensor)

    # ------------------------------------------------------------------ the whole rewrite
    def run(self) -> None:
        """Lift the region, or raise LiftError with the graph left exactly as it was."""
        culprit: str | None = None
        try:
            for node in self.region:
                culprit = node.name
                HANDLERS[node.op](self, node)
            exits = []
            for t in self._leaving():
                culprit = t.inputs[0].name if t.inputs else None
                x = self.lifted[t.name]
                exits.append((t, x, L.steps_between(x.shape, x.layout, None)))
        except (ValueError, KeyError, IndexError) as exc:
            for node in self.created:
                node.inputs.clear()
                node.outputs.clear()
            raise LiftError(f"{type(exc).__name__}: {exc}", culprit) from exc
        for node in self.region:
            node.inputs.clear()
            node.outputs.clear()
        binds = []
        for t, x, steps in exits:
            if steps:
                self._chain(x.var, steps, f"{t.name}_from4d", last=t)
            else:
                binds.append((x.var, t))
        for var, t in binds:
            self._bind(var, t)
        _simplify(self.graph, self.created, self._fresh_vars, self._shapes)
        self.graph.nodes.extend(n for n in self.created if n.outputs)

    def _leaving(self) -> list[gs.Tensor]:
        """Region outputs the rest of the graph reads: graph outputs and outside consumers."""
        members = {id(n) for n in self.region}
        graph_outputs = {id(t) for t in self.graph.outputs}
        return [
            t
            for node in self.region
            for t in node.outputs
            if t.name in self.lifted
            and (id(t) in graph_outputs or any(id(c) not in members for c in t.outputs))
        ]

    def _bind(self, var: gs.Tensor, original: gs.Tensor) -> None:
        """Make the original tensor the output of the node that computes its 4-D form."""
        source = self._bound.get(var.name, var)
        producer = var.inputs[0] if len(var.inputs) == 1 else None
        if source is var and var.name in self._fresh_vars and producer is not None:
            for consumer in list(var.outputs):
                _swap(consumer.inputs, var, original)
            _swap(producer.outputs, var, original)
            self._fresh_vars.discard(var.name)
            self._bound[var.name] = original
            return
        name = self._names(original.name)
        self.created.append(gs.Node("Identity", name, {}, [source], [original]))


def _only_reshaped(node: gs.Node) -> bool:
    """The node's single output is read by reshapes only (it is needed in plain order)."""
    readers = [r for out in node.outputs for r in out.outputs]
    return bool(readers) and all(r.op in ("Reshape", "Flatten") for r in readers)


def _swap(tensors: list[gs.Tensor], old: gs.Tensor, new: gs.Tensor) -> None:
    """Replace `old` by `new` in a graphsurgeon input/output list (no slice assignment there)."""
    for k, t in enumerate(tensors):
        if t is old:
            tensors[k] = new


def _dtype(tensor: gs.Tensor) -> Any:
    return tensor.dtype if tensor.dtype is not None else np.float32


# ---------------------------------------------------------------------- clean-up of the emitted ops


def _simplify(
    graph: gs.Graph, created: list[gs.Node], fresh: set[str], shapes: dict[str, Shape]
) -> None:
    """Merge back-to-back Reshapes and Transposes and drop no-op ones among the emitted nodes.

    Only tensors this rewrite created are folded away; original tensors keep their producers.
    """
    outputs = {id(t) for t in graph.outputs}

    def single_use(t: gs.Tensor) -> bool:
        return t.name in fresh and id(t) not in outputs and len(t.outputs) == 1

    changed = True
    while changed:
        changed = False
        for node in created:
            if not node.outputs or not node.inputs:
                continue
            src = node.inputs[0]
            inner = src.inputs[0] if len(src.inputs) == 1 else None
            if inner is not None and inner.op == node.op and single_use(src):
                if node.op == "Transpose":
                    outer, first = node.attrs["perm"], inner.attrs["perm"]
                    node.attrs["perm"] = [first[p] for p in outer]
                if node.op in ("Reshape", "Transpose"):
                    node.inputs[0] = inner.inputs[0]
                    _detach(inner)
                    changed = True
            if _is_no_op(node, shapes) and node.outputs[0].name in fresh:
                _bypass(node)
                changed = True
    _fuse_conv_bias(created, fresh)


def _is_no_op(node: gs.Node, shapes: dict[str, Shape]) -> bool:
    if not node.inputs or not node.outputs:
        return False
    if node.op == "Transpose":
        perm = node.attrs.get("perm")
        return perm is not None and list(perm) == sorted(perm)
    if node.op == "Reshape":
        src = shapes.get(node.inputs[0].name) or _static(node.inputs[0])
        return src is not None and src == shapes.get(node.outputs[0].name)
    return False


def _static(tensor: gs.Tensor) -> Shape | None:
    shape = tensor.shape
    if shape is None or not all(isinstance(d, int) for d in shape):
        return None
    return tuple(shape)


def _bypass(node: gs.Node) -> None:
    src, dst = node.inputs[0], node.outputs[0]
    for consumer in list(dst.outputs):
        _swap(consumer.inputs, dst, src)
    _detach(node)


def _detach(node: gs.Node) -> None:
    if node.outputs and node.outputs[0].outputs:
        return  # still used elsewhere
    node.inputs.clear()
    node.outputs.clear()


def _fuse_conv_bias(created: list[gs.Node], fresh: set[str]) -> None:
    """Conv without bias followed only by Add of a per-channel constant → Conv with that bias."""
    for conv in created:
        if conv.op != "Conv" or len(conv.inputs) != 2 or not conv.outputs:
            continue
        y = conv.outputs[0]
        if y.name not in fresh or len(y.outputs) != 1 or y.outputs[0].op != "Add":
            continue
        add = y.outputs[0]
        other = [t for t in add.inputs if t is not y]
        if len(other) != 1 or not isinstance(other[0], gs.Constant):
            continue
        bias = np.asarray(other[0].values)
        channels = conv.inputs[1].shape[0]
        if bias.ndim != 4 or bias.shape != (1, channels, 1, 1) or bias.dtype != np.float32:
            continue
        out = add.outputs[0]
        add.inputs.clear()
        add.outputs.clear()
        conv.inputs.append(gs.Constant(other[0].name + "_bias", bias.reshape(channels)))
        conv.outputs[0] = out
