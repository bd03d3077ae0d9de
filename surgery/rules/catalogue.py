"""Imports every rule module so the registry is complete. Order = priority in `surgery fix`."""

from surgery.rules import cleanup  # noqa: F401
