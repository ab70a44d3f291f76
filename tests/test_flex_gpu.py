"""flex_attention, attention_varlen and attention_kvcache with mods on a CUDA device: long
sequences against fp64 and torch's flex_attention, the fused Hopper backward, ALiBi's split
form, and the built-ins against masks written by hand, bit for bit."""

from __future__ import annotations

import pytest
import torch
from conftest import TOL
from flex_helpers import (
    GALLERY,
    _assert_within_twice_torchs_error,
    _gallery,
    _kvcache_reference,
    _packed,
    _prefix_per_sequence,
    _prefix_per_sequence_t,
    _varlen_reference,
)

import flashlite
from flashlite import reference
from flashlite.masking import gallery, mods


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
        # a second call runs the kept plan (the band's bound flex plan), new inputs too
        assert torch.equal(flashlite.attention(q, k, v, causal=True, window=(256, 0)), o)
        q2 = torch.randn_like(q)
        o2 = flashlite.attention(q2, k, v, causal=True, window=(256, 0))
        assert torch.equal(flashlite.flex_attention(q2, k, v, block_mask=bm), o2)
        leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
        exact = reference.attention(*leaves, causal=True, window=(256, 0))
        low = reference.attention(q, k, v, causal=True, window=(256, 0))
        _assert_within_twice_torchs_error(o, low, exact, (q, k, v), leaves, torch.bfloat16)
