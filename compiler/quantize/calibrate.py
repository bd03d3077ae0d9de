"""One pass over the calibration data, in memory that does not grow with the number of samples.

The float model runs in ONNX Runtime with the tensors to be quantized exposed as extra outputs
(only those). Each sample's arrays update the observers and are dropped before the next sample
is read. When the exposed tensors of one run would exceed `max_output_bytes`, they are fetched in
groups (one `run` per group, same session), trading compute for a bounded peak.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort

from compiler.quantize.errors import CalibrationDataError, QuantizationError
from compiler.quantize.observers import Observer
from compiler.quantize.samples import SamplePasses, as_feed, input_signature
from surgery.errors import SurgeryError
from surgery.graph import GraphView
from surgery.verify import ort_session

__all__ = [
    "DEFAULT_MAX_OUTPUT_BYTES",
    "Progress",
    "calibrate",
    "float_session",
    "output_groups",
    "reference_session",
]

Progress = Callable[[int, int | None], None]
DEFAULT_MAX_OUTPUT_BYTES = 1 << 30
"""Budget for the exposed tensors of a single ORT run (1 GiB)."""


@dataclass
class CalibrationStats:
    samples: int
    runs_per_sample: int


def float_session(model: onnx.ModelProto, outputs: list[str]) -> ort.InferenceSession:
    """A CPU session of `model` that also returns the intermediate tensors `outputs`."""
    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    existing = {o.name for o in exposed.graph.output}
    for name in outputs:
        if name not in existing:
            exposed.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
    return reference_session(exposed)


def reference_session(model: onnx.ModelProto) -> ort.InferenceSession:
    """A CPU session that simulates Q/DQ in float instead of fusing them into int8 kernels.

    ONNX Runtime's default optimizations turn DQ → Conv → Q into QLinearConv; its x86 int8
    kernels round differently (per-channel u8s8 loses ~7 dB SQNR on MobileNetV2), so they are
    not the reference the integer executor and the emulator are held to.
    """
    try:
        return ort_session(model, label="ONNX Runtime")
    except SurgeryError as exc:
        raise QuantizationError(exc.message) from None


def output_groups(model: onnx.ModelProto, tensors: list[str], max_bytes: int) -> list[list[str]]:
    """Split `tensors` into groups whose static sizes fit `max_bytes` (unknown sizes count 0)."""
    view = GraphView(model)
    groups: list[list[str]] = [[]]
    used = 0
    for name in tensors:
        n = view.tensor(name).num_elements or 0
        size = 4 * n
        if groups[-1] and used + size > max_bytes:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += size
    return [g for g in groups if g]


def calibrate(
    model: onnx.ModelProto,
    observers: Mapping[str, list[Observer]],
    data: SamplePasses,
    *,
    progress: Progress | None = None,
    max_output_bytes: int = DEFAULT_MAX_OUTPUT_BYTES,
) -> CalibrationStats:
    """Feed every sample through `model`, updating `observers` (tensor name → its observers)."""
    signature = input_signature(model)
    from_inputs = [t for t in observers if t in signature.names]
    exposed = [t for t in observers if t not in signature.names]
    groups = output_groups(model, exposed, max_output_bytes) if exposed else []
    session = float_session(model, exposed) if exposed else None
    done = 0
    for sample in data.new_pass():
        feed = as_feed(sample, signature, done)
        for name in from_inputs:
            for obs in observers[name]:
                obs.update(feed[name])
        for group in groups:
            assert session is not None
            try:
                values = session.run(group, feed)
            except Exception as exc:  # ORT raises its own exception types
                raise CalibrationDataError(
                    f"calibration sample {done}: ONNX Runtime failed: {str(exc).splitlines()[0][:300]}"
                ) from None
            for name, value in zip(group, values, strict=True):
                for obs in observers[name]:
                    obs.update(np.asarray(value))
            del values
        del feed, sample
        done += 1
        if progress is not None:
            progress(done, data.total)
    if done == 0:
        raise CalibrationDataError("the calibration data yielded no samples")
    return CalibrationStats(done, len(groups))
