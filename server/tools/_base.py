"""Registration helper: every tool gets honest annotations and the error translation."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from mcp.server.mcpserver import MCPServer
from mcp.types import ToolAnnotations

from server.errors import tool_errors

F = TypeVar("F", bound=Callable[..., Any])


def register_tool(
    mcp: MCPServer,
    *,
    title: str,
    read_only: bool,
    idempotent: bool,
    destructive: bool = False,
) -> Callable[[F], F]:
    """Decorator: wrap errors, then register with annotations (openWorldHint is always False:
    tools touch only the workspace and the allowed roots, never the network)."""
    annotations = ToolAnnotations(
        title=title,
        read_only_hint=read_only,
        destructive_hint=destructive,
        idempotent_hint=idempotent,
        open_world_hint=False,
    )

    def decorator(fn: F) -> F:
        mcp.add_tool(tool_errors(fn), title=title, annotations=annotations, structured_output=True)
        _forbid_unknown_arguments(mcp, fn.__name__)
        return fn

    return decorator


def _forbid_unknown_arguments(mcp: MCPServer, name: str) -> None:
    """mcp builds each tool's argument model with pydantic's default `extra="ignore"`: an
    argument an agent misspells (`input_shape` for `input_shapes`, `limt`) would be dropped
    without a word and the call answered as if it had not been given. Refuse it instead, and
    say so in the advertised schema (`additionalProperties: false`)."""
    tool = mcp._tool_manager.get_tool(name)  # no public accessor in mcp 2.x
    if tool is None:
        raise RuntimeError(f"tool {name!r} was not registered")
    model = tool.fn_metadata.arg_model
    model.model_config["extra"] = "forbid"
    model.model_rebuild(force=True)
    tool.parameters = model.model_json_schema(by_alias=True)
