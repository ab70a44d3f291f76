"""The (m, s) pair: algebra of the torch twins, and agreement of the Triton helpers with them.

Twins are checked in fp64 with hypothesis (the algebra must hold up to rounding); the Triton
helpers run inside tiny test kernels on fp32 tiles and are held against their twins.
"""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st

from flashlite import reference, stats
from flashlite.stats import (
    finalize_lse,
    fixed_update,
    merge_pair,
    merge_partials,
    online_update,
    online_update_lazy,
    rescale,
    tile_stats,
)

NEG_INF = -math.inf
LOG2E = 1.4426950408889634
PROPS = settings(max_examples=25, deadline=None)

# Logits with a fair share of -inf (masked entries) and no NaN.
logit = st.one_of(st.floats(-60.0, 60.0), st.just(NEG_INF))
logits = st.lists(logit, min_size=1, max_size=12)


def _t(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def _pair(values: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(m, s) of a non-empty list of logits, as 0-d fp64 tensors."""
    return stats.torch_tile_stats(_t(values))


def _identity() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.tensor(NEG_INF, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64)


def _assert_pair(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> None:
    # m is a max, so exact; s is a sum of rescaled exponentials, so close.
    torch.testing.assert_close(a[0], b[0], atol=0, rtol=0)
    torch.testing.assert_close(a[1], b[1], atol=1e-12, rtol=1e-12)


# --------------------------------------------------------------------------- twin algebra
@PROPS
@given(logits, logits, logits)
def test_merge_is_associative(a: list[float], b: list[float], c: list[float]) -> None:
    pa, pb, pc = _pair(a), _pair(b), _pair(c)
    left = stats.merge(*stats.merge(*pa, *pb), *pc)
    right = stats.merge(*pa, *stats.merge(*pb, *pc))
    _assert_pair(left, right)


@PROPS
@given(logits, logits)
def test_merge_is_commutative(a: list[float], b: list[float]) -> None:
    pa, pb = _pair(a), _pair(b)
    _assert_pair(stats.merge(*pa, *pb), stats.merge(*pb, *pa))


@PROPS
@given(logits)
def test_merge_identity(a: list[float]) -> None:
    pa = _pair(a)
    _assert_pair(stats.merge(*pa, *_identity()), pa)
    _assert_pair(stats.merge(*_identity(), *pa), pa)


def test_merge_of_two_empty_sets_is_identity_not_nan() -> None:
    m, s = stats.merge(*_identity(), *_identity())
    assert m.item() == NEG_INF and s.item() == 0.0
    # a fully -inf tile has the identity as its stats too
    m, s = _pair([NEG_INF, NEG_INF, NEG_INF])
    assert m.item() == NEG_INF and s.item() == 0.0
    assert not torch.isnan(stats.torch_finalize_lse(m, s))
    assert stats.torch_finalize_lse(m, s).item() == NEG_INF


@PROPS
@given(logits, logits)
def test_merge_of_halves_equals_stats_of_whole(a: list[float], b: list[float]) -> None:
    _assert_pair(stats.merge(*_pair(a), *_pair(b)), _pair(a + b))


@PROPS
@given(st.lists(logit, min_size=1, max_size=40), st.integers(1, 9))
def test_online_update_folds_to_logsumexp(values: list[float], tile: int) -> None:
    x = _t(values)
    m, s = _identity()
    for start in range(0, len(values), tile):
        m, s, alpha, p = stats.torch_online_update(m, s, x[start : start + tile])
        assert not torch.isnan(alpha) and not torch.isnan(p).any()
    lse = stats.torch_finalize_lse(m, s)
    torch.testing.assert_close(lse, torch.logsumexp(x, 0), atol=1e-12, rtol=1e-12)
    assert m.item() == max(values)


@PROPS
@given(logits, logits)
def test_online_update_alpha_and_p(prev: list[float], tile: list[float]) -> None:
    m, s = _pair(prev)
    x = _t(tile)
    m_new, s_new, alpha, p = stats.torch_online_update(m, s, x)
    torch.testing.assert_close(alpha, stats.torch_rescale(m, m_new), atol=0, rtol=0)
    ref = 0.0 if m_new.item() == NEG_INF else m_new
    torch.testing.assert_close(p, torch.exp(x - ref), atol=0, rtol=0)
    _assert_pair((m_new, s_new), _pair(prev + tile))


@PROPS
@given(
    st.integers(1, 5),  # queries
    st.integers(2, 9),  # keys
    st.integers(1, 8),  # split point (clamped below)
    st.sampled_from([4, 8]),  # head dim
    st.integers(0, 2**16),
)
def test_merge_attention_of_disjoint_key_sets(
    nq: int, nk: int, cut: int, d: int, seed: int
) -> None:
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, n, d, generator=g, dtype=torch.float64) for n in (nq, nk, nk))
    cut = min(cut, nk - 1)
    o_ref, lse_ref = reference.attention(q, k, v, return_lse=True)
    o_a, lse_a = reference.attention(q, k[:, :, :cut], v[:, :, :cut], return_lse=True)
    o_b, lse_b = reference.attention(q, k[:, :, cut:], v[:, :, cut:], return_lse=True)
    o, lse = stats.merge_attention(o_a, lse_a, o_b, lse_b)
    assert o.dtype == torch.float64 and lse.dtype == torch.float32
    # the partial LSEs are fp32, so the merge weights carry fp32 rounding
    torch.testing.assert_close(o, o_ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, lse_ref, atol=1e-6, rtol=1e-6)
    o2, lse2 = stats.merge_attention(o_b, lse_b, o_a, lse_a)  # order does not matter
    torch.testing.assert_close(o2, o, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse2, lse, atol=0, rtol=0)


def test_merge_attention_with_empty_parts() -> None:
    o_a = torch.randn(1, 1, 3, 4, dtype=torch.float64)
    lse_a = torch.randn(1, 1, 3)
    empty_o, empty_lse = torch.zeros_like(o_a), torch.full_like(lse_a, NEG_INF)
    # a part that saw no key leaves the other unchanged
    o, lse = stats.merge_attention(o_a, lse_a, empty_o, empty_lse)
    torch.testing.assert_close(o, o_a)
    torch.testing.assert_close(lse, lse_a)
    # rows no part saw: o = 0, lse = -inf, no NaN
    o, lse = stats.merge_attention(empty_o, empty_lse, empty_o, empty_lse)
    assert not torch.isnan(o).any() and (o == 0).all()
    assert (lse == NEG_INF).all()


# --------------------------------------------------------------------------- Triton helpers
# Kernels keep m in the logits' own units and take SCALE = c·LOG2E, so for raw logits x a kernel
# pair (m, s) is the twin's natural-unit pair of c·x as (c·m, s); p and alpha are the same.
# Test kernels: one [R, C] (or [R]) tile, row-major and contiguous, one program.
@triton.jit
def _tile_stats_kernel(X, M, S, P, R: tl.constexpr, C: tl.constexpr, SCALE: tl.constexpr):
    r, c = tl.arange(0, R), tl.arange(0, C)
    offs = r[:, None] * C + c[None, :]
    m, s, p = tile_stats(tl.load(X + offs), SCALE)
    tl.store(M + r, m)
    tl.store(S + r, s)
    tl.store(P + offs, p)


@triton.jit
def _online_update_kernel(
    M0, S0, X, M, S, ALPHA, P, R: tl.constexpr, C: tl.constexpr, SCALE: tl.constexpr
):
    r, c = tl.arange(0, R), tl.arange(0, C)
    offs = r[:, None] * C + c[None, :]
    m, s, alpha, p = online_update(tl.load(M0 + r), tl.load(S0 + r), tl.load(X + offs), SCALE)
    tl.store(M + r, m)
    tl.store(S + r, s)
    tl.store(ALPHA + r, alpha)
    tl.store(P + offs, p)


@triton.jit
def _lazy_fold_kernel(X, M, S, MOVES, R: tl.constexpr, C: tl.constexpr, TILES: tl.constexpr,
                      SCALE: tl.constexpr, TAU: tl.constexpr):  # fmt: skip
    # fold TILES tiles of a [R, TILES*C] block with the lazy update, counting reference moves
    r = tl.arange(0, R)
    c = tl.arange(0, C)
    m = tl.full([R], float("-inf"), tl.float32)
    s = tl.zeros([R], tl.float32)
    moves = 0
    for t in tl.static_range(TILES):
        x = tl.load(X + r[:, None] * (TILES * C) + t * C + c[None, :])
        m, s, _, _, moved = online_update_lazy(m, s, x, SCALE, TAU)
        moves += moved.to(tl.int32)
    tl.store(M + r, m)
    tl.store(S + r, s)
    tl.store(MOVES + tl.arange(0, 1), tl.full([1], moves, tl.int32))


@triton.jit
def _fixed_fold_kernel(X, M0, S, P, R: tl.constexpr, C: tl.constexpr, TILES: tl.constexpr,
                       SCALE: tl.constexpr, P_BF16: tl.constexpr):  # fmt: skip
    # fold TILES tiles of a [R, TILES*C] block into sums against the fixed references M0
    r = tl.arange(0, R)
    c = tl.arange(0, C)
    m = tl.load(M0 + r)
    s = tl.zeros([R], tl.float32)
    for t in tl.static_range(TILES):
        offs = r[:, None] * (TILES * C) + t * C + c[None, :]
        if P_BF16:
            s, p = fixed_update(m, s, tl.load(X + offs), SCALE, tl.bfloat16)
        else:
            s, p = fixed_update(m, s, tl.load(X + offs), SCALE)
        tl.store(P + offs, p)
    tl.store(S + r, s)


@triton.jit
def _rescale_kernel(M_OLD, M_NEW, OUT, R: tl.constexpr, SCALE: tl.constexpr):
    r = tl.arange(0, R)
    tl.store(OUT + r, rescale(tl.load(M_OLD + r), tl.load(M_NEW + r), SCALE))


@triton.jit
def _merge_pair_kernel(MA, SA, MB, SB, M, S, R: tl.constexpr, SCALE: tl.constexpr):
    r = tl.arange(0, R)
    m, s = merge_pair(tl.load(MA + r), tl.load(SA + r), tl.load(MB + r), tl.load(SB + r), SCALE)
    tl.store(M + r, m)
    tl.store(S + r, s)


@triton.jit
def _merge_partials_kernel(MP, SP, M, S, R: tl.constexpr, C: tl.constexpr, SCALE: tl.constexpr):
    r, c = tl.arange(0, R), tl.arange(0, C)
    offs = r[:, None] * C + c[None, :]
    m, s = merge_partials(tl.load(MP + offs), tl.load(SP + offs), SCALE)
    tl.store(M + r, m)
    tl.store(S + r, s)


@triton.jit
def _finalize_lse_kernel(M, S, LSE, R: tl.constexpr, SCALE: tl.constexpr):
    r = tl.arange(0, R)
    tl.store(LSE + r, finalize_lse(tl.load(M + r), tl.load(S + r), SCALE))


R, C = 4, 8
# Softmax passes SCALE = LOG2E (c = 1); attention folds a score scale c into it.
SCALES = [pytest.param(1.0, id="softmax"), pytest.param(0.35, id="scaled")]


def _launch(kernel, *args, **meta) -> None:  # noqa: ANN001
    kernel[(1,)](*args, **meta)


def _tiles() -> torch.Tensor:
    """[R, C] fp32 tile: ordinary row, fully -inf row, partly -inf row, ±1e4 row."""
    x = torch.randn(R, C) * 3
    x[1] = NEG_INF
    x[2, ::2] = NEG_INF
    x[3] = torch.tensor([1e4, -1e4, 9999.5, 1e4, -3.0, 0.0, 1e4 - 1, -1e4])
    return x


def _close(actual: torch.Tensor, expected: torch.Tensor, tol: float = 2e-6) -> None:
    torch.testing.assert_close(actual.double(), expected.double(), atol=tol, rtol=tol)


def _no_nan(*ts: torch.Tensor) -> None:
    assert not any(torch.isnan(t).any() for t in ts)


@pytest.mark.parametrize("c", SCALES)
def test_triton_tile_stats(c: float) -> None:
    x = _tiles()
    m, s, p = torch.empty(R), torch.empty(R), torch.empty(R, C)
    _launch(_tile_stats_kernel, x, m, s, p, R=R, C=C, SCALE=c * LOG2E)
    _no_nan(m, s, p)
    m_ref, s_ref = stats.torch_tile_stats(x.double() * c)
    _close(m * c, m_ref)
    _close(s, s_ref)
    _close(p, torch.exp(x.double() * c - stats._ref_point(m_ref).unsqueeze(1)))
    assert m[1].item() == NEG_INF and s[1].item() == 0.0  # fully -inf tile: the identity
    assert (p[1] == 0).all() and (p[2, ::2] == 0).all()  # -inf entries give exact zeros


@pytest.mark.parametrize("c", SCALES)
@pytest.mark.parametrize("prev", ["identity", "finite", "mixed"])
def test_triton_online_update(c: float, prev: str) -> None:
    x = _tiles()
    m0, s0 = {
        "identity": (torch.full((R,), NEG_INF), torch.zeros(R)),
        "finite": (torch.tensor([0.5, 2.0, -1.0, 1e4 + 1]), torch.tensor([1.0, 3.0, 2.5, 1.5])),
        # -inf meets a fully -inf tile in row 1: both maxima -inf
        "mixed": (torch.tensor([5.0, NEG_INF, NEG_INF, -1e4]), torch.tensor([2.0, 0.0, 0.0, 1.0])),
    }[prev]
    m, s, alpha, p = torch.empty(R), torch.empty(R), torch.empty(R), torch.empty(R, C)
    _launch(_online_update_kernel, m0, s0, x, m, s, alpha, p, R=R, C=C, SCALE=c * LOG2E)
    _no_nan(m, s, alpha, p)
    ref = stats.torch_online_update(m0.double() * c, s0.double(), x.double() * c)
    for got, want in zip((m * c, s, alpha, p), ref, strict=True):
        _close(got, want)
    if prev != "finite":  # row 1: an empty pair meets a fully -inf tile
        assert m[1].item() == NEG_INF and s[1].item() == 0.0 and (p[1] == 0).all()


@pytest.mark.parametrize("tau", [0.0, 8.0])
def test_triton_online_update_lazy_gives_the_same_lse(tau: float) -> None:
    # the reference need not be the maximum: any reference gives the same lse = m + log s, and
    # with TAU = 8 the reference moves on few tiles (the attention kernel then skips rescaling)
    tiles, cols = 8, 8
    x = torch.randn(R, tiles * cols) * 3
    x[1] = NEG_INF  # an empty row stays (-inf, 0)
    x[2, : 3 * cols] = NEG_INF  # a row that starts masked
    m, s, moves = torch.empty(R), torch.empty(R), torch.zeros(1, dtype=torch.int32)
    _launch(_lazy_fold_kernel, x, m, s, moves, R=R, C=cols, TILES=tiles, SCALE=LOG2E, TAU=tau)
    _no_nan(m, s)
    lse = m.double() + torch.log(s.double())
    _close(lse[[0, 2, 3]], torch.logsumexp(x.double(), -1)[[0, 2, 3]])
    assert m[1].item() == NEG_INF and s[1].item() == 0.0
    assert (m <= x.amax(-1)).all()  # the reference never passes the true maximum
    if tau == 0.0:
        torch.testing.assert_close(m[[0, 2, 3]], x.amax(-1)[[0, 2, 3]])
    assert 1 <= moves.item() <= tiles


@pytest.mark.parametrize("c", SCALES)
def test_triton_fixed_update_gives_the_same_lse(c: float) -> None:
    # logits bounded by a cap: a fixed reference at the cap (or below it, as the attention
    # forward puts it) gives the pair of the running maximum's lse, and p like the twin's
    tiles, cols, cap = 4, 8, 20.0
    x = cap * torch.tanh(torch.randn(R, tiles * cols) * 3 / cap)
    x[1] = -cap  # every logit at the bottom of the cap: p = e^-40, still normal in fp32
    m0 = torch.tensor([cap, cap, cap - 5.0, 0.5 * cap])
    s, p = torch.empty(R), torch.empty(R, tiles * cols)
    _launch(_fixed_fold_kernel, x / c, m0 / c, s, p, R=R, C=cols, TILES=tiles, SCALE=c * LOG2E,
            P_BF16=False)  # fmt: skip
    _no_nan(s, p)
    want_s, want_p = stats.torch_fixed_update(m0.double(), torch.zeros(R).double(), x.double())
    _close(s, want_s)
    _close(p, want_p)
    _close(m0.double() + torch.log(s.double()), torch.logsumexp(x.double(), -1))


def test_triton_fixed_update_sums_the_rounded_exponentials() -> None:
    # with P_DTYPE = bf16 the p that come back are bf16 values and s is exactly their sum, so
    # that Σ p·v / Σ p is a true weighted mean (one key: v itself)
    x = 20.0 * torch.tanh(torch.randn(R, 32))
    m0 = torch.full((R,), 20.0)
    s, p = torch.empty(R), torch.empty(R, 32)
    _launch(_fixed_fold_kernel, x, m0, s, p, R=R, C=8, TILES=4, SCALE=LOG2E, P_BF16=True)
    assert torch.equal(p.to(torch.bfloat16).float(), p)
    torch.testing.assert_close(s, p.sum(-1), rtol=1e-6, atol=0)
    # rounded to nearest: within half a bf16 ulp (2^-8 relative: 8 significant bits)
    exact = torch.exp(x.double() - 20.0)
    assert ((p.double() - exact).abs() <= exact * (2**-8 + 1e-6)).all()


@pytest.mark.parametrize("c", SCALES)
def test_triton_rescale(c: float) -> None:
    m_old = torch.tensor([0.0, NEG_INF, NEG_INF, -3.0, 1e4, 2.0, NEG_INF, 7.0])
    m_new = torch.tensor([1.0, NEG_INF, 4.0, -3.0, 1e4 + 2, 2.0, 0.0, 7.5])
    out = torch.empty(8)
    _launch(_rescale_kernel, m_old, m_new, out, R=8, SCALE=c * LOG2E)
    _no_nan(out)
    _close(out, stats.torch_rescale(m_old.double() * c, m_new.double() * c))
    assert out[1].item() == 0.0  # both -inf: 0, not NaN
    assert out[2].item() == 0.0 and out[3].item() == 1.0


@pytest.mark.parametrize("c", SCALES)
def test_triton_merge_pair(c: float) -> None:
    # columns: ordinary, one side -inf, the other side -inf, both -inf, equal maxima, ±1e4, ...
    m_a = torch.tensor([1.0, NEG_INF, 3.0, NEG_INF, 2.0, 1e4, -5.0, 0.0])
    s_a = torch.tensor([2.0, 0.0, 1.5, 0.0, 1.0, 1.0, 4.0, 1.0])
    m_b = torch.tensor([3.0, 2.0, NEG_INF, NEG_INF, 2.0, -1e4, -4.0, 30.0])
    s_b = torch.tensor([1.0, 3.0, 0.0, 0.0, 2.0, 2.0, 1.0, 1.0])
    m, s = torch.empty(8), torch.empty(8)
    _launch(_merge_pair_kernel, m_a, s_a, m_b, s_b, m, s, R=8, SCALE=c * LOG2E)
    _no_nan(m, s)
    m_ref, s_ref = stats.merge(m_a.double() * c, s_a.double(), m_b.double() * c, s_b.double())
    _close(m * c, m_ref)
    _close(s, s_ref)
    assert m[3].item() == NEG_INF and s[3].item() == 0.0
    # commutative, and the identity leaves a pair unchanged
    m2, s2 = torch.empty(8), torch.empty(8)
    _launch(_merge_pair_kernel, m_b, s_b, m_a, s_a, m2, s2, R=8, SCALE=c * LOG2E)
    assert torch.equal(m2, m) and torch.equal(s2, s)
    ident_m, ident_s = torch.full((8,), NEG_INF), torch.zeros(8)
    _launch(_merge_pair_kernel, m_a, s_a, ident_m, ident_s, m2, s2, R=8, SCALE=c * LOG2E)
    assert torch.equal(m2, m_a) and torch.equal(s2, s_a)


@pytest.mark.parametrize("c", SCALES)
def test_triton_merge_partials(c: float) -> None:
    x = torch.randn(R, 3 * C) * 4
    x[1] = NEG_INF  # every partial of row 1 is the identity
    x[2, :C] = NEG_INF  # row 2: one partial is the identity
    x[3, C:] = NEG_INF  # row 3: all but one
    m_p, s_p = stats.torch_tile_stats(x.double().view(R, 3, C) * c)  # natural units of c·x
    # pad to a power of two with identity partials, as the split kernel does
    m_p = torch.cat([m_p, torch.full((R, 1), NEG_INF, dtype=torch.float64)], 1)
    s_p = torch.cat([s_p, torch.zeros(R, 1, dtype=torch.float64)], 1)
    m, s = torch.empty(R), torch.empty(R)
    _launch(_merge_partials_kernel, (m_p / c).float(), s_p.float(), m, s,
            R=R, C=4, SCALE=c * LOG2E)  # fmt: skip
    _no_nan(m, s)
    # reference: merge the partials one by one with the twin
    m_ref, s_ref = m_p[:, 0], s_p[:, 0]
    for j in range(1, 4):
        m_ref, s_ref = stats.merge(m_ref, s_ref, m_p[:, j], s_p[:, j])
    _close(m * c, m_ref)
    _close(s, s_ref)
    # and the merged pair is the stats of the whole row
    _close(stats.torch_finalize_lse(m.double() * c, s.double()), torch.logsumexp(x.double() * c, 1))
    assert m[1].item() == NEG_INF and s[1].item() == 0.0


@pytest.mark.parametrize("c", SCALES)
def test_triton_finalize_lse(c: float) -> None:
    m = torch.tensor([0.0, 3.0, NEG_INF, -1e4, 1e4, -2.0, 5.0, 0.5])
    s = torch.tensor([1.0, 2.5, 0.0, 1.0, 3.0, 7.0, 1.0, 100.0])
    lse = torch.empty(8)
    _launch(_finalize_lse_kernel, m, s, lse, R=8, SCALE=c * LOG2E)
    _close(lse, stats.torch_finalize_lse(m.double() * c, s.double()))
    assert lse[2].item() == NEG_INF  # empty set: -inf, not NaN


@settings(max_examples=10, deadline=None)
@given(st.lists(st.lists(logit, min_size=C, max_size=C), min_size=R, max_size=R))
def test_triton_tile_stats_property(rows: list[list[float]]) -> None:
    x = torch.tensor(rows, dtype=torch.float32)
    m, s, p = torch.empty(R), torch.empty(R), torch.empty(R, C)
    _launch(_tile_stats_kernel, x, m, s, p, R=R, C=C, SCALE=LOG2E)
    _no_nan(m, s, p)
    m_ref, s_ref = stats.torch_tile_stats(x.double())
    _close(m, m_ref)
    _close(s, s_ref)
