"""Placement probes (`replace_common.probe_node`) answer what `surgery check` would answer for
the same node in a real one-node model: the probe skips building that model, not any check."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from surgery.graph import GraphView
from surgery.rules.base import RuleContext
from surgery.rules.replace_common import TensorSpec, probe_node
from surgery.targets import NodeContext, resolve_target

F = TensorProto.FLOAT


def _one_node_model(
    op: str,
    inputs: list[TensorSpec | None],
    outputs: list[TensorSpec],
    attrs: dict[str, Any],
    opset: int,
) -> tuple[onnx.ModelProto, frozenset[str]]:
    """The model a probe stands for: data inputs as graph inputs, values as initializers."""
    names, infos, inits, constants = [], [], [], set()
    for k, spec in enumerate(inputs):
        if spec is None:
            names.append("")
            continue
        name = f"in{k}"
        names.append(name)
        if spec.value is not None:
            inits.append(numpy_helper.from_array(np.asarray(spec.value), name))
        else:
            infos.append(helper.make_tensor_value_info(name, spec.elem_type, spec.shape))
        if spec.constant or spec.value is not None:
            constants.add(name)
    outs = [
        helper.make_tensor_value_info(f"out{k}", s.elem_type, s.shape)
        for k, s in enumerate(outputs)
    ]
    node = helper.make_node(op, names, [o.name for o in outs], **attrs)
    graph = helper.make_graph([node], "probe", infos, outs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    return model, frozenset(constants)


def _model_answer(target: str, op, inputs, outputs, attrs, opset):
    model, constants = _one_node_model(op, inputs, outputs, attrs, opset)
    decision = resolve_target(target).decide(
        op, NodeContext(GraphView(model), 0, constants), known_op=True
    )
    return None if decision.processor == "MLA" else decision.reasons[-1]


def _context(target: str, opset: int) -> RuleContext:
    host = helper.make_model(
        helper.make_graph([], "host", [], []), opset_imports=[helper.make_opsetid("", opset)]
    )
    return RuleContext.build(host, target)


MAP = TensorSpec((1, 16, 20, 20))
CASES = {
    "clip with constant bounds": (
        "Clip",
        [MAP, TensorSpec.const(np.float32(0)), TensorSpec.const(np.float32(6))],
        [MAP],
        {},
        13,
    ),
    "rank-5 slice": (
        "Slice",
        [
            TensorSpec((1, 3, 85, 20, 20)),
            *(TensorSpec.const(np.array(v, np.int64)) for v in ([0], [2], [2])),
        ],
        [TensorSpec((1, 3, 2, 20, 20))],
        {},
        13,
    ),
    "symbolic batch": (
        "Relu",
        [TensorSpec(("N", 16, 20, 20))],
        [TensorSpec(("N", 16, 20, 20))],
        {},
        13,
    ),
    "unknown rank": ("Sigmoid", [TensorSpec(None)], [TensorSpec(None)], {}, 13),
    "integer data": (
        "Mul",
        [TensorSpec((1, 4, 8, 8), TensorProto.INT64)] * 2,
        [TensorSpec((1, 4, 8, 8), TensorProto.INT64)],
        {},
        13,
    ),
    "attribute out of range": (
        "MaxPool",
        [MAP],
        [TensorSpec((1, 16, 1, 1))],
        {"kernel_shape": [200, 200], "pads": [90, 90, 90, 90]},
        13,
    ),
    "computed weight": (
        "Conv",
        [MAP, TensorSpec((8, 16, 3, 3))],
        [TensorSpec((1, 8, 18, 18))],
        {},
        13,
    ),
    "constant weight, no bias": (
        "Conv",
        [MAP, TensorSpec.const(np.ones((8, 16, 3, 3), np.float32)), None],
        [TensorSpec((1, 8, 18, 18))],
        {},
        13,
    ),
    "axis attribute on the batch": (
        "Softmax",
        [MAP],
        [MAP],
        {"axis": 0},
        13,
    ),
    "opset-10 slice attributes": (
        "Slice",
        [MAP],
        [TensorSpec((1, 8, 20, 20))],
        {"starts": [0], "ends": [8], "axes": [1]},
        9,
    ),
    "gelu needs bf16": ("Gelu", [MAP], [MAP], {}, 20),
    "slope over the whole map": (
        "PRelu",
        [MAP, TensorSpec.const(np.full((1, 16, 20, 20), 0.1, np.float32))],
        [MAP],
        {},
        13,
    ),
    "depthwise kernel from the weight": (
        "Conv",
        [MAP, TensorSpec.const(np.ones((16, 1, 9, 9), np.float32))],
        [TensorSpec((1, 16, 12, 12))],
        {"group": 16},
        13,
    ),
}


@pytest.mark.parametrize("target", ["mlsoc", "modalix", "rk3588"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_probe_places_like_the_one_node_model(target: str, case: str):
    op, inputs, outputs, attrs, opset = CASES[case]
    ctx = _context(target, opset)
    if not ctx.target.supports(op, "MLA"):
        assert probe_node(ctx, op, inputs, outputs, attrs, opset).code == "op_not_supported"
        return
    assert probe_node(ctx, op, inputs, outputs, attrs, opset) == _model_answer(
        target, op, inputs, outputs, attrs, opset
    )


def test_probe_cases_reach_both_answers():
    """The cases above are only a check if some place on the MLA and some do not."""
    answers = [
        probe_node(_context("mlsoc", opset), op, inputs, outputs, attrs, opset)
        for op, inputs, outputs, attrs, opset in CASES.values()
    ]
    assert any(a is None for a in answers)
    assert {a.code for a in answers if a is not None} >= {
        "rank",
        "dtype",
        "non_constant_input",
        "shape",
    }
