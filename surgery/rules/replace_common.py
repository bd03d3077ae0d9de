"""Shared machinery for the operator-replacement and cleanup rules.

Three things every replacement needs and none should re-invent:

- **Would the replacement run on the MLA?** `probe_node` places a hypothetical node with the
  target's own op table (the same `Target.decide` that `surgery check` uses), so a rule only
  claims to free a blocker when the ops it emits really run on the accelerator — never by a
  hard-coded op list. `net_freed` turns the probes into the blockers a match reports.
- **Pattern lookups on the read-only view** (`Pattern`): producers, sole consumers, attributes
  and constant values, by op structure only (node names are never part of a pattern).
- **Small graphsurgeon edits** (`Editor`): fresh names for new nodes, tensors and constants,
  constant values through the pre-edit context, and (`GraphRule`) one edit per match with
  overlapping matches skipped.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from math import prod
from typing import Any

import numpy as np
import onnx
import onnx_graphsurgeon as gs
from onnx import helper

from surgery.constant_values import evaluate_constants
from surgery.graph import GraphView, TensorInfo, attribute_values, default_opset
from surgery.model import convert_opset
from surgery.rules.base import Match, Rule, RuleContext, RuleParams
from surgery.rules.engine import RuleNotApplicableError
from surgery.rules.graph_edit import constant, import_graph, nodes_by_name
from surgery.targets import NodeContext, Reason

FLOAT32 = onnx.TensorProto.FLOAT

_LARGE = 1 << 40


# --------------------------------------------------------------------------- placement probes


@dataclass(frozen=True)
class TensorSpec:
    """A tensor of a hypothetical node: its type, static shape and, for constants, its value."""

    shape: tuple[int, ...] | None
    elem_type: int = FLOAT32
    value: np.ndarray | None = None
    constant: bool = False

    @classmethod
    def const(cls, value: np.ndarray) -> TensorSpec:
        arr = np.asarray(value)
        return cls(tuple(arr.shape), helper.np_dtype_to_tensor_dtype(arr.dtype), arr, True)


def probe_node(
    ctx: RuleContext,
    op: str,
    inputs: Sequence[TensorSpec | None],
    outputs: Sequence[TensorSpec],
    attrs: dict[str, Any] | None = None,
    opset: int | None = None,
) -> Reason | None:
    """None when the target places `op` with these tensors on the MLA, else the first reason.

    The node is placed by the target's op table, on a one-node model with the given shapes and
    constants, so every declarative constraint (rank, axis, attribute, constant input …) is the
    one `surgery check` would apply to the rewritten graph.
    """
    if not ctx.target.supports(op, "MLA"):
        return Reason("op_not_supported", f"{op} is not supported on the MLA of {ctx.target.name}")
    opset = opset or model_opset(ctx)
    key = _probe_key(op, inputs, outputs, attrs or {}, opset)
    probes = ctx.probes
    if key in probes:
        return probes[key]
    view, constants = _probe_view(op, inputs, outputs, attrs or {}, opset)
    decision = ctx.target.decide(op, NodeContext(view, 0, constants), known_op=True)
    if decision.processor == "MLA":
        answer = None
    else:
        answer = (
            decision.reasons[-1] if decision.reasons else Reason("unknown", f"{op} is not placed")
        )
    probes[key] = answer
    return answer


def _probe_key(
    op: str,
    inputs: Sequence[TensorSpec | None],
    outputs: Sequence[TensorSpec],
    attrs: dict[str, Any],
    opset: int,
) -> tuple:
    """Everything the one-node probe model is built from, hashable (the target is the
    context's own, so it is not part of the key)."""

    def spec_key(spec: TensorSpec | None) -> tuple | None:
        if spec is None:
            return None
        value = None
        if spec.value is not None:
            arr = np.asarray(spec.value)
            value = (arr.dtype.str, arr.shape, arr.tobytes())
        return (spec.shape, spec.elem_type, spec.constant, value)

    return (
        op,
        opset,
        repr(sorted(attrs.items())),
        tuple(spec_key(s) for s in inputs),
        tuple(spec_key(s) for s in outputs),
    )


class _ProbeView(GraphView):
    """The view of a one-node model, built from the node and its tensor specs directly.

    A probe asks the same `Target.decide` as `surgery check`, which reads the node only
    through a GraphView; serialising specs into a ModelProto (value infos, initializers) just
    to parse them back cost more than the placement itself. Tensor dims read as
    `shape_from_type` would read them from the TypeProto the model would hold.
    """

    def __init__(
        self,
        node: onnx.NodeProto,
        opset: int,
        specs: dict[str, TensorSpec],
        graph_inputs: list[str],
        graph_outputs: list[str],
    ) -> None:
        self.model = onnx.ModelProto(opset_import=[helper.make_opsetid("", opset)])
        self.initializers = {}
        self.graph_inputs = graph_inputs
        self.graph_outputs = graph_outputs
        self._index_nodes([node])
        self.reload_value_info()
        self._specs = specs

    def _make_tensor_info(self, name: str) -> TensorInfo:
        spec = self._specs.get(name)
        if spec is None:
            return TensorInfo(name, 0, None, False)
        if spec.value is not None:
            value = np.asarray(spec.value)
            elem_type = helper.np_dtype_to_tensor_dtype(value.dtype)
            return TensorInfo(name, elem_type, tuple(value.shape), True)
        if spec.shape is None:
            return TensorInfo(name, spec.elem_type, None, False)
        # Dims as `shape_from_type` reads the TypeProto a model would hold: a positive int
        # stays, a symbol name stays, anything else (0, negative, None) is unknown.
        dims = tuple(
            d if (isinstance(d, int) and d > 0) or (isinstance(d, str) and d) else None
            for d in spec.shape
        )
        return TensorInfo(name, spec.elem_type, dims)

    def has_tensor_info(self, name: str) -> bool:
        return name in self._specs

    def is_initializer(self, name: str) -> bool:
        spec = self._specs.get(name)
        return spec is not None and spec.value is not None

    def _decode_constant(self, name: str, max_elements: int) -> np.ndarray | None:
        spec = self._specs.get(name)
        if spec is None or spec.value is None:
            return None
        value = np.asarray(spec.value)
        return value if value.size <= max_elements else None


def _probe_view(
    op: str,
    inputs: Sequence[TensorSpec | None],
    outputs: Sequence[TensorSpec],
    attrs: dict[str, Any],
    opset: int,
) -> tuple[_ProbeView, frozenset[str]]:
    """The one-node model's view (inputs in0…, outputs out0…) and its constant inputs."""
    names, specs, graph_inputs, constants = [], {}, [], set()
    for k, spec in enumerate(inputs):
        if spec is None:
            names.append("")
            continue
        name = f"in{k}"
        names.append(name)
        specs[name] = spec
        if spec.value is None:
            graph_inputs.append(name)
        if spec.constant or spec.value is not None:
            constants.add(name)
    outs = [f"out{k}" for k in range(len(outputs))]
    specs.update(zip(outs, outputs, strict=True))
    node = helper.make_node(op, names, outs, **attrs)
    return _ProbeView(node, opset, specs, graph_inputs, outs), frozenset(constants)


def all_on_mla(probes: Iterable[Reason | None]) -> bool:
    """True when every probed replacement node is placed on the MLA."""
    return all(p is None for p in probes)


def freed_blockers(ctx: RuleContext, nodes: Iterable[str], on_mla: bool = True) -> list[str]:
    """The current blockers among `nodes` — the ones a rewrite frees when its replacement runs
    on the MLA (`on_mla`); none otherwise, so `surgery fix` does not pick a rewrite that only
    moves a blocker around."""
    if not on_mla:
        return []
    blockers = ctx.blocker_names
    return [n for n in nodes if n in blockers]


def net_freed(
    ctx: RuleContext,
    removed: Iterable[str],
    main: Iterable[Reason | None],
    extra: Iterable[Reason | None] = (),
) -> list[str]:
    """Blockers among the `removed` nodes, claimed only when the main replacement runs on the
    MLA and the helper nodes left off it (e.g. a rank-2 Reshape back at the model's output)
    are fewer than the blockers removed — a net gain `surgery fix` can rely on."""
    if not all_on_mla(main):
        return []
    freed = freed_blockers(ctx, removed)
    blocked_helpers = sum(1 for r in extra if r is not None)
    return freed if len(freed) > blocked_helpers else []


def model_opset(ctx: RuleContext | onnx.ModelProto) -> int:
    return ctx.opset if isinstance(ctx, RuleContext) else default_opset(ctx)


# --------------------------------------------------------------------------- opset upgrades


def opset_upgrade_error(ctx: RuleContext, version: int) -> str | None:
    """None when the model is at `version` already or may be converted to it, else why not.

    New ops (Gelu needs opset 20, HardSwish 14, Swish 24) cannot simply be declared: ops whose
    signature changed in between must be converted, which `upgrade_graph` does with ONNX's
    version converter when the rule is applied. `find` only makes the cheap check (the
    installed onnx knows that opset): a trial conversion of the whole model per rule made
    `surgery check` ten times slower. A conversion that fails at apply time is reported as
    the rule not applying, and the engine's verification proves ONNX Runtime accepts it.
    """
    if model_opset(ctx) >= version:
        return None
    if version > onnx.defs.onnx_opset_version():
        return f"opset {version} is newer than this onnx ({onnx.defs.onnx_opset_version()})"
    return None


def _try_upgrade(model: onnx.ModelProto, version: int) -> tuple[onnx.ModelProto | None, str | None]:
    try:
        converted = convert_opset(model, version)
        onnx.checker.check_model(converted, full_check=False)
    except Exception as exc:  # noqa: BLE001 - the converter raises many unrelated types
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        return None, f"converting to opset {version} failed: {first}"
    return converted, None


def conversion_note(ctx: RuleContext, opset: int) -> str:
    """Said in a match's reason when the rewrite converts the whole model to a newer opset:
    the converter may expand ops whose semantics changed (a Softmax before opset 13 gains a
    Flatten/Reshape pair to keep its 2-D semantics)."""
    old = model_opset(ctx)
    return f"; converts the model from opset {old} to {opset}" if opset > old else ""


def upgrade_graph(graph: gs.Graph, ctx: RuleContext, version: int) -> None:
    """Convert the (not yet edited) graph to `version` in place, before new ops are added.

    Node and tensor names survive the conversion, so matches found on the original model
    still address the same nodes."""
    if model_opset(ctx) >= version or graph.opset >= version:
        return
    converted, error = _try_upgrade(ctx.model, version)
    if converted is None:
        raise RuleNotApplicableError(error or f"cannot convert to opset {version}")
    new = import_graph(converted)
    for out in new.outputs:
        if out.shape is not None and any(isinstance(d, int) and d < 0 for d in out.shape):
            out.shape = None  # e.g. Paddle's -1 batch: invalid, and it conflicts after conversion
    graph.nodes, graph.inputs, graph.outputs = new.nodes, new.inputs, new.outputs
    graph.opset, graph.import_domains = new.opset, new.import_domains


# --------------------------------------------------------------------------- pattern lookups


class Pattern:
    """Structural lookups over `ctx.view` used by `find` (read-only; indices are node indices)."""

    def __init__(self, ctx: RuleContext) -> None:
        self.ctx = ctx
        self.view = ctx.view
        self.outputs = set(ctx.view.graph_outputs)
        self._values: dict[str, np.ndarray | None] = {}

    def nodes(self, *ops: str) -> list[int]:
        """Indices of the nodes of these op types, in graph order."""
        by_op = self.view.nodes_by_op
        if len(ops) == 1:
            return list(by_op.get(ops[0], ()))
        return sorted(i for op in set(ops) for i in by_op.get(op, ()))

    def blocked(self, *ops: str) -> list[int]:
        """Nodes of these ops that the target does not place on the MLA — the only ones a
        replacement that exists for the target's sake should touch."""
        blockers = self.ctx.blocker_names
        return [i for i in self.nodes(*ops) if self.view.names[i] in blockers]

    def op(self, idx: int) -> str:
        return self.view.op_types[idx]

    def name(self, idx: int) -> str:
        return self.view.names[idx]

    def ins(self, idx: int) -> tuple[str, ...]:
        return self.view.node_inputs[idx]

    def outs(self, idx: int) -> tuple[str, ...]:
        return self.view.node_outputs[idx]

    def attrs(self, idx: int) -> dict[str, Any]:
        return attribute_values(self.view.nodes[idx])

    def producer(self, tensor: str, *ops: str) -> int | None:
        """The node producing `tensor` (only if its op is one of `ops`, when given)."""
        idx = self.view.producer.get(tensor)
        if idx is None or (ops and self.view.op_types[idx] not in ops):
            return None
        return idx

    def consumers(self, tensor: str) -> list[int]:
        return list(self.view.consumers.get(tensor, ()))

    def sole_consumer(self, tensor: str, *ops: str) -> int | None:
        """The only node reading `tensor`, when the tensor is not also a graph output."""
        users = self.view.consumers.get(tensor, [])
        if len(users) != 1 or tensor in self.outputs:
            return None
        if ops and self.view.op_types[users[0]] not in ops:
            return None
        return users[0]

    def private(self, tensor: str) -> bool:
        """The tensor feeds exactly one node and is not a graph output (safe to rewire)."""
        return len(self.view.consumers.get(tensor, [])) == 1 and tensor not in self.outputs

    def unused_extra_outputs(self, idx: int) -> bool:
        outs = self.outs(idx)
        return not any(o and (self.consumers(o) or o in self.outputs) for o in outs[1:])

    def is_const(self, tensor: str) -> bool:
        return bool(tensor) and tensor in self.ctx.constants

    def value(self, tensor: str) -> np.ndarray | None:
        """Value of a small constant initializer or Constant node output (shape vectors,
        scalars, axes); None otherwise. Constant subgraphs are not evaluated here — patterns
        are matched on every `surgery check`; fold-constants turns them into initializers."""
        if not self.is_const(tensor):
            return None
        if tensor not in self._values:
            self._values[tensor] = self.view.constant_value(tensor)
        return self._values[tensor]

    def stored(self, tensor: str) -> np.ndarray | None:
        """The value of an initializer or Constant node output of any size, as stored; None
        for anything else. Never evaluates a constant subgraph: `find` runs on every
        `surgery check`, and fix folds such subgraphs into initializers first."""
        if not self.is_const(tensor):
            return None
        return self.view.constant_value(tensor, prod(self.shape(tensor) or (0,)) or 1)

    def scalar(self, tensor: str) -> float | None:
        value = self.value(tensor)
        if value is None or value.size != 1 or value.dtype.kind not in "fiu":
            return None
        return float(value.reshape(-1)[0])

    def shape(self, tensor: str) -> tuple[int, ...] | None:
        """Static shape or None."""
        t = self.view.tensor(tensor)
        return tuple(t.shape) if t.is_static else None  # type: ignore[arg-type]

    def elem_type(self, tensor: str) -> int:
        return self.view.tensor(tensor).elem_type

    def is_float(self, tensor: str) -> bool:
        return self.elem_type(tensor) in (
            onnx.TensorProto.FLOAT,
            onnx.TensorProto.FLOAT16,
            onnx.TensorProto.DOUBLE,
            onnx.TensorProto.BFLOAT16,
        )

    def spec(self, tensor: str, *, with_value: bool = False) -> TensorSpec:
        """A probe spec for an existing tensor (constants keep their value when small)."""
        t = self.view.tensor(tensor)
        shape = tuple(t.shape) if t.is_static else None  # type: ignore[arg-type]
        const = self.is_const(tensor)
        value = self.value(tensor) if const and with_value else None
        return TensorSpec(shape, t.elem_type, value, const)

    def other_input(self, idx: int, tensor: str) -> str | None:
        """For a binary node reading `tensor`, its other input (None if both are `tensor`)."""
        a, b = self.ins(idx)[:2]
        if a == tensor and b != tensor:
            return b
        if b == tensor and a != tensor:
            return a
        return None


RESHAPES = ("Reshape", "Flatten", "Squeeze", "Unsqueeze")
"""Nodes that only view their input in another shape."""


def reshape_source(pat: Pattern, tensor: str) -> tuple[str, list[str]]:
    """The ≤ 4-D tensor a Reshape made `tensor` from, and that Reshape's name when nothing else
    reads `tensor` (a rewrite that reads the source directly absorbs it); else (`tensor`, [])."""
    p = pat.producer(tensor, *RESHAPES)
    if p is None:
        return tensor, []
    source = pat.ins(p)[0]
    shape = pat.shape(source)
    if shape is None or len(shape) > 4 or pat.is_const(source):
        return tensor, []
    return source, [pat.name(p)] if pat.private(tensor) else []


def reshaped_by_reader(pat: Pattern, tensor: str) -> tuple[str, list[str]]:
    """The ≤ 4-D tensor the only reader of `tensor` reshapes it to, and that reader's name (a
    rewrite that writes the reshaped tensor directly absorbs it); else (`tensor`, [])."""
    user = pat.sole_consumer(tensor, *RESHAPES)
    if user is None:
        return tensor, []
    out = pat.outs(user)[0]
    shape = pat.shape(out)
    if shape is None or len(shape) > 4:
        return tensor, []
    return out, [pat.name(user)]


def axis_view(shape: Sequence[int], axis: int) -> tuple[list[int], int]:
    """The 4-D tensor to slice or concatenate along `axis` and that axis in it: the tensor itself
    for H or W of a 4-D one, else the view [1, outer, n, inner] (its axis 2), since the MLA
    concatenates along neither N nor C and takes 4-D tensors only."""
    if len(shape) == 4 and axis >= 2:
        return list(shape), axis
    return [1, prod(shape[:axis]), shape[axis], prod(shape[axis + 1 :])], 2


def reduce_axes(pat: Pattern, node: int, rank: int) -> list[int] | None:
    """The normalised axes of a Reduce* node (attribute before opset 18, input from 18)."""
    ins = pat.ins(node)
    attrs = pat.attrs(node)
    if len(ins) > 1 and ins[1]:
        value = pat.value(ins[1])
        if value is None:
            return None
        axes = [int(a) for a in value.reshape(-1)]
    else:
        axes = list(attrs.get("axes", []))
    if not axes:
        return [] if attrs.get("noop_with_empty_axes", 0) else list(range(rank))
    return sorted(a % rank for a in axes)


def constant_array(ctx: RuleContext, tensor: str, max_elements: int = _LARGE) -> np.ndarray | None:
    """The value of a tensor known before run time: an initializer, a Constant node's output or
    the result of a constant subgraph (e.g. ConstantOfShape weights in Caffe2 exports),
    evaluated (`constant_values.evaluate_constants`). None when the tensor is computed at run
    time."""
    if tensor not in ctx.constants:
        return None
    view = ctx.view
    value = view.constant_value(tensor, max_elements)
    if value is not None:
        return value
    size = view.tensor(tensor).num_elements
    if tensor in view.initializers or (size or _LARGE) > max_elements:
        return None  # larger than asked for (or of unknown size when a small value is wanted)
    values = evaluate_constants(view, [tensor], _MAX_EVALUATED_NODES)
    value = values[tensor] if values is not None else None
    return value if value is not None and value.size <= max_elements else None


_MAX_EVALUATED_NODES = 256
"""A constant that large a subgraph computes is fold-constants' job, not a pattern's."""


# --------------------------------------------------------------------------- graph edits


class Editor:
    """Small graphsurgeon edits with names that cannot collide with existing ones."""

    def __init__(self, graph: gs.Graph, ctx: RuleContext) -> None:
        self.graph = graph
        self.ctx = ctx
        self._taken = set(graph.tensors()) | {n.name for n in graph.nodes}
        self._nodes: dict[str, gs.Node] | None = None
        self._tensors: dict[str, gs.Tensor] | None = None

    def _fresh(self, base: str) -> str:
        name, k = base, 1
        while name in self._taken:
            name = f"{base}_{k}"
            k += 1
        self._taken.add(name)
        return name

    def tensor(self, name: str) -> gs.Tensor:
        """A tensor that existed before this edit, by name."""
        if self._tensors is None:
            self._tensors = self.graph.tensors()
        return self._tensors[name]

    def node_named(self, name: str) -> gs.Node | None:
        if self._nodes is None:
            self._nodes = nodes_by_name(self.graph)
        node = self._nodes.get(name)
        if node is None or not node.outputs:
            return None  # detached by an earlier edit
        return node

    def var(self, base: str, dtype: Any = np.float32, shape: Sequence[int] | None = None):
        return gs.Variable(self._fresh(base), dtype=dtype, shape=list(shape) if shape else None)

    def const(self, base: str, value: np.ndarray) -> gs.Constant:
        return constant(self._fresh(base), value)

    def node(
        self,
        op: str,
        base: str,
        inputs: Sequence[gs.Tensor],
        outputs: Sequence[gs.Tensor],
        **attrs: Any,
    ) -> gs.Node:
        node = gs.Node(op, self._fresh(base), attrs, list(inputs), list(outputs))
        self.graph.nodes.append(node)
        return node

    def op(
        self,
        op: str,
        base: str,
        inputs: Sequence[gs.Tensor],
        shape: Sequence[int] | None = None,
        dtype: Any = np.float32,
        **attrs: Any,
    ) -> gs.Variable:
        """Add a single-output node and return its (new) output tensor."""
        out = self.var(f"{base}_out", dtype, shape)
        self.node(op, base, inputs, [out], **attrs)
        return out

    def value(self, tensor: gs.Tensor, original: str | None = None) -> np.ndarray | None:
        """Value of a constant input: gs.Constant, a Constant node's output, or (through the
        pre-edit context) any tensor known before run time."""
        if isinstance(tensor, gs.Constant):
            return np.asarray(tensor.values)
        producer = tensor.inputs[0] if tensor.inputs else None
        if producer is not None and producer.op == "Constant" and "value" in producer.attrs:
            return np.asarray(producer.attrs["value"].values)
        return constant_array(self.ctx, original or tensor.name)

    @staticmethod
    def detach(*nodes: gs.Node) -> None:
        """Disconnect nodes; graph cleanup at export removes them."""
        for n in nodes:
            n.inputs.clear()
            n.outputs.clear()

    def replace_op(self, name: str, op: str, base: str, **attrs: Any) -> bool:
        """The node `name` (one data input, one output) replaced by `op` on the same tensors:
        the edit of every rule that swaps one op for an equivalent one."""
        node = self.node_named(name)
        assert node is not None
        x, y = node.inputs[0], node.outputs[0]
        self.detach(node)
        self.node(op, base, [x], [y], **attrs)
        return True


def slice_inputs(starts: Sequence[int], ends: Sequence[int], axes: Sequence[int]) -> list:
    """Constant Slice operands (opset ≥ 10), as probe specs."""
    return [TensorSpec.const(np.array(v, np.int64)) for v in (starts, ends, axes)]


def probe_slice(
    ctx: RuleContext,
    x: TensorSpec,
    out: TensorSpec,
    starts: Sequence[int],
    ends: Sequence[int],
    axes: Sequence[int],
    steps: Sequence[int] | None = None,
) -> Reason | None:
    """Placement of a Slice in the form the model's opset expects (`add_slice`); `steps`
    (opset ≥ 10) only when some step is not 1."""
    if model_opset(ctx) < 10:
        attrs = {"starts": list(starts), "ends": list(ends), "axes": list(axes)}
        return probe_node(ctx, "Slice", [x], [out], attrs)
    inputs = slice_inputs(starts, ends, axes)
    if steps is not None and any(s != 1 for s in steps):
        inputs.append(TensorSpec.const(np.array(steps, np.int64)))
    return probe_node(ctx, "Slice", [x, *inputs], [out])


def add_slice(
    ed: Editor,
    x: gs.Tensor,
    out: gs.Tensor,
    starts: Sequence[int],
    ends: Sequence[int],
    axes: Sequence[int],
    steps: Sequence[int] | None = None,
) -> gs.Node:
    """A Slice node in the form the model's opset expects (attributes before opset 10, which
    has no steps: callers check `model_opset` before asking for steps other than 1)."""
    if model_opset(ed.ctx) < 10:
        return ed.node(
            "Slice", "slice", [x], [out], starts=list(starts), ends=list(ends), axes=list(axes)
        )
    operands = [("starts", starts), ("ends", ends), ("axes", axes)]
    if steps is not None and any(s != 1 for s in steps):
        operands.append(("steps", steps))
    consts = [ed.const(f"slice_{what}", np.array(v, np.int64)) for what, v in operands]
    return ed.node("Slice", "slice", [x, *consts], [out])


def conv_by_constant_weights(
    pat: Pattern, node: int
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(input shape, weight shape) of a 2-D Conv of a float run-time input by constant weights
    (and a constant bias, if any); None for any other Conv. The reads that rules reshaping a
    Conv's weights start from."""
    ins = pat.ins(node)
    shape, weight = pat.shape(ins[0]), pat.shape(ins[1])
    if shape is None or weight is None or len(shape) != 4 or len(weight) != 4:
        return None
    if not pat.is_float(ins[0]) or pat.is_const(ins[0]) or not pat.is_const(ins[1]):
        return None
    if len(ins) > 2 and ins[2] and not pat.is_const(ins[2]):
        return None
    return shape, weight


def probe_reshape(ctx: RuleContext, x: TensorSpec, out: TensorSpec) -> Reason | None:
    """Placement of a Reshape of `x` to `out`'s (static) shape, given as a constant."""
    assert out.shape is not None
    return probe_node(ctx, "Reshape", [x, TensorSpec.const(np.array(out.shape, np.int64))], [out])


def probe_zero_pad(
    ctx: RuleContext, x: TensorSpec, padded: Sequence[int], pads: Sequence[int]
) -> Reason | None:
    """Placement of a constant-zero Pad by ONNX `pads` ([begin…, end…]) in the model's opset."""
    out = [TensorSpec(tuple(padded), x.elem_type)]
    if model_opset(ctx) >= 11:
        return probe_node(ctx, "Pad", [x, TensorSpec.const(np.array(pads, np.int64))], out)
    return probe_node(ctx, "Pad", [x], out, {"pads": list(pads)})


def add_zero_pad(
    ed: Editor, x: gs.Tensor, pads: Sequence[int], padded: Sequence[int], base: str
) -> gs.Variable:
    """A constant-zero Pad of `x` (its output, of shape `padded`) in the model's opset."""
    if model_opset(ed.ctx) >= 11:
        amounts = ed.const(f"{base}_pads", np.array(pads, np.int64))
        return ed.op("Pad", base, [x, amounts], padded, x.dtype)
    return ed.op("Pad", base, [x], padded, x.dtype, pads=list(pads))


class GraphRule(Rule):
    """A rule that edits through an `Editor`, one match at a time.

    `edit` returns False when the match no longer holds on the graph as edited so far (an
    earlier overlapping match rewrote it); such matches are not reported as applied. Matches
    whose nodes an earlier match detached are skipped.
    """

    def edit(self, ed: Editor, match: Match, params: RuleParams) -> bool:
        raise NotImplementedError

    def apply(self, graph: gs.Graph, match: Match, params: RuleParams, ctx: RuleContext) -> None:
        self.edit(Editor(graph, ctx), match, params)

    def apply_all(
        self, graph: gs.Graph, matches: list[Match], params: RuleParams, ctx: RuleContext
    ) -> list[Match]:
        applied = []
        for m in matches:
            ed = Editor(graph, ctx)
            if not all(ed.node_named(n) is not None for n in m.nodes):
                continue
            if self.edit(ed, m, params) is not False:
                applied.append(m)
        return applied


class OpsetGraphRule(GraphRule):
    """A GraphRule whose replacement may need a newer opset than the model's (each match's
    `data["opset"]`): the whole graph is converted once, before any edit, so matches found
    on the original model still address the same nodes."""

    def apply_all(
        self, graph: gs.Graph, matches: list[Match], params: RuleParams, ctx: RuleContext
    ) -> list[Match]:
        upgrade_graph(graph, ctx, max(m.data["opset"] for m in matches))
        return super().apply_all(graph, matches, params, ctx)


def close(value: float, target: float, tol: float = 1e-4) -> bool:
    """Float constants in exports are rounded (0.7071068, 1.4142135): compare with a tolerance."""
    return abs(value - target) <= tol * max(1.0, abs(target))


def with_axis(shape: Sequence[int], axis: int, size: int) -> tuple[int, ...]:
    """`shape` with axis `axis` resized to `size`."""
    return tuple(size if k == axis else d for k, d in enumerate(shape))


def fmt_shape(shape: Sequence[int] | None) -> str:
    return "?" if shape is None else "[" + ",".join(str(d) for d in shape) + "]"
