"""The emulator's compiled kernels, when they were built (`mla_kernels.c`), else None.

They compute exactly what the numpy code they replace computes (tests/test_native_kernels.py
holds them to it, bit for bit); the numpy code stays the definition and the fallback. Set
MODEL_SURGERY_NATIVE=0 to run without them.
"""

from __future__ import annotations

import os
from types import ModuleType

__all__ = ["kernels", "status"]


def _load() -> tuple[ModuleType | None, str]:
    if os.environ.get("MODEL_SURGERY_NATIVE", "1") == "0":
        return None, "disabled by MODEL_SURGERY_NATIVE=0"
    try:
        from compiler.native import _mla_kernels
    except ImportError as error:
        return None, f"not built ({error}); the emulator runs its numpy code"
    return _mla_kernels, "compiled kernels in use"


kernels, status = _load()
"""The extension module (None without it) and a line saying which code the emulator runs."""
