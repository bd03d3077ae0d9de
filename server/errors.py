"""Error translation: what an MCP client sees when a tool or resource fails.

In mcp 2.x only a `ToolError`'s message reaches the client; any other exception becomes a bare
"Error executing tool" and is logged as a crash. So every tool is wrapped: a `SurgeryError`
(bad input: corrupt model, unknown node, path outside the roots …) becomes a ToolError carrying
its code, message and hint, and anything else is logged with its traceback and still answered
with a ToolError, so one bad call never takes the server down or leaves the agent guessing.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
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
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "input"
        return f"invalid_argument: {where}: {first['msg']}"
    if isinstance(exc, MemoryError):
        return "out_of_memory: the model is too large for this machine's memory"
    if isinstance(exc, OSError):
        where = f" ({exc.filename})" if exc.filename else ""
        return f"os_error: {exc.strerror or exc}{where}"
    return (
        f"internal_error: {type(exc).__name__}: {str(exc)[:300]}\n"
        "hint: this is a bug in model-surgery, not in your request; the server is still running"
    )


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
