"""Running the server: stdio (default) or streamable HTTP bound to loopback.

HTTP on a non-loopback address exposes the workspace and every allowed root to the network, so
it is refused unless a bearer token is set; the token is checked on every request in constant
time. On loopback the SDK's DNS-rebinding protection (Host/Origin checks) stays on.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from typing import Any

import anyio
from mcp.server.mcpserver import MCPServer
from starlette.types import ASGIApp, Receive, Scope, Send

from surgery.errors import SurgeryError

log = logging.getLogger("server")


class ServeConfigError(SurgeryError):
    code = "serve_config"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_http_binding(host: str, token: str | None) -> None:
    """Refuse a non-loopback bind without a token, saying why and what to do."""
    if not is_loopback(host) and not token:
        raise ServeConfigError(
            f"--host {host} is not a loopback address: anyone who can reach it could read and "
            "rewrite models under the allowed roots",
            hint="pass --token SECRET (or set SURGERY_MCP_TOKEN); clients then send "
            "'Authorization: Bearer SECRET'. Or keep the default --host 127.0.0.1",
        )


class BearerAuth:
    """ASGI middleware: every HTTP request must carry `Authorization: Bearer <token>`."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                await _unauthorized(send)
                return
        await self.app(scope, receive, send)


async def _unauthorized(send: Send) -> None:
    body = b'{"error": "unauthorized: send Authorization: Bearer <token>"}'
    await send(
        {
            "type": "http.response.start",
            "status": 401,
            "headers": [
                (b"content-type", b"application/json"),
                (b"www-authenticate", b'Bearer realm="model-surgery"'),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def http_app(mcp: MCPServer, host: str, token: str | None) -> Any:
    app = mcp.streamable_http_app(host=host)
    return BearerAuth(app, token) if token else app


def serve_http(
    mcp: MCPServer, host: str = "127.0.0.1", port: int = 8000, token: str | None = None
) -> None:
    """Serve streamable HTTP at http://HOST:PORT/mcp until interrupted."""
    import uvicorn

    check_http_binding(host, token)
    config = uvicorn.Config(
        http_app(mcp, host, token),
        host=host,
        port=port,
        log_config=None,  # uvicorn's default sends access logs to stdout; keep them on stderr
        log_level="warning",
        lifespan="on",
    )
    anyio.run(uvicorn.Server(config).serve)


def serve_stdio(mcp: MCPServer) -> None:
    """Serve over stdin/stdout. The SDK points fd 1 at stderr while serving, so a stray print
    from any library lands in the log instead of corrupting the JSON-RPC stream."""
    mcp.run("stdio")
