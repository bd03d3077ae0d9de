"""Save the shared models as ONNX Runtime optimises them (`ORT_ENABLE_EXTENDED`, the model a
session writes to `optimized_model_filepath`), as a user brings a model from ORT or Optimum's
`ORTOptimizer`: the corpus for `expand-ort-fused-ops` and `fix` on ORT's fused contrib ops.

Each model of ../shared/models gets its input shapes fixed (INDEX.tsv's run_inputs) and is
optimised by a CPU session; the table lists the com.microsoft ops it now holds and MLA
segments before and after `fix`. Writes the models and an INDEX.tsv into --out, so the folder
feeds the pipeline sweep:

    python bench/ort_optimized_models.py --out /tmp/ort_optimized_models
    python bench/pipeline_sweep.py --models /tmp/ort_optimized_models --target mlsoc rk3588 \\
        --out bench/results/pipeline_sweep_ort_optimized.json
"""

from __future__ import annotations

import argparse
import csv
import json
import tempfile
from collections import Counter
from pathlib import Path

import onnx
import onnxruntime as ort
from corpus import run_inputs

from surgery.check import check_model
from surgery.model import set_input_shapes
from surgery.rules.fix import fix_model

ROOT = Path(__file__).resolve().parents[1]


def optimise(source: Path, shapes: dict[str, list[int]], target: Path) -> str | None:
    """`source` as an ORT CPU session saves it optimised at `target`; the reason if it cannot."""
    model = onnx.load(source)
    if shapes:
        set_input_shapes(model, shapes)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(target)
    options.log_severity_level = 3
    with tempfile.TemporaryDirectory() as tmp:
        fixed = Path(tmp) / source.name
        onnx.save(model, fixed)
        try:
            ort.InferenceSession(str(fixed), options, providers=["CPUExecutionProvider"])
        except Exception as exc:  # noqa: BLE001 - ORT raises many types; report it
            return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="Folder for the models.")
    parser.add_argument("--models", type=Path, default=ROOT.parent / "shared" / "models")
    parser.add_argument("--target", default="mlsoc")
    parser.add_argument(
        "--json", type=Path, default=ROOT / "bench" / "results" / "ort_optimized_models.json"
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    shapes = run_inputs(args.models / "INDEX.tsv")
    rows, results = [], []
    print(f"{'model':36s} {'segments':>9s}  com.microsoft ops")
    for path in sorted(args.models.glob("*.onnx")):
        name = f"{path.stem}_ort_optimized.onnx"
        given = shapes.get(path.name, {})
        failed = optimise(path, given, args.out / name)
        if failed:
            print(f"{path.name:36s} skipped: {failed}")
            continue
        model = onnx.load(args.out / name)
        fused = Counter(n.op_type for n in model.graph.node if n.domain == "com.microsoft")
        before = check_model(model, args.target, suggest=False).mla_segments
        after = fix_model(model, args.target).coverage_after.mla_segments
        spec = " ".join(f"{n}{list(d)}" for n, d in given.items())
        rows.append({"file": name, "run_inputs": spec, "what": f"{path.name}, ORT optimised"})
        results.append({"model": name, "fused": dict(fused), "before": before, "after": after})
        ops = ", ".join(f"{op} ×{k}" for op, k in fused.most_common()) or "-"
        print(f"{name:36s} {before:>4d} → {after:<3d}  {ops}", flush=True)
    with (args.out / "INDEX.tsv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["file", "run_inputs", "what"], delimiter="\t")
        writer.writeheader()
        writer.writerows(rows)
    out = args.json
    out.write_text(json.dumps({"target": args.target, "rows": results}, indent=2) + "\n")
    print(f"wrote {args.out / 'INDEX.tsv'} and {out}")


if __name__ == "__main__":
    main()
