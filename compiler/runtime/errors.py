"""Errors of the integer reference executor, in the project's `SurgeryError` family."""

from __future__ import annotations

from surgery.errors import SurgeryError


class QdqModelError(SurgeryError):
    """The QDQ model cannot be read as a program at all (its graph has a cycle)."""

    code = "invalid_qdq_model"


class UnsupportedQuantizedOpError(SurgeryError):
    """A node wrapped in DequantizeLinear/QuantizeLinear has no integer implementation.

    Raised only with `strict=True`; otherwise such nodes run in float and are listed in
    `IntegerExecutor.float_nodes` with the reason.
    """

    code = "unsupported_quantized_op"


class ExecutionError(SurgeryError):
    """The inputs given to `run` / `run_integer` do not fit the model."""

    code = "execution_error"


class UnknownOpError(SurgeryError):
    """A node that nothing can run: no ONNX schema, no kernel in ONNX Runtime or onnx.reference,
    no function of that name in the model (a typo'd op type, a custom domain's op)."""

    code = "unknown_op"
