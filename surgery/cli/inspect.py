"""`surgery inspect`: a model summary, or one focused query (node, neighbourhood, search)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from surgery.cli.app import app, console, emit_json, handle_errors
from surgery.cli.options import InputShapeOpt, JsonOpt, ModelArg
from surgery.graph import shape_text
from surgery.model import load_model, parse_input_shapes
from surgery.query import find_nodes, inspect_node, neighbourhood
from surgery.summary import summarize


@app.command("inspect")
@handle_errors
def inspect_command(
    model: ModelArg,
    node: Annotated[
        str | None,
        typer.Option("--node", "-n", help="Show one node (by node or output tensor name)."),
    ] = None,
    hops: Annotated[
        int, typer.Option(help="With --node: include neighbours up to this many edges away.")
    ] = 0,
    op: Annotated[str | None, typer.Option("--op", help="List nodes of this op type.")] = None,
    find: Annotated[
        str | None,
        typer.Option("--find", help="List nodes whose name matches (substring, glob, or /regex/)."),
    ] = None,
    limit: Annotated[int, typer.Option(help="Maximum nodes listed by --op/--find.")] = 50,
    input_shape: InputShapeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Summarise a model, or answer one focused question about it."""
    m = load_model(model, parse_input_shapes(input_shape or []))
    if node:
        data = neighbourhood(m, node, hops) if hops > 0 else inspect_node(m, node)
    elif op or find:
        data = find_nodes(m, op_type=op, pattern=find, limit=limit)
    else:
        data = summarize(m).to_dict()
    if as_json:
        emit_json(data)
        return
    if node or op or find:
        console.print_json(data=data)
        return
    _render_summary(str(model), data)


def _render_summary(label: str, s: dict) -> None:
    console.print(
        f"[bold]{label}[/]  IR {s['ir_version']}, opsets {s['opsets']}, producer {s['producer'] or '—'}",
        highlight=False,
    )
    io = Table("", "name", "dtype", "shape", show_edge=False, header_style="bold")
    for kind in ("inputs", "outputs"):
        for t in s[kind]:
            io.add_row(kind[:-1], t["name"], t["dtype"], str(t["shape"]))
    console.print(io)
    console.print(
        f"{s['nodes']} nodes ({s['nodes_including_subgraphs']} incl. subgraphs), "
        f"{s['parameters']:,} parameters ({s['parameter_bytes'] / 2**20:.1f} MiB)"
    )
    ops = ", ".join(f"{k} {v}" for k, v in list(s["op_histogram"].items())[:20])
    console.print(f"ops: {ops}", highlight=False)
    if s["dynamic_dims"]:
        dims = ", ".join(f"{k}={shape_text(v)}" for k, v in s["dynamic_dims"].items())
        console.print(
            f"[yellow]dynamic inputs:[/] {dims} — fix with --input-shape NAME=DIMS",
            highlight=False,
        )
    if s["custom_domains"]:
        console.print(f"custom domains: {', '.join(s['custom_domains'])}")
