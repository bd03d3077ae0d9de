"""Split a model at named tensors, and merge two models back into one.

Splitting is how post-processing comes off the accelerator and how a troublesome region is
edited in isolation; merging puts the pieces back. Both are pure (inputs are never modified),
keep the models' opset, IR version and metadata, and end in shape inference plus the full
ONNX checker. A split that is merged back computes exactly what the original did, which the
tests prove with `verify_models(..., exact=True)`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper

from surgery.coverage import PLACEMENT_METADATA_KEY
from surgery.edit import finish
from surgery.errors import SurgeryError
from surgery.graph import GraphView, node_reads, rename_tensors
from surgery.model import convert_opset, load_model, toposort_nodes

IoMap = Sequence[tuple[str, str]] | Mapping[str, str]


class SplitError(SurgeryError):
    """The requested cut or merge does not make a valid model."""

    code = "split_error"


# --------------------------------------------------------------------------- split


@dataclass
class _Region:
    """The nodes between the cut inputs and the outputs, found by walking back."""

    nodes: list[int]
    initializers: set[str]
    leaks: list[str]
    """Graph inputs outside `inputs` that the region reads (the cut is not closed)."""


def split_model(
    model: onnx.ModelProto,
    inputs: Sequence[str],
    outputs: Sequence[str],
    *,
    name: str | None = None,
) -> onnx.ModelProto:
    """The subgraph computing `outputs` from `inputs`, as a model of its own.

    Initializers and Constant nodes it needs are copied, shapes are inferred, and the opset,
    IR version and metadata are kept. The cut must be closed: if the outputs also depend on a
    tensor that is neither in `inputs` nor a constant (a skip connection around the cut, a
    graph input left out), SplitError names the tensors to add.
    """
    source = load_model(model)
    toposort_nodes(source)
    view = GraphView(source)
    inputs, outputs = list(inputs), list(outputs)
    _check_names(view, inputs, outputs)
    region = _walk_back(view, set(inputs), outputs)
    if inputs and not any(t in outputs or _reads(view, region, t) for t in inputs):
        raise SplitError(
            f"the outputs do not depend on any of the inputs ({', '.join(inputs)}); "
            "are inputs and outputs swapped?"
        )
    if region.leaks:
        raise _open_cut(view, region, set(inputs))
    sub = _build(source, view, region, inputs, outputs, name)
    return finish(sub, "split", SplitError, keep_output_shapes=True)


def _check_names(view: GraphView, inputs: list[str], outputs: list[str]) -> None:
    if not outputs:
        raise SplitError("give at least one output tensor")
    known = set(view.producer) | set(view.graph_inputs)
    for role, names in (("input", inputs), ("output", outputs)):
        seen: set[str] = set()
        for t in names:
            if t in seen:
                raise SplitError(f"{role} {t!r} is listed twice")
            seen.add(t)
            if t in view.initializers:
                raise SplitError(f"{role} {t!r} is an initializer (a constant), not a tensor")
            if t not in known:
                raise SplitError(
                    f"{role} {t!r} is not a tensor of the model",
                    hint="tensor names are node outputs or graph inputs (see `surgery inspect`)",
                )


def _walk_back(view: GraphView, stop: set[str], outputs: Sequence[str]) -> _Region:
    nodes: set[int] = set()
    inits: set[str] = set()
    leaks: list[str] = []
    seen: set[str] = set()
    stack = list(outputs)
    graph_inputs = set(view.graph_inputs)
    while stack:
        t = stack.pop()
        if not t or t in seen:
            continue
        seen.add(t)
        if t in stop:
            continue
        if t in view.initializers:
            inits.add(t)
            continue
        p = view.producer.get(t)
        if p is not None:
            if p not in nodes:
                nodes.add(p)
                stack.extend(node_reads(view.nodes[p]))
        elif t in graph_inputs:
            leaks.append(t)
    return _Region(sorted(nodes), inits, leaks)


def _reads(view: GraphView, region: _Region, tensor: str) -> bool:
    return any(tensor in node_reads(view.nodes[i]) for i in region.nodes)


def _open_cut(view: GraphView, region: _Region, inputs: set[str]) -> SplitError:
    """Name the tensors that cross into the region from outside the cut.

    A node "depends on the cut" if it reads one of `inputs` (transitively) and "leaks" if it
    reads a graph input that is not one. A leaking, non-dependent node's output read by a
    dependent node is exactly a skip connection around the cut.
    """
    members = set(region.nodes)
    dep: dict[int, bool] = {}
    leak: dict[int, bool] = {}
    leaked = set(region.leaks)
    for i in region.nodes:
        reads = node_reads(view.nodes[i])
        producers = [view.producer[t] for t in reads if view.producer.get(t) in members]
        dep[i] = any(t in inputs for t in reads) or any(dep[p] for p in producers)
        leak[i] = any(t in leaked for t in reads) or any(leak[p] for p in producers)
    crossing: list[str] = []
    for i in region.nodes:
        if not dep[i]:
            continue
        for t in node_reads(view.nodes[i]):
            p = view.producer.get(t)
            outside = (p in members and leak[p] and not dep[p]) or t in leaked
            if outside and t not in crossing:
                crossing.append(t)
    crossing = crossing or list(dict.fromkeys(region.leaks))
    shown = ", ".join(map(repr, crossing[:8])) + (" …" if len(crossing) > 8 else "")
    return SplitError(
        f"the cut is not closed: the outputs also need {shown}, "
        f"which {'is' if len(crossing) == 1 else 'are'} not among the inputs",
        hint="add them to the inputs (and to the other part's outputs), or cut elsewhere",
    )


def _build(
    source: onnx.ModelProto,
    view: GraphView,
    region: _Region,
    inputs: list[str],
    outputs: list[str],
    name: str | None,
) -> onnx.ModelProto:
    g = source.graph
    nodes = [g.node[i] for i in region.nodes]
    produced = {t for n in nodes for t in n.output}
    value_infos = [vi for vi in g.value_info if vi.name in produced]
    graph = onnx.helper.make_graph(
        nodes,
        name or f"{g.name or 'model'}_split",
        [_value_info(view, t, "input") for t in inputs],
        [_value_info(view, t, "output") for t in outputs],
        [t for t in g.initializer if t.name in region.initializers],
        value_info=value_infos,
    )
    sub = onnx.ModelProto()
    sub.CopyFrom(_shell(source))
    sub.graph.CopyFrom(graph)
    used = {(n.domain, n.op_type) for n in nodes}
    sub.functions.extend(f for f in source.functions if (f.domain, f.name) in used)
    _keep_pins(sub, {view.names[i] for i in region.nodes}, set(view.names))
    return sub


def _shell(model: onnx.ModelProto) -> onnx.ModelProto:
    """A model with `model`'s header (IR, opsets, producer, metadata) and an empty graph."""
    shell = onnx.ModelProto()
    shell.ir_version = model.ir_version
    shell.opset_import.extend(model.opset_import)
    shell.producer_name = model.producer_name
    shell.producer_version = model.producer_version
    shell.domain = model.domain
    shell.model_version = model.model_version
    shell.doc_string = model.doc_string
    shell.metadata_props.extend(model.metadata_props)
    return shell


def _value_info(view: GraphView, tensor: str, role: str) -> onnx.ValueInfoProto:
    info = view.tensor(tensor)
    if info.elem_type == 0:
        raise SplitError(
            f"{role} {tensor!r} has no known type (shape inference could not determine it)",
            hint="fix dynamic input shapes with --input-shape and try again",
        )
    shape = None if info.shape is None else list(info.shape)
    return onnx.helper.make_tensor_value_info(tensor, info.elem_type, shape)


def _keep_pins(model: onnx.ModelProto, kept: set[str], all_nodes: set[str]) -> None:
    """Placement pins of nodes not in the model are dropped (op-type pins are kept)."""
    for prop in model.metadata_props:
        if prop.key != PLACEMENT_METADATA_KEY:
            continue
        try:
            pins = json.loads(prop.value)
        except json.JSONDecodeError:
            return
        if isinstance(pins, dict):
            pins = {k: v for k, v in pins.items() if k in kept or k not in all_nodes}
            prop.value = json.dumps(pins, sort_keys=True)


# --------------------------------------------------------------------------- merge


def merge_models(
    a: onnx.ModelProto,
    b: onnx.ModelProto,
    io_map: IoMap,
    *,
    prefix: str | None = None,
    keep_outputs: Sequence[str] = (),
    name: str | None = None,
) -> onnx.ModelProto:
    """Connect outputs of `a` to inputs of `b` (`io_map` pairs A_OUT → B_IN) as one model.

    - b's names that collide with a's are prefixed (all of b's names when `prefix` is given;
      otherwise only the colliding ones, with a generated prefix). Identical initializers and
      graph inputs of the same name and type are shared instead.
    - a's outputs consumed by b disappear from the merged outputs unless in `keep_outputs`.
    - opsets and IR version are reconciled to the maximum; a model on a lower default-domain
      opset is converted with onnx.version_converter first.
    """
    pairs = list(io_map.items()) if isinstance(io_map, Mapping) else [tuple(p) for p in io_map]
    ma, mb = load_model(a), load_model(b)
    ma, mb = _reconcile_opsets(ma, mb)
    va, vb = GraphView(ma), GraphView(mb)
    mapping = _check_io_map(va, vb, pairs)
    kept = _check_keep(va, keep_outputs, mapping)
    shared_inputs, shared_inits = _shared(ma, mb, va, vb, set(mapping))
    renames, node_renames = _renames(ma, mb, set(mapping), shared_inputs | shared_inits, prefix)
    gb = onnx.GraphProto()
    gb.CopyFrom(mb.graph)
    rename_tensors(gb, {**renames, **mapping})
    for node in gb.node:
        node.name = node_renames.get(node.name, node.name)
    merged = _shell(ma)
    del merged.opset_import[:]
    merged.opset_import.extend(_max_opsets(ma, mb))
    merged.ir_version = max(ma.ir_version, mb.ir_version)
    _merge_metadata(merged, mb, node_renames)
    consumed = set(mapping.values())
    graph = merged.graph
    graph.name = name or f"{ma.graph.name or 'a'}+{mb.graph.name or 'b'}"
    graph.node.extend(ma.graph.node)
    graph.node.extend(gb.node)
    graph.input.extend(ma.graph.input)
    graph.input.extend(
        i for i in gb.input if i.name not in consumed and i.name not in shared_inputs
    )
    graph.initializer.extend(ma.graph.initializer)
    graph.initializer.extend(t for t in gb.initializer if t.name not in shared_inits)
    outs = [o for o in ma.graph.output if o.name not in consumed or o.name in kept]
    names = {o.name for o in outs}
    outs.extend(o for o in gb.output if o.name not in names)
    graph.output.extend(outs)
    known = {(f.domain, f.name) for f in ma.functions}
    merged.functions.extend(ma.functions)
    merged.functions.extend(f for f in mb.functions if (f.domain, f.name) not in known)
    return finish(merged, "merge", SplitError)


def _reconcile_opsets(
    ma: onnx.ModelProto, mb: onnx.ModelProto
) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    va, vb = _default_opset(ma), _default_opset(mb)
    if va == vb:
        return ma, mb
    target = max(va, vb)
    if va < target:
        return _convert(ma, target, "A"), mb
    return ma, _convert(mb, target, "B")


def _default_opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def _convert(model: onnx.ModelProto, version: int, which: str) -> onnx.ModelProto:
    try:
        converted = convert_opset(model, version)
    except Exception as exc:  # the converter raises bare RuntimeErrors and others
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise SplitError(
            f"model {which} is on opset {_default_opset(model)} and cannot be converted to "
            f"opset {version} to match the other model: {first}",
            hint="convert it yourself (onnx.version_converter) and merge again",
        ) from None
    return load_model(converted)


def _max_opsets(ma: onnx.ModelProto, mb: onnx.ModelProto) -> list[onnx.OperatorSetIdProto]:
    versions: dict[str, int] = {}
    for o in (*ma.opset_import, *mb.opset_import):
        domain = "" if o.domain == "ai.onnx" else o.domain
        versions[domain] = max(versions.get(domain, 0), o.version)
    return [onnx.helper.make_opsetid(d, v) for d, v in versions.items()]


def _check_io_map(va: GraphView, vb: GraphView, pairs: list[tuple[str, str]]) -> dict[str, str]:
    """B input → A output, after checking both ends exist and their types agree."""
    if not pairs:
        raise SplitError("the io map is empty: say which outputs of A feed which inputs of B")
    mapping: dict[str, str] = {}
    for pair in pairs:
        if len(pair) != 2:
            raise SplitError(f"io map entry {pair!r}: expected (A_OUT, B_IN)")
        a_out, b_in = pair
        if a_out not in va.graph_outputs:
            raise SplitError(
                f"{a_out!r} is not an output of model A",
                hint=f"A's outputs: {', '.join(va.graph_outputs)}",
            )
        if b_in not in vb.graph_inputs:
            raise SplitError(
                f"{b_in!r} is not an input of model B",
                hint=f"B's inputs: {', '.join(vb.graph_inputs)}",
            )
        if b_in in mapping:
            raise SplitError(f"input {b_in!r} of B is mapped twice")
        ta, tb = va.tensor(a_out), vb.tensor(b_in)
        if ta.elem_type and tb.elem_type and ta.elem_type != tb.elem_type:
            raise SplitError(
                f"{a_out!r} of A is {ta.dtype} but {b_in!r} of B is {tb.dtype}",
                hint="insert a Cast (surgery edit) on one side",
            )
        if ta.is_static and tb.is_static and ta.shape != tb.shape:
            raise SplitError(
                f"{a_out!r} of A has shape {list(ta.shape)} but {b_in!r} of B expects "
                f"{list(tb.shape)}"
            )
        mapping[b_in] = a_out
    return mapping


def _check_keep(va: GraphView, keep: Iterable[str], mapping: Mapping[str, str]) -> set[str]:
    kept = set(keep)
    bad = sorted(kept - set(va.graph_outputs))
    if bad:
        raise SplitError(
            f"keep_outputs names {', '.join(map(repr, bad))}, which are not outputs of model A"
        )
    return kept


def _shared(
    ma: onnx.ModelProto,
    mb: onnx.ModelProto,
    va: GraphView,
    vb: GraphView,
    mapped: set[str],
) -> tuple[set[str], set[str]]:
    """B's graph inputs that are also A's (same type) and identical initializers: shared."""
    inputs = {
        t
        for t in set(vb.graph_inputs) - mapped
        if t in va.graph_inputs and va.tensor(t) == vb.tensor(t)
    }
    inits = {
        name
        for name, tb in vb.initializers.items()
        if name in va.initializers and _same_tensor(va.initializers[name], tb)
    }
    return inputs, inits


def _same_tensor(x: onnx.TensorProto, y: onnx.TensorProto) -> bool:
    if x.data_type != y.data_type or list(x.dims) != list(y.dims):
        return False
    return np.array_equal(numpy_helper.to_array(x), numpy_helper.to_array(y), equal_nan=True)


def _names(model: onnx.ModelProto) -> tuple[set[str], set[str]]:
    """(tensor names, node names) of the top graph."""
    g = model.graph
    tensors = {t for n in g.node for t in (*n.input, *n.output)}
    tensors.update(t.name for t in g.initializer)
    tensors.update(v.name for v in (*g.input, *g.output))
    tensors.discard("")
    return tensors, {n.name for n in g.node if n.name}


def _renames(
    ma: onnx.ModelProto,
    mb: onnx.ModelProto,
    mapped: set[str],
    shared: set[str],
    prefix: str | None,
) -> tuple[dict[str, str], dict[str, str]]:
    """Tensor and node renames for B: everything with `prefix`, else only collisions."""
    a_tensors, a_nodes = _names(ma)
    b_tensors, b_nodes = _names(mb)
    b_tensors -= mapped | shared
    if prefix is not None:
        tensors, nodes = b_tensors, b_nodes
    else:
        tensors, nodes = b_tensors & a_tensors, b_nodes & a_nodes
        if not tensors and not nodes:
            return {}, {}
        prefix = _free_prefix(a_tensors | a_nodes | b_tensors | b_nodes, tensors | nodes)
    taken = (a_tensors | a_nodes) - tensors - nodes
    clash = sorted(n for n in tensors | nodes if prefix + n in taken)
    if clash:
        raise SplitError(
            f"prefix {prefix!r} makes B's {clash[0]!r} collide with a name in A",
            hint="choose another prefix",
        )
    return {t: prefix + t for t in tensors}, {n: prefix + n for n in nodes}


def _free_prefix(taken: set[str], renamed: set[str]) -> str:
    k = 0
    while True:
        prefix = "b_" if k == 0 else f"b{k}_"
        if not any(prefix + n in taken for n in renamed):
            return prefix
        k += 1


def _merge_metadata(
    merged: onnx.ModelProto, mb: onnx.ModelProto, node_renames: Mapping[str, str]
) -> None:
    """A's metadata wins; B adds its own keys, and its placement pins follow B's renames."""
    props = {p.key: p.value for p in merged.metadata_props}
    for p in mb.metadata_props:
        if p.key == PLACEMENT_METADATA_KEY:
            props[p.key] = _merge_pins(props.get(p.key), p.value, node_renames)
        elif p.key not in props:
            props[p.key] = p.value
    del merged.metadata_props[:]
    onnx.helper.set_model_props(merged, props)


def _merge_pins(a: str | None, b: str, renames: Mapping[str, str]) -> str:
    try:
        pins_a = json.loads(a) if a else {}
        pins_b = json.loads(b)
    except json.JSONDecodeError:
        return a or b
    if not isinstance(pins_a, dict) or not isinstance(pins_b, dict):
        return a or b
    merged = dict(pins_a)
    merged.update({renames.get(k, k): v for k, v in pins_b.items()})
    return json.dumps(merged, sort_keys=True)


__all__ = ["SplitError", "merge_models", "split_model"]
