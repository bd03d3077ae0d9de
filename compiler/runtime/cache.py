"""One thread-safe, size-limited least-recently-used cache for what a runtime loads once and
reuses: decoded programs, host-stage sessions, lookup tables."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


class LruCache(Generic[V]):
    """Values by key, the least recently used dropped beyond `limit` entries. `build` runs
    outside the lock, so a slow build does not hold up other threads (two threads may build
    the same value; both results are equal and the later one is kept)."""

    def __init__(self) -> None:
        self._entries: OrderedDict[Hashable, V] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable, build: Callable[[], V], limit: int) -> V:
        """The value kept under `key`, else build() kept under it (at most `limit` kept)."""
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
                return value
        value = build()
        with self._lock:
            self._entries[key] = value
            while len(self._entries) > limit:
                self._entries.popitem(last=False)
        return value
