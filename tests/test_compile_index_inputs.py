"""Integer inputs that index a table (token ids): the archive records their valid range,
default random inputs stay inside it, and an out-of-range id is a clear run error (as is a
host stage ONNX Runtime cannot load)."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler.archive import read_archive
from compiler.compile import compile_model
from compiler.quantize import quantize_model
from compiler.runtime.compare import random_inputs, reference_outputs
from compiler.runtime.errors import ExecutionError
from compiler.runtime.pipeline import run_archive

ROWS = 5


def _embedding_then_conv() -> onnx.ModelProto:
    """ids [1] → Gather(table of ROWS feature maps) → 1×1 Conv."""
    rng = np.random.default_rng(0)
    table = numpy_helper.from_array(rng.normal(0, 1, (ROWS, 4, 8, 8)).astype(np.float32), "table")
    weight = numpy_helper.from_array(rng.normal(0, 0.5, (4, 4, 1, 1)).astype(np.float32), "w")
    graph = helper.make_graph(
        [
            helper.make_node("Gather", ["table", "ids"], ["embedded"], axis=0),
            helper.make_node("Conv", ["embedded", "w"], ["y"]),
        ],
        "embedding",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        [table, weight],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    samples = [{"ids": np.array([k], np.int64)} for k in range(ROWS)]
    qdq = quantize_model(_embedding_then_conv(), samples, target="mlsoc").model
    result = compile_model(qdq, tmp_path_factory.mktemp("archive"), model_name="embedding")
    return qdq, read_archive(result.archive)


def test_the_manifest_records_the_table_rows_as_the_ids_range(compiled) -> None:
    _, archive = compiled
    (ids,) = archive.manifest["input_nodes"]
    assert ids["value_range"] == [0, ROWS]


def test_default_random_inputs_are_valid_ids_and_run_bit_exact(compiled) -> None:
    qdq, archive = compiled
    for seed in range(4):
        feed = random_inputs(archive.manifest, seed=seed)
        assert 0 <= int(feed["ids"][0]) < ROWS
        outputs, _ = run_archive(archive, feed)
        expected = reference_outputs(archive.manifest, qdq, feed)
        assert np.array_equal(outputs["y"], expected["y"])


def test_an_out_of_range_id_is_an_execution_error_naming_the_stage(compiled) -> None:
    _, archive = compiled
    with pytest.raises(ExecutionError, match=r"stage '.*' \(.*ONNX Runtime\).*Gather"):
        run_archive(archive, {"ids": np.array([ROWS + 2], np.int64)})


def test_a_host_stage_onnx_runtime_cannot_load_is_an_execution_error_naming_it(compiled) -> None:
    _, archive = compiled
    host = next(
        p
        for p in archive.manifest["plugins"]
        if p["resources"].get("executable", "").endswith(".onnx")
    )
    files = dict(archive.files)
    files[host["resources"]["executable"]] = b"not an onnx model"
    broken = dataclasses.replace(archive, files=files)
    with pytest.raises(ExecutionError, match=rf"stage '{host['name']}'.*cannot load"):
        run_archive(broken, {"ids": np.array([1], np.int64)})
