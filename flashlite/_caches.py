"""Every cache, memo and registry flashlite keeps, listed in one place.

A call's host work is done once per *kind* of call (shapes, strides, dtypes, options) and kept
here: bound launches, plans, checked argument signatures. A program that sweeps shapes would
otherwise grow these without limit, so each cache holds at most ``limit`` entries and drops its
oldest first. :func:`caches` lists them (the tests and ``flashlite`` tools read it).

Other state a module keeps (a set of kernel variants that failed to build, a memo of device
facts, the mods' name registry) is registered with :func:`register` (a ``functools.cache``
with :func:`memo`): :func:`state` lists everything by name, caches included, and :func:`clear`
resets it all, so a process can always get back to how flashlite started.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

V = TypeVar("V")
S = TypeVar("S")

_registry: dict[str, Cache] = {}
#: everything else by name: (the object, how to reset it)
_others: dict[str, tuple[Any, Callable[[], None]]] = {}


def _claim(name: str) -> None:
    if name in _registry or name in _others:
        raise ValueError(f"a cache named {name!r} exists already")


class Cache(dict):  # type: ignore[type-arg]
    """A dict with a size limit: :meth:`put` drops the oldest entry when it is full. Lookups are
    the dict's own (``get``, ``in``, ``[]``): nothing is added to the hot path."""

    def __init__(self, name: str, limit: int) -> None:
        super().__init__()
        _claim(name)
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


class Versioned(dict):  # type: ignore[type-arg]
    """A registry dict that counts its changes (:attr:`version`): a memo of what its entries
    decided holds while the version it saw is current."""

    version = 0

    def __setitem__(self, key: Hashable, value: Any) -> None:
        self.version += 1
        super().__setitem__(key, value)

    def clear(self) -> None:
        self.version += 1
        super().clear()


def register(name: str, state: S, reset: Callable[[], None] | None = None) -> S:
    """Register module state under ``name`` and return it, for :func:`clear` to reset: a set,
    dict, ``WeakSet`` or anything with ``clear()``, a ``functools`` cache (``cache_clear()``),
    or whatever ``reset()`` resets. The state itself is used as it is: no cost per call."""
    if reset is None:
        reset = getattr(state, "cache_clear", None) or getattr(state, "clear", None)
        if reset is None:
            kind = type(state).__name__
            raise TypeError(f"{name}: a {kind} has no clear() or cache_clear(); pass reset=")
    _claim(name)
    _others[name] = (state, reset)
    return state


def memo(name: str) -> Callable[[Callable[..., V]], Callable[..., V]]:
    """``functools.cache``, registered under ``name`` (a decorator)."""

    def wrap(fn: Callable[..., V]) -> Callable[..., V]:
        return register(name, functools.cache(fn))

    return wrap


def caches() -> dict[str, Cache]:
    """Every bounded cache by name (a copy of the registry)."""
    return dict(_registry)


def state() -> dict[str, Any]:
    """Everything :func:`clear` resets, by name: the caches and the registered state."""
    return {**_registry, **{name: obj for name, (obj, _) in _others.items()}}


def clear() -> None:
    """Reset every cache and registered state (the next call of each kind plans again)."""
    for cache in _registry.values():
        cache.clear()
    for _, reset in _others.values():
        reset()
