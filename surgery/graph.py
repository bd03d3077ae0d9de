"""A read-only index over an ONNX graph: producers, consumers, tensor types and constants.

Coverage, queries and rules all need the same lookups; building them once per analysis keeps
`surgery check` fast on graphs with thousands of nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
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
    dims: list[Dim] = []
    for d in tt.shape.dim:
        v = d.dim_value
        if v > 0:
            dims.append(v)
        else:
            dims.append(d.dim_param or None)
    return tt.elem_type, tuple(dims)


def attribute_values(node: onnx.NodeProto) -> dict[str, object]:
    """Node attributes as plain Python values (tensors stay TensorProto; graphs stay GraphProto)."""
    out: dict[str, object] = {}
    for a in node.attribute:
        t = a.type
        if t == onnx.AttributeProto.INT:
            out[a.name] = a.i
        elif t == onnx.AttributeProto.INTS:
            out[a.name] = list(a.ints)
        elif t == onnx.AttributeProto.FLOAT:
            out[a.name] = a.f
        elif t == onnx.AttributeProto.FLOATS:
            out[a.name] = list(a.floats)
        elif t == onnx.AttributeProto.STRING:
            out[a.name] = a.s.decode("utf-8", "replace")
        elif t == onnx.AttributeProto.STRINGS:
            out[a.name] = [s.decode("utf-8", "replace") for s in a.strings]
        elif t == onnx.AttributeProto.TENSOR:
            out[a.name] = a.t
        elif t == onnx.AttributeProto.GRAPH:
            out[a.name] = a.g
        elif t == onnx.AttributeProto.GRAPHS:
            out[a.name] = list(a.graphs)
        else:
            out[a.name] = onnx.helper.get_attribute_value(a)
    return out


def node_label(node: onnx.NodeProto, index: int) -> str:
    """A stable display name: the node's own name, or `<OpType>_<index>` when it has none."""
    return node.name or f"{node.op_type}_{index}"


@dataclass
class GraphView:
    """Lookups over one (top-level) graph. Built once; never mutates the model."""

    model: onnx.ModelProto
    nodes: list[onnx.NodeProto] = field(init=False)
    names: list[str] = field(init=False)
    producer: dict[str, int] = field(init=False)
    consumers: dict[str, list[int]] = field(init=False)
    initializers: dict[str, onnx.TensorProto] = field(init=False)
    tensors: dict[str, TensorInfo] = field(init=False, repr=False)
    graph_inputs: list[str] = field(init=False)
    graph_outputs: list[str] = field(init=False)

    def __post_init__(self) -> None:
        g = self.model.graph
        self.nodes = list(g.node)
        self.initializers = {t.name: t for t in g.initializer}
        self.graph_inputs = [i.name for i in g.input if i.name not in self.initializers]
        self.graph_outputs = [o.name for o in g.output]
        self.names = []
        self.producer = {}
        self.consumers = {}
        seen: set[str] = set()
        for idx, node in enumerate(self.nodes):
            label = node_label(node, idx)
            if label in seen:
                label = f"{label}#{idx}"
            seen.add(label)
            self.names.append(label)
            for out in node.output:
                if out:
                    self.producer[out] = idx
            for inp in node.input:
                if inp:
                    self.consumers.setdefault(inp, []).append(idx)
        value_infos: dict[str, onnx.ValueInfoProto] = {}
        for vi in (*g.output, *g.value_info, *g.input):
            value_infos[vi.name] = vi
        self._value_infos = value_infos
        self.tensors = _LazyTensors(self)

    @cached_property
    def index_by_name(self) -> dict[str, int]:
        return {n: i for i, n in enumerate(self.names)}

    def tensor(self, name: str) -> TensorInfo:
        info = self.tensors.get(name)
        return info if info is not None else TensorInfo(name, 0, None)

    def _make_tensor_info(self, name: str) -> TensorInfo | None:
        init = self.initializers.get(name)
        if init is not None:
            return TensorInfo(name, init.data_type, tuple(init.dims))
        vi = self._value_infos.get(name)
        if vi is not None:
            elem, shape = shape_from_type(vi.type)
            return TensorInfo(name, elem, shape)
        return None

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
        for t in self.nodes[idx].output:
            out.extend(self.consumers.get(t, ()))
        return out

    def predecessors(self, idx: int) -> list[int]:
        out: list[int] = []
        for t in self.nodes[idx].input:
            p = self.producer.get(t)
            if p is not None:
                out.append(p)
        return out


class _LazyTensors(dict):
    """name → TensorInfo, parsed from value_info on first use (most tensors never are)."""

    def __init__(self, view: GraphView) -> None:
        super().__init__()
        self._view = view

    def __missing__(self, name: str) -> TensorInfo:
        info = self._view._make_tensor_info(name)
        if info is None:
            raise KeyError(name)
        self[name] = info
        return info

    def get(self, name: str, default: TensorInfo | None = None) -> TensorInfo | None:  # type: ignore[override]
        try:
            return self[name]
        except KeyError:
            return default

    def __contains__(self, name: object) -> bool:
        return dict.__contains__(self, name) or self.get(name) is not None  # type: ignore[arg-type]


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
