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


@app.command("demo")
@handle_errors
def demo_command(
    example: Annotated[
        str, typer.Option(help=f"Example model: {', '.join(EXAMPLES)}.")
    ] = "yolo_head",
    target: TargetOpt = "mlsoc",
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="Folder to keep the example model in.")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Build a small YOLO-style model and check it (later steps: fix → quantize → compile → run)."""
    if example not in EXAMPLES:
        raise typer.BadParameter(f"unknown example {example!r}; choose from {', '.join(EXAMPLES)}")
    folder = out or Path(tempfile.mkdtemp(prefix="surgery-demo-"))
    path = save_model(EXAMPLES[example](), folder / f"{example}.onnx")
    report = analyze_coverage(load_model(path), target)
    if as_json:
        emit_json({"model": str(path), "check": report.to_dict()})
        return
    console.rule(f"[bold]1. check[/] {path}")
    render_report(str(path), report)
