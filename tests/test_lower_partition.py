"""Partition: MLA segments come from coverage of the float view; .elf count == check's count."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from compiler.compile import compile_model
from compiler.lower.partition import partition_model, stage_graph, tensor_types
from compiler.runtime.pipeline import run_archive
from surgery import examples
from surgery.check import check_model
from surgery.coverage import analyze_coverage
from surgery.model import load_model
from surgery.qdq import float_view
from tests.lower_support import input_frames, load_example, reference_outputs
from tests.test_reference_support import float_model, ort_quantize, random_feeds

EXAMPLES = ["plain_cnn", "yolo_head", "yolov5_head", "transformer_block", "cnn_with_topk"]


def test_float_view_drops_activation_qdq_and_keeps_names() -> None:
    qdq = load_example("plain_cnn")
    view = float_view(qdq)
    activation_q = [
        n for n in view.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == "relu_4_out"
    ]
    assert not activation_q
    float_names = {n.name for n in examples.plain_cnn().graph.node}
    assert float_names <= {n.name for n in view.graph.node}
    assert [o.name for o in view.graph.output] == ["logits"]


@pytest.mark.parametrize("name", EXAMPLES)
def test_elf_count_equals_the_segments_check_reports(name: str, tmp_path) -> None:
    float_model_path = tmp_path / "float.onnx"
    import onnx

    onnx.save(examples.EXAMPLES[name](), float_model_path)
    expected = check_model(float_model_path, "mlsoc").mla_segments
    result = compile_model(load_example(name), tmp_path, model_name=name)
    assert len(result.elf_files) == expected == result.mla_segments
    if name == "cnn_with_topk":
        assert expected == 2


def test_two_segments_around_the_apu_node_in_pipeline_order() -> None:
    partition = partition_model(load_example("cnn_with_topk"), "mlsoc")
    kinds = [(s.processor, s.kernel) for s in partition.stages]
    assert kinds == [
        ("CVU", "quantize"),
        ("MLA", "mla"),
        ("CVU", "dequantize"),
        ("APU", "onnx"),
        ("CVU", "quantize"),
        ("MLA", "mla"),
        ("CVU", "dequantize"),
    ]
    assert [s.name for s in partition.mla_stages] == ["MLA_0", "MLA_1"]
    topk = partition.stages[3]
    graph = stage_graph(partition, topk, tensor_types(partition))
    assert [n.op_type for n in graph.graph.node] == ["TopK"]
    assert [i.name for i in graph.graph.input] == list(topk.inputs)


def test_a_node_left_in_float_splits_its_segment_with_a_note(tmp_path) -> None:
    """ORT excludes the middle conv from quantization; coverage still puts it on the MLA."""
    rng = np.random.default_rng(0)
    weights = {
        f"w{k}": (rng.standard_normal((4, 4, 3, 3)) * 0.3).astype(np.float32) for k in range(3)
    }
    nodes = [
        helper.make_node("Conv", ["x", "w0"], ["a"], pads=[1, 1, 1, 1], name="c0"),
        helper.make_node("Conv", ["a", "w1"], ["b"], pads=[1, 1, 1, 1], name="c1"),
        helper.make_node("Conv", ["b", "w2"], ["y"], pads=[1, 1, 1, 1], name="c2"),
    ]
    model = float_model(nodes, {"x": (1, 4, 6, 6)}, ["y"], weights)
    qdq = ort_quantize(model, random_feeds(model, rng, 4), nodes_to_exclude=["c1"])
    assert analyze_coverage(load_model(model), "mlsoc").mla_segments == 1
    partition = partition_model(qdq, "mlsoc")
    assert len(partition.mla_stages) == 2
    assert any("c1" in note for note in partition.notes)
    assert any("split" in note for note in partition.notes)
    result = compile_model(qdq, tmp_path, model_name="split")
    feeds = input_frames(qdq, 2)
    outputs, _ = run_archive(result.archive, feeds)
    reference = reference_outputs(qdq, feeds, 2)
    np.testing.assert_array_equal(outputs["y"], reference["y"])
