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

A model with static inputs is checked as it is, as the floor reads it. A model with a dynamic
input is checked at the INDEX's input shapes (`--input-shape`, as compile needs them), and
also as given: then check places a model of unknown sizes, and the fix-input-shapes rule it
suggests analyses the model a second time at batch 1 to tell which blockers that frees.

A second table times what a user waits for at a terminal: the `surgery check MODEL --json`
command as a new process against a new Python process that imports onnx and runs the floor,
best of N, in turns. Both start an interpreter and import onnx; the command also loads its
CLI, the target profile and the rules. The package is byte-compiled first, as an installed
package is (this machine's PYTHONDONTWRITEBYTECODE would otherwise recompile it every run).

    python bench/check_speed.py [--repeat 7] [--models DIR] [--no-cli] [--out FILE]

Other corpora: `--models` a folder from bench/pypi_models.py (results in
check_speed_pypi.json) or from bench/ort_quantized_models.py (check_speed_ort_qdq.json). A
quantized model costs check two analyses (its float view, placed; the float model it
quantizes, whose blockers the rules are asked about) and building that float model: 6–10×
the floor, 2.3–3.8× without suggestions.

Where the bar is not met (2026-12-04 evening, this machine, `--repeat 9`, floors up to 2×
slower than in the morning's runs: the ratios, measured in turns, moved less than 10%): in
process on light_resnet50 (2.5×) and ppocr_mobile_v2_cls (2.8×); ppocrv4_det is at 1.4×,
the others at 0.4–1.2×. light_resnet50 and ppocr_mobile_v2_cls hold their weights
in ConstantOfShape / Constant nodes, so their floor is 2.1–2.7 ms, and the bar leaves about
1 ms for validating, placing, segmenting and explaining 175–260 placed nodes (about 4 µs a
node) after a read and an inference that cost what the floor's do; check's Python takes
10–15 µs a node. In these turns the call that follows the floor pays about 0.7 ms for the
memory the floor freed (the same call following itself runs that much faster; the floor is
not slowed by following check). Without --input-shape the dynamic models are at 2.1–5.9×
(the second analysis). As a command the ratios are 1.4–2.3 (they were 1.8–3.0 before the
command line was imported with the collector paused and typer stopped evaluating postponed
annotations): the floor process imports onnx (~110 ms), the command also imports pydantic,
yaml, typer and rich, builds its CLI, and with blockers loads the rule catalogue (~25 ms).
"""

from __future__ import annotations

import argparse
import compileall
import json
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import onnx
from corpus import run_inputs
from onnx import shape_inference

from surgery.check import check_model

ROOT = Path(__file__).resolve().parents[1]
SHARED_MODELS = ROOT.parent / "shared" / "models"


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


def has_dynamic_inputs(path: Path) -> bool:
    """Whether a graph input has a dimension that is not a fixed size: only those models are
    checked with the INDEX's input shapes (as a user fixes them with --input-shape), and also
    as given; a static model is checked as it is, as the floor reads it."""
    graph = onnx.load(str(path), load_external_data=False).graph
    weights = {t.name for t in graph.initializer}
    return any(
        not d.HasField("dim_value") or d.dim_value <= 0
        for i in graph.input
        if i.name not in weights
        for d in i.type.tensor_type.shape.dim
    )


FLOOR_PROCESS = (
    "import sys, onnx\n"
    "from onnx import shape_inference\n"
    "shape_inference.infer_shapes(onnx.load(sys.argv[1]), data_prop=True)"
)


def process_times(path: Path, shapes: dict[str, list[int]] | None, repeat: int) -> dict[str, float]:
    """Best wall times of the floor and of `surgery check --json` as new processes, in turns."""
    check = [sys.executable, "-m", "server", "check", str(path), "--json"]
    for name, dims in (shapes or {}).items():
        check += ["--input-shape", f"{name}={','.join(map(str, dims))}"]
    commands = {"floor": [sys.executable, "-c", FLOOR_PROCESS, str(path)], "check": check}

    def run(command: list[str]) -> Callable[[], object]:
        return partial(subprocess.run, command, stdout=subprocess.DEVNULL, cwd=ROOT)

    return best_in_turns({label: run(cmd) for label, cmd in commands.items()}, repeat)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--models", type=Path, default=SHARED_MODELS)
    parser.add_argument("--target", default="mlsoc")
    parser.add_argument(
        "--out",
        type=Path,
        help="the JSON to write (default: bench/results/check_speed.json for the shared "
        "models, check_speed_<folder>.json for another folder)",
    )
    parser.add_argument(
        "--no-cli", action="store_true", help="skip the command-line (new process) comparison"
    )
    args = parser.parse_args()
    if not args.no_cli:
        for package in ("surgery", "compiler", "server"):
            compileall.compile_dir(ROOT / package, quiet=1)
    models = sorted(args.models.glob("*.onnx"))
    if not models:
        parser.error(f"no .onnx models in {args.models}")
    shapes = run_inputs(args.models / "INDEX.tsv")
    rows = []
    for path in models:
        given = shapes.get(path.name) if has_dynamic_inputs(path) else None
        contenders = {
            "floor": partial(floor, path),
            "check": partial(check_model, path, args.target, input_shapes=given),
            "place": partial(check_model, path, args.target, input_shapes=given, suggest=False),
        }
        if given:
            contenders["as_given"] = partial(check_model, path, args.target)
        times = best_in_turns(contenders, args.repeat + 1)  # round 1 warms caches (files, schemas)
        t_floor, t_check, t_place = times["floor"], times["check"], times["place"]
        report = check_model(path, args.target, input_shapes=given)
        rows.append(
            {
                "model": path.name,
                "nodes": report.nodes_total,
                "input_shapes": given,
                "floor_s": round(t_floor, 5),
                "check_s": round(t_check, 5),
                "ratio": round(t_check / t_floor, 3),
                "placement_only_s": round(t_place, 5),
                "placement_only_ratio": round(t_place / t_floor, 3),
                "mla_segments": report.mla_segments,
            }
        )
        r = rows[-1]
        if given:
            r["without_input_shapes_s"] = round(times["as_given"], 5)
            r["without_input_shapes_ratio"] = round(times["as_given"] / t_floor, 3)
        dynamic = f"  without --input-shape {r['without_input_shapes_ratio']:5.2f}" if given else ""
        print(
            f"{r['model']:30s} {r['nodes']:5d} nodes  floor {1000 * r['floor_s']:8.1f} ms  "
            f"check {1000 * r['check_s']:8.1f} ms  ratio {r['ratio']:5.2f}  "
            f"(without rule suggestions {r['placement_only_ratio']:5.2f})  "
            f"segments {r['mla_segments']}{dynamic}"
        )
    worst = max((r["ratio"] for r in rows), default=0.0)
    print(f"worst ratio {worst:.2f} (bar: 1.50)")
    result = {"target": args.target, "repeat": args.repeat, "rows": rows, "worst_ratio": worst}
    if not args.no_cli:
        print("\nas a command (new process each run):")
        cli_rows = []
        for path in sorted(args.models.glob("*.onnx")):
            given = shapes.get(path.name) if has_dynamic_inputs(path) else None
            times = process_times(path, given, args.repeat)
            cli_rows.append(
                {
                    "model": path.name,
                    "floor_process_s": round(times["floor"], 4),
                    "check_command_s": round(times["check"], 4),
                    "ratio": round(times["check"] / times["floor"], 3),
                }
            )
            r = cli_rows[-1]
            print(
                f"{r['model']:30s} floor process {1000 * r['floor_process_s']:6.0f} ms  "
                f"surgery check {1000 * r['check_command_s']:6.0f} ms  ratio {r['ratio']:5.2f}"
            )
        result["command_rows"] = cli_rows
        result["command_worst_ratio"] = max(r["ratio"] for r in cli_rows)
        print(f"worst command ratio {result['command_worst_ratio']:.2f}")
    out = args.out or default_out(args.models)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


def default_out(models: Path) -> Path:
    """Where results go without --out: another folder's run never overwrites the shared
    models' results."""
    results = ROOT / "bench" / "results"
    if models.resolve() == SHARED_MODELS.resolve():
        return results / "check_speed.json"
    return results / f"check_speed_{models.resolve().name}.json"


if __name__ == "__main__":
    main()
