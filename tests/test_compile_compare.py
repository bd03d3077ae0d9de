"""`compare_with_reference`: outputs and every MLA stage against the integer reference, so a
difference is placed in the compiled program or in a float host stage."""

from __future__ import annotations

import pytest

from compiler.archive import read_archive
from compiler.compile import compile_model
from compiler.runtime.compare import ReferenceComparison, compare_with_reference
from compiler.runtime.pipeline import run_archive
from tests.lower_support import input_frames, load_example


@pytest.fixture(scope="module")
def yolo_run(tmp_path_factory):
    model = load_example("yolo_head")
    result = compile_model(model, tmp_path_factory.mktemp("yolo"), model_name="yolo")
    archive = read_archive(result.archive)
    feed = input_frames(model, 1)
    outputs, stats = run_archive(archive, feed, keep_tensors=True)
    return model, archive, feed, outputs, stats.tensors


def test_every_mla_stage_is_compared_and_bit_exact(yolo_run) -> None:
    model, archive, feed, outputs, tensors = yolo_run
    comparison = compare_with_reference(archive.manifest, model, feed, outputs, tensors)
    mla_plugins = [p["name"] for p in archive.manifest["plugins"] if p["processor"] == "MLA"]
    assert [s["name"] for s in comparison.mla_stages] == mla_plugins
    assert all(stage["outputs"] for stage in comparison.mla_stages)
    assert comparison.mla_bit_exact and comparison.bit_exact
    assert comparison.explanation() is None


def test_a_wrong_mla_result_is_found_in_its_stage(yolo_run) -> None:
    model, archive, feed, outputs, tensors = yolo_run
    stage = next(p for p in archive.manifest["plugins"] if p["processor"] == "MLA")
    wrong = stage["output_nodes"][0]["name"]
    tampered = dict(tensors)
    tampered[wrong] = tensors[wrong].copy()
    tampered[wrong].flat[0] += 1
    comparison = compare_with_reference(archive.manifest, model, feed, outputs, tampered)
    assert not comparison.mla_bit_exact
    row = next(r for s in comparison.mla_stages for r in s["outputs"] if r["name"] == wrong)
    assert row["bit_exact"] is False and row["max_abs_diff_vs_reference"] == 1.0


def test_outputs_that_differ_behind_exact_mla_stages_are_explained() -> None:
    exact_stage = {"name": "MLA_0", "bit_exact": True, "outputs": []}
    differing = {"max_abs_diff_vs_reference": 2e-7, "bit_exact": False}
    comparison = ReferenceComparison({"probs": differing}, [exact_stage])
    assert "host float stages" in comparison.explanation()
    broken = ReferenceComparison({"probs": differing}, [{**exact_stage, "bit_exact": False}])
    assert broken.explanation() is None
    assert broken.to_dict()["mla_bit_exact"] is False
    assert comparison.to_dict()["bit_exact"] is False
