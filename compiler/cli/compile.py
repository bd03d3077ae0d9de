"""`surgery compile`, `surgery archive`, `surgery run`: QDQ model -> archive -> emulated run.

`compile` lowers a quantized model to `<name>_mpk.tar.gz` and reports the .elf count, each MLA
segment's peak arena against its lower bound, and cycles. `archive` shows what an archive
holds. `run` executes its pipeline (the emulator for MLA stages) and, with
`--compare-reference`, checks the outputs against the integer reference executor.
"""

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import numpy as np
import onnx
import typer
from rich.markup import escape
from rich.table import Table

from surgery.cli.app import EXIT_OK, EXIT_VERDICT, app, console, emit_json, handle_errors
from surgery.cli.options import JsonOpt
from surgery.errors import SurgeryError

if TYPE_CHECKING:
    from compiler.compile import CompileResult
    from compiler.costmodel import MlaHardware

ArchiveArg = Annotated[
    Path,
    typer.Argument(
        help="A compiled archive (<name>_mpk.tar.gz), or the folder `compile -o` wrote it to."
    ),
]


@app.command("compile")
@handle_errors
def compile_command(
    model: Annotated[Path, typer.Argument(help="Quantized (QDQ) ONNX model to compile.")],
    output: Annotated[
        Path, typer.Option("--output", "--out", "-o", help="Directory for <name>_mpk.tar.gz.")
    ],
    target: Annotated[
        str | None,
        typer.Option(
            "--target",
            "-t",
            help="Target profile: mlsoc, modalix, rk3588 or a profile .yaml (default: the "
            "target the model was quantized for, else mlsoc).",
        ),
    ] = None,
    batch_size: Annotated[
        int,
        typer.Option(
            "--batch-size", min=1, help="Batch wanted; the largest batch up to it that fits."
        ),
    ] = 1,
    memory_plan: Annotated[
        str,
        typer.Option(
            "--memory-plan",
            help="Arena planning: BestFit, GreedyBySize, GreedyByLifetime, SlowPeakGrowth.",
        ),
    ] = "BestFit",
    compute_order: Annotated[
        str, typer.Option("--compute-order", help="Layer order: WidthFirst or DepthFirst.")
    ] = "WidthFirst",
    tessellate_default: Annotated[
        bool,
        typer.Option(
            "--tessellate-default",
            help="Let the MLA read HWC inputs and write HWC16 outputs directly "
            "(no CVU tessellate / detessellate stages where possible).",
        ),
    ] = False,
    single_core: Annotated[
        bool, typer.Option("--single-core", help="Use one quad (single_core_mode).")
    ] = False,
    compress: Annotated[
        bool, typer.Option("--compress/--no-compress", help="zlib-compress each ELF's .rodata.")
    ] = True,
    custom_string: Annotated[
        str | None, typer.Option("--custom-string", help="Stored in the archive and every ELF.")
    ] = None,
    name: Annotated[
        str | None, typer.Option("--name", help="Model name (default: the file name).")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Compile a QDQ model into <name>_mpk.tar.gz: one .elf per MLA segment plus host stages."""
    from compiler.compile import compile_model

    result = compile_model(
        model,
        output,
        target=target,
        batch_size=batch_size,
        compress=compress,
        tessellate_parameters="default" if tessellate_default else None,
        memory_plan_strategy=memory_plan,  # type: ignore[arg-type]
        compute_order=compute_order,  # type: ignore[arg-type]
        single_core_mode=single_core,
        custom_string=custom_string,
        model_name=name,
    )
    if as_json:
        emit_json(result.to_dict())
        raise typer.Exit(EXIT_OK)
    console.print(f"[bold]{escape(str(result.archive))}[/]", highlight=False)
    console.print(
        f"{len(result.elf_files)} .elf file(s) for {result.mla_segments} MLA segment(s) "
        f"(surgery check); batch {result.actual_batch_size} of {result.desired_batch_size} "
        f"requested; {result.quads} quad(s){_default_mla_text(result)}; "
        f"{result.compile_seconds:.2f} s",
        highlight=False,
    )
    table = Table(show_edge=False, header_style="bold")
    for column in ("segment", "layers", "peak arena", "lower bound", "peak/bound", "cycles"):
        table.add_column(column, justify="left" if column == "segment" else "right")
    for segment in result.segments:
        bound = segment["lower_bound_bytes"] or 1
        table.add_row(
            escape(str(segment["name"])),
            str(segment["layers"]),
            f"{segment['peak_bytes']:,}",
            f"{segment['lower_bound_bytes']:,}",
            f"{segment['peak_bytes'] / bound:.3f}",
            f"{segment['cycles']:,}",
        )
    console.print(table)
    console.print(
        "pipeline: " + escape(" → ".join(f"{s['name']} ({s['processor']})" for s in result.stages)),
        highlight=False,
    )
    console.print(f"total MLA cycles (static schedule): {result.total_cycles:,}")
    for note in result.notes:
        console.print(f"[yellow]note:[/] {escape(str(note))}", highlight=False)


@app.command("archive")
@handle_errors
def archive_command(
    archive: ArchiveArg,
    stats: Annotated[
        bool, typer.Option("--stats", help="Also list every MLA layer's start and end cycle.")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Show what a compiled archive holds: the pipeline, its executables and MLA programs."""
    from compiler.archive import read_archive

    opened = read_archive(archive)
    summary = opened.summary()
    if stats:
        summary["mla_stats"] = {str(k): v for k, v in sorted(opened.stats.items())}
    if as_json:
        emit_json(summary)
        raise typer.Exit(EXIT_OK)
    console.print(
        f"[bold]{escape(str(summary['name']))}[/] for {escape(str(summary['target']))} — "
        f"{len(summary['elf_files'])} .elf, "
        f"batch {summary['actual_batch_size']} (asked {summary['desired_batch_size']})",
        highlight=False,
    )
    console.print(
        f"[dim]{escape(str(summary['model_sdk_version']))}; "
        f"model {escape(str(summary['model_path']))}[/]"
    )
    if summary["custom_string"]:
        console.print(f"custom string: {escape(str(summary['custom_string']))}", highlight=False)
    table = Table(show_edge=False, header_style="bold")
    for column in ("#", "plugin", "processor", "kernel", "executable", "cycles", "peak / bound"):
        table.add_column(column)
    for plugin in summary["plugins"]:
        peak = plugin.get("peak_bytes")
        table.add_row(
            str(plugin["sequence"]),
            escape(str(plugin["name"])),
            escape(str(plugin["processor"])),
            escape(str(plugin["kernel"])),
            escape(str(plugin["executable"] or "(built-in)")),
            f"{plugin['static_cycles']:,}" if plugin.get("static_cycles") is not None else "",
            f"{peak:,} / {plugin['lower_bound_bytes']:,}" if peak is not None else "",
        )
    console.print(table)
    if stats:
        layers = Table(show_edge=False, header_style="bold")
        for column in ("idx", "layer", "start", "end"):
            layers.add_column(column)
        for index, entry in sorted(opened.stats.items()):
            layers.add_row(
                str(index),
                escape(str(entry["name"])),
                str(entry["start_cycle"]),
                str(entry["end_cycle"]),
            )
        console.print(layers)
    for note in summary["notes"]:
        console.print(f"[yellow]note:[/] {escape(str(note))}", highlight=False)


def _default_mla_text(result: "CompileResult") -> str:
    if not result.default_mla:
        return ""
    return (
        f" of the default virtual MLA (the {result.target} profile gives no MLA geometry: "
        "its placement and segments, this machine's quads and cycles)"
    )


@app.command("run")
@handle_errors
def run_command(
    archive: ArchiveArg,
    inputs: Annotated[
        Path | None,
        typer.Option(
            "--inputs",
            "-i",
            help="An .npz keyed by input name (NCHW; frames on axis 0).",
            metavar="FILE.npz",
        ),
    ] = None,
    save_outputs: Annotated[
        Path | None,
        typer.Option("--save-outputs", help="Write the outputs to this .npz.", metavar="FILE.npz"),
    ] = None,
    compare_reference: Annotated[
        bool,
        typer.Option(
            "--compare-reference",
            help="Also run the QDQ model in the integer reference executor and compare.",
        ),
    ] = False,
    model: Annotated[
        Path | None,
        typer.Option(
            "--model",
            help="The QDQ model for --compare-reference (default: the "
            "model_path recorded in the archive).",
        ),
    ] = None,
    frames: Annotated[
        int, typer.Option(min=1, help="Random frames to run when --inputs is not given.")
    ] = 1,
    seed: Annotated[int, typer.Option(help="Seed of the random inputs.")] = 0,
    target: Annotated[
        str | None,
        typer.Option(
            "--target",
            "-t",
            help="The profile .yaml of an archive compiled for a target read from a file "
            "(default: the built-in target the archive names).",
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Run an archive's pipeline: CVU kernels in numpy, MLA stages in the bit-exact emulator.

    Exit code: 0 on success (and bit-exact with --compare-reference), 1 when
    --compare-reference finds a difference, 2 on bad input.
    """
    from compiler.archive import read_archive
    from compiler.runtime.compare import compare_with_reference, random_inputs
    from compiler.runtime.pipeline import run_archive, run_notes
    from surgery.verify import load_inputs

    opened = read_archive(archive)
    hardware = _hardware(opened.manifest, target)
    feed = (
        load_inputs(inputs, [node["name"] for node in opened.manifest["input_nodes"]])
        if inputs
        else random_inputs(opened.manifest, frames, seed)
    )
    qdq_model = _reference_model(opened, model) if compare_reference else None
    try:
        outputs, stats = run_archive(
            opened, feed, keep_tensors=compare_reference, hardware=hardware
        )
    except (RuntimeError, ValueError) as error:
        raise SurgeryError(f"running {archive} failed: {error}") from error
    report: dict[str, Any] = {
        "archive": str(archive),
        "outputs": [],
        "stats": stats.to_dict(),
        "notes": run_notes(opened.manifest["input_nodes"], feed, outputs),
    }
    verdict = True
    references: dict[str, dict[str, Any]] = {}
    if qdq_model is not None:
        comparison = compare_with_reference(
            opened.manifest, qdq_model, feed, outputs, stats.tensors
        )
        references = comparison.outputs
        report["reference"] = comparison.to_dict()
        verdict = comparison.bit_exact
    for name, value in outputs.items():
        entry: dict[str, Any] = {
            "name": name,
            "shape": list(value.shape),
            "dtype": str(value.dtype),
            "min": float(np.min(value)) if value.size else None,
            "max": float(np.max(value)) if value.size else None,
        }
        entry.update(references.get(name, {}))
        report["outputs"].append(entry)
    if save_outputs:
        save_outputs.parent.mkdir(parents=True, exist_ok=True)
        np.savez(save_outputs, **outputs)
        report["saved"] = str(save_outputs)
    code = EXIT_OK if verdict else EXIT_VERDICT
    if as_json:
        emit_json(report)
        raise typer.Exit(code)
    _render_run(report, compare_reference)
    raise typer.Exit(code)


def _hardware(document: dict[str, Any], target: str | None) -> "MlaHardware | None":
    """The MLA hardware of `--target` (which must be the archive's target), or None: the
    runner takes the built-in target the archive names."""
    if target is None:
        return None
    from compiler.costmodel import MlaHardware
    from surgery.targets import resolve_target

    profile = resolve_target(target)
    if profile.name != document.get("target"):
        raise SurgeryError(
            f"--target {target}: profile {profile.name!r}, but the archive was compiled for "
            f"{document.get('target')!r}"
        )
    return MlaHardware.from_profile(profile.profile.hardware)


def _reference_model(opened, model: Path | None) -> onnx.ModelProto:
    """The QDQ model the archive was compiled from (`model`, or the path the archive records),
    checked by its checksum."""
    from compiler.archive import check_compiled_from
    from surgery.model import read_model

    document = opened.manifest
    path = model or Path(document.get("model_path", ""))
    if not path or not path.is_file():
        raise SurgeryError(
            f"--compare-reference needs the QDQ model; {str(path)!r} is not a file",
            hint="pass it with --model PATH",
        )
    check_compiled_from(document, path)
    return read_model(path)


def _render_run(report: dict[str, Any], compared: bool) -> None:
    stats = report["stats"]
    console.print(
        f"[bold]{escape(report['archive'])}[/]: {stats['frames']} frame(s), batch "
        f"{stats['actual_batch_size']}, {stats['wall_seconds']:.3f} s",
        highlight=False,
    )
    table = Table(show_edge=False, header_style="bold")
    cycles = "cycles" if stats["frames"] == 1 else f"cycles ({stats['frames']} frames)"
    for column in ("stage", "processor", "kernel", cycles, "µs / frame", "estimate"):
        table.add_column(column)
    for stage in stats["stages"]:
        table.add_row(
            escape(str(stage["name"])),
            escape(str(stage["processor"])),
            escape(str(stage["kernel"])),
            f"{stage['stall_aware_cycles']:,}" if stage["stall_aware_cycles"] else "",
            f"{stage['latency_us_per_frame']:.2f}",
            escape(str(stage["estimate"])),
        )
    console.print(table)
    host = stats["host_measured_us_per_frame"]
    host_text = (
        f"; host ONNX stages {host:.2f} µs measured on this machine (not a device estimate)"
        if host
        else ""
    )
    console.print(
        f"modelled latency per frame (MLA + CVU kernels): {stats['latency_us_per_frame']:.2f} µs"
        f"{host_text}; emulator: {escape(str(stats['emulator_kernels']))}",
        highlight=False,
    )
    outputs = Table(show_edge=False, header_style="bold")
    for column in (
        "output",
        "shape",
        "min",
        "max",
        *(("max |Δ| vs ref", "bit-exact") if compared else ()),
    ):
        outputs.add_column(column)
    for entry in report["outputs"]:
        row = [
            escape(str(entry["name"])),
            escape(json.dumps(entry["shape"])),
            f"{entry['min']:.6g}",
            f"{entry['max']:.6g}",
        ]
        if compared:
            row += [
                f"{entry['max_abs_diff_vs_reference']:.6g}",
                "yes" if entry["bit_exact"] else "[red]no[/]",
            ]
        outputs.add_row(*row)
    console.print(outputs)
    reference = report.get("reference")
    if reference:
        exact = sum(stage["bit_exact"] for stage in reference["mla_stages"])
        console.print(
            f"MLA stages bit-exact with the reference: {exact} of {len(reference['mla_stages'])}",
            highlight=False,
        )
        if reference["explanation"]:
            console.print(f"[yellow]{escape(str(reference['explanation']))}[/]", highlight=False)
    for note in report["notes"]:
        console.print(f"note: {escape(note)}", highlight=False)
