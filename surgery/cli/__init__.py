"""The `surgery` command. Each sub-command lives in its own module and registers on `app`."""

from __future__ import annotations

from surgery.cli import check as _check  # noqa: F401  (importing registers the commands)
from surgery.cli import demo as _demo  # noqa: F401
from surgery.cli import edit as _edit  # noqa: F401
from surgery.cli import inspect as _inspect  # noqa: F401
from surgery.cli import rules as _rules  # noqa: F401
from surgery.cli import serve as _serve  # noqa: F401
from surgery.cli import skills as _skills  # noqa: F401
from surgery.cli import targets as _targets  # noqa: F401
from surgery.cli import verify as _verify  # noqa: F401
from surgery.cli.app import app


def main() -> None:
    app()


__all__ = ["app", "main"]
from surgery.cli import compile as _compile  # noqa: E402,F401  (registers compile/archive/run)
