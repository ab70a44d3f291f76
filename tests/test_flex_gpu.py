"""Your own masks and score functions: the gallery forward and backward against the fp64
reference, the tile classifier against its twin, torch's BlockMask, compile, opcheck and bad
input. (GPU tests at the end: torch's flex_attention on the same mods, long sequences.)"""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl
from conftest import TOL, maybe_compile

import flashlite
from flashlite import reference
from flashlite.masking import block_mask as BM
from flashlite.masking import gallery, masks, mods
from flashlite.masking.classify import torch_classify

N, D, BLOCK = 72, 32, 32  # a ragged last tile both ways, several tiles per row


def _ids(b: int, n: int, docs: int = 4) -> torch.Tensor:
    return torch.sort(torch.randint(0, docs, (b, n)), dim=1).values.to(torch.int32)


def _gallery(h: int, b: int) -> dict[str, tuple[mods.MaskMod | None, mods.ScoreMod | None]]:
    ids = _ids(b, N)
    return {
        "causal": (gallery.causal(), None),
        "sliding_window": (gallery.sliding_window(20), None),
        "prefix_lm": (gallery.prefix_lm(10), None),
        "document": (gallery.document(ids), None),
        "document_causal": (gallery.document_causal(ids), None),
        "alibi": (gallery.causal(), gallery.alibi(gallery.alibi_slopes(h))),
        "tanh_softcap": (None, gallery.tanh_softcap(3.0)),
        "relative_bias": (gallery.causal(), gallery.relative_bias(torch.randn(h, 9))),
    }


GALLERY = list(_gallery(4, 2))


def _block_mask(mm: mods.MaskMod | None, b: int, h: int | None = None) -> BM.BlockMask | None:
    if mm is None:
        return None
    batch = b if mm.name.startswith("flashlite.gallery.document") else None
    return flashlite.create_block_mask(mm, batch, h, N, N, device="cpu", BLOCK_SIZE=BLOCK)


def _grads(out: tuple[torch.Tensor, torch.Tensor], leaves: list[torch.Tensor],
           go: torch.Tensor, gl: torch.Tensor) -> tuple[torch.Tensor, ...]:  # fmt: skip
    o, lse = out
    return torch.autograd.grad((o * go).sum() + (lse * gl).sum(), leaves)


@pytest.mark.parametrize("name", GALLERY)
def test_gallery_forward_backward_fp32(name: str) -> None:
    """Each gallery mod, GQA, through the output and the LSE, against fp64."""
    b, hq, hkv = 2, 4, 2
    mm, sm = _gallery(hq, b)[name]
    q = torch.randn(b, hq, N, D, requires_grad=True)
    k, v = (torch.randn(b, hkv, N, D, requires_grad=True) for _ in range(2))
    out = flashlite.flex_attention(q, k, v, score_mod=sm, block_mask=_block_mask(mm, b),
                                   return_lse=True)  # fmt: skip
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = reference.attention(*exact, mask_mod=mm, score_mod=sm, return_lse=True)
    go, gl = torch.randn_like(out[0]), torch.randn_like(out[1])
    got = _grads(out, [q, k, v], go, gl)
    want = _grads((ref[0], ref[1].double()), exact, go.double(), gl.double())
    torch.testing.assert_close(out[0].double(), ref[0], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(out[1].double(), ref[1].double(), atol=2e-5, rtol=1e-5)
    for a, w in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), w, atol=3e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", ["document_causal", "alibi"])
def test_low_precision_within_twice_torchs_error(name: str, dtype: torch.dtype) -> None:
    """16-bit inputs (bf16 through the interpreter's fp32 dots): the error against fp64 is at
    most 2x that of the same math in torch at the input precision, plus the table's floor."""
    b, h = 1, 2
    mm, sm = _gallery(h, b)[name]
    q, k, v = (torch.randn(b, h, N, D, dtype=dtype, requires_grad=True) for _ in range(3))
    o = flashlite.flex_attention(q, k, v, score_mod=sm, block_mask=_block_mask(mm, b))
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    exact = reference.attention(*leaves, mask_mod=mm, score_mod=sm)
    low = reference.attention(q, k, v, mask_mod=mm, score_mod=sm)
    _assert_within_twice_torchs_error(o, low, exact, (q, k, v), leaves, dtype)


def _assert_within_twice_torchs_error(o, low, exact, inputs, leaves, dtype) -> None:  # noqa: ANN001
    """``o`` (from 16-bit ``inputs``) and its gradients are within 2x the error of ``low``, the
    same math in torch at the input precision, against ``exact`` (fp64 ``leaves``), plus the
    tolerance table's floor."""
    go = torch.randn_like(o)
    got = torch.autograd.grad(o, inputs, go)
    want = torch.autograd.grad(exact, leaves, go.double())
    torch_low = torch.autograd.grad(low, inputs, go)
    floor = TOL[dtype].floor
    assert (o.double() - exact).abs().max() <= 2 * (low.double() - exact).abs().max() + floor
    for a, w, t in zip(got, want, torch_low, strict=True):
        assert (a.double() - w).abs().max() <= 2 * (t.double() - w).abs().max() + 4 * floor


@pytest.mark.filterwarnings("ignore:Input #")  # gradcheck prefers fp64, which no kernel takes
def test_gradcheck_fp32_document_alibi() -> None:
    gen = torch.Generator().manual_seed(0)
    n = 40
    ids = torch.tensor([0] * 13 + [1] * 20 + [2] * 7, dtype=torch.int32)
    bm = flashlite.create_block_mask(gallery.document_causal(ids), None, None, n, n,
                                     device="cpu", BLOCK_SIZE=16)  # fmt: skip
    sm = gallery.alibi(gallery.alibi_slopes(2))
    q, k, v = (torch.randn(1, 2, n, 8, generator=gen).requires_grad_() for _ in range(3))

    def fn(q, k, v):  # noqa: ANN001, ANN202
        return flashlite.flex_attention(q, k, v, score_mod=sm, block_mask=bm, return_lse=True)

    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-3, atol=2e-3, rtol=1e-2, fast_mode=True)


@pytest.mark.parametrize("name", ["causal", "sliding_window", "prefix_lm", "document",
                                  "document_causal"])  # fmt: skip
@pytest.mark.parametrize("block", [(16, 16), (32, 16), (16, 64)])
def test_classifier_matches_its_twin(name: str, block: tuple[int, int]) -> None:
    mm = _gallery(2, 2)[name][0]
    b = 2 if name.startswith("document") else 1
    got = flashlite.create_block_mask(mm, b, 3, N, N - 5, device="cpu", BLOCK_SIZE=block)
    want = torch_classify(mm, b, 3, N, N - 5, block)
    assert torch.equal(got.classes(), want)
    assert got.shape == (b, 3, N, N - 5) and block == got.BLOCK_SIZE


def test_tables_list_each_class_in_order() -> None:
    classes = torch.tensor([[[[2, 0, 1, 2], [0, 0, 0, 0], [1, 1, 2, 0]]]], dtype=torch.int8)
    bm = BM.BlockMask.from_classes(classes, (48, 64), (16, 16), gallery.causal())
    assert bm.full_kv_num_blocks.tolist() == [[[2, 0, 1]]]
    assert bm.full_kv_indices[0, 0, 0, :2].tolist() == [0, 3]
    assert bm.kv_num_blocks.tolist() == [[[1, 0, 2]]]
    assert bm.kv_indices[0, 0, 2, :2].tolist() == [0, 1]
    assert bm.q_num_blocks.tolist() == [[[1, 1, 1, 0]]]
    assert bm.full_q_indices[0, 0, 3, :1].tolist() == [0]
    assert torch.equal(bm.classes(), classes)
    assert bm.sparsity() == pytest.approx(6 / 12)


def test_empty_tiles_are_never_read() -> None:
    """Keys in empty tiles are never loaded: NaN there does not reach the output."""
    ids = torch.tensor([0] * 32 + [1] * 32, dtype=torch.int32)
    bm = flashlite.create_block_mask(gallery.document(ids), None, None, 64, 64, device="cpu",
                                     BLOCK_SIZE=32)  # fmt: skip
    assert bm.classes().flatten().tolist() == [2, 0, 0, 2]
    q, k, v = (torch.randn(1, 1, 64, 16) for _ in range(3))
    k[:, :, 32:], v[:, :, 32:] = math.nan, math.nan  # document 1's keys
    o = flashlite.flex_attention(q, k, v, block_mask=bm)
    assert torch.isfinite(o[:, :, :32]).all()
    ref = reference.attention(q[:, :, :32].double(), k[:, :, :32].double(), v[:, :, :32].double())
    torch.testing.assert_close(o[:, :, :32].double(), ref, atol=2e-5, rtol=1e-5)


def test_row_with_no_key_gives_zero_and_minus_inf() -> None:
    @triton.jit
    def odd_rows_see_nothing(b, h, q_idx, kv_idx):
        return (q_idx % 2 == 0) & (kv_idx <= q_idx)

    mm = mods.mask_mod(odd_rows_see_nothing)
    bm = flashlite.create_block_mask(mm, None, None, 40, 40, device="cpu", BLOCK_SIZE=16)
    q, k, v = (torch.randn(1, 2, 40, 16, requires_grad=True) for _ in range(3))
    o, lse = flashlite.flex_attention(q, k, v, block_mask=bm, return_lse=True)
    assert (o[:, :, 1::2] == 0).all() and (lse[:, :, 1::2] == -math.inf).all()
    ro = reference.attention(q.double(), k.double(), v.double(), mask_mod=mm)
    torch.testing.assert_close(o.double(), ro, atol=2e-5, rtol=1e-5)
    (o.sum() + lse[:, :, ::2].sum()).backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("alibi", [False, True], ids=["plain", "alibi"])
def test_plus_inf_key_and_huge_scores_follow_logsumexp(dtype: torch.dtype, alibi: bool) -> None:
    """A +inf key: the rows whose score against it is +inf get LSE +inf and output NaN (as
    torch.logsumexp and torch's attention), the others stay finite and right; scores in the
    tens of thousands (fp32) lose nothing to the online softmax."""
    sm = gallery.alibi(gallery.alibi_slopes(2)) if alibi else None
    q = torch.randn(1, 2, 3, 8).to(dtype)
    k, v = torch.randn(1, 2, 40, 8).to(dtype), torch.randn(1, 2, 40, 8).to(dtype)
    q[..., 0] = torch.tensor([1.0, -1.0, 0.5]).to(dtype)
    k[0, :, 17, 0] = math.inf
    out, lse = flashlite.flex_attention(q, k, v, score_mod=sm, return_lse=True)
    want = reference.attention(q.double(), k.double(), v.double(), score_mod=sm,
                               return_lse=True)[1]  # fmt: skip
    plus = want == math.inf
    assert plus[..., 0].all() and not plus[..., 1].any()
    assert (lse[plus] == math.inf).all() and out[plus].isnan().all()
    assert out[~plus].isfinite().all()
    torch.testing.assert_close(lse[~plus].double(), want[~plus].double(), atol=2e-2, rtol=2e-2)
    q, k = (torch.randn(1, 2, N, 16) * 300 for _ in range(2))
    v = torch.randn(1, 2, N, 16)
    bm = _block_mask(gallery.causal(), 1)
    o, lse = flashlite.flex_attention(q, k, v, score_mod=sm, block_mask=bm, return_lse=True)
    ro, rl = reference.attention(q.double(), k.double(), v.double(), mask_mod=gallery.causal(),
                                 score_mod=sm, return_lse=True)  # fmt: skip
    torch.testing.assert_close(o.double(), ro, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), rl.double(), atol=1e-2, rtol=1e-6)


def test_hand_written_causal_and_window_match_the_built_ins() -> None:
    """A mask written by hand gives the built-in paths' results (bit for bit is a GPU test:
    the two kernels order their arithmetic differently)."""
    q, k, v = (torch.randn(1, 2, N, D) for _ in range(3))
    for mm, kw in ((gallery.causal(), {"causal": True}),
                   (gallery.sliding_window(17), {"causal": True, "window": (17, 0)})):  # fmt: skip
        o = flashlite.flex_attention(q, k, v, block_mask=_block_mask(mm, 1))
        torch.testing.assert_close(o, flashlite.attention(q, k, v, **kw), atol=2e-6, rtol=1e-5)


def test_causal_lower_right_is_the_built_in_causal_and_causal_is_top_left() -> None:
    """``attention(causal=True)`` is bottom-right aligned: ``gallery.causal_lower_right(Nq,
    Nk)`` gives it for any lengths, ``gallery.causal()`` (top-left) only when Nq == Nk."""
    for nq, nk in ((20, 64), (40, 40)):
        q = torch.randn(1, 2, nq, 16)
        k, v = (torch.randn(1, 2, nk, 16) for _ in range(2))
        want = flashlite.attention(q, k, v, causal=True)
        for mm, agrees in ((gallery.causal_lower_right(nq, nk), True),
                           (gallery.causal(), nq == nk)):  # fmt: skip
            bm = flashlite.create_block_mask(mm, None, None, nq, nk, device="cpu", BLOCK_SIZE=16)
            got = flashlite.flex_attention(q, k, v, block_mask=bm)
            assert torch.allclose(got, want, atol=2e-6, rtol=1e-5) == agrees, (mm.name, nq, nk)
    with pytest.raises(ValueError, match="n_k must be an int >= 1, got 0"):
        gallery.causal_lower_right(4, 0)


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
    from flashlite.ops.attention import bwd as B
    from flashlite.ops.attention import fwd as F
    from flashlite.ops.attention import planner as W

    ran: list[str] = []
    fwd, bwd = F.window_fwd, B.window_bwd
    monkeypatch.setattr(W, "window_fwd_config", lambda facts: HopperConfig(BLOCK, BLOCK, 2))
    monkeypatch.setattr(W, "window_bwd_block", lambda q, k, v, do: (BLOCK, BLOCK))
    monkeypatch.setattr(F, "window_fwd", lambda *a: ran.append("fwd") or fwd(*a))
    monkeypatch.setattr(B, "window_bwd", lambda *a: ran.append("bwd") or bwd(*a))
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
    from flashlite.ops.attention import bwd as B
    from flashlite.ops.attention import fwd as F
    from flashlite.ops.attention import planner as W

    def refuse(*args: object) -> None:
        raise AssertionError("folded")

    monkeypatch.setattr(F, "window_fwd", refuse)
    monkeypatch.setattr(B, "window_bwd", refuse)
    q, k, v = (torch.randn(1, 2, N, D, requires_grad=True) for _ in range(3))
    flashlite.attention(q, k, v, window=(9, 5)).sum().backward()
    monkeypatch.setattr(W, "window_fwd_config", lambda facts: HopperConfig(BLOCK, BLOCK, 2))
    monkeypatch.setattr(W, "window_bwd_block", lambda q, k, v, do: (BLOCK, BLOCK))
    flashlite.attention(q, k, v, window=(9, 5), softcap=5.0).sum().backward()
    flashlite.attention(q, k, v, window=(9, 5), sinks=torch.zeros(2)).sum().backward()


def test_no_block_mask_is_dense_attention_and_layouts_agree() -> None:
    q = torch.randn(2, 3, 50, 4, D)[:, :, :, 1]  # non-contiguous (B, N, H, D): b n h d
    k, v = (torch.randn(2, 45, 1, D) for _ in range(2))
    o = flashlite.flex_attention(q, k, v, layout="b n h d")
    want = flashlite.attention(q, k, v, layout="b n h d")
    assert o.shape == q.shape
    torch.testing.assert_close(o, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("torch_block", [16, 32, 64])
def test_torch_block_mask_gives_identical_results(torch_block: int) -> None:
    """torch's own create_block_mask on the same mod (it calls the twin), re-tiled to
    flashlite's 32: the same output, bit for bit."""
    from torch.nn.attention.flex_attention import create_block_mask as torch_create

    b, h = 2, 2
    mm = gallery.document_causal(_ids(b, N))
    ours = flashlite.create_block_mask(mm, b, None, N, N, device="cpu", BLOCK_SIZE=BLOCK)
    theirs = torch_create(mm, b, None, N, N, device="cpu", BLOCK_SIZE=torch_block)
    converted = BM.BlockMask.from_torch(theirs, block_size=(BLOCK, BLOCK))
    assert converted.mask_mod is mm
    # converted tables may call more tiles partial (torch never calls a tile with ragged rows
    # full; a coarser torch block's pieces stay partial), never fewer
    assert ((converted.classes() == ours.classes()) | (converted.classes() == BM.PARTIAL)).all()
    q, k, v = (torch.randn(b, h, N, D) for _ in range(3))
    a = flashlite.flex_attention(q, k, v, block_mask=ours)
    assert torch.equal(a, flashlite.flex_attention(q, k, v, block_mask=converted))
    if torch_block == BLOCK:  # handed over as it is
        assert torch.equal(a, flashlite.flex_attention(q, k, v, block_mask=theirs))


def _py_causal(b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
    return q_idx >= kv_idx


_jit_causal = triton.jit(_py_causal)


def test_torch_block_mask_of_a_python_mask_and_the_jit_routes_agree() -> None:
    """torch's BlockMask of a plain Python mask runs (its mask kept as bits), and so does each
    route to a jit mask."""
    from torch.nn.attention.flex_attention import create_block_mask as torch_create

    n = 40
    q, k, v = (torch.randn(1, 2, n, 16) for _ in range(3))
    theirs = torch_create(_py_causal, None, None, n, n, device="cpu", BLOCK_SIZE=16)
    want = flashlite.attention(q, k, v, causal=True)
    routes = (
        flashlite.create_block_mask(_jit_causal, None, None, n, n, device="cpu", BLOCK_SIZE=16),
        torch_create(flashlite.mods.mask_mod(_jit_causal), None, None, n, n, device="cpu",
                     BLOCK_SIZE=16),
        flashlite.BlockMask.from_torch(theirs, mask_mod=_jit_causal),
    )  # fmt: skip
    for bm in (theirs, *routes):
        got = flashlite.flex_attention(q, k, v, block_mask=bm)
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def test_block_mask_repr_is_a_short_summary() -> None:
    bm = flashlite.create_block_mask(gallery.causal(), 2, None, 256, 256, device="cpu",
                                     BLOCK_SIZE=16)  # fmt: skip
    text = repr(bm)
    assert len(text) < 400, text
    assert text == ("BlockMask(shape=(2, 1, 256, 256), BLOCK_SIZE=(16, 16), sparsity=46.88%, "
                    "mask_mod=flashlite.gallery.causal)")  # fmt: skip
    assert bm.classes().shape == (2, 1, 16, 16)  # (the detailed view)


def test_compiled_matches_eager_without_recompiling_per_length() -> None:
    """fullgraph compile; new lengths are new table shapes, not new graphs (dynamic shapes)."""
    sm = gallery.alibi(gallery.alibi_slopes(2))

    def step(q, k, v, bm):  # noqa: ANN001, ANN202
        return flashlite.flex_attention(q, k, v, score_mod=sm, block_mask=bm)

    compiled = maybe_compile(step, True)
    for n in (40, 56, 72):
        bm = flashlite.create_block_mask(gallery.causal(), None, None, n, n, device="cpu",
                                         BLOCK_SIZE=16)  # fmt: skip
        q, k, v = (torch.randn(1, 2, n, 16, requires_grad=True) for _ in range(3))
        _assert_compiled_equals_eager(step, compiled, q, k, v, bm)


def _assert_compiled_equals_eager(step, compiled, q, k, v, *rest) -> None:  # noqa: ANN001
    """``compiled(q, k, v, *rest)`` and ``step``'s eager call agree bit for bit, gradients to
    q, k and v (of the output's sum) included."""
    o = compiled(q, k, v, *rest)
    o.sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    e = step(q, k, v, *rest)
    e.sum().backward()
    assert torch.equal(o, e)
    for g, t in zip(grads, (q, k, v), strict=True):
        assert torch.equal(g, t.grad)


def test_opcheck() -> None:
    from torch.library import opcheck

    from flashlite.ops.attention.flex import FLEX_FWD, table_request

    mm, sm = gallery.document_causal(_ids(1, 40)), gallery.tanh_softcap(4.0)
    bm = flashlite.create_block_mask(mm, 1, None, 40, 40, device="cpu", BLOCK_SIZE=16)
    q = torch.randn(1, 2, 40, 16, requires_grad=True)
    k, v = (torch.randn(1, 1, 40, 16, requires_grad=True) for _ in range(2))
    fields, named = FLEX_FWD.fields.flat(table_request(bm, 0.25, sm))
    opcheck(torch.ops.flashlite.flex_attention_fwd.default, (q, k, v, *fields), named)
    o, lse = torch.ops.flashlite.flex_attention_fwd.default(q, k, v, *fields, **named)
    grads = (torch.randn_like(o), q.detach(), k.detach(), v.detach(), o.detach(), lse.detach())
    opcheck(
        torch.ops.flashlite.flex_attention_bwd.default,
        (*grads, torch.randn_like(lse), *fields),
        named,
    )


# --------------------------------------------------------------------------- varlen
@triton.jit
def _prefix_per_sequence(b, h, q_idx, kv_idx, prefix):
    return (kv_idx < tl.load(prefix + b)) | (q_idx >= kv_idx)


def _prefix_per_sequence_t(b, h, q_idx, kv_idx, prefix):  # type: ignore[no-untyped-def]
    return (kv_idx < prefix[b]) | (q_idx >= kv_idx)


def _packed(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def _varlen_reference(q, k, v, cu_q, cu_k, mm, sm):  # noqa: ANN001, ANN202
    """fp64 attention of each packed sequence on its own, the mods seeing it as batch b and
    positions from its start: ``(o (total_q, Hq, D), lse (Hq, total_q))``."""
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    outs, lses = [], []
    for b in range(cu_q.shape[0] - 1):
        qs = q[cu_q[b] : cu_q[b + 1]].transpose(0, 1)
        ks, vs = (t[cu_k[b] : cu_k[b + 1]].transpose(0, 1).repeat_interleave(hq // hkv, 0)
                  for t in (k, v))  # fmt: skip
        s = qs @ ks.transpose(-1, -2) * d**-0.5
        dev = q.device
        idx = (torch.tensor(b, device=dev), torch.arange(hq, device=dev)[:, None, None],
               torch.arange(qs.shape[1], device=dev)[None, :, None],
               torch.arange(ks.shape[1], device=dev)[None, None, :])  # fmt: skip
        if sm is not None:
            s = sm(s, *idx).to(q.dtype)  # (a bias table's fp32 promotes 16-bit scores)
        if mm is not None:
            s = torch.where(mm(*idx), s, float("-inf"))
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - lse[..., None]).nan_to_num(0.0)  # rows with no key: 0, LSE -inf
        outs.append((p @ vs).transpose(0, 1))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, dim=1)


def _varlen_case(name: str, hq: int, lq: list[int], lk: list[int]):  # noqa: ANN202
    """(mask, score, per-sequence block mask?) of a varlen case."""
    prefix = torch.tensor([2, 0, 7, 1, 3], dtype=torch.int32)[: len(lq)]
    return {
        "causal+alibi": (gallery.causal(), gallery.alibi(gallery.alibi_slopes(hq)), False),
        "prefix per sequence": (mods.mask_mod(_prefix_per_sequence, prefix,
                                              torch_fn=_prefix_per_sequence_t,
                                              name="tests.prefix_per_sequence"), None, True),
        "softcap, no mask": (None, gallery.tanh_softcap(2.0), False),
        "window+relative bias": (gallery.sliding_window(9),
                                 gallery.relative_bias(torch.randn(hq, 7)), False),
    }[name]  # fmt: skip


# sequences of 0, 1, a ragged tile and several tiles; keys shorter and longer than queries
VARLEN_Q, VARLEN_K = [23, 1, 0, 40, 9], [23, 5, 3, 31, 17]


@pytest.mark.parametrize("name", ["causal+alibi", "prefix per sequence", "softcap, no mask",
                                  "window+relative bias"])  # fmt: skip
def test_varlen_with_mods_fp32(name: str) -> None:
    """attention_varlen with a score function and block tables, GQA, forward, backward and
    the LSE, against fp64 per sequence (the mods see sequence b as batch b)."""
    hq, hkv, d = 4, 2, 16
    lq, lk = VARLEN_Q, VARLEN_K
    mm, sm, per_sequence = _varlen_case(name, hq, lq, lk)
    cu_q, cu_k = _packed(lq), _packed(lk)
    bm = None
    if mm is not None:
        bm = flashlite.create_block_mask(mm, len(lq) if per_sequence else None, None, max(lq),
                                         max(lk), device="cpu", BLOCK_SIZE=16)  # fmt: skip
    q = torch.randn(sum(lq), hq, d, requires_grad=True)
    k, v = (torch.randn(sum(lk), hkv, d, requires_grad=True) for _ in range(2))
    out = flashlite.attention_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), score_mod=sm,
                                     block_mask=bm, return_lse=True)  # fmt: skip
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = _varlen_reference(*exact, cu_q, cu_k, mm, sm)
    go, gl = torch.randn_like(out[0]), torch.randn_like(out[1])
    gl[~torch.isfinite(ref[1])] = 0.0  # (rows with no key: their LSE is -inf either way)
    got = _grads(out, [q, k, v], go, gl)
    want = _grads((ref[0], torch.where(torch.isfinite(ref[1]), ref[1], 0.0)), exact,
                  go.double(), gl.double())  # fmt: skip
    torch.testing.assert_close(out[0].double(), ref[0], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(out[1].double(), ref[1], atol=2e-5, rtol=1e-5)
    for a, w in zip(got, want, strict=True):
        torch.testing.assert_close(a.double(), w, atol=3e-5, rtol=1e-5)


def test_varlen_with_mods_equals_flex_per_sequence_and_longer_max_seqlen() -> None:
    """Each packed sequence gives what flex_attention gives it alone (fp16: the same tiles),
    also when max_seqlen overstates the longest sequence (more tables, programs that leave)."""
    hq, d = 2, 16
    lq = [30, 7, 18]
    cu = _packed(lq)
    mm, sm = gallery.causal(), gallery.alibi(gallery.alibi_slopes(hq))
    q, k, v = (torch.randn(sum(lq), hq, d, dtype=torch.float16) for _ in range(3))
    for max_len in (30, 50):
        bm = flashlite.create_block_mask(mm, None, None, max_len, max_len, device="cpu",
                                         BLOCK_SIZE=16)  # fmt: skip
        got = flashlite.attention_varlen(q, k, v, cu, cu, max_len, max_len, score_mod=sm,
                                         block_mask=bm)  # fmt: skip
        for b, n in enumerate(lq):
            rows = slice(int(cu[b]), int(cu[b + 1]))
            one = [t[rows].transpose(0, 1)[None] for t in (q, k, v)]
            alone = flashlite.flex_attention(*one, score_mod=sm, block_mask=flashlite.
                                             create_block_mask(mm, None, None, n, n, device="cpu",
                                                               BLOCK_SIZE=16))  # fmt: skip
            torch.testing.assert_close(got[rows], alone[0].transpose(0, 1), atol=1e-3, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_varlen_with_mods_low_precision(dtype: torch.dtype) -> None:
    """16-bit varlen with a mask and a score function: within 2x torch's own error."""
    hq, d = 2, 16
    lq = [20, 33, 1]
    cu = _packed(lq)
    mm, sm = gallery.causal(), gallery.alibi(gallery.alibi_slopes(hq))
    bm = flashlite.create_block_mask(mm, None, None, 33, 33, device="cpu", BLOCK_SIZE=16)
    q, k, v = (torch.randn(sum(lq), hq, d, dtype=dtype, requires_grad=True) for _ in range(3))
    o = flashlite.attention_varlen(q, k, v, cu, cu, 33, 33, score_mod=sm, block_mask=bm)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    exact = _varlen_reference(*leaves, cu, cu, mm, sm)[0]
    low = _varlen_reference(q, k, v, cu, cu, mm, sm)[0]
    _assert_within_twice_torchs_error(o, low, exact, (q, k, v), leaves, dtype)


def test_varlen_with_mods_compiles_fullgraph_and_passes_opcheck() -> None:
    """The varlen offsets reach the flex ops as tensors: fullgraph compile equals eager, and
    the ops' schema, fake and autograd hold with them (opcheck)."""
    from torch.library import opcheck

    from flashlite.ops.attention.flex import FLEX_FWD, table_request

    hq, d = 2, 16
    lq = [12, 21, 4]
    cu = _packed(lq)
    sm = gallery.alibi(gallery.alibi_slopes(hq))
    bm = flashlite.create_block_mask(gallery.causal(), None, None, 21, 21, device="cpu",
                                     BLOCK_SIZE=16)  # fmt: skip

    def step(q, k, v, cu):  # noqa: ANN001, ANN202
        return flashlite.attention_varlen(q, k, v, cu, cu, 21, 21, score_mod=sm, block_mask=bm)

    q, k, v = (torch.randn(sum(lq), hq, d, requires_grad=True) for _ in range(3))
    _assert_compiled_equals_eager(step, maybe_compile(step, True), q, k, v, cu)

    qc, kc, vc = (t.detach().unsqueeze(0).transpose(1, 2).requires_grad_() for t in (q, k, v))
    request = table_request(bm, d**-0.5, sm, cu_seqlens_q=cu, cu_seqlens_k=cu)
    fields, named = FLEX_FWD.fields.flat(request)
    opcheck(torch.ops.flashlite.flex_attention_fwd.default, (qc, kc, vc, *fields), named)
    o, lse = torch.ops.flashlite.flex_attention_fwd.default(qc, kc, vc, *fields, **named)
    grads = (torch.randn_like(o), qc.detach(), kc.detach(), vc.detach(), o.detach())
    opcheck(
        torch.ops.flashlite.flex_attention_bwd.default,
        (*grads, lse.detach(), torch.randn_like(lse), *fields),
        named,
    )


_SM90_MOD_BUILD = """
import os, subprocess, sys
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource
from flashlite.masking import gallery
from flashlite.kernels.attention import decode as KD
from flashlite.kernels.attention import flex as KF
from flashlite.ops.attention.backends.tables import args as FA
from flashlite.ops.attention.backends.tables import bwd as TB
from flashlite.ops.attention.backends.tables import fwd as TF

which = sys.argv[1]
kernel = {"fwd": KF._flex_fwd_kernel, "dkdv": KF._flex_bwd_dkdv_kernel,
          "dq": KF._flex_bwd_dq_kernel, "decode": KD._attention_decode_kernel}[which]
names = list(kernel.arg_names)
mods = dict(MASK_MOD=gallery._document_causal, N_MASK_BUF=2, SCORE_MOD=gallery._alibi,
            N_SCORE_BUF=1)
if which == "decode":
    consts = dict(GROUP=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=16, BLOCK_N=64, IS_CAUSAL=True,
                  WINDOW=False, SOFTCAP=False, HAS_SEQLENS=True, HAS_SINKS=False, PAGE_SIZE=0,
                  USE_DESC=False, PRESCALE_Q=True, DOT_FP32=False, DOT_PRECISION="tf32",
                  ROUND_BF16=False, **mods)
    options = {"num_warps": 4, "num_stages": 3}
else:  # varlen, with the options the plans give D 128 bf16
    bwd = which != "fwd"
    opts = FA.plan_options(torch.empty(1, 1, 1, 128, dtype=torch.bfloat16), 128, 128, bwd, True)
    options = {k: opts.pop(k) for k in ("num_warps", "num_stages")}
    consts = dict(HAS_SCORE=True, VARLEN=True, **opts, **mods)
    if bwd:
        consts["SCORE_GRAD"] = gallery._alibi_grad
ptrs = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "O": "*bf16", "DO": "*bf16", "DK": "*bf16",
        "DV": "*bf16", "DQ": "*bf16", "LSE": "*fp32", "DELTA": "*fp32", "SINKS": "*fp32",
        "MB0": "*i32", "SB0": "*fp32", "sm_scale": "fp32", "softcap": "fp32"}
sig = {n: "constexpr" if n in consts else ptrs.get(n, "*i32" if n.isupper() else "i32")
       for n in names}
sig.update({n: "i32" for n in ("MB1", "MB2", "MB3", "SB1", "SB2", "SB3")})
src = ASTSource(kernel, sig, {(names.index(n),): v for n, v in consts.items()})
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
path = os.path.join(sys.argv[2], "k.ptx")
open(path, "w").write(k.asm["ptx"])
out = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", path, "-o", path + ".cubin"],
                     capture_output=True, text=True)
print(out.stdout + out.stderr)
"""


@pytest.mark.parametrize("which", ["fwd", "dkdv", "dq", "decode"])
def test_mod_kernels_build_for_sm90(which: str, tmp_path) -> None:  # noqa: ANN001
    """No GPU needed: Triton compiles the varlen flex kernels (with the plans' options) and the
    decode kernel, each with a document-causal mask and ALiBi, for sm_90 (what a GPU would
    run), and its ptxas reports. A change that breaks their build, or makes them spill a
    kilobyte as 64-key varlen tiles did, fails on CPU too."""
    import os
    import re
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "0"}  # a real build, not the interpreter
    run = subprocess.run([sys.executable, "-c", _SM90_MOD_BUILD, which, str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    spills = [int(n) for n in re.findall(r"(\d+) bytes spill stores", run.stdout)]
    assert spills and max(spills) <= 256, run.stdout


def test_document_ids_from_varlen_offsets_give_varlen_causal() -> None:
    """The packed sequences of attention_varlen as documents of one sequence: flex_attention
    with document_causal over the ids document_ids makes from the offsets equals
    attention_varlen(causal=True), sequences of 0 and 1 tokens included."""
    lengths = [23, 1, 0, 40, 9]
    cu, total = _packed(lengths), sum(lengths)
    ids = gallery.document_ids(cu)
    assert ids.dtype == torch.int32
    assert torch.equal(ids, torch.repeat_interleave(torch.arange(5), torch.tensor(lengths)).int())
    assert torch.equal(gallery.document_ids(cu, total + 2)[-2:], torch.tensor([5, 5]).int())
    q = torch.randn(total, 4, 16)
    k, v = (torch.randn(total, 2, 16) for _ in range(2))
    want = flashlite.attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
    bm = flashlite.create_block_mask(gallery.document_causal(ids), None, None, total, total,
                                     device="cpu", BLOCK_SIZE=16)  # fmt: skip
    got = flashlite.flex_attention(q[None], k[None], v[None], block_mask=bm, layout="b n h d")
    torch.testing.assert_close(got[0], want, atol=2e-6, rtol=1e-5)
    with pytest.raises(TypeError, match="cu_seqlens"):
        gallery.document_ids(cu.float())
    with pytest.raises(TypeError, match="cu_seqlens"):
        gallery.document_ids(cu[None])
    with pytest.raises(ValueError, match="total"):
        gallery.document_ids(cu, -1)


def test_varlen_rows_with_no_key_give_zero_and_minus_inf() -> None:
    """A window of 0 (each query sees its own position only): queries past a shorter
    sequence's keys see nothing, so their output is 0 and their LSE −inf; the rest match fp64."""
    hq, d = 2, 16
    lq, lk = [40, 9], [31, 17]  # rows 31..39 of the first sequence have no key
    cu_q, cu_k = _packed(lq), _packed(lk)
    mm = gallery.sliding_window(0)
    bm = flashlite.create_block_mask(mm, None, None, 40, 31, device="cpu", BLOCK_SIZE=16)
    q = torch.randn(sum(lq), hq, d)
    k, v = (torch.randn(sum(lk), hq, d) for _ in range(2))
    o, lse = flashlite.attention_varlen(q, k, v, cu_q, cu_k, 40, 31, block_mask=bm,
                                        return_lse=True)  # fmt: skip
    empty = torch.zeros(sum(lq), dtype=torch.bool)
    empty[31:40] = True
    assert (o[empty] == 0).all() and (lse[:, empty] == -math.inf).all()
    ref, ref_lse = _varlen_reference(q.double(), k.double(), v.double(), cu_q, cu_k, mm, None)
    torch.testing.assert_close(o.double(), ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse[:, ~empty].double(), ref_lse[:, ~empty], atol=2e-5, rtol=1e-5)


def test_varlen_with_mods_bad_input() -> None:
    hq, d = 2, 16
    cu = _packed([10, 6])
    q, k, v = (torch.randn(16, hq, d) for _ in range(3))
    sm = gallery.alibi(gallery.alibi_slopes(hq))
    for kw, words in (({"causal": True}, "without causal"), ({"window": (4, 0)}, "window"),
                      ({"softcap": 5.0}, "softcap")):  # fmt: skip
        with pytest.raises(ValueError, match=words):
            flashlite.attention_varlen(q, k, v, cu, cu, 10, 10, score_mod=sm, **kw)
    bm = flashlite.create_block_mask(gallery.causal(), None, None, 16, 16, device="cpu")
    with pytest.raises(ValueError, match="Q_LEN, KV_LEN"):
        flashlite.attention_varlen(q, k, v, cu, cu, 10, 10, block_mask=bm)
    bm = flashlite.create_block_mask(gallery.causal(), 3, None, 10, 10, device="cpu")
    with pytest.raises(ValueError, match="B=3"):
        flashlite.attention_varlen(q, k, v, cu, cu, 10, 10, block_mask=bm)


# --------------------------------------------------------------------------- bad input
@triton.jit
def _three_args(b, h, q_idx):
    return q_idx >= 0


@triton.jit
def _needs_table(score, b, h, q_idx, kv_idx, table):
    return score + tl.load(table + h)


def test_bad_mods_raise_clear_errors() -> None:
    with pytest.raises(TypeError, match="mask_mod must be a @triton.jit function"):
        flashlite.create_block_mask(lambda b, h, q: q >= 0, None, None, 8, 8, device="cpu")
    # a gallery maker passed without calling it
    with pytest.raises(TypeError, match=r"got function.*did you mean `gallery\.causal\(\)`\?"):
        flashlite.create_block_mask(gallery.causal, None, None, 8, 8, device="cpu")
    with pytest.raises(TypeError, match=r"did you mean `gallery\.sliding_window\(window\)`\?"):
        flashlite.create_block_mask(gallery.sliding_window, None, None, 8, 8, device="cpu")
    with pytest.raises(TypeError, match=r"score_mod .*did you mean `gallery\.tanh_softcap\(cap\)`"):
        q = torch.randn(1, 1, 16, 16)
        flashlite.flex_attention(q, q, q, score_mod=gallery.tanh_softcap)
    with pytest.raises(TypeError, match="takes 3 arguments.*must take 4"):
        mods.mask_mod(_three_args)
    with pytest.raises(TypeError, match="takes 6 arguments; with 0 buffers it must take 5"):
        mods.score_mod(_needs_table)
    with pytest.raises(TypeError, match="buffer 0 must be a tensor, int or float"):
        mods.score_mod(_needs_table, "table")
    with pytest.raises(ValueError, match="at most 4"):
        mods.mask_mod(_three_args, 1, 2, 3, 4, 5)
    q = torch.randn(1, 2, 16, 16, requires_grad=True)
    sm = mods.score_mod(_needs_table, torch.zeros(2))  # no derivative: forward only
    o = flashlite.flex_attention(q, q, q, score_mod=sm)
    with pytest.raises(NotImplementedError, match="has no derivative"):
        o.sum().backward()


@triton.jit
def _int_mask(b, h, q_idx, kv_idx):
    return q_idx - kv_idx  # (an int: which keys are seen is unclear)


@triton.jit
def _float_mask(b, h, q_idx, kv_idx):
    return (q_idx >= kv_idx) * 1.0


@triton.jit
def _bool_score(score, b, h, q_idx, kv_idx):
    return score > 0


@triton.jit
def _int_score(score, b, h, q_idx, kv_idx):
    return q_idx - kv_idx


def test_mods_returning_the_wrong_kind_are_refused() -> None:
    """A mask must give bools and a score function a floating-point score: their twins are
    tried on one position when the mod is made, so an int or float mask (which failed to
    compile, or was read as nonzero = seen) and a bool or int score are TypeErrors."""
    for fn in (_int_mask, _float_mask):
        with pytest.raises(TypeError, match=r"must return a bool tensor.*returned torch\."):
            mods.mask_mod(fn, name=f"tests.flex.{fn.__name__}")
    for fn in (_bool_score, _int_score):
        with pytest.raises(TypeError, match=r"must return a floating-point score"):
            mods.score_mod(fn, name=f"tests.flex.{fn.__name__}")
    with pytest.raises(TypeError, match="must return a bool tensor"):  # (a bare function too)
        flashlite.create_block_mask(_float_mask, None, None, 8, 8, device="cpu")


def test_mods_refuse_calls_past_what_their_buffers_hold() -> None:
    """The gallery's mods say how many batches, heads and positions their buffers hold
    (``limits``): document ids, ALiBi slopes and relative tables; a call with more is a
    ValueError naming the mod, where the kernels would have read past the buffer, and so are
    tables shared across batches (B=None) for ids that differ per batch. Ids of shape (N,)
    serve every batch; a mod without limits is trusted."""
    q = torch.randn(3, 4, 40, 16)
    ids = gallery.random_documents(2, 40, 3)
    docs = gallery.document_causal(ids)
    assert docs.limits == (2, None, 40) and gallery.document(ids[0]).limits == (None, None, 40)
    with pytest.raises(ValueError, match=r"document_causal has buffer entries for 2 batches, "
                                         r"the call has 3"):  # fmt: skip
        flashlite.create_block_mask(docs, 3, None, 40, 40, device="cpu", BLOCK_SIZE=16)
    shared = flashlite.create_block_mask(docs, None, None, 40, 40, device="cpu", BLOCK_SIZE=16)
    with pytest.raises(ValueError, match="entries for 2 batches, the call has 3"):
        flashlite.flex_attention(q, q, q, block_mask=shared)
    # (tables built with B=None hold batch 0's tiles: wrong for per-batch ids, even at B=2)
    with pytest.raises(ValueError, match=r"built with B=None .* entries for 2 batches and may "
                                         r"differ between them: build it with B=2"):  # fmt: skip
        flashlite.flex_attention(q[:2], q[:2], q[:2], block_mask=shared)
    short = gallery.document_causal(gallery.random_documents(2, 20, 3))
    with pytest.raises(ValueError, match="entries for 20 positions, the call has 40"):
        flashlite.create_block_mask(short, 2, None, 40, 40, device="cpu", BLOCK_SIZE=16)
    every = flashlite.create_block_mask(gallery.document_causal(ids[0]), None, None, 40, 40,
                                        device="cpu", BLOCK_SIZE=16)  # fmt: skip
    assert flashlite.flex_attention(q, q, q, block_mask=every).isfinite().all()
    for sm in (gallery.alibi(gallery.alibi_slopes(3)), gallery.relative_bias(torch.randn(3, 9))):
        with pytest.raises(ValueError, match=f"{sm.name} has buffer entries for 3 query heads, "
                                             "the call has 4"):  # fmt: skip
            flashlite.flex_attention(q, q, q, score_mod=sm)
    cu = torch.tensor([0, 30, 60, 90], dtype=torch.int32)
    packed = torch.randn(90, 4, 16)
    two = flashlite.create_block_mask(gallery.document_causal(gallery.random_documents(2, 30, 2)),
                                      2, None, 30, 30, device="cpu", BLOCK_SIZE=16)  # fmt: skip
    with pytest.raises(ValueError, match="entries for 2 batches, the call has 3"):
        flashlite.attention_varlen(packed, packed, packed, cu, cu, 30, 30, block_mask=two)
    cache = torch.randn(2, 50, 4, 16)
    lens = torch.tensor([10, 20], dtype=torch.int32)
    with pytest.raises(ValueError, match="entries for 2 query heads, the call has 4"):
        flashlite.attention_kvcache(q[:2, :, :1].transpose(1, 2), cache, cache, cache_seqlens=lens,
                                    score_mod=gallery.alibi(gallery.alibi_slopes(2)))  # fmt: skip
    with pytest.raises(ValueError, match="entries for 30 positions, the call has 50"):
        flashlite.attention_kvcache(q[:2, :, :1].transpose(1, 2), cache, cache, cache_seqlens=lens,
                                    mask_mod=gallery.document_causal(
                                        gallery.random_documents(2, 30, 2)))  # fmt: skip
    for bad in ((0, None, None), [1, 2, 3], (1, 2), (None, True, None)):
        with pytest.raises(ValueError, match="limits must be a tuple"):
            mods.mask_mod(gallery._causal, limits=bad, name="tests.flex.limited")
    trusted = mods.mask_mod(gallery._document_causal, ids, 40, torch_fn=gallery._document_causal_t,
                            name="tests.flex.trusted")  # fmt: skip
    assert trusted.limits == (None, None, None)


def test_bad_block_masks_raise_clear_errors() -> None:
    q = torch.randn(2, 2, 40, 16)
    bm = flashlite.create_block_mask(gallery.causal(), None, None, 48, 48, device="cpu",
                                     BLOCK_SIZE=16)  # fmt: skip
    with pytest.raises(ValueError, match=r"built for \(Q_LEN, KV_LEN\) = \(48, 48\)"):
        flashlite.flex_attention(q, q, q, block_mask=bm)
    bm3 = flashlite.create_block_mask(gallery.causal(), 3, None, 40, 40, device="cpu",
                                      BLOCK_SIZE=16)  # fmt: skip
    with pytest.raises(ValueError, match="built for B=3"):
        flashlite.flex_attention(q, q, q, block_mask=bm3)
    cls = bm3.classes()[:1]
    wrong = BM.BlockMask.from_classes(cls, (40, 40), (32, 32), gallery.causal())  # 16's tables
    with pytest.raises(ValueError, match=r"block_mask.kv_num_blocks is \(1, 1, 3\)"):
        flashlite.flex_attention(q, q, q, block_mask=wrong)
    with pytest.raises(TypeError, match="block_mask must be a flashlite or torch BlockMask"):
        flashlite.flex_attention(q, q, q, block_mask=torch.ones(1))
    for bad in (24, 8, (16, 48), "128"):
        with pytest.raises(ValueError, match="BLOCK_SIZE must be a power of two"):
            flashlite.create_block_mask(gallery.causal(), None, None, 40, 40, BLOCK_SIZE=bad)
    with pytest.raises(ValueError, match="Q_LEN must be an int >= 1"):
        flashlite.create_block_mask(gallery.causal(), None, None, 0, 40)
    with pytest.raises(ValueError, match="must divide one another"):
        from torch.nn.attention.flex_attention import create_block_mask as torch_create

        theirs = torch_create(gallery.causal(), None, None, 40, 40, device="cpu", BLOCK_SIZE=48)
        BM.BlockMask.from_torch(theirs, block_size=(32, 32))
    with pytest.raises(ValueError, match="ids must be"):
        gallery.document(torch.zeros(2, 3, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="window must be an int"):
        gallery.sliding_window(-1)


def test_plans_follow_a_name_registered_again_and_serve_later_calls() -> None:
    """A call of a planned kind makes no new plan; a score function registered again under its
    name (a notebook cell run again) gets its own plan, never the old function's."""
    from flashlite.ops.attention.backends.tables import args as FA

    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=gen) for _ in range(3))
    bm = flashlite.create_block_mask(gallery.causal(), None, None, 40, 40, device="cpu",
                                     BLOCK_SIZE=32)  # fmt: skip

    @triton.jit
    def bias(score, b, h, q_idx, kv_idx):
        return score + 1.0

    first = mods.score_mod(bias, name="tests.flex.redefined")
    out1 = flashlite.flex_attention(q, k, v, score_mod=first, block_mask=bm)
    planned = len(FA.fwd_plans)
    again = flashlite.flex_attention(q.clone(), k.clone(), v.clone(), score_mod=first,
                                     block_mask=bm)  # fmt: skip
    assert len(FA.fwd_plans) == planned and torch.equal(again, out1)

    @triton.jit
    def bias2(score, b, h, q_idx, kv_idx):
        return score + (kv_idx == 0) * 4.0  # favours the first key

    second = mods.score_mod(bias2, name="tests.flex.redefined")
    out2 = flashlite.flex_attention(q, k, v, score_mod=second, block_mask=bm)
    want = reference.attention(*(t.double() for t in (q, k, v)), mask_mod=gallery.causal(),
                               score_mod=second)  # fmt: skip
    torch.testing.assert_close(out2.double(), want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out2, out1)


@pytest.mark.parametrize("lead", [(1, 1), (2, 1), (1, 4), (2, 4)])
def test_table_strides_are_the_broadcast_views(lead: tuple[int, int]) -> None:
    """The kernels' table strides are those of the tables expanded to the call's (B, H): 0 along
    a dimension the mask ignores."""
    from flashlite.ops.attention.backends.tables.args import table_args

    num = torch.zeros(*lead, 5, dtype=torch.int32)
    idx = torch.zeros(*lead, 5, 7, dtype=torch.int32)
    want = (*num.expand(2, 4, 5).stride(), *idx.expand(2, 4, 5, 7).stride()[:3])
    assert table_args(num, idx) == want


def test_hopper_build_failures_fall_back_to_the_triton_kernels(monkeypatch) -> None:  # noqa: ANN001
    """Where the Gluon kernels would run but fail to build, one warning per direction and the
    Triton kernels' results (the dispatch, on CPU: the Gluon launches themselves are broken)."""
    import warnings

    from flashlite import _caches
    from flashlite.kernels.attention import hopper as KH
    from flashlite.ops.attention.backends.tables import bwd as TB
    from flashlite.ops.attention.backends.tables import fwd as TF

    q, k, v = (torch.randn(1, 2, 40, 16, generator=torch.Generator().manual_seed(i))
               for i in range(3))  # fmt: skip
    bm = flashlite.create_block_mask(gallery.causal(), None, None, 40, 40, device="cpu",
                                     BLOCK_SIZE=128)  # fmt: skip
    go = torch.randn_like(q)

    def run() -> tuple[torch.Tensor, ...]:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        o = flashlite.flex_attention(*leaves, block_mask=bm)
        return (o.detach(), *torch.autograd.grad(o, leaves, go))

    want = run()

    def broken(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AttributeError("module 'triton.experimental.gluon.language' has no attribute")

    _caches.clear()  # (the reference calls planned the Triton kernels)
    monkeypatch.setattr(TF, "hopper_config", lambda *a: KH.HopperConfig(128, 128, 3))
    monkeypatch.setattr(TB, "hopper_bwd_applies", lambda *a: True)
    monkeypatch.setattr(TF, "descriptor_ok", lambda *a: True)
    monkeypatch.setattr(TB, "descriptor_ok", lambda *a: True)
    monkeypatch.setattr(TF, "plan_flex_fwd", broken)
    monkeypatch.setattr(TB, "plan_flex_bwd", broken)
    monkeypatch.setattr(TF, "hopper_failed", set())
    monkeypatch.setattr(TB, "hopper_bwd_failed", set())
    with pytest.warns(RuntimeWarning) as caught:
        got = run()
    said = sorted(
        str(w.message).split(" kernel failed")[0] for w in caught if "Hopper" in str(w.message)
    )  # (not an old interpreter's numpy warnings)
    assert said == ["flashlite: the Hopper flex", "flashlite: the Hopper flex backward"], said
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        again = run()
    assert not [w for w in seen if "Hopper" in str(w.message)]  # no second warning
    for g, a, w in zip(got, again, want, strict=True):
        assert torch.equal(g, w) and torch.equal(a, w)


def test_fused_backward_receives_what_its_kernel_reads(monkeypatch) -> None:  # noqa: ANN001
    """The host side of the fused Hopper backward on CPU, with the Gluon launch replaced by a
    stand-in: it gets ``Qs = Q·scale·log2 e`` (as the forward rounded it) in dQ's memory, delta,
    a zeroed accumulator, the ``q_*`` tables with their strides and the mods; what it writes is
    what the call returns, and an LSE gradient reaches delta."""
    from flashlite.ops.attention.backends.tables import args as FA
    from flashlite.ops.attention.backends.tables import bwd as TB

    gen = torch.Generator().manual_seed(4)
    b, h, n, d = 2, 2, 40, 16
    q, k, v = (torch.randn(b, h, n, d, generator=gen).half() for _ in range(3))
    go, gl = torch.randn(b, h, n, d, generator=gen).half(), torch.randn(b, h, n, generator=gen)
    mm = gallery.document_causal(gallery.random_documents(b, n, 3, seed=2))
    bm = flashlite.create_block_mask(mm, b, None, n, n, device="cpu", BLOCK_SIZE=128)
    scale = d**-0.5
    seen = {}

    def stand_in(qs, k_, v_, do, lse, delta, dq, dk, dv, acc, tables, strides, scale_, bufs,
                 mods):  # noqa: ANN001, ANN202  # fmt: skip
        seen.update(qs_is_dq=qs is dq, acc_zero=bool((acc == 0).all()), mods=mods)
        seen.update(qs=qs.clone(), delta=delta, tables=tables, strides=strides)
        dq.fill_(1.0), dk.fill_(2.0), dv.fill_(3.0)
        return lambda *a: None  # (the plan's launch for later calls: none here)

    monkeypatch.setattr(TB, "hopper_bwd_applies", lambda *a: True)
    monkeypatch.setattr(TB, "descriptor_ok", lambda *a: True)
    monkeypatch.setattr(TB, "plan_flex_bwd", stand_in)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o, lse = flashlite.flex_attention(*leaves, block_mask=bm, return_lse=True)
    dq, dk, dv = torch.autograd.grad((o * go).sum() + (lse * gl).sum(), leaves)
    assert (dq == 1).all() and (dk == 2).all() and (dv == 3).all()
    assert seen["qs_is_dq"] and seen["acc_zero"]
    qs = (q.float() * (scale * math.log2(math.e))).half()  # (as the forward rounded it)
    torch.testing.assert_close(seen["qs"], qs, atol=0, rtol=0)
    want_delta = (o.detach().float() * go.float()).sum(-1) - gl
    torch.testing.assert_close(seen["delta"], want_delta, atol=2e-3, rtol=2e-3)
    assert all(a is w for a, w in zip(seen["tables"], (bm.q_num_blocks, bm.q_indices,
               bm.full_q_num_blocks, bm.full_q_indices), strict=True))  # fmt: skip
    assert seen["strides"] == FA.table_args(bm.q_num_blocks, bm.q_indices)
    assert seen["mods"]["MASK_MOD"] is mm.fn and not seen["mods"]["HAS_SCORE"]


# --------------------------------------------------------------------------- KV-cache decoding
def _kvcache_reference(q, kc, vc, lens, mm, causal=True, window=None, sm=None):  # noqa: ANN001, ANN202
    """fp64 decode step over caches that already hold the new keys: query i of Nq sits at
    position ``lens[b] − Nq + i`` (lens: lengths after the append); ``sm`` a score function."""
    bsz, nq, hq, d = q.shape
    group = hq // kc.shape[2]
    out = torch.zeros(bsz, nq, hq, d, dtype=torch.float64)
    for b in range(bsz):
        n = int(lens[b])
        qpos, kpos = torch.arange(n - nq, n)[:, None], torch.arange(n)[None]
        for h in range(hq):
            s = q[b, :, h].double() @ kc[b, :n, h // group].double().T * d**-0.5
            if sm is not None:
                s = sm(s, torch.tensor(b), torch.tensor(h), qpos, kpos).double()
            seen = mm(torch.tensor(b), torch.tensor(h), qpos, kpos) if mm is not None else True
            if causal:
                seen = seen & (kpos <= qpos)
            if window is not None:
                seen = seen & (kpos >= qpos - window)
            p = torch.softmax(s.masked_fill(~seen, -math.inf), -1).nan_to_num(0.0)
            out[b, :, h] = p @ vc[b, :n, h // group].double()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("paged,splits", [(False, 1), (False, 3), (True, 2)])
@pytest.mark.parametrize("mods_", ["mask", "mask+alibi", "relative bias"])
def test_kvcache_decode_with_a_mask_function(dtype: torch.dtype, paged: bool, splits: int,
                                             mods_: str) -> None:  # fmt: skip
    """Document-causal decoding with GQA, an append and split keys, contiguous or paged: the
    mask function sees each query's position in its sequence and its query head; so does a
    score function (ALiBi, a relative-bias table), with the mask or without."""
    gen = torch.Generator().manual_seed(3)
    bsz, cap, hq, hkv, d, nq = 2, 96, 4, 2, 32, 3
    kc, vc = (torch.randn(bsz, cap, hkv, d, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(bsz, nq, hq, d, generator=gen).to(dtype)
    kn, vn = (torch.randn(bsz, nq, hkv, d, generator=gen).to(dtype) for _ in range(2))
    lens = torch.tensor([40, 70], dtype=torch.int32)
    mm = gallery.document_causal(gallery.random_documents(bsz, cap, 3, seed=1))
    sm = None
    if mods_ == "mask+alibi":
        sm = gallery.alibi(gallery.alibi_slopes(hq))
    elif mods_ == "relative bias":
        mm, sm = None, gallery.relative_bias(torch.randn(hq, 21, generator=gen))
    table = None
    k_arg, v_arg = kc.clone(), vc.clone()
    if paged:  # pages of 16 keys, shuffled
        per, page = cap // 16, 16
        table = torch.randperm(bsz * per, generator=gen).view(bsz, per).to(torch.int32)
        k_arg = torch.empty(bsz * per, page, hkv, d, dtype=dtype)
        v_arg = torch.empty_like(k_arg)
        for b in range(bsz):
            for j in range(per):
                k_arg[table[b, j]] = kc[b, j * page : (j + 1) * page]
                v_arg[table[b, j]] = vc[b, j * page : (j + 1) * page]
    o, lse = flashlite.attention_kvcache(q, k_arg, v_arg, cache_seqlens=lens, k_new=kn,
                                         v_new=vn, block_table=table, mask_mod=mm,
                                         score_mod=sm, num_splits=splits,
                                         return_lse=True)  # fmt: skip
    for b, n in enumerate(lens.tolist()):  # the reference's caches hold the new keys too
        kc[b, n : n + nq], vc[b, n : n + nq] = kn[b], vn[b]
    ref = _kvcache_reference(q, kc, vc, lens + nq, mm, sm=sm)
    tol = TOL[dtype]
    torch.testing.assert_close(o.double(), ref, atol=tol.atol, rtol=tol.rtol)
    assert torch.isfinite(lse).all()


def test_kvcache_window_as_a_mask_function_matches_the_built_in() -> None:
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 2, 4, 32, generator=gen)
    kc, vc = (torch.randn(2, 80, 2, 32, generator=gen) for _ in range(2))
    lens = torch.tensor([77, 30], dtype=torch.int32)
    ours = flashlite.attention_kvcache(q, kc, vc, cache_seqlens=lens,
                                       mask_mod=gallery.sliding_window(20))  # fmt: skip
    builtin = flashlite.attention_kvcache(q, kc, vc, cache_seqlens=lens, window=(20, 0))
    torch.testing.assert_close(ours, builtin, atol=1e-6, rtol=1e-6)


def test_kvcache_rows_with_no_key_and_bad_mask_functions() -> None:
    @triton.jit
    def nothing(b, h, q_idx, kv_idx):
        return q_idx < 0

    q = torch.randn(1, 1, 2, 16)
    kc, vc = (torch.randn(1, 40, 1, 16) for _ in range(2))
    lens = torch.tensor([33], dtype=torch.int32)
    o, lse = flashlite.attention_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=2,
                                         mask_mod=mods.mask_mod(nothing),
                                         return_lse=True)  # fmt: skip
    assert (o == 0).all() and (lse == -math.inf).all()
    with pytest.raises(TypeError, match="mask_mod"):
        flashlite.attention_kvcache(q, kc, vc, cache_seqlens=lens, mask_mod=lambda *a: True)
    with pytest.raises(TypeError, match="score_mod"):
        flashlite.attention_kvcache(q, kc, vc, cache_seqlens=lens, score_mod=lambda s, *a: s)
    with pytest.raises(ValueError, match="without softcap"):
        flashlite.attention_kvcache(q, kc, vc, cache_seqlens=lens, softcap=5.0,
                                    score_mod=gallery.tanh_softcap(5.0))  # fmt: skip
    # a score function that turns −inf finite leaves the pairs causal masked, masked
    sm = gallery.tanh_softcap(3.0)
    o, lse = flashlite.attention_kvcache(q, kc, vc, cache_seqlens=lens, score_mod=sm,
                                         return_lse=True)  # fmt: skip
    ref = _kvcache_reference(q, kc, vc, lens, None, sm=sm)
    torch.testing.assert_close(o.double(), ref, atol=2e-5, rtol=1e-5)


def test_kvcache_op_with_a_mask_function_passes_opcheck() -> None:
    from torch.library import opcheck

    from flashlite.masking.mod_args import spec_mod

    q = torch.randn(2, 1, 4, 16)
    kc, vc = (torch.randn(2, 40, 2, 16) for _ in range(2))
    new = [torch.randn(2, 1, 2, 16) for _ in range(2)]
    lens = torch.tensor([7, 30], dtype=torch.int32)
    mm = gallery.document_causal(gallery.random_documents(2, 40, 3, seed=1))
    sm = gallery.alibi(gallery.alibi_slopes(4))
    for score in (None, sm):
        (m_spec, m_tensors, m_nums), (s_spec, s_tensors, s_nums) = spec_mod(mm), spec_mod(score)
        args = (q, kc, vc, *new, m_tensors, s_tensors)
        fields = {"cache_seqlens": lens, "causal": True, "scale": 0.25, "num_splits": 2}
        fields |= {"mask_mod": m_spec, "mask_nums": m_nums}
        if score is not None:
            fields |= {"score_mod": s_spec, "score_nums": s_nums}
        opcheck(torch.ops.flashlite.attention_kvcache.default, args, fields)


def test_kvcache_with_a_mask_function_compiles_fullgraph() -> None:
    q = torch.randn(2, 1, 4, 16)
    kc, vc = (torch.randn(2, 40, 2, 16) for _ in range(2))
    lens = torch.tensor([33, 12], dtype=torch.int32)
    mm = gallery.document_causal(gallery.random_documents(2, 40, 3, seed=1))
    sm = gallery.alibi(gallery.alibi_slopes(4))

    def step(q, kc, vc, lens):  # noqa: ANN001, ANN202
        return flashlite.attention_kvcache(q, kc, vc, cache_seqlens=lens, mask_mod=mm,
                                           score_mod=sm)  # fmt: skip

    assert torch.equal(torch.compile(step, fullgraph=True)(q, kc, vc, lens), step(q, kc, vc, lens))


# --------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("name", GALLERY)
def test_gpu_gallery_against_fp64_and_torch_flex(name: str) -> None:
    """Long sequences on the GPU, bf16, forward and backward: flashlite's error against fp64 is
    within 2x that of torch's compiled flex_attention on the same mods (their twins)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from torch.nn.attention.flex_attention import create_block_mask as torch_create
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    b, h, n, d = 2, 4, 1000, 128  # (D 128 forwards run the Gluon kernel on the H200)
    mm, sm = _gallery(h, b)[name]
    if mm is not None and mm.buffers:  # ids for this length, on the GPU
        make = gallery.document if name == "document" else gallery.document_causal
        mm = make(gallery.random_documents(b, n, 8).cuda())
    if sm is not None and isinstance(sm.buffers[0], torch.Tensor):
        sm = mods.ScoreMod(sm.fn, sm.grad_fn, sm.torch_fn,
                           (sm.buffers[0].cuda(), *sm.buffers[1:]), sm.name)  # fmt: skip
    base = [torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    do = torch.randn_like(base[0])
    per_batch = b if mm is not None and mm.name.startswith("flashlite.gallery.document") else None
    bm = None if mm is None else flashlite.create_block_mask(mm, per_batch, None, n, n)
    tbm = None if mm is None else torch_create(mm, per_batch, None, n, n, device="cuda")
    ours = [t.clone().requires_grad_() for t in base]
    theirs = [t.clone().requires_grad_() for t in base]
    exact = [t.double().requires_grad_() for t in base]
    o = flashlite.flex_attention(*ours, score_mod=sm, block_mask=bm)
    torch._dynamo.reset()  # (a graph cached by an earlier test's mods made Dynamo trip)
    try:
        t_o = torch.compile(torch_flex)(*theirs, score_mod=sm, block_mask=tbm)
    except torch._inductor.exc.InductorError as err:  # its kernel staged the bias table
        if "out of resource" not in str(err):
            raise
        t_o = torch.compile(torch_flex)(*theirs, score_mod=sm, block_mask=tbm,
                                        kernel_options={"num_stages": 1})  # fmt: skip
    e_o = reference.attention(*exact, mask_mod=mm, score_mod=sm)
    for out in (o, t_o, e_o):
        out.backward(do.to(out.dtype))
    floor = TOL[torch.bfloat16].floor
    assert (o.double() - e_o).abs().max() <= 2 * (t_o.double() - e_o).abs().max() + floor
    for a, t, e in zip(ours, theirs, exact, strict=True):
        err, flex_err = (
            (a.grad.double() - e.grad).abs().max(),
            (t.grad.double() - e.grad).abs().max(),
        )
        assert err <= 2 * flex_err + 4 * floor


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["document_causal", "alibi", "relative_bias", "tanh_softcap"])
def test_gpu_flex_backward_on_the_fused_hopper_kernel(name: str, monkeypatch) -> None:  # noqa: ANN001
    """GQA, heads second to last, ragged lengths and an LSE gradient through the fused Gluon
    backward over the tables: its error against fp64 is within 2x that of the Triton flex
    kernels (deterministic algorithms select them) on the same call."""
    from flashlite.kernels.attention import hopper_bwd as KHB
    from flashlite.ops.attention.backends.tables import bwd as HP

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs the Hopper (sm_90) kernel")
    if not KHB.available():
        pytest.skip("this Triton has no usable Gluon")
    b, hq, hkv, n, d = 2, 8, 2, 1500, 128
    mm, sm = _gallery(hq, b)[name]
    if mm is not None and mm.buffers:
        mm = gallery.document_causal(gallery.random_documents(b, n, 5).cuda())
    if sm is not None and isinstance(sm.buffers[0], torch.Tensor):
        sm = mods.ScoreMod(sm.fn, sm.grad_fn, sm.torch_fn,
                           (sm.buffers[0].cuda(), *sm.buffers[1:]), sm.name)  # fmt: skip
    per_batch = b if name == "document_causal" else None
    bm = None if mm is None else flashlite.create_block_mask(mm, per_batch, None, n, n)
    base = [torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for h in (hq, hkv, hkv)]
    go, gl = torch.randn_like(base[0]), torch.randn(b, hq, n, device="cuda")
    calls = []
    real = HP.plan_flex_bwd
    monkeypatch.setattr(HP, "plan_flex_bwd", lambda *a, **k: calls.append(1) or real(*a, **k))

    def grads(leaves: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        o, lse = flashlite.flex_attention(*leaves, score_mod=sm, block_mask=bm, return_lse=True,
                                          layout="b n h d")  # fmt: skip
        return torch.autograd.grad((o * go).sum() + (lse * gl).sum(), leaves)

    fused = grads([t.clone().requires_grad_() for t in base])
    assert calls, "the fused Hopper backward did not run"
    with _Deterministic():
        triton_grads = grads([t.clone().requires_grad_() for t in base])
    assert len(calls) == 1  # (deterministic algorithms: the Triton kernels ran)
    exact = [t.transpose(1, 2).double().requires_grad_() for t in base]
    o, lse = reference.attention(*exact, mask_mod=mm, score_mod=sm, return_lse=True)
    want = torch.autograd.grad((o * go.transpose(1, 2).double()).sum()
                               + (lse.double() * gl.double()).sum(), exact)  # fmt: skip
    floor = TOL[torch.bfloat16].floor
    for ours, theirs, e in zip(fused, triton_grads, want, strict=True):
        err = (ours.transpose(1, 2).double() - e).abs().max()
        triton_err = (theirs.transpose(1, 2).double() - e).abs().max()
        assert err <= 2 * triton_err + 4 * floor, (err, triton_err)


class _Deterministic:
    """``torch.use_deterministic_algorithms(True)`` inside a ``with`` block."""

    def __enter__(self) -> None:
        self.was = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)

    def __exit__(self, *exc: object) -> None:
        torch.use_deterministic_algorithms(self.was)


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("nq", [1, 4])
@pytest.mark.parametrize("alibi", [False, True], ids=["mask", "mask+alibi"])
def test_gpu_kvcache_decode_with_a_mask_function(paged: bool, nq: int, alibi: bool) -> None:
    """The decode kernel with a document-causal mask function (and ALiBi) on the GPU (bf16,
    GQA 32/8, D 128, an append, the default split), against the fp64 reference."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    gen = torch.Generator().manual_seed(5)
    bsz, cap, hq, hkv, d, page = 3, 4096, 32, 8, 128, 256
    kc, vc = (torch.randn(bsz, cap, hkv, d, generator=gen).bfloat16() for _ in range(2))
    q = torch.randn(bsz, nq, hq, d, generator=gen).bfloat16()
    kn, vn = (torch.randn(bsz, nq, hkv, d, generator=gen).bfloat16() for _ in range(2))
    lens = torch.tensor([100, 2500, 4000], dtype=torch.int32)
    ids = gallery.random_documents(bsz, cap, 6, seed=2)
    table, k_arg, v_arg = None, kc, vc
    if paged:  # pages of 256 keys, shuffled
        per = cap // page
        table = torch.randperm(bsz * per, generator=gen).view(bsz, per).to(torch.int32)
        k_arg = torch.empty(bsz * per, page, hkv, d, dtype=torch.bfloat16)
        v_arg = torch.empty_like(k_arg)
        for b in range(bsz):
            for j in range(per):
                k_arg[table[b, j]] = kc[b, j * page : (j + 1) * page]
                v_arg[table[b, j]] = vc[b, j * page : (j + 1) * page]
    cuda = [t.cuda() if t is not None else None for t in (q, k_arg, v_arg, lens, kn, vn, table)]
    slopes = gallery.alibi_slopes(hq)
    sm = gallery.alibi(slopes.cuda()) if alibi else None
    o = flashlite.attention_kvcache(*cuda[:3], cache_seqlens=cuda[3], k_new=cuda[4],
                                    v_new=cuda[5], block_table=cuda[6],
                                    mask_mod=gallery.document_causal(ids.cuda()),
                                    score_mod=sm)  # fmt: skip
    for b, n in enumerate(lens.tolist()):
        kc[b, n : n + nq], vc[b, n : n + nq] = kn[b], vn[b]
    ref = _kvcache_reference(q, kc, vc, lens + nq, gallery.document_causal(ids),
                             sm=gallery.alibi(slopes) if alibi else None)  # fmt: skip
    tol = TOL[torch.bfloat16]
    torch.testing.assert_close(o.cpu().double(), ref, atol=tol.atol, rtol=tol.rtol)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_varlen_with_mods(dtype: torch.dtype) -> None:
    """Packed sequences with causal + ALiBi and with a per-sequence prefix mask, GQA 8/2,
    D 128, through the output and the LSE: within 2x torch's own 16-bit error of fp64."""
    hq, hkv, d = 8, 2, 128
    lq = [700, 1, 513, 0, 1500, 77]
    lk = [700, 9, 513, 5, 1500, 300]
    cu_q, cu_k = _packed(lq).cuda(), _packed(lk).cuda()
    prefix = torch.tensor([5, 0, 100, 1, 700, 30], dtype=torch.int32, device="cuda")
    cases = {
        "causal+alibi": (gallery.causal(), gallery.alibi(gallery.alibi_slopes(hq).cuda()), None),
        "prefix per sequence": (mods.mask_mod(_prefix_per_sequence, prefix,
                                              torch_fn=_prefix_per_sequence_t,
                                              name="tests.prefix_per_sequence"), None, len(lq)),
    }  # fmt: skip
    for mm, sm, batch in cases.values():
        bm = flashlite.create_block_mask(mm, batch, None, max(lq), max(lk), device="cuda")
        q = torch.randn(sum(lq), hq, d, device="cuda", dtype=dtype, requires_grad=True)
        k, v = (torch.randn(sum(lk), hkv, d, device="cuda", dtype=dtype, requires_grad=True)
                for _ in range(2))  # fmt: skip
        o, lse = flashlite.attention_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), score_mod=sm,
                                            block_mask=bm, return_lse=True)  # fmt: skip
        leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
        exact, exact_lse = _varlen_reference(*leaves, cu_q, cu_k, mm, sm)
        low = _varlen_reference(q, k, v, cu_q, cu_k, mm, sm)[0]
        seen = torch.isfinite(exact_lse)
        assert torch.equal(torch.isfinite(lse), seen)
        assert (lse.double() - exact_lse)[seen].abs().max() <= 1e-3
        _assert_within_twice_torchs_error(o, low, exact, (q, k, v), leaves, dtype)


@pytest.mark.gpu
def test_gpu_alibi_as_row_and_column_terms_keeps_its_precision() -> None:
    """The Hopper forward applies the gallery's ALiBi as a column term per score and a row term
    in each row's maximum. At 16k keys (biases up to 10^4, far past bf16's and near fp32's
    steps) its output and LSE on the last rows are within 2x the error of the same function
    applied to every score (declaring no fast path: the general path), against fp64;
    forward + backward stays finite and close to the general path's."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs the Hopper (sm_90) kernels")
    from flashlite.ops.attention.backends.tables.args import head_linear_bias

    n, h, d, rows = 16384, 8, 128, 64
    q, k, v = (torch.randn(1, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))  # fmt: skip
    alibi = gallery.alibi(gallery.alibi_slopes(h).cuda())
    general = mods.score_mod(gallery._alibi, alibi.buffers[0], grad=gallery._alibi_grad,
                             torch_fn=gallery._alibi_t, name="tests.alibi_general")  # fmt: skip
    assert head_linear_bias(alibi.op_args()) and not head_linear_bias(general.op_args())
    bm = flashlite.create_block_mask(gallery.causal(), None, None, n, n)
    out = {}
    for name, sm in (("split", alibi), ("general", general)):
        o, lse = flashlite.flex_attention(q, k, v, score_mod=sm, block_mask=bm, return_lse=True)
        out[name] = (o, lse, *torch.autograd.grad(o, (q, k, v), torch.ones_like(o)))
    q0 = n - rows
    s = q[:, :, q0:].double() @ k.double().transpose(-1, -2) * d**-0.5
    qi = torch.arange(q0, n, device="cuda")[:, None]
    kj = torch.arange(n, device="cuda")[None, :]
    s = s + alibi.buffers[0].double().view(h, 1, 1) * (kj - qi)
    s = s.masked_fill(kj > qi, float("-inf"))
    e_lse = torch.logsumexp(s, -1)
    e_o = torch.softmax(s, -1) @ v.double()
    err = {name: ((o[:, :, q0:].double() - e_o).abs().max(),
                  (lse[:, :, q0:].double() - e_lse).abs().max())
           for name, (o, lse, *_) in out.items()}  # fmt: skip
    floor = TOL[torch.bfloat16].floor
    assert err["split"][0] <= 2 * err["general"][0] + floor, err
    assert err["split"][1] <= 2 * err["general"][1] + 1e-4, err
    for a, b in zip(out["split"][2:], out["general"][2:], strict=True):
        assert torch.isfinite(a).all()
        assert (a.float() - b.float()).abs().max() <= 2e-2 * b.float().abs().max()


@pytest.mark.gpu
def test_gpu_hand_written_causal_matches_the_built_in_bit_for_bit() -> None:
    """On the H200 both run the Gluon kernel over the same tiles in the same order: the
    built-in's causal arithmetic and a listed mask function give the same bits."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs the Hopper (sm_90) kernel")
    for n in (2048, 3000):  # (3000: a ragged last tile)
        q, k, v = (torch.randn(1, 8, n, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        bm = flashlite.create_block_mask(gallery.causal(), None, None, n, n)
        assert torch.equal(flashlite.flex_attention(q, k, v, block_mask=bm),
                           flashlite.attention(q, k, v, causal=True))  # fmt: skip


@pytest.mark.gpu
def test_gpu_hand_written_window_matches_the_built_in_bit_for_bit() -> None:
    """The built-in window runs the flex Hopper kernels over its band's tables: a window mask
    written by hand gives the same bits forward, and forward and backward (the fused flex
    kernel) are within 2x torch's bf16 error."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs the Hopper (sm_90) kernel")
    from flashlite.ops.attention import planner as W

    for n in (2048, 3000):
        q, k, v = (torch.randn(1, 8, n, 128, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))  # fmt: skip
        assert W.window_fwd_config(W.Facts.of(q, k, v)) is not None
        bm = flashlite.create_block_mask(gallery.sliding_window(256), None, None, n, n)
        o = flashlite.attention(q, k, v, causal=True, window=(256, 0))
        assert torch.equal(flashlite.flex_attention(q, k, v, block_mask=bm), o)
        leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
        exact = reference.attention(*leaves, causal=True, window=(256, 0))
        low = reference.attention(q, k, v, causal=True, window=(256, 0))
        _assert_within_twice_torchs_error(o, low, exact, (q, k, v), leaves, torch.bfloat16)


# --------------------------------------------------------------------------- traffic
@pytest.mark.parametrize("name", ["causal", "document_causal", "alibi", "relative_bias"])
def test_traffic_model_equals_count(name: str) -> None:
    """The tables' model of the forward's bytes equals the interpreter's count, mods' buffer
    reads included; empty tiles save K/V bytes against the dense tables."""
    from flashlite.ops.attention import dense_block_mask
    from flashlite.traffic import AttentionShape, count_flex_attention, model_flex_attention

    shape = AttentionShape(2, 4, N, D, kv_heads=2, dtype=torch.float16)
    mm, sm = _gallery(4, 2)[name]
    bm = _block_mask(mm, 2)
    model, counted = model_flex_attention(shape, bm, sm), count_flex_attention(shape, bm, sm)
    assert (model.read, model.write) == (counted.read, counted.write)
    assert model.info["mods_modelled"] and model.info["empty"] > 0
    dense_bm = dense_block_mask(N, N, (BLOCK, BLOCK), torch.device("cpu"))
    dense = model_flex_attention(shape, dense_bm)
    assert dense.parts["k"][0] > model.parts["k"][0]


@pytest.mark.parametrize("mask", ["document_causal", "document"])
def test_traffic_cli_mask_counts(mask: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The flex, varlen and dense rows: counted equals the model; the documents as varlen
    sequences issue less than the document mask over the packed sequence (whose tiles
    straddle documents) and than every tile, which issues less than the naive reference.
    (At this N, document's id reads outweigh the one empty tile it skips.)"""
    import json

    from flashlite.cli import main

    code = main(["traffic", "--mask", mask, "--seq", "200", "--count", "--json", "--quiet"])
    rows = json.loads(capsys.readouterr().out)
    varlen = "varlen-causal" if mask == "document_causal" else "varlen"
    assert code == 0 and [r["method"] for r in rows] == [f"flex-{mask}", varlen, "flex-dense",
                                                          "naive"]  # fmt: skip
    for r in rows[:3]:
        assert r["model_bytes"] == r["counted_bytes"]
    flex, varlen_b, dense, naive = (r["model_bytes"] for r in rows)
    assert varlen_b < min(flex, dense) and max(flex, dense) < naive
    if mask == "document_causal":
        assert flex < dense


def test_traffic_cli_mask_measure_without_a_gpu(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--measure with --mask on a machine without CUDA: the library gives the model's rows,
    nothing measured, a note saying why; the command refuses before it starts (exit 2)."""
    from flashlite.cli import main
    from flashlite.traffic import AttentionShape, block_sparse_rows

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    shape = AttentionShape(1, 2, 256, 16)
    rows, notes = block_sparse_rows([shape], "causal", measure=True, show_progress=False)
    assert [r["method"] for r in rows] == ["flex-causal", "flex-dense", "naive"]
    assert all(r["measured_bytes"] is None for r in rows)
    assert any("no CUDA device" in n for n in notes)
    with pytest.raises(SystemExit) as exc:
        main(["traffic", "--mask", "causal", "--seq", "256", "--measure", "--json", "--quiet"])
    out = capsys.readouterr()
    assert exc.value.code == 2 and out.out == ""
    assert "flashlite traffic: error: --measure needs a CUDA GPU" in out.err


@pytest.mark.parametrize("name", ["causal+alibi", "window+relative bias", "document per sequence"])
def test_varlen_traffic_model_equals_count(name: str) -> None:
    """attention_varlen with mods: the tables' model of the forward's bytes (offsets, tiles
    skipped past a shorter sequence, mods' buffer reads) equals the interpreter's count, with
    sequences of 0 and 1 rows and keys longer and shorter than queries; the DRAM estimate
    (every byte once) lies below it."""
    from flashlite.traffic import AttentionShape, count_flex_varlen, model_flex_varlen
    from flashlite.traffic.model import dram_flex_varlen

    hq, hkv, d = 4, 2, 16
    lq, lk = VARLEN_Q, VARLEN_K
    if name == "document per sequence":
        ids = torch.stack([_ids(1, max(*lq, *lk), 3)[0] for _ in lq])
        # (self-attention ids over the tables' longest positions: ids over the keys' only
        # had the tables' classifier read past them, which their limits now refuse)
        mm, sm, per_sequence = gallery.document_causal(ids), None, True
        lq = lk = [min(a, b) for a, b in zip(lq, lk, strict=True)]
    else:
        mm, sm, per_sequence = _varlen_case(name, hq, lq, lk)
    bm = flashlite.create_block_mask(mm, len(lq) if per_sequence else None, None, max(VARLEN_Q),
                                     max(VARLEN_K), device="cpu", BLOCK_SIZE=16)  # fmt: skip
    shape = AttentionShape(len(lq), hq, max(VARLEN_Q), d, seq_k=max(VARLEN_K), kv_heads=hkv,
                           dtype=torch.float16)  # fmt: skip
    model, counted = (
        model_flex_varlen(shape, lq, lk, bm, sm),
        count_flex_varlen(shape, lq, lk, bm, sm),
    )
    assert (model.read, model.write) == (counted.read, counted.write)
    assert model.info["mods_modelled"] and model.parts["offsets"][0] > 0
    assert dram_flex_varlen(shape, lq, lk, bm).total < model.total
    with pytest.raises(ValueError, match="lengths_q"):
        model_flex_varlen(shape, [*lq, 1], [*lk, 1], bm)
    with pytest.raises(ValueError, match="lengths_k must lie in"):
        model_flex_varlen(shape, lq, [max(VARLEN_K) + 1, *lk[1:]], bm)


def test_measure_flex_child_runs_every_row_and_ranges_are_attributed(
    tmp_path,
    monkeypatch: pytest.MonkeyPatch,  # noqa: ANN001
) -> None:
    """The ncu child builds and runs each --mask row's call (here on the CPU, the ranges
    recorded instead of profiled), and measure_flex sums each range's kernels (a stand-in ncu
    printing a stored sample). Without CUDA it measures nothing and says why."""
    import json
    import stat
    import sys
    from pathlib import Path

    from flashlite.traffic import AttentionShape, measure

    ran: list[int] = []
    monkeypatch.setattr(measure, "_warm_up", lambda fn: fn())
    monkeypatch.setattr(measure, "_measure_once", lambda i, fn: ran.append(i) or fn())
    shape = AttentionShape(1, 2, 64, 16, dtype=torch.float16)
    calls = [[m, shape.to_json()] for m in ("flex-document_causal", "varlen-causal",
                                            "flex-dense")]  # fmt: skip
    report: dict = {"errors": {}, "configs": {}}
    measure._flex_child({"mask": "document_causal", "docs": 3, "block": [16, 16],
                         "calls": calls, "device": "cpu"}, report)  # fmt: skip
    assert report["errors"] == {} and ran == [0, 1, 2]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    got, message = measure.measure_flex([("flex-dense", shape)], "document_causal", 3)
    assert got == [None] and "CUDA" in message
    sample = Path(__file__).parent / "data" / "ncu_sample.csv"
    ncu = tmp_path / "ncu"
    ncu.write_text(f"#!{sys.executable}\nimport json, sys\n"
                   "spec = json.load(open(sys.argv[-1]))\n"
                   "json.dump({'errors': {}, 'configs': {}}, open(spec['report'], 'w'))\n"
                   f"print(open({str(sample)!r}).read())\n")  # fmt: skip
    ncu.chmod(ncu.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("NCU", str(ncu))
    got, message = measure.measure_flex([("flex-document_causal", shape), ("flex-dense", shape)],
                                        "document_causal", 3)  # fmt: skip
    assert message == "" and all(t is not None and t.total > 0 for t in got)
    assert json.dumps([t.read for t in got])  # (plain ints, as the JSON rows carry them)


@pytest.mark.gpu
def test_gpu_dram_estimate_of_document_masks_against_ncu() -> None:
    """ncu's DRAM bytes of the document-causal forward (the Hopper kernel) within 15% of the
    estimate at two points, through ``flashlite traffic --mask --measure``'s own path."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from flashlite.traffic import AttentionShape, block_sparse_rows, find_ncu

    if find_ncu() is None:
        pytest.skip("ncu not found")
    shapes = [AttentionShape(1, 16, n, 128, dtype=torch.bfloat16) for n in (16384, 32768)]
    rows, notes = block_sparse_rows(shapes, "document_causal", measure=True,
                                    show_progress=False)  # fmt: skip
    if any("permitted" in n for n in notes):
        pytest.skip("; ".join(notes))
    for r in rows:
        if r["method"] == "flex-document_causal":
            assert r["measured_bytes"] is not None, notes
            assert 0.85 <= r["measured_bytes"] / r["dram_bytes"] <= 1.15, r


def test_dram_estimate_reads_visited_keys_once() -> None:
    from flashlite.traffic import AttentionShape
    from flashlite.traffic.model import dram_flex_attention

    shape = AttentionShape(1, 2, 64, 16, dtype=torch.float16)
    ids = torch.tensor([0] * 32 + [1] * 32, dtype=torch.int32)
    bm = flashlite.create_block_mask(gallery.document_causal(ids), None, None, 64, 64,
                                     device="cpu", BLOCK_SIZE=16)  # fmt: skip
    t = dram_flex_attention(shape, bm)
    assert t.parts["k"][0] == t.parts["v"][0] == 2 * 64 * 16 * 2  # every key once per head

    @triton.jit
    def first_half_only(b, h, q_idx, kv_idx):
        return kv_idx < 32

    half = flashlite.create_block_mask(mods.mask_mod(first_half_only), None, None, 64, 64,
                                       device="cpu", BLOCK_SIZE=16)  # fmt: skip
    assert dram_flex_attention(shape, half).parts["k"][0] == 2 * 32 * 16 * 2  # never-seen keys
