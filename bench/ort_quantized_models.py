"""Quantize the shared models with ONNX Runtime's own `quantize_static` (QDQ, or with
`--format qoperator` its QOperator format: QLinearConv, QGemm, ...), as a user brings a model
quantized elsewhere: the corpus for `fix` and `compile` on already-quantized models.

Each model of ../shared/models gets its input shapes fixed (INDEX.tsv's run_inputs) and is
quantized per channel to int8 QDQ on two seeded random inputs (`surgery.verify.make_inputs`:
images in [0, 1], token ids within their table): this measures what `fix` does with the
graph ONNX Runtime writes, not accuracy. Models it cannot quantize are listed and skipped.
For each model it prints how far the float model that `fix` rewrites (`surgery.qdq.float_model`)
is from the original, beside how far the QDQ model is, as SQNR on a third seeded input: the
float model only has int8 weights, so it should be at least as close as the QDQ model; a float
model far below it has lost part of the network (ONNX Runtime removes the Relus and Clips its
activation ranges stand for, and `float_model` must put them back). Writes the models and an INDEX.tsv into --out, so the folder feeds the pipeline sweep:

    python bench/ort_quantized_models.py --out /tmp/ort_qdq_models
    python bench/pipeline_sweep.py --models /tmp/ort_qdq_models --target mlsoc rk3588 \\
        --out bench/results/pipeline_sweep_ort_qdq.json

A QOperator model also gets the SQNR of its QDQ form (`surgery.qoperator.qdq_form`, what check
and compile read), which should match the QOperator model's own:

    python bench/ort_quantized_models.py --format qoperator --out /tmp/ort_qoperator_models
    python bench/pipeline_sweep.py --models /tmp/ort_qoperator_models --target mlsoc rk3588 \\
        --out bench/results/pipeline_sweep_ort_qoperator.json
"""

from __future__ import annotations

import argparse
import csv
import tempfile
from pathlib import Path

import numpy as np
import onnx
from corpus import run_inputs
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

from surgery.model import set_input_shapes
from surgery.qdq import float_model
from surgery.qoperator import qdq_form
from surgery.verify import make_inputs, verify_models

ROOT = Path(__file__).resolve().parents[1]


class SeededInputs(CalibrationDataReader):
    """Two seeded inputs per model, in the form ONNX Runtime's quantizer reads them."""

    def __init__(self, model: onnx.ModelProto) -> None:
        self._feeds = iter([make_inputs(model, seed=k) for k in range(2)])

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._feeds, None)


def quantize(
    source: Path, shapes: dict[str, list[int]], target: Path, quant_format: QuantFormat
) -> str | None:
    """`source` quantized (QDQ or QOperator) at `target`; the reason when ONNX Runtime cannot."""
    model = onnx.load(source)
    if shapes:
        set_input_shapes(model, shapes)
    with tempfile.TemporaryDirectory() as tmp:
        static = Path(tmp) / source.name
        onnx.save(model, static)
        try:
            quantize_static(
                static, target, SeededInputs(model), quant_format=quant_format, per_channel=True
            )
        except Exception as exc:  # noqa: BLE001 - ORT's quantizer raises many types; report it
            return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


def _db(value: float | None) -> str:
    return "n/a" if value is None else f"{value:6.1f} dB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="Folder for the QDQ models.")
    parser.add_argument("--models", type=Path, default=ROOT.parent / "shared" / "models")
    parser.add_argument(
        "--format", choices=["qdq", "qoperator"], default="qdq", help="ONNX Runtime's format."
    )
    args = parser.parse_args()
    quant_format = QuantFormat.QDQ if args.format == "qdq" else QuantFormat.QOperator
    args.out.mkdir(parents=True, exist_ok=True)
    shapes = run_inputs(args.models / "INDEX.tsv")
    rows = []
    for path in sorted(args.models.glob("*.onnx")):
        name = f"{path.stem}_ort_{args.format}.onnx"
        given = shapes.get(path.name, {})
        failed = quantize(path, given, args.out / name, quant_format)
        if failed:
            print(f"{path.name:30s} skipped: {failed}")
            continue
        quantized = onnx.load(args.out / name)
        candidates = [(args.format, quantized)]
        if args.format == "qoperator":
            candidates.append(("as qdq", qdq_form(quantized)[0]))
        candidates.append(("float_model", float_model(quantized)))
        sqnr = {
            label: verify_models(path, candidate, input_shapes=given or None, seed=2).worst[
                "min_sqnr_db"
            ]
            for label, candidate in candidates
        }
        spec = " ".join(f"{n}{list(d)}" for n, d in given.items())
        what = f"{path.name}, ORT quantize_static ({args.format})"
        rows.append({"file": name, "run_inputs": spec, "what": what})
        measured = ", ".join(f"{label} {_db(value)}" for label, value in sqnr.items())
        print(
            f"{name:40s} {(args.out / name).stat().st_size / 1e6:7.1f} MB   SQNR vs the original: "
            f"{measured}"
        )
    with (args.out / "INDEX.tsv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["file", "run_inputs", "what"], delimiter="\t")
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {args.out / 'INDEX.tsv'}")


if __name__ == "__main__":
    main()
