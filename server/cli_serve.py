"""`surgery serve`: the MCP server, over stdio (default) or streamable HTTP on loopback.

The server package is imported inside the command so `surgery` itself never depends on it.
"""

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from surgery.cli.app import app, err_console, handle_errors


class LogLevel(str, Enum):
    """The levels the server logs at on stderr."""

    DEBUG = "DEBUG"
    INFO = "INFO"
    WARNING = "WARNING"
    ERROR = "ERROR"


@app.command("serve")
@handle_errors
def serve_command(
    http: Annotated[
        bool, typer.Option("--http", help="Serve streamable HTTP instead of stdio.")
    ] = False,
    host: Annotated[
        str,
        typer.Option(
            help="HTTP bind address. Anything but loopback requires --token.",
        ),
    ] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="HTTP port.", min=1, max=65535)] = 8000,
    token: Annotated[
        str | None,
        typer.Option(
            envvar="SURGERY_MCP_TOKEN",
            help="Bearer token HTTP clients must send (Authorization: Bearer TOKEN).",
        ),
    ] = None,
    workspace: Annotated[
        Path,
        typer.Option("--workspace", "-w", help="Workspace folder for model versions."),
    ] = Path(".surgery"),
    allow_root: Annotated[
        list[Path] | None,
        typer.Option(
            "--allow-root",
            help="Folder tools may read and write (repeatable; default: the current folder).",
        ),
    ] = None,
    target: Annotated[
        str, typer.Option("--target", "-t", help="Default target profile for the tools.")
    ] = "mlsoc",
    log_level: Annotated[
        LogLevel,
        typer.Option(case_sensitive=False, help="Log level on stderr."),
    ] = LogLevel.WARNING,
) -> None:
    """Run the MCP server for Claude Code, Codex or any MCP client (stdio unless --http).

    Every path a tool reads or writes must lie under an --allow-root folder.
    """
    from server.app import create_server
    from server.transport import check_http_binding, serve_http, serve_stdio

    if http:
        check_http_binding(host, token)  # refuse before building anything
    roots = allow_root or [Path.cwd()]
    mcp = create_server(workspace, roots, default_target=target, log_level=log_level.value)
    try:
        if not http:
            serve_stdio(mcp)
            return
        auth = "bearer token required" if token else "no token (loopback only)"
        err_console.print(
            f"model-surgery MCP on http://{escape(host)}:{port}/mcp ({auth}); "
            f"workspace {escape(str(workspace))}, "
            f"allowed roots: {escape(', '.join(str(r) for r in roots))}",
            highlight=False,
            soft_wrap=True,
        )
        serve_http(mcp, host, port, token)
    except KeyboardInterrupt:
        raise typer.Exit(0) from None
