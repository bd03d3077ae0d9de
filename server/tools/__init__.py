"""MCP tools, one module per area; each module's `register(mcp, state)` adds its tools."""

from __future__ import annotations

import importlib
from importlib.util import find_spec

from mcp.server.mcpserver import MCPServer

from server.state import ServerState
from server.tools import coverage, graph, pipeline, rules, versions

_CORE = (graph, coverage, rules, versions, pipeline)
_OPTIONAL = {"server.tools.edit": ("surgery.edit", "surgery.split")}
"""Tool modules whose core API may not be in this install yet: registered when it is."""


def register_all(mcp: MCPServer, state: ServerState) -> None:
    for module in _CORE:
        module.register(mcp, state)
    for name, needs in _OPTIONAL.items():
        if all(find_spec(n) is not None for n in needs):
            importlib.import_module(name).register(mcp, state)
