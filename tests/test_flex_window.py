"""attention's window folded into the flex kernels over its band's tables (where the Hopper
kernels apply, forced here on the CPU): against fp64 and a band written by hand, the closed-form
tables against the classifier, either layout, and the Triton kernels everywhere else."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl  # noqa: F401  (the interpreter wants it in jit functions' globals)
from conftest import maybe_compile
from flex_helpers import BLOCK, D, N, _grads

import flashlite
from flashlite import reference
from flashlite.masking import gallery, masks, mods


@triton.jit
def _band_by_hand(b, h, q_idx, kv_idx, lo, hi):
    return (kv_idx - q_idx >= lo) & (kv_idx - q_idx <= hi)


@pytest.mark.parametrize(("nq", "nk", "window", "causal"), [
    (N, N, (17, 0), True),  # a causal window: the gallery's sliding_window
    (N, N, (9, 5), False),  # two-sided
    (40, N, (-1, 3), False),  # fewer queries (bottom-right aligned), unlimited left
    (N, 50, (20, -1), False),  # more queries than keys: some rows see no key
])  # fmt: skip
def test_window_folds_into_the_flex_kernels_where_they_apply(
    nq: int, nk: int, window: tuple[int, int], causal: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the Hopper kernels apply (forced here on the CPU), attention's window runs the
    flex kernels over its band's tables: forward and backward against fp64 (GQA, the LSE),
    the same bits as a window written by hand as a mask function, and a second call reuses
    the tables."""
    from flashlite.kernels.attention.hopper import HopperConfig
    from flashlite.masking import band
    from flashlite.ops.attention import planner as W
    from flashlite.ops.attention.backends.tables import bwd as B
    from flashlite.ops.attention.backends.tables import fwd as F

    ran: list[str] = []
    fwd, bwd = F.plan_window_fwd, B.plan_window_bwd
    monkeypatch.setattr(W, "window_fwd_config", lambda facts: HopperConfig(BLOCK, BLOCK, 2))
    monkeypatch.setattr(W, "window_bwd_block", lambda q, k, v, do: (BLOCK, BLOCK))
    monkeypatch.setattr(F, "plan_window_fwd", lambda *a: ran.append("fwd") or fwd(*a))
    monkeypatch.setattr(B, "plan_window_bwd", lambda *a: ran.append("bwd") or bwd(*a))
    q = torch.randn(2, 4, nq, D, requires_grad=True)
    k, v = (torch.randn(2, 2, nk, D, requires_grad=True) for _ in range(2))
    out = flashlite.attention(q, k, v, causal=causal, window=window, return_lse=True)
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = reference.attention(*exact, causal=causal, window=window, return_lse=True)
    seen = torch.isfinite(ref[1])
    go, gl = torch.randn_like(out[0]), torch.randn_like(out[1]) * seen
    got = _grads(out, [q, k, v], go, gl)
    want = _grads((ref[0], torch.where(seen, ref[1], 0.0)), exact, go.double(), gl.double())
    assert ran == ["fwd", "bwd"]
    torch.testing.assert_close(out[0].double(), ref[0], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(out[1].double(), ref[1].double(), atol=2e-5, rtol=1e-5)
    for a, w in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), w, atol=3e-5, rtol=1e-5)
    # the same band written by hand, through flex_attention: the same bits
    left, right = masks.window_bounds(window, causal)
    far = nq + nk
    lo, hi = (nk - nq) - (far if left < 0 else left), (nk - nq) + (far if right < 0 else right)
    hand = mods.mask_mod(_band_by_hand, lo, hi, name="tests.band_by_hand")
    bm = flashlite.create_block_mask(hand, None, None, nq, nk, device="cpu", BLOCK_SIZE=BLOCK)
    with torch.no_grad():
        assert torch.equal(flashlite.flex_attention(q, k, v, block_mask=bm), out[0])
        assert torch.equal(flashlite.attention(q, k, v, causal=causal, window=window), out[0])
    assert len([c for c in band._bands if c[:2] == (nq, nk)]) == 1


def test_window_band_classes_equal_the_classifiers() -> None:
    """The fold's closed-form tables are the classifier's for the same band: ragged rows and
    keys, bands that miss every key, a window of one key, unlimited sides."""
    from flashlite.masking.band import band_classes

    gen = torch.Generator().manual_seed(0)
    cases = [(72, 72, -17, 0, (32, 32)), (40, 72, 20, 32, (16, 32)), (72, 50, -200, -100, (16, 16)),
             (33, 33, 0, 0, (16, 16)), (50, 70, -1000, 1000, (32, 16))]  # fmt: skip
    for _ in range(6):
        nq, nk = (int(x) for x in torch.randint(1, 90, (2,), generator=gen))
        lo = int(torch.randint(-nq, nk, (1,), generator=gen))
        cases.append((nq, nk, lo, lo + int(torch.randint(0, 40, (1,), generator=gen)), (16, 16)))
    for nq, nk, lo, hi, block in cases:
        hand = mods.mask_mod(_band_by_hand, lo, hi, name="tests.band_by_hand")
        want = flashlite.create_block_mask(hand, None, None, nq, nk, device="cpu",
                                           BLOCK_SIZE=block).classes()  # fmt: skip
        got = band_classes(nq, nk, lo, hi, block, "cpu")
        assert torch.equal(got, want), (nq, nk, lo, hi, block)


def test_window_fold_reads_either_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fold takes ``b n h d`` views of a packed buffer as the Triton window kernel does:
    the same bits as the ``b h n d`` call and as a compiled call, and the Triton kernel's
    answer to rounding."""
    from flashlite import _caches
    from flashlite.kernels.attention.hopper import HopperConfig
    from flashlite.ops.attention import planner as W

    qkv = torch.randn(2, N, 3, 4, D)  # (B, N, q/k/v, H, D): strided views, heads second to last
    q, k, v = qkv.unbind(2)
    kw = {"window": (11, 4), "layout": "b n h d", "return_lse": True}
    triton_o, triton_lse = flashlite.attention(q, k, v, **kw)
    _caches.clear()  # (that call's plan would serve the next one: a window's plan is kept too)
    monkeypatch.setattr(W, "window_fwd_config", lambda facts: HopperConfig(BLOCK, BLOCK, 2))
    o, lse = flashlite.attention(q, k, v, **kw)
    heads_first = [t.transpose(1, 2).contiguous() for t in (q, k, v)]
    o2, lse2 = flashlite.attention(*heads_first, window=(11, 4), return_lse=True)
    assert o.shape == q.shape and torch.equal(o, o2.transpose(1, 2)) and torch.equal(lse, lse2)
    torch.testing.assert_close(o, triton_o, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(lse, triton_lse, atol=2e-6, rtol=1e-5)
    # a compiled graph runs the op's body at run time: the same fold, the same bits
    compiled = maybe_compile(lambda a, b, c: flashlite.attention(a, b, c, **kw), True)
    assert all(torch.equal(x, y) for x, y in zip(compiled(q, k, v), (o, lse), strict=True))


def test_window_stays_on_the_triton_kernels_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the Hopper kernels do not apply (here: the CPU, and a soft cap or pinned config
    beside a forced gate), a window never reaches the fold."""
    from flashlite.kernels.attention.hopper import HopperConfig
    from flashlite.ops.attention import planner as W
    from flashlite.ops.attention.backends.tables import bwd as B
    from flashlite.ops.attention.backends.tables import fwd as F

    def refuse(*args: object) -> None:
        raise AssertionError("folded")

    monkeypatch.setattr(F, "plan_window_fwd", refuse)
    monkeypatch.setattr(B, "plan_window_bwd", refuse)
    q, k, v = (torch.randn(1, 2, N, D, requires_grad=True) for _ in range(3))
    flashlite.attention(q, k, v, window=(9, 5)).sum().backward()
    monkeypatch.setattr(W, "window_fwd_config", lambda facts: HopperConfig(BLOCK, BLOCK, 2))
    monkeypatch.setattr(W, "window_bwd_block", lambda q, k, v, do: (BLOCK, BLOCK))
    flashlite.attention(q, k, v, window=(9, 5), softcap=5.0).sum().backward()
    flashlite.attention(q, k, v, window=(9, 5), sinks=torch.zeros(2)).sum().backward()


def test_a_window_on_the_tables_is_planned_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a window runs on the tables backend (forced here), its first call keeps the band's
    bound flex plan for calls of its kind: the next call skips the planner, gives the same bits
    (and new tensors' answers), and FLASHLITE_HOPPER_KERNEL=0 (part of the key) plans again."""
    from flashlite import _caches
    from flashlite.kernels.attention.hopper import HopperConfig
    from flashlite.ops.attention import planner as W

    _caches.clear()
    monkeypatch.setattr(W, "window_fwd_config", lambda facts: HopperConfig(BLOCK, BLOCK, 2))
    planned: list[object] = []
    forward = W.forward
    monkeypatch.setattr(W, "forward", lambda *a, **kw: planned.append(1) or forward(*a, **kw))
    q, k, v = (torch.randn(1, 2, N, D) for _ in range(3))
    first = flashlite.attention(q, k, v, window=(11, 4))
    assert len(planned) == 1
    assert torch.equal(flashlite.attention(q, k, v, window=(11, 4)), first)
    q2 = torch.randn_like(q)
    want = reference.attention(q2.double(), k.double(), v.double(), window=(11, 4))
    got = flashlite.attention(q2, k, v, window=(11, 4)).double()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    assert len(planned) == 1
    monkeypatch.setenv("FLASHLITE_HOPPER_KERNEL", "0")
    flashlite.attention(q, k, v, window=(11, 4))
    assert len(planned) == 2


def test_a_block_masks_request_is_built_once() -> None:
    """flex's Request of one block mask, scale and score function is kept with the mask (a
    loop over one mask builds it once); another scale or score function gets its own."""
    from flashlite.ops.attention.backends.tables.args import table_request

    bm = flashlite.create_block_mask(gallery.causal(), None, None, N, N, BLOCK_SIZE=BLOCK)
    alibi = gallery.alibi(gallery.alibi_slopes(2))
    assert table_request(bm, 0.5) is table_request(bm, 0.5)
    assert table_request(bm, 0.25) is not table_request(bm, 0.5)
    assert table_request(bm, 0.5, alibi) is table_request(bm, 0.5, alibi)
    assert table_request(bm, 0.5, alibi).score_mod is not None
    assert table_request(bm, 0.5).score_mod is None


def test_a_block_masks_requests_go_with_it() -> None:
    """The kept requests of a block mask are dropped when the mask is."""
    import gc

    from flashlite.ops.attention.backends.tables import args as TA

    bm = flashlite.create_block_mask(gallery.causal(), None, None, N, N, BLOCK_SIZE=BLOCK)
    TA.table_request(bm, 0.5)
    key = id(bm)
    assert key in TA._requests
    del bm
    gc.collect()
    assert key not in TA._requests
