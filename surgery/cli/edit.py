"""`surgery split`, `merge`, `edit` and `cut-postprocess`: structural edits on the command line.

Each reads its model(s), writes the result to `-o` (never over an input file) and prints a
summary, or one JSON document with `--json`. Bad requests exit 2 with a one-line message.
"""

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

import onnx
import typer
from rich.markup import escape

from surgery.cli.app import app, console, emit_json, handle_errors, refuse_overwrite
from surgery.cli.options import InputShapeOpt, JsonOpt, ModelArg, TargetOpt
from surgery.errors import SurgeryError
from surgery.model import load_model, parse_input_shapes, save_model

OutArg = Annotated[
    Path, typer.Option("--out", "--output", "-o", help="Where to write the resulting model.")
]
TensorsOpt = Annotated[
    list[str] | None,
    typer.Option(help="Tensor names, comma-separated or repeated.", metavar="T1,T2"),
]


def _names(values: Sequence[str] | None) -> list[str]:
    return [t.strip() for v in values or [] for t in v.split(",") if t.strip()]


def _io_summary(model: onnx.ModelProto) -> dict[str, Any]:
    inits = {t.name for t in model.graph.initializer}
    return {
        "nodes": len(model.graph.node),
        "inputs": [i.name for i in model.graph.input if i.name not in inits],
        "outputs": [o.name for o in model.graph.output],
    }


@app.command("split")
@handle_errors
def split_command(
    model: ModelArg,
    out: OutArg,
    inputs: Annotated[
        list[str] | None,
        typer.Option(
            "--inputs",
            help="Tensors the part starts from (default: the model's inputs).",
            metavar="T1,T2",
        ),
    ] = None,
    outputs: Annotated[
        list[str] | None,
        typer.Option(
            "--outputs",
            help="Tensors the part computes (default: the model's outputs).",
            metavar="T1,T2",
        ),
    ] = None,
    input_shape: InputShapeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Extract the subgraph between named tensors as its own model.

    Give --inputs, --outputs or both; the one left out is the model's own.
    """
    from surgery.split import SplitError, split_model

    refuse_overwrite(out, model)
    loaded = load_model(model, parse_input_shapes(input_shape or []))
    ins, outs = _names(inputs), _names(outputs)
    if not ins and not outs:
        raise SplitError("give --inputs and/or --outputs (tensor names where the part starts/ends)")
    inits = {t.name for t in loaded.graph.initializer}
    ins = ins or [i.name for i in loaded.graph.input if i.name not in inits]
    outs = outs or [o.name for o in loaded.graph.output]
    part = split_model(loaded, ins, outs)
    path = save_model(part, out)
    data = {"output": str(path), "source_nodes": len(loaded.graph.node), **_io_summary(part)}
    if as_json:
        emit_json(data)
        return
    console.print(
        f"[green]split[/] {data['nodes']} of {data['source_nodes']} nodes "
        f"({escape(', '.join(data['inputs']) or 'no inputs')} → "
        f"{escape(', '.join(data['outputs']))}); wrote {escape(str(path))}",
        highlight=False,
    )


def _parse_map(items: Sequence[str]) -> list[tuple[str, str]]:
    """`--map A_OUT=B_IN,…` as (A output, B input) pairs."""
    from surgery.split import SplitError

    pairs = []
    for item in items:
        for spec in item.split(","):
            a_out, sep, b_in = spec.strip().partition("=")
            if not sep or not a_out or not b_in:
                raise SplitError(f"--map {spec!r}: expected A_OUT=B_IN")
            pairs.append((a_out, b_in))
    return pairs


def _same_name_map(a: onnx.ModelProto, b: onnx.ModelProto) -> list[tuple[str, str]]:
    b_inputs = {i.name for i in b.graph.input}
    return [(o.name, o.name) for o in a.graph.output if o.name in b_inputs]


@app.command("merge")
@handle_errors
def merge_command(
    model_a: Annotated[Path, typer.Argument(help="First model (.onnx): its outputs feed B.")],
    model_b: Annotated[Path, typer.Argument(help="Second model (.onnx).")],
    out: OutArg,
    io_map: Annotated[
        list[str] | None,
        typer.Option(
            "--map",
            help="Feed output A_OUT of A into input B_IN of B (repeatable). Default: A's "
            "outputs into B's inputs of the same name.",
            metavar="A_OUT=B_IN",
        ),
    ] = None,
    prefix: Annotated[
        str | None,
        typer.Option(help="Prefix all of B's names (default: only names that collide)."),
    ] = None,
    keep: Annotated[
        list[str] | None,
        typer.Option(
            help="Outputs of A that B reads to keep as outputs of the merged model too (they "
            "are dropped otherwise); comma-separated or repeated.",
            metavar="T1,T2",
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Connect two models into one (e.g. a body and its post-processing)."""
    from surgery.split import SplitError, merge_models

    refuse_overwrite(out, model_a, model_b)
    a, b = load_model(model_a), load_model(model_b)
    pairs = _parse_map(io_map or []) or _same_name_map(a, b)
    if not pairs:
        raise SplitError(
            "no outputs of A match inputs of B by name; say how to connect them with --map",
            hint=f"A's outputs: {', '.join(o.name for o in a.graph.output)}",
        )
    merged = merge_models(a, b, pairs, prefix=prefix, keep_outputs=_names(keep))
    path = save_model(merged, out)
    data = {"output": str(path), "map": [list(p) for p in pairs], **_io_summary(merged)}
    if as_json:
        emit_json(data)
        return
    console.print(
        f"[green]merged[/] {len(pairs)} connection(s), {data['nodes']} nodes "
        f"({escape(', '.join(data['inputs']))} → {escape(', '.join(data['outputs']))}); "
        f"wrote {escape(str(path))}",
        highlight=False,
    )


def _read_ops(spec: str) -> list[Any]:
    """An edit list from a JSON file, or inline JSON when the value starts with '[' (or '{',
    to say that one edit must be in a list)."""
    from surgery.edit import EditError

    text = spec
    if not spec.lstrip().startswith(("[", "{")):
        path = Path(spec)
        if not path.is_file():
            raise EditError(f"--ops {spec}: no such file (give a .json file or an inline list)")
        text = path.read_text()
    try:
        ops = json.loads(text)
    except json.JSONDecodeError as exc:
        raise EditError(f"--ops: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(ops, list):
        raise EditError('--ops: expected a JSON list like [{"op": "remove_node", "node": "X"}]')
    return ops


@app.command("edit")
@handle_errors
def edit_command(
    model: ModelArg,
    out: OutArg,
    ops: Annotated[
        str,
        typer.Option(
            "--ops",
            help='Edits as a JSON list, in a file or inline: [{"op": "remove_node", '
            '"node": "X"}, …]. Ops: remove_node, bypass_node, replace_op, set_attributes, '
            "insert_node_before, insert_node_after, rename_tensor, set_input_shape, "
            "add_output, remove_output, replace_initializer.",
            metavar="OPS.json",
        ),
    ],
    input_shape: InputShapeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Apply low-level edits (each checked by the ONNX checker) and write the result."""
    from surgery.edit import apply_edits

    refuse_overwrite(out, model)
    edits = _read_ops(ops)
    loaded = load_model(model, parse_input_shapes(input_shape or []))
    edited = apply_edits(loaded, edits)
    path = save_model(edited, out)
    data = {
        "output": str(path),
        "edits": len(edits),
        "ops": [e.get("op") if isinstance(e, dict) else None for e in edits],
        "nodes_before": len(loaded.graph.node),
        **_io_summary(edited),
    }
    if as_json:
        emit_json(data)
        return
    console.print(
        f"[green]edited[/] {len(edits)} edit(s), nodes {data['nodes_before']} → "
        f"{data['nodes']}; wrote {escape(str(path))} (numbers may differ: check with `surgery verify`)",
        highlight=False,
    )


@app.command("cut-postprocess")
@handle_errors
def cut_postprocess_command(
    model: ModelArg,
    out: OutArg,
    post: Annotated[Path, typer.Option("--post", help="Where to write the post-processing model.")],
    target: TargetOpt = "mlsoc",
    input_shape: InputShapeOpt = None,
    inputs: Annotated[
        Path | None,
        typer.Option(
            "--inputs",
            "-i",
            help="An .npz keyed by input name for the proof (default: seeded).",
            metavar="FILE.npz",
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Cut the decode tail off a detector: an MLA body (4-D maps) and a post-processing model,
    with the proof that body→post reproduces the original exactly."""
    from surgery.rules.structure import cut_postprocess
    from surgery.verify import check_user_inputs, load_inputs, model_input_names

    refuse_overwrite(out, model)
    refuse_overwrite(post, model)
    if out.resolve() == post.resolve():
        raise SurgeryError("-o and --post name the same file; the body and post need two")
    loaded = load_model(model, parse_input_shapes(input_shape or []))
    feed = (
        check_user_inputs(loaded, load_inputs(inputs, model_input_names(loaded)))
        if inputs
        else None
    )
    body, post_model, report = cut_postprocess(loaded, target, inputs=feed)
    body_path, post_path = save_model(body, out), save_model(post_model, post)
    report.post_path = str(post_path)
    data = {"body": str(body_path), "post": str(post_path), **report.to_dict()}
    if as_json:
        emit_json(data)
        return
    proof = report.proof
    console.print(
        f"[green]cut[/] {len(report.plan.tail)} post-processing node(s) "
        f"({escape(', '.join(f'{k}×{v}' for k, v in report.plan.tail_ops.items()))}); body ends at "
        f"{len(report.plan.cut)} 4-D map(s), {report.body_segments} MLA segment(s) "
        f"(was {report.segments_before})",
        highlight=False,
    )
    verdict = "bitwise identical" if proof.bitwise else "exact within float rounding"
    console.print(
        f"proof: body→post vs original on {len(proof.outputs)} output(s): {verdict}; "
        f"wrote {escape(str(body_path))} and {escape(str(post_path))}",
        highlight=False,
    )
