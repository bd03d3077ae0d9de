"""A read-only index over an ONNX graph: producers, consumers, tensor types and constants.

Coverage, queries and rules all need the same lookups; building them once per analysis keeps
`surgery check` fast on graphs with thousands of nodes.
"""

from __future__ import annotations

from functools import cached_property

import numpy as np
import onnx
from onnx import numpy_helper

Dim = int | str | None
"""A dimension: an int when static, a symbol name (str) or None when dynamic."""

FLOAT_TYPES = frozenset(
    {
        onnx.TensorProto.FLOAT,
        onnx.TensorProto.FLOAT16,
        onnx.TensorProto.BFLOAT16,
        onnx.TensorProto.DOUBLE,
    }
)

SMALL_CONSTANT_ELEMENTS = 4096
"""Constants up to this size are decoded eagerly (shape vectors, axes, scalars)."""


def dtype_name(elem_type: int) -> str:
    """ONNX elem type → short lowercase name (`float32`, `int64`, …)."""
    if elem_type == 0:
        return "unknown"
    return str(onnx.helper.tensor_dtype_to_np_dtype(elem_type)) if elem_type != 16 else "bfloat16"


class TensorInfo:
    """What is known about a tensor without running the model (immutable by convention)."""

    __slots__ = ("name", "elem_type", "shape", "rank", "is_static")

    def __init__(self, name: str, elem_type: int, shape: tuple[Dim, ...] | None) -> None:
        self.name = name
        self.elem_type = elem_type
        self.shape = shape
        """None when even the rank is unknown."""
        self.rank = None if shape is None else len(shape)
        self.is_static = shape is not None and all(type(d) is int for d in shape)

    def __repr__(self) -> str:
        return f"TensorInfo({self.name!r}, {self.dtype}, {self.shape})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TensorInfo) and (self.name, self.elem_type, self.shape) == (
            other.name,
            other.elem_type,
            other.shape,
        )

    __hash__ = None  # type: ignore[assignment]

    @property
    def dtype(self) -> str:
        return dtype_name(self.elem_type)

    @property
    def num_elements(self) -> int | None:
        if not self.is_static:
            return None
        n = 1
        for d in self.shape:  # type: ignore[union-attr]
            n *= d  # type: ignore[operator]
        return n

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape) if self.shape is not None else None,
        }


def shape_from_type(tp: onnx.TypeProto) -> tuple[int, tuple[Dim, ...] | None]:
    tt = tp.tensor_type
    if not tt.HasField("shape"):
        return tt.elem_type, None
    dims = tt.shape.dim
    values = [d.dim_value for d in dims]
    if all(values):
        return tt.elem_type, tuple(values)
    return tt.elem_type, tuple(
        v if v > 0 else (d.dim_param or None) for v, d in zip(values, dims, strict=True)
    )


_INT, _INTS, _FLOAT, _FLOATS = 2, 7, 1, 6
_STRING, _STRINGS, _TENSOR, _GRAPH, _GRAPHS = 3, 8, 4, 5, 10


def attribute_value(a: onnx.AttributeProto) -> object:
    """One attribute as a plain Python value (tensors stay TensorProto; graphs GraphProto)."""
    t = a.type
    if t == _INT:
        return a.i
    if t == _INTS:
        return list(a.ints)
    if t == _FLOAT:
        return a.f
    if t == _FLOATS:
        return list(a.floats)
    if t == _STRING:
        return a.s.decode("utf-8", "replace")
    if t == _STRINGS:
        return [s.decode("utf-8", "replace") for s in a.strings]
    if t == _TENSOR:
        return a.t
    if t == _GRAPH:
        return a.g
    if t == _GRAPHS:
        return list(a.graphs)
    return onnx.helper.get_attribute_value(a)


def attribute_values(node: onnx.NodeProto) -> dict[str, object]:
    """Node attributes as plain Python values, by name."""
    return {a.name: attribute_value(a) for a in node.attribute}


def node_label(node: onnx.NodeProto, index: int) -> str:
    """A stable display name: the node's own name, or `<OpType>_<index>` when it has none."""
    return node.name or f"{node.op_type}_{index}"


class GraphView:
    """Lookups over one (top-level) graph. Built once; never mutates the model.

    Per-node inputs/outputs/op types are copied out of the protobuf once: repeated protobuf
    field access dominates analysis time on large graphs.
    """

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        g = model.graph
        self.nodes: list[onnx.NodeProto] = list(g.node)
        self.initializers: dict[str, onnx.TensorProto] = {t.name: t for t in g.initializer}
        self.graph_inputs = [i.name for i in g.input if i.name not in self.initializers]
        self.graph_outputs = [o.name for o in g.output]
        names: list[str] = []
        op_types: list[str] = []
        domains: list[str] = []
        node_inputs: list[tuple[str, ...]] = []
        node_outputs: list[tuple[str, ...]] = []
        producer: dict[str, int] = {}
        consumers: dict[str, list[int]] = {}
        seen: set[str] = set()
        for idx, node in enumerate(self.nodes):
            op = node.op_type
            label = node.name or f"{op}_{idx}"
            if label in seen:
                label = f"{label}#{idx}"
            seen.add(label)
            names.append(label)
            op_types.append(op)
            domains.append(node.domain)
            ins = tuple(node.input)
            outs = tuple(node.output)
            node_inputs.append(ins)
            node_outputs.append(outs)
            for out in outs:
                if out:
                    producer[out] = idx
            for inp in ins:
                if inp:
                    lst = consumers.get(inp)
                    if lst is None:
                        consumers[inp] = [idx]
                    elif lst[-1] != idx:
                        lst.append(idx)
        self.names = names
        self.op_types = op_types
        self.domains = domains
        self.node_inputs = node_inputs
        self.node_outputs = node_outputs
        self.producer = producer
        self.consumers = consumers
        self.reload_value_info()

    def reload_value_info(self) -> None:
        """Re-read tensor types after shape inference changed `graph.value_info`."""
        g = self.model.graph
        value_infos: dict[str, onnx.ValueInfoProto] = {}
        for vi in (*g.output, *g.value_info, *g.input):
            value_infos[vi.name] = vi
        self._value_infos = value_infos
        self._tensors: dict[str, TensorInfo] = {}

    @cached_property
    def index_by_name(self) -> dict[str, int]:
        return {n: i for i, n in enumerate(self.names)}

    def tensor(self, name: str) -> TensorInfo:
        """Type and shape of a tensor (rank None when unknown); parsed on first use."""
        info = self._tensors.get(name)
        if info is None:
            info = self._make_tensor_info(name)
            self._tensors[name] = info
        return info

    def has_tensor_info(self, name: str) -> bool:
        return name in self.initializers or name in self._value_infos

    def _make_tensor_info(self, name: str) -> TensorInfo:
        init = self.initializers.get(name)
        if init is not None:
            return TensorInfo(name, init.data_type, tuple(init.dims))
        vi = self._value_infos.get(name)
        if vi is not None:
            elem, shape = shape_from_type(vi.type)
            return TensorInfo(name, elem, shape)
        return TensorInfo(name, 0, None)

    def is_initializer(self, name: str) -> bool:
        return name in self.initializers

    def constant_value(
        self, name: str, max_elements: int = SMALL_CONSTANT_ELEMENTS
    ) -> np.ndarray | None:
        """The value of an initializer or `Constant` node output, if it is small enough to decode."""
        init = self.initializers.get(name)
        if init is None:
            idx = self.producer.get(name)
            if idx is None or self.nodes[idx].op_type != "Constant":
                return None
            return _constant_node_value(self.nodes[idx], max_elements)
        n = 1
        for d in init.dims:
            n *= d
        if n > max_elements:
            return None
        return numpy_helper.to_array(init)

    def successors(self, idx: int) -> list[int]:
        out: list[int] = []
        for t in self.node_outputs[idx]:
            out.extend(self.consumers.get(t, ()))
        return out

    def predecessors(self, idx: int) -> list[int]:
        out: list[int] = []
        for t in self.node_inputs[idx]:
            p = self.producer.get(t)
            if p is not None:
                out.append(p)
        return out


def _constant_node_value(node: onnx.NodeProto, max_elements: int) -> np.ndarray | None:
    for a in node.attribute:
        if a.name == "value":
            n = 1
            for d in a.t.dims:
                n *= d
            return numpy_helper.to_array(a.t) if n <= max_elements else None
        if a.name == "value_float":
            return np.array(a.f, dtype=np.float32)
        if a.name == "value_floats":
            return np.array(list(a.floats), dtype=np.float32)
        if a.name == "value_int":
            return np.array(a.i, dtype=np.int64)
        if a.name == "value_ints":
            return np.array(list(a.ints), dtype=np.int64)
    return None
