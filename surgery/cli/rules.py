"""`surgery rules`, `surgery apply` and `surgery fix`: the rewrite engine on the command line."""

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from surgery.cli.app import (
    EXIT_OK,
    EXIT_VERDICT,
    app,
    console,
    emit_json,
    err_console,
    handle_errors,
    refuse_overwrite,
)
from surgery.cli.options import InputShapeOpt, JsonOpt, ModelArg, TargetOpt
from surgery.errors import SurgeryError
from surgery.model import load_model, parse_input_shapes, save_model
from surgery.rules import all_rules, apply_rule, get_rule
from surgery.rules.fix import describe_step, fix_model
from surgery.rules.registry import UnknownRuleError
from surgery.session import import_or_reuse, name_in_workspace, record_fix, record_rewrite
from surgery.workspace import Workspace

WorkspaceOpt = Annotated[
    Path,
    typer.Option(
        "--workspace", "-w", help="Workspace folder: every step is kept as a numbered version."
    ),
]
NameOpt = Annotated[
    str | None,
    typer.Option(
        "--name",
        help="The model's name in the workspace (default: the file name); another file whose "
        "name is taken there needs a name of its own.",
    ),
]
ApplyOutOpt = Annotated[
    Path | None,
    typer.Option(
        "--out",
        "--output",
        "-o",
        help="Also write the result here (it is always kept as a workspace version).",
    ),
]
FixOutOpt = Annotated[
    Path | None,
    typer.Option(
        "--out",
        "--output",
        "-o",
        help="Where to write the fixed model (default: <model>_fixed.onnx in this folder).",
    ),
]


@app.command("rules")
@handle_errors
def rules_command(
    name: Annotated[str | None, typer.Argument(help="Explain one rule; omit to list all.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """List the rewrite rules, or explain one (parameters, exactness, example)."""
    if name:
        info = get_rule(name).describe()
        if as_json:
            emit_json(info)
            return
        # Rule texts are full of shapes in brackets ([N, C, L]): printed as text, not markup.
        console.print(
            f"[bold]{escape(info['name'])}[/] ({escape(info['category'])}, "
            f"{escape(info['exactness'])}): {escape(info['summary'])}"
        )
        console.print(reflow(info["doc"]), highlight=False, markup=False)
        if info["params"]:
            console.print("parameters:")
            for key, spec in info["params"].items():
                console.print(
                    f"  --param {key}=…  {spec.get('description', '')} (default {spec.get('default')})",
                    highlight=False,
                    markup=False,
                )
        if info["example"]:
            console.print(f"example: [cyan]{escape(info['example'])}[/]", highlight=False)
        return
    rows = [cls.describe() for cls in all_rules()]
    if as_json:
        emit_json({"rules": rows})
        return
    table = Table("rule", "category", "exact", "summary", show_edge=False, header_style="bold")
    for r in rows:
        table.add_row(
            escape(r["name"]),
            escape(r["category"]),
            "yes" if r["exactness"] == "exact" else "approx",
            escape(r["summary"]),
        )
    console.print(table)


def reflow(doc: str) -> str:
    """A docstring's paragraphs as single lines, so the terminal wraps them at its own width
    (printed as written, lines broken for 100 columns wrap again at 80 into ragged halves).
    List items and indented lines keep their own lines."""
    paragraphs = []
    for block in doc.split("\n\n"):
        lines: list[str] = []
        for line in block.splitlines():
            keep = (
                not lines or line.startswith((" ", "-", "*", "•")) or line[:2].rstrip(".").isdigit()
            )
            if keep:
                lines.append(line)
            else:
                lines[-1] = f"{lines[-1]} {line.strip()}"
        paragraphs.append("\n".join(lines))
    return "\n\n".join(paragraphs)


def _parse_params(items: list[str]) -> dict:
    params = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SurgeryError(f"--param {item!r}: expected KEY=VALUE")
        try:
            params[key] = json.loads(value)
        except json.JSONDecodeError:
            params[key] = value
    return params


@app.command("apply")
@handle_errors
def apply_command(
    rule: Annotated[str, typer.Argument(help="Rule name (see `surgery rules`).")],
    model: ModelArg,
    nodes: Annotated[
        str | None,
        typer.Option("--nodes", help="Only matches touching these nodes (comma-separated)."),
    ] = None,
    param: Annotated[
        list[str] | None,
        typer.Option("--param", "-p", help="Rule parameter KEY=VALUE (repeatable)."),
    ] = None,
    out: ApplyOutOpt = None,
    workspace: WorkspaceOpt = Path(".surgery"),
    name: NameOpt = None,
    target: TargetOpt = "mlsoc",
    input_shape: InputShapeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Apply one rule, verify the result against the original, and save it as a new version."""
    _refuse_swapped_arguments(rule, model)
    refuse_overwrite(out, model)
    ws = Workspace(workspace)
    ws_name = name_in_workspace(ws, model, name)
    loaded = load_model(model, parse_input_shapes(input_shape or []))
    result = apply_rule(
        loaded,
        rule,
        target,
        nodes=[n.strip() for n in nodes.split(",")] if nodes else None,
        params=_parse_params(param or []),
    ).as_compiled(target)
    written = save_model(result.model, out) if out else None  # first: a failed write stores nothing
    v0 = import_or_reuse(ws, model, ws_name)
    version = record_rewrite(ws, v0.name, v0.version, result, _parse_params(param or []))
    output = written or version.path
    summary = {
        **result.summary(),
        "output": str(output),
        "workspace_version": version.id,
        "model": v0.name,
    }
    if as_json:
        emit_json(summary)
        return
    v = result.verification
    console.print(
        f"[green]applied[/] {escape(rule)}: {len(result.matches)} match(es), "
        f"-{len(result.nodes_removed)}/+{len(result.nodes_added)} nodes; verify {v.mode} "
        f"{'passed' if v.passed else 'FAILED'} (max abs {v.worst_max_abs:.3g})"
    )
    console.print(
        f"segments {summary['mla_segments_before']} → {summary['mla_segments_after']}, "
        f"blockers {summary['blockers_before']} → {summary['blockers_after']}; "
        f"saved {escape(str(output))} ({escape(v0.name)} {escape(str(version.id))})",
        highlight=False,
    )
    for note in result.notes:
        console.print(f"[bold]note:[/] {escape(note)}", highlight=False)


def _refuse_swapped_arguments(rule: str, model: Path) -> None:
    """`surgery apply MODEL RULE` would read "no such file" for the rule's name."""
    if Path(rule).is_file() and not model.exists() and str(model) in {r.name for r in all_rules()}:
        raise UnknownRuleError(
            f"unknown rule {rule!r}: that is a file, and {str(model)!r} is a rule",
            hint=f"the rule comes first: surgery apply {model} {rule}",
        )


@app.command("fix")
@handle_errors
def fix_command(
    model: ModelArg,
    target: TargetOpt = "mlsoc",
    out: FixOutOpt = None,
    max_steps: Annotated[int, typer.Option(min=1, help="Stop after this many applied rules.")] = 30,
    allow_approximate: Annotated[
        bool,
        typer.Option(
            "--allow-approximate",
            help="Also use rules that change the math within a declared bound (e.g. GELU → tanh).",
        ),
    ] = False,
    skip: Annotated[
        list[str] | None, typer.Option("--skip", help="Never use this rule (repeatable).")
    ] = None,
    workspace: WorkspaceOpt = Path(".surgery"),
    name: NameOpt = None,
    input_shape: InputShapeOpt = None,
    inputs: Annotated[
        Path | None,
        typer.Option(
            "--inputs",
            "-i",
            help="A .npz of real inputs keyed by input name (or a .npy for a one-input model) "
            "to verify every step with (default: seeded random).",
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Apply verified rules until the model maps to one MLA segment (exit 0) or nothing helps (1)."""
    output_path = out or Path(f"{Path(model).stem}_fixed.onnx")
    refuse_overwrite(output_path, model)
    ws = Workspace(workspace)
    ws_name = name_in_workspace(ws, model, name)
    loaded = load_model(model, parse_input_shapes(input_shape or []))
    feed = None
    if inputs is not None:
        from surgery.verify import check_user_inputs, load_inputs, model_input_names

        feed = check_user_inputs(loaded, load_inputs(inputs, model_input_names(loaded)))

    def show(step: dict) -> None:
        if not as_json:
            err_console.print(
                f"  {escape(describe_step(step))}, max abs {step['verify']['max_abs']:.2g}",
                highlight=False,
            )

    result = fix_model(
        loaded,
        target,
        max_steps=max_steps,
        allow_approximate=allow_approximate,
        skip=skip or [],
        on_step=show,
        inputs=feed,
    )
    output = save_model(result.model, output_path)  # first: a failed write stores nothing
    v0 = import_or_reuse(ws, model, ws_name)
    final, check = record_fix(ws, v0, result, allow_approximate=allow_approximate, inputs=feed)
    data = {
        **result.to_dict(str(output)),
        "workspace_version": final.id,
        "model": v0.name,
        "verify": check,
    }
    if as_json:
        emit_json(data)
    else:
        verdict = (
            "[bold green]single .elf[/]"
            if result.single_elf
            else f"[bold yellow]{data['mla_segments_after']} MLA segments[/]"
        )
        console.print(
            f"{verdict}: segments {data['mla_segments_before']} → {data['mla_segments_after']}, MLA MAC share "
            f"{100 * data['mla_mac_fraction_before']:.1f}% → {100 * data['mla_mac_fraction_after']:.1f}%, "
            f"{len(result.steps)} verified step(s); wrote {escape(str(output))} (kept as "
            f"{escape(v0.name)} {escape(str(final.id))} in workspace {escape(str(ws.root))})",
            highlight=False,
        )
        for group in data["remaining_blockers"][:8]:
            console.print(
                f"  {group['count']:>4} × {escape('/'.join(group['op_types']))}: "
                f"{escape(group['reason'])}",
                highlight=False,
            )
        for note in result.notes:
            console.print(f"[bold]note:[/] {escape(note)}", highlight=False)
        if not check["passed"]:
            console.print(
                "[bold red]end-to-end verification against the input failed[/]: "
                f"{escape(', '.join(check['failed_outputs']))} (surgery verify shows the errors)",
                highlight=False,
            )
            for out in check["outputs"]:
                if not out["passed"] and out.get("rows_moved"):
                    console.print(
                        f"  {escape(out['name'])}: {escape(out['message'])}", highlight=False
                    )
    raise typer.Exit(EXIT_OK if result.single_elf else EXIT_VERDICT)
