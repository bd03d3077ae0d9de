"""`surgery demo`: the main job end to end on an example model that ships with the package.

check → fix → quantize → compile → run, on a small YOLO-style detector built with onnx.helper,
calibrated on seeded synthetic images, so it works on a fresh machine with no downloads.
"""

import tempfile
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer
from rich.markup import escape

from surgery.cli.app import EXIT_OK, EXIT_VERDICT, app, console, emit_json, handle_errors
from surgery.cli.check import render_report
from surgery.cli.options import JsonOpt, TargetOpt
from surgery.examples import EXAMPLES
from surgery.model import load_model, save_model

CALIBRATION_SAMPLES = 8


def _synthetic_images(model, count: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """Smooth random images in [0, 1] (blurred noise): closer to photos than white noise."""
    from surgery.verify import make_inputs

    samples = []
    for k in range(count):
        feed = make_inputs(model, seed=seed + k)
        for name, value in feed.items():
            if value.dtype.kind == "f" and value.ndim == 4:
                blurred = (value + np.roll(value, 1, axis=2) + np.roll(value, 1, axis=3)) / 3
                feed[name] = blurred.astype(value.dtype)
        samples.append(feed)
    return samples


@app.command("demo")
@handle_errors
def demo_command(
    example: Annotated[
        str, typer.Option(help=f"Example model: {', '.join(EXAMPLES)}.")
    ] = "yolo_head",
    target: TargetOpt = "mlsoc",
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            "--output",
            "-o",
            help="Folder for the demo's files (default: a new temp folder).",
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Run the whole pipeline on a small YOLO-style model that ships with the package:
    check → fix → quantize → compile → run (bit-exact against the integer reference)."""
    # The pipeline's modules load here, not at start-up: every other command would pay for them.
    from compiler.api import load_model as load_net
    from compiler.archive import read_archive
    from compiler.costmodel import MlaHardware
    from compiler.runtime.compare import compare_output, reference_outputs
    from compiler.runtime.pipeline import run_archive
    from surgery.coverage import analyze_coverage
    from surgery.rules.fix import fix_model, pinned_text

    if example not in EXAMPLES:
        raise typer.BadParameter(f"unknown example {example!r}; choose from {', '.join(EXAMPLES)}")
    folder = out or Path(tempfile.mkdtemp(prefix="surgery-demo-"))
    path = save_model(EXAMPLES[example](), folder / f"{example}.onnx")
    model = load_model(path)
    report = analyze_coverage(model, target)
    if not as_json:
        console.rule(f"[bold]1. check[/] {escape(str(path))}")
        render_report(str(path), report)
        console.rule("[bold]2. fix[/]")
    fixed = fix_model(model, target)
    fixed_path = save_model(fixed.model, folder / f"{example}_fixed.onnx")
    if not as_json:
        for step in fixed.steps:
            console.print(
                f"  {escape(step['rule'])}: segments {step['segments_before']}→{step['segments_after']}, "
                f"blockers {step['blockers_before']}→{step['blockers_after']}"
                f"{pinned_text(step)}, verified "
                f"(max |err| {step['verify']['max_abs']:.2g})",
                highlight=False,
            )
        if not fixed.steps:
            segments = fixed.coverage_after.mla_segments
            console.print(
                "  nothing to rewrite: the model is one MLA segment already"
                if fixed.single_elf
                else f"  no rule frees its blockers: {segments} MLA segments stay "
                f"({segments} .elf files, the host runs what lies between them)",
                highlight=False,
            )
        console.rule("[bold]3. quantize[/]")
    net = load_net(fixed_path, target=target)
    samples = _synthetic_images(fixed.model, CALIBRATION_SAMPLES + 1)
    quantized = net.quantize(samples[:-1], model_name=example)
    qdq_path = quantized.save(f"{example}_int8", folder)
    held_out = samples[-1]
    sqnr = _sqnr(net.execute(held_out), quantized.execute(held_out))
    if not as_json:
        console.print(
            f"  {escape(str(qdq_path))}: SQNR vs float on a held-out sample {sqnr:.1f} dB",
            highlight=False,
        )
        console.rule("[bold]4. compile[/]")
    compiled = quantized.compile(folder)
    if not as_json:
        console.print(
            f"  {escape(str(compiled.archive))}: {len(compiled.elf_files)} .elf file(s) "
            f"({escape(', '.join(compiled.elf_files))}); check said {fixed.coverage_after.mla_segments} MLA segment(s)",
            highlight=False,
        )
        console.rule("[bold]5. run[/]")
    archive = read_archive(compiled.archive)
    # The target's hardware from its profile: one read from a file is not found by name.
    hardware = MlaHardware.from_profile(net.resolved_target().profile.hardware)
    outputs, stats = run_archive(archive, held_out, hardware=hardware)
    references = reference_outputs(archive.manifest, quantized.qdq_model, held_out)
    compared = {name: compare_output(value, references[name]) for name, value in outputs.items()}
    exact = all(c["bit_exact"] for c in compared.values())
    if as_json:
        emit_json(
            {
                "model": str(path),
                "check": report.to_dict(),
                "fix": fixed.to_dict(str(fixed_path)),
                "quantize": {"output": str(qdq_path), "held_out_sqnr_db": sqnr},
                "compile": compiled.to_dict(),
                "run": {"outputs": compared, "bit_exact": exact, "stats": stats.to_dict()},
            }
        )
    else:
        for name, c in compared.items():
            result = "bit-exact" if c["bit_exact"] else f"max |Δ| {c['max_abs_diff_vs_reference']}"
            console.print(
                f"  {escape(name)}: emulator vs integer reference: {result}", highlight=False
            )
        verdict = "[bold green]done[/]" if exact else "[bold red]emulator and reference differ[/]"
        console.print(f"\n{verdict}: files in {escape(str(folder))}")
        console.print(
            f"next: surgery run {escape(str(compiled.archive))} --compare-reference; "
            "surgery check YOUR_MODEL.onnx",
            highlight=False,
        )
    raise typer.Exit(EXIT_OK if exact else EXIT_VERDICT)


def _sqnr(reference: dict[str, Any], test: dict[str, Any]) -> float:
    ref = np.concatenate([np.asarray(v, np.float64).ravel() for v in reference.values()])
    out = np.concatenate([np.asarray(test[k], np.float64).ravel() for k in reference])
    noise = float(np.sum((ref - out) ** 2))
    return float("inf") if noise == 0 else 10 * np.log10(float(np.sum(ref**2)) / noise)
