"""Real models (slow): fix -> quantize -> compile -> run, against `check` and the reference.

Each model in ../shared/models is rewritten by `fix_model` until it maps to the MLA, quantized
with the project's quantizer on random calibration data, compiled, and run in the emulator.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from compiler.compile import compile_model
from compiler.quantize.quantizer import quantize_model
from compiler.runtime.pipeline import run_archive
from surgery.coverage import analyze_coverage
from surgery.model import load_model
from surgery.rules.fix import fix_model
from surgery.verify import make_inputs
from tests.conftest import RUN_INPUTS, shared_model
from tests.lower_support import reference_outputs
from tests.test_compile_pipeline import assert_mla_stages_bit_exact

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


@pytest.fixture(scope="module", params=MODELS)
def prepared(request):
    name = request.param
    model = load_model(shared_model(name), input_shapes=RUN_INPUTS.get(name))
    fixed = fix_model(model, "mlsoc").model
    calibration = [make_inputs(fixed, seed=seed) for seed in range(2)]
    qdq = quantize_model(fixed, calibration, target="mlsoc").model
    segments = analyze_coverage(fixed, "mlsoc", suggest=False).mla_segments
    return name, qdq, segments, make_inputs(fixed, seed=2)


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
