"""A QDQ model's float view keeps the shapes inferred for the QDQ model: where they give every
tensor a static shape, check does not infer the float view again, and sees the same types."""

from __future__ import annotations

import onnx

from surgery.check import check_model
from surgery.model import open_model
from surgery.qdq import float_view
from tests.test_qdq_removed_activations import _conv_model, _ort_qdq


def _inferences(monkeypatch) -> list[int]:
    calls: list[int] = []
    infer = onnx.shape_inference.infer_shapes

    def counting(model, *args, **kwargs):
        calls.append(len(model.graph.node))
        return infer(model, *args, **kwargs)

    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", counting)
    return calls


def _types(view) -> dict[str, tuple]:
    outputs = [t for outs in view.node_outputs for t in outs if t]
    return {t: (view.tensor(t).elem_type, view.tensor(t).shape) for t in outputs}


def test_a_static_float_view_is_not_inferred_again_and_has_the_inferred_types(
    monkeypatch, tmp_path
):
    loaded, _ = open_model(_ort_qdq(_conv_model("Relu"), tmp_path))
    _, inferred = open_model(float_view(loaded))
    calls = _inferences(monkeypatch)
    _, reused = open_model(float_view(loaded), reuse_static_shapes=True)
    assert calls == []
    assert _types(reused) == _types(inferred)


def test_a_float_view_with_a_dynamic_dim_is_inferred(monkeypatch, tmp_path):
    qdq = _ort_qdq(_conv_model("Relu"), tmp_path)
    qdq.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "batch"
    loaded, _ = open_model(qdq)
    calls = _inferences(monkeypatch)
    open_model(float_view(loaded), reuse_static_shapes=True)
    assert len(calls) == 1


def test_check_of_a_quantized_model_infers_only_the_quantized_model(monkeypatch, tmp_path):
    qdq = _ort_qdq(_conv_model("Relu"), tmp_path)
    calls = _inferences(monkeypatch)
    check_model(qdq, "mlsoc", suggest=False)
    assert len(calls) == 1  # the QDQ model's; its float view reuses those shapes


def test_the_float_model_for_suggestions_keeps_the_shapes_too(monkeypatch, tmp_path):
    """The Clips that stand for removed Relus get their input's type, so the float model the
    rules are asked about is all static as well."""
    qdq = _ort_qdq(_conv_model("Relu"), tmp_path)
    calls = _inferences(monkeypatch)
    report = check_model(qdq, "mlsoc")
    assert len(calls) == 1
    assert report.mla_segments == 1
