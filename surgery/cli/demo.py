"""`surgery demo`: the main job end to end on an example model that ships with the package."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated

import typer

from surgery.cli.app import app, console, emit_json, handle_errors
from surgery.cli.check import render_report
from surgery.cli.options import JsonOpt, TargetOpt
from surgery.coverage import analyze_coverage
from surgery.examples import EXAMPLES
from surgery.model import load_model, save_model
from surgery.rules.fix import fix_model


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
            "--out", "-o", help="Folder for the demo's files (default: a new temp folder)."
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Run the pipeline on a small YOLO-style model that ships with the package: check → fix."""
    if example not in EXAMPLES:
        raise typer.BadParameter(f"unknown example {example!r}; choose from {', '.join(EXAMPLES)}")
    folder = out or Path(tempfile.mkdtemp(prefix="surgery-demo-"))
    path = save_model(EXAMPLES[example](), folder / f"{example}.onnx")
    model = load_model(path)
    report = analyze_coverage(model, target)
    fixed = fix_model(model, target)
    fixed_path = save_model(fixed.model, folder / f"{example}_fixed.onnx")
    if as_json:
        emit_json(
            {"model": str(path), "check": report.to_dict(), "fix": fixed.to_dict(str(fixed_path))}
        )
        return
    console.rule(f"[bold]1. check[/] {path}")
    render_report(str(path), report)
    console.rule("[bold]2. fix[/]")
    for step in fixed.steps:
        console.print(
            f"  {step['rule']}: segments {step['segments_before']}→{step['segments_after']}, "
            f"blockers {step['blockers_before']}→{step['blockers_after']}, verified (max |err| {step['verify']['max_abs']:.2g})",
            highlight=False,
        )
    after = fixed.coverage_after
    console.print(
        f"  {fixed_path}: {after.mla_segments} MLA segment(s), {len(after.blockers)} blocker(s), "
        f"MLA share of MACs {100 * after.mla_mac_fraction:.1f}%",
        highlight=False,
    )
