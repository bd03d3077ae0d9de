"""Small helpers for the wording of messages and reports."""

from __future__ import annotations


def counted(n: int, word: str) -> str:
    """`n` and `word`, plural unless n is 1: "1 node", "2 nodes"."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"
