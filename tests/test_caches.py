"""flashlite._caches: every cache, memo, failure set and registry is registered, and
``clear()`` resets them all; a compiled graph that finds its mods by name runs on after it."""

from __future__ import annotations

import functools
import importlib
import pkgutil
import weakref
from typing import Any

import pytest
import torch
import triton

import flashlite
from flashlite import _caches
from flashlite.masking import gallery, mods

#: Module globals that are mutable containers but not state: tables and constants written
#: once at import (never by a call), aliases, and the registries of state themselves.
NOT_STATE = {
    "flashlite._caches._registry": "the registry of caches itself",
    "flashlite._caches._others": "the registry of other state itself",
    "flashlite._backend._RAW_ENV": "os.environ's own mapping, read (not kept) by getenv",
    "flashlite.masking.mods._made": "weak: keeps nothing alive; clear() refills the registry",
    "flashlite.cli.commands.DTYPES": "constant table",
    "flashlite.cli.commands.ATTENTION_DTYPES": "constant table",
    "flashlite.ops.attention.backends.split_kv.decode._WIDE": "constant table",
    "flashlite.cli.commands.SOFTMAX_TOL": "constant table",
    "flashlite.cli.commands.ATTENTION_FLOOR": "constant table",
    "flashlite.integrations.transformers._UNSUPPORTED": "constant table",
    "flashlite.kernels.attention.hopper.CONFIGS": "config table",
    "flashlite.kernels.configs.GPU_CONFIGS": "config table",
    "flashlite.kernels.configs.HOPPER_CONFIGS": "config table",
    "flashlite.kernels.configs.HOPPER_SOFTCAP_CONFIGS": "config table",
    "flashlite.kernels.configs.HOPPER_BWD_CONFIGS": "config table",
    "flashlite.kernels.softmax.ELEMS_PER_PROGRAM": "config table",
    "flashlite.kernels.softmax.TEAM_CHUNK_BYTES": "config table",
    "flashlite.kernels.softmax.TEAM_WARPS": "config table",
    "flashlite.kernels.softmax_gluon.SINGLE_READ_WINS": "config table",
    "flashlite.ops.attention.kvcache.VALIDATE_MODES": "constant table",
    "flashlite.traffic.ncu._UNITS": "constant table",
    "flashlite.traffic.model.softmax._PASSES": "constant table",
    "flashlite.traffic.measure._CHILDREN": "constant table",
    "flashlite.traffic.model.common.GPUS": "constant table",
    "flashlite.traffic.shapes._DTYPES": "constant table",
}

_CONTAINERS = (
    dict,
    set,
    list,
    bytearray,
    weakref.WeakSet,
    weakref.WeakKeyDictionary,
    weakref.WeakValueDictionary,
)


def _modules() -> list[Any]:
    names = [m.name for m in pkgutil.walk_packages(flashlite.__path__, "flashlite.")]
    return [importlib.import_module(n) for n in names if not n.endswith("__main__")]


def _is_state(value: Any, module: str) -> bool:
    if isinstance(value, _CONTAINERS):
        return True
    # a functools cache defined in flashlite (not one imported from elsewhere)
    return hasattr(value, "cache_clear") and getattr(value, "__module__", "") == module


def _found() -> dict[str, Any]:
    """Every mutable module global of flashlite, ``module.name`` -> object."""
    found = {}
    for module in _modules():
        for name, value in vars(module).items():
            if not name.startswith("__") and _is_state(value, module.__name__):
                found[f"{module.__name__}.{name}"] = value
    return found


def test_every_mutable_module_global_is_registered_or_a_named_constant() -> None:
    found = _found()
    registered = {id(x) for x in _caches.state().values()}
    allowed = {id(found[name]) for name in NOT_STATE if name in found}
    assert set(NOT_STATE) <= set(found), set(NOT_STATE) - set(found)  # (no stale entries)
    # (an import of a registered or allowed object elsewhere is the same object)
    missing = sorted(n for n, x in found.items() if id(x) not in registered | allowed)
    assert not missing, f"module state not registered with flashlite._caches: {missing}"


def test_the_known_state_is_registered() -> None:
    names = set(_caches.state())
    assert {
        "attention.hopper_failed",
        "attention.hopper_bwd_failed",
        "flex.one_stage",
        "flex.hopper_failed",
        "flex.hopper_bwd_failed",
        "attention.offsets_checked",
        "attention.offsets_failed",
        "flex.checked_block_masks",
        "mods.registry",
        "backend.env_keys",
        "backend.capability",
        "backend.num_sms",
        "launch.cooperative",
    } <= names
    assert set(_caches.caches()) <= names  # (the bounded caches are listed too)


def _size(x: Any) -> int:
    return x.cache_info().currsize if hasattr(x, "cache_info") else len(x)


def _fill() -> list[Any]:
    """A few small calls of each kind: plans, bound launches, checks, mods and memos (and what
    the weakly kept state refers to, kept alive by the caller)."""
    from flashlite import _launch

    x = torch.randn(4, 100, requires_grad=True)
    flashlite.softmax(x).sum().backward()
    flashlite.cross_entropy(torch.randn(4, 30), torch.randint(0, 30, (4,)))
    q, k, v = (torch.randn(1, 2, 24, 16) for _ in range(3))
    flashlite.attention(q, k, v, causal=True)
    cu = torch.tensor([0, 10, 24], dtype=torch.int32)
    qv, kv, vv = (torch.randn(24, 2, 16) for _ in range(3))
    flashlite.attention_varlen(qv, kv, vv, cu, cu, 14, 14, causal=True)
    bm = flashlite.create_block_mask(
        gallery.causal(), None, None, 24, 24, device="cpu", BLOCK_SIZE=16
    )
    sm = gallery.tanh_softcap(4.0)
    flashlite.flex_attention(q, k, v, block_mask=bm, score_mod=sm)
    _launch.cooperative_launch_supported()
    return [bm, sm]


def test_clear_resets_every_registered_entry() -> None:
    alive = _fill()
    state = _caches.state()
    filled = {name for name, x in state.items() if _size(x)}
    # the calls above reached the bound caches and the other kinds of state alike
    assert {
        "softmax.bwd",
        "attention.fwd",
        "flex.fwd",
        "mods.registry",
        "launch.cooperative",
        "backend.env_keys",
        "flex.checked_block_masks",
    } <= filled
    # what only a GPU reaches (Hopper kernels that failed to build, the offsets check): a mark
    for name, x in state.items():
        if not _size(x) and isinstance(x, (set, weakref.WeakSet)):
            x.add(alive[0])
        elif not _size(x) and isinstance(x, dict):
            x[name] = None
    _caches.clear()
    # (device facts asked of CUDA are functools caches: empty here; see the register test)
    assert {name: _size(x) for name, x in state.items() if _size(x)} == {}
    _fill()  # (and everything works again from empty)


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


# --------------------------------------------------------------------------- mods' registry
@triton.jit
def _gone(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def test_a_name_comes_back_after_clear_while_a_mod_made_as_it_lives() -> None:
    sm = gallery.tanh_softcap(4.0)
    entry = mods.registered(sm.name)
    _caches.clear()
    assert mods._REGISTRY == {}
    assert mods.registered(sm.name) == entry  # (found again through the live mod)
    mods.mask_mod(_gone, name="test.gone")  # (made and dropped at once)
    _caches.clear()
    assert mods.registered_as("test.gone") is None
    with pytest.raises(ValueError, match="no mask or score function is registered"):
        mods.registered("test.gone")


def test_compiled_flex_and_kvcache_calls_with_mods_run_after_clear() -> None:
    mm = gallery.document_causal(gallery.random_documents(2, 40, 3, seed=1))
    sm = gallery.alibi(gallery.alibi_slopes(4))
    q = torch.randn(2, 1, 4, 16)
    kc, vc = (torch.randn(2, 40, 2, 16) for _ in range(2))
    lens = torch.tensor([33, 12], dtype=torch.int32)

    def decode(q, kc, vc, lens):  # noqa: ANN001, ANN202
        return flashlite.attention_kvcache(q, kc, vc, cache_seqlens=lens, mask_mod=mm, score_mod=sm)

    bm = flashlite.create_block_mask(mm, 2, None, 40, 40, device="cpu", BLOCK_SIZE=16)
    qf, kf, vf = (torch.randn(2, 4, 40, 16) for _ in range(3))

    def flex(q, k, v):  # noqa: ANN001, ANN202
        return flashlite.flex_attention(q, k, v, score_mod=sm, block_mask=bm)

    compiled = [torch.compile(decode, fullgraph=True), torch.compile(flex, fullgraph=True)]
    args = [(q, kc, vc, lens), (qf, kf, vf)]
    first = [c(*a) for c, a in zip(compiled, args, strict=True)]
    for c, a, f, eager in zip(compiled, args, first, (decode, flex), strict=True):
        _caches.clear()  # (the graph finds mm and sm by name at run time)
        assert torch.equal(c(*a), f)
        assert torch.equal(f, eager(*a))


def test_a_table_call_is_worked_out_once_per_request_while_the_registry_stands() -> None:
    from flashlite.ops.attention.backends.tables import args as FA

    bm = flashlite.create_block_mask(gallery.causal(), None, None, 40, 40, device="cpu",
                                     BLOCK_SIZE=32)  # fmt: skip
    request = FA.table_request(bm, 0.25)
    call = FA.table_call(request)
    assert FA.table_call(request) is call  # (a loop's later calls: nothing worked out again)
    version = mods.registry_version()
    mods.mask_mod(_gone, name="test.gone.again")  # a name registered: every memo is stale
    assert mods.registry_version() > version
    again = FA.table_call(request)
    assert again is not call and again.key == call.key
    for i in range(20):  # many requests: the memo stays small (each keeps its tables alive)
        FA.table_call(FA.table_request(bm, 0.1 + i))
    assert 0 < len(FA._calls) <= 8
    _caches.clear()
    assert FA._calls == {}
