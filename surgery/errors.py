"""Typed errors. Every user-facing failure is a `SurgeryError` with a stable `code`.

The CLI maps these to exit code 2 with a one-line message; the MCP layer maps them to
`ToolError`. Anything else escaping is a bug in model-surgery, not bad input.
"""

from __future__ import annotations


class SurgeryError(Exception):
    """Base class: a problem with the user's input or request, with a clear message."""

    code = "error"

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def to_dict(self) -> dict[str, str | None]:
        return {"code": self.code, "message": self.message, "hint": self.hint}

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message} ({self.hint})"


class ModelNotFoundError(SurgeryError):
    code = "file_not_found"


class ModelFormatError(SurgeryError):
    """The file is not a readable ONNX protobuf (wrong format, truncated, corrupt)."""

    code = "not_onnx"


class InvalidGraphError(SurgeryError):
    """The graph is structurally broken: cycle, dangling tensor, missing initializer, …"""

    code = "invalid_graph"


class MalformedTensorError(InvalidGraphError):
    """A weight or constant whose data does not fit its dims or element type (a damaged or
    hand-edited file): the model's problem wherever an analysis reads it, never a rule's."""


class UnknownDomainError(SurgeryError):
    code = "unknown_domain"


class ShapeError(SurgeryError):
    """Shape inference failed or an --input-shape request does not fit the model."""

    code = "shape_error"


class TargetError(SurgeryError):
    """Unknown target or an invalid target profile file."""

    code = "target_error"


class NodeNotFoundError(SurgeryError):
    code = "node_not_found"


class WorkspaceError(SurgeryError):
    code = "workspace_error"


class VerifyError(SurgeryError):
    """The models cannot be compared (no common outputs, inputs that do not match, …)."""

    code = "verify_error"


def first_line(exc: BaseException, limit: int = 300) -> str:
    """The first line of an exception's message (its type name when it has none), for wrapping
    a library's error into one of ours."""
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:limit]
