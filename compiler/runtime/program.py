"""The steps of an integer program and how each one runs on a dictionary of named tensors.

A program is a topologically ordered list of steps. Integer steps read and write integer tensors
(the outputs of QuantizeLinear nodes in the QDQ model); quantize / dequantize steps are the
float boundary (graph inputs and outputs, float islands); float steps run a node the integer
program cannot express in float (ONNX Runtime, as the archive's host stages do).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal

import numpy as np
import onnx
from onnx import helper
from onnx.reference import ReferenceEvaluator

from compiler.intmath import dequantize_linear, quantize_linear
from compiler.runtime.errors import ExecutionError, UnknownOpError
from compiler.runtime.float_ops import FLOAT_OP_OVERRIDES
from compiler.runtime.host_session import single_node_session
from compiler.runtime.ops.base import Kernel
from compiler.runtime.qparams import NotLowerable, QuantParams
from surgery.graph import node_reads

StepKind = Literal["integer", "quantize", "dequantize", "float"]
Values = dict[str, np.ndarray]


@dataclass(frozen=True, eq=False)
class IntegerStep:
    """One integer op: an anchor node with its fused activation / bias and QuantizeLinear(s).

    `pattern` names what was fused, e.g. "Conv+Relu" or "Mul(x, Sigmoid(x))".
    """

    name: str
    pattern: str
    kernel: Kernel
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    output_params: tuple[QuantParams | None, ...]
    kind: StepKind = "integer"

    def run(self, values: Values) -> None:
        try:
            results = self.kernel(*(values[name] for name in self.inputs))
        except NotLowerable as error:
            raise ExecutionError(f"{self.name} ({self.pattern}): {error}") from error
        if not isinstance(results, tuple):
            results = (results,)
        for name, result in zip(self.outputs, results, strict=False):
            if name:
                values[name] = result


@dataclass(frozen=True, eq=False)
class QuantizeStep:
    """ONNX QuantizeLinear of a float tensor (a graph input or the end of a float island)."""

    name: str
    input: str
    output: str
    params: QuantParams
    kind: StepKind = "quantize"
    pattern: str = "QuantizeLinear"

    def run(self, values: Values) -> None:
        x = np.asarray(values[self.input])
        scale = self.params.along(self.params.scale, x.ndim)
        zero_point = self.params.along(self.params.zero_point, x.ndim)
        values[self.output] = quantize_linear(x, scale, zero_point, self.params.dtype)


@dataclass(frozen=True, eq=False)
class DequantizeStep:
    """ONNX DequantizeLinear of an integer tensor feeding float nodes or a graph output."""

    name: str
    input: str
    output: str
    params: QuantParams
    kind: StepKind = "dequantize"
    pattern: str = "DequantizeLinear"

    def run(self, values: Values) -> None:
        q = np.asarray(values[self.input])
        scale = self.params.along(self.params.scale, q.ndim)
        zero_point = self.params.along(self.params.zero_point, q.ndim)
        values[self.output] = dequantize_linear(q, scale, zero_point)


ONNX_RUNTIME_DOMAINS = frozenset({"", "ai.onnx", "com.microsoft"})
"""Float steps of these domains run on ONNX Runtime, configured as the archive's host stages
(`compiler.runtime.host_session`), so a float island gives the same bits in both and the MLA
stages after it see the same codes: onnx.reference rounds differently (an RT-DETR decoder's MLA
stages were one code off behind its float ops), and its Conv builds an int64 im2col (6.9 GiB
for one dilated ASPP Conv of DeepLabV3). onnx.reference runs what ONNX Runtime has no kernel
for."""


class FloatStep:
    """A node run in float (a float island, or an op with no integer form): by ONNX Runtime
    (`ONNX_RUNTIME_DOMAINS`), else by onnx.reference."""

    kind: StepKind = "float"

    def __init__(
        self,
        node: onnx.NodeProto,
        opsets: dict[str, int],
        functions: list[onnx.FunctionProto],
        reason: str,
        constants: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        self.node = node
        self.name = node.name or node.output[0]
        self.pattern = node.op_type
        self.reason = reason
        # An If/Loop/Scan body may read tensors of the outer graph: they are inputs too.
        self.inputs = tuple(dict.fromkeys(node_reads(node)))
        self.outputs = tuple(node.output)
        untyped = onnx.TypeProto()
        graph = helper.make_graph(
            [node],
            f"float_island_{self.name}",
            [helper.make_value_info(name, untyped) for name in self.inputs],
            [helper.make_value_info(name, untyped) for name in self.outputs if name],
        )
        self._on_onnxruntime = node.domain in ONNX_RUNTIME_DOMAINS
        self._evaluator: ReferenceEvaluator | None = None
        try:
            self._evaluator = ReferenceEvaluator(
                graph, opsets=opsets, functions=functions or None, new_ops=list(FLOAT_OP_OVERRIDES)
            )
        except Exception:  # noqa: BLE001 - NotImplementedError for an op it has no code for
            if not (self._on_onnxruntime and onnxruntime_runs(node, functions)):
                raise unknown_op_error(node, self.name) from None
        self._opsets = opsets
        self._constants = dict(constants or {})
        self._sessions: dict[tuple, Any] = {}

    def run(self, values: Values) -> None:
        feeds = {name: np.asarray(values[name]) for name in self.inputs}
        results = self._run_onnxruntime(feeds) if self._on_onnxruntime else None
        if results is None:
            if self._evaluator is None:
                raise ExecutionError(
                    f"{self.name} ({self.pattern}): ONNX Runtime cannot run it on inputs "
                    f"{', '.join(f'{v.dtype}{list(v.shape)}' for v in feeds.values())}, and "
                    "onnx.reference has no implementation of it"
                )
            results = self._evaluator.run(None, feeds)
        for name, result in zip((o for o in self.outputs if o), results, strict=True):
            values[name] = np.asarray(result)

    def _run_onnxruntime(self, feeds: Values) -> list | None:
        """The node's outputs from ONNX Runtime, or None where it cannot run them (no kernel,
        or an input dtype its Python binding does not take, such as ml_dtypes' int4): those
        inputs go to onnx.reference from then on."""
        session = self._session(feeds)
        if session is None:
            return None
        try:
            return session.run(None, {k: v for k, v in feeds.items() if k not in self._constants})
        except Exception:  # noqa: BLE001 - ORT's own exception types
            self._sessions[self._key(feeds)] = None
            return None

    @staticmethod
    def _key(feeds: Values) -> tuple:
        return tuple((name, value.dtype.str, value.shape) for name, value in feeds.items())

    def _session(self, feeds: Values) -> Any:
        """The ONNX Runtime session for inputs of these dtypes and shapes (None when ONNX
        Runtime has no kernel for them: onnx.reference runs the node then)."""
        key = self._key(feeds)
        if key not in self._sessions:
            try:
                self._sessions[key] = single_node_session(
                    self.node, self._opsets, feeds, self._constants
                )
            except Exception:  # noqa: BLE001 - e.g. NOT_IMPLEMENTED for an input type
                self._sessions[key] = None
        return self._sessions[key]


Step = IntegerStep | QuantizeStep | DequantizeStep | FloatStep


@cache
def _onnxruntime_kernels() -> frozenset[tuple[str, str]]:
    """(domain, op type) of every kernel of ONNX Runtime's CPU provider ("" for ai.onnx)."""
    try:
        from onnxruntime.capi import _pybind_state

        return frozenset((k.domain, k.op_name) for k in _pybind_state.get_all_opkernel_def())
    except Exception:  # noqa: BLE001 - a build without the listing: assume nothing
        return frozenset()


def _domain(node: onnx.NodeProto) -> str:
    return "" if node.domain in ("", "ai.onnx") else node.domain


def onnxruntime_runs(
    node: onnx.NodeProto, functions: Sequence[onnx.FunctionProto] | None = None
) -> bool:
    """Whether ONNX Runtime can run `node`: an ONNX op (ONNX Runtime expands the ones defined as
    functions), an op it has a kernel for, or a function the model defines."""
    domain = _domain(node)
    if any(f.name == node.op_type and f.domain == node.domain for f in functions or ()):
        return True
    if domain == "" and onnx.defs.has(node.op_type):
        return True
    return (domain, node.op_type) in _onnxruntime_kernels()


def unknown_op_error(node: onnx.NodeProto, name: str) -> UnknownOpError:
    """The error for a node that neither ONNX Runtime nor onnx.reference can run."""
    domain = _domain(node)
    if domain == "":
        what = f"{node.op_type} (domain ai.onnx) has no ONNX schema and no kernel"
    else:
        what = (
            f"{domain}:{node.op_type} has no kernel in ONNX Runtime or onnx.reference and no "
            "function in the model"
        )
    return UnknownOpError(
        f"node {name!r}: {what}; the host stage cannot run it",
        hint="check the op type's spelling, or replace the node with standard ONNX ops",
    )
