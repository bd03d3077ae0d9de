"""Imports every rule module so the registry is complete. Order = priority in `surgery fix`."""

# ruff: noqa: I001

from surgery.rules import cleanup  # noqa: F401
from surgery.rules import cleanup_norm  # noqa: F401
from surgery.rules import cleanup_attention  # noqa: F401
from surgery.rules import replace  # noqa: F401
from surgery.rules import structure  # noqa: F401
from surgery.rules import rank4  # noqa: F401
from surgery.rules import rank4_heads  # noqa: F401
