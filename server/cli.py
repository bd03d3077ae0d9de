"""The full `surgery` command line: the graph engine's commands, the compiler's, and `serve`.

Each layer registers its own commands on the one typer app from `surgery.cli.app`; assembling
them here keeps the dependency direction (server → compiler → surgery) intact.
"""

from __future__ import annotations

import sys

import typer

import compiler.cli  # noqa: F401  (registers quantize/compile/archive/run/demo)
import server.cli_serve  # noqa: F401  (registers serve)
import server.cli_skills  # noqa: F401  (registers skills)
from surgery.cli import app


def main() -> None:
    """Run the command line. With --json a usage error (a missing option, a value of the wrong
    kind) is a JSON error document on stdout too, as every other error is: an agent reads
    stdout, where it found nothing."""
    if "--json" not in sys.argv[1:]:
        app()
        return
    try:
        code = app(standalone_mode=False, prog_name="surgery")
    except _USAGE_ERROR as error:
        from surgery.cli.app import emit_json

        command = error.ctx.command_path if error.ctx is not None else "surgery"
        message = error.format_message()
        emit_json(
            {
                "error": {
                    "code": "usage_error",
                    "message": message,
                    "hint": f"{command} --help lists the options",
                }
            }
        )
        error.show()
        sys.exit(error.exit_code)
    except typer.Abort:
        sys.exit(130)  # Ctrl-C: the shell's code for an interrupt
    sys.exit(code if isinstance(code, int) else 0)


_USAGE_ERROR = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")
"""click's UsageError, found from typer's public BadParameter: typer 0.28 carries its own
copy of click, earlier releases use click itself."""


__all__ = ["app", "main"]
