"""`LruCache`: built once per key, least recently used dropped beyond the limit."""

from __future__ import annotations

from compiler.runtime.cache import LruCache


def test_a_kept_value_is_not_built_again_and_the_oldest_goes_first() -> None:
    cache: LruCache[str] = LruCache()
    builds: list[str] = []

    def build(key: str):
        return lambda: builds.append(key) or key.upper()

    assert cache.get("a", build("a"), 2) == "A"
    assert cache.get("b", build("b"), 2) == "B"
    assert cache.get("a", build("a"), 2) == "A"  # kept; "a" is now the most recent
    cache.get("c", build("c"), 2)  # drops "b", the least recently used
    assert len(cache) == 2
    cache.get("a", build("a"), 2)
    cache.get("b", build("b"), 2)
    assert builds == ["a", "b", "c", "b"]
