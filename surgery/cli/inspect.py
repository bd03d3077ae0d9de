"""`surgery inspect`: a model summary, or one focused query (node, neighbourhood, search)."""

from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from surgery.cli.app import app, console, emit_json, handle_errors
from surgery.cli.options import InputShapeOpt, JsonOpt, ModelArg
from surgery.errors import SurgeryError
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
        int,
        typer.Option(min=0, help="With --node: include neighbours up to this many edges away."),
    ] = 0,
    op: Annotated[str | None, typer.Option("--op", help="List nodes of this op type.")] = None,
    find: Annotated[
        str | None,
        typer.Option("--find", help="List nodes whose name matches (substring, glob, or /regex/)."),
    ] = None,
    limit: Annotated[int, typer.Option(min=1, help="Maximum nodes listed by --op/--find.")] = 50,
    input_shape: InputShapeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Summarise a model, or answer one focused question about it: one node (--node, with
    --hops its neighbourhood) or the nodes of an op type or name pattern (--op / --find)."""
    if node and (op or find):
        raise SurgeryError("--node shows one node; --op/--find list nodes: give one of them")
    if hops and not node:
        raise SurgeryError("--hops is the neighbourhood of a --node: give --node NAME too")
    m = load_model(model, parse_input_shapes(input_shape or []))
    if node:
        data = neighbourhood(m, node, hops) if hops > 0 else inspect_node(m, node)
    elif op or find:
        data = find_nodes(m, op_type=op, pattern=find, limit=limit)
    else:
        data = summarize(m).to_dict()
    if as_json:
        emit_json(data)
    elif node and hops > 0:
        _render_neighbourhood(data)
    elif node:
        _render_node(data)
    elif op or find:
        _render_found(data)
    else:
        _render_summary(str(model), data)


def _tensor_table(tensors: list[dict], link: str) -> Table:
    """Tensors with dtype, shape and their producer (inputs) or consumers (outputs)."""
    table = Table("name", "dtype", "shape", link, show_edge=False, header_style="bold")
    for t in tensors:
        linked = t.get("producer") if link == "producer" else ", ".join(t.get("consumers", []))
        if t.get("graph_output"):
            linked = ", ".join(filter(None, [linked, "(graph output)"]))
        shape = shape_text(t["shape"]) if "shape" in t else "?"
        table.add_row(*map(escape, (t["name"], t.get("dtype", "?"), shape, linked or "—")))
    return table


def _render_node(d: dict) -> None:
    console.print(
        f"[bold]{escape(d['name'])}[/]: {d['op_type']} ({d['domain']}), node #{d['index']}",
        highlight=False,
    )
    for key, value in d["attributes"].items():
        console.print(f"  {key} = {escape(str(value))}", highlight=False)
    console.print("[bold]inputs[/]")
    console.print(_tensor_table(d["inputs"], "producer"))
    console.print("[bold]outputs[/]")
    console.print(_tensor_table(d["outputs"], "consumers"))


def _render_neighbourhood(d: dict) -> None:
    console.print(f"[bold]{escape(d['centre'])}[/] and its nodes up to {d['hops']} edge(s) away")
    table = Table("hops", "name", "op", "outputs", show_edge=False, header_style="bold")
    for n in d["nodes"]:
        outs = ", ".join(
            f"{o['name']} {shape_text(o.get('shape'))}" if isinstance(o, dict) else str(o)
            for o in n["outputs"]
        )
        table.add_row(str(n["distance"]), escape(n["name"]), n["op_type"], escape(outs))
    console.print(table)


def _render_found(d: dict) -> None:
    table = Table("name", "op", "outputs", show_edge=False, header_style="bold")
    for n in d["nodes"]:
        outs = ", ".join(f"{o['name']} {shape_text(o.get('shape'))}" for o in n["outputs"])
        table.add_row(escape(n["name"]), n["op_type"], escape(outs))
    console.print(table)
    more = " (raise --limit for the rest)" if d["truncated"] else ""
    console.print(f"{len(d['nodes'])} of {d['count']} node(s){more}", highlight=False)


def _render_summary(label: str, s: dict) -> None:
    console.print(
        f"[bold]{escape(label)}[/]  IR {s['ir_version']}, opsets {escape(str(s['opsets']))}, "
        f"producer {escape(s['producer'] or '—')}",
        highlight=False,
    )
    io = Table("", "name", "dtype", "shape", show_edge=False, header_style="bold")
    for kind in ("inputs", "outputs"):
        for t in s[kind]:
            io.add_row(kind[:-1], escape(t["name"]), t["dtype"], escape(shape_text(t["shape"])))
    console.print(io)
    console.print(
        f"{s['nodes']} nodes ({s['nodes_including_subgraphs']} incl. subgraphs), "
        f"{s['parameters']:,} parameters ({s['parameter_bytes'] / 2**20:.1f} MiB)"
    )
    ops = ", ".join(f"{k} {v}" for k, v in list(s["op_histogram"].items())[:20])
    console.print(f"ops: {ops}", highlight=False)
    if s["dynamic_dims"]:
        dims = escape(", ".join(f"{k}={shape_text(v)}" for k, v in s["dynamic_dims"].items()))
        console.print(
            f"[yellow]dynamic inputs:[/] {dims} — fix with --input-shape NAME=DIMS",
            highlight=False,
        )
    if s["custom_domains"]:
        console.print(f"custom domains: {', '.join(s['custom_domains'])}")
