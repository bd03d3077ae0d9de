"""Verifying a rewrite of a model whose outputs pass through a selection (TopK, ArgMax, NMS …).

A detector that picks its queries or boxes with TopK turns a float rounding difference in the
scores into a different selection whenever two scores are closer than the rounding: RT-DETR
keeps the 300 best of 2,100 encoder scores, and with random weights the 300th and 301st differ
by 1e-7. Every exact rewrite (a fused LayerNorm, a Linear lifted to a 1×1 Conv) then changes the
final boxes by whole units although it computes the same scores to float rounding.

So when the outputs differ, the rewritten model is checked stage by stage. A selection fed by
run-time float data starts a new stage: a tensor's stage is the number of such selections on
its longest path from the inputs. Every node that reads a tensor of an earlier stage than its
own result (the scores entering TopK, the features the selected indices gather from) reads the
*original* model's value of that tensor instead, so both models make the same selections; the
rewritten model's own value of each such tensor and every graph output are then compared with
the original's. Matching everywhere means each stage computes what the original stage computed
from the same inputs: what differed was the selections' tie order, not the rewrite.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import onnx
from onnx import TensorProto

from surgery.verify import OutputComparison, ort_session, run_model

SELECTION_OPS = frozenset(
    {
        "TopK",
        "ArgMax",
        "ArgMin",
        "NonMaxSuppression",
        "NonZero",
        "Greater",
        "GreaterOrEqual",
        "Less",
        "LessOrEqual",
        "Equal",
        "Round",
        "Floor",
        "Ceil",
        "Sign",
    }
)
"""Ops whose result jumps when a float input crosses a threshold or another element."""

_FLOAT = frozenset(
    {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE}
)
_FED = "__from_original"
"""Suffix of the extra graph inputs that carry the original model's value of a tensor."""

Compare = Callable[[str, np.ndarray, np.ndarray], OutputComparison]


def stage_crossings(model: onnx.ModelProto) -> list[tuple[int, int, str]]:
    """(node, input position, tensor) for every run-time input read from an earlier stage.

    Empty when the model has no selection fed by run-time float data. Nodes are visited in
    the graph's order, which ONNX requires to be topological.
    """
    graph = model.graph
    elem = elem_types(model)
    initializers = {t.name for t in graph.initializer}
    stage = {i.name: 0 for i in graph.input if i.name not in initializers}
    node_stage: list[int | None] = []
    selections = 0
    for node in graph.node:
        dynamic = [t for t in node.input if t in stage]
        if not dynamic:
            node_stage.append(None)  # computes constants only
            continue
        here = max(stage[t] for t in dynamic)
        selects = node.op_type in SELECTION_OPS and node.domain in ("", "ai.onnx")
        if selects and any(elem.get(t) in _FLOAT for t in dynamic):
            here += 1
            selections += 1
        node_stage.append(here)
        for out in node.output:
            if out:
                stage[out] = here
    if not selections:
        return []
    inputs = {i.name for i in graph.input}
    return [
        (k, pos, t)
        for k, (node, here) in enumerate(zip(graph.node, node_stage, strict=True))
        if here is not None
        for pos, t in enumerate(node.input)
        if t in stage and stage[t] < here and t not in inputs
    ]


def compare_by_stages(
    parent: onnx.ModelProto,
    child: onnx.ModelProto,
    inputs: Mapping[str, np.ndarray],
    expected_outputs: Mapping[str, np.ndarray],
    compare: Compare,
) -> list[OutputComparison] | None:
    """Compare `child` with `parent` stage by stage (see the module docstring).

    Returns the comparisons of every graph output and every stage-crossing tensor, or None
    when the child has no selection stages or a tensor it crosses is not in the parent.
    """
    crossings = stage_crossings(child)
    if not crossings:
        return None
    tensors = sorted({t for _, _, t in crossings})
    original = _run_with_outputs(parent, tensors, inputs, "original model")
    if original is None:
        return None
    fed = onnx.ModelProto()
    fed.CopyFrom(child)
    elem = elem_types(child)
    if any(t not in elem for t in tensors):
        return None
    for k, pos, t in crossings:
        fed.graph.node[k].input[pos] = t + _FED
    fed.graph.input.extend(
        onnx.helper.make_tensor_value_info(t + _FED, elem[t], None) for t in tensors
    )
    outputs = {o.name for o in fed.graph.output}
    fed.graph.output.extend(
        onnx.helper.make_tensor_value_info(t, elem[t], None) for t in tensors if t not in outputs
    )
    feed = dict(inputs)
    feed.update({t + _FED: original[t] for t in tensors})
    got = run_model(ort_session(fed, label="rewritten model, by stages"), feed)
    comparisons = [
        compare(name, value, got[name]) for name, value in expected_outputs.items() if name in got
    ]
    for t in tensors:
        cmp = compare(t, original[t], got[t])
        cmp.message = cmp.message or "enters a later stage (after a TopK/ArgMax/NMS …)"
        comparisons.append(cmp)
    if len(comparisons) < len(expected_outputs) + len(tensors):
        return None  # an output disappeared: the plain comparison already says so
    return comparisons


def elem_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element type of every tensor the (shape-inferred) model declares."""
    graph = model.graph
    types = {
        v.name: v.type.tensor_type.elem_type
        for v in (*graph.value_info, *graph.input, *graph.output)
        if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type
    }
    types.update({t.name: t.data_type for t in graph.initializer})
    return types


def _run_with_outputs(
    model: onnx.ModelProto, tensors: list[str], inputs: Mapping[str, np.ndarray], label: str
) -> dict[str, np.ndarray] | None:
    """Run `model` with `tensors` as its outputs; None if one of them is not in the model."""
    elem = elem_types(model)
    if any(t not in elem for t in tensors):
        return None
    tapped = onnx.ModelProto()
    tapped.CopyFrom(model)
    del tapped.graph.output[:]
    tapped.graph.output.extend(
        onnx.helper.make_tensor_value_info(t, elem[t], None) for t in tensors
    )
    return run_model(ort_session(tapped, label=label), inputs, label=label)
