"""Emulator speed vs ONNX Runtime on the same QDQ model, and compile time.

For every model (the example fixtures, and the real models fixed + quantized as in
bench/memory_plan.py), side by side in one process:

* compile: `compile_model` wall time (the issue's bar: yolov8n < 10 s);
* emulator: `run_archive` on one frame (archive read once) — the whole pipeline, and its
  MLA stages alone;
* ORT: ONNX Runtime on the QDQ model (default graph optimisations, CPU);
* BLAS floor: the model's dense GEMMs alone in float32 BLAS (bench/blas_floor.py), a lower
  bound on any numpy emulator — when floor / ORT is above 3, the bar is out of numpy's reach;
* each the best of N runs, N at least --repeat and enough for a second of runs (at most 50);
* the ratio emulator / ORT (the issue's bar: <= 3x on the real models; the fixtures, runs of
  well under a millisecond, are reported apart: there the pipeline's fixed cost per run, some
  0.5 ms of Python, is most of the time, and ORT takes 0.1 ms);
* which kernels the emulator ran (compiler.native: compiled, with AVX-512 VNNI or not, or
  numpy), so a figure says what produced it.

    python bench/emulator_vs_ort.py [--no-real] [--repeat 5] [--cache DIR] [--workers N]

Prints a table and writes bench/results/emulator_vs_ort.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from blas_floor import blas_floor_seconds
from memory_plan import ROOT, prepared_models

from compiler import native
from compiler.archive import read_archive
from compiler.compile import compile_model
from compiler.runtime import parallel
from compiler.runtime.pipeline import run_archive
from surgery import examples


def _feeds(model) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    feeds = {}
    for info in model.graph.input:
        shape = [d.dim_value for d in info.type.tensor_type.shape.dim]
        feeds[info.name] = rng.random(shape, dtype=np.float32)
    return feeds


MIN_SECONDS = 1.0
"""Repeat each measured function at least `--repeat` times and for at least this long."""

MAX_RUNS = 50


def _best(fn, repeat: int):
    """(best wall time, what the best run returned) over at least `repeat` runs and
    MIN_SECONDS (at most MAX_RUNS): fast models get more runs, since a single scheduling
    hiccup is a large part of a millisecond run."""
    best, payload = float("inf"), None
    runs, started = 0, time.perf_counter()
    while runs < repeat or (runs < MAX_RUNS and time.perf_counter() - started < MIN_SECONDS):
        clock = time.perf_counter()
        value = fn()
        elapsed = time.perf_counter() - clock
        if elapsed < best:
            best, payload = elapsed, value
        runs += 1
    return best, payload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-real", action="store_true", help="Fixtures only.")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument(
        "--workers",
        type=int,
        default=parallel.WORKERS,
        help="Emulator threads (compiler.runtime.parallel.WORKERS; 0: every usable CPU).",
    )
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "ms-bench")
    parser.add_argument("--models", type=Path, default=ROOT.parent / "shared" / "models")
    parser.add_argument(
        "--output", type=Path, default=ROOT / "bench" / "results" / "emulator_vs_ort.json"
    )
    args = parser.parse_args()
    parallel.WORKERS = args.workers or None
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name, model in prepared_models(not args.no_real, args.cache, args.models).items():
            started = time.perf_counter()
            result = compile_model(model, folder, model_name=name)
            compile_seconds = time.perf_counter() - started
            feeds = _feeds(model)
            archive = read_archive(result.archive)
            emulator_seconds, (_, stats) = _best(
                lambda archive=archive, feeds=feeds: run_archive(archive, feeds), args.repeat
            )
            mla_seconds = sum(s.wall_seconds for s in stats.stages if s.processor == "MLA")
            # ORT runs after the emulator: its idle worker threads spin for a while after
            # each run, which would slow an emulator run measured right after it.
            options = ort.SessionOptions()
            options.log_severity_level = 3
            session = ort.InferenceSession(
                model.SerializeToString(), options, providers=["CPUExecutionProvider"]
            )
            session.run(None, feeds)
            ort_seconds, _ = _best(
                lambda session=session, feeds=feeds: session.run(None, feeds), args.repeat
            )
            floor_seconds, dense_macs = blas_floor_seconds(model, args.repeat)
            rows.append(
                {
                    "model": name,
                    "elf_files": len(result.elf_files),
                    "compile_seconds": round(compile_seconds, 3),
                    "emulator_seconds": round(emulator_seconds, 4),
                    "emulator_mla_seconds": round(mla_seconds, 4),
                    "ort_seconds": round(ort_seconds, 4),
                    "ratio": round(emulator_seconds / ort_seconds, 2),
                    "dense_macs": dense_macs,
                    "blas_floor_seconds": round(floor_seconds, 4),
                    "blas_floor_ratio": round(floor_seconds / ort_seconds, 2),
                    "mla_static_cycles": stats.mla_static_cycles,
                    "latency_us_per_frame": round(stats.latency_us_per_frame, 2),
                }
            )
    header = (
        f"{'model':<18} {'elf':>3} {'compile s':>10} {'emulator s':>11} {'(MLA s)':>9} "
        f"{'ORT s':>8} {'emu/ORT':>8} {'floor/ORT':>10} {'MLA cycles':>12}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        print(
            f"{row['model']:<18} {row['elf_files']:>3} {row['compile_seconds']:>10.2f} "
            f"{row['emulator_seconds']:>11.3f} {row['emulator_mla_seconds']:>9.3f} "
            f"{row['ort_seconds']:>8.4f} {row['ratio']:>8.1f} {row['blas_floor_ratio']:>10.1f} "
            f"{row['mla_static_cycles']:>12,}"
        )
    yolo = next((r for r in rows if r["model"] == "yolov8n"), None)
    if yolo:
        print(f"\nyolov8n compile: {yolo['compile_seconds']:.2f} s (bar: < 10 s)")
    real = [r["ratio"] for r in rows if r["model"] not in examples.EXAMPLES]
    fixtures = [r["ratio"] for r in rows if r["model"] in examples.EXAMPLES]
    if real:
        print(f"worst emulator/ORT on the real models: {max(real):.1f}x (bar: <= 3x)")
    if fixtures:
        print(
            f"worst emulator/ORT on the sub-millisecond fixtures: {max(fixtures):.1f}x "
            "(fixed per-run cost; not the bar)"
        )
    print(f"emulator kernels: {native.describe()}")
    print("floor/ORT: the dense GEMMs alone in float32 BLAS / ORT (a numpy emulator's lower bound)")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "emulator_workers": parallel.worker_count(),
        "emulator_kernels": native.describe(),
        "worst_ratio_real_models": max(real, default=None),
        "worst_ratio_fixtures": max(fixtures, default=None),
        "rows": rows,
    }
    args.output.write_text(json.dumps(document, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
