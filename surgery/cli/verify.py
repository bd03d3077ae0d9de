"""`surgery verify A B`: run both models with ONNX Runtime on the same inputs and compare."""

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from surgery.cli.app import EXIT_OK, EXIT_VERDICT, app, console, emit_json, handle_errors
from surgery.cli.options import InputShapeOpt, JsonOpt
from surgery.errors import VerifyError
from surgery.model import parse_input_shapes
from surgery.verify import VerifyResult, verify_models


@app.command("verify")
@handle_errors
def verify_command(
    model_a: Annotated[
        Path, typer.Argument(help="Reference model (.onnx), e.g. the version before a rewrite.")
    ],
    model_b: Annotated[
        Path, typer.Argument(help="Candidate model (.onnx) whose outputs are checked against A.")
    ],
    inputs: Annotated[
        Path | None,
        typer.Option(
            "--inputs",
            "-i",
            help="An .npz file keyed by input name to use instead of seeded random inputs.",
            metavar="FILE.npz",
        ),
    ] = None,
    input_shape: InputShapeOpt = None,
    atol: Annotated[
        float, typer.Option(help="Absolute tolerance: pass iff |B - A| <= atol + rtol·|A|.")
    ] = 1e-4,
    rtol: Annotated[
        float, typer.Option(help="Relative tolerance: pass iff |B - A| <= atol + rtol·|A|.")
    ] = 1e-3,
    exact: Annotated[
        bool,
        typer.Option(
            "--exact",
            help="Float rounding only, for data-movement rewrites: pass iff "
            "max|B - A| <= 1e-5·max(1, max|A|). Overrides --atol/--rtol.",
        ),
    ] = False,
    output_map: Annotated[
        list[str] | None,
        typer.Option(
            "--map",
            help="Compare output A_OUT of A with B_OUT of B (repeatable). Unmapped outputs "
            "match by name, then by position.",
            metavar="A_OUT=B_OUT",
        ),
    ] = None,
    samples: Annotated[
        int,
        typer.Option(
            min=1, help="Random trials with seeds SEED, SEED+1, …; metrics are the worst case."
        ),
    ] = 1,
    seed: Annotated[int, typer.Option(help="Seed of the first random trial.")] = 0,
    as_json: JsonOpt = False,
) -> None:
    """Compare the outputs of two models on the same inputs (max/mean error, cosine, SQNR).

    Random inputs come from A's signature: floats uniform in [0, 1), token ids within their embedding table, other integers in [0, 100); unknown dims are 1 unless --input-shape sets them.

    Exit code: 0 when every output passes, 1 when one fails, 2 on bad input.
    """
    result = verify_models(
        model_a,
        model_b,
        inputs=inputs,
        input_shapes=parse_input_shapes(input_shape or []),
        atol=atol,
        rtol=rtol,
        exact=exact,
        output_map=parse_output_map(output_map or []),
        seed=seed,
        samples=samples,
    )
    if as_json:
        emit_json(result.to_dict())
    else:
        render_result(result)
    raise typer.Exit(EXIT_OK if result.passed else EXIT_VERDICT)


def parse_output_map(specs: Sequence[str]) -> dict[str, str]:
    """Parse `A_OUT=B_OUT` strings into {name in A: name in B}."""
    mapping: dict[str, str] = {}
    for spec in specs:
        a, sep, b = spec.partition("=")
        if not sep or not a or not b:
            raise VerifyError(f"--map {spec!r}: expected A_OUT=B_OUT (e.g. logits=output_0)")
        mapping[a] = b
    return mapping


def render_result(result: VerifyResult) -> None:
    """Rich terminal view: one row per compared output, then the verdict and notes."""
    tolerance = (
        "exact (float rounding only)"
        if result.mode == "exact"
        else f"atol={result.atol:g}, rtol={result.rtol:g}"
    )
    trials = f", {result.samples} samples" if result.samples > 1 else ""
    console.print(
        f"[bold]A[/] {escape(str(result.model_a))}\n[bold]B[/] {escape(str(result.model_b))}\n"
        f"[dim]{tolerance}{trials}[/]",
        highlight=False,
    )
    table = Table(show_edge=False, header_style="bold", collapse_padding=True)
    table.add_column("result", no_wrap=True)
    table.add_column("output", overflow="fold", min_width=min(_widest(result), 12))
    table.add_column("shape", overflow="fold")
    for column in ("max abs", "max rel", "mean abs", "cosine", "SQNR dB", "bad"):
        table.add_column(column, justify="right", no_wrap=True)
    for o in result.outputs:
        name = o.name if o.name == o.name_b else f"{o.name} → {o.name_b}"
        shape = "×".join(map(str, o.shape_a)) or "scalar"
        if o.shape_a != o.shape_b:
            shape = f"{shape} ≠ {'×'.join(map(str, o.shape_b)) or 'scalar'}"
        table.add_row(
            "[green]PASS[/]" if o.passed else "[bold red]FAIL[/]",
            escape(name),
            escape(shape),
            _fmt(o.max_abs),
            _fmt(o.max_rel),
            _fmt(o.mean_abs),
            _fmt(o.cosine, ".6f"),
            _fmt(o.sqnr_db, ".1f"),
            "—" if o.mismatches is None else str(o.mismatches),
        )
    console.print(table)
    for o in result.outputs:
        if o.message:
            console.print(f"[red]{escape(o.name)}[/]: {escape(o.message)}", highlight=False)
    for note in result.notes:
        console.print(f"[dim]note: {escape(note)}[/]", highlight=False)
    worst = result.worst
    summary = f"worst max abs {_fmt(worst['max_abs'])}, min cosine {_fmt(worst['min_cosine'], '.6f')}, min SQNR {_fmt(worst['min_sqnr_db'], '.1f')} dB"
    if result.passed:
        console.print(f"[bold green]PASS[/]: {len(result.outputs)} output(s) match; {summary}")
    else:
        failed = escape(", ".join(result.failed_outputs))
        console.print(f"[bold red]FAIL[/]: {failed}; {summary}", highlight=False)


def _widest(result: VerifyResult) -> int:
    return max((len(o.name) for o in result.outputs), default=6)


def _fmt(value: float | None, spec: str = ".3g") -> str:
    if value is None:
        return "—"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return format(value, spec)
