"""Commands that need the quantize/compile core: they register on the shared `surgery` app.

`surgery/` never imports `compiler/`; the full command line is assembled in `server.cli`.
"""

from __future__ import annotations

from compiler.cli import compile as _compile  # noqa: F401  (registers compile/archive/run)
from compiler.cli import demo as _demo  # noqa: F401
from compiler.cli import quantize as _quantize  # noqa: E402,F401  (registers quantize/analyze)
