"""Tools that bring a model in and look at it: open, summary, node queries, validation."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

import onnx
from mcp.server.mcpserver import MCPServer
from pydantic import Field

from server.convert import summary_out
from server.models import (
    FindNodesOut,
    LimitArg,
    ModelName,
    NodeBrief,
    NodeOut,
    OffsetArg,
    OpenModelOut,
    Page,
    PathArg,
    SummaryOut,
    Tensor,
    ValidateOut,
    ValidationProblem,
    VersionArg,
)
from server.state import ServerState
from server.tools._base import register_tool
from surgery.errors import SurgeryError
from surgery.model import check_model_fully, load_model
from surgery.query import find_nodes as core_find_nodes
from surgery.query import inspect_node as core_inspect_node
from surgery.query import neighbourhood
from surgery.session import open_in_workspace
from surgery.summary import summarize
from surgery.workspace import VersionInfo, sanitize_name, validate_name

InputShapes = Annotated[
    dict[str, list[Annotated[int, Field(gt=0)]]] | None,
    Field(
        description='Fix dynamic input dims, e.g. {"images": [1, 3, 640, 640]}. '
        "The file itself is never modified."
    ),
]
MAX_NEIGHBOURS = 60


def _import(
    state: ServerState, path: Path, name: str, shapes: dict[str, list[int]] | None
) -> tuple[VersionInfo, bool, onnx.ModelProto]:
    """Import `path` as `name`, reusing the latest version when it is the same file.

    Validation runs first (typed errors for corrupt, cyclic, … files, before anything is
    stored); the check-then-import runs under the server's import lock so two clients opening
    the same file at once get one version, not an "already exists" error.
    """
    with state.import_lock:
        return open_in_workspace(state.workspace, path, name, input_shapes=shapes)


def register(mcp: MCPServer, state: ServerState) -> None:
    @register_tool(mcp, title="Open a model", read_only=False, idempotent=True)
    def open_model(
        path: PathArg,
        name: Annotated[
            str | None,
            Field(description="Workspace name (default: the file name without .onnx)."),
        ] = None,
        input_shapes: InputShapes = None,
    ) -> OpenModelOut:
        """Import an ONNX file into the workspace (the file is only read) and summarise it.

        Returns the model name and version that every other tool takes. Opening the same
        unchanged file again returns the existing version instead of adding one.
        """
        source = state.input_path(path)
        model_name = validate_name(name) if name else sanitize_name(source.stem)
        info, created, model = _import(state, source, model_name, input_shapes)
        return OpenModelOut(
            model=info.name,
            version=info.id,
            created=created,
            source=str(source),
            summary=summary_out(info, summarize(model), top_ops=10),
        )

    @register_tool(mcp, title="Model summary", read_only=True, idempotent=True)
    def model_summary(
        model: ModelName,
        version: VersionArg = "latest",
        top_ops: Annotated[int, Field(ge=1, le=200, description="Op types to list.")] = 20,
    ) -> SummaryOut:
        """Inputs/outputs, opsets, node count, op histogram, parameters and dynamic dims."""
        info, proto = state.read_only(model, version)
        return summary_out(info, summarize(proto), top_ops)

    @register_tool(mcp, title="Inspect a node", read_only=True, idempotent=True)
    def inspect_node(
        model: ModelName,
        node: Annotated[str, Field(description="Node name, or the name of a tensor it produces.")],
        version: VersionArg = "latest",
        hops: Annotated[
            int, Field(ge=0, le=3, description="Also list nodes within this many edges.")
        ] = 0,
    ) -> NodeOut:
        """One node with its attributes, input/output tensors (shapes, producers, consumers)
        and, with hops > 0, its neighbourhood — instead of dumping the whole graph."""
        info, proto = state.read_only(model, version)
        detail = core_inspect_node(proto, node)
        around: list[dict] = []
        if hops:
            around = neighbourhood(proto, node, hops)["nodes"]
        return NodeOut(
            model=info.name,
            version=info.id,
            node=detail,
            neighbourhood=around[:MAX_NEIGHBOURS],
            neighbourhood_truncated=len(around) > MAX_NEIGHBOURS,
        )

    @register_tool(mcp, title="Find nodes", read_only=True, idempotent=True)
    def find_nodes(
        model: ModelName,
        version: VersionArg = "latest",
        op_type: Annotated[str | None, Field(description="Op type, e.g. 'Reshape'.")] = None,
        pattern: Annotated[
            str | None,
            Field(description="Name filter: substring, glob ('*/Reshape_*') or /regex/."),
        ] = None,
        limit: LimitArg = 50,
        offset: OffsetArg = 0,
    ) -> FindNodesOut:
        """Nodes by op type and/or name pattern, paged (limit/offset), with output shapes."""
        info, proto = state.read_only(model, version)
        try:
            found = core_find_nodes(proto, op_type=op_type, pattern=pattern, limit=offset + limit)
        except re.error as exc:
            raise SurgeryError(
                f"pattern {pattern!r} is not a valid regular expression: {exc}",
                hint="use a substring, a glob like '*/Reshape_*', or a valid /regex/",
            ) from None
        chunk = found["nodes"][offset:]
        return FindNodesOut(
            model=info.name,
            version=info.id,
            page=Page.of(found["count"], offset, len(chunk)),
            nodes=[
                NodeBrief(
                    name=n["name"],
                    op_type=n["op_type"],
                    outputs=[
                        Tensor(name=o["name"], dtype=o["dtype"], shape=o["shape"])
                        for o in n["outputs"]
                    ],
                )
                for n in chunk
            ],
        )

    @register_tool(mcp, title="Validate a model", read_only=True, idempotent=True)
    def validate_model(
        path: Annotated[
            str | None, Field(description="An .onnx file under the allowed roots.", max_length=4096)
        ] = None,
        model: Annotated[str | None, Field(description="Or a workspace model name.")] = None,
        version: VersionArg = "latest",
    ) -> ValidateOut:
        """Load a model and run the full ONNX checker; problems are returned, not raised.

        Use it on a file before open_model, or on a workspace version after an edit.
        """
        if (path is None) == (model is None):
            raise SurgeryError("pass exactly one of `path` or `model`")
        source = state.input_path(path) if path is not None else state.info(model, version).path
        label = str(source) if path is not None else f"{model} {state.info(model, version).id}"
        problems: list[ValidationProblem] = []
        try:
            loaded = load_model(source)
        except SurgeryError as exc:
            problems.append(ValidationProblem(code=exc.code, message=exc.message, hint=exc.hint))
            return ValidateOut(valid=False, source=label, problems=problems)
        try:
            check_model_fully(loaded)
        except (onnx.checker.ValidationError, onnx.shape_inference.InferenceError) as exc:
            first = str(exc).strip().splitlines()[0][:500]
            problems.append(ValidationProblem(code="checker", message=first))
        opset = next((o.version for o in loaded.opset_import if o.domain in ("", "ai.onnx")), None)
        return ValidateOut(
            valid=not problems,
            source=label,
            problems=problems,
            nodes=len(loaded.graph.node),
            opset=opset,
        )
