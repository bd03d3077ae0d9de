"""Loading, validating, shape-inferring and saving ONNX models.

`load_model` never modifies the user's file or the ModelProto passed in: it works on a copy.
Structural problems (truncated protobuf, cycles, dangling tensors, unknown domains) become
typed `SurgeryError`s that name the file, node and tensor.
"""

from __future__ import annotations

import logging
import math
import numbers
import os
import re
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import NoReturn

import onnx
from google.protobuf.message import DecodeError
from onnx import helper, shape_inference

from surgery.errors import (
    InvalidGraphError,
    ModelFormatError,
    ModelNotFoundError,
    ShapeError,
    SurgeryError,
    UnknownDomainError,
    first_line,
)
from surgery.graph import (
    DEFAULT_DOMAINS,
    SUBGRAPH_OPS,
    GraphView,
    default_opset,
    remove_where,
    shape_from_type,
    shape_text,
    topological_order,
)
from surgery.schema_check import check_node_counts
from surgery.targets import CONTRIB_OPS

log = logging.getLogger(__name__)

PROTOBUF_LIMIT = 2**31 - 1
STANDARD_DOMAINS = frozenset({"", "ai.onnx", "ai.onnx.ml", "ai.onnx.preview.training"})
_STRIP_BYTES = 4096  # weights larger than this are hidden from shape inference (speed, >2 GB)
_HIDE_WEIGHTS_FROM_BYTES = 2 * 2**20
"""Model files smaller than this are shape-inferred with their weights in place: finding the
weights to hide costs microseconds per tensor in Python, more than serialising them all."""

InputShapes = Mapping[str, Sequence[int]]


MAX_DIM = 2**63
"""ONNX dims are int64."""


def parse_input_shapes(specs: Sequence[str]) -> dict[str, list[int]]:
    """Parse CLI `NAME=1,3,640,640` strings (also `NAME=1x3x640x640`)."""
    shapes: dict[str, list[int]] = {}
    for spec in specs:
        name, sep, dims = spec.rpartition("=")
        if not sep or not name or not dims:
            raise ShapeError(
                f"--input-shape {spec!r}: expected NAME=D1,D2,… (e.g. images=1,3,640,640)"
            )
        try:
            values = [int(d) for d in dims.replace("x", ",").split(",") if d.strip()]
        except ValueError:
            raise ShapeError(f"--input-shape {spec!r}: dimensions must be integers") from None
        if not values or any(not 0 < v < MAX_DIM for v in values):
            raise ShapeError(
                f"--input-shape {spec!r}: dimensions must be positive integers below 2**63"
            )
        if name in shapes and shapes[name] != values:
            raise ShapeError(
                f"--input-shape {spec!r}: {name!r} is given twice, as "
                f"{','.join(map(str, shapes[name]))} and {','.join(map(str, values))}"
            )
        shapes[name] = values
    return shapes


def input_shape_specs(shapes: Mapping[str, Sequence[int]]) -> list[str]:
    """`shapes` as --input-shape values ("images=1,3,640,640"): what `parse_input_shapes`
    reads."""
    return [f"{name}={','.join(map(str, dims))}" for name, dims in shapes.items()]


def recorded_input_shapes(
    model: onnx.ModelProto, dynamic: Mapping[str, Sequence | None]
) -> dict[str, list[int]]:
    """Concrete shapes for the dynamic image inputs (NCHW, static channels) from the size the
    exporter recorded in the metadata: `imgsz` ("[H, W]" or "S") and `batch` (default 1), as
    Ultralytics writes them. Empty when the metadata records no size. A suggestion for
    --input-shape, never applied on its own."""
    meta = {p.key: p.value for p in model.metadata_props}
    size = [int(v) for v in re.findall(r"\d+", meta.get("imgsz", ""))]
    if len(size) == 1:
        size *= 2
    batch = int(meta["batch"]) if meta.get("batch", "").isdigit() else 1
    if len(size) != 2 or min(size) < 1 or batch < 1:
        return {}
    shapes: dict[str, list[int]] = {}
    for name, dims in dynamic.items():
        if dims is None or len(dims) != 4 or not isinstance(dims[1], int) or dims[1] < 1:
            continue
        recorded = [batch, dims[1], *size]
        shapes[name] = [
            d if isinstance(d, int) and d > 0 else r for d, r in zip(dims, recorded, strict=True)
        ]
    return shapes


def read_model(
    source: str | os.PathLike | onnx.ModelProto, *, owned: bool = False
) -> onnx.ModelProto:
    """Read a model from disk (with external data) or copy a ModelProto; no validation.
    `owned`: the caller hands the ModelProto over (one it made), and it is used as it is."""
    if isinstance(source, onnx.ModelProto):
        if owned:
            return source
        copy = onnx.ModelProto()
        copy.CopyFrom(source)
        _forget_invalid_dims(copy)  # as for a file: the proto may be an exporter's, unsaved
        return copy
    if not isinstance(source, str | os.PathLike):
        raise ModelFormatError(
            f"expected an .onnx path or an onnx.ModelProto, got {type(source).__name__}"
        )
    path = Path(source)
    if not path.is_file():
        _raise_not_a_file(path)
    try:
        model = onnx.load(str(path), load_external_data=False)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise ModelFormatError(f"{path}: not a valid ONNX protobuf ({first_line(exc)})") from None
    except OSError as exc:
        raise ModelNotFoundError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if model.graph is None or (not model.graph.node and not model.graph.output):
        raise ModelFormatError(f"{path}: not an ONNX model (no graph, nodes or outputs)")
    _forget_invalid_dims(model)
    if _uses_external_data(model):
        try:
            onnx.external_data_helper.load_external_data_for_model(model, str(path.parent))
        except (OSError, ValueError, onnx.checker.ValidationError) as exc:
            raise ModelFormatError(
                f"{path}: external data cannot be loaded: {first_line(exc)}",
                hint="keep the model's data file(s) beside it as regular files: onnx reads "
                "no missing file and no symbolic link",
            ) from None
    return model


def _raise_not_a_file(path: Path) -> NoReturn:
    if not path.exists():
        raise ModelNotFoundError(f"{path}: no such file")
    if path.is_dir():
        raise ModelNotFoundError(f"{path}: is a directory, expected an .onnx file")
    # a FIFO or a device: reading it could block for ever
    raise ModelNotFoundError(f"{path}: not a regular file, expected an .onnx file")


def load_model(
    source: str | os.PathLike | onnx.ModelProto,
    input_shapes: InputShapes | None = None,
    *,
    infer_shapes: bool = True,
) -> onnx.ModelProto:
    """Read, validate and shape-infer a model; `input_shapes` fixes dynamic input dimensions."""
    return open_model(source, input_shapes, infer_shapes=infer_shapes)[0]


def open_model(
    source: str | os.PathLike | onnx.ModelProto,
    input_shapes: InputShapes | None = None,
    *,
    infer_shapes: bool = True,
    owned: bool = False,
    reuse_static_shapes: bool = False,
) -> tuple[onnx.ModelProto, GraphView]:
    """`load_model` plus the GraphView built while validating (analyses reuse it). `owned`
    (`read_model`): a ModelProto the caller made and hands over is not copied first.
    `reuse_static_shapes`: where the model's value_info already gives every tensor a dtype
    and a static shape (a QDQ model's float view keeps the shapes inferred for the QDQ
    model), inference could find nothing more, and is not run again."""
    model = read_model(source, owned=owned)
    label = model_label(source)
    view = validate_graph(model, label)
    if input_shapes:
        set_input_shapes(model, input_shapes)
    if reuse_static_shapes and not input_shapes and _every_tensor_static(view):
        return model, view
    if infer_shapes:
        try:
            model = _shape_inferred(model, label, view, _worth_hiding_weights(source, model))
        except _InvalidNode as invalid:
            raise _refusal(invalid, label, shapes_set=bool(input_shapes)) from None
        view.rebind(model)
        if input_shapes:
            refuse_impossible_reshapes(view, label)
    else:
        view.reload_value_info()
    return model, view


def _every_tensor_static(view: GraphView) -> bool:
    """Whether every graph input and node output has a known dtype and a static shape in the
    model as stored (the view's value infos are reloaded to read them)."""
    view.reload_value_info()
    tensor = view.tensor
    return all(
        (info := tensor(t)).elem_type and info.is_static
        for t in (*view.graph_inputs, *(t for outs in view.node_outputs for t in outs if t))
    )


def refuse_impossible_reshapes(view: GraphView, label: str = "model") -> None:
    """A ShapeError when, at the model's input shapes, a Reshape would get a different number of values
    than its target shape holds: the model cannot run at those shapes. Shape inference does
    not check this (it takes the target shape as the output's), so `check` counted segments of
    a model ONNX Runtime then refused to run. The usual cause is an export that traced a size
    as a constant: torch's TorchScript exporter writes nn.MultiheadAttention's head reshape
    with the sequence length it saw, so a recogniser exported at width 128 with a dynamic
    width axis runs at 128 only. Tensors that are graph outputs are left out (their declared
    shape may be the export's, not the inferred one)."""
    if "Reshape" not in view.op_types:
        return
    outputs = {o.name for o in view.model.graph.output}
    for k, op in enumerate(view.op_types):
        ins, outs = view.node_inputs[k], view.node_outputs[k]
        if op != "Reshape" or view.domains[k] not in DEFAULT_DOMAINS or not ins or not outs:
            continue
        if outs[0] in outputs:
            continue
        node = view.nodes[k]
        src, dst = view.tensor(ins[0]), view.tensor(outs[0])
        if not (src.is_static and dst.is_static) or src.shape is None or dst.shape is None:
            continue
        have, want = math.prod(map(int, src.shape)), math.prod(map(int, dst.shape))
        if have and want and have != want:
            given = ", ".join(
                f"{t.name}={list(t.shape or ())}" for t in map(view.tensor, view.graph_inputs)
            )
            raise ShapeError(
                f"{label}: the model cannot run at input shape {given}: Reshape "
                f"{node.name or node.output[0]!r} gets {list(src.shape)} ({have} values) and "
                f"makes {list(dst.shape)} ({want}); a size in its target shape was fixed at "
                "export (a traced constant): use the export's input shape, or export again"
            )


def model_label(source: str | os.PathLike | onnx.ModelProto) -> str:
    """How errors name a model: its path, or a ModelProto's graph name."""
    if isinstance(source, onnx.ModelProto):
        return source.graph.name or "model"
    return str(source)


def _worth_hiding_weights(
    source: str | os.PathLike | onnx.ModelProto, model: onnx.ModelProto
) -> bool:
    """Whether to hide large weights from the shape inferencer: unless `source` is a small,
    self-contained file (a ModelProto's size is unknown without serialising it)."""
    if isinstance(source, onnx.ModelProto) or _uses_external_data(model):
        return True
    return Path(source).stat().st_size >= _HIDE_WEIGHTS_FROM_BYTES


def outputs_as_inferred(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[str]]:
    """A shape-inferred copy of `model` whose graph outputs take the inferred shape where it
    contradicts the declared one (another rank, or another fixed size), and the names of those
    outputs. Exporters can declare a wrong output shape (a CRNN whose [T, 1, classes] logits
    are declared [1, seqlen]) that ONNX Runtime ignores and that only surfaces once folding
    lets inference reach the output; the full checker then rejects the model."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    declared = {o.name: onnx.TypeProto() for o in copy.graph.output}
    for out in copy.graph.output:
        declared[out.name].CopyFrom(out.type)
        if out.type.HasField("tensor_type"):
            out.type.tensor_type.ClearField("shape")
    inferred = load_model(copy)
    repaired = []
    for out in inferred.graph.output:
        before = declared[out.name]
        if _shapes_contradict(before, out.type):
            repaired.append(out.name)
        else:
            out.type.CopyFrom(before)
    return inferred, repaired


def _shapes_contradict(declared: onnx.TypeProto, inferred: onnx.TypeProto) -> bool:
    """Whether both types have a shape and the shapes differ in rank or in a fixed size."""
    a, b = declared.tensor_type, inferred.tensor_type
    if not (a.HasField("shape") and b.HasField("shape")):
        return False
    if len(a.shape.dim) != len(b.shape.dim):
        return True
    return any(
        x.HasField("dim_value") and y.HasField("dim_value") and x.dim_value != y.dim_value
        for x, y in zip(a.shape.dim, b.shape.dim, strict=True)
    )


def validate_graph(model: onnx.ModelProto, label: str = "model") -> GraphView:
    """Raise a typed error for unknown domains, dangling tensors or cycles in the top graph."""
    declared = {o.domain for o in model.opset_import}
    if not any(d in ("", "ai.onnx") for d in declared):
        raise InvalidGraphError(f"{label}: no default-domain opset in opset_import")
    _check_versions(model, label)
    if not model.graph.output:
        raise InvalidGraphError(f"{label}: the graph has no outputs, so it computes nothing")
    view = GraphView(model)
    if not set(view.domains) <= STANDARD_DOMAINS | declared:
        _raise_unknown_domain(view, declared, label)
    _check_unique_names(model, view, label)
    produced = view.producer
    # Outputs are rarely omitted (""): count them only when the cheap count disagrees.
    if len(produced) != sum(map(len, view.node_outputs)) and len(produced) != sum(
        1 for outs in view.node_outputs for o in outs if o
    ):
        _raise_produced_twice(view, label)
    # Graph inputs that are also initializers are in `available` through the initializers.
    available = {*view.graph_inputs, *view.initializers, ""}
    read = view.consumers.keys()  # every non-empty input of a node
    if read - available - produced.keys() or set(view.graph_outputs).difference(
        available, produced
    ):
        _raise_dangling(view, available, label)
    check_node_counts(model, view, label)
    _check_acyclic(view, label)
    return view


def _check_unique_names(model: onnx.ModelProto, view: GraphView, label: str) -> None:
    """Two initializers or two graph inputs of one name: which one a reader takes is up to it
    (ONNX Runtime refuses the model). The view's initializer index has one entry per name, so
    the names are only listed when the counts differ."""
    g = model.graph
    inputs = [i.name for i in g.input]
    for kind, unique, protos in (
        ("initializer", len(view.initializers), g.initializer),
        ("graph input", len(set(inputs)), g.input),
    ):
        if unique != len(protos):
            names = [p.name for p in protos]
            twice = next(n for n in names if names.count(n) > 1)
            raise InvalidGraphError(f"{label}: two {kind}s are named {twice!r}")


def _check_versions(model: onnx.ModelProto, label: str) -> None:
    """A model newer than the installed onnx cannot be read reliably (its ops may not exist)."""
    newest_opset = onnx.defs.onnx_opset_version()
    opset = default_opset(model)
    if opset < 1:
        raise InvalidGraphError(
            f"{label}: opset {opset} is not an ONNX opset (the default domain's start at 1)",
            hint="set the model's opset_import to the opset it was exported for",
        )
    if opset > newest_opset:
        raise InvalidGraphError(
            f"{label}: opset {opset} is newer than this onnx {onnx.__version__} knows "
            f"(up to {newest_opset})",
            hint="convert it to an older opset, or upgrade onnx",
        )
    if model.ir_version > onnx.IR_VERSION:
        raise InvalidGraphError(
            f"{label}: IR version {model.ir_version} is newer than this onnx "
            f"{onnx.__version__} reads (up to {onnx.IR_VERSION})"
        )


def _raise_unknown_domain(view: GraphView, declared: set[str], label: str) -> None:
    for idx, domain in enumerate(view.domains):
        if domain and domain not in STANDARD_DOMAINS and domain not in declared:
            raise UnknownDomainError(
                f"{label}: node {view.names[idx]!r} ({view.op_types[idx]}) uses domain {domain!r}, "
                "which the model's opset_import does not declare"
            )


def _raise_produced_twice(view: GraphView, label: str) -> None:
    seen: dict[str, int] = {}
    for idx, outs in enumerate(view.node_outputs):
        for out in outs:
            if out and out in seen:
                raise InvalidGraphError(
                    f"{label}: tensor {out!r} is produced twice (nodes "
                    f"{view.names[seen[out]]!r} and {view.names[idx]!r})"
                )
            seen[out] = idx


def _raise_dangling(view: GraphView, available: set[str], label: str) -> None:
    """The first node input or graph output that nothing provides, as a typed error."""
    produced = view.producer
    for idx, ins in enumerate(view.node_reads):
        for inp in ins:
            if inp not in produced and inp not in available:
                raise InvalidGraphError(
                    f"{label}: node {view.names[idx]!r} ({view.op_types[idx]}) reads tensor "
                    f"{inp!r}, which no node, graph input or initializer provides "
                    "(missing initializer?)"
                )
    for out in view.graph_outputs:
        if out not in available and out not in produced:
            raise InvalidGraphError(f"{label}: graph output {out!r} is not produced by any node")


def _check_acyclic(view: GraphView, label: str) -> None:
    if view.is_sorted:
        return  # the common case
    n = len(view.nodes)
    producer = view.producer
    indegree = [0] * n
    users: list[list[int]] = [[] for _ in range(n)]
    for idx, ins in enumerate(view.node_reads):
        for inp in set(ins):
            p = producer.get(inp)
            if p is not None:
                indegree[idx] += 1
                users[p].append(idx)
    ready = [i for i in range(n) if indegree[i] == 0]
    seen = 0
    while ready:
        i = ready.pop()
        seen += 1
        for u in users[i]:
            indegree[u] -= 1
            if indegree[u] == 0:
                ready.append(u)
    if seen != n:
        stuck = [view.names[i] for i in range(n) if indegree[i] > 0]
        raise InvalidGraphError(
            f"{label}: the graph has a cycle through {len(stuck)} node(s): {', '.join(stuck[:8])}"
            + (" …" if len(stuck) > 8 else "")
        )


def toposort_nodes(model: onnx.ModelProto) -> None:
    """Reorder the top-level graph's nodes topologically (stable for already sorted graphs).

    A control-flow node depends on the outer tensors its bodies read as well as on its inputs
    (`topological_order`): a Keras LSTM's Loop reads the sequence only from inside its body,
    and sorting by inputs alone put the Loop first."""
    g = model.graph
    n = len(g.node)
    order = topological_order(g.node)
    if order is None:
        raise InvalidGraphError("the graph has a cycle")
    if order != list(range(n)):
        nodes = [onnx.NodeProto() for _ in range(n)]
        for new, old in enumerate(order):
            nodes[new].CopyFrom(g.node[old])
        del g.node[:]
        g.node.extend(nodes)


def set_input_shapes(model: onnx.ModelProto, input_shapes: InputShapes) -> None:
    """Replace the declared shapes of graph inputs (in place on our copy)."""
    inits = {t.name for t in model.graph.initializer}
    inputs = {i.name: i for i in model.graph.input if i.name not in inits}
    for name, dims in input_shapes.items():
        vi = inputs.get(name)
        if vi is None:
            raise ShapeError(
                f"--input-shape names {name!r}, but the model's inputs are: {', '.join(inputs) or '(none)'}"
            )
        bad = [d for d in dims if not isinstance(d, numbers.Integral) or not 0 < d < MAX_DIM]
        if bad:
            raise ShapeError(
                f"input {name!r}: dims {list(dims)} must be positive integers below 2**63 "
                f"(got {bad[0]!r})"
            )
        shape = vi.type.tensor_type.shape
        if len(shape.dim) and len(shape.dim) != len(dims):
            raise ShapeError(
                f"input {name!r} has rank {len(shape.dim)}; --input-shape gives {len(dims)} dims {list(dims)}"
            )
        for i, (old, new) in enumerate(zip(shape.dim, dims, strict=False)):
            if old.HasField("dim_value") and old.dim_value > 0 and old.dim_value != new:
                raise ShapeError(
                    f"input {name!r} dim {i} is fixed at {old.dim_value}; cannot set it to {new}"
                )
        shape.ClearField("dim")
        for d in dims:
            shape.dim.add().dim_value = int(d)
    # Stale intermediate shapes would contradict the new input shapes.
    del model.graph.value_info[:]


def infer_model_shapes(
    model: onnx.ModelProto,
    label: str = "model",
    view: GraphView | None = None,
    refuse_invalid: bool = False,
) -> None:
    """Shape inference with data propagation, in place: the inferencer sees `model` without
    its large weights (`_run_inferencer`), and its value_info and the output shapes it found
    are copied into `model`. `refuse_invalid`: see `_run_inferencer`."""
    inferred = _run_inferencer(model, label, view, refuse_invalid=refuse_invalid)
    del model.graph.value_info[:]
    model.graph.value_info.extend(inferred.graph.value_info)
    by_name = {o.name: o for o in inferred.graph.output}
    for out in model.graph.output:
        new = by_name.get(out.name)
        if new is not None and new.type.tensor_type.HasField("shape"):
            out.type.CopyFrom(new.type)


def _run_inferencer(
    model: onnx.ModelProto,
    label: str,
    view: GraphView | None,
    hide_weights: bool = True,
    refuse_invalid: bool = False,
) -> onnx.ModelProto:
    """The C++ inferencer's output for `model`, which it leaves as it is; with `hide_weights`,
    for a copy without its large weights (`_weightless_copy`: they never affect shapes,
    serialising them dominates the time, and it keeps models over 2 GB inferrable), whose
    output has them empty. A failure is a ShapeError; with `refuse_invalid`, a node ONNX's
    inference finds invalid (as ONNX Runtime's load does) is `_InvalidNode`, where otherwise
    its outputs would only stay unshaped."""
    source = _weightless_copy(model, view) if hide_weights else model
    try:
        return infer_shapes_through_contrib_ops(
            source,
            domains=view.domains if view is not None else None,
            op_types=view.op_types if view is not None else None,
            refuse_invalid=refuse_invalid,
        )
    except _InvalidNode:
        raise  # open_model words it, knowing the input shapes it set
    except Exception as exc:  # onnx raises several unrelated types here
        raise ShapeError(f"{label}: shape inference failed: {first_line(exc)}") from None


def infer_shapes_through_contrib_ops(
    model: onnx.ModelProto,
    domains: Iterable[str] | None = None,
    op_types: Iterable[str] | None = None,
    *,
    refuse_invalid: bool = False,
) -> onnx.ModelProto:
    """ONNX shape inference (with data propagation) carried through the contrib ops of
    `CONTRIB_OPS`, returning the inferred copy.

    onnx has no schema for ONNX Runtime's contrib ops (QuickGelu), so their outputs stay
    untyped and everything after them has an unknown rank: `surgery check` would block the
    rest of the network and the quantizer and compiler would see no shapes. Those ops are
    unary and elementwise, so each untyped output takes its input's type and inference runs
    again from there, until no contrib output is left untyped. The one place this is done:
    loading, `fix`, the quantizer and the compiler's partition all infer through here.
    `domains` (the nodes' domains, when the caller has them) skips the scan for models without
    a contrib op, and `op_types` (their op types) the one for models without control flow
    (`_with_original_subgraphs`): `surgery check` infers every model through here.
    `refuse_invalid`: see `_inferred_over_recorded_shapes`.
    """
    inferred = _inferred_over_recorded_shapes(model, refuse_invalid)
    present = set(domains) if domains is not None else {n.domain for n in model.graph.node}
    if not present.isdisjoint(CONTRIB_OPS):
        while _type_contrib_outputs(inferred):
            inferred = shape_inference.infer_shapes(
                inferred, check_type=False, strict_mode=False, data_prop=True
            )
    if op_types is not None and SUBGRAPH_OPS.isdisjoint(op_types):
        return inferred
    return _with_original_subgraphs(model, inferred)


def _inferred_over_recorded_shapes(
    model: onnx.ModelProto, refuse_invalid: bool = False
) -> onnx.ModelProto:
    """Shape inference where a shape the model records (value_info) contradicts what its graph
    computes: the computed shape wins, as in ONNX Runtime ("falling back to lenient merge").

    onnx's lenient inference keeps the recorded shape instead, so a model whose input size was
    edited without clearing its value_info kept the old sizes: check counted the MACs of the
    old input, and the compiler lowered convolutions for it. Strict inference finds such a
    contradiction at no extra cost (its result is the lenient one's, byte for byte, on 178 real
    models); then the intermediate shapes are inferred again without the recorded ones, but
    those of nodes onnx has no schema for. Graph outputs keep their declared shapes (the
    model's interface, read as before), and any other strict failure infers leniently, but,
    with `refuse_invalid`, a node the inference finds invalid as ONNX Runtime's load does (a
    Softmax axis out of range, Split sizes that do not add up): then `_InvalidNode`.
    """
    try:
        return shape_inference.infer_shapes(
            model, check_type=False, strict_mode=True, data_prop=True
        )
    except shape_inference.InferenceError as exc:
        # A graph output's declared shape is its interface (kept, as before); value_info is not
        if _CONTRADICTION in str(exc) and model.graph.value_info:
            log.warning(
                "%s: its recorded shapes contradict its graph (%s); they are inferred again",
                model.graph.name or "model",
                _first_inference_error(exc),
            )
            model = _without_recorded_shapes(model)
        elif refuse_invalid and not any(c in str(exc) for c in _RECORDED_CONTRADICTIONS):
            _raise_invalid_node(model, exc)
    return shape_inference.infer_shapes(model, check_type=False, strict_mode=False, data_prop=True)


_CONTRADICTION = "Inferred shape and existing shape differ"
_RECORDED_CONTRADICTIONS = (_CONTRADICTION, "Inferred elem type differs from existing elem type")
_NODE_FAILURE = re.compile(
    r"\(op_type:(?P<op>[^,]*), node name: (?P<node>.*?)\): \[\w+\] (?P<message>[^\n]*)"
)


class _InvalidNode(Exception):
    """A node ONNX's shape inference finds invalid, raised inside inference; `open_model`
    makes it a ShapeError that names the model (`_refusal`). `inputs`: the input shapes
    inference saw."""

    def __init__(self, node: str, op_type: str, message: str, inputs: str) -> None:
        super().__init__(message)
        self.node, self.op_type, self.message, self.inputs = node, op_type, message, inputs


def _raise_invalid_node(model: onnx.ModelProto, exc: Exception) -> None:
    """`_InvalidNode` for the first node of a strict inference failure that ONNX Runtime
    cannot run either: an op onnx has a schema for, failing without data propagation (which
    ONNX Runtime does not run: a failure only there leaves the lenient result, as before)."""
    if not _names_a_schema_op(exc):
        return
    try:
        shape_inference.infer_shapes(model, check_type=False, strict_mode=True, data_prop=False)
    except shape_inference.InferenceError as without_propagation:
        found = _names_a_schema_op(without_propagation)  # the node ONNX Runtime would see
        if found is None:
            return
        weights = {t.name for t in model.graph.initializer}
        inputs = ", ".join(
            f"{i.name}={shape_text(shape_from_type(i.type)[1])}"
            for i in model.graph.input
            if i.name not in weights
        )
        message = found["message"].strip()
        raise _InvalidNode(found["node"], found["op"], message, inputs) from None


def _names_a_schema_op(exc: Exception) -> re.Match[str] | None:
    """The failing node of an inference error, when it is an op onnx has a schema for."""
    found = _NODE_FAILURE.search(str(exc))
    return found if found is not None and onnx.defs.has(found["op"]) else None


def _refusal(invalid: _InvalidNode, label: str, *, shapes_set: bool) -> ShapeError:
    """The ShapeError for a node shape inference finds invalid, at the input shapes it saw
    (`shapes_set`: the caller's --input-shape, not the model's own)."""
    where = f"node {invalid.node!r} ({invalid.op_type})" if invalid.node else invalid.op_type
    at = f" (at input shape {invalid.inputs})" if invalid.inputs else ""
    hint = (
        "ONNX Runtime cannot run it at that shape either: use a shape the model takes"
        if shapes_set
        else "ONNX Runtime cannot run it either: re-export the model"
    )
    return ShapeError(f"{label}: {where}: {invalid.message}{at}", hint=hint)


def _first_inference_error(exc: Exception) -> str:
    text = str(exc)
    start = text.find("(op_type:")
    return text[start:].splitlines()[0][:200] if start >= 0 else first_line(exc)


def _without_recorded_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy whose value_info keeps only the outputs of nodes without an onnx schema (custom
    ops, whose shapes nothing else gives)."""
    unknown = {
        out
        for node in model.graph.node
        if not onnx.defs.has(node.op_type, node.domain)
        for out in node.output
    }
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    remove_where(copy.graph.value_info, lambda info: info.name not in unknown)
    return copy


_GRAPH_ATTRIBUTES = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)


def _with_original_subgraphs(model: onnx.ModelProto, inferred: onnx.ModelProto) -> onnx.ModelProto:
    """`inferred` with the control-flow bodies (If branches, Loop and Scan bodies) of `model`.

    onnx's data propagation keys the values it propagates by tensor name across subgraphs, so
    when two branches of an If reuse names (Optimum's merged decoder: both branches are exports
    of one module) one branch's propagated shapes land in the other's value_info and outputs;
    ONNX Runtime then refuses the model ("Incompatible dimensions"). Nothing placed reads the
    shapes inside a body (coverage places the If whole), so the bodies are kept as they were."""
    for source, node in zip(model.graph.node, inferred.graph.node, strict=True):
        if any(a.type in _GRAPH_ATTRIBUTES for a in source.attribute):
            del node.attribute[:]
            node.attribute.extend(source.attribute)
    return inferred


def _type_contrib_outputs(model: onnx.ModelProto) -> bool:
    """Give the untyped output of each `CONTRIB_OPS` node its shaped input's type (a graph
    output in place, any other tensor as value_info); True if any was typed."""
    graph = model.graph
    types = {v.name: v.type for v in (*graph.input, *graph.value_info, *graph.output)}
    types.update(
        {i.name: helper.make_tensor_type_proto(i.data_type, i.dims) for i in graph.initializer}
    )
    outputs = {o.name: o for o in graph.output}
    typed = False
    for node in graph.node:
        if node.op_type not in CONTRIB_OPS.get(node.domain, ()) or not node.output[0]:
            continue
        source, name = types.get(node.input[0]), node.output[0]
        if source is None or not source.tensor_type.HasField("shape"):
            continue
        if name in types and types[name].tensor_type.HasField("shape"):
            continue
        info = outputs[name] if name in outputs else graph.value_info.add(name=name)
        info.type.CopyFrom(source)
        types[name] = info.type
        typed = True
    return typed


def _shape_inferred(
    model: onnx.ModelProto,
    label: str,
    view: GraphView,
    hide_weights: bool = True,
) -> onnx.ModelProto:
    """Shape inference with data propagation; returns the inferred model (`model` is spent).

    A small self-contained model without subgraphs, local functions or custom ops is inferred
    with its weights, and the inferencer's output, the input model plus `value_info` and
    output shapes, is used as is (outputs it could not shape keep their declared type) instead
    of copying its `value_info` back: on small models that copy costs a fifth of the
    inference. Other models are inferred by `infer_model_shapes`, on a copy without their
    large weights, and keep their own nodes. A node the inference finds invalid is
    `_InvalidNode` (`_run_inferencer`'s `refuse_invalid`).
    """
    if (
        hide_weights
        or model.functions
        or not DEFAULT_DOMAINS.issuperset(view.domains)
        or not SUBGRAPH_OPS.isdisjoint(view.op_types)
    ):
        infer_model_shapes(model, label, view, refuse_invalid=True)
        return model
    inferred = _run_inferencer(model, label, view, hide_weights=False, refuse_invalid=True)
    declared = model.graph.output
    last = {o.name: k for k, o in enumerate(inferred.graph.output)}
    for k, out in enumerate(inferred.graph.output):
        new = inferred.graph.output[last[out.name]]
        if not new.type.tensor_type.HasField("shape"):
            out.type.CopyFrom(declared[k].type)
        elif last[out.name] != k:
            out.type.CopyFrom(new.type)
    return inferred


def _weightless_copy(model: onnx.ModelProto, view: GraphView | None = None) -> onnx.ModelProto:
    """`model` with its large weights (initializers and Constant-node values) as empty tensors
    of the same name, type and dims, made without reading their bytes: copying them out and
    back into the model cost as much as the inference itself on a model of 8 MB of weights.
    `model` itself when it has none at its top level (its weights are in subgraphs, which a
    copy would only duplicate).

    Weights held only in Constant nodes (Paddle and Caffe2 exports) are emptied in a whole
    copy of the model (`_copy_without_constant_weights`): protobuf copies a message tree in
    one C call, where rebuilding every node of the graph around new Constant nodes cost five
    times as much on PP-OCRv4's detector."""
    source = model.graph
    op_types = view.op_types if view is not None else [n.op_type for n in source.node]
    initializers = [_empty_like(t) if _is_large_weight(t) else t for t in source.initializer]
    large_constants = [
        (idx, value)
        for idx, op in enumerate(op_types)
        if op == "Constant" and (value := _large_value(source.node[idx])) is not None
    ]
    kept_initializers = all(
        new is old for old, new in zip(source.initializer, initializers, strict=True)
    )
    if kept_initializers:
        if not large_constants:
            return model
        if sum(_nbytes(value.t) for _, value in large_constants) <= _COPY_WHOLE_BYTES:
            return _copy_without_constant_weights(model, [idx for idx, _ in large_constants])
    emptied = dict(large_constants)
    nodes = [
        _without_large_value(node, emptied[idx]) if idx in emptied else node
        for idx, node in enumerate(source.node)
    ]
    copy = onnx.ModelProto()
    for field, value in model.ListFields():
        if field.name != "graph":
            _copy_field(copy, field, value)
    graph = copy.graph
    for field, value in source.ListFields():
        if field.name not in ("initializer", "node"):
            _copy_field(graph, field, value)
    graph.initializer.extend(initializers)
    graph.node.extend(nodes)
    return copy


_COPY_WHOLE_BYTES = 256 * 2**20
"""Up to this many bytes of Constant-node weights, the weightless copy is a whole copy with
their bytes cleared: above it the copy would hold the weights twice in memory for a moment."""


def _copy_without_constant_weights(model: onnx.ModelProto, constants: list[int]) -> onnx.ModelProto:
    """A copy of `model` whose Constant nodes at indices `constants` hold empty tensors."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    nodes = copy.graph.node
    for idx in constants:
        value = _large_value(nodes[idx])
        assert value is not None  # the copy has the nodes of the original
        value.t.ClearField("raw_data")
    return copy


def _nbytes(t: onnx.TensorProto) -> int:
    """Bytes of a weight's data from its dims (4 a value, an upper bound for 8- and 16-bit
    types), without reading the data."""
    return math.prod(t.dims) * 4


def _without_large_value(node: onnx.NodeProto, large: onnx.AttributeProto) -> onnx.NodeProto:
    """A copy of a Constant node whose large `value` attribute `large` is an empty tensor."""
    copy = onnx.NodeProto(
        op_type=node.op_type, domain=node.domain, name=node.name, output=node.output
    )
    copy.attribute.add(name="value", type=onnx.AttributeProto.TENSOR).t.CopyFrom(
        _empty_like(large.t)
    )
    return copy


def _copy_field(message, field, value) -> None:
    """One field (as `ListFields` gives it) of another message of the same type into `message`."""
    repeated = (  # protobuf 6+ has is_repeated; older versions only the label
        field.is_repeated if hasattr(field, "is_repeated") else field.label == field.LABEL_REPEATED
    )
    if repeated:
        getattr(message, field.name).extend(value)
    elif field.type == field.TYPE_MESSAGE:
        getattr(message, field.name).CopyFrom(value)
    else:
        setattr(message, field.name, value)


def _large_value(node: onnx.NodeProto) -> onnx.AttributeProto | None:
    """A Constant node's `value` attribute when it holds a large weight."""
    for a in node.attribute:
        if a.name == "value":
            return a if _is_large_weight(a.t) else None
    return None


def _empty_like(t: onnx.TensorProto) -> onnx.TensorProto:
    """A tensor with `t`'s name, element type and dims, and no data."""
    empty = onnx.TensorProto(name=t.name, data_type=t.data_type)
    empty.dims.extend(t.dims)
    return empty


def _is_large_weight(t: onnx.TensorProto) -> bool:
    """A weight stored as raw bytes whose values cannot matter to shape inference."""
    return t.data_type in _WEIGHT_TYPES and _nbytes(t) > _STRIP_BYTES and t.HasField("raw_data")


_T = onnx.TensorProto
_WEIGHT_TYPES = frozenset(
    {_T.FLOAT, _T.FLOAT16, _T.DOUBLE, _T.BFLOAT16, _T.INT8, _T.UINT8, _T.INT16, _T.UINT16}
    | {_T.INT4, _T.UINT4}
)
"""The element types of weights, float and quantized: data propagation reads only int64 and
int32 tensors (shapes, axes, indices), and a large float tensor is no Resize scale. An
int8-quantized model's weights were serialised for every inference (8 ms on a 13 MB CRNN)."""


def raise_ir_version(model: onnx.ModelProto) -> None:
    """Raise the IR version to the lowest its default-domain opset allows: ONNX's version
    converter and rules that raise the opset keep the old IR (an IR-3 model at opset 13 then
    fails the checker). Opsets this onnx does not know leave the IR version as it is."""
    opset = onnx.helper.make_opsetid("", default_opset(model))
    try:
        needed = onnx.helper.find_min_ir_version_for([opset])
    except (KeyError, ValueError):
        return
    model.ir_version = max(model.ir_version, needed)


_RESIZE_ATTRIBUTES_OPSET = 11
"""Resize gained coordinate_transformation_mode (default half_pixel) at opset 11; Upsample
(≤ 9) and Resize-10 compute asymmetric coordinates with floor for nearest."""


def convert_opset(model: onnx.ModelProto, version: int) -> onnx.ModelProto:
    """ONNX's version converter, with the semantics of old resizes kept.

    Converting an Upsample (opset ≤ 9) or a Resize-10 past opset 11 leaves the new Resize
    without a coordinate_transformation_mode, so it takes the half_pixel default: a linear
    upsample then differs from the original by up to a quarter of the input range. Here every
    such Resize gets the asymmetric mode (and floor rounding for nearest) the old op computed,
    and the node name the converter dropped (it keeps node order, not always tensor names).
    Raises whatever the converter raises.
    """
    original = default_opset(model)
    converted = onnx.version_converter.convert_version(model, version)
    if original >= _RESIZE_ATTRIBUTES_OPSET or version < _RESIZE_ATTRIBUTES_OPSET:
        return converted
    old = [
        node
        for node in model.graph.node
        if node.op_type in ("Upsample", "Resize") and node.domain in ("", "ai.onnx")
    ]
    new = [node for node in converted.graph.node if node.op_type == "Resize"]
    if len(old) != len(new):  # the converter keeps node order; anything else is not ours
        return converted
    for source, node in zip(old, new, strict=True):
        mode = next((a.s for a in node.attribute if a.name == "mode"), b"nearest")
        kept = {a.name for a in node.attribute}
        if "coordinate_transformation_mode" not in kept:
            node.attribute.append(
                onnx.helper.make_attribute("coordinate_transformation_mode", "asymmetric")
            )
        if mode == b"nearest" and "nearest_mode" not in kept:
            node.attribute.append(onnx.helper.make_attribute("nearest_mode", "floor"))
        if not node.name:
            node.name = source.name
    return converted


def model_nbytes(model: onnx.ModelProto) -> int:
    """Approximate serialized size without serialising (works above the 2 GB limit)."""
    total = 0
    for t in model.graph.initializer:
        total += len(t.raw_data) if t.HasField("raw_data") else t.ByteSize()
    for node in model.graph.node:
        total += (
            node.ByteSize()
            if node.op_type != "Constant"
            else sum(a.t.ByteSize() for a in node.attribute)
        )
    return total


def check_model_fully(model: onnx.ModelProto) -> None:
    """onnx's full checker (strict shape inference included), also above the 2 GB protobuf
    limit, where the checker cannot serialise the model: the weights that do not fit are
    checked as graph inputs of their type and shape instead (which is all the checker reads
    of them besides their bytes)."""
    if model_nbytes(model) < PROTOBUF_LIMIT - _CHECK_MARGIN:
        _run_checker(model)
        return
    light = onnx.ModelProto(ir_version=model.ir_version)
    light.opset_import.extend(model.opset_import)
    light.functions.extend(model.functions)
    source, graph = model.graph, light.graph
    graph.name = source.name
    for field in ("node", "input", "output", "value_info", "sparse_initializer"):
        getattr(graph, field).extend(getattr(source, field))
    declared = {i.name for i in source.input}
    for t in source.initializer:
        if not _is_large_weight(t):
            graph.initializer.append(t)
        elif t.name not in declared:
            graph.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, t.dims))
    _run_checker(light)


def _run_checker(model: onnx.ModelProto) -> None:
    """onnx's full checker, whose verdict on a tensor of an element type it does not know comes
    as a ValueError ("Invalid tensor data type 99"): raised as the ValidationError it is, which
    every caller reports as the checker's finding."""
    try:
        onnx.checker.check_model(model, full_check=True)
    except ValueError as exc:
        raise onnx.checker.ValidationError(first_line(exc)) from None


_CHECK_MARGIN = 2**26
"""Room under the protobuf limit for what `model_nbytes` does not count (names, value infos)."""


def _current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_FILE_MODE = 0o666 & ~_current_umask()
"""The mode open() gives a new file (read at import, while there is one thread)."""


def refuse_special_file(path: Path) -> None:
    """Writes rename a temporary file over their target: over a FIFO or a device (-o /dev/null)
    that would replace it with a regular file, so such a target is refused."""
    if path.is_dir():
        raise SurgeryError(f"cannot write {path}: it is a folder")
    if path.exists() and not path.is_file():
        raise SurgeryError(f"cannot write {path}: it exists and is not a regular file")


def temp_file_beside(path: Path) -> tuple[int, str]:
    """A temporary file in `path`'s folder, to be renamed over `path`, with the mode a plain
    open() would give: mkstemp's 0600 would leave every model written unreadable to the
    other users, containers and CI steps that share it."""
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:  # name the file asked for, not the temporary one
        raise SurgeryError(f"cannot write {path}: {exc.strerror or exc}") from None
    os.fchmod(fd, _FILE_MODE)
    return fd, tmp


def save_model(
    model: onnx.ModelProto,
    path: str | os.PathLike,
    *,
    external_data: bool | None = None,
) -> Path:
    """Write atomically (temp file + rename). Models near 2 GB use an external data file.

    `external_data=None` decides by size; the data file is `<name>.onnx.data` beside the model.
    """
    path = Path(path)
    refuse_special_file(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise SurgeryError(f"cannot write {path}: {path.parent} is a file, not a folder") from None
    if external_data is None:
        external_data = model_nbytes(model) > PROTOBUF_LIMIT - 64 * 2**20
    fd, tmp = temp_file_beside(path)
    os.close(fd)
    data_name = f"{path.name}.data"
    tmp_data = path.parent / f".{data_name}.tmp"
    try:
        if external_data:
            copy = onnx.ModelProto()
            copy.CopyFrom(model)
            if tmp_data.exists():
                tmp_data.unlink()
            onnx.external_data_helper.convert_model_to_external_data(
                copy, all_tensors_to_one_file=True, location=tmp_data.name, size_threshold=1024
            )
            onnx.save_model(copy, tmp)
            # The proto names the final data file; rename the data first so the pair is consistent.
            if tmp_data.exists():  # nothing is written when every tensor is under the threshold
                _relocate_external_data(tmp, data_name)
                os.replace(tmp_data, path.parent / data_name)
        else:
            with open(tmp, "wb") as f:
                f.write(model.SerializeToString())
        os.replace(tmp, path)
    except BaseException:
        for p in (Path(tmp), tmp_data):
            if p.exists():
                p.unlink()
        raise
    return path


def _relocate_external_data(model_path: str, location: str) -> None:
    m = onnx.load(model_path, load_external_data=False)
    for t in onnx.external_data_helper._get_all_tensors(m):
        for entry in t.external_data:
            if entry.key == "location":
                entry.value = location
    with open(model_path, "wb") as f:
        f.write(m.SerializeToString())


def _forget_invalid_dims(model: onnx.ModelProto) -> None:
    """Turn declared dims ≤ 0 (some exporters write -1 for "dynamic") into unknown dims.

    ONNX dims are positive or symbolic; a literal -1 on an output would otherwise contradict
    the shape inferred once the inputs are fixed.
    """
    valid: set[bytes] = set()  # serialized types seen without such dims (legacy graphs list
    # every weight as an input, mostly with a few distinct types)
    for vi in (*model.graph.input, *model.graph.output):
        tp = vi.type
        key = tp.SerializeToString()
        if key in valid:
            continue
        tt = tp.tensor_type
        if not tt.HasField("shape"):
            continue
        changed = False
        for d in tt.shape.dim:
            if d.HasField("dim_value") and d.dim_value <= 0:
                d.ClearField("dim_value")
                changed = True
        if not changed:
            valid.add(key)


def _uses_external_data(model: onnx.ModelProto) -> bool:
    return any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer)


def _name(node: onnx.NodeProto, idx: int) -> str:
    return node.name or f"{node.op_type}_{idx}"


__all__ = [
    "SurgeryError",
    "infer_model_shapes",
    "infer_shapes_through_contrib_ops",
    "load_model",
    "parse_input_shapes",
    "read_model",
    "save_model",
    "set_input_shapes",
    "toposort_nodes",
    "validate_graph",
]
