"""A pooling window wider than its padded input (a small input shape): ONNX Runtime pools the
part that exists, the MLA whole windows only, so the pool runs on the host and the pipeline
gives ONNX Runtime's values, where the emulator refused the compiled program."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from surgery.check import check_model


def _conv_pool_conv(width: int, **pool_attrs) -> onnx.ModelProto:
    """Conv → MaxPool 2×2 stride 2 → Conv on a 1×3×8×`width` input."""
    rng = np.random.default_rng(0)
    weights = [
        numpy_helper.from_array(rng.standard_normal((4, 3, 1, 1)).astype(np.float32), "w1"),
        numpy_helper.from_array(rng.standard_normal((4, 4, 1, 1)).astype(np.float32), "w2"),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["a"], name="conv1"),
        helper.make_node(
            "MaxPool", ["a"], ["b"], name="pool", kernel_shape=[2, 2], strides=[2, 2], **pool_attrs
        ),
        helper.make_node("Conv", ["b", "w2"], ["y"], name="conv2"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=weights,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("target", ["mlsoc", "modalix", "rk3588"])
def test_a_window_wider_than_the_padded_input_keeps_the_pool_off_the_mla(target):
    report = check_model(_conv_pool_conv(width=1), target)
    (blocker,) = report.blockers
    assert blocker.name == "pool"
    assert [r.code for r in blocker.reasons] == ["window"]
    assert (
        "window of 2 is wider than input 'a' padded along axis 3 (1)" in blocker.reasons[0].message
    )


def test_a_window_that_fits_leaves_the_pool_on_the_mla():
    assert check_model(_conv_pool_conv(width=2)).blocker_names == frozenset()


def test_padding_that_makes_the_window_fit_leaves_the_pool_on_the_mla():
    model = _conv_pool_conv(width=1, pads=[0, 0, 0, 1])
    assert check_model(model).blocker_names == frozenset()


def test_ceil_mode_pads_the_last_window_and_leaves_the_pool_on_the_mla():
    assert check_model(_conv_pool_conv(width=1, ceil_mode=1)).blocker_names == frozenset()


def test_the_pipeline_runs_the_overhanging_pool_on_the_host_bit_exactly(tmp_path):
    from compiler.archive import read_archive
    from compiler.compile import compile_model
    from compiler.quantize import quantize_model
    from compiler.runtime.compare import compare_with_reference
    from compiler.runtime.pipeline import run_archive
    from surgery.verify import make_inputs

    model = _conv_pool_conv(width=1)
    qdq = quantize_model(model, [make_inputs(model, seed=s) for s in range(2)]).model
    result = compile_model(qdq, tmp_path)
    assert len(result.elf_files) == check_model(model).mla_segments == 2
    archive = read_archive(result.archive)
    feed = make_inputs(model, seed=9)
    outputs, stats = run_archive(archive, feed, keep_tensors=True)
    assert compare_with_reference(archive.manifest, qdq, feed, outputs, stats.tensors).mla_bit_exact


def _qdq_pool(op: str, **attrs) -> onnx.ModelProto:
    """Q → DQ → a 2×2 stride-2 pool → Q → DQ over a 1×2×4×1 input (the window overhangs)."""
    scale = numpy_helper.from_array(np.array(0.05, np.float32), "s")
    zero = numpy_helper.from_array(np.array(3, np.int8), "z")
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
        helper.make_node(op, ["xd"], ["p"], kernel_shape=[2, 2], strides=[2, 2], **attrs),
        helper.make_node("QuantizeLinear", ["p", "s", "z"], ["pq"]),
        helper.make_node("DequantizeLinear", ["pq", "s", "z"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 4, 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=[scale, zero],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize(
    ("op", "attrs", "codes_apart"),
    [
        ("MaxPool", {}, 0),
        ("AveragePool", {"count_include_pad": 1}, 0),  # the overhang counts, as padding does
        ("AveragePool", {}, 1),  # integer rounding of the mean, as without an overhang
    ],
)
def test_the_integer_pools_compute_an_overhanging_window_as_onnx_runtime(op, attrs, codes_apart):
    import onnxruntime as ort

    from compiler.runtime.reference import IntegerExecutor

    model = _qdq_pool(op, **attrs)
    x = np.random.default_rng(0).uniform(-3, 3, (1, 2, 4, 1)).astype(np.float32)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    expected = session.run(None, {"x": x})[0]
    got = np.asarray(IntegerExecutor(model).run({"x": x})["y"])
    assert got.shape == expected.shape == (1, 2, 2, 1)
    assert np.abs(got - expected).max() <= codes_apart * 0.05 + 1e-6
