"""Keep ONNX Runtime's optimiser notes off the user's terminal.

ORT's graph transformers log through its process-wide default logger ("UnsqueezeElimination
cannot remove node …"), which ignores a session's own log severity, and onnx-graphsurgeon's
constant folding opens sessions without options at all. Such notes about what ORT could not
optimise are noise in `surgery` output, so the default logger is set to errors before any
session the project opens, directly or through onnx-graphsurgeon.
"""

from __future__ import annotations

ERRORS_ONLY = 3
"""ORT's severity levels: 0 verbose, 1 info, 2 warning, 3 error, 4 fatal."""
FATAL_ONLY = 4
"""For sessions and runs, whose failures the project raises as typed errors with ORT's
message: an error logged as well reached the terminal twice, once as ORT's coloured log line."""


def quiet_ort_logging() -> None:
    """Log only errors from ONNX Runtime's default logger (cheap; safe to call repeatedly)."""
    import onnxruntime as ort

    ort.set_default_logger_severity(ERRORS_ONLY)
