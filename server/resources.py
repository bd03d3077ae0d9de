"""Read-only resources: the workspace's models, per-version summaries, op tables, rules.

Resources are what a client may attach to the model's context without a tool call, so each
is small and stable: JSON for data, Markdown for the reference tables.
"""

from __future__ import annotations

import json
from typing import Any

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ResourceNotFoundError

from server.catalogue import rules_markdown, target_markdown
from server.convert import summary_out
from server.errors import resource_errors
from server.state import ServerState
from surgery.summary import summarize
from surgery.targets import available_targets

JSON = "application/json"
MARKDOWN = "text/markdown"


def _json(data: Any) -> str:
    return json.dumps(data, indent=2, default=str)


def register(mcp: MCPServer, state: ServerState) -> None:
    ws = state.workspace

    @mcp.resource("surgery://models", name="models", mime_type=JSON)
    @resource_errors
    def models() -> str:
        """Models in the workspace with their latest version and version count."""
        rows = []
        for name in ws.list_models():
            versions = ws.versions(name)
            first = versions[0]
            rows.append(
                {
                    "name": name,
                    "latest": versions[-1].id,
                    "versions": len(versions),
                    "source": first.params.get("source"),
                    "summary": f"surgery://models/{name}/{versions[-1].id}/summary",
                }
            )
        return _json({"workspace": str(ws.root), "models": rows})

    @mcp.resource("surgery://models/{name}/{version}/summary", name="model-summary", mime_type=JSON)
    @resource_errors
    def model_summary(name: str, version: str) -> str:
        """Summary of one version (inputs, outputs, op histogram, parameters) and its record."""
        info, proto = state.read_only(name, version)
        out = summary_out(info, summarize(proto)).model_dump(mode="json")
        out["record"] = {"action": info.action, "parent": info.parent_id, "coverage": info.coverage}
        return _json(out)

    @mcp.resource("surgery://targets", name="targets", mime_type=JSON)
    @resource_errors
    def targets() -> str:
        """Target profile names and the URIs of their op tables."""
        return _json({"targets": {n: f"surgery://targets/{n}" for n in available_targets()}})

    @mcp.resource("surgery://targets/{name}", name="target-op-table", mime_type=MARKDOWN)
    @resource_errors
    def target_table(name: str) -> str:
        """A target's op table: which processor runs each op, in which precision, under which
        constraints."""
        if name not in available_targets():
            raise ResourceNotFoundError(
                f"unknown target {name!r}; available: {', '.join(available_targets())}"
            )
        return target_markdown(name)

    @mcp.resource("surgery://rules", name="rules", mime_type=MARKDOWN)
    @resource_errors
    def rules() -> str:
        """The rule catalogue (generated from the registry)."""
        return rules_markdown()
