"""The `surgery` command. Each sub-command lives in its own module and registers on `app`."""

from __future__ import annotations

from surgery.cli import check as _check  # noqa: F401  (registers commands)
from surgery.cli import demo as _demo  # noqa: F401
from surgery.cli import inspect as _inspect  # noqa: F401
from surgery.cli import targets as _targets  # noqa: F401
from surgery.cli.app import app

_OPTIONAL_COMMAND_MODULES = ("verify", "workspace")


def _register_optional() -> None:
    import importlib

    for name in _OPTIONAL_COMMAND_MODULES:
        try:
            importlib.import_module(f"surgery.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"surgery.cli.{name}":
                raise


_register_optional()


def main() -> None:
    app()


__all__ = ["app", "main"]
