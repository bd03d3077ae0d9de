"""check's shortcut where shapes wait for folding: resolve them without folding the model.

ONNX's data propagation gives up on some shape arithmetic (a Reshape-5/13 never reads a
propagated target; Paddle's flatten computes it through Casts), leaving the shapes after it
unknown. The quantizer folds such subgraphs, and check must count the segments of that folded
model. Folding the whole model (every Constant node to an initializer, ONNX Runtime over the
constant subgraphs, shape inference over every node again) costs three times what check's own
analysis does; but only the shapes after the arithmetic change. So here the computed constants
the analysis reads are evaluated with ONNX's reference evaluator, and only the nodes whose
shapes are unknown, and what follows them, are inferred again, in a model of their own; their
shapes go back into the model's value_info and the computed values into the view (as folding
would make them initializers). Round after round, as folding does, until every shape is static.

Where this cannot stand in for the fold exactly (custom ops, functions, subgraphs, graphs not
stored in topological order, shapes that stay unknown, constants ONNX's evaluator cannot
compute or folding would keep as a subgraph), `repair_shapes` says so and check folds as
before. A computed constant read only by a check or rule after the repair, which the
evaluator cannot compute, reads as unknown (the fold would have left it to ONNX Runtime)."""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from surgery.constant_values import evaluate_constants, ir_version_for_parts
from surgery.coverage import constant_tensors
from surgery.fold import FOLD_LIMIT_BYTES, FOLD_ROUNDS
from surgery.graph import SUBGRAPH_OPS, GraphView
from surgery.model import DEFAULT_DOMAINS

__all__ = ["can_repair_shapes", "repair_shapes"]

Constants = tuple[set[str], list[bool]]


def repair_shapes(
    model: onnx.ModelProto, view: GraphView, constants: Constants
) -> Constants | None:
    """Make every shape of `model` static as folding would, in place (`model` is the caller's
    own, `view` its view, which then reads computed constants as folded); the new
    `constant_tensors(view)`, or None when only the fold can tell (then `model` and `view` may
    be half repaired: the caller reopens the model). Where `can_repair_shapes` says no, it
    is None at once and nothing has changed."""
    if not can_repair_shapes(model, view):
        return None
    values = ComputedValues(view)
    unresolved = None
    for _ in range(FOLD_ROUNDS):  # as many rounds as folding makes
        known, foldable = constants
        view.read_computed_constants(_computed(view, foldable), values.get)
        if not _type_computed_constants(model, view, foldable, values):
            return None
        tail = _unresolved_tail(view, foldable)
        if not tail:
            _forget_shape_readers(view, known, foldable)
            return constants
        count = sum(len(view.node_outputs[i]) for i in tail)
        if unresolved is not None and count >= unresolved:
            return None  # no progress: some shape is not a matter of constants
        unresolved = count
        if not _infer_tail(model, view, tail, known, values):
            return None
        constants = constant_tensors(view)
    return None


def can_repair_shapes(model: onnx.ModelProto, view: GraphView) -> bool:
    """Whether `repair_shapes` may repair the model: not where only the fold can tell."""
    if model.functions or not DEFAULT_DOMAINS.issuperset(view.domains):
        return False
    if not SUBGRAPH_OPS.isdisjoint(view.op_types) or "Size" in view.op_types:
        return False  # outer-scope names; a Size of a static tensor is not what folding folds
    return view.is_sorted  # the view forgets readers: only the stored order stays an order


def _forget_shape_readers(view: GraphView, known: set[str], foldable: list[bool]) -> None:
    """Folding replaces the Shape nodes of computed tensors by their values: in the view of
    the model as folded, those tensors lose them as readers (a rule that wants a tensor's
    only reader must find it so, as it finds it in the folded model)."""
    readers = {
        idx
        for idx, op in enumerate(view.op_types)
        if op == "Shape" and foldable[idx] and view.node_inputs[idx][0] not in known
    }
    if readers:
        view.forget_readers(readers, (view.node_inputs[idx][0] for idx in readers))


def _computed(view: GraphView, foldable: list[bool]) -> list[str]:
    """Outputs of foldable nodes other than Constant nodes: what folding evaluates."""
    return [
        t
        for idx, outs in enumerate(view.node_outputs)
        if foldable[idx] and view.op_types[idx] != "Constant"
        for t in outs
        if t
    ]


class ComputedValues:
    """The values of a view's computed constants, evaluated on demand
    (`constant_values.evaluate_constants`) and kept: placement and the rules read a
    few (a Reshape's target, a Resize's scales), most are never read.

    It holds the view only weakly: the view holds it (`read_computed_constants`), and a cycle
    would leave the whole analysis to the garbage collector instead of freeing it on return."""

    def __init__(self, view: GraphView) -> None:
        self._view = weakref.ref(view)
        self.values: dict[str, np.ndarray] = {}
        self.failed: set[str] = set()

    def get(self, name: str) -> np.ndarray | None:
        if name not in self.values and name not in self.failed:
            self.evaluate([name])
        return self.values.get(name)

    def prefetch(self, names: Iterable[str]) -> None:
        """Evaluate `names` in one evaluator run where each, asked for alone, would build an
        evaluator of its own (its set-up costs more than most such subgraphs: 18 of them were
        a tenth of checking PP-OCRv4's recogniser). Where one cannot be computed the batch
        is dropped, and each is evaluated alone when asked, as before."""
        todo = [t for t in dict.fromkeys(names) if t not in self.values and t not in self.failed]
        view = self._view()
        if len(todo) < 2 or view is None:
            return
        got = evaluate_constants(view, todo)
        for name, value in (got or {}).items():
            if value.nbytes > FOLD_LIMIT_BYTES:
                self.failed.add(name)
            else:
                value.flags.writeable = False
                self.values[name] = value

    def evaluate(self, names: list[str]) -> dict[str, np.ndarray] | None:
        """The values of `names`; None where the evaluator cannot compute one, or folding
        would keep it as a subgraph (larger than `FOLD_LIMIT_BYTES`)."""
        todo = [t for t in dict.fromkeys(names) if t not in self.values]
        if any(t in self.failed for t in todo):
            return None
        if todo:
            view = self._view()
            got = evaluate_constants(view, todo) if view is not None else None
            if got is None or any(v.nbytes > FOLD_LIMIT_BYTES for v in got.values()):
                self.failed.update(todo)
                return None
            for value in got.values():
                value.flags.writeable = False
            self.values.update(got)
        return {t: self.values[t] for t in names}


def _type_computed_constants(
    model: onnx.ModelProto, view: GraphView, foldable: list[bool], values: ComputedValues
) -> bool:
    """Computed constants read by nodes that stay, whose type inference left unknown, typed by
    their values (folding makes them initializers, typed so); False where one cannot be
    evaluated."""
    tensor, computed = view.tensor, view.computed
    untyped = [
        t
        for idx, ins in enumerate(view.node_inputs)
        if not foldable[idx]
        for t in ins
        if t in computed and not tensor(t).is_static
    ]
    if not untyped:
        return True
    got = values.evaluate(untyped)
    if got is None:
        return False
    types = {
        t: helper.make_tensor_type_proto(helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
        for t, v in got.items()
    }
    _write_types(model, types)
    view.retype(types)
    return True


def _unresolved_tail(view: GraphView, foldable: list[bool]) -> list[int]:
    """The nodes that stay with an output whose shape is not static, and every node after
    them: what inference must see again once the computed constants are known."""
    tensor, outputs = view.tensor, view.node_outputs
    seeds = [
        idx
        for idx, outs in enumerate(outputs)
        if not foldable[idx] and not all(tensor(t).is_static for t in outs if t)
    ]
    tail: set[int] = set()
    stack = seeds
    while stack:
        idx = stack.pop()
        if idx in tail:
            continue
        tail.add(idx)
        stack.extend(c for t in outputs[idx] for c in view.consumers.get(t, ()) if not foldable[c])
    return sorted(tail)


def _infer_tail(
    model: onnx.ModelProto,
    view: GraphView,
    tail: list[int],
    known: set[str],
    values: ComputedValues,
) -> bool:
    """Shape inference over the nodes `tail` alone, their shapes written into `model`'s
    value_info (and graph outputs); False where an input of the tail has no static type.

    What the tail reads from outside is what the full inference would know there: static
    tensor types, and the values of small constants (the ones shape inference reads)."""
    inside = {t for idx in tail for t in view.node_outputs[idx] if t}
    values.prefetch(
        t
        for idx in tail
        for t in view.node_inputs[idx]
        if t in view.computed and t not in inside and not view.known_larger_than(t)
    )
    inputs: list[onnx.ValueInfoProto] = []
    small: list[onnx.TensorProto] = []
    seen: set[str] = set()
    for idx in tail:
        for t in view.node_inputs[idx]:
            if not t or t in inside or t in seen:
                continue
            seen.add(t)
            value = view.constant_value(t) if t in known else None
            if value is not None:  # its value says its type (an empty one reads as unknown)
                small.append(numpy_helper.from_array(np.asarray(value), t))
                continue
            info = view.tensor(t)
            if not info.is_static or not info.elem_type:
                return False
            inputs.append(helper.make_tensor_value_info(t, info.elem_type, info.shape))
    outputs = [o for o in view.graph_outputs if o in inside]
    graph = helper.make_graph(
        [view.nodes[idx] for idx in tail],
        "tail",
        inputs,
        [helper.make_empty_tensor_value_info(o) for o in outputs],
        small,
    )
    sub = helper.make_model(
        graph, opset_imports=list(model.opset_import), ir_version=ir_version_for_parts(model)
    )
    try:
        inferred = onnx.shape_inference.infer_shapes(
            sub, check_type=False, strict_mode=False, data_prop=True
        )
    except Exception:  # noqa: BLE001 - onnx raises several unrelated types here
        return False
    types = {vi.name: vi.type for vi in (*inferred.graph.value_info, *inferred.graph.output)}
    found = {t: types[t] for t in inside if t in types}
    _write_types(model, found)
    view.retype(found)
    return True


def _write_types(model: onnx.ModelProto, types: dict[str, onnx.TypeProto]) -> None:
    """Set the types of tensors in `model`: graph outputs in place (when shaped), every other
    tensor's value_info entry replaced or added."""
    if not types:
        return
    g = model.graph
    for out in g.output:
        new = types.get(out.name)
        if new is not None and new.tensor_type.HasField("shape"):
            out.type.CopyFrom(new)
    outputs = {o.name for o in g.output}
    rest = {t: tp for t, tp in types.items() if t not in outputs}
    for vi in g.value_info:
        new = rest.pop(vi.name, None)
        if new is not None:
            vi.type.CopyFrom(new)
    for t, tp in rest.items():
        g.value_info.add(name=t).type.CopyFrom(tp)
