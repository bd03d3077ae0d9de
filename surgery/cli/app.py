"""The typer application shared by every `surgery` sub-command, and its output conventions.

Conventions: `--json` prints one JSON document on stdout and nothing else; errors print one
line on stderr and exit 2; a command's own verdict (e.g. "not a single segment") exits 1.

The modules that define commands (here, in compiler.cli and in server) do not postpone their
annotations (no `from __future__ import annotations`): typer builds every command's options
from its parameter annotations on every run, and a postponed `Annotated[..., typer.Option(...)]`
is a string it compiles and evaluates each time, 11 ms of each `surgery` run for ~330 of them.
Evaluated once at import they cost nothing more; a name imported only for type checking is
quoted where it is used.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from surgery.errors import SurgeryError

app = typer.Typer(
    name="surgery",
    help="Check, rewrite, verify, quantize and compile ONNX models for edge NPUs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)


def _print_version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"model-surgery {version('model-surgery')}")
        except PackageNotFoundError:
            typer.echo("model-surgery (not installed: running from a source tree)")
        raise typer.Exit(0)


@app.callback()
def _global_options(
    show_version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print the version."
    ),
) -> None:
    """Check, rewrite, verify, quantize and compile ONNX models for edge NPUs."""


PIPE_WIDTH = 160
"""Line width when output goes to a pipe or file (agents, CI logs), where rich would assume 80
columns and wrap node names and tables; a terminal's own width, or COLUMNS, still wins."""


def _console(stderr: bool) -> Console:
    """A console that writes to whatever sys.stdout/stderr is at the time (test runners swap
    them), as wide as PIPE_WIDTH when that is not a terminal."""
    stream = sys.stderr if stderr else sys.stdout
    wide = not stream.isatty() and "COLUMNS" not in os.environ
    # emoji=False: ":b:" in a rule text (x[a:b:k]) is a slice, not an emoji code
    return Console(stderr=stderr, width=PIPE_WIDTH if wide else None, emoji=False)


console = _console(stderr=False)
err_console = _console(stderr=True)

EXIT_OK, EXIT_VERDICT, EXIT_ERROR = 0, 1, 2

F = TypeVar("F", bound=Callable[..., Any])


def emit_json(data: Any) -> None:
    """Print a JSON document to stdout (machines read this; nothing else goes to stdout)."""
    sys.stdout.write(json.dumps(data, indent=2, default=_json_default) + "\n")
    sys.stdout.flush()


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if hasattr(obj, "to_dict"):
        return obj.to_dict()
    return str(obj)


def fail(error: SurgeryError | str, *, as_json: bool = False) -> NoReturn:
    """Report a user error on stderr (and as JSON on stdout with --json) and exit 2."""
    err = error if isinstance(error, SurgeryError) else SurgeryError(str(error))
    if as_json:
        emit_json({"error": err.to_dict()})
    err_console.print(f"[bold red]error:[/] {escape(err.message)}", highlight=False, soft_wrap=True)
    if err.hint:
        err_console.print(f"[dim]hint: {escape(err.hint)}[/]", highlight=False, soft_wrap=True)
    raise typer.Exit(EXIT_ERROR)


def handle_errors(fn: F) -> F:
    """Turn SurgeryError (and a few OS errors) into a clean message and exit code 2."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        as_json = bool(kwargs.get("as_json"))
        try:
            return fn(*args, **kwargs)
        except SurgeryError as exc:
            fail(exc, as_json=as_json)
        except (OSError, MemoryError) as exc:
            fail(SurgeryError(os_error_message(exc)), as_json=as_json)

    return wrapper  # type: ignore[return-value]


def os_error_message(exc: OSError | MemoryError) -> str:
    """An OS error as a person reads it: the path and what is wrong with it, not the class."""
    if isinstance(exc, MemoryError):
        return "out of memory"
    if exc.filename and exc.strerror:
        return f"{exc.filename}: {exc.strerror}"
    return f"{type(exc).__name__}: {exc}"


def refuse_overwrite(out: Path | None, *sources: Path) -> None:
    """Never write over an input: the user's files are only read; and a file that cannot be
    written is said before any work (quantize calibrated for seconds, then failed to save)."""
    if out is None:
        return
    for src in sources:
        if out.resolve() == src.resolve():
            raise SurgeryError(f"{out}: refusing to overwrite the input model; choose another -o")
    refuse_unwritable(out)


def refuse_unwritable(out: Path) -> None:
    """A SurgeryError unless a file can be created where `out` goes: in its folder, or in the
    nearest folder above it that exists (the missing ones are made when writing)."""
    if out.is_dir():
        raise SurgeryError(f"{out}: is a folder; give a file name", hint="choose another -o")
    folder = out.absolute().parent
    while not folder.exists():
        folder = folder.parent
    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".surgery-write-probe-")
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise SurgeryError(
            f"{out}: cannot write in {folder} ({reason})", hint="choose another -o"
        ) from None
    os.close(fd)
    os.unlink(probe)
