"""Shared builders for the integer reference executor tests (no tests here).

Float models are written with onnx.helper and quantized by ONNX Runtime's `quantize_static`
(an independent QDQ producer); ONNX Runtime then runs the QDQ model as written (graph
optimisations off: dequantize, float op, quantize) as the float-simulated reference.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper
from onnxruntime.quantization import (
    CalibrationDataReader,
    QuantFormat,
    QuantType,
    quantize_static,
)

from compiler.runtime import IntegerExecutor

Feeds = dict[str, np.ndarray]


def float_model(
    nodes: Sequence[onnx.NodeProto],
    inputs: dict[str, Sequence[int]],
    outputs: Sequence[str],
    initializers: dict[str, np.ndarray] | None = None,
    opset: int = 17,
) -> onnx.ModelProto:
    """A float32 model; outputs are declared without shapes."""
    graph = helper.make_graph(
        list(nodes),
        "test",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(s)) for n, s in inputs.items()],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs],
        initializer=[numpy_helper.from_array(v, n) for n, v in (initializers or {}).items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 9
    return model


def random_feeds(
    model: onnx.ModelProto, rng: np.random.Generator, count: int, scale: float = 1.0
) -> list[Feeds]:
    """`count` sets of normal random float32 inputs for every graph input."""
    shapes = {
        i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input
    }
    return [
        {
            name: (scale * rng.standard_normal(shape)).astype(np.float32)
            for name, shape in shapes.items()
        }
        for _ in range(count)
    ]


class _Reader(CalibrationDataReader):
    def __init__(self, feeds: list[Feeds]) -> None:
        self._feeds = iter(feeds)

    def get_next(self) -> Feeds | None:
        return next(self._feeds, None)


def ort_quantize(
    model: onnx.ModelProto,
    calibration: list[Feeds],
    *,
    per_channel: bool = True,
    activation_type: QuantType = QuantType.QInt8,
    weight_type: QuantType = QuantType.QInt8,
    op_types: Sequence[str] | None = None,
    nodes_to_exclude: Sequence[str] | None = None,
    extra_options: dict | None = None,
) -> onnx.ModelProto:
    """QDQ model produced by onnxruntime.quantization.quantize_static (MinMax calibration).

    ForceQuantizeNoInputCheck makes ORT wrap data movement and pooling ops even when their input
    comes straight from a graph input, so single-op models are quantized too.
    """
    with tempfile.TemporaryDirectory() as folder:
        source, target = Path(folder) / "float.onnx", Path(folder) / "qdq.onnx"
        onnx.save(model, source)
        logging.disable(logging.WARNING)  # ORT's "consider pre-processing" advice, every call
        try:
            quantize_static(
                str(source),
                str(target),
                _Reader(calibration),
                quant_format=QuantFormat.QDQ,
                per_channel=per_channel,
                activation_type=activation_type,
                weight_type=weight_type,
                op_types_to_quantize=list(op_types) if op_types else None,
                nodes_to_exclude=list(nodes_to_exclude) if nodes_to_exclude else None,
                extra_options={"ForceQuantizeNoInputCheck": True, **(extra_options or {})},
            )
        finally:
            logging.disable(logging.NOTSET)
        return onnx.load(target)


def ort_run(model: onnx.ModelProto, feeds: Feeds) -> dict[str, np.ndarray]:
    """ONNX Runtime on the QDQ graph exactly as written (no QDQ fusion into integer kernels)."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(None, feeds), strict=True))


def steps_apart(
    executor: IntegerExecutor, model: onnx.ModelProto, feeds: list[Feeds]
) -> dict[str, int]:
    """Largest difference, in output quantization steps, between the executor and ORT."""
    worst: dict[str, int] = {}
    for feed in feeds:
        ours = executor.run(feed)
        theirs = ort_run(model, feed)
        for name, value in ours.items():
            scale = executor.output_params[name].scalar_scale()
            steps = int(np.rint(np.max(np.abs(value - theirs[name]), initial=0.0) / scale))
            worst[name] = max(worst.get(name, 0), steps)
    return worst


def quantized_single_op(
    node: onnx.NodeProto,
    inputs: dict[str, Sequence[int]],
    initializers: dict[str, np.ndarray] | None = None,
    *,
    rng: np.random.Generator,
    opset: int = 17,
    positive: bool = False,
    **quantize_options,
) -> tuple[onnx.ModelProto, list[Feeds]]:
    """One float op quantized by ORT, plus fresh random test inputs (|x| + 0.5 if `positive`)."""
    model = float_model([node], inputs, list(node.output), initializers, opset)
    calibration, tests = random_feeds(model, rng, 8), random_feeds(model, rng, 3)
    if positive:
        calibration, tests = (
            [{k: np.abs(v) + np.float32(0.5) for k, v in feed.items()} for feed in feeds]
            for feeds in (calibration, tests)
        )
    qdq = ort_quantize(model, calibration, **quantize_options)
    return qdq, tests
