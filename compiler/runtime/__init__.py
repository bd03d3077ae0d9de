"""Reference integer executor of quantized (QDQ) models: the spec the MLA emulator must match.

See docs/integer-semantics.md. Integer arithmetic lives in `compiler.intmath`.
"""

from __future__ import annotations

from compiler.runtime.errors import ExecutionError, QdqModelError, UnsupportedQuantizedOpError
from compiler.runtime.qparams import QuantParams
from compiler.runtime.reference import IntegerExecutor

__all__ = [
    "ExecutionError",
    "IntegerExecutor",
    "QdqModelError",
    "QuantParams",
    "UnsupportedQuantizedOpError",
]
