"""The whole pipeline on every model of a folder: check → fix → quantize → compile → run.

For each model and target: MLA segments before and after `fix`, the `.elf` files the compile
writes (which must equal `check`'s segments on the fixed model), whether every MLA stage equals
the integer reference bit for bit, and the wall time of each stage. A stage that raises is
reported with its error; a typed error (SurgeryError, QuantizationError, CompileError …) is a
clear refusal, anything else is a crash and a bug. Calibration uses two seeded inputs
(`surgery.verify.make_inputs`): this measures robustness and agreement, not accuracy.

Input shapes come from the folder's INDEX.tsv `run_inputs` column when it has one (as in
../shared/models); otherwise dynamic dimensions are fixed by `fix` (batch 1).

    python bench/pipeline_sweep.py [--models DIR] [--target mlsoc ...] [--timeout 300]

`--as-quantized` takes already quantized models (QDQ, ONNX Runtime's QOperator format) as they
are: check → compile → run with the model's own scales, no fix and no quantize.

A sweep takes minutes to hours and imports some modules only when a stage first needs them:
while the tree is being edited, run it from a snapshot (`git archive HEAD | tar -x -C DIR`,
then `PYTHONPATH=DIR`) so every row is measured on one version of the code.

Prints a table and writes bench/results/pipeline_sweep.json.
"""

from __future__ import annotations

import argparse
import json
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeVar

from corpus import run_inputs

from compiler.archive import read_archive
from compiler.compile import compile_model
from compiler.quantize import quantize_model
from compiler.runtime.compare import compare_with_reference
from compiler.runtime.pipeline import run_archive
from surgery.check import check_model
from surgery.errors import SurgeryError
from surgery.model import load_model
from surgery.rules.fix import fix_model
from surgery.verify import make_inputs

ROOT = Path(__file__).resolve().parents[1]
T = TypeVar("T")


@dataclass
class SweepRow:
    model: str
    target: str
    status: str = "ok"
    """ok, mismatch (.elf != check or an MLA stage not bit-exact), refused (a typed error),
    crash (any other exception) or timeout."""
    segments_before: int | None = None
    segments_after: int | None = None
    elf_files: int | None = None
    mla_bit_exact: bool | None = None
    fix_steps: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    error: str | None = None


class _Timeout(BaseException):
    """The per-model time limit. A BaseException, like KeyboardInterrupt, so that library code
    catching Exception (compile measures unknown shapes by running the model, and reports any
    failure as a CompileError) cannot turn a slow model into a refusal."""


def _on_alarm(signum: int, frame: object) -> None:
    raise _Timeout


def sweep_one(
    path: Path, target: str, shapes: dict[str, list[int]] | None, as_quantized: bool = False
) -> SweepRow:
    row = SweepRow(path.stem, target)
    stage = "load"

    def timed(name: str, fn: Callable[[], T]) -> T:
        nonlocal stage
        stage, started = name, time.perf_counter()
        value = fn()
        row.seconds[name] = round(time.perf_counter() - started, 3)
        return value

    try:
        model = timed("load", lambda: load_model(path, input_shapes=shapes or None))
        row.segments_before = timed("check", lambda: check_model(model, target)).mla_segments
        if as_quantized:
            fixed = qdq = model
            row.segments_after = row.segments_before
        else:
            fixed_result = timed("fix", lambda: fix_model(model, target))
            fixed = fixed_result.model
            row.fix_steps = [s["rule"] for s in fixed_result.steps]
            row.segments_after = check_model(fixed, target, suggest=False).mla_segments
            qdq = timed(  # the calibration inputs are drawn inside: their errors are quantize's
                "quantize",
                lambda: (
                    quantize_model(
                        fixed, [make_inputs(fixed, seed=seed) for seed in range(2)], target=target
                    ).model
                ),
            )
        with tempfile.TemporaryDirectory() as folder:
            result = timed(
                "compile", lambda: compile_model(qdq, folder, target=target, model_name=path.stem)
            )
            row.elf_files = len(result.elf_files)
            archive = read_archive(result.archive)
        feed = make_inputs(fixed, seed=9)
        outputs, stats = timed("run", lambda: run_archive(archive, feed, keep_tensors=True))
        comparison = compare_with_reference(archive.manifest, qdq, feed, outputs, stats.tensors)
        row.mla_bit_exact = comparison.mla_bit_exact
        if row.elf_files != row.segments_after or not comparison.mla_bit_exact:
            row.status = "mismatch"
    except _Timeout:
        row.status, row.error = "timeout", f"at {stage}"
    except Exception as exc:  # every failure is a row of the report
        row.status = "refused" if isinstance(exc, SurgeryError) else "crash"
        row.error = f"{stage}: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=ROOT.parent / "shared" / "models")
    parser.add_argument("--target", nargs="+", default=["mlsoc"])
    parser.add_argument("--timeout", type=int, default=300, help="Seconds per model and target.")
    parser.add_argument(
        "--as-quantized",
        action="store_true",
        help="Compile already quantized models as they are (no fix, no quantize).",
    )
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "results" / "pipeline_sweep.json"
    )
    args = parser.parse_args()
    shapes = run_inputs(args.models / "INDEX.tsv")
    signal.signal(signal.SIGALRM, _on_alarm)
    rows = []
    print(
        f"{'model':32s} {'target':8s} {'status':9s} {'segs':>7s} {'elf':>4s} {'exact':>6s}  seconds"
    )
    for path in sorted(args.models.glob("*.onnx")):
        for target in args.target:
            signal.alarm(args.timeout)
            try:
                row = sweep_one(path, target, shapes.get(path.name), args.as_quantized)
            finally:
                signal.alarm(0)
            rows.append(row)
            segs = f"{row.segments_before}->{row.segments_after}"
            total = sum(row.seconds.values())
            print(
                f"{row.model:32s} {target:8s} {row.status:9s} {segs:>7s} {row.elf_files!s:>4s} "
                f"{row.mla_bit_exact!s:>6s}  {total:6.1f}  {row.error or ''}",
                flush=True,
            )
    counts = {s: sum(r.status == s for r in rows) for s in ("ok", "mismatch", "refused", "crash")}
    print("  ".join(f"{k} {v}" for k, v in counts.items()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": [asdict(r) for r in rows], **counts}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
