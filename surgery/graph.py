"""A read-only index over an ONNX graph: producers, consumers, tensor types and constants.

Coverage, queries and rules all need the same lookups; building them once per analysis keeps
`surgery check` fast on graphs with thousands of nodes.
"""

from __future__ import annotations

import heapq
import math
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import cache, cached_property
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from surgery.errors import MalformedTensorError, first_line

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


@cache
def dtype_name(elem_type: int) -> str:
    """ONNX elem type → short lowercase name (`float32`, `int64`, …); cached, since placement
    asks for every tensor and numpy's dtype naming costs microseconds."""
    if elem_type == 0:
        return "unknown"
    if elem_type == onnx.TensorProto.BFLOAT16:
        return "bfloat16"
    try:
        return str(onnx.helper.tensor_dtype_to_np_dtype(elem_type))
    except KeyError:  # not an ONNX type (a damaged file): named, not a crash of inspect
        return f"element type {elem_type}"


class TensorInfo:
    """What is known about a tensor without running the model (immutable by convention)."""

    __slots__ = ("name", "elem_type", "shape", "rank", "is_static")

    def __init__(
        self,
        name: str,
        elem_type: int,
        shape: tuple[Dim, ...] | None,
        is_static: bool | None = None,
    ) -> None:
        """`is_static`, when the caller already knows it, saves scanning the dims again."""
        self.name = name
        self.elem_type = elem_type
        self.shape = shape
        """None when even the rank is unknown."""
        self.rank = None if shape is None else len(shape)
        self.is_static = (
            is_static
            if is_static is not None
            else shape is not None and all(type(d) is int for d in shape)
        )

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


def shape_text(shape: Sequence[Dim] | None) -> str:
    """A shape as people write it: [batch, 3, h, w], `?` for an unnamed dynamic dim (no
    Python quotes: reason texts quote only tensor names)."""
    if shape is None:
        return "[unknown rank]"
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"


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


DEFAULT_DOMAINS = frozenset({"", "ai.onnx"})
"""The names of the default (ai.onnx) domain."""

VALUE_MOVING_OPS = frozenset(
    {
        "MaxPool",
        "GlobalMaxPool",
        "Reshape",
        "Flatten",
        "Transpose",
        "Squeeze",
        "Unsqueeze",
        "Slice",
        "Split",
        "Identity",
        "Dropout",
        "DepthToSpace",
        "SpaceToDepth",
        "Gather",
        "Resize",
        "Expand",
        "Tile",
        "Pad",
    }
)
"""Ops whose outputs are input values moved around (or mixes of them, for Resize), plus Pad's
constant: a quantizer gives them their input's scale."""

VIEW_OPS = frozenset({"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Transpose"})
"""Ops that only rearrange their first input's elements, every one of them, once."""


def behind_views(
    tensor: str, producers: Mapping[str, onnx.NodeProto]
) -> tuple[onnx.NodeProto | None, list[onnx.NodeProto]]:
    """The first producer of `tensor` that is not a view (`VIEW_OPS`), or None, and the views
    walked back through to it, the nearest first."""
    chain: list[onnx.NodeProto] = []
    node = producers.get(tensor)
    while node is not None and node.op_type in VIEW_OPS and node.input:
        chain.append(node)
        node = producers.get(node.input[0])
    return node, chain


def default_opset(model: onnx.ModelProto) -> int:
    """The model's default-domain ("" or "ai.onnx") opset; 1 when it declares none."""
    return next((int(o.version) for o in model.opset_import if o.domain in DEFAULT_DOMAINS), 1)


SUBGRAPH_OPS = frozenset({"If", "Loop", "Scan", "SequenceMap"})
"""Ops whose attributes hold graphs that read the outer graph's tensors by name."""


def subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    """The graphs held by a node's attributes (If branches, Loop and Scan bodies)."""
    found: list[onnx.GraphProto] = []
    for a in node.attribute:
        if a.type == onnx.AttributeProto.GRAPH:
            found.append(a.g)
        elif a.type == onnx.AttributeProto.GRAPHS:
            found.extend(a.graphs)
    return found


def node_reads(node: onnx.NodeProto) -> list[str]:
    """A node's inputs plus outer-scope tensors its subgraphs (If/Loop/Scan bodies) read."""
    reads = [t for t in node.input if t]
    for sub in subgraphs(node):
        reads.extend(outer_reads(sub))
    return reads


def drop_unread_initializers(graph: onnx.GraphProto, read: set[str] | None = None) -> None:
    """Delete the initializers no node reads and no graph output is (`read`, when the caller
    knows it), with the graph inputs that list them (legacy IR lists every initializer as an
    input). ONNX Runtime refuses an unread initializer that is not an input at IR version 3."""
    if read is None:
        read = {name for node in graph.node for name in node_reads(node)}
        read |= {o.name for o in graph.output}
    dropped = {t.name for t in graph.initializer if t.name not in read}
    if dropped:
        remove_where(graph.initializer, lambda t: t.name in dropped)
        remove_where(graph.input, lambda i: i.name in dropped)


def remove_where(field: Any, dropped: Callable[[Any], bool]) -> int:
    """Remove the elements of a repeated protobuf field for which `dropped` is true, in place
    and in order (`remove_at`); how many went."""
    indices = [k for k, element in enumerate(field) if dropped(element)]
    remove_at(field, indices)
    return len(indices)


REMOVE_IN_PLACE_MOVES = 1 << 22
"""Up to this many (runs removed × field length) pointer moves, `remove_at` deletes in place."""


def remove_at(field: Any, indices: Sequence[int]) -> None:
    """Remove the elements at `indices` (ascending, each once) of a repeated protobuf field,
    keeping the others in order.

    Each run of consecutive indices goes with one slice deletion from the end, which moves
    pointers only. Rebuilding the field (`del field[:]` then `extend(kept)`) copies every kept
    message, weights and all: filtering a 35 MB model's initializers cost 2 ms that way and
    0.02 ms so. Where the pointer moves would add up quadratically (tens of thousands of
    scattered removals), the field is rebuilt instead."""
    if not indices:
        return
    runs: list[tuple[int, int]] = []
    for k in indices:
        if runs and runs[-1][1] == k:
            runs[-1] = (runs[-1][0], k + 1)
        else:
            runs.append((k, k + 1))
    if len(runs) * len(field) > REMOVE_IN_PLACE_MOVES:
        drop = set(indices)
        kept = [element for k, element in enumerate(field) if k not in drop]
        del field[:]
        field.extend(kept)
        return
    for first, end in reversed(runs):
        del field[first:end]


def topological_order(nodes: Sequence[onnx.NodeProto]) -> list[int] | None:
    """Node indices in dependency order (`node_reads`), keeping the given order among
    independent nodes (an already sorted list is returned as it is); None on a cycle."""
    produced = {out: i for i, node in enumerate(nodes) for out in node.output if out}
    indegree = [0] * len(nodes)
    users: list[list[int]] = [[] for _ in nodes]
    for idx, node in enumerate(nodes):
        for inp in set(node_reads(node)):
            p = produced.get(inp)
            if p is not None and p != idx:
                indegree[idx] += 1
                users[p].append(idx)
    ready = [i for i, d in enumerate(indegree) if d == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for u in users[i]:
            indegree[u] -= 1
            if indegree[u] == 0:
                heapq.heappush(ready, u)
    return order if len(order) == len(nodes) else None


def outer_reads(graph: onnx.GraphProto) -> list[str]:
    """The tensors of enclosing graphs that `graph` (a body) reads, nested bodies included.

    Read in whole-graph comprehensions (a body's own tensors are unique names in a sorted
    graph): silero's If branches hold 342 nodes each, nested Ifs included, and `check` reads them
    on every load."""
    nodes = graph.node
    local = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    local.update(o for n in nodes for o in n.output)
    local.add("")
    out = [t for n in nodes for t in n.input if t not in local]
    for n in nodes:
        if n.op_type in SUBGRAPH_OPS:
            out.extend(t for sub in subgraphs(n) for t in outer_reads(sub) if t not in local)
    return out


def rename_tensors(graph: onnx.GraphProto, renames: Mapping[str, str]) -> None:
    """Rename several tensors at once (a simultaneous substitution, so chains are safe)."""
    if not renames:
        return
    for node in graph.node:
        for field in (node.input, node.output):
            for k, t in enumerate(field):
                if t in renames:
                    field[k] = renames[t]
        for sub in subgraphs(node):
            outer = {o: n for o, n in renames.items() if not _defines(sub, o)}
            rename_tensors(sub, outer)
    for vi in (*graph.input, *graph.output, *graph.value_info):
        vi.name = renames.get(vi.name, vi.name)
    for t in graph.initializer:
        t.name = renames.get(t.name, t.name)
    for s in graph.sparse_initializer:
        s.values.name = renames.get(s.values.name, s.values.name)


def _defines(graph: onnx.GraphProto, name: str) -> bool:
    """Whether a subgraph declares `name` itself (then the outer tensor is shadowed there)."""
    return (
        any(i.name == name for i in graph.input)
        or any(t.name == name for t in graph.initializer)
        or any(name in n.output for n in graph.node)
    )


class FreshNames:
    """Names no tensor or node of a graph uses yet (`base`, else `base_2`, `base_3`, ...);
    every name handed out is taken from then on."""

    def __init__(self, graph: onnx.GraphProto | None = None, taken: Iterable[str] = ()) -> None:
        self.taken = set(taken)
        if graph is not None:
            self.taken |= {t.name for t in graph.initializer} | {i.name for i in graph.input}
            self.taken |= {o for n in graph.node for o in n.output} | {n.name for n in graph.node}

    def __call__(self, base: str) -> str:
        name, k = base, 1
        while name in self.taken:
            k += 1
            name = f"{base}_{k}"
        self.taken.add(name)
        return name


def node_label(node: onnx.NodeProto, index: int) -> str:
    """A stable display name: the node's own name, or `<OpType>_<index>` when it has none."""
    return node.name or f"{node.op_type}_{index}"


def _labels(names: list[str], op_types: list[str]) -> list[str]:
    """`node_label` for every node, with `#<index>` appended to a repeated label.

    Most graphs give every node a unique label (their own names, or none at all, as Paddle
    exports): that case is one comprehension and one set comparison.
    """
    labels = (
        [name or f"{op_types[idx]}_{idx}" for idx, name in enumerate(names)]
        if "" in names
        else names
    )
    if len(set(labels)) == len(labels):
        return labels
    labels = []
    seen: set[str] = set()
    for idx, name in enumerate(names):
        label = name or f"{op_types[idx]}_{idx}"
        if label in seen:
            label = f"{label}#{idx}"
        seen.add(label)
        labels.append(label)
    return labels


def _consumers(node_inputs: list[tuple[str, ...]]) -> dict[str, list[int]]:
    """Tensor → indices of the nodes reading it (each node once, in graph order)."""
    consumers: dict[str, list[int]] = {}
    for idx, ins in enumerate(node_inputs):
        for inp in ins:
            if inp:
                lst = consumers.get(inp)
                if lst is None:
                    consumers[inp] = [idx]
                elif lst[-1] != idx:
                    lst.append(idx)
    return consumers


class GraphView:
    """Lookups over one (top-level) graph. Built once; never mutates the model.

    Per-node inputs/outputs/op types are copied out of the protobuf once: repeated protobuf
    field access dominates analysis time on large graphs.
    """

    def __init__(self, model: onnx.ModelProto) -> None:
        self.model = model
        g = model.graph
        self.initializers: dict[str, onnx.TensorProto] = {t.name: t for t in g.initializer}
        self.graph_inputs = [i.name for i in g.input if i.name not in self.initializers]
        self.graph_outputs = [o.name for o in g.output]
        self._index_nodes(list(g.node))
        self.computed: frozenset[str] = frozenset()
        """Computed constants whose values `constant_value` reads as if folded (see
        `read_computed_constants`)."""
        self._evaluate_computed: Callable[[str], np.ndarray | None] | None = None
        self.reload_value_info()

    def _index_nodes(self, nodes: list[onnx.NodeProto]) -> None:
        """The per-node fields, producers and consumers of `nodes` (the graph's, in order)."""
        self.nodes = nodes
        # One comprehension per field: each protobuf field is read once, in C-speed loops.
        op_types = [n.op_type for n in nodes]
        self.op_types = op_types
        self.names = _labels([n.name for n in nodes], op_types)
        self.domains = [n.domain for n in nodes]
        node_inputs = [tuple(n.input[:]) for n in nodes]
        node_outputs = [tuple(n.output[:]) for n in nodes]
        self.node_inputs = node_inputs
        self.node_outputs = node_outputs
        self.node_reads = node_inputs
        """What each node depends on: its inputs, and for a control-flow node also the outer
        tensors its bodies read (a Keras LSTM's Loop reads its sequence only from its body).
        Orders, segments and consumers follow these; `node_inputs` stays positional."""
        if not SUBGRAPH_OPS.isdisjoint(op_types):
            self.node_reads = [
                tuple(node_reads(n)) if op in SUBGRAPH_OPS else ins
                for n, op, ins in zip(nodes, op_types, node_inputs, strict=True)
            ]
        self.producer = {out: idx for idx, outs in enumerate(node_outputs) for out in outs if out}
        self.consumers = _consumers(self.node_reads)

    def rebind(self, model: onnx.ModelProto) -> None:
        """Point the view at `model`, a copy of the viewed model with the same nodes in the
        same order (e.g. the shape inferencer's output), and re-read its tensor types."""
        if model is not self.model:
            self.model = model
            g = model.graph
            self.nodes = list(g.node)
            self.initializers = {t.name: t for t in g.initializer}
        self.reload_value_info()

    def forget_readers(self, readers: set[int], tensors: Iterable[str]) -> None:
        """Drop nodes `readers` from the consumers of `tensors`: a view of the model as
        folded, where the Shape nodes that read computed tensors are gone (check's shape
        repair analyses the model unfolded, as if folded)."""
        for t in tensors:
            users = self.consumers.get(t)
            if users is None:
                continue
            kept = [u for u in users if u not in readers]
            if kept:
                self.consumers[t] = kept
            else:
                del self.consumers[t]

    def retype(self, names: Iterable[str]) -> None:
        """Re-read the types of tensors `names` only, after their value_info entries changed
        (or were added): the other tensors' parsed types stay."""
        self._value_infos = None
        for name in names:
            self._tensors.pop(name, None)

    def reload_value_info(self) -> None:
        """Re-read tensor types after shape inference changed `graph.value_info`. The index
        of value infos is built on first use: `open_model` builds a view before inference
        (to validate) and reloads after it, and only the second index is ever read."""
        self._value_infos: dict[str, onnx.ValueInfoProto] | None = None
        self._tensors: dict[str, TensorInfo] = {}
        self._constants: dict[tuple[str, int], np.ndarray | None] = {}
        self._types: dict[bytes, tuple[int, tuple[Dim, ...] | None, bool]] = {}

    @cached_property
    def is_sorted(self) -> bool:
        """Whether every node comes after the producers of its inputs (the stored order is a
        topological order). Validation, coverage and the rules all ask; it is computed once."""
        get = self.producer.get
        for i, ins in enumerate(self.node_reads):
            for t in ins:
                if get(t, -1) >= i:
                    return False
        return True

    @cached_property
    def nodes_by_op(self) -> dict[str, list[int]]:
        """Op type → indices of its nodes, in graph order (every rule looks up a few ops)."""
        by_op: dict[str, list[int]] = {}
        for idx, op in enumerate(self.op_types):
            lst = by_op.get(op)
            if lst is None:
                by_op[op] = [idx]
            else:
                lst.append(idx)
        return by_op

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

    def _value_info_index(self) -> dict[str, onnx.ValueInfoProto]:
        """Tensor name → its declared or inferred ValueInfoProto (graph inputs win over
        value_info, which wins over outputs), built in one pass on first use. Types are
        serialized only for the tensors an analysis asks about: a network has a value info per
        tensor, but placement reads about half of them, and serializing every type up front
        cost more than the rest of indexing. Inputs that are initializers are left out (the
        initializer gives their type)."""
        index = self._value_infos
        if index is None:
            g = self.model.graph
            inits = self.initializers
            index = {vi.name: vi for vi in (*g.output, *g.value_info)}
            index.update((vi.name, vi) for vi in g.input if vi.name not in inits)
            self._value_infos = index
        return index

    def has_tensor_info(self, name: str) -> bool:
        return name in self.initializers or name in self._value_info_index()

    def _make_tensor_info(self, name: str) -> TensorInfo:
        init = self.initializers.get(name)
        if init is not None:
            return TensorInfo(name, init.data_type, tuple(init.dims), True)
        index = self._value_infos
        info = (index if index is not None else self._value_info_index()).get(name)
        if info is not None:
            return TensorInfo(name, *self._parsed_type(info.type.SerializeToString()))
        return TensorInfo(name, 0, None, False)

    def _parsed_type(self, key: bytes) -> tuple[int, tuple[Dim, ...] | None, bool]:
        """`shape_from_type` and whether the shape is static, once per distinct serialized
        type: reading dims field by field is slow, and most tensors of a network share a
        handful of types."""
        parsed = self._types.get(key)
        if parsed is None:
            elem, shape = shape_from_type(onnx.TypeProto.FromString(key))
            static = shape is not None and all(type(d) is int for d in shape)
            parsed = (elem, shape, static)
            self._types[key] = parsed
        return parsed

    def is_initializer(self, name: str) -> bool:
        return name in self.initializers

    def constant_value(
        self, name: str, max_elements: int = SMALL_CONSTANT_ELEMENTS
    ) -> np.ndarray | None:
        """The value of an initializer or `Constant` node output, if it is small enough to decode.

        Decoded once per view: every rule's pattern asks for the same scalars and axes, and
        decoding a TensorProto costs more than the lookups around it. Writable arrays are
        handed out as copies so a caller editing its array cannot change what others see.
        """
        key = (name, max_elements)
        if key in self._constants:
            value = self._constants[key]
        else:
            value = self._decode_constant(name, max_elements)
            self._constants[key] = value
        if value is not None and value.flags.writeable:
            return value.copy()
        return value

    def has_value(self, name: str) -> bool:
        """Whether `name` is a constant whose value is stored (an initializer or a Constant
        node's output) or, in a view analysed as if folded, a computed constant it reads
        (`read_computed_constants`)."""
        if name in self.initializers or name in self.computed:
            return True
        producer = self.producer.get(name)
        return producer is not None and self.op_types[producer] == "Constant"

    def read_computed_constants(
        self, names: Iterable[str], evaluate: Callable[[str], np.ndarray | None]
    ) -> None:
        """Let `constant_value` read computed constants `names` (outputs of nodes that only
        compute constants) through `evaluate`, as it reads the initializers folding would make
        of them: check's shape repair analyses the model unfolded, as if folded."""
        self.computed = frozenset(names)
        self._evaluate_computed = evaluate
        self._constants = {k: v for k, v in self._constants.items() if k[0] not in self.computed}

    def known_larger_than(self, name: str, max_elements: int = SMALL_CONSTANT_ELEMENTS) -> bool:
        """Whether `name`'s static shape already says it holds more than `max_elements` values
        (`constant_value` then reads no value for it without evaluating it)."""
        info = self.tensor(name)
        return info.is_static and math.prod(info.shape) > max_elements

    def _decode_constant(self, name: str, max_elements: int) -> np.ndarray | None:
        init = self.initializers.get(name)
        if init is None:
            if name in self.computed and self._evaluate_computed is not None:
                if self.known_larger_than(name, max_elements):
                    return None  # not evaluated
                value = self._evaluate_computed(name)
                return value if value is not None and value.size <= max_elements else None
            idx = self.producer.get(name)
            if idx is None or self.nodes[idx].op_type != "Constant":
                return None
            return _constant_node_value(self.nodes[idx], max_elements, self.names[idx])
        n = 1
        for d in init.dims:
            n *= d
        if n > max_elements:
            return None
        return _decoded(init, f"initializer {name!r}")

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


_RAW_DTYPES: dict[int, np.dtype] = {
    code: np.dtype(onnx.helper.tensor_dtype_to_np_dtype(code))
    for code in (1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13)
}
"""Element types whose raw bytes are the little-endian numpy array as is (no packed bits)."""

_LITTLE_ENDIAN = sys.byteorder == "little"

_FIELD_DTYPES: dict[int, tuple[str, np.dtype]] = {
    onnx.TensorProto.FLOAT: ("float_data", np.dtype(np.float32)),
    onnx.TensorProto.INT32: ("int32_data", np.dtype(np.int32)),
    onnx.TensorProto.INT64: ("int64_data", np.dtype(np.int64)),
    onnx.TensorProto.DOUBLE: ("double_data", np.dtype(np.float64)),
}
"""Element types stored in a typed field of their own dtype (no widening or bit packing)."""

_WIDENED_DTYPES: dict[int, np.dtype] = {
    code: np.dtype(onnx.helper.tensor_dtype_to_np_dtype(code))
    for code in (
        onnx.TensorProto.INT8,
        onnx.TensorProto.UINT8,
        onnx.TensorProto.INT16,
        onnx.TensorProto.UINT16,
        onnx.TensorProto.BOOL,
    )
}
"""Element types whose values are stored widened in `int32_data`, one value each (ONNX
Runtime's quantizer writes its zero points so)."""


def tensor_value(t: onnx.TensorProto) -> np.ndarray:
    """`numpy_helper.to_array`, with a direct path for plain numeric raw data (what exporters
    write): a pattern decodes dozens of scalar constants per `check`, and the generic
    converter's dtype-table and external-data lookups cost more than the decode itself. The
    direct paths return what `to_array` returns: a read-only view of raw bytes, a writable
    array of typed-field values."""
    if t.data_location == onnx.TensorProto.EXTERNAL or t.HasField("segment"):
        return numpy_helper.to_array(t)
    if t.HasField("raw_data"):
        dtype = _RAW_DTYPES.get(t.data_type)
        if dtype is not None and _LITTLE_ENDIAN:
            return np.frombuffer(t.raw_data, dtype=dtype).reshape(t.dims)
        return numpy_helper.to_array(t)
    field = _FIELD_DTYPES.get(t.data_type)
    if field is not None:  # a writable copy, as `to_array` makes
        return np.array(getattr(t, field[0]), dtype=field[1]).reshape(t.dims)
    widened = _WIDENED_DTYPES.get(t.data_type)
    if widened is not None:
        return np.array(t.int32_data, dtype=np.int32).astype(widened).reshape(t.dims)
    return numpy_helper.to_array(t)


def _decoded(t: onnx.TensorProto, label: str) -> np.ndarray:
    """`tensor_value`, where data that does not fit the tensor's dims or type is the model's
    problem, named (a truncated weight failed inside whichever analysis read it first)."""
    try:
        return tensor_value(t)
    except (ValueError, TypeError, KeyError) as exc:
        raise MalformedTensorError(
            f"{label}: {tensor_data_problem(t) or first_line(exc)}",
            hint=DAMAGED_FILE_HINT,
        ) from None


DAMAGED_FILE_HINT = (
    "the file is damaged or was edited by hand (ONNX Runtime cannot load it either): "
    "re-export the model"
)


def tensor_data_problem(tensor: onnx.TensorProto) -> str | None:
    """What is wrong with a tensor's data for its dims and element type (onnx's checker, then
    the decoder, which also refuses more values than the dims hold), or None. It serialises
    the tensor: for explaining a failure, not for every load."""
    if tensor.data_type not in _ELEMENT_TYPES:
        return f"element type {tensor.data_type} is not an ONNX type"
    try:
        onnx.checker.check_tensor(tensor)
    except onnx.checker.ValidationError as exc:
        return _TENSOR_PREFIX.sub("", first_line(exc))
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        return None  # not loaded: its file is read where the data is needed
    try:
        numpy_helper.to_array(tensor)
    except (ValueError, TypeError, KeyError) as exc:
        return f"its data does not fit dims {list(tensor.dims)} ({first_line(exc)})"
    return None


_ELEMENT_TYPES = frozenset(onnx.TensorProto.DataType.values()) - {onnx.TensorProto.UNDEFINED}
_TENSOR_PREFIX = re.compile(r"^TensorProto \(tensor name: [^)]*\) ")


def _constant_node_value(node: onnx.NodeProto, max_elements: int, label: str) -> np.ndarray | None:
    for a in node.attribute:
        if a.name == "value":
            n = 1
            for d in a.t.dims:
                n *= d
            return _decoded(a.t, f"Constant node {label!r}") if n <= max_elements else None
        if a.name == "value_float":
            return np.array(a.f, dtype=np.float32)
        if a.name == "value_floats":
            return np.array(list(a.floats), dtype=np.float32)
        if a.name == "value_int":
            return np.array(a.i, dtype=np.int64)
        if a.name == "value_ints":
            return np.array(list(a.ints), dtype=np.int64)
    return None
