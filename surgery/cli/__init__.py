"""The graph engine's commands. Each lives in its own module and registers on `app`.

The full `surgery` command (with quantize/compile/serve) is assembled in `server.cli`.
"""

from __future__ import annotations

from surgery.cli import check as _check  # noqa: F401  (importing registers the commands)
from surgery.cli import edit as _edit  # noqa: F401
from surgery.cli import inspect as _inspect  # noqa: F401
from surgery.cli import rules as _rules  # noqa: F401
from surgery.cli import targets as _targets  # noqa: F401
from surgery.cli import verify as _verify  # noqa: F401
from surgery.cli.app import app


def main() -> None:
    app()


__all__ = ["app", "main"]
