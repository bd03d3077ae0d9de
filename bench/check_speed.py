"""`surgery check` time vs the floor: onnx.load + shape inference with data propagation.

Two figures per model: the full check (placement, segments, and the rewrite rules' suggestions
per blocker) and the check without suggestions (placement and segments only).

For every model in ../shared/models, the best of N runs of each, side by side in one process,
taken in turns (floor, check, check without suggestions, floor, …): both read and free
megabytes of weights, and how fast that is depends on what glibc's allocator has kept from
earlier work (a floor measured right after a check was up to 2× slower than one measured in
a fresh process, because freed memory had gone back to the OS and had to be faulted in
again). Taking turns gives every contender the same allocator state and the same background
load. The issue's bar: check ≤ 1.5× the floor. Prints a table and writes
bench/results/check_speed.json.

    python bench/check_speed.py [--repeat 7] [--models DIR]
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import onnx
from onnx import shape_inference

from surgery.check import check_model

ROOT = Path(__file__).resolve().parents[1]


def run_inputs(index: Path) -> dict[str, dict[str, list[int]]]:
    """Concrete input shapes from INDEX.tsv's run_inputs column ("name[1, 3, 640, 640] …")."""
    shapes: dict[str, dict[str, list[int]]] = {}
    if not index.exists():
        return shapes
    with index.open() as f:
        for row in csv.DictReader(f, delimiter="\t"):
            spec = row.get("run_inputs", "")
            entries: dict[str, list[int]] = {}
            for part in spec.split("] "):
                name, _, dims = part.partition("[")
                dims = dims.rstrip("]")
                if name and dims:
                    entries[name.strip()] = [int(d) for d in dims.split(",")]
            shapes[row["file"]] = entries
    return shapes


def best_in_turns(fns: dict[str, Callable[[], object]], repeat: int) -> dict[str, float]:
    """The best wall time of each function over `repeat` rounds, one call of each per round."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeat):
        for label, fn in fns.items():
            t = time.perf_counter()
            fn()
            best[label] = min(best[label], time.perf_counter() - t)
    return best


def floor(path: Path) -> None:
    shape_inference.infer_shapes(onnx.load(str(path)), data_prop=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--models", type=Path, default=ROOT.parent / "shared" / "models")
    parser.add_argument("--target", default="mlsoc")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "check_speed.json")
    args = parser.parse_args()
    shapes = run_inputs(args.models / "INDEX.tsv")
    rows = []
    for path in sorted(args.models.glob("*.onnx")):
        given = shapes.get(path.name)
        times = best_in_turns(
            {
                "floor": partial(floor, path),
                "check": partial(check_model, path, args.target, input_shapes=given),
                "place": partial(check_model, path, args.target, input_shapes=given, suggest=False),
            },
            args.repeat + 1,  # the first round warms caches (file system, onnx schemas)
        )
        t_floor, t_check, t_place = times["floor"], times["check"], times["place"]
        report = check_model(path, args.target, input_shapes=shapes.get(path.name))
        rows.append(
            {
                "model": path.name,
                "nodes": report.nodes_total,
                "floor_s": round(t_floor, 5),
                "check_s": round(t_check, 5),
                "ratio": round(t_check / t_floor, 3),
                "placement_only_s": round(t_place, 5),
                "placement_only_ratio": round(t_place / t_floor, 3),
                "mla_segments": report.mla_segments,
            }
        )
        r = rows[-1]
        print(
            f"{r['model']:30s} {r['nodes']:5d} nodes  floor {1000 * r['floor_s']:8.1f} ms  "
            f"check {1000 * r['check_s']:8.1f} ms  ratio {r['ratio']:5.2f}  "
            f"(without rule suggestions {r['placement_only_ratio']:5.2f})  segments {r['mla_segments']}"
        )
    worst = max((r["ratio"] for r in rows), default=0.0)
    print(f"worst ratio {worst:.2f} (bar: 1.50)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {"target": args.target, "repeat": args.repeat, "rows": rows, "worst_ratio": worst},
            indent=2,
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
