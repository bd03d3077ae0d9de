"""`surgery targets`: list target profiles, show one op table, explain one op."""

from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from surgery.cli.app import app, console, emit_json, handle_errors
from surgery.cli.options import JsonOpt
from surgery.errors import TargetError
from surgery.targets import available_targets, load_target


@app.command("targets")
@handle_errors
def targets_command(
    target: Annotated[str | None, typer.Argument(help="Profile to show; omit to list all.")] = None,
    op: Annotated[
        str | None, typer.Option("--op", help="Explain one op type, e.g. Resize.")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """List target profiles, or show what one target runs where (and under which constraints)."""
    if target is None:
        if op:
            raise TargetError("--op needs a target, e.g. `surgery targets mlsoc --op Resize`")
        rows = []
        for name in available_targets():
            t = load_target(name)
            rows.append(
                {
                    "name": name,
                    "title": t.profile.title,
                    "processors": list(t.profile.processors),
                    "mla_precisions": t.profile.processors["MLA"].precisions,
                    "mla_ops": sum(1 for o in t.ops if t.supports(o, "MLA")),
                }
            )
        if as_json:
            emit_json({"targets": rows})
            return
        table = Table(
            "target", "title", "MLA precisions", "MLA ops", show_edge=False, header_style="bold"
        )
        for r in rows:
            table.add_row(
                escape(r["name"]),
                escape(str(r["title"])),
                escape(", ".join(r["mla_precisions"])),
                str(r["mla_ops"]),
            )
        console.print(table)
        return
    tgt = load_target(target)
    if op:
        info = tgt.explain(op)
        if as_json:
            emit_json(info)
            return
        note = f": {escape(info['note'])}" if info["note"] else ""
        console.print(
            f"[bold]{escape(op)}[/] on [bold]{escape(tgt.name)}[/]{note}", highlight=False
        )
        for placement in info["placements"]:
            proc = escape(placement["processor"])
            prec = escape(", ".join(placement["precisions"]) or "—")
            suffix = " (fallback: runs anything)" if placement.get("fallback") else ""
            console.print(f"  [cyan]{proc}[/] \\[{prec}]{suffix}", highlight=False)
            for c in placement["constraints"]:
                console.print(f"    • {escape(c['rule'])}", highlight=False)
        return
    data = {
        "name": tgt.name,
        "title": tgt.profile.title,
        "description": tgt.profile.description,
        "source": tgt.profile.source,
        "processors": {k: v.model_dump() for k, v in tgt.profile.processors.items()},
        "ops": {
            op_type: [r.processor for r in tgt.rules_for(op_type)] for op_type in sorted(tgt.ops)
        },
    }
    if as_json:
        emit_json(data)
        return
    console.print(
        f"[bold]{escape(tgt.name)}[/]: {escape(str(tgt.profile.title))}\n"
        f"{escape(str(tgt.profile.description))}\n[dim]source: {escape(str(tgt.profile.source))}[/]"
    )
    table = Table("op", "processors", "note", show_edge=False, header_style="bold")
    for op_type in sorted(tgt.ops):
        procs = " → ".join(r.processor for r in tgt.rules_for(op_type))
        table.add_row(
            escape(op_type),
            escape(procs + " → APU" if "APU" not in procs else procs),
            escape(tgt.ops[op_type].note or ""),
        )
    console.print(table)
    console.print(
        "[dim]Ops not listed run on the APU. Explain one: surgery targets NAME --op OP[/]"
    )
