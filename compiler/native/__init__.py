"""The emulator's compiled kernels, when they were built (`mla_kernels.c`), else None.

They compute exactly what the numpy code they replace computes (tests/test_native_kernels.py
holds them to it, bit for bit); the numpy code stays the definition and the fallback. Set
MODEL_SURGERY_NATIVE=0 to run without them, MODEL_SURGERY_VNNI=0 to run them without the
int8 CONV kernels (AVX-512 VNNI), as on a CPU that lacks it.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType

__all__ = ["describe", "kernels", "status", "vnni"]


def _load() -> tuple[ModuleType | None, str]:
    if os.environ.get("MODEL_SURGERY_NATIVE", "1") == "0":
        return None, "disabled by MODEL_SURGERY_NATIVE=0"
    try:
        from compiler.native import _mla_kernels
    except ImportError as error:
        # Python words a missing submodule as "cannot import name … (most likely due to a
        # circular import)": say what it is, and keep the error of a file that is there.
        missing = not any(Path(__file__).parent.glob("_mla_kernels.*"))
        why = (
            "no compiled _mla_kernels beside compiler/native: `pip install -e .` builds it "
            "where a C compiler is available"
            if missing
            else f"{error}"
        )
        return None, f"not built ({why}); the emulator runs its numpy code"
    return _mla_kernels, "compiled kernels in use"


kernels, status = _load()
"""The extension module (None without it) and a line saying which code the emulator runs."""

vnni: bool = (
    kernels is not None and bool(kernels.vnni) and os.environ.get("MODEL_SURGERY_VNNI", "1") != "0"
)
"""Whether the emulator runs its int8 CONVs in the VNNI kernels (conv_planes,
depthwise_planes): the CPU has AVX-512 VNNI and MODEL_SURGERY_VNNI is not 0."""


def describe() -> str:
    """Which code the emulator runs, in a few words (for reports and benchmarks)."""
    if kernels is None:
        return f"numpy ({status})"
    int8 = "int8 CONVs on AVX-512 VNNI" if vnni else "no VNNI: CONV products in BLAS"
    return f"compiled kernels ({kernels.instruction_set}; {int8})"
