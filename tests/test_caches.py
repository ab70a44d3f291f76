"""flashlite._caches: register any clearable state (sets, dicts, weak sets, functools caches,
a reset of one's own) for ``clear()`` to reset, and list it with the caches."""

from __future__ import annotations

import functools
import weakref

import pytest

from flashlite import _caches


def test_register_takes_sets_dicts_weak_sets_functools_caches_and_resets() -> None:
    made: list[str] = []

    def kept() -> None:  # (something a WeakSet can hold)
        pass

    things = {
        "s": {1},
        "d": {1: 2},
        "w": weakref.WeakSet([kept]),
    }
    try:
        for name, thing in things.items():
            assert _caches.register(f"test.{name}", thing) is thing
            made.append(f"test.{name}")
        calls = []

        @_caches.memo("test.memo")
        def twice(n: int) -> int:
            calls.append(n)
            return 2 * n

        made.append("test.memo")
        box = [1]
        _caches.register("test.custom", box, reset=lambda: box.clear())
        made.append("test.custom")
        assert twice(3) == twice(3) == 6 and calls == [3]
        with pytest.raises(ValueError, match="'test.s' exists already"):
            _caches.register("test.s", set())
        with pytest.raises(ValueError, match="'softmax.fwd' exists already"):
            _caches.register("softmax.fwd", set())
        with pytest.raises(TypeError, match="has no clear"):
            _caches.register("test.tuple", (1, 2))
        assert {"test.s", "test.d", "test.w", "test.memo", "test.custom"} <= set(_caches.state())
        _caches.clear()
        assert not any(things.values()) and box == []
        assert twice(3) == 6 and calls == [3, 3]
    finally:
        for name in made:
            _caches._others.pop(name)


def test_functools_caches_keep_their_hot_path() -> None:
    # memo is functools.cache itself: no wrapper of ours between the caller and the lookup
    from flashlite import _backend

    assert type(_backend.num_sms) is type(functools.cache(len))
    assert isinstance(_caches.caches()["softmax.fwd"], dict)
