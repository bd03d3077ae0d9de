"""Low-level graph edits for what no rule covers, as pure functions ModelProto → ModelProto.

Rules are named, pattern-matched and verified; these operations are the scalpel for everything
else (drop a node, change an attribute, splice in a Cast, rename a tensor, swap a weight). They
are what the MCP `edit_graph` tool and `surgery edit --ops` run, so each one:

- never modifies its input (it edits a copy) and gives every node its display name first, so a
  list of edits can address unnamed nodes without their names shifting under it;
- checks its arguments and fails with an `EditError` that names the node or tensor at fault;
- ends in `finish`: stale shapes dropped, shapes re-inferred through `load_model`, and the full
  ONNX checker run, so an edit either returns a valid model or raises.

Edits change numbers on purpose, so nothing here compares outputs; `surgery verify` does that.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
import onnx
from onnx import numpy_helper
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

from surgery.errors import NodeNotFoundError, SurgeryError
from surgery.graph import (
    GraphView,
    drop_unread_initializers,
    node_reads,
    remove_at,
    rename_tensors,
)
from surgery.model import (
    check_model_fully,
    load_model,
    read_model,
    toposort_nodes,
)
from surgery.rules.graph_edit import with_unique_node_names

ArrayLike = np.ndarray | Sequence[Any] | float | int


class EditError(SurgeryError):
    """An edit cannot be made as asked, or would leave an invalid model."""

    code = "edit_error"


# --------------------------------------------------------------------------- plumbing


@dataclass
class _Index:
    """Lookups over the working copy; rebuilt per edit (edits are small, models are not)."""

    model: onnx.ModelProto
    view: GraphView

    @classmethod
    def of(cls, model: onnx.ModelProto) -> _Index:
        return cls(model, GraphView(model))

    @property
    def graph(self) -> onnx.GraphProto:
        return self.model.graph

    def node_index(self, name: str) -> int:
        idx = self.view.index_by_name.get(name)
        if idx is None:
            close = difflib.get_close_matches(name, self.view.names, n=3)
            raise NodeNotFoundError(
                f"no node named {name!r} in the model",
                hint=f"did you mean {', '.join(map(repr, close))}?"
                if close
                else "list node names with `surgery inspect`",
            )
        return idx

    def node(self, name: str) -> tuple[int, onnx.NodeProto]:
        idx = self.node_index(name)
        return idx, self.graph.node[idx]

    def exists(self, tensor: str) -> bool:
        v = self.view
        return tensor in v.producer or tensor in v.initializers or tensor in _input_names(self)

    def require_tensor(self, tensor: str, what: str) -> None:
        if not tensor or not self.exists(tensor):
            names = list(self.view.producer) + list(self.view.initializers)
            close = difflib.get_close_matches(tensor, names, n=3)
            raise EditError(
                f"{what}: no tensor named {tensor!r} in the model",
                hint=f"did you mean {', '.join(map(repr, close))}?" if close else None,
            )

    def is_constant(self, tensor: str) -> bool:
        """Initializer or output of a Constant node: known before run time, not data."""
        return self.view.has_value(tensor)

    def is_graph_output(self, tensor: str) -> bool:
        return tensor in self.view.graph_outputs

    def used(self, tensor: str) -> bool:
        return bool(self.view.consumers.get(tensor)) or self.is_graph_output(tensor)

    def fresh(self, base: str) -> str:
        """A name no tensor or node uses yet."""
        taken = _all_names(self.model)
        if base not in taken:
            return base
        k = 1
        while f"{base}_{k}" in taken:
            k += 1
        return f"{base}_{k}"

    def opset(self, domain: str = "") -> int:
        for o in self.model.opset_import:
            if o.domain == domain or (domain in ("", "ai.onnx") and o.domain in ("", "ai.onnx")):
                return o.version
        return 0


def _input_names(ix: _Index) -> set[str]:
    return {i.name for i in ix.graph.input}


def _all_names(model: onnx.ModelProto) -> set[str]:
    g = model.graph
    names = {n.name for n in g.node}
    names.update(t for n in g.node for t in (*n.input, *n.output))
    names.update(t.name for t in g.initializer)
    names.update(v.name for v in (*g.input, *g.output, *g.value_info))
    names.discard("")
    return names


def start(model: onnx.ModelProto) -> _Index:
    """A private, fully named copy of `model` to edit."""
    return _Index.of(with_unique_node_names(read_model(model)))


def finish(
    model: onnx.ModelProto,
    what: str,
    error: type[SurgeryError] = EditError,
    *,
    keep_output_shapes: bool = False,
) -> onnx.ModelProto:
    """Drop stale shapes, re-infer, and run the full checker: the end of every edit.

    Shapes of node-produced outputs are cleared with the intermediate ones because an edit may
    change them; their element types stay unless inference finds new ones. A cut computes the
    same tensors (`keep_output_shapes`): its outputs keep the shapes they had, which ONNX
    inference alone may not find again (a Reshape-13 does not read a shape computed by a
    Shape node, and the checker refuses a graph output without a shape).
    """
    del model.graph.value_info[:]
    produced = {t for n in model.graph.node for t in n.output}
    for out in model.graph.output:
        if out.name in produced and out.type.HasField("tensor_type") and not keep_output_shapes:
            out.type.tensor_type.ClearField("shape")
    try:
        toposort_nodes(model)
        inferred = load_model(model)
    except SurgeryError as exc:
        raise error(f"{what}: the result is not a valid model: {exc.message}") from None
    full_check(inferred, what, error)
    return inferred


def full_check(model: onnx.ModelProto, what: str, error: type[SurgeryError] = EditError) -> None:
    """`check_model_fully`, its failure as `error` naming `what`."""
    try:
        check_model_fully(model)
    except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
        first = str(exc).strip().splitlines()[0][:300]
        raise error(f"{what}: the result fails the ONNX checker: {first}") from None


def rename_everywhere(graph: onnx.GraphProto, old: str, new: str) -> None:
    """Rename a tensor in a graph and in nested subgraphs that read it from the outer scope."""
    rename_tensors(graph, {old: new})


def _np_dtype(name: str) -> np.dtype:
    try:
        dtype = np.dtype(name)
    except TypeError:
        raise EditError(f"unknown dtype {name!r} (use e.g. float32, int64, uint8)") from None
    try:
        onnx.helper.np_dtype_to_tensor_dtype(dtype)
    except (KeyError, ValueError, TypeError):
        raise EditError(f"dtype {name!r} has no ONNX tensor type") from None
    return dtype


def _as_array(value: ArrayLike, dtype: str | np.dtype | None, what: str) -> np.ndarray:
    try:
        arr = np.asarray(value) if dtype is None else np.asarray(value, dtype=_np_dtype(str(dtype)))
    except (ValueError, TypeError) as exc:
        raise EditError(f"{what}: cannot make an array of the value ({exc})") from None
    if arr.dtype == np.float64 and dtype is None and not isinstance(value, np.ndarray):
        arr = arr.astype(np.float32)  # JSON numbers default to the usual model dtype
    if arr.dtype.kind not in "fiub":
        raise EditError(f"{what}: values must be numbers or booleans (got {arr.dtype})")
    return np.ascontiguousarray(arr)


def _schema(op_type: str, domain: str, opset: int) -> onnx.defs.OpSchema | None:
    try:
        return onnx.defs.get_schema(op_type, opset, domain)
    except onnx.defs.SchemaError:
        return None


_AttrType = onnx.defs.OpSchema.AttrType


def make_attribute(
    name: str, value: Any, schema: onnx.defs.OpSchema | None, what: str
) -> onnx.AttributeProto:
    """An AttributeProto whose type follows the op schema (so `alpha=1` becomes a float).

    Tensor attributes take an array or `{"value": [...], "dtype": "int64"}`.
    """
    spec = schema.attributes.get(name) if schema is not None else None
    if schema is not None and spec is None:
        known = ", ".join(sorted(schema.attributes)) or "none"
        raise EditError(f"{what}: {schema.name} has no attribute {name!r} (it has: {known})")
    kind = spec.type if spec is not None else None
    try:
        value = _coerce_attribute(value, kind)
        return onnx.helper.make_attribute(name, value)
    except (ValueError, TypeError) as exc:
        expected = f" ({kind.name.lower()})" if kind is not None else ""
        raise EditError(f"{what}: bad value for attribute {name!r}{expected}: {exc}") from None


def _coerce_attribute(value: Any, kind: Any) -> Any:
    if isinstance(value, Mapping) and "value" in value:
        value = _as_array(value["value"], value.get("dtype"), "tensor attribute")
    if isinstance(value, np.ndarray) or kind == _AttrType.TENSOR:
        return numpy_helper.from_array(_as_array(value, None, "tensor attribute"))
    if kind == _AttrType.FLOAT:
        return float(value)
    if kind == _AttrType.INT:
        return _int(value)
    if kind == _AttrType.STRING:
        return str(value)
    if kind == _AttrType.FLOATS:
        return [float(v) for v in _listed(value)]
    if kind == _AttrType.INTS:
        return [_int(v) for v in _listed(value)]
    if kind == _AttrType.STRINGS:
        return [str(v) for v in _listed(value)]
    if isinstance(value, bool):
        return int(value)
    return value


def _listed(value: Any) -> list[Any]:
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise TypeError(f"expected a list, got {value!r}")
    return list(value)


def _int(value: Any) -> int:
    if isinstance(value, float) and not value.is_integer():
        raise ValueError(f"expected an integer, got {value}")
    return int(value)


def _set_attribute(node: onnx.NodeProto, attr: onnx.AttributeProto) -> None:
    for k, a in enumerate(node.attribute):
        if a.name == attr.name:
            node.attribute[k].CopyFrom(attr)
            return
    node.attribute.append(attr)


def _attribute_schema(ix: _Index, node: onnx.NodeProto) -> onnx.defs.OpSchema | None:
    domain = node.domain if node.domain != "ai.onnx" else ""
    return _schema(node.op_type, domain, ix.opset(domain))


def _check_op(ix: _Index, op_type: str, domain: str, what: str) -> onnx.defs.OpSchema | None:
    """The schema of a standard op at the model's opset; custom domains must be declared."""
    domain = "" if domain == "ai.onnx" else domain
    if domain and domain not in {o.domain for o in ix.model.opset_import}:
        raise EditError(
            f"{what}: domain {domain!r} is not in the model's opset_import",
            hint="custom ops need their domain declared; standard ops use domain ''",
        )
    schema = _schema(op_type, domain, ix.opset(domain))
    if schema is None and domain in ("", "ai.onnx.ml"):
        close = difflib.get_close_matches(
            op_type, [s.name for s in onnx.defs.get_all_schemas() if s.domain == domain], n=3
        )
        raise EditError(
            f"{what}: {op_type!r} is not an ONNX op at opset {ix.opset(domain)}",
            hint=f"did you mean {', '.join(close)}?" if close else None,
        )
    return schema


# --------------------------------------------------------------------------- node edits


def remove_node(model: onnx.ModelProto, node: str) -> onnx.ModelProto:
    """Remove a single-input, single-output node; its consumers read its input instead.

    "Single input" counts data inputs only: Reshape(x, shape) and Add(x, bias) qualify, since
    their other inputs are constants. For several data inputs use `bypass_node` and say which.
    """
    ix = start(model)
    idx, proto = ix.node(node)
    data = [k for k, t in enumerate(proto.input) if t and not ix.is_constant(t)]
    if len(data) != 1:
        listed = ", ".join(repr(proto.input[k]) for k in data) or "none"
        raise EditError(
            f"remove_node: {node!r} ({proto.op_type}) has {len(data)} data inputs ({listed}); "
            "it needs exactly one",
            hint="use bypass_node with input=K to say which input its consumers should read",
        )
    _bypass(ix, idx, data[0], "remove_node")
    return finish(ix.model, f"remove_node {node!r}")


def bypass_node(model: onnx.ModelProto, node: str, input: int = 0) -> onnx.ModelProto:
    """Remove a node and wire its consumers (and graph output) to its `input`-th input."""
    ix = start(model)
    idx, proto = ix.node(node)
    if not 0 <= input < len(proto.input) or not proto.input[input]:
        raise EditError(
            f"bypass_node: {node!r} ({proto.op_type}) has no input {input} "
            f"(inputs: {', '.join(repr(t) for t in proto.input) or 'none'})"
        )
    _bypass(ix, idx, input, "bypass_node")
    return finish(ix.model, f"bypass_node {node!r}")


def _bypass(ix: _Index, idx: int, k: int, what: str) -> None:
    g = ix.graph
    proto = g.node[idx]
    name, src = ix.view.names[idx], proto.input[k]
    used = [o for o in proto.output if o and ix.used(o)]
    if len(used) > 1:
        raise EditError(
            f"{what}: {name!r} ({proto.op_type}) has {len(used)} used outputs "
            f"({', '.join(map(repr, used))}); only a node with one used output can be removed"
        )
    del g.node[idx]
    if not used:
        return
    dst = used[0]
    if not ix.is_graph_output(dst):
        rename_everywhere(g, dst, src)
        return
    if src in ix.view.producer and not ix.is_constant(src) and not ix.is_graph_output(src):
        rename_everywhere(g, src, dst)  # the graph keeps its output name
        return
    raise EditError(
        f"{what}: {name!r} feeds graph output {dst!r} straight from {src!r}, which is a graph "
        "input, constant or another output; removing it would leave the output without a node",
        hint="keep the node, or remove the output first",
    )


def replace_op(
    model: onnx.ModelProto,
    node: str,
    op_type: str,
    attributes: Mapping[str, Any] | None = None,
    *,
    domain: str = "",
    keep_attributes: bool = False,
) -> onnx.ModelProto:
    """Change a node's op type (same inputs and outputs) and set its attributes.

    The old attributes are dropped unless `keep_attributes`, since they rarely mean the same
    thing on another op; `attributes` then sets or overrides.
    """
    ix = start(model)
    _, proto = ix.node(node)
    what = f"replace_op {node!r}"
    schema = _check_op(ix, op_type, domain, what)
    old = proto.op_type
    proto.op_type, proto.domain = op_type, domain
    if not keep_attributes:
        del proto.attribute[:]
    elif schema is not None:
        dropped = [a.name for a in proto.attribute if a.name not in schema.attributes]
        if dropped:
            raise EditError(
                f"{what}: {op_type} has no attribute(s) {', '.join(map(repr, dropped))} "
                f"kept from {old}",
                hint="pass keep_attributes=false, or remove them first with set_attributes",
            )
    for key, value in (attributes or {}).items():
        _set_attribute(proto, make_attribute(key, value, schema, what))
    return finish(ix.model, what)


def set_attributes(
    model: onnx.ModelProto,
    node: str,
    attributes: Mapping[str, Any] | None = None,
    *,
    remove: Sequence[str] = (),
) -> onnx.ModelProto:
    """Set (add or overwrite) attributes of a node and delete those named in `remove`."""
    ix = start(model)
    _, proto = ix.node(node)
    what = f"set_attributes {node!r}"
    if not attributes and not remove:
        raise EditError(f"{what}: nothing to do (give attributes and/or remove)")
    present = {a.name for a in proto.attribute}
    missing = [r for r in remove if r not in present]
    if missing:
        raise EditError(
            f"{what}: {proto.op_type} node has no attribute(s) {', '.join(map(repr, missing))} "
            f"to remove (it has: {', '.join(sorted(present)) or 'none'})"
        )
    kept = [a for a in proto.attribute if a.name not in set(remove)]
    del proto.attribute[:]
    proto.attribute.extend(kept)
    schema = _attribute_schema(ix, proto)
    for key, value in (attributes or {}).items():
        _set_attribute(proto, make_attribute(key, value, schema, what))
    return finish(ix.model, what)


def _extra_inputs(
    ix: _Index, inputs: Sequence[Any], owner: str, what: str
) -> tuple[list[str], list[onnx.TensorProto]]:
    """Tensor names for a new node's extra inputs: existing names, "" or new constants."""
    names: list[str] = []
    created: list[onnx.TensorProto] = []
    for j, item in enumerate(inputs, start=1):
        if isinstance(item, str):
            if item:
                ix.require_tensor(item, what)
            names.append(item)
            continue
        value = item.array() if isinstance(item, ConstantInput) else _as_array(item, None, what)
        tensor_name = ix.fresh(f"{owner}_in{j}")
        created.append(numpy_helper.from_array(value, tensor_name))
        names.append(tensor_name)
    return names, created


def _new_node(
    ix: _Index,
    op_type: str,
    domain: str,
    attributes: Mapping[str, Any] | None,
    data: str,
    inputs: Sequence[Any],
    output: str,
    name: str | None,
    what: str,
) -> onnx.NodeProto:
    schema = _check_op(ix, op_type, domain, what)
    node_name = name or ix.fresh(op_type.lower())
    if name and name in {n.name for n in ix.graph.node}:
        raise EditError(f"{what}: a node named {name!r} already exists")
    extra, created = _extra_inputs(ix, inputs, node_name, what)
    ix.graph.initializer.extend(created)
    node = onnx.helper.make_node(op_type, [data, *extra], [output], name=node_name, domain=domain)
    for key, value in (attributes or {}).items():
        node.attribute.append(make_attribute(key, value, schema, what))
    return node


def insert_node_before(
    model: onnx.ModelProto,
    node: str,
    op_type: str,
    attributes: Mapping[str, Any] | None = None,
    inputs: Sequence[Any] = (),
    *,
    input_index: int = 0,
    name: str | None = None,
    domain: str = "",
) -> onnx.ModelProto:
    """Insert `op_type` on one input of `node`: node reads op(x, *inputs) instead of x.

    Only this node sees the change; other consumers of x keep reading x. `inputs` are the new
    node's extra inputs: existing tensor names, "" for an omitted optional input, or constants
    (arrays, lists or `ConstantInput`), which become initializers.
    """
    ix = start(model)
    idx, proto = ix.node(node)
    what = f"insert_node_before {node!r}"
    if not 0 <= input_index < len(proto.input) or not proto.input[input_index]:
        raise EditError(f"{what}: {proto.op_type} node has no input {input_index}")
    x = proto.input[input_index]
    new_name = name or ix.fresh(f"{op_type.lower()}_before_{node}")
    out = ix.fresh(f"{new_name}_out")
    new = _new_node(ix, op_type, domain, attributes, x, inputs, out, new_name, what)
    proto.input[input_index] = out
    ix.graph.node.insert(idx, new)
    return finish(ix.model, what)


def insert_node_after(
    model: onnx.ModelProto,
    node: str,
    op_type: str,
    attributes: Mapping[str, Any] | None = None,
    inputs: Sequence[Any] = (),
    *,
    output_index: int = 0,
    name: str | None = None,
    domain: str = "",
) -> onnx.ModelProto:
    """Insert `op_type` on one output y of `node`: every consumer (and graph output) of y now
    reads op(y, *inputs).

    The new node takes over the name y, so graph outputs keep their names; the node's own
    output is renamed `<y>_pre`.
    """
    ix = start(model)
    idx, proto = ix.node(node)
    what = f"insert_node_after {node!r}"
    if not 0 <= output_index < len(proto.output) or not proto.output[output_index]:
        raise EditError(f"{what}: {proto.op_type} node has no output {output_index}")
    y = proto.output[output_index]
    pre = ix.fresh(f"{y}_pre")
    new_name = name or ix.fresh(f"{op_type.lower()}_after_{node}")
    new = _new_node(ix, op_type, domain, attributes, pre, inputs, y, new_name, what)
    proto.output[output_index] = pre
    ix.graph.node.insert(idx + 1, new)
    return finish(ix.model, what)


# --------------------------------------------------------------------------- tensors and I/O


def rename_tensor(model: onnx.ModelProto, old: str, new: str) -> onnx.ModelProto:
    """Rename a tensor everywhere (producer, consumers, graph inputs/outputs, initializers)."""
    ix = start(model)
    what = f"rename_tensor {old!r}"
    ix.require_tensor(old, what)
    if not new:
        raise EditError(f"{what}: the new name is empty")
    if new in _all_names(ix.model) and new != old:
        raise EditError(f"{what}: the name {new!r} is already used in the model")
    rename_everywhere(ix.graph, old, new)
    return finish(ix.model, what)


def set_input_shape(
    model: onnx.ModelProto, input: str, shape: Sequence[int | str | None]
) -> onnx.ModelProto:
    """Declare a graph input's shape: ints are fixed dims, strings symbolic, None/-1 unknown.

    Unlike `--input-shape` (which only fills dynamic dims), this may change a fixed dim;
    shape inference and the checker then say whether the graph still fits.
    """
    ix = start(model)
    what = f"set_input_shape {input!r}"
    vi = next(
        (i for i in ix.graph.input if i.name == input and i.name not in ix.view.initializers),
        None,
    )
    if vi is None:
        raise EditError(
            f"{what}: no graph input named {input!r}",
            hint=f"inputs: {', '.join(ix.view.graph_inputs) or '(none)'}",
        )
    if not vi.type.HasField("tensor_type"):
        raise EditError(f"{what}: the input is not a tensor")
    dims = vi.type.tensor_type.shape
    dims.ClearField("dim")
    for d in shape:
        dim = dims.dim.add()
        if isinstance(d, str):
            dim.dim_param = d
        elif d is not None and int(d) > 0:
            dim.dim_value = int(d)
        elif d is not None and int(d) not in (0, -1):
            raise EditError(f"{what}: dimension {d} is not valid (use >0, a name, or -1)")
    return finish(ix.model, what)


def add_output(model: onnx.ModelProto, tensor: str) -> onnx.ModelProto:
    """Make an intermediate tensor a graph output too (its type comes from shape inference)."""
    ix = start(model)
    what = f"add_output {tensor!r}"
    ix.require_tensor(tensor, what)
    if ix.is_graph_output(tensor):
        raise EditError(f"{what}: {tensor!r} is already a graph output")
    inferred = load_model(ix.model)
    info = GraphView(inferred).tensor(tensor)
    if info.elem_type == 0:
        raise EditError(f"{what}: the type of {tensor!r} is unknown (shape inference failed)")
    ix.graph.output.append(
        onnx.helper.make_tensor_value_info(
            tensor, info.elem_type, list(info.shape) if info.shape is not None else None
        )
    )
    return finish(ix.model, what)


def remove_output(model: onnx.ModelProto, output: str, *, prune: bool = True) -> onnx.ModelProto:
    """Drop a graph output; with `prune`, nodes and initializers only it needed go too."""
    ix = start(model)
    what = f"remove_output {output!r}"
    outs = ix.view.graph_outputs
    if output not in outs:
        raise EditError(f"{what}: not a graph output (outputs: {', '.join(outs)})")
    if len(outs) == 1:
        raise EditError(f"{what}: it is the model's only output; a graph needs one")
    kept = [o for o in ix.graph.output if o.name != output]
    del ix.graph.output[:]
    ix.graph.output.extend(kept)
    if prune:
        prune_dead(ix.model)
    return finish(ix.model, what)


def prune_dead(model: onnx.ModelProto) -> None:
    """Delete nodes no graph output depends on, and initializers nothing reads (in place)."""
    g = model.graph
    needed = {o.name for o in g.output}
    keep = [False] * len(g.node)
    for k in range(len(g.node) - 1, -1, -1):
        node = g.node[k]
        if any(o in needed for o in node.output):
            keep[k] = True
            needed.update(node_reads(node))
    remove_at(g.node, [k for k, alive in enumerate(keep) if not alive])
    drop_unread_initializers(g, needed)


def replace_initializer(
    model: onnx.ModelProto,
    name: str,
    value: ArrayLike | str | os.PathLike,
    *,
    allow_dtype_change: bool = False,
    allow_shape_change: bool = False,
) -> onnx.ModelProto:
    """Replace the value of an initializer (or a Constant node's output) from an array or .npy.

    The dtype and shape must stay the same unless explicitly allowed: a weight of another
    shape usually means the wrong file.
    """
    ix = start(model)
    what = f"replace_initializer {name!r}"
    array = (
        _load_npy(value, what)
        if isinstance(value, str | os.PathLike)
        else _as_array(value, None, what)
    )
    init = ix.view.initializers.get(name)
    const = None if init is not None else _constant_node_tensor(ix, name)
    target = init if init is not None else const
    if target is None:
        hint = "it is computed at run time" if name in ix.view.producer else None
        raise EditError(f"{what}: no initializer or Constant named {name!r}", hint=hint)
    old_dtype = onnx.helper.tensor_dtype_to_np_dtype(target.data_type)
    old_shape = tuple(target.dims)
    if array.dtype != old_dtype and not allow_dtype_change:
        raise EditError(
            f"{what}: the initializer is {np.dtype(old_dtype)} and the new value is {array.dtype}",
            hint="cast the array, or allow_dtype_change=true",
        )
    if array.shape != old_shape and not allow_shape_change:
        raise EditError(
            f"{what}: the initializer has shape {list(old_shape)} and the new value "
            f"{list(array.shape)}",
            hint="check the file, or allow_shape_change=true",
        )
    target.CopyFrom(numpy_helper.from_array(array, target.name))
    for vi in ix.graph.input:  # old IR: initializers may also be listed as inputs
        if vi.name == name:
            vi.type.CopyFrom(
                onnx.helper.make_tensor_type_proto(target.data_type, list(array.shape))
            )
    return finish(ix.model, what)


def _constant_node_tensor(ix: _Index, name: str) -> onnx.TensorProto | None:
    p = ix.view.producer.get(name)
    if p is None or ix.view.op_types[p] != "Constant":
        return None
    for a in ix.graph.node[p].attribute:
        if a.name == "value":
            return a.t
    return None


def _load_npy(path: str | os.PathLike, what: str) -> np.ndarray:
    p = Path(path)
    if not p.is_file():
        raise EditError(f"{what}: {p}: no such .npy file")
    try:
        array = np.load(p, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise EditError(f"{what}: {p}: not a readable .npy file ({exc})") from None
    if not isinstance(array, np.ndarray):
        raise EditError(f"{what}: {p}: holds several arrays (.npz); save one array as .npy")
    return _as_array(array, None, what)


# --------------------------------------------------------------------------- edit lists


class ConstantInput(BaseModel):
    """A constant input for a new node: a number or nested list, and its dtype."""

    model_config = ConfigDict(extra="forbid")
    value: Any = Field(description="A number or a nested list of numbers.")
    dtype: str = Field("float32", description="numpy dtype name: float32, int64, …")

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, v: str) -> str:
        try:
            _np_dtype(v)
        except EditError as exc:
            raise ValueError(exc.message) from None
        return v

    def array(self) -> np.ndarray:
        return _as_array(self.value, self.dtype, "constant input")


class _Op(BaseModel):
    model_config = ConfigDict(extra="forbid")
    op: str

    def apply(self, model: onnx.ModelProto) -> onnx.ModelProto:
        raise NotImplementedError


class RemoveNode(_Op):
    """Remove a single-data-input, single-output node; consumers read its input."""

    op: Literal["remove_node"]
    node: str

    def apply(self, model: onnx.ModelProto) -> onnx.ModelProto:
        return remove_node(model, self.node)


class BypassNode(_Op):
    """Remove a node; consumers read its input number `input`."""

    op: Literal["bypass_node"]
    node: str
    input: int = Field(0, ge=0, description="Which input the consumers read instead.")

    def apply(self, model: onnx.ModelProto) -> onnx.ModelProto:
        return bypass_node(model, self.node, self.input)


class ReplaceOp(_Op):
    """Change a node's op type and set its attributes."""

    op: Literal["replace_op"]
    node: str
    op_type: str
    attributes: dict[str, Any] = Field(default_factory=dict)
    domain: str = ""
    keep_attributes: bool = False

    def apply(self, model: onnx.ModelProto) -> onnx.ModelProto:
        return replace_op(
            model,
            self.node,
            self.op_type,
            self.attributes,
            domain=self.domain,
            keep_attributes=self.keep_attributes,
        )


class SetAttributes(_Op):
    """Set or remove attributes of a node."""

    op: Literal["set_attributes"]
    node: str
    attributes: dict[str, Any] = Field(default_factory=dict)
    remove: list[str] = Field(default_factory=list)

    def apply(self, model: onnx.ModelProto) -> onnx.ModelProto:
        return set_attributes(model, self.node, self.attributes, remove=self.remove)


class _Insert(_Op):
    node: str
    op_type: str
    attributes: dict[str, Any] = Field(default_factory=dict)
    inputs: list[str | ConstantInput] = Field(
        default_factory=list,
        description='Extra inputs after the data input: tensor names, "" or constants.',
    )
    name: str | None = None
    domain: str = ""


class InsertNodeBefore(_Insert):
    """Insert a node on one input of `node`."""

    op: Literal["insert_node_before"]
    input_index: int = Field(0, ge=0)

    def apply(self, model: onnx.ModelProto) -> onnx.ModelProto:
        return insert_node_before(
            model,
            self.node,
            self.op_type,
            self.attributes,
            self.inputs,
            input_index=self.input_index,
            name=self.name,
            domain=self.domain,
        )


class InsertNodeAfter(_Insert):
    """Insert a node on one output of `node` (all its consumers read the new node)."""

    op: Literal["insert_node_after"]
    output_index: int = Field(0, ge=0)

    def apply(self, model: onnx.ModelProto) -> onnx.ModelProto:
        return insert_node_after(
            model,
            self.node,
            self.op_type,
            self.attributes,
            self.inputs,
            output_index=self.output_index,
            name=self.name,
            domain=self.domain,
        )


class RenameTensor(_Op):
    """Rename a tensor everywhere."""

    op: Literal["rename_tensor"]
    tensor: str
    new_name: str

    def apply(self, model: onnx.ModelProto) -> onnx.ModelProto:
        return rename_tensor(model, self.tensor, self.new_name)


class SetInputShape(_Op):
    """Declare a graph input's shape (ints fixed, strings symbolic, null or -1 unknown)."""

    op: Literal["set_input_shape"]
    input: str
    shape: list[int | str | None]

    def apply(self, model: onnx.ModelProto) -> onnx.ModelProto:
        return set_input_shape(model, self.input, self.shape)


class AddOutput(_Op):
    """Make an intermediate tensor a graph output."""

    op: Literal["add_output"]
    tensor: str

    def apply(self, model: onnx.ModelProto) -> onnx.ModelProto:
        return add_output(model, self.tensor)


class RemoveOutput(_Op):
    """Drop a graph output (and, with prune, what only it needed)."""

    op: Literal["remove_output"]
    output: str
    prune: bool = True

    def apply(self, model: onnx.ModelProto) -> onnx.ModelProto:
        return remove_output(model, self.output, prune=self.prune)


class ReplaceInitializer(_Op):
    """Replace an initializer's value from a .npy file or an inline value."""

    op: Literal["replace_initializer"]
    name: str
    npy: str | None = Field(None, description="Path of a .npy file holding the new value.")
    value: Any = Field(None, description="Inline value (number or nested list) instead of npy.")
    dtype: str | None = Field(None, description="dtype of an inline value; default: the old one.")
    allow_dtype_change: bool = False
    allow_shape_change: bool = False

    def apply(self, model: onnx.ModelProto) -> onnx.ModelProto:
        if (self.npy is None) == (self.value is None):
            raise EditError(f"replace_initializer {self.name!r}: give exactly one of npy or value")
        value: Any = self.npy
        if self.npy is None:
            dtype = self.dtype or _initializer_dtype(model, self.name)
            value = _as_array(self.value, dtype, f"replace_initializer {self.name!r}")
        return replace_initializer(
            model,
            self.name,
            value,
            allow_dtype_change=self.allow_dtype_change,
            allow_shape_change=self.allow_shape_change,
        )


def _initializer_dtype(model: onnx.ModelProto, name: str) -> str | None:
    for t in model.graph.initializer:
        if t.name == name:
            return str(np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type)))
    return None


EditOp = Annotated[
    RemoveNode
    | BypassNode
    | ReplaceOp
    | SetAttributes
    | InsertNodeBefore
    | InsertNodeAfter
    | RenameTensor
    | SetInputShape
    | AddOutput
    | RemoveOutput
    | ReplaceInitializer,
    Field(discriminator="op"),
]
"""One edit as data: `{"op": "remove_node", "node": "X"}` and so on (discriminated by "op")."""

_EDIT_LIST = TypeAdapter(list[EditOp])
EDIT_OPS = (
    "remove_node",
    "bypass_node",
    "replace_op",
    "set_attributes",
    "insert_node_before",
    "insert_node_after",
    "rename_tensor",
    "set_input_shape",
    "add_output",
    "remove_output",
    "replace_initializer",
)


def parse_edits(ops: Sequence[Mapping[str, Any] | BaseModel]) -> list[_Op]:
    """Validate a list of edit dicts; the first problem becomes an EditError naming the edit."""
    if isinstance(ops, Mapping | str | bytes) or not isinstance(ops, Sequence):
        raise EditError("edits must be a list of operations, e.g. [{'op': 'remove_node', ...}]")
    raw = [o.model_dump() if isinstance(o, BaseModel) else o for o in ops]
    try:
        return list(_EDIT_LIST.validate_python(raw))
    except ValidationError as exc:
        raise _edit_validation_error(exc, raw) from None


_UNION_MEMBERS = frozenset({"str", "int", "float", "bool", "none", "ConstantInput"})


def _edit_validation_error(exc: ValidationError, raw: list[Any]) -> EditError:
    """The most telling pydantic error as one line: our own checks beat union type misses."""
    errors = exc.errors()
    first = next((e for e in errors if e["type"] == "value_error"), errors[0])
    loc = list(first["loc"])
    k = loc[0] if loc and isinstance(loc[0], int) else 0
    op = raw[k].get("op") if k < len(raw) and isinstance(raw[k], Mapping) else None
    if first["type"] in ("union_tag_invalid", "union_tag_not_found"):
        return EditError(
            f"edit #{k + 1}: unknown or missing op {op!r}", hint=f"ops: {', '.join(EDIT_OPS)}"
        )
    field = ".".join(str(x) for x in loc[2:] if x not in _UNION_MEMBERS)
    msg = first["msg"].removeprefix("Value error, ")
    return EditError(f"edit #{k + 1} ({op}): {field + ': ' if field else ''}{msg}")


def apply_edits(
    model: onnx.ModelProto, ops: Sequence[Mapping[str, Any] | BaseModel]
) -> onnx.ModelProto:
    """Run a list of edits in order; each must succeed (and pass the checker) for the next.

    Errors name the edit by position and op, e.g. "edit #2 (remove_node): no node named 'x'".
    """
    parsed = parse_edits(ops)
    if not parsed:
        raise EditError("the edit list is empty")
    current = model
    for k, op in enumerate(parsed, start=1):
        try:
            current = op.apply(current)
        except SurgeryError as exc:
            error = EditError(f"edit #{k} ({op.op}): {exc.message}", hint=exc.hint)
            error.code = exc.code  # keep e.g. node_not_found for MCP clients
            raise error from None
    return current


__all__ = [
    "EDIT_OPS",
    "ConstantInput",
    "EditError",
    "EditOp",
    "add_output",
    "apply_edits",
    "bypass_node",
    "insert_node_after",
    "insert_node_before",
    "parse_edits",
    "remove_node",
    "remove_output",
    "rename_tensor",
    "replace_initializer",
    "replace_op",
    "set_attributes",
    "set_input_shape",
]
