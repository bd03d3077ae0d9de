"""The full `surgery` command line: the graph engine's commands, the compiler's, and `serve`.

Each layer registers its own commands on the one typer app from `surgery.cli.app`; assembling
them here keeps the dependency direction (server → compiler → surgery) intact.
"""

from __future__ import annotations

import compiler.cli  # noqa: F401  (registers quantize/compile/archive/run/demo)
import server.cli_serve  # noqa: F401  (registers serve)
import server.cli_skills  # noqa: F401  (registers skills)
from surgery.cli import app


def main() -> None:
    app()


__all__ = ["app", "main"]
