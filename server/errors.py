"""Error translation: what an MCP client sees when a tool or resource fails.

In mcp 2.x only a `ToolError`'s message reaches the client; any other exception becomes a bare
"Error executing tool" and is logged as a crash. So every tool is wrapped: a `SurgeryError`
(bad input: corrupt model, unknown node, path outside the roots …) becomes a ToolError carrying
its code, message and hint, and anything else is logged with its traceback and still answered
with a ToolError, so one bad call never takes the server down or leaves the agent guessing.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from mcp.server.mcpserver.exceptions import ResourceError, ResourceNotFoundError, ToolError
from pydantic import ValidationError

from server.wording import tool_words
from surgery.errors import SurgeryError, WorkspaceError

log = logging.getLogger("server")


class FileExistsSurgeryError(SurgeryError):
    """A tool would replace an existing file."""

    code = "file_exists"


F = TypeVar("F", bound=Callable[..., Any])


def describe_error(exc: BaseException) -> str:
    """The one text an agent reads: `code: message` plus a hint line when there is one."""
    if isinstance(exc, SurgeryError):
        text = f"{exc.code}: {tool_words(exc.message)}"
        return f"{text}\nhint: {tool_words(exc.hint)}" if exc.hint else text
    if isinstance(exc, ValidationError):
        return "invalid_argument: " + "; ".join(_problem(e) for e in exc.errors())
    if isinstance(exc, MemoryError):
        return "out_of_memory: the model is too large for this machine's memory"
    if isinstance(exc, OSError):
        where = f" ({exc.filename})" if exc.filename else ""
        return f"os_error: {exc.strerror or exc}{where}"
    return (
        f"internal_error: {type(exc).__name__}: {str(exc)[:300]}\n"
        "hint: this is a bug in model-surgery, not in your request; the server is still running"
    )


def describe_argument_errors(tool: str, exc: ValidationError, accepted: Sequence[str]) -> str:
    """A tool call's arguments that do not fit its schema, as one `invalid_argument` text:
    every problem, a misspelt name with the nearest real one (an agent guessing
    `input_shapes` for `input_shape`), and the names the tool takes."""
    problems = []
    for error in exc.errors():
        name = str(error["loc"][0]) if error["loc"] else ""
        if error["type"] == "extra_forbidden":
            near = difflib.get_close_matches(name, accepted, n=1)
            guess = f" (did you mean `{near[0]}`?)" if near else ""
            problems.append(f"`{name}` is not an argument of {tool}{guess}")
        else:
            problems.append(_problem(error))
    return f"invalid_argument: {'; '.join(problems)}\nhint: {tool} takes {', '.join(accepted)}"


def _problem(error: Any) -> str:
    """One pydantic error as `where`: what is wrong (and the value given)."""
    where = ".".join(str(x) for x in error["loc"]) or "input"
    if error["type"] == "missing":
        return f"`{where}` is required"
    given = repr(error.get("input"))
    given = given if len(given) <= 60 else given[:57] + "..."
    return f"`{where}`: {error['msg']} (got {given})"


def _expected(exc: BaseException) -> bool:
    return isinstance(exc, SurgeryError | ValidationError | MemoryError | OSError)


def _translate(exc: Exception, what: str) -> ToolError:
    if isinstance(exc, ToolError):
        return exc
    if _expected(exc):
        log.debug("%s refused: %s", what, describe_error(exc).splitlines()[0])
    else:
        log.exception("%s crashed", what)
    return ToolError(describe_error(exc))


def tool_errors(fn: F) -> F:
    """Wrap a tool (sync or async) so every failure reaches the client as a clear ToolError."""
    what = f"tool {fn.__name__}"
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
            try:
                return await fn(*args, **kwargs)
            except Exception as exc:
                raise _translate(exc, what) from exc

        return async_wrapper  # type: ignore[return-value]

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            raise _translate(exc, what) from exc

    return wrapper  # type: ignore[return-value]


def resource_errors(fn: F) -> F:
    """The same for resources: unknown models are 'not found', other failures say why."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ResourceError:
            raise
        except WorkspaceError as exc:
            raise ResourceNotFoundError(describe_error(exc)) from exc
        except Exception as exc:
            if not _expected(exc):
                log.exception("resource %s crashed", fn.__name__)
            raise ResourceError(describe_error(exc)) from exc

    return wrapper  # type: ignore[return-value]
