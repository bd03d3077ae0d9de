"""One pass over the calibration data, in memory that does not grow with the number of samples.

The float model runs in ONNX Runtime with the tensors to be quantized exposed as extra outputs
(only those). Each run's arrays update the observers and are dropped. When the exposed tensors of
one run would exceed half of `max_output_bytes`, they are fetched in groups (one `run` per group,
same session), trading compute for a bounded peak.

The observers of run k are updated by worker threads while ONNX Runtime computes run k + 1 and
the next sample is read (ONNX Runtime and NumPy's ufuncs release the GIL). A run's tensors are
shared out among the workers by size, every tensor to one worker; the next run is handed over
only when all of them are done. At most two runs' arrays are alive — hence half the budget per
run — and each observer still sees the samples one at a time and in order, so the ranges are
exactly those of a sequential pass.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort

from compiler.quantize.errors import CalibrationDataError, QuantizationError
from compiler.quantize.observers import Observer
from compiler.quantize.samples import SamplePasses, as_feed, input_signature
from compiler.runtime.parallel import usable_cpus
from surgery.errors import SurgeryError, first_line
from surgery.graph import GraphView
from surgery.verify import ort_session

__all__ = [
    "DEFAULT_MAX_OUTPUT_BYTES",
    "Progress",
    "calibrate",
    "float_session",
    "output_groups",
    "reference_session",
    "with_outputs",
]

Progress = Callable[[int, int | None], None]
DEFAULT_MAX_OUTPUT_BYTES = 1 << 30
"""Budget for the exposed tensors of a single ORT run (1 GiB)."""

OBSERVER_THREADS = max(1, min(4, usable_cpus()))
"""Threads updating observers. Binning is most of calibration's time (PP-OCRv4 at 320²: ~0.19 s
of observer updates vs ~0.05 s of ONNX Runtime per sample), and its ufuncs release the GIL."""

Run = tuple[Sequence[str], Sequence[np.ndarray]]


@dataclass
class CalibrationStats:
    samples: int
    runs_per_sample: int


def float_session(model: onnx.ModelProto, outputs: list[str]) -> ort.InferenceSession:
    """A CPU session of `model` that also returns the intermediate tensors `outputs`.

    Its intra-op threads sleep instead of spinning between runs: during calibration the observer
    thread needs the cores ONNX Runtime's idle workers would otherwise spin on."""
    return reference_session(
        with_outputs(model, outputs),
        config={"session.intra_op.allow_spinning": "0"},
        label="the float model",
    )


def with_outputs(model: onnx.ModelProto, names: Iterable[str]) -> onnx.ModelProto:
    """A copy of `model` that also returns the tensors `names` (each once) as graph outputs."""
    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    existing = {o.name for o in exposed.graph.output}
    for name in names:
        if name not in existing:
            exposed.graph.output.append(onnx.helper.make_empty_tensor_value_info(name))
            existing.add(name)
    return exposed


_CANNOT_LOAD = "ONNX Runtime cannot load it: "
"""How `surgery.verify.ort_session` words a model ONNX Runtime rejects, after its label."""


def reference_session(
    model: onnx.ModelProto,
    *,
    config: Mapping[str, str] | None = None,
    label: str = "the model",
) -> ort.InferenceSession:
    """A CPU session that simulates Q/DQ in float instead of fusing them into int8 kernels.

    ONNX Runtime's default optimizations turn DQ → Conv → Q into QLinearConv; its x86 int8
    kernels round differently (per-channel u8s8 loses ~7 dB SQNR on MobileNetV2), so they are
    not the reference the integer executor and the emulator are held to. `label` says which
    model a failure is about ("the float model", "the quantized model").
    """
    try:
        return ort_session(model, label=label, config=config)
    except SurgeryError as exc:
        message, prefix = exc.message, f"{label}: {_CANNOT_LOAD}"
        if message.startswith(prefix):  # once: "ONNX Runtime cannot load the quantized model"
            message = f"ONNX Runtime cannot load {label}: {message.removeprefix(prefix)}"
        raise QuantizationError(message, hint=exc.hint) from None


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
    groups = output_groups(model, exposed, max_output_bytes // 2) if exposed else []
    session = float_session(model, exposed) if exposed else None
    done = 0
    with ThreadPoolExecutor(max_workers=OBSERVER_THREADS, thread_name_prefix="observers") as worker:
        pending: list[Future[None]] = []
        for sample in data.new_pass():
            feed = as_feed(sample, signature, done)
            runs: list[Run] = [(from_inputs, [feed[name] for name in from_inputs])]
            for group in groups:
                assert session is not None
                runs.append((group, _run(session, group, feed, done)))
                pending = _hand_over(worker, pending, observers, runs, done)
                runs = []
            pending = _hand_over(worker, pending, observers, runs, done)
            del feed, sample
            done += 1
            if progress is not None:
                progress(done, data.total)
        _wait(pending)
    if done == 0:
        raise CalibrationDataError("the calibration data yielded no samples")
    return CalibrationStats(done, len(groups))


def _run(
    session: ort.InferenceSession, names: list[str], feed: Mapping[str, np.ndarray], index: int
) -> list[np.ndarray]:
    try:
        return [np.asarray(v) for v in session.run(names, dict(feed))]
    except Exception as exc:  # ORT raises its own exception types
        raise CalibrationDataError(
            f"calibration sample {index}: ONNX Runtime failed: {first_line(exc)}"
        ) from None


def _hand_over(
    worker: ThreadPoolExecutor,
    pending: list[Future[None]],
    observers: Mapping[str, list[Observer]],
    runs: list[Run],
    sample: int,
) -> list[Future[None]]:
    """Wait for the previous update (at most two runs' arrays alive, observers fed in order) and
    start observing `runs` (of calibration sample `sample`) in the workers; an exception of the
    previous update surfaces here."""
    if not runs:
        return pending
    _wait(pending)
    shares = _shares(runs, OBSERVER_THREADS)
    return [worker.submit(_observe, observers, share, sample) for share in shares]


def _wait(pending: list[Future[None]]) -> None:
    for future in pending:
        future.result()


def _shares(runs: list[Run], count: int) -> list[list[Run]]:
    """Split the runs' tensors into up to `count` shares of similar size (largest first into
    the lightest share); each tensor, with all its observers, goes to exactly one share."""
    items = sorted(
        (
            (name, value)
            for names, values in runs
            for name, value in zip(names, values, strict=True)
        ),
        key=lambda item: -item[1].size,
    )
    shares: list[tuple[list[str], list[np.ndarray]]] = [([], []) for _ in range(max(1, count))]
    loads = [0] * len(shares)
    for name, value in items:
        k = loads.index(min(loads))
        shares[k][0].append(name)
        shares[k][1].append(value)
        loads[k] += value.size
    return [[share] for share in shares if share[0]]


def _observe(observers: Mapping[str, list[Observer]], runs: list[Run], sample: int) -> None:
    """Feed the observers; a NaN is refused: no range can be fitted to it, and it means the
    float model itself fails on the sample (an attention mask of other values than 0 and 1
    turns BERT's (1 − mask)·finfo.min into inf, then NaN)."""
    for names, values in runs:
        for name, value in zip(names, values, strict=True):
            if value.dtype.kind == "f" and value.size and np.isnan(value.max()):  # max keeps NaN
                raise CalibrationDataError(
                    f"calibration sample {sample}: tensor {name!r} holds NaN (the float "
                    "model's value on this sample), so no range can be fitted",
                    hint="check the sample against what the model expects (value ranges, "
                    "normalisation; attention masks hold 0 and 1): run the float model on it "
                    "with ONNX Runtime",
                )
            for obs in observers[name]:
                obs.update(value)
