"""Every cache flashlite keeps, bounded, and listed in one place.

A call's host work is done once per *kind* of call (shapes, strides, dtypes, options) and kept
here: bound launches, plans, checked argument signatures. A program that sweeps shapes would
otherwise grow these without limit, so each cache holds at most ``limit`` entries and drops its
oldest first. :func:`caches` lists them (the tests and ``flashlite`` tools read it) and
:func:`clear` empties them all.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, TypeVar

V = TypeVar("V")

_registry: dict[str, Cache] = {}


class Cache(dict):  # type: ignore[type-arg]
    """A dict with a size limit: :meth:`put` drops the oldest entry when it is full. Lookups are
    the dict's own (``get``, ``in``, ``[]``): nothing is added to the hot path."""

    def __init__(self, name: str, limit: int) -> None:
        super().__init__()
        if name in _registry:
            raise ValueError(f"a cache named {name!r} exists already")
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        self.name, self.limit = name, limit
        _registry[name] = self

    def put(self, key: Hashable, value: V) -> V:
        """Store ``value`` under ``key`` (the oldest entry goes when full) and return it."""
        if key not in self and len(self) >= self.limit:
            del self[next(iter(self))]
        self[key] = value
        return value

    def made(self, key: Hashable, make: Callable[..., V], *args: Any) -> V:
        """The entry under ``key``, made by ``make(*args)`` and stored on first use (the
        arguments, not a closure: a lambda would be built on every call, hits included)."""
        found = self.get(key, _MISSING)
        return self.put(key, make(*args)) if found is _MISSING else found

    def __repr__(self) -> str:
        return f"Cache({self.name!r}, {len(self)}/{self.limit})"


_MISSING: Any = object()


def caches() -> dict[str, Cache]:
    """Every cache by name (a copy of the registry)."""
    return dict(_registry)


def clear() -> None:
    """Empty every cache (the next call of each kind plans again)."""
    for cache in _registry.values():
        cache.clear()
