"""The values of computed constants (tensors known before run time that nodes compute), without
folding the model: ONNX's reference evaluator over the nodes behind them.

One evaluator for check's shape repair and for the rules that need a constant's value
(a Caffe2 export's ConstantOfShape weights); folding itself evaluates with ONNX Runtime."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from surgery.coverage import NON_FOLDABLE_OPS, shape_known, shape_slice
from surgery.graph import GraphView

__all__ = ["evaluate_constants", "ir_version_for_parts"]


def evaluate_constants(
    view: GraphView, names: list[str], max_nodes: int | None = None
) -> dict[str, np.ndarray] | None:
    """The values of constants `names` (outputs of nodes of `view` that only compute
    constants), by ONNX's reference evaluator over the nodes behind them: initializers and
    Constant nodes read as stored, a Shape node of a statically shaped tensor as that shape
    (as folding reads it). None where one is not such a constant, more than `max_nodes`
    nodes compute them, or the evaluator cannot."""
    producer = view.producer
    if any(t not in producer for t in names):
        return None
    within: set[int] = set()
    stack = [producer[t] for t in names]
    while stack:
        idx = stack.pop()
        if idx in within:
            continue
        within.add(idx)
        if max_nodes is not None and len(within) > max_nodes:
            return None
        if view.op_types[idx] in NON_FOLDABLE_OPS:
            return None
        if view.op_types[idx] == "Shape" and view.node_inputs[idx][0] not in view.initializers:
            if not shape_known(view, idx, view.node_inputs[idx][0]):
                return None
            continue  # read from the inferred shape below, not computed
        for t in view.node_inputs[idx]:
            if t in producer:
                stack.append(producer[t])
            elif t and t not in view.initializers:
                return None  # a graph input: computed at run time
    shapes: list[onnx.TensorProto] = []
    computed: list[onnx.NodeProto] = []
    for idx in sorted(within):
        if view.op_types[idx] == "Shape" and view.node_inputs[idx][0] not in view.initializers:
            shapes.append(
                numpy_helper.from_array(_shape_value(view, idx), view.node_outputs[idx][0])
            )
        else:
            computed.append(view.nodes[idx])
    used = {t for n in computed for t in n.input}
    graph = helper.make_graph(
        computed,
        "constants",
        [],
        [helper.make_empty_tensor_value_info(t) for t in names],
        [*shapes, *(view.initializers[t] for t in used if t in view.initializers)],
    )
    model = view.model
    sub = helper.make_model(
        graph, opset_imports=list(model.opset_import), ir_version=ir_version_for_parts(model)
    )
    from onnx.reference import ReferenceEvaluator  # its ~400 op modules: only when used

    try:
        results = ReferenceEvaluator(sub).run(None, {})
    except Exception:  # noqa: BLE001 - the evaluator's own errors: not a usable constant
        return None
    return {t: np.asarray(v) for t, v in zip(names, results, strict=True)}


def ir_version_for_parts(model: onnx.ModelProto) -> int:
    """The IR version of a model made from `model`'s nodes: at least 4, where initializers
    need not be listed as graph inputs (legacy IR-3 models list them)."""
    return max(model.ir_version, 4)


def _shape_value(view: GraphView, idx: int) -> np.ndarray:
    """A Shape node's value from the inferred shape of its input."""
    shape = view.tensor(view.node_inputs[idx][0]).shape
    return np.array(shape[shape_slice(view.nodes[idx], len(shape))], np.int64)
