"""`surgery check`: which nodes run where, how many .elf files a compile would produce, and why."""

from typing import Annotated

import onnx
import typer
from rich.markup import escape
from rich.table import Table

from surgery.check import check_model
from surgery.cli.app import EXIT_OK, EXIT_VERDICT, app, console, emit_json, handle_errors
from surgery.cli.options import InputShapeOpt, JsonOpt, ModelArg
from surgery.coverage import CoverageReport
from surgery.graph import shape_text
from surgery.model import input_shape_specs, parse_input_shapes, recorded_input_shapes
from surgery.text import counted


@app.command("check")
@handle_errors
def check_command(
    model: ModelArg,
    target: Annotated[
        str | None,
        typer.Option(
            "--target",
            "-t",
            help="Target profile: mlsoc, modalix, rk3588 (see `surgery targets`) or a profile "
            ".yaml (default: the target a quantized model was quantized for, else mlsoc).",
        ),
    ] = None,
    input_shape: InputShapeOpt = None,
    blockers: Annotated[
        int, typer.Option(min=0, help="How many blocker groups to show on the terminal.")
    ] = 10,
    as_json: JsonOpt = False,
) -> None:
    """Map every node to MLA / CVU / APU and count MLA segments (= .elf files).

    Exit code: 0 when the model maps to exactly one MLA segment, 1 when it maps to zero or
    several (so it works as a CI gate), 2 on bad input.
    """
    report = check_model(model, target, input_shapes=parse_input_shapes(input_shape or []))
    if as_json:
        emit_json({"model": str(model), **report.to_dict()})
    else:
        render_report(str(model), report, max_groups=blockers)
        if report.dynamic_inputs:
            recorded = recorded_input_shapes(
                onnx.load(str(model), load_external_data=False), report.dynamic_inputs
            )
            if recorded:
                flags = " ".join(f"-s {spec}" for spec in input_shape_specs(recorded))
                console.print(f"the size its metadata records: {escape(flags)}", highlight=False)
    raise typer.Exit(EXIT_OK if report.single_elf else EXIT_VERDICT)


def render_report(model_label: str, report: CoverageReport, *, max_groups: int = 10) -> None:
    """Rich terminal view of a coverage report."""
    folded = sum(1 for p in report.placements if p.foldable)
    console.print(
        f"[bold]{model_label}[/] on [bold]{report.target}[/]: {report.nodes_total} nodes ({folded} fold to constants)"
    )
    table = Table(show_edge=False, header_style="bold")
    table.add_column("processor")
    table.add_column("nodes", justify="right")
    table.add_column("MACs", justify="right")
    table.add_column("MAC share", justify="right")
    total = report.total_macs or 1
    for proc in ("MLA", "CVU", "APU"):
        n = report.count(proc, include_foldable=False)
        macs = report.macs_on(proc)
        table.add_row(proc, str(n), f"{macs:,}", f"{100 * macs / total:.1f}%")
    if folded:
        table.add_row("[dim]folded[/]", f"[dim]{folded}[/]", "[dim]0[/]", "[dim]-[/]")
    console.print(table)
    if report.dynamic_inputs:
        dims = escape(", ".join(f"{k}={shape_text(v)}" for k, v in report.dynamic_inputs.items()))
        console.print(
            f"[yellow]dynamic inputs:[/] {dims} — fix them with --input-shape NAME=DIMS",
            highlight=False,
        )
    for seg in report.segments:
        ins = escape(", ".join(seg.inputs[:3]) + (" …" if len(seg.inputs) > 3 else ""))
        outs = escape(", ".join(seg.outputs[:3]) + (" …" if len(seg.outputs) > 3 else ""))
        console.print(
            f"  [cyan]{seg.name}[/]: {counted(len(seg.nodes), 'node')}, {seg.macs:,} MACs  ({ins} → {outs})",
            highlight=False,
        )
    groups = report.blocker_groups()
    if groups:
        console.print(
            f"\n[bold]Blockers[/] ({counted(len(report.blockers), 'node')}, "
            f"{counted(len(groups), 'reason')}):"
        )
        for g in groups[:max_groups]:
            example = escape(", ".join(g["nodes"][:3]) + (" …" if g["count"] > 3 else ""))
            rules = f"  [green]fix: {escape(_rules_text(g))}[/]" if g["suggested_rules"] else ""
            console.print(
                f"  {g['count']:>4} × {'/'.join(g['op_types'])}: {escape(g['reason'])}{rules}",
                highlight=False,
            )
            console.print(f"         [dim]{example}[/]", highlight=False)
        if len(groups) > max_groups:
            console.print(
                f"  … {len(groups) - max_groups} more reasons (use --json or --blockers N)"
            )
    if report.single_elf:
        verdict = "[bold green]single .elf[/]: the whole MLA part compiles to one segment"
    elif report.dynamic_inputs:
        verdict = (
            f"[bold yellow]{report.mla_segments} MLA segment(s) while the input shapes are "
            "dynamic[/]: fix them with --input-shape before it can be quantized and compiled"
        )
    else:
        verdict = (
            f"[bold yellow]{report.mla_segments} MLA segments[/] → {report.mla_segments} .elf files"
        )
    share = f"MLA share of MACs {100 * report.mla_mac_fraction:.1f}%"
    if report.macs_unknown_nodes:
        share = (
            f"MLA share of the MACs that could be counted {100 * report.mla_mac_fraction:.1f}% "
            f"([yellow]{report.macs_unknown_nodes} matrix ops have unknown shapes[/]: fix the "
            "inputs with --input-shape)"
        )
    console.print(f"\n{verdict}; {share}")


def _rules_text(group: dict) -> str:
    """The group's rules, each with how many of its nodes it frees when that is not all of
    them: "classifier-to-conv (1 of 47)" must not read as a fix for the 47."""
    count = group["count"]
    return ", ".join(
        rule if n == count else f"{rule} ({n} of {count})"
        for rule, n in group["suggested_rule_nodes"].items()
    )
