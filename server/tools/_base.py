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
        return fn

    return decorator
