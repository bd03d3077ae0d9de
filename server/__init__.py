"""MCP server: a thin tool layer over `surgery` (and later `compiler`), built on mcp 2.x.

`server.app.create_server` builds it; `surgery serve` runs it over stdio or streamable HTTP.
"""
