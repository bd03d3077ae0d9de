"""Building the MCP server: one MCPServer with every tool, resource and prompt registered."""

from __future__ import annotations

import os
from collections.abc import Sequence

from mcp.server.mcpserver import MCPServer

from server import prompts, resources, tools
from server.state import DEFAULT_TARGET, ServerState

INSTRUCTIONS = """\
model-surgery: check, rewrite and verify ONNX models for an edge NPU (MLA accelerator, CVU
vector DSP, APU CPU). Start with open_model(path); every other tool addresses the model by the
returned name (+ version, default latest). Loop: check_model -> suggest_rules -> apply_rule or
fix_model -> verify_models -> check_model, until single_elf is true. Edits are new immutable
versions (history, diff_versions, revert). Paths must lie under the server's allowed roots.
"""


def create_server(
    workspace: str | os.PathLike[str] = ".surgery",
    allow_roots: Sequence[str | os.PathLike[str]] = (".",),
    *,
    default_target: str = DEFAULT_TARGET,
    log_level: str = "WARNING",
) -> MCPServer:
    """A ready server over `workspace`, reading and writing only under `allow_roots`."""
    from surgery.targets import load_target

    load_target(default_target)  # fail at start-up, not on the first call, for a bad target
    state = ServerState.create(workspace, allow_roots, default_target)
    mcp = MCPServer(
        "model-surgery",
        title="model-surgery",
        instructions=INSTRUCTIONS,
        version=_version(),
        log_level=log_level,  # type: ignore[arg-type]
    )
    tools.register_all(mcp, state)
    resources.register(mcp, state)
    prompts.register(mcp, state)
    return mcp


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("model-surgery")
    except PackageNotFoundError:
        return "0"
