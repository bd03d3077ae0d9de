"""Real models (slow): fix -> quantize -> compile -> run, against `check` and the reference.

Each model in ../shared/models is rewritten by `fix_model` until it maps to the MLA, quantized
with the project's quantizer on random calibration data, compiled, and run in the emulator.
"""

from __future__ import annotations

import functools
import time

import numpy as np
import pytest

from compiler.archive import read_archive
from compiler.compile import compile_model
from compiler.lower.memory import STRATEGIES
from compiler.quantize.quantizer import quantize_model
from compiler.runtime.compare import compare_with_reference, reference_run
from compiler.runtime.pipeline import run_archive
from surgery.coverage import analyze_coverage
from surgery.model import load_model
from surgery.rules.fix import fix_model
from surgery.verify import make_inputs
from tests.conftest import RUN_INPUTS, shared_model
from tests.lower_support import compile_configured, reference_outputs
from tests.test_compile_pipeline import ORDERS, assert_mla_stages_bit_exact

pytestmark = pytest.mark.slow
ISSUE_BAR_MODELS = {"mobilenet_v2", "yolov8n", "nudenet_320n", "ppocrv4_det"}
"""The models whose default memory plan must stay within 1.05x of the lower bound (the
compiler issue's bar); the others are held to 1.10x (yolov5n's head: 1.06x, PP-OCR's
classifier: 1.0506x with every strategy)."""
MODELS = [
    "mobilenet_v2",
    "yolov8n",
    "nudenet_320n",
    "ppocrv4_det",
    # older exports and other families: IR-3 weights-as-inputs and n-ary Sum, a YOLOv5 decode
    # with Pow, Paddle's HardSigmoid/Constant-node classifier, token-id transformers
    "light_resnet50",
    "yolov5n_anchor",
    "ppocr_mobile_v2_cls",
    "vit_tiny_patch16_224",
    "bert_tiny",
]


MATRIX = [(strategy, order, 1, None) for strategy in STRATEGIES for order in ORDERS] + [
    ("BestFit", "WidthFirst", 2, "default"),
    ("GreedyByLifetime", "DepthFirst", 2, None),
]
"""Every memory strategy and compute order, and batch 2 on both tessellation paths."""


@functools.cache
def _prepare(name: str):
    """(name, QDQ model, check's MLA segments of the fixed model, 2 frames of inputs)."""
    model = load_model(shared_model(name), input_shapes=RUN_INPUTS.get(name))
    fixed = fix_model(model, "mlsoc").model
    calibration = [make_inputs(fixed, seed=seed) for seed in range(2)]
    qdq = quantize_model(fixed, calibration, target="mlsoc").model
    segments = analyze_coverage(fixed, "mlsoc", suggest=False).mla_segments
    frames = [make_inputs(fixed, seed=seed) for seed in (2, 3)]
    feeds = {key: np.concatenate([f[key] for f in frames]) for key in frames[0]}
    return name, qdq, segments, feeds


@pytest.fixture(scope="module", params=MODELS)
def prepared(request):
    name, qdq, segments, feeds = _prepare(request.param)
    return name, qdq, segments, {key: value[:1] for key, value in feeds.items()}


@pytest.fixture(scope="module", params=sorted(ISSUE_BAR_MODELS))
def issue_model(request):
    name, qdq, _, feeds = _prepare(request.param)
    return name, qdq, feeds, {}  # the last: the reference run, made by the first test


def test_compile_and_run_real_model(prepared, tmp_path) -> None:
    name, qdq, segments, feeds = prepared
    started = time.perf_counter()
    result = compile_model(qdq, tmp_path, model_name=name)
    seconds = time.perf_counter() - started
    if name == "yolov8n":
        assert seconds < 10.0
    bar = 1.05 if name in ISSUE_BAR_MODELS else 1.10
    for segment in result.segments:
        assert segment["peak_bytes"] <= bar * segment["lower_bound_bytes"], segment
    outputs, stats = run_archive(result.archive, feeds, keep_tensors=True)
    assert_mla_stages_bit_exact(result, stats.tensors, 1)
    reference = reference_outputs(qdq, feeds, 1)
    for output, value in reference.items():
        np.testing.assert_allclose(outputs[output], value, rtol=1e-5, atol=1e-5)
    assert len(result.elf_files) == segments, result.notes


@pytest.mark.parametrize(("strategy", "order", "batch", "tessellate"), MATRIX)
def test_issue_models_are_bit_exact_under_every_plan_order_batch_and_layout(
    issue_model, strategy, order, batch, tessellate, tmp_path
) -> None:
    """The compiler issue's acceptance: each memory strategy and compute order, batch 1 and 2,
    CVU or MLA-side tessellation; two frames each, compared with one reference run."""
    name, qdq, feeds, reference = issue_model
    result = compile_configured(qdq, tmp_path, name, strategy, order, batch, tessellate)
    archive = read_archive(result.archive)
    outputs, stats = run_archive(archive, feeds, keep_tensors=True)
    if "run" not in reference:  # one reference run serves every configuration of the model
        reference["run"] = reference_run(archive.manifest, qdq, feeds)
    comparison = compare_with_reference(
        archive.manifest, qdq, feeds, outputs, stats.tensors, reference=reference["run"]
    )
    assert comparison.mla_stages and comparison.mla_bit_exact, comparison.mla_stages
    assert comparison.bit_exact, comparison.outputs
