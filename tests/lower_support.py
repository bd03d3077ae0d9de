"""Shared builders for the compiler tests (no tests here): QDQ fixtures and segment checks."""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from compiler.archive import read_archive
from compiler.compile import CompileResult, compile_model
from compiler.costmodel import MlaHardware
from compiler.lower.layout import plan_layouts
from compiler.lower.partition import Stage, partition_model, tensor_types
from compiler.lower.pipeline import CompileOptions, generate_segment, prepare_segment
from compiler.quantize.quantizer import quantize_model
from compiler.runtime import IntegerExecutor
from compiler.runtime.compare import ReferenceComparison, compare_with_reference
from compiler.runtime.emulator import Emulator
from compiler.runtime.pipeline import run_archive
from compiler.runtime.program import IntegerStep
from surgery import examples
from surgery.model import load_model
from surgery.verify import make_inputs


@cache
def example_qdq(name: str) -> bytes:
    """An example model (surgery.examples) quantized by the project's quantizer, serialized."""
    model = load_model(examples.EXAMPLES[name]())
    graph_input = model.graph.input[0]
    shape = [d.dim_value for d in graph_input.type.tensor_type.shape.dim]
    rng = np.random.default_rng(0)
    data = [{graph_input.name: rng.standard_normal(shape).astype(np.float32)} for _ in range(4)]
    return quantize_model(model, data, target="mlsoc").model.SerializeToString()


def compile_configured(model, out, name: str, strategy: str, order: str, batch: int, tessellate):
    """`compile_model` in one configuration of the compiler issue's acceptance matrix."""
    return compile_model(
        model,
        out,
        model_name=name,
        batch_size=batch,
        memory_plan_strategy=strategy,
        compute_order=order,
        tessellate_parameters=tessellate,
    )


def load_example(name: str) -> onnx.ModelProto:
    return onnx.load_from_string(example_qdq(name))


def input_frames(model: onnx.ModelProto, frames: int, seed: int = 1) -> dict[str, np.ndarray]:
    """`frames` random frames per graph input, stacked on axis 0."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for info in model.graph.input:
        shape = [d.dim_value for d in info.type.tensor_type.shape.dim]
        shape[0] *= frames
        feeds[info.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def reference_outputs(model: onnx.ModelProto, feeds: dict[str, np.ndarray], frames: int):
    """IntegerExecutor.run frame by frame, outputs stacked."""
    executor = IntegerExecutor(model)
    results: dict[str, list[np.ndarray]] = {}
    for k in range(frames):
        frame = {}
        for info in model.graph.input:
            head = info.type.tensor_type.shape.dim[0].dim_value
            frame[info.name] = feeds[info.name][k * head : (k + 1) * head]
        for name, value in executor.run(frame).items():
            results.setdefault(name, []).append(value)
    return {name: np.concatenate(parts) for name, parts in results.items()}


def qdq_op(
    node: onnx.NodeProto,
    shape: Sequence[int],
    *,
    initializers: dict[str, np.ndarray] | None = None,
    in_scale: float = 0.05,
    out_scale: float = 0.05,
    zero_point: int = 3,
    opset: int = 17,
) -> onnx.ModelProto:
    """x -> Q -> DQ -> node -> Q -> DQ -> y by hand (int8), for ops quantizers do not wrap."""
    inits = {
        "s_in": np.array(in_scale, np.float32),
        "s_out": np.array(out_scale, np.float32),
        "z": np.array(zero_point, np.int8),
        **(initializers or {}),
    }
    op = helper.make_node(
        node.op_type,
        ["x_dq", *node.input[1:]],
        ["y_f"],
        **{a.name: helper.get_attribute_value(a) for a in node.attribute},
    )
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s_in", "z"], ["x_q"], name="q_in"),
        helper.make_node("DequantizeLinear", ["x_q", "s_in", "z"], ["x_dq"], name="dq_in"),
        op,
        helper.make_node("QuantizeLinear", ["y_f", "s_out", "z"], ["y_q"], name="q_out"),
        helper.make_node("DequantizeLinear", ["y_q", "s_out", "z"], ["y"], name="dq_out"),
    ]
    op.name = "op"
    graph = helper.make_graph(
        nodes,
        "qdq_op",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 9
    return model


def emulate_all_integer_steps(
    model: onnx.ModelProto,
    feeds: list[dict[str, np.ndarray]],
    *,
    batch: int = 1,
    strategy: str = "BestFit",
    order: str = "WidthFirst",
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Compile every integer step of `model` as one MLA segment, whatever the target says.

    This tests code generation independently of placement. Returns, per segment output,
    (emulator result, IntegerExecutor result) over the `batch` frames of `feeds`.
    """
    partition = partition_model(model, "mlsoc")
    steps = [s for stage in partition.stages for s in stage.steps if isinstance(s, IntegerStep)]
    assert steps, "the model has no integer step"
    produced = {n for s in steps for n in s.outputs if n}
    read = [n for s in steps for n in s.inputs if n]
    inputs = tuple(
        dict.fromkeys(n for n in read if n not in produced and n not in partition.constants)
    )
    read_outside = {
        n
        for stage in partition.stages
        for s in stage.steps
        if not isinstance(s, IntegerStep)
        for n in getattr(s, "inputs", (getattr(s, "input", ""),))
    }
    outputs = tuple(
        n
        for s in steps
        for n in s.outputs
        if n and (n in read_outside or n in partition.output_names)
    )
    stage = Stage("MLA_0", "MLA", "mla", tuple(steps), inputs, outputs)
    partition.stages = [stage]
    types = tensor_types(partition)
    layouts = plan_layouts(partition, {n: t.shape for n, t in types.items()}, {})
    options = CompileOptions(memory_plan_strategy=strategy, compute_order=order)
    prep = prepare_segment(stage, partition, types, order)
    plan = prep.plan(batch, strategy, None)
    hardware = MlaHardware()
    segment = generate_segment(
        prep, plan, batch, partition, layouts, types, hardware, 4, "test", options
    )
    executor = IntegerExecutor(model, keep_intermediates=True)
    captured: list[dict[str, np.ndarray]] = []
    for feed in feeds[:batch]:
        executor.run(feed)
        captured.append(dict(executor.intermediates))
    emulator = Emulator(segment.program, hardware)
    results = emulator.run({n: _stack([c[n] for c in captured]) for n in stage.inputs})
    return {n: (results[n], _stack([c[n] for c in captured])) for n in stage.outputs}


def _stack(frames: list[np.ndarray]) -> np.ndarray:
    """Frames stacked on axis 0 (a 0-d frame counts as one element)."""
    return np.concatenate([np.reshape(f, (1,)) if np.ndim(f) == 0 else f for f in frames])


def run_and_compare(
    result: CompileResult, qdq: onnx.ModelProto, feed: dict[str, np.ndarray]
) -> ReferenceComparison:
    """Run a compiled archive on `feed` and compare every MLA stage and output with the
    integer reference executor on the QDQ model it was compiled from."""
    archive = read_archive(result.archive)
    outputs, stats = run_archive(archive, feed, keep_tensors=True)
    return compare_with_reference(archive.manifest, qdq, feed, outputs, stats.tensors)


def quantize_on(model: onnx.ModelProto, target: str, samples: int = 3) -> onnx.ModelProto:
    """The QDQ model for `target`, calibrated on `samples` seeded `make_inputs` frames."""
    frames = [make_inputs(model, seed=seed) for seed in range(samples)]
    return quantize_model(model, frames, target=target).model
