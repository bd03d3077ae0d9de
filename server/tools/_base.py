"""Registration helper: every tool gets honest annotations and the error translation."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.mcpserver.tools.base import Tool
from mcp.types import ToolAnnotations
from pydantic import ValidationError

from server.errors import describe_argument_errors, tool_errors

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
        _check_arguments_clearly(mcp, fn.__name__)
        return fn

    return decorator


class _ArgumentCheckedTool(Tool):
    """A tool whose bad arguments are answered like the server's other refusals
    (`invalid_argument: …` naming each argument, the nearest real name of a misspelt one, and
    the names the tool takes) instead of mcp's raw pydantic report with its links."""

    async def run(
        self, arguments: dict[str, Any], context: Any, convert_result: bool = False
    ) -> Any:
        try:
            self.fn_metadata.validate_arguments(arguments)
        except ValidationError as exc:
            accepted = list(self.parameters.get("properties", {}))
            text = describe_argument_errors(self.name, exc, accepted)
            raise ToolError(f"Error executing tool {self.name}: {text}") from exc
        return await super().run(arguments, context, convert_result=convert_result)


def _check_arguments_clearly(mcp: MCPServer, name: str) -> None:
    """mcp builds each tool's argument model with pydantic's default `extra="ignore"`: an
    argument an agent misspells (`input_shape` for `input_shapes`, `limt`) would be dropped
    without a word and the call answered as if it had not been given. Refuse it instead, say
    so in the advertised schema (`additionalProperties: false`), and word argument errors as
    `_ArgumentCheckedTool` does."""
    manager = mcp._tool_manager  # no public accessor in mcp 2.x
    tool = manager.get_tool(name)
    if tool is None:
        raise RuntimeError(f"tool {name!r} was not registered")
    model = tool.fn_metadata.arg_model
    model.model_config["extra"] = "forbid"
    model.model_rebuild(force=True)
    tool.parameters = model.model_json_schema(by_alias=True)
    manager._tools[name] = _ArgumentCheckedTool.model_construct(**dict(tool))
