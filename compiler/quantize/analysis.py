"""Per-layer quantization error, in the layout RKNN's `accuracy_analysis` made familiar.

For every quantized activation (a QuantizeLinear → DequantizeLinear or Cast → Cast pair in the
QDQ model) two errors are measured against the float model's tensor of the same name:

- **entire**: the QDQ model run from the input. Errors of every upstream layer accumulate, so
  this says how far the deployed model has drifted by that point.
- **single**: the layer fed the *float* model's values of its inputs (quantized with the QDQ
  model's own input parameters), then quantized as in the QDQ model. This isolates the layer's
  own error, which is what mixed precision should act on: raising a layer whose entire error is
  bad only because an upstream layer is bad changes nothing.

Both come from three ONNX Runtime sessions over the same samples: the float model with the
intermediate tensors exposed; the QDQ model with the DequantizeLinear outputs exposed; and a
"single" copy of the QDQ model in which each pair is duplicated onto a new graph input fed the
float tensor, and the downstream readers are rewired to the duplicate. One pass serves every
layer. Tensors are matched by name: the quantizer keeps the float tensor's name on the
dequantized value of a quantized node's output (`compiler.quantize.qdq`); a tensor read from a
graph input or a float node keeps its name on the Q input instead.

Sums (not arrays) are kept across samples, so memory does not grow with the number of samples;
one sample's intermediate tensors are held three times (float, entire, single) while it is
measured.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import numpy as np
import onnx
from onnx import helper

from compiler.quantize.calibrate import Progress, reference_session, with_outputs
from compiler.quantize.errors import QuantizationError
from compiler.quantize.samples import CalibrationData, SamplePasses, as_feed, input_signature
from surgery.errors import first_line
from surgery.graph import FreshNames, behind_views

__all__ = [
    "AnalysisResult",
    "ErrorMetrics",
    "LayerError",
    "QuantizedTensor",
    "analyze_quantization_error",
    "concat_output_parts",
    "find_quantized_tensors",
]

_FLOAT_CASTS = {onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT16}


@dataclass(frozen=True)
class QuantizedTensor:
    """One activation Q/DQ (or Cast) pair of the QDQ model, tied to a float tensor."""

    tensor: str
    """Name of the float model's tensor this pair approximates."""
    source: str
    """The pair's input in the QDQ model."""
    dequantized: str
    """The pair's output in the QDQ model (what readers see)."""
    nodes: tuple[onnx.NodeProto, onnx.NodeProto]
    op_type: str
    """Op type of the float tensor's producer (`Input` for graph inputs)."""
    producer: str | None
    """Name of the float tensor's producer node (None for graph inputs)."""
    parts: tuple[tuple[str, int], ...] = ()
    """For a Concat output: (input tensor, length along the axis) of each input, in order."""
    axis: int = 0


def sqnr_db(signal: float, noise: float) -> float:
    """10·log10(signal / noise) in dB for sums of squares; inf when there is no noise."""
    return math.inf if noise <= 0 else 10 * math.log10(max(signal, 1e-300) / noise)


@dataclass
class ErrorSums:
    dot: float = 0.0
    ref: float = 0.0
    test: float = 0.0
    diff: float = 0.0
    euclid: float = 0.0
    samples: int = 0
    cos_min: float = 1.0

    def add(self, ref: np.ndarray, test: np.ndarray) -> None:
        r = np.asarray(ref, dtype=np.float64).ravel()
        t = np.asarray(test, dtype=np.float64).ravel()
        dot, rr, tt = float(r @ t), float(r @ r), float(t @ t)
        dd = float(np.square(r - t).sum())
        self.dot += dot
        self.ref += rr
        self.test += tt
        self.diff += dd
        self.euclid += math.sqrt(dd)
        self.samples += 1
        self.cos_min = min(self.cos_min, _cosine(dot, rr, tt))

    def metrics(self) -> ErrorMetrics:
        sqnr = sqnr_db(self.ref, self.diff)
        return ErrorMetrics(
            cosine=_cosine(self.dot, self.ref, self.test),
            euclidean=self.euclid / max(self.samples, 1),
            sqnr_db=sqnr,
            cosine_min=self.cos_min,
        )


def _cosine(dot: float, ref: float, test: float) -> float:
    if ref == 0 and test == 0:
        return 1.0
    if ref == 0 or test == 0:
        return 0.0
    return max(-1.0, min(1.0, dot / math.sqrt(ref * test)))


@dataclass(frozen=True)
class ErrorMetrics:
    """Error of one tensor against float over all samples (cosine and SQNR from summed
    products, so a sample with a tiny tensor does not dominate; euclidean per sample, averaged,
    as RKNN prints it)."""

    cosine: float
    euclidean: float
    sqnr_db: float
    cosine_min: float
    """The worst single sample's cosine."""

    def to_dict(self) -> dict[str, float | None]:
        return {
            "cosine": _finite(self.cosine),
            "cosine_min": _finite(self.cosine_min),
            "euclidean": _finite(self.euclidean),
            "sqnr_db": _finite(self.sqnr_db),
        }


def _finite(value: float) -> float | None:
    """JSON has no inf/nan: an exact match (infinite SQNR) is written as null."""
    return round(value, 6) if math.isfinite(value) else None


@dataclass(frozen=True)
class LayerError:
    tensor: str
    op_type: str
    node: str | None
    entire: ErrorMetrics
    single: ErrorMetrics
    entire_parts: dict[str, ErrorMetrics] = field(default_factory=dict)
    """Concat outputs: the error of each input's slice of the output."""
    single_parts: dict[str, ErrorMetrics] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"[{self.op_type}] {self.tensor}"

    def worst_cosine(self, kind: str = "single") -> float:
        """The lowest cosine of the whole tensor and its parts (what mixed precision acts on)."""
        whole: ErrorMetrics = getattr(self, kind)
        parts: dict[str, ErrorMetrics] = getattr(self, f"{kind}_parts")
        return min([whole.cosine, *(m.cosine for m in parts.values())])

    def worst_euclidean(self, kind: str = "single") -> float:
        whole: ErrorMetrics = getattr(self, kind)
        parts: dict[str, ErrorMetrics] = getattr(self, f"{kind}_parts")
        return max([whole.euclidean, *(m.euclidean for m in parts.values())])

    def to_dict(self) -> dict[str, Any]:
        return {
            "layer": self.label,
            "tensor": self.tensor,
            "op_type": self.op_type,
            "node": self.node,
            "entire": self.entire.to_dict(),
            "single": self.single.to_dict(),
            **(
                {
                    "entire_parts": {k: v.to_dict() for k, v in self.entire_parts.items()},
                    "single_parts": {k: v.to_dict() for k, v in self.single_parts.items()},
                }
                if self.single_parts
                else {}
            ),
        }


@dataclass
class AnalysisResult:
    """Layers worst first (by the single cosine of the tensor or its worst Concat part, then
    the entire one) and the model outputs."""

    layers: list[LayerError]
    outputs: dict[str, ErrorMetrics]
    samples: int
    skipped: list[str] = field(default_factory=list)
    """Quantized tensors with no float counterpart of the same name."""

    def worst(self, n: int) -> list[LayerError]:
        return self.layers[:n]

    def layer(self, tensor: str) -> LayerError:
        for entry in self.layers:
            if entry.tensor == tensor:
                return entry
        raise KeyError(tensor)

    def to_dict(self) -> dict[str, Any]:
        return {
            "samples": self.samples,
            "layers": [entry.to_dict() for entry in self.layers],
            "outputs": {k: v.to_dict() for k, v in self.outputs.items()},
            "skipped": list(self.skipped),
        }


# --------------------------------------------------------------------------- the graph side


def find_quantized_tensors(
    qdq_model: onnx.ModelProto, float_model: onnx.ModelProto
) -> tuple[list[QuantizedTensor], list[str]]:
    """The activation pairs of `qdq_model` matched to `float_model` tensors (and unmatched ones)."""
    g = qdq_model.graph
    inits = {t.name for t in g.initializer}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in g.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    float_producers = {o: n for n in float_model.graph.node for o in n.output if o}
    float_inputs = {i.name for i in float_model.graph.input} - {
        t.name for t in float_model.graph.initializer
    }
    known = float_producers.keys() | float_inputs
    shapes = _static_shapes(float_model)
    found: list[QuantizedTensor] = []
    unmatched: list[str] = []
    seen: set[str] = set()
    for first in g.node:
        if not first.input or first.input[0] in inits or not _opens_pair(first):
            continue
        closing = [n for n in readers.get(first.output[0], []) if _closes_pair(first, n)]
        if len(closing) != 1:
            continue
        second = closing[0]
        source, dequantized = first.input[0], second.output[0]
        tensor = dequantized if dequantized in known else source if source in known else None
        if tensor is None:
            unmatched.append(dequantized)
            continue
        if dequantized in seen:
            continue
        seen.add(dequantized)
        producer = float_producers.get(tensor)
        found.append(
            QuantizedTensor(
                tensor,
                source,
                dequantized,
                (first, second),
                producer.op_type if producer is not None else "Input",
                (producer.name or None) if producer is not None else None,
                *_concat_parts(producer, shapes),
            )
        )
    return found, unmatched


def _static_shapes(model: onnx.ModelProto) -> dict[str, list[int | None]]:
    if not model.graph.value_info:
        # a convenience: without shapes a Concat gets no parts, the analysis still runs
        with contextlib.suppress(Exception):
            model = onnx.shape_inference.infer_shapes(model)
    g = model.graph
    shapes: dict[str, list[int | None]] = {t.name: list(t.dims) for t in g.initializer}
    for vi in [*g.input, *g.value_info, *g.output]:
        tt = vi.type.tensor_type
        if tt.HasField("shape"):
            shapes[vi.name] = [d.dim_value if d.dim_value > 0 else None for d in tt.shape.dim]
    return shapes


def _concat_parts(
    node: onnx.NodeProto | None, shapes: Mapping[str, list[int | None]]
) -> tuple[tuple[tuple[str, int], ...], int]:
    """The inputs of a Concat with their static lengths along its axis; () when unknown.

    A concatenated tensor is judged per part too: a detection head's boxes (hundreds of pixels)
    and scores (0‥1) share one tensor, and the whole tensor's cosine stays near 1 while int8
    steps sized for the boxes erase the scores."""
    if node is None or node.op_type != "Concat" or len(node.input) < 2:
        return (), 0
    axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
    parts: list[tuple[str, int]] = []
    for name in node.input:
        shape = shapes.get(name)
        if not shape or not -len(shape) <= axis < len(shape) or shape[axis] is None:
            return (), 0
        parts.append((name, int(shape[axis])))
    rank = len(shapes[node.input[0]])
    return tuple(parts), axis % rank


def concat_output_parts(model: onnx.ModelProto) -> dict[str, dict[str, np.ndarray]]:
    """{graph output: {Concat input: boolean mask of its elements in the output}} for each
    graph output that is a Concat, or a view of one (Reshape, Flatten, Squeeze, Unsqueeze,
    Identity, Transpose), with static shapes.

    A detector exports boxes (hundreds of pixels) and class scores (0‥1) as one concatenated
    output, often reshaped after `surgery fix` made the Concat 4-D: the whole output's SQNR and
    cosine stay high while int8 steps sized for the boxes round every score to zero. Judging
    each part's elements on their own shows it."""
    shapes = _static_shapes(model)
    producers = {o: n for n in model.graph.node for o in n.output if o}
    found: dict[str, dict[str, np.ndarray]] = {}
    for output in model.graph.output:
        node, chain = behind_views(output.name, producers)
        name = chain[-1].input[0] if chain else output.name
        parts, axis = _concat_parts(node, shapes)
        shape = shapes.get(name)
        if not parts or not shape or any(d is None for d in shape):
            continue
        along = np.repeat(np.arange(len(parts)), [length for _, length in parts])
        labels = np.broadcast_to(
            along.reshape([-1 if i == axis else 1 for i in range(len(shape))]), shape
        )
        for view in reversed(chain):
            out_shape = shapes.get(view.output[0])
            if view.op_type == "Transpose":
                perm = next((list(a.ints) for a in view.attribute if a.name == "perm"), None)
                labels = labels.transpose(perm)
            elif out_shape and all(d is not None for d in out_shape):
                labels = labels.reshape(out_shape)
            else:
                labels = None
                break
        if labels is None:
            continue
        masks: dict[str, np.ndarray] = {}
        for index, (part, _) in enumerate(parts):
            key = part if part not in masks else f"{part}#{index}"
            masks[key] = labels == index
        found[output.name] = masks
    return found


def _opens_pair(node: onnx.NodeProto) -> bool:
    if node.op_type == "QuantizeLinear":
        return True
    return node.op_type == "Cast" and _cast_to(node) in _FLOAT_CASTS


def _closes_pair(first: onnx.NodeProto, node: onnx.NodeProto) -> bool:
    if first.op_type == "QuantizeLinear":
        return node.op_type == "DequantizeLinear"
    return node.op_type == "Cast" and _cast_to(node) == onnx.TensorProto.FLOAT


def _cast_to(node: onnx.NodeProto) -> int:
    return next((a.i for a in node.attribute if a.name == "to"), 0)


def single_layer_model(
    qdq_model: onnx.ModelProto, pairs: list[QuantizedTensor]
) -> tuple[onnx.ModelProto, dict[str, str]]:
    """The QDQ model with every layer reading Q/DQ(float input) instead of the upstream layer's
    output. Returns the model and {float tensor: new graph input to feed it with}."""
    model = onnx.ModelProto()
    model.CopyFrom(qdq_model)
    g = model.graph
    fresh = FreshNames(g)
    feeds: dict[str, str] = {}
    rewire: dict[str, str] = {}
    extra: list[onnx.NodeProto] = []

    for pair in pairs:
        if pair.tensor not in feeds:
            feeds[pair.tensor] = fresh(f"{pair.tensor}__float")
            g.input.append(helper.make_tensor_value_info(feeds[pair.tensor], 1, None))
        first, second = pair.nodes
        mid, out = fresh(f"{pair.dequantized}__single_q"), fresh(f"{pair.dequantized}__single")
        a, b = onnx.NodeProto(), onnx.NodeProto()
        a.CopyFrom(first)
        b.CopyFrom(second)
        a.name, b.name = fresh(f"{first.name}__single"), fresh(f"{second.name}__single")
        a.input[0], a.output[0] = feeds[pair.tensor], mid
        b.input[0], b.output[0] = mid, out
        extra += [a, b]
        rewire[pair.dequantized] = out
    for node in g.node:
        for k, name in enumerate(node.input):
            if name in rewire:
                node.input[k] = rewire[name]
    g.node.extend(extra)
    return model, feeds


# --------------------------------------------------------------------------- the numbers


def analyze_quantization_error(
    float_model: onnx.ModelProto,
    qdq_model: onnx.ModelProto,
    data: CalibrationData,
    *,
    limit: int | None = None,
    progress: Progress | None = None,
) -> AnalysisResult:
    """Entire and single error of every quantized layer of `qdq_model` against `float_model`
    over the samples of `data` (at most `limit`). Float-simulated sessions (Q/DQ not fused)."""
    pairs, unmatched = find_quantized_tensors(qdq_model, float_model)
    if not pairs:
        raise QuantizationError(
            "no quantized activations of the QDQ model match a tensor of the float model",
            hint="pass the float model the QDQ model was quantized from",
        )
    signature = input_signature(float_model)
    float_outputs = [o.name for o in float_model.graph.output]
    qdq_outputs = {o.name for o in qdq_model.graph.output}
    compared_outputs = [o for o in float_outputs if o in qdq_outputs]
    tensors = list(dict.fromkeys(p.tensor for p in pairs))
    exposed_float = list(dict.fromkeys(tensors + compared_outputs))
    single_model, feeds = single_layer_model(qdq_model, pairs)
    float_sess = reference_session(
        with_outputs(float_model, exposed_float), label="the float model"
    )
    entire_names = list(dict.fromkeys([p.dequantized for p in pairs] + compared_outputs))
    entire_sess = reference_session(
        with_outputs(qdq_model, entire_names), label="the quantized model"
    )
    single_names = list(dict.fromkeys(p.dequantized for p in pairs))
    single_sess = reference_session(
        with_outputs(single_model, single_names),
        label="the quantized model with float layer inputs",
    )
    entire = {p.dequantized: ErrorSums() for p in pairs}
    single = {p.dequantized: ErrorSums() for p in pairs}
    entire_parts = {p.dequantized: {n: ErrorSums() for n, _ in p.parts} for p in pairs}
    single_parts = {p.dequantized: {n: ErrorSums() for n, _ in p.parts} for p in pairs}
    outputs = {o: ErrorSums() for o in compared_outputs}
    passes = SamplePasses(data)
    total = passes.total if limit is None else min(limit, passes.total or limit)
    done = 0
    for sample in islice(passes.new_pass(), limit):
        feed = as_feed(sample, signature, done)
        ref = dict(
            zip(exposed_float, run_outputs(float_sess, exposed_float, feed, done), strict=True)
        )
        got = dict(
            zip(entire_names, run_outputs(entire_sess, entire_names, feed, done), strict=True)
        )
        single_feed = dict(feed)
        single_feed.update({feeds[t]: ref[t] for t in tensors})
        alone = dict(
            zip(
                single_names, run_outputs(single_sess, single_names, single_feed, done), strict=True
            )
        )
        for pair in pairs:
            entire[pair.dequantized].add(ref[pair.tensor], got[pair.dequantized])
            single[pair.dequantized].add(ref[pair.tensor], alone[pair.dequantized])
            for name, r, e, a in _split_parts(
                pair, ref[pair.tensor], got[pair.dequantized], alone[pair.dequantized]
            ):
                entire_parts[pair.dequantized][name].add(r, e)
                single_parts[pair.dequantized][name].add(r, a)
        for name, sums in outputs.items():
            sums.add(ref[name], got[name])
        del ref, got, alone, single_feed
        done += 1
        if progress is not None:
            progress(done, total)
    if done == 0:
        raise QuantizationError("the analysis data yielded no samples")
    duplicated = {t for t in tensors if sum(p.tensor == t for p in pairs) > 1}
    layers = [
        LayerError(
            p.dequantized if p.tensor in duplicated else p.tensor,
            p.op_type,
            p.producer,
            entire[p.dequantized].metrics(),
            single[p.dequantized].metrics(),
            {k: v.metrics() for k, v in entire_parts[p.dequantized].items()},
            {k: v.metrics() for k, v in single_parts[p.dequantized].items()},
        )
        for p in pairs
    ]
    layers.sort(key=lambda e: (e.worst_cosine("single"), e.worst_cosine("entire")))
    return AnalysisResult(layers, {k: v.metrics() for k, v in outputs.items()}, done, unmatched)


def _split_parts(
    pair: QuantizedTensor, *arrays: np.ndarray
) -> list[tuple[str, np.ndarray, np.ndarray, np.ndarray]]:
    if not pair.parts or arrays[0].ndim <= pair.axis:
        return []
    sizes = [n for _, n in pair.parts]
    if arrays[0].shape[pair.axis] != sum(sizes):
        return []
    cuts = np.cumsum(sizes)[:-1]
    split = [np.split(a, cuts, axis=pair.axis) for a in arrays]
    return [(name, *(s[k] for s in split)) for k, (name, _) in enumerate(pair.parts)]


def run_outputs(session: Any, names: list[str], feed: Mapping[str, np.ndarray], index: int) -> list:
    if not names:
        return []
    try:
        return session.run(names, dict(feed))
    except Exception as exc:  # ORT raises its own exception types
        raise QuantizationError(f"sample {index}: ONNX Runtime failed: {first_line(exc)}") from None
