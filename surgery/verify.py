"""Numerical verification: run two ONNX models with ONNX Runtime and compare their outputs.

Model A is the reference and model B the candidate (typically the model before and after a
rewrite). Inputs are generated once from A's input signature (or read from a user `.npz`) and the
same arrays are fed to both, so any difference comes from the graphs, not from the data.

Metrics, per matched output (all computed in float64; `ref` is A's output, `test` is B's):

- `max_abs`: max |test - ref|.
- `max_rel`: max_abs / max|ref| — the error scaled by the output's magnitude. Robust to
  elements near zero; this is the relative error to look at first.
- `max_rel_elementwise`: max(|test - ref| / (|ref| + 1e-6)) — the classic per-element relative
  error. The epsilon only prevents division by zero, so elements where ref ≈ 0 dominate it.
- `mean_abs`, `cosine` (cosine similarity of the flattened tensors), `sqnr_db`
  (10·log10(Σref² / Σ(ref - test)²), +inf when identical).
- `min_atol` / `min_rtol`: the smallest atol (with rtol=0) and rtol (with atol=0) for which
  `numpy.allclose(test, ref, ...)` would pass.

Pass/fail follows numpy.allclose, |test - ref| <= atol + rtol·|ref|, or in exact mode
("float rounding only", for data-movement rewrites) max_abs <= 1e-5 · max(1, max|ref|).
Non-float outputs (indices, masks) are compared exactly.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx

from surgery.errors import ShapeError, SurgeryError, VerifyError, first_line
from surgery.graph import shape_from_type, shape_text
from surgery.model import (
    PROTOBUF_LIMIT,
    load_model,
    model_nbytes,
    read_model,
    save_model,
    set_input_shapes,
)
from surgery.ort_logging import FATAL_ONLY, quiet_ort_logging

if TYPE_CHECKING:  # ONNX Runtime loads when a model first runs: `check` never pays for it
    import onnxruntime as ort

ModelSource = str | os.PathLike | onnx.ModelProto

EXACT_SCALE = 1e-5
"""Exact mode passes iff max_abs <= EXACT_SCALE * max(1, max|ref|): float rounding only."""

REL_EPS = 1e-6
"""Epsilon in the denominator of `max_rel_elementwise`."""

DEFAULT_INT_HIGH = 100
MAX_RANDOM_INPUT_VALUES = 2**30
"""The most values one random input may hold (4 GiB as float32, drawn as 8 GiB of float64):
two orders of magnitude above a 2048×2048 image batch, and what an input dimension of 2**40
(a typo, or a model declaring a huge static size) would otherwise try to allocate."""
"""Random integer inputs are drawn from [0, DEFAULT_INT_HIGH) unless an embedding bounds them."""

_INDEX_PASS_THROUGH = frozenset(
    {"Cast", "Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Expand", "Transpose"}
)
_TABLE_PASS_THROUGH = frozenset({"Cast", "Identity", "DequantizeLinear"})
_ORT_PREFIX = "[ONNXRuntimeError] : "


# --------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class InputSpec:
    """How one random input is generated: dtype, concrete shape and value range."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    low: float | None = None
    high: float | None = None
    dynamic_dims: tuple[int, ...] = ()
    """Indices of dimensions that were unknown in the model and set to 1."""
    range_source: str = ""
    """Why the range was chosen (e.g. "Gather table 'emb' has 10 rows"); empty by default."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dtype": str(self.dtype),
            "shape": list(self.shape),
            "low": self.low,
            "high": self.high,
            "dynamic_dims": list(self.dynamic_dims),
            "range_source": self.range_source,
        }


def input_specs(
    model: ModelSource, input_shapes: Mapping[str, Sequence[int]] | None = None
) -> list[InputSpec]:
    """Describe the random input each graph input needs (initializer-backed inputs excluded).

    Float inputs are image-like, uniform in [0, 1). Integer inputs that reach a Gather as
    indices stay below the table's row count (token ids into an embedding); integer masks
    (`attention_mask`, `padding_mask`: a name with "mask") hold 0 and 1, as transformers read
    them (BERT's (1 − mask)·finfo.min is inf for any other value); other integers use
    [0, 100). Unknown dimensions become 1 unless `input_shapes` fixes them.
    """
    proto = model if isinstance(model, onnx.ModelProto) else read_model(model)
    inputs = _shaped_inputs(proto, input_shapes or {})
    specs = []
    for vi in inputs:
        if not vi.type.HasField("tensor_type"):
            raise VerifyError(
                f"input {vi.name!r} is not a tensor; pass its value with an .npz file"
            )
        tensor_type = vi.type.tensor_type
        dtype = _np_dtype(tensor_type.elem_type, vi.name)
        dims = [
            d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else 0
            for d in tensor_type.shape.dim
        ]
        dynamic = tuple(i for i, d in enumerate(dims) if d == 0)
        shape = tuple(d or 1 for d in dims)
        low: float | None = None
        high: float | None = None
        source = ""
        if dtype.kind == "f":
            low, high = 0.0, 1.0
        elif dtype.kind in "iu":
            bound = _gather_bound(proto, vi.name)
            low, high = 0, DEFAULT_INT_HIGH
            if bound is not None:
                high, source = bound[0], f"Gather table {bound[1]!r} has {bound[0]} rows"
            elif "mask" in vi.name.lower():
                high, source = 2, "a mask: 0 or 1"
            high = min(high, int(np.iinfo(dtype).max) + 1)  # no wrap-around in int8/uint8
        specs.append(InputSpec(vi.name, dtype, shape, low, high, dynamic, source))
    return specs


def make_inputs(
    model: ModelSource,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    seed: int = 0,
) -> dict[str, np.ndarray]:
    """Seeded random inputs for every graph input of `model` (see `input_specs` for ranges)."""
    return generate_inputs(input_specs(model, input_shapes), seed)


def generate_inputs(specs: Iterable[InputSpec], seed: int = 0) -> dict[str, np.ndarray]:
    """Draw arrays for already computed specs (cheap to call once per random trial)."""
    rng = np.random.default_rng(seed)
    arrays: dict[str, np.ndarray] = {}
    for spec in specs:
        values = math.prod(spec.shape)
        if values > MAX_RANDOM_INPUT_VALUES:
            raise VerifyError(
                f"input {spec.name!r} has shape {list(spec.shape)}: {values:,} values, too many "
                f"to draw random inputs for (at most {MAX_RANDOM_INPUT_VALUES:,})",
                hint="check the input's dims: a dynamic one is set with --input-shape "
                "NAME=DIMS, a static one only by exporting the model again",
            )
        if spec.dtype.kind == "f":
            value = rng.uniform(spec.low or 0.0, spec.high or 1.0, spec.shape)
        elif spec.dtype.kind in "iu":
            value = rng.integers(int(spec.low or 0), int(spec.high or 1), spec.shape)
        else:
            value = rng.random(spec.shape) < 0.5
        arrays[spec.name] = np.asarray(value).astype(spec.dtype)
    return arrays


def load_inputs(
    source: str | os.PathLike | Mapping[str, Any], input_names: Sequence[str] = ()
) -> dict[str, np.ndarray]:
    """User inputs from a mapping, an `.npz` file whose keys are input names, or an `.npy`
    holding the one input of a model whose only input is `input_names[0]`."""
    if isinstance(source, Mapping):
        return {str(k): np.asarray(v) for k, v in source.items()}
    path = Path(source)
    if not path.is_file():
        what = "not a regular file" if path.exists() else "inputs file not found"
        raise VerifyError(f"{path}: {what}", hint="pass an .npz file keyed by input name")
    try:
        loaded = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise VerifyError(f"{path}: not a readable .npz file ({first_line(exc)})") from None
    try:
        return _named_arrays(path, loaded, input_names)
    except ValueError as exc:  # object arrays: numbers only, never pickles
        raise VerifyError(f"{path}: {first_line(exc)}", hint="save numeric arrays") from None


def _named_arrays(path: Path, loaded: Any, input_names: Sequence[str]) -> dict[str, np.ndarray]:
    """The arrays of a loaded .npz by key, or a .npy's one array as the only input."""
    if isinstance(loaded, np.ndarray):  # a .npy: one array, no name
        if len(input_names) != 1:
            raise VerifyError(
                f"{path} is a .npy (one array without a name), but the model takes "
                f"{len(input_names)} inputs",
                hint="pass an .npz keyed by input name (numpy.savez(path, name=array, ...))",
            )
        return {input_names[0]: loaded}
    with loaded as data:
        return {k: np.asarray(data[k]) for k in data.files}


def check_user_inputs(
    model: onnx.ModelProto, given: Mapping[str, np.ndarray], notes: list[str] | None = None
) -> dict[str, np.ndarray]:
    """`given` checked against the model's inputs (every input present, shapes matching the
    declared dims, finite floats) and cast to the declared dtypes; casts and ignored arrays
    are noted. A mismatch is a VerifyError that names the input, not ONNX Runtime's message."""
    notes = notes if notes is not None else []
    declared = _shaped_inputs(model, {})
    missing = [vi.name for vi in declared if vi.name not in given]
    if missing:
        raise VerifyError(
            f"the inputs file lacks the model's input(s) {', '.join(map(repr, missing))}",
            hint=f"it has: {', '.join(given) or '(nothing)'}",
        )
    extra = sorted(set(given) - {vi.name for vi in declared})
    if extra:
        notes.append(f"ignored supplied arrays that are not model inputs: {', '.join(extra)}")
    feed = {}
    for vi in declared:
        value = np.asarray(given[vi.name])
        _check_shape(vi, value)
        if value.dtype.kind == "f" and not np.isfinite(value).all():
            raise VerifyError(f"input {vi.name!r} holds NaN or infinite values")
        dtype = _np_dtype(vi.type.tensor_type.elem_type, vi.name)
        if value.dtype != dtype:
            notes.append(f"input {vi.name!r} cast from {value.dtype} to {dtype}")
            value = value.astype(dtype)
        feed[vi.name] = value
    return feed


def model_input_names(model: onnx.ModelProto) -> list[str]:
    """The inputs a caller feeds (graph inputs that are not initializers)."""
    return [vi.name for vi in _shaped_inputs(model, {})]


def _check_shape(vi: onnx.ValueInfoProto, value: np.ndarray) -> None:
    _, declared = shape_from_type(vi.type)
    if declared is None:
        return
    fits = len(declared) == value.ndim and all(
        not isinstance(d, int) or d == n for d, n in zip(declared, value.shape, strict=False)
    )
    if not fits:
        raise VerifyError(
            f"input {vi.name!r} has shape {list(value.shape)}; the model takes "
            f"{shape_text(declared)}"
        )


def _shaped_inputs(
    model: onnx.ModelProto, input_shapes: Mapping[str, Sequence[int]]
) -> list[onnx.ValueInfoProto]:
    """Copies of the non-initializer graph inputs with `input_shapes` applied.

    Works on a stub model holding only the inputs, so the user's (possibly huge) model is not
    copied and the checks and messages are exactly those of `set_input_shapes`.
    """
    inits = {t.name for t in model.graph.initializer}
    stub = onnx.ModelProto()
    stub.graph.input.extend(vi for vi in model.graph.input if vi.name not in inits)
    if input_shapes:
        set_input_shapes(stub, input_shapes)
    return list(stub.graph.input)


def _np_dtype(elem_type: int, name: str) -> np.dtype:
    try:
        dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type))
    except (KeyError, TypeError, ValueError):
        dtype = np.dtype(object)
    if dtype.kind not in "fiub" or elem_type == onnx.TensorProto.BFLOAT16:
        type_name = onnx.TensorProto.DataType.Name(elem_type) if elem_type else "undefined"
        raise VerifyError(
            f"input {name!r} has type {type_name}, which cannot be generated at random",
            hint="pass its values with --inputs FILE.npz",
        )
    return dtype


def _gather_bound(model: onnx.ModelProto, name: str) -> tuple[int, str] | None:
    """(rows, table name) of the smallest Gather table that `name` indexes, if any.

    Follows the tensor through value-preserving ops (Cast, Reshape, Unsqueeze …) to Gather
    nodes that use it as indices, and reads the gathered axis of their data tensor.
    """
    consumers: dict[str, list[tuple[onnx.NodeProto, int]]] = {}
    for node in model.graph.node:
        for idx, inp in enumerate(node.input):
            consumers.setdefault(inp, []).append((node, idx))
    best: tuple[int, str] | None = None
    stack, seen = [name], {name}
    while stack:
        for node, idx in consumers.get(stack.pop(), []):
            table = _TABLE_INDEXED.get((node.op_type, idx))
            if table is not None and table < len(node.input) and node.input[table]:
                rows = _gathered_dim(model, node, table)
                if rows and (best is None or rows < best[0]):
                    best = (rows, node.input[table])
            elif node.op_type in _INDEX_PASS_THROUGH and idx == 0 and node.output[0] not in seen:
                seen.add(node.output[0])
                stack.append(node.output[0])
    return best


_TABLE_INDEXED = {
    ("Gather", 1): 0,
    ("EmbedLayerNormalization", 0): 2,  # ONNX Runtime's fused BERT embedding: input_ids
    ("EmbedLayerNormalization", 1): 4,  # segment_ids
    ("EmbedLayerNormalization", 8): 3,  # position_ids
}
"""(op type, input index) of an index tensor → the input index of the table it indexes."""


def _gathered_dim(model: onnx.ModelProto, gather: onnx.NodeProto, table: int = 0) -> int | None:
    axis = next((a.i for a in gather.attribute if a.name == "axis"), 0)
    dims = _tensor_dims(model, gather.input[table])
    if not dims or not -len(dims) <= axis < len(dims):
        return None
    return dims[axis] or None


def _tensor_dims(model: onnx.ModelProto, name: str, depth: int = 0) -> list[int] | None:
    """Static dims of a tensor: initializer, Constant, declared shape, or through a dequantize."""
    g = model.graph
    for t in g.initializer:
        if t.name == name:
            return list(t.dims)
    for node in g.node:
        if name not in node.output:
            continue
        if node.op_type == "Constant":
            value = next((a.t for a in node.attribute if a.name == "value"), None)
            return list(value.dims) if value is not None else None
        if node.op_type in _TABLE_PASS_THROUGH and depth < 4:
            return _tensor_dims(model, node.input[0], depth + 1)
    for vi in (*g.value_info, *g.input):
        if vi.name == name:
            dims = vi.type.tensor_type.shape.dim
            if dims and all(d.HasField("dim_value") for d in dims):
                return [d.dim_value for d in dims]
    return None


# --------------------------------------------------------------------------- running


def quiet_session_options() -> ort.SessionOptions:
    """Session options for every session the project opens: a failure to load is raised as a
    VerifyError, so ORT does not log it too (its default logger logs errors only: see
    surgery.ort_logging)."""
    import onnxruntime as ort

    quiet_ort_logging()
    options = ort.SessionOptions()
    options.log_severity_level = FATAL_ONLY
    return options


def ort_session(
    model: onnx.ModelProto, *, label: str = "model", config: Mapping[str, str] | None = None
) -> ort.InferenceSession:
    """A CPU ONNX Runtime session for `model`; failures become a `VerifyError` naming `label`.

    Models above protobuf's 2 GB limit cannot be serialised to bytes, so those are written to
    a temporary directory with external data and opened by path. `config` adds session config
    entries (e.g. threads that sleep instead of spinning between runs).
    """
    options = quiet_session_options()
    # Simulate Q/DQ in float (the QDQ reference semantics) instead of fusing them into ORT's
    # int8 kernels, which round differently; float models are unaffected.
    options.add_session_config_entry("session.disable_quant_qdq", "1")
    for key, value in (config or {}).items():
        options.add_session_config_entry(key, value)
    with _without_value_info(model):
        data: bytes | None = None
        if model_nbytes(model) < PROTOBUF_LIMIT - 64 * 2**20:
            try:
                data = model.SerializeToString()
            except ValueError:  # protobuf refuses messages over 2 GB: external data instead
                data = None
        if data is not None:
            return _open_session(data, options, label)
        with tempfile.TemporaryDirectory(prefix="surgery-verify-") as tmp:
            path = save_model(model, Path(tmp) / "model.onnx", external_data=True)
            return _open_session(str(path), options, label)


@contextmanager
def _without_value_info(model: onnx.ModelProto) -> Iterator[None]:
    """The model with its intermediate value infos set aside while ONNX Runtime reads it.

    They are our shape inference's (with data propagation), written for the analyses; ONNX
    Runtime infers its own. Given ours, it failed to run torchvision's FCOS (a Reshape of
    the empty detection set to [0, -1]) that it runs without them: the reference must be the
    model as its exporter wrote it, whatever our annotations say."""
    kept = list(model.graph.value_info)
    if not kept:
        yield
        return
    del model.graph.value_info[:]
    try:
        yield
    finally:
        model.graph.value_info.extend(kept)


def _open_session(
    model: bytes | str, options: ort.SessionOptions, label: str
) -> ort.InferenceSession:
    import onnxruntime as ort

    try:
        return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # ORT raises its own exception types, all direct Exception subclasses
        raise VerifyError(f"{label}: ONNX Runtime cannot load it: {_ort_message(exc)}") from None


def run_model(
    model: ModelSource | ort.InferenceSession,
    inputs: Mapping[str, np.ndarray],
    *,
    label: str = "model",
) -> dict[str, np.ndarray]:
    """Run `model` on `inputs` with ONNX Runtime; returns every graph output by name.

    Keys of `inputs` the model does not take are ignored, so one dict can feed several models.
    Pass an `InferenceSession` (from `ort_session`) to avoid reloading for repeated runs.
    """
    import onnxruntime as ort

    if isinstance(model, ort.InferenceSession):
        session = model
    else:
        proto = model if isinstance(model, onnx.ModelProto) else read_model(model)
        session = ort_session(proto, label=label)
    needed = [i.name for i in session.get_inputs()]
    missing = [n for n in needed if n not in inputs]
    if missing:
        raise VerifyError(
            f"{label} needs input(s) {', '.join(map(repr, missing))}, which were not provided",
            hint=f"available: {', '.join(inputs) or '(none)'}",
        )
    try:
        values = session.run(None, {n: inputs[n] for n in needed}, _quiet_run())
    except Exception as exc:  # ORT raises its own exception types, all direct Exception subclasses
        raise VerifyError(f"{label}: ONNX Runtime failed to run it: {_ort_message(exc)}") from None
    results: dict[str, np.ndarray] = {}
    for meta, value in zip(session.get_outputs(), values, strict=True):
        if not isinstance(value, np.ndarray):
            raise VerifyError(
                f"{label}: output {meta.name!r} is a {meta.type}, not a tensor; only tensors can be compared"
            )
        results[meta.name] = value
    return results


def _quiet_run() -> ort.RunOptions:
    """Run failures are raised as VerifyError; stop ORT also logging them to stderr."""
    import onnxruntime as ort

    options = ort.RunOptions()
    options.log_severity_level = FATAL_ONLY
    return options


def _ort_message(exc: BaseException) -> str:
    line = first_line(exc)
    if line.startswith(_ORT_PREFIX):
        line = line[len(_ORT_PREFIX) :].split(" : ", 1)[-1]
    return line


# --------------------------------------------------------------------------- comparing


_WORSE_IF_HIGHER = (
    "max_abs",
    "max_rel",
    "max_rel_elementwise",
    "mean_abs",
    "min_atol",
    "min_rtol",
    "mismatches",
)
_WORSE_IF_LOWER = ("cosine", "sqnr_db")


@dataclass
class OutputComparison:
    """One output of A compared with its counterpart in B (worst case over all trials).

    Float metrics are None for non-float outputs, which are compared exactly; `mismatches`
    counts the elements that fail the pass criterion in either case.
    """

    name: str
    name_b: str
    matched_by: str
    """"name", "position" (names differ; paired by output index) or "map" (output_map)."""
    shape_a: tuple[int, ...]
    shape_b: tuple[int, ...]
    dtype_a: str
    dtype_b: str
    passed: bool
    size: int = 0
    mismatches: int | None = None
    max_abs: float | None = None
    max_rel: float | None = None
    max_rel_elementwise: float | None = None
    mean_abs: float | None = None
    cosine: float | None = None
    sqnr_db: float | None = None
    min_atol: float | None = None
    min_rtol: float | None = None
    rows_moved: int | None = None
    """Failed: how many of the differing rows (along the last axis) are, within the
    tolerance, another differing row of B in its place (`reordered_rows`), as when a TopK or
    sort upstream orders near-equal scores differently after a rounding change."""
    message: str = ""

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict: infinities become the strings "inf" / "-inf", n/a metrics None."""
        return {f.name: _json_safe(getattr(self, f.name)) for f in fields(self)}


@dataclass
class VerifyResult:
    """The verdict of `verify_models`, with per-output metrics and notes for the user."""

    passed: bool
    model_a: str
    model_b: str
    mode: str
    """"tolerance" (allclose with atol/rtol) or "exact" (float rounding only)."""
    atol: float
    rtol: float
    seed: int
    samples: int
    outputs: list[OutputComparison]
    inputs: list[InputSpec] = field(default_factory=list)
    """How random inputs were generated (empty when the user supplied them)."""
    notes: list[str] = field(default_factory=list)

    @property
    def worst(self) -> dict[str, float | None]:
        """Worst max_abs, lowest cosine and lowest SQNR over the outputs that have them."""
        return {
            "max_abs": _extreme((o.max_abs for o in self.outputs), max),
            "min_cosine": _extreme((o.cosine for o in self.outputs), min),
            "min_sqnr_db": _extreme((o.sqnr_db for o in self.outputs), min),
        }

    @property
    def failed_outputs(self) -> list[str]:
        return [o.name for o in self.outputs if not o.passed]

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe dict: infinities become the strings "inf" / "-inf", n/a metrics None."""
        return {
            "passed": self.passed,
            "model_a": self.model_a,
            "model_b": self.model_b,
            "mode": self.mode,
            "atol": self.atol,
            "rtol": self.rtol,
            "seed": self.seed,
            "samples": self.samples,
            "worst": {k: _json_safe(v) for k, v in self.worst.items()},
            "failed_outputs": self.failed_outputs,
            "outputs": [o.to_dict() for o in self.outputs],
            "inputs": [s.to_dict() for s in self.inputs],
            "notes": list(self.notes),
        }


def compare_arrays(
    ref: np.ndarray,
    test: np.ndarray,
    *,
    atol: float = 1e-4,
    rtol: float = 1e-3,
    exact: bool = False,
    name: str = "output",
    name_b: str | None = None,
    matched_by: str = "name",
) -> OutputComparison:
    """Compare one reference array with one candidate; never raises on mismatching data."""
    ref, test = np.asarray(ref), np.asarray(test)
    result = OutputComparison(
        name=name,
        name_b=name if name_b is None else name_b,
        matched_by=matched_by,
        shape_a=tuple(ref.shape),
        shape_b=tuple(test.shape),
        dtype_a=str(ref.dtype),
        dtype_b=str(test.dtype),
        passed=False,
        size=int(ref.size),
    )
    if ref.shape != test.shape:
        result.message = f"shape differs: A {list(ref.shape)} vs B {list(test.shape)}"
        return result
    if ref.dtype.kind == "f" or test.dtype.kind == "f":
        _float_metrics(result, ref.astype(np.float64), test.astype(np.float64), atol, rtol, exact)
    else:
        _exact_metrics(result, ref, test)
    return result


def _float_metrics(
    out: OutputComparison, ref: np.ndarray, test: np.ndarray, atol: float, rtol: float, exact: bool
) -> None:
    finite = np.isfinite(ref) & np.isfinite(test)
    same_nonfinite = ~finite & ((ref == test) | (np.isnan(ref) & np.isnan(test)))
    nonfinite_bad = int(np.count_nonzero(~finite & ~same_nonfinite))
    r, t = ref[finite], test[finite]
    err = np.abs(t - r)
    mag = np.abs(r)
    ref_peak = float(mag.max()) if mag.size else 0.0
    max_abs = float(err.max()) if err.size else 0.0
    out.max_abs = max_abs
    out.mean_abs = float(err.mean()) if err.size else 0.0
    out.max_rel = _ratio(max_abs, ref_peak)
    out.max_rel_elementwise = float((err / (mag + REL_EPS)).max()) if err.size else 0.0
    out.cosine = _cosine(r, t)
    out.sqnr_db = _sqnr_db(r, t)
    out.min_atol = max_abs
    out.min_rtol = _min_rtol(err, mag)
    if exact:
        limit = EXACT_SCALE * max(1.0, ref_peak)
        bad = int(np.count_nonzero(err > limit))
        rule = f"max abs error {max_abs:.3g} > {limit:.3g} (exact mode: float rounding only)"
    else:
        bad = int(np.count_nonzero(err > atol + rtol * mag))
        rule = (
            f"{bad} of {out.size} elements exceed atol={atol:g} + rtol={rtol:g}·|ref| "
            f"(max abs error {max_abs:.3g})"
        )
    out.mismatches = bad + nonfinite_bad
    out.passed = out.mismatches == 0
    messages = [rule] if bad else []
    if bad and not nonfinite_bad:
        tolerance = EXACT_SCALE * max(1.0, ref_peak) if exact else None
        differing, moved = reordered_rows(ref, test, atol, rtol, tolerance)
        if moved:
            out.rows_moved = moved
            messages.append(
                f"{moved} of the {differing} differing rows are rows of B in another place "
                "(a TopK or sort upstream ordered near-equal values differently)"
            )
    if nonfinite_bad:
        messages.append(f"{nonfinite_bad} NaN/inf value(s) differ")
    out.message = "; ".join(messages)


MAX_REORDERED_ROWS = 2048
"""Rows out of place above which `reordered_rows` does not look for a pairing."""


def reordered_rows(
    ref: np.ndarray,
    test: np.ndarray,
    atol: float,
    rtol: float,
    tolerance: float | None = None,
) -> tuple[int, int]:
    """(rows that differ, how many of them are another differing row in its place): the rows
    along the last axis, compared within the tolerance (`tolerance` if given, else
    atol + rtol·|ref|) at the same leading indices, paired one for one. A detector's TopK
    output (rows of box, score, class) differs this way when a rewrite moves near-equal scores
    by a rounding error: the same detections in another order, and at most a few at the k-th
    place swapped for the next one. (0, 0) for rank < 2 and when too many rows differ."""
    if ref.ndim < 2 or ref.shape != test.shape or not np.isfinite(ref).all():
        return 0, 0
    rows, width = ref.shape[-2], ref.shape[-1]
    differing = paired = 0
    for ra, rb in zip(ref.reshape(-1, rows, width), test.reshape(-1, rows, width), strict=True):
        limit = tolerance if tolerance is not None else atol + rtol * np.abs(ra)
        off = np.flatnonzero(~(np.abs(ra - rb) <= limit).all(axis=1))
        if off.size > MAX_REORDERED_ROWS:
            return 0, 0
        if not off.size:
            continue
        xa, xb = ra[off], rb[off]
        limit = tolerance if tolerance is not None else atol + rtol * np.abs(xa)[:, None, :]
        close = (np.abs(xa[:, None, :] - xb[None, :, :]) <= limit).all(axis=2)
        differing += off.size
        paired += _max_matching(close)
    return differing, paired


def _max_matching(close: np.ndarray) -> int:
    """The size of a maximum matching of the boolean matrix's rows to its columns (Kuhn's
    augmenting paths, iterative)."""
    owner = [-1] * close.shape[1]
    size = 0
    for start in np.flatnonzero(close.any(axis=1)):
        seen = [False] * close.shape[1]
        stack = [(int(start), iter(np.flatnonzero(close[start])))]
        path: list[tuple[int, int]] = []
        found = False
        while stack and not found:
            row, cols = stack[-1]
            for col in cols:
                if seen[col]:
                    continue
                seen[col] = True
                path = [*path[: len(stack) - 1], (row, int(col))]
                if owner[col] < 0:
                    found = True
                else:
                    stack.append((owner[col], iter(np.flatnonzero(close[owner[col]]))))
                break
            else:
                stack.pop()
        if found:
            size += 1
            for row, col in path:
                owner[col] = row
    return size


def _min_rtol(err: np.ndarray, mag: np.ndarray) -> float:
    """Smallest rtol (atol=0) that passes; inf when an element is off where the reference is 0."""
    off = err > 0
    if not off.any():
        return 0.0
    if not mag[off].all():
        return math.inf
    return float(np.max(err[off] / mag[off]))


def _exact_metrics(out: OutputComparison, ref: np.ndarray, test: np.ndarray) -> None:
    out.mismatches = int(np.count_nonzero(ref != test))
    out.passed = out.mismatches == 0
    if ref.dtype.kind in "iu" and test.dtype.kind in "iu" and ref.size:
        out.max_abs = float(np.max(np.abs(ref.astype(np.float64) - test.astype(np.float64))))
    if not out.passed:
        out.message = (
            f"{out.mismatches} of {out.size} elements differ (exact comparison of {out.dtype_a})"
        )


def _ratio(num: float, den: float) -> float:
    if den > 0:
        return num / den
    return 0.0 if num == 0 else math.inf


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    if na == 0 or nb == 0:
        return 1.0 if na == nb else 0.0
    return float(np.clip(np.dot(a.ravel(), b.ravel()) / (na * nb), -1.0, 1.0))


def _sqnr_db(ref: np.ndarray, test: np.ndarray) -> float:
    noise = float(np.sum((ref - test) ** 2))
    signal = float(np.sum(ref**2))
    if noise == 0:
        return math.inf
    if signal == 0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def _merge(worst: OutputComparison, new: OutputComparison) -> OutputComparison:
    """Fold another trial into the running worst case for the same output."""
    for name in _WORSE_IF_HIGHER:
        setattr(worst, name, _pick(getattr(worst, name), getattr(new, name), max))
    for name in _WORSE_IF_LOWER:
        setattr(worst, name, _pick(getattr(worst, name), getattr(new, name), min))
    worst.passed = worst.passed and new.passed
    worst.message = worst.message or new.message
    return worst


def _pick(a: Any, b: Any, choose: Any) -> Any:
    if a is None or b is None:
        return a if b is None else b
    return choose(a, b)


def _extreme(values: Iterable[float | None], choose: Any) -> float | None:
    present = [v for v in values if v is not None]
    return choose(present) if present else None


def _json_safe(value: Any) -> Any:
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
    if isinstance(value, tuple):
        return list(value)
    return value


# --------------------------------------------------------------------------- verify


def match_outputs(
    names_a: Sequence[str], names_b: Sequence[str], output_map: Mapping[str, str] | None = None
) -> list[tuple[str, str, str]]:
    """Pair outputs as (name in A, name in B, how): explicit map, then same name, then position."""
    output_map = dict(output_map or {})
    for a, b in output_map.items():
        if a not in names_a:
            raise VerifyError(
                f"output map names {a!r}, which is not an output of model A",
                hint=f"A's outputs: {', '.join(names_a)}",
            )
        if b not in names_b:
            raise VerifyError(
                f"output map names {b!r}, which is not an output of model B",
                hint=f"B's outputs: {', '.join(names_b)}",
            )
    pairs: dict[str, tuple[str, str]] = {a: (b, "map") for a, b in output_map.items()}
    taken = set(output_map.values())
    for a in names_a:
        if a not in pairs and a in names_b and a not in taken:
            pairs[a] = (a, "name")
            taken.add(a)
    for i, a in enumerate(names_a):
        if a not in pairs and i < len(names_b) and names_b[i] not in taken:
            pairs[a] = (names_b[i], "position")
            taken.add(names_b[i])
    return [(a, *pairs[a]) for a in names_a if a in pairs]


def verify_models(
    model_a: ModelSource,
    model_b: ModelSource,
    *,
    inputs: str | os.PathLike | Mapping[str, Any] | None = None,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    atol: float = 1e-4,
    rtol: float = 1e-3,
    exact: bool = False,
    output_map: Mapping[str, str] | None = None,
    seed: int = 0,
    samples: int = 1,
) -> VerifyResult:
    """Run A (reference) and B (candidate) on the same inputs and compare outputs by name.

    `inputs` is a dict or an `.npz` path keyed by input name; otherwise random inputs are drawn
    from A's signature (`samples` trials, seeds `seed`, `seed+1`, …; metrics are worst-case).
    `exact=True` ignores atol/rtol and allows float rounding only (for data-movement
    rewrites). Every failure to load, feed or run a model raises `VerifyError` naming model A
    or B; mismatching outputs (including different shapes) are a failed result, not an
    exception.
    """
    if samples < 1:
        raise VerifyError(f"samples must be at least 1 (got {samples})")
    if not all(math.isfinite(t) and t >= 0 for t in (atol, rtol)):  # NaN passes any `<`
        raise VerifyError(f"tolerances must be finite and non-negative (atol={atol}, rtol={rtol})")
    if seed < 0:
        raise VerifyError(f"seed must be 0 or more (got {seed})")
    proto_a, proto_b = _load(model_a, "A"), _load(model_b, "B")
    name_a, name_b = _describe(model_a), _describe(model_b)
    label_a, label_b = f"model A ({name_a})", f"model B ({name_b})"
    notes: list[str] = []
    specs: list[InputSpec] = []
    if inputs is not None:
        trials = [
            check_user_inputs(proto_a, load_inputs(inputs, model_input_names(proto_a)), notes)
        ]
        if input_shapes:
            notes.append("input shapes come from the supplied inputs; --input-shape was ignored")
        if samples > 1:
            notes.append(f"supplied inputs are fixed, so {samples} samples were reduced to 1")
    else:
        borrowed = _static_shapes_of_b(proto_a, proto_b, input_shapes or {})
        if borrowed:
            notes.append(
                "model A's dynamic input(s) take model B's static shape: "
                + ", ".join(f"{k}={shape_text(v)}" for k, v in borrowed.items())
            )
            input_shapes = {**borrowed, **(input_shapes or {})}
        try:
            specs = input_specs(proto_a, input_shapes)
        except ShapeError as exc:
            raise VerifyError(f"{label_a}: {exc.message}", hint=exc.hint) from None
        notes.extend(_spec_notes(specs))
        trials = [generate_inputs(specs, seed + k) for k in range(samples)]
    session_a = ort_session(proto_a, label=label_a)
    session_b = ort_session(proto_b, label=label_b)
    _check_b_inputs(session_b, trials[0], label_b, notes)
    names_a = [o.name for o in session_a.get_outputs()]
    names_b = [o.name for o in session_b.get_outputs()]
    pairs = match_outputs(names_a, names_b, output_map)
    if not pairs:
        raise VerifyError(
            "the models have no outputs in common",
            hint=f"A: {', '.join(names_a)}; B: {', '.join(names_b)}; pair them with --map A_OUT=B_OUT",
        )
    notes.extend(_pairing_notes(pairs, names_a, names_b))
    worst: dict[str, OutputComparison] = {}
    for feed in trials:
        feed_b = _cast_for(session_b, feed)
        out_a = run_model(session_a, feed, label=label_a)
        out_b = run_model(session_b, feed_b, label=label_b)
        for a, b, how in pairs:
            cmp = compare_arrays(
                out_a[a],
                out_b[b],
                atol=atol,
                rtol=rtol,
                exact=exact,
                name=a,
                name_b=b,
                matched_by=how,
            )
            worst[a] = _merge(worst[a], cmp) if a in worst else cmp
    outputs = [worst[a] for a, _, _ in pairs]
    passed = all(o.passed for o in outputs)
    if not passed and not exact:
        notes.extend(_quantization_notes(proto_a, proto_b))
    return VerifyResult(
        passed=passed,
        model_a=name_a,
        model_b=name_b,
        mode="exact" if exact else "tolerance",
        atol=float(atol),
        rtol=float(rtol),
        seed=seed,
        samples=len(trials),
        outputs=outputs,
        inputs=specs,
        notes=notes,
    )


def _quantization_notes(proto_a: onnx.ModelProto, proto_b: onnx.ModelProto) -> list[str]:
    """Why a float model and its quantized form fail tolerances made for rewrites."""
    from surgery.graph import GraphView
    from surgery.qdq import is_qdq

    quantized = [name for name, p in (("A", proto_a), ("B", proto_b)) if is_qdq(GraphView(p))]
    if len(quantized) != 1:
        return []
    return [
        f"model {quantized[0]} is quantized and the other is not: int8 rounding is beyond "
        "tolerances made for rewrites; judge it by cosine and SQNR (as `surgery quantize` "
        "reports them), or pass --atol/--rtol as wide as the quantization's error"
    ]


def _static_shapes_of_b(
    proto_a: onnx.ModelProto, proto_b: onnx.ModelProto, given: Mapping[str, Sequence[int]]
) -> dict[str, list[int]]:
    """B's declared shape for each input A declares with dynamic dims (same name, same rank,
    the same fixed dims) and the caller did not size: verifying a model against its
    shape-fixed version should feed both that shape, not A's dynamic dims as 1."""
    shapes_b = {vi.name: shape_from_type(vi.type)[1] for vi in _shaped_inputs(proto_b, {})}
    borrowed: dict[str, list[int]] = {}
    for vi in _shaped_inputs(proto_a, {}):
        _, dims_a = shape_from_type(vi.type)
        dims_b = shapes_b.get(vi.name)
        if vi.name in given or dims_a is None or dims_b is None or len(dims_a) != len(dims_b):
            continue
        static_b = all(isinstance(d, int) for d in dims_b)
        agree = all(not isinstance(a, int) or a == b for a, b in zip(dims_a, dims_b, strict=True))
        if static_b and agree and not all(isinstance(d, int) for d in dims_a):
            borrowed[vi.name] = [int(d) for d in dims_b]  # type: ignore[arg-type]
    return borrowed


def _describe(source: ModelSource) -> str:
    if isinstance(source, onnx.ModelProto):
        return f"<ModelProto {source.graph.name or 'unnamed'}>"
    return str(source)


def _load(source: ModelSource, which: str) -> onnx.ModelProto:
    """Load and validate; any load problem becomes a VerifyError that says which model, with
    the load error's code (a missing file is `file_not_found` in every command's JSON)."""
    try:
        return load_model(source, infer_shapes=False)
    except SurgeryError as exc:
        error = VerifyError(f"model {which}: {exc.message}", hint=exc.hint)
        error.code = exc.code
        raise error from exc


def _check_b_inputs(
    session: ort.InferenceSession, feed: Mapping[str, np.ndarray], label: str, notes: list[str]
) -> None:
    missing = [i.name for i in session.get_inputs() if i.name not in feed]
    if missing:
        raise VerifyError(
            f"{label} needs input(s) {', '.join(map(repr, missing))} that model A does not have",
            hint=f"A's inputs: {', '.join(feed) or '(none)'}",
        )
    for meta in session.get_inputs():
        dtype = _ort_dtype(meta.type)
        if dtype is not None and feed[meta.name].dtype != dtype:
            notes.append(
                f"input {meta.name!r} cast from {feed[meta.name].dtype} to {dtype} for model B"
            )
    unused = sorted(set(feed) - {i.name for i in session.get_inputs()})
    if unused:
        notes.append(f"model B does not take input(s) {', '.join(unused)}")


def _cast_for(
    session: ort.InferenceSession, feed: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """The same values, cast where B declares a different element type than A."""
    out = dict(feed)
    for meta in session.get_inputs():
        dtype = _ort_dtype(meta.type)
        if dtype is not None and out[meta.name].dtype != dtype:
            out[meta.name] = out[meta.name].astype(dtype)
    return out


_ORT_TYPES = {
    "tensor(float)": np.float32,
    "tensor(double)": np.float64,
    "tensor(float16)": np.float16,
    "tensor(int8)": np.int8,
    "tensor(int16)": np.int16,
    "tensor(int32)": np.int32,
    "tensor(int64)": np.int64,
    "tensor(uint8)": np.uint8,
    "tensor(uint16)": np.uint16,
    "tensor(uint32)": np.uint32,
    "tensor(uint64)": np.uint64,
    "tensor(bool)": np.bool_,
}


def _ort_dtype(type_name: str) -> np.dtype | None:
    dtype = _ORT_TYPES.get(type_name)
    return np.dtype(dtype) if dtype is not None else None


def _spec_notes(specs: Sequence[InputSpec]) -> list[str]:
    notes = []
    for s in specs:
        if s.dynamic_dims:
            dims = ", ".join(str(i) for i in s.dynamic_dims)
            notes.append(
                f"input {s.name!r}: unknown dim(s) {dims} set to 1 (shape {list(s.shape)}); "
                "use --input-shape NAME=DIMS to choose"
            )
        if s.range_source:
            notes.append(f"input {s.name!r}: random ids in [0, {s.high:g}) ({s.range_source})")
    return notes


def _pairing_notes(
    pairs: Sequence[tuple[str, str, str]], names_a: Sequence[str], names_b: Sequence[str]
) -> list[str]:
    notes = [
        f"output {a!r} of A compared with {b!r} of B by position (names differ)"
        for a, b, how in pairs
        if how == "position"
    ]
    used_a = {a for a, _, _ in pairs}
    used_b = {b for _, b, _ in pairs}
    if unmatched := [n for n in names_a if n not in used_a]:
        notes.append(f"not compared, only in A: {', '.join(unmatched)}")
    if unmatched := [n for n in names_b if n not in used_b]:
        notes.append(f"not compared, only in B: {', '.join(unmatched)}")
    return notes


__all__ = [
    "InputSpec",
    "OutputComparison",
    "VerifyResult",
    "compare_arrays",
    "generate_inputs",
    "input_specs",
    "check_user_inputs",
    "model_input_names",
    "load_inputs",
    "make_inputs",
    "match_outputs",
    "ort_session",
    "run_model",
    "verify_models",
]
