"""Calibration samples as the quantizer consumes them: one feed dict at a time, never a list.

Accepted data: any iterable of samples (a generator works), or a callable returning a fresh
iterable. A sample is a {input name: array} mapping, a bare array (single-input models) or a
sequence of arrays in input order. Bias correction needs a second pass, which a generator cannot
give; lists, `load_calibration_data` datasets and callables can.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import onnx

from compiler.quantize.errors import CalibrationDataError, QuantizationError

__all__ = ["CalibrationData", "InputSignature", "SamplePasses", "as_feed", "input_signature"]

Sample = Mapping[str, np.ndarray] | np.ndarray | Sequence[np.ndarray]
CalibrationData = Iterable[Any] | Callable[[], Iterable[Any]]


_NON_TENSOR_KINDS = {
    "sequence_type": "a sequence",
    "map_type": "a map",
    "optional_type": "an optional",
    "sparse_tensor_type": "a sparse tensor",
}


def non_tensor_input_error(model: onnx.ModelProto) -> QuantizationError | None:
    """The error for the first graph input that is not a dense tensor (a sequence, map,
    optional or sparse tensor), or None: calibration samples are tensors, and so are the
    buffers of the compiled pipeline."""
    inits = {t.name for t in model.graph.initializer}
    for vi in model.graph.input:
        kind = _NON_TENSOR_KINDS.get(vi.type.WhichOneof("value") or "")
        if vi.name not in inits and kind is not None:
            return QuantizationError(
                f"input {vi.name!r} is {kind}, not a tensor; the pipeline takes tensors",
                hint="cut the part that reads it off the model (surgery split) and quantize "
                "the tensor part",
            )
    return None


class InputSignature:
    """Names, dtypes and static shapes (None for dynamic dims) of a model's graph inputs."""

    def __init__(self, model: onnx.ModelProto) -> None:
        error = non_tensor_input_error(model)
        if error is not None:
            raise error
        inits = {t.name for t in model.graph.initializer}
        self.names: list[str] = []
        self.dtypes: dict[str, np.dtype] = {}
        self.shapes: dict[str, tuple[int | None, ...] | None] = {}
        for vi in model.graph.input:
            if vi.name in inits:
                continue
            tt = vi.type.tensor_type
            self.names.append(vi.name)
            self.dtypes[vi.name] = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type or 1))
            if tt.HasField("shape"):
                self.shapes[vi.name] = tuple(
                    d.dim_value if d.dim_value > 0 else None for d in tt.shape.dim
                )
            else:
                self.shapes[vi.name] = None


def input_signature(model: onnx.ModelProto) -> InputSignature:
    return InputSignature(model)


def as_feed(sample: Any, signature: InputSignature, index: int) -> dict[str, np.ndarray]:
    """One sample as a feed dict with the model's dtypes; shape and name problems are errors."""
    names = signature.names
    if isinstance(sample, Mapping):
        missing = [n for n in names if n not in sample]
        if missing:
            raise CalibrationDataError(
                f"calibration sample {index} has no value for input(s) {', '.join(map(repr, missing))}",
                hint=f"the model's inputs are: {', '.join(names)}; the sample has: {', '.join(map(str, sample))}",
            )
        raw = {n: sample[n] for n in names}
    elif isinstance(sample, np.ndarray):
        if len(names) != 1:
            raise CalibrationDataError(
                f"calibration sample {index} is a bare array, but the model has {len(names)} inputs",
                hint="give each sample as a dict {input name: array}",
            )
        raw = {names[0]: sample}
    elif isinstance(sample, Sequence) and not isinstance(sample, str | bytes):
        if len(sample) != len(names):
            raise CalibrationDataError(
                f"calibration sample {index} has {len(sample)} arrays; the model has {len(names)} inputs ({', '.join(names)})"
            )
        raw = dict(zip(names, sample, strict=True))
    else:
        raise CalibrationDataError(
            f"calibration sample {index} is a {type(sample).__name__}; expected a dict of arrays, an array "
            "or a sequence of arrays"
        )
    return {n: _conform(n, np.asarray(v), signature, index) for n, v in raw.items()}


def _conform(name: str, value: np.ndarray, signature: InputSignature, index: int) -> np.ndarray:
    dtype = signature.dtypes[name]
    if value.dtype != dtype:
        if value.dtype.kind not in "fiub" or (dtype.kind != "f" and value.dtype.kind == "f"):
            raise CalibrationDataError(
                f"calibration sample {index}: input {name!r} is {value.dtype}, the model takes {dtype}"
            )
        value = value.astype(dtype)
    shape = signature.shapes.get(name)
    if shape is None:
        return value
    if value.ndim == len(shape) - 1 and shape[0] in (1, None):
        value = value[None]
    if value.ndim != len(shape) or any(
        d is not None and d != v for d, v in zip(shape, value.shape, strict=True)
    ):
        raise CalibrationDataError(
            f"calibration sample {index}: input {name!r} has shape {list(value.shape)}, the model takes "
            f"{[d if d is not None else '?' for d in shape]}"
        )
    return value


class SamplePasses:
    """Gives the quantizer as many passes over the data as the data can give."""

    def __init__(self, data: CalibrationData) -> None:
        if data is None:
            raise CalibrationDataError("no calibration data given")
        self._factory: Callable[[], Iterable[Any]] | None = None
        self._single: Iterable[Any] | None = None
        if callable(data) and not isinstance(data, Iterable):
            self._factory = data
        elif isinstance(data, Iterator):
            self._single = data
        elif isinstance(data, Iterable):
            self._factory = lambda: data
        else:
            raise CalibrationDataError(
                f"calibration data is a {type(data).__name__}; expected an iterable of samples or a callable returning one"
            )
        self.total: int | None = _length(data)
        self._used = False

    @property
    def reiterable(self) -> bool:
        return self._factory is not None

    def new_pass(self) -> Iterator[Any]:
        if self._factory is not None:
            return iter(self._factory())
        if self._used:
            raise CalibrationDataError(
                "the calibration data is a one-shot iterator and was already consumed",
                hint="pass a list, a dataset from load_calibration_data, or a callable returning a fresh iterator",
            )
        self._used = True
        assert self._single is not None
        return iter(self._single)


def _length(data: Any) -> int | None:
    try:
        return len(data)
    except TypeError:
        return None
