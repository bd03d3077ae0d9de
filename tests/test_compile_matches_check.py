"""compile partitions a QDQ model with check's own analysis (`check_model`: the float view with
shapes folded as check folds them), so the `.elf` files it writes are the segments check
reports. ONNX Runtime's QDQ BERT-tiny on rk3588 computes its attention mask's shape through
arithmetic only check's folding resolves; partitioning on the raw float view left those shapes
dynamic and compiled 5 programs where check said 3."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

from compiler.compile import compile_model
from surgery.check import check_model
from surgery.model import load_model
from surgery.verify import make_inputs
from tests.conftest import shared_model


class _Seeded(CalibrationDataReader):
    def __init__(self, model: onnx.ModelProto) -> None:
        self.feeds = iter([make_inputs(model, seed=k) for k in range(2)])

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self.feeds, None)


@pytest.mark.slow
def test_ort_quantized_bert_compiles_to_the_segments_check_reports(tmp_path) -> None:
    model = load_model(
        shared_model("bert_tiny"), input_shapes={"input_ids": [1, 128], "attention_mask": [1, 128]}
    )
    onnx.save(model, tmp_path / "float.onnx")
    quantize_static(
        tmp_path / "float.onnx",
        tmp_path / "qdq.onnx",
        _Seeded(model),
        quant_format=QuantFormat.QDQ,
        per_channel=True,
    )
    qdq = onnx.load(tmp_path / "qdq.onnx")
    segments = check_model(qdq, "rk3588").mla_segments
    result = compile_model(qdq, tmp_path / "out", target="rk3588", model_name="bert")
    assert len(result.elf_files) == segments == result.mla_segments
