"""Arena planning quality: peak arena / lower bound, per strategy, per MLA segment.

The lower bound is the most bytes live at any one schedule position (no plan can use less).
For the example fixtures and the real models in ../shared/models (each fixed with `fix_model`
and quantized with the project's quantizer on random data, cached in --cache), every MLA
segment is planned by the four strategies under both compute orders. Real networks are mostly
chains, where every strategy meets the bound; a synthetic set of random live ranges shows how
the strategies differ when lifetimes interleave. The issue's bar: BestFit within 1.05x.

    python bench/memory_plan.py [--no-real] [--cache DIR] [--models DIR]

Prints a table and writes bench/results/memory_plan.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

from compiler.lower.memory import STRATEGIES, LiveTensor, plan_memory, verify_plan
from compiler.lower.pipeline import segment_live_tensors
from compiler.quantize.quantizer import quantize_model
from surgery import examples
from surgery.model import load_model
from surgery.rules.fix import fix_model

ROOT = Path(__file__).resolve().parents[1]
REAL_MODELS = {
    "mobilenet_v2": None,
    "yolov8n": None,
    "nudenet_320n": {"images": [1, 3, 320, 320]},
    "ppocrv4_det": {"x": [1, 3, 640, 640]},
}
ORDERS = ("WidthFirst", "DepthFirst")


def _quantize(model: onnx.ModelProto, samples: int = 2) -> onnx.ModelProto:
    info = model.graph.input[0]
    shape = [d.dim_value for d in info.type.tensor_type.shape.dim]
    rng = np.random.default_rng(0)
    data = [{info.name: rng.random(shape, dtype=np.float32)} for _ in range(samples)]
    return quantize_model(model, data, target="mlsoc").model


def prepared_models(real: bool, cache: Path, models: Path) -> dict[str, onnx.ModelProto]:
    """QDQ models: the fixtures, then (fixed + quantized, cached) real models."""
    prepared = {name: _quantize(load_model(build())) for name, build in examples.EXAMPLES.items()}
    if not real:
        return prepared
    cache.mkdir(parents=True, exist_ok=True)
    for name, shapes in REAL_MODELS.items():
        source = models / f"{name}.onnx"
        cached = cache / f"{name}_qdq.onnx"
        if cached.exists():
            prepared[name] = onnx.load(cached)
            continue
        if not source.exists():
            continue
        fixed = fix_model(load_model(source, input_shapes=shapes), "mlsoc").model
        prepared[name] = _quantize(fixed)
        onnx.save(prepared[name], cached)
    return prepared


def synthetic(seed: int, count: int = 300, horizon: int = 120) -> list[LiveTensor]:
    rng = np.random.default_rng(seed)
    tensors = []
    for k in range(count):
        first = int(rng.integers(0, horizon))
        size = int(rng.choice([256, 1024, 4096, 16384, 65536, 262144]) * rng.uniform(0.5, 1.5))
        tensors.append(LiveTensor(f"t{k}", size, first, first + int(rng.integers(0, 12))))
    return tensors


def evaluate(tensors: list[LiveTensor]) -> dict[str, dict[str, float]]:
    results = {}
    for strategy in STRATEGIES:
        started = time.perf_counter()
        plan = plan_memory(tensors, strategy)
        elapsed = time.perf_counter() - started
        verify_plan(plan)
        results[strategy] = {
            "peak_bytes": plan.peak_bytes,
            "lower_bound_bytes": plan.lower_bound_bytes,
            "ratio": round(plan.efficiency, 4),
            "seconds": round(elapsed, 4),
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-real", action="store_true", help="Fixtures and synthetic only.")
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "ms-bench")
    parser.add_argument("--models", type=Path, default=ROOT.parent / "shared" / "models")
    parser.add_argument(
        "--output", type=Path, default=ROOT / "bench" / "results" / "memory_plan.json"
    )
    args = parser.parse_args()
    rows = []
    for name, model in prepared_models(not args.no_real, args.cache, args.models).items():
        for order in ORDERS:
            for segment, tensors in segment_live_tensors(model, "mlsoc", order).items():
                rows.append(
                    {
                        "model": name,
                        "order": order,
                        "segment": segment,
                        "tensors": len(tensors),
                        "strategies": evaluate(tensors),
                    }
                )
    for seed in range(5):
        rows.append(
            {
                "model": f"synthetic_{seed}",
                "order": "-",
                "segment": "-",
                "tensors": 300,
                "strategies": evaluate(synthetic(seed)),
            }
        )
    header = f"{'model':<20} {'order':<10} {'seg':<8} {'tensors':>7} {'bound':>11} " + " ".join(
        f"{s:>16}" for s in STRATEGIES
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        bound = row["strategies"]["BestFit"]["lower_bound_bytes"]
        ratios = " ".join(f"{row['strategies'][s]['ratio']:>16.3f}" for s in STRATEGIES)
        print(
            f"{row['model']:<20} {row['order']:<10} {row['segment']:<8} {row['tensors']:>7} "
            f"{bound:>11,} {ratios}"
        )
    worst = {s: max(r["strategies"][s]["ratio"] for r in rows) for s in STRATEGIES}
    mean = {
        s: round(float(np.mean([r["strategies"][s]["ratio"] for r in rows])), 4) for s in STRATEGIES
    }
    real_rows = [r for r in rows if not r["model"].startswith("synthetic")]
    best_fit_real = max(r["strategies"]["BestFit"]["ratio"] for r in real_rows)
    print(f"\nworst peak/bound: {worst}\nmean peak/bound:  {mean}")
    print(f"BestFit on models: worst {best_fit_real:.3f} (bar: <= 1.05)")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(
        json.dumps(
            {
                "rows": rows,
                "worst_ratio": worst,
                "mean_ratio": mean,
                "best_fit_worst_on_models": best_fit_real,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
