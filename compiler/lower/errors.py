"""Errors of the compiler, in the project's `SurgeryError` family (CLI exit 2, MCP isError)."""

from __future__ import annotations

from surgery.errors import ModelNotFoundError, SurgeryError


class CompileError(SurgeryError):
    """The model (or a compile option) cannot be turned into a deployable archive."""

    code = "compile_error"


class ArchiveError(SurgeryError):
    """An archive is missing, unreadable, or does not follow docs/archive-format.md."""

    code = "archive_error"


class ArchiveNotFoundError(ArchiveError):
    """No archive at the path given: `file_not_found`, as a missing model is, in every
    command's JSON."""

    code = ModelNotFoundError.code
